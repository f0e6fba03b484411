"""pyspark_glue.local_workers without Spark: a stand-in SparkContext (what the check reads of
one: ``_jsc``, ``master``, ``pythonExec``) and stand-in interpreters. The real case (the demo
run by a venv's python without the venv activated): tests/spark/test_local_workers_spark.py."""
import os
import stat
import sys

import pytest

from pyspark_glue import local_workers
from pyspark_glue.local_workers import WorkerPythonError, check_local_workers


class Context:
    _jsc = object()

    def __init__(self, python, master="local[2]"):
        self.pythonExec, self.master = python, master


def interpreter(directory, name, body):
    """An executable shell script standing in for a Python interpreter."""
    path = os.path.join(str(directory), name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(local_workers, "_checked", {})


def test_workers_on_an_interpreter_without_statecore_are_refused_with_what_to_set(tmp_path):
    """The venv's python run without activating the venv: the workers would run another
    python3, which cannot import pyspark_glue."""
    other = interpreter(tmp_path, "python3", "echo \"ModuleNotFoundError: No module named 'pyspark_glue'\" >&2; exit 1")
    with pytest.raises(WorkerPythonError) as e:
        check_local_workers(Context(other))
    message = str(e.value)
    assert f"PYSPARK_PYTHON={sys.executable}" in message and other in message
    assert "No module named 'pyspark_glue'" in message


def test_python3_found_on_path_is_named_as_such(tmp_path, monkeypatch):
    interpreter(tmp_path, "python3", "exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(WorkerPythonError, match=r"python3 on PATH \(PYSPARK_PYTHON is not set\)"):
        check_local_workers(Context("python3"))


def test_the_driver_s_own_interpreter_or_one_that_imports_statecore_is_fine(tmp_path, monkeypatch):
    probes = []
    real_probe = local_workers._probe
    monkeypatch.setattr(local_workers, "_probe", lambda path: probes.append(path) or real_probe(path))
    check_local_workers(Context(sys.executable))
    assert probes == []  # the same interpreter: nothing to run
    same = interpreter(tmp_path, "python-wrapper", f'exec "{sys.executable}" "$@"')
    check_local_workers(Context(same))
    check_local_workers(Context(same))
    assert probes == [same]  # probed once per process


def test_a_cluster_master_and_a_missing_interpreter(tmp_path):
    check_local_workers(Context(str(tmp_path / "absent"), master="spark://127.0.0.1:7077"))  # not checked
    with pytest.raises(WorkerPythonError, match="FileNotFoundError"):
        check_local_workers(Context(str(tmp_path / "absent")))
