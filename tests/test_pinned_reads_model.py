"""Pinned versions read three ways (per row, in batches, by iteration) while commits, spills
and maintenance run, against a dict model of every committed version.

The state machine holds several stores of one provider open at once: read stores and writing
stores at any retained version (each pins it), writing stores that committed (they then read
the version they made) and iterations of any of them taken a chunk at a time. Between
those reads it commits (also re-executions from an older version, and stale attempts, which
must be refused), aborts, spills the head whatever its size (levels stacked or taken in),
and runs maintenance that spills, writes snapshots, compacts and deletes old files. Every
read of a store must give exactly what its version held when it was opened, plus, for a
writing store, its own updates (an iteration sees them as they were when it began;
``statecore.file_stores.FileStore``): ``get`` of a few keys, present and absent, ``get_batch``
of keys repeated and absent, a whole ``iterator()`` or ``iter_batches``, and the key count.

Only the public store API is used, and the module constants that make spills, compactions
and deep stacks of levels happen at a few dozen keys (``small_spills``), so that the test
holds whatever the in-memory versions look like inside. Keys come from a small range (they
collide in few buckets) and a few far apart (key filters rule them out or not); values are of
fixed width. Deterministic (``derandomize=True``); ``STATECORE_STATEFUL_EXAMPLES`` raises the
number of examples for a longer local run. The focused tests at the end force the
interleavings the machine reaches only by chance.
"""
import contextlib
import dataclasses
import os
import shutil
import tempfile
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import statecore.provider
import statecore.spill
from statecore import (CommitConflictError, IllegalStateError, StateStoreConf, StateStoreId, VersionNotFoundError,
                       create_and_init_provider)

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
NEAR = list(range(12))  # a small key space: keys collide in a few buckets
FAR = [1 << 40, -(1 << 52), (1 << 62) + 3]  # far apart from the rest and from each other
NEVER = [12, -1, 1 << 41, -(1 << 62)]  # never written: absent from every version
CONF = dict(min_deltas_for_snapshot=2, min_versions_to_retain=4, max_versions_to_retain_in_memory=2)
RETAIN = CONF["min_versions_to_retain"]
MAX_OPEN = 6

keys_st = st.sampled_from(NEAR + FAR)
probe_st = st.sampled_from(NEAR + FAR + NEVER)
# how far below the newest retained version a store opens: mostly the newest (the next batch)
back_st = st.sampled_from([0, 0, 0, 1, 2, RETAIN + 1])
values_st = st.tuples(st.integers(-5, 5), st.sampled_from([0.0, 0.5, -1.25, 3.0]))


@contextlib.contextmanager
def small_spills(spill=True, ratio=0, hard_ratio=None, compact=False, stack=False):
    """The engine's size thresholds set for a state of a few dozen keys: with ``spill``, any
    non-empty head is due to be spilled (``ratio`` of the state, and the commit's own spill
    past ``hard_ratio``); with ``compact``, changes past half the state are due for a
    snapshot or a compaction; with ``stack``, a spill never takes in the levels below it."""
    patches = {}
    if spill:
        patches.update(SPILL_MIN_ROWS=-1, SPILL_RATIO=ratio)
        if hard_ratio is not None:
            patches["SPILL_HARD_RATIO"] = hard_ratio
    if compact:
        patches["HEAD_SNAPSHOT_MIN_ROWS"] = 0
    with contextlib.ExitStack() as stack_:
        if patches:
            stack_.enter_context(mock.patch.multiple(statecore.provider, **patches))
        if stack:
            stack_.enter_context(mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0))
        yield


def keys_array(ks):
    out = np.zeros(len(ks), KEY)
    out["k"] = ks
    return out


def values_array(vs):
    out = np.zeros(len(vs), VALUE)
    out["n"] = [v[0] for v in vs]
    out["x"] = [v[1] for v in vs]
    return out


def as_value(v):
    return None if v is None else (int(v[0]), float(v[1]))


def check_rows(store, expected, ks, as_tuples, what):
    """``get`` of each key (as an int or a 1-tuple) gives its value in ``expected``, or None."""
    for k in ks:
        got = as_value(store.get((k,) if as_tuples else k))
        assert got == expected.get(k), f"{what}: get({k}) gave {got}, expected {expected.get(k)}"


def check_batch(store, expected, ks, what):
    """``get_batch`` of ``ks`` (repeats and absent keys allowed) gives each key's value, or
    not found; returns what it read, a value or None per key."""
    values, found = store.get_batch(keys_array(ks))
    got = [as_value(v) if f else None for v, f in zip(values.tolist(), found.tolist())]
    assert got == [expected.get(k) for k in ks], f"{what}: get_batch({ks}) gave {got}"
    return got


def check_count(store, expected, what):
    assert store.metrics.num_keys == len(expected), f"{what}: counts {store.metrics.num_keys}, holds {len(expected)}"


class Iteration:
    """An iteration of a store, taken a step at a time: ``iterator()`` (a step is one item) or
    ``iter_batches(rows)`` (a step is one batch); ``expected``: the store's contents when it began."""

    def __init__(self, opened, rows_per_batch):
        self.opened = opened
        self.expected = dict(opened.contents)
        self.what = f"{opened.what}, {'iterator()' if rows_per_batch is None else f'iter_batches({rows_per_batch})'}"
        if rows_per_batch is None:
            self.items = opened.store.iterator()
        else:
            self.items = ((int(k), as_value(v)) for keys, values in opened.store.iter_batches(rows_per_batch)
                          for (k,), v in zip(keys.tolist(), values.tolist()))
        self.seen = {}
        self.done = False

    def step(self, n):
        """Take ``n`` more steps; at the end, check that every key of its version came once."""
        for _ in range(n):
            item = next(self.items, None)
            if item is None:
                self.done = True
                assert self.seen == self.expected, f"{self.what}: iterated {self.seen}, expected {self.expected}"
                return
            key, value = item
            k = int(key[0]) if isinstance(key, tuple) else key
            assert k not in self.seen, f"{self.what}: key {k} iterated twice"
            self.seen[k] = as_value(value)

    def finish(self):
        while not self.done:
            self.step(64)

    def abandon(self):
        self.items.close()


@dataclasses.dataclass
class Opened:
    """A store the machine holds open, and what its reads must give (``contents``)."""

    store: object
    version: int  # the version it opened
    writable: bool
    opened_after: int  # commits made before it opened
    contents: dict
    committed: bool = False
    serial: int = 0

    @property
    def what(self):
        kind = "committed store" if self.committed else ("writing store" if self.writable else "read store")
        return f"{kind} #{self.serial} of version {self.version}"


class PinnedReadsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="statecore-pinned-")
        self.conf = StateStoreConf(local_cache_dir=os.path.join(self.root, "cache"), **CONF)
        self.p = create_and_init_provider(StateStoreId(os.path.join(self.root, "state"), 0, 0), KEY, VALUE, self.conf)
        self.model = {0: {}}  # the default lineage: version -> contents
        self.born = {0: 0}  # version -> the number of commits made when it was committed
        self.commits = 0
        self.high_water = 0  # the newest version any maintenance pass saw (cleanup's window)
        self.opened = []
        self.iterations = []
        self.serial = 0

    def teardown(self):
        for it in self.iterations:
            it.abandon()
        for o in self.opened:
            o.store.abort()
        self.p.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the model -------------------------------------------------------------------------
    @property
    def top(self):
        return max(self.model)

    def retained(self, back):
        """The version ``back`` steps below the newest, among those every open must still
        find: cleanup keeps ``min_versions_to_retain`` below the newest version any pass
        saw, and a re-execution brings nothing back."""
        floor = max(self.top, self.high_water) - RETAIN
        retained = [v for v in sorted(self.model) if v >= floor]
        return retained[max(len(retained) - 1 - back, 0)]

    @staticmethod
    def pick(candidates, i):
        return candidates[i % len(candidates)]

    def updating(self):
        return [o for o in self.opened if o.writable and not o.committed]

    def add_version(self, version, contents):
        """``version`` committed with ``contents``: the versions above the one it follows
        are abandoned (a re-execution)."""
        self.commits += 1
        self.model = {v: c for v, c in self.model.items() if v < version}
        self.model[version] = contents
        self.born[version] = self.commits

    @initialize(batches=st.lists(st.dictionaries(keys_st, values_st, min_size=1, max_size=12), min_size=1, max_size=4))
    def first_versions(self, batches):
        for items in batches:
            self.next_batch(items, [], spilling=False)

    def next_batch(self, items, gone, spilling):
        """Another task commits the version after the newest (one put_batch, one remove_batch)
        while the machine's stores stay open."""
        v = self.top
        store = self.p.get_store(v)
        store.put_batch(keys_array(list(items)), values_array(list(items.values())))
        store.remove_batch(keys_array(gone))
        with small_spills(hard_ratio=0) if spilling else contextlib.nullcontext():
            assert store.commit() == v + 1
        store.abort()
        contents = dict(self.model[v])
        contents.update(items)
        for k in gone:
            contents.pop(k, None)
        self.add_version(v + 1, contents)

    # -- stores: open (pin), update, commit, close (unpin) -----------------------------------
    @rule(i=st.integers(0, MAX_OPEN - 1), how=st.sampled_from(["open writing", "open reading", "close"]),
          back=back_st)
    def open_or_close(self, i, how, back):
        """Open a writing or a read store at a retained version (it pins it), or close one
        (``close``, or when MAX_OPEN are open)."""
        if how == "close" or len(self.opened) >= MAX_OPEN:
            if self.opened:
                self.close(self.pick(self.opened, i))
            return
        v = self.retained(back)
        writable = how == "open writing"
        store = self.p.get_store(v) if writable else self.p.get_read_store(v)
        assert store.version == v
        self.serial += 1
        self.opened.append(Opened(store, v, writable, self.commits, dict(self.model[v]), serial=self.serial))

    def close(self, o):
        """Abort (unpin) a store, abandoning its iterations first."""
        for it in [it for it in self.iterations if it.opened is o]:
            it.abandon()
            self.iterations.remove(it)
        o.store.abort()
        self.opened.remove(o)

    @precondition(lambda self: self.updating())
    @rule(i=st.integers(0, MAX_OPEN - 1), data=st.data(),
          how=st.sampled_from(["put_batch", "commit", "put", "remove", "remove_batch", "read_modify_write",
                               "commit spilling"]))
    def write(self, i, how, data):
        """An update of a writing store, per row (the key as an int or a 1-tuple) or by batch
        (``read_modify_write``: one ``get_batch`` of some keys, then one ``put_batch`` of the
        same keys, as a counting fn does: when it is the store's first write, its commit takes
        the priors from that read); or its commit."""
        o = self.pick(self.updating(), i)
        if how.startswith("commit"):
            self.commit(o, spilling=how == "commit spilling")
        elif how == "put":
            k, value = data.draw(keys_st), data.draw(values_st)
            o.store.put((k,) if data.draw(st.booleans()) else k, value)
            o.contents[k] = value
        elif how == "remove":
            k = data.draw(probe_st)
            o.store.remove((k,) if data.draw(st.booleans()) else k)
            o.contents.pop(k, None)
        elif how == "put_batch":
            items = data.draw(st.dictionaries(keys_st, values_st, min_size=1, max_size=10))
            o.store.put_batch(keys_array(list(items)), values_array(list(items.values())))
            o.contents.update(items)
        elif how == "remove_batch":
            ks = data.draw(st.lists(probe_st, min_size=1, max_size=8))
            o.store.remove_batch(keys_array(ks))
            for k in ks:
                o.contents.pop(k, None)
        else:
            ks = data.draw(st.lists(keys_st, min_size=1, max_size=8, unique=True))
            read = check_batch(o.store, o.contents, ks, o.what)
            new = {k: (1, 0.0) if v is None else (v[0] + 1, v[1] + 0.5) for k, v in zip(ks, read)}
            o.store.put_batch(keys_array(ks), values_array(list(new.values())))
            o.contents.update(new)

    def commit(self, o, spilling):
        """Commit a writing store of version v. When no commit went past it since it opened,
        that makes v + 1 (abandoning the versions above v, if any: a re-execution), and the
        store then reads the version it made and refuses updates; ``spilling``: the head is
        due to be spilled at any size, and a commit after one that asked spills it itself.
        A late attempt (v + 1 was committed, and built on, since it opened) is refused, and
        the store reads what it read; any other is given up (aborted): its commit would be
        a second attempt of v + 1, which the default lineage takes by the files' times."""
        if o.opened_after == self.commits:
            with small_spills(hard_ratio=0) if spilling else contextlib.nullcontext():
                assert o.store.commit() == o.version + 1
            self.add_version(o.version + 1, o.contents)
            o.committed = True
            with pytest.raises(IllegalStateError):
                o.store.put(0, (0, 0.0))
        elif self.top > o.version + 1 and self.born[self.top] > o.opened_after:
            with pytest.raises(CommitConflictError):
                o.store.commit()
        else:
            self.close(o)

    # -- spills and maintenance -----------------------------------------------------------------
    @rule(how=st.sampled_from(["next batch", "next batch spilling", "spill", "spill stacked", "maintenance",
                               "maintenance spilling", "maintenance stacking", "maintenance compacting"]),
          data=st.data())
    def background(self, how, data):
        """What happens while stores are open and iterations held: another task commits the
        next batch; or the registry's thread spills the head (whatever its size; the levels
        below taken in, or stacked), or runs a maintenance pass: as configured, or spilling
        any head, or with changes past half the state due for a snapshot or a compaction."""
        if how.startswith("next batch"):
            self.next_batch(data.draw(st.dictionaries(keys_st, values_st, max_size=8)),
                            data.draw(st.lists(probe_st, max_size=4)), spilling=how.endswith("spilling"))
        elif how.startswith("spill"):
            with small_spills(stack=how == "spill stacked"):
                self.p.spill_if_outgrown(0)
        else:
            self.high_water = max(self.high_water, self.top)
            with small_spills(spill=how != "maintenance", compact=how.endswith("compacting"),
                              stack=how.endswith("stacking")):
                self.p.do_maintenance()

    # -- reads ------------------------------------------------------------------------------------
    @rule(i=st.integers(0, MAX_OPEN - 1), how=st.sampled_from(["rows", "batch", "all", "fresh"]), data=st.data())
    def read(self, i, how, data):
        """Read an open store: ``get`` of a few keys (present, absent, far apart); ``get_batch``
        of keys with two repeated; or a whole iteration (``iterator()`` or ``iter_batches``)
        and the key count. ``fresh`` (and with no store open): a read store opened afresh at
        a retained version (from memory, or loaded from files after spills, snapshots and
        cleanup) read all three ways, then closed."""
        if how == "fresh" or not self.opened:
            v = self.retained(data.draw(back_st))
            store = self.p.get_read_store(v)
            try:
                o = Opened(store, v, False, self.commits, self.model[v])
                check_rows(store, o.contents, data.draw(st.lists(probe_st, min_size=1, max_size=6)), False, o.what)
                check_batch(store, o.contents, NEVER + NEAR + FAR, o.what)
                Iteration(o, None).finish()
                check_count(store, o.contents, o.what)
            finally:
                store.abort()
            return
        o = self.pick(self.opened, i)
        if how == "rows":
            check_rows(o.store, o.contents, data.draw(st.lists(probe_st, min_size=1, max_size=6)),
                       data.draw(st.booleans()), o.what)
        elif how == "batch":
            ks = data.draw(st.lists(probe_st, min_size=1, max_size=12))
            check_batch(o.store, o.contents, ks + ks[:2], o.what)
        else:
            Iteration(o, data.draw(st.one_of(st.none(), st.integers(1, 5)))).finish()
            check_count(o.store, o.contents, o.what)

    @precondition(lambda self: self.opened)
    @rule(i=st.integers(0, 10), how=st.sampled_from(["start", "step", "step", "finish", "abandon"]), data=st.data())
    def iterate(self, i, how, data):
        """Start an iteration of an open store, taking its first step only (the rest comes
        after other rules ran: commits, spills, maintenance, updates of the store itself);
        or take a few more steps of one, finish it, or abandon it."""
        if how == "start" or not self.iterations:
            it = Iteration(self.pick(self.opened, i), data.draw(st.one_of(st.none(), st.integers(1, 3))))
            it.step(1)
            if not it.done:
                self.iterations.append(it)
            return
        it = self.pick(self.iterations, i)
        if how == "abandon":
            it.abandon()
        elif how == "finish":
            it.finish()
        else:
            it.step(data.draw(st.integers(1, 4)))
        if how == "abandon" or it.done:
            self.iterations.remove(it)

EXAMPLES = int(os.environ.get("STATECORE_STATEFUL_EXAMPLES", "60"))

PinnedReadsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=60, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_pinned_reads_machine = PinnedReadsMachine.TestCase
