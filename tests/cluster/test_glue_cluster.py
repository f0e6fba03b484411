"""statecore on a real cluster: the wheel executors get, and a Spark standalone cluster that
loses a worker in the middle of a stateful stream (see docs/cluster.md).

1. The sdist and the wheel. ``tools/build_wheel.sh`` on a clean copy of the source tree
   makes the sdist (the ``.pyx``/``.pxd`` sources and ``setup.py``, no generated C), the
   wheel from that sdist, and repairs it to a ``manylinux`` tag of glibc 2.28 or older. The
   wheel must hold every compiled module (one ``.so`` per ``statecore/*.pyx``) and the
   ``.pxd`` files, ``auditwheel show`` must accept its tag, and a Python process that sees
   only the wheel's contents (plus numpy, lz4, xxhash and fsspec) imports statecore and
   round-trips a store.

   The wheel is built with ``STATECORE_DEBUG=1`` (``-O0``, and ``-Werror`` as in CI) and
   ``--no-isolation`` (the build requirements of the running environment): the release
   ``-O3`` build takes a few times longer, and the packaging is the same.

2. The cluster (``test_worker_killed_mid_stream``). The test starts a standalone master and
   two workers (1 core, 1 GB each) from pyspark's own ``bin/spark-class`` on 127.0.0.1,
   with ports chosen by the JVMs (port 0, read back from the master's log) so that nothing
   collides with another Spark on the machine, and a SPARK_HOME scratch directory of
   symlinks so that nothing is written into the pip package. The Spark driver is a
   subprocess (this file run as a script), so the cluster's SparkContext never meets the
   local[2] session of ``conftest.spark`` in this process. Driver and executors run
   statecore from the wheel, in the venv that ``tools/pack_executor_env.sh`` makes and packs
   (docs/cluster.md's recipe: the wheel, its dependencies and the ``executor`` extra): the
   executors from the archive, shipped with ``spark.archives=...#env`` and
   ``PYSPARK_PYTHON=./env/bin/python`` (a driver started as a Python script reads the
   variable, not ``spark.pyspark.python``); the driver from the venv itself, to which a
   ``.pth`` file added after packing appends this test's own site-packages (pyspark, pytest),
   which the executors never see.

   The stream: parquet files, one per micro-batch, through ``foreachBatch`` and a
   :class:`~pyspark_glue.StatefulOperator` keeping a running count and sum per key in 4
   state partitions. In batch ``HOLD_BATCH`` every task waits in ``fn.finish`` (after its
   ``put_batch``, before the commit) while a hold file exists; the test SIGKILLs the
   worker whose executor holds such a task, with its executor JVM and Python processes
   (a node dying: no process of it gets to clean up), then removes the hold file. The
   query goes on with the surviving executor; later it is stopped and restarted from its
   checkpoint with more files. At the end the state read back with ``read_state``, Spark's
   ``groupBy().agg()`` over the input, the newest sink row of every key, and a count over
   the input files made here with pyarrow are all equal.

   The test runs twice, with the statecore state root on the local disk and on a bucket of the
   local S3 server (moto's, ``tests/conftest.py``'s ``s3_server``; the operator's batch records
   and outputs go there too, Spark's own checkpoint, the input and the sink stay local). The
   driver and the executors reach the server through the environment only: the driver's
   process environment and ``spark.executorEnv.*`` (the endpoint and dummy credentials of
   ``s3_server.environment()``); the archive holds the wheel's ``s3`` extra (s3fs) for both
   runs. The wheel and the archive are built once per run (module-scoped fixtures).

   Waits are deadlines on observable events (a log line, a marker file, the driver's exit),
   never fixed sleeps. Everything lives under ``tmp_path``; every process started is ended,
   and the test checks that none is left.
"""
import importlib.machinery
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# three folders up, not tests.paths: this file also runs as the driver's script, where tests/ is not importable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("statecore", "pyspark_glue")  # [tool.setuptools] packages in pyproject.toml
COMPILED = sorted(n[:-4] for n in os.listdir(os.path.join(ROOT, "statecore")) if n.endswith(".pyx"))
PXD = sorted(n[:-4] for n in os.listdir(os.path.join(ROOT, "statecore")) if n.endswith(".pxd"))
RUNTIME_DEPS = ("numpy", "lz4", "xxhash", "fsspec")  # pyproject.toml [project] dependencies
BUILT_DIST_VARIABLE = "STATECORE_BUILT_DIST"  # a folder tools/build_wheel.sh filled from this tree (CI)

KEY = np.dtype([("user", "<i8"), ("region", "S4")])
REGIONS = np.array(["eu", "us", "apac", "latm"])
INPUT_DDL = "user long, region string, amount long"
NUM_PARTITIONS = 4
RUN1_FILES = 6  # the first run: batches 0..5; the worker dies in batch HOLD_BATCH
RUN2_FILES = 2  # the restart from the checkpoint: batches 6..7
HOLD_BATCH = 2
ROWS_PER_FILE = 300
ROWS_PER_GROUP = 100  # 3 row groups of about 1.3 KB per file, each read by its own task:
SPLIT_BYTES = 1400  # spark.sql.files.maxPartitionBytes, so that a batch's shuffle has several map tasks
TEST_DEADLINE_S = 480  # a hard cap for the whole cluster test (about 2 minutes on a quiet machine)
# Temporary files under tmp_path; no /tmp/hsperfdata_<user>/<pid> file, which a SIGKILLed JVM leaves behind.
JVM_OPTIONS = "-Djava.io.tmpdir={tmp} -XX:-UsePerfData"
HOLD_MAX_S = 150  # a held task gives up waiting after this, whatever happens to the test


# -- helpers shared by the test and the driver ---------------------------------------------------

def make_events(seed, n, users=40):
    rng = np.random.default_rng(seed)
    return pa.table({"user": pa.array(rng.integers(0, users, n), pa.int64()),
                     "region": pa.array(REGIONS[rng.integers(0, len(REGIONS), n)]),
                     "amount": pa.array(rng.integers(-5, 100, n), pa.int64())})


def write_events(directory, name, table):
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.tmp")
    pq.write_table(table, tmp, row_group_size=ROWS_PER_GROUP)
    os.replace(tmp, os.path.join(directory, name))  # the file source never sees a partial file


def wait_for(predicate, timeout_s, what, poll_s=0.2):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


# -- the wheel --------------------------------------------------------------------------------------

SOURCE_DIRS = (*PACKAGES, "tools")  # what tools/build_wheel.sh builds from, beside the top-level files
WHEEL_TAG = re.compile(r"manylinux_2_(\d+)_x86_64")  # a platform tag of the portable wheel
MAX_GLIBC_MINOR = 28  # the wheel runs on glibc 2.28 or newer (tools/build_wheel.sh)


def _copy_source_tree(dest):
    """The files the sdist is made from: top-level files, the packages' sources and the build
    script, without build outputs (``build/``, in-place ``.so``, generated ``.c``, caches)."""
    os.makedirs(dest)
    for name in os.listdir(ROOT):
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):
            shutil.copy2(path, dest)
    ignore = shutil.ignore_patterns("*.so", "*.c", "*.html", "__pycache__", "*.pyc")
    for folder in SOURCE_DIRS:
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dest, folder), ignore=ignore)


def _clean_env(**extra):
    """This process's environment without anything that points Python or Spark elsewhere;
    this interpreter's bin/ first on PATH (the scripts of tools/ run ``python``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYSPARK_", "SPARK_", "STATECORE_", "PYTEST_"))
           and k not in ("VIRTUAL_ENV", "_JAVA_OPTIONS", "JAVA_TOOL_OPTIONS")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(extra)
    return env


def _dist_files(dist):
    """(sdist, wheel) of a ``tools/build_wheel.sh`` output folder: exactly one of each."""
    sdists = [os.path.join(dist, n) for n in os.listdir(dist) if n.endswith(".tar.gz")]
    wheels = [os.path.join(dist, n) for n in os.listdir(dist) if n.endswith(".whl")]
    assert len(sdists) == 1 and len(wheels) == 1, os.listdir(dist)
    return sdists[0], wheels[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel): what ``tools/build_wheel.sh`` makes of a clean copy of the tree, or, when
    ``STATECORE_BUILT_DIST`` names a folder it already filled from this tree (CI builds once for
    this test and for ``.ci/wheel``), what is there."""
    given = os.environ.get(BUILT_DIST_VARIABLE)
    if given:
        return _dist_files(given)
    for module in ("Cython", "setuptools", "build", "auditwheel"):
        pytest.importorskip(module, reason=f"building the wheel needs {module} in this environment (the test extra)")
    base = tmp_path_factory.mktemp("wheel")
    src, dist = str(base / "src"), str(base / "dist")
    _copy_source_tree(src)
    started = time.monotonic()
    out = subprocess.run(["bash", os.path.join(src, "tools", "build_wheel.sh"), "--no-isolation", dist],
                         cwd=src, env=_clean_env(STATECORE_DEBUG="1"), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"tools/build_wheel.sh failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    sdist, wheel = _dist_files(dist)
    print(f"built {os.path.basename(sdist)} and {os.path.basename(wheel)} in {time.monotonic() - started:.1f} s")
    return sdist, wheel


@pytest.fixture(scope="module")
def wheel(built):
    return built[1]


def test_sdist_holds_the_cython_sources_and_no_generated_code(built):
    """A platform without a matching wheel builds from the sdist: it must hold setup.py and
    every .pyx and .pxd of the core, and no generated C or compiled module."""
    with tarfile.open(built[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "MANIFEST.in"} <= names
    for module in COMPILED:
        assert f"statecore/{module}.pyx" in names, f"{module}.pyx is not in the sdist"
    for module in PXD:
        assert f"statecore/{module}.pxd" in names, f"{module}.pxd is not in the sdist"
    assert not [n for n in names if n.endswith((".c", ".so", ".html"))], "build outputs leaked into the sdist"


def test_wheel_is_manylinux_for_glibc_2_28_or_older(wheel):
    """The wheel an executor image without a compiler, or with an older glibc, installs: every
    platform tag manylinux of glibc <= 2.28, and auditwheel agrees with it."""
    platforms = os.path.basename(wheel)[:-len(".whl")].split("-")[-1].split(".")
    minors = [int(m.group(1)) for m in map(WHEEL_TAG.fullmatch, platforms) if m]
    assert minors and max(minors) <= MAX_GLIBC_MINOR, platforms
    assert all(WHEEL_TAG.fullmatch(p) or p == "manylinux2014_x86_64" for p in platforms), platforms
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", wheel], capture_output=True, text=True,
                         timeout=120, env=_clean_env())
    assert out.returncode == 0, out.stderr
    consistent = re.search(r'consistent with the\s+following\s+platform\s+tag:\s+"manylinux_2_(\d+)_x86_64"',
                           out.stdout)
    assert consistent and int(consistent.group(1)) <= min(minors), out.stdout


def test_wheel_holds_the_compiled_core_and_pxd_files(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
        wheel_info = z.read(f"{dist_info}/WHEEL").decode()
    assert COMPILED and {"_hash", "_rowtable", "_snapshot", "_delta"} <= set(COMPILED)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # .cpython-311-x86_64-linux-gnu.so
    for module in COMPILED:
        assert f"statecore/{module}{suffix}" in names, f"{module}{suffix} is not in the wheel"
    assert {"_hash", "_rowtable", "_snapshot"} <= set(PXD)
    for module in PXD:
        assert f"statecore/{module}.pxd" in names, f"{module}.pxd is not in the wheel"
    assert not [n for n in names if n.endswith((".pyx", ".c"))], "sources of the compiled core leaked into the wheel"
    for package in PACKAGES:  # every module, sub-packages (pyspark_glue.continuous) included
        expected = {os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/")
                    for folder, dirs, files in os.walk(os.path.join(ROOT, package)) if "__pycache__" not in folder
                    for n in files if n.endswith(".py")}
        assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)", metadata, re.M)
    assert set(RUNTIME_DEPS) <= set(requires), requires
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"Tag: {tag}-{tag}-" in wheel_info and "Root-Is-Purelib: false" in wheel_info, wheel_info


def _link_packages(dest, modules):
    """A directory of symlinks to exactly ``modules`` (and their ``<name>.libs`` folders of
    bundled shared libraries) as installed in this environment."""
    import importlib.util

    os.makedirs(dest, exist_ok=True)
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed here"
        package_dir = list(spec.submodule_search_locations)[0]
        os.symlink(package_dir, os.path.join(dest, name))
        site = os.path.dirname(package_dir)
        for entry in os.listdir(site):
            if entry.endswith(".libs") and entry.split(".")[0] in (name, f"{name}_"):
                os.symlink(os.path.join(site, entry), os.path.join(dest, entry))


ROUND_TRIP = r"""
import os, sys
site, deps, root = sys.argv[1:4]
sys.path[:0] = [site, deps]
import numpy as np
import statecore, statecore._hash, statecore._rowtable, statecore._snapshot, statecore._delta
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
for m in (statecore, statecore._hash, statecore._rowtable, statecore._snapshot, statecore._delta):
    assert os.path.realpath(m.__file__).startswith(os.path.realpath(site) + os.sep), m.__file__
assert "pyspark" not in sys.modules
key = np.dtype([("user", "<i8"), ("region", "S4")])
value = np.dtype([("count", "<i8"), ("sum", "<i8")])
keys = np.array([(i, b"eu" if i % 2 else b"us") for i in range(1000)], dtype=key)
values = np.array([(i, 3 * i) for i in range(1000)], dtype=value)
provider = create_and_init_provider(StateStoreId(root, 0, 0), key, value, StateStoreConf())
store = provider.get_store(0)
store.put_batch(keys, values)
store.commit()
provider.close()
again = create_and_init_provider(StateStoreId(root, 0, 0), key, value, StateStoreConf())
read = again.get_read_store(1)
got, found = read.get_batch(keys)
assert found.all() and got.tolist() == values.tolist()
read.abort()
again.close()
print("round trip ok from", os.path.dirname(statecore.__file__))
"""


def test_wheel_alone_imports_and_round_trips_a_store(wheel, tmp_path):
    site, deps = str(tmp_path / "site"), str(tmp_path / "deps")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    _link_packages(deps, RUNTIME_DEPS)
    # -S: no site-packages at all (nor their .pth files, such as an editable install's);
    # -E: no PYTHONPATH. sys.path is then the standard library, the wheel, and the four deps.
    out = subprocess.run([sys.executable, "-E", "-S", "-s", "-c", ROUND_TRIP, site, deps, str(tmp_path / "state")],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "round trip ok" in out.stdout


# -- processes --------------------------------------------------------------------------------------

def _stat(pid):
    """``(state, ppid, start time)`` of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def _ppid(pid):
    return _stat(pid)[1]


def _start_time(pid):
    try:
        return _stat(pid)[2]
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid, start_time=None):
    """Whether ``pid`` runs (not a zombie) and, if given, is still the process that started
    at ``start_time`` (not another one that got its pid since)."""
    try:
        state, _ppid_, started = _stat(pid)
    except (OSError, ValueError, IndexError):
        return False
    return state not in (b"Z", b"X") and (start_time is None or started == start_time)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _descendants(pid):
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children.setdefault(_ppid(int(name)), []).append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ancestors(pid, limit=16):
    out = []
    for _ in range(limit):
        try:
            pid = _ppid(pid)
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        out.append(pid)
    return out


def _describe(pid):
    args = _cmdline(pid)
    for cls in ("CoarseGrainedExecutorBackend", "deploy.worker.Worker", "deploy.master.Master", "SparkSubmit"):
        if any(cls in a for a in args):
            return cls.rsplit(".", 1)[-1]
    if any("pyspark.daemon" in a for a in args):
        return "pyspark.daemon"
    return os.path.basename(args[0]) if args else "(exited)"


class Processes:
    """The processes this test starts (each in its own session) and everything below them:
    ended by pid at the end, never by name."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.started = {}  # name -> Popen
        self.seen = {}  # pid -> (description, start time), of every process found under ours

    def start(self, name, cmd, env, cwd):
        with open(os.path.join(self.log_dir, f"{name}.log"), "wb") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started[name] = proc
        return proc

    def log(self, name):
        with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def tree(self, name):
        proc = self.started[name]
        pids = [proc.pid] + _descendants(proc.pid)
        for pid in pids:
            if pid not in self.seen:
                self.seen[pid] = (_describe(pid), _start_time(pid))
        return pids

    def kill_tree(self, name):
        """SIGKILL ``name`` and every process below it at once (a node dying);
        ``[(pid, description, argv)]`` of what was killed."""
        pids = self.tree(name)
        killed = [(pid, _describe(pid), _cmdline(pid)) for pid in pids]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.started[name].wait(timeout=30)
        return killed

    def stop_all(self, grace_s=20):
        """SIGTERM the processes started (Spark's daemons stop their executors), then SIGKILL
        whatever is left of everything ever seen under them (checked by start time, so that a
        pid reused by another process is left alone). Returns the survivors (none)."""
        for name, proc in self.started.items():
            if proc.poll() is None:  # not reaped yet: its pid is still its own
                self.tree(name)
        for name in ("driver", *sorted(n for n in self.started if n.startswith("worker")), "master"):
            proc = self.started.get(name)
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._running():
            for proc in self.started.values():
                proc.poll()
            time.sleep(0.2)
        for pid in self._running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.started.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return {pid: self.seen[pid][0] for pid in self._running()}

    def _running(self):
        return [pid for pid, (_what, started) in self.seen.items() if started is not None and _alive(pid, started)]


def _spark_home(dest):
    """A SPARK_HOME of symlinks to the pip package's bin, sbin, jars and python: workers then
    put their work and log directories here, never inside site-packages."""
    import pyspark

    package = os.path.dirname(pyspark.__file__)
    os.makedirs(dest)
    for name in ("bin", "sbin", "jars", "python"):
        os.symlink(os.path.join(package, name), os.path.join(dest, name))
    return package


EXECUTOR_EXTRAS = "executor,s3"  # s3: s3fs, for the run with the state root on the S3 server


def _env_archive(wheel, base):
    """The executors' environment by docs/cluster.md's recipe (``tools/pack_executor_env.sh``:
    a venv of the wheel, its dependencies and :data:`EXECUTOR_EXTRAS`, packed by venv-pack);
    then, for the driver alone, a ``.pth`` in the venv appending this environment's
    site-packages (pyspark and pytest, which the driver imports and the archive does not hold)."""
    import site

    env_dir, archive = os.path.join(base, "env"), os.path.join(base, "env.tar.gz")
    out = subprocess.run(["bash", os.path.join(ROOT, "tools", "pack_executor_env.sh"), "--extras", EXECUTOR_EXTRAS,
                          wheel, archive, env_dir],
                         capture_output=True, text=True, timeout=600, env=_clean_env())
    assert out.returncode == 0, f"tools/pack_executor_env.sh failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    env_python = os.path.join(env_dir, "bin", "python")
    env_site = subprocess.run([env_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, timeout=60, env=_clean_env()).stdout.strip()
    with tarfile.open(archive) as tar:
        packed = tar.getnames()
    assert not [n for n in packed if n.endswith(".pth") and "_statecore_test" in n]
    for package in ("statecore", "s3fs"):
        assert any(n.startswith("lib/") and f"/site-packages/{package}/" in n for n in packed), (package, packed[:20])
    import pyspark

    dirs = [os.path.dirname(os.path.dirname(m.__file__)) for m in (pyspark, pytest)]
    dirs += [d for d in site.getsitepackages() if d not in dirs]
    with open(os.path.join(env_site, "_statecore_test_driver.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(dirs)) + "\n")
    return env_dir, env_python, archive


def _read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _state_of_files(source):
    """{(user, region bytes): (count, sum)} over every input file, computed here with pyarrow."""
    import pyarrow.compute as pc

    tables = [pq.read_table(os.path.join(source, n)) for n in sorted(os.listdir(source)) if n.endswith(".parquet")]
    table = pa.concat_tables(tables)
    grouped = table.group_by(["user", "region"]).aggregate([("amount", "count"), ("amount", "sum")])
    users, regions = grouped["user"].to_pylist(), grouped["region"].to_pylist()
    counts, sums = grouped["amount_count"].to_pylist(), grouped["amount_sum"].to_pylist()
    assert pc.sum(grouped["amount_count"]).as_py() == table.num_rows
    return {(u, r.encode()): (c, s) for u, r, c, s in zip(users, regions, counts, sums)}


def _pairs(rows):
    return {(u, r.encode("latin-1")): (c, s) for u, r, c, s in rows}


@pytest.fixture(scope="module")
def executor_env(wheel, tmp_path_factory):
    """``(env_dir, env_python, archive)``: the executors' packed environment, made once for
    every run of the cluster test (:func:`_env_archive`)."""
    started = time.monotonic()
    made = _env_archive(wheel, str(tmp_path_factory.mktemp("pyenv")))
    print(f"executor environment packed in {time.monotonic() - started:.1f} s: "
          f"{os.path.getsize(made[2]) / 1e6:.1f} MB")
    return made


def _state_root(state_on, base, request):
    """``(state root, environment reaching it)``: a local directory, or a new bucket of the
    local S3 server and the variables that make s3fs reach it."""
    if state_on == "local":
        return os.path.join(base, "state"), {}
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.new_bucket('cluster')}/state", server.environment()


def _versions_in_bucket(state_url, environment):
    """``{partition: {version, ...}}`` of the delta files under ``state_url``'s operator 0."""
    import s3fs

    options = {"key": environment["AWS_ACCESS_KEY_ID"], "secret": environment["AWS_SECRET_ACCESS_KEY"],
               "endpoint_url": environment["AWS_ENDPOINT_URL"]}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    found = {}
    for path in fs.find(state_url):
        match = re.search(r"/state/0/(\d+)/(\d+)_[0-9a-f]{16}\.delta$", path)
        if match:
            found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("state_on", ["local", "s3"])
def test_worker_killed_mid_stream(state_on, executor_env, tmp_path, request):
    t0 = time.monotonic()

    def remaining():
        return max(1.0, TEST_DEADLINE_S - (time.monotonic() - t0))

    def note(what):
        print(f"{time.monotonic() - t0:6.1f} s  {what}", flush=True)

    base = str(tmp_path)
    dirs = {name: os.path.join(base, name) for name in ("logs", "tmp", "local", "work", "markers")}
    for d in dirs.values():
        os.makedirs(d)
    spark_home = os.path.join(base, "spark_home")
    package = _spark_home(spark_home)
    package_work = os.path.join(package, "work")
    package_work_before = os.path.exists(package_work)

    _env_dir, env_python, archive = executor_env
    state_root, state_env = _state_root(state_on, base, request)
    note(f"statecore's state root: {state_root}")

    spark_env = dict(SPARK_HOME=spark_home, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=dirs["local"],
                     TMPDIR=dirs["tmp"], SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS.format(tmp=dirs["tmp"]))
    daemon_props = os.path.join(base, "daemon.properties")
    with open(daemon_props, "w") as f:
        f.write("spark.master.rest.enabled=false\n")
    spark_class = os.path.join(spark_home, "bin", "spark-class")
    procs = Processes(dirs["logs"])
    hold_file = os.path.join(dirs["markers"], "hold")
    result_file = os.path.join(base, "result.json")
    progress_file = os.path.join(base, "progress.jsonl")
    try:
        procs.start("master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", "0", "--webui-port", "0", "--properties-file", daemon_props],
                    _clean_env(**spark_env), base)

        def master_url():
            if procs.started["master"].poll() is not None:
                raise AssertionError(f"the master exited:\n{procs.log('master')[-3000:]}")
            match = re.search(r"Starting Spark master at (spark://\S+)", procs.log("master"))
            return match and match.group(1)

        master = wait_for(master_url, min(90, remaining()), "the master to start")
        note(f"master up at {master}")
        for i in (1, 2):
            work = os.path.join(dirs["work"], f"worker{i}")
            procs.start(f"worker{i}", [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                       "--port", "0", "--webui-port", "0", "--cores", "1", "--memory", "1g",
                                       "--work-dir", work, "--properties-file", daemon_props, master],
                        _clean_env(**spark_env, SPARK_WORKER_DIR=work), base)

        def registered():
            for i in (1, 2):
                if procs.started[f"worker{i}"].poll() is not None:
                    raise AssertionError(f"worker{i} exited:\n{procs.log(f'worker{i}')[-3000:]}")
            return all("Successfully registered with master" in procs.log(f"worker{i}") for i in (1, 2))

        wait_for(registered, min(120, remaining()), "both workers to register with the master")
        note("both workers registered")

        config = {"master": master, "archive": archive, "source": os.path.join(base, "in"),
                  "checkpoint": os.path.join(base, "checkpoint"), "state": state_root, "executor_env": state_env,
                  "sink": os.path.join(base, "sink"), "markers": dirs["markers"], "hold_file": hold_file,
                  "progress": progress_file, "result": result_file, "tmp": dirs["tmp"]}
        config_file = os.path.join(base, "driver.json")
        with open(config_file, "w") as f:
            json.dump(config, f)
        with open(hold_file, "w") as f:
            f.write("tasks of the held batch wait while this file exists\n")
        procs.start("driver", [env_python, os.path.abspath(__file__), config_file],
                    _clean_env(**spark_env, **state_env, PYSPARK_PYTHON="./env/bin/python"), base)
        note("driver started")

        def held_task():
            if procs.started["driver"].poll() is not None:
                raise AssertionError(f"the driver exited before batch {HOLD_BATCH} was held:\n"
                                     f"{procs.log('driver')[-6000:]}")
            for marker in _read_markers(dirs["markers"]):
                if marker["version"] == HOLD_BATCH:
                    for name in ("worker1", "worker2"):
                        if procs.started[name].pid in _ancestors(marker["pid"]):
                            return name, marker
            return None

        victim, marker = wait_for(held_task, remaining(), f"a task of batch {HOLD_BATCH} to be held")
        note(f"a task of batch {HOLD_BATCH} (partition {marker['partition']}, executor {marker['executor']}) "
             f"is held under {victim}")
        batches_before_kill = [p["batch_id"] for p in _read_jsonl(progress_file)]
        killed = procs.kill_tree(victim)
        os.remove(hold_file)
        note(f"SIGKILLed {victim}'s processes: " + ", ".join(f"{what} {pid}" for pid, what, _ in killed)
             + "; hold released")
        killed_executors = {_option_of(args, "--executor-id") for _, what, args in killed
                            if what == "CoarseGrainedExecutorBackend"}
        assert killed_executors == {marker["executor"]}, (killed_executors, marker)
        killed_executor = marker["executor"]

        try:
            code = procs.started["driver"].wait(timeout=remaining())
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver did not finish in time:\n{procs.log('driver')[-6000:]}") from None
        assert code == 0, f"the driver failed ({code}):\n{procs.log('driver')[-8000:]}"
        note("driver finished")
        with open(result_file) as f:
            result = json.load(f)
    finally:
        leftovers = procs.stop_all()
        if os.path.exists(hold_file):
            os.remove(hold_file)
    note("every process ended")
    assert not leftovers, f"processes left running: {leftovers}"
    assert os.path.exists(package_work) == package_work_before, "a work/ directory appeared in the pyspark package"

    progress = _read_jsonl(progress_file)
    markers = _read_markers(dirs["markers"])
    driver_log = procs.log("driver")
    loss_lines = [line for line in driver_log.splitlines()
                  if re.search(r"Lost executor|ExecutorLostFailure|FetchFailed|Resubmitt|worker lost|"
                               r"Removed executor|Lost task", line)]
    print("driver log, executor loss:\n  " + "\n  ".join(loss_lines[:20]))
    for p in progress:
        print(f"batch {p['batch_id']} (run {p['run']}): partitions on executors {p['executors']}, "
              f"{p['stores_already_loaded']}/{NUM_PARTITIONS} stores already loaded, {p['seconds']:.1f} s")
    print("tasks of the held batch: " + ", ".join(
        f"p{m['partition']}@{m['executor']}(stage {m['stage']}, task {m['task']}, attempt {m['attempt']})"
        for m in markers if m["version"] == HOLD_BATCH))
    print(f"query failures: {result['query_failures'] or 'none'}; executors at the end: {result['executors_at_end']}")
    print("on the executors: " + "; ".join(sorted({f"python {r['executable']}, statecore {r['statecore']}, "
                                                   f"pyspark {r['pyspark']}" for r in result["probe"]})))

    # Both executors worked, and statecore ran from the shipped archive on each of them.
    executors = set(result["executors_at_start"])
    assert len(executors) == 2 and killed_executor in executors, (executors, killed_executor)
    survivor = (executors - {killed_executor}).pop()
    assert result["probe"], "the probe job returned nothing"
    for row in result["probe"]:
        assert row["executable"].endswith("/env/bin/python"), row
        for path in (row["statecore"], row["compiled"], row["pyspark_glue"]):
            assert "/env/lib/" in path and path.startswith(dirs["work"] + os.sep), row

    # The query went on with the surviving executor: no failure, no restart, every batch once
    # per run, and every batch after the kill ran entirely on the survivor.
    assert result["query_failures"] == [], result["query_failures"]
    assert [p["batch_id"] for p in progress] == list(range(RUN1_FILES + RUN2_FILES))
    assert [p["run"] for p in progress] == [1] * RUN1_FILES + [2] * RUN2_FILES
    assert HOLD_BATCH not in batches_before_kill
    for p in progress:
        if p["batch_id"] > HOLD_BATCH:
            assert set(p["executors"].values()) == {survivor}, p
    held = progress[HOLD_BATCH]
    assert held["executors"][str(marker["partition"])] == survivor  # the killed task ran again, on the survivor
    assert any(m["version"] == HOLD_BATCH and m["partition"] == marker["partition"] and m["executor"] == survivor
               for m in markers)
    assert result["executors_at_end"] == [survivor]  # no worker was free for a replacement
    assert any("Lost executor" in line or "ExecutorLostFailure" in line for line in loss_lines), loss_lines

    # Exactly right: the state equals Spark's own aggregation and one computed here, and the
    # newest sink row of every key carries its state.
    expected = _state_of_files(config["source"])
    assert len(expected) > 100
    state = _pairs(result["state"])
    assert state == _pairs(result["spark_group_by"]) == expected
    sink = pq.read_table(config["sink"]).to_pandas()
    sink["batch"] = sink["batch"].astype(int)
    newest = sink.sort_values("batch").groupby(["user", "region"]).last()
    assert {(u, bytes(r)): (int(row["count"]), int(row["sum"])) for (u, r), row in newest.iterrows()} == state
    assert set(sink["batch"]) <= set(range(RUN1_FILES + RUN2_FILES))
    if state_on == "s3":  # the state is in the bucket, every partition's versions, and not on the local disk
        assert _versions_in_bucket(state_root, state_env) == {
            p: set(range(1, RUN1_FILES + RUN2_FILES + 1)) for p in range(NUM_PARTITIONS)}
        assert not os.path.exists(os.path.join(base, "state"))
    note(f"state of {len(state)} keys exactly right")


def _option_of(args, name):
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _read_markers(directory):
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("task-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass  # being written
    return out


# -- the Spark driver (this file run as a script, by the test above) -----------------------------

class HoldingAggregate:
    """RunningAggregate that leaves a marker file per task (its pid, executor, partition and
    attempt), and in batch HOLD_BATCH waits in ``finish`` (state updated, not committed)
    while the hold file exists. Defined in ``__main__`` of the driver: shipped by value."""

    def __init__(self, markers, hold_file):
        from pyspark_glue import RunningAggregate

        self.inner = RunningAggregate(KEY, "amount")
        self.markers, self.hold_file = markers, hold_file

    def open(self, context):
        self.task = self.inner.open(context)

    def __call__(self, store, batch):
        return self.task.process(batch)

    def finish(self, store):
        from pyspark import TaskContext

        from pyspark_glue.executor import executor_identity

        ctx = TaskContext.get()
        marker = {"pid": os.getpid(), "executor": executor_identity()[1], "version": store.version,
                  "partition": ctx.partitionId(), "stage": ctx.stageId(), "task": ctx.taskAttemptId(),
                  "attempt": ctx.attemptNumber()}
        name = (f"task-{store.version:03d}-{marker['partition']}-{marker['task']}-"
                f"{os.getpid()}.json")
        tmp = os.path.join(self.markers, f".{name}")
        with open(tmp, "w") as f:
            json.dump(marker, f)
        os.replace(tmp, os.path.join(self.markers, name))
        if store.version == HOLD_BATCH:
            deadline = time.monotonic() + HOLD_MAX_S
            while os.path.exists(self.hold_file) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.task.finish()


def _probe(_):
    """Where statecore comes from on an executor."""
    import pyspark
    import statecore
    import statecore._hash

    import pyspark_glue
    from pyspark_glue.executor import executor_identity

    return json.dumps({"executor": executor_identity()[1], "executable": sys.executable,
                       "statecore": statecore.__file__, "compiled": statecore._hash.__file__,
                       "pyspark_glue": pyspark_glue.__file__, "pyspark": pyspark.__file__}, sort_keys=True)


def _executor_ids(sc):
    ids = sc._jsc.sc().getExecutorIds()  # a Scala Seq through py4j
    return sorted(ids.apply(i) for i in range(ids.size()))


def _driver(config_file):
    with open(config_file) as f:
        cfg = json.load(f)
    t0 = time.monotonic()

    def say(what):
        print(f"[driver {time.monotonic() - t0:6.1f} s] {what}", flush=True)

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from pyspark_glue import StatefulOperator, read_state

    builder = SparkSession.builder
    for name, value in cfg["executor_env"].items():  # the S3 server's endpoint and credentials, if any
        builder = builder.config(f"spark.executorEnv.{name}", value)
    spark = (builder.master(cfg["master"]).appName("statecore-cluster-test")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "768m")
             .config("spark.executor.memory", "1g")
             .config("spark.executor.cores", "1")
             .config("spark.cores.max", "2")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.locality.wait", "100ms")
             .config("spark.python.worker.reuse", "true")
             .config("spark.sql.shuffle.partitions", str(NUM_PARTITIONS))
             .config("spark.sql.files.maxPartitionBytes", str(SPLIT_BYTES))
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS.format(tmp=cfg["tmp"]))
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS.format(tmp=cfg["tmp"]))
             .config("spark.archives", f"file://{cfg['archive']}#env")  # and PYSPARK_PYTHON: docs/cluster.md
             .getOrCreate())
    sc = spark.sparkContext
    sc.setLogLevel("WARN")
    say("session up")
    result = {"query_failures": []}
    try:
        wait_for(lambda: len(_executor_ids(sc)) >= 2, 120, "2 executors")
        result["executors_at_start"] = _executor_ids(sc)
        say(f"executors {result['executors_at_start']}")
        probe = sc.parallelize(range(8), 8).map(_probe).distinct().collect()
        result["probe"] = [json.loads(p) for p in probe]
        say(f"probe: {sorted({p['executor'] for p in result['probe']})}")

        source = cfg["source"]
        for i in range(RUN1_FILES):
            write_events(source, f"events-{i:02d}.parquet", make_events(i, ROWS_PER_FILE))

        def run(number):
            """One run of the query over the files present; restarted from its checkpoint if it
            fails (recorded: the test expects no failure)."""
            for _attempt in range(3):
                fn = HoldingAggregate(cfg["markers"], cfg["hold_file"])
                op = StatefulOperator(cfg["state"], 0, NUM_PARTITIONS, ["user", "region"], KEY,
                                      fn.inner.value_schema, fn, fn.inner.output_schema)

                def handle(df, batch_id, op=op):
                    out = op.process(df, batch_id)
                    out.write.mode("overwrite").parquet(f"{cfg['sink']}/batch={batch_id}")
                    lp = op.last_progress
                    record = {"batch_id": batch_id, "run": number, "query_run_id": lp["query_run_id"],
                              "seconds": lp["seconds"], "rows_in": lp["rows_in"],
                              "re_execution": lp["re_execution"],
                              "stores_already_loaded": lp["stores_already_loaded"],
                              "executors": {str(p["partition_id"]): p["worker"].split(".")[0]
                                            for p in lp["partitions"]}}
                    with open(cfg["progress"], "a") as f:
                        f.write(json.dumps(record) + "\n")
                    say(f"batch {batch_id}: {record['executors']}")

                query = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
                         .writeStream.foreachBatch(handle).option("checkpointLocation", cfg["checkpoint"]).start())
                try:
                    query.processAllAvailable()
                    return
                except Exception as e:
                    result["query_failures"].append({"run": number, "error": str(e)[:3000]})
                    say(f"query failed, restarting from its checkpoint: {str(e)[:500]}")
                finally:
                    query.stop()
                    op.close()
            raise RuntimeError("the query failed three times")

        run(1)
        for i in range(RUN1_FILES, RUN1_FILES + RUN2_FILES):
            write_events(source, f"events-{i:02d}.parquet", make_events(i, ROWS_PER_FILE))
        run(2)

        state = read_state(spark, cfg["state"], 0).collect()
        result["state"] = [(r["user"], bytes(r["region"]).decode("latin-1"), r["count"], r["sum"]) for r in state]
        grouped = (spark.read.schema(INPUT_DDL).parquet(source).groupBy("user", "region")
                   .agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum")).collect())
        result["spark_group_by"] = [(r["user"], r["region"], r["count"], r["sum"]) for r in grouped]
        result["executors_at_end"] = _executor_ids(sc)
        say("done")
    finally:
        tmp = cfg["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, cfg["result"])
        spark.stop()


if __name__ == "__main__":
    _driver(sys.argv[1])
