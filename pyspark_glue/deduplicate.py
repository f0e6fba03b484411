"""``Deduplicate``: Spark's ``withWatermark(event_time, delay).dropDuplicatesWithinWatermark(keys)``.

The first row of each key is kept (output with the input's columns); later rows of the key
are dropped until the key's state expires, ``delay`` after the kept row's event time, once
the watermark reaches that. Late rows (event time at or below the previous batch's
watermark) are dropped and counted. The state is one row per key (its expiry) plus an
:class:`~statecore.expiry.ExpiryIndex`, so eviction costs what expires
(``docs/event-time.md``).
"""
import numpy as np

from statecore.grouping import group_rows

from pyspark_glue.arrow import columns_from_arrow, dtype_of_columns
from pyspark_glue.event_time import event_times_us
from pyspark_glue.keyed_event_fn import KeyedEventTimeFn
from pyspark_glue.operator_fn import TaskHandler

__all__ = ["Deduplicate", "EXPIRES_FIELD"]

EXPIRES_FIELD = "expires_at_us"


class Deduplicate(KeyedEventTimeFn):
    """``fn`` for :class:`~pyspark_glue.StatefulOperator`: drop rows whose key was seen within
    ``delay`` of event time, as ``dropDuplicatesWithinWatermark`` does.

    Parameters
    ----------
    key_columns : sequence of str
    event_time : str
        A timestamp column.
    delay : str or datetime.timedelta
        The watermark delay (``"10 minutes"``); also how long a key is remembered.
    key_widths : dict, optional
        Bytes per value of each string or binary key column (required for those).

    The key schema is taken from the first batch's column types (and recorded with the
    operator); the output has the input's columns.
    """

    value_schema = np.dtype([(EXPIRES_FIELD, "<i8")])

    def __init__(self, key_columns, event_time, delay, *, key_widths=None):
        super().__init__(key_columns, event_time, delay, key_widths)

    def resolve_schemas(self, spark_schema):
        """Take the key schema from the input's columns, and the output schema (the input's)."""
        self.key_schema = dtype_of_columns(spark_schema, self.key_columns, self.key_widths)
        self.output_schema = spark_schema

    def open(self, context):
        return _DeduplicateTask(self, context)


class _DeduplicateTask(TaskHandler):
    """One task of a :class:`Deduplicate`: the first row of each new key kept; at the end, the
    new keys filed in the expiry index and the expired ones forgotten."""

    def __init__(self, fn, context):
        super().__init__(fn, context)
        self.kept_keys, self.kept_expiry = [], []  # the keys kept in each Arrow batch, and their expiry times

    def process(self, batch):
        fn, store = self.fn, self.store
        context, kept_keys, kept_expiry = self.context, self.kept_keys, self.kept_expiry
        times = event_times_us(batch, fn.event_time)
        on_time = times > context.watermarks.for_late_events_us
        context.late_rows += int(len(times) - on_time.sum())
        rows = np.flatnonzero(on_time)
        if not len(rows):
            return None
        keys = columns_from_arrow(batch, fn.key_schema, fn.key_columns)[rows]
        order, starts = group_rows(keys)
        first = order[starts]  # each key's first row in the batch, ascending
        candidates = keys[first]
        _, seen = store.get_batch(candidates)
        kept = first[~seen]
        if not len(kept):
            return None
        new_keys = keys[kept]
        expires = times[rows[kept]] + fn.delay_us
        values = np.empty(len(kept), dtype=fn.value_schema)
        values[EXPIRES_FIELD] = expires
        store.put_batch(new_keys, values)
        kept_keys.append(new_keys)
        kept_expiry.append(expires)
        return batch.take(rows[kept])

    def finish(self):
        """File the batch's new keys in the expiry index (once per task), then forget the keys
        whose expiry the batch's eviction watermark reached.

        Every entry of the index is current: a key is filed once, when it enters the state,
        and leaves the state only when its entry is popped, so what ``pop_until`` returns is
        removed without checking it against the state."""
        fn, store, context = self.fn, self.store, self.context
        kept_keys, kept_expiry = self.kept_keys, self.kept_expiry
        index = fn.index(context)
        if kept_keys:
            index.add(np.concatenate(kept_expiry), np.concatenate(kept_keys))
        _, keys = index.pop_until(context.watermarks.for_eviction_us)
        if len(keys):
            store.remove_batch(keys)
        return None
