"""The function's contract (pyspark_glue/operator_fn.py) without Spark: tasks of one fn keep
their state in their handlers, never on the fn; a plain callable is read through the same
contract; the task's status row comes from one dataclass."""
import pickle

import numpy as np
import pyarrow as pa
import pytest

from pyspark_glue import OperatorFunction, RunningAggregate, TaskHandler
from pyspark_glue.event_time import Watermarks
from pyspark_glue.operator_fn import CallableFunction, FunctionSettings, PartitionContext, contract_of
from pyspark_glue.task_status import TaskStatus

from tests.glue_support import KEY, events, expected_state
from tests.processor_support import Sessions
from tests.store_support import Partition


def emitted(out):
    """{(user, region): (count, sum)} of a RunningAggregate's output batch."""
    return {(u, r): (c, s) for u, r, c, s in zip(*(out.column(i).to_pylist() for i in range(4)))}


def test_two_tasks_of_one_aggregate_open_at_once_keep_their_own_keys(tmp_path):
    """A worker running two partitions' tasks of the same RunningAggregate object at once (their
    batches interleaved): each task emits exactly its own partition's keys and totals, and the
    shared aggregate is left as it was built (nothing of either task on it)."""
    agg = RunningAggregate(KEY, "amount")
    tables = {p: [events(10 * p + i, 300, users=20 + p) for i in range(3)] for p in (0, 1)}
    partitions = {p: Partition(tmp_path / f"p{p}", {"default": (KEY, agg.value_schema)}) for p in (0, 1)}
    stores = {p: partitions[p].open() for p in (0, 1)}
    tasks = {p: agg.open(PartitionContext(p, 0, stores[p], "default", None)) for p in (0, 1)}
    for i in range(3):
        for p in (1, 0):
            assert tasks[p].process(tables[p][i].to_batches()[0]) is None
    outputs = {p: tasks[p].finish() for p in (0, 1)}
    for p in (0, 1):
        partitions[p].commit(stores[p])
        assert emitted(outputs[p]) == expected_state(tables[p]), f"partition {p}"
        assert tasks[p].context.counts["input_rows"] == 900, "each task counts its own rows"
    assert pickle.dumps(agg) == pickle.dumps(RunningAggregate(KEY, "amount")), "a task left something on the fn"


def click_rows(rng, n, users):
    return pa.RecordBatch.from_pydict({
        "user": pa.array(rng.integers(0, users, n), pa.int64()),
        "ts": pa.array(rng.integers(1_000_000, 9_000_000, n), pa.timestamp("us", "UTC")),
        "page": pa.array(rng.integers(0, 5, n), pa.int64())})


def test_two_tasks_of_one_processor_open_at_once_keep_their_own_rows(tmp_path):
    """Two partitions' tasks of one StatefulProcessor object open at once, their rows
    interleaved: each handler runs the handlers on its own copy of the processor, bound to
    its own stores, and the processor given to the operator is never bound (it pickles as
    a fresh one does)."""
    processor = Sessions()
    schemas = dict(processor.state_stores, default=(processor.key_schema, processor.value_schema))
    partitions = {p: Partition(tmp_path / f"p{p}", schemas) for p in (0, 1)}
    stores = {p: partitions[p].open() for p in (0, 1)}
    rng = np.random.default_rng(5)
    rows = {p: [click_rows(rng, 40, users=6 + p) for _ in range(2)] for p in (0, 1)}
    tasks = {p: processor.open(PartitionContext(p, 0, stores[p], "default", Watermarks(0, 0))) for p in (0, 1)}
    for i in range(2):
        for p in (1, 0):
            tasks[p].process(rows[p][i])
    assert tasks[0].processor is not tasks[1].processor and tasks[0].processor is not processor
    for p in (0, 1):
        tasks[p].finish()
        partitions[p].commit(stores[p])
    for p in (0, 1):
        stores[p] = partitions[p].open()
        read = processor.open(PartitionContext(p, 1, stores[p], "default", Watermarks(0, 0))).processor
        users = np.array([(u,) for u in range(8)], dtype=KEY_USER)
        values, found = read.count.get(users)
        batch = pa.Table.from_batches(rows[p])
        clicks = {u: batch.column("user").to_pylist().count(u) for u in set(batch.column("user").to_pylist())}
        assert {int(u["user"]): int(v["n"]) for u, v, f in zip(users, values, found) if f} == clicks, p
        for store in stores[p].values():
            store.abort()
    assert "count" not in vars(processor), "a task bound its variables to the shared processor"
    assert pickle.dumps(processor) == pickle.dumps(Sessions())


KEY_USER = np.dtype([("user", "<i8")])


class PlainTotals:
    """A plain callable fn with today's documented attributes and hooks, counting its calls."""

    key_columns = ["user"]
    key_schema = KEY_USER
    value_schema = np.dtype([("n", "<i8")])
    output_schema = "user long, n long"

    def __init__(self):
        self.calls = []

    def open(self, context):
        self.calls.append(("open", context.partition_id))

    def __call__(self, store, batch):
        self.calls.append(("call", batch.num_rows))
        return batch.select(["user"]).append_column("n", pa.array([1] * batch.num_rows, pa.int64()))

    def finish(self, store):
        self.calls.append(("finish", store.version))

    def observe(self, progress):
        self.calls.append(("observe", progress["batch_id"]))


def test_a_plain_callable_is_read_through_the_contract(tmp_path):
    """A function written against the documented attributes (a callable with key_columns,
    schemas, open, finish, observe) is read through contract_of unchanged: its attributes and
    hooks as they are, its calls in the task's order; a callable without them has defaults."""
    fn = PlainTotals()
    contract = contract_of(fn)
    assert isinstance(contract, CallableFunction) and contract_of(contract) is contract
    assert (contract.key_columns, contract.key_schema, contract.output_schema) == (["user"], KEY_USER,
                                                                                   "user long, n long")
    assert contract.state_stores is None and not contract.takes_initial_state
    partition = Partition(tmp_path, {"default": (KEY_USER, fn.value_schema)})
    stores = partition.open()
    task = contract.open(PartitionContext(3, 0, stores, "default", None))
    out = task.process(pa.RecordBatch.from_pydict({"user": pa.array([1, 2], pa.int64())}))
    assert out.column("n").to_pylist() == [1, 1]
    assert task.finish() is None
    contract.observe({"batch_id": 0})
    assert fn.calls == [("open", 3), ("call", 2), ("finish", 0), ("observe", 0)]
    assert contract.prepare("df", ["user"]) == "df"  # no prepare: the DataFrame as it is
    for store in stores.values():
        store.abort()

    def bare(store, batch):
        return None
    settings = FunctionSettings(bare, key_columns="user", key_schema=KEY_USER, value_schema=fn.value_schema)
    assert settings.key_columns == ["user"] and settings.event_time is None and settings.delay_us is None


def test_what_is_not_a_function_is_refused_naming_it():
    """Not a function, an open() that returns no handler, a missing schema: each a clear error."""
    with pytest.raises(TypeError, match="fn must be an OperatorFunction or a callable fn\\(store, batch\\), got int"):
        contract_of(7)

    class NoHandler(OperatorFunction):
        key_columns, key_schema, value_schema = ["user"], KEY_USER, KEY_USER

        def open(self, context):
            return None

    from pyspark_glue.operator_fn import open_task
    with pytest.raises(TypeError, match="NoHandler.open\\(context\\) must return a TaskHandler, got NoneType"):
        open_task(NoHandler(), None)
    with pytest.raises(ValueError, match="key_columns must be a non-empty list"):
        FunctionSettings(NoHandler(), key_columns=[])

    class NoValue(OperatorFunction):
        key_columns, key_schema = ["user"], KEY_USER

    from pyspark.sql.types import LongType, StructField, StructType
    settings = FunctionSettings(NoValue())
    with pytest.raises(ValueError, match="no value_schema: pass it"):
        settings.resolve_input(StructType([StructField("user", LongType())]))
    with pytest.raises(ValueError, match="key column 'user' is not in the rows"):
        settings.resolve_input(StructType([StructField("other", LongType())]), "the rows")


def test_emit_latest_emits_each_key_once_with_its_last_values():
    """A handler that emits the keys it updated in every batch, a key in several batches (and
    twice in one): finish emits each key once, with the last values given."""
    class Task(TaskHandler):
        pass

    value = np.dtype([("n", "<i8")])
    task = Task(None, PartitionContext(0, 0, {"default": None}, "default", None))
    assert task.finish() is None
    task.emit_latest(np.array([(1,), (2,), (1,)], KEY_USER), np.array([(10,), (20,), (11,)], value))
    task.emit_latest(np.array([(3,), (2,)], KEY_USER), np.array([(30,), (21,)], value), distinct=True)
    out = task.finish()
    assert sorted(zip(out.column("user").to_pylist(), out.column("n").to_pylist())) == [(1, 11), (2, 21), (3, 30)]
    assert task.finish() is None, "what was emitted is not emitted again"


def test_the_task_status_row_and_its_schemas_come_from_one_dataclass():
    """The status row a task returns: its Arrow batch has the dataclass's schema, with maps and
    structs where the row used to hold JSON strings; the Spark schema mapInArrow is given is
    derived from it; a collected Spark row reads back as the same status."""
    from pyspark.sql import Row

    status = TaskStatus(
        partition_id=2, rows_in=10, batches_in=1, rows_out=3, num_keys=7, memory_used_bytes=100,
        already_loaded=True, worker="exec-1", open_s=0.5, fn_s=0.25, write_s=0.125, commit_s=1.0,
        custom_metrics={"rolledForwardCount": 2}, commit_id="ab" * 8, base_commit_id="cd" * 8,
        store_commit_ids={"expiry_heads": {"base_commit_id": "01" * 8, "commit_id": "02" * 8}},
        max_event_time_us=None, late_rows=0, fn_counts={"keys": 3})
    batch = status.to_record_batch()
    assert batch.schema == TaskStatus.arrow_schema()
    assert pa.types.is_map(batch.schema.field("custom_metrics").type)
    assert pa.types.is_struct(batch.schema.field("store_commit_ids").type.item_type)
    ddl = TaskStatus.spark_schema().simpleString()
    assert "store_commit_ids:map<string,struct<base_commit_id:string,commit_id:string>>" in ddl
    assert "fn_counts:map<string,bigint>" in ddl and "partition_id:int" in ddl
    values = batch.to_pylist()[0]
    values = {k: dict(v) if isinstance(v, list) else v for k, v in values.items()}
    values["store_commit_ids"] = {k: Row(**v) for k, v in values["store_commit_ids"].items()}
    assert TaskStatus.from_row(Row(**values)) == status
