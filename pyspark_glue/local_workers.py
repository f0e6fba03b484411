"""Whether Spark's Python workers can import statecore, checked before a local-mode job.

A classic local session starts its Python workers with ``PYSPARK_PYTHON`` as it was when the
SparkContext was made, else ``python3`` on PATH, not with the interpreter the driver runs.
A user who runs a venv's python without activating the venv gets workers on another
interpreter, which cannot import ``pyspark_glue``, and a task failure deep in a Python
traceback. :func:`check_local_workers` finds that out on the driver first (one short
subprocess per interpreter and process) and raises :class:`WorkerPythonError` naming what to
set. Only local masters are checked: on a cluster the executors' interpreter is another
machine's (docs/cluster.md); under Spark Connect the server decides.
"""
import logging
import os
import shutil
import subprocess
import sys

from pyspark_glue import spark_internals

__all__ = ["WorkerPythonError", "check_local_workers"]

log = logging.getLogger(__name__)

_PROBE = "import pyspark_glue, statecore._hash"
_PROBE_TIMEOUT_S = 120
_checked = {}  # interpreter path -> None (imports) or the probe's error text


class WorkerPythonError(RuntimeError):
    """Spark's local Python workers would run an interpreter that cannot import statecore."""


def check_local_workers(spark):
    """Raise :class:`WorkerPythonError` if ``spark`` (a classic session or SparkContext) runs
    on a local master and its Python workers' interpreter is not this one and cannot import
    ``pyspark_glue`` and statecore's compiled core. A Spark Connect session: nothing checked."""
    try:
        sc = spark_internals.classic_context(spark)
    except TypeError:  # not a session at all (a stand-in): no workers to check
        return
    if sc is None or not str(sc.master).startswith("local"):
        return
    given = spark_internals.worker_python(sc)
    if given is None:
        return
    found = shutil.which(given) or given
    if os.path.realpath(found) == os.path.realpath(sys.executable):
        return
    if found not in _checked:
        _checked[found] = _probe(found)
    error = _checked[found]
    if error is not None:
        source = "PYSPARK_PYTHON" if given != "python3" else "python3 on PATH (PYSPARK_PYTHON is not set)"
        raise WorkerPythonError(
            f"Spark's Python workers run {given} ({source}: {found}), which cannot import statecore "
            f"({error}); this driver runs {sys.executable}. Set PYSPARK_PYTHON={sys.executable} in the environment "
            f"before the SparkSession is created (or activate the venv first), or install statecore for {found}")


def _probe(interpreter):
    """None if ``interpreter`` imports what the workers need, else the last line of its error."""
    try:
        done = subprocess.run([interpreter, "-c", _PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"
