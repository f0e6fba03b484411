"""The harness and a real StatefulOperator on Spark, given the same batches (and the same clock),
give the same output batch by batch and the same state in every store: for each built-in and
for the processors of tests/processor_support.py (the README's example among them). The
operator's output is read from the parquet files it materialized, so both sides compare as
Arrow rows; its state through read_state."""
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyspark_glue import (Deduplicate, RunningAggregate, SessionWindow, StatefulOperator, WindowedAggregate,
                          read_state)
from pyspark_glue.clocks import ManualClock
from pyspark_glue.testing import Harness
from tests.processor_support import KEY, Sessions, readme_module, sorted_rows

PARTITIONS = 2
EVENTS_DDL = "id long, user long, ts timestamp, amount long, page long, item long, qty long"
MINUTE_MS = 60_000


def events(rng, batch, n=30):
    """Ids (some repeated), users, event times 3 s a batch (some late), amounts, pages, items."""
    ts = 1_000_000 * (3 * batch + rng.uniform(-8, 2, n)) + 50_000_000
    return pa.table({"id": pa.array(rng.integers(0, 60, n), pa.int64()),
                     "user": pa.array(rng.integers(0, 8, n), pa.int64()),
                     "ts": pa.array(ts.astype(np.int64), pa.timestamp("us", "UTC")),
                     "amount": pa.array(rng.integers(-5, 100, n), pa.int64()),
                     "page": pa.array(rng.integers(0, 20, n), pa.int64()),
                     "item": pa.array(rng.integers(0, 4, n), pa.int64()),
                     "qty": pa.array(rng.integers(1, 3, n), pa.int64())})


def operator_output(operator, batch_id):
    """The output files the operator wrote for ``batch_id``, as one Arrow table (None: none)."""
    directory = operator.output_dir(batch_id)
    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else None


def state_rows(spark, root, store, key_dtype, value_dtype):
    columns = list(key_dtype.names) + list(value_dtype.names or ())
    return sorted(tuple(r[c] for c in columns) for r in read_state(spark, root, 0, store).collect())


def harness_rows(harness, store):
    keys, values = harness.rows(store)
    columns = [(keys, n) for n in keys.dtype.names] + [(values, n) for n in (values.dtype.names or ())]
    return sorted(zip(*[a[n].tolist() for a, n in columns])) if len(keys) else []


def run_both(spark, tmp_path, fn_factory, batches, clock_times=None, flush_ms=None, **args):
    """Every batch through a harness and an operator (both given ``args``); their outputs
    compared batch by batch, then every store's rows."""
    root = str(tmp_path / "state")
    op_clock, h_clock = (ManualClock(0), ManualClock(0)) if clock_times else (None, None)
    operator = StatefulOperator(root, 0, PARTITIONS, fn=fn_factory(), clock=op_clock, coordinator=False, **args)
    outputs = 0
    try:
        with Harness(fn_factory(), num_partitions=PARTITIONS, clock=h_clock, **args) as harness:
            for b, rows in enumerate(batches):
                if clock_times:
                    op_clock.set(clock_times[b])
                    h_clock.set(clock_times[b])
                advance = flush_ms if (flush_ms is not None and rows.num_rows == 0) else None
                operator.process(spark.createDataFrame(rows.to_pandas(), EVENTS_DDL), b, advance_watermark_to=advance,
                                 read_output=False)
                ours = harness.run(rows, advance_watermark_to=advance)
                theirs = operator_output(operator, b)
                assert sorted_rows(ours) == sorted_rows(theirs if theirs is not None else []), f"batch {b}"
                assert harness.last_progress["late_rows"] == operator.last_progress.get("late_rows", 0)
                outputs += ours.num_rows
            for store, (key, value) in harness._store_schemas().items():
                assert harness_rows(harness, store) == state_rows(spark, root, store, key, value), store
    finally:
        operator.close()
    return outputs


def batches_of(seed, count, empty=0):
    rng = np.random.default_rng(seed)
    tables = [events(rng, b) for b in range(count)]
    return tables + [tables[0].slice(0, 0)] * empty


AGGREGATE = RunningAggregate(KEY, "amount")
BUILT_INS = {  # name -> (fn, the operator's arguments it needs)
    "running_aggregate": (lambda: RunningAggregate(KEY, "amount"), dict(
        key_columns=["user"], key_schema=KEY, value_schema=AGGREGATE.value_schema,
        output_schema=AGGREGATE.output_schema)),
    "deduplicate": (lambda: Deduplicate(["id"], "ts", "4 seconds"), {}),
    "windows": (lambda: WindowedAggregate(["user"], "ts", "4 seconds", "6 seconds", "2 seconds",
                                          aggregates={"n": ("count", "*"), "spent": ("sum", "amount")}), {}),
    "sessions": (lambda: SessionWindow(["user"], "ts", "4 seconds", "3 seconds",
                                       aggregates={"n": ("count", "*"), "spent": ("sum", "amount")}), {}),
}


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_a_built_in_gives_the_operators_output_and_state(spark, tmp_path, name):
    fn, args = BUILT_INS[name]
    flush = None if name == "running_aggregate" else 200_000  # the end of a bounded run: windows close
    out = run_both(spark, tmp_path, fn, batches_of(11, 4, empty=1), flush_ms=flush, **args)
    assert out > 0


def test_an_event_time_processor_gives_the_operators_output_and_state(spark, tmp_path):
    out = run_both(spark, tmp_path, Sessions, batches_of(12, 6, empty=1), flush_ms=200_000)
    assert out > 3, "sessions must end for the test to mean anything"


def test_the_readme_processor_under_a_set_clock_gives_the_operators_output_and_state(spark, tmp_path):
    """Processing time from the same ManualClock on both sides: reminders fire and cart items
    end at the same batches."""
    times = [0, 10 * MINUTE_MS, 35 * MINUTE_MS, 60 * MINUTE_MS, 61 * MINUTE_MS, 2 * 60 * MINUTE_MS]
    with readme_module(tmp_path) as module:
        out = run_both(spark, tmp_path, module.Carts, batches_of(13, 3, empty=3), clock_times=times)
    assert out > 3, "reminders must fire for the test to mean anything"


def test_a_re_executed_batch_keeps_the_processing_time_of_its_record(spark, tmp_path):
    """Batch 1 run again after the clock moved past a reminder's time: it takes the recorded
    time, so the reminder does not fire in it (Spark replays a batch's timestamp too)."""
    with readme_module(tmp_path) as module:
        clock = ManualClock(0)
        operator = StatefulOperator(str(tmp_path / "state"), 0, 1, fn=module.Carts(), clock=clock,
                                    coordinator=False)
        try:
            df = spark.createDataFrame([(1, 7, 2)], "user long, item long, qty long")
            operator.process(df, 0)
            clock.set(10 * MINUTE_MS)
            assert operator.process(df.limit(0), 1).count() == 0
            assert operator.commit_record(1)["batch_timestamp_ms"] == 10 * MINUTE_MS
            clock.set(45 * MINUTE_MS)  # past the reminder (30 min)
            assert operator.process(df.limit(0), 1).count() == 0, "the re-execution took a new time"
            assert operator.last_progress["re_execution"]
            assert operator.commit_record(1)["batch_timestamp_ms"] == 10 * MINUTE_MS
            assert operator.process(df.limit(0), 2).collect()[0]["user"] == 1  # the next batch takes 45 min
        finally:
            operator.close()


def test_an_input_spark_knows_is_empty_still_runs_every_partition(spark, tmp_path):
    """A bounded run flushed with an empty DataFrame: ``createDataFrame([])``, and ``limit(0)``,
    for which Spark plans no task at all (it knows the input empty); every partition must
    still run, to fire its timers and commit."""
    operator = StatefulOperator(str(tmp_path / "state"), 0, PARTITIONS, fn=Sessions(), coordinator=False)
    try:
        operator.process(spark.createDataFrame(batches_of(14, 1)[0].to_pandas(), EVENTS_DDL), 0, read_output=False)
        out = operator.process(spark.createDataFrame([], EVENTS_DDL), 1, advance_watermark_to=200_000)
        assert out.count() > 0, "the flush ended no session"
        assert [p["partition_id"] for p in operator.last_progress["partitions"]] == list(range(PARTITIONS))
        assert operator.process(spark.createDataFrame([], EVENTS_DDL).limit(0), 2).count() == 0
    finally:
        operator.close()


DDL = ["user long, clicks long", "a int,b string, `c d` double", "x decimal(10, 2), y timestamp, z TIMESTAMP_NTZ",
       "k: bigint, v: binary", "n date, f float, t tinyint, s smallint, b boolean, r real, i integer"]


@pytest.mark.parametrize("text", DDL)
def test_an_output_ddl_of_simple_columns_reads_as_sparks_own_parser_reads_it(spark, text):
    """The harness reads an output schema's DDL without a JVM: it must read what Spark does."""
    from pyspark.sql.types import StructType

    from pyspark_glue.arrow import parse_simple_ddl

    assert parse_simple_ddl(text) == StructType.fromDDL(text)
