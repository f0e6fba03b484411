"""statecore.package_origin: run from the folder above a clone named ``statecore`` (here, a
folder of that name in the current directory), an editable install's ``statecore`` resolves
to that folder as a namespace package; the entry points then say so instead of failing later
with ``cannot import name ... (unknown location)``. A regular install is found first and
imports as usual."""
import subprocess
import sys


def run(code, cwd):
    return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})


def test_a_folder_named_statecore_in_the_current_directory(tmp_path):
    (tmp_path / "statecore").mkdir()  # the clone's root, seen from the folder above it
    resolved = run("import statecore; print(statecore.__file__)", tmp_path)
    assert resolved.returncode == 0, resolved.stderr
    shadowed = resolved.stdout.strip() == "None"
    for entry in ("import pyspark_glue", "import statecore.cli"):
        done = run(entry, tmp_path)
        if shadowed:  # an editable install: the folder wins, and the entry point names it
            assert done.returncode != 0
            assert f"'statecore' was imported from {tmp_path / 'statecore'}" in done.stderr, done.stderr
            assert "Run from another directory" in done.stderr
        else:  # a regular install (CI's wheel venv): the package wins
            assert done.returncode == 0, done.stderr


def test_the_installed_package_passes(tmp_path):
    assert run("import pyspark_glue, statecore.cli", tmp_path).returncode == 0
