"""The ``statecore`` command on a checkpoint written by a StatefulOperator on Spark (metadata
and batch records): inspect's JSON against what was written, dump against ``read_state``, and
verify against a flipped byte in the operator's files and a batch record naming a missing
attempt. The checkpoints written with the store API alone are tests/engine/test_cli.py's."""
import json
import os
import shutil

import pyarrow.parquet as pq
import pytest

from statecore.operator_files import COMMITS_DIR, OPERATOR_METADATA_FILE
from tests.engine.test_cli import flip, problems_of, run


@pytest.fixture(scope="module")
def operator_root(spark, tmp_path_factory):
    from tests.glue_support import events_df, make_operator

    root = str(tmp_path_factory.mktemp("operator") / "state")
    op = make_operator(root, num_partitions=3)
    try:
        for b in range(3):
            op.process(events_df(spark, b), b)
    finally:
        op.close()
    return root


@pytest.fixture
def operator_copy(operator_root, tmp_path):
    copy = str(tmp_path / "state")
    shutil.copytree(operator_root, copy)
    return copy


def test_operator_checkpoint_inspect_verify_and_dump(spark, operator_copy, tmp_path):
    from pyspark_glue import read_state
    from tests.glue_support import KEY as OP_KEY, VALUE as OP_VALUE, store_rows

    root = operator_copy
    data = json.loads(run("inspect", root, "--json").output)
    op = data["operators"][0]
    with open(os.path.join(root, "0", OPERATOR_METADATA_FILE)) as f:
        written = json.load(f)
    assert written.pop("checksum") and op["metadata"] == written
    assert [r["batch_id"] for r in op["batch_records"]] == [0, 1, 2]
    for r in op["batch_records"]:
        with open(os.path.join(root, "0", COMMITS_DIR, str(r["batch_id"]))) as f:
            written = json.load(f)
        assert r["commit_ids"] == written["commit_ids"] and r["version"] == written["version"]
    newest = op["batch_records"][-1]
    for s in data["stores"]:
        assert (s["newest_version"], s["newest_commit_id"]) == (3, newest["commit_ids"][s["partition_id"]])
        assert s["rows"] == len(store_rows(root, s["partition_id"], 3, OP_KEY, OP_VALUE))
    assert run("verify", root).exit_code == 0
    assert run("verify", root, "--operator", 0, "--version", 2).exit_code == 0

    out = tmp_path / "state.parquet"
    assert run("dump", root, "--operator", 0, "--format", "parquet", "--out", out).exit_code == 0
    table = pq.read_table(out).to_pydict()
    dumped = sorted(zip(table["user"], table["region"], table["count"], table["sum"], table["partition_id"]))
    via_spark = sorted((r["user"], bytes(r["region"]), r["count"], r["sum"], r["partition_id"])
                       for r in read_state(spark, root, 0).collect())
    assert dumped == via_spark and len(dumped) > 0


@pytest.mark.parametrize("name", [OPERATOR_METADATA_FILE, f"{COMMITS_DIR}/1"])
def test_verify_catches_a_flipped_byte_in_operator_files(operator_copy, name):
    path = os.path.join(operator_copy, "0", name)
    flip(path, 9)
    result = run("verify", operator_copy, "--json")
    assert result.exit_code == 1
    assert [(p["path"], p["offset"]) for p in problems_of(result)] == [(path, 9)]


def test_verify_reports_a_batch_record_naming_a_missing_attempt(operator_copy):
    with open(os.path.join(operator_copy, "0", COMMITS_DIR, "2")) as f:
        named = json.load(f)["commit_ids"][1]
    os.unlink(os.path.join(operator_copy, "0", "1", f"3_{named}.delta"))
    result = run("verify", operator_copy, "--json")
    assert result.exit_code == 1
    record = os.path.join(operator_copy, "0", COMMITS_DIR, "2")
    assert any(p["path"] == record and f"attempt {named} of partition 1" in p["what"] for p in problems_of(result))
