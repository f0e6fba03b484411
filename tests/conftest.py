"""Shared fixtures (seeded random generators whose seed shows in the test id and repr; the
directories statecore.files fsyncs; one Spark session per run) and the suite's layers, declared
here and nowhere else: the folder a test file is in decides its markers (``LAYERS``), so that
``pytest tests/engine`` or ``pytest -m "not spark"`` runs the engine's tests alone. A test in
tests/engine that starts Spark, one in tests/spark that does not, or a test file outside the
layer folders stops the collection with the test's name."""
import os
import shutil
import tempfile

import numpy as np
import pytest

from tests.paths import REPO_ROOT, TESTS_DIR

# The folder under tests/ -> the markers every test in it gets. A test in tests/spark starts Spark:
# it takes the ``spark`` fixture, or says with @pytest.mark.spark that it starts a Spark of its own
# (a subprocess); tests/bench marks only the tests that do so ``spark``.
LAYERS = {"engine": (), "spark": ("spark",), "cluster": ("spark", "cluster"), "bench": ("bench",)}
MARKERS = {
    "spark": "starts a real Spark (tests/spark, tests/cluster, and the tests of tests/bench marked so)",
    "cluster": "starts a standalone Spark cluster (tests/cluster; also marked spark)",
    "bench": "runs the benchmark harness (tests/bench)",
    "slow": "long-running; still part of the default run",
}


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def layer_of(item):
    """The layer folder (a key of LAYERS) a collected test's file is in, or None."""
    parts = os.path.relpath(str(item.path), TESTS_DIR).split(os.sep)
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def misplacement(item, layer):
    """Why a test is in the wrong layer folder, or None."""
    starts_spark = "spark" in item.fixturenames or item.get_closest_marker("spark") is not None
    if layer is None:
        return f"its file is not in a layer folder of tests/ ({', '.join(LAYERS)})"
    if layer == "engine" and starts_spark:
        return ("it starts Spark (the spark fixture or @pytest.mark.spark) "
                "but is in tests/engine: move it to tests/spark")
    if layer == "spark" and not starts_spark:
        return ("it is in tests/spark but starts no Spark (neither the spark fixture nor @pytest.mark.spark "
                "for a Spark of its own): move it to tests/engine")
    return None


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        layer = layer_of(item)
        reason = misplacement(item, layer)
        if reason:
            misplaced.append(f"{item.nodeid}: {reason}")
        for name in LAYERS.get(layer, ()):
            item.add_marker(name)
        if "spark" in item.fixturenames:
            item.add_marker("spark")
    if misplaced:
        raise pytest.UsageError("tests in the wrong layer (see tests/conftest.py):\n  " + "\n  ".join(misplaced))


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

    root = str(REPO_ROOT)
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
