"""StatefulOperator's pieces without Spark: the Arrow/numpy helpers, RunningAggregate, the
task's partition checks, the joining of fn's batches, the job's settings, which query may
re-execute recorded batches, and the termination callback. The streaming jobs on real Spark
are tests/spark/test_glue_operator.py's."""
import uuid

import numpy as np
import pyarrow as pa
import pytest

from statecore import StateStoreConf, StateStoreId, create_and_init_provider

from pyspark_glue.operator_fn import PartitionContext

from tests.glue_support import KEY, events, expected_state


def test_keys_from_arrow_strings_and_casts():
    from pyspark_glue import column_to_numpy, keys_from_arrow

    batch = pa.RecordBatch.from_pydict({"user": pa.array([3, 1], pa.int32()),
                                        "region": pa.array(["", "abcd"]).slice(0, 2)})
    keys = keys_from_arrow(batch, KEY)
    assert keys.dtype == KEY and keys.tolist() == [(3, b""), (1, b"abcd")]
    sliced = pa.array(["zz", "ab", "c", "def"]).slice(1, 2)
    assert column_to_numpy(sliced, np.dtype("S2"), "s").tolist() == [b"ab", b"c"]
    with pytest.raises(ValueError, match="column 'region' holds a 5-byte value"):
        keys_from_arrow(pa.RecordBatch.from_pydict({"user": [1], "region": ["abcde"]}), KEY)
    with pytest.raises(ValueError, match="column 'user' has 1 null"):
        keys_from_arrow(pa.RecordBatch.from_pydict({"user": [None, 1], "region": ["a", "b"]}), KEY)
    with pytest.raises(ValueError, match="column 'x'.*uint8"):
        column_to_numpy(pa.array([300]), np.dtype("u1"), "x")
    with pytest.raises(TypeError, match="column 'r' is string"):
        column_to_numpy(pa.array(["7"]), np.dtype("<i8"), "r")
    with pytest.raises(KeyError, match="column 'nope'"):
        keys_from_arrow(batch, np.dtype([("nope", "<i8")]))


def test_to_record_batch_round_trip_with_unsigned_and_bytes():
    from pyspark_glue import columns_from_arrow, to_record_batch

    rows = np.zeros(3, [("a", "u1"), ("b", "<u2"), ("c", "<u4"), ("d", "<u8"), ("s", "S3"), ("f", "?")])
    rows["a"], rows["b"], rows["c"] = [0, 255, 1], [0, 65535, 2], [0, 2**32 - 1, 3]
    rows["d"], rows["s"], rows["f"] = [0, 2**64 - 1, 4], [b"", b"abc", b"a\0b"], [True, False, True]
    batch = to_record_batch(rows, partition_id=7)
    assert [str(t) for t in batch.schema.types] == ["int16", "int32", "int64", "decimal128(20, 0)", "binary",
                                                    "bool", "int32"]
    assert batch.column(4).to_pylist() == [b"", b"abc", b"a\0b"]
    assert batch.column(6).to_pylist() == [7, 7, 7]
    back = columns_from_arrow(batch, rows.dtype)
    assert back.tolist() == rows.tolist()


def test_running_aggregate_groups_within_and_across_batches(tmp_path):
    from pyspark_glue import RunningAggregate

    agg = RunningAggregate(KEY, "amount")
    provider = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), KEY, agg.value_schema, StateStoreConf())
    first = events(1, 500)
    second = events(2, 300)
    store = provider.get_store(0)
    task = agg.open(PartitionContext(0, 0, {"default": store}, "default", None))
    assert task.process(first.to_batches()[0]) is None
    assert task.process(second.to_batches()[0]) is None
    out = task.finish()
    store.commit()
    emitted = {(u, r): (c, s) for u, r, c, s in zip(*(out.column(i).to_pylist() for i in range(4)))}
    assert emitted == expected_state([first, second])  # each key once, with its final totals
    provider.close()


def partial_batch(table):
    """What RunningAggregate.prepare gives a task: one row per (user, region) with count and sum."""
    from pyspark_glue.aggregates import PARTIAL_COUNT, PARTIAL_SUM

    totals = expected_state([table])
    keys = sorted(totals)
    return pa.RecordBatch.from_pydict({
        "user": pa.array([k[0] for k in keys], pa.int64()), "region": pa.array([k[1] for k in keys], pa.binary()),
        PARTIAL_COUNT: pa.array([totals[k][0] for k in keys], pa.int64()),
        PARTIAL_SUM: pa.array([totals[k][1] for k in keys], pa.int64())})


def test_running_aggregate_merges_partial_aggregates_like_raw_rows(tmp_path):
    from pyspark_glue import RunningAggregate

    agg = RunningAggregate(KEY, "amount")
    provider = create_and_init_provider(StateStoreId(str(tmp_path), 0, 0), KEY, agg.value_schema, StateStoreConf())
    store = provider.get_store(0)
    agg.open(PartitionContext(0, 0, {"default": store}, "default", None)).process(
        events(1, 500).to_batches()[0])  # an earlier batch, as raw rows
    store.commit()
    store = provider.get_store(1)
    second, third = events(2, 300, users=20), events(3, 200, users=30)  # disjoint users: each key in one batch
    third = third.set_column(0, "user", pa.compute.add(third.column("user"), 1000))
    task = agg.open(PartitionContext(0, 1, {"default": store}, "default", None))
    task.process(partial_batch(second))
    task.process(partial_batch(third))
    out = task.finish()
    store.commit()
    emitted = {(u, r): (c, s) for u, r, c, s in zip(*(out.column(i).to_pylist() for i in range(4)))}
    everything = expected_state([events(1, 500), second, third])
    assert emitted == {k: everything[k] for k in expected_state([second, third])}
    keys = np.array(sorted(everything), dtype=KEY)
    values, found = provider.get_read_store(2).get_batch(keys)
    assert found.all()
    assert dict(zip(keys.tolist(), values.tolist())) == everything
    provider.close()


def test_running_aggregate_auto_drops_and_takes_up_spark_s_aggregation():
    """pre_aggregate="auto": off after a batch of mostly distinct keys, on again after one of
    many rows per key, unchanged in between or on small batches; True and False stay."""
    from pyspark_glue import RunningAggregate
    from pyspark_glue.aggregates import AUTO_MIN_ROWS

    def after(agg, rows, keys):
        agg.observe({"fn_counts": {"input_rows": rows, "keys": keys}})
        return agg.pre_aggregating

    agg = RunningAggregate(KEY, "amount")
    assert agg.pre_aggregate == "auto" and agg.pre_aggregating
    assert after(agg, AUTO_MIN_ROWS - 1, AUTO_MIN_ROWS - 1)  # too small to tell
    assert after(agg, 100_000, 40_000)  # 0.4 keys a row: between the two thresholds
    assert not after(agg, 1_000_000, 632_000)  # most keys once: off
    assert not after(agg, 100_000, 40_000)
    assert after(agg, 1_000_000, 100_000)  # ten rows a key: on again
    assert after(RunningAggregate(KEY, "amount", pre_aggregate=True), 10**6, 10**6)
    assert not after(RunningAggregate(KEY, "amount", pre_aggregate=False), 10**6, 10)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        RunningAggregate(KEY, "amount", pre_aggregate="yes")


def test_rows_of_another_partition_fail_the_task_before_fn():
    from pyspark_glue.operator_task import PARTITION_COLUMN, checked_partition

    batch = pa.RecordBatch.from_pydict({"user": [1, 2], PARTITION_COLUMN: pa.array([3, 3], pa.int32())})
    assert checked_partition(batch, 3).schema.names == ["user"]
    empty = batch.slice(0, 0)
    assert checked_partition(empty, 0).num_rows == 0
    wrong = pa.RecordBatch.from_pydict({"user": [1, 2], PARTITION_COLUMN: pa.array([3, 1], pa.int32())})
    with pytest.raises(RuntimeError, match="rows of state partition 1 reached the task of partition 3"):
        checked_partition(wrong, 3)
    with pytest.raises(RuntimeError, match=f"column {PARTITION_COLUMN} is missing"):
        checked_partition(pa.RecordBatch.from_pydict({"user": [1]}), 0)


def test_the_task_checks_fixed_width_keys_by_hashing_them():
    """Keys of fixed-width types carry no partition column: the task hashes them as Spark
    does and refuses a row of another partition, naming it."""
    from pyspark_glue.operator_task import checked_partition, routed_partitions

    batch = pa.RecordBatch.from_pydict({"user": pa.array(np.arange(40), pa.int64())})
    routing = (4, ("user",), ("bigint",))
    parts = routed_partitions(batch, *routing)
    mine = batch.filter(pa.array(parts == 2))
    assert 0 < mine.num_rows < 40
    assert checked_partition(mine, 2, routing).equals(mine)
    with pytest.raises(RuntimeError, match="reached the task of partition 2"):
        checked_partition(batch, 2, routing)


def test_joined_batches_keep_the_rows_in_order_within_both_limits():
    """fn's batches: consecutive Arrow batches joined up to the row and byte limits (a batch
    past a limit alone passes alone), the same rows in the same order; None joins nothing."""
    from pyspark_glue.arrow import joined_batches

    rng = np.random.default_rng(7)
    sizes = [0, 3, 40, 1, 0, 25, 100, 7, 7, 7]
    start = np.cumsum([0] + sizes)
    batches = [pa.RecordBatch.from_pydict({"k": pa.array(np.arange(a, b), pa.int64()),
                                           "s": pa.array([f"r{i}" for i in range(a, b)], pa.string())})
               for a, b in zip(start[:-1], start[1:])]
    rows = lambda bs: [r for b in bs for r in b.column("k").to_pylist()]  # noqa: E731
    assert list(joined_batches(iter(batches), None, 1 << 30)) == batches
    for max_rows in (1, 10, 30, 64, 1000):
        out = list(joined_batches(iter(batches), max_rows, 1 << 30))
        assert rows(out) == list(range(start[-1]))
        assert all(b.num_rows <= max_rows or b in batches for b in out)  # only a batch past it alone
        assert all(b.schema == batches[0].schema for b in out)
    assert [b.num_rows for b in joined_batches(iter(batches), 64, 1 << 30)] == [44, 25, 100, 21]
    one_row_bytes = batches[3].nbytes
    by_bytes = list(joined_batches(iter(batches), 1000, 10 * one_row_bytes))
    assert rows(by_bytes) == list(range(start[-1])) and len(by_bytes) > 4
    assert all(b.nbytes <= 10 * one_row_bytes or b in batches for b in by_bytes)
    assert list(joined_batches(iter([]), 10, 100)) == []
    shuffled = [batches[i] for i in rng.permutation(len(batches))]
    assert rows(joined_batches(iter(shuffled), 50, 1 << 30)) == rows(shuffled)


def test_job_settings_change_only_what_differs_and_restore_it():
    from pyspark_glue.operator import _job_settings

    class Conf:  # a session's RuntimeConfig: every call below would be a py4j round trip
        def __init__(self, values):
            self.values, self.calls = dict(values), []

        def get(self, key, default):
            return self.values.get(key, default)

        def set(self, key, value):
            self.calls.append(("set", key, value))
            self.values[key] = value

        def unset(self, key):
            self.calls.append(("unset", key))
            del self.values[key]

    class Session:
        def __init__(self, conf):
            self.conf = conf

    conf = Conf({"a": "2", "b": "true"})
    with _job_settings(Session(conf), {"a": "2", "b": "false", "c": "x"}):
        assert conf.values == {"a": "2", "b": "false", "c": "x"}
    assert conf.values == {"a": "2", "b": "true"}
    assert conf.calls == [("set", "b", "false"), ("set", "c", "x"), ("set", "b", "true"), ("unset", "c")]
    conf.calls.clear()
    with pytest.raises(RuntimeError):
        with _job_settings(Session(conf), {"a": "2"}):
            raise RuntimeError("the job failed")
    assert conf.calls == [] and conf.values == {"a": "2", "b": "true"}


def test_which_query_may_re_execute_the_recorded_batches(tmp_path):
    """Batch ids at or below the newest record (batch 4) re-execute only for the query that
    wrote it: a new query (another id), or any query over import-spark's or repartition's
    records, is refused with the way on. A record that names no query (outside a streaming
    query, under Spark Connect, or from before records named their query) lets its own run
    re-execute any batch; a later run may re-execute the newest batch alone (a restart) where
    either record or run names no query."""
    import uuid

    from pyspark_glue import RunningAggregate, StatefulOperator
    from statecore import operator_files

    root = str(tmp_path)
    agg = RunningAggregate(KEY, "amount")
    op = StatefulOperator(root, 0, 1, ["user", "region"], KEY, agg.value_schema, agg, agg.output_schema,
                          coordinator=False)
    log = op.commit_log()
    run, other = uuid.UUID(int=1), uuid.UUID(int=2)

    def record(batch_id, **fields):
        entry = operator_files.commit_record(batch_id, 1, "default", run, ["ab" * 8], ["cd" * 8])
        entry.update(fields)
        for key in [k for k, v in fields.items() if v is _DROP]:
            del entry[key]
        log.write(batch_id, entry)

    def refuse(batch_id, query_id, run_id):
        op._refuse_starting_over(batch_id, log.epochs(), query_id, run_id)

    for b in range(5):
        record(b, query_id="q1")
    refuse(5, "q2", other)  # after the records: any query continues
    refuse(2, "q1", other)  # the same query restarted from its checkpoint
    with pytest.raises(ValueError, match=r"holds batches up to 4 written by query q1.*batch_id_offset=5"):
        refuse(0, "q2", other)
    refuse(4, None, other)  # restarted under Spark Connect: the newest batch again, no query id to tell
    with pytest.raises(ValueError, match=r"query q1.*batch_id_offset=4"):
        refuse(1, None, run)

    for writer in (operator_files.WRITER_IMPORT_SPARK, operator_files.WRITER_REPARTITION):
        record(4, query_id=None, writer=writer)
        for query_id, run_id in (("q2", other), (None, other), (None, run)):
            with pytest.raises(ValueError, match=f"statecore {writer}.*batch_id_offset=5"):
                refuse(0, query_id, run_id)
            with pytest.raises(ValueError, match="batch_id_offset=1"):
                refuse(4, query_id, run_id)

    # Written by run `run` with no query id: outside a streaming query, or under Spark Connect.
    record(4, query_id=None)
    refuse(2, None, run)  # its own run re-executes any batch
    refuse(4, None, other)  # a restart re-runs the newest batch, under Connect or classic
    refuse(4, "q2", other)
    for query_id in (None, "q2"):
        with pytest.raises(ValueError, match=r"written by run 00000000-0000-0000-0000-000000000001 \(outside a "
                                             r"streaming query, or under Spark Connect\).*batch_id_offset=5"):
            refuse(0, query_id, other)  # a new Spark checkpoint over it, batch ids from 0 again

    record(4, query_id=_DROP, writer=_DROP)  # written before records named their query or writer
    refuse(4, "q2", other)
    with pytest.raises(ValueError, match="batch_id_offset=2"):
        refuse(3, "q2", other)
    with pytest.raises(ValueError, match="batch_id_offset must be an int >= 0"):
        StatefulOperator(root, 0, 1, ["user", "region"], KEY, agg.value_schema, agg, agg.output_schema,
                         coordinator=False, batch_id_offset=-1)


_DROP = object()  # a record field left out


def test_the_termination_callback_reports_the_run_id_and_never_raises(caplog):
    from py4j.protocol import Py4JError

    from pyspark_glue.query_runs import _report_termination
    from pyspark_glue.spark_internals import _TerminationCallback

    class Event:  # the JVM's QueryTerminatedEvent, as py4j shows it
        def __init__(self, run_id):
            self._run_id = run_id

        def runId(self):  # a java.util.UUID
            if self._run_id is None:
                raise Py4JError("the gateway is gone")
            return type("JavaUUID", (), {"toString": lambda _: str(self._run_id)})()

    run = uuid.uuid4()
    ended = []

    def reporting(on_terminated):
        return lambda run_id: _report_termination(on_terminated, run_id)

    callback = _TerminationCallback(reporting(ended.append))
    callback.onQueryProgress(object())  # other events are not read at all
    callback.onQueryTerminated(Event(run))
    assert ended == [run]

    def failing(run_id):
        raise ValueError("coordinator unreachable")

    with caplog.at_level("WARNING"):
        _TerminationCallback(reporting(failing)).onQueryTerminated(Event(run))
        _TerminationCallback(reporting(ended.append)).onQueryTerminated(Event(None))
    assert ended == [run]
    assert [r.getMessage() for r in caplog.records] == [
        f"handling the termination of query run {run} failed: coordinator unreachable",
        "could not read the run id of a terminated query (its state store instances stay active until the next "
        "run or close()): the gateway is gone"]


def test_a_session_whose_settings_cannot_be_read_is_logged_not_dropped_silently(tmp_path, caplog):
    """The operator takes its store settings from the session; when PySpark cannot hand them
    over (a version without ``conf.getAll``), the operator says so and runs on the defaults."""
    import types

    from pyspark_glue import RunningAggregate, StatefulOperator

    agg = RunningAggregate(KEY, "amount")
    op = StatefulOperator(str(tmp_path), 0, 1, ["user", "region"], KEY, agg.value_schema, agg, agg.output_schema,
                          coordinator=False)
    with caplog.at_level("WARNING"):
        op._resolve(types.SimpleNamespace(conf=object()))  # a session whose conf has no getAll
    assert op.conf == StateStoreConf()
    assert any("cannot read the session's SQL settings" in r.getMessage()
               and "statecore's defaults are" in r.getMessage() for r in caplog.records), caplog.records
