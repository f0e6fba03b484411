"""``statecore rewrite`` (statecore/rewrite.py, docs/rewrite.md): a StatefulOperator's state
rewritten offline through a transform of the user's, switched to atomically, a kill at any
step leaving the old or the new state whole."""
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider, operator_files, operator_lock
from statecore import repartition as protocol
from statecore.cli import main
from statecore.cli.output import BAD_INPUT
from statecore.rewrite import RewriteError, rewrite
from statecore.schema_file import read_schema_history
from statecore.files import open_store_files
from statecore.spark_hash import spark_partition

from tests import rewrite_support
from tests.engine.test_repartition import KEY_TYPES, KILLER, make_checkpoint
from tests.glue_support import KEY, VALUE
from tests.paths import REPO_ROOT
from tests.state_files import tree

ROOT = str(REPO_ROOT)
SUPPORT = "tests.rewrite_support"


def cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def applied(rule, expected):
    """``expected`` ({key: value}) under a transform's plain-Python twin."""
    out = {}
    for key, value in expected.items():
        row = rule(key, value)
        if row is not None:
            out[row[0]] = row[1]
    return out


def read_state(root, key_dtype, value_dtype):
    """``{partition: {key: value}}`` of operator 0 at its newest record, each partition read
    by a fresh provider of the given schemas at the recorded attempt."""
    location = operator_files.operator_dir(root, 0)
    metadata = operator_files.read_metadata(location)
    records = operator_files.commit_log(location)
    record = operator_files.read_commit_record(records, records.latest(), metadata)
    out = {}
    for p in range(record["num_partitions"]):
        provider = create_and_init_provider(StateStoreId(root, 0, p), key_dtype, value_dtype, StateStoreConf())
        store = provider.get_read_store(record["version"], record["commit_ids"][p])
        out[p] = {tuple(k): tuple(v) for k, v in store.iterator()}
        store.abort()
        provider.close()
    return out


def merged_and_routed(by_partition):
    """The union of the partitions' rows, each key checked to be where Spark routes it."""
    merged = {}
    for p, rows in by_partition.items():
        for user, region in rows:
            dest = spark_partition([np.array([user]), np.array([region])], KEY_TYPES, len(by_partition))
            assert dest[0] == p, (user, region, p)
        merged.update(rows)
    return merged


def decoded(rows):
    """Rows read back with their S<n> fields as the store returns them (no padding)."""
    return {(u, r.rstrip(b"\0")): v for (u, r), v in rows.items()}


# -- what a rewrite writes ---------------------------------------------------------------------------

def test_a_transform_that_drops_keys_and_doubles_a_value_field(tmp_path):
    """Users divisible by 3 dropped and every sum doubled: the state after is the rule applied
    to the state before, every partition at the new ids, one snapshot each, and the summary
    counts the rows."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=3)
    result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:drop_and_double", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    want = applied(rewrite_support.drop_and_double_rule, expected)
    assert merged_and_routed(read_state(root, KEY, VALUE)) == want
    assert (out["rows_in"], out["rows_out"], out["version"]) == (len(expected), len(want), 3)
    assert sum(p["dropped"] for p in out["partitions"]) == len(expected) - len(want)
    assert out["schemas"]["change"] == ["unchanged"]
    for q in range(4):
        names = [n for n in os.listdir(os.path.join(root, "0", str(q))) if n[0].isdigit()]
        assert names == [f"3_{out['commit_ids']['default'][q]}.snapshot"]
    assert os.listdir(os.path.join(root, "0", protocol.JOURNAL_DIR)) == []
    record = operator_files.read_commit_record(operator_files.commit_log(operator_files.operator_dir(root, 0)), 2)
    assert record["writer"] == operator_files.WRITER_REWRITE


def test_a_schema_change_the_rules_refuse_is_written_and_recorded(tmp_path):
    """A key field widened, a value field renamed, an int one turned into a float (which the
    schema rules refuse, so the change reads "rewritten"): the state
    reads in the new schemas, _operator.json holds them, and every partition's schema history
    gains a rewritten entry from the rewrite's version (the older entry kept)."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=3, batches=2, seed=5)
    result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:reshape", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["schemas"]["change"] == ["rewritten"]
    got = decoded(merged_and_routed(read_state(root, rewrite_support.NEW_KEY, rewrite_support.NEW_VALUE)))
    assert got == applied(rewrite_support.reshape_rule, {(u, r): v for (u, r), v in expected.items()})
    metadata = operator_files.read_metadata(operator_files.operator_dir(root, 0))
    assert metadata["key_schema"] == [["user", "<i8"], ["region", "|S8"]]
    assert metadata["value_schema"] == [["events", "<i8"], ["sum", "<f8"]]
    for q in range(3):
        history = read_schema_history(open_store_files(StateStoreId(root, 0, q).store_checkpoint_location()))
        assert [(e.key.dtype, e.value.dtype, e.from_version, e.rewritten) for e in history.entries] == [
            (KEY, VALUE, 1, False), (rewrite_support.NEW_KEY, rewrite_support.NEW_VALUE, 2, True)]


def test_dry_run_reports_and_writes_nothing(tmp_path):
    """--dry-run runs the transform and reports each partition's rows and the schema change,
    and leaves every file as it was (names, sizes, modification times)."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=2, seed=3)
    before = tree(root)
    result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:drop_and_double", "--dry-run",
                 "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["dry_run"] and out["commit_ids"] is None
    assert out["rows_in"] == len(expected)
    assert out["rows_out"] == len(applied(rewrite_support.drop_and_double_rule, expected))
    assert tree(root) == before
    human = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:reshape", "--dry-run")
    assert human.exit_code == 0 and "would rewrite" in human.output and "rewritten" in human.output, human.output
    assert tree(root) == before


def test_a_python_caller_passes_the_function_itself(tmp_path):
    """The entry point takes a callable as well as module:function; an empty result drops
    every key, and the next rewrite then reads an empty state."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1, seed=7)
    out = rewrite(root, 0, lambda keys, values: (keys[:0], values[:0]))
    assert out["rows_out"] == 0
    assert read_state(root, KEY, VALUE) == {0: {}, 1: {}}
    again = rewrite(root, 0, rewrite_support.drop_and_double)
    assert (again["rows_in"], again["rows_out"]) == (0, 0)


def test_partitions_read_at_once_still_call_the_transform_one_at_a_time(tmp_path, monkeypatch):
    """Two old partitions are read on two threads at once (both reach their first batch before
    either goes on: a barrier, asserted passed), and the transform's first call waits up to two
    seconds for a second call to enter beside it: none does, the state is the rule applied."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=2, batches=2, seed=11)
    monkeypatch.setattr(protocol, "READERS", 2)
    both_reading = threading.Barrier(2, timeout=60)
    read = protocol._version_rows

    def reading_together(plan, store, p):
        if store.name == "default":
            both_reading.wait()
        yield from read(plan, store, p)

    monkeypatch.setattr(protocol, "_version_rows", reading_together)
    inside, most, second_entered = [0], [0], threading.Event()
    guard = threading.Lock()

    def transform(keys, values):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            first = most[0] == 1 and not second_entered.is_set()
            if inside[0] > 1:
                second_entered.set()
        if first:
            second_entered.wait(timeout=2)
        with guard:
            inside[0] -= 1
        return rewrite_support.drop_and_double(keys, values)

    rewrite(root, 0, transform)
    assert not both_reading.broken and both_reading.n_waiting == 0
    assert most[0] == 1 and not second_entered.is_set()
    assert merged_and_routed(read_state(root, KEY, VALUE)) == applied(rewrite_support.drop_and_double_rule,
                                                                      expected)


@pytest.mark.parametrize("readers", [1, 3])
def test_routed_rows_come_in_partition_order_whatever_the_readers(tmp_path, monkeypatch, readers):
    """read_sources gives the same chunks in the same order read one partition at a time or
    three at once (the new snapshots' row order does not depend on the threads)."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=4, batches=3, seed=12)
    monkeypatch.setattr(protocol, "ROWS_PER_READ", 16)  # many batches per partition
    monkeypatch.setattr(protocol, "READERS", 1)
    plan = protocol.plan_repartition(root, 0, 3)
    one = protocol.read_sources(plan)
    monkeypatch.setattr(protocol, "READERS", readers)
    many = protocol.read_sources(plan)
    assert one.keys() == many.keys() and sum(len(c) for c in one.values()) > 3
    for target, chunks in one.items():
        assert len(chunks) == len(many[target])
        for a, b in zip(chunks, many[target]):
            np.testing.assert_array_equal(a, b)


# -- refusals: a clear error, nothing written ------------------------------------------------------

@pytest.mark.parametrize("transform, message", [
    ("tests.no_such_module:f", "does not import"),
    (f"{SUPPORT}:no_such_function", "has no 'no_such_function'"),
    (f"{SUPPORT}:NOT_CALLABLE", "not a function"),
    ("no_colon_here", "module:function"),
    (f"{SUPPORT}:lengths_differ", "keys and"),
    (f"{SUPPORT}:dtype_per_batch", "every batch must have the same schemas"),
    (f"{SUPPORT}:every_region_eu", "keys must be unique"),
    (f"{SUPPORT}:not_arrays", "two 1-D numpy structured arrays"),
    (f"{SUPPORT}:fails", "raised KeyError"),
    (f"{SUPPORT}:object_values", "rows a store cannot hold"),
])
def test_a_bad_transform_is_refused_and_writes_nothing(tmp_path, transform, message):
    """A module that does not import, a missing or uncallable name, a transform returning
    mismatched lengths, other dtypes for a later batch, a key twice, no arrays, a field no
    store holds, or raising:
    exit 3, one line naming it, every file as it was."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=3, batches=2, seed=1)
    rewrite_support.CALLS[0] = 0
    before = tree(root)
    result = cli("rewrite", root, "--operator", "0", "--transform", transform)
    assert result.exit_code == BAD_INPUT, result.output
    assert message in result.output and "Traceback" not in result.output, result.output
    assert tree(root) == before


def test_a_duplicated_key_is_named(tmp_path):
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=1, batches=1, seed=2)
    with pytest.raises(RewriteError, match=r"returned key \(-?\d+, b'eu'\) \d+ times in partition 0"):
        rewrite(root, 0, rewrite_support.every_region_eu)


def test_a_transform_that_changes_a_key_column_is_refused(tmp_path):
    """A user id negated moves keys between partitions under a hash the operator's key types
    fix, so that is fine; a key column turned into another type is not."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1, seed=2)
    before = tree(root)

    def to_int32(keys, values):
        out = np.zeros(len(keys), [("user", "<i4"), ("region", "S4")])
        out["user"], out["region"] = keys["user"], keys["region"]
        return out, values

    with pytest.raises(RewriteError, match=r"key column\(s\) \['user'\]"):
        rewrite(root, 0, to_int32)
    assert tree(root) == before


def test_moved_keys_are_routed_to_their_new_partition(tmp_path):
    """A transform that changes key values (every user negated): each key lands in the
    partition Spark routes its new value to."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=2, seed=6)

    def negate(keys, values):
        keys = keys.copy()
        keys["user"] = -keys["user"]
        return keys, values

    rewrite(root, 0, negate)
    assert merged_and_routed(read_state(root, KEY, VALUE)) == {(-u, r): v for (u, r), v in expected.items()}


def test_the_lock_held_by_a_query_is_refused(tmp_path):
    """A running query holds the operator's lock: the rewrite is refused by name, nothing written."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1)
    lock = operator_lock.OperatorLock(root, 0, "query", kind=operator_lock.QUERY)
    lock.acquire()
    try:
        before = tree(root)
        result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:drop_and_double")
        assert result.exit_code == BAD_INPUT and "query" in result.output, result.output
        assert tree(root) == before
    finally:
        lock.release()


# -- a kill at each file step ---------------------------------------------------------------------

def killed_rewrite(root, step, pattern, nth, transform):
    done = subprocess.run([sys.executable, "-c", KILLER, step, pattern, str(nth), "rewrite", root, "--operator", "0",
                           "--transform", transform], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


@pytest.mark.parametrize("step, pattern, nth, switched", [
    ("rename", "*.json", 0, False),  # the journal
    ("rename", "*.snapshot", 2, False),  # in the middle of writing the new snapshots
    ("rename", "_operator.json", 0, False),  # just before the switch
    ("rename", "_statecore.schema.json", 1, True),  # after the switch, recording the new schemas
    ("delete", "*.delta", 1, True),  # after the switch, while the old files are deleted
])
def test_a_kill_leaves_the_old_or_the_new_state_and_a_second_run_finishes_it(tmp_path, step, pattern, nth,
                                                                             switched):
    """SIGKILL at each file step of a schema-changing rewrite: before the switch the old state
    reads whole in the old schemas; after it _operator.json holds the new ones; the second run
    finishes the first (without running the transform again) or makes it afresh, and the state
    is the transform applied once."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=2, seed=8)
    killed_rewrite(root, step, pattern, nth, f"{SUPPORT}:reshape")
    metadata = operator_files.read_metadata(operator_files.operator_dir(root, 0))
    assert (metadata["value_schema"] == [["events", "<i8"], ["sum", "<f8"]]) == switched
    if not switched:
        assert merged_and_routed(read_state(root, KEY, VALUE)) == expected
    result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:reshape", "--json")
    assert result.exit_code == 0, result.output
    assert ("finished" in json.loads(result.output)) == switched
    got = decoded(merged_and_routed(read_state(root, rewrite_support.NEW_KEY, rewrite_support.NEW_VALUE)))
    assert got == applied(rewrite_support.reshape_rule, expected)
    # no journal left, nor the temporary file of one whose write the kill cut short
    assert os.listdir(os.path.join(root, "0", protocol.JOURNAL_DIR)) == []
    for q in range(4):
        names = [n for n in os.listdir(os.path.join(root, "0", str(q))) if n[0].isdigit()]
        assert len(names) == 1 and names[0].startswith("2_") and names[0].endswith(".snapshot"), names


# -- the operator's other stores ------------------------------------------------------------------

SEEN = np.dtype([("n", "<i8")])


def add_seen_store(root, partitions):
    """A second store "seen" of operator 0 (a processor's value state, say), keyed by the same
    keys, at the version of the one batch, named in the batch record; returns its rows."""
    location = operator_files.operator_dir(root, 0)
    records = operator_files.commit_log(location)
    record = operator_files.read_commit_record(records, 0)
    ids, rows = [], {}
    for p in range(partitions):
        default = create_and_init_provider(StateStoreId(root, 0, p), KEY, VALUE, StateStoreConf())
        keys = np.concatenate([k for k, _ in default.version_rows(1, record["commit_ids"][p])] or [np.zeros(0, KEY)])
        default.close()
        provider = create_and_init_provider(StateStoreId(root, 0, p, "seen"), KEY, SEEN, StateStoreConf())
        store = provider.get_store(0)
        values = np.zeros(len(keys), SEEN)
        values["n"] = keys["user"] * 10
        store.put_batch(keys, values)
        store.commit()
        ids.append(store.commit_id)
        provider.close()
        rows.update({tuple(k): (v,) for k, v in zip(keys.tolist(), values["n"].tolist())})
    records.write(0, operator_files.commit_record(0, partitions, "default", "r", record["commit_ids"],
                                                  record["base_commit_ids"], store_commit_ids={"seen": ids}))
    return rows


def test_another_store_is_carried_over_unchanged_under_the_new_ids(tmp_path):
    """A processor-like operator with a second store: the transform sees only the default
    store; the other keeps every row (those of dropped keys too) at the new record's ids."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=3, batches=1, seed=9)
    seen = add_seen_store(root, 3)
    out = rewrite(root, 0, rewrite_support.drop_and_double)
    assert merged_and_routed(read_state(root, KEY, VALUE)) == applied(rewrite_support.drop_and_double_rule, expected)
    record = operator_files.read_commit_record(operator_files.commit_log(operator_files.operator_dir(root, 0)), 0)
    assert list(record["store_commit_ids"]["seen"]) == out["commit_ids"]["seen"]
    got = {}
    for p in range(3):
        provider = create_and_init_provider(StateStoreId(root, 0, p, "seen"), KEY, SEEN, StateStoreConf())
        for keys, values in provider.version_rows(1, record["store_commit_ids"]["seen"][p]):
            got.update({tuple(k): tuple(v) for k, v in zip(keys.tolist(), values.tolist())})
        provider.close()
    assert decoded(got) == decoded(seen)


def test_a_key_schema_change_with_another_store_is_refused_by_name(tmp_path):
    """The other store is keyed by the old keys: a transform that reshapes the key is refused,
    naming the store, and nothing is written."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1, seed=9)
    add_seen_store(root, 2)
    before = tree(root)
    result = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:reshape")
    assert result.exit_code == BAD_INPUT and "changes the key schema" in result.output and "'seen'" in result.output
    assert tree(root) == before


def test_an_older_batch_record_after_a_rewrite_says_rewritten(tmp_path):
    """A reader asking for a batch before the rewrite is told the state was rewritten, not
    that the operator was repartitioned from 2 to 2 partitions."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=3, seed=4)
    rewrite(root, 0, rewrite_support.drop_and_double)
    location = operator_files.operator_dir(root, 0)
    with pytest.raises(ValueError, match="rewritten by statecore rewrite after batch 2: the state of batch 1"):
        operator_files.read_commit_record(operator_files.commit_log(location), 1,
                                          operator_files.read_metadata(location))


def test_a_dry_run_over_an_unfinished_switch_is_refused_and_the_next_run_finishes_it(tmp_path):
    """Killed after its switch, a rewrite awaits its clean-up: a dry run refuses to report on
    it (its rows are in the new schemas, its old files still there) and writes nothing; the
    next run finishes it and says the transform was not run again."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=3, batches=2, seed=11)
    killed_rewrite(root, "delete", "*.delta", 0, f"{SUPPORT}:drop_and_double")
    before = tree(root)
    dry = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:drop_and_double", "--dry-run")
    assert dry.exit_code == BAD_INPUT and "switched rewrite" in dry.output, dry.output
    assert tree(root) == before
    again = cli("rewrite", root, "--operator", "0", "--transform", f"{SUPPORT}:drop_and_double")
    assert again.exit_code == 0 and "the transform was not run again" in again.output, again.output
    assert merged_and_routed(read_state(root, KEY, VALUE)) == applied(rewrite_support.drop_and_double_rule, expected)


def test_a_rewrite_after_an_interrupted_repartition_finishes_it_then_rewrites(tmp_path):
    """A repartition killed after its switch: the rewrite finishes it (its 5 partitions), then
    applies the transform to the repartitioned state."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=3, batches=2, seed=12)
    killed = subprocess.run([sys.executable, "-c", KILLER, "delete", "*.delta", "0", "repartition", root, "--operator",
                             "0", "--to", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    out = rewrite(root, 0, rewrite_support.drop_and_double)
    assert "finished" not in out and len(out["partitions"]) == 5
    assert merged_and_routed(read_state(root, KEY, VALUE)) == applied(rewrite_support.drop_and_double_rule, expected)
    assert sorted(int(n) for n in os.listdir(os.path.join(root, "0")) if n.isdigit()) == list(range(5))
