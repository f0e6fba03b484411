"""A StatefulOperator never loses state to batch ids that start over (docs/operator.md,
"Batch ids and new Spark checkpoints"), on real Spark (local[2]):

- a new streaming query over state imported by ``statecore import-spark`` (Spark's own
  aggregation checkpoint cannot restart without the aggregation) calls ``process(df, 0)``:
  refused, nothing deleted; with ``batch_id_offset`` it continues from the imported state;
- a query restarted from its own checkpoint re-executes its last batch as before;
- a first batch that fails (a key dtype that does not fit its column) records nothing, and
  the corrected re-run works."""
import json
import os

import numpy as np
import pytest

from glue_support import INPUT_DDL as EVENTS_DDL, KEY, events, expected_state, make_operator, state_dict, \
    write_parquet
from test_spark_import import INPUT_DDL, PARTITIONS, batch_table, import_cli, run_aggregation, statecore_rows
from tests.state_files import tree


def stream(spark, inputs, checkpoint, handle):
    """One run of a streaming query over the parquet files in ``inputs`` (one per batch) with
    ``handle`` as its foreachBatch, until they are processed; returns its exception or None."""
    from pyspark.errors import StreamingQueryException

    query = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(inputs)
             .writeStream.foreachBatch(handle).option("checkpointLocation", checkpoint).start())
    try:
        query.processAllAvailable()
        return None
    except StreamingQueryException as e:
        return e
    finally:
        query.stop()


def test_a_new_query_over_imported_state_is_refused_then_continues_with_an_offset(spark, tmp_path):
    """The issue's case: import-spark, then a new query's batch 0 would have deleted versions
    1..n. It is refused with an error naming the way on, nothing is deleted, and the same
    query with ``batch_id_offset`` continues from the imported state."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F
    from pyspark_glue import RunningAggregate, StatefulOperator

    tables = [batch_table(seed) for seed in range(3)]
    checkpoint, _ = run_aggregation(spark, str(tmp_path / "spark"), tables)
    target = str(tmp_path / "statecore")
    result = import_cli(checkpoint, target, "--operator", 0, "--value-names", "count,sum", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["versions"][1] == len(tables)
    last = len(tables)  # the imported versions end at the last batch's: batch last - 1
    imported = tree(target)
    key = np.dtype([tuple(f) for f in summary["key_schema"]])
    aggregate = RunningAggregate(key, "v")
    more = [batch_table(100 + k) for k in range(2)]
    inputs = str(tmp_path / "new-in")
    write_parquet(inputs, "part-0000.parquet", more[0])

    def operator(offset):
        return StatefulOperator(target, 0, PARTITIONS, ["i", "l", "s"], key, aggregate.value_schema, aggregate,
                                aggregate.output_schema, coordinator=False,
                                **({"batch_id_offset": offset} if offset else {}))

    op = operator(0)
    error = stream(spark, inputs, str(tmp_path / "new-ckpt"), lambda df, b: op.process(df, b))
    assert error is not None, "batch 0 of a new query over imported state ran"
    message = str(error)
    assert f"holds batches up to {last - 1}" in message and "import-spark" in message
    assert f"batch_id_offset={last}" in message
    assert tree(target) == imported  # nothing deleted, nothing written
    op.close()

    op = operator(last)
    write_parquet(inputs, "part-0001.parquet", more[1])
    assert stream(spark, inputs, str(tmp_path / "new-ckpt-2"), lambda df, b: op.process(df, b)) is None
    assert op.last_progress["batch_id"] == last + 1
    op.close()
    union = None
    for t in tables + more:
        df = spark.createDataFrame(t.to_pandas(), INPUT_DDL)
        union = df if union is None else DataFrame.unionByName(union, df)
    want = {(r.i, r.l, r.s.encode()): (r.n, r.total) for r in union.groupBy("i", "l", "s").agg(
        F.count(F.lit(1)).alias("n"), F.sum("v").alias("total")).collect()}
    got = statecore_rows(spark, target, last + 1)
    assert {k: v[:2] for k, v in got.items()} == want


def test_a_query_restarted_from_its_own_checkpoint_re_executes_its_last_batch(spark, tmp_path):
    """Spark restarts a query whose last batch was not committed in its checkpoint: the
    same query id re-runs that batch, which the operator re-executes as before."""
    from pyspark_glue import read_state

    state_root, inputs, checkpoint = str(tmp_path / "state"), str(tmp_path / "in"), str(tmp_path / "ckpt")
    tables = [events(seed, 200) for seed in range(2)]
    for i, t in enumerate(tables):
        write_parquet(inputs, f"events-{i}.parquet", t)
    seen = []

    def run():
        op = make_operator(state_root, coordinator=False)

        def handle(df, batch_id):
            op.process(df, batch_id)
            seen.append((batch_id, op.last_progress["re_execution"]))

        query = (spark.readStream.schema(EVENTS_DDL).option("maxFilesPerTrigger", 1).parquet(inputs)
                 .writeStream.foreachBatch(handle).option("checkpointLocation", checkpoint).start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()
        op.close()

    run()
    assert [b for b, _ in seen] == [0, 1]
    for name in ("1", ".1.crc"):  # batch 1 ran, but Spark did not commit it
        os.remove(os.path.join(checkpoint, "commits", name))
    run()
    assert [b for b, _ in seen] == [0, 1, 1]
    assert state_dict(read_state(spark, state_root, 0)) == expected_state(tables)


def test_a_failed_first_batch_records_nothing_and_the_corrected_rerun_works(spark, tmp_path):
    """A key dtype that does not fit its key column (bytes for a long): an error naming the
    column, its Spark type and the dtype, before anything runs; no operator metadata is
    recorded, so the corrected operator runs batch 0 on the same checkpoint."""
    from pyspark_glue import RunningAggregate, StatefulOperator

    state_root = str(tmp_path / "state")
    df = spark.createDataFrame(events(3, 100).to_pandas(), EVENTS_DDL)
    wrong = np.dtype([("user", "S8"), ("region", "S4")])
    agg = RunningAggregate(wrong, "amount")
    op = StatefulOperator(state_root, 0, 2, ["user", "region"], wrong, agg.value_schema, agg, agg.output_schema,
                          coordinator=False)
    with pytest.raises(ValueError, match=r"key column 'user' is bigint .* dtype \|S8"):
        op.process(df, 0)
    assert not os.path.exists(os.path.join(state_root, "0", "_operator.json"))
    fixed = make_operator(state_root, num_partitions=2, coordinator=False)
    fixed.process(df, 0)
    assert fixed.last_progress["state_keys"] == len(expected_state([events(3, 100)]))
    assert os.path.exists(os.path.join(state_root, "0", "_operator.json"))


class FailsInPartitionOne:
    """Puts each batch's keys with a value schema of its own, and fails at the end of
    partition 1 only: partition 0 commits version 1 (and its store's schema file)."""

    value_schema = np.dtype([("n", "<f8")])

    def __call__(self, store, batch):
        from pyspark_glue import keys_from_arrow

        keys = keys_from_arrow(batch, KEY)
        store.put_batch(keys, np.zeros(len(keys), self.value_schema))

    def finish(self, store):
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 1:
            raise RuntimeError("partition 1 fails before its commit")


def test_a_first_batch_failing_after_some_partitions_committed_leaves_no_schema_behind(spark, tmp_path):
    """Batch 0 of a first, mistaken operator (another value schema) fails in partition 1 after
    partition 0 committed: what its tasks wrote is deleted, so the corrected operator runs
    batch 0 on the same checkpoint instead of failing on partition 0's recorded schema."""
    from pyspark_glue import StatefulOperator, read_state

    state_root = str(tmp_path / "state")
    df = spark.createDataFrame(events(3, 100).to_pandas(), EVENTS_DDL)
    wrong = FailsInPartitionOne()
    op = StatefulOperator(state_root, 0, 2, ["user", "region"], KEY, wrong.value_schema, wrong, None,
                          coordinator=False)
    with pytest.raises(Exception, match="partition 1 fails before its commit"):
        op.process(df, 0, read_output=False)
    op.close()
    assert not os.path.exists(os.path.join(state_root, "0", "0"))  # partition 0's committed attempt is gone
    fixed = make_operator(state_root, num_partitions=2, coordinator=False)
    fixed.process(df, 0)
    assert state_dict(read_state(spark, state_root, 0)) == expected_state([events(3, 100)])
    fixed.close()
