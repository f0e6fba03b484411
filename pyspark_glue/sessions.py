"""``SessionWindow``: Spark's ``groupBy(session_window(event_time, gap), keys).agg(...)`` with a
watermark, in append mode.

Each on-time row opens a session ``[event time, event time + gap)``; sessions of a key that
overlap or touch merge, with the sessions the key already has in state. A row is late, and
dropped, when its own session's end is at or below the previous batch's watermark (judged
row by row, before merging). A session is emitted once, at the end of the first batch whose
eviction watermark reaches its end, then removed; a later on-time row opens a new session
even where it overlaps the emitted one. State: each key's open sessions as a
:class:`~statecore.keyed_lists.KeyedLists` (the default store holds how many), and an
:class:`~statecore.expiry.ExpiryIndex` by session end (``docs/event-time.md``).
"""
import numpy as np
import pyarrow as pa

from statecore.grouping import group_rows
from statecore.keyed_lists import COUNT_FIELD, KeyedLists

from pyspark_glue.aggregate_specs import Aggregates
from pyspark_glue.arrow import columns_from_arrow, dtype_of_columns, numpy_to_arrow
from pyspark_glue.event_time import event_times_us, parse_duration_us
from pyspark_glue.keyed_event_fn import KeyedEventTimeFn
from pyspark_glue.operator_fn import TaskHandler
from pyspark_glue.windows import window_spark_type, window_struct

__all__ = ["SessionWindow", "segmented_running_max"]

_START, _END = "__start", "__end"
_SESSIONS = "sessions"


def segmented_running_max(values, group_starts):
    """The running maximum of ``values`` restarted at each index in ``group_starts`` (which
    includes 0): log2(n) vectorized passes, no Python loop per element."""
    out = np.array(values, copy=True)
    n = len(out)
    group = np.zeros(n, dtype=np.int64)
    if n:
        group[group_starts[1:]] = 1
        group = np.cumsum(group)
    step = 1
    while step < n:
        same = group[step:] == group[:-step]
        np.maximum(out[step:], np.where(same, out[:-step], out[step:]), out=out[step:])
        step *= 2
    return out


def _spans(owner, sessions):
    """``(owner, start, end)`` of each session as one comparable value (for ``np.isin``)."""
    spans = np.empty(len(owner), dtype=[("o", "<i8"), ("s", "<i8"), ("e", "<i8")])
    spans["o"], spans["s"], spans["e"] = owner, sessions[_START], sessions[_END]
    return spans.view("V24").ravel()


class SessionWindow(KeyedEventTimeFn):
    """``fn`` for :class:`~pyspark_glue.StatefulOperator`: aggregates per key and session.

    Parameters
    ----------
    key_columns : sequence of str
    event_time : str
        A timestamp column.
    delay : str or datetime.timedelta
        The watermark delay.
    gap : str or datetime.timedelta
        The session gap (positive): a session ends ``gap`` after its last row.
    aggregates : dict
        As for :class:`~pyspark_glue.WindowedAggregate`.
    key_widths : dict, optional
        Bytes per value of each string or binary key column.

    Output: the key columns, ``session_window`` (``struct<start, end>``), the aggregates.
    """

    def __init__(self, key_columns, event_time, delay, gap, aggregates=None, *, key_widths=None):
        super().__init__(key_columns, event_time, delay, key_widths)
        self.gap_us = parse_duration_us(gap, "the session gap", positive=True, months=False)
        self.aggregates = Aggregates(aggregates if aggregates is not None else {"count": ("count", "*")})
        self.value_schema = None

    def resolve_schemas(self, spark_schema):
        """The state's schemas and the output schema, from the input's columns."""
        from pyspark.sql.types import StructField, StructType

        self.key_schema = dtype_of_columns(spark_schema, self.key_columns, self.key_widths)
        self.value_schema = np.dtype([(COUNT_FIELD, "<i8")])
        self.aggregates.bind(spark_schema)
        self.session_dtype = np.dtype([(_START, "<i8"), (_END, "<i8")] + self.aggregates.state_fields)
        types = {f.name: f.dataType for f in spark_schema.fields}
        self.timestamp_type = types[self.event_time].simpleString()
        self.output_schema = StructType(
            [StructField(c, types[c], True) for c in self.key_columns]
            + [StructField("session_window", window_spark_type(self.timestamp_type), True)]
            + [StructField(name, t, True) for name, t in self.aggregates.output_fields()])

    @property
    def state_stores(self):
        sessions = KeyedLists.schemas(self.key_schema, self.session_dtype)
        return {_SESSIONS: sessions["entries"], **super().state_stores}

    def lists(self, context):
        return KeyedLists(context.store, context.stores[_SESSIONS], self.key_schema, self.session_dtype)

    def add_rows(self, context, keys, fresh):
        """Merge the batch's sessions (all its Arrow batches at once) into each key's held ones;
        file in the expiry index only the sessions that are new or whose end moved."""
        order, starts = group_rows(keys)
        distinct = keys[order[starts]]
        row_owner = np.empty(len(keys), dtype=np.int64)
        row_owner[order] = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(keys))))
        lists = self.lists(context)
        counts = lists.counts(distinct)
        held_owner, held = lists.read(distinct, counts)
        merged_owner, merged = self.merge(np.concatenate([held_owner, row_owner]), np.concatenate([held, fresh]))
        lists.replace(distinct, merged_owner, merged, counts)
        moved = ~np.isin(_spans(merged_owner, merged), _spans(held_owner, held))
        self.index(context).add(merged[_END][moved], distinct[merged_owner[moved]])

    def merge(self, owner, sessions):
        """The sessions of each owner merged where they overlap or touch: ``(owner, session)``
        sorted by owner, then start."""
        order = np.lexsort((sessions[_START], owner))
        owner, sessions = owner[order], sessions[order]
        group_starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        reach = segmented_running_max(sessions[_END], group_starts)
        opens = np.ones(len(sessions), dtype=bool)
        opens[1:] = sessions[_START][1:] > reach[:-1]
        opens[group_starts] = True
        runs = np.flatnonzero(opens)
        merged = self.aggregates.combine(sessions, runs)
        merged[_START] = sessions[_START][runs]
        merged[_END] = np.maximum.reduceat(sessions[_END], runs)
        return owner[runs], merged

    def open(self, context):
        return _SessionTask(self, context)


class _SessionTask(TaskHandler):
    """One task of a :class:`SessionWindow`: each batch's on-time rows kept as sessions; at the
    end, merged into the held sessions at once, and the closed sessions emitted and forgotten."""

    def __init__(self, fn, context):
        super().__init__(fn, context)
        self.pending = []  # the batch's on-time rows as (keys, one session each)

    def process(self, batch):
        fn, context, pending = self.fn, self.context, self.pending
        times = event_times_us(batch, fn.event_time)
        on_time = times + fn.gap_us > context.watermarks.for_late_events_us
        context.late_rows += int(len(times) - on_time.sum())
        rows = np.flatnonzero(on_time)
        if len(rows):
            fresh = np.zeros(len(rows), dtype=fn.session_dtype)  # each row its own session
            fresh[_START] = times[rows]
            fresh[_END] = times[rows] + fn.gap_us
            per_row = np.arange(len(rows))
            fn.aggregates.aggregate(fn.aggregates.inputs(batch, rows), per_row, per_row, fresh)
            pending.append((columns_from_arrow(batch, fn.key_schema, fn.key_columns)[rows], fresh))
        return None

    def finish(self):
        """Merge the batch's rows, then emit and forget the sessions the eviction watermark closes."""
        fn, context, pending = self.fn, self.context, self.pending
        if pending:
            fn.add_rows(context, np.concatenate([k for k, _ in pending]), np.concatenate([f for _, f in pending]))
        limit = context.watermarks.for_eviction_us
        _, due = fn.index(context).pop_until(limit)
        if not len(due):
            return None
        order, starts = group_rows(due)
        keys = due[order[starts]]
        lists = fn.lists(context)
        counts = lists.counts(keys)
        owner, sessions = lists.read(keys, counts)
        closed = sessions[_END] <= limit
        if not closed.any():
            return None
        lists.replace(keys, owner[~closed], sessions[~closed], counts)
        out_keys, out = keys[owner[closed]], sessions[closed]
        columns = [numpy_to_arrow(out_keys[name]) for name in fn.key_schema.names]
        columns.append(window_struct(out[_START], out[_END], fn.timestamp_type))
        aggregates = fn.aggregates.output_columns(out)
        return pa.RecordBatch.from_arrays(columns + list(aggregates.values()),
                                          names=fn.key_columns + ["session_window"] + list(aggregates))
