"""StatefulOperator on real Spark (local[2]): a streaming job over files with a stop and a
restart checked against Spark's own groupBy().agg(), exactly-once re-execution, an output
computed once, aborts, empty partitions, the fixed partition count. The Arrow/numpy helpers
and RunningAggregate without Spark: tests/engine/test_glue_operator_engine.py."""
import os
import time
import uuid

import numpy as np
import pytest

from statecore import StateStoreId, StateStoreProviderId
from statecore.errors import SchemaMismatchError

from pyspark_glue.operator_fn import OperatorFunction, TaskHandler

from tests.glue_support import (INPUT_DDL, KEY, VALUE, events, expected_state, make_operator, spark_group_by,
                                 state_dict, stream_files, write_parquet)
from tests.state_files import version_names


def delta_exists(root, partition, version, operator_id=0):
    return f"{version}.delta" in version_names(os.path.join(root, str(operator_id), str(partition)))


def test_hashing_keys_in_the_task_agrees_with_spark(spark):
    """routed_partitions on the Arrow rows Spark hands a task equals Spark's pmod(hash(keys), n)
    for every fixed-width key type, nulls included, one and several columns."""
    from pyspark_glue.operator_task import routed_partitions

    rng = np.random.default_rng(5)
    n = 400
    rows = []
    for i in range(n):
        null = rng.random(6) < 0.1
        rows.append((None if null[0] else int(rng.integers(-2**40, 2**40)),
                     None if null[1] else int(rng.integers(-2**31, 2**31)),
                     None if null[2] else bool(rng.integers(0, 2)),
                     None if null[3] else float(rng.choice([0.0, -0.0, float("nan"), 1.5, -3.25e10])),
                     None if null[4] else int(rng.integers(0, 40000)),
                     None if null[5] else int(rng.integers(-2**50, 2**50))))
    df = spark.createDataFrame(rows, "l long, i int, b boolean, d double, days int, us long").selectExpr(
        "l", "i", "cast(i % 30000 as short) as s", "cast(i % 100 as byte) as t", "b", "d", "cast(d as float) as f",
        "date_add(date'1970-01-01', days) as dt", "timestamp_micros(us) as ts")
    types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    for columns in (["l"], ["i"], ["s"], ["t"], ["b"], ["d"], ["f"], ["dt"], ["ts"], ["l", "d", "dt"],
                    ["b", "ts", "i", "f"]):
        expected = [r[0] for r in df.selectExpr(f"pmod(hash({', '.join(columns)}), 7)").collect()]
        table = df.toArrow()
        got = np.concatenate([routed_partitions(b, 7, columns, tuple(types[c] for c in columns))
                              for b in table.to_batches()])
        assert got.tolist() == expected, columns


def run_stream(spark, source, checkpoint, state_root, sink, wait_for_deactivation=False, op=None):
    """One run of the streaming query (one file per micro-batch) with ``op`` (default: a new
    operator), stopped and the operator closed once the files present are processed. Returns
    (run id, [(batch id, run id the operator used)], operator)."""
    op = make_operator(state_root) if op is None else op
    seen = []

    def handle(df, batch_id):
        out = op.process(df, batch_id)
        out.write.mode("overwrite").parquet(f"{sink}/batch={batch_id}")
        seen.append((batch_id, op.last_progress["query_run_id"]))

    query = stream_files(spark, INPUT_DDL, source, handle, checkpoint)
    run_id = uuid.UUID(query.runId)
    if wait_for_deactivation:
        provider_id = StateStoreProviderId(StateStoreId(state_root, 0, 0), run_id)
        deadline = time.monotonic() + 20
        while op.coordinator.get_location(provider_id) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert op.coordinator.get_location(provider_id) is None, "the stopped run's instances are still active"
    op.close()
    return run_id, seen, op


def test_stream_stop_restart_equals_spark_group_by(spark, tmp_path, monkeypatch):
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.listener import QueryProgressEvent

    from pyspark_glue import read_state

    # The operator's termination listener reads a query's end only: no progress event of its
    # batches is copied into Python (PySpark's own listener side does so for every batch).
    converted = []
    from_jobject = QueryProgressEvent.fromJObject.__func__
    monkeypatch.setattr(QueryProgressEvent, "fromJObject",
                        classmethod(lambda cls, jevent: converted.append(1) or from_jobject(cls, jevent)))

    source, state_root, sink = str(tmp_path / "in"), str(tmp_path / "state"), str(tmp_path / "sink")
    checkpoint = str(tmp_path / "checkpoint")
    tables = [events(seed, 400) for seed in range(3)]
    for i in range(2):
        write_parquet(source, f"events-{i}.parquet", tables[i])
    run1, seen1, _ = run_stream(spark, source, checkpoint, state_root, sink, wait_for_deactivation=True)
    assert [b for b, _ in seen1] == [0, 1]
    assert converted == []
    assert {r for _, r in seen1} == {str(run1)}  # the run id is the query's
    write_parquet(source, "events-2.parquet", tables[2])
    run2, seen2, _ = run_stream(spark, source, checkpoint, state_root, sink)  # a restart: new query and run
    assert [b for b, _ in seen2] == [2] and {r for _, r in seen2} == {str(run2)} and run2 != run1

    state = state_dict(read_state(spark, state_root, 0))
    spark_agg = (spark.read.schema(INPUT_DDL).parquet(source).groupBy("user", "region")
                 .agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum")))
    expected = {(r["user"], r["region"].encode()): (r["count"], r["sum"]) for r in spark_agg.collect()}
    assert state == expected == expected_state(tables)

    # The sink holds one row per key updated per batch; the newest row of each key is its state.
    sunk = spark.read.parquet(sink).toPandas().sort_values("batch")
    newest = sunk.groupby(["user", "region"]).last()
    assert {(u, bytes(r)): (int(row["count"]), int(row["sum"])) for (u, r), row in newest.iterrows()} == state
    assert sunk.groupby("batch").apply(lambda g: not g.duplicated(["user", "region"]).any(),
                                       include_groups=False).all()


def test_a_pickled_operator_continues_the_query_it_was_copied_from(spark, tmp_path):
    """As Spark Connect does at each query start (the foreachBatch function, the operator in it,
    unpickled afresh in the server's Python process): a query runs two batches, its operator
    goes through cloudpickle, the query restarts with the copy; the state and the output equal
    Spark's groupBy().agg() over every batch."""
    from pyspark import cloudpickle

    from pyspark_glue import read_state

    source, state_root, sink = str(tmp_path / "in"), str(tmp_path / "state"), str(tmp_path / "sink")
    checkpoint = str(tmp_path / "checkpoint")
    tables = [events(30 + seed, 400) for seed in range(4)]
    for i in range(2):
        write_parquet(source, f"events-{i}.parquet", tables[i])
    op = make_operator(state_root)
    _, seen1, _ = run_stream(spark, source, checkpoint, state_root, sink, op=op)
    assert [b for b, _ in seen1] == [0, 1]
    copy = cloudpickle.loads(cloudpickle.dumps(op))  # op is closed by now: the copy is as constructed
    assert copy is not op and copy.last_progress is None
    for i in range(2, 4):
        write_parquet(source, f"events-{i}.parquet", tables[i])
    _, seen2, _ = run_stream(spark, source, checkpoint, state_root, sink, op=copy)
    assert [b for b, _ in seen2] == [2, 3]
    assert not copy.last_progress["re_execution"] and copy.last_progress["committed_version"] == 4

    state = state_dict(read_state(spark, state_root, 0))
    inputs = [spark.read.schema(INPUT_DDL).parquet(os.path.join(source, f"events-{i}.parquet")) for i in range(4)]
    assert state == spark_group_by(inputs) == expected_state(tables)
    sunk = spark.read.parquet(sink).toPandas().sort_values("batch")
    newest = sunk.groupby(["user", "region"]).last()
    assert {(u, bytes(r)): (int(row["count"]), int(row["sum"])) for (u, r), row in newest.iterrows()} == state


def test_same_batch_twice_gives_same_state_and_output(spark, tmp_path):
    from pyspark_glue import read_state

    state_root = str(tmp_path / "state")
    tables = [events(10 + i, 300) for i in range(3)]
    dfs = [spark.createDataFrame(t.to_pandas(), INPUT_DDL) for t in tables]
    op = make_operator(state_root)
    op.process(dfs[0], 0)
    first = sorted(op.process(dfs[1], 1).collect())
    state_first = state_dict(read_state(spark, state_root, 0))
    assert not op.last_progress["re_execution"]

    again = sorted(op.process(dfs[1], 1).collect())  # foreachBatch re-run after a failure
    assert op.last_progress["re_execution"]
    assert again == first
    assert state_dict(read_state(spark, state_root, 0)) == state_first == expected_state(tables[:2])

    op.process(dfs[2], 2)  # the next batch builds on the re-executed version, from any worker
    assert state_dict(read_state(spark, state_root, 0)) == expected_state(tables)
    assert state_dict(read_state(spark, state_root, 0, version=2)) == state_first
    op.close()

    restarted = make_operator(state_root)  # a restart (new run id) re-running the last batch
    restarted.process(dfs[2], 2)
    assert restarted.last_progress["query_run_id"] != op.last_progress["query_run_id"]
    assert state_dict(read_state(spark, state_root, 0)) == expected_state(tables)
    restarted.close()


class CountingAggregate:
    """A RunningAggregate that counts its calls in files (the workers are other processes).
    Defined here on purpose: the operator must ship it by value."""

    def __init__(self, directory):
        from pyspark_glue import RunningAggregate

        self.inner = RunningAggregate(KEY, "amount")
        self.directory = directory

    def _count(self, what):
        with open(os.path.join(self.directory, what), "a") as f:
            f.write("x\n")

    def open(self, context):  # a plain fn's open: the inner aggregate's handler of this task
        self.task = self.inner.open(context)

    def __call__(self, store, batch):
        self._count("calls")
        return self.task.process(batch)

    def finish(self, store):
        self._count("finishes")
        return self.task.finish()


def count_lines(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.readlines())


def test_output_is_computed_once(spark, tmp_path):
    counters = tmp_path / "counters"
    counters.mkdir()
    op = make_operator(str(tmp_path / "state"), fn=CountingAggregate(str(counters)), coordinator=False)
    table = events(20, 500)
    out = op.process(spark.createDataFrame(table.to_pandas(), INPUT_DDL), 0)
    assert count_lines(counters / "finishes") == 4  # once per partition
    calls = count_lines(counters / "calls")
    assert calls >= 1
    rows = out.count()
    collected = out.collect()
    assert rows == len(collected) == len(expected_state([table])) == op.last_progress["rows_out"]
    assert count_lines(counters / "finishes") == 4 and count_lines(counters / "calls") == calls
    op.close()


def test_fn_gets_a_partition_s_arrow_batches_joined(spark, tmp_path):
    """With Spark sending 100-row Arrow batches, fn is called once per partition (its rows
    joined, under fn_batch_rows) by default, and once per Spark batch with None; the state
    and output are the same either way."""
    table = events(21, 2000)
    df = spark.createDataFrame(table.to_pandas(), INPUT_DDL)
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "100")
    try:
        calls = {}
        for name, rows in (("joined", 1 << 20), ("as_sent", None)):
            counters = tmp_path / name
            counters.mkdir()
            op = make_operator(str(tmp_path / f"state-{name}"), fn=CountingAggregate(str(counters)),
                               coordinator=False, fn_batch_rows=rows)
            out = op.process(df, 0)
            assert state_dict(out) == expected_state([table])
            calls[name] = count_lines(counters / "calls")
            op.close()
    finally:
        spark.conf.set(key, before)
    assert calls["joined"] == 4, f"fn was called {calls['joined']} times for 4 partitions"
    assert calls["as_sent"] >= 2000 // 100, calls


class NaturalTotals(OperatorFunction):
    """A running count and sum of ``amount`` per key written as docs/operator.md teaches a new
    fn: each batch reads its keys' values, adds the batch's rows, writes them back and emits
    the keys it updated. Defined here on purpose: the operator must ship it by value."""

    def open(self, context):
        return NaturalTotalsTask(self, context)


class NaturalTotalsTask(TaskHandler):
    def process(self, batch):
        from pyspark_glue import column_to_numpy, keys_from_arrow
        from pyspark_glue.aggregates import group_rows
        from pyspark_glue.arrow import column

        keys = keys_from_arrow(batch, KEY)
        if not len(keys):
            return None
        amounts = column_to_numpy(column(batch, "amount"), np.int64, "amount")
        order, starts = group_rows(keys)
        distinct = keys[order[starts]]
        old, found = self.store.get_batch(distinct)
        new = np.zeros(len(distinct), VALUE)
        new["count"] = np.where(found, old["count"], 0) + np.diff(np.append(starts, len(keys)))
        new["sum"] = np.where(found, old["sum"], 0) + np.add.reduceat(amounts[order], starts)
        self.store.put_batch(distinct, new)
        self.emit_latest(distinct, new)
        return None


@pytest.mark.spark
def test_a_natural_fn_emits_each_key_once_however_its_rows_are_batched(any_spark, tmp_path):
    """A new user's fn (read, add, write back, emit what it updated) with ``fn_batch_rows=None``
    and Spark sending 100-row Arrow batches, so each key's rows reach it in several batches:
    every updated key is emitted once per micro-batch, with its final totals, as with the
    batches joined. Under both kinds of session (the client calling ``process`` itself)."""
    tables = [events(41, 4000), events(42, 2000)]
    dfs = [any_spark.createDataFrame(t.to_pandas(), INPUT_DDL) for t in tables]
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = any_spark.conf.get(key)
    any_spark.conf.set(key, "100")
    try:
        for rows in (1 << 20, None):
            op = make_operator(str(tmp_path / f"state-{rows}"), fn=NaturalTotals(), coordinator=False,
                               fn_batch_rows=rows)
            for b, df in enumerate(dfs):
                emitted = [(r["user"], bytes(r["region"])) for r in op.process(df, b).collect()]
                assert len(emitted) == len(set(emitted)), \
                    f"fn_batch_rows={rows}, batch {b}: {len(emitted) - len(set(emitted))} keys emitted twice or more"
                everything = expected_state(tables[:b + 1])
                assert state_dict(op.output(b)) == {k: everything[k] for k in expected_state([tables[b]])}
            if rows is None:
                assert min(p["batches_in"] for p in op.last_progress["partitions"]) > 1, \
                    "each partition's rows must come in several batches for the test to mean anything"
            op.close()
    finally:
        any_spark.conf.set(key, before)


def test_output_left_unread_is_read_later_from_its_files(spark, tmp_path):
    op = make_operator(str(tmp_path / "state"))
    with pytest.raises(RuntimeError, match="processed no batch yet"):
        op.output(0)
    tables = [events(30 + i, 400) for i in range(2)]
    dfs = [spark.createDataFrame(t.to_pandas(), INPUT_DDL) for t in tables]
    assert op.process(dfs[0], 0, read_output=False) is None
    read_later = sorted(op.output(0).collect())
    assert len(read_later) == op.last_progress["rows_out"] == len(expected_state(tables[:1]))
    assert sorted(op.process(dfs[0], 0).collect()) == read_later  # the same batch, output read
    assert op.process(dfs[1], 1, read_output=False) is None
    second = sorted(op.output(1).collect())
    assert len(second) == op.last_progress["rows_out"] > 0
    assert sorted(op.process(dfs[1], 1).collect()) == second
    op.close()


class Exploding:
    """Updates the store, then fails: in every batch and at the end of every partition."""

    def __call__(self, store, batch):
        from pyspark_glue import keys_from_arrow

        keys = keys_from_arrow(batch, KEY)
        store.put_batch(keys, np.zeros(len(keys), [("count", "<i8"), ("sum", "<i8")]))
        raise RuntimeError("boom in fn")

    def finish(self, store):
        raise RuntimeError("boom in finish")


def test_failing_fn_aborts_the_store(spark, tmp_path):
    from pyspark_glue import read_state

    state_root = str(tmp_path / "state")
    table = events(30, 200)
    df = spark.createDataFrame(table.to_pandas(), INPUT_DDL)
    op = make_operator(state_root, fn=Exploding())
    with pytest.raises(Exception, match="boom in"):
        op.process(df, 0)
    op.close()
    assert not any(delta_exists(state_root, p, 1) for p in range(4))

    good = make_operator(state_root)  # the same batch again, now succeeding
    good.process(df, 0)
    assert all(delta_exists(state_root, p, 1) for p in range(4))
    assert state_dict(read_state(spark, state_root, 0)) == expected_state([table])
    good.close()


def test_an_output_write_that_fails_aborts_the_store_and_the_rerun_counts_once(spark, tmp_path):
    """The output is written before the store commits: a write that fails (here the output's
    name is taken by a directory) fails the task and aborts its store, the batch gets no
    record, and the batch run again gives the state and the output of one run."""
    from pyspark_glue import read_state

    state_root = str(tmp_path / "state")
    table = events(30, 200)
    df = spark.createDataFrame(table.to_pandas(), INPUT_DDL)
    op = make_operator(state_root)
    blocker = os.path.join(op.output_dir(0), "part-00000.parquet")
    os.makedirs(os.path.join(blocker, "taken"))
    with pytest.raises(Exception, match="part-00000.parquet"):
        op.process(df, 0)
    assert not delta_exists(state_root, 0, 1) and op.commit_record(0) is None
    os.rmdir(os.path.join(blocker, "taken"))
    os.rmdir(blocker)
    assert state_dict(op.process(df, 0)) == expected_state([table])  # the batch again
    assert state_dict(read_state(spark, state_root, 0)) == expected_state([table])
    assert all(delta_exists(state_root, p, 1) for p in range(4))
    op.close()


def test_empty_partitions_and_empty_batches_commit(spark, tmp_path):
    from pyspark_glue import read_state

    state_root = str(tmp_path / "state")
    op = make_operator(state_root, coordinator=False)
    one = spark.createDataFrame([(7, "eu", 5)], INPUT_DDL)
    out = op.process(one, 0)
    assert out.collect()[0].asDict() == {"user": 7, "region": b"eu", "count": 1, "sum": 5}
    assert sorted(p["rows_in"] for p in op.last_progress["partitions"]) == [0, 0, 0, 1]
    assert all(delta_exists(state_root, p, 1) for p in range(4))
    empty = spark.createDataFrame([], INPUT_DDL)
    assert op.process(empty, 1).count() == 0
    assert all(delta_exists(state_root, p, 2) for p in range(4))
    assert state_dict(read_state(spark, state_root, 0)) == {(7, b"eu"): (1, 5)}
    op.close()


def test_num_partitions_and_schemas_are_fixed_for_a_checkpoint(spark, tmp_path):
    from pyspark_glue import RunningAggregate, StatefulOperator

    state_root = str(tmp_path / "state")
    df = spark.createDataFrame([(1, "eu", 5)], INPUT_DDL)
    op = make_operator(state_root, num_partitions=2, coordinator=False)
    op.process(df, 0)
    op.close()
    with pytest.raises(ValueError, match=r"num_partitions=2.*num_partitions=3"):
        make_operator(state_root, num_partitions=3, coordinator=False).process(df, 1)
    agg = RunningAggregate(KEY, "amount", sum_dtype="<f8")
    other = StatefulOperator(state_root, 0, 2, ["user", "region"], KEY, agg.value_schema, agg,
                             agg.output_schema, coordinator=False)
    with pytest.raises(SchemaMismatchError, match="value schema"):
        other.process(df, 1)
    with pytest.raises(ValueError, match="key columns"):
        StatefulOperator(state_root, 0, 2, ["user"], KEY, agg.value_schema, agg, agg.output_schema,
                         coordinator=False).process(df, 1)
    with pytest.raises(ValueError, match="key column 'nope' is not in the DataFrame"):
        StatefulOperator(str(tmp_path / "other"), 0, 2, ["nope"], KEY, agg.value_schema, agg,
                         agg.output_schema, coordinator=False).process(df, 0)


def test_batches_are_aggregated_in_spark_and_session_settings_restored(spark, tmp_path):
    """RunningAggregate.prepare: one row per key reaches Python; the job's shuffle partitions
    and adaptive execution are the operator's during the job only, also when it fails."""
    from pyspark_glue import read_state

    state_root = str(tmp_path / "state")
    conf = spark.conf
    settings = ("spark.sql.shuffle.partitions", "spark.sql.adaptive.enabled")
    before = {key: conf.get(key) for key in settings}
    conf.set("spark.sql.adaptive.enabled", "true")  # would coalesce these small partitions
    try:
        op = make_operator(state_root, num_partitions=3, coordinator=False)
        tables = [events(11, 3000), events(12, 2000)]
        for batch_id, table in enumerate(tables):
            op.process(spark.createDataFrame(table.to_pandas()), batch_id)
            assert op.last_progress["rows_in"] == len(expected_state([table]))  # distinct keys, not rows
            assert {key: conf.get(key) for key in settings} == {**before, "spark.sql.adaptive.enabled": "true"}
        assert state_dict(read_state(spark, state_root, 0)) == expected_state(tables)
        op.close()
        with pytest.raises(Exception, match="column 'user' has 1 null"):
            bad = make_operator(str(tmp_path / "other"), num_partitions=3, coordinator=False)
            bad.process(spark.createDataFrame([(None, "eu", 1)], INPUT_DDL), 0)
        assert {key: conf.get(key) for key in settings} == {**before, "spark.sql.adaptive.enabled": "true"}
    finally:
        for key, value in before.items():
            conf.set(key, value)


@pytest.mark.parametrize("pre_aggregate", [True, False])
def test_float_keys_group_as_spark_groups_them(spark, tmp_path, pre_aggregate):
    """-0.0 and 0.0 are one key, and every NaN one key, as in Spark's groupBy: with Spark's
    pre-aggregation and without it (the task groups the raw rows itself)."""
    from pyspark.sql import functions as F

    from pyspark_glue import RunningAggregate, StatefulOperator, read_state

    key = np.dtype([("x", "<f8")])
    agg = RunningAggregate(key, "amount", pre_aggregate=pre_aggregate)
    op = StatefulOperator(str(tmp_path / "state"), 0, 3, ["x"], key, agg.value_schema, agg, agg.output_schema,
                          coordinator=False)
    nan_payload = float(np.frombuffer(np.uint64(0x7FF8000000000123).tobytes(), "<f8")[0])
    batches = [[(0.0, 1), (-0.0, 2), (float("nan"), 3), (1.5, 4)],
               [(-0.0, 10), (nan_payload, 20), (-float("nan"), 30), (0.0, 40)]]
    frames = [spark.createDataFrame(rows, "x double, amount long") for rows in batches]
    for batch_id, df in enumerate(frames):
        op.process(df, batch_id)
    op.close()

    def label(x):
        return "nan" if x != x else repr(x + 0.0)  # -0.0 + 0.0 is 0.0

    everything = frames[0].unionAll(frames[1])
    expected = {label(r["x"]): (r["count"], r["sum"])
                for r in everything.groupBy("x").agg(F.count("amount").alias("count"),
                                                     F.sum("amount").alias("sum")).collect()}
    got = {label(r["x"]): (r["count"], r["sum"]) for r in read_state(spark, str(tmp_path / "state"), 0).collect()}
    assert expected == {"0.0": (4, 53), "nan": (3, 53), "1.5": (1, 4)}
    assert got == expected


def test_auto_pre_aggregation_follows_the_batches_and_keeps_the_state_exact(spark, tmp_path):
    """RunningAggregate's default, on Spark: the tasks count the batch's rows and keys into
    ``fn_counts``; after a batch of distinct keys the next is shuffled raw, after a batch of
    repeated keys Spark aggregates again; the state equals Spark's groupBy over every batch."""
    from pyspark.sql import functions as F

    from pyspark_glue import RunningAggregate, StatefulOperator, read_state
    from pyspark_glue.aggregates import AUTO_MIN_ROWS

    key = np.dtype([("k", "<i8")])
    agg = RunningAggregate(key, "amount")
    op = StatefulOperator(str(tmp_path / "state"), 0, 2, ["k"], key, agg.value_schema, agg, agg.output_schema,
                          coordinator=False)
    n = AUTO_MIN_ROWS * 2
    distinct = spark.range(n).selectExpr("id as k", "id % 7 as amount")
    repeated = spark.range(n).selectExpr("id % 50 as k", "1 as amount")
    modes = []
    for batch_id, df in enumerate([distinct, distinct, repeated, repeated]):
        modes.append(agg.pre_aggregating)
        op.process(df, batch_id, read_output=False)
        counts = op.last_progress["fn_counts"]
        assert counts["input_rows"] == n
        if df is distinct:
            assert counts["keys"] == n
        else:  # raw rows are grouped per Arrow batch: a key may count once per batch of a task
            assert 50 <= counts["keys"] <= (50 if modes[-1] else 200)
    op.close()
    assert modes == [True, False, False, True]
    everything = distinct.unionAll(distinct).unionAll(repeated).unionAll(repeated)
    expected = {r["k"]: (r["count"], r["sum"]) for r in
                everything.groupBy("k").agg(F.count("amount").alias("count"), F.sum("amount").alias("sum")).collect()}
    got = {r["k"]: (r["count"], r["sum"]) for r in read_state(spark, str(tmp_path / "state"), 0).collect()}
    assert got == expected
