"""statecore's benchmarks: one runnable module per hot path (``python -m bench.bench_rowtable``).

Benchmarks are scratch. Importing this package points the process's temporary directory, and
through ``TMPDIR`` that of every process it starts (Spark's JVM and Python workers, a race's
contenders), at a directory of its own that is removed when the process exits. Nothing a run
leaves in temporary files outlives it, statecore's local image cache included: by default it
lies under the temporary directory and keeps the images of checkpoints a benchmark deleted
until its sweep, a day later. Inputs a benchmark generates once and reuses across runs (the
races' input files) go under ``SHARED_TEMPDIR`` instead: the temporary directory the first
benchmark process of a run was started with.
"""
import atexit
import os
import shutil
import tempfile

# Kept for every process a run starts (they inherit the environment).
SHARED_TEMPDIR = os.environ.setdefault("STATECORE_BENCH_SHARED_TMPDIR", tempfile.gettempdir())
RACE_DATA_DIR = os.path.join(SHARED_TEMPDIR, "statecore-race-data")


def _private_tempdir():
    path = tempfile.mkdtemp(prefix="statecore-bench-")
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    atexit.register(shutil.rmtree, path, True)


_private_tempdir()
