"""RowTable against a dict model, plus the edges: empty, one row, the resize threshold,
probe wrap-around, cursors under mutation, memory accounting, probe lengths, and the
negative filter (a put of a key it rules out inserts without a lookup: a filter that forgot
a key would make a duplicate)."""
import gc
import tracemalloc

import numpy as np
import pytest

from statecore import RowTable
from statecore._hash import hash_rows
from statecore._rowtable import TRACE_DOMAIN

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
LAYOUTS = [
    ("int64->count,sum", KEY, VALUE),
    ("multi-key->int32", np.dtype([("a", "<i4"), ("b", "S3"), ("c", "?")]), np.dtype([("v", "<i4")])),
    ("bytes16->set", np.dtype([("id", "S16")]), np.dtype([])),
    ("uint8->float32", np.dtype([("b", "u1")]), np.dtype([("x", "<f4")])),
    ("wide", np.dtype([("k1", "<u8"), ("k2", "<u8"), ("k3", "<u8")]), np.dtype([("payload", "S40")])),
]


def random_rows(rand, dtype, n, key_space):
    """``n`` rows of ``dtype`` drawn from ``key_space`` distinct values per row (seeded)."""
    idx = rand.integers(0, key_space, n)
    out = np.zeros(n, dtype=dtype)
    for i, name in enumerate(dtype.names or ()):
        f = dtype.fields[name][0]
        mix = (idx * (2 * i + 7919) + i) % max(key_space, 1)
        if f.kind == "S":
            out[name] = np.char.encode(np.char.mod("%x", mix), "ascii").astype(f)
        elif f.kind == "b":
            out[name] = (mix % 2).astype(bool)
        elif f.kind == "f":
            out[name] = mix * 0.5
        else:
            out[name] = mix.astype(f)  # wraps for narrow types: only more duplicates
    return out


@pytest.mark.parametrize("name,key_dt,value_dt", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_batch_ops_match_dict_model(rand, name, key_dt, value_dt):
    table = RowTable(key_dt, value_dt)
    model = {}
    key_space = 256 if key_dt == np.dtype([("b", "u1")]) else 20_000
    for step in range(60):
        n = int(rand.integers(0, 4000))
        keys = random_rows(rand, key_dt, n, key_space)
        op = rand.integers(0, 3)
        krows = keys.view(np.uint8).reshape(n, -1) if key_dt.itemsize else None
        if op == 0:
            values = random_rows(rand, value_dt, n, 1 << 30) if value_dt.names else None
            table.put_batch(keys, values)
            vbytes = values.view(np.uint8).reshape(n, -1) if value_dt.names else np.empty((n, 0), np.uint8)
            for i in range(n):
                model[krows[i].tobytes()] = vbytes[i].tobytes()
        elif op == 1:
            removed = table.remove_batch(keys)
            expected = 0
            for i in range(n):
                expected += model.pop(krows[i].tobytes(), None) is not None
            assert removed == expected
        else:
            values, found = table.get_batch(keys)
            vview = values.view(np.uint8).reshape(n, -1) if value_dt.names else None
            for i in range(n):
                want = model.get(krows[i].tobytes())
                assert found[i] == (want is not None)
                if want is not None and vview is not None:
                    assert vview[i].tobytes() == want
                elif vview is not None:
                    assert not vview[i].any()
        assert len(table) == len(model)
    got = {}
    for k, v in table.iter_batches(777):
        kr = k.view(np.uint8).reshape(len(k), -1)
        vr = v.view(np.uint8).reshape(len(v), -1) if value_dt.names else np.empty((len(k), 0), np.uint8)
        for i in range(len(k)):
            assert kr[i].tobytes() not in got
            got[kr[i].tobytes()] = vr[i].tobytes()
    assert got == model


def test_scalar_ops_match_dict_model(rand):
    table = RowTable(KEY, VALUE)
    model = {}
    for _ in range(30_000):
        k = int(rand.integers(0, 3000))
        op = rand.integers(0, 4)
        if op == 0:
            v = (int(rand.integers(0, 100)), float(rand.integers(0, 100)) / 4)
            table.put(k, v)
            model[k] = v
        elif op == 1:
            assert table.remove(k) == (model.pop(k, None) is not None)
        else:
            assert table.get(k) == model.get(k)
            assert (k in table) == (k in model)
    assert len(table) == len(model)
    assert dict(table.items()) == {(k,): v for k, v in model.items()}


def test_puts_after_removals_reset_and_clear_never_duplicate_a_key():
    t = RowTable(KEY, VALUE)
    n = 5000
    for k in range(n):
        assert t.put_row(np.int64(k).tobytes(), np.zeros(1, VALUE).tobytes())
    # More removals than keys left: the filter is rebuilt from the index along the way.
    for k in range(0, n - 100):
        assert t.remove_row(np.int64(k).tobytes())
    for k in range(n):  # the 100 left are overwritten (found), the others are new
        assert t.put_row(np.int64(k).tobytes(), np.ones(1, VALUE).tobytes()) == (k < n - 100)
    assert len(t) == n and len(dict(t.items())) == n
    t.reset()
    for k in range(0, n, 3):
        t.put_row(np.int64(k).tobytes(), np.zeros(1, VALUE).tobytes())
        assert not t.put_row(np.int64(k).tobytes(), np.zeros(1, VALUE).tobytes())
    assert len(t) == len(range(0, n, 3))
    t.clear()
    assert t.put_row(np.int64(7).tobytes(), np.zeros(1, VALUE).tobytes())
    assert not t.put_row(np.int64(7).tobytes(), np.zeros(1, VALUE).tobytes()) and len(t) == 1


def test_empty_table():
    t = RowTable(KEY, VALUE)
    assert len(t) == 0 and t.get(1) is None and not t.remove(1) and list(t.items()) == []
    values, found = t.get_batch(np.zeros(0, KEY))
    assert values.shape == (0,) and found.shape == (0,)
    values, found = t.get_batch(np.arange(5).astype([("k", "<i8")]))
    assert not found.any() and not values.view(np.uint8).any()
    assert t.remove_batch(np.zeros(0, KEY)) == 0
    t.put_batch(np.zeros(0, KEY), np.zeros(0, VALUE))
    assert t.sizeof() == 0 and t.max_probe_len == 0


def test_one_row():
    t = RowTable(KEY, VALUE)
    t.put_batch(np.array([(7,)], KEY), np.array([(1, 2.0)], VALUE))
    assert t.get(7) == (1, 2.0) and len(t) == 1
    values, found = t.get_batch(np.array([(7,), (8,)], KEY))
    assert found.tolist() == [True, False] and values[0].item() == (1, 2.0)
    assert t.remove_batch(np.array([(7,)], KEY)) == 1 and len(t) == 0


def test_resize_at_exact_threshold_keeps_all_keys():
    t = RowTable(KEY, VALUE)
    t.put(0, (0, 0.0))
    cap = t.capacity  # 12 of 16 slots
    for k in range(1, cap):
        t.put(k, (k, 0.0))
    assert t.capacity == cap and len(t) == cap
    t.put(cap, (cap, 0.0))  # one past the threshold: the index doubles
    assert t.capacity == 2 * cap
    assert all(t.get(k) == (k, 0.0) for k in range(cap + 1))
    # the batch path across the same threshold, from empty
    t2 = RowTable(KEY, VALUE)
    keys = np.arange(cap + 1).astype(KEY)
    t2.put_batch(keys[:cap], np.zeros(cap, VALUE))
    assert t2.capacity == cap
    t2.put_batch(keys[cap:], np.zeros(1, VALUE))
    assert len(t2) == cap + 1 and t2.get_batch(keys)[1].all()


def keys_homed_at_last_slot(n_keys, n_slots=16):
    cand = np.arange(200_000, dtype="<i8")
    tags = hash_rows(cand.view(np.uint8).reshape(-1, 8)) & 0xFFFFFFFF
    return cand[(tags & (n_slots - 1)) == n_slots - 1][:n_keys]


def test_probe_wraps_around_the_end_of_the_index():
    keys = keys_homed_at_last_slot(6)
    t = RowTable(KEY, VALUE)
    for k in keys:
        t.put(int(k), (int(k), 1.0))
    assert t.capacity == 12  # still 16 slots: the cluster wrapped to slots 0..4
    assert t.probe_stats()["max"] == 5
    for k in keys:
        assert t.get(int(k)) == (int(k), 1.0)
    # removing from the middle of a wrapped cluster shifts the rest back correctly
    assert t.remove(int(keys[1])) and t.remove(int(keys[4]))
    left = [keys[0], keys[2], keys[3], keys[5]]
    assert [t.get(int(k)) for k in left] == [(int(k), 1.0) for k in left]
    assert t.get(int(keys[1])) is None
    assert t.probe_stats()["max"] == 3
    values, found = t.get_batch(keys.astype(KEY))
    assert found.tolist() == [True, False, True, True, False, True]


def test_duplicates_in_a_batch_last_wins():
    t = RowTable(KEY, VALUE)
    keys = np.array([(1,), (2,), (1,)], KEY)
    t.put_batch(keys, np.array([(1, 1.0), (2, 2.0), (3, 3.0)], VALUE))
    assert t.get(1) == (3, 3.0) and len(t) == 2
    assert t.remove_batch(keys) == 2


def test_read_only_inputs():
    keys = np.arange(100).astype(KEY)
    values = np.zeros(100, VALUE)
    keys.flags.writeable = False
    values.flags.writeable = False
    t = RowTable(KEY, VALUE)
    t.put_batch(keys, values)
    assert t.get_batch(keys)[1].all()
    assert t.remove_batch(keys) == 100


def test_value_less_table_is_a_set():
    t = RowTable(KEY, np.dtype([]))
    t.put_batch(np.arange(10).astype(KEY))
    assert t.get(3) == () and t.get(11) is None and 3 in t
    values, found = t.get_batch(np.arange(12).astype(KEY))
    assert found.sum() == 10 and values.dtype == np.dtype([])
    with pytest.raises(ValueError, match="null"):
        RowTable(KEY, VALUE).put_batch(np.arange(2).astype(KEY))


def test_bad_shapes_and_types_are_refused_without_change():
    t = RowTable(KEY, VALUE)
    t.put(1, (1, 1.0))
    with pytest.raises(ValueError, match="2 keys but 3"):
        t.put_rows(np.zeros((2, 8), np.uint8), np.zeros((3, 16), np.uint8))
    with pytest.raises(ValueError, match="8"):
        t.put_rows(np.zeros((2, 4), np.uint8), np.zeros((2, 16), np.uint8))
    with pytest.raises(TypeError, match="field 'k'"):
        t.put_batch(np.zeros(2, [("k", "<i4")]), np.zeros(2, VALUE))
    with pytest.raises(ValueError, match="null"):
        t.put(2, None)
    with pytest.raises(TypeError, match="key schema"):
        RowTable(np.dtype([]), VALUE)
    assert len(t) == 1 and t.get(1) == (1, 1.0)


def test_cursor_visits_each_initial_key_exactly_once_under_mutation(rand):
    t = RowTable(KEY, VALUE)
    initial = np.unique(rand.integers(0, 50_000, 8000)).astype(KEY)
    t.put_batch(initial, np.zeros(len(initial), VALUE))
    seen = []
    for i, (k, v) in enumerate(t.items()):
        seen.append(k[0])
        # an eviction loop: remove what we visit, re-insert some, add new keys, overwrite others
        t.remove(k)
        if i % 3 == 0:
            t.put(k, (1, 1.0))  # removed then re-put: must not be visited again
        t.put(100_000 + i, (0, 0.0))  # new: must not be visited
        other = int(initial[int(rand.integers(0, len(initial)))]["k"])
        if rand.integers(0, 2):
            t.remove(other)
        else:
            t.put(other, (2, 2.0))
    assert sorted(seen) == sorted(initial["k"].tolist())


def drain(cursor, chunk):
    chunks = []
    while (rows := cursor.next_rows(chunk)) is not None:
        chunks.append(rows)
    return np.concatenate(chunks)


def test_overlapping_cursors_and_zombies():
    t = RowTable(KEY, VALUE)
    t.put_batch(np.arange(100).astype(KEY), np.zeros(100, VALUE))
    first = t.cursor()
    t.remove(5)  # a zombie for `first` to visit
    second = t.cursor()  # 5 was gone when this one opened
    t.remove(6)  # both must still visit 6
    rows_first = drain(first, 7)
    rows_second = drain(second, 7)
    ks = lambda rows: sorted(rows[:, :8].copy().view("<i8").ravel().tolist())
    assert ks(rows_first) == list(range(100))
    assert ks(rows_second) == [k for k in range(100) if k != 5]
    # both closed: the two zombie rows are reused, the arena does not grow
    used = t.sizeof()
    t.put(1000, (0, 0.0))
    t.put(1001, (0, 0.0))
    assert t.sizeof() == used and len(t) == 100


def test_abandoned_cursor_releases_on_collection():
    t = RowTable(KEY, VALUE)
    t.put_batch(np.arange(10).astype(KEY), np.zeros(10, VALUE))
    it = t.items()
    next(it)
    t.remove(3)
    del it
    gc.collect()
    t.put(3, (0, 0.0))  # reuses the freed row: no cursor is open any more
    assert [k for k, _ in t.items()].count((3,)) == 1 and len(t) == 10


def test_lookups_do_not_degrade_after_many_delete_insert_cycles(rand):
    t = RowTable(KEY, VALUE)
    live = rand.permutation(1_000_000)[:100_000]
    t.put_batch(live.astype(KEY), np.zeros(len(live), VALUE))
    before = t.probe_stats()
    next_key = 1_000_000
    for _ in range(20):
        drop = rand.choice(len(live), 20_000, replace=False)
        t.remove_batch(live[drop].astype(KEY))
        fresh = np.arange(next_key, next_key + 20_000)
        next_key += 20_000
        live[drop] = fresh
        t.put_batch(fresh.astype(KEY), np.zeros(len(fresh), VALUE))
    after = t.probe_stats()
    assert len(t) == 100_000 and t.get_batch(live.astype(KEY))[1].all()
    assert after["slots"] == before["slots"]  # no tombstone build-up forcing growth
    assert after["mean"] < before["mean"] * 1.3 + 0.05 and after["max"] <= 2 * before["max"] + 4
    assert t.max_probe_len >= after["max"] + 1


def test_probe_length_is_bounded_at_full_load():
    t = RowTable(KEY, VALUE)
    n = 3 * (1 << 16)  # exactly 3/4 of 2**18 slots
    t.put_batch(np.arange(n).astype(KEY), np.zeros(n, VALUE))
    stats = t.probe_stats()
    assert stats["slots"] == 1 << 18 and stats["keys"] == n
    assert stats["mean"] < 2.5 and stats["max"] < 64


def test_sizeof_is_exactly_the_traced_allocations():
    tracemalloc.start()
    try:
        def traced():
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, TRACE_DOMAIN)])
            return sum(s.size for s in snap.statistics("filename"))
        base = traced()
        t = RowTable(KEY, VALUE)
        for n in (10, 1000, 300_000):
            t.put_batch(np.arange(n).astype(KEY), np.zeros(n, VALUE))
            assert traced() - base == t.sizeof() > 0
        t.remove_batch(np.arange(0, 300_000, 2).astype(KEY))
        assert traced() - base == t.sizeof()
        t.clear()
        assert t.sizeof() == 0 and traced() == base
        t.put_batch(np.arange(50).astype(KEY), np.zeros(50, VALUE))
        del t
        gc.collect()
        assert traced() == base
    finally:
        tracemalloc.stop()


def test_memory_is_close_to_raw_row_bytes():
    # Arena + index + state bytes: at a mid-range load, about 2x the raw rows of 24 bytes.
    t = RowTable(KEY, VALUE)
    n = 700_000
    t.put_batch(np.arange(n).astype(KEY), np.zeros(n, VALUE))
    raw = n * 24
    assert t.sizeof() < 2.2 * raw


# -- float keys: one key per Spark grouping key (-0.0 is 0.0, every NaN is one NaN) ---------
FKEY = np.dtype([("x", "<f8")])


def nan_with(bits):
    """A float64 NaN with these exact bits (payload, sign)."""
    return np.array([bits], "<u8").view("<f8")[0]


NAN_A, NAN_B, NAN_C = (nan_with(0x7FF8_0000_0000_0001), nan_with(0xFFF8_0000_0000_0000),
                       nan_with(0x7FF0_0000_0000_0002))


def test_float_keys_per_row_are_one_key_for_zero_signs_and_nan_payloads():
    t = RowTable(FKEY, VALUE)
    t.put(0.0, (1, 1.0))
    assert t.get(-0.0) == (1, 1.0) and -0.0 in t and t.get((np.float64(-0.0),)) == (1, 1.0)
    t.put(-0.0, (2, 2.0))
    t.put(NAN_A, (3, 3.0))
    assert len(t) == 2 and t.get(0.0) == (2, 2.0)
    assert t.get(NAN_B) == (3, 3.0) and t.get(float("nan")) == (3, 3.0)
    assert t.get(NAN_C.tobytes()) == (3, 3.0)  # a key given as its row bytes
    keys = sorted(k for k, _ in t.items())
    assert [np.signbit(k[0]) for k in keys if k[0] == 0] == [False]
    assert t.remove(NAN_C) and not t.remove(np.float64(np.nan)) and t.remove(-0.0) and len(t) == 0


def test_float_keys_per_batch_are_one_key_and_the_callers_arrays_are_untouched():
    key = np.dtype([("id", "<i4"), ("x", "<f8"), ("y", "<f4")])
    value = np.dtype([("v", "<f8")])
    t = RowTable(key, value)
    keys = np.zeros(3, key)
    keys["x"] = [-0.0, NAN_A, 1.5]
    keys["y"] = np.array([0x8000_0000, 0x7FC0_0001, 0x3F80_0000], "<u4").view("<f4")
    values = np.zeros(3, value)
    values["v"] = [-0.0, NAN_A, 2.0]  # values keep their bytes
    before = keys.tobytes(), values.tobytes()
    t.put_batch(keys, values)
    assert (keys.tobytes(), values.tobytes()) == before
    same = np.zeros(3, key)
    same["x"] = [0.0, NAN_B, 1.5]
    same["y"] = [0.0, np.nan, 1.0]
    same.flags.writeable = False
    got, found = t.get_batch(same)
    assert found.all() and got.tobytes() == values.tobytes()
    other_nan = {"id": np.zeros(3, "<i4"), "x": np.array([NAN_C, -0.0, 1.5]),
                 "y": np.array([-np.nan, -0.0, 1.0], "<f4")}
    assert t.get_batch(other_nan)[1].all()
    t.put_batch(same, np.zeros(3, value))
    assert len(t) == 3
    assert t.remove_batch(keys) == 3 and len(t) == 0
    assert keys.tobytes() == before[0]
