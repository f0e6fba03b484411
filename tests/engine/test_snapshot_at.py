"""statecore.snapshot_at.start_empty: a store new to a running operator starts empty at the batch's
version N (an empty snapshot of N under a new id), is committed, reloaded, maintained and
verified like any other; leftovers of an earlier attempt of the same batch are started over,
older versions no record names are refused (docs/lineage.md, "A store new to a running operator")."""
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.cli import main
from statecore.errors import StateCorruptionError, UnrecordedStateError
from statecore.files import open_store_files
from statecore.lineage import file_name
from statecore.schema import key_value_schemas
from statecore.snapshot_at import start_empty

KEY = np.dtype([("user", "<i8")])
VALUE = np.dtype([("n", "<i8")])
CONF = StateStoreConf(min_deltas_for_snapshot=2, min_versions_to_retain=3)


def store_id(root, name="added"):
    return StateStoreId(str(root), 0, 0, store_name=name)


def files_of(root, name="added"):
    return open_store_files(store_id(root, name).store_checkpoint_location())


def seed(root, version, name="added"):
    key, value = key_value_schemas(KEY, VALUE)
    return start_empty(files_of(root, name), version, key, value, CONF.compression)


def rows(n, start=0):
    keys = np.zeros(n, dtype=KEY)
    keys["user"] = np.arange(start, start + n)
    values = np.zeros(n, dtype=VALUE)
    values["n"] = keys["user"] * 10
    return keys, values


def state_of(provider, version, commit_id=None):
    store = provider.get_read_store(version, commit_id) if commit_id is not None else provider.get_read_store(version)
    try:
        return {int(k["user"]): int(v["n"]) for keys, values in store.iter_batches() for k, v in zip(keys, values)}
    finally:
        store.abort()


def test_a_variable_added_at_batch_5_starts_empty_commits_reloads_and_verifies(tmp_path):
    """A state variable added to a query at batch 5: its store starts empty at version 5, takes
    puts, commits 6..9 (maintenance writing snapshots and cleaning up between), and reads back
    from files alone; `statecore verify` finds the checkpoint sound."""
    commit_id = seed(tmp_path, 5)
    provider = create_and_init_provider(store_id(tmp_path), KEY, VALUE, CONF)
    store = provider.get_store(5, commit_id)
    assert store.metrics.num_keys == 0
    store.put_batch(*rows(10))
    store.commit()
    assert store.commit_id is not None
    expected = dict(zip(range(10), range(0, 100, 10)))
    for version in range(6, 9):
        store = provider.get_store(version)
        store.put_batch(*rows(3, start=100 + version))
        store.commit()
        expected.update({100 + version + i: (100 + version + i) * 10 for i in range(3)})
        provider.do_maintenance()
    provider.close()

    reloaded = create_and_init_provider(store_id(tmp_path), KEY, VALUE, CONF)
    try:
        assert state_of(reloaded, 9) == expected
    finally:
        reloaded.close()
    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--json", "--deep"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["sound"]


def test_a_retried_task_starts_over_the_empty_snapshot_its_first_attempt_left(tmp_path):
    """A task retry of the batch that adds the variable: the first attempt's empty snapshot of
    version 3 and its commit of 4 are unrecorded leftovers; the retry starts empty again under
    a new id and its commit is what the store then holds."""
    first = seed(tmp_path, 3)
    provider = create_and_init_provider(store_id(tmp_path), KEY, VALUE, CONF)
    store = provider.get_store(3, first)
    store.put_batch(*rows(4))
    store.commit()

    second = seed(tmp_path, 3)  # the retry, in the same worker: the provider is still loaded
    assert second != first
    try:
        store = provider.get_store(3, second)
        assert store.metrics.num_keys == 0, "the retry starts from its own empty snapshot"
        store.put_batch(*rows(2, start=50))
        store.commit()
        assert state_of(provider, 4, store.commit_id) == {50: 500, 51: 510}
    finally:
        provider.close()
    reloaded = create_and_init_provider(store_id(tmp_path), KEY, VALUE, CONF)
    try:
        assert state_of(reloaded, 4, store.commit_id) == {50: 500, 51: 510}
    finally:
        reloaded.close()


def test_older_versions_no_record_names_are_refused_and_nothing_is_written(tmp_path):
    """A variable removed from the query and declared again later: its directory holds versions
    1..2 from before; starting it empty at version 6 would hide them, so it is refused, naming
    the directory and the versions, and no file is added."""
    provider = create_and_init_provider(store_id(tmp_path), KEY, VALUE, CONF)
    for version in range(2):
        store = provider.get_store(version)
        store.put_batch(*rows(2, start=version))
        store.commit()
    provider.close()
    location = store_id(tmp_path).store_checkpoint_location()
    before = sorted(os.listdir(location))
    with pytest.raises(UnrecordedStateError, match=r"holds versions 1\.\.2 that no record names") as raised:
        seed(tmp_path, 6)
    assert location in str(raised.value)
    assert sorted(os.listdir(location)) == before


def test_a_schema_file_of_other_schemas_is_refused_before_the_snapshot(tmp_path):
    """The directory's schema file records another value schema (a variable declared again with
    another type): StateCorruptionError naming the schema file; no snapshot is written."""
    other = create_and_init_provider(store_id(tmp_path), KEY, np.dtype([("s", "S4")]), CONF)
    other.get_store(0).abort()
    store = other.get_store(0)
    store.commit()  # the first commit writes the schema file
    other.close()
    location = store_id(tmp_path).store_checkpoint_location()
    os.remove(os.path.join(location, file_name(1, bytes.fromhex(store.commit_id), "delta")))
    with pytest.raises(StateCorruptionError, match="_statecore.schema.json.*other schemas"):
        seed(tmp_path, 4)
    assert not [n for n in os.listdir(location) if n.endswith(".snapshot")]


@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_a_snapshot_damaged_on_its_way_to_disk_is_caught_by_the_check_after_writing(tmp_path, monkeypatch,
                                                                                     compression):
    """The check after writing reads the file back (every checksum: the packed blocks, or the
    image's blocks): a byte changed between the writer and the disk raises, naming the file."""
    import statecore.snapshot_at as snapshot_at

    written = snapshot_at.write_snapshot_file

    def write_then_damage(files, name, *args, **kwargs):
        size = written(files, name, *args, **kwargs)
        path = files.path(name)
        with open(path, "r+b") as f:  # a byte in the middle of the rows
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x40]))
        return size

    monkeypatch.setattr(snapshot_at, "write_snapshot_file", write_then_damage)
    key, value = key_value_schemas(KEY, VALUE)
    keys, values = rows(50_000)
    chunk = np.concatenate([key.rows(keys), value.rows(values)], axis=1)
    with pytest.raises(StateCorruptionError, match=file_name(3, b"\1" * 8, "snapshot")):
        snapshot_at.write_snapshot_at(files_of(tmp_path), 3, b"\1" * 8, key, value, [chunk], len(chunk), compression)
