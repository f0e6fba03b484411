"""Pinned versions read three ways (per row, in batches, by iteration) while commits, spills
and maintenance run, against a dict model of every committed version.

The state machine holds several stores of one provider open at once: read stores and writing
stores at any retained version (each pins it), writing stores that committed (they then read
the version they made) and iterations of any of them taken a few keys at a time. Between
those reads it commits (also re-executions from an older version, and stale attempts, which
must be refused), aborts, spills the head whatever its size (levels stacked or taken in),
and runs maintenance that spills, writes snapshots, compacts and deletes old files. Every
read of a store must give exactly what its version held when it was opened, plus, for a
writing store, its own updates (an iteration sees them as they were when it began, as
``FileStore._iteration_layers`` says): ``get`` of a few keys, present and absent, ``get_batch``
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
import threading
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import statecore.held_versions
import statecore.spill
import statecore.stores
from statecore import (CommitConflictError, IllegalStateError, StateStoreConf, StateStoreId, VersionNotFoundError,
                       create_and_init_provider)
from statecore._versions import State
from tests.store_support import (WAIT_S, applied, assert_reads, commit_numbered, commit_upto, committed, contents,
                                 open_numbered, write_batch)
from tests.engine.test_store_stateful import KEY, VALUE, keys_array, values_array  # key k, value (n: int64, x: float64)

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
# a writing store's updates (PinnedReadsMachine.update)
UPDATES = ["put_batch", "put", "remove", "remove_batch", "read_modify_write"]
# what happens beside the machine's stores (PinnedReadsMachine.background)
background_st = st.sampled_from(["next batch", "next batch spilling", "spill", "spill stacked", "maintenance",
                                 "maintenance spilling", "maintenance stacking", "maintenance compacting", "rerun"])
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
            stack_.enter_context(mock.patch.multiple(statecore.held_versions, **patches))
        if stack:
            stack_.enter_context(mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0))
        yield


def open_provider(root, **conf):
    """A provider of ``root`` whose spills go to ``root/cache`` (see :func:`mapped_images`)."""
    conf = dict(CONF, local_cache_dir=os.path.join(str(root), "cache"), **conf)
    return create_and_init_provider(StateStoreId(os.path.join(str(root), "state"), 0, 0), KEY, VALUE,
                                    StateStoreConf(**conf))


def commit_from(p, version, puts, removes):
    """A task's store of ``version`` commits one ``put_batch`` of ``puts`` ({k: value}) and one
    ``remove_batch`` of ``removes``, then is aborted by its completion hook."""
    store = p.get_store(version)
    write_batch(store, KEY, VALUE, puts, list(removes))
    assert store.commit() == version + 1
    store.abort()


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
    """An iteration of ``store`` (``what``, in messages), taken a key at a time: ``iterator()``,
    or ``iter_batches`` of ``rows_per_batch`` rows; it must give ``expected`` (copied now)."""

    def __init__(self, store, expected, what, rows_per_batch):
        self.store = store
        self.expected = dict(expected)
        if rows_per_batch is None:
            self.what = f"{what}, iterator()"
            self.source = self.items = store.iterator()
        else:
            self.what = f"{what}, iter_batches({rows_per_batch})"
            self.source = store.iter_batches(rows_per_batch)
            self.items = ((int(k), as_value(v)) for keys, values in self.source
                          for (k,), v in zip(keys.tolist(), values.tolist()))
        self.seen = {}
        self.done = False

    def step(self, n):
        """Take ``n`` more keys; at the end, check that every key of its version came once."""
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
        self.source.close()


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
        if self.committed:
            return f"store #{self.serial}, opened at version {self.version}, committed {self.version + 1}"
        return f"{'writing' if self.writable else 'read'} store #{self.serial} of version {self.version}"


class PinnedReadsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="statecore-pinned-")
        self.p = open_provider(self.root)
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

    def next_batch(self, items, gone, spilling, version=None):
        """Another task commits the version after ``version`` (the newest by default; below
        it, a batch re-executed) while the machine's stores stay open."""
        v = self.top if version is None else version
        with small_spills(hard_ratio=0) if spilling else contextlib.nullcontext():
            commit_from(self.p, v, items, gone)
        self.add_version(v + 1, applied(self.model[v], items, gone))

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
        for it in [it for it in self.iterations if it.store is o.store]:
            it.abandon()
            self.iterations.remove(it)
        o.store.abort()
        self.opened.remove(o)

    @precondition(lambda self: self.updating())
    @rule(i=st.integers(0, MAX_OPEN - 1), data=st.data(),
          how=st.sampled_from(["put_batch", "commit", "put", "remove", "remove_batch", "read_modify_write",
                               "commit spilling"]))
    def write(self, i, how, data):
        """Update a writing store, or commit it."""
        self.update(self.pick(self.updating(), i), how, data)

    def update(self, o, how, data):
        """An update of writing store ``o``, per row (the key as an int or a 1-tuple) or by
        batch (``read_modify_write``: one ``get_batch`` of some keys, then one ``put_batch`` of
        the same keys, as a counting fn does: when it is the store's first write, its commit
        takes the priors from that read); or its commit."""
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
        a second attempt of v + 1 (the default lineage then follows the files' times), or a
        version over an attempt of v that a re-execution deleted (see the last test below)."""
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
    @rule(how=background_st, data=st.data())
    def background(self, how, data):
        """What happens while stores are open and iterations held: another task commits the
        next batch, or re-executes an older one (``rerun``: the versions above it are
        abandoned); or the registry's thread spills the head (whatever its size; the levels
        below taken in, or stacked), or runs a maintenance pass: as configured, or spilling
        any head, or with changes past half the state due for a snapshot or a compaction."""
        if how.startswith("next batch") or how == "rerun":
            self.next_batch(data.draw(st.dictionaries(keys_st, values_st, max_size=8)),
                            data.draw(st.lists(probe_st, max_size=4)), spilling=how.endswith("spilling"),
                            version=self.retained(data.draw(st.integers(1, RETAIN + 1))) if how == "rerun" else None)
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
                what = f"a read store of version {v} opened afresh"
                check_rows(store, self.model[v], data.draw(st.lists(probe_st, min_size=1, max_size=6)), False, what)
                check_batch(store, self.model[v], NEVER + NEAR + FAR, what)
                Iteration(store, self.model[v], what, None).finish()
                check_count(store, self.model[v], what)
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
            Iteration(o.store, o.contents, o.what, data.draw(st.one_of(st.none(), st.integers(1, 5)))).finish()
            check_count(o.store, o.contents, o.what)

    @precondition(lambda self: self.opened)
    @rule(i=st.integers(0, 10), how=st.sampled_from(["start", "across", "step", "finish", "abandon"]),
          data=st.data())
    def iterate(self, i, how, data):
        """Start an iteration of an open store, taking its first step only (the rest comes
        after other rules ran: commits, spills, maintenance, updates of the store itself);
        ``across``: start one, then another store commits the next batch, and up to two more
        things happen (commits, spills, maintenance, updates of the store iterated), then
        finish it; or take a few more steps of one, finish it, or abandon it."""
        if how in ("start", "across") or not self.iterations:
            o = self.pick(self.opened, i)
            it = Iteration(o.store, o.contents, o.what, data.draw(st.one_of(st.none(), st.integers(1, 3))))
            it.step(1)
            if how == "across":
                self.background("next batch", data)
                for _ in range(data.draw(st.integers(0, 2))):
                    then = data.draw(st.one_of(background_st, st.sampled_from(UPDATES)))
                    if then not in UPDATES:
                        self.background(then, data)
                    elif o.writable and not o.committed:
                        self.update(o, then, data)
                it.finish()
            elif not it.done:
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


EXAMPLES = int(os.environ.get("STATECORE_STATEFUL_EXAMPLES", "100"))

PinnedReadsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=60, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_pinned_reads_machine = PinnedReadsMachine.TestCase


# -- focused interleavings ---------------------------------------------------------------------
def state_files(root):
    return sorted(os.listdir(os.path.join(str(root), "state", "0", "0")))


def mapped_images(root):
    """The files under ``root/cache`` this process has mapped (a spill's images are mapped
    there, and unlinked at once): a new one shows that a spill happened."""
    cache = os.path.join(str(root), "cache")
    with open("/proc/self/maps") as f:
        fields = [line.split(None, 5) for line in f]
    return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith(cache)}


def spill(p, root, stack=False):
    """Spill the head now, whatever its size; asserts that a new image was mapped."""
    before = mapped_images(root)
    with small_spills(stack=stack):
        p.spill_if_outgrown(0)
    assert mapped_images(root) - before, "no spill was made"


def commit_next(p, model, puts, removes=()):
    """Commit the version after the newest in ``model`` and add it there."""
    v = max(model)
    commit_from(p, v, puts, removes)
    model[v + 1] = applied(model[v], puts, removes)


def check_three_ways(store, expected, what):
    check_rows(store, expected, NEAR + FAR + NEVER, False, what)
    check_batch(store, expected, NEVER + FAR + NEAR + NEAR[:3], what)
    for rows_per_batch in (None, 2):
        Iteration(store, expected, what, rows_per_batch).finish()
    check_count(store, expected, what)


def first_three_versions(p):
    """Versions 1 to 3: every NEAR and FAR key put, then changed, removed and put back."""
    model = {0: {}}
    commit_next(p, model, {k: (k, 0.0) for k in NEAR + FAR})
    commit_next(p, model, {k: (k, 1.0) for k in NEAR[:6]}, removes=NEAR[9:] + FAR[:1])
    commit_next(p, model, {k: (k, 2.0) for k in NEAR[4:10]}, removes=NEAR[:2])
    return model


def test_an_iteration_held_across_a_commit_a_spill_and_a_snapshot_returns_its_version(tmp_path):
    """A fn iterates an older version (read today from the newer version's undo layer, then
    the head) and a writing store iterates its own updates over the newest, each one step
    in, while the next batch commits, the head is spilled, two more batches commit and
    maintenance writes a snapshot: each iteration, finished after all that, gives exactly
    what it began on; the writing store's puts made meanwhile are not in it, and both stores
    still read their versions."""
    p = open_provider(tmp_path, min_versions_to_retain=10)
    model = first_three_versions(p)
    reader = p.get_read_store(2)
    held = Iteration(reader, model[2], "the read store of version 2", None)
    held.step(1)
    writer = p.get_store(3)
    writer.put_batch(keys_array(NEAR[:3]), values_array([(-1, 0.5)] * 3))
    writer.remove(7)
    mine = {k: v for k, v in {**model[3], **{k: (-1, 0.5) for k in NEAR[:3]}}.items() if k != 7}
    held_batches = Iteration(writer, mine, "the writing store of version 3", 2)
    held_batches.step(1)
    # after the iteration began (not in it): a key put back, one changed, one removed
    writer.put_batch(keys_array([FAR[0], NEAR[8]]), values_array([(9, 9.0)] * 2))
    writer.remove(FAR[1])
    mine = applied(mine, {FAR[0]: (9, 9.0), NEAR[8]: (9, 9.0)}, [FAR[1]])

    commit_next(p, model, {k: (k, 4.0) for k in NEAR[6:]}, removes=NEAR[2:4])
    spill(p, tmp_path)
    commit_next(p, model, {k: (k, 5.0) for k in FAR}, removes=NEAR[5:7])
    commit_next(p, model, {k: (k, 6.0) for k in NEAR[:4]})
    assert not [n for n in state_files(tmp_path) if n.endswith(".snapshot")]
    p.do_maintenance()
    assert [n for n in state_files(tmp_path) if n.endswith(".snapshot")] == \
        [n for n in state_files(tmp_path) if n.startswith("6_") and n.endswith(".snapshot")] != []

    held.finish()
    held_batches.finish()
    check_three_ways(reader, model[2], "the read store of version 2")
    check_three_ways(writer, mine, "the writing store of version 3")
    check_three_ways(p.get_read_store(6), model[6], "version 6")


def test_a_store_pinned_at_a_version_reads_it_after_two_spills_a_snapshot_and_cleanup(tmp_path):
    """Read stores opened at versions 2 and 3 stay open while the head is spilled twice (the
    second a level stacked over the first), a snapshot of version 6 replaces what the state
    stood on and cleanup deletes the files of version 2: both read their version three ways,
    and versions 3 and 6 opened afresh read the same as the model."""
    p = open_provider(tmp_path, min_versions_to_retain=2)
    model = first_three_versions(p)
    p.do_maintenance()  # a snapshot of 3, which cleanup later keeps as its base
    assert [n for n in state_files(tmp_path) if n.endswith(".snapshot")][0].startswith("3_")
    pinned = {v: p.get_read_store(v) for v in (2, 3)}
    commit_next(p, model, {k: (k, 4.0) for k in NEAR[::2]}, removes=FAR[1:2])
    spill(p, tmp_path)
    commit_next(p, model, {k: (k, 5.0) for k in NEAR[:3]}, removes=NEAR[3:4])
    spill(p, tmp_path, stack=True)
    commit_next(p, model, {k: (k, 6.0) for k in FAR}, removes=NEAR[4:6])
    p.do_maintenance()
    files = state_files(tmp_path)
    assert any(n.startswith("6_") and n.endswith(".snapshot") for n in files), files
    assert not any(n.startswith(("1_", "2_")) for n in files), f"cleanup left {files}"
    for v, store in pinned.items():
        check_three_ways(store, model[v], f"the read store pinned at version {v}")
    for v in (3, 6):
        check_three_ways(p.get_read_store(v), model[v], f"version {v} opened afresh")


def test_a_re_execution_leaves_the_readers_of_the_abandoned_versions_their_versions(tmp_path):
    """Batch 3 runs again (a store of version 3 commits 4 while 4 and 5 exist) while read
    stores hold versions 4 and 5, one of them iterating, and the head was spilled: the
    abandoned run's files go, fresh stores read the new lineage, and the held stores (and
    the iteration) still give the versions they opened, also after the new run's next
    batch, a spill and maintenance."""
    p = open_provider(tmp_path, min_versions_to_retain=10)
    model = first_three_versions(p)
    commit_next(p, model, {k: (k, 4.0) for k in NEAR[:5]})
    commit_next(p, model, {k: (k, 5.0) for k in FAR}, removes=NEAR[5:8])
    abandoned = {v: model[v] for v in (4, 5)}
    pinned = {v: p.get_read_store(v) for v in (4, 5)}
    held = Iteration(pinned[4], abandoned[4], "the read store of the abandoned version 4", None)
    held.step(1)
    spill(p, tmp_path)
    rerun = p.get_store(3)
    rerun.put_batch(keys_array(NEAR[8:]), values_array([(-8, 0.5)] * 4))
    assert rerun.commit() == 4
    del model[5]
    model[4] = {**model[3], **{k: (-8, 0.5) for k in NEAR[8:]}}
    assert [n for n in state_files(tmp_path) if n.startswith(("4_", "5_"))] == [f"4_{rerun.commit_id}.delta"]
    with pytest.raises(VersionNotFoundError):
        p.get_read_store(5)
    check_three_ways(rerun, model[4], "the re-executed store, committed")
    commit_next(p, model, {k: (k, 55.0) for k in NEAR[:2]})
    spill(p, tmp_path)
    with small_spills(compact=True):
        p.do_maintenance()
    held.finish()
    for v, store in pinned.items():
        check_three_ways(store, abandoned[v], f"the read store of the abandoned version {v}")
    for v in (4, 5):
        check_three_ways(p.get_read_store(v), model[v], f"version {v} of the new run")



def test_a_late_commit_on_an_attempt_a_re_execution_replaced_leaves_the_newest_version_loadable(tmp_path):
    """A task opens version 2 (attempt A); batch 1 is re-executed meanwhile (version 2 is now
    attempt B, and A's file is deleted); then the late task commits. Whether that commit is
    refused or not, the default lineage's newest version must still load from the files
    (docs/provider-rules.md: every version on the default lineage loads).

    Fails on main (4d14748): the commit succeeds and writes version 3 over the deleted A, so
    a fresh provider's load of version 3 raises VersionNotFoundError naming A's delta. The
    machine above gives such a store up instead of committing it."""
    p = open_provider(tmp_path)
    model = {0: {}}
    commit_next(p, model, {1: (1, 0.0)})
    commit_next(p, model, {2: (2, 0.0)})
    late = p.get_store(2)
    del model[2]
    commit_next(p, model, {3: (3, 0.0)})  # batch 1 again: version 2 is another attempt now
    late.put(4, (4, 0.0))
    try:
        late.commit()
    except CommitConflictError:
        pass
    fresh = open_provider(tmp_path)
    newest = max(int(n.split("_")[0]) for n in state_files(tmp_path) if n.endswith(".delta"))
    store = fresh.get_read_store(newest)
    store.abort()


@pytest.mark.parametrize("reader", ["read_store", "store"])
@pytest.mark.parametrize("target", ["newest", "older"])
def test_iteration_returns_its_version_while_other_stores_commit(tmp_path, monkeypatch, target, reader):
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=2, max_versions_to_retain_in_memory=3)
    p.do_maintenance()  # version 3 on a mapped snapshot: the iteration crosses layers and base
    commit_upto(p, model, 4)
    v = 4 if target == "newest" else 3

    reached, go = threading.Event(), threading.Event()
    original = State.iter_rows
    iterating_thread = []

    def blocking_iter_rows(self, version, extra_layers=(), chunk_rows=1 << 16):
        hooked = threading.current_thread() in iterating_thread and not reached.is_set()
        for chunk in original(self, version, extra_layers, chunk_rows=3 if hooked else chunk_rows):
            yield chunk
            if hooked and not reached.is_set():
                reached.set()  # one chunk out, the rest still to copy
                assert go.wait(WAIT_S)

    monkeypatch.setattr(statecore.stores, "iter_state_rows", blocking_iter_rows)
    result, errors = {}, []
    opened = p.get_read_store(v) if reader == "read_store" else p.get_store(v)

    def iterate():
        try:
            result.update(contents(opened))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=iterate)
    iterating_thread.append(t)
    t.start()
    try:
        assert reached.wait(WAIT_S), "the iteration never reached its hook"
        for _ in range(3):  # versions 5, 6, 7 from other stores of the same provider
            commit_numbered(p, model)
        assert t.is_alive() and not go.is_set(), "the commits did not overlap the iteration"
    finally:
        go.set()
        t.join(WAIT_S)
    assert not t.is_alive()
    assert not errors, f"the iteration raised {errors[0]!r}"
    assert result == model[v], f"the iteration of version {v} did not return exactly version {v}'s rows"
    opened.abort()
    for u in (5, 6, 7):
        assert_reads(p, u, model[u])
    for u in range(1, 8):
        assert_reads(open_numbered(tmp_path), u, model[u])
