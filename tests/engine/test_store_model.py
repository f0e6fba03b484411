"""Model-based random test: FileStateStoreProvider against the reference model.

The same seeded random sequence of operations runs on a FileStateStoreProvider and on
``models.DictStateStoreProvider`` (each on its own root): stores opened at the newest or an
earlier version (re-executed batches, several versions back), scalar and batch updates,
lookups, iteration with updates interleaved, commit or abort, read stores of random versions
held open across commits, maintenance with small snapshot and retention settings, and
restarts (a fresh provider on the same directory). After every step everything observable
is compared.

Versions cleanup deleted may legitimately be missing from the file provider while the
model (which keeps everything) still has them. ``floor`` tracks, over every maintenance
pass, the highest ``newest - min_versions_to_retain``: every version from ``floor`` to the
newest must load exactly; an older one may raise VersionNotFoundError, and if it loads
(from memory) it must be exact.

The file provider's files are a ``statecore.faults.FaultInjectingFiles``: some commits fail
at a random step of the delta write; the provider must then serve the previous versions
exactly (the merge it ran meanwhile undone), and the same store's next commit attempt must
succeed. A commit that re-executes a batch deletes the abandoned run's later files before
it writes its delta (by design), so after such a commit fails, the versions above the one
it was writing may be gone from the files (``lost_above``) until a commit succeeds again.
"""
import collections
import os

import numpy as np
import pytest

from statecore import (IllegalStateError, StateStoreConf, StateStoreId, VersionNotFoundError,
                       create_and_init_provider)
from tests.store_support import inject_faulty_files, maintaining

FILE = "statecore.FileStateStoreProvider"
MODEL = "models.DictStateStoreProvider"


# -- the two schemas -------------------------------------------------------------------------
class Counts:
    """Key int64, value (int64, float64): a small key space so that updates collide."""

    name = "counts"
    key = np.dtype([("k", "<i8")])
    value = np.dtype([("count", "<i8"), ("sum", "<f8")])
    n_keys = 40

    def key_obj(self, rng):
        k = int(rng.integers(-2, self.n_keys))
        return k if rng.random() < 0.5 else (k,)

    def keys(self, rng, n):
        out = np.zeros(n, self.key)
        out["k"] = rng.integers(-2, self.n_keys, n)
        return out

    def value_obj(self, rng):
        return (int(rng.integers(-3, 4)), float(rng.choice([0.0, -1.5, 2.25, rng.random()])))

    def values(self, rng, n):
        out = np.zeros(n, self.value)
        out["count"] = rng.integers(-3, 4, n)
        out["sum"] = rng.random(n)
        return out

    def all_keys(self):
        out = np.zeros(self.n_keys + 3, self.key)
        out["k"] = np.arange(-2, self.n_keys + 1)
        return out


class Sets:
    """A set: a multi-field key with an S8 field (NULs inside, empty, full width) and a bool,
    and the empty value schema."""

    name = "set"
    key = np.dtype([("id", "<i4"), ("name", "S8"), ("flag", "?")])
    value = np.dtype([])
    NAMES = [b"", b"a", b"ab", b"a\x00b", b"12345678", b"\xff\x00\x01", b"zz"]

    def _one(self, rng):
        return (int(rng.integers(0, 3)), self.NAMES[int(rng.integers(len(self.NAMES)))], bool(rng.random() < 0.5))

    def key_obj(self, rng):
        return self._one(rng)

    def keys(self, rng, n):
        out = np.zeros(n, self.key)
        for i in range(n):
            out[i] = self._one(rng)
        return out

    def value_obj(self, rng):
        return ()

    def values(self, rng, n):
        return None if rng.random() < 0.5 else np.zeros(n, self.value)

    def all_keys(self):
        rows = [(i, name, flag) for i in range(4) for name in self.NAMES for flag in (False, True)]
        return np.array(rows, dtype=self.key)


# -- comparing -------------------------------------------------------------------------------
def contents(store):
    """The store's iterator as a dict; every key must come once."""
    out = {}
    for k, v in store.iterator():
        assert k not in out, f"key {k} iterated twice"
        out[k] = v
    return out


def same_lookups(f, m, schema, rng, where):
    keys = schema.all_keys()
    fv, ff = f.get_batch(keys)
    mv, mf = m.get_batch(keys)
    assert ff.tolist() == mf.tolist(), where
    assert fv[ff].tolist() == mv[mf].tolist(), where
    for k in (schema.key_obj(rng) for _ in range(3)):
        assert f.get(k) == m.get(k), (where, k)


def same_store(f, m, schema, rng, where):
    assert f.version == m.version, where
    expected = contents(m)
    assert contents(f) == expected, where
    assert f.metrics.num_keys == m.metrics.num_keys == len(expected), where
    same_lookups(f, m, schema, rng, where)
    return expected


def probe(provider, version):
    """(contents, num_keys) of a version through a read store, or None if it does not exist."""
    try:
        store = provider.get_read_store(version)
    except VersionNotFoundError:
        return None
    try:
        return contents(store), store.metrics.num_keys
    finally:
        store.abort()


# -- the random run ------------------------------------------------------------------------
class Run:
    def __init__(self, tmp_path, rng, schema, k, opened_files):
        self.rng, self.schema, self.k = rng, schema, k
        self.opened_files = opened_files  # every FaultInjectingFiles made, newest last
        self.file_root = str(tmp_path / "file")
        self.model_root = str(tmp_path / "model")
        self.min_deltas = int(rng.integers(0, 3))
        self.retain = int(rng.integers(1, 4))
        self.fp = self._open(FILE)
        self.mp = self._open(MODEL)
        self.latest = 0  # the newest committed version (the model's and the files')
        self.floor = 0  # versions from here to latest must load from files (see module doc)
        self.lost_above = None  # versions above this may be gone (a failed re-execution)
        self.writer = None  # (file store, model store)
        self.held = []  # (file read store, expected contents, expected num_keys): held open
        self.log = []
        self.stats = collections.Counter()

    def _open(self, provider_class):
        root = self.file_root if provider_class == FILE else self.model_root
        conf = StateStoreConf(provider_class=provider_class, min_deltas_for_snapshot=self.min_deltas,
                              min_versions_to_retain=self.retain, max_versions_to_retain_in_memory=self.k)
        provider = create_and_init_provider(StateStoreId(root, 0, 0), self.schema.key, self.schema.value, conf)
        if provider_class == FILE:
            self.files = self.opened_files[-1]
        return provider

    def where(self):
        return (f"{self.schema.name} K={self.k} min_deltas={self.min_deltas} retain={self.retain} "
                f"latest={self.latest} floor={self.floor} steps: {self.log[-12:]}")

    def top(self):
        """The newest version in the files."""
        return self.latest if self.lost_above is None else min(self.latest, self.lost_above)

    def guaranteed(self, version):
        if self.lost_above is not None and version > self.lost_above:
            return False
        return version == 0 or self.floor <= version <= self.latest

    # -- steps ------------------------------------------------------------------------------
    def open_writer(self):
        r = self.rng.random()
        top = self.top()
        if self.lost_above is not None and r < 0.7:
            v = self.lost_above - 1  # the failed batch runs again
        elif r < 0.5:
            v = top
        elif r < 0.9:
            v = int(self.rng.integers(min(top, max(self.floor, top - 5)), top + 1))
        else:
            v = int(self.rng.integers(0, self.latest + 3))
        self.log.append(f"get_store({v})")
        try:
            m = self.mp.get_store(v)
        except VersionNotFoundError:
            with pytest.raises(VersionNotFoundError):
                self.fp.get_store(v)
            return
        try:
            f = self.fp.get_store(v)
        except VersionNotFoundError:
            assert not self.guaranteed(v), f"version {v} is missing: {self.where()}"
            m.abort()
            return
        self.writer = (f, m)

    def committable(self):
        # A batch is only re-executed from a version the retention keeps (or from 0): a
        # commit on top of an older version that cleanup deleted could not be loaded again.
        base = self.writer[0].version
        if self.lost_above is not None and base > self.lost_above:
            return False  # its files may be gone (and a batch re-runs from a known version)
        return base == 0 or base >= self.floor

    def update(self):
        f, m = self.writer
        rng, schema = self.rng, self.schema
        op = rng.integers(4)
        if op == 0:
            k, v = schema.key_obj(rng), schema.value_obj(rng)
            self.log.append(f"put({k!r})")
            f.put(k, v)
            m.put(k, v)
        elif op == 1:
            k = schema.key_obj(rng)
            self.log.append(f"remove({k!r})")
            f.remove(k)
            m.remove(k)
        elif op == 2:
            n = int(rng.integers(0, 10))
            keys, values = schema.keys(rng, n), schema.values(rng, n)
            self.log.append(f"put_batch({n})")
            f.put_batch(keys, values)
            m.put_batch(keys, values)
        else:
            n = int(rng.integers(0, 10))
            keys = schema.keys(rng, n)
            self.log.append(f"remove_batch({n})")
            f.remove_batch(keys)
            m.remove_batch(keys)

    def iterate_with_updates(self):
        """Iterate the writer while updating it (and maybe running maintenance): the iteration
        visits exactly what the store held when it began, each key once."""
        f, m = self.writer
        self.log.append("iterate")
        before = same_store(f, m, self.schema, self.rng, self.where())
        it = f.iterator()
        seen = {}
        for k, v in it:
            assert k not in seen, f"key {k} iterated twice: {self.where()}"
            seen[k] = v
            if self.rng.random() < 0.5:
                self.update()
            if self.rng.random() < 0.05:
                self.maintenance()
        assert seen == before, self.where()
        same_store(f, m, self.schema, self.rng, self.where())

    def commit(self):
        f, m = self.writer
        self.writer = None
        self.log.append(f"commit({f.version}->{f.version + 1})")
        same_store(f, m, self.schema, self.rng, self.where())
        new_version = f.commit()
        assert new_version == m.commit() == f.version + 1
        self.stats["commits"] += 1
        if new_version <= self.latest:
            self.stats["re-executions"] += 1
        assert f.has_committed and m.has_committed
        self.latest = new_version
        self.lost_above = None
        self.stats["held across commits"] += len(self.held)
        if new_version == 1:
            self.floor = min(self.floor, 1)  # a new lineage from the empty state
        assert f.metrics.num_keys == m.metrics.num_keys, self.where()
        if self.rng.random() < 0.3:
            f.abort()  # harmless after commit
            assert not f.has_committed
        self.check_version(new_version)

    def failed_commit(self):
        """A commit whose delta write fails: nothing changes, and the store can commit again."""
        f, m = self.writer
        step = str(self.rng.choice(["write", "flush", "fsync", "rename"]))
        after_bytes = int(self.rng.choice([0, 1, 80, 200])) if step == "write" else 0
        self.log.append(f"failed_commit({f.version}, {step}, {after_bytes})")
        before = dict(self.files.raised)
        self.files.arm(step, "*.delta", after_bytes=after_bytes)
        with pytest.raises(OSError, match="injected fault"):
            f.commit()
        self.files.disarm()
        if f.version < self.latest:
            self.lost_above = min(self.lost_above or f.version + 1, f.version + 1)
        assert self.files.raised[step] == before.get(step, 0) + 1
        self.stats["failed commits"] += 1
        assert not f.has_committed
        directory = os.path.join(self.file_root, "0", "0")
        assert not [n for n in os.listdir(directory) if n.endswith(".tmp")], self.where()
        # the store still holds its updates; the provider still has exactly what it had
        same_store(f, m, self.schema, self.rng, self.where())
        for v in {f.version, f.version + 1, self.latest, self.latest + 1}:
            self.check_version(v)
        r = self.rng.random()
        if r < 0.4:
            self.commit()  # the next attempt, by the same store
        elif r < 0.7:
            self.abort()
        # else: the store stays open for more updates

    def abort(self):
        f, m = self.writer
        self.writer = None
        self.log.append(f"abort({f.version})")
        f.abort()
        m.abort()
        assert not f.has_committed
        with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
            f.put(self.schema.key_obj(self.rng), self.schema.value_obj(self.rng))
        with pytest.raises(IllegalStateError, match="Cannot commit after already committed or aborted"):
            f.commit()

    def read_store(self):
        v = int(self.rng.integers(0, self.latest + 2))
        self.log.append(f"get_read_store({v})")
        try:
            m = self.mp.get_read_store(v)
        except VersionNotFoundError:
            with pytest.raises(VersionNotFoundError):
                self.fp.get_read_store(v)
            return
        try:
            f = self.fp.get_read_store(v)
        except VersionNotFoundError:
            assert not self.guaranteed(v), f"version {v} is missing: {self.where()}"
            return
        expected = same_store(f, m, self.schema, self.rng, self.where())
        if self.rng.random() < 0.5 and len(self.held) < 4:
            self.held.append((f, expected, m.metrics.num_keys))
        else:
            f.abort()

    def check_held(self):
        """Open read stores never change under their reader, whatever happened since."""
        for f, expected, num_keys in self.held:
            assert contents(f) == expected, f"held read store of version {f.version} changed: {self.where()}"
            assert f.metrics.num_keys == num_keys, self.where()
        if self.held and self.rng.random() < 0.3:
            f, _, _ = self.held.pop(int(self.rng.integers(len(self.held))))
            f.abort()

    def check_version(self, version):
        m = probe(self.mp, version)
        f = probe(self.fp, version)
        if m is None:
            assert f is None, f"version {version} exists only in the file provider: {self.where()}"
        elif f is None:
            assert not self.guaranteed(version), f"version {version} is missing: {self.where()}"
        else:
            assert f == m, f"version {version} differs: {self.where()}"

    def check_versions(self):
        self.log.append("check_versions")
        for v in sorted({0, *range(max(0, self.latest - 6), self.latest + 3),
                         int(self.rng.integers(0, self.latest + 1))}):
            self.check_version(v)

    def maintenance(self):
        self.log.append("maintenance")
        self.floor = max(self.floor, self.top() - self.retain)
        self.fp.do_maintenance()
        directory = os.path.join(self.file_root, "0", "0")
        names = os.listdir(directory) if os.path.isdir(directory) else []
        self.stats["snapshots seen"] += sum(name.endswith(".snapshot") for name in names)
        assert not [name for name in names if name.endswith(".tmp")], self.where()

    def restart(self):
        self.log.append("restart")
        self.stats["restarts"] += 1
        if self.writer is not None:
            self.abort()
        self.fp.close()
        self.fp = self._open(FILE)
        self.mp = self._open(MODEL)
        self.check_version(self.latest)

    def step(self):
        r = self.rng.random()
        if self.writer is None:
            if r < 0.6:
                self.open_writer()
            elif r < 0.75:
                self.read_store()
            elif r < 0.85:
                self.maintenance()
            elif r < 0.9:
                self.restart()
            elif r < 0.95:
                self.check_versions()
            else:
                self.check_held()
            return
        f, m = self.writer
        if r < 0.45:
            self.update()
        elif r < 0.55:
            self.log.append("compare")
            same_store(f, m, self.schema, self.rng, self.where())
        elif r < 0.6:
            self.iterate_with_updates()
        elif r < 0.65:
            self.read_store()  # a reader of any version while the writer is open
        elif r < 0.7:
            self.maintenance()  # the maintenance thread does not wait for tasks
        elif r < 0.85 and self.committable():
            self.commit()
        elif r < 0.9 and self.committable():
            self.failed_commit()
        else:
            self.abort()

    def run(self, n_steps):
        for _ in range(n_steps):
            self.step()
        if self.writer is not None:
            self.commit() if self.committable() else self.abort()
        self.maintenance()
        self.check_versions()
        self.check_held()
        self.restart()
        self.check_versions()
        for f, _, _ in self.held:
            f.abort()
        # the sequence did exercise what it is meant to
        assert self.stats["commits"] >= 20 and self.stats["re-executions"] >= 1, self.stats
        assert self.stats["restarts"] >= 1, self.stats
        # a provider that keeps no version in memory never snapshots (Spark's rule: docs/spark-state-store.md, Maintenance)
        assert (self.stats["snapshots seen"] >= 1) == (self.k > 0), self.stats
        assert self.stats["held across commits"] >= 1 and self.stats["failed commits"] >= 1, self.stats


@pytest.mark.parametrize("schema", [Counts(), Sets()], ids=lambda s: s.name)
@pytest.mark.parametrize("k", [0, 1, 2, 3], ids=lambda k: f"K{k}")
def test_file_provider_matches_the_model(tmp_path, monkeypatch, rand, schema, k):
    opened = inject_faulty_files(monkeypatch)
    Run(tmp_path, rand, schema, k, opened).run(n_steps=250)


def test_set_older_version_after_a_new_member(tmp_path):
    """The smallest sequence the random test fails on for sets (empty value schema): reading
    the version before a commit that added a member, while it is still held in memory."""
    conf = StateStoreConf(provider_class=FILE)
    p = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), Counts.key, np.dtype([]), conf)
    s = p.get_store(0)
    s.put(1, ())
    assert s.commit() == 1
    s = p.get_store(1)
    s.put(1, ())  # already a member
    s.put(2, ())  # new
    assert s.commit() == 2
    old = p.get_read_store(1)
    assert old.get(2) is None and old.get(1) == ()
    assert contents(old) == {(1,): ()}


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 2), (2, 3)], ids=["seed0-K1", "seed1-K2", "seed2-K3"])
def test_maintenance_thread_racing_the_task(tmp_path, seed, k):
    """The maintenance thread snapshots and cleans up while the task commits, reads older
    versions and re-executes batches (from versions the retention keeps): maintenance never
    fails, and every version read, in this provider or a fresh one, is exactly the model's.
    (A stress test: what it finds depends on timing; test_store_crash.py pins the
    interleavings it found, one by one.)"""
    from conftest import Rand

    rand = Rand(seed)
    schema = Counts()
    conf = StateStoreConf(min_deltas_for_snapshot=1, min_versions_to_retain=3, max_versions_to_retain_in_memory=k)
    p = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), schema.key, schema.value, conf)
    versions = {0: {}}
    v = high = 0  # the newest version now, and ever (cleanup keeps high - 3 on)
    with maintaining(p) as errors:
        for step in range(150):
            high = max(high, v)
            back = int(rand.integers(1, 3))
            if v - back >= high - 3 and rand.random() < 0.1:
                v -= back  # a batch re-executed
            s = p.get_store(v)
            data = dict(versions[v])
            for _ in range(int(rand.integers(1, 6))):
                key, value = int(rand.integers(0, 60)), schema.value_obj(rand)
                s.put(key, value)
                data[(key,)] = value
            for key in rand.integers(0, 60, int(rand.integers(0, 3))).tolist():
                s.remove(key)
                data.pop((key,), None)
            assert s.commit() == v + 1
            s.abort()
            v += 1
            versions = {u: d for u, d in versions.items() if u < v}
            versions[v] = data
            for u in (v, v - 1):
                if u in versions and (u == v or k > 1):
                    r = p.get_read_store(u)
                    assert contents(r) == versions[u], (step, u)
                    assert r.metrics.num_keys == len(versions[u])
                    r.abort()
    assert errors == []
    p.do_maintenance()
    fresh = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), schema.key, schema.value, conf)
    for u in range(max(v, high) - 3, v + 1):
        assert contents(fresh.get_read_store(u)) == versions[u], u
