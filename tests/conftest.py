"""Shared fixtures (seeded random generators whose seed shows in the test id and repr; the
directories statecore.files fsyncs; one Spark session per run) and the suite's layers: every test that uses the ``spark`` fixture is
marked ``spark``, the standalone-cluster tests also ``cluster``, the benchmark harness tests
``bench``, so that ``pytest -m "not spark"`` runs the engine's tests alone."""
import os
import shutil
import tempfile

import numpy as np
import pytest

_LAYERS = {"test_glue_cluster.py": ("spark", "cluster"), "test_bench.py": ("bench",)}


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts a standalone Spark cluster (also marked spark)")
    config.addinivalue_line("markers", "bench: runs the benchmark harness")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in _LAYERS.get(os.path.basename(str(item.fspath)), ()):
            item.add_marker(name)
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker("spark")


class Rand(np.random.Generator):
    """A numpy Generator that remembers its seed, so a failing case can be replayed."""

    def __init__(self, seed):
        super().__init__(np.random.PCG64(seed))
        self.seed = seed

    def __repr__(self):
        return f"Rand(seed={self.seed})"


@pytest.fixture(scope="session", autouse=True)
def private_tempdir(tmp_path_factory):
    """The run's own temporary directory (TMPDIR, for this process and the workers it
    starts), removed at the end: the image cache's default directory is under it, so images
    unpacked from the snapshots of tests' checkpoints go with the run."""
    tmp_path_factory.getbasetemp()  # pytest's own directories stay where they were
    path = tempfile.mkdtemp(prefix="statecore-tests-tmp-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield path
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def rand(request):
    return Rand(request.param)


@pytest.fixture
def synced_dirs(monkeypatch):
    """Records each directory statecore.files fsyncs, with its entries at that moment."""
    import statecore.files

    synced = []
    real = statecore.files._fsync_dir

    def recording(path):
        synced.append((path, sorted(os.listdir(path))))
        return real(path)

    monkeypatch.setattr(statecore.files, "_fsync_dir", recording)
    return synced


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for every Spark test of the run, stopped at the end.

    Workers run this interpreter (PYSPARK_PYTHON) and import statecore and pyspark_glue from
    the project root (PYTHONPATH, made absolute so it holds whatever the workers' cwd)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [os.path.abspath(p) for p in paths]
    if root not in paths:
        paths.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)

    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("statecore-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               # Spark starts its state stores' maintenance thread once per JVM, at the interval
               # of the first store loaded: a test that waits for Spark's snapshots and cleanup
               # (test_spark_import) gets them in a tenth of a second, not after a minute
               .config("spark.sql.streaming.stateStore.maintenanceInterval", "100ms")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
