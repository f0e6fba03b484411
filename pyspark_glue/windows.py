"""``WindowedAggregate``: Spark's ``groupBy(window(event_time, window, slide), keys).agg(...)``
with a watermark, in append or update mode.

A row counts in every window ``[start, start + window)`` that holds its event time, starts
aligned to the slide (one window when tumbling). A (row, window) pair is late, and dropped,
when the window's end is at or below the previous batch's watermark: with sliding windows a
row may be late for one window and counted in the next. In append mode a window is emitted
once, at the end of the first batch whose eviction watermark reaches its end (ties emitted),
then removed; in update mode each batch emits the windows it changed, and windows are
removed (not emitted again) when the watermark passes them. State: one row per (window, key)
and an :class:`~statecore.expiry.ExpiryIndex` by window end (``docs/event-time.md``).
"""
import numpy as np
import pyarrow as pa

from statecore.grouping import group_rows

from pyspark_glue.aggregate_specs import Aggregates
from pyspark_glue.arrow import columns_from_arrow, dtype_of_columns, numpy_to_arrow
from pyspark_glue.event_time import event_times_us, parse_duration_us
from pyspark_glue.keyed_event_fn import KeyedEventTimeFn
from pyspark_glue.operator_fn import TaskHandler

__all__ = ["WindowedAggregate", "WINDOW_START"]

WINDOW_START = "__window_start"
OUTPUT_MODES = ("append", "update")


def window_struct(starts, ends, timestamp_type):
    """Spark's ``window`` column, ``struct<start, end>``, from microsecond arrays."""
    tz = "UTC" if timestamp_type == "timestamp" else None
    return pa.StructArray.from_arrays([pa.array(starts, pa.timestamp("us", tz)), pa.array(ends, pa.timestamp("us", tz))],
                                      names=["start", "end"])


def window_spark_type(timestamp_type):
    from pyspark.sql.types import StructField, StructType, TimestampNTZType, TimestampType

    t = TimestampType() if timestamp_type == "timestamp" else TimestampNTZType()
    return StructType([StructField("start", t, True), StructField("end", t, True)])


class WindowedAggregate(KeyedEventTimeFn):
    """``fn`` for :class:`~pyspark_glue.StatefulOperator`: aggregates per key and time window.

    Parameters
    ----------
    key_columns : sequence of str
    event_time : str
        A timestamp column.
    delay : str or datetime.timedelta
        The watermark delay.
    window, slide : str or datetime.timedelta
        The window's length and the distance between window starts (default: ``window``,
        tumbling windows). Both positive, the window at least the slide.
    aggregates : dict
        Output column -> ``(function, column)``: ``count`` (``"*"`` or a column: its
        non-null values), ``sum``, ``min``, ``max`` (null over only nulls, as in Spark).
    output_mode : "append" or "update"
    key_widths : dict, optional
        Bytes per value of each string or binary key column.

    Output: the key columns, ``window`` (``struct<start, end>``), the aggregates in order.
    """

    def __init__(self, key_columns, event_time, delay, window, slide=None, aggregates=None, output_mode="append",
                 *, key_widths=None):
        super().__init__(key_columns, event_time, delay, key_widths)
        self.window_us = parse_duration_us(window, "the window", positive=True, months=False)
        self.slide_us = self.window_us if slide is None else parse_duration_us(slide, "the slide", positive=True,
                                                                                months=False)
        if self.window_us < self.slide_us:
            raise ValueError(f"the window ({window!r}) must not be shorter than its slide ({slide!r})")
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        self.output_mode = output_mode
        self.aggregates = Aggregates(aggregates if aggregates is not None else {"count": ("count", "*")})
        self.value_schema = None

    def resolve_schemas(self, spark_schema):
        """The state's key and value schemas and the output schema, from the input's columns."""
        self.user_keys = dtype_of_columns(spark_schema, self.key_columns, self.key_widths)
        self.key_schema = np.dtype([(WINDOW_START, "<i8")] + self.user_keys.descr)
        self.aggregates.bind(spark_schema)
        self.value_schema = np.dtype(self.aggregates.state_fields)
        from pyspark.sql.types import StructField, StructType

        types = {f.name: f.dataType for f in spark_schema.fields}
        self.timestamp_type = types[self.event_time].simpleString()
        self.output_schema = StructType(
            [StructField(c, types[c], True) for c in self.key_columns]
            + [StructField("window", window_spark_type(self.timestamp_type), True)]
            + [StructField(name, t, True) for name, t in self.aggregates.output_fields()])

    def windows_of(self, times):
        """``(row, start)`` of every window each event time falls in."""
        overlapping = -(-self.window_us // self.slide_us)
        last_start = times - times % self.slide_us
        starts = last_start[:, None] - np.arange(overlapping, dtype=np.int64)[None, :] * self.slide_us
        inside = times[:, None] < starts + self.window_us
        rows = np.broadcast_to(np.arange(len(times))[:, None], starts.shape)
        return rows[inside], starts[inside]

    def add_partials(self, store, context, pending):
        """Merge the batch's partial aggregates (all its Arrow batches at once) into the state;
        returns the windows changed and their new values."""
        keys = np.concatenate([k for k, _ in pending])
        values = np.concatenate([v for _, v in pending])
        if len(pending) > 1:  # a window of a key may be in several Arrow batches
            order, starts = group_rows(keys)
            keys, values = keys[order[starts]], self.aggregates.combine(values[order], starts)
        old, found = store.get_batch(keys)
        self.aggregates.merge(old, found, values)
        store.put_batch(keys, values)
        if not found.all():
            self.index(context).add(keys[WINDOW_START][~found] + self.window_us, keys[~found])
        return keys, values

    def output(self, keys, values):
        columns = [numpy_to_arrow(keys[name]) for name in self.user_keys.names]
        columns.append(window_struct(keys[WINDOW_START], keys[WINDOW_START] + self.window_us, self.timestamp_type))
        aggregates = self.aggregates.output_columns(values)
        names = self.key_columns + ["window"] + list(aggregates)
        return pa.RecordBatch.from_arrays(columns + list(aggregates.values()), names=names)

    def open(self, context):
        return _WindowTask(self, context)


class _WindowTask(TaskHandler):
    """One task of a :class:`WindowedAggregate`: each batch's partial aggregates kept; at the
    end, merged into the state at once, emitted, and the closed windows forgotten."""

    def __init__(self, fn, context):
        super().__init__(fn, context)
        self.pending = []  # the batch's partial aggregates, per Arrow batch

    def process(self, batch):
        fn, context, pending = self.fn, self.context, self.pending
        times = event_times_us(batch, fn.event_time)
        rows, starts = fn.windows_of(times)
        on_time = starts + fn.window_us > context.watermarks.for_late_events_us
        context.late_rows += int(len(rows) - on_time.sum())
        rows, starts = rows[on_time], starts[on_time]
        if not len(rows):
            return None
        user_keys = columns_from_arrow(batch, fn.user_keys, fn.key_columns)
        keys = np.empty(len(rows), dtype=fn.key_schema)
        keys[WINDOW_START] = starts
        for name in fn.user_keys.names:
            keys[name] = user_keys[name][rows]
        order, group_starts = group_rows(keys)
        distinct = keys[order[group_starts]]
        inputs = {c: (None if v is None else v[rows], nn[rows])
                  for c, (v, nn) in fn.aggregates.inputs(batch).items()}
        partial = np.zeros(len(distinct), dtype=fn.value_schema)
        fn.aggregates.aggregate(inputs, order, group_starts, partial)
        pending.append((distinct, partial))
        return None

    def finish(self):
        """Merge the batch's rows; emit (append mode: the windows the eviction watermark
        closes; update mode: the windows this batch changed) and forget the closed windows."""
        fn, store, context, pending = self.fn, self.store, self.context, self.pending
        out = []
        if pending:
            keys, values = fn.add_partials(store, context, pending)
            if fn.output_mode == "update":
                out.append(fn.output(keys, values))
        _, closed = fn.index(context).pop_until(context.watermarks.for_eviction_us)
        if len(closed):
            values, found = store.get_batch(closed)
            closed, values = closed[found], values[found]
            if fn.output_mode == "append" and len(closed):
                out.append(fn.output(closed, values))
            store.remove_batch(closed)
        if not out:
            return None
        return pa.Table.from_batches(out)
