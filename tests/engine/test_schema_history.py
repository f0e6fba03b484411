"""A store whose schemas change (docs/evolution.md): the schema history beside its versions,
versions written under older schemas read in the schemas asked for (from snapshots and deltas,
loaded, rolled forward, read whole, as a change feed), every refused change refused before a
byte is written, and old checkpoints whose schema file predates the history."""
import json
import os

import numpy as np
import pytest

from statecore import SchemaMismatchError, StateStoreConf, StateStoreId, create_and_init_provider
from statecore.schema_evolution import SchemaChanges, SchemaEvolutionError
from statecore.schema_file import SCHEMA_FILE, read_schema_history
from tests.store_support import commit_batch, contents, open_provider, snapshot_now, store_dir, version_files

KEY = np.dtype([("id", "<i4")])
OLD = np.dtype([("count", "<i4"), ("total", "<i4")])
# total widened and moved first, count renamed to n and widened, label added with a default
NEW = np.dtype([("total", "<i8"), ("n", "<i8"), ("label", "S4")])
CHANGES = SchemaChanges(renames={"count": "n"}, defaults={"label": b"new"})


def old_rows(v):
    """Version v's puts under OLD: keys v*10 .. v*10+9, and from v = 2 on the first key of v-1 removed."""
    return [(k, (k % 7, k * 1000)) for k in range(v * 10, v * 10 + 10)], ([(v - 1) * 10] if v > 1 else [])


def as_new(value):
    """An OLD value as the plan defines it under NEW: written here, not by the store's code."""
    count, total = value
    return (total, count, b"new")


def committed_old(root, top, snapshot_at=None):
    """A store of OLD values with versions 1..top (a snapshot of ``snapshot_at``); its model."""
    p = open_provider(root, KEY, OLD)
    model = {0: {}}
    for v in range(1, top + 1):
        puts, removes = old_rows(v)
        commit_batch(p, v - 1, puts, removes)
        state = dict(model[v - 1])
        state.update(dict(puts))
        for k in removes:
            state.pop(k, None)
        model[v] = state
        if v == snapshot_at:
            snapshot_now(p)
    p.close()
    return model


def open_new(root, changes=CHANGES, key=KEY, value=NEW):
    conf = StateStoreConf(schema_changes=None if changes is None else {"default": changes})
    return create_and_init_provider(StateStoreId(str(root), 0, 0), key, value, conf)


def files_of(root):
    d = store_dir(root)
    return {name: os.path.getmtime(os.path.join(d, name)) for name in os.listdir(d)}


@pytest.mark.parametrize("snapshot_at", [None, 2], ids=["deltas only", "snapshot then deltas"])
def test_a_restarted_query_with_a_changed_value_reads_its_old_state_converted(tmp_path, snapshot_at):
    model = committed_old(tmp_path, 4, snapshot_at)
    p = open_new(tmp_path)
    store = p.get_read_store(4)
    assert contents(store) == {k: as_new(v) for k, v in model[4].items()}
    store.abort()
    for v in (1, 3):  # an older version reads in the schemas asked for too
        store = p.get_read_store(v)
        assert contents(store) == {k: as_new(v) for k, v in model[v].items()}
        store.abort()


def test_the_first_commit_under_new_schemas_records_them_and_later_loads_mix_both(tmp_path):
    model = committed_old(tmp_path, 3, snapshot_at=2)
    before = read_schema_history(open_provider(tmp_path, KEY, OLD).files)
    assert len(before.entries) == 1
    p = open_new(tmp_path)
    assert len(read_schema_history(p.files).entries) == 1  # nothing written by opening
    commit_batch(p, 3, [(500, (9, 8, b"abc"))], [30])
    history = read_schema_history(p.files)
    assert [(e.from_version, e.rewritten) for e in history.entries] == [(1, False), (4, False)]
    assert dict(history.newest.renames) == {"count": "n"} and dict(history.newest.defaults) == {"label": b"new"}
    expected = {k: as_new(v) for k, v in model[3].items() if k != 30}
    expected[500] = (9, 8, b"abc")
    p.close()
    again = open_new(tmp_path, changes=None)  # a later restart need not declare the change again
    store = again.get_read_store(4)
    assert contents(store) == expected
    store.abort()
    snapshot_now(again)  # maintenance writes version 4 under the new schemas
    again.close()
    last = open_new(tmp_path, changes=None)
    assert contents(last.get_read_store(4)) == expected
    assert contents(last.get_read_store(2)) == {k: as_new(v) for k, v in model[2].items()}


def test_a_changed_value_without_a_declared_rename_is_a_drop_and_an_add(tmp_path):
    model = committed_old(tmp_path, 2)
    p = open_new(tmp_path, changes=SchemaChanges(defaults={"label": b"new"}))
    assert contents(p.get_read_store(2)) == {k: (total, 0, b"new") for k, (count, total) in model[2].items()}


def test_a_dropped_value_field_and_a_read_by_the_old_query_after_the_change(tmp_path):
    """The old code, started again after the new one committed, reads the new versions with
    the rules from the new schemas to its own (here: a field added, which it drops)."""
    model = committed_old(tmp_path, 2)
    dropped = np.dtype([("total", "<i4")])
    p = open_new(tmp_path, value=dropped, changes=None)
    commit_batch(p, 2, [(7, (77,))])
    expected = {k: (total,) for k, (_, total) in model[2].items()}
    expected[7] = (77,)
    assert contents(p.get_read_store(3)) == expected
    p.close()
    old = open_provider(tmp_path, KEY, OLD)
    assert contents(old.get_read_store(3)) == {k: (0, t) for k, (t,) in expected.items()}


def test_a_widened_key_is_rekeyed_once_and_found_by_its_new_bytes(tmp_path):
    model = committed_old(tmp_path, 3, snapshot_at=2)
    wide = np.dtype([("user", "<i8")])
    p = open_new(tmp_path, key=wide, value=OLD, changes=SchemaChanges(renames={"id": "user"}))
    store = p.get_store(3)
    assert contents(store) == model[3]
    keys = np.array([(30,), (31,), (12345,)], dtype=wide)
    values, found = store.get_batch(keys)
    assert found.tolist() == [True, True, False]
    assert values[0].tolist() == (30 % 7, 30000)
    store.put((2 ** 40,), (1, 2))  # a key only the wider schema holds
    store.commit()
    p.close()
    again = open_new(tmp_path, key=wide, value=OLD, changes=None)
    expected = dict(model[3])
    expected[2 ** 40] = (1, 2)
    assert contents(again.get_read_store(4)) == expected


@pytest.mark.parametrize("value, problem", [
    (np.dtype([("count", "<i2"), ("total", "<i4")]), "count"),  # narrowed
    (np.dtype([("count", "<f4"), ("total", "<i4")]), "count"),  # int32 -> float32 is not exact
    (np.dtype([("count", "?"), ("total", "<i4")]), "count"),  # an int becoming a bool
], ids=["narrowed", "inexact float", "int to bool"])
def test_a_refused_value_change_fails_at_open_and_writes_nothing(tmp_path, value, problem):
    committed_old(tmp_path, 2)
    before = files_of(tmp_path)
    with pytest.raises(SchemaEvolutionError) as e:
        open_new(tmp_path, value=value, changes=None)
    assert f"value field '{problem}'" in str(e.value) and "statecore rewrite" in str(e.value)
    assert files_of(tmp_path) == before


def test_a_refused_key_change_names_every_field_of_both_schemas(tmp_path):
    committed_old(tmp_path, 1)
    before = files_of(tmp_path)
    with pytest.raises(SchemaEvolutionError) as e:
        open_new(tmp_path, key=np.dtype([("id", "<i4"), ("region", "<i4")]),
                 value=np.dtype([("count", "<i2"), ("total", "<i4")]), changes=None)
    assert "key field 'region'" in str(e.value) and "value field 'count'" in str(e.value)
    assert files_of(tmp_path) == before


def test_a_declared_rename_of_a_field_the_store_lacks_is_refused(tmp_path):
    committed_old(tmp_path, 1)
    with pytest.raises(SchemaEvolutionError, match="no field 'cnt'"):
        open_new(tmp_path, changes=SchemaChanges(renames={"cnt": "n"}))


def test_the_change_feed_across_a_change_gives_every_version_in_the_schemas_asked_for(tmp_path):
    committed_old(tmp_path, 2)
    p = open_new(tmp_path)
    commit_batch(p, 2, [(900, (1, 2, b"z"))], [20])
    feed = [(v, put, keys["id"].tolist(), None if values is None else values.tolist())
            for v, put, keys, values in p.changes(1, 3)]
    assert feed[0] == (1, True, list(range(10, 20)), [as_new((k % 7, k * 1000)) for k in range(10, 20)])
    assert (2, False, [10], None) in feed
    assert feed[-1] == (3, True, [900], [(1, 2, b"z")])
    assert (3, False, [20], None) in feed
    rows = list(p.version_rows(1))  # version 1 read straight from its delta
    assert sorted(rows[0][1].tolist()) == sorted(as_new((k % 7, k * 1000)) for k in range(10, 20))


def test_a_provider_holding_the_old_schema_rolls_forward_over_a_delta_of_the_new(tmp_path):
    """Two workers of an executor in turn, one still on the old code: the newer versions it
    reaches from memory come converted to its schemas (a field added: dropped for it)."""
    model = committed_old(tmp_path, 2)
    old = open_provider(tmp_path, KEY, OLD)
    assert contents(old.get_read_store(2)) == model[2]
    widened = np.dtype([("count", "<i4"), ("total", "<i4"), ("extra", "<i8")])
    new = open_new(tmp_path, value=widened, changes=None)
    commit_batch(new, 2, [(5, (1, 2, 3))])
    expected = dict(model[2])
    expected[5] = (1, 2)
    assert contents(old.get_read_store(3)) == expected


def test_a_file_of_schemas_the_history_does_not_name_is_refused_by_name(tmp_path):
    committed_old(tmp_path, 2)
    with open(os.path.join(store_dir(tmp_path), SCHEMA_FILE), "w") as f:  # the history lost
        json.dump({"format": "statecore-state-schema-2", "schemas": [
            {"key": [["id", "<i4"]], "value": [["other", "<i8"]], "from_version": 1}]}, f)
    p = open_provider(tmp_path, KEY, np.dtype([("other", "<i8")]))
    with pytest.raises(SchemaMismatchError, match="schema history"):
        p.get_read_store(2)


def test_a_schema_file_of_the_first_format_reads_as_one_entry_and_evolves(tmp_path):
    """A checkpoint written before the history existed: its schema file names one schema."""
    model = committed_old(tmp_path, 2)
    with open(os.path.join(store_dir(tmp_path), SCHEMA_FILE), "w") as f:
        json.dump({"format": "statecore-state-schema-1", "key": [["id", "<i4"]],
                   "value": [["count", "<i4"], ["total", "<i4"]]}, f)
    p = open_new(tmp_path)
    commit_batch(p, 2, [])
    history = read_schema_history(p.files)
    assert len(history.entries) == 2 and history.entries[0].from_version == 1
    assert contents(p.get_read_store(3)) == {k: as_new(v) for k, v in model[2].items()}


def test_a_commit_that_fails_after_the_history_was_recorded_publishes_no_version(tmp_path, monkeypatch):
    """The history is written before the delta; a commit failing between leaves an entry that
    names no file, and version 3 stays invisible; the retry commits it."""
    model = committed_old(tmp_path, 2)
    p = open_new(tmp_path)
    store = p.get_store(2)
    store.put((99,), (1, 1, b"a"))
    import statecore.commit
    original = statecore.commit.DeltaWriter

    def failing(*args, **kwargs):
        raise OSError("disk full while writing the delta")

    monkeypatch.setattr(statecore.commit, "DeltaWriter", failing)
    with pytest.raises(OSError, match="disk full"):
        store.commit()
    monkeypatch.setattr(statecore.commit, "DeltaWriter", original)
    assert (3, "delta") not in version_files(tmp_path)
    assert len(read_schema_history(p.files).entries) == 2
    fresh = open_new(tmp_path, changes=None)
    assert contents(fresh.get_read_store(2)) == {k: as_new(v) for k, v in model[2].items()}
    commit_batch(fresh, 2, [(99, (1, 1, b"a"))])
    assert contents(fresh.get_read_store(3))[99] == (1, 1, b"a")


def test_maintenance_snapshots_the_first_versions_under_changed_schemas_so_restarts_convert_nothing(tmp_path, caplog):
    """Long before min_deltas_for_snapshot versions passed, the next maintenance pass after a
    schema change writes a snapshot under the new schemas: a restart loads it as it is."""
    committed_old(tmp_path, 3, snapshot_at=2)
    p = open_new(tmp_path)
    commit_batch(p, 3, [(1, (1, 1, b"a"))])
    assert p.schemas_changed_at == 4
    p.do_maintenance()
    assert (4, "snapshot") in version_files(tmp_path)
    p.close()
    caplog.set_level("INFO", logger="statecore.loading")
    again = open_new(tmp_path, changes=None)
    assert contents(again.get_read_store(4))[1] == (1, 1, b"a")
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    again.do_maintenance()  # nothing more is due: no snapshot of another version
    assert sorted(v for v, kind in version_files(tmp_path) if kind == "snapshot") == [4]  # 2 thinned out


def test_verify_inspect_and_dump_read_a_store_whose_schemas_changed(tmp_path):
    """The operating tools on a store with versions under two schemas: `verify` finds every
    file sound (each against the schemas its version was written with), `dump` gives the
    newest state in the newest schemas, an old version converted to them."""
    from click.testing import CliRunner

    from statecore.cli import main

    model = committed_old(tmp_path, 3, snapshot_at=2)
    p = open_new(tmp_path)
    commit_batch(p, 3, [(1, (1, 1, b"a"))])
    p.close()

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    result = run("verify", tmp_path, "--deep")
    assert result.exit_code == 0, result.output
    assert "sound" in result.output
    result = run("inspect", tmp_path / "0" / "0", "--json")
    assert result.exit_code == 0, result.output
    changes = json.loads(result.output)["stores"][0]["schema_history"]
    new_value = [list(f) for f in open_new(tmp_path).value_schema.describe()]
    assert [(c["from_version"], c["value_schema"]) for c in changes] == [(4, new_value)]
    assert "value field 'count' renamed to 'n', widened int32 -> int64" in changes[0]["changes"]
    assert "schema changed from version 4: " in run("inspect", tmp_path / "0" / "0").output
    out = tmp_path / "dump.csv"
    result = run("dump", tmp_path / "0" / "0", "--version", 2, "--format", "csv", "--out", out)
    assert result.exit_code == 0, result.output
    import pyarrow.csv as pcsv
    table = pcsv.read_csv(out).to_pydict()
    got = {k: (t, n) for k, t, n in zip(table["id"], table["total"], table["n"])}
    assert got == {k: as_new(v)[:2] for k, v in model[2].items()}


def test_a_store_on_object_storage_records_its_schema_change_and_reads_back(s3_env):
    """On S3 (the local server): the history uploaded whole with the first commit under the new
    schemas, the old snapshot and deltas converted on a fresh provider's load."""
    root = s3_env + "/state"
    model = committed_old(root, 3, snapshot_at=2)
    p = open_new(root)
    commit_batch(p, 3, [(7, (70, 7, b"s3"))])
    p.close()
    fresh = open_new(root, changes=None)
    assert [e.from_version for e in read_schema_history(fresh.files).entries] == [1, 4]
    expected = {k: as_new(v) for k, v in model[3].items()}
    expected[7] = (70, 7, b"s3")
    assert contents(fresh.get_read_store(4)) == expected
