"""The compiled core is really compiled: a missing build fails here, loudly, not deep in a test."""
import importlib
import importlib.machinery

import pytest

import statecore

COMPILED = ["statecore._hash", "statecore._rowtable", "statecore._snapshot", "statecore._delta", "statecore._rpccodec"]


@pytest.mark.parametrize("name", COMPILED)
def test_module_is_an_extension(name):
    module = importlib.import_module(name)
    assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), module.__file__


def test_pxd_files_ship_beside_the_modules():
    from pathlib import Path
    here = Path(statecore.__file__).parent
    for name in ("_hash", "_rowtable", "_snapshot"):
        assert (here / f"{name}.pxd").is_file(), name


def test_engine_imports_without_pyspark():
    import subprocess
    import sys
    code = ("import sys; sys.modules['pyspark'] = None; import statecore, statecore._snapshot, "
            "statecore._delta; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
