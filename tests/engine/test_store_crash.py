"""Crash safety of the file provider: processes killed at random instants and at pinned
points, injected I/O faults, and damaged files.

Version files are named by version and commit id (``<v>_<16 hex>.delta`` / ``.snapshot``,
or ``<v>.delta`` of the old layout); several attempts of one version may coexist, and a
load follows a chain of ids, from a named attempt or from the default lineage (the newest
version with a delta; among its attempts, the one renamed last). A commit encodes and
fsyncs its delta under a temporary name on a second thread while it merges into memory,
renames it only once the merge succeeded, and then (a re-execution) deletes the files of
later versions it saw when its store opened (docs/provider-rules.md).

Kill tests: a worker process (tests/crash_worker.py) commits a deterministic workload and
records each version after its commit returned. After a SIGKILL, the last recorded version
L must load exactly (compared with a model replayed here from the same batches), version
L+1 must be absent or exact (the kill landed between the rename and the record), nothing
above it may exist, every state file in the directory must be whole and agree with its
name, and a new worker continues from L or L+1 (restart after crash; from L it re-executes
L+1), to be killed again. Kills land at random instants and at every step of the commit
order (write and fsync on the writer thread, merge, rename, supersede, record).

Then: I/O faults injected at every step of a commit (its delta's write, flush, fsync and
rename, the directory fsync, the listings and deletes after the rename, the merge itself),
of maintenance's snapshot write, and of cleanup's deletes (statecore.faults.FaultInjectingFiles);
damaged deltas and snapshots; names of the old layout; directories named like version files;
and maintenance interleaved with the task at exact points (a re-executed batch, a load, a
commit between its merge and its return), each pinned by hooks in the store's files.
"""
import collections
import errno
import fnmatch
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
import statecore.commit
from statecore._versions import FrozenView
from state_files import list_names, version_names, version_path
from tests.paths import REPO_ROOT, TESTS_DIR
from tests.store_support import commit_batch, contents, inject_faulty_files, store_dir
from statecore import (DeltaReader, SnapshotReader, StateCorruptionError, StateStoreConf, StateStoreId,
                       StateStoreProviderId, VersionNotFoundError, create_and_init_provider, registry)
from statecore.faults import FaultInjectingFiles
from statecore.files import StoreFiles
from statecore.lineage import parse_name
from statecore.snapshot_files import check_snapshot, open_snapshot

REPO = REPO_ROOT
WORKER = str(TESTS_DIR / "crash_worker.py")
KEY, VALUE = cw.KEY, cw.VALUE
ID = r"[0-9a-f]{16}"


# -- helpers ---------------------------------------------------------------------------------
def make(root, **conf):
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(**conf))


def names(root):
    return sorted(list_names(store_dir(root)))


def tmp_files(root):
    return [n for n in names(root) if n.endswith(".tmp")]


def listing(root):
    """The version files of the store directory, as the store lists them."""
    return StoreFiles(store_dir(root)).list_versions()


def versions_on_disk(root):
    files = listing(root)
    return set(files.versions("delta")), set(files.versions("snapshot"))


def attempts(root, version, kind="delta"):
    """The names of the ``kind`` files of every attempt of ``version``."""
    return sorted(f.name for f in listing(root).of(kind, version))


def id_of(name):
    return parse_name(name).commit_id.hex()


def fault_message(step, version, kind="delta"):
    return rf"^injected fault at {step} of {version}_{ID}\.{kind}$"


def keys_of(ks):
    out = np.zeros(len(ks), KEY)
    out["k"] = ks
    return out


ALL_KEYS = keys_of(np.arange(-1, cw.KEY_SPACE + 1))


def assert_version(provider, version, expected, commit_id=None):
    """``version`` (the default lineage's, or attempt ``commit_id``) read through ``provider``
    is exactly ``expected`` ({key: (count, sum)}), by every read path."""
    store = provider.get_read_store(version, commit_id)
    try:
        if commit_id is not None:
            assert store.base_commit_id == commit_id
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


def assert_versions(provider, root, versions, expected):
    """Each of ``versions`` reads ``expected[v]`` through ``provider``, then through a fresh
    provider on ``root``."""
    for v in versions:
        assert_version(provider, v, expected[v])
        assert_version(make(root), v, expected[v])


def default_id(provider, version):
    """The commit id (hex) of ``version`` on the default lineage."""
    store = provider.get_read_store(version)
    try:
        return store.base_commit_id
    finally:
        store.abort()


def assert_files_whole(root):
    """Every delta and snapshot in the directory reads back whole (checksums, trailer) and
    its header agrees with its name (version, and commit id where the name has one);
    temporary files are ignored, as the store ignores them."""
    d = store_dir(root)
    for f in listing(root):
        path = os.path.join(d, f.name)
        if f.kind == "delta":
            reader = DeltaReader(StoreFiles(d).read_bytes(f.name), KEY, VALUE, path=path)
            list(reader)  # every block, to the trailer
            version, commit_id = reader.store_version, reader.commit_id
        else:
            header = check_snapshot(StoreFiles(d), f.name, KEY, VALUE, deep=True)  # packed or an image
            version, commit_id = header.store_version, header.commit_id
        assert version == f.version, f.name
        assert f.commit_id is None or commit_id == f.commit_id, f.name


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


# Points where a test may stop a thread: HOOKS[point](name) is called there (a hook that
# blocks holds that thread). "merge"/"merged" run inside the provider's lock: a hook there
# must not wait for anything that takes it (a maintenance pass, a lookup).
HOOKS = {}


class HookedFiles(FaultInjectingFiles):
    """FaultInjectingFiles whose operations call HOOKS: ``"listed"`` (after a listing, name
    None), ``"writer"`` (before a write callback), ``"wrote"`` (after each write of the
    callback's bytes), each step (``"flush"``, ``"fsync"``,
    ``"rename"``, ``"delete"``, ``"read"``: before it), ``"fired"`` (an injected fault fires),
    ``"pending"`` (write_pending returned: durable under its temporary name),
    ``"published"`` (renamed into place, its directory fsynced) and ``"written"``
    (write_atomic returned)."""

    def _hook(self, point, name):
        hook = HOOKS.get(point)
        if hook is not None:
            hook(name)

    def list_versions(self):
        out = super().list_versions()
        self._hook("listed", None)
        return out

    def _writer(self, f, name):
        self._hook("writer", name)
        return _ToldWriter(super()._writer(f, name), self, name)

    def _step(self, step, name):
        self._hook(step, name)
        super()._step(step, name)

    def _fire(self, step, name):
        self._hook("fired", name)
        super()._fire(step, name)

    def write_pending(self, name, write, on_flushed=None):
        pending = super().write_pending(name, write, on_flushed=on_flushed)
        self._hook("pending", name)
        return pending

    def _publish(self, pending, overwrite):
        size = super()._publish(pending, overwrite)
        self._hook("published", pending.name)
        return size

    def write_atomic(self, name, write, overwrite=True, on_flushed=None):
        size = super().write_atomic(name, write, overwrite, on_flushed)
        self._hook("written", name)
        return size


class _ToldWriter:
    """A writable file that calls the ``"wrote"`` hook after each write."""

    def __init__(self, f, files, name):
        self._f, self._files, self._name = f, files, name

    def write(self, data):
        n = self._f.write(data)
        self._files._hook("wrote", self._name)
        return n


@pytest.fixture
def faulty(monkeypatch):
    """Every provider created in the test gets a HookedFiles (a FaultInjectingFiles); the
    list holds them. The merge of every commit calls HOOKS["merge"] and HOOKS["merged"]."""
    HOOKS.clear()
    made = inject_faulty_files(monkeypatch, HookedFiles)
    merge = statecore.commit.merge_update

    def hooked_merge(self, *args, **kwargs):
        hook = HOOKS.get("merge")
        if hook is not None:
            hook(None)
        out = merge(self, *args, **kwargs)
        hook = HOOKS.get("merged")
        if hook is not None:
            hook(None)
        return out

    monkeypatch.setattr(statecore.commit, "merge_update", hooked_merge)
    yield made
    HOOKS.clear()


@pytest.fixture
def hooks(faulty):
    return HOOKS


@pytest.fixture
def failing_dir_fsync(monkeypatch):
    """``arm(path)``: the next fsync of directory ``path`` raises EIO (after the rename it
    makes durable). Returns the list of the paths whose fsync failed."""
    armed, failed = [], []
    real = statecore.files._fsync_dir

    def fsync_dir(path):
        if armed and os.path.abspath(path) == armed[0]:
            armed.clear()
            failed.append(path)
            raise OSError(errno.EIO, "injected directory fsync failure", path)
        return real(path)

    monkeypatch.setattr(statecore.files, "_fsync_dir", fsync_dir)

    def arm(path):
        armed[:] = [os.path.abspath(path)]

    arm.failed = failed
    return arm


@pytest.fixture
def clean_registry():
    registry.stop()
    yield
    registry.stop()


def run_thread(target, name="test-racer"):
    out = []

    def body():
        try:
            out.append(target())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=body, name=name)
    t.start()
    return t, out


# -- kill tests --------------------------------------------------------------------------------
BEFORE_RENAME = "kills before a rename (a temporary file left)"
AFTER_RENAME = "kills after the rename, before the record"
RE_EXECUTIONS = "re-executions (restart from L with L+1 on disk)"
BETWEEN = "kills between a re-execution's rename and its deletes (two attempts on disk)"
CASES = ("versions", "snapshots", BEFORE_RENAME, AFTER_RENAME, RE_EXECUTIONS, BETWEEN)


class CrashRun:
    """One store directory written by successive worker processes, each killed, and the
    model of what it must hold."""

    def __init__(self, tmp_path, seed, mode, root=None):
        self.tmp = tmp_path
        self.root = root or str(tmp_path / "state")  # a URL: the workers reach it by the environment
        self.seed, self.mode = seed, mode
        self.rng = np.random.default_rng(seed)
        self.start = 0  # the version the next worker starts from
        self.model_version, self.model = 0, {}
        self.recent = {0: {}}  # a few versions below model_version
        self.rounds = 0
        self.before = set()  # the directory's names when the last worker started
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
        self.before = set(names(self.root))
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

    def kill_round(self, delay, from_spawn=False, restart=None):
        """Start a worker from ``self.start``, SIGKILL it ``delay`` seconds after it is ready
        (or after it was spawned): a random instant, not a synchronisation. Then check."""
        proc = self.spawn()
        if not from_spawn:
            self.wait_ready(proc)
        time.sleep(delay)
        assert proc.poll() is None, f"worker exited by itself ({proc.returncode}): {self.stderr()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, self.stderr()
        return self.check(restart)

    def die_round(self, spec, restart=None, timeout=60):
        """Start a worker that SIGKILLs itself at the point ``spec`` names; then check."""
        self.kill_at(spec, timeout)
        self.stats[kill_label(spec)] += 1  # it died there: it kills itself nowhere else
        return self.check(restart)

    def kill_at(self, spec, timeout=60):
        proc = self.spawn(die=spec)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"the worker never reached {spec}: {self.stderr()}")
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, f"{proc.returncode}: {self.stderr()}"

    def recorded(self):
        raw = Path(self.side).read_bytes() if os.path.exists(self.side) else b""
        lines = raw.split(b"\n")
        complete = [int(x) for x in lines[:-1]]  # a last line without its newline was torn
        assert complete == list(range(self.start + 1, self.start + 1 + len(complete))), complete
        return complete[-1] if complete else self.start

    def new_names(self):
        return set(names(self.root)) - self.before

    def check(self, restart=None):
        """Check the directory after a kill and choose where the next worker starts:
        ``restart`` "continue" (from L+1 when it is there), "re-execute" (from L), or None
        (either, by the seeded generator)."""
        last = self.recorded()
        self.stats["versions"] += last - self.start
        assert_files_whole(self.root)
        on_disk = listing(self.root)
        assert on_disk.top <= last + 1, (last, sorted(on_disk.names))
        self.stats["snapshots"] += len(on_disk.versions("snapshot"))
        new = self.new_names()
        if any(n.endswith(".tmp") for n in new):
            self.stats[BEFORE_RENAME] += 1
        self.advance(last)
        assert_version(make(self.root, **cw.conf_kwargs()), last, self.model)
        following = dict(self.model)
        cw.apply_to_dict(following, cw.batch(self.seed, last + 1))
        fresh = make(self.root, **cw.conf_kwargs())
        try:
            assert_version(fresh, last + 1, following)
            next_exists = True
            self.stats[AFTER_RENAME] += 1
        except VersionNotFoundError:
            next_exists = False
        with pytest.raises(VersionNotFoundError):
            fresh.get_read_store(last + 2)
        tries = list(on_disk.of("delta", last + 1))
        if len(tries) > 1:
            # Several attempts of L+1 on disk: a re-execution was killed after renaming its
            # delta and before deleting the abandoned attempt(s). Each is a whole version
            # (the same batch); the default follows the one renamed last, this worker's.
            for f in tries:
                assert_version(fresh, last + 1, following, commit_id=f.commit_id.hex())
            mine = [f for f in tries if f.name in new]
            if len(mine) == 1:
                assert default_id(fresh, last + 1) == mine[0].commit_id.hex(), (tries, mine)
                self.stats[BETWEEN] += 1
            else:
                assert default_id(fresh, last + 1) in {f.commit_id.hex() for f in tries}
        # the versions retention keeps load too
        newest = last + 1 if next_exists else last
        for v in range(max(1, newest - cw.MIN_VERSIONS_TO_RETAIN), last):
            if v in self.recent:
                assert_version(make(self.root, **cw.conf_kwargs()), v, self.recent[v])
        if restart is None:
            restart = "re-execute" if self.rng.random() < 0.5 else "continue"
        if next_exists and restart == "continue":
            self.advance(last + 1)
            self.start = last + 1
        else:
            self.start = last  # from L: re-executes L+1 if it is there
            if next_exists:
                self.stats[RE_EXECUTIONS] += 1
        return last, next_exists


def kill_label(spec):
    """The counter of the kills at ``spec``'s step: "killed at rename of a delta", ..."""
    step, pattern = spec.split(":")[:2]
    kind = next((k for k in ("delta", "snapshot", "schema") if k in pattern), None)
    return f"killed at {step}" + (f" of a {kind}" if kind else "")


def die_specs(rng):
    """One kill at each step of a commit (and of maintenance), at a random occurrence."""
    def n():
        return int(rng.integers(1, 25))

    return [
        f"write:*.delta:{n()}:{int(rng.integers(0, 200))}",  # on the writer thread, while it merges
        f"fsync:*.delta:{n()}",  # whole, not durable
        f"merged:*:{n()}",  # merged; the delta maybe still being written
        f"rename:*.delta:{n()}",  # durable and merged, not renamed
        f"published:*.delta:{n()}",  # renamed, the commit not returned
        f"recorded:*:{n()}",  # returned, not recorded
        f"write:*.snapshot:{n()}:{int(rng.integers(0, 9000))}",
        f"delete:*:{n()}",
    ]


def kill_plan(rng, delays, dies):
    """Rounds (kind, argument, restart) in a seeded order: timed kills, kills at pinned steps,
    and a re-execution killed between its rename and its deletes (a kill after the rename
    makes L+1 exist; the restart re-executes it and dies right after renaming its own)."""
    rounds = [("timed", float(d), None) for d in delays] + [("die", spec, None) for spec in dies]
    rounds = [rounds[i] for i in rng.permutation(len(rounds))]
    at = int(rng.integers(0, len(rounds) + 1))
    rounds[at:at] = [("die", f"published:*.delta:{int(rng.integers(1, 10))}", "re-execute"),
                     ("die", "published:*.delta:1", None)]
    return rounds


def play(run, rounds):
    first_timed = True
    for kind, arg, restart in rounds:
        if kind == "timed":
            run.kill_round(arg, from_spawn=first_timed, restart=restart)  # one kill lands while it starts up
            first_timed = False
        else:
            run.die_round(arg, restart=restart)


def test_random_kills_and_restarts(tmp_path):
    run = CrashRun(tmp_path, seed=11, mode="plain")
    rng = np.random.default_rng(2024)
    delays = [0.0, 0.002, *rng.uniform(0.0, 0.8, 5), 1.0]
    dies = die_specs(rng)
    play(run, kill_plan(rng, delays, dies))
    assert run.start > 100, run.stats  # the workload went on across the restarts
    # each interesting case happened, and a kill at each step of the commit order
    for case in CASES + tuple(kill_label(spec) for spec in dies):
        assert run.stats[case] > 0, (case, run.stats)


def test_random_kills_with_the_registry_maintenance_thread(tmp_path, clean_registry):
    """Snapshots and cleanup run on the registry's thread, concurrently with commits, so
    kills land in the middle of them."""
    run = CrashRun(tmp_path, seed=12, mode="registry")
    rng = np.random.default_rng(7)
    delays = [*rng.uniform(0.1, 0.9, 4), 0.01]
    dies = [f"write:*.snapshot:{int(rng.integers(1, 8))}:{int(rng.integers(0, 9000))}",
            f"published:*.snapshot:{int(rng.integers(1, 8))}",  # renamed, not yet the base
            f"delete:*:{int(rng.integers(1, 10))}",
            f"rename:*.delta:{int(rng.integers(1, 20))}",
            f"merged:*:{int(rng.integers(1, 20))}"]
    play(run, kill_plan(rng, delays, dies))
    assert run.start > 50, run.stats
    for case in CASES + tuple(kill_label(spec) for spec in dies):
        assert run.stats[case] > 0, (case, run.stats)


# (die spec for crash_worker.py, where the first worker dies, whether version L+1 is there)
PINNED = [
    ("write:_statecore.schema.json:1:0", "the schema file of the first commit, torn", False),
    ("write:1_*.delta:1:0", "the first delta, empty, while the merge runs", False),
    ("merged:*:1", "the first commit merged, its delta maybe not written", False),
    ("rename:1_*.delta:1", "the first delta, durable and merged, not renamed", False),
    ("published:1_*.delta:1", "the first delta renamed, the commit not returned", True),
    ("recorded:*:1", "the first commit returned, not recorded", True),
    ("write:*.delta:5:0", "a delta's temporary file, empty", False),
    ("write:*.delta:5:100", "a delta, torn inside its first block", False),
    ("flush:*.delta:6", "a delta written, not flushed", False),
    ("fsync:*.delta:7", "a delta, before its fsync", False),
    ("merged:*:7", "a commit merged, its delta in flight", False),
    ("rename:*.delta:8", "a delta, durable and merged, not renamed", False),
    ("published:*.delta:8", "a delta renamed, the commit not returned", True),
    ("recorded:*:9", "a commit returned, not recorded", True),
    ("write:*.snapshot:1:5000", "a snapshot, torn in its rows", None),
    ("fsync:*.snapshot:1", "a snapshot mapped and verified, not durable", None),
    ("rename:*.snapshot:2", "a snapshot, whole but not renamed", None),
    ("published:*.snapshot:2", "a snapshot renamed, not yet the base", None),
    ("delete:*:1", "cleanup, before its first delete", None),
    ("delete:*:3", "cleanup, after two deletes", None),
]


@pytest.mark.parametrize("spec,next_there", [(p[0], p[2]) for p in PINNED], ids=[p[1] for p in PINNED])
def test_kill_at_pinned_points(tmp_path, spec, next_there):
    run = CrashRun(tmp_path, seed=21, mode="plain")
    step = spec.split(":")[0]
    last, next_exists = run.die_round(spec, restart="continue")
    if next_there is not None:
        assert next_exists == next_there, (last, sorted(listing(run.root).names))
    temporaries = [n for n in run.new_names() if n.endswith(".tmp")]
    if step in ("write", "flush", "fsync", "rename") and "delta" in spec:
        # the kill left the delta's temporary file (not a version: it is ignored)
        assert [n for n in temporaries if fnmatch.fnmatch(n, f".{last + 1}_*.delta.*.tmp")], temporaries
    elif step in ("published", "recorded", "delete"):
        assert temporaries == []  # the rename was done, or no file was being written
    # restarted: the next worker dies right after a commit, before recording it, which
    # also makes the version after that be re-executed (or continued) by the third one
    run.die_round("recorded:*:3")
    run.die_round("recorded:*:2")
    assert run.model_version >= last + 2


# The pinned kills on S3 (a representative subset of PINNED: a delta torn, one whole and
# merged but not uploaded, one uploaded with the commit not returned, a snapshot torn, cleanup
# before its first delete); each worker reaches the local S3 server through the environment.
ON_S3 = ["write:*.delta:5:100", "rename:*.delta:8", "published:*.delta:8", "write:*.snapshot:1:5000",
         "delete:*:1"]


@pytest.mark.parametrize("spec,next_there", [(p[0], p[2]) for p in PINNED if p[0] in ON_S3],
                         ids=[p[1] for p in PINNED if p[0] in ON_S3])
def test_kill_at_pinned_points_on_s3(tmp_path, s3_env, spec, next_there):
    """test_kill_at_pinned_points with the checkpoint in a bucket: a process killed at each
    step leaves no object but whole versions (no temporary object ever: a version is one
    upload under its own name), and the next workers go on from it."""
    run = CrashRun(tmp_path, seed=21, mode="plain", root=s3_env + "/state")
    last, next_exists = run.die_round(spec, restart="continue")
    if next_there is not None:
        assert next_exists == next_there, (last, sorted(listing(run.root).names))
    assert [n for n in names(run.root) if n.endswith(".tmp")] == []
    run.die_round("recorded:*:3")
    run.die_round("recorded:*:2")
    assert run.model_version >= last + 2


def test_random_kills_and_restarts_on_s3(tmp_path, s3_env):
    """test_random_kills_and_restarts' checks after SIGKILLs at seeded random instants, on
    S3 (six timed kills and a re-execution killed between its upload and its deletes)."""
    run = CrashRun(tmp_path, seed=13, mode="plain", root=s3_env + "/state")
    rng = np.random.default_rng(36)
    rounds = [("timed", float(d), None) for d in [0.0, *rng.uniform(0.1, 0.9, 5)]]
    rounds.append(("die", "published:*.delta:2", "re-execute"))
    rounds.append(("die", "published:*.delta:1", None))
    play(run, rounds)
    assert run.start > 10 and run.stats["versions"] > 0, run.stats
    assert run.stats[RE_EXECUTIONS] > 0 and run.stats[BETWEEN] > 0, run.stats


# (die spec for the worker that re-executes version 5 from 4, attempts of 5 left on disk)
RE_EXECUTION_KILLS = [
    ("published:*.delta:1", 2, "renamed, before it deletes the abandoned attempt"),
    ("delete:*.delta:1", 2, "at its delete of the abandoned attempt"),
    ("recorded:*:1", 1, "the abandoned attempt deleted, the commit not recorded"),
]


@pytest.mark.parametrize("spec,n_attempts", [k[:2] for k in RE_EXECUTION_KILLS],
                         ids=[k[2] for k in RE_EXECUTION_KILLS])
def test_kill_in_a_re_execution(tmp_path, spec, n_attempts):
    """The worker commits 5 and dies before recording it; the next re-executes 5 from 4 (an
    attempt of 5 is on disk) and dies at a step of its commit. The attempts left are whole
    versions, the default is the re-execution's once it is renamed, and work goes on."""
    run = CrashRun(tmp_path, seed=22, mode="plain")
    assert run.die_round("recorded:*:5", restart="re-execute") == (4, True)
    assert run.start == 4 and run.stats[RE_EXECUTIONS] == 1
    [abandoned] = attempts(run.root, 5)
    assert run.die_round(spec, restart="re-execute") == (4, True)
    left = attempts(run.root, 5)
    assert len(left) == n_attempts and (abandoned in left) == (n_attempts == 2), left
    [mine] = [n for n in left if n != abandoned]
    assert default_id(make(run.root), 5) == id_of(mine)
    assert run.stats[BETWEEN] == (n_attempts == 2)
    # the next worker re-executes 5 once more (deleting every attempt it saw), then goes on
    run.die_round("recorded:*:3")
    assert attempts(run.root, 5) != left and len(attempts(run.root, 5)) == 1
    run.die_round("recorded:*:2")
    assert run.model_version >= 7


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
def test_kill_in_a_deep_re_executions_deletes_leaves_a_loadable_lineage(tmp_path, nth):
    """Versions 1..8 committed; a worker re-executes batch 5 from version 4: once its own
    delta of 5 is renamed it deletes the abandoned run's 5..8, and is killed at the nth of
    those deletes. Whatever is left must be a loadable default lineage (the abandoned run's,
    as though the re-execution had not run, or the re-execution's): version 4, which both
    share, loads, and so does every version of the default lineage; a restart from 4 works."""
    seed = 23
    expected = workload(seed, 8)
    run = CrashRun(tmp_path, seed, "plain")
    commit_workload(make(run.root, **cw.conf_kwargs()), seed, 0, 8)
    run.start = 4
    run.kill_at(f"delete:*.delta:{nth}")
    assert run.recorded() == 4
    [mine] = [n for n in run.new_names() if fnmatch.fnmatch(n, "5_*.delta")]  # renamed before the kill
    assert len(run.before - set(names(run.root))) == nth - 1  # killed before the nth delete
    assert_files_whole(run.root)
    fresh = make(run.root)
    for v in range(5):
        assert_version(fresh, v, expected[v])
    top = max(listing(run.root).versions("delta"))
    for v in range(5, top + 1):  # the default lineage, wherever it ends, loads whole
        assert_version(make(run.root), v, expected[v])
    run.die_round("recorded:*:2", restart="continue")  # a restart from 4 (re-executes 5 again)
    assert run.model_version >= 5


# -- injected faults at commit -----------------------------------------------------------------
STEPS = [("write", 0), ("write", 150), ("flush", 0), ("fsync", 0), ("rename", 0)]
# The delta's header and blocks are written on the commit's writer thread while the merge
# runs, its trailer (which records the merged version's key count), flush, fsync and rename
# after the merge: a fault in the header fires before the merge (the merge then runs, and is
# undone), or any fault after it.
FAULT_CASES = [(step, after_bytes, order) for step, after_bytes in STEPS for order in ("fault-first", "merge-first")
               if order == "merge-first" or (step, after_bytes) == ("write", 0)]


@pytest.mark.parametrize("step,after_bytes,order", FAULT_CASES,
                         ids=[f"{s}{b or ''}-{o}" for s, b, o in FAULT_CASES])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("over_snapshot", [False, True], ids=["deltas", "over-snapshot"])
def test_failed_commit_changes_nothing(tmp_path, faulty, hooks, step, after_bytes, order, k, over_snapshot):
    seed = 5
    expected = workload(seed, 9)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3, max_versions_to_retain_in_memory=k)
    files = faulty[-1]
    commit_workload(p, seed, 0, 6, maintenance_every=3 if over_snapshot else None)
    reader = p.get_read_store(6)  # an open reader of the version the failed commit builds on
    files.arm(step, "7_*.delta", after_bytes=after_bytes)
    seen, fired, merged = [], threading.Event(), threading.Event()

    def on_fired(name):
        seen.append("fault")
        fired.set()

    def on_merge(_):
        if order == "fault-first":
            assert fired.wait(10)  # the writer thread takes no provider lock: waiting here is safe

    def on_merged(_):
        seen.append("merged")
        merged.set()

    def on_writer(name):
        if order == "merge-first" and fnmatch.fnmatch(name, "7_*.delta"):
            assert merged.wait(10)

    hooks.update(fired=on_fired, merge=on_merge, merged=on_merged, writer=on_writer)
    s = p.get_store(6)
    cw.apply_to_store(s, cw.batch(seed, 7))
    with pytest.raises(OSError, match=fault_message(step, 7)):
        s.commit()
    hooks.clear()
    assert seen == (["fault", "merged"] if order == "fault-first" else ["merged", "fault"])
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
    assert_versions(p, tmp_path, (7, 8, 9), expected)
    assert tmp_files(tmp_path) == []


@pytest.mark.parametrize("step", ["write", "flush", "fsync", "rename", "directory-fsync", "listing"])
def test_failed_commit_can_be_retried_by_the_same_store(tmp_path, faulty, hooks, failing_dir_fsync, step):
    """A fault at any step of the commit, including after its delta was renamed into place
    (the directory's fsync, the listing that checks for newer attempts): the commit raises,
    its delta is not visible (deleted again if it was renamed), and the same store's next
    commit() succeeds."""
    seed = 6
    expected = workload(seed, 4)
    p = make(tmp_path)
    commit_workload(p, seed, 0, 3)
    renamed = []

    def on_published(name):
        if fnmatch.fnmatch(name, "4_*.delta"):
            renamed.append(name)

    def on_listed(_):
        if step == "listing" and len(renamed) == 1:
            renamed.append("listing failed")
            raise OSError(errno.EIO, "injected listing failure")

    def on_rename(name):
        if step == "directory-fsync" and fnmatch.fnmatch(name, "4_*.delta") and not renamed:
            failing_dir_fsync(store_dir(tmp_path))

    hooks.update(published=on_published, listed=on_listed, rename=on_rename)
    if step in ("write", "flush", "fsync", "rename"):
        faulty[-1].arm(step, "4_*.delta")
    s = p.get_store(3)
    cw.apply_to_store(s, cw.batch(seed, 4))
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert not s.has_committed
    if step == "directory-fsync":
        assert failing_dir_fsync.failed == [store_dir(tmp_path)]  # after the rename
    if step == "listing":
        assert len(renamed) == 2  # the listing after the rename failed
    assert 4 not in versions_on_disk(tmp_path)[0] and tmp_files(tmp_path) == []
    with pytest.raises(VersionNotFoundError):
        make(tmp_path).get_read_store(4)
    hooks.clear()
    assert s.commit() == 4 and s.has_committed
    assert s.metrics.num_keys == len(expected[4])
    assert_version(p, 4, expected[4])
    assert_version(make(tmp_path), 4, expected[4])
    assert tmp_files(tmp_path) == [] and len(attempts(tmp_path, 4)) == 1


def test_the_deltas_trailer_waits_for_the_merge_and_records_its_key_count(tmp_path, faulty, hooks):
    """A commit's delta is made durable only after the merge, and its trailer records the
    key count the merge found: what a roll forward in another worker takes as that
    version's count instead of looking every key up."""
    seed = 27
    expected = workload(seed, 4)
    p = make(tmp_path)
    commit_workload(p, seed, 0, 3)
    seen = []
    hooks.update(merged=lambda _: seen.append("merged"),
                 flush=lambda name: seen.append("delta flushed") if fnmatch.fnmatch(name, "4_*.delta") else None)
    s = p.get_store(3)
    cw.apply_to_store(s, cw.batch(seed, 4))
    assert s.commit() == 4
    hooks.clear()
    assert seen == ["merged", "delta flushed"]
    assert s.metrics.num_keys == len(expected[4])
    for version in range(1, 5):
        (name,) = attempts(tmp_path, version)
        path = os.path.join(store_dir(tmp_path), name)
        reader = DeltaReader(Path(path).read_bytes(), KEY, VALUE, path=path)
        reader.check()
        assert reader.num_keys == len(expected[version])


@pytest.mark.parametrize("fails", ["merge", "merged"], ids=["before-it-changed-anything", "after-it-merged"])
@pytest.mark.parametrize("when", ["delta-partly-written", "delta-not-started"])
def test_failed_merge_leaves_no_file(tmp_path, faulty, hooks, fails, when):
    """The merge fails while the writer thread's delta is partly written under its
    temporary name (its trailer waits for the merge), or before its first byte: the delta
    is discarded (never renamed), the version the commit builds on stays exact (an open
    reader of it too), and the same store commits once the merge works."""
    seed = 26
    expected = workload(seed, 5)
    p = make(tmp_path)
    commit_workload(p, seed, 0, 3)
    reader = p.get_read_store(3)
    wrote, writing, go_on = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def on_pending(name):
        if fnmatch.fnmatch(name, "4_*.delta"):
            seen.append("delta durable")

    def on_writer(name):
        if fnmatch.fnmatch(name, "4_*.delta") and when == "delta-not-started":
            writing.set()
            assert go_on.wait(10)  # written once the merge failed

    def on_wrote(name):
        if fnmatch.fnmatch(name, "4_*.delta"):
            wrote.set()

    def fail(_):
        assert (wrote if when == "delta-partly-written" else writing).wait(10)
        seen.append("merge failed")
        go_on.set()
        raise RuntimeError("injected merge failure")

    hooks.update(pending=on_pending, writer=on_writer, wrote=on_wrote, **{fails: fail})
    s = p.get_store(3)
    cw.apply_to_store(s, cw.batch(seed, 4))
    with pytest.raises(RuntimeError, match="injected merge failure"):
        s.commit()
    hooks.clear()
    assert seen == ["merge failed", "delta durable"]
    assert not s.has_committed
    assert tmp_files(tmp_path) == [] and 4 not in versions_on_disk(tmp_path)[0]
    assert contents(reader) == expected[3]
    for provider in (p, make(tmp_path)):
        assert_version(provider, 3, expected[3])
        with pytest.raises(VersionNotFoundError):
            provider.get_read_store(4)
    assert s.commit() == 4
    commit_workload(p, seed, 4, 5)
    assert_versions(p, tmp_path, (4, 5), expected)
    assert contents(reader) == expected[3]


def test_failed_schema_file_write_at_the_first_commit(tmp_path, faulty):
    p = make(tmp_path)
    faulty[-1].arm("rename", "_statecore.schema.json")
    s = p.get_store(0)
    s.put(1, (1, 1.0))
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert not s.has_committed and tmp_files(tmp_path) == []
    assert versions_on_disk(tmp_path) == (set(), set())
    with pytest.raises(VersionNotFoundError):
        make(tmp_path).get_read_store(1)
    s.abort()
    assert commit_batch(p, 0, [(1, (1, 1.0))]) == 1
    assert contents(make(tmp_path).get_read_store(1)) == {1: (1, 1.0)}
    assert "_statecore.schema.json" in names(tmp_path)


# (step, file pattern): before the re-execution's rename, or at a delete of the abandoned run
RE_EXECUTION_FAULTS = [("write", "5_*.delta"), ("fsync", "5_*.delta"), ("rename", "5_*.delta"),
                       ("delete", "5_*.delta"), ("delete", "6_*.delta"), ("delete", "8_*.delta")]


@pytest.mark.parametrize("step,pattern", RE_EXECUTION_FAULTS, ids=[f"{s}-{p[0]}" for s, p in RE_EXECUTION_FAULTS])
def test_failed_re_execution_commit_keeps_the_version_it_builds_on(tmp_path, faulty, step, pattern):
    """Re-executing batch 5 from version 4 deletes the abandoned run's later files only once
    its own delta is renamed into place (nothing is deleted before). When its commit fails,
    before the rename or at one of those deletes, nothing of it is visible; version 4, which
    it builds on, loads; the default lineage loads wherever it now ends; and the
    re-execution can be retried."""
    seed = 8
    expected = workload(seed, 8)
    p = make(tmp_path, min_deltas_for_snapshot=2)
    commit_workload(p, seed, 0, 8, maintenance_every=3)
    before = set(names(tmp_path))
    s = make(tmp_path).get_store(4)  # a restarted query re-runs batch 5
    store_files = faulty[-1]  # (the commit's look for batch records opens more files)
    store_files.arm(step, pattern)
    s.put(-1, (-1, -1.0))
    with pytest.raises(OSError):
        s.commit()
    assert store_files.raised[step] == 1
    assert tmp_files(tmp_path) == []
    after = set(names(tmp_path))
    assert after <= before  # nothing of the failed commit is visible
    if step != "delete":
        assert after == before  # nothing of the abandoned run was deleted before the rename
    for provider in (make(tmp_path), p):
        assert_version(provider, 4, expected[4])
    top = max(listing(tmp_path).versions("delta"))
    for v in range(5, top + 1):  # the default lineage, wherever it ends, loads whole
        assert_version(make(tmp_path), v, expected[v])
    s.abort()
    q = make(tmp_path)
    assert commit_batch(q, 4, [(-1, (-1, -1.0))]) == 5
    assert_version(make(tmp_path), 5, {**expected[4], -1: (-1, -1.0)})
    with pytest.raises(VersionNotFoundError):
        make(tmp_path).get_read_store(6)


# -- injected faults in maintenance ------------------------------------------------------------
def snapshot_bases(provider):
    """The bases of the provider's States that are mapped snapshots (their paths)."""
    out = []
    with provider.held.lock:
        node = provider.held.newest
        while node is not None:
            base = node.base
            if isinstance(base, SnapshotReader):
                out.append(base)
            node = base.state if isinstance(base, FrozenView) else None
    return out


@pytest.mark.parametrize("step,after_bytes", [("write", 0), ("write", 6000), ("flush", 0), ("fsync", 0),
                                              ("rename", 0)])
def test_failed_snapshot_write_in_maintenance(tmp_path, faulty, step, after_bytes):
    seed = 9
    expected = workload(seed, 12)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    files = faulty[-1]
    commit_workload(p, seed, 0, 5)
    files.arm(step, "*.snapshot", after_bytes=after_bytes)
    with pytest.raises(OSError, match=fault_message(step, 5, "snapshot")):
        p.do_maintenance()  # maintenance errors reach the caller (the registry unloads the provider)
    assert files.raised[step] == 1
    assert tmp_files(tmp_path) == [] and versions_on_disk(tmp_path)[1] == set()
    assert snapshot_bases(p) == []  # never swapped in: it is not durable
    for v in (3, 4, 5):
        assert_version(make(tmp_path), v, expected[v])
        assert_version(p, v, expected[v])
    # the provider goes on: commits, then a snapshot when maintenance works again
    commit_workload(p, seed, 5, 8)
    p.do_maintenance()
    assert versions_on_disk(tmp_path)[1] == {8}
    assert len(snapshot_bases(p)) == 1
    assert_files_whole(tmp_path)
    commit_workload(p, seed, 8, 12, maintenance_every=2)
    assert_versions(p, tmp_path, range(9, 13), expected)
    assert tmp_files(tmp_path) == []


def test_snapshot_whose_directory_fsync_fails_is_not_the_base(tmp_path, faulty, hooks, failing_dir_fsync):
    """The snapshot is renamed into place but the directory's fsync fails: maintenance
    raises and the snapshot is not swapped in as the base (it could vanish with a power
    loss); the file left is whole, and loads that use it are exact."""
    seed = 27
    expected = workload(seed, 9)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 5)
    hooks["rename"] = lambda name: name.endswith(".snapshot") and failing_dir_fsync(store_dir(tmp_path))
    with pytest.raises(OSError, match="injected directory fsync failure"):
        p.do_maintenance()
    hooks.clear()
    assert failing_dir_fsync.failed == [store_dir(tmp_path)]
    assert versions_on_disk(tmp_path)[1] == {5}  # renamed: in place, not known durable
    assert snapshot_bases(p) == []
    assert_files_whole(tmp_path)
    assert_versions(p, tmp_path, (3, 4, 5), expected)
    commit_workload(p, seed, 5, 9, maintenance_every=2)
    assert_versions(p, tmp_path, range(6, 10), expected)


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


@pytest.mark.parametrize("point", ["rename", "published", "returned"])
def test_maintenance_while_a_commit_finishes(tmp_path, hooks, point):
    """The registry's thread may run maintenance at any instant of a commit: after its merge
    and before its rename ("rename"), after the rename and before it returns ("published"),
    or right after it returned, the snapshot then being written while the task commits on
    ("returned"). It may skip the snapshot of an unfinished version or write it, but then
    the snapshot must be that version; commits made while it is being written must neither
    disturb it nor make maintenance fail."""
    seed = 15
    expected = workload(seed, 12)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 3)
    entered, hold, progressed = threading.Event(), threading.Event(), threading.Event()
    threads = []

    def start_maintenance(name=None):
        def maintain():
            try:
                return p.do_maintenance()
            finally:
                progressed.set()

        threads.append(run_thread(maintain, name="test-maintenance"))
        assert progressed.wait(10)  # it finished, or it is writing a snapshot (held below)

    def on_writer(name):
        if name.endswith(".snapshot") and not entered.is_set():
            entered.set()
            progressed.set()
            assert hold.wait(10)  # until the test's commits below are done

    def at(hook_point):
        def hook(name):
            if point == hook_point and fnmatch.fnmatch(name, "4_*.delta") and not threads:
                start_maintenance()
        return hook

    hooks.update(writer=on_writer, rename=at("rename"), published=at("published"))
    commit_workload(p, seed, 3, 4)  # with point != "returned", maintenance runs inside this commit
    if point == "returned":
        start_maintenance()
        assert entered.is_set()  # the snapshot of 4 is being written while the task goes on
    assert len(threads) == 1
    commit_workload(p, seed, 4, 7)
    hold.set()
    (thread, result), = threads
    thread.join(10)
    assert result == [None], result
    hooks.clear()
    assert_files_whole(tmp_path)
    snapshots = listing(tmp_path).versions("snapshot")
    if point == "returned":
        assert snapshots == [4]
    else:
        assert set(snapshots) <= {4}  # skipped, or of the version committed (below)
    if snapshots:
        [name] = attempts(tmp_path, 4, "snapshot")
        assert id_of(name) == default_id(make(tmp_path), 4)  # of the version committed
        reader = open_snapshot(StoreFiles(store_dir(tmp_path)), name, KEY, VALUE)
        assert reader.row_count == len(expected[4])
        reader.close()
    assert_versions(p, tmp_path, range(4, 8), expected)
    commit_workload(p, seed, 7, 12, maintenance_every=2)
    assert_versions(p, tmp_path, range(9, 13), expected)


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
    # header, its lineage (own and parent id) and checksum; the first block's header and
    # payload; the trailer
    return sorted({0, 1, 8, 40, 48, 50, 56, 63, 64, 71, 72, 80, 100, 104, 200, size // 2, size - 48, size - 20,
                   size - 1})


@pytest.mark.parametrize("where", ["truncate", "flip"])
def test_damaged_delta_is_an_error_naming_it(tmp_path, where):
    expected = delta_store(tmp_path)
    path = version_path(store_dir(tmp_path), 4, "delta")
    good = Path(path).read_bytes()
    assert len(good) > 300
    before_it_broken = {}  # offset -> the error loading version 3 (collected: every offset is tried)
    for offset in delta_offsets(len(good)):
        if where == "truncate":
            bad = good[:offset]
        else:
            bad = bytearray(good)
            bad[offset] ^= 0x5A
        replace_file(path, bad)
        with pytest.raises(StateCorruptionError, match=rf"4_{ID}\.delta") as info:
            make(tmp_path).get_read_store(6)
        assert info.value.path == path, (offset, info.value)
        try:
            assert_version(make(tmp_path), 3, expected[3])  # versions before it are fine
        except (StateCorruptionError, VersionNotFoundError) as e:
            before_it_broken[offset] = e
    assert not before_it_broken, (f"damage in 4's delta at offsets {sorted(before_it_broken)} (of {len(good)}) "
                                  f"makes version 3 unloadable, e.g. {next(iter(before_it_broken.values()))}")
    replace_file(path, good + b"\0")  # a byte too many
    with pytest.raises(StateCorruptionError, match=rf"4_{ID}\.delta"):
        make(tmp_path).get_read_store(6)
    replace_file(path, good)
    assert_version(make(tmp_path), 6, expected[6])


def test_delta_of_another_version_or_attempt_is_an_error(tmp_path):
    """A file whose checked header disagrees with its name (another version's delta, or
    another attempt's delta of the same version) is damage naming it, never that version."""
    delta_store(tmp_path)
    other = tmp_path / "other"
    delta_store(other)  # the same batches: other attempts, other ids
    d = store_dir(tmp_path)
    four = version_path(d, 4, "delta")
    good = Path(four).read_bytes()
    for source in (version_path(d, 5, "delta"), version_path(store_dir(other), 4, "delta")):
        replace_file(four, Path(source).read_bytes())
        with pytest.raises(StateCorruptionError, match=rf"4_{ID}\.delta") as info:
            make(tmp_path).get_read_store(6)
        assert info.value.path == four
    replace_file(four, good)
    make(tmp_path).get_read_store(6).abort()


def test_attempt_whose_parent_is_missing_is_not_found(tmp_path):
    """Another run's delta copied in under its own name is an attempt of that version whose
    chain leads nowhere here: asked for by its id, it is not found (it is never data), and
    the default lineage is not disturbed by it."""
    expected = delta_store(tmp_path)
    other = tmp_path / "other"
    delta_store(other, seed=99)
    foreign = version_path(store_dir(other), 4, "delta")
    os.link(foreign, os.path.join(store_dir(tmp_path), os.path.basename(foreign)))
    with pytest.raises((VersionNotFoundError, StateCorruptionError)):
        contents(make(tmp_path).get_read_store(4, id_of(os.path.basename(foreign))))
    for v in (3, 4, 6):
        assert_version(make(tmp_path), v, expected[v])


def snapshot_store(tmp_path, seed=17, n_keys=30_000, deltas_after=2, compression="lz4"):
    """A snapshot of version 2 holding n_keys keys (several data blocks), then more deltas."""
    p = make(tmp_path, min_deltas_for_snapshot=1, compression=compression)
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
            assert "2.snapshot" in version_names(store_dir(tmp_path))
    p.close()
    return expected, version_path(store_dir(tmp_path), 2, "snapshot")


def test_a_commit_whose_merge_meets_a_damaged_block_leaves_the_version_as_it_was(tmp_path):
    """The merge looks prior values up in the base; a damaged block found there fails the
    commit, and a reader of the same version (same in-memory state) sees nothing of it."""
    p = make(tmp_path, min_deltas_for_snapshot=1, compression="none")
    commit_batch(p, 0, [(k, (k, 0.0)) for k in range(30_000)])
    commit_batch(p, 1, [(0, (0, 0.0))])
    p.do_maintenance()  # a snapshot of version 2
    commit_batch(p, 2, [(k, (k, 1.0)) for k in range(100, 110)])  # the head: rows of block 0
    p.close()
    path = version_path(store_dir(tmp_path), 2, "snapshot")
    bad = bytearray(Path(path).read_bytes())
    bad[4096 + 5 * 65536 + 1000] ^= 0xFF  # key k is row k, 24 bytes from byte 4096: keys ~13650-16380
    replace_file(path, bad)
    q = make(tmp_path)
    reader = q.get_read_store(3)
    assert reader.metrics.num_keys == 30_000
    writer = q.get_store(3)
    for k in [*range(100, 110), *range(14_000, 14_010)]:  # in the head, then only in the damaged block
        writer.put(k, (-1, -1.0))
    with pytest.raises(StateCorruptionError, match=r"2_[0-9a-f]{16}\.snapshot"):
        writer.commit()
    assert [reader.get(k) for k in range(100, 110)] == [(k, 1.0) for k in range(100, 110)]
    assert not any(n.startswith("4_") for n in version_names(store_dir(tmp_path)))


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_damaged_snapshot_data_is_found_by_the_lookup_that_touches_it(tmp_path, compression):
    """An image's damaged block is found by the lookup that touches it (an image is mapped
    and checked lazily); a packed snapshot's, when it is unpacked on load, which then skips it
    for the deltas: every value is right."""
    expected, path = snapshot_store(tmp_path, compression=compression)
    good = Path(path).read_bytes()
    # the rows start after the 4096-byte header; damage one byte in the second data block
    offset = 4096 + 65536 + 1000
    bad = bytearray(good)
    bad[offset] ^= 0xFF
    replace_file(path, bad)
    fresh = make(tmp_path)
    if compression == "lz4":
        for version in (2, 4):
            assert contents(fresh.get_read_store(version)) == expected[version]
        return
    for version in (2, 4):
        store = fresh.get_read_store(version)  # opening checks only the header and footer
        want = expected[version]
        right = damaged = 0
        for k in range(0, 30_000, 7):
            try:
                got = store.get(k)
            except StateCorruptionError as e:
                assert os.path.basename(path) in str(e)
                damaged += 1
                continue
            assert got == want.get(k), k  # never a wrong value
            right += 1
        assert damaged and right
        with pytest.raises(StateCorruptionError, match=rf"2_{ID}\.snapshot"):
            store.get_batch(keys_of(np.arange(30_000)))
        with pytest.raises(StateCorruptionError, match=rf"2_{ID}\.snapshot"):
            contents(store)


@pytest.mark.parametrize("damage", ["magic", "header", "lineage", "schema-json", "header-checksum", "footer",
                                    "truncated", "half", "empty", "extended"])
def test_damaged_snapshot_header_falls_back_to_the_deltas(tmp_path, damage):
    expected, path = snapshot_store(tmp_path, n_keys=3000)
    good = Path(path).read_bytes()
    bad = bytearray(good)
    flip = {"magic": 0, "header": 48, "lineage": 117, "schema-json": 140, "header-checksum": 4090,
            "footer": len(good) - 60}
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
    os.remove(version_path(store_dir(tmp_path), 1, "delta"))
    with pytest.raises(StateCorruptionError, match=rf"2_{ID}\.snapshot"):
        make(tmp_path).get_read_store(4)


def test_snapshot_of_another_attempt_under_this_ones_name_is_an_error(tmp_path):
    """A snapshot file whose header is of another attempt than its name says is damage: the
    load falls back to the deltas (and is exact), never to the other attempt's rows."""
    expected, path = snapshot_store(tmp_path, n_keys=3000)
    other = tmp_path / "other"
    snapshot_store(other, seed=18, n_keys=3000)
    replace_file(path, Path(version_path(store_dir(other), 2, "snapshot")).read_bytes())
    for version in (2, 3, 4):
        assert_version(make(tmp_path), version, expected[version])


# -- names of the old layout, and directories named like version files ---------------------------
def test_old_layout_names_still_load(tmp_path):
    """A store written with the names of the old layout (``<v>.delta``, ``<v>.snapshot``;
    their ids are in the checked headers) loads every version, takes new commits (named with
    ids) on top, and maintenance snapshots and cleans up across both; damage in an old name's
    header is an error naming it."""
    seed = 24
    expected = workload(seed, 12)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=100)
    commit_workload(p, seed, 0, 6, maintenance_every=3)
    p.close()
    d = store_dir(tmp_path)
    for f in listing(tmp_path):
        os.rename(os.path.join(d, f.name), os.path.join(d, f"{f.version}.{f.kind}"))
    old = set(names(tmp_path)) - {"_statecore.schema.json"}
    assert old and all(parse_name(n).commit_id is None for n in old)
    assert {n for n in old if n.endswith(".snapshot")}  # a snapshot among them
    for v in range(7):
        assert_version(make(tmp_path), v, expected[v])
    # damage in an old name's header: an error naming it (its id comes from that header)
    four = os.path.join(d, "4.delta")
    good = Path(four).read_bytes()
    for bad in (good[:40], bytes([good[0] ^ 1]) + good[1:], good[:50] + bytes([good[50] ^ 1]) + good[51:]):
        replace_file(four, bad)
        with pytest.raises(StateCorruptionError, match="4.delta") as info:
            make(tmp_path).get_read_store(4)
        assert info.value.path == four
    replace_file(four, good)
    # new commits on top of the old names, then maintenance over both
    q = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    commit_workload(q, seed, 6, 12, maintenance_every=2)
    assert all(parse_name(n).commit_id is not None for n in set(names(tmp_path)) - old - {"_statecore.schema.json"})
    assert old - set(names(tmp_path))  # cleanup deleted old names too
    assert_files_whole(tmp_path)
    assert_versions(q, tmp_path, range(9, 13), expected)


def test_directories_named_like_version_files_break_no_load(tmp_path):
    """Directories named like version files (of versions on the lineage, above it, and of the
    old layout) and like a killed writer's temporary file are never opened as files: every
    load, commit and maintenance pass works around them (no IsADirectoryError)."""
    seed = 25
    expected = workload(seed, 9)
    p = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 5, maintenance_every=3)
    d = store_dir(tmp_path)
    dirs = [f"6_{'ab' * 8}.delta", f"5_{'cd' * 8}.delta", f"3_{'ef' * 8}.snapshot", "5.snapshot", "7.delta",
            f".6_{'ab' * 8}.delta.{'0f' * 16}.tmp"]
    for n in dirs:
        os.mkdir(os.path.join(d, n))
    two_hours_ago = time.time() - 7200
    os.utime(os.path.join(d, dirs[-1]), (two_hours_ago, two_hours_ago))
    for v in range(6):
        assert_version(make(tmp_path), v, expected[v])
    commit_workload(p, seed, 5, 9, maintenance_every=1)
    fresh = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    fresh.do_maintenance()
    assert_versions(fresh, tmp_path, range(6, 10), expected)
    assert all(os.path.isdir(os.path.join(d, n)) for n in dirs)


# -- durability ----------------------------------------------------------------------------------
def test_a_new_store_directory_is_durable_before_its_first_commit(tmp_path, synced_dirs):
    """The store directory (and each parent the provider creates) is fsynced into its parent
    when created; each commit's rename is fsynced into the store directory."""
    root = tmp_path / "ckpt"
    p = make(root)
    assert synced_dirs == [(str(tmp_path), ["ckpt"]), (str(root), ["0"]), (str(root / "0"), ["0"])]
    synced_dirs.clear()
    commit_batch(p, 0, [(1, (1, 1.0))])
    [delta] = attempts(root, 1)
    assert synced_dirs == [(store_dir(root), ["_statecore.schema.json"]),
                      (store_dir(root), sorted(["_statecore.schema.json", delta]))]


# -- maintenance racing the task ---------------------------------------------------------------
def re_execute_while_maintenance_snapshots(tmp_path, hooks, seed, order, **conf):
    """Versions 1..4 committed; then maintenance lists the files (the newest is 4, attempt
    A); batch 4 is re-executed from 3 (attempt B) while maintenance freezes A's version 4 and
    writes its snapshot, which it finishes after that commit returned. ``order``: maintenance
    freezes A before B's merge ("freeze-first"), or after it, B's rename then waiting for
    the snapshot to be under way ("merge-first"). Returns the provider, B's version 4,
    A's name, and maintenance's result."""
    p = make(tmp_path, min_deltas_for_snapshot=1, **conf)
    commit_workload(p, seed, 0, 4)
    [abandoned] = attempts(tmp_path, 4)
    new4 = {**workload(seed, 3)[3], -1: (-1, -1.0)}
    listed, go_freeze, snapshot_writing, commit_done, committing = (threading.Event() for _ in range(5))
    seen = []

    def on_listed(_):
        name = threading.current_thread().name
        if name == "test-racer" and not listed.is_set():
            listed.set()
            assert go_freeze.wait(10)  # maintenance goes on when the re-execution lets it
        elif name == "MainThread" and committing.is_set() and order == "freeze-first" and not go_freeze.is_set():
            go_freeze.set()  # the commit's check for newer attempts, before its merge
            assert snapshot_writing.wait(10)

    def on_writer(name):
        if fnmatch.fnmatch(name, "4_*.snapshot") and not snapshot_writing.is_set():
            seen.append("frozen")
            snapshot_writing.set()
            assert commit_done.wait(10)  # the snapshot is finished after the commit returned

    def on_merged(_):  # inside the provider's lock: wait for nothing here
        if committing.is_set():
            seen.append("merged")
            go_freeze.set()

    def on_rename(name):
        if fnmatch.fnmatch(name, "4_*.delta") and order == "merge-first":
            assert snapshot_writing.wait(10)

    hooks.update(listed=on_listed, writer=on_writer, merged=on_merged, rename=on_rename)
    thread, result = run_thread(p.do_maintenance)
    assert listed.wait(10)
    s = p.get_store(3)
    s.put(-1, (-1, -1.0))
    committing.set()
    assert s.commit() == 4
    s.abort()
    commit_done.set()
    thread.join(10)
    hooks.clear()
    assert seen == (["frozen", "merged"] if order == "freeze-first" else ["merged", "frozen"])
    assert attempts(tmp_path, 4) != [abandoned]  # B's delta replaced A's
    return p, new4, abandoned, result


ORDERS = ["freeze-first", "merge-first"]


@pytest.mark.parametrize("order", ORDERS)
def test_snapshot_of_the_abandoned_run_never_becomes_the_new_runs_base(tmp_path, hooks, order):
    """The old run's snapshot of 4 must not be swapped in under the new run's state:
    version 4 read through the provider must be the new run's."""
    p, new4, abandoned, result = re_execute_while_maintenance_snapshots(tmp_path, hooks, 18, order,
                                                                        min_versions_to_retain=3)
    assert result == [None], result
    # the abandoned attempt's snapshot is on disk (written after the re-execution deleted
    # what it saw); it is no file of the default lineage
    assert [id_of(n) for n in attempts(tmp_path, 4, "snapshot")] == [id_of(abandoned)]
    assert default_id(make(tmp_path), 4) != id_of(abandoned)
    assert_version(make(tmp_path), 4, new4)  # the files are right (lineage check)
    assert_version(p, 4, new4)  # and so must be the provider's memory
    commit_batch(p, 4, [(-2, (-2, -2.0))])
    assert_version(p, 5, {**new4, -2: (-2, -2.0)})
    assert_version(make(tmp_path), 5, {**new4, -2: (-2, -2.0)})


@pytest.mark.parametrize("order", ORDERS)
def test_snapshot_of_the_abandoned_run_is_no_base_for_cleanup(tmp_path, hooks, order):
    """The same interleaving, then one more commit and maintenance pass (retention 1): the
    old run's snapshot of 4 must not be taken as the base that lets cleanup delete older
    files, or the new run's versions 4 and 5 (retained) can no longer be loaded."""
    p, new4, _, _ = re_execute_while_maintenance_snapshots(tmp_path, hooks, 18, order, min_versions_to_retain=1)
    q = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=1)  # a restarted query
    assert_version(q, 4, new4)
    assert commit_batch(q, 4, [(-2, (-2, -2.0))]) == 5
    q.do_maintenance()
    assert_version(make(tmp_path), 5, {**new4, -2: (-2, -2.0)})
    assert_version(make(tmp_path), 4, new4)


def test_maintenance_whose_snapshot_a_re_commit_deleted(tmp_path, hooks):
    """Maintenance renamed the snapshot of version 4 into place; before it swaps it in,
    batch 4 is re-executed and its commit deletes that snapshot of the abandoned run.
    Maintenance must not fail for that (the registry would unload the provider)."""
    seed = 19
    expected = workload(seed, 4)
    p = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=3)
    commit_workload(p, seed, 0, 4)
    renamed, commit_done = threading.Event(), threading.Event()

    def on_written(name):
        if fnmatch.fnmatch(name, "4_*.snapshot") and not renamed.is_set():
            renamed.set()
            assert commit_done.wait(10)

    hooks.update(written=on_written)
    thread, result = run_thread(p.do_maintenance)
    assert renamed.wait(10)
    assert versions_on_disk(tmp_path)[1] == {4}
    assert commit_batch(p, 3, [(-1, (-1, -1.0))]) == 4
    assert versions_on_disk(tmp_path)[1] == set()  # the re-execution deleted it
    commit_done.set()
    thread.join(10)
    hooks.clear()
    new4 = {**expected[3], -1: (-1, -1.0)}
    assert_version(p, 4, new4)
    assert_version(make(tmp_path), 4, new4)
    assert result == [None], result


def test_load_racing_another_instances_cleanup(tmp_path, hooks):
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
            assert cleaned.wait(10)

    hooks.update(listed=on_listed)
    thread, result = run_thread(lambda: contents(new.get_read_store(6)))
    assert listed.wait(10)
    old.do_maintenance()  # snapshot 6
    commit_workload(old, seed, 6, 7)
    old.do_maintenance()  # newest 7, retain 1: everything older than 6's snapshot goes
    assert 3 not in versions_on_disk(tmp_path)[1]
    cleaned.set()
    thread.join(10)
    hooks.clear()
    assert result == [expected[6]], result


def test_maintenance_deletes_the_temporary_files_a_killed_writer_left(tmp_path):
    p = make(tmp_path, min_deltas_for_snapshot=100)
    commit_batch(p, 0, [(1, (1, 1.0))])
    directory = store_dir(tmp_path)
    old = [os.path.join(directory, f".2_{'0f' * 8}.delta." + "0f" * 16 + ".tmp"),  # a killed commit's
           os.path.join(directory, ".2.delta." + "1f" * 16 + ".tmp")]  # the old layout's
    young = os.path.join(directory, f".2_{'1e' * 8}.snapshot." + "1e" * 16 + ".tmp")
    for path in old + [young]:
        with open(path, "wb") as f:
            f.write(b"half a file")
    two_hours_ago = time.time() - 7200
    for path in old:
        os.utime(path, (two_hours_ago, two_hours_ago))
    p.do_maintenance()
    assert not any(os.path.exists(path) for path in old)
    assert os.path.exists(young)  # it may belong to a writer still at work
    assert_version(make(tmp_path), 1, {1: (1, 1.0)})


def test_a_version_re_executed_by_another_process_is_not_served_from_memory(tmp_path):
    """Worker processes come and go: one holds version 2 (attempt A) in memory while another,
    after re-executing batch 2 from version 1, committed attempt B of version 2 and deleted
    A. The first must not serve (or build on) its own, abandoned, version 2."""
    first = make(tmp_path)
    commit_batch(first, 0, [(1, (1, 1.0))])
    commit_batch(first, 1, [(2, (2, 2.0))])
    assert_version(first, 2, {1: (1, 1.0), 2: (2, 2.0)})  # held in memory
    [a] = attempts(tmp_path, 2)
    second = make(tmp_path)  # another process
    commit_batch(second, 1, [(3, (3, 3.0))])  # batch 2 re-executed there
    [b] = attempts(tmp_path, 2)
    assert b != a  # A deleted: B is the only attempt
    assert_version(first, 2, {1: (1, 1.0), 3: (3, 3.0)}, commit_id=id_of(b))
    commit_batch(first, 2, [(4, (4, 4.0))])
    assert_version(make(tmp_path), 3, {1: (1, 1.0), 3: (3, 3.0), 4: (4, 4.0)})


def test_two_attempts_of_a_version_coexist_and_loads_follow_the_right_one(tmp_path):
    """A task and its retry both open version 2 and both commit version 3 (before, a re-commit
    overwrote ``3.delta``; now the attempts are two files, neither overwrites the other).
    The default lineage follows the attempt renamed last (ties: the larger name); a named
    attempt is loaded as named; the next version builds on the default, and the other
    attempt stays loadable by its id."""
    p = make(tmp_path)
    commit_batch(p, 0, [(1, (1, 1.0))])
    commit_batch(p, 1, [(2, (2, 2.0))])
    task, retry = p.get_store(2), make(tmp_path).get_store(2)  # opened before either commits
    task.put(3, (3, 3.0))
    retry.put(3, (3, 30.0))
    assert task.commit() == 3 and retry.commit() == 3
    a, b = task.commit_id, retry.commit_id
    assert sorted(id_of(n) for n in attempts(tmp_path, 3)) == sorted([a, b])
    base = {1: (1, 1.0), 2: (2, 2.0)}
    by_task, by_retry = {**base, 3: (3, 3.0)}, {**base, 3: (3, 30.0)}
    d = store_dir(tmp_path)
    path = {id_of(n): os.path.join(d, n) for n in attempts(tmp_path, 3)}
    now = time.time()
    # renamed in that order (set explicitly: filesystem timestamps may be coarser than that)
    os.utime(path[a], (now - 10, now - 10))
    os.utime(path[b], (now - 5, now - 5))
    assert default_id(make(tmp_path), 3) == b
    assert_version(make(tmp_path), 3, by_retry)
    assert_version(make(tmp_path), 3, by_task, commit_id=a)
    assert_version(make(tmp_path), 3, by_retry, commit_id=b)
    assert_version(p, 3, by_retry)  # the task's own provider too: the default is the retry's
    # the same instant: the larger name
    os.utime(path[a], (now, now))
    os.utime(path[b], (now, now))
    assert default_id(make(tmp_path), 3) == max(a, b)
    os.utime(path[a], (now - 10, now - 10))
    os.utime(path[b], (now - 5, now - 5))
    # the next batch builds on the default; the other attempt stays loadable by its id
    assert commit_batch(make(tmp_path), 3, [(4, (4, 4.0))]) == 4
    assert_version(make(tmp_path), 4, {**by_retry, 4: (4, 4.0)})
    assert_version(make(tmp_path), 3, by_retry)
    assert_version(make(tmp_path), 3, by_task, commit_id=a)
    assert len(attempts(tmp_path, 3)) == 2
