"""Lookups through spilled levels (statecore._versions) and their key filters
(statecore._keyfilter): the filter never forgets a key and rarely claims an absent one, and
a snapshot writer fills one with the keys it writes;
the compiled walk through deep stacks of levels with removes equals the model, with real
filters (the levels' and the snapshot's) and with none; damage in the snapshot under the
levels is reported, naming it."""
from unittest import mock

import numpy as np
import pytest

import statecore.maintenance
import statecore.spill
from statecore._keyfilter import KeyFilter
from statecore._snapshot import SnapshotWriter
from statecore.errors import StateCorruptionError
from statecore.spill import Spill
from tests.store_support import open_provider, snapshot_now
from tests.engine.test_spill import KEY, VALUE, NO_VALUE, check, commit, random_changes, spill_always


def key_rows(values):
    return np.ascontiguousarray(np.asarray(values, dtype="<i8").view(np.uint8).reshape(-1, 8))


def test_a_filter_holds_every_key_added_and_few_others():
    rng = np.random.default_rng(5)
    added = rng.choice(1 << 40, size=50_000, replace=False)
    f = KeyFilter(8, added.size)
    f.add_rows(key_rows(added[:25_000]))
    f.add_rows(np.hstack([key_rows(added[25_000:]), np.zeros((25_000, 16), np.uint8)]))  # whole rows
    assert f.may_hold_rows(key_rows(added)).all()
    absent = np.setdiff1d(rng.choice(1 << 40, size=200_000, replace=False), added)
    rate = f.may_hold_rows(key_rows(absent)).mean()
    assert 0.002 < rate < 0.03, rate  # 10 bits a key: about one in a hundred
    assert f.nbytes == 50_000 * 10 // 8 + 32 - (50_000 * 10 // 8) % 32


def test_a_filter_refuses_what_it_cannot_hold():
    assert not KeyFilter(8, 0).may_hold_rows(key_rows([1, 2, 3])).any()
    with pytest.raises(ValueError, match="sized for no keys"):
        KeyFilter(8, 0).add_rows(key_rows([1]))
    with pytest.raises(ValueError, match="8-byte key"):
        KeyFilter(8, 10).add_rows(np.zeros((2, 4), np.uint8))
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        KeyFilter(8, 10).may_hold_rows(np.zeros((2, 16), np.uint8))
    with pytest.raises(ValueError, match="positive"):
        KeyFilter(0, 10)


def test_a_snapshot_writer_fills_a_filter_with_the_keys_it_writes(tmp_path):
    rng = np.random.default_rng(9)
    keys = rng.choice(1 << 40, size=30_000, replace=False)
    rows = np.zeros(keys.size, np.dtype([("k", "<i8"), ("count", "<i8"), ("sum", "<f8")]))
    rows["k"] = keys
    f = KeyFilter(8, keys.size)
    with open(tmp_path / "image", "wb") as out:
        writer = SnapshotWriter(out, KEY, VALUE, keys.size, 1, key_filter=f)
        for part in np.array_split(rows.view(np.uint8).reshape(keys.size, -1), 7):
            writer.write_rows(np.ascontiguousarray(part))
        writer.finish()
    assert f.may_hold_rows(key_rows(keys)).all()
    assert f.may_hold_rows(key_rows(keys + (1 << 41))).mean() < 0.03
    with open(tmp_path / "other", "wb") as out:
        with pytest.raises(ValueError, match="16-byte keys, not 8"):
            SnapshotWriter(out, KEY, VALUE, 1, 1, key_filter=KeyFilter(16, 1))
        with pytest.raises(ValueError, match="sized for no keys"):
            SnapshotWriter(out, KEY, VALUE, 1, 1, key_filter=KeyFilter(8, 0))


def levels_of(spill):
    out, node = [], spill
    while isinstance(node, Spill):
        out.append(node)
        node = node.lower
    return out, node


def python_walk(spill, keys):
    """The reference: each key's newest level that puts or removes it, per row, through each
    image's own get_row (written here, apart from the compiled rule it checks)."""
    out = []
    for row in keys:
        key, node, value = bytes(row), spill, None
        while isinstance(node, Spill):
            value = node.puts.get_row(key)
            if value is not None or node.lower is None:
                break
            if node.dels is not None and node.dels.get_row(key) is not None:
                break  # removed here: absent
            node = node.lower
        else:
            value = node.get_row(key) if node is not None else None
        out.append(value)
    return out


@pytest.mark.parametrize("value", [VALUE, NO_VALUE], ids=["values", "set"])
@pytest.mark.parametrize("filters", [True, False], ids=["filters", "no-filters"])
def test_the_walk_through_deep_levels_equals_the_model(tmp_path, monkeypatch, value, filters):
    """Levels never taken in (so ten stack up), each with puts and removes over a snapshot
    (given its key filter by maintenance, or not): batch lookups, per-row gets and iteration
    equal the model at every retained version, and the batch walk equals a per-row walk."""
    if not filters:  # no level's writer fills a filter, and maintenance builds none
        monkeypatch.setattr(statecore.maintenance, "KEY_FILTER_MAX_ROWS", -1)
        monkeypatch.setattr(statecore.spill, "KeyFilter", lambda key_width, capacity: None)
    rng = np.random.default_rng(17)
    key_space = 600
    p = open_provider(tmp_path, KEY, value, min_deltas_for_snapshot=1000, max_versions_to_retain_in_memory=3)
    model = {0: {}}
    commit(p, model, {k: ((k, 0.0) if value.names else ()) for k in range(300)}, [], value)
    snapshot_now(p)  # a snapshot of 1
    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0):
        for _ in range(10):
            commit(p, model, *random_changes(rng, max(model) + 1, key_space, 30, 20, value), value)
            with spill_always():
                p.do_maintenance()
    top = p.held.newest.base
    levels, bottom = levels_of(top)
    assert len(levels) == 10 and type(bottom).__name__ == "SnapshotReader"
    assert (bottom.key_filter is not None) == filters
    assert all(level.dels is not None and level.dels.row_count for level in levels)
    assert all((image.key_filter is not None) == filters for level in levels for image in (level.puts, level.dels))
    check(p, model, range(max(model) - 2, max(model) + 1), key_space, value)
    keys = key_rows(np.arange(key_space))
    values, found = top.lookup(keys)
    reference = python_walk(top, keys)
    assert found.tolist() == [r is not None for r in reference]
    if value.names:
        assert [bytes(values[i]) for i in np.flatnonzero(found)] == [r for r in reference if r is not None]
        assert not values[~found].any(), "absent keys read as zeros"


def test_the_walk_reports_damage_in_the_snapshot_below_the_levels(tmp_path):
    """The data blocks of the mapped snapshot, damaged after it was opened, while most were
    not yet checked: the walk raises StateCorruptionError naming that file, and the store keeps
    serving the keys the levels decide."""
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(20_000)}, [], VALUE)
    snapshot_now(p)
    p.close()  # its whole image goes: the reopened provider maps the snapshot
    reopened = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)  # blocks not yet checked
    commit(reopened, model, {k: (k, 1.0) for k in range(10)}, [], VALUE)
    with spill_always():
        reopened.do_maintenance()
    top = reopened.held.newest.base
    _, bottom = levels_of(top)
    assert isinstance(top, Spill) and type(bottom).__name__ == "SnapshotReader"
    n_blocks = bottom.n_blocks
    assert bottom.verified_blocks() < n_blocks  # the commit's lookups read a few
    with open(bottom.path, "r+b") as f:  # a byte of every data block: the mapping sees the writes
        for b in range(n_blocks):
            at = bottom.rows_offset + b * bottom.block_size
            f.seek(at)
            damaged = bytes([f.read(1)[0] ^ 0xFF])
            f.seek(at)
            f.write(damaged)
    with pytest.raises(StateCorruptionError, match="checksum mismatch") as raised:
        top.lookup(key_rows(np.arange(20_000)))
    assert str(bottom.path) in str(raised.value)
    values, found = top.lookup(key_rows(np.arange(10)))  # decided by the level: no block read
    assert found.all() and (values.view(VALUE)["sum"] == 1.0).all()


def test_levels_that_only_remove_or_only_put(tmp_path):
    """A level whose puts image is empty (its version only removed keys) and one with no
    removes: lookups, per-row gets and iteration still equal the model."""
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(200)}, [], VALUE)
    snapshot_now(p)
    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0):
        commit(p, model, {}, list(range(0, 50)), VALUE)
        with spill_always():
            p.do_maintenance()
        commit(p, model, {k: (k, 2.0) for k in range(40, 60)}, [], VALUE)
        with spill_always():
            p.do_maintenance()
    levels, _ = levels_of(p.held.newest.base)
    assert [(level.puts.row_count, level.dels.row_count) for level in levels] == [(20, 0), (0, 50)]
    check(p, model, [max(model)], 250, VALUE)


def test_the_walk_asks_the_snapshot_s_filter_only_while_it_pays(tmp_path, monkeypatch):
    """Under the levels, the snapshot's filter is asked about the first keys of each window of
    a batch that reach it, and about the rest only if it ruled out at least one in eight of
    those. Made visible with a filter that lacks some present keys (a broken filter, for the
    test): where it was asked about them they read as absent, where it was not they are found."""
    monkeypatch.setattr(statecore.maintenance, "KEY_FILTER_MAX_ROWS", -1)  # the test gives it its filter
    rng = np.random.default_rng(23)
    n = 20_000
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(n)}, [], VALUE)
    snapshot_now(p)
    p.close()  # its whole image goes: the reopened provider maps the snapshot
    reopened = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)
    commit(reopened, model, {k: (k, 1.0) for k in range(0, n, 1000)}, [], VALUE)
    with spill_always():
        reopened.do_maintenance()
    top = reopened.held.newest.base
    levels, bottom = levels_of(top)
    assert len(levels) == 1 and type(bottom).__name__ == "SnapshotReader" and bottom.key_filter is None
    keys = key_rows(np.arange(n))
    lacking = rng.random(n) < 0.05
    broken = KeyFilter(8, n)
    broken.add_rows(np.ascontiguousarray(keys[~lacking]))
    bottom.set_key_filter(broken)
    in_level = np.arange(n) % 1000 == 0
    held = broken.may_hold_rows(keys) | in_level  # found whether the filter is asked or not
    # Ruled out by the snapshot's filter where the walk asks it about them in the first pass
    # (the keys no level's filter may hold; the others are asked about after their probe).
    ruled_out = ~held & ~levels[0].puts.key_filter.may_hold_rows(keys)
    assert ruled_out.sum() > 900
    offset = np.arange(n) % 4096
    # Every key present: past each window's sample the filter is not asked.
    _, found = top.lookup(keys)
    assert found[held].all()
    assert not found[ruled_out & (offset < 256)].any()  # asked
    assert found[ruled_out & (offset >= 512)].all()  # not asked: probed, found
    # Half the keys absent: it pays, and is asked about every key that reaches the snapshot.
    mixed = key_rows(np.stack([np.arange(n), np.arange(n) + 10 * n], axis=1).ravel())
    _, found = top.lookup(mixed)
    assert found[0::2].tolist() == held.tolist() and not found[1::2].any()
