"""``StatefulProcessor``: statecore's ``transformWithStateInPandas``, with whole batches in numpy.

Subclass it, declare state variables in :meth:`~StatefulProcessor.init`, and handle a
micro-batch's rows of all keys at once in :meth:`~StatefulProcessor.handle_input` (a
:class:`Groups`: the rows grouped by key once, the distinct keys, where each key's rows
start); due timers come to :meth:`~StatefulProcessor.handle_expired_timers` as arrays of keys
and times. An instance is an :class:`~pyspark_glue.OperatorFunction`: its ``open(context)``
returns a :class:`ProcessorTask`, which runs the handlers on the task's own copy of the
processor (its variables bound to the task's stores). The order within a batch, the clocks
and an example are in ``docs/processor.md``.
"""
import copy

import numpy as np
import pyarrow as pa

from statecore.grouping import group_rows

from pyspark_glue.arrow import column, column_to_numpy, columns_from_arrow, dtype_of_columns
from pyspark_glue.event_time import event_times_us, parse_duration_us
from pyspark_glue.operator_fn import OperatorFunction, TaskHandler
from pyspark_glue.operator_task import INITIAL_STATE_COLUMN
from pyspark_glue.state_vars import StateHandle

__all__ = ["StatefulProcessor", "ProcessorTask", "Groups", "TIME_MODES"]

TIME_MODES = ("none", "event_time", "processing_time")
_PROTOCOL = frozenset(["init", "handle_input", "handle_expired_timers", "handle_initial_state", "open", "prepare",
                       "observe", "resolve_schemas", "state_stores", "value_schema", "key_schema", "key_columns"])


class Groups:
    """A micro-batch's rows of one partition, grouped by key.

    Attributes
    ----------
    keys : structured numpy array
        The distinct keys, one per group.
    rows : pyarrow.RecordBatch
        Every row, ordered so that each group's rows are together (groups in the order of
        their first row, rows in arrival order within a group): group ``g`` is
        ``rows[starts[g]:starts[g] + sizes[g]]``.
    starts, sizes : int64 arrays
    group : int64 array
        The group of each row of ``rows``.
    """

    def __init__(self, keys, rows, starts):
        self.keys, self.rows = keys, rows
        self.starts = np.asarray(starts, dtype=np.int64)
        self.sizes = np.diff(np.append(self.starts, rows.num_rows)).astype(np.int64)
        self.group = np.repeat(np.arange(len(self.starts), dtype=np.int64), self.sizes)

    def __len__(self):
        return len(self.keys)

    def column(self, name, dtype=None):
        """Column ``name`` of ``rows`` as numpy (``dtype``: cast to it, nulls refused)."""
        arr = column(self.rows, name)
        if dtype is not None:
            return column_to_numpy(arr, dtype, name)
        if pa.types.is_timestamp(arr.type):
            return np.asarray(arr.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
        return arr.to_numpy(zero_copy_only=False)


class StatefulProcessor(OperatorFunction):
    """Base class of a vectorized stateful processor.

    Class attributes (or instance attributes set in ``__init__``) the operator takes:
    ``key_columns``; ``key_schema`` (a structured dtype) or ``key_widths`` for string keys
    (else it comes from the input's column types); ``output_schema`` (a StructType or DDL
    string); ``time_mode`` (``"none"``, ``"event_time"`` or ``"processing_time"``), and with
    event time ``event_time`` (a timestamp column) and ``delay``.

    Methods to define: :meth:`init` (declare variables), :meth:`handle_input`, and as needed
    :meth:`handle_expired_timers`, :meth:`handle_initial_state`.
    """

    key_widths = None
    time_mode = "none"
    takes_initial_state = True

    # -- what a processor defines ------------------------------------------------------------

    def init(self, state):
        """Declare the state variables: ``self.x = state.value(name, schema, ttl=None)``,
        ``state.list(...)``, ``state.map(name, user_key_schema, schema, ttl=None)``. Called on
        a copy of the processor: on the driver (to learn the stores) and at the start of each
        task (the task's own copy, bound to its stores)."""

    def handle_input(self, groups, timers):
        """The batch's rows (:class:`Groups`); return a RecordBatch or Table of
        ``output_schema``, or None."""
        raise NotImplementedError(f"{type(self).__name__} must define handle_input(groups, timers)")

    def handle_expired_timers(self, keys, times, timers):
        """Timers at or before the clock: ``keys[i]`` has one at ``times[i]`` (microseconds),
        deleted when this returns (registering one of them here does not arm it again).
        Other timers registered here fire in a later batch. Return output or None."""
        return None

    def handle_initial_state(self, groups, timers):
        """The rows of the operator's ``initial_state`` DataFrame, in the first batch."""
        raise NotImplementedError(f"{type(self).__name__} was given an initial state but does not define "
                                  f"handle_initial_state(groups, timers)")

    # -- the operator's fn contract -----------------------------------------------------------

    value_schema = np.dtype([])  # the default store stays empty: the variables have their own

    def resolve_schemas(self, spark_schema):
        """The key schema from the input's column types (string keys need ``key_widths``)."""
        self.key_schema = dtype_of_columns(spark_schema, self.key_columns, self.key_widths)

    def _checked_mode(self):
        if self.time_mode not in TIME_MODES:
            raise ValueError(f"time_mode must be one of {TIME_MODES}, got {self.time_mode!r}")
        if self.time_mode == "event_time" and (self.event_time is None or self.delay is None):
            raise ValueError("time_mode 'event_time' needs event_time (a column) and delay")
        if self.delay is not None:
            parse_duration_us(self.delay, "the watermark delay")

    @property
    def state_stores(self):
        """Every store the processor's variables and timers use (checked on the driver before
        any store changes: a type a store cannot hold is an error naming the variable)."""
        self._checked_mode()
        if self.key_schema is None:
            raise ValueError("the processor's key_schema is not known yet")
        handle = StateHandle(self.key_schema)
        declared = copy.copy(self)  # declaring must not bind variables to the driver's instance
        declared.init(handle)
        shadowed = sorted(set(vars(declared)) & _PROTOCOL)
        if shadowed:
            raise ValueError(f"{type(self).__name__}.init assigns {shadowed[0]!r}, a method of the processor "
                             f"protocol: name the state variable otherwise")
        return handle.stores()

    def open(self, context):
        """In each task: a :class:`ProcessorTask` over a copy of the processor whose ``init``
        bound the variables to the task's stores (this instance stays unbound)."""
        return ProcessorTask(self, context)



class ProcessorTask(TaskHandler):
    """One task of a :class:`StatefulProcessor`: the task's copy of the processor (``processor``,
    its variables bound to the task's stores through ``handle``, a
    :class:`~pyspark_glue.state_vars.StateHandle`), and the batch's rows kept until
    :meth:`finish` hands them to the handlers at once."""

    def __init__(self, fn, context):
        super().__init__(fn, context)
        watermarks = context.watermarks
        self.handle = StateHandle(fn.key_schema, context.stores, self._clock_us(),
                                  processing_time_us=context.batch_timestamp_ms * 1000,
                                  watermark_us=None if watermarks is None else watermarks.for_eviction_us)
        self.processor = copy.copy(fn)
        self.processor.init(self.handle)
        self.batches, self.initial = [], []

    def _clock_us(self):
        """What the timers and TTLs compare with: the eviction watermark, the batch's
        processing time, or None (``time_mode``)."""
        if self.fn.time_mode == "event_time":
            return self.context.watermarks.for_eviction_us
        if self.fn.time_mode == "processing_time":
            return self.context.batch_timestamp_ms * 1000
        return None

    def _groups(self, batches):
        rows = pa.Table.from_batches(batches).combine_chunks().to_batches()[0] if len(batches) > 1 else batches[0]
        keys = columns_from_arrow(rows, self.fn.key_schema, self.fn.key_columns)
        order, starts = group_rows(keys)
        return Groups(keys[order[starts]], rows.take(pa.array(order)), starts)

    def process(self, batch):
        i = batch.schema.get_field_index(INITIAL_STATE_COLUMN)
        if i >= 0:  # the operator's first batch carries the initial state, marked
            marked = np.asarray(batch.column(i).to_numpy(zero_copy_only=False), dtype=bool)
            batch = batch.remove_column(i)
            if marked.any():
                self.initial.append(batch.filter(pa.array(marked)))
            batch = batch.filter(pa.array(~marked))
        if self.fn.time_mode == "event_time" and batch.num_rows:
            on_time = event_times_us(batch, self.fn.event_time) > self.context.watermarks.for_late_events_us
            self.context.late_rows += int(batch.num_rows - on_time.sum())
            batch = batch.filter(pa.array(on_time))
        if batch.num_rows:
            self.batches.append(batch)
        return None

    def finish(self):
        """Initial state (first batch), the input, then due timers, then TTL cleanup."""
        processor, handle = self.processor, self.handle
        timers = handle.timers
        out = []
        if self.initial:
            out.append(processor.handle_initial_state(self._groups(self.initial), timers))
        if self.batches:
            out.append(processor.handle_input(self._groups(self.batches), timers))
        clock = handle.now_us
        if clock is not None:
            # the timers due now fire once, registered until their handler returns (then
            # deleted: registering one of them again there does not arm it again); others the
            # handler registers wait for a later batch, due or not (Spark's
            # transformWithStateInPandas: docs/processor.md)
            keys, times = timers.pop_due(clock)
            if len(keys):
                out.append(processor.handle_expired_timers(keys, times, timers))
                timers.delete(keys, times)
            handle.expire()
        out = [o for o in out if o is not None]
        return out or None
