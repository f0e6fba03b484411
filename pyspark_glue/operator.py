"""The DataFrame / Structured Streaming level: :class:`StatefulOperator` for ``foreachBatch``,
the Arrow <-> numpy conversions user functions need, and :class:`RunningAggregate`.

How a micro-batch runs (``StatefulOperator.process(df, batch_id)``)
    1. On the driver: the operator's metadata file ``<checkpoint>/<operator>/_operator.json``
       is written on first use (number of partitions, key columns and their Spark types,
       store name, key and value schemas) and checked on every later use: another number
       of partitions is a ``ValueError`` naming both numbers (rows are routed to partitions
       by a hash of the key columns modulo that number, so changing it would scatter every
       key's state), other key columns or column types a ``ValueError``, other schemas a
       ``SchemaMismatchError``.
    2. ``df.repartition(num_partitions, *key_columns).mapInArrow(...)``: Spark's hash
       partitioning (murmur3 of the key columns, the same in every batch and after a
       restart) sends a key to the same partition ``p`` every time; ``p`` is
       ``TaskContext.partitionId()`` inside the task. If ``fn`` has a callable
       ``prepare(df, key_columns)``, its DataFrame is repartitioned instead: a function
       that merges per-key partial results lets Spark aggregate the batch first
       (:meth:`RunningAggregate.prepare`). The job runs with ``spark.sql.shuffle.partitions``
       set to ``num_partitions`` (so an aggregation in ``prepare`` shuffles once, straight
       into the operator's partitions, as a streaming query runs every shuffle with its
       checkpoint's number) and adaptive execution off (Spark runs its own stateful
       operators without it: it would merge small partitions, or drop the tasks of a batch
       it finds empty); both are restored after the job. Every row also carries the
       partition its key hashes to (:data:`PARTITION_COLUMN`, computed by Spark), and the
       task checks it before ``fn`` sees the batch (without that column): a row routed to
       the wrong task fails the task instead of updating another partition's keys.
    3. In the task of partition ``p``: the store of ``(operator, p)`` at version
       ``batch_id`` (the attempt the record of batch ``batch_id - 1`` names: see "The batch
       record" below) comes from the worker's registry (loaded once per Python worker and
       kept across batches); ``fn(store, batch)`` runs for every ``pyarrow.RecordBatch`` of
       the partition (zero batches for an empty partition) and may return a record batch (the
       operator's output) or None. If ``fn`` has a callable attribute ``finish``,
       ``fn.finish(store)`` runs once after the last batch (also for an empty partition)
       and may return a batch too: operators that emit one row per key per micro-batch use
       it (:class:`RunningAggregate` does). Then the output is written (step 4) and the
       store commits version ``batch_id + 1``: every partition commits every batch, as in
       Spark, so the next batch finds its version everywhere. An exception anywhere aborts
       the store (no new version) and fails the task.
    4. Output, materialized once: each task writes its output batches to
       ``<checkpoint>/<operator>/_output/<batch_id>/part-<p>.parquet`` (a hidden temporary
       name, then a rename: Spark's reader ignores names starting with ``.``), and tasks
       return only a one-row status each (counts, timings, and the store's new commit id).
       ``process`` runs that job once, eagerly, records the batch (below), and returns
       ``spark.read.parquet`` of the directory.

Why materialize to files
    ``process`` must return a DataFrame whose rows were computed exactly once, however many
    actions the caller runs on it (a ``foreachBatch`` body commonly writes the output and
    also counts or shows it). A lazy DataFrame would re-run ``fn`` and re-commit the stores
    on every action; ``cache()`` is not a guarantee (evicted blocks are recomputed, and a
    recompute of a store task at the same version is only safe because stores support
    re-execution, while the *cost* is paid again); ``collect()`` to the driver does not
    scale. Files written idempotently (one file per partition, replaced atomically by a
    retried task or a re-executed batch) give an output that is durable, cheap to read any
    number of times, and the same on re-execution. Older outputs are deleted after
    ``output_batches_to_retain`` batches: keep that at least as long as the returned
    DataFrame is used (normally the ``foreachBatch`` call itself). The output location must
    be readable by Spark as well as writable by fsspec: a local path, ``file://``, or a
    shared filesystem mounted on every node; for object stores use a scheme both
    understand.

Exactly once
    Processing a ``batch_id`` again (``foreachBatch`` re-run after a failure, a restart from
    the query's checkpoint, or a second ``process`` call) gets version ``batch_id`` again and
    commits ``batch_id + 1`` again: the store supports re-execution (files of the abandoned
    run are never read for the new one), so a deterministic ``fn`` leaves the same state and
    writes the same output files. A worker process that still holds a provider loaded before
    a re-execution must not trust its in-memory versions (another worker may have committed
    the same version again, with another lineage): the driver counts re-executions within a
    run (the *generation*, shipped with every task) and a worker whose provider was used in
    an earlier generation unloads it and reloads from files; with a coordinator, a worker
    also reloads when the coordinator says another worker was the last to load the store
    (a retried task that ran elsewhere). ``process`` must be called for every batch id, in
    order, as ``foreachBatch`` does: version ``batch_id`` must exist.

The batch record: which attempt each batch builds on
    Several attempts of one version can be on disk (a retried task, a zombie task that
    commits late; ``docs/lineage.md``), and the store's default, the attempt renamed last,
    need not be the one Spark kept. So each task's status row carries its store's new
    ``commit_id`` (and the ``base_commit_id`` it opened), and once the batch's job has
    succeeded the driver writes ``<checkpoint>/<operator>/_commits/<batch_id>`` (JSON,
    atomically; :data:`COMMITS_DIR`): ``format``, ``batch_id``, ``version`` (``batch_id +
    1``), ``num_partitions``, ``store_name``, ``run_id``, and ``commit_ids`` and
    ``base_commit_ids``, one 16-hex id per partition. The tasks of batch ``b`` open
    version ``b`` at the ids of record ``b - 1`` (batch 0 opens the empty version 0); with
    no such record (a checkpoint written before records existed) they open the default
    lineage. Before batch ``b`` runs, the records of batches ``>= b`` are deleted (a
    re-execution's commits delete the files those name), and record ``b`` is written only
    by a job that succeeded; records more than ``min_versions_to_retain`` batches old are
    deleted (their versions' files go too). :func:`~pyspark_glue.read_state` reads at the
    newest record.

Query runs and the coordinator
    The run id that stores are loaded under is the streaming query's own ``runId`` when
    ``process`` runs inside ``foreachBatch`` (found through the query id Spark sets as a
    local property): Spark gives every start of a query, including a restart from its
    checkpoint, a new run id, so a restart never reuses provider instances of the previous
    run (a worker unloads other runs' instances of a store before loading it). Outside a
    streaming query (plain batch use, tests), the run id is a ``uuid4`` drawn per
    ``StatefulOperator`` instance, or the ``query_run_id`` given. With a coordinator
    (``coordinator=True``, the default, starts :func:`pyspark_glue.driver.coordinator_for`
    the first time it is needed), workers report every store they load to it, and when a
    run ends its instances are deactivated: when a new run of the query is seen, at
    :meth:`StatefulOperator.close`, and when the query terminates (a
    ``StreamingQueryListener`` registered on the session that started the query).

No per-row Python
    Arrow columns become numpy columns (:func:`columns_from_arrow`: zero-copy for
    fixed-width types, one vectorized scatter for ``S<n>``), go through the store's batch
    API (``get_batch``/``put_batch``), and come back as Arrow (:func:`to_record_batch`).

Types (numpy field -> Spark)
    bool -> boolean, int8 -> byte, int16 -> short, int32 -> int, int64 -> long,
    float32 -> float, float64 -> double, ``S<n>`` -> binary (trailing NULs dropped, as numpy
    drops them), and, since Spark has no unsigned types, each unsigned type widens to the
    next signed one: uint8 -> short, uint16 -> int, uint32 -> long, and uint64 ->
    decimal(20,0) (exact over the whole range). Going the other way
    (:func:`columns_from_arrow`) any Arrow numeric column casts to the field's dtype with a
    range check (a value out of range is a ``ValueError`` naming the column); strings and
    binaries fill ``S<n>`` fields and must fit in ``n`` bytes; null keys are refused.
"""
import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from statecore import registry
from statecore.conf import StateStoreConf
from statecore.errors import SchemaMismatchError
from statecore.files import open_store_files
from statecore.lineage import ROOT_COMMIT_ID
from statecore.metrics import StateStoreMetrics
from statecore.schema import RowSchema, as_schema, key_value_schemas

from pyspark_glue import executor
from pyspark_glue.logs import EpochLog, checked_commit_ids
from pyspark_glue.rdd import StatefulOperatorStateInfo, ship_function_module

__all__ = ["StatefulOperator", "RunningAggregate", "columns_from_arrow", "keys_from_arrow", "column_to_numpy",
           "to_record_batch", "numpy_to_arrow", "arrow_type_of", "spark_type_of", "spark_schema_of",
           "group_rows", "conform_output", "OPERATOR_METADATA_FILE", "OUTPUT_DIR", "COMMITS_DIR", "PARTITION_COLUMN",
           "commit_log", "read_commit_record"]

log = logging.getLogger(__name__)

OPERATOR_METADATA_FILE = "_operator.json"  # in <checkpoint>/<operator_id>/
OUTPUT_DIR = "_output"  # <checkpoint>/<operator_id>/_output/<batch_id>/part-<p>.parquet
COMMITS_DIR = "_commits"  # <checkpoint>/<operator_id>/_commits/<batch_id>: the batch record
# The partition each row's key hashes to, computed by Spark after the operator's repartition
# and checked in the task (then dropped): a wrong routing fails the task instead of updating
# another partition's keys.
PARTITION_COLUMN = "__statecore_partition"
# Columns of the per-batch partial aggregate RunningAggregate.prepare hands to its tasks.
PARTIAL_COUNT, PARTIAL_SUM = "__statecore_count", "__statecore_sum"
_METADATA_FORMAT = "statecore-operator-1"
_RECORD_FORMAT = "statecore-operator-commit-1"
_PROVIDER_CLASS_KEY = "spark.sql.streaming.stateStore.providerClass"

# -- numpy <-> Arrow <-> Spark types -----------------------------------------------------------

_ARROW_OF_KIND = {  # (kind, itemsize) -> the Arrow type Spark takes for it
    ("b", 1): pa.bool_(),
    ("i", 1): pa.int8(), ("i", 2): pa.int16(), ("i", 4): pa.int32(), ("i", 8): pa.int64(),
    ("u", 1): pa.int16(), ("u", 2): pa.int32(), ("u", 4): pa.int64(), ("u", 8): pa.decimal128(20, 0),
    ("f", 4): pa.float32(), ("f", 8): pa.float64(),
}
_ARROW_NATIVE = {  # (kind, itemsize) -> the Arrow type with exactly the numpy dtype's range
    ("b", 1): pa.bool_(),
    ("i", 1): pa.int8(), ("i", 2): pa.int16(), ("i", 4): pa.int32(), ("i", 8): pa.int64(),
    ("u", 1): pa.uint8(), ("u", 2): pa.uint16(), ("u", 4): pa.uint32(), ("u", 8): pa.uint64(),
    ("f", 4): pa.float32(), ("f", 8): pa.float64(),
}
_WIDENED = {1: np.int16, 2: np.int32, 4: np.int64}  # unsigned itemsize -> the signed dtype Spark gets


def arrow_type_of(dtype):
    """The Arrow type a numpy field of ``dtype`` becomes (see the module docstring)."""
    dt = np.dtype(dtype)
    if dt.kind == "S":
        return pa.binary()
    try:
        return _ARROW_OF_KIND[(dt.kind, dt.itemsize)]
    except KeyError:
        raise TypeError(f"no Spark type for numpy dtype {dt}") from None


def spark_type_of(dtype):
    """The Spark SQL type a numpy field of ``dtype`` becomes (see the module docstring)."""
    from pyspark.sql import types as T

    t = arrow_type_of(dtype)
    if pa.types.is_decimal(t):
        return T.DecimalType(t.precision, t.scale)
    return {
        pa.bool_(): T.BooleanType(), pa.int8(): T.ByteType(), pa.int16(): T.ShortType(),
        pa.int32(): T.IntegerType(), pa.int64(): T.LongType(), pa.float32(): T.FloatType(),
        pa.float64(): T.DoubleType(), pa.binary(): T.BinaryType(),
    }[t]


def spark_schema_of(*dtypes, extra=()):
    """A ``StructType`` of the fields of structured ``dtypes`` in order, then ``extra``
    (``(name, spark type)`` pairs). Every field is nullable, as Spark reads them back."""
    from pyspark.sql import types as T

    fields = []
    for dtype in dtypes:
        schema = as_schema(dtype)
        fields += [T.StructField(name, spark_type_of(f), True) for name, f in schema.fields]
    fields += [T.StructField(name, t, True) for name, t in extra]
    return T.StructType(fields)


def _fixed_to_binary(col):
    """A binary Arrow array of an ``S<n>`` column, each value without its trailing NULs."""
    col = np.ascontiguousarray(col)
    m, n = col.shape[0], col.dtype.itemsize
    matrix = col.view(np.uint8).reshape(m, n)
    nonzero = matrix != 0
    lengths = np.where(nonzero.any(axis=1), n - np.argmax(nonzero[:, ::-1], axis=1), 0)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = matrix[np.arange(n)[None, :] < lengths[:, None]]  # row-major: the values, concatenated
    if offsets[-1] < 2**31:
        return pa.Array.from_buffers(pa.binary(), m, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                      pa.py_buffer(data)])
    large = pa.Array.from_buffers(pa.large_binary(), m, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return large.cast(pa.binary())  # raises if it cannot be one binary array


def numpy_to_arrow(col):
    """The Arrow array of one numpy column, typed as :func:`arrow_type_of` says."""
    dt = col.dtype
    if dt.kind == "S":
        return _fixed_to_binary(col)
    col = np.ascontiguousarray(col)
    if dt.kind == "u":
        if dt.itemsize == 8:
            return pa.array(col, type=pa.uint64()).cast(pa.decimal128(20, 0))
        return pa.array(col.astype(_WIDENED[dt.itemsize]))
    if (dt.kind, dt.itemsize) not in _ARROW_OF_KIND:
        raise TypeError(f"no Spark type for numpy dtype {dt}")
    return pa.array(col)


def to_record_batch(*arrays, names=None, **constant_columns):
    """A ``pyarrow.RecordBatch`` of the fields of the structured ``arrays`` (equal lengths), in
    order, then one column per keyword holding that constant (an int becomes int32, as a
    partition id). ``names`` renames the fields (one name per field, in order). Types as
    :func:`arrow_type_of`; ``S<n>`` values lose their trailing NULs."""
    columns, out_names = [], []
    lengths = {len(a) for a in arrays}
    if len(lengths) > 1:
        raise ValueError(f"arrays have different lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    for array in arrays:
        if array.dtype.names is None:
            raise TypeError(f"expected structured arrays, got dtype {array.dtype}")
        for name in array.dtype.names:
            columns.append(numpy_to_arrow(array[name]))
            out_names.append(name)
    for name, value in constant_columns.items():
        if isinstance(value, (bool, np.bool_)):
            columns.append(pa.array(np.full(n, value, dtype=np.bool_)))
        elif isinstance(value, (int, np.integer)):
            columns.append(pa.array(np.full(n, value, dtype=np.int32)))
        else:
            columns.append(pa.array([value] * n))
        out_names.append(name)
    if names is not None:
        names = list(names)
        if len(names) != len(out_names) - len(constant_columns):
            raise ValueError(f"{len(names)} names for {len(out_names) - len(constant_columns)} fields")
        out_names[:len(names)] = names
    return pa.RecordBatch.from_arrays(columns, names=out_names)


def _binary_to_fixed(arr, n, name):
    """The ``S<n>`` numpy column of a string/binary Arrow array without nulls (one scatter)."""
    t = arr.type
    m = len(arr)
    if pa.types.is_fixed_size_binary(t):
        width = t.byte_width
        if width > n:
            raise ValueError(f"column '{name}' holds {width}-byte values; the field is S{n}")
        data = arr.buffers()[1]
        raw = np.frombuffer(data, dtype=np.uint8, count=(arr.offset + m) * width)[arr.offset * width:]
        out = np.zeros((m, n), dtype=np.uint8)
        out[:, :width] = raw.reshape(m, width)
        return out.view(f"S{n}").reshape(m)
    if pa.types.is_string(t):
        arr, t = arr.cast(pa.binary()), pa.binary()
    elif pa.types.is_large_string(t):
        arr, t = arr.cast(pa.large_binary()), pa.large_binary()
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise TypeError(f"column '{name}' is {t}; an S{n} field takes string or binary columns")
    off_dtype = np.int64 if pa.types.is_large_binary(t) else np.int32
    buffers = arr.buffers()
    offsets = np.frombuffer(buffers[1], dtype=off_dtype, count=arr.offset + m + 1)[arr.offset:].astype(np.int64)
    lengths = np.diff(offsets)
    if m and lengths.max() > n:
        i = int(np.argmax(lengths))
        raise ValueError(f"column '{name}' holds a {int(lengths[i])}-byte value (row {i}); the field is S{n}")
    out = np.zeros((m, n), dtype=np.uint8)
    total = int(offsets[-1] - offsets[0]) if m else 0
    if total:
        data = np.frombuffer(buffers[2], dtype=np.uint8)
        src = np.arange(offsets[0], offsets[-1])
        rows = np.repeat(np.arange(m), lengths)
        out[rows, src - np.repeat(offsets[:-1], lengths)] = data[src]
    return out.view(f"S{n}").reshape(m)


def column_to_numpy(arr, dtype, name="?", null_value=None):
    """The numpy column of dtype ``dtype`` of one Arrow array (``name`` is for messages).

    Numeric and boolean columns cast with Arrow's safe cast (a value out of the dtype's range,
    or a fraction cast to an integer, is a ``ValueError``); string and binary columns fill
    ``S<n>``. Nulls are a ``ValueError`` unless ``null_value`` replaces them.
    """
    dt = np.dtype(dtype)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        if null_value is None:
            raise ValueError(f"column '{name}' has {arr.null_count} null value(s); state keys cannot be null")
        arr = arr.fill_null(null_value)
    if dt.kind == "S":
        return _binary_to_fixed(arr, dt.itemsize, name)
    target = _ARROW_NATIVE.get((dt.kind, dt.itemsize))
    if target is None:
        raise TypeError(f"field for column '{name}' has dtype {dt}, which no store holds")
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_decimal(t)):
        raise TypeError(f"column '{name}' is {t}; a {dt} field takes numeric columns")
    if t != target:
        try:
            arr = arr.cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"column '{name}' ({t}) does not fit the field's dtype {dt}: {e}") from None
    out = arr.to_numpy(zero_copy_only=False)
    return out if out.dtype == dt else out.astype(dt)


def _column_index(batch, name):
    i = batch.schema.get_field_index(name)
    if i < 0:
        raise KeyError(f"column '{name}' is not in the batch (columns: {batch.schema.names})")
    return i


def columns_from_arrow(batch, schema, columns=None):
    """A structured numpy array of ``schema`` (a structured dtype or RowSchema; the
    canonical packed layout, ready for the store's batch API) from a ``RecordBatch``.

    Field ``i`` comes from column ``columns[i]`` (default: the column named like the field).
    See :func:`column_to_numpy` for the casts; nulls are refused.
    """
    schema = as_schema(schema)
    names = schema.names if columns is None else tuple(columns)
    if len(names) != len(schema.names):
        raise ValueError(f"{len(names)} columns for the {len(schema.names)} fields {schema.names}")
    out = np.empty(batch.num_rows, dtype=schema.dtype)
    for field, column in zip(schema.names, names):
        out[field] = column_to_numpy(batch.column(_column_index(batch, column)), schema.dtype[field], column)
    return out


keys_from_arrow = columns_from_arrow  # the name the key side reads best with


def group_rows(keys):
    """``(order, starts)`` grouping the equal rows of a structured array: ``keys[order]`` is
    sorted so that equal keys are adjacent, and group ``g`` is ``order[starts[g]:starts[g+1]]``
    (stable: rows of a group keep their input order). Keys are equal when the store's key
    rows are: float fields normalized (``-0.0`` is ``0.0``, every NaN one key), the rest
    compared by bytes. One sort, no Python loop."""
    n = keys.shape[0]
    if keys.dtype.names is not None and len(keys.dtype.names) == 1 and keys.dtype[0].kind in "iub":
        sort_key = keys[keys.dtype.names[0]]
    elif keys.dtype.names is not None and any(keys.dtype[f].kind == "f" for f in keys.dtype.names):
        rows = as_schema(keys.dtype, key=True).rows(keys)
        sort_key = rows.view(f"S{rows.shape[1]}").ravel() if rows.shape[1] else np.zeros(n, "S1")
    else:
        packed = np.ascontiguousarray(keys)
        sort_key = packed.view(f"S{packed.dtype.itemsize}") if packed.dtype.itemsize else np.zeros(n, "S1")
    order = np.argsort(sort_key, kind="stable")
    if n == 0:
        return order, np.zeros(0, dtype=np.intp)
    ordered = sort_key[order]
    new_group = np.empty(n, dtype=np.bool_)
    new_group[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_group[1:])
    return order, np.flatnonzero(new_group)


# -- ready-made functions ----------------------------------------------------------------------

class RunningAggregate:
    """``fn`` for a running count and sum per key (Spark's ``groupBy(keys).agg(count, sum)``
    in update mode): one row per key updated in the micro-batch, with its new totals.

    In a :class:`StatefulOperator`, :meth:`prepare` has Spark count and sum each micro-batch
    per key first, so a task merges one row per key: one ``get_batch`` and one ``put_batch``
    per Arrow batch. Given raw rows instead (other runners call it that way), a batch's keys
    are grouped with one sort (:func:`group_rows`) and counted and summed with
    ``np.add.reduceat`` (exact for integer sums). The output is emitted by :meth:`finish`,
    once per key per micro-batch.

    Parameters
    ----------
    key_schema : structured dtype
        The state key; its fields are read from the columns of the same names (or
        ``key_columns``).
    value_column : str
        The column summed. Nulls count as rows and add nothing to the sum.
    sum_dtype : dtype, default int64
        The sum's dtype (the state's int64 sum wraps on overflow, as numpy's does; Spark's
        per-batch sum in :meth:`prepare` fails on overflow when ANSI mode is on).
    count_field, sum_field : str
        Names of the value fields (and output columns).
    emit : bool, default True
        Whether to output the updated rows (False: state only, no output).
    pre_aggregate : bool, default True
        Whether :meth:`prepare` has Spark aggregate each batch first. It pays when a batch
        holds several rows per key (measured: 1M-row batches over 100k keys, 1.70 -> 1.26 s
        per batch) and costs when most keys come once (over 1M keys: 1.79 -> 2.31 s, Spark's
        hash aggregation of ~630k keys being dearer than shuffling the rows and grouping them
        with one numpy sort); see bench/RESULTS.md.

    Attributes
    ----------
    value_schema : numpy dtype ``[(count_field, int64), (sum_field, sum_dtype)]``
    output_schema : StructType of the key fields, then count and sum (None if not emit)
    """

    def __init__(self, key_schema, value_column, *, key_columns=None, sum_dtype="<i8", count_field="count",
                 sum_field="sum", emit=True, pre_aggregate=True):
        self.key_dtype = as_schema(key_schema).dtype
        self.value_column = value_column
        self.key_columns = None if key_columns is None else tuple(key_columns)
        self.count_field, self.sum_field = count_field, sum_field
        self.value_schema = RowSchema([(count_field, "<i8"), (sum_field, np.dtype(sum_dtype))]).dtype
        self.sum_dtype = self.value_schema[sum_field]
        if self.sum_dtype.kind not in "iuf":
            raise TypeError(f"sum_dtype must be numeric, got {self.sum_dtype}")
        self.emit = emit
        self.pre_aggregate = bool(pre_aggregate)
        self._pending = {}  # id(store) -> [(keys, values)] of the current task

    @property
    def output_schema(self):
        return spark_schema_of(self.key_dtype, self.value_schema) if self.emit else None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pending"] = {}
        return state

    def prepare(self, df, key_columns):
        """The micro-batch aggregated per key in Spark (count and sum), before the operator's
        shuffle: Spark aggregates each input partition first and merges after the shuffle, as
        its own streaming aggregation does, so only one row per key and batch reaches Python.
        The operator calls this on the driver; the tasks then see :data:`PARTIAL_COUNT` and
        :data:`PARTIAL_SUM` columns, each key once per partition."""
        if not self.pre_aggregate:
            return df
        from pyspark.sql import functions as F

        names = self.key_columns or self.key_dtype.names
        value = F.col(f"`{self.value_column}`")
        if self.sum_dtype.kind == "f":
            value = value.cast("double")
        return df.groupBy(*names).agg(F.count(F.lit(1)).alias(PARTIAL_COUNT),
                                      F.coalesce(F.sum(value), F.lit(0)).alias(PARTIAL_SUM))

    def __call__(self, store, batch):
        keys = columns_from_arrow(batch, self.key_dtype, self.key_columns)
        partial = batch.schema.get_field_index(PARTIAL_COUNT) >= 0
        if partial:  # from prepare(): the keys are distinct in the whole partition
            distinct = keys
            counts = column_to_numpy(batch.column(_column_index(batch, PARTIAL_COUNT)), np.int64, PARTIAL_COUNT)
            sums = column_to_numpy(batch.column(_column_index(batch, PARTIAL_SUM)), self.sum_dtype, PARTIAL_SUM,
                                   null_value=0)
        else:
            amounts = column_to_numpy(batch.column(_column_index(batch, self.value_column)), self.sum_dtype,
                                      self.value_column, null_value=0)
            order, starts = group_rows(keys)
            distinct = keys[order[starts]]
            counts = np.diff(np.append(starts, len(keys)))
            sums = np.add.reduceat(amounts[order], starts) if len(starts) else amounts[:0]
        if not len(distinct):
            return None
        old, found = store.get_batch(distinct)
        new = np.empty(len(distinct), dtype=self.value_schema)
        new[self.count_field] = np.where(found, old[self.count_field], 0) + counts
        new[self.sum_field] = np.where(found, old[self.sum_field], 0) + sums
        store.put_batch(distinct, new)
        if self.emit:
            pending = self._pending.setdefault(id(store), [[], True])
            pending[0].append((distinct, new))
            pending[1] = pending[1] and partial
        return None

    def finish(self, store):
        parts, distinct = self._pending.pop(id(store), [[], True])
        if not self.emit or not parts:
            return None
        if len(parts) == 1:
            keys, values = parts[0]
        elif distinct:  # partial aggregates: every key came once
            keys = np.concatenate([k for k, _ in parts])
            values = np.concatenate([v for _, v in parts])
        else:  # a key may be in several Arrow batches: emit it once, with its final totals
            everything = np.concatenate([k for k, _ in parts])
            order, starts = group_rows(everything)
            keys = everything[order[starts]]
            values, _found = store.get_batch(keys)
        return to_record_batch(keys, values)


# -- the operator --------------------------------------------------------------------------------

_STATUS_DDL = ("partition_id int, rows_in long, batches_in int, rows_out long, num_keys long, "
               "memory_used_bytes long, already_loaded boolean, worker string, open_s double, fn_s double, "
               "write_s double, commit_s double, custom_metrics string, commit_id string, base_commit_id string")
_STATUS_SCHEMA = pa.schema([
    ("partition_id", pa.int32()), ("rows_in", pa.int64()), ("batches_in", pa.int32()), ("rows_out", pa.int64()),
    ("num_keys", pa.int64()), ("memory_used_bytes", pa.int64()), ("already_loaded", pa.bool_()),
    ("worker", pa.string()), ("open_s", pa.float64()), ("fn_s", pa.float64()), ("write_s", pa.float64()),
    ("commit_s", pa.float64()), ("custom_metrics", pa.string()), ("commit_id", pa.string()),
    ("base_commit_id", pa.string()),
])


@dataclasses.dataclass(frozen=True)
class _PartitionTask:
    """Everything a task needs; pickled into the job (nothing here needs the caller's module)."""

    state_info: StatefulOperatorStateInfo
    store_name: str
    key_dtype: np.dtype
    value_dtype: np.dtype
    conf: StateStoreConf
    fn: object
    arrow_schema: object  # pyarrow.Schema of the output, or None
    output_dir: str  # where part-<p>.parquet goes, or None
    coordinator_address: tuple
    authkey: bytes
    generation: int


_generations = {}  # provider id -> generation of the last task that used it in this process
_generations_lock = threading.Lock()


def _retire_stale_instances(task, provider_id, coordinator):
    """Unload what this worker must not reuse: other runs' instances of the same store, and
    this run's instance if it was used before a re-execution (another generation) or the
    coordinator says another worker loaded the store since."""
    for other in registry.loaded_provider_ids():
        if other != provider_id and other.store_id == provider_id.store_id:
            registry.unload(other)
            with _generations_lock:
                _generations.pop(other, None)
    with _generations_lock:
        previous = _generations.get(provider_id)
        _generations[provider_id] = task.generation
    if not registry.is_loaded(provider_id):
        return
    stale = previous != task.generation
    if not stale and coordinator is not None:
        stale = not coordinator.verify_if_instance_active(provider_id, executor.worker_executor_id())
    if stale:
        log.info("reloading %s from files (a batch was re-executed, or another worker loaded it since)",
                 provider_id.store_id)
        registry.unload(provider_id)


def conform_output(out, schema, where):
    """``out`` (a RecordBatch or Table that ``fn`` returned) as batches of exactly ``schema``, cast
    safely; ``where`` names the function in errors. Every runner of ``fn`` shares it."""
    if isinstance(out, pa.Table):
        return _conform_batches(out.to_batches(), schema, where)
    if not isinstance(out, pa.RecordBatch):
        raise TypeError(f"{where} must return a pyarrow.RecordBatch or None, got {type(out).__name__}")
    return _conform_batches([out], schema, where)


def _conform_batches(batches, schema, where):
    if schema is None:
        raise ValueError(f"{where} returned rows, but the operator has no output_schema")
    out = []
    for batch in batches:
        if batch.schema.names != schema.names:
            if sorted(batch.schema.names) != sorted(schema.names):
                raise ValueError(f"{where} returned columns {batch.schema.names}; the output schema has "
                                 f"{schema.names}")
            batch = batch.select(schema.names)
        columns = []
        for column, field in zip(batch.columns, schema):
            if column.type != field.type:
                try:
                    column = column.cast(field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise ValueError(f"{where}: column '{field.name}' ({column.type}) does not cast to the "
                                     f"output type {field.type}: {e}") from None
            columns.append(column)
        out.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return out


def _write_output(task, partition_id, batches):
    files = open_store_files(task.output_dir, task.conf.storage_options, task.conf.local_cache_dir)

    def write(f):
        writer = pq.ParquetWriter(f, task.arrow_schema)
        for batch in batches:
            writer.write_batch(batch)
        writer.close()

    files.write_atomic(f"part-{partition_id:05d}.parquet", write)


def _checked_partition(batch, partition_id):
    """``batch`` without :data:`PARTITION_COLUMN`, after checking that every row's key hashes to
    ``partition_id``: a row in another partition's task would update the wrong store."""
    i = batch.schema.get_field_index(PARTITION_COLUMN)
    if i < 0:
        raise RuntimeError(f"the operator's column {PARTITION_COLUMN} is missing from the task's rows")
    routed = batch.column(i).to_numpy(zero_copy_only=False)
    if len(routed) and (routed.min() != partition_id or routed.max() != partition_id):
        other = int(routed[routed != partition_id][0])
        raise RuntimeError(
            f"rows of state partition {other} reached the task of partition {partition_id}: the job's partitioning "
            f"was changed after the operator's repartition (by adaptive execution or a rule that merges or splits "
            f"shuffle partitions); no store was changed")
    return batch.remove_column(i)


def _run_partition(task, batches):
    """The body of partition ``p``'s task (see the module docstring, step 3)."""
    from pyspark import TaskContext

    started = time.perf_counter()
    partition_id = TaskContext.get().partitionId()
    coordinator = executor.ensure_worker_registry(task.coordinator_address, task.authkey)
    provider_id = task.state_info.provider_id(partition_id, task.store_name)
    _retire_stale_instances(task, provider_id, coordinator)
    store, already_loaded = executor.open_store(provider_id, task.key_dtype, task.value_dtype,
                                                task.state_info.store_version, task.conf,
                                                commit_id=task.state_info.commit_id(partition_id))
    opened = time.perf_counter()
    fn = task.fn
    outputs, rows_in, batches_in = [], 0, 0
    try:
        for batch in batches:
            batch = _checked_partition(batch, partition_id)
            rows_in += batch.num_rows
            batches_in += 1
            out = fn(store, batch)
            if out is not None:
                outputs += conform_output(out, task.arrow_schema, "fn")
        finish = getattr(fn, "finish", None)
        if callable(finish):
            out = finish(store)
            if out is not None:
                outputs += conform_output(out, task.arrow_schema, "fn.finish")
        ran = time.perf_counter()
        if task.output_dir is not None:
            _write_output(task, partition_id, outputs)
        written = time.perf_counter()
        store.commit()
    except BaseException:
        if not store.has_committed:
            store.abort()
        raise
    committed = time.perf_counter()
    metrics = store.metrics
    status = {
        "partition_id": [partition_id], "rows_in": [rows_in], "batches_in": [batches_in],
        "rows_out": [sum(b.num_rows for b in outputs)], "num_keys": [metrics.num_keys],
        "memory_used_bytes": [metrics.memory_used_bytes], "already_loaded": [already_loaded],
        "worker": [executor.worker_executor_id()], "open_s": [opened - started], "fn_s": [ran - opened],
        "write_s": [written - ran], "commit_s": [committed - written],
        "custom_metrics": [json.dumps(metrics.custom_metrics)], "commit_id": [store.commit_id],
        "base_commit_id": [store.base_commit_id],
    }
    yield pa.RecordBatch.from_pydict(status, schema=_STATUS_SCHEMA)


def _partition_function(task):
    def run_partition(batches):
        return _run_partition(task, batches)
    return run_partition


_SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
_ADAPTIVE = "spark.sql.adaptive.enabled"


@contextlib.contextmanager
def _job_settings(spark, settings):
    """SQL settings of ``spark`` changed for one job and restored afterwards."""
    conf = spark.conf
    before = {key: conf.get(key, None) for key in settings}
    for key, value in settings.items():
        conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                conf.unset(key)
            else:
                conf.set(key, value)


_THREAD_RUN_ID = re.compile(r"runId = ([0-9a-fA-F-]{36})")


def _streaming_query_run(df):
    """``(run_id, session)`` of the streaming query whose ``foreachBatch`` is running, or
    ``(None, None)`` outside one. ``session`` is the one that started the query (where a
    listener sees it terminate), if found."""
    from pyspark.sql import SparkSession

    spark = df.sparkSession
    query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    if not query_id:
        return None, None
    # foreachBatch runs in a clone of the session that started the query; the original
    # session (usually the first one created) knows the query.
    candidates = [SparkSession.getActiveSession(), getattr(SparkSession, "_instantiatedSession", None), spark]
    for session in candidates:
        if session is None:
            continue
        try:
            query = session.streams.get(query_id)
        except Exception:  # a stopped session, a clone without the query
            continue
        if query is not None:
            return uuid.UUID(query.runId), session
    # Spark names the stream execution thread "... [id = <id>, runId = <runId>]", and py4j
    # calls from foreachBatch run on that thread.
    try:
        name = spark.sparkContext._jvm.java.lang.Thread.currentThread().getName()
    except Exception:
        name = ""
    match = _THREAD_RUN_ID.search(name or "")
    return (uuid.UUID(match.group(1)), None) if match else (None, None)


def _termination_listener_class():
    from pyspark.sql.streaming import StreamingQueryListener

    class _DeactivateOnTermination(StreamingQueryListener):
        """Deactivates a query run's store instances at the coordinator when it terminates."""

        def __init__(self, operator):
            self.operator = operator

        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            pass

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            try:
                self.operator._run_ended(uuid.UUID(str(event.runId)))
            except Exception as e:  # never fail Spark's listener bus
                log.warning("could not deactivate the state stores of run %s: %s", event.runId, e)

    return _DeactivateOnTermination


def commit_log(operator_dir, storage_options=None):
    """The batch records of the operator at ``operator_dir`` (``<checkpoint>/<operator_id>``)."""
    return EpochLog(f"{operator_dir}/{COMMITS_DIR}", storage_options)


def read_commit_record(records, batch_id):
    """The record of ``batch_id`` in ``records`` (:func:`commit_log`), checked, its
    ``commit_ids`` and ``base_commit_ids`` tuples; None if there is none. ValueError naming
    the file if it is not a batch record."""
    try:
        record = records.read(batch_id)
    except FileNotFoundError:
        return None
    where = records.path(batch_id)
    if (not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT
            or record.get("batch_id") != batch_id or not isinstance(record.get("num_partitions"), int)):
        raise ValueError(f"{where} is not the record of batch {batch_id} of a statecore operator")
    for ids in ("commit_ids", "base_commit_ids"):
        record[ids] = checked_commit_ids(record.get(ids), record["num_partitions"], where)
    return record


class StatefulOperator:
    """A stateful operator for ``foreachBatch``: ``process(df, batch_id)`` runs ``fn(store,
    batch)`` over the rows of ``df`` hash-partitioned by ``key_columns``, each partition with
    its own store, and returns the output DataFrame (see the module docstring).

    Parameters
    ----------
    checkpoint_location : str
        The state root (a path or fsspec URL, kept exactly as given in store ids): stores go
        to ``<checkpoint_location>/<operator_id>/<partition>[/<store_name>]``.
    operator_id : int
    num_partitions : int
        Fixed for the life of the checkpoint (recorded on first use).
    key_columns : sequence of str
        The columns rows are partitioned by; they must determine the state key (normally
        the key schema's fields).
    key_schema, value_schema : numpy structured dtypes
    fn : callable ``(StateStore, pyarrow.RecordBatch) -> pyarrow.RecordBatch | None``
        Optionally with ``fn.finish(store) -> RecordBatch | None``, called once per
        partition after the last batch. Defined anywhere: a test module or notebook helper
        is shipped by value.
    output_schema : pyspark StructType, DDL string, or None
        The schema of the batches ``fn`` returns (cast to it exactly; the columns must be the
        same). None: ``fn`` returns nothing, and ``process`` returns an empty DataFrame.
    conf : StateStoreConf or dict, optional
        A dict goes through ``StateStoreConf.from_spark_conf``; default: the session's
        ``spark.sql.streaming.*`` and ``spark.statecore.*`` settings, read at the first
        ``process`` (a provider class of Spark's own, such as RocksDB for Spark's operators,
        is ignored there).
    store_name : str, default "default"
    coordinator : bool or StateStoreCoordinatorRef, default True
        True: the driver's coordinator (:func:`pyspark_glue.driver.coordinator_for`);
        False/None: none.
    query_run_id : uuid.UUID, optional
        The run id outside streaming queries (default: a uuid4 per instance).
    output_batches_to_retain : int, default 2
        How many batches' outputs (the latest ones) are kept on disk.

    Attributes
    ----------
    last_progress : dict or None
        Of the last ``process``: ``batch_id``, ``query_run_id``, ``committed_version``,
        ``rows_in``, ``rows_out``, ``state_keys``, ``memory_used_bytes``, ``custom_metrics``
        (summed over partitions), ``stores_already_loaded`` and
        ``stores_loaded_from_files`` (tasks whose store was already in their Python worker),
        ``re_execution``, ``seconds``, and ``partitions`` (the per-partition status rows).
    """

    def __init__(self, checkpoint_location, operator_id, num_partitions, key_columns, key_schema, value_schema,
                 fn, output_schema, conf=None, *, store_name="default", coordinator=True, query_run_id=None,
                 output_batches_to_retain=2):
        if not isinstance(checkpoint_location, str) or not checkpoint_location:
            raise ValueError(f"checkpoint_location must be a non-empty str, got {checkpoint_location!r}")
        if not isinstance(operator_id, int) or isinstance(operator_id, bool) or operator_id < 0:
            raise ValueError(f"operator_id must be an int >= 0, got {operator_id!r}")
        if not isinstance(num_partitions, int) or isinstance(num_partitions, bool) or num_partitions < 1:
            raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
        if isinstance(key_columns, str):
            key_columns = [key_columns]
        key_columns = list(key_columns)
        if not key_columns or not all(isinstance(c, str) for c in key_columns):
            raise ValueError(f"key_columns must be a non-empty list of column names, got {key_columns!r}")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(output_batches_to_retain, int) or output_batches_to_retain < 1:
            raise ValueError(f"output_batches_to_retain must be an int >= 1, got {output_batches_to_retain!r}")
        if query_run_id is not None and not isinstance(query_run_id, uuid.UUID):
            raise TypeError(f"query_run_id must be a uuid.UUID, got {type(query_run_id).__name__}")
        self.checkpoint_location = checkpoint_location
        self.operator_id = operator_id
        self.num_partitions = num_partitions
        self.key_columns = key_columns
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.fn = fn
        self.store_name = store_name
        self.output_batches_to_retain = output_batches_to_retain
        self.last_progress = None
        self._output_schema_arg = output_schema
        self._conf_arg = conf
        self._coordinator_arg = coordinator
        self._own_run_id = query_run_id or uuid.uuid4()
        self._lock = threading.Lock()
        self._resolved = False
        self._metadata_checked = False
        self._runs = {}  # run id -> [generation, last batch id processed]
        self._current_run = None
        self._listener = None  # (session, listener)
        self._closed = False

    # -- paths ---------------------------------------------------------------------------------

    @property
    def operator_dir(self):
        return f"{self.checkpoint_location.rstrip('/')}/{self.operator_id}"

    def output_dir(self, batch_id):
        """Where the output of ``batch_id`` is written (as given to fsspec)."""
        return f"{self.operator_dir}/{OUTPUT_DIR}/{batch_id}"

    def _files(self, location):
        return open_store_files(location, self.conf.storage_options, self.conf.local_cache_dir)

    # -- set-up on the driver ---------------------------------------------------------------------

    def _resolve(self, spark):
        if self._resolved:
            return
        from pyspark.sql.types import StructType

        conf = self._conf_arg
        if conf is None:
            try:
                settings = spark.conf.getAll
                settings = dict(settings() if callable(settings) else settings)
            except Exception:
                settings = {}
            # A session's provider class configures Spark's own stateful operators (RocksDB,
            # say); it is statecore's business only when it names a statecore provider.
            provider = settings.get(_PROVIDER_CLASS_KEY, "")
            if provider.startswith("org.apache.spark."):
                settings.pop(_PROVIDER_CLASS_KEY)
            conf = StateStoreConf.from_spark_conf(settings)
        elif not isinstance(conf, StateStoreConf):
            conf = StateStoreConf.from_spark_conf(conf)
        self.conf = conf
        schema = self._output_schema_arg
        if isinstance(schema, str):
            schema = StructType.fromDDL(schema)
        if schema is not None and not isinstance(schema, StructType):
            raise TypeError(f"output_schema must be a StructType, a DDL string or None, got {type(schema).__name__}")
        self.output_schema = schema
        if schema is not None:
            from pyspark.sql.pandas.types import to_arrow_schema
            self._arrow_schema = to_arrow_schema(schema, timezone="UTC")
        else:
            self._arrow_schema = None
        coordinator = self._coordinator_arg
        if coordinator is True:
            from pyspark_glue import driver
            coordinator = driver.coordinator_for(spark)
        self.coordinator = coordinator or None
        ship_function_module(self.fn)
        self._resolved = True

    def _metadata(self, df):
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        missing = [c for c in self.key_columns if c not in types]
        if missing:
            raise ValueError(f"key column '{missing[0]}' is not in the DataFrame (columns: {df.columns})")
        return {"format": _METADATA_FORMAT, "operator_id": self.operator_id, "num_partitions": self.num_partitions,
                "key_columns": self.key_columns, "key_column_types": [types[c] for c in self.key_columns],
                "store_name": self.store_name, "key_schema": self.key_schema.describe(),
                "value_schema": self.value_schema.describe()}

    def _check_metadata(self, df):
        ours = self._metadata(df)  # also checks the key columns of every batch
        if self._metadata_checked:
            if ours["key_column_types"] != self._recorded["key_column_types"]:
                self._compare(ours, self._recorded)
            return
        files = self._files(self.operator_dir)
        payload = json.dumps(ours, indent=1).encode()
        try:
            files.write_atomic(OPERATOR_METADATA_FILE, lambda f: f.write(payload), overwrite=False)
            recorded = ours
        except FileExistsError:
            try:
                recorded = json.loads(files.read_bytes(OPERATOR_METADATA_FILE))
            except ValueError as e:
                raise ValueError(f"unreadable operator metadata {files.path(OPERATOR_METADATA_FILE)}: {e}") from None
            self._compare(ours, recorded)
        self._recorded = recorded
        self._metadata_checked = True

    def _compare(self, ours, recorded):
        where = self._files(self.operator_dir).path(OPERATOR_METADATA_FILE)
        if recorded.get("num_partitions") != ours["num_partitions"]:
            raise ValueError(
                f"operator {self.operator_id} at {self.operator_dir} was created with num_partitions="
                f"{recorded.get('num_partitions')}, but this operator has num_partitions={ours['num_partitions']}: "
                f"the number of partitions of a stateful operator is fixed for the life of its checkpoint "
                f"(keys are routed by hash modulo that number); use {recorded.get('num_partitions')}, or start "
                f"from a new checkpoint ({where})")
        if recorded.get("key_columns") != ours["key_columns"]:
            raise ValueError(f"operator {self.operator_id} at {self.operator_dir} partitions by key columns "
                             f"{recorded.get('key_columns')}, not {ours['key_columns']} ({where})")
        if recorded.get("key_column_types") != ours["key_column_types"]:
            raise ValueError(
                f"operator {self.operator_id}: key columns {ours['key_columns']} have types "
                f"{ours['key_column_types']}, but the checkpoint was written with {recorded.get('key_column_types')}: "
                f"rows would be routed to other partitions; cast them back ({where})")
        if recorded.get("store_name", "default") != ours["store_name"]:
            raise ValueError(f"operator {self.operator_id} at {self.operator_dir} uses store name "
                             f"{recorded.get('store_name')!r}, not {ours['store_name']!r} ({where})")
        for part in ("key_schema", "value_schema"):
            if [list(f) for f in recorded.get(part, [])] != [list(f) for f in ours[part]]:
                raise SchemaMismatchError(f"the {part.replace('_', ' ')} {ours[part]} of operator {self.operator_id} "
                                          f"differs from the one its checkpoint was written with: "
                                          f"{recorded.get(part)} ({where})")

    # -- runs ----------------------------------------------------------------------------------------

    def _run_for(self, df, batch_id):
        """The run id and generation of this batch; notices new runs and re-executions."""
        run_id, session = _streaming_query_run(df)
        if run_id is None:
            run_id = self._own_run_id
        with self._lock:
            previous = self._current_run
            self._current_run = run_id
            run = self._runs.setdefault(run_id, [0, None])
            re_execution = run[1] is not None and batch_id <= run[1]
            if re_execution:
                run[0] += 1
            run[1] = batch_id
            generation = run[0]
        if previous is not None and previous != run_id:
            self._run_ended(previous)
        if session is not None and self.coordinator is not None:
            self._listen_for_termination(session)
        return run_id, generation, re_execution

    def _listen_for_termination(self, session):
        with self._lock:
            if self._listener is not None:
                return
            listener = _termination_listener_class()(self)
            self._listener = (session, listener)
        try:
            session.streams.addListener(listener)
        except Exception as e:
            log.warning("cannot watch for query termination (instances are deactivated at the next run or "
                        "at close()): %s", e)

    def _run_ended(self, run_id):
        with self._lock:
            known = self._runs.pop(run_id, None) is not None
            if self._current_run == run_id:
                self._current_run = None
        if known and self.coordinator is not None:
            try:
                self.coordinator.deactivate_instances(run_id)
                log.info("deactivated the state store instances of run %s", run_id)
            except Exception as e:
                log.warning("could not deactivate the state store instances of run %s: %s", run_id, e)

    def close(self):
        """Deactivate the current run's instances and stop listening for query termination.
        The operator may not be used afterwards."""
        with self._lock:
            runs = list(self._runs)
            listener, self._listener = self._listener, None
            self._closed = True
        for run_id in runs:
            self._run_ended(run_id)
        if listener is not None:
            session, listener = listener
            try:
                session.streams.removeListener(listener)
            except Exception as e:
                log.debug("removing the termination listener: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- a micro-batch -------------------------------------------------------------------------------

    def process(self, df, batch_id):
        """Run micro-batch ``batch_id`` of ``df`` through the operator (one Spark job) and
        return its output as a DataFrame read from the materialized files.

        Raises
        ------
        ValueError
            A bad ``batch_id``, a key column missing from ``df``, or a checkpoint written
            with another number of partitions, other key columns or key column types.
        SchemaMismatchError
            A checkpoint written with other key or value schemas.
        pyspark.errors.PythonException
            ``fn`` (or a store) failed in a task; the failed partitions' stores are aborted.
        """
        if self._closed:
            raise RuntimeError("this StatefulOperator was closed")
        if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
            raise ValueError(f"batch_id must be an int >= 0, got {batch_id!r}")
        begun = time.perf_counter()
        spark = df.sparkSession
        self._resolve(spark)
        self._check_metadata(df)
        run_id, generation, re_execution = self._run_for(df, batch_id)
        records = self.commit_log()
        recorded = records.epochs()
        records.delete([b for b in recorded if b >= batch_id])  # a re-execution replaces them (module docstring)
        state_info = StatefulOperatorStateInfo(self.checkpoint_location, run_id, self.operator_id, batch_id,
                                               self.num_partitions, self._base_commit_ids(batch_id))
        output_dir = self.output_dir(batch_id) if self._arrow_schema is not None else None
        coordinator = self.coordinator
        task = _PartitionTask(
            state_info=state_info, store_name=self.store_name, key_dtype=self.key_schema.dtype,
            value_dtype=self.value_schema.dtype, conf=self.conf, fn=self.fn, arrow_schema=self._arrow_schema,
            output_dir=output_dir,
            coordinator_address=None if coordinator is None else tuple(coordinator.address),
            authkey=None if coordinator is None else coordinator.authkey, generation=generation)
        started = time.perf_counter()
        sc = spark.sparkContext
        description = sc.getLocalProperty("spark.job.description")  # streaming sets one per batch
        sc.setJobDescription(f"statecore operator {self.operator_id} batch {batch_id}")
        try:
            with _job_settings(spark, {_SHUFFLE_PARTITIONS: str(self.num_partitions), _ADAPTIVE: "false"}):
                rows = self._routed(df).mapInArrow(_partition_function(task), _STATUS_DDL).collect()
        finally:
            sc.setJobDescription(description)
        seconds = time.perf_counter() - started
        statuses = sorted((r.asDict() for r in rows), key=lambda r: r["partition_id"])
        seen = [s["partition_id"] for s in statuses]
        if seen != list(range(self.num_partitions)):
            raise RuntimeError(f"operator {self.operator_id} batch {batch_id}: expected one task per partition "
                               f"0..{self.num_partitions - 1}, got partitions {seen}")
        self._record_batch(records, state_info, statuses)
        records.delete([b for b in recorded if b < batch_id - self.conf.min_versions_to_retain])
        self._record_progress(batch_id, run_id, statuses, re_execution, seconds)
        self._clean_outputs(batch_id)
        if output_dir is None:
            from pyspark.sql.types import StructType
            out = spark.createDataFrame([], StructType([]))
        else:
            out = spark.read.schema(self.output_schema).parquet(self._spark_path(output_dir))
        self.last_progress["driver_s"] = {"before_job": started - begun, "job": seconds,
                                          "after_job": time.perf_counter() - started - seconds}
        return out

    # -- the batch record ------------------------------------------------------------------------------

    def commit_log(self):
        """The operator's batch records (module docstring, "The batch record")."""
        conf = self.conf if self._resolved else self._conf_arg  # before the first process: the conf given
        if isinstance(conf, dict):
            conf = StateStoreConf.from_spark_conf(conf)
        return commit_log(self.operator_dir, None if conf is None else conf.storage_options)

    def commit_record(self, batch_id):
        """The record of ``batch_id`` (a dict; ``commit_ids`` and ``base_commit_ids`` are
        tuples, one id per partition), or None if there is none."""
        return read_commit_record(self.commit_log(), batch_id)

    def _base_commit_ids(self, batch_id):
        """Per partition, the attempt of version ``batch_id`` the batch's tasks open: the
        winners recorded for ``batch_id - 1``; None (the default lineage) without a record."""
        if batch_id == 0:
            return (ROOT_COMMIT_ID.hex(),) * self.num_partitions
        record = self.commit_record(batch_id - 1)
        if record is None:
            log.info("operator %s: no record of batch %d under %s; batch %d opens the default lineage",
                     self.operator_id, batch_id - 1, self.commit_log().location, batch_id)
            return None
        return record["commit_ids"]

    def _record_batch(self, records, state_info, statuses):
        """Write the record of the batch whose job just succeeded: each partition's winner."""
        batch_id = state_info.store_version
        if state_info.commit_ids is not None:
            opened = tuple(s["base_commit_id"] for s in statuses)
            if opened != state_info.commit_ids:
                raise RuntimeError(f"operator {self.operator_id} batch {batch_id}: the tasks opened version "
                                   f"{batch_id} at {opened}, not at the recorded {state_info.commit_ids}")
        records.write(batch_id, {
            "format": _RECORD_FORMAT, "batch_id": batch_id, "version": batch_id + 1,
            "num_partitions": self.num_partitions, "store_name": self.store_name,
            "run_id": str(state_info.query_run_id), "commit_ids": [s["commit_id"] for s in statuses],
            "base_commit_ids": [s["base_commit_id"] for s in statuses]})

    def _routed(self, df):
        """``df`` (after ``fn.prepare``, if any) hash-partitioned by the key columns into the
        operator's partitions, each row tagged with the partition its key belongs to."""
        from pyspark.sql import functions as F

        prepare = getattr(self.fn, "prepare", None)
        if callable(prepare):
            df = prepare(df, self.key_columns)
            missing = [c for c in self.key_columns if c not in df.columns]
            if missing:
                raise ValueError(f"fn.prepare returned a DataFrame without the key column '{missing[0]}' "
                                 f"(columns: {df.columns})")
        keys = ", ".join(f"`{c}`" for c in self.key_columns)
        return (df.repartition(self.num_partitions, *self.key_columns)
                .withColumn(PARTITION_COLUMN, F.expr(f"pmod(hash({keys}), {self.num_partitions})")))

    def _record_progress(self, batch_id, run_id, statuses, re_execution, seconds):
        metrics = StateStoreMetrics.combine(
            StateStoreMetrics(s["num_keys"], s["memory_used_bytes"], json.loads(s["custom_metrics"]))
            for s in statuses)
        loaded = sum(1 for s in statuses if s["already_loaded"])
        self.last_progress = {
            "batch_id": batch_id, "query_run_id": str(run_id), "committed_version": batch_id + 1,
            "num_partitions": self.num_partitions,
            "rows_in": sum(s["rows_in"] for s in statuses), "rows_out": sum(s["rows_out"] for s in statuses),
            "state_keys": metrics.num_keys, "memory_used_bytes": metrics.memory_used_bytes,
            "custom_metrics": metrics.custom_metrics, "stores_already_loaded": loaded,
            "stores_loaded_from_files": len(statuses) - loaded, "re_execution": re_execution,
            "seconds": seconds, "partitions": statuses,
        }

    def _spark_path(self, location):
        """``location`` as Spark's readers take it (``file://`` + absolute path when local)."""
        fs, path = fsspec.core.url_to_fs(location, **(self.conf.storage_options or {}))
        return f"file://{path}" if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)

    def _clean_outputs(self, batch_id):
        """Delete the outputs of batches older than the last ``output_batches_to_retain``."""
        oldest_kept = batch_id - self.output_batches_to_retain + 1
        if oldest_kept <= 0:
            return
        fs, base = fsspec.core.url_to_fs(f"{self.operator_dir}/{OUTPUT_DIR}", **(self.conf.storage_options or {}))
        try:
            entries = fs.ls(base, detail=False)
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit() and int(name) < oldest_kept:
                try:
                    fs.rm(entry, recursive=True)
                except OSError as e:
                    log.warning("could not delete old output %s: %s", entry, e)
