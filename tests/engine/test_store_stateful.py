"""The file provider against a dict model, driven by a hypothesis state machine.

The machine keeps one live provider on a store directory and a model of its default
lineage (``{version: {key: value}}``). Its steps: puts and removes (one row, or a batch)
on the open store, commits and aborts, re-executions from an older retained version,
reloads (a fresh provider on the same directory), a switch to another live provider of the
same store (another worker, holding an older version), maintenance with a small snapshot
cadence and retention window (and spills of the head whatever its size, by maintenance or
by a commit past the hard limit), one flipped byte in any file (every load then either
returns the model's data or raises StateCorruptionError naming that file; maintenance runs
over it; then the bytes are restored and every retained version must load), and an
iteration of a version while another store commits.

Deterministic (``derandomize=True``) and bounded (``max_examples``, ``stateful_step_count``):
it runs in well under a minute. ``STATECORE_STATEFUL_EXAMPLES`` raises the number of
examples for a longer local run.
"""
import contextlib
import os
import re
import shutil
import tempfile
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.store_support import contents
from statecore import (StateCorruptionError, StateStoreConf, StateStoreId, VersionNotFoundError,
                       create_and_init_provider)

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
KEY_SPACE = 16
CONF = dict(min_deltas_for_snapshot=2, min_versions_to_retain=3, max_versions_to_retain_in_memory=2)
RETAIN = CONF["min_versions_to_retain"]

keys_st = st.integers(0, KEY_SPACE - 1)
values_st = st.tuples(st.integers(-5, 5), st.sampled_from([0.0, 0.5, -1.25, 3.0]))


def keys_array(ks):
    out = np.zeros(len(ks), KEY)
    out["k"] = ks
    return out


def values_array(vs):
    out = np.zeros(len(vs), VALUE)
    out["n"] = [v[0] for v in vs]
    out["x"] = [v[1] for v in vs]
    return out


ALL_KEYS = keys_array(list(range(-1, KEY_SPACE + 1)))


def reads(store):
    """The store's contents, by iteration, checked against its batch lookups."""
    got = contents(store)
    values, found = store.get_batch(ALL_KEYS)
    assert found.tolist() == [int(k) in got for k in ALL_KEYS["k"]], "lookups disagree with the iteration"
    assert [(int(n), float(x)) for n, x in values[found].tolist()] == [got[int(k)] for k in ALL_KEYS["k"][found]]
    return got


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="statecore-stateful-")
        self.dir = os.path.join(self.root, "0", "0")
        self.p = self.make()
        self.other = self.make()  # another worker's provider of the same store, kept alive
        self.model = {0: {}}  # the default lineage: version -> contents
        self.store = None  # the open writable store, its version and its expected contents
        self.base = None
        self.pending = None
        # The newest version any maintenance pass saw: cleanup keeps the versions from
        # (newest - min_versions_to_retain) on at that time, and a re-execution that goes
        # back further does not bring older files back.
        self.high_water = 0

    def make(self, **conf):
        return create_and_init_provider(StateStoreId(self.root, 0, 0), KEY, VALUE,
                                        StateStoreConf(**dict(CONF, **conf)))

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def top(self):
        return max(self.model)

    @property
    def floor(self):
        """The oldest version every load must still find."""
        return max(self.top, self.high_water) - RETAIN

    def retained(self):
        return [v for v in sorted(self.model) if v >= self.floor]

    # -- checking --------------------------------------------------------------------------
    def check_version(self, provider, v, damaged=None):
        """Version ``v`` reads as the model has it; with a damaged file, a load may instead
        raise StateCorruptionError naming it; a version older than the retention window may
        be gone (VersionNotFoundError)."""
        try:
            store = provider.get_read_store(v)
        except StateCorruptionError as e:
            assert damaged is not None and e.path == damaged, f"version {v}: {e}"
            return "corrupt"
        except VersionNotFoundError:
            assert v < self.floor, f"retained version {v} (newest {self.top}) is not found"
            return "gone"
        try:
            got = reads(store)
            num_keys = store.metrics.num_keys
        except StateCorruptionError as e:
            assert damaged is not None and e.path == damaged, f"version {v}: {e}"
            return "corrupt"
        finally:
            store.abort()
        assert got == self.model[v], f"version {v} differs from the model"
        assert num_keys == len(got), f"version {v} counts {num_keys} keys, holds {len(got)}"
        return "correct"

    @invariant()
    def newest_reads_right(self):
        self.check_version(self.p, self.top)

    @invariant()
    def open_store_sees_its_updates(self):
        if self.store is not None:
            assert reads(self.store) == self.pending

    # -- the open store ----------------------------------------------------------------------
    @precondition(lambda self: self.store is None)
    @rule(back=st.integers(0, RETAIN))
    def open_store(self, back):
        # back > 0: a re-execution of a batch from an older retained version
        v = max(self.top - back, self.floor, 0)
        self.store = self.p.get_store(v)
        self.base = v
        self.pending = dict(self.model[v])

    @precondition(lambda self: self.store is not None)
    @rule(k=keys_st, value=values_st)
    def put(self, k, value):
        self.store.put(k, value)
        self.pending[k] = value

    @precondition(lambda self: self.store is not None)
    @rule(k=keys_st)
    def remove(self, k):
        self.store.remove(k)
        self.pending.pop(k, None)

    @precondition(lambda self: self.store is not None)
    @rule(items=st.dictionaries(keys_st, values_st, min_size=1, max_size=10))
    def put_batch(self, items):
        self.store.put_batch(keys_array(list(items)), values_array(list(items.values())))
        self.pending.update(items)

    @precondition(lambda self: self.store is not None)
    @rule(ks=st.lists(keys_st, min_size=1, max_size=8, unique=True))
    def remove_batch(self, ks):
        self.store.remove_batch(keys_array(ks))
        for k in ks:
            self.pending.pop(k, None)

    @precondition(lambda self: self.store is not None)
    @rule(spilling=st.booleans())
    def commit(self, spilling):
        # spilling: the commit spills the head itself, whatever its size, as past the hard
        # limit when an earlier commit asked already and maintenance did not come
        latest = self.p.held.newest
        if spilling and latest is not None:
            latest.spill_asked(latest.version)
        with mock.patch.multiple("statecore.held_versions", SPILL_MIN_ROWS=-1, SPILL_RATIO=0,
                                 SPILL_HARD_RATIO=0) if spilling else contextlib.nullcontext():
            assert self.store.commit() == self.base + 1
        # A re-execution from `base` abandons the versions after it.
        self.model = {v: c for v, c in self.model.items() if v <= self.base}
        self.model[self.base + 1] = self.pending
        self.store = None

    @precondition(lambda self: self.store is not None)
    @rule()
    def abort(self):
        self.store.abort()
        self.store = None

    # -- the provider --------------------------------------------------------------------------
    @precondition(lambda self: self.store is None)
    @rule()
    def reload(self):
        self.p.close()
        self.p = self.make()
        for v in self.retained():
            assert self.check_version(self.p, v) == "correct"

    @precondition(lambda self: self.store is None)
    @rule()
    def switch_worker(self):
        # The next task runs in the other worker, which holds an older version (or none):
        # it reaches the newest by the deltas since, or loads it; either way every retained
        # version reads right.
        self.p, self.other = self.other, self.p
        for v in reversed(self.retained()):
            assert self.check_version(self.p, v) == "correct"

    @rule(which=st.sampled_from(["live", "spill", "fresh", "eager"]))
    def maintenance(self, which):
        # also while a store is open: the registry's thread does not wait for tasks.
        # "spill": the live provider spills its head whatever its size (its reads then go
        # through the spill, and spills take in older ones).
        # "eager": another instance with min_deltas_for_snapshot=0 that holds the newest
        # version, so it writes a snapshot of it; the usual cadence later thins such ones.
        self.high_water = max(self.high_water, self.top)
        if which == "live":
            self.p.do_maintenance()
        elif which == "spill":
            with mock.patch.multiple("statecore.held_versions", SPILL_MIN_ROWS=-1, SPILL_RATIO=0):
                self.p.do_maintenance()
        else:
            other = self.make(min_deltas_for_snapshot=0) if which == "eager" else self.make()
            if which == "eager":
                other.get_read_store(self.top).abort()
            other.do_maintenance()
            other.close()
        for v in self.retained():
            assert self.check_version(self.p, v) == "correct"

    @precondition(lambda self: self.store is None)
    @rule(back=st.integers(0, RETAIN), items=st.dictionaries(keys_st, values_st, min_size=1, max_size=6),
          gone=st.lists(keys_st, max_size=4, unique=True))
    def iterate_while_committing(self, back, items, gone):
        """A store iterates a version, one chunk out, while another store of the provider
        commits the next version of the newest one; the iteration returns its version."""
        v = max(self.top - back, self.floor, 0)
        reader = self.p.get_read_store(v)
        it = reader.iterator()
        seen = {}
        first = next(it, None)
        writer = self.p.get_store(self.top)
        writer.put_batch(keys_array(list(items)), values_array(list(items.values())))
        writer.remove_batch(keys_array(gone))
        assert writer.commit() == self.top + 1
        new = dict(self.model[self.top])
        new.update(items)
        for k in gone:
            new.pop(k, None)
        self.model[self.top + 1] = new
        for (k,), value in ([first] if first is not None else []) + list(it):
            assert int(k) not in seen
            seen[int(k)] = (int(value[0]), float(value[1]))
        reader.abort()
        assert seen == self.model[v], f"the iteration of version {v} did not return version {v}"

    @precondition(lambda self: self.store is None)
    @rule(file_pick=st.integers(0, 10**6), offset_pick=st.integers(0, 10**9))
    def damage_and_repair(self, file_pick, offset_pick):
        # ordered by version and kind first: the ids in the names are random
        names = sorted((n for n in os.listdir(self.dir) if not n.startswith(".")),
                       key=lambda n: (re.sub(r"_[0-9a-f]{16}\.", ".", n), n))
        if not names:
            return
        name = names[file_pick % len(names)]
        path = os.path.join(self.dir, name)
        with open(path, "rb") as f:
            pristine = f.read()
        offset = offset_pick % len(pristine)
        damaged = bytearray(pristine)
        damaged[offset] ^= 0xFF
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            fresh = self.make()
        except StateCorruptionError as e:
            assert e.path == path, f"opening the provider: {e}"
            fresh = None
        for provider in (self.p, fresh):
            if provider is None:
                continue
            for v in sorted(self.model):
                self.check_version(provider, v, damaged=path)
            self.high_water = max(self.high_water, self.top)
            provider.do_maintenance()  # must delete nothing on account of the damage
            for v in self.retained():
                self.check_version(provider, v, damaged=path)
        if os.path.exists(path):
            with open(path, "wb") as f:
                f.write(pristine)
        else:  # an old file cleanup may delete (the loads below show nothing needed went)
            assert name[0].isdigit(), f"maintenance deleted {name}"
        self.p.close()
        self.p = self.make()
        for v in self.retained():
            assert self.check_version(self.p, v) == "correct"


EXAMPLES = int(os.environ.get("STATECORE_STATEFUL_EXAMPLES", "100"))

StoreMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=50, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_store_machine = StoreMachine.TestCase
