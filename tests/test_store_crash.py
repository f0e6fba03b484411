"""Crash safety of the file provider: processes killed at random instants and at pinned
points, injected I/O faults, and damaged files.

Kill tests: a worker process (tests/crash_worker.py) commits a deterministic workload and
records each version after its commit returned. After a SIGKILL, the last recorded version
L must load exactly (compared with a model replayed here from the same batches), version
L+1 must be absent or exact (the kill landed between the rename and the record), nothing
above it may exist, every state file in the directory must be whole, and a new worker
continues from L or L+1 (restart after crash), to be killed again.

Then: I/O faults injected at every step of a commit's delta write, of maintenance's snapshot
write, and of cleanup's deletes (statecore.files.FaultInjectingFiles); damaged deltas and
snapshots; and maintenance interleaved with the task at exact points (a re-executed batch,
a load), each pinned by hooks in the store's files.
"""
import collections
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import crash_worker as cw
import statecore.files
from statecore import (SnapshotReader, StateCorruptionError, StateStoreConf,
                       StateStoreId, StateStoreProviderId, VersionNotFoundError, create_and_init_provider,
                       read_delta, registry)
from statecore.files import FaultInjectingFiles

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "crash_worker.py")
KEY, VALUE = cw.KEY, cw.VALUE


# -- helpers ---------------------------------------------------------------------------------
def make(root, **conf):
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(**conf))


def store_dir(root):
    return os.path.join(str(root), "0", "0")


def names(root):
    d = store_dir(root)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def tmp_files(root):
    return [n for n in names(root) if n.endswith(".tmp")]


def versions_on_disk(root):
    deltas, snapshots = set(), set()
    for n in names(root):
        stem, _, kind = n.partition(".")
        if stem.isdigit() and kind == "delta":
            deltas.add(int(stem))
        elif stem.isdigit() and kind == "snapshot":
            snapshots.add(int(stem))
    return deltas, snapshots


def keys_of(ks):
    out = np.zeros(len(ks), KEY)
    out["k"] = ks
    return out


ALL_KEYS = keys_of(np.arange(-1, cw.KEY_SPACE + 1))


def contents(store):
    out = {}
    for (k,), v in store.iterator():
        assert k not in out, f"key {k} iterated twice"
        out[k] = v
    return out


def assert_version(provider, version, expected):
    """``version`` read through ``provider`` is exactly ``expected`` ({key: (count, sum)}),
    by every read path."""
    store = provider.get_read_store(version)
    try:
        got = contents(store)
        assert len(got) == len(expected), f"version {version}: {len(got)} keys, expected {len(expected)}"
        assert got == expected, f"version {version} differs"
        assert store.metrics.num_keys == len(expected)
        values, found = store.get_batch(ALL_KEYS)
        assert found.tolist() == [int(k) in expected for k in ALL_KEYS["k"]]
        assert values[found].tolist() == [expected[int(k)] for k in ALL_KEYS["k"][found]]
        for k in list(expected)[:5] + [-1]:
            assert store.get(k) == expected.get(k)
    finally:
        store.abort()


def assert_files_whole(root):
    """Every delta and snapshot in the directory reads back whole (checksums, trailer,
    version); temporary files are ignored, as the store ignores them."""
    d = store_dir(root)
    for n in names(root):
        stem, _, kind = n.partition(".")
        if not stem.isdigit():
            continue
        path = os.path.join(d, n)
        if kind == "delta":
            read_delta(Path(path).read_bytes(), KEY, VALUE, path=path)
        elif kind == "snapshot":
            reader = SnapshotReader(path, KEY, VALUE)
            try:
                reader.verify()
                assert reader.store_version == int(stem)
            finally:
                reader.close()


def commit(provider, version, puts=(), removes=()):
    store = provider.get_store(version)
    for k, v in puts:
        store.put(k, v)
    for k in removes:
        store.remove(k)
    new_version = store.commit()
    store.abort()  # what the task-completion hook does; harmless after commit
    return new_version


def workload(seed, versions):
    """{version: contents} for a deterministic workload of crash_worker batches."""
    model, out = {}, {0: {}}
    for v in range(1, versions + 1):
        cw.apply_to_dict(model, cw.batch(seed, v))
        out[v] = dict(model)
    return out


def commit_workload(provider, seed, start, stop, maintenance_every=None):
    for v in range(start, stop):
        store = provider.get_store(v)
        cw.apply_to_store(store, cw.batch(seed, v + 1))
        assert store.commit() == v + 1
        store.abort()
        if maintenance_every and (v + 1) % maintenance_every == 0:
            provider.do_maintenance()


@pytest.fixture
def faulty(monkeypatch):
    """Every provider created in the test gets a FaultInjectingFiles; the list holds them."""
    made = []

    def open_store_files(location, storage_options=None, local_cache_dir=None):
        made.append(FaultInjectingFiles(location, storage_options, local_cache_dir))
        return made[-1]

    monkeypatch.setattr(statecore.files, "open_store_files", open_store_files)
    return made


@pytest.fixture
def clean_registry():
    registry.stop()
    yield
    registry.stop()


# -- kill tests --------------------------------------------------------------------------------
class CrashRun:
    """One store directory written by successive worker processes, each killed, and the
    model of what it must hold."""

    def __init__(self, tmp_path, seed, mode):
        self.tmp = tmp_path
        self.root = str(tmp_path / "state")
        self.seed, self.mode = seed, mode
        self.rng = np.random.default_rng(seed)
        self.start = 0  # the version the next worker starts from
        self.model_version, self.model = 0, {}
        self.recent = {0: {}}  # a few versions below model_version
        self.rounds = 0
        self.stats = collections.Counter()

    def advance(self, version):
        assert version >= self.model_version
        for v in range(self.model_version + 1, version + 1):
            cw.apply_to_dict(self.model, cw.batch(self.seed, v))
            if v > version - cw.MIN_VERSIONS_TO_RETAIN:
                self.recent[v] = dict(self.model)
        self.model_version = version
        self.recent = {v: d for v, d in self.recent.items() if v >= version - cw.MIN_VERSIONS_TO_RETAIN}

    def spawn(self, die=None):
        self.rounds += 1
        self.side = str(self.tmp / f"recorded-{self.rounds}.txt")
        self.stderr_path = str(self.tmp / f"stderr-{self.rounds}.txt")
        args = [sys.executable, WORKER, self.root, str(self.seed), str(self.start), self.side, self.mode]
        if die:
            args += ["--die", die]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.stderr_path, "wb") as err:
            return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, cwd=str(REPO), env=env)

    def stderr(self):
        return Path(self.stderr_path).read_text(errors="replace")[-3000:]

    def wait_ready(self, proc, timeout=30):
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        assert line == b"ready\n", f"worker did not start: {line!r} {self.stderr()}"

    def kill_round(self, delay, from_spawn=False):
        """Start a worker from ``self.start``, SIGKILL it ``delay`` seconds after it is ready
        (or after it was spawned), then check and pick the next start."""
        proc = self.spawn()
        if not from_spawn:
            self.wait_ready(proc)
        time.sleep(delay)
        assert proc.poll() is None, f"worker exited by itself ({proc.returncode}): {self.stderr()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, self.stderr()
        self.check()

    def die_round(self, spec, timeout=30):
        """Start a worker that SIGKILLs itself at the point ``spec`` names; then check."""
        proc = self.spawn(die=spec)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"the worker never reached {spec}: {self.stderr()}")
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, f"{proc.returncode}: {self.stderr()}"
        return self.check()

    def recorded(self):
        raw = Path(self.side).read_bytes() if os.path.exists(self.side) else b""
        lines = raw.split(b"\n")
        complete = [int(x) for x in lines[:-1]]  # a last line without its newline was torn
        assert complete == list(range(self.start + 1, self.start + 1 + len(complete))), complete
        return complete[-1] if complete else self.start

    def check(self):
        last = self.recorded()
        self.stats["versions"] += last - self.start
        assert_files_whole(self.root)
        deltas, snapshots = versions_on_disk(self.root)
        assert max(deltas | snapshots | {0}) <= last + 1, (last, sorted(deltas), sorted(snapshots))
        self.stats["snapshots"] += len(snapshots)
        self.stats["tmp files left"] += len(tmp_files(self.root))
        self.advance(last)
        assert_version(make(self.root, **cw.conf_kwargs()), last, self.model)
        following = dict(self.model)
        cw.apply_to_dict(following, cw.batch(self.seed, last + 1))
        fresh = make(self.root, **cw.conf_kwargs())
        try:
            assert_version(fresh, last + 1, following)
            next_exists = True
            self.stats["kills after the rename, before the record"] += 1
        except VersionNotFoundError:
            next_exists = False
        with pytest.raises(VersionNotFoundError):
            fresh.get_read_store(last + 2)
        # the versions retention keeps load too
        newest = last + 1 if next_exists else last
        for v in range(max(1, newest - cw.MIN_VERSIONS_TO_RETAIN), last):
            if v in self.recent:
                assert_version(make(self.root, **cw.conf_kwargs()), v, self.recent[v])
        # restart: from the recorded version, or from the one after it when it is there
        # (the other choice re-executes it, re-committing a version that exists)
        if next_exists and self.rng.random() < 0.5:
            self.advance(last + 1)
            self.start = last + 1
        else:
            self.start = last
        return last, next_exists


def test_random_kills_and_restarts(tmp_path):
    run = CrashRun(tmp_path, seed=11, mode="plain")
    rng = np.random.default_rng(2024)
    delays = [0.0, 0.002, *rng.uniform(0.0, 0.8, 6), 1.0]
    rng.shuffle(delays)
    for i, delay in enumerate(delays):
        run.kill_round(float(delay), from_spawn=(i == 3))  # one kill lands while it starts up
    assert run.start > 100, run.stats  # the workload went on across the restarts
    assert run.stats["snapshots"] > 0, run.stats


def test_random_kills_with_the_registry_maintenance_thread(tmp_path, clean_registry):
    """Snapshots and cleanup run on the registry's thread, concurrently with commits, so
    kills land in the middle of them."""
    run = CrashRun(tmp_path, seed=12, mode="registry")
    rng = np.random.default_rng(7)
    for delay in [*rng.uniform(0.1, 0.9, 5), 0.01]:
        run.kill_round(float(delay))
    assert run.start > 50, run.stats
    assert run.stats["snapshots"] > 0, run.stats


# (die spec for crash_worker.py, where the first worker dies)
PINNED = [
    ("write:_statecore.schema.json:1:0", "the schema file of the first commit, torn"),
    ("rename:1.delta:1", "the first delta, whole but not renamed"),
    ("recorded:*:1", "the first commit, renamed, not recorded"),
    ("write:*.delta:5:0", "a delta's temporary file, empty"),
    ("write:*.delta:5:100", "a delta, torn inside its first block"),
    ("fsync:*.delta:7", "a delta, before its fsync"),
    ("rename:*.delta:8", "a delta, whole but not renamed"),
    ("recorded:*:9", "a commit renamed but not recorded"),
    ("write:*.snapshot:1:5000", "a snapshot, torn in its rows"),
    ("rename:*.snapshot:2", "a snapshot, whole but not renamed"),
    ("delete:*:1", "cleanup, before its first delete"),
    ("delete:*:3", "cleanup, after two deletes"),
]


@pytest.mark.parametrize("spec", [p[0] for p in PINNED], ids=[p[1] for p in PINNED])
def test_kill_at_pinned_points(tmp_path, spec):
    run = CrashRun(tmp_path, seed=21, mode="plain")
    last, next_exists = run.die_round(spec)
    if spec.startswith("recorded"):
        assert next_exists  # the kill came after the rename: the version is there
    elif spec.startswith(("write", "fsync", "rename:")) and "delta" in spec:
        assert not next_exists
    # restarted: the next worker dies right after a commit, before recording it, which
    # also makes the version after that be re-committed (or continued) by the third one
    run.die_round("recorded:*:3")
    assert not tmp_files(run.root) or spec.split(":")[0] in ("write", "fsync", "rename")


# -- injected faults at commit -----------------------------------------------------------------
STEPS = [("write", 0), ("write", 150), ("flush", 0), ("fsync", 0), ("rename", 0)]


@pytest.mark.parametrize("step,after_bytes", STEPS, ids=[f"{s}{b or ''}" for s, b in STEPS])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("over_snapshot", [False, True], ids=["deltas", "over-snapshot"])
def test_failed_commit_changes_nothing(tmp_path, faulty, step, after_bytes, k, over_snapshot):
    seed = 5
    expected = workload(seed, 9)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3, max_versions_to_retain_in_memory=k)
    files = faulty[-1]
    commit_workload(p, seed, 0, 6, maintenance_every=3 if over_snapshot else None)
    reader = p.get_read_store(6)  # an open reader of the version the failed commit builds on
    files.arm(step, "*.delta", after_bytes=after_bytes)
    s = p.get_store(6)
    cw.apply_to_store(s, cw.batch(seed, 7))
    with pytest.raises(OSError, match=f"injected fault at {step} of 7.delta"):
        s.commit()
    assert files.raised[step] == 1
    assert not s.has_committed
    assert tmp_files(tmp_path) == []
    assert 7 not in versions_on_disk(tmp_path)[0]
    # the failing store still holds its updates; the provider and a fresh one serve 6 exactly
    assert contents(s) == expected[7]
    assert contents(reader) == expected[6]
    for provider in (p, make(tmp_path)):
        assert_version(provider, 6, expected[6])
        assert_version(provider, 5, expected[5])
        with pytest.raises(VersionNotFoundError):
            provider.get_read_store(7)
    s.abort()
    assert not s.has_committed
    # the next attempt succeeds, and the workload goes on
    commit_workload(p, seed, 6, 9, maintenance_every=3 if over_snapshot else None)
    assert contents(reader) == expected[6]
    for v in (7, 8, 9):
        assert_version(p, v, expected[v])
        assert_version(make(tmp_path), v, expected[v])
    assert tmp_files(tmp_path) == []


@pytest.mark.parametrize("step", ["write", "flush", "fsync", "rename"])
def test_failed_commit_can_be_retried_by_the_same_store(tmp_path, faulty, step):
    seed = 6
    expected = workload(seed, 4)
    p = make(tmp_path)
    commit_workload(p, seed, 0, 3)
    faulty[-1].arm(step, "4.delta")
    s = p.get_store(3)
    cw.apply_to_store(s, cw.batch(seed, 4))
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert not s.has_committed
    assert s.commit() == 4 and s.has_committed
    assert s.metrics.num_keys == len(expected[4])
    assert_version(p, 4, expected[4])
    assert_version(make(tmp_path), 4, expected[4])
    assert tmp_files(tmp_path) == []


def test_failed_schema_file_write_at_the_first_commit(tmp_path, faulty):
    p = make(tmp_path)
    faulty[-1].arm("rename", "_statecore.schema.json")
    s = p.get_store(0)
    s.put(1, (1, 1.0))
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert not s.has_committed and tmp_files(tmp_path) == []
    with pytest.raises(VersionNotFoundError):
        make(tmp_path).get_read_store(1)
    s.abort()
    assert commit(p, 0, [(1, (1, 1.0))]) == 1
    assert contents(make(tmp_path).get_read_store(1)) == {1: (1, 1.0)}
    assert "_statecore.schema.json" in names(tmp_path)


def test_failed_re_execution_commit_keeps_the_version_it_builds_on(tmp_path, faulty):
    """Re-executing batch 5 from version 4 first deletes the abandoned run's later files
    (by design); when the delta write then fails, version 4 is intact, and so is the old
    run's version 5 (its delta is only replaced by a successful rename)."""
    seed = 8
    expected = workload(seed, 8)
    p = make(tmp_path, min_deltas_for_snapshot=2)
    commit_workload(p, seed, 0, 8, maintenance_every=3)
    s = make(tmp_path).get_store(4)  # a restarted query re-runs batch 5
    faulty[-1].arm("rename", "5.delta")
    s.put(-1, (-1, -1.0))
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert tmp_files(tmp_path) == []
    fresh = make(tmp_path)
    assert_version(fresh, 4, expected[4])
    assert_version(fresh, 5, expected[5])
    s.abort()
    q = make(tmp_path)
    assert commit(q, 4, [(-1, (-1, -1.0))]) == 5
    assert_version(make(tmp_path), 5, {**expected[4], -1: (-1, -1.0)})
    with pytest.raises(VersionNotFoundError):
        make(tmp_path).get_read_store(6)


# -- injected faults in maintenance ------------------------------------------------------------
@pytest.mark.parametrize("step,after_bytes", [("write", 0), ("write", 6000), ("flush", 0), ("fsync", 0),
                                              ("rename", 0)])
def test_failed_snapshot_write_in_maintenance(tmp_path, faulty, step, after_bytes):
    seed = 9
    expected = workload(seed, 12)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    files = faulty[-1]
    commit_workload(p, seed, 0, 5)
    files.arm(step, "*.snapshot", after_bytes=after_bytes)
    try:
        p.do_maintenance()
    except OSError as e:  # maintenance errors reach the caller (the registry unloads the provider)
        assert "injected fault" in str(e)
    assert files.raised[step] == 1
    assert tmp_files(tmp_path) == [] and versions_on_disk(tmp_path)[1] == set()
    for v in (3, 4, 5):
        assert_version(make(tmp_path), v, expected[v])
        assert_version(p, v, expected[v])
    # the provider goes on: commits, then a snapshot when maintenance works again
    commit_workload(p, seed, 5, 8)
    p.do_maintenance()
    assert versions_on_disk(tmp_path)[1] == {8}
    assert_files_whole(tmp_path)
    commit_workload(p, seed, 8, 12, maintenance_every=2)
    for v in range(9, 13):
        assert_version(p, v, expected[v])
        assert_version(make(tmp_path), v, expected[v])
    assert tmp_files(tmp_path) == []


def test_failed_snapshot_in_the_registry_unloads_only_that_provider(tmp_path, faulty, clean_registry):
    seed = 10
    expected = workload(seed, 8)
    conf = StateStoreConf(min_deltas_for_snapshot=1, min_versions_to_retain=2, maintenance_interval_s=3600)
    pid = StateStoreProviderId(StateStoreId(str(tmp_path), 0, 0), uuid.uuid4())
    other = StateStoreProviderId(StateStoreId(str(tmp_path), 0, 1), uuid.uuid4())

    def run(provider_id, start, stop):
        for v in range(start, stop):
            store = registry.get(provider_id, KEY, VALUE, v, conf)
            cw.apply_to_store(store, cw.batch(seed, v + 1))
            assert store.commit() == v + 1

    run(pid, 0, 4)
    run(other, 0, 4)
    files = faulty[0]
    files.arm("fsync", "*.snapshot")
    registry.run_maintenance_now()
    assert files.raised["fsync"] == 1
    assert not registry.is_loaded(pid) and registry.is_loaded(other)
    assert tmp_files(tmp_path) == [] and versions_on_disk(tmp_path)[1] == set()
    assert_version(make(tmp_path), 4, expected[4])
    run(pid, 4, 8)  # loaded again, from the files
    registry.run_maintenance_now()
    assert registry.is_loaded(pid)
    assert versions_on_disk(tmp_path)[1] == {8}
    assert_version(make(tmp_path), 8, expected[8])
    assert_version(make(tmp_path), 6, expected[6])


@pytest.mark.parametrize("times", [1, 2, None], ids=["one", "two", "all"])
def test_failed_deletes_in_cleanup(tmp_path, faulty, times):
    seed = 13
    expected = workload(seed, 16)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    files = faulty[-1]
    commit_workload(p, seed, 0, 10, maintenance_every=3)
    assert min(versions_on_disk(tmp_path)[0]) > 1  # cleanup did delete (the setting is right)
    commit_workload(p, seed, 10, 13)
    files.arm("delete", times=times)
    p.do_maintenance()  # failed deletes are logged and skipped
    assert files.raised["delete"] >= 1
    assert tmp_files(tmp_path) == []
    assert_files_whole(tmp_path)
    for v in range(10, 14):
        assert_version(make(tmp_path), v, expected[v])
    files.disarm()
    commit_workload(p, seed, 13, 16, maintenance_every=1)
    deltas, snapshots = versions_on_disk(tmp_path)
    # everything older than the snapshot that version 16 - 3 needs is gone
    base = max(s for s in snapshots if s <= 13)
    assert min(deltas | snapshots) == base, (sorted(deltas), sorted(snapshots))
    for v in range(13, 17):
        assert_version(make(tmp_path), v, expected[v])


def test_failed_reads_while_loading_are_errors_not_data(tmp_path, faulty):
    seed = 14
    expected = workload(seed, 7)
    p = make(tmp_path, min_deltas_for_snapshot=2)
    commit_workload(p, seed, 0, 7, maintenance_every=3)
    for pattern in ("*.delta", "*.snapshot"):
        fresh = make(tmp_path)
        faulty[-1].arm("read", pattern)
        with pytest.raises(OSError, match="injected"):
            fresh.get_read_store(7)
        assert_version(fresh, 7, expected[7])  # nothing half-loaded was kept


def test_maintenance_while_a_commit_finishes(tmp_path, monkeypatch):
    """The registry's thread may run maintenance at any instant, e.g. right after a commit's
    delta was renamed into place but before the commit returned. It may skip the snapshot of
    that version or write it, but then the snapshot must be that version, and commits made
    while it is being written must neither disturb it nor make maintenance fail."""
    seed = 15
    expected = workload(seed, 12)
    hold = threading.Event()
    entered = threading.Event()
    results, threads = [], []
    armed = {"on": None}
    provider = {}

    class Files(statecore.files.StoreFiles):
        def write_atomic(self, name, write, overwrite=True, on_flushed=None):
            size = super().write_atomic(name, write, overwrite, on_flushed)
            if name == armed["on"]:
                armed["on"] = None
                time.sleep(0.2)  # the committing thread's merge is done by now

                def maintain():
                    try:
                        provider["p"].do_maintenance()
                        results.append("ok")
                    except BaseException as e:  # noqa: BLE001 - reported below
                        results.append(e)
                t = threading.Thread(target=maintain)
                t.start()
                deadline = time.monotonic() + 10
                while t.is_alive() and not entered.is_set() and time.monotonic() < deadline:
                    time.sleep(0.001)  # until it writes a snapshot or is done
                threads.append(t)
            return size

        def _writer(self, f, name):
            if name.endswith(".snapshot") and not entered.is_set():
                entered.set()
                hold.wait(10)  # until the test's commits below are done
            return f

    monkeypatch.setattr(statecore.files, "open_store_files", lambda loc, so=None, lc=None: Files(loc, so, lc))
    p = provider["p"] = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 3)
    armed["on"] = "4.delta"
    commit_workload(p, seed, 3, 4)  # maintenance runs inside this commit
    assert len(threads) == 1
    commit_workload(p, seed, 4, 7)  # meanwhile the task goes on
    hold.set()
    threads[0].join(10)
    assert results == ["ok"], results
    assert_files_whole(tmp_path)
    assert versions_on_disk(tmp_path)[1] <= {4}
    if entered.is_set():
        reader = SnapshotReader(os.path.join(store_dir(tmp_path), "4.snapshot"), KEY, VALUE)
        assert reader.row_count == len(expected[4])
        reader.close()
    for v in range(4, 8):
        assert_version(p, v, expected[v])
        assert_version(make(tmp_path), v, expected[v])
    commit_workload(p, seed, 7, 12, maintenance_every=2)
    for v in range(9, 13):
        assert_version(p, v, expected[v])
        assert_version(make(tmp_path), v, expected[v])


# -- damaged files -----------------------------------------------------------------------------
def replace_file(path, data):
    """Write ``data`` as a new file under ``path`` (a new inode: a mapping of the old file
    stays valid, as a torn or damaged file appears after a crash, not under a live reader)."""
    tmp = path + ".damage"
    Path(tmp).write_bytes(bytes(data))
    os.replace(tmp, path)


def delta_store(tmp_path, versions=6, seed=16):
    p = make(tmp_path, min_deltas_for_snapshot=100)
    commit_workload(p, seed, 0, versions)
    return workload(seed, versions)


def delta_offsets(size):
    # header, its lineage and checksum; the first block's header and payload; the trailer
    return sorted({0, 1, 8, 40, 50, 64, 71, 72, 80, 100, 104, 200, size // 2, size - 48, size - 20, size - 1})


@pytest.mark.parametrize("where", ["truncate", "flip"])
def test_damaged_delta_is_an_error_naming_it(tmp_path, where):
    expected = delta_store(tmp_path)
    path = os.path.join(store_dir(tmp_path), "4.delta")
    good = Path(path).read_bytes()
    assert len(good) > 300
    for offset in delta_offsets(len(good)):
        if where == "truncate":
            bad = good[:offset]
        else:
            bad = bytearray(good)
            bad[offset] ^= 0x5A
        replace_file(path, bad)
        with pytest.raises(StateCorruptionError, match="4.delta") as info:
            make(tmp_path).get_read_store(6)
        assert info.value.path.endswith("4.delta"), (offset, info.value)
        assert_version(make(tmp_path), 3, expected[3])  # versions before it are fine
    replace_file(path, good + b"\0")  # a byte too many
    with pytest.raises(StateCorruptionError, match="4.delta"):
        make(tmp_path).get_read_store(6)
    replace_file(path, good)
    assert_version(make(tmp_path), 6, expected[6])


def test_delta_of_another_version_is_an_error(tmp_path):
    delta_store(tmp_path)
    d = store_dir(tmp_path)
    replace_file(os.path.join(d, "4.delta"), Path(d, "5.delta").read_bytes())
    with pytest.raises(StateCorruptionError, match="4.delta"):
        make(tmp_path).get_read_store(6)


def snapshot_store(tmp_path, seed=17, n_keys=30_000, deltas_after=2):
    """A snapshot of version 2 holding n_keys keys (several data blocks), then more deltas."""
    p = make(tmp_path, min_deltas_for_snapshot=1)
    expected = {0: {}}
    state = {}
    rng = np.random.default_rng(seed)
    for v in range(2 + deltas_after):
        s = p.get_store(v)
        if v < 2:
            ks = np.arange(v * n_keys // 2, (v + 1) * n_keys // 2)
            vals = np.zeros(len(ks), VALUE)
            vals["count"] = ks
            vals["sum"] = rng.random(len(ks))
            s.put_batch(keys_of(ks), vals)
            state.update({int(k): (int(c), float(x)) for k, c, x in zip(ks, vals["count"], vals["sum"])})
        else:
            for k in rng.integers(0, n_keys, 5).tolist():
                s.put(k, (v, 0.5))
                state[k] = (v, 0.5)
            for k in rng.integers(0, n_keys, 5).tolist():
                s.remove(k)
                state.pop(k, None)
        assert s.commit() == v + 1
        expected[v + 1] = dict(state)
        if v == 1:
            p.do_maintenance()
            assert "2.snapshot" in names(tmp_path)
    p.close()
    return expected, os.path.join(store_dir(tmp_path), "2.snapshot")


def test_damaged_snapshot_data_is_found_by_the_lookup_that_touches_it(tmp_path):
    expected, path = snapshot_store(tmp_path)
    good = Path(path).read_bytes()
    # the rows start after the 4096-byte header; damage one byte in the second data block
    offset = 4096 + 65536 + 1000
    bad = bytearray(good)
    bad[offset] ^= 0xFF
    replace_file(path, bad)
    fresh = make(tmp_path)
    for version in (2, 4):
        store = fresh.get_read_store(version)  # opening checks only the header and footer
        want = expected[version]
        right = damaged = 0
        for k in range(0, 30_000, 7):
            try:
                got = store.get(k)
            except StateCorruptionError as e:
                assert "2.snapshot" in str(e)
                damaged += 1
                continue
            assert got == want.get(k), k  # never a wrong value
            right += 1
        assert damaged and right
        with pytest.raises(StateCorruptionError, match="2.snapshot"):
            store.get_batch(keys_of(np.arange(30_000)))
        with pytest.raises(StateCorruptionError, match="2.snapshot"):
            contents(store)


@pytest.mark.parametrize("damage", ["magic", "header", "schema-json", "header-checksum", "footer",
                                    "truncated", "half", "empty", "extended"])
def test_damaged_snapshot_header_falls_back_to_the_deltas(tmp_path, damage):
    expected, path = snapshot_store(tmp_path, n_keys=3000)
    good = Path(path).read_bytes()
    bad = bytearray(good)
    flip = {"magic": 0, "header": 48, "schema-json": 140, "header-checksum": 4090, "footer": len(good) - 60}
    if damage in flip:
        bad[flip[damage]] ^= 0x01
    elif damage == "truncated":
        bad = bad[:-1]
    elif damage == "half":
        bad = bad[:len(bad) // 2]
    elif damage == "empty":
        bad = b""
    else:
        bad += b"\0" * 64
    replace_file(path, bad)
    for version in (2, 3, 4):
        assert_version(make(tmp_path), version, expected[version])
    # with the deltas it would fall back to gone, the damage is the error
    os.remove(os.path.join(store_dir(tmp_path), "1.delta"))
    with pytest.raises(StateCorruptionError, match="2.snapshot"):
        make(tmp_path).get_read_store(4)


# -- maintenance racing the task ---------------------------------------------------------------
class OrchestratedFiles(statecore.files.StoreFiles):
    """StoreFiles whose hooks call ``hooks[point](name)`` (points: ``"listed"``, after a listing;
    ``"writer"``, before a write callback; ``"written"``, after a write_atomic), so a test can
    stop a thread at an exact point. A hook returning blocks that thread until it returns."""

    hooks = {}

    def list_versions(self):
        out = super().list_versions()
        hook = self.hooks.get("listed")
        if hook:
            hook(None)
        return out

    def _writer(self, f, name):
        hook = self.hooks.get("writer")
        if hook:
            hook(name)
        return f

    def write_atomic(self, name, write, overwrite=True, on_flushed=None):
        size = super().write_atomic(name, write, overwrite, on_flushed)
        hook = self.hooks.get("written")
        if hook:
            hook(name)
        return size


@pytest.fixture
def orchestrated(monkeypatch):
    OrchestratedFiles.hooks = {}
    monkeypatch.setattr(statecore.files, "open_store_files",
                        lambda loc, so=None, lc=None: OrchestratedFiles(loc, so, lc))
    yield OrchestratedFiles.hooks
    OrchestratedFiles.hooks = {}


def run_thread(target):
    out = []

    def body():
        try:
            out.append(target())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=body, name="test-racer")
    t.start()
    return t, out


def re_execute_while_maintenance_snapshots(tmp_path, hooks, seed, **conf):
    """Versions 1..4 committed; then maintenance lists the files (the newest is 4); batch 4
    is re-executed from 3, whose commit records the re-commit; maintenance then freezes the
    old run's 4 and writes its snapshot while that commit finishes. Returns the provider,
    the new run's version 4, and maintenance's result."""
    p = make(tmp_path, min_deltas_for_snapshot=1, **conf)
    commit_workload(p, seed, 0, 4)
    new4 = {**workload(seed, 3)[3], -1: (-1, -1.0)}
    listed, go_freeze, snapshot_writing, commit_done = (threading.Event() for _ in range(4))

    def on_listed(_):
        if threading.current_thread().name == "test-racer" and not listed.is_set():
            listed.set()
            go_freeze.wait(10)  # maintenance goes on only once the re-commit was recorded

    def on_writer(name):
        if name == "4.delta" and listed.is_set() and not go_freeze.is_set():
            go_freeze.set()
            snapshot_writing.wait(10)  # the delta lands after maintenance froze the old 4
        elif name == "4.snapshot" and not snapshot_writing.is_set():
            snapshot_writing.set()
            commit_done.wait(10)  # the snapshot is finished after the commit returned

    hooks.update(listed=on_listed, writer=on_writer)
    thread, result = run_thread(p.do_maintenance)
    assert listed.wait(10)
    s = p.get_store(3)
    s.put(-1, (-1, -1.0))
    assert s.commit() == 4
    s.abort()
    commit_done.set()
    thread.join(10)
    hooks.clear()
    assert snapshot_writing.is_set()  # the interleaving happened as intended
    return p, new4, result


def test_snapshot_of_the_abandoned_run_never_becomes_the_new_runs_base(tmp_path, orchestrated):
    """The old run's snapshot of 4 must not be swapped in under the new run's state:
    version 4 read through the provider must be the new run's."""
    p, new4, _ = re_execute_while_maintenance_snapshots(tmp_path, orchestrated, seed=18, min_versions_to_retain=3)
    assert_version(make(tmp_path), 4, new4)  # the files are right (lineage check)
    assert_version(p, 4, new4)  # and so must be the provider's memory
    commit(p, 4, [(-2, (-2, -2.0))])
    assert_version(p, 5, {**new4, -2: (-2, -2.0)})


def test_snapshot_of_the_abandoned_run_is_no_base_for_cleanup(tmp_path, orchestrated):
    """The same interleaving, then one more commit and maintenance pass (retention 1): the
    old run's snapshot of 4 must not be taken as the base that lets cleanup delete older
    files, or the new run's versions 4 and 5 (retained) can no longer be loaded."""
    p, new4, _ = re_execute_while_maintenance_snapshots(tmp_path, orchestrated, seed=18, min_versions_to_retain=1)
    q = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=1)  # a restarted query
    assert_version(q, 4, new4)
    assert commit(q, 4, [(-2, (-2, -2.0))]) == 5
    q.do_maintenance()
    assert_version(make(tmp_path), 5, {**new4, -2: (-2, -2.0)})
    assert_version(make(tmp_path), 4, new4)


def test_maintenance_whose_snapshot_a_re_commit_deleted(tmp_path, orchestrated):
    """Maintenance renamed the snapshot of version 4 into place; before it maps it, batch 4
    is re-executed and its commit deletes that snapshot of the abandoned run. Maintenance
    must not fail for that (the registry would unload the provider)."""
    seed = 19
    expected = workload(seed, 4)
    p = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 4)
    renamed, commit_done = threading.Event(), threading.Event()

    def on_written(name):
        if name == "4.snapshot" and not renamed.is_set():
            renamed.set()
            commit_done.wait(10)

    orchestrated.update(written=on_written)
    thread, result = run_thread(p.do_maintenance)
    assert renamed.wait(10)
    assert commit(p, 3, [(-1, (-1, -1.0))]) == 4
    commit_done.set()
    thread.join(10)
    orchestrated.clear()
    new4 = {**expected[3], -1: (-1, -1.0)}
    assert_version(p, 4, new4)
    assert_version(make(tmp_path), 4, new4)
    assert result == [None], result


def test_load_racing_another_instances_cleanup(tmp_path, orchestrated):
    """A new provider instance (a restarted query) lists the files to load version 6 while
    the old instance still runs a last maintenance pass whose cleanup deletes the files the
    load picked (a newer snapshot now covers them). Version 6 is within the retention: the
    load must still succeed, and exactly."""
    seed = 20
    expected = workload(seed, 7)
    old = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=1)
    commit_workload(old, seed, 0, 3)
    old.do_maintenance()
    commit_workload(old, seed, 3, 6)
    assert versions_on_disk(tmp_path)[1] == {3}
    new = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=1)
    listed, cleaned = threading.Event(), threading.Event()

    def on_listed(_):
        if threading.current_thread().name == "test-racer" and not listed.is_set():
            listed.set()
            cleaned.wait(10)

    orchestrated.update(listed=on_listed)
    thread, result = run_thread(lambda: contents(new.get_read_store(6)))
    assert listed.wait(10)
    old.do_maintenance()  # snapshot 6
    commit_workload(old, seed, 6, 7)
    old.do_maintenance()  # newest 7, retain 1: everything older than 6.snapshot goes
    assert 3 not in versions_on_disk(tmp_path)[1]
    cleaned.set()
    thread.join(10)
    orchestrated.clear()
    assert result == [expected[6]], result


def test_maintenance_deletes_the_temporary_files_a_killed_writer_left(tmp_path):
    p = make(tmp_path, min_deltas_for_snapshot=100)
    commit(p, 0, [(1, (1, 1.0))])
    directory = store_dir(tmp_path)
    old = os.path.join(directory, ".2.delta." + "0f" * 16 + ".tmp")
    young = os.path.join(directory, ".2.snapshot." + "1e" * 16 + ".tmp")
    for path in (old, young):
        with open(path, "wb") as f:
            f.write(b"half a file")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    p.do_maintenance()
    assert not os.path.exists(old)
    assert os.path.exists(young)  # it may belong to a writer still at work
    assert_version(make(tmp_path), 1, {1: (1, 1.0)})


def test_a_version_re_committed_by_another_process_is_not_served_from_memory(tmp_path):
    """Worker processes come and go: one holds version 2 in memory while another, after
    re-executing batch 2 from version 1, committed a different version 2. The first must
    not serve (or build on) its own, abandoned, version 2."""
    first = make(tmp_path)
    commit(first, 0, [(1, (1, 1.0))])
    commit(first, 1, [(2, (2, 2.0))])
    assert_version(first, 2, {1: (1, 1.0), 2: (2, 2.0)})  # held in memory
    second = make(tmp_path)  # another process
    commit(second, 1, [(3, (3, 3.0))])  # batch 2 re-executed there
    assert_version(first, 2, {1: (1, 1.0), 3: (3, 3.0)})
    commit(first, 2, [(4, (4, 4.0))])
    assert_version(make(tmp_path), 3, {1: (1, 1.0), 3: (3, 3.0), 4: (4, 4.0)})

