"""An operator and every kind of ``fn`` pickle by their configuration (cloudpickle, as PySpark
ships them): under Spark Connect the user's ``foreachBatch`` function is pickled on the client
and run in a Python process the server starts for each query, with the operator inside it
(docs/operator.md, "Pickling"). What belongs to a run (locks, the coordinator, the resolved
conf, ``last_progress``) does not travel: the copy is the operator as constructed. The copy
continuing a query's state on Spark: tests/spark/test_glue_restart.py."""
import datetime
import threading
import types
import uuid

import numpy as np
import pyarrow as pa
import pytest
from pyspark import cloudpickle

from statecore.schema import RowSchema, as_schema

from pyspark_glue import (Deduplicate, RunningAggregate, SessionWindow, StatefulOperator, StatefulProcessor,
                          WindowedAggregate)
from pyspark_glue.clocks import ManualClock
from pyspark_glue.operator_fn import CallableFunction, contract_of
from pyspark_glue.testing import Harness

KEY = np.dtype([("user", "<i8"), ("region", "S4")])
_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def round_trip(obj):
    return cloudpickle.loads(cloudpickle.dumps(obj))


def assert_same_configuration(copy, original, path="obj"):
    """``copy`` holds what ``original`` holds, attribute by attribute (a lock is no
    configuration: each copy has its own)."""
    assert type(copy) is type(original), path
    if isinstance(original, _LOCK_TYPES):
        assert copy is not original, path
    elif isinstance(original, RowSchema):
        assert (copy.describe(), copy.key) == (original.describe(), original.key), path
    elif isinstance(original, types.FunctionType):
        assert copy.__code__ == original.__code__, path
        for i, (c, o) in enumerate(zip(copy.__closure__ or (), original.__closure__ or ())):
            assert_same_configuration(c.cell_contents, o.cell_contents, f"{path}.<closure {i}>")
    elif isinstance(original, (list, tuple)):
        assert len(copy) == len(original), path
        for i, (c, o) in enumerate(zip(copy, original)):
            assert_same_configuration(c, o, f"{path}[{i}]")
    elif isinstance(original, dict):
        assert copy.keys() == original.keys(), path
        for name in original:
            assert_same_configuration(copy[name], original[name], f"{path}[{name!r}]")
    elif hasattr(original, "__dict__") and not isinstance(original, type):
        assert_same_configuration(vars(copy), vars(original), path)
    else:
        assert copy == original, path


class Clicks(StatefulProcessor):
    """A user's processor: clicks counted per user, the count emitted with each batch."""

    key_columns = ["user"]
    key_schema = np.dtype([("user", "<i8")])
    output_schema = "user long, clicks long"

    def __init__(self, label):
        self.label = label  # an instance attribute of the user's

    def init(self, state):
        self.count = state.value("count", [("n", "<i8")])

    def handle_input(self, groups, timers):
        old, found = self.count.get(groups.keys)
        new = np.zeros(len(groups), self.count.dtype)
        new["n"] = np.where(found, old["n"], 0) + groups.sizes
        self.count.put(groups.keys, new)
        return pa.RecordBatch.from_pydict({"user": groups.keys["user"], "clicks": new["n"]})


def sum_amounts(store, batch):
    """A plain ``fn(store, batch)``: the sum of ``amount`` per user, no output."""
    keys = np.zeros(batch.num_rows, np.dtype([("user", "<i8")]))
    keys["user"] = batch.column("user").to_numpy()
    old, found = store.get_batch(keys)
    new = np.zeros(len(keys), np.dtype([("total", "<i8")]))
    new["total"] = np.where(found, old["total"], 0) + batch.column("amount").to_numpy()
    store.put_batch(keys, new)


sum_amounts.key_columns = ["user"]

FN_KINDS = {
    "running_aggregate": lambda: RunningAggregate(KEY, "amount", key_columns=["user", "region"]),
    "deduplicate": lambda: Deduplicate(["user"], "ts", "10 seconds"),
    "windowed_aggregate": lambda: WindowedAggregate(["user"], "ts", "10 seconds", "10 seconds", "5 seconds",
                                                    {"n": ("count", "*"), "spent": ("sum", "amount")}),
    "session_window": lambda: SessionWindow(["user"], "ts", "10 seconds", "30 seconds",
                                            {"n": ("count", "*"), "top": ("max", "amount")}),
    "stateful_processor": lambda: Clicks("mine"),
    "plain_fn": lambda: contract_of(sum_amounts),
}


def clicks_batch(batch):
    """Rows of every column some fn kind reads: user, region, amount, ts. Each batch a minute
    after the last, some users new: every kind emits something in some batch after the first."""
    rng = np.random.default_rng(batch)
    start = datetime.datetime(2026, 1, 1) + datetime.timedelta(minutes=batch)
    return [{"user": int(u), "region": b"eu", "amount": int(a), "ts": start + datetime.timedelta(seconds=int(s))}
            for u, a, s in zip(rng.integers(0, 5, 30) + 3 * batch, rng.integers(0, 100, 30), rng.integers(0, 20, 30))]


def harness_for(fn):
    """A harness running ``fn`` given the schemas the operator would be given for it."""
    if isinstance(fn, CallableFunction):
        return Harness(fn.fn, key_schema=[("user", "<i8")], value_schema=[("total", "<i8")])
    if isinstance(fn, RunningAggregate):
        return Harness(fn, key_schema=KEY, value_schema=fn.value_schema)
    return Harness(fn)


def sorted_rows(table):
    return None if table is None else sorted(map(str, table.to_pylist()))


@pytest.mark.parametrize("kind", sorted(FN_KINDS))
def test_each_fn_kind_round_trips_with_its_configuration(kind):
    fn = FN_KINDS[kind]()
    assert_same_configuration(round_trip(fn), fn, kind)


@pytest.mark.parametrize("kind", sorted(FN_KINDS))
def test_a_copy_of_an_fn_resolved_by_its_first_batch_continues_the_state(kind):
    """After a batch resolved its schemas from the columns, the fn pickles resolved, and the
    copy (a query started again with it) gives the next batch the output of the original."""
    kept, copied = FN_KINDS[kind](), FN_KINDS[kind]()
    with harness_for(kept) as original, harness_for(copied) as restarted:
        for h in (original, restarted):
            h.run(clicks_batch(0), processing_time=0)
        copy = round_trip(copied)
        assert_same_configuration(copy, copied, kind)
        restarted.restart(fn=copy.fn if isinstance(copy, CallableFunction) else copy)
        emitted = 0
        for batch in (1, 2, 3):
            out = original.run(clicks_batch(batch))
            assert sorted_rows(restarted.run(clicks_batch(batch))) == sorted_rows(out)
            emitted += 0 if out is None else out.num_rows
        assert emitted or kind == "plain_fn"
        if kind == "plain_fn":
            assert sorted(map(tuple, restarted.rows()[1].tolist())) == sorted(map(tuple, original.rows()[1].tolist()))


def test_a_row_schema_pickles_as_its_dtype_and_key_flag():
    """A key schema's copy is a key schema: it normalizes -0.0 and NaNs as the original does."""
    key = RowSchema([("x", "<f8"), ("name", "S3"), ("flag", "?")], key=True)
    value = as_schema([("n", "<i8")], key=False)
    for schema in (key, value):
        copy = round_trip(schema)
        assert (copy, copy.key, copy.fingerprint) == (schema, schema.key, schema.fingerprint)
    copy = round_trip(key)
    assert copy.encode((-0.0, b"ab", True)) == key.encode((0.0, b"ab", True))
    assert copy.encode((float("nan"), b"", False)) == key.encode((-float("nan"), b"", False))


def test_a_manual_clock_pickles_at_its_time_and_moves_alone():
    clock = ManualClock(5_000)
    copy = round_trip(clock)
    assert copy.now_ms() == 5_000
    copy.advance("2 seconds")
    assert (copy.now_ms(), clock.now_ms()) == (7_000, 5_000)


def configured_operator(tmp_path, **kwargs):
    agg = RunningAggregate(KEY, "amount")
    arguments = dict(conf={"spark.sql.streaming.minBatchesToRetain": "7"}, store_name="counts", coordinator=False,
                     output_batches_to_retain=3, fn_batch_rows=1000, batch_id_offset=4, clock=ManualClock(123))
    arguments.update(kwargs)
    return StatefulOperator(str(tmp_path / "state"), 2, 3, ["user", "region"], KEY, agg.value_schema, agg,
                            agg.output_schema, **arguments)


def test_an_operator_pickles_its_configuration_and_nothing_of_a_run(tmp_path):
    run_id = uuid.uuid4()
    op = configured_operator(tmp_path, query_run_id=run_id)
    # what a run leaves on it: a resolved conf, progress, runs, the lock held by a batch
    op.conf, op.coordinator, op._resolved = object(), object(), True
    op.last_progress = {"batch_id": 9}
    op._runs[uuid.uuid4()] = [1, 9]
    op._recorded = {"format": 1}
    op._closed = True
    with op._lock:
        copy = round_trip(op)
    assert_same_configuration(copy._arguments, op._arguments, "arguments")
    for name in ("checkpoint_location", "operator_id", "num_partitions", "key_columns", "store_name",
                 "output_batches_to_retain", "fn_batch_rows", "batch_id_offset", "event_time", "delay_us",
                 "key_schema", "value_schema", "output_schema", "_own_run_id"):
        assert getattr(copy, name) == getattr(op, name), name
    assert copy.clock.now_ms() == 123 and copy._conf_arg == op._conf_arg
    assert (copy.last_progress, copy._runs, copy._recorded, copy._resolved, copy._closed) == (None, {}, None, False,
                                                                                                False)
    assert copy._lock.acquire(blocking=False)
    assert copy.operator_dir == op.operator_dir  # the same checkpoint


def test_an_operator_without_a_run_id_is_a_new_run_when_copied(tmp_path):
    op = configured_operator(tmp_path)
    assert round_trip(op)._own_run_id != op._own_run_id


def test_an_operator_with_an_fn_resolved_from_the_input_pickles_resolved(tmp_path):
    """A built-in given only column names: its key schema, resolved by the first batch, travels."""
    from pyspark.sql.types import LongType, StructField, StructType, TimestampType

    op = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=Deduplicate(["user"], "ts", "1 minute"),
                          coordinator=False)
    op._resolve_input(types.SimpleNamespace(schema=StructType([StructField("user", LongType()),
                                                                  StructField("ts", TimestampType())])))
    copy = round_trip(op)
    assert copy.key_schema == op.key_schema and copy.key_schema.names == ("user",)
    assert copy.key_schema.key


def test_an_operator_captured_in_a_foreachBatch_closure_pickles(tmp_path):
    """The user's case: ``foreachBatch(handle)`` where ``handle`` calls ``op.process``; Connect
    pickles ``handle`` with the operator it closes over."""
    op = configured_operator(tmp_path)
    sink = str(tmp_path / "sink")

    def handle(df, batch_id):
        op.process(df, batch_id).write.mode("append").parquet(sink)

    copy = round_trip(handle)
    captured = dict(zip(copy.__code__.co_freevars, (c.cell_contents for c in copy.__closure__)))
    assert captured["sink"] == sink
    assert isinstance(captured["op"], StatefulOperator) and captured["op"] is not op
    assert_same_configuration(captured["op"]._arguments, op._arguments, "op")
    bound = round_trip(op.process)  # foreachBatch(op.process): the bound method travels too
    assert bound.__self__.checkpoint_location == op.checkpoint_location


def test_an_attribute_neither_from_the_arguments_nor_per_run_refuses_to_pickle(tmp_path):
    op = configured_operator(tmp_path)
    op.cache_of_something = {}
    with pytest.raises(TypeError, match=r"\['cache_of_something'\].*classify"):
        cloudpickle.dumps(op)
