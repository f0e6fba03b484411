"""Testing an operator's ``fn`` without Spark: :class:`Harness`.

A :class:`Harness` runs a :class:`~pyspark_glue.StatefulProcessor` (or a built-in, or any
``fn`` a :class:`~pyspark_glue.StatefulOperator` takes) over micro-batches given by hand, in
this process, on real statecore stores in a directory: each batch's rows are routed to the
partitions by Spark's hash, each partition runs the operator task's own steps
(:func:`~pyspark_glue.operator_task.run_fn`: ``open``, the rows, ``finish``; then every store
commits), with the operator's watermark rule and a processing time from a clock you set. What
the processor sees, the late rows it drops, the timers it fires and the TTLs it ends are
therefore those of a Spark run given the same batches and times. Between batches the state
can be read: a variable's value for some keys, the timers of a key, the rows of a store.
How to use it: ``docs/processor.md``, "Testing a processor".
"""
import copy
import shutil
import tempfile

import numpy as np
import pyarrow as pa

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.snapshot_at import start_store_empty
from statecore.spark_hash import FIXED_WIDTH_TYPES

from pyspark_glue.arrow import to_record_batch
from pyspark_glue.clocks import ManualClock, as_millis
from pyspark_glue.event_time import batch_watermarks
from pyspark_glue.operator_fn import FROM_FN, FunctionSettings, PartitionContext, contract_of
from pyspark_glue.operator_task import (INITIAL_STATE_COLUMN, abort_uncommitted, commit_stores, routed_partitions,
                                        run_fn)
from pyspark_glue.state_vars import StateHandle

__all__ = ["Harness"]


def as_table(rows, schema=None, what="rows"):
    """``rows`` as a pyarrow Table: a Table, a RecordBatch, a pandas DataFrame, or a list of
    dicts (``schema``, a pyarrow schema, fixes the column types; without it Arrow infers
    them: ints are int64, datetimes timestamps)."""
    if isinstance(rows, pa.Table):
        table = rows
    elif isinstance(rows, pa.RecordBatch):
        table = pa.Table.from_batches([rows])
    elif isinstance(rows, list):
        if rows and not all(isinstance(r, dict) for r in rows):
            raise TypeError(f"{what}: a list of rows must hold dicts (column name -> value)")
        if not rows and schema is None:
            raise ValueError(f"{what}: an empty list has no columns: pass schema= (a pyarrow schema)")
        table = pa.Table.from_pylist(rows, schema=schema)
    elif type(rows).__name__ == "DataFrame" and hasattr(rows, "to_records"):  # pandas, without importing it
        table = pa.Table.from_pandas(rows, preserve_index=False)
    else:
        raise TypeError(f"{what} must be a pyarrow Table or RecordBatch, a pandas DataFrame or a list of dicts, "
                        f"got {type(rows).__name__}")
    if schema is not None and table.schema != schema:
        table = table.select(schema.names).cast(schema)
    return table


class Harness:
    """Runs ``fn`` over micro-batches given by hand, without Spark (module docstring).

    Parameters
    ----------
    fn : a StatefulProcessor, a built-in, or any ``fn`` of StatefulOperator
    num_partitions : int, default 1
        The state partitions rows are routed to (by Spark's hash of the key columns: more
        than one needs key columns of fixed-width types).
    key_columns, key_schema, value_schema, output_schema, event_time, delay
        As for :class:`~pyspark_glue.StatefulOperator` (default: ``fn``'s attributes).
    initial_state : rows (as :meth:`run` takes them), optional
        Given to ``fn.handle_initial_state`` in the first batch, as ``initial_state=`` is.
    clock : object with ``now_ms()``, default ``ManualClock(0)``
        The processing time of each batch; :meth:`run`'s ``processing_time`` sets it.
    checkpoint_location : str, optional
        Where the stores go (``<location>/0/<partition>/<store>``); default a temporary
        directory, removed by :meth:`close`.
    conf : StateStoreConf or dict, optional

    Attributes
    ----------
    batch_id : int
        The id of the next batch.
    last_progress : dict
        Of the last batch: ``batch_id``, ``batch_timestamp_ms``, ``rows_in``, ``rows_out``,
        ``late_rows``, the watermarks (with event time) and ``fn_counts``.
    """

    def __init__(self, fn, num_partitions=1, *, key_columns=FROM_FN, key_schema=FROM_FN, value_schema=FROM_FN,
                 output_schema=FROM_FN, event_time=FROM_FN, delay=FROM_FN, initial_state=None, clock=None,
                 checkpoint_location=None, conf=None, store_name="default"):
        if not isinstance(num_partitions, int) or isinstance(num_partitions, bool) or num_partitions < 1:
            raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
        self.fn, self.num_partitions, self.store_name = fn, num_partitions, store_name
        # the operator's own reading of fn and the arguments (pyspark_glue.operator_fn)
        self._settings = settings = FunctionSettings(fn, key_columns, key_schema, value_schema, output_schema,
                                                     event_time, delay, initial_state is not None)
        self.key_columns, self.event_time, self.delay_us = settings.key_columns, settings.event_time, settings.delay_us
        self._initial_state = None if initial_state is None else as_table(initial_state, what="initial_state")
        self.clock = ManualClock(0) if clock is None else clock
        self.conf = conf if isinstance(conf, StateStoreConf) else StateStoreConf.from_spark_conf(conf or {})
        self._own_dir = checkpoint_location is None
        self.checkpoint_location = tempfile.mkdtemp(prefix="statecore-harness-") if self._own_dir \
            else checkpoint_location
        self.batch_id = 0
        self.last_progress = None
        self._input_schema = None  # the first batch's Arrow schema: every batch must have it
        self._marks = None  # the last batch's watermarks, as a batch record holds them
        self._clock_us = None  # the processor's clock in the last batch (for reading state)
        self._providers = {}  # (partition, store name) -> provider, kept open between batches
        self._committed_stores = set()  # the stores the last batch committed

    # -- set-up -------------------------------------------------------------------------------

    # The schemas: given, fn's attributes, or resolved from the first batch's columns.
    key_schema = property(lambda self: self._settings.key_schema)
    value_schema = property(lambda self: self._settings.value_schema)
    output_schema = property(lambda self: self._settings.output_schema)
    _arrow_schema = property(lambda self: self._settings.arrow_schema)

    def _resolve(self, schema):
        """The schemas, from ``fn`` or the first batch's columns, as the operator resolves them."""
        from pyspark_glue.spark_internals import spark_schema_from_arrow

        spark_schema = spark_schema_from_arrow(schema)
        self._settings.resolve_input(spark_schema, "the rows")
        types = {f.name: f.dataType.simpleString() for f in spark_schema.fields}
        self._key_types = tuple(types[c] for c in self.key_columns)
        if self.num_partitions > 1 and not all(t in FIXED_WIDTH_TYPES for t in self._key_types):
            raise ValueError(f"routing rows to {self.num_partitions} partitions here needs key columns of fixed-width "
                             f"types ({', '.join(FIXED_WIDTH_TYPES)}); these are {self._key_types}: use "
                             f"num_partitions=1")
        self._input_schema = schema

    def _store_schemas(self):
        extra = self._settings.extra_stores(self.store_name)
        return {self.store_name: (self.key_schema.dtype, self.value_schema.dtype),
                **{name: (key.dtype, value.dtype) for name, (key, value) in extra.items()}}

    def _provider(self, partition, name, key, value):
        provider = self._providers.get((partition, name))
        if provider is None:
            store_id = StateStoreId(self.checkpoint_location, 0, partition, store_name=name)
            provider = create_and_init_provider(store_id, key, value, self.conf)
            self._providers[(partition, name)] = provider
        return provider

    def _open(self, partition):
        """``(stores, new)``: every store of ``partition`` at the current version, and the names
        of those that start empty in it (all in the first batch; later, one the previous batch
        did not have, started empty at the version as the operator starts a store new to it)."""
        stores, new = {}, set()
        try:
            for name, (key, value) in self._store_schemas().items():
                provider = self._provider(partition, name, key, value)
                commit_id = None
                if self.batch_id == 0:
                    new.add(name)
                elif name not in self._committed_stores:
                    commit_id = start_store_empty(provider.state_store_id, self.batch_id, key, value, self.conf)
                    new.add(name)
                stores[name] = provider.get_store(self.batch_id, commit_id)
        except BaseException:
            for store in stores.values():
                store.abort()
            raise
        return stores, new

    # -- batches --------------------------------------------------------------------------------

    def run(self, rows=None, *, processing_time=None, advance_watermark_to=None):
        """Run the next micro-batch over ``rows`` (a Table, RecordBatch, pandas DataFrame or
        list of dicts; None: a batch without rows) and return its output as a pyarrow Table
        (None for an ``fn`` without output), partitions in order.

        ``processing_time`` (a ``datetime`` or int milliseconds) sets the clock before the
        batch begins; ``advance_watermark_to`` raises the batch's eviction watermark to at
        least that, as :meth:`StatefulOperator.process` does. If ``fn`` fails, every store is
        aborted: the batch can be run again."""
        if processing_time is not None:
            self.clock.set(processing_time)
        table = self._batch_rows(rows)
        timestamp_ms = self.clock.now_ms()
        watermarks = None
        if self.event_time is not None:
            advance = None if advance_watermark_to is None else as_millis(advance_watermark_to,
                                                                          "advance_watermark_to")
            watermarks = batch_watermarks(self._marks, self.delay_us, advance)
        elif advance_watermark_to is not None:
            raise ValueError("advance_watermark_to needs an event-time column")
        if self.batch_id == 0 and self._initial_state is not None:
            table = _with_initial_state(table, self._initial_state, self.key_columns)
        parts = self._route(table)
        shipped = _pickled(self.fn)
        outputs, late_rows, counts, maxima, rows_in, opened = [], 0, {}, [], 0, []
        try:  # every partition runs, then every store commits: a failure leaves none committed
            for partition in range(self.num_partitions):
                stores, new = self._open(partition)
                opened.append(stores)
                context = PartitionContext(partition, self.batch_id, stores, self.store_name, watermarks,
                                           timestamp_ms, new)
                fn = shipped.copy()  # each task gets its own copy, as Spark ships it
                out, n, _, max_event = run_fn(contract_of(fn), context, parts[partition], self._arrow_schema,
                                              self.event_time)
                outputs += out
                rows_in += n
                late_rows += context.late_rows
                if max_event is not None:
                    maxima.append(max_event)
                for name, value in context.counts.items():
                    counts[name] = counts.get(name, 0) + int(value)
            for stores in opened:
                commit_stores(stores, self.store_name)
        except BaseException:
            for stores in opened:
                abort_uncommitted(stores)
            raise
        self._committed_stores = set(self._store_schemas())
        self._finish_batch(watermarks, maxima, timestamp_ms)
        self.last_progress = {"batch_id": self.batch_id - 1, "batch_timestamp_ms": timestamp_ms, "rows_in": rows_in,
                              "rows_out": sum(b.num_rows for b in outputs), "late_rows": late_rows,
                              "fn_counts": counts}
        if watermarks is not None:
            self.last_progress.update(watermark_for_late_events_ms=watermarks.for_late_events,
                                      watermark_for_eviction_ms=watermarks.for_eviction)
        self._settings.contract.observe(self.last_progress)
        if self._arrow_schema is None:
            return None
        return pa.Table.from_batches(outputs, schema=self._arrow_schema)

    def _batch_rows(self, rows):
        if rows is None:
            if self._input_schema is None:
                raise ValueError("the first batch needs rows (or an empty Table): its columns give the schemas")
            return self._input_schema.empty_table()
        table = as_table(rows, self._input_schema, f"the rows of batch {self.batch_id}")
        if self._input_schema is None:
            self._resolve(table.schema)
        return table

    def _route(self, table):
        """Per partition, the rows whose key hashes to it (one batch, or none)."""
        batches = [b for b in table.combine_chunks().to_batches() if b.num_rows]
        if self.num_partitions == 1:
            return [batches]
        parts = [[] for _ in range(self.num_partitions)]
        for batch in batches:
            routed = routed_partitions(batch, self.num_partitions, self.key_columns, self._key_types)
            for partition in np.unique(routed):
                parts[int(partition)].append(batch.filter(pa.array(routed == partition)))
        return parts

    def _finish_batch(self, watermarks, maxima, timestamp_ms):
        if watermarks is not None:
            self._marks = {"for_eviction_ms": watermarks.for_eviction,
                           "max_event_time_us": max(maxima) if maxima else None}
            self._clock_us = watermarks.for_eviction_us
        else:
            self._clock_us = timestamp_ms * 1000
        self.batch_id += 1

    # -- reading state ---------------------------------------------------------------------------

    def _keys(self, keys):
        if self.batch_id == 0:
            raise RuntimeError("no batch has run yet: there is no state to read")
        keys = np.asarray(keys) if isinstance(keys, np.ndarray) else np.array(
            [k if isinstance(k, tuple) else (k,) for k in keys], dtype=self.key_schema.dtype)
        if keys.dtype != self.key_schema.dtype:
            raise TypeError(f"keys must have the key dtype {self.key_schema.dtype}, got {keys.dtype}")
        return keys

    def _partitions_of(self, keys):
        if self.num_partitions == 1:
            return np.zeros(len(keys), dtype=np.int64)
        batch = to_record_batch(keys)
        return routed_partitions(batch.select(self.key_columns), self.num_partitions, self.key_columns,
                                 self._key_types)

    def _variables(self, stores):
        """The processor's variables bound to ``stores`` (read at the last batch's clock)."""
        handle = StateHandle(self.key_schema.dtype, stores, self._clock_us)
        copy.copy(self.fn).init(handle)  # binds the variables to a copy: fn itself stays unbound
        return handle

    def _read(self, keys, read):
        """``read(handle, keys of one partition)`` over the partitions the keys are in, the
        results put back in the order of ``keys``: a ``which`` (first array of a listing) is
        mapped back to positions in ``keys``."""
        keys = self._keys(keys)
        partitions = self._partitions_of(keys)
        results = []
        for partition in np.unique(partitions):
            mine = np.flatnonzero(partitions == partition)
            stores, _ = self._open(int(partition))
            try:
                results.append((mine, read(self._variables(stores), keys[mine])))
            finally:
                for store in stores.values():
                    store.abort()
        return results

    def _variable(self, handle, name, kind):
        variable = handle.variables.get(name)
        if variable is None or type(variable).__name__ != kind:
            declared = {n: type(v).__name__ for n, v in handle.variables.items()}
            raise KeyError(f"the processor declares no {kind} named {name!r} (it declares {declared})")
        return variable

    def value(self, name, keys):
        """``(values, found)`` of the ValueState ``name`` for each key (a structured array of
        the key dtype, or a list of key tuples / scalars)."""
        keys = self._keys(keys)
        values, found = None, np.zeros(len(keys), dtype=bool)
        for mine, (v, f) in self._read(keys, lambda h, k: self._variable(h, name, "ValueState").get(k)):
            if values is None:
                values = np.zeros(len(keys), dtype=v.dtype)
            values[mine], found[mine] = v, f
        return values, found

    def list(self, name, keys):
        """``(which, items)`` of the ListState ``name``: ``items[j]`` is in the list of
        ``keys[which[j]]``, each list in order."""
        return self._listing(keys, lambda h, k: self._variable(h, name, "ListState").get(k))

    def map(self, name, keys):
        """``(which, user_keys, values)`` of the MapState ``name``: each entry of the map of
        ``keys[which[j]]``."""
        return self._listing(keys, lambda h, k: self._variable(h, name, "MapState").items(k))

    def timers(self, keys):
        """``(which, times)``: the registered timers of each key, ascending (microseconds)."""
        return self._listing(keys, lambda h, k: h.timers.list(k))

    def _listing(self, keys, read):
        keys = self._keys(keys)
        if len(np.unique(keys)) != len(keys):
            raise ValueError("the keys of a listing must be distinct")
        parts = [(mine[which], *rest) for mine, (which, *rest) in self._read(keys, read)]
        which = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        order = np.argsort(which, kind="stable")  # by key, each key's entries in their order
        return (which[order], *(np.concatenate([p[i] for p in parts])[order] for i in range(1, len(parts[0]))))

    def rows(self, store_name=None):
        """``(keys, values)``: every row of a store (default: the operator's own) over all
        partitions, as numpy structured arrays, at the current version."""
        store_name = store_name or self.store_name
        schemas = self._store_schemas()
        if store_name not in schemas:
            raise KeyError(f"no store {store_name!r} (the stores: {sorted(schemas)})")
        key, value = schemas[store_name]
        keys, values = [np.zeros(0, dtype=key)], [np.zeros(0, dtype=value)]
        for partition in range(self.num_partitions):
            provider = self._provider(partition, store_name, key, value)
            for k, v in provider.version_rows(self.batch_id):
                keys.append(k)
                values.append(v)
        return np.concatenate(keys), np.concatenate(values)

    # -- life ------------------------------------------------------------------------------------

    def restart(self, fn=None):
        """Close every store, as a query stopping does; the next batch opens them from their
        files. ``fn``: a new ``fn`` to go on with (an upgraded processor)."""
        for provider in self._providers.values():
            provider.close()
        self._providers = {}
        if fn is not None:
            self.fn = fn
            self._settings.contract = contract_of(fn)  # the schemas and columns stay as resolved

    def close(self):
        """Close the stores; remove the directory if the harness made it."""
        self.restart()
        if self._own_dir:
            shutil.rmtree(self.checkpoint_location, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _pickled:
    """``fn`` pickled once (by Spark's pickler), for copies as tasks get them: nothing a task
    sets on its copy outlives the task, as nothing does on Spark."""

    def __init__(self, fn):
        from pyspark import cloudpickle

        self._loads, self._blob = cloudpickle.loads, cloudpickle.dumps(fn)

    def copy(self):
        return self._loads(self._blob)


def _with_initial_state(table, initial, key_columns):
    """The first batch's rows with the initial state's, marked, as the operator unions them."""
    missing = [c for c in key_columns if c not in initial.column_names]
    if missing:
        raise ValueError(f"the initial state has no key column '{missing[0]}' (columns: {initial.column_names})")
    marked = table.append_column(INITIAL_STATE_COLUMN, pa.array(np.zeros(table.num_rows, dtype=bool)))
    initial = initial.append_column(INITIAL_STATE_COLUMN, pa.array(np.ones(initial.num_rows, dtype=bool)))
    return pa.concat_tables([marked, initial], promote_options="permissive")
