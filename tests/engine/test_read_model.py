"""The read model (statecore/_versions.pyx): a version's sources are
flattened once and kept by the per-row reader until the provider's change counter moves (a
spill's ``lower`` swapped deep under frozen States included); pins are per-version counts on
the State that ``retain`` keeps; a frozen State refuses every change, and no field of any
State can be set from Python; ``describe()`` says what is held; lock requirements are checked
with STATECORE_DEBUG_LOCKS=1."""
import itertools
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore._lock import ProviderLock
from statecore._rowcalls import RowCalls
from statecore._versions import FrozenView, Layer, Spill, State, join_rows, replace_in_chain
from statecore.schema import key_value_schemas
from statecore.spill import spill_rows
from tests.paths import REPO_ROOT
from tests.store_support import applied, commit_batch, open_provider, write_batch

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8")])
KS, VS = key_value_schemas(KEY, VALUE)
ID = bytes(8)


def rows(schema, items):
    return np.frombuffer(b"".join(schema.encode(x) for x in items), np.uint8).reshape(len(items), schema.width)


def image(tmp_path, items):
    """A mapped image (a whole spill's puts) of ``items`` ({key: value})."""
    names = itertools.count()
    keys, values = rows(KS, [(k,) for k in items]), rows(VS, [(v,) for v in items.values()])
    chunk = np.concatenate([keys, values], axis=1)
    whole = spill_rows(lambda: open(tmp_path / f"image-{len(os.listdir(tmp_path))}-{next(names)}", "wb"),
                       KS, VS, 1, ID, [chunk], len(items))
    return whole.puts


def merge(state, puts):
    state.merge(rows(KS, [(k,) for k in puts]), rows(VS, [(v,) for v in puts.values()]), rows(KS, []), ID)


def test_a_kept_per_row_walk_follows_a_lower_swapped_under_a_frozen_state(tmp_path):
    """A snapshot replacing the lower of a spill level two frozen States down (maintenance
    writing a snapshot from a spill while commits went on): a store's per-row reader that
    kept the flattened sources reads the new lower at once. The images differ here on
    purpose, to see which one is read."""
    old_lower, new_lower = image(tmp_path, {2: 2, 3: 3}), image(tmp_path, {2: 20, 3: 30})
    level = Spill(image(tmp_path, {1: 1}), None, old_lower, 4, ID, 3)
    frozen = State(KS, VS, level, 4, ID, 3)
    merge(frozen, {5: 5})
    top = frozen.freeze_into_successor(5, keep_versions=True)
    merge(top, {6: 6})
    assert top.changes is frozen.changes, "the States of one chain share one change counter"
    reader = RowCalls(SimpleNamespace(state=top, version=6), ProviderLock(), KS, VS)
    assert [reader.get((k,)) for k in (1, 2, 5, 6, 7)] == [(1,), (2,), (5,), (6,), None]
    assert replace_in_chain(top, lambda base: base is old_lower, new_lower)
    assert level.lower is new_lower
    assert [reader.get((k,)) for k in (1, 2, 3, 5)] == [(1,), (20,), (30,), (5,)], \
        "the per-row reader kept the sources of before the swap"
    values, found = top.lookup(6, rows(KS, [(k,) for k in range(8)]))
    assert found.tolist() == [False, True, True, True, False, True, True, False]
    assert sorted(int.from_bytes(bytes(r[:8]), "little") for c in top.iter_rows(6) for r in c) == [1, 2, 3, 5, 6]


def test_a_frozen_state_refuses_every_change_in_one_place():
    """A frozen State (read without the lock by iterations and by the State built over it)
    refuses merges, replays, rollbacks, advances and retains alike; its base may still be
    swapped for the same rows mapped."""
    state = State(KS, VS, None, 0, ID, 0)
    merge(state, {1: 1})
    merge(state, {2: 2})
    successor = state.freeze_into_successor(2, keep_versions=True)
    changes = [lambda: merge(state, {3: 3}), state.rollback, lambda: state.advance(3, ID, 2),
               lambda: state.retain(2), lambda: state.replay(True, rows(KS, [(4,)]), rows(VS, [(4,)]))]
    for change in changes:
        with pytest.raises(AssertionError, match="a change to a frozen in-memory state"):
            change()
    assert state.version == 2 and sorted(state.commit_ids) == [0, 1, 2]
    state.base = None  # a base swap is the one change a frozen State may see
    assert successor.holds(1) and successor.lookup(1, rows(KS, [(1,), (2,)]))[1].tolist() == [True, False]


def test_a_frozen_state_read_without_the_lock_cannot_be_changed_from_python():
    """A State frozen under its successor (what a snapshot being written reads without the
    lock): a stray assignment in Python cannot change it, nor any State, behind the change
    counter's back: every field is read-only, there is no __dict__ to add one to, and its
    versions, undo layers and pins are read-only mappings."""
    state = State(KS, VS, None, 0, ID, 0)
    merge(state, {1: 1})
    successor = state.freeze_into_successor(1, keep_versions=True)
    for target in (state, successor):
        for name, value in [("frozen", False), ("head", Layer(KS, VS)), ("version", 7), ("pending", 1),
                            ("iterating", 0), ("spill_asked_at", 1), ("adopted_head", 1), ("undo", {}),
                            ("commit_ids", {}), ("num_keys", {}), ("pins", {}), ("changes", None)]:
            with pytest.raises(AttributeError):
                setattr(target, name, value)
        with pytest.raises(AttributeError):
            target.anything = 1
        for mapping, key, value in [(target.undo, 1, Layer(KS, VS)), (target.commit_ids, 1, ID),
                                    (target.num_keys, 1, 0), (target.pins, 1, 1)]:
            with pytest.raises(TypeError):
                mapping[key] = value
    with pytest.raises(AssertionError, match="a change to a frozen in-memory state"):
        state.spill_asked(1)
    assert state.frozen and state.version == 1 and sorted(state.commit_ids) == [0, 1] and not state.pins
    assert successor.lookup(1, rows(KS, [(1,)]))[1].tolist() == [True]


def test_a_version_stands_only_on_what_the_read_model_reads(tmp_path):
    """A State, a Spill and a base swap are refused, with the type named, when given a base the
    read model has no rule for (a mistake a duck-typed base would have turned into wrong reads
    later); a FrozenView is only of a frozen State."""
    snapshot = image(tmp_path, {1: 1})
    with pytest.raises(TypeError, match="not dict"):
        State(KS, VS, {}, 0, ID, 0)
    with pytest.raises(TypeError, match="not str"):
        Spill(snapshot, None, "lower", 1, ID, 1)
    state = State(KS, VS, snapshot, 1, ID, 1)
    with pytest.raises(TypeError, match="not list"):
        state.base = []
    with pytest.raises(TypeError, match="not State"):
        replace_in_chain(state, lambda base: base is snapshot, State(KS, VS, None, 0, ID, 0))
    assert state.base is snapshot
    with pytest.raises(ValueError, match="frozen"):
        FrozenView(state, 1)


def test_pins_are_counts_on_the_state_that_retain_keeps(tmp_path):
    """Two stores open at version 1 while later versions commit with one version retained:
    version 1 stays in memory until the second of them closes; describe() shows the pins."""
    p = open_provider(tmp_path, KEY, VALUE, max_versions_to_retain_in_memory=1)
    commit_batch(p, 0, puts=[((1,), (1,))])
    first, second = p.get_read_store(1), p.get_read_store(1)
    assert p.describe()["latest"]["pins"] == {1: 2}
    commit_batch(p, 1, puts=[((1,), (10,))])
    commit_batch(p, 2, puts=[((1,), (100,))])
    assert p.describe()["latest"]["versions"][0] == 1
    first.abort()
    commit_batch(p, 3, puts=[((2,), (2,))])
    latest = p.describe()["latest"]
    assert latest["versions"][0] == 1 and latest["pins"] == {1: 1} and second.get((1,)) == (1,)
    second.abort()
    commit_batch(p, 4, puts=[((3,), (3,))])
    latest = p.describe()["latest"]
    # the store committing version 5 had version 4 pinned while it committed: kept so far
    assert latest["versions"] == [4, 5] and latest["pins"] == {}, latest
    p.close()


def test_describe_says_what_the_provider_holds(tmp_path):
    """describe(): the newest State's version, versions held, head rows, undo layers, base
    (its kind and levels, down frozen States) and snapshot version, and the counters."""
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1)
    assert p.describe()["latest"] is None
    model = {0: {}}
    for v in range(3):
        store = p.get_store(v)
        write_batch(store, KEY, VALUE, {k: (v,) for k in range(v * 10, v * 10 + 10)}, [])
        store.commit()
        model[v + 1] = applied(model[v], {k: (v,) for k in range(v * 10, v * 10 + 10)}, [])
    d = p.describe()
    latest = d["latest"]
    assert (latest["version"], latest["head_rows"], latest["frozen"]) == (3, 30, False)
    assert 3 in latest["versions"] and set(latest["undo_layers"]) == set(latest["versions"][1:]), latest
    assert latest["base"] == {"kind": "none"} and latest["snapshot_version"] == 0
    assert d["changes"] > 0 and d["memory_bytes"] > 0 and not d["closed"]
    p.do_maintenance()  # a snapshot of version 3: written from a spill, which it replaces
    latest = p.describe()["latest"]
    assert latest["snapshot_version"] == 3 and latest["head_rows"] == 0, latest
    base = latest["base"]
    while base["kind"] == "frozen":
        base = base["state"]["base"]
    assert base["kind"] == "snapshot" and base["version"] == 3 and base["rows"] == 30, latest
    json.dumps(p.describe())  # plain data
    p.close()
    assert p.describe() == {**p.describe(), "latest": None, "closed": True}


def test_lock_requirements_are_checked_with_statecore_debug_locks(tmp_path):
    """With STATECORE_DEBUG_LOCKS=1, a provider method that requires the provider's lock
    raises when called without it, and a workload of commits, reads, spills and snapshots
    (every such call made under the lock) runs clean."""
    body = f"""
        import numpy as np
        from unittest import mock
        from tests.store_support import commit_batch, open_provider
        p = open_provider({str(tmp_path)!r}, np.dtype([("k", "<i8")]), np.dtype([("n", "<i8")]),
                          min_deltas_for_snapshot=2)
        with mock.patch.multiple("statecore.held_versions", SPILL_MIN_ROWS=-1, SPILL_RATIO=0):
            for v in range(6):
                commit_batch(p, v, puts=[((k,), (v,)) for k in range(v, v + 20)], removes=[(v - 1,)])
                p.do_maintenance()
        store = p.get_read_store(6)
        assert store.get((10,)) == (5,) and sum(1 for _ in store.iterator()) == 20
        store.abort()
        try:
            p.held.retain(p.held.newest)
        except AssertionError as e:
            print(e)
        with p.held.lock:
            p.held.retain(p.held.newest)
    """
    env = dict(os.environ, STATECORE_DEBUG_LOCKS="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HeldVersions.retain needs the provider's lock" in done.stdout, done.stdout


# -- join_rows: a key row and its value row side by side -----------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.sampled_from([1, 3, 4, 8, 12, 16, 24, 33]), st.sampled_from([0, 1, 4, 8, 16, 24, 40]),
       st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_join_rows_is_numpys_concatenate_and_take(n, kw, vw, gather, strided, seed):
    """Every key and value width (the inlined ones and others, a set's empty value), with and
    without an index (repeats allowed), over contiguous rows and over rows sliced out of a
    wider array: numpy's concatenate, then take."""
    rng = np.random.default_rng(seed)
    wide = rng.integers(0, 256, (n, kw + vw + 5), dtype=np.uint8)
    keys = wide[:, 2:2 + kw] if strided else np.ascontiguousarray(wide[:, 2:2 + kw])
    values = wide[:, 2 + kw:2 + kw + vw] if strided else np.ascontiguousarray(wide[:, 2 + kw:2 + kw + vw])
    index = rng.integers(0, n, 3 * n) if gather and n else None
    want = np.concatenate([keys, values], axis=1)
    got = join_rows(keys, values, index)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want if index is None else want[index])


def test_join_rows_refuses_an_index_outside_the_rows_and_unequal_counts():
    keys, values = np.zeros((4, 8), np.uint8), np.zeros((4, 16), np.uint8)
    with pytest.raises(IndexError, match="row index 4 is outside the 4 rows"):
        join_rows(keys, values, np.array([0, 4]))
    with pytest.raises(IndexError, match="row index -1"):
        join_rows(keys, values, np.array([-1]))
    with pytest.raises(ValueError, match="4 key rows and 3 value rows"):
        join_rows(keys, values[:3])
    with pytest.raises(ValueError, match="contiguous within a row"):
        join_rows(np.zeros((4, 16), np.uint8)[:, ::2], values)
