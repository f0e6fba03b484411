"""A snapshot written under an older value schema, read in place (docs/evolution.md, "How a
store follows a changed query"): RowConverter against numpy's own casts, and a store whose base
is a ConvertedImage read by every path (per row, in batches, whole), with spilled levels over it,
snapshotted by maintenance, damaged; a re-key still converts whole."""
import logging
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore import StateCorruptionError, StateStoreConf, StateStoreId, create_and_init_provider
from statecore._row_convert import RowConverter, narrow_rows
from statecore.maintenance import _filter_bottom
from statecore.schema import RowSchema
from statecore.schema_evolution import SchemaChanges, plan
from tests.store_support import commit_batch, contents, open_provider, snapshot_now, the_file

# -- RowConverter against numpy ------------------------------------------------------------------
# Each old dtype with the new dtypes the rules let it become (itself included).
WIDENINGS = {
    "i1": ["i1", "<i2", "<i4", "<i8", "<f8"], "<i2": ["<i2", "<i4", "<i8", "<f8"], "<i4": ["<i4", "<i8", "<f8"],
    "<i8": ["<i8"], "u1": ["u1", "<u2", "<u8", "<i2", "<i4", "<f8"], "<u2": ["<u2", "<u4", "<i4", "<i8", "<f8"],
    "<u4": ["<u4", "<u8", "<i8", "<f8"], "<f4": ["<f4", "<f8"], "<f8": ["<f8"], "?": ["?"],
    "S3": ["S3", "S4", "S16"],
}


@st.composite
def evolutions(draw):
    """``(old dtype, new dtype, defaults, rows of old as a structured array)``: fields widened,
    reordered, dropped, added (with or without a default)."""
    n_old = draw(st.integers(1, 6))
    old_types = draw(st.lists(st.sampled_from(sorted(WIDENINGS)), min_size=n_old, max_size=n_old))
    old = np.dtype([(f"f{i}", t) for i, t in enumerate(old_types)])
    kept = [i for i in range(n_old) if draw(st.booleans())]
    new_fields = [(f"f{i}", draw(st.sampled_from(WIDENINGS[old_types[i]]))) for i in kept]
    defaults = {}
    for j in range(draw(st.integers(0, 3))):
        t = draw(st.sampled_from(["<i4", "<f8", "S5", "?"]))
        new_fields.append((f"added{j}", t))
        if draw(st.booleans()):
            defaults[f"added{j}"] = {"<i4": -7, "<f8": 2.5, "S5": b"dflt", "?": True}[t]
    new = np.dtype(draw(st.permutations(new_fields)) if new_fields else [])
    n = draw(st.integers(0, 40))
    raw = draw(st.binary(min_size=n * old.itemsize, max_size=n * old.itemsize))
    rows = np.frombuffer(raw, dtype=old).copy() if n else np.zeros(0, old)
    for name in old.names:  # values a schema holds: a bool is 0 or 1, bytes NUL-padded as numpy keeps them
        if old[name].kind == "b":
            rows[name] = rows[name].view(np.uint8) & 1
        elif old[name].kind == "S":
            rows[name] = [bytes(v).rstrip(b"\0").split(b"\0")[0] for v in rows[name]]
    return old, new, defaults, rows


@settings(max_examples=300, deadline=None)
@given(evolutions())
def test_row_converter_gives_what_numpy_field_copies_give(case):
    """The oracle: a structured array of the new dtype, each field numpy's safe cast of the
    old one (or the default); compared byte for byte (a NaN keeps its payload both ways)."""
    old, new, defaults, rows = case
    evolution = plan(old, new, defaults=defaults)
    expected = np.zeros(len(rows), dtype=evolution.new.dtype)
    with np.errstate(invalid="ignore"):  # a NaN cast to float64 is a NaN: numpy warns of it
        for f in evolution.fields:
            if f.added:
                expected[f.name] = f.default
            else:
                np.copyto(expected[f.name], rows[f.source], casting="safe")
    old_rows = evolution.old.rows(rows) if len(rows) else np.zeros((0, evolution.old.width), np.uint8)
    got = RowConverter(evolution).convert_rows(old_rows)
    assert got.shape == (len(rows), evolution.new.width)
    assert got.tobytes() == expected.tobytes()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_key_widening_narrows_back_exactly_where_a_new_key_is_an_old_one(data):
    """For every widening of int and bytes fields (a key's): narrowing a converted row gives
    the old row back; and a new row of any bytes narrows (ok) exactly when converting what it
    narrows to gives it back, which is when some old row becomes it."""
    kinds = [t for t in sorted(WIDENINGS) if np.dtype(t).kind in "iuS"]
    old_types = data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4))
    old = np.dtype([(f"k{i}", t) for i, t in enumerate(old_types)])
    new = np.dtype([(f"k{i}", data.draw(st.sampled_from([w for w in WIDENINGS[t] if np.dtype(w).kind != "f"])))
                    for i, t in enumerate(old_types)])
    evolution = plan(old, new, key=True)
    converter = RowConverter(evolution)
    assert converter.invertible
    n = data.draw(st.integers(0, 30))
    old_rows = np.frombuffer(data.draw(st.binary(min_size=n * old.itemsize, max_size=n * old.itemsize)),
                             np.uint8).reshape(n, old.itemsize).copy()
    for name in old.names:  # bytes NUL-padded, as key rows hold them
        if old[name].kind == "S":
            view = evolution.old.from_rows(old_rows)
            view[name] = [bytes(v).split(b"\0")[0] for v in view[name]]
    new_rows = converter.convert_rows(old_rows)
    back, ok = narrow_rows(converter, new_rows)
    assert ok.all() and back.tobytes() == old_rows.tobytes()
    anything = np.frombuffer(data.draw(st.binary(min_size=n * new.itemsize, max_size=n * new.itemsize)),
                             np.uint8).reshape(n, new.itemsize)
    back, ok = narrow_rows(converter, np.ascontiguousarray(anything))
    again = converter.convert_rows(back)
    assert ok.tolist() == [again[i].tobytes() == anything[i].tobytes() for i in range(n)]


def test_a_conversion_that_drops_adds_or_makes_floats_cannot_be_undone():
    for old, new in ((np.dtype([("a", "<i4"), ("b", "<i4")]), np.dtype([("a", "<i4")])),
                     (np.dtype([("a", "<i4")]), np.dtype([("a", "<i4"), ("b", "<i4")])),
                     (np.dtype([("a", "<i4")]), np.dtype([("a", "<f8")]))):
        converter = RowConverter(plan(old, new))
        assert not converter.invertible
        with pytest.raises(ValueError, match="cannot be undone"):
            narrow_rows(converter, np.zeros((1, converter.new_width), np.uint8))


def test_negative_ints_widen_with_their_sign_and_to_float_exactly():
    old = np.dtype([("a", "i1"), ("b", "<i2"), ("c", "<i4"), ("d", "<u4"), ("e", "<i4")])
    new = np.dtype([("a", "<i8"), ("b", "<i4"), ("c", "<f8"), ("d", "<f8"), ("e", "<i8")])
    rows = np.array([(-128, -32768, -(2**31), 2**32 - 1, -1), (127, 32767, 2**31 - 1, 0, 0)], dtype=old)
    evolution = plan(old, new)
    got = evolution.new.from_rows(RowConverter(evolution).convert_rows(evolution.old.rows(rows)))
    assert got.tolist() == [(-128, -32768, -2147483648.0, 4294967295.0, -1), (127, 32767, 2147483647.0, 0.0, 0)]


def test_rows_of_another_width_are_refused_naming_both_widths():
    evolution = plan(np.dtype([("a", "<i4")]), np.dtype([("a", "<i8")]))
    with pytest.raises(ValueError, match="rows are 8 bytes wide; the old rows are 4"):
        RowConverter(evolution).convert_rows(np.zeros((2, 8), np.uint8))


# -- a store read through a ConvertedImage -------------------------------------------------------
KEY = np.dtype([("id", "<i8")])
OLD = np.dtype([("count", "<i4"), ("total", "<f4"), ("tag", "S4")])
NEW = np.dtype([("tag", "S8"), ("n", "<i8"), ("total", "<f8"), ("seen", "?")])
CHANGES = SchemaChanges(renames={"count": "n"}, defaults={"seen": True})
N_KEYS = 3000


def old_value(k):
    return (k % 1000 - 500, k / 4, b"t%d" % (k % 97))


def as_new(value):
    """An OLD value as the plan defines it under NEW: written here, not by the store's code."""
    count, total, tag = value
    return (tag, count, float(np.float32(total)), True)


def old_store(root):
    """Version 1: N_KEYS keys, snapshotted; version 2: 100 updated, 50 removed (a delta)."""
    p = open_provider(root, KEY, OLD)
    commit_batch(p, 0, [(k, old_value(k)) for k in range(N_KEYS)])
    snapshot_now(p)
    commit_batch(p, 1, [(k, old_value(k + 1)) for k in range(100)], range(100, 150))
    p.close()
    model = {k: as_new(old_value(k)) for k in range(N_KEYS)}
    model.update({k: as_new(old_value(k + 1)) for k in range(100)})
    for k in range(100, 150):
        del model[k]
    return model


def open_new(root, **conf):
    conf = StateStoreConf(schema_changes={"default": CHANGES}, **conf)
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, NEW, conf)


def assert_restart_reads(p, version, model):
    """A provider opened afresh (``p``) reads ``version`` as ``model``; closed after."""
    store = p.get_read_store(version)
    try:
        assert contents(store) == model
    finally:
        store.abort()
        p.close()


def base_of(p):
    base = p.describe()["latest"]["base"]
    while base["kind"] == "spill":
        base = base["below"]
    return base


def test_a_value_change_reads_the_snapshot_in_place_by_every_path(tmp_path, caplog):
    model = old_store(tmp_path)
    p = open_new(tmp_path)
    with caplog.at_level(logging.INFO, logger="statecore"):
        store = p.get_store(2)
    base = base_of(p)
    assert (base["kind"], base["version"], base["rows"]) == ("snapshot", 1, N_KEYS)
    assert base["converted_from"] == RowSchema(OLD).describe()
    assert any("each row converted as it is read" in r.getMessage() for r in caplog.records)
    assert "keys_converted_from" not in base
    assert not any("converted to its schemas from" in r.getMessage() for r in caplog.records)  # not whole
    # per row (the compiled row calls), in a batch, whole
    for k in (0, 99, 100, 149, 150, 2999, 3000, -1):
        assert store.get(k) == model.get(k)
    keys = np.array([(k,) for k in range(-5, N_KEYS + 5, 7)], dtype=KEY)
    values, found = store.get_batch(keys)
    assert found.tolist() == [k in model for k in keys["id"]]
    assert [tuple(v) for v, f in zip(values.tolist(), found) if f] == [model[k] for k in keys["id"] if k in model]
    assert not values[~found].tobytes().strip(b"\0")  # a key not found has a zeroed value, no default in it
    assert contents(store) == model
    # a batch over it, committed, read again after a restart
    store.put(7, (b"later", 70, 0.5, False))
    store.remove(8)
    assert store.commit() == 3
    model[7] = (b"later", 70, 0.5, False)
    del model[8]
    p.close()
    assert_restart_reads(open_new(tmp_path), 3, model)


def test_levels_spilled_over_a_converted_snapshot_read_through_it_key_by_key(tmp_path, monkeypatch):
    """A spill before maintenance snapshots the change: lookups walk the levels, then the
    converted snapshot, with the per-row rule."""
    model = old_store(tmp_path)
    p = open_new(tmp_path, maintenance_interval_s=3600)
    updates = {k: (b"u", k, 1.0, False) for k in range(2000, 2600)}
    commit_batch(p, 2, list(updates.items()), range(2600, 2700))
    model.update(updates)
    for k in range(2600, 2700):
        del model[k]
    monkeypatch.setattr("statecore.held_versions.SPILL_MIN_ROWS", 16)
    p.spill_if_outgrown(ratio=0.0)
    described = p.describe()["latest"]["base"]
    assert described["kind"] == "spill" and described["below"].get("converted_from")
    store = p.get_read_store(3)
    keys = np.array([(k,) for k in range(N_KEYS + 10)], dtype=KEY)
    values, found = store.get_batch(keys)
    assert {int(k): tuple(v) for k, v, f in zip(keys["id"], values.tolist(), found) if f} == model
    assert store.get(2650) is None and store.get(5) == model[5] and store.get(2001) == model[2001]
    assert contents(store) == model
    store.abort()
    p.close()


def test_maintenance_snapshots_the_change_and_the_base_is_a_plain_snapshot_after(tmp_path):
    model = old_store(tmp_path)
    p = open_new(tmp_path)
    store = p.get_store(2)
    store.put(1, (b"x", 1, 1.0, True))
    store.commit()
    model[1] = (b"x", 1, 1.0, True)
    p.do_maintenance()  # the first version under the new schemas is snapshotted at the next pass
    assert "converted_from" not in base_of(p)
    store = p.get_read_store(3)
    assert contents(store) == model
    store.abort()
    p.close()
    p = open_new(tmp_path)
    p.get_read_store(3).abort()
    assert "converted_from" not in base_of(p)  # loaded from the new snapshot
    p.close()


def test_a_damaged_block_of_the_old_snapshot_raises_when_read_through_the_conversion(tmp_path):
    """An image snapshot (mapped where it lies) damaged in its rows, with no delta to fall
    back on: reading it through the conversion raises naming the file, never a wrong value."""
    q = open_provider(tmp_path, KEY, OLD, compression="none")
    commit_batch(q, 0, [(k, old_value(k)) for k in range(N_KEYS)])
    snapshot_now(q)
    q.close()
    snapshot = the_file(tmp_path, 1, "snapshot")
    with open(snapshot, "r+b") as f:
        f.seek(os.path.getsize(snapshot) // 3)
        f.write(b"\xff" * 8)
    os.remove(the_file(tmp_path, 1, "delta"))
    p = open_new(tmp_path, compression="none")
    with pytest.raises(StateCorruptionError, match=os.path.basename(snapshot)):
        store = p.get_read_store(1)
        assert base_of(p).get("converted_from")
        contents(store)
    p.close()


def test_a_snapshot_two_key_changes_old_is_converted_whole_and_maintenance_makes_it_durable(tmp_path, caplog):
    """A key widened twice (int16 -> int32 at version 2, with no snapshot, then -> int64): the
    snapshot of version 1 is two recorded changes old, so it is converted whole into a spill
    of the provider's schemas, once; after an empty batch (no change to the rows) maintenance
    still snapshots the newest version under the new schemas, and a restart converts nothing."""
    q = open_provider(tmp_path, np.dtype([("id", "<i2")]), OLD)
    commit_batch(q, 0, [(k, old_value(k)) for k in range(100)])
    snapshot_now(q)
    q.close()
    q = open_provider(tmp_path, np.dtype([("id", "<i4")]), OLD, maintenance_interval_s=3600)
    commit_batch(q, 1, [(100, old_value(100))])
    q.close()
    expected = {k: old_value(k) for k in range(101)}
    p = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), KEY, OLD, StateStoreConf())
    with caplog.at_level(logging.INFO, logger="statecore"):
        store = p.get_store(2)
    assert any("converted to its schemas from" in r.getMessage() for r in caplog.records)
    assert "converted_from" not in str(p.describe())
    assert contents(store) == expected
    assert store.commit() == 3  # nothing changed in it
    p.do_maintenance()
    assert os.path.exists(the_file(tmp_path, 3, "snapshot"))
    p.close()
    caplog.clear()
    p = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), KEY, OLD, StateStoreConf())
    with caplog.at_level(logging.INFO, logger="statecore"):
        store = p.get_read_store(3)
    assert not any("converted" in r.getMessage() for r in caplog.records)
    assert contents(store) == expected
    store.abort()
    p.close()


# -- a re-key read in place: int and bytes key fields widened --------------------------------------
OLD_KEY = np.dtype([("id", "<i4"), ("tag", "S4")])
NEW_KEY = np.dtype([("id", "<i8"), ("tag", "S8")])


def rekey_store(root):
    """Version 1: keys (id, tag) with ids of both signs, snapshotted; version 2: 100 updated,
    50 removed (a delta). Returns the model in the new schemas: {(id, tag): NEW value}."""
    p = open_provider(root, OLD_KEY, OLD)
    keys = [(k - 1500, b"t%d" % (k % 7)) for k in range(N_KEYS)]
    commit_batch(p, 0, [(key, old_value(i)) for i, key in enumerate(keys)])
    snapshot_now(p)
    commit_batch(p, 1, [(key, old_value(i + 1)) for i, key in enumerate(keys[:100])], keys[100:150])
    p.close()
    model = {key: as_new(old_value(i + 1 if i < 100 else i)) for i, key in enumerate(keys)}
    for key in keys[100:150]:
        del model[key]
    return model


def open_rekeyed(root, **conf):
    conf = StateStoreConf(schema_changes={"default": CHANGES}, **conf)
    return create_and_init_provider(StateStoreId(str(root), 0, 0), NEW_KEY, NEW, conf)


# New keys no old key becomes: an id beyond int32 whose low bytes are an old id, a tag longer
# than the old S4 whose first bytes are an old tag. A narrowing that only kept the low bytes
# would find the old rows.
OUT_OF_RANGE = [(2**32 - 1500 + 1, b"t1"), (-(2**32) - 1499, b"t1"), (-1499, b"t1xxxx"), (1, b"t3\0\0z")]


def test_a_widened_key_reads_the_snapshot_in_place_by_every_path(tmp_path, caplog):
    """int32 -> int64 and S4 -> S8: the snapshot is probed in place, each
    new key narrowed back to the old one it comes from: per row, in a batch and whole, keys out
    of the old fields' ranges are not found, a batch commits over it, and a restart reads it."""
    model = rekey_store(tmp_path)
    p = open_rekeyed(tmp_path)
    with caplog.at_level(logging.INFO, logger="statecore"):
        store = p.get_store(2)
    base = base_of(p)
    assert (base["kind"], base["version"], base["rows"]) == ("snapshot", 1, N_KEYS)
    assert base["keys_converted_from"] == RowSchema(OLD_KEY).describe()
    assert not any("converted to its schemas from" in r.getMessage() for r in caplog.records)  # not whole
    probes = list(model)[::37] + [(-1399, b"t1"), (-1400, b"t2")] + OUT_OF_RANGE
    for key in probes:
        assert store.get(key) == model.get(key), key
    keys = np.array(probes, dtype=NEW_KEY)
    values, found = store.get_batch(keys)
    assert found.tolist() == [key in model for key in probes]
    assert [tuple(v) for v, f in zip(values.tolist(), found) if f] == [model[k] for k in probes if k in model]
    assert not values[~found].tobytes().strip(b"\0")
    assert contents(store) == model
    store.put((-1499, b"t1xxxx"), (b"new", 1, 1.0, True))  # beside (-1499, b"t1"), not over it
    store.put((-1499, b"t1"), (b"upd", 2, 2.0, False))
    store.remove((-1498, b"t2"))
    assert store.commit() == 3
    model[(-1499, b"t1xxxx")] = (b"new", 1, 1.0, True)
    model[(-1499, b"t1")] = (b"upd", 2, 2.0, False)
    del model[(-1498, b"t2")]
    p.close()
    assert_restart_reads(open_rekeyed(tmp_path), 3, model)


def test_levels_spilled_over_a_rekeyed_snapshot_and_its_key_filter(tmp_path, monkeypatch):
    """Levels spilled over the re-keyed snapshot hide its rows they change or remove (its rows
    are marked through the narrowed keys), and the snapshot offers no key filter (its own is of
    the old keys), even when maintenance is asked to build one."""
    model = rekey_store(tmp_path)
    p = open_rekeyed(tmp_path, maintenance_interval_s=3600)
    some = list(model)[1000:1600]
    updates = {key: (b"u", i, 1.0, False) for i, key in enumerate(some[:500])}
    commit_batch(p, 2, list(updates.items()) + [((2**40, b"t9xxxx"), (b"far", 0, 0.0, True))], some[500:])
    model.update(updates)
    model[(2**40, b"t9xxxx")] = (b"far", 0, 0.0, True)
    for key in some[500:]:
        del model[key]
    monkeypatch.setattr("statecore.held_versions.SPILL_MIN_ROWS", 16)
    p.spill_if_outgrown(ratio=0.0)
    _filter_bottom(p)
    described = p.describe()["latest"]["base"]
    assert described["kind"] == "spill" and described["below"].get("keys_converted_from")
    assert described["below"]["filter"] is False
    store = p.get_read_store(3)
    probes = list(model) + some[500:] + OUT_OF_RANGE
    values, found = store.get_batch(np.array(probes, dtype=NEW_KEY))
    assert {key: tuple(v) for key, v, f in zip(probes, values.tolist(), found) if f} == model
    assert all(store.get(key) == model.get(key) for key in probes[::11])
    assert contents(store) == model
    store.abort()
    p.do_maintenance()  # the change snapshotted: a plain snapshot under it from then on
    assert "keys_converted_from" not in base_of(p)
    store = p.get_read_store(3)
    assert contents(store) == model
    store.abort()
    p.close()
