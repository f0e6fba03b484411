"""Repartitioning a StatefulOperator's state without Spark: the local rewrite and the
``statecore repartition`` command, kills at every step of the protocol, bad input. Spark's
hash against Spark's own, and queries moved on Spark: tests/spark/test_repartition_spark.py."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider, operator_files
from statecore.cli import main
from statecore.cli.output import BAD_INPUT
from statecore.lineage import ROOT_COMMIT_ID
from statecore.spark_hash import spark_hash, spark_partition
from statecore import repartition as engine

from tests.glue_support import KEY, VALUE
from tests.paths import REPO_ROOT
from tests.state_files import tree

ROOT = str(REPO_ROOT)
KEY_TYPES = ["bigint", "string"]

# A child process that runs the command and SIGKILLs itself at the n-th time a chosen file
# step runs (the StoreFiles step hook statecore.faults uses): a kill -9 at that point.
KILLER = r'''
import fnmatch, os, signal, sys
import statecore.checkpoint, statecore.files
step, pattern, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = [0]

class Killing(statecore.files.StoreFiles):
    def _step(self, s, name):
        if s == step and fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], pattern):
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            seen[0] += 1

def opener(location, storage_options=None, local_cache_dir=None):
    return Killing(location, storage_options, local_cache_dir)

statecore.files.open_store_files = opener
statecore.checkpoint.open_store_files = opener
from statecore.cli import run
sys.exit(run(sys.argv[4:]))
'''


# -- Spark's hash (against Spark's own: tests/spark/test_repartition_spark.py) --------------------

def test_spark_hash_refuses_what_it_cannot_hash():
    with pytest.raises(ValueError, match="decimal"):
        spark_hash([np.zeros(3, np.int64)], ["decimal(10,2)"])
    with pytest.raises(TypeError, match="S<n>"):
        spark_hash([np.zeros(3, np.int64)], ["string"])


# -- a StatefulOperator checkpoint made without Spark -----------------------------------------------

def _keys(n, seed):
    rng = np.random.default_rng(seed)
    keys = np.zeros(n, KEY)
    keys["user"] = rng.integers(-1000, 1000, n)
    keys["region"] = np.array([b"eu", b"us", b"apac", b"", b"latm"])[rng.integers(0, 5, n)]
    return np.unique(keys)


def make_checkpoint(root, partitions=4, batches=3, seed=0):
    """Operator 0 of ``root`` as a RunningAggregate on ``partitions`` leaves it after
    ``batches`` batches (every key in the partition Spark routes it to), with its metadata and
    batch records; returns ``{key tuple: value tuple}``."""
    location = operator_files.operator_dir(root, 0)
    operator_files.check_metadata(location, {
        "format": operator_files.METADATA_FORMAT, "operator_id": 0, "num_partitions": partitions,
        "key_columns": ["user", "region"], "key_column_types": KEY_TYPES, "store_name": "default",
        "key_schema": [["user", "<i8"], ["region", "|S4"]], "value_schema": [["count", "<i8"], ["sum", "<i8"]]})
    providers = [create_and_init_provider(StateStoreId(root, 0, p), KEY, VALUE, StateStoreConf())
                 for p in range(partitions)]
    ids = [ROOT_COMMIT_ID.hex()] * partitions
    expected = {}
    for b in range(batches):
        keys = _keys(200, seed * 100 + b)
        dest = spark_partition([keys["user"], keys["region"]], KEY_TYPES, partitions)
        new_ids = []
        for p, provider in enumerate(providers):
            store = provider.get_store(b, ids[p])
            mine = keys[dest == p]
            old, found = store.get_batch(mine)
            values = np.zeros(len(mine), VALUE)
            values["count"] = np.where(found, old["count"], 0) + 1
            values["sum"] = np.where(found, old["sum"], 0) + mine["user"]
            store.put_batch(mine, values)
            store.commit()
            new_ids.append(store.commit_id)
            for k, v in zip(mine.tolist(), values.tolist()):
                expected[k] = v
        operator_files.commit_log(location).write(b, operator_files.commit_record(
            b, partitions, "default", "test-run", new_ids, ids))
        ids = new_ids
    for provider in providers:
        provider.close()
    return expected


def read_at_record(root, partitions=None):
    """``{partition: {key: value}}`` of operator 0 at its newest record, each read by a fresh
    provider at the recorded attempt (as the operator and read_state open it)."""
    location = operator_files.operator_dir(root, 0)
    metadata = operator_files.read_metadata(location)
    records = operator_files.commit_log(location)
    record = operator_files.read_commit_record(records, records.latest(), metadata)
    assert record["num_partitions"] == metadata["num_partitions"] == (partitions or record["num_partitions"])
    out = {}
    for p in range(record["num_partitions"]):
        provider = create_and_init_provider(StateStoreId(root, 0, p), KEY, VALUE, StateStoreConf())
        store = provider.get_read_store(record["version"], record["commit_ids"][p])
        out[p] = {tuple(k): tuple(v) for k, v in store.iterator()}
        store.abort()
        provider.close()
    return out


def check_routed(by_partition, expected):
    """Every key is in the partition Spark routes it to, and the union is ``expected``."""
    m = len(by_partition)
    merged = {}
    for p, rows in by_partition.items():
        keys = np.array(list(rows), dtype=KEY) if rows else np.zeros(0, KEY)
        if len(keys):
            assert (spark_partition([keys["user"], keys["region"]], KEY_TYPES, m) == p).all()
        merged.update(rows)
    assert merged == expected


def cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def killed_run(root, step, pattern, nth, to):
    done = subprocess.run([sys.executable, "-c", KILLER, step, pattern, str(nth), "repartition", root,
                           "--operator", "0", "--to", str(to)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


# -- the local rewrite --------------------------------------------------------------------------------

@pytest.mark.parametrize("to", [1, 3, 4, 7])
def test_local_repartition_routes_every_key_and_keeps_every_value(tmp_path, to):
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=3)
    result = cli("repartition", root, "--operator", "0", "--to", str(to), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert (out["from_partitions"], out["to_partitions"], out["version"], out["batch_id"]) == (4, to, 3, 2)
    assert out["stores"]["default"]["rows"] == len(expected)
    check_routed(read_at_record(root, to), expected)
    # only the new partitions are left, each with its one snapshot (the old files are gone)
    numbered = sorted(int(n) for n in os.listdir(os.path.join(root, "0")) if n.isdigit())
    assert numbered == list(range(to))
    for q in range(to):
        versions = [n for n in os.listdir(os.path.join(root, "0", str(q))) if n[0].isdigit()]
        assert versions == [f"3_{out['stores']['default']['commit_ids'][q]}.snapshot"]
    assert os.listdir(os.path.join(root, "0", engine.JOURNAL_DIR)) == []
    assert operator_files.commit_log(operator_files.operator_dir(root, 0)).epochs() == [2]


def test_repartition_twice_and_human_output(tmp_path):
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=3, batches=2, seed=4)
    first = cli("repartition", root, "--operator", "0", "--to", "5")
    assert first.exit_code == 0 and "3 -> 5 partitions at version 2" in first.output, first.output
    assert cli("repartition", root, "--operator", "0", "--to", "2").exit_code == 0
    check_routed(read_at_record(root, 2), expected)


@pytest.mark.parametrize("step, pattern, nth, switched", [
    ("rename", "*.snapshot", 2, False),  # in the middle of writing the new partitions
    ("rename", "_operator.json", 0, False),  # just before the switch
    ("delete", "*.delta", 1, True),  # after the switch, while the old files are deleted
])
def test_a_kill_leaves_the_old_or_the_new_state_and_a_second_run_succeeds(tmp_path, step, pattern, nth, switched):
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=4, batches=3, seed=2)
    killed_run(root, step, pattern, nth, to=7)
    if switched:
        check_routed(read_at_record(root, 7), expected)
    else:
        before = read_at_record(root, 4)
        check_routed(before, expected)
    result = cli("repartition", root, "--operator", "0", "--to", "5", "--json")
    assert result.exit_code == 0, result.output
    check_routed(read_at_record(root, 5), expected)
    numbered = sorted(int(n) for n in os.listdir(os.path.join(root, "0")) if n.isdigit())
    assert numbered == list(range(5))
    assert os.listdir(os.path.join(root, "0", engine.JOURNAL_DIR)) == []


def test_bad_input_is_refused_and_writes_nothing(tmp_path):
    missing = cli("repartition", str(tmp_path / "nowhere"), "--operator", "0", "--to", "3")
    assert missing.exit_code == BAD_INPUT and "not a checkpoint" in missing.output
    assert not (tmp_path / "nowhere").exists()

    bare = str(tmp_path / "bare")  # a store with no StatefulOperator metadata
    provider = create_and_init_provider(StateStoreId(bare, 0, 0), KEY, VALUE, StateStoreConf())
    store = provider.get_store(0)
    store.put((1, b"eu"), (1, 1))
    store.commit()
    provider.close()
    before = tree(bare)
    out = cli("repartition", bare, "--operator", "0", "--to", "3")
    assert out.exit_code == BAD_INPUT and "_operator.json" in out.output and "StatefulOperator" in out.output
    other = cli("repartition", bare, "--operator", "9", "--to", "3")
    assert other.exit_code == BAD_INPUT and "_operator.json" in other.output
    assert tree(bare) == before

    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1)
    before = tree(root)
    for bad in ("0", "-2"):
        out = cli("repartition", root, "--operator", "0", "--to", bad)
        assert out.exit_code == BAD_INPUT and f"from 1 to {engine.MAX_PARTITIONS}" in out.output, out.output
    usage = cli("repartition", root, "--operator", "0", "--to", "x")
    assert usage.exit_code == 2
    assert tree(root) == before


def bounded_cli(*args, timeout_s=60, address_space=2 << 30):
    """``python -m statecore *args`` in a child limited to ``address_space`` bytes and killed
    after ``timeout_s`` (a count that sizes a loop or a list would run it out of either)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    try:
        return subprocess.run([sys.executable, "-m", "statecore", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"statecore {args[0]} did not finish within {timeout_s} s")


@pytest.mark.parametrize("count", [engine.MAX_PARTITIONS + 1, 10**8, 10**12])
def test_to_beyond_max_partitions_is_refused_promptly(tmp_path, count):
    """`repartition --to 100000000`: refused at once (exit 3, one line naming the bound) before
    anything is sized by it, nothing written."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1)
    before = tree(root)
    done = bounded_cli("repartition", root, "--operator", "0", "--to", str(count))
    assert done.returncode == BAD_INPUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"from 1 to {engine.MAX_PARTITIONS}" in lines[0] and str(count) in lines[0]
    assert tree(root) == before


def test_metadata_naming_too_many_partitions_is_refused_promptly(tmp_path):
    """A damaged _operator.json whose num_partitions is 10**12: refused, not walked partition by partition."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1)
    path = os.path.join(operator_files.operator_dir(root, 0), operator_files.OPERATOR_METADATA_FILE)
    with open(path) as f:
        metadata = json.load(f)
    metadata["num_partitions"] = 10**12
    metadata.pop("checksum", None)  # as a file written before checksums: only the count is wrong
    with open(path, "w") as f:
        json.dump(metadata, f)
    before = tree(root)
    done = bounded_cli("repartition", root, "--operator", "0", "--to", "3")
    assert done.returncode == BAD_INPUT and "num_partitions" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert tree(root) == before


def test_a_checkpoint_path_that_is_a_symlink_loop_is_bad_input(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    out = CliRunner().invoke(main, ["repartition", str(loop), "--operator", "0", "--to", "3"])
    assert out.exit_code == BAD_INPUT and "Too many levels of symbolic links" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["schema_not_json", "schema_fifo", "record_fifo", "metadata_fifo"])
def test_damage_found_while_planning_is_exit_1_and_one_line(tmp_path, damage):
    """A damaged or refused file met while planning (the first partition's schema file, the
    batch record, _operator.json) is damaged state: exit 1 and one line naming it, as the same
    damage met while reading the partitions is, and nothing written."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=2)
    operator = operator_files.operator_dir(root, 0)
    path = {"schema_not_json": os.path.join(operator, "0", "_statecore.schema.json"),
            "schema_fifo": os.path.join(operator, "0", "_statecore.schema.json"),
            "record_fifo": os.path.join(operator, operator_files.COMMITS_DIR, "1"),
            "metadata_fifo": os.path.join(operator, operator_files.OPERATOR_METADATA_FILE)}[damage]
    os.unlink(path)
    if damage.endswith("fifo"):
        os.mkfifo(path)
    else:
        with open(path, "w") as f:
            f.write('{"key": [')
    before = tree(root)
    done = bounded_cli("repartition", root, "--operator", "0", "--to", "3", timeout_s=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and path in lines[0], done.stderr
    assert tree(root) == before


@pytest.mark.parametrize("journal", [
    "[" * 100000 + "]" * 100000,  # JSON nested deeper than the parser's recursion allows
    {"to_partitions": 10**12},  # a leftover naming 10**12 new partitions: their directories were walked one by one
    {"to_partitions": "3"}, {"version": "x"}, {"stores": {"default": ["zz" * 8]}}, {"stores": ["default"]},
    {"stores": {"../../elsewhere": ["ab" * 8, "cd" * 8]}},
])
def test_a_damaged_leftover_journal_is_skipped_promptly_and_the_run_succeeds(tmp_path, journal):
    """A leftover repartition journal with a count or an id no run writes: skipped with a warning
    (nothing deleted on its account), and the repartition goes on."""
    root = str(tmp_path / "state")
    expected = make_checkpoint(root, partitions=2, batches=1)
    journals = os.path.join(operator_files.operator_dir(root, 0), engine.JOURNAL_DIR)
    os.makedirs(journals)
    leftover = journal if isinstance(journal, str) else json.dumps(dict(
        {"format": "statecore-repartition-1", "batch_id": 0, "version": 1, "from_partitions": 2, "to_partitions": 3,
         "stores": {"default": ["ab" * 8] * 3}}, **journal))
    with open(os.path.join(journals, "0123456789abcdef.json"), "w") as f:
        f.write(leftover)
    done = bounded_cli("repartition", root, "--operator", "0", "--to", "3")
    assert done.returncode == 0, done.stderr
    check_routed(read_at_record(root, 3), expected)


def test_a_store_not_keyed_by_the_key_columns_is_refused_by_name(tmp_path):
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=2, batches=1)
    location = operator_files.operator_dir(root, 0)
    records = operator_files.commit_log(location)
    record = operator_files.read_commit_record(records, 0)
    index_key = np.dtype([("bucket", "<i8")])
    ids = []
    for p in range(2):
        provider = create_and_init_provider(StateStoreId(root, 0, p, "expiry-heads"), index_key,
                                            np.dtype([("n", "<i8")]), StateStoreConf())
        store = provider.get_store(0)
        store.put(p, (1,))
        store.commit()
        ids.append(store.commit_id)
        provider.close()
    records.write(0, operator_files.commit_record(0, 2, "default", "r", record["commit_ids"],
                                                  record["base_commit_ids"], store_commit_ids={"expiry-heads": ids}))
    before = tree(root)
    out = cli("repartition", root, "--operator", "0", "--to", "3")
    assert out.exit_code == BAD_INPUT and "'expiry-heads'" in out.output and "bucket" in out.output
    assert tree(root) == before



def test_a_repartition_on_s3_reads_and_writes_from_several_threads(s3_env, monkeypatch):
    """A checkpoint in a bucket (the local S3 server), repartitioned 4 -> 7 with the new
    snapshots written four at a time (and the old partitions read four at a time): every key
    routed, every value kept, read back at the record as the operator reads it."""
    monkeypatch.setattr(engine, "WRITERS", 4)
    monkeypatch.setattr(engine, "READERS", 4)
    root = s3_env + "/state"
    expected = make_checkpoint(root, partitions=4, batches=2)
    result = cli("repartition", root, "--operator", "0", "--to", "7", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stores"]["default"]["rows"] == len(expected)
    check_routed(read_at_record(root, 7), expected)
