"""StatefulOperator's batch records on real Spark (local[2]): every batch opens the attempts the
driver recorded for the batch before, so a zombie attempt of a batch, committed through
statecore on the same directory from this process, changes nothing: neither a late one (the
engine refuses it) nor one that becomes the engine's default lineage (the record is followed).
Also a re-executed batch, a re-execution from an older batch, and a checkpoint without records.
Each state is checked against Spark's own groupBy().agg() over every input."""
import os
import shutil

import numpy as np
import pytest

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.errors import CommitConflictError

from tests.glue_support import KEY, VALUE, events_df, make_operator, spark_group_by, state_dict, store_rows
from tests.state_files import version_names

JUNK_KEY = (10**6, b"junk")


def partition_dir(state_root, p):
    return os.path.join(state_root, "0", str(p))


def started(spark, tmp_path, seeds):
    """The state root, a batch of events per seed, and an operator (no coordinator) that has
    processed the first batch as batch 0."""
    state_root = str(tmp_path / "state")
    dfs = [events_df(spark, seed) for seed in seeds]
    op = make_operator(state_root, coordinator=False)
    op.process(dfs[0], 0)
    return state_root, dfs, op


def open_zombie(state_root, version, commit_id):
    """An attempt of batch ``version`` on partition 0, opened from this process (its own
    provider on the same directory, as a task in another worker would be): it overwrites
    every key with junk and adds JUNK_KEY; committed later by the test."""
    provider = create_and_init_provider(StateStoreId(state_root, 0, 0), KEY, VALUE, StateStoreConf())
    store = provider.get_store(version, commit_id)
    keys = np.array([k for k, _ in store.iterator()] + [JUNK_KEY], dtype=KEY)
    junk = np.zeros(len(keys), dtype=VALUE)
    junk["count"] = junk["sum"] = 10**9
    store.put_batch(keys, junk)
    return provider, store


def check_output(out, expected, df):
    """A batch's output: each key of ``df`` once, with its totals over every input so far."""
    emitted = state_dict(out)
    assert set(emitted) == {(r["user"], r["region"].encode()) for r in df.select("user", "region").collect()}
    assert emitted == {k: expected[k] for k in emitted}


def test_a_late_zombie_changes_nothing(spark, tmp_path):
    from pyspark_glue import read_state

    state_root, dfs, op = started(spark, tmp_path, range(6))
    zombie_provider, zombie = open_zombie(state_root, 1, op.commit_record(0)["commit_ids"][0])  # batch 1, early
    for batch_id in range(1, 5):
        op.process(dfs[batch_id], batch_id)
    with pytest.raises(CommitConflictError, match="stale attempt"):
        zombie.commit()  # version 2 again, after the query committed versions 2..5
    zombie.abort()
    zombie_provider.close()
    assert version_names(partition_dir(state_root, 0)) == [
        "1.delta", "2.delta", "3.delta", "4.delta", "5.delta", "_statecore.schema.json"]  # nothing of the zombie

    expected = spark_group_by(dfs[:5])
    assert state_dict(read_state(spark, state_root, 0)) == expected
    out = op.process(dfs[5], 5)  # the next batch
    expected = spark_group_by(dfs)
    check_output(out, expected, dfs[5])
    assert state_dict(read_state(spark, state_root, 0)) == expected
    assert JUNK_KEY not in expected
    op.close()


def test_a_zombie_that_wins_the_default_still_changes_nothing(spark, tmp_path):
    from pyspark_glue import read_state

    state_root, dfs, op = started(spark, tmp_path, range(100, 105))
    op.process(dfs[1], 1)
    zombie_provider, zombie = open_zombie(state_root, 2, op.commit_record(1)["commit_ids"][0])  # with batch 2
    op.process(dfs[2], 2)  # the live attempt commits version 3 ...
    zombie.commit()  # ... and so does the zombie, later: the same version, so the engine keeps both
    zombie_provider.close()
    live = op.commit_record(2)["commit_ids"][0]
    assert zombie.commit_id != live
    assert version_names(partition_dir(state_root, 0)).count("3.delta") == 2

    # Without the record a reader follows the default lineage, the zombie's (renamed last) ...
    assert store_rows(state_root, 0, 3)[JUNK_KEY] == (10**9, 10**9)
    # ... with it, the live attempt; read_state and the next batches follow the record.
    assert JUNK_KEY not in store_rows(state_root, 0, 3, commit_id=live)
    expected = spark_group_by(dfs[:3])
    assert state_dict(read_state(spark, state_root, 0)) == expected
    assert state_dict(read_state(spark, state_root, 0, version=3)) == expected
    assert state_dict(read_state(spark, state_root, 0, batch_id=2)) == expected
    out = op.process(dfs[3], 3)
    check_output(out, spark_group_by(dfs[:4]), dfs[3])
    op.process(dfs[4], 4)
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs)
    assert op.commit_record(3)["base_commit_ids"][0] == live
    op.close()


def test_a_re_executed_batch_equals_spark_group_by(spark, tmp_path):
    from pyspark_glue import read_state

    state_root, dfs, op = started(spark, tmp_path, range(200, 204))
    first_out = state_dict(op.process(dfs[1], 1))
    first = op.commit_record(1)
    again_out = state_dict(op.process(dfs[1], 1))  # foreachBatch re-run after a failure
    again = op.commit_record(1)
    assert op.last_progress["re_execution"] and again_out == first_out
    assert again["base_commit_ids"] == first["base_commit_ids"] == op.commit_record(0)["commit_ids"]
    assert set(again["commit_ids"]).isdisjoint(first["commit_ids"])  # new attempts, now the recorded ones
    for p in range(4):  # the attempts it replaced stay (of the same version: never deleted), unrecorded
        assert version_names(partition_dir(state_root, p)).count("2.delta") == 2
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:2])
    op.process(dfs[2], 2)
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:3])
    op.close()

    # A restart outside a streaming query (a new run, no query id to tell it by): it may run the
    # newest batch again, as Spark re-runs a batch it had not committed, not rewind past it.
    restarted = make_operator(state_root, coordinator=False)
    with pytest.raises(ValueError, match="would re-execute"):
        restarted.process(dfs[1], 1)
    assert restarted.commit_log().epochs() == [0, 1, 2]
    restarted.process(dfs[2], 2)
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:3])
    restarted.process(dfs[1], 1)  # its own records now: a rewind within its run, later records go
    assert restarted.commit_log().epochs() == [0, 1]
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:2])
    restarted.process(dfs[2], 2)
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:3])

    # A checkpoint written before records existed: the default lineage, then records again.
    winners = restarted.commit_record(2)["commit_ids"]
    shutil.rmtree(os.path.join(state_root, "0", "_commits"))
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs[:3])
    restarted.process(dfs[3], 3)
    assert restarted.commit_log().epochs() == [3]
    assert restarted.commit_record(3)["base_commit_ids"] == winners  # no other attempt: the default is right
    assert state_dict(read_state(spark, state_root, 0)) == spark_group_by(dfs)
    restarted.close()
