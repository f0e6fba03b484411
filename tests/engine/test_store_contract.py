"""The store contract (docs/spark-state-store.md), for every provider class, the reference model included;
then what only the file provider has: files, snapshots, cleanup, lineage, damage. Damage must
give StateCorruptionError naming the damaged file, or a refusal that leaves nothing behind;
the cases that could hang or exhaust memory on a broken store (a huge version, a version file
that is /dev/zero or a FIFO) run in a subprocess with a time and address-space limit."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import statecore
import statecore.loading
from statecore.provider import SCHEMA_FILE
from tests.state_files import flip, put_in_place, version_names, version_path
from tests.store_support import (DELTA_LINEAGE_OFFSET, VERSION_FILE, assert_reads, attempt_id, call_with_deadline,
                                 commit_batch, commit_numbered, commit_upto, committed, contents, has_file,
                                 inject_faulty_files, load_outcome, maintaining, open_numbered, snapshot_now,
                                 snapshot_versions, store_dir, the_file)
from statecore import (IllegalStateError, SchemaMismatchError,
                       StateCorruptionError, StateStoreConf, StateStoreId, VersionNotFoundError,
                       create_and_init_provider)

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
PROVIDERS = ["statecore.FileStateStoreProvider", "models.DictStateStoreProvider"]


@pytest.fixture(params=PROVIDERS, ids=["file", "model"])
def provider_class(request):
    return request.param


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "state")


def make(root, provider_class="statecore.FileStateStoreProvider", partition=0, key=KEY, value=VALUE, **conf):
    conf = StateStoreConf(provider_class=provider_class, **conf)
    return create_and_init_provider(StateStoreId(root, 0, partition), key, value, conf)


def commit_one_key_each(p, versions, maintain=False):
    """Commit versions 1..``versions``, version v + 1 putting key v = (v, 0.0); with
    ``maintain``, a maintenance pass after each commit."""
    for v in range(versions):
        commit_batch(p, v, [(v, (v, 0.0))])
        if maintain:
            p.do_maintenance()


def test_commit_returns_next_version_and_is_durable(root, provider_class):
    p = make(root, provider_class)
    store = p.get_store(0)
    assert store.version == 0 and store.get(1) is None
    store.put(1, (1, 1.0))
    assert store.get(1) == (1, 1.0)  # sees its own update
    assert p.get_read_store(0).get(1) is None  # nobody else does
    assert store.commit() == 1 and store.has_committed
    assert make(root, provider_class).get_read_store(1).get(1) == (1, 1.0)  # a new provider sees it
    uncommitted = p.get_store(1)
    uncommitted.put(2, (2, 2.0))
    uncommitted.abort()
    assert make(root, provider_class).get_read_store(1).get(2) is None
    with pytest.raises(VersionNotFoundError):
        make(root, provider_class).get_read_store(2)


def test_bad_versions(root, provider_class):
    p = make(root, provider_class)
    with pytest.raises(ValueError, match="less than 0"):
        p.get_store(-1)
    with pytest.raises(VersionNotFoundError):
        p.get_store(1)
    commit_batch(p, 0, [(1, (1, 1.0))])
    with pytest.raises(VersionNotFoundError):
        make(root, provider_class).get_store(3)


def test_lifecycle_messages(root, provider_class):
    p = make(root, provider_class)
    store = p.get_store(0)
    with pytest.raises(ValueError, match="Cannot put a null value"):
        store.put(1, None)
    store.commit()
    with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
        store.put(1, (1, 1.0))
    with pytest.raises(IllegalStateError, match="Cannot remove after already committed or aborted"):
        store.remove(1)
    with pytest.raises(IllegalStateError, match="Cannot commit after already committed or aborted"):
        store.commit()
    with pytest.raises(ValueError, match="Cannot put a null value"):
        store.put(1, None)  # the null check comes before the state check
    assert store.get(1) is None and store.metrics.num_keys == 0  # reads stay allowed
    store.abort()
    assert not store.has_committed
    aborted = p.get_store(1)
    aborted.abort()
    aborted.abort()
    with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
        aborted.put(1, (1, 1.0))
    assert p.get_read_store(1).get(1) is None


def test_reads_after_a_commit_see_its_version_and_its_updates_are_let_go(root):
    """After commit, the store reads the version it made (from the provider's State, as every
    reader does), ``version`` still names the one it opened, and the update layer is let go:
    the store reports no memory beyond the provider's. With no version kept in
    memory, the store keeps its updates to read them."""
    p = make(root)
    commit_batch(p, 0, [(k, (k, 0.0)) for k in range(2000)])
    store = p.get_store(1)
    keys = np.zeros(2000, KEY)
    keys["k"] = np.arange(1000, 3000)
    values = np.zeros(2000, VALUE)
    values["count"] = 7
    store.put_batch(keys, values)
    store.remove(0)
    opened = store.base_commit_id
    assert store.commit() == 2
    assert store.version == 1 and store.base_commit_id == opened
    assert store.get(0) is None and store.get(1) == (1, 0.0) and store.get(2999) == (7, 0.0)
    assert store.get_batch(keys)[1].all() and len(dict(store.iterator())) == 2999
    assert store.metrics.num_keys == 2999
    reader = p.get_read_store(2)
    assert store.metrics.memory_used_bytes == reader.metrics.memory_used_bytes  # nothing of its own
    reader.abort()
    with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
        store.put(5, (5, 5.0))
    store.abort()  # after a commit: releases the view, changes nothing
    assert p.get_read_store(2).get(2999) == (7, 0.0)

    kept = make(root + "-none", max_versions_to_retain_in_memory=0)
    commit_batch(kept, 0, [(1, (1, 0.0))])
    store = kept.get_store(1)
    store.put(2, (2, 2.0))
    store.commit()
    assert store.get(1) == (1, 0.0) and store.get(2) == (2, 2.0)
    assert kept.describe()["latest"] is None  # nothing of it kept in memory


def test_batch_api_matches_scalar_api(root, provider_class):
    p = make(root, provider_class)
    s = p.get_store(0)
    keys = np.arange(100).astype(KEY)
    values = np.zeros(100, VALUE)
    values["count"] = np.arange(100)
    s.put_batch(keys, values)
    s.remove_batch(np.arange(0, 100, 3).astype(KEY))
    assert s.commit() == 1
    r = p.get_read_store(1)
    got, found = r.get_batch(np.arange(105).astype(KEY))
    assert found.tolist() == [k % 3 != 0 and k < 100 for k in range(105)]
    assert all(r.get(k) == ((k, 0.0) if k % 3 else None) for k in range(100))
    assert got["count"][found].tolist() == [k for k in range(100) if k % 3]
    assert r.metrics.num_keys == 66


def test_re_execution_overwrites_later_versions(root, provider_class):
    p = make(root, provider_class)
    commit_one_key_each(p, 4)
    # batch 2 runs again from version 2 with other input
    assert commit_batch(p, 2, [(100, (100, 0.0))]) == 3
    assert contents(p.get_read_store(3)) == {0: (0, 0.0), 1: (1, 0.0), 100: (100, 0.0)}
    fresh = make(root, provider_class)
    assert contents(fresh.get_read_store(3)) == {0: (0, 0.0), 1: (1, 0.0), 100: (100, 0.0)}
    with pytest.raises(VersionNotFoundError):
        fresh.get_read_store(4)  # the abandoned run's version 4 is gone
    assert commit_batch(fresh, 3, [(5, (5, 0.0))]) == 4


def test_reading_a_version_while_it_is_being_updated(root, provider_class):
    p = make(root, provider_class)
    commit_batch(p, 0, [(k, (k, 0.0)) for k in range(10)])
    reader = p.get_read_store(1)
    writer = p.get_store(1)
    writer.remove(3)
    writer.put(4, (40, 0.0))
    writer.put(11, (11, 0.0))
    assert reader.get(3) == (3, 0.0) and reader.get(11) is None
    assert writer.commit() == 2
    # the committed version 2 does not leak into the reader of version 1
    assert contents(reader) == {k: (k, 0.0) for k in range(10)}
    reader.abort()  # aborting a reader deletes nothing
    assert contents(p.get_read_store(2))[4] == (40, 0.0)


def test_iterating_while_updating_visits_each_key_once(root, provider_class):
    p = make(root, provider_class)
    commit_batch(p, 0, [(k, (k, 0.0)) for k in range(0, 500)])
    commit_batch(p, 1, [(k, (k, 1.0)) for k in range(400, 700)], removes=range(0, 50))
    s = p.get_store(2)
    s.put(900, (900, 0.0))
    s.remove(60)
    seen = []
    for (k,), v in s.iterator():
        seen.append(k)
        s.remove(k)  # evict what we visit
        s.put(10_000 + k, (0, 0.0))  # add keys the iteration must not visit
        s.put(k + 1, (k, 9.0))  # overwrite a key that may still be ahead
    expected = set(range(50, 700)) - {60} | {900}
    assert sorted(seen) == sorted(expected)
    s.commit()


def test_metrics_and_combine(root, provider_class):
    from statecore import StateStoreMetrics
    p = make(root, provider_class)
    s = p.get_store(0)
    s.put(1, (1, 1.0))
    s.put(2, (1, 1.0))
    assert s.metrics.num_keys == 2
    s.commit()
    m = p.get_read_store(1).metrics
    assert m.num_keys == 2
    combined = StateStoreMetrics.combine([m, m])
    assert combined.num_keys == 4
    assert combined.custom_metrics == {k: 2 * v for k, v in m.custom_metrics.items()}


# -- the file provider -------------------------------------------------------------------------
def test_a_delta_records_removals_only_of_keys_that_were_there(root):
    """As Spark's stores do: removing a key absent from the version (never there, or put and
    removed in the same batch) leaves no remove in the delta, so the delta is the version's
    exact change; a present key's removal is recorded, and the state is the same."""
    from statecore._delta import BLOCK_PUTS, read_delta

    p = make(root)
    s = p.get_store(0)
    s.put_batch(np.array([(1,), (2,)], dtype=KEY), np.array([(1, 1.0), (2, 2.0)], dtype=VALUE))
    s.commit()
    s = p.get_store(1)
    s.remove_batch(np.array([(1,), (3,)], dtype=KEY))  # 3 was never there
    s.put(5, (5, 5.0))
    s.remove(5)  # put and removed in this batch: absent before, absent after
    s.put(4, (4, 4.0))
    s.commit()
    removed, put = [], []
    with open(version_path(store_dir_of(root), 2, "delta"), "rb") as f:
        blocks = read_delta(f.read(), KEY, VALUE)
    for kind, keys, _ in blocks:
        (put if kind == BLOCK_PUTS else removed).extend(np.ascontiguousarray(keys).view(KEY).ravel()["k"].tolist())
    assert removed == [1] and put == [4]
    assert sorted(contents(p.get_read_store(2))) == [2, 4]
    p.close()
    p = make(root)  # reloaded from the files
    assert sorted(contents(p.get_read_store(2))) == [2, 4]
    p.close()


def test_changes_are_each_versions_delta_and_need_it_retained(root):
    """``changes`` yields each version's puts and removals, oldest first, from the deltas of
    the chain it is asked for; once maintenance deleted old deltas, a start before them is a
    VersionNotFoundError naming the missing file, and later ranges still read."""
    p = make(root, min_deltas_for_snapshot=2, min_versions_to_retain=2)
    for v in range(6):
        s = p.get_store(v)
        s.put(v, (v, 0.5))
        if v:
            s.remove(v - 1)
        s.commit()
    got = [(u, is_put, keys["k"].tolist(), None if values is None else values["count"].tolist())
           for u, is_put, keys, values in p.changes(2, 4)]
    assert sorted(got) == [(2, False, [0], None), (2, True, [1], [1]), (3, False, [1], None), (3, True, [2], [2]),
                           (4, False, [2], None), (4, True, [3], [3])]
    for v in range(6, 12):  # more versions, maintained after each commit as the registry does
        commit_batch(p, v, [(v, (v, 0.5))], removes=[v - 1])
        p.do_maintenance()
    deltas = sorted(int(n.split(".")[0]) for n in version_names(store_dir_of(root)) if n.endswith(".delta"))
    oldest = deltas[0]
    assert 1 < oldest < 11, deltas
    with pytest.raises(VersionNotFoundError, match=f"change of version {oldest - 1} .* not retained"):
        list(p.changes(oldest - 1, 12))
    assert [u for u, _, _, _ in p.changes(oldest, 12)] == [u for u in range(oldest, 13) for _ in (0, 1)]
    with pytest.raises(ValueError, match="start_version 4 is after end_version 3"):
        list(p.changes(4, 3))
    p.close()


def test_version_rows_reads_every_row_once_by_each_path(root):
    """version_rows equals the version read through a store, whether the version is its own
    snapshot, the delta of version 1 alone, or deltas over a snapshot; a damaged delta of
    version 1 raises before any row is handed out."""
    p = make(root, min_deltas_for_snapshot=1)
    keys = np.zeros(500, KEY)
    keys["k"] = np.arange(500) * 3
    values = np.zeros(500, VALUE)
    values["count"] = np.arange(500)
    s = p.get_store(0)
    s.put_batch(keys, values)
    s.commit()
    for v in (1, 2, 3):
        s = p.get_store(v)
        s.put_batch(keys[v::7], values[v::7])
        s.remove_batch(keys[v + 1::11])
        s.commit()
        if v == 1:
            p.do_maintenance()  # version 2's own snapshot
    for version in (1, 2, 3, 4):
        expected = contents(p.get_read_store(version))
        got = {}
        for k, val in p.version_rows(version, rows_per_batch=64):
            for key, value in zip(k.tolist(), val.tolist()):
                assert key[0] not in got
                got[key[0]] = tuple(value)
        assert got == expected, version
    p.close()
    path = version_path(store_dir_of(root), 1, "delta")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    rows = make(root).version_rows(1)
    with pytest.raises(StateCorruptionError):
        next(rows)


def store_dir_of(root, partition=0):
    return StateStoreId(root, 0, partition).store_checkpoint_location()


def store_files(root, partition=0):
    return version_names(os.path.join(root, "0", str(partition)))


def test_nothing_is_written_before_commit_and_abort_leaves_nothing(root):
    p = make(root)
    s = p.get_store(0)
    s.put(1, (1, 1.0))
    assert [f for f in store_files(root) if f.endswith("delta") or f.endswith(".tmp")] == []
    s.abort()
    assert [f for f in store_files(root) if "delta" in f or f.endswith(".tmp")] == []
    assert p.get_store(0).commit() == 1  # an empty commit still writes its delta
    assert "1.delta" in store_files(root)
    assert make(root).get_read_store(1).metrics.num_keys == 0


def test_other_files_in_the_directory_are_ignored(root):
    p = make(root)
    commit_batch(p, 0, [(1, (1, 1.0))])
    d = store_dir(root)
    for name in (".1.delta.abc.tmp", "notes.txt", "x.delta", "2.delta.bak", "_metadata"):
        Path(d, name).write_bytes(b"")
    assert make(root).get_read_store(1).get(1) == (1, 1.0)


@pytest.mark.parametrize("layout", ["with_id", "previous"])
def test_directory_with_a_version_file_name_is_ignored(tmp_path, layout):
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=1, min_versions_to_retain=2)
    name = f"5_{'ab' * 8}.delta" if layout == "with_id" else "5.delta"
    os.mkdir(os.path.join(store_dir(tmp_path), name))
    fresh = open_numbered(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=2)
    for provider in (p, fresh):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(5)
        with pytest.raises(VersionNotFoundError):
            provider.get_read_store(5, commit_id="ab" * 8)
    assert_reads(fresh, 3, model[3])
    for _ in range(4):  # 4, 5, 6, 7, with maintenance (snapshots, cleanup) between
        commit_numbered(fresh, model)
        fresh.do_maintenance()
    for u in range(5, 8):
        assert_reads(open_numbered(tmp_path), u, model[u])


@pytest.mark.parametrize("name", ["05.delta", "5.DELTA", "5.Snapshot", "005.snapshot"])
def test_a_foreign_old_layout_name_is_not_taken_for_a_version(tmp_path, name):
    """A file someone copied in as "05.delta" or "5.DELTA" (no writer makes these: Spark writes the
    version with Java's Long.toString, statecore a lower-case kind) is not version 5: it must not
    become the default attempt and hide the store's newest version, nor be cleaned up as one."""
    p, model = committed(tmp_path, 4, min_deltas_for_snapshot=100)
    foreign = os.path.join(store_dir(tmp_path), name)
    shutil.copyfile(the_file(tmp_path, 4, "delta"), foreign)
    fresh = open_numbered(tmp_path, min_deltas_for_snapshot=100)
    assert_reads(fresh, 4, model[4])
    with pytest.raises(VersionNotFoundError):
        fresh.get_store(5)
    commit_numbered(fresh, model)  # version 5 is the store's own
    assert_reads(open_numbered(tmp_path), 5, model[5])
    assert os.path.exists(foreign)


def test_snapshots_after_more_than_min_deltas_and_cleanup_like_spark(root):
    # Spark's example (docs/spark-state-store.md, Maintenance): minDeltasForSnapshot 5, maintenance after every commit ->
    # snapshots at 6, 12, 18; minBatchesToRetain 2 and commit 20 -> files < 18 deleted
    p = make(root, min_deltas_for_snapshot=5, min_versions_to_retain=2)
    for v in range(20):
        commit_batch(p, v, [(v, (v, 0.0))], removes=[v - 3] if v >= 3 else ())
        p.do_maintenance()
    files = store_files(root)
    assert [f for f in files if f.endswith(".snapshot")] == ["18.snapshot"]
    assert sorted(int(f.split(".")[0]) for f in files if f.endswith(".delta")) == [18, 19, 20]
    fresh = make(root)
    assert contents(fresh.get_read_store(20)) == {k: (k, 0.0) for k in range(17, 20)}
    assert contents(make(root).get_read_store(19)) == {k: (k, 0.0) for k in range(16, 19)}


def every_key_batches(p, versions, keys=20):
    """Commit ``versions`` batches that update every key, each followed by a maintenance pass
    that writes its snapshot (as other workers of the store, or re-executions, may leave
    them), then one pass as the provider's conf has it; returns {version: contents}."""
    expected = {}
    for v in range(versions):
        commit_batch(p, v, [(k, (v, float(k))) for k in range(keys)])
        expected[v + 1] = {k: (v, float(k)) for k in range(keys)}
        snapshot_now(p)
    p.do_maintenance()
    return expected


def test_snapshots_are_thinned_to_the_spark_cadence_and_every_version_still_loads(root):
    p = make(root, min_deltas_for_snapshot=5, min_versions_to_retain=100)
    expected = every_key_batches(p, 13)
    assert [f for f in store_files(root) if f.endswith(".snapshot")] == ["10.snapshot", "13.snapshot",
                                                                          "5.snapshot"]
    assert len([f for f in store_files(root) if f.endswith(".delta")]) == 13
    for version in range(1, 14):  # each from a fresh provider: from files only
        assert contents(make(root).get_read_store(version)) == expected[version]


def test_old_deltas_are_still_deleted_when_snapshots_are_thinned(root):
    p = make(root, min_deltas_for_snapshot=2, min_versions_to_retain=4)
    expected = every_key_batches(p, 20)
    files = store_files(root)
    deltas = sorted(int(f.split(".")[0]) for f in files if f.endswith(".delta"))
    snapshots = sorted(int(f.split(".")[0]) for f in files if f.endswith(".snapshot"))
    assert snapshots[0] <= 20 - 4 and deltas == list(range(snapshots[0], 21))
    assert len(deltas) <= 4 + 2 and len(snapshots) <= 4
    for version in range(20 - 4, 21):
        assert contents(make(root).get_read_store(version)) == expected[version]


def test_no_snapshot_at_exactly_min_deltas(root):
    p = make(root, min_deltas_for_snapshot=5)
    commit_one_key_each(p, 5, maintain=True)
    assert not [f for f in store_files(root) if f.endswith(".snapshot")]
    commit_batch(p, 5, [(5, (5, 0.0))])
    p.do_maintenance()
    assert "6.snapshot" in store_files(root)


def test_state_loads_from_snapshot_plus_deltas_and_keeps_serving_during_snapshots(root):
    p = make(root, min_deltas_for_snapshot=2)
    model = {}
    rng = np.random.default_rng(7)
    for v in range(12):
        s = p.get_store(v)
        keys = rng.integers(0, 300, 80)
        for k in keys[:60]:
            s.put(int(k), (int(k), float(v)))
            model[int(k)] = (int(k), float(v))
        for k in keys[60:]:
            s.remove(int(k))
            model.pop(int(k), None)
        s.commit()
        if v % 3 == 2:
            p.do_maintenance()
        assert contents(p.get_read_store(v + 1)) == model
        assert p.get_read_store(v + 1).metrics.num_keys == len(model)
    assert contents(make(root).get_read_store(12)) == model


def test_reopening_with_other_schemas_is_refused(root):
    commit_batch(make(root), 0, [(1, (1, 1.0))])
    with pytest.raises(SchemaMismatchError, match="value schema"):
        make(root, value=np.dtype([("count", "<i4"), ("sum", "<f8")]))
    with pytest.raises(SchemaMismatchError, match="key schema"):
        make(root, key=np.dtype([("k", "<i4")]))


@pytest.mark.parametrize("shape", ["lists", "dicts", "directory", "fifo", "dev_zero", "oversize"])
def test_unreadable_schema_file_is_corruption(tmp_path, shape):
    p = open_numbered(tmp_path)
    commit_upto(p, {0: {}}, 2)
    path = os.path.join(store_dir(tmp_path), SCHEMA_FILE)
    os.unlink(path)
    depth = 100_000
    if shape == "lists":
        with open(path, "w") as f:
            f.write('{"format": "statecore-state-schema-1", "key": ' + "[" * depth + "]" * depth + ', "value": 1}')
    elif shape == "dicts":
        with open(path, "w") as f:
            f.write('{"key": ' + '{"a": ' * depth + "1" + "}" * depth + "}")
    elif shape == "oversize":  # sparse: its size is refused before a byte is read
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    else:
        put_in_place(path, shape)
    kind, value = call_with_deadline(lambda: open_numbered(tmp_path))
    assert kind == "raised" and isinstance(value, StateCorruptionError), (kind, value)
    assert value.path == path


def test_memory_filesystem(tmp_path):
    bucket = f"memory://sctest-{uuid.uuid4().hex}"
    root = f"{bucket}/state"
    try:
        p = make(root, min_deltas_for_snapshot=1, local_cache_dir=str(tmp_path / "cache"))
        commit_one_key_each(p, 4, maintain=True)
        assert contents(make(root, local_cache_dir=str(tmp_path / "cache")).get_read_store(4)) == {
            k: (k, 0.0) for k in range(4)}
    finally:
        import fsspec
        fsspec.filesystem("memory").rm(bucket, recursive=True)


def test_stale_snapshot_of_an_abandoned_run_is_never_read(root):
    p = make(root, min_deltas_for_snapshot=3)
    commit_one_key_each(p, 6)
    p.do_maintenance()
    d = store_dir(root)
    assert "6.snapshot" in store_files(root)
    stale_path = version_path(d, 6, "snapshot")
    stale = Path(stale_path).read_bytes()
    # re-execute batches 4 and 5 with other data
    q = make(root)
    commit_batch(q, 4, [(50, (50, 0.0))])
    commit_batch(q, 5, [(60, (60, 0.0))])
    assert "6.snapshot" not in store_files(root)
    # an old maintenance thread finishing late puts the old run's snapshot back
    Path(stale_path).write_bytes(stale)
    expected = {0: (0, 0.0), 1: (1, 0.0), 2: (2, 0.0), 3: (3, 0.0), 50: (50, 0.0), 60: (60, 0.0)}
    assert contents(make(root).get_read_store(6)) == expected


def test_damaged_snapshot_falls_back_to_deltas_and_damaged_delta_is_an_error(root):
    p = make(root, min_deltas_for_snapshot=2)
    commit_one_key_each(p, 5)
    p.do_maintenance()
    p.close()  # and the whole image it may have published for the others goes with it
    d = store_dir(root)
    snap = version_path(d, 5, "snapshot")
    data = bytearray(Path(snap).read_bytes())
    data[10] ^= 0xFF  # in the header: found when the store opens
    Path(snap).write_bytes(bytes(data))
    assert contents(make(root).get_read_store(5)) == {k: (k, 0.0) for k in range(5)}
    delta = version_path(d, 3, "delta")
    data = bytearray(Path(delta).read_bytes())
    data[-20] ^= 0xFF
    Path(delta).write_bytes(bytes(data))
    os.remove(snap)
    with pytest.raises(StateCorruptionError, match="/3_[0-9a-f]{16}.delta"):
        make(root).get_read_store(5)


def same_attempt_name(name_of_attempt, version, kind):
    """The name of ``kind`` of ``version`` for the attempt that ``name_of_attempt`` names."""
    cid = VERSION_FILE.match(name_of_attempt).group(2)
    return f"{version}_{cid}.{kind}" if cid else f"{version}.{kind}"


@pytest.mark.parametrize("deltas", ["present", "cleaned_up"])
def test_copy_of_an_older_snapshot_is_never_served_as_a_newer_version(tmp_path, deltas):
    p = open_numbered(tmp_path, min_deltas_for_snapshot=2)
    model = {0: {}}
    for top in (3, 6):
        commit_upto(p, model, top)
        p.do_maintenance()
    commit_upto(p, model, 8)
    three, six = the_file(tmp_path, 3, "snapshot"), the_file(tmp_path, 6, "snapshot")
    # The copy takes the name version 6's attempt has (the id of version 6's delta).
    six_delta = os.path.basename(the_file(tmp_path, 6, "delta"))
    copy = os.path.join(store_dir(tmp_path), same_attempt_name(six_delta, 6, "snapshot"))
    os.unlink(six)
    shutil.copyfile(three, copy)
    # and a copy renamed with 3's id too
    shutil.copyfile(three, os.path.join(store_dir(tmp_path), f"6_{attempt_id(three)}.snapshot"))
    if deltas == "cleaned_up":  # as if cleanup had deleted what the snapshot of 6 covered
        for u in range(1, 7):
            os.unlink(the_file(tmp_path, u, "delta"))
    for attempt in ("before maintenance", "after maintenance"):
        fresh = open_numbered(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=2)
        # before: every version with its files; after: the retained ones (8 - 2 = 6 on)
        for u in range(1 if attempt.startswith("before") and deltas == "present" else 6, 9):
            try:
                assert_reads(fresh, u, model[u])
            except StateCorruptionError as e:
                assert deltas == "cleaned_up", (
                    f"{attempt}: version {u} no longer loads though its deltas were there: {e}; "
                    f"files: {sorted(os.listdir(store_dir(tmp_path)))}")
        fresh.do_maintenance()


@pytest.mark.parametrize("field", ["own_id", "parent_id"])
# 4: a middle delta; 6: the newest; "snapshot's": the delta of version 6, whose snapshot is
# what versions 6.. load from (the deltas below it are cleaned up)
@pytest.mark.parametrize("damaged", [4, 6, "snapshot's"])
def test_damaged_commit_id_in_a_delta_header_names_the_file(tmp_path, damaged, field):
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=2)
    p = open_numbered(tmp_path, **conf)
    model = {0: {}}
    if damaged == "snapshot's":
        for top in (3, 6, 8):
            commit_upto(p, model, top)
            p.do_maintenance()
        assert snapshot_versions(tmp_path) == [6] and not has_file(tmp_path, 5, "delta"), "setup"
        damaged, first = 6, 6
    else:
        commit_upto(p, model, 6)
        first = 1
    path = the_file(tmp_path, damaged, "delta")
    flip(path, DELTA_LINEAGE_OFFSET + (0 if field == "own_id" else 8))
    for provider in (open_numbered(tmp_path, **conf), p):
        for u in range(first, max(model) + 1):
            outcome = load_outcome(provider, u, model[u])  # never VersionNotFoundError
            if u >= damaged and provider is not p and not has_file(tmp_path, damaged, "snapshot"):
                assert outcome == path, f"version {u}: {outcome}"  # from files, through it
            else:  # in memory, from the snapshot of 6, or resolved through the damaged delta
                assert outcome in ("correct", path), f"version {u}: {outcome}"
        provider.do_maintenance()
        assert os.path.exists(path)


def run_bounded(body, timeout_s=60, extra_address_space=1 << 30):
    """Run ``body`` (Python source) in a fresh interpreter that imports this checkout's
    statecore, with its address space capped at what it has after the imports plus
    ``extra_address_space``, killed after ``timeout_s``; returns its last stdout line as JSON."""
    prelude = f"""
        import json, os, resource, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(statecore.__file__))!r})
        import numpy as np
        import statecore
        from statecore import *
        KEY = np.dtype([("k", "<i8")])
        VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
        def vm_bytes():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        return int(line.split()[1]) * 1024
        _limit = vm_bytes() + {extra_address_space}
        resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))
        def open_numbered(root, **conf):
            return create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, StateStoreConf(**conf))
        def contents(store):
            return {{int(k[0]): list(v) for k, v in store.iterator()}}
    """
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(body)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the subprocess did not finish within {timeout_s} s")
    assert done.returncode == 0, f"subprocess exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["dev_zero", "fifo"])
@pytest.mark.parametrize("which", ["newest_delta", "middle_delta", "snapshot"])
def test_version_file_linked_to_dev_zero_is_corruption_promptly(tmp_path, which, what):
    """A link to /dev/zero, or a FIFO someone left, where a version file should be: every load
    that needs it is corruption naming it, at once; the others and maintenance go on."""
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=2)
    p.do_maintenance()
    commit_upto(p, model, 6)
    version, kind = {"newest_delta": (6, "delta"), "middle_delta": (5, "delta"), "snapshot": (3, "snapshot")}[which]
    path = the_file(tmp_path, version, kind)
    put_in_place(path, what)
    result = run_bounded(f"""
        p = open_numbered({str(tmp_path)!r}, min_deltas_for_snapshot=2)
        out = {{}}
        t0 = time.monotonic()
        for v in range(1, 7):
            try:
                out[v] = ["data", contents(p.get_read_store(v))]
            except StateCorruptionError as e:
                out[v] = ["corrupt", e.path]
            except BaseException as e:
                out[v] = [type(e).__name__, str(e)]
        try:
            p.do_maintenance()
            maintenance = "ok"
        except BaseException as e:
            maintenance = f"{{type(e).__name__}}: {{e}}"
        print(json.dumps({{"loads": out, "maintenance": maintenance, "seconds": time.monotonic() - t0}}))
    """, timeout_s=60)
    assert result["seconds"] < 5, result
    assert result["maintenance"] == "ok", result
    for v in range(1, 7):
        kind_, what = result["loads"][str(v)]
        if kind_ == "data":
            assert {int(k): tuple(x) for k, x in what.items()} == model[v], f"version {v}: wrong data"
        else:
            assert [kind_, what] == ["corrupt", path], f"version {v}: {kind_} {what}"
    assert os.path.lexists(path) and not os.path.isfile(path), "maintenance deleted the damaged file"


def test_huge_version_is_not_found_promptly_in_bounded_memory(tmp_path):
    p = open_numbered(tmp_path)
    commit_upto(p, {0: {}}, 3)
    result = run_bounded(f"""
        import resource
        p = open_numbered({str(tmp_path)!r})
        outcomes = []
        t0 = time.monotonic()
        for v in (2**63 - 1, 2**62, 10**12):
            for open_ in (p.get_store, p.get_read_store):
                try:
                    open_(v)
                    outcomes.append("opened")
                except VersionNotFoundError:
                    outcomes.append("not found")
                except BaseException as e:
                    outcomes.append(type(e).__name__)
        print(json.dumps({{"outcomes": outcomes, "seconds": time.monotonic() - t0,
                          "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
    """, timeout_s=60)
    assert result["outcomes"] == ["not found"] * 6, result
    assert result["seconds"] < 5, result


def _metric(p, version, name):
    """A custom metric of ``p``, read through a store of ``version`` (one it holds)."""
    store = p.get_read_store(version)
    try:
        return store.metrics.custom_metrics[name]
    finally:
        store.abort()


def _two_workers_taking_turns(root):
    """Providers ``a`` and ``b`` of one store (two workers of an executor): ``a`` commits
    versions 1 and 2, ``b`` loads 2 and commits 3 and 4. Returns ``(a, b, version 3, version 4)``."""
    a, b = make(root), make(root)
    commit_batch(a, 0, [(k, (k, 0.0)) for k in range(6)])
    commit_batch(a, 1, [(6, (6, 0.0))])
    assert contents(b.get_read_store(2)) == {k: (k, 0.0) for k in range(7)}  # b loads: nothing held
    assert _metric(b, 2, "rolledForwardCount") == 0
    commit_batch(b, 2, [(0, (0, 9.5)), (7, (7, 0.0))], removes=[1, 99])
    commit_batch(b, 3, [(8, (8, 0.0))], removes=[2])
    version_3 = {k: (k, 0.0) for k in range(8) if k != 1}
    version_3[0] = (0, 9.5)
    version_4 = {k: v for k, v in version_3.items() if k != 2}
    version_4[8] = (8, 0.0)
    return a, b, version_3, version_4


def test_a_version_committed_by_another_worker_is_reached_by_its_deltas(root):
    """Two workers take the batches in turn: each reaches the newest version from the one
    it holds by the deltas since, and sees exactly what the other committed (puts and
    removes). Nothing reads the version ``a`` holds, so the deltas are replayed into it,
    each version's key count taken from its delta, and the versions passed over are read
    from files again when asked for."""
    a, _, version_3, version_4 = _two_workers_taking_turns(root)
    store = a.get_read_store(4)
    assert contents(store) == version_4 and store.metrics.num_keys == len(version_4)
    store.abort()
    assert _metric(a, 4, "rolledForwardCount") == 1
    misses = _metric(a, 4, "loadedMapCacheMissCount")
    assert contents(a.get_read_store(3)) == version_3  # replayed over: loaded again
    assert _metric(a, 4, "loadedMapCacheMissCount") == misses + 1
    commit_batch(a, 4, [(9, (9, 0.0))])
    assert contents(make(root).get_read_store(5)) == {**version_4, 9: (9, 0.0)}


def test_a_roll_forward_under_an_open_reader_keeps_the_versions_held(root):
    """A store of the held version is open (it pins it): the deltas are merged as commits
    are, their undo kept, so that store reads on unchanged and the versions in between are
    held in memory."""
    a, b = make(root), make(root)
    commit_batch(a, 0, [(k, (k, 0.0)) for k in range(6)])
    reader = a.get_read_store(1)
    b.get_read_store(1).abort()
    commit_batch(b, 1, [(0, (0, 9.5)), (7, (7, 0.0))], removes=[1, 99])
    commit_batch(b, 2, [(8, (8, 0.0))], removes=[2])
    version_2 = {k: (k, 0.0) for k in (0, 2, 3, 4, 5, 7)}
    version_2[0] = (0, 9.5)
    version_3 = {k: v for k, v in version_2.items() if k != 2}
    version_3[8] = (8, 0.0)
    store = a.get_read_store(3)
    assert contents(store) == version_3 and store.metrics.num_keys == len(version_3)
    store.abort()
    assert _metric(a, 3, "rolledForwardCount") == 1
    hits = _metric(a, 3, "loadedMapCacheHitCount")
    assert contents(a.get_read_store(2)) == version_2  # held by the roll forward's undo
    assert _metric(a, 3, "loadedMapCacheHitCount") == hits + 2
    assert contents(reader) == {k: (k, 0.0) for k in range(6)}
    reader.abort()


def test_deltas_that_record_no_key_count_are_merged(root, monkeypatch):
    """Deltas written before their trailer recorded the key count (format version 1) are
    merged as commits are, which finds the count: the versions passed over stay held."""
    a, _, version_3, version_4 = _two_workers_taking_turns(root)
    checked = statecore.loading.read_checked_delta

    def without_count(p, f, parent_id=None):
        commit_id, blocks, _ = checked(p, f, parent_id)
        return commit_id, blocks, None

    monkeypatch.setattr(statecore.loading, "read_checked_delta", without_count)
    store = a.get_read_store(4)
    assert contents(store) == version_4 and store.metrics.num_keys == len(version_4)
    store.abort()
    assert _metric(a, 4, "rolledForwardCount") == 1
    hits = _metric(a, 4, "loadedMapCacheHitCount")
    assert contents(a.get_read_store(3)) == version_3  # held by the merge's undo
    assert _metric(a, 4, "loadedMapCacheHitCount") == hits + 2


def test_no_roll_forward_across_another_lineage_or_past_a_newer_snapshot(root):
    a, b = make(root, min_deltas_for_snapshot=1), make(root, min_deltas_for_snapshot=1)
    commit_one_key_each(a, 3)
    b.get_read_store(2).abort()
    commit_batch(b, 2, [(50, (50, 0.0))])  # re-executes version 3: a holds the other attempt
    assert contents(a.get_read_store(3)) == {0: (0, 0.0), 1: (1, 0.0), 50: (50, 0.0)}
    assert _metric(a, 3, "rolledForwardCount") == 0
    commit_batch(b, 3, [(60, (60, 0.0))])
    commit_batch(b, 4, [(70, (70, 0.0))])
    b.do_maintenance()  # a snapshot of version 5, newer than a's version 3
    assert any(n.startswith("5_") and n.endswith(".snapshot") for n in os.listdir(store_dir(root)))
    assert contents(a.get_read_store(5)) == {0: (0, 0.0), 1: (1, 0.0), 50: (50, 0.0), 60: (60, 0.0),
                                             70: (70, 0.0)}
    assert _metric(a, 5, "rolledForwardCount") == 0


def test_roll_forward_leaves_an_iteration_of_the_held_version_alone(root):
    a, b = make(root), make(root)
    commit_batch(a, 0, [(k, (k, 0.0)) for k in range(4)])
    reader = a.get_read_store(1)
    it = reader.iterator()
    first = next(it)
    commit_batch(b, 1, [(9, (9, 0.0))], removes=[0, 1, 2, 3])
    assert contents(a.get_read_store(2)) == {9: (9, 0.0)}
    assert _metric(a, 2, "rolledForwardCount") == 1
    rest = {int(k[0]): tuple(v) for k, v in it}
    rest[int(first[0][0])] = tuple(first[1])
    assert rest == {k: (k, 0.0) for k in range(4)}
    reader.abort()


def test_a_commit_and_the_next_maintenance_pass_read_no_delta_back(root, monkeypatch):
    """The committing provider knows what it wrote: its maintenance pass follows the lineage
    without reading delta headers back (a ranged GET each on an object store)."""
    from statecore.files import StoreFiles

    p = make(root, min_deltas_for_snapshot=2)
    reads, original = [], StoreFiles._step

    def counting(self, step, name):
        if step == "read":
            reads.append(name)
        return original(self, step, name)

    monkeypatch.setattr(StoreFiles, "_step", counting)
    commit_one_key_each(p, 5)
    p.do_maintenance()
    assert [n for n in reads if n.endswith(".delta")] == []
    assert any(n.endswith(".snapshot") for n in os.listdir(store_dir(root)))


def test_reading_an_old_version_keeps_the_newest_in_memory(root):
    p = make(root)
    commit_one_key_each(p, 6)
    hits = _metric(p, 6, "loadedMapCacheHitCount")
    assert contents(p.get_read_store(1)) == {0: (0, 0.0)}  # older than what is held: loaded
    assert contents(p.get_read_store(6)) == {k: (k, 0.0) for k in range(6)}
    assert _metric(p, 6, "loadedMapCacheHitCount") == hits + 2  # version 6 still in memory
    assert commit_batch(p, 6, [(6, (6, 0.0))]) == 7


def test_cache_hits_and_misses(root):
    p = make(root)
    commit_batch(p, 0, [(1, (1, 0.0))])
    commit_batch(p, 1, [(2, (2, 0.0))])
    m = p.get_read_store(2).metrics.custom_metrics
    assert m["loadedMapCacheMissCount"] == 0 and m["loadedMapCacheHitCount"] == 2
    p.get_read_store(1)  # held in memory (max_versions_to_retain_in_memory=2)
    q = make(root)
    q.get_read_store(1)
    m = q.get_read_store(1).metrics.custom_metrics
    assert m["loadedMapCacheMissCount"] == 1 and m["loadedMapCacheHitCount"] == 1


@pytest.mark.parametrize("step", ["write", "flush", "fsync", "rename"])
def test_failed_delta_write_undoes_the_merge_in_the_same_provider(root, monkeypatch, step):
    injected = inject_faulty_files(monkeypatch)
    p = make(root)
    commit_batch(p, 0, [(k, (k, 0.0)) for k in range(20)])
    commit_batch(p, 1, [(k, (k, 1.0)) for k in range(10, 30)], removes=[0, 1])
    before = contents(p.get_read_store(2))
    injected[0].arm(step, "*.delta")
    s = p.get_store(2)
    s.put(5, (5, 9.0))
    s.put(100, (100, 9.0))
    s.remove(12)
    with pytest.raises(OSError, match="injected"):
        s.commit()
    assert not s.has_committed
    s.abort()
    # the same provider still serves version 2 exactly, and version 3 does not exist
    assert contents(p.get_read_store(2)) == before
    assert p.get_read_store(2).metrics.num_keys == len(before)
    with pytest.raises(VersionNotFoundError):
        make(root).get_read_store(3)
    assert not [f for f in store_files(root) if f.endswith(".tmp")]
    assert commit_batch(p, 2, [(7, (7, 7.0))]) == 3
    assert contents(make(root).get_read_store(3)) == {**before, 7: (7, 7.0)}


def test_maintenance_racing_commits_keeps_every_version_exact(root):
    # Regression: a snapshot pass that froze a state while its commit was still in flight
    # let the commit re-install the frozen state; later commits then mutated the tables the
    # snapshot writer was iterating (wrong row counts, and a crash).
    p = make(root, min_deltas_for_snapshot=1, min_versions_to_retain=5)
    model = {}
    rng = np.random.default_rng(11)
    with maintaining(p) as errors:  # a failure there is the bug
        for v in range(60):
            s = p.get_store(v)
            keys = rng.choice(5000, 400, replace=False)
            values = np.zeros(300, VALUE)
            values["count"] = v
            s.put_batch(keys[:300].astype(KEY), values)
            s.remove_batch(keys[300:].astype(KEY))
            for k in keys[:300]:
                model[int(k)] = (v, 0.0)
            for k in keys[300:]:
                model.pop(int(k), None)
            assert s.commit() == v + 1
    assert not errors, errors
    assert contents(p.get_read_store(60)) == model
    assert p.get_read_store(60).metrics.num_keys == len(model)
    p.do_maintenance()
    assert contents(make(root).get_read_store(60)) == model


def test_maintenance_gives_the_snapshot_under_the_state_its_key_filter(root, monkeypatch):
    """A state loaded from a snapshot: the next maintenance pass builds the snapshot's key
    filter (counted in the provider's memory), after which every lookup path answers as
    before; a snapshot over KEY_FILTER_MAX_ROWS rows gets none."""
    import statecore.maintenance

    p = make(root, min_deltas_for_snapshot=1)
    commit_batch(p, 0, [(k, (k, 0.5)) for k in range(0, 4000, 2)])
    commit_batch(p, 1, [(1, (1, 0.0))], removes=[0])
    p.do_maintenance()  # a snapshot of version 2
    p.close()  # and the whole image of it p published goes: the others load the snapshot
    assert any(n.startswith("2_") and n.endswith(".snapshot") for n in os.listdir(store_dir(root)))
    expected = {k: (k, 0.5) for k in range(2, 4000, 2)}
    expected[1] = (1, 0.0)
    for cap, filtered in ((100, False), (1 << 23, True)):
        monkeypatch.setattr(statecore.maintenance, "KEY_FILTER_MAX_ROWS", cap)
        q = make(root, min_deltas_for_snapshot=1000)
        reader = q.get_read_store(2)  # loaded: the snapshot is the base
        bytes_before = reader.metrics.memory_used_bytes
        reader.abort()
        q.do_maintenance()
        base = q.held.newest.base
        assert type(base).__name__ == "SnapshotReader" and (base.key_filter is not None) == filtered
        store = q.get_read_store(2)
        assert contents(store) == expected
        assert [store.get(k) for k in (0, 1, 2, 3, 3999, 4000, -2)] == \
            [None, (1, 0.0), (2, 0.5), None, None, None, None]
        keys = np.zeros(8000, KEY)
        keys["k"] = np.arange(-2000, 6000)
        values, found = store.get_batch(keys)
        assert found.tolist() == [int(k) in expected for k in keys["k"]]
        assert store.metrics.memory_used_bytes == bytes_before + (base.key_filter.nbytes if filtered else 0)
        store.abort()
        q.close()


def test_a_snapshot_maintenance_writes_keeps_its_writers_key_filter(root, monkeypatch):
    """The snapshot maintenance writes and maps gets the filter its writer filled while
    writing it: no later scan of its rows builds one."""
    import statecore.maintenance
    from statecore.spill import bottom_snapshot

    monkeypatch.setattr(statecore.maintenance, "_filter_bottom", lambda p: None)  # no scan at all
    p = make(root, min_deltas_for_snapshot=1)
    commit_batch(p, 0, [(k, (k, 0.5)) for k in range(300)])
    commit_batch(p, 1, [(300, (300, 0.0))], removes=[0])
    p.do_maintenance()
    reader = bottom_snapshot(p.held.newest.base)
    assert reader is not None and reader.store_version == 2 and reader.key_filter is not None
    keys = np.zeros(400, KEY)
    keys["k"] = np.arange(400)
    assert reader.key_filter.may_hold_rows(keys.view(np.uint8).reshape(400, -1)[1:301]).all()
    store = p.get_read_store(2)
    assert contents(store) == {**{k: (k, 0.5) for k in range(1, 300)}, 300: (300, 0.0)}
    store.abort()


def test_a_bool_key_byte_of_two_is_the_same_key_as_true(root):
    """Keys whose bool field was viewed from other bytes (byte 0x02): one row per key, in
    the store and after a reload from its files."""
    key = np.dtype([("flag", "?"), ("id", "<i8")])
    p = make(root, key=key)
    odd = np.zeros(2, key)
    odd["flag"] = np.frombuffer(b"\x02\x01", dtype=np.bool_)
    odd["id"] = 5
    s = p.get_store(0)
    s.put_batch(odd[:1], np.array([(1, 1.0)], dtype=VALUE))
    s.put((True, 5), (2, 2.0))
    s.put_batch(odd[1:], np.array([(3, 3.0)], dtype=VALUE))
    s.commit()
    assert list(p.get_read_store(1).iterator()) == [((True, 5), (3, 3.0))]  # a list: a dict hides twins
    p.close()
    again = make(root, key=key)
    assert list(again.get_read_store(1).iterator()) == [((True, 5), (3, 3.0))]
    again.close()
