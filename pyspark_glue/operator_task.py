"""The task of a :class:`~pyspark_glue.StatefulOperator` micro-batch: one per state partition.

It checks that its rows were routed to it, opens the partition's stores (the default one and
any ``fn.state_stores``) at the attempts the driver recorded, runs ``fn`` through its contract
(``fn.open(context)``, the handler's ``process`` for each Arrow batch, its ``finish``), writes
the output, commits every store, and returns one status row (a
:class:`~pyspark_glue.task_status.TaskStatus`). What the steps are and why is in
``docs/operator.md``; the event-time part in ``docs/event-time.md``.
"""
import dataclasses
import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 (pa.compute)

from statecore import registry
from statecore.arrow_rows import parquet_writer
from statecore.conf import StateStoreConf
from statecore.snapshot_at import start_store_empty
from statecore.spark_hash import spark_partition
from statecore.checkpoint import CheckpointFiles

from pyspark_glue import executor
from pyspark_glue.arrow import conform_output, joined_batches
from pyspark_glue.event_time import Watermarks, event_times_us
from pyspark_glue.operator_fn import PartitionContext, open_task
from pyspark_glue.rdd import StatefulOperatorStateInfo
from pyspark_glue.task_status import TaskStatus

__all__ = ["PARTITION_COLUMN", "INITIAL_STATE_COLUMN", "PartitionContext", "partition_function"]

log = logging.getLogger(__name__)

# The partition each row's key hashes to, computed by Spark after the operator's repartition
# and checked in the task (then dropped): a wrong routing fails the task instead of updating
# another partition's keys. Keys of fixed-width types need no column: the task hashes them.
PARTITION_COLUMN = "__statecore_partition"
# Marks the rows of the operator's initial state, which its first batch carries with the input.
INITIAL_STATE_COLUMN = "__statecore_initial_state"
# What fn gets at most in one joined batch: FN_BATCH_ROWS rows (the operator's default
# fn_batch_rows) and FN_BATCH_BYTES of Arrow buffers. Fewer, larger batches let a fn read and
# write its keys once per task instead of once per Spark batch.
FN_BATCH_ROWS = 1 << 20
FN_BATCH_BYTES = 128 << 20

@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """One of the operator's stores besides the default one: its name and numpy schemas, and
    per partition the attempt to open (None: the default lineage); ``starts_empty``: the
    store is new to the operator (the previous batch's record does not name it), each task
    starts it empty at the batch's version (``docs/lineage.md``)."""

    name: str
    key_dtype: np.dtype
    value_dtype: np.dtype
    commit_ids: tuple = None
    starts_empty: bool = False


@dataclasses.dataclass(frozen=True)
class PartitionTask:
    """Everything a task needs; pickled into the job (nothing here needs the caller's module)."""

    state_info: StatefulOperatorStateInfo
    store_name: str
    key_dtype: np.dtype
    value_dtype: np.dtype
    extra_stores: tuple  # StoreSpec
    conf: StateStoreConf
    fn: object  # the fn's contract (pyspark_glue.operator_fn.OperatorFunction)
    arrow_schema: object  # pyarrow.Schema of the output, or None
    output_dir: str  # where part-<p>.parquet goes, or None
    coordinator_address: tuple
    authkey: bytes
    generation: int
    event_time: str = None  # the event-time column, or None
    watermarks: Watermarks = None
    batch_timestamp_ms: int = 0  # the batch's processing time, taken on the driver
    # (key columns, their Spark types) when the task checks the routing from the keys
    # themselves; None: the rows carry PARTITION_COLUMN
    routing_keys: tuple = None
    # fn gets the partition's Arrow batches joined up to this many rows (and FN_BATCH_BYTES);
    # None: as Spark sends them (spark.sql.execution.arrow.maxRecordsPerBatch rows)
    fn_batch_rows: int = None


_generations = {}  # provider id -> generation of the last task that used it in this process
_generations_lock = threading.Lock()


def _retire_stale_instances(task, provider_id):
    """Unload what this worker must not reuse: other runs' instances of the same store, and
    this run's instance if it was used before a re-execution (another generation). An
    instance another worker used since is kept: the provider opens the attempt the driver
    recorded, from the version it holds by the deltas since when that is on its lineage."""
    for other in executor.unload_other_runs(provider_id):
        with _generations_lock:
            _generations.pop(other, None)
    with _generations_lock:
        previous = _generations.get(provider_id)
        _generations[provider_id] = task.generation
    if not registry.is_loaded(provider_id):
        return
    if previous != task.generation:
        log.info("reloading %s from files (a batch was re-executed)", provider_id.store_id)
        registry.unload(provider_id)


def _write_output(task, partition_id, batches):
    files = CheckpointFiles(task.output_dir, task.conf.storage_options, task.conf.local_cache_dir)

    def write(f):
        writer = parquet_writer(f, task.arrow_schema)
        for batch in batches:
            writer.write_batch(batch)
        writer.close()

    files.write_atomic(f"part-{partition_id:05d}.parquet", write)


def _hashable_values(column):
    """``(values, valid mask or None)`` of a fixed-width key column as :mod:`statecore.spark_hash`
    takes them: temporal types as their integer counts, booleans as 0/1, nulls filled."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    elif pa.types.is_date32(column.type):
        column = column.cast(pa.int32())
    elif pa.types.is_boolean(column.type):
        column = column.cast(pa.int8())
    valid = None
    if column.null_count:
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        column = pa.compute.fill_null(column, pa.scalar(0, column.type))
    return column.to_numpy(zero_copy_only=False), valid


def routed_partitions(batch, num_partitions, key_columns, key_types):
    """The partition Spark's ``pmod(hash(key columns), n)`` gives each row, in numpy (for key
    columns of :data:`~statecore.spark_hash.FIXED_WIDTH_TYPES`)."""
    pairs = [_hashable_values(batch.column(batch.schema.get_field_index(c))) for c in key_columns]
    return spark_partition([v for v, _ in pairs], key_types, num_partitions, [m for _, m in pairs])


def checked_partition(batch, partition_id, routing=None):
    """``batch`` without :data:`PARTITION_COLUMN`, after checking that every row's key hashes to
    ``partition_id``: a row in another partition's task would update the wrong store. With
    ``routing`` (``(num_partitions, key_columns, key_types)``), the partitions are computed
    from the key columns here instead of read from the column."""
    if routing is not None:
        routed = routed_partitions(batch, *routing)
    else:
        i = batch.schema.get_field_index(PARTITION_COLUMN)
        if i < 0:
            raise RuntimeError(f"the operator's column {PARTITION_COLUMN} is missing from the task's rows")
        routed = batch.column(i).to_numpy(zero_copy_only=False)
        batch = batch.remove_column(i)
    if len(routed) and (routed.min() != partition_id or routed.max() != partition_id):
        other = int(routed[routed != partition_id][0])
        raise RuntimeError(
            f"rows of state partition {other} reached the task of partition {partition_id}: the job's partitioning "
            f"was changed after the operator's repartition (by adaptive execution or a rule that merges or splits "
            f"shuffle partitions); no store was changed")
    return batch


def _max_event_time(batch, column):
    """The largest event time of the batch's input rows (not its initial-state rows), or None."""
    i = batch.schema.get_field_index(INITIAL_STATE_COLUMN)
    if i >= 0:
        batch = batch.filter(pa.compute.invert(batch.column(i)))
    if not batch.num_rows:
        return None
    i = batch.schema.get_field_index(column)
    col = batch.column(i) if i >= 0 else None
    if col is None or col.null_count or not pa.types.is_timestamp(col.type) or col.type.unit != "us":
        return int(event_times_us(batch, column).max())  # the checks, and their errors
    return pa.compute.max(col).value  # microseconds, without a copy of the column


def _open_stores(task, partition_id):
    """``({name: store}, already_loaded of the default store, names of the stores started
    empty)``, every store at the batch's version."""
    info = task.state_info
    version = info.store_version
    specs = [(task.store_name, task.key_dtype, task.value_dtype, info.commit_id(partition_id), False)]
    specs += [(s.name, s.key_dtype, s.value_dtype, None if s.commit_ids is None else s.commit_ids[partition_id],
               s.starts_empty) for s in task.extra_stores]
    stores, already_loaded, new_stores = {}, None, set()
    try:
        for name, key_dtype, value_dtype, commit_id, starts_empty in specs:
            provider_id = info.provider_id(partition_id, name)
            _retire_stale_instances(task, provider_id)
            if starts_empty:
                commit_id = start_store_empty(provider_id.store_id, version, key_dtype, value_dtype, task.conf)
            store, loaded = executor.open_store(provider_id, key_dtype, value_dtype, version, task.conf,
                                                commit_id=commit_id)
            stores[name] = store
            if starts_empty or version == 0:
                new_stores.add(name)
            if already_loaded is None:
                already_loaded = loaded
    except BaseException:
        for store in stores.values():
            store.abort()
        raise
    return stores, already_loaded, new_stores


def run_fn(contract, context, batches, arrow_schema, event_time=None, check=None):
    """``fn`` over one partition's batches, as every runner of an operator's ``fn`` runs it
    (the operator's task, :class:`pyspark_glue.testing.Harness`): ``contract.open(context)``
    (the task's handler), ``handler.process(batch)`` for each batch (after ``check(batch)``,
    which may drop columns), ``handler.finish()``. Returns ``(outputs, rows_in, batches_in,
    max_event_time_us)``, the outputs conformed to ``arrow_schema``. The stores are left to
    the caller to commit."""
    outputs, rows_in, batches_in, max_event_time = [], 0, 0, None
    handler = open_task(contract, context)
    for batch in batches:
        if check is not None:
            batch = check(batch)
        rows_in += batch.num_rows
        batches_in += 1
        if event_time is not None and batch.num_rows:
            batch_max = _max_event_time(batch, event_time)
            if batch_max is not None:
                max_event_time = batch_max if max_event_time is None else max(max_event_time, batch_max)
        out = handler.process(batch)
        if out is not None:
            outputs += conform_output(out, arrow_schema, "fn")
    out = handler.finish()
    if out is not None:
        outputs += conform_output(out, arrow_schema, "fn.finish")
    return outputs, rows_in, batches_in, max_event_time


def commit_stores(stores, store_name):
    """Commit every store of a partition, the operator's own (``store_name``) last: its commit
    id is the batch's. On a failure, the stores not yet committed are aborted."""
    try:
        for name, other in stores.items():
            if name != store_name:
                other.commit()
        stores[store_name].commit()
    except BaseException:
        abort_uncommitted(stores)
        raise


def abort_uncommitted(stores):
    """Abort every store of ``stores`` that has not committed (after a failure)."""
    for store in stores.values():
        if not store.has_committed:
            store.abort()


def _run_partition(task, batches):
    """The body of partition ``p``'s task (``docs/operator.md``, step 3)."""
    from pyspark import TaskContext

    started = time.perf_counter()
    partition_id = TaskContext.get().partitionId()
    executor.ensure_worker_registry(task.coordinator_address, task.authkey)
    stores, already_loaded, new_stores = _open_stores(task, partition_id)
    store = stores[task.store_name]
    opened = time.perf_counter()
    context = PartitionContext(partition_id, task.state_info.store_version, stores, task.store_name,
                               task.watermarks, task.batch_timestamp_ms, new_stores)
    routing = None if task.routing_keys is None else (task.state_info.num_partitions, *task.routing_keys)
    try:
        outputs, rows_in, batches_in, max_event_time = run_fn(
            task.fn, context, joined_batches(batches, task.fn_batch_rows, FN_BATCH_BYTES), task.arrow_schema,
            task.event_time, lambda batch: checked_partition(batch, partition_id, routing))
        ran = time.perf_counter()
        if task.output_dir is not None:
            _write_output(task, partition_id, outputs)
        written = time.perf_counter()
        commit_stores(stores, task.store_name)
    except BaseException:
        abort_uncommitted(stores)
        raise
    committed = time.perf_counter()
    metrics = store.metrics
    status = TaskStatus(
        partition_id=partition_id, rows_in=rows_in, batches_in=batches_in, rows_out=sum(b.num_rows for b in outputs),
        num_keys=metrics.num_keys, memory_used_bytes=metrics.memory_used_bytes, already_loaded=already_loaded,
        worker=executor.worker_executor_id(), open_s=opened - started, fn_s=ran - opened, write_s=written - ran,
        commit_s=committed - written, custom_metrics={k: int(v) for k, v in metrics.custom_metrics.items()},
        commit_id=store.commit_id, base_commit_id=store.base_commit_id,
        store_commit_ids={name: {"base_commit_id": s.base_commit_id, "commit_id": s.commit_id}
                          for name, s in stores.items() if name != task.store_name},
        max_event_time_us=max_event_time, late_rows=int(context.late_rows),
        fn_counts={k: int(v) for k, v in context.counts.items()})
    yield status.to_record_batch()


def partition_function(task):
    """The function ``mapInArrow`` runs: partition ``p``'s task over its Arrow batches."""
    def run_partition(batches):
        return _run_partition(task, batches)
    return run_partition
