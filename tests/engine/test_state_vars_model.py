"""The state variables of a StatefulProcessor (ValueState, ListState, MapState, with and
without a TTL) against plain-Python dicts and lists, driven by a hypothesis state machine.

Each step is one call on a variable (get, exists, put, remove, clear, items, append) over a
few keys and user keys, checked against the model (docs/processor.md). Steps form batches
over the real stores of one partition (tests/store_support.py: Partition), bound through a
``StateHandle`` at the batch's clock; a batch ends in a commit (after the TTL's expiry, as a
processor's batch does), an abort (its changes vanish), or a re-execution (abort, then the
same calls again at a later clock, then a commit); now and then the stores are reloaded from
their files. The clock moves by up to twice the TTL per batch, so that rows expire between
and within batches, interleaved with removes and puts. After every step a map's listing must
be exact: each user key with an entry listed once, in the order it was first put since it
was last absent, and nothing else.

The same machine also drives the maps alone (their calls meet more often). Also: a map
listing a user key twice (state written before the listing was kept exact), calls that
repeat a (key, user key) pair, a TTL-expired entry put again, items() of a key given twice.
"""
import datetime
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pyspark_glue.state_vars import StateHandle
from tests.store_support import Partition

KEY = np.dtype([("k", "<i8")])
USER_KEY = [("u", "<i4")]
VALUE = [("x", "<i8")]
KEYS, USER_KEYS = 2, 3
TTL_US = 10
START_US = 1_000

VALUES = ("value", "ttl_value")
LISTS = ("list", "ttl_list")
MAPS = ("map", "ttl_map")

key_st = st.integers(0, KEYS - 1)
distinct_keys_st = st.lists(key_st, unique=True, max_size=KEYS)
pair_st = st.tuples(key_st, st.integers(0, USER_KEYS - 1))
x_st = st.integers(-99, 99)


def declare(handle, names=VALUES + LISTS + MAPS):
    """The variables ``names`` declared on ``handle`` (those named ``ttl_...`` with a TTL):
    ``{name: variable}``."""
    for name in names:
        ttl = datetime.timedelta(microseconds=TTL_US) if name.startswith("ttl_") else None
        if name in VALUES:
            handle.value(name, VALUE, ttl=ttl)
        elif name in LISTS:
            handle.list(name, VALUE, ttl=ttl)
        else:
            handle.map(name, USER_KEY, VALUE, ttl=ttl)
    return handle.variables


def schemas(names=VALUES + LISTS + MAPS):
    """The stores of the variables ``names`` (not the timers'): ``{store name: (key, value)}``."""
    return {store: schema for variable in declare(StateHandle(KEY), names).values()
            for store, schema in variable.stores().items()}


def keys_of(ks):
    return np.array([(k,) for k in ks], dtype=KEY)


def rows_of(xs, dtype):
    return np.array([(x,) for x in xs], dtype=dtype)


class StateVarsModel(RuleBasedStateMachine):
    """The model: per variable, what its store holds (expired rows included until the end of
    the batch that expires them), each row with its expiry (None without a TTL). The calls
    made are on the variables named in ``DRIVEN``."""

    DRIVEN = VALUES + LISTS + MAPS

    def __init__(self):
        super().__init__()
        # On tmpfs where there is one: the fsyncs of every commit would be most of the run
        # time, and durability is not what this test is about.
        self.tmp = tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.partition = Partition(self.tmp.name, schemas(self.DRIVEN))
        self.now = START_US
        self.committed = self._empty()
        self.model = self._empty()
        self.calls = []  # the calls of the open batch, for a re-execution
        self._open()

    def _empty(self):
        return {name: {} for name in self.DRIVEN}

    @staticmethod
    def _copy(model):
        return {name: {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                       for k, v in rows.items()} for name, rows in model.items()}

    def drives(self, names):
        return bool(set(names) & set(self.DRIVEN))

    def _open(self):
        self.stores = self.partition.open()
        self.handle = StateHandle(KEY, self.stores, self.now)
        self.vars = declare(self.handle, self.DRIVEN)

    def _abort(self):
        for store in self.stores.values():
            store.abort()

    def _expires(self, name):
        return None if self.vars[name].ttl_us is None else self.now + TTL_US

    def _live(self, expires):
        return expires is None or expires > self.now

    # -- the calls: each applied to the variable and the model, reads compared --------------

    def call(self, op, name, *args):
        self.calls.append((op, name, args))
        getattr(self, f"_{op}")(self.vars[name], self.model[name], *args)

    def _value_get(self, var, model, ks):
        values, found = var.get(keys_of(ks))
        expected = [model.get(k) for k in ks]
        assert found.tolist() == [e is not None and self._live(e[1]) for e in expected]
        assert values["x"][found].tolist() == [e[0] for e in expected if e is not None and self._live(e[1])]
        assert var.exists(keys_of(ks)).tolist() == found.tolist()

    def _value_put(self, var, model, ks, xs):
        var.put(keys_of(ks), rows_of(xs, var.dtype))
        for k, x in zip(ks, xs):
            model[k] = (x, self._expires(var.name))

    def _value_clear(self, var, model, ks):
        var.clear(keys_of(ks))
        for k in ks:
            model.pop(k, None)

    def _list_get(self, var, model, ks):
        which, items = var.get(keys_of(ks))
        got = [(ks[w], int(x)) for w, x in zip(which, items["x"])]
        assert got == [(k, x) for k in ks for x, e in model.get(k, []) if self._live(e)]

    def _list_append(self, var, model, ks, xs):
        var.append(keys_of(ks), rows_of(xs, var.dtype))
        for k, x in zip(ks, xs):
            model.setdefault(k, []).append((x, self._expires(var.name)))

    def _list_put(self, var, model, ks, which, xs):
        var.put(keys_of(ks), np.array(which, dtype=np.int64), rows_of(xs, var.dtype))
        for i, k in enumerate(ks):
            new = [(x, self._expires(var.name)) for w, x in zip(which, xs) if w == i]
            if new:
                model[k] = new
            else:
                model.pop(k, None)

    def _list_clear(self, var, model, ks):
        var.clear(keys_of(ks))
        for k in ks:
            model.pop(k, None)

    def _map_get(self, var, model, pairs):
        values, found = var.get(keys_of([k for k, _ in pairs]), rows_of([u for _, u in pairs], var.user_key_dtype))
        expected = [model.get(k, {}).get(u) for k, u in pairs]
        assert found.tolist() == [e is not None and self._live(e[1]) for e in expected]
        assert values["x"][found].tolist() == [e[0] for e in expected if e is not None and self._live(e[1])]

    def _map_put(self, var, model, pairs, xs):
        var.put(keys_of([k for k, _ in pairs]), rows_of([u for _, u in pairs], var.user_key_dtype),
                rows_of(xs, var.dtype))
        for (k, u), x in zip(pairs, xs):  # a dict keeps a present key's place and appends an absent one
            model.setdefault(k, {})[u] = (x, self._expires(var.name))

    def _map_remove(self, var, model, pairs):
        var.remove(keys_of([k for k, _ in pairs]), rows_of([u for _, u in pairs], var.user_key_dtype))
        for k, u in pairs:
            model.get(k, {}).pop(u, None)
            if not model.get(k, True):
                del model[k]

    def _map_items(self, var, model, ks):
        which, user_keys, values = var.items(keys_of(ks))
        got = [(ks[w], int(u), int(x)) for w, u, x in zip(which, user_keys["u"], values["x"])]
        assert got == [(k, u, x) for k in ks for u, (x, e) in model.get(k, {}).items() if self._live(e)], \
            "each live entry once, in the order its user key was first put since it was last absent"

    def _map_clear(self, var, model, ks):
        var.clear(keys_of(ks))
        for k in ks:
            model.pop(k, None)

    # -- the rules ---------------------------------------------------------------------------

    @precondition(lambda self: self.drives(VALUES))
    @rule(name=st.sampled_from(VALUES), ks=st.lists(key_st, max_size=4))
    def value_get(self, name, ks):
        self.call("value_get", name, ks)

    @precondition(lambda self: self.drives(VALUES))
    @rule(name=st.sampled_from(VALUES), kxs=st.lists(st.tuples(key_st, x_st), max_size=4))
    def value_put(self, name, kxs):
        self.call("value_put", name, [k for k, _ in kxs], [x for _, x in kxs])

    @precondition(lambda self: self.drives(VALUES))
    @rule(name=st.sampled_from(VALUES), ks=st.lists(key_st, max_size=3))
    def value_clear(self, name, ks):
        self.call("value_clear", name, ks)

    @precondition(lambda self: self.drives(LISTS))
    @rule(name=st.sampled_from(LISTS), ks=distinct_keys_st)
    def list_get(self, name, ks):
        self.call("list_get", name, ks)

    @precondition(lambda self: self.drives(LISTS))
    @rule(name=st.sampled_from(LISTS), kxs=st.lists(st.tuples(key_st, x_st), max_size=4))
    def list_append(self, name, kxs):
        self.call("list_append", name, [k for k, _ in kxs], [x for _, x in kxs])

    @precondition(lambda self: self.drives(LISTS))
    @rule(name=st.sampled_from(LISTS), ks=st.lists(key_st, unique=True, min_size=1, max_size=KEYS), data=st.data())
    def list_put(self, name, ks, data):
        wxs = data.draw(st.lists(st.tuples(st.integers(0, len(ks) - 1), x_st), max_size=4))
        self.call("list_put", name, ks, [w for w, _ in wxs], [x for _, x in wxs])

    @precondition(lambda self: self.drives(LISTS))
    @rule(name=st.sampled_from(LISTS), ks=distinct_keys_st)
    def list_clear(self, name, ks):
        self.call("list_clear", name, ks)

    @precondition(lambda self: self.drives(MAPS))
    @rule(name=st.sampled_from(MAPS), pairs=st.lists(pair_st, max_size=4))
    def map_get(self, name, pairs):
        self.call("map_get", name, pairs)

    @precondition(lambda self: self.drives(MAPS))
    @rule(name=st.sampled_from(MAPS), pxs=st.lists(st.tuples(pair_st, x_st), max_size=4))
    def map_put(self, name, pxs):
        self.call("map_put", name, [p for p, _ in pxs], [x for _, x in pxs])

    @precondition(lambda self: self.drives(MAPS))
    @rule(name=st.sampled_from(MAPS), pairs=st.lists(pair_st, max_size=4))
    def map_remove(self, name, pairs):
        self.call("map_remove", name, pairs)

    @precondition(lambda self: self.drives(MAPS))
    @rule(name=st.sampled_from(MAPS), ks=distinct_keys_st)
    def map_items(self, name, ks):
        self.call("map_items", name, ks)

    @precondition(lambda self: self.drives(MAPS))
    @rule(name=st.sampled_from(MAPS), ks=distinct_keys_st)
    def map_clear(self, name, ks):
        self.call("map_clear", name, ks)

    # -- the ends of a batch -----------------------------------------------------------------

    def _commit(self):
        """The end of a processor's batch: what the TTL ended leaves the stores, then every
        store commits."""
        self.handle.expire()
        for name, rows in self.model.items():
            for k in list(rows):
                if name in LISTS:
                    kept = [(x, e) for x, e in rows[k] if self._live(e)]
                elif name in MAPS:
                    kept = {u: (x, e) for u, (x, e) in rows[k].items() if self._live(e)}
                else:
                    kept = rows[k] if self._live(rows[k][1]) else None
                if kept:
                    rows[k] = kept
                else:
                    del rows[k]
        self.partition.commit(self.stores)
        self.committed = self._copy(self.model)
        for name, rows in self.model.items():  # what the TTL ended has left the stores, not only the reads
            rows_store = f"{name}.entries" if name in LISTS else name
            assert self.stores[rows_store].metrics.num_keys == sum(len(v) if name not in VALUES else 1
                                                                  for v in rows.values()), name

    def _next_batch(self, advance, reload):
        self.calls = []
        self.now += advance
        if reload:
            self.partition.reload()
        self._open()

    @rule(advance=st.integers(0, 2 * TTL_US), reload=st.booleans())
    def commit(self, advance, reload):
        self._commit()
        self._next_batch(advance, reload)

    @rule(advance=st.integers(0, 2 * TTL_US), reload=st.booleans())
    def abort(self, advance, reload):
        """The batch's changes vanish."""
        self._abort()
        self.model = self._copy(self.committed)
        self._next_batch(advance, reload)

    @rule(later=st.integers(0, TTL_US), advance=st.integers(0, 2 * TTL_US))
    def reexecute(self, later, advance):
        """The batch aborted, then the same calls again at a later clock (a processing-time
        batch takes a new clock when it is re-executed), committed."""
        calls = self.calls
        self._abort()
        self.model = self._copy(self.committed)
        self._next_batch(later, False)
        for op, name, args in calls:
            self.call(op, name, *args)
        self._commit()
        self._next_batch(advance, False)

    @invariant()
    def map_listings_are_exact(self):
        """Every listed user key has an entry in the store, listed once, in the model's order;
        and every entry is listed."""
        keys = keys_of(range(KEYS))
        for name in set(MAPS) & set(self.DRIVEN):
            var = self.vars[name]
            which, user_keys = var._lists().read(keys)
            listed = [(int(w), int(u)) for w, u in zip(which, user_keys["u"])]
            assert listed == [(k, u) for k in range(KEYS) for u in self.model[name].get(k, {})], name
            pairs = [(k, u) for k in range(KEYS) for u in range(USER_KEYS)]
            _, present = self.stores[name].get_batch(var._full(keys_of([k for k, _ in pairs]),
                                                                rows_of([u for _, u in pairs], var.user_key_dtype)))
            assert [p for p, f in zip(pairs, present) if f] == sorted(listed), name

    def teardown(self):
        self._abort()
        self.partition.reload()
        self.tmp.cleanup()


class MapsModel(StateVarsModel):
    """The same, calling only the maps: a handler that puts, removes and lists user keys
    meets each of their orders far more often."""

    DRIVEN = MAPS


_SETTINGS = dict(stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                 derandomize=True)
TestStateVarsModel = StateVarsModel.TestCase
TestStateVarsModel.settings = settings(max_examples=40, **_SETTINGS)
TestMapsModel = MapsModel.TestCase
TestMapsModel.settings = settings(max_examples=40, **_SETTINGS)


class Batches:
    """A map (and a TTL'd one) on the stores of one partition, bound batch by batch."""

    def __init__(self, root):
        self.partition = Partition(root, schemas())
        self.now = START_US

    def open(self, now=None):
        self.now = self.now if now is None else now
        self.stores = self.partition.open()
        return declare(StateHandle(KEY, self.stores, self.now))

    def commit(self, variables):
        next(iter(variables.values())).handle.expire()
        self.partition.commit(self.stores)

    def close(self):
        for store in self.stores.values():
            store.abort()
        self.partition.reload()


def pairs_of(var, pairs):
    return keys_of([k for k, _ in pairs]), rows_of([u for _, u in pairs], var.user_key_dtype)


def listing(var, ks):
    which, user_keys = var._lists().read(keys_of(ks))
    return [(ks[w], int(u)) for w, u in zip(which, user_keys["u"])]


def items(var, ks):
    which, user_keys, values = var.items(keys_of(ks))
    return [(ks[w], int(u), int(x)) for w, u, x in zip(which, user_keys["u"], values["x"])]


def test_a_map_an_older_version_listed_twice_yields_each_entry_once(tmp_path):
    """State written before the listing was kept exact: a page removed and put again listed
    twice, and a removed page still listed. ``items()`` yields each entry once, at its first
    listing, and rewrites the listing."""
    batches = Batches(tmp_path)
    m = batches.open()["map"]
    m.put(*pairs_of(m, [(0, 1), (0, 2), (1, 5)]), rows_of([10, 20, 50], m.dtype))
    m._lists().append(*pairs_of(m, [(0, 3), (0, 1), (0, 2)]))  # 3 has no entry; 1 and 2 twice
    batches.commit({"map": m})
    m = batches.open()["map"]
    assert listing(m, [0, 1]) == [(0, 1), (0, 2), (0, 3), (0, 1), (0, 2), (1, 5)]
    assert items(m, [0, 1]) == [(0, 1, 10), (0, 2, 20), (1, 5, 50)]
    assert listing(m, [0, 1]) == [(0, 1), (0, 2), (1, 5)]
    batches.close()


def test_repeated_pairs_in_one_call_put_the_last_value_and_remove_once(tmp_path):
    """A handler putting the same (user, page) twice in one call (last value wins, listed
    once), then removing a page given twice, then putting it again: listed once, at the end."""
    batches = Batches(tmp_path)
    m = batches.open()["map"]
    m.put(*pairs_of(m, [(0, 1), (0, 2), (0, 1), (1, 1)]), rows_of([5, 6, 7, 8], m.dtype))
    values, found = m.get(*pairs_of(m, [(0, 1), (0, 2), (1, 1)]))
    assert found.all() and values["x"].tolist() == [7, 6, 8]
    assert listing(m, [0, 1]) == [(0, 1), (0, 2), (1, 1)]
    m.remove(*pairs_of(m, [(0, 1), (0, 1), (1, 0)]))
    assert listing(m, [0, 1]) == [(0, 2), (1, 1)]
    m.put(*pairs_of(m, [(0, 1)]), rows_of([9], m.dtype))
    assert items(m, [0, 1]) == [(0, 2, 6), (0, 1, 9), (1, 1, 8)]
    batches.close()


def test_an_entry_expired_by_its_ttl_and_put_again_later_is_listed_once(tmp_path):
    """A page whose TTL ended (removed at the end of its batch) is put again in a later
    batch, before anything lists the map: ``items()`` yields it once."""
    batches = Batches(tmp_path)
    m = batches.open()["ttl_map"]
    m.put(*pairs_of(m, [(0, 1), (0, 2)]), rows_of([1, 2], m.dtype))
    batches.commit({"ttl_map": m})
    m = batches.open(START_US + TTL_US // 2)["ttl_map"]
    m.put(*pairs_of(m, [(0, 2)]), rows_of([3], m.dtype))  # page 2 lives on
    batches.commit({"ttl_map": m})
    m = batches.open(START_US + TTL_US)["ttl_map"]  # page 1's TTL ends in this batch
    batches.commit({"ttl_map": m})
    m = batches.open()["ttl_map"]
    assert listing(m, [0]) == [(0, 2)], "the expiry removed page 1 from the listing"
    m.put(*pairs_of(m, [(0, 1)]), rows_of([4], m.dtype))
    assert items(m, [0]) == [(0, 2, 3), (0, 1, 4)]
    batches.close()


def test_items_of_a_key_given_twice_is_refused_and_loses_nothing(tmp_path):
    """A handler passing each row's key (``groups.keys[groups.group]``) instead of the batch's
    distinct keys: ValueError naming the key, and the map is intact."""
    batches = Batches(tmp_path)
    m = batches.open()["map"]
    m.put(*pairs_of(m, [(0, 1), (0, 2), (1, 1)]), rows_of([1, 2, 3], m.dtype))
    with pytest.raises(ValueError, match=r"state variable 'map': items\(\) takes distinct keys, but key \(0,\) "
                                         r"\(at 2\) comes twice"):
        m.items(keys_of([0, 1, 0]))
    assert items(m, [0, 1]) == [(0, 1, 1), (0, 2, 2), (1, 1, 3)]
    batches.close()
