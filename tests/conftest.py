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


# The fixtures that start Spark: a classic session, a Spark Connect server and its client.
SPARK_FIXTURES = ("spark", "connect_server", "connect_spark", "any_spark")


def starts_spark_by_fixture(item):
    return any(name in item.fixturenames for name in SPARK_FIXTURES)


def misplacement(item, layer):
    """Why a test is in the wrong layer folder, or None."""
    starts_spark = starts_spark_by_fixture(item) or item.get_closest_marker("spark") is not None
    if layer is None:
        return f"its file is not in a layer folder of tests/ ({', '.join(LAYERS)})"
    if layer == "engine" and starts_spark:
        return ("it starts Spark (the spark or connect_spark fixture, or @pytest.mark.spark) "
                "but is in tests/engine: move it to tests/spark")
    if layer == "spark" and not starts_spark:
        return ("it is in tests/spark but starts no Spark (no spark or connect_spark fixture, nor @pytest.mark.spark "
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
        if starts_spark_by_fixture(item):
            item.add_marker("spark")
    if misplaced:
        raise pytest.UsageError("tests in the wrong layer (see tests/conftest.py):\n  " + "\n  ".join(misplaced))
    # The slow modules first (their order kept, and the others'): with the suite spread over
    # workers a module at a time (``--dist loadscope``), a long module started last leaves
    # the other workers idle while it runs.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


# The settings of every Spark the suite starts (the classic session and the Connect server).
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    # Spark starts its state stores' maintenance thread once per JVM, at the interval of the
    # first store loaded: a test that waits for Spark's snapshots and cleanup (test_spark_import)
    # gets them in a tenth of a second, not after a minute
    "spark.sql.streaming.stateStore.maintenanceInterval": "100ms",
}


def set_worker_environment():
    """Workers run this interpreter (PYSPARK_PYTHON) and import statecore and pyspark_glue from
    the project root (PYTHONPATH, made absolute so it holds whatever the workers' cwd)."""
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


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for every Spark test of the run, stopped at the end; its
    workers as :func:`set_worker_environment` says."""
    set_worker_environment()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master("local[2]").appName("statecore-tests")
    for key, value in SPARK_CONF.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """One local[2] Spark Connect server for the run (per xdist worker), from PySpark's own
    jars, with the classic session's settings and workers (``pyspark_glue/connect_server.py``); its
    client session is stopped, then the server and what it started, at the end."""
    from pyspark_glue.connect_server import start_connect_server

    set_worker_environment()
    server = start_connect_server(SPARK_CONF, dict(os.environ), str(tmp_path_factory.mktemp("connect-server")))
    yield server
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    client = ConnectSession.getActiveSession()
    if client is not None:
        client.stop()
    server.stop()


@pytest.fixture
def connect_spark(connect_server, monkeypatch):
    """A Spark Connect client session of :func:`connect_server`, with PySpark switched to its
    Connect side for this test (``SPARK_CONNECT_MODE_ENABLED``; unset again afterwards, so that
    the classic ``spark`` session works in the same process: ``pyspark_glue/connect_server.py``)."""
    from pyspark_glue.connect_server import CONNECT_MODE_VARIABLE, client_session

    monkeypatch.setenv(CONNECT_MODE_VARIABLE, "1")
    return client_session(connect_server.url)


@pytest.fixture(params=["classic", "connect"])
def any_spark(request):
    """The classic session, then a Spark Connect client (:func:`connect_spark`): a test taking
    it runs under both kinds of session, and should find the same state, output and records."""
    return request.getfixturevalue("spark" if request.param == "classic" else "connect_spark")


@pytest.fixture(scope="session")
def s3_server():
    """One local S3 server (moto's, ``bench/s3_server.py``) on 127.0.0.1 for the run (per xdist
    worker), its requests counted; stopped at the end by the object that started it."""
    from bench.s3_server import S3Server

    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """``(url, storage_options)`` of a new empty bucket of :func:`s3_server`, for this test alone."""
    return f"s3://{s3_server.new_bucket()}", s3_server.storage_options()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The url of a new bucket of :func:`s3_server` that s3fs reaches with no storage options:
    the endpoint and dummy credentials in the environment (botocore's ``AWS_ENDPOINT_URL``),
    for this test and the processes it starts."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server.new_bucket()}"
