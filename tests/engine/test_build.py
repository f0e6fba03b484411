"""The compiled core is really compiled: a missing build fails here, loudly, not deep in a test."""
import ast
import importlib
import importlib.machinery
from pathlib import Path

import pytest

import statecore
from tests.paths import REPO_ROOT


def _built_modules():
    """setup.py's MODULES: every module the build compiles."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MODULES")


COMPILED = [f"statecore.{name}" for name in _built_modules()]


def test_the_core_modules_are_built():
    assert {"statecore._hash", "statecore._rowtable", "statecore._snapshot", "statecore._delta"} <= set(COMPILED)


@pytest.mark.parametrize("name", COMPILED)
def test_module_is_an_extension(name):
    module = importlib.import_module(name)
    assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), module.__file__


def test_pxd_files_ship_beside_the_modules():
    here = Path(statecore.__file__).parent
    for name in [m.rpartition(".")[2] for m in COMPILED] + ["_probe"]:
        assert (here / f"{name}.pxd").is_file(), name


def test_engine_imports_without_pyspark():
    import subprocess
    import sys
    code = ("import sys; sys.modules['pyspark'] = None; import statecore, statecore._snapshot, "
            "statecore._delta; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
