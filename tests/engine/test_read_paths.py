"""Every read of an operator's state follows its batch records, for every store: plan_read (what
read_state and ``statecore dump`` read) takes an extra store's attempts from the record's
``store_commit_ids``; the change feed's range is checked on the driver (after a repartition, in
batch ids, with a start found from the files); and store names that would make two stores share
a directory are refused. No Spark here: read_state's checks run before it touches the session."""
import json
import logging
import os

import numpy as np
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider, operator_files
from statecore.cli import main
from statecore.lineage import ROOT_COMMIT_ID
from statecore.state_reads import plan_read
from tests.state_files import version_path
from tests.engine.test_repartition import make_checkpoint

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8")])
SEEN = np.dtype([("first", "<i8")])
PARTITIONS = 2


def rows(dtype, values):
    out = np.zeros(len(values), dtype)
    out[dtype.names[0]] = values
    return out


def write_operator(root, batches=2, extra="seen", zombie=False):
    """Operator 0 of ``root`` after ``batches`` batches, as the operator leaves it: its own store
    and an extra store ``extra`` (a processor's variable, an expiry index) committed per batch,
    each batch's winners in its record. Batch b puts key b with value b in every store of every
    partition. Returns ``{(store, batch): [commit id hex per partition]}``.

    With ``zombie``, the last batch was run twice for ``extra`` in partition 0: the losing
    attempt (a speculative copy opened before the winner committed) commits after it, putting
    key -1 with value -1; its file is the newer, so it is the default lineage. Its id is
    ``winners[("zombie", batches - 1)]``."""
    location = operator_files.operator_dir(root, 0)
    stores = {"default": VALUE, extra: SEEN}
    providers = {(name, p): create_and_init_provider(StateStoreId(root, 0, p, name), KEY, dtype, StateStoreConf())
                 for name, dtype in stores.items() for p in range(PARTITIONS)}
    ids = {name: [ROOT_COMMIT_ID.hex()] * PARTITIONS for name in stores}
    winners = {}
    for b in range(batches):
        late = None
        if zombie and b == batches - 1:
            loser = create_and_init_provider(StateStoreId(root, 0, 0, extra), KEY, SEEN, StateStoreConf())
            late = loser.get_store(b, ids[extra][0])
        new = {}
        for name, dtype in stores.items():
            new[name] = []
            for p in range(PARTITIONS):
                store = providers[(name, p)].get_store(b, ids[name][p])
                store.put_batch(rows(KEY, [b]), rows(dtype, [b]))
                store.commit()
                new[name].append(store.commit_id)
            winners[(name, b)] = new[name]
        if late is not None:
            late.put_batch(rows(KEY, [-1]), rows(SEEN, [-1]))
            late.commit()
            winners[("zombie", b)] = late.commit_id
            loser.close()
            directory = StateStoreId(root, 0, 0, extra).store_checkpoint_location()
            newest = max(os.stat(os.path.join(directory, n)).st_mtime for n in os.listdir(directory))
            os.utime(os.path.join(directory, f"{b + 1}_{late.commit_id}.delta"), (newest + 60, newest + 60))
        operator_files.commit_log(location).write(b, operator_files.commit_record(
            b, PARTITIONS, "default", "test-run", new["default"], ids["default"],
            store_commit_ids={extra: new[extra]}))
        ids = new
    for provider in providers.values():
        provider.close()
    return winners


def test_a_zombie_attempt_of_a_processor_store_is_not_what_plan_read_reads(tmp_path):
    """A StatefulProcessor-like extra store whose newest version has a loser's attempt written
    after the recorded winner: plan_read (read_state, dump) takes the record's
    store_commit_ids, at the newest version and at an older one."""
    root = str(tmp_path / "state")
    winners = write_operator(root, zombie=True)
    zombie = winners[("zombie", 1)]
    provider = create_and_init_provider(StateStoreId(root, 0, 0, "seen"), KEY, SEEN, StateStoreConf())
    assert -1 in [k for keys, _ in provider.version_rows(2) for k in keys["k"]]  # the default lineage: the zombie's
    provider.close()
    plan = plan_read(root, 0, "seen")
    assert plan.version == 2
    assert plan.commit_ids == dict(enumerate(winners[("seen", 1)]))
    assert zombie not in plan.commit_ids.values()
    assert plan_read(root, 0, "seen", version=1).commit_ids == dict(enumerate(winners[("seen", 0)]))
    assert plan_read(root, 0).commit_ids == dict(enumerate(winners[("default", 1)]))  # the own store unchanged


def test_dump_of_a_processor_store_shows_the_recorded_attempt_not_the_zombie(tmp_path):
    """``statecore dump --store-name seen`` after a re-executed batch whose losing task of that
    store wrote last: the rows are the winner's (keys 0 and 1), not the zombie's key -1."""
    root = str(tmp_path / "state")
    write_operator(root, zombie=True)
    out = tmp_path / "seen.jsonl"
    result = CliRunner().invoke(main, ["dump", root, "--operator", "0", "--store-name", "seen", "--format", "jsonl",
                                       "--out", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with open(out) as f:
        dumped = sorted((r["partition_id"], r["k"], r["first"]) for r in map(json.loads, f))
    assert dumped == [(p, k, k) for p in range(PARTITIONS) for k in (0, 1)]


def test_a_store_the_records_do_not_name_reads_its_default_lineage_and_says_so(tmp_path, caplog):
    """A store that exists on the files but that no record lists (a store the function declares
    no more): its default lineage, with a warning naming the store and the record."""
    root = str(tmp_path / "state")
    write_operator(root, batches=1)
    for p in range(PARTITIONS):
        provider = create_and_init_provider(StateStoreId(root, 0, p, "old"), KEY, SEEN, StateStoreConf())
        store = provider.get_store(0)
        store.put_batch(rows(KEY, [7]), rows(SEEN, [7]))
        store.commit()
        provider.close()
    with caplog.at_level(logging.WARNING, logger="statecore.state_reads"):
        plan = plan_read(root, 0, "old")
    assert (plan.version, plan.commit_ids) == (1, None)
    assert "names no attempts of store 'old'" in caplog.text and "['default', 'seen']" in caplog.text


# -- store names ---------------------------------------------------------------------------------------

def test_store_name_dot_dot_no_longer_lets_partition_0_read_partition_1s_data(tmp_path):
    """The issue's case: a store named '..' of partition 1 and of partition 0 were the same
    directory (``<root>/<operator>``), so partition 0 read what partition 1 wrote. Refused,
    naming the store name, before any file is opened."""
    root = str(tmp_path / "state")
    for p in (1, 0):
        with pytest.raises(ValueError, match=r"store_name '\.\.'"):
            StateStoreId(root, 0, p, "..")
    assert not os.path.exists(root)


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden", "a/b", "a\\b", "a\0b", "3.delta",
                                  "4_0123456789abcdef.snapshot", "_statecore.schema.json", 7])
def test_store_names_that_would_share_a_directory_are_refused(name):
    """Names that are no directory of their own (empty, '.', '..', separators, NUL, hidden) or that
    a partition's default store's own files take (its version files, its schema file)."""
    with pytest.raises(ValueError, match="store_name"):
        StateStoreId("/state", 0, 0, name)


@pytest.mark.parametrize("args, field", [(("", 0, 0), "checkpoint_root_location"), (("/state", True, 0), "operator_id"),
                                         (("/state", 0, False), "partition_id")])
def test_an_empty_root_and_bool_ids_are_refused(args, field):
    """An empty root would put the stores at the filesystem's root; True would be a directory
    named 'True'."""
    with pytest.raises(ValueError, match=field):
        StateStoreId(*args)


def test_the_store_names_the_glue_creates_stay_valid():
    """Every store a StatefulProcessor's timers and variables, and the event-time operators, use."""
    from pyspark_glue.keyed_event_fn import _ENTRIES, _HEADS
    from pyspark_glue.sessions import _SESSIONS
    from pyspark_glue.state_vars import StateHandle

    handle = StateHandle(KEY)
    handle.value("count", VALUE, ttl="1 hour")
    handle.list("events", VALUE, ttl="1 hour")
    handle.map("by_page", SEEN, VALUE, ttl="1 hour")
    names = [*handle.stores(), _HEADS, _ENTRIES, _SESSIONS, "default"]
    assert "__timers" in names and "events.entries" in names
    for name in names:
        StateStoreId("/state", 0, 0, name)


def test_a_state_variable_whose_store_could_not_be_a_directory_is_refused_when_declared():
    """A processor declaring a variable named 'a\\b' hears it on the driver, naming the variable,
    rather than from every task that would open its store."""
    from pyspark_glue.state_vars import StateHandle

    with pytest.raises(ValueError, match=r"state variable name 'a\\\\b'"):
        StateHandle(KEY).value("a\\b", VALUE)


# -- the change feed's range -------------------------------------------------------------------------

def repartitioned(root):
    """A 4-partition operator after batches 0..2, repartitioned to 2 (after batch 2), then batch 3
    run on the new partitioning at the recorded attempts."""
    make_checkpoint(root, partitions=4, batches=3)
    result = CliRunner().invoke(main, ["repartition", root, "--operator", "0", "--to", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    location = operator_files.operator_dir(root, 0)
    records = operator_files.commit_log(location)
    record = operator_files.read_commit_record(records, 2, operator_files.read_metadata(location))
    from tests.glue_support import KEY as AGG_KEY, VALUE as AGG_VALUE
    ids = []
    for p in range(2):
        provider = create_and_init_provider(StateStoreId(root, 0, p), AGG_KEY, AGG_VALUE, StateStoreConf())
        store = provider.get_store(3, record["commit_ids"][p])
        key = np.zeros(1, AGG_KEY)
        key["user"] = 10**6 + p  # a key the batches before never had
        store.put_batch(key, np.ones(1, AGG_VALUE))
        store.commit()
        ids.append(store.commit_id)
        provider.close()
    records.write(3, operator_files.commit_record(3, 2, "default", "test-run", ids, record["commit_ids"]))


@pytest.mark.parametrize("bounds", [{"start_version": 2}, {"start_batch_id": 1}, {"start_version": 3}])
def test_a_change_feed_from_before_a_repartition_is_refused_on_the_driver(tmp_path, bounds):
    """After ``statecore repartition`` after batch 2, a feed from batch 1 (or from the version the
    repartition wrote) is refused before any task runs, saying from which batch it can start."""
    from pyspark_glue.read import read_state

    root = str(tmp_path / "state")
    repartitioned(root)
    with pytest.raises(ValueError, match=r"repartitioned from 4 to 2 partitions after batch 2: its change feed can "
                                         r"start at batch 3 \(start_version 4\)"):
        read_state(None, root, 0, change_feed=True, **bounds)  # no session: nothing reaches Spark


def test_a_change_feed_without_a_start_begins_after_the_repartition(tmp_path):
    """No start given: the feed begins at the first batch after the repartition; ending at the
    version the repartition wrote (a snapshot, no change) is a clear error on the driver."""
    from statecore.errors import VersionNotFoundError
    from statecore.state_reads import plan_changes

    root = str(tmp_path / "state")
    repartitioned(root)
    plan, start = plan_changes(root, 0)
    assert (start, plan.version, plan.partitions) == (4, 4, [0, 1])
    with pytest.raises(VersionNotFoundError, match=r"holds no change of version 3: partition\(s\) \[0, 1\]"):
        plan_changes(root, 0, end_version=3)


def test_a_change_feed_without_a_start_begins_at_the_oldest_change_every_partition_holds(tmp_path):
    """Partition 0's deltas of versions 1 and 2 deleted (as maintenance does once a snapshot
    covers them): the feed starts at version 3 (batch 2); a start in batch ids is the version
    less one, and an end before the start is refused naming both."""
    from pyspark_glue.read import read_state
    from statecore.state_reads import plan_changes

    root = str(tmp_path / "state")
    write_operator(root, batches=5)
    directory = StateStoreId(root, 0, 0).store_checkpoint_location()
    for v in (1, 2):
        os.unlink(version_path(directory, v, "delta"))
    plan, start = plan_changes(root, 0)
    assert (start, plan.version) == (3, 5)
    plan, start = plan_changes(root, 0, "seen")
    assert (start, plan.version) == (1, 5)  # the extra store kept every delta
    with pytest.raises(ValueError, match=r"end \(version 2, batch 1\) is before its start \(version 4, batch 3\)"):
        read_state(None, root, 0, change_feed=True, start_batch_id=3, end_batch_id=1)
    with pytest.raises(ValueError, match="start_version or start_batch_id, not both"):
        read_state(None, root, 0, change_feed=True, start_batch_id=3, start_version=4)
    with pytest.raises(ValueError, match=r"start_batch_id must be an int >= 0, got -1"):
        read_state(None, root, 0, change_feed=True, start_batch_id=-1)


def test_inspect_skips_a_stray_directory_no_store_could_be_named_after(tmp_path):
    """A directory ``7.delta`` (a name StateStoreId now refuses) left in a partition's directory
    is not a store: inspect lists the real stores and exits 0, no traceback."""
    root = str(tmp_path / "state")
    write_operator(root, batches=1)
    os.mkdir(os.path.join(root, "0", "0", "7.delta"))
    result = CliRunner().invoke(main, ["inspect", root, "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["operators"][0]["store_names"] == ["default", "seen"]
    assert sorted((s["partition_id"], s["store_name"]) for s in found["stores"]) == [
        (p, name) for p in range(PARTITIONS) for name in ("default", "seen")]
