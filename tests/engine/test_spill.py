"""Spilled heads (statecore.spill): reads through a spill equal the model at every retained
version (batch lookups, per-row gets, iteration, a reload from files), spills take in older
ones, a snapshot is written from a spill; the heap stays a fraction of the raw rows at every
commit; a spill that fails half-way loses nothing and leaves no file."""
import os
from unittest import mock

import numpy as np
import pytest

import statecore.maintenance
import statecore.held_versions
import statecore.loading
import statecore._versions
import statecore.spill
from tests.store_support import applied, contents, open_provider, snapshot_now, write_batch
from statecore._versions import FrozenView
from statecore.spill import Spill, bottom_snapshot

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
NO_VALUE = np.dtype([])
ROW_BYTES = KEY.itemsize + VALUE.itemsize


def spill_always():
    """Maintenance spills any non-empty head."""
    return mock.patch.multiple("statecore.held_versions", SPILL_MIN_ROWS=-1, SPILL_RATIO=0)


def random_changes(rng, version, key_space, n_puts, n_removes, value):
    ks = rng.choice(key_space, size=n_puts + n_removes, replace=False).tolist()
    if value.names:
        puts = {k: (int(rng.integers(0, 1000)), float(version)) for k in ks[:n_puts]}
    else:
        puts = {k: () for k in ks[:n_puts]}
    return puts, ks[n_puts:]


def commit(provider, model, puts, removes, value):
    v = max(model)
    store = provider.get_store(v)
    write_batch(store, KEY, value, puts, removes)
    assert store.commit() == v + 1
    model[v + 1] = applied(model[v], puts, removes)


def check(provider, model, versions, key_space, value):
    """Every version in ``versions`` reads as the model has it: iteration, get_batch of the
    whole key space, and per-row gets."""
    keys = np.zeros(key_space, KEY)
    keys["k"] = np.arange(key_space)
    for v in versions:
        store = provider.get_read_store(v)
        try:
            assert contents(store) == model[v], f"version {v}: iteration differs"
            values, found = store.get_batch(keys)
            assert found.tolist() == [k in model[v] for k in range(key_space)], f"version {v}: get_batch"
            if value.names:
                got = {k: tuple(values[k].tolist()) for k in np.flatnonzero(found).tolist()}
                assert got == model[v], f"version {v}: get_batch values"
            for k in range(0, key_space, 7):
                expected = model[v].get(k)
                got = store.get((k,))
                assert (got is None if expected is None else tuple(got) == expected), f"version {v}: get({k})"
        finally:
            store.abort()


def bases(provider):
    out, state = [], provider.held.newest
    while state is not None:
        out.append(state.base)
        state = state.base.state if isinstance(state.base, FrozenView) else None
    return out


@pytest.mark.parametrize("value", [VALUE, NO_VALUE], ids=["values", "set"])
def test_reads_through_spills_equal_the_model(tmp_path, value):
    rng = np.random.default_rng(7)
    key_space = 400
    p = open_provider(tmp_path, KEY, value, min_deltas_for_snapshot=5, max_versions_to_retain_in_memory=3)
    model = {0: {}}
    spills = snapshots = 0
    for _ in range(30):
        commit(p, model, *random_changes(rng, max(model) + 1, key_space, 40, 15, value), value)
        with spill_always():
            p.do_maintenance()
        base = p.held.newest.base
        spills += isinstance(base, Spill)
        snapshots += type(base).__name__ == "SnapshotReader"
        top = max(model)
        check(p, model, range(max(top - 2, 0), top + 1), key_space, value)
    assert spills > 10 and snapshots > 2, (spills, snapshots)  # both kinds of base were read
    reloaded = open_provider(tmp_path, KEY, value)
    check(reloaded, model, [max(model)], key_space, value)


def test_spills_stack_and_take_in_the_levels_no_bigger_than_them(tmp_path):
    """A spill smaller than half the newest level stacks over it; one at least half as big
    takes it in, and the next level too when that is no bigger than twice both; keys put in
    one level and removed (or put again) in a newer one are decided by the newest; a
    snapshot written from the levels equals the model."""
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=100)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(100)}, [], VALUE)
    snapshot_now(p)  # a snapshot of 1
    snapshot = p.held.newest.base
    assert type(snapshot).__name__ == "SnapshotReader"
    commit(p, model, {k: (k, 1.0) for k in range(100, 120)}, list(range(0, 10)), VALUE)
    with spill_always():
        p.do_maintenance()
    first = p.held.newest.base
    assert isinstance(first, Spill) and first.own_changed == 30 and first.lower is snapshot
    commit(p, model, {k: (k, 2.0) for k in range(0, 5)}, list(range(100, 109)), VALUE)
    with spill_always():
        p.do_maintenance()
    second = p.held.newest.base
    assert isinstance(second, Spill) and second.lower is first, "14 changes stack over a level of 30"
    check(p, model, [1, 2, 3], 130, VALUE)
    commit(p, model, {k: (k, 3.0) for k in range(200, 240)}, list(range(110, 115)), VALUE)
    with spill_always():
        p.do_maintenance()
    third = p.held.newest.base
    assert isinstance(third, Spill) and third.lower is snapshot, "45 changes take in 14, then 30"
    # puts: 200..239, 0..4 (second), 109 and 115..119 (first, less second's and the head's
    # removes); dels: 110..114, 100..108 (second), 5..9 (first, less second's puts)
    assert (third.puts.row_count, third.dels.row_count) == (51, 19)
    check(p, model, [2, 3, 4], 250, VALUE)
    commit(p, model, {k: (k, 4.0) for k in range(0, 3)}, [200], VALUE)
    with spill_always():
        p.do_maintenance()
    assert p.held.newest.base.lower is third
    snapshot_now(p)  # a snapshot of 5, from two levels over the snapshot of 1
    base = p.describe()["latest"]["base"]
    assert base["kind"] == "snapshot" and base["version"] == 5 and base["rows"] == len(model[5])
    check(open_provider(tmp_path, KEY, VALUE), model, [5], 250, VALUE)


def snapshot_files(root):
    d = os.path.join(str(root), "0", "0")
    return sorted(n for n in os.listdir(d) if n.endswith(".snapshot"))


def outgrown_at_any_size():
    """Changes past half the state are due for compaction whatever the state's size."""
    return mock.patch("statecore.held_versions.HEAD_SNAPSHOT_MIN_ROWS", 0)


def spilled_whole(root):
    """A provider of 500 keys in version 1, which maintenance spilled whole (over nothing),
    and its model."""
    p = open_provider(root, KEY, VALUE, min_deltas_for_snapshot=1000)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(500)}, [], VALUE)
    with spill_always():
        p.do_maintenance()
    return p, model


@pytest.mark.parametrize("value", [VALUE, NO_VALUE], ids=["values", "set"])
def test_changes_past_half_the_state_compact_the_levels_into_a_whole_spill(tmp_path, value):
    """Levels stacked over the snapshot of 1 until their changes pass half the state: the
    pass writes the version whole as one local spill (no snapshot file: none is due by the
    deltas), the levels are let go, and every retained version reads as the model, from
    memory and from files; later spills stand over the whole one as over a snapshot."""
    rng = np.random.default_rng(23)
    key_space = 300
    p = open_provider(tmp_path, KEY, value, min_deltas_for_snapshot=1000, max_versions_to_retain_in_memory=3)
    model = {0: {}}
    commit(p, model, {k: ((k, 0.0) if value.names else ()) for k in range(200)}, [], value)
    snapshot_now(p)
    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0):
        for _ in range(3):  # three levels of up to 40 changes each, of about 200 keys
            commit(p, model, *random_changes(rng, max(model) + 1, key_space, 30, 10, value), value)
            with spill_always():
                p.do_maintenance()
        top = p.held.newest.base
        assert isinstance(top, Spill) and not top.whole
        assert top.lower.lower.lower is bottom_snapshot(top) is not None
        assert top.changed == top.own_changed + top.lower.own_changed + top.lower.lower.own_changed
        commit(p, model, *random_changes(rng, max(model) + 1, key_space, 30, 10, value), value)
        with spill_always(), outgrown_at_any_size():
            p.do_maintenance()
    whole = p.held.newest.base
    assert isinstance(whole, Spill) and whole.whole and whole.dels is None, whole
    assert whole.version == max(model) and whole.changed == 0
    assert whole.puts.row_count == whole.num_keys == len(model[max(model)])
    assert snapshot_files(tmp_path) == [n for n in snapshot_files(tmp_path) if n.startswith("1_")], \
        "compaction wrote a snapshot file"
    check(p, model, range(max(model) - 2, max(model) + 1), key_space, value)
    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0):
        commit(p, model, *random_changes(rng, max(model) + 1, key_space, 20, 5, value), value)
        with spill_always():
            p.do_maintenance()
    assert p.held.newest.base.lower is whole and p.held.newest.base.changed == p.held.newest.base.own_changed > 0
    check(p, model, range(max(model) - 2, max(model) + 1), key_space, value)
    check(open_provider(tmp_path, KEY, value), model, [max(model)], key_space, value)


def test_a_head_as_big_as_half_the_whole_spill_takes_it_in(tmp_path, monkeypatch):
    """A batch that changes most keys (the race at 1M keys changes about 60% of each
    partition's): its spill takes in the whole spill below, so it is whole itself and no
    compaction follows; no snapshot file is written until the deltas rule asks."""
    rng = np.random.default_rng(29)
    p, model = spilled_whole(tmp_path)
    first = p.held.newest.base
    assert isinstance(first, Spill) and first.whole, "the first head spills over nothing: whole"
    compactions, compact = [], statecore.maintenance._compact
    monkeypatch.setattr(statecore.maintenance, "_compact", lambda *args: compactions.append(args) or compact(*args))
    for _ in range(3):
        commit(p, model, *random_changes(rng, max(model) + 1, 500, 300, 20, VALUE), VALUE)
        with spill_always(), outgrown_at_any_size():
            p.do_maintenance()
        base = p.held.newest.base
        assert isinstance(base, Spill) and base.whole and base.version == max(model)
        assert base.puts.row_count == len(model[max(model)])
    assert snapshot_files(tmp_path) == [] and not compactions, compactions
    check(p, model, [max(model)], 500, VALUE)
    check(open_provider(tmp_path, KEY, VALUE), model, [max(model)], 500, VALUE)


def test_an_image_over_the_filter_cap_gets_no_filter_and_reads_the_same(tmp_path, monkeypatch):
    """A whole spill of more than KEY_FILTER_MAX_ROWS rows keeps no KeyFilter on the heap;
    lookups probe its slots instead, with the same answers; a smaller level keeps its own."""
    monkeypatch.setattr(statecore.spill, "KEY_FILTER_MAX_ROWS", 100)
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(300)}, [], VALUE)
    with spill_always():
        p.do_maintenance()
    whole = p.held.newest.base
    assert isinstance(whole, Spill) and whole.whole and whole.puts.key_filter is None
    commit(p, model, {k: (k, 1.0) for k in range(290, 330)}, [1, 2, 3], VALUE)
    with spill_always():
        p.do_maintenance()
    level = p.held.newest.base
    assert level.lower is whole and level.puts.key_filter is not None
    check(p, model, [max(model) - 1, max(model)], 400, VALUE)


def test_a_head_spilled_while_the_levels_are_compacted_stands_over_the_whole_spill(tmp_path, monkeypatch):
    """While the compaction writes its rows, a commit makes the head outgrow its share: it is
    spilled at once, over the spill being compacted; the whole spill then replaces that one
    under it, and every version reads as the model."""
    rng = np.random.default_rng(31)
    key_space = 300
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000, max_versions_to_retain_in_memory=3)
    model = {0: {}}
    commit(p, model, {k: (k, 0.0) for k in range(200)}, [], VALUE)
    snapshot_now(p)
    original_rows = Spill.rows
    compacting = []

    def rows_with_a_commit_between(self, chunk_rows=1 << 16):
        for i, chunk in enumerate(original_rows(self, chunk_rows=7)):
            yield chunk
            if i == 2 and not compacting:  # once, in the middle of the compaction's rows
                compacting.append(self)
                commit(p, model, *random_changes(rng, max(model) + 1, key_space, 20, 5, VALUE), VALUE)

    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0):
        commit(p, model, *random_changes(rng, max(model) + 1, key_space, 160, 30, VALUE), VALUE)
        monkeypatch.setattr(statecore.maintenance, "rewritten_rows", rows_with_a_commit_between)
        with spill_always(), outgrown_at_any_size():
            p.do_maintenance()
    assert compacting, "no commit happened during the compaction"
    top = p.held.newest.base
    assert isinstance(top, Spill) and top.version == max(model) and not top.whole
    assert top.lower.whole and top.lower.version == compacting[0].version, "the newer spill is not over the whole one"
    monkeypatch.setattr(statecore.maintenance, "rewritten_rows", original_rows)
    check(p, model, range(max(model) - 2, max(model) + 1), key_space, VALUE)
    check(open_provider(tmp_path, KEY, VALUE), model, [max(model)], key_space, VALUE)


def test_heap_stays_a_fraction_of_the_rows(tmp_path):
    """Maintenance after every commit (as the registry's hint asks): once the state holds most
    of its keys, the provider's tables (the head, the undo layer, the committing store's
    update layer, the levels' key filters) stay under 0.8x the raw rows at every commit;
    without spills, past 1.5x."""
    def run(root, spill_ratio):
        rng = np.random.default_rng(3)
        key_space, batch = 50_000, 5_000
        p = open_provider(root, KEY, VALUE, min_deltas_for_snapshot=1000)
        model_version, ratios = 0, []
        with mock.patch.multiple("statecore.held_versions", SPILL_RATIO=spill_ratio, SPILL_HARD_RATIO=2 * spill_ratio):
            for _ in range(30):
                store = p.get_store(model_version)
                keys = np.zeros(batch, KEY)
                keys["k"] = rng.choice(key_space, size=batch, replace=False)
                store.put_batch(keys, np.zeros(batch, VALUE))
                model_version = store.commit()
                m = store.metrics
                ratios.append(m.memory_used_bytes / (m.num_keys * ROW_BYTES))
                p.do_maintenance()
        return ratios[10:], p

    with_spills, p = run(tmp_path / "spill", statecore.held_versions.SPILL_RATIO)
    assert max(with_spills) < 0.8, with_spills
    assert p.describe()["latest"]["base"]["kind"] == "spill"
    without, _ = run(tmp_path / "none", float("inf"))
    assert max(without) > 1.5, without


def test_a_failed_spill_loses_nothing_and_leaves_no_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=100, max_versions_to_retain_in_memory=2)
    model = {0: {}}
    for _ in range(3):
        commit(p, model, *random_changes(rng, max(model) + 1, 300, 50, 10, VALUE), VALUE)
    made = []
    real_writer = statecore.spill.SnapshotWriter

    class FailingWriter:
        """A SnapshotWriter whose second chunk fails as a full disk would."""

        def __init__(self, f, *args, **kwargs):
            made.append(f.name)
            self.writer = real_writer(f, *args, **kwargs)
            self.chunks = 0

        def write_rows(self, chunk):
            self.chunks += 1
            if self.chunks == 2:
                raise OSError(28, "No space left on device")
            return self.writer.write_rows(chunk)

        def finish(self):
            return self.writer.finish()

    monkeypatch.setattr(statecore.spill, "SnapshotWriter", FailingWriter)
    monkeypatch.setattr(statecore.spill, "CHUNK_ROWS", 16)
    with spill_always(), pytest.raises(OSError, match="No space"):
        p.do_maintenance()
    assert made and not any(os.path.exists(f) for f in made), "the half-written spill is still there"
    check(p, model, [2, 3], 300, VALUE)
    commit(p, model, *random_changes(rng, 4, 300, 50, 10, VALUE), VALUE)
    check(p, model, [3, 4], 300, VALUE)
    monkeypatch.undo()
    with spill_always():
        p.do_maintenance()  # the state built over the frozen one: spilled whole
    assert any(isinstance(b, Spill) for b in bases(p))
    check(p, model, [3, 4], 300, VALUE)
    check(open_provider(tmp_path, KEY, VALUE), model, [1, 2, 3, 4], 300, VALUE)


def test_the_head_spills_over_the_spill_a_snapshot_is_written_from(tmp_path, monkeypatch):
    """Commits go on while maintenance writes a snapshot from a spill; the head they fill is
    spilled over that spill between chunks, and ends over the new snapshot once written."""
    rng = np.random.default_rng(5)
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=2, max_versions_to_retain_in_memory=2)
    model = {0: {}}
    for _ in range(3):
        commit(p, model, *random_changes(rng, max(model) + 1, 500, 60, 10, VALUE), VALUE)
    original_rows = Spill.rows
    during = []

    def rows_with_commits(self, chunk_rows=1 << 16):
        for i, chunk in enumerate(original_rows(self, chunk_rows=8)):
            yield chunk
            if i < 2:  # the maintenance thread itself commits between chunks: no race to set up
                commit(p, model, *random_changes(rng, max(model) + 1, 500, 60, 10, VALUE), VALUE)
                during.append(max(model))

    monkeypatch.setattr(statecore.maintenance, "rewritten_rows", rows_with_commits)
    with spill_always():
        p.do_maintenance()
    assert during == [4, 5]
    base = p.held.newest.base
    assert isinstance(base, Spill) and base.version == 5, base
    levels, bottom = statecore._versions.spill_chain(base)
    assert [level.version for level in levels] in ([5], [5, 4]), levels
    assert type(bottom).__name__ == "SnapshotReader" and bottom.store_version == 3, \
        "the snapshot did not replace the spill it was written from"
    assert bottom.row_count == len(model[3])
    monkeypatch.undo()
    check(p, model, [4, 5], 500, VALUE)
    check(open_provider(tmp_path, KEY, VALUE), model, [3, 4, 5], 500, VALUE)


def test_a_store_open_across_a_spill_commits_into_the_spilled_state(tmp_path):
    """A task opens version 3, maintenance spills 3 meanwhile, the task commits 4: version 4
    stands on the spill (the frozen head is let go), not on the frozen State."""
    rng = np.random.default_rng(2)
    p = open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=100)
    model = {0: {}}
    for _ in range(3):
        commit(p, model, *random_changes(rng, max(model) + 1, 300, 40, 5, VALUE), VALUE)
    store = p.get_store(3)
    with spill_always():
        p.do_maintenance()
    spill = p.held.newest.base
    assert isinstance(spill, Spill) and spill.version == 3
    puts, removes = random_changes(rng, 4, 300, 40, 5, VALUE)
    write_batch(store, KEY, VALUE, puts, removes)
    assert store.commit() == 4
    model[4] = applied(model[3], puts, removes)
    assert bases(p) == [spill], bases(p)
    check(p, model, [3, 4], 300, VALUE)


def test_a_commit_spills_the_head_past_the_hard_limit(tmp_path, monkeypatch):
    """No maintenance runs: a commit whose head passed SPILL_HARD_RATIO of the state, when an
    earlier commit asked for a spill already, spills it before returning (so no two commits
    in a row leave it past the limit); one whose spill fails still returns its version."""
    rng = np.random.default_rng(4)
    p = open_provider(tmp_path, KEY, VALUE)
    model = {0: {}}
    heads = []
    monkeypatch.setattr(statecore.held_versions, "SPILL_MIN_ROWS", 16)
    for _ in range(12):
        commit(p, model, *random_changes(rng, max(model) + 1, 2000, 150, 10, VALUE), VALUE)
        state = p.held.newest
        heads.append(len(state.head) / state.count(state.version))
    over = [h > statecore.held_versions.SPILL_HARD_RATIO for h in heads]
    assert not any(a and b for a, b in zip(over, over[1:])), heads
    assert any(over) and p.describe()["latest"]["base"]["kind"] == "spill", heads

    attempts = []

    def failing(*args, **kwargs):
        attempts.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(statecore.spill, "SnapshotWriter", failing)
    monkeypatch.setattr(statecore.held_versions, "SPILL_HARD_RATIO", 0)
    monkeypatch.setattr(statecore.held_versions, "SPILL_RATIO", 0)
    for _ in range(2):  # the first asks for a spill, the second tries one itself
        commit(p, model, *random_changes(rng, max(model) + 1, 2000, 150, 10, VALUE), VALUE)
    monkeypatch.undo()
    assert attempts, "no commit tried to spill"
    check(p, model, [max(model) - 1, max(model)], 2000, VALUE)
    check(open_provider(tmp_path, KEY, VALUE), model, [max(model)], 2000, VALUE)


def test_after_a_failed_spill_the_commits_wait_before_trying_again(tmp_path, monkeypatch):
    """A spill that fails (a full disk) leaves the State on a frozen one, so the next try
    writes the whole state: commits within SPILL_RETRY_S of the failure do not try, and
    their versions stand; once the window passed, a spill is tried again and succeeds."""
    rng = np.random.default_rng(6)
    p = open_provider(tmp_path, KEY, VALUE)
    model = {0: {}}
    commit(p, model, *random_changes(rng, 1, 2000, 300, 0, VALUE), VALUE)
    attempts = []
    writer = statecore.spill.SnapshotWriter

    def failing(*args, **kwargs):
        attempts.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(statecore.held_versions, "SPILL_HARD_RATIO", 0)
    monkeypatch.setattr(statecore.held_versions, "SPILL_RATIO", 0)
    monkeypatch.setattr(statecore.held_versions, "SPILL_MIN_ROWS", 16)
    monkeypatch.setattr(statecore.maintenance, "SPILL_RETRY_S", 3600.0)
    monkeypatch.setattr(statecore.spill, "SnapshotWriter", failing)
    for _ in range(2):  # the first asks for a spill, the second tries one itself, and fails
        commit(p, model, *random_changes(rng, max(model) + 1, 2000, 150, 10, VALUE), VALUE)
    assert len(attempts) == 1 and p.maintenance_record.spill_failed_at is not None
    for _ in range(3):
        commit(p, model, *random_changes(rng, max(model) + 1, 2000, 150, 10, VALUE), VALUE)
        p.spill_if_outgrown()  # what the registry's thread does on a commit's hint
    assert len(attempts) == 1, "a spill was tried again within SPILL_RETRY_S of a failure"
    check(p, model, [max(model) - 1, max(model)], 2000, VALUE)

    monkeypatch.setattr(statecore.spill, "SnapshotWriter", writer)
    monkeypatch.setattr(statecore.maintenance, "SPILL_RETRY_S", 0.0)
    commit(p, model, *random_changes(rng, max(model) + 1, 2000, 150, 10, VALUE), VALUE)
    assert p.describe()["latest"]["base"]["kind"] == "spill" and p.maintenance_record.spill_failed_at is None
    check(p, model, [max(model)], 2000, VALUE)


# -- whole images shared by the processes of a machine ---------------------------------------------
def delta_name(provider, version):
    from statecore.lineage import file_name

    return file_name(version, provider.held.newest.commit_ids[version], "delta")


def count_delta_reads(monkeypatch):
    reads, original = [], statecore.loading.read_checked_delta

    def counted(p, f, *args, **kwargs):
        reads.append(f.name)
        return original(p, f, *args, **kwargs)

    monkeypatch.setattr(statecore.loading, "read_checked_delta", counted)
    return reads


def test_a_worker_maps_the_whole_image_another_published_instead_of_replaying_deltas(tmp_path, monkeypatch):
    """Two providers of one store (two Python workers of an executor) take the batches in
    turn. Each whole spill is published as the image of its version's delta; the other one,
    opening that version, maps it (no delta read, the image its base, a whole spill that its
    next spill takes in: whole again, with no compaction) rather than rolling forward; every
    version reads as the model has it, there and from files. A provider's
    older published image goes when it publishes a newer one, the newest when it closes."""
    rng = np.random.default_rng(41)
    workers = [open_provider(tmp_path, KEY, VALUE, min_deltas_for_snapshot=1000) for _ in range(2)]
    model = {0: {}}
    commit(workers[0], model, {k: (k, 0.0) for k in range(500)}, [], VALUE)
    reads = count_delta_reads(monkeypatch)
    compactions, compact = [], statecore.maintenance._compact
    monkeypatch.setattr(statecore.maintenance, "_compact", lambda *args: compactions.append(args) or compact(*args))
    published = {}
    for turn in range(5):
        writer, opener = workers[turn % 2], workers[(turn + 1) % 2]
        with spill_always(), outgrown_at_any_size():
            writer.do_maintenance()
        v = max(model)
        base = writer.held.newest.base
        assert isinstance(base, Spill) and base.whole and base.version == v
        name = delta_name(writer, v)
        published[v] = name
        assert writer.files.published_image(name) is not None, f"the whole spill of {v} was not published"
        del reads[:]
        check(opener, model, [v], 500, VALUE)
        assert reads == [], f"version {v} was read from deltas {reads}, not mapped from the published image"
        mapped = opener.held.newest.base
        assert isinstance(mapped, Spill) and mapped.whole and mapped.version == opener.held.newest.version == v
        if v - 2 in published:  # the writer published v - 2 too: it went when v was published
            assert writer.files.published_image(published[v - 2]) is None
        commit(opener, model, *random_changes(rng, v + 1, 500, 300, 20, VALUE), VALUE)
        check(opener, model, [v + 1], 500, VALUE)
    assert not compactions, "the spill over a mapped whole image did not take it in (a compaction made it whole)"
    check(open_provider(tmp_path, KEY, VALUE), model, [max(model)], 500, VALUE)
    last = workers[(5 - 1) % 2]
    name = published[max(published)]
    assert last.files.published_image(name) is not None
    last.close()
    assert last.files.published_image(name) is None, "a closed provider's image is still published"


@pytest.mark.parametrize("damage", ["flipped_byte", "another_version"])
def test_a_published_image_that_is_not_the_version_is_dropped_and_the_version_loads_from_files(
        tmp_path, monkeypatch, damage):
    """An image published for a version's delta that fails its checksums, or holds another
    version, is not used: the version loads from the checkpoint's files (its deltas), reads
    as the model has it, and the image is dropped."""
    rng = np.random.default_rng(43)
    writer, model = spilled_whole(tmp_path)
    with open(writer.files.published_image(delta_name(writer, 1)), "rb") as f:
        first = f.read()  # version 1's image (it goes when version 2's is published)
    commit(writer, model, *random_changes(rng, 2, 500, 300, 20, VALUE), VALUE)
    with spill_always(), outgrown_at_any_size():
        writer.do_maintenance()
    name = delta_name(writer, 2)
    path = writer.files.published_image(name)
    assert path is not None
    if damage == "flipped_byte":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    else:  # version 1's image, published as version 2's
        copy = writer.files.new_image_file("copy")
        with copy:
            copy.write(first)
        writer.files.publish_image(name, copy.name)
    reads = count_delta_reads(monkeypatch)
    reader = open_provider(tmp_path, KEY, VALUE)
    check(reader, model, [2], 500, VALUE)
    assert reads, "the version was not loaded from its deltas"
    assert writer.files.published_image(name) is None, "the image that is not the version is still published"
