"""What the event-time built-ins share: their key and event-time arguments, the task each
runs per partition, and the expiry index their state leaves by (``docs/event-time.md``)."""
from statecore.expiry import ExpiryIndex

from pyspark_glue.event_time import parse_duration_us
from pyspark_glue.operator_fn import OperatorFunction, added_aggregate_problems

__all__ = ["KeyedEventTimeFn"]

_HEADS, _ENTRIES = "expiry_heads", "expiry_entries"


class KeyedEventTimeFn(OperatorFunction):
    """Base of :class:`~pyspark_glue.Deduplicate`, :class:`~pyspark_glue.WindowedAggregate` and
    :class:`~pyspark_glue.SessionWindow`: ``key_columns``, ``event_time``, ``delay`` and
    ``key_widths`` checked once; an :class:`~statecore.expiry.ExpiryIndex` over the
    ``index_key`` schema in two stores of the partition. Each defines ``open`` (its task's
    handler)."""

    def schema_change_problems(self, plan):
        return added_aggregate_problems(plan)

    def __init__(self, key_columns, event_time, delay, key_widths=None):
        if isinstance(key_columns, str):
            key_columns = [key_columns]
        self.key_columns = list(key_columns)
        if not self.key_columns or not all(isinstance(c, str) for c in self.key_columns):
            raise ValueError(f"key_columns must be a non-empty list of column names, got {key_columns!r}")
        if not isinstance(event_time, str) or not event_time:
            raise ValueError(f"event_time must be a column name, got {event_time!r}")
        self.event_time = event_time
        self.delay = delay
        self.delay_us = parse_duration_us(delay, "the watermark delay")
        self.key_widths = dict(key_widths or {})
        self.key_schema = self.output_schema = None

    @property
    def index_key(self):
        """The keys the expiry index files (default: the state's key schema)."""
        return self.key_schema

    @property
    def state_stores(self):
        schemas = ExpiryIndex.schemas(self.index_key)
        return {_HEADS: schemas["heads"], _ENTRIES: schemas["entries"]}

    def index(self, context):
        """The task's expiry index."""
        return ExpiryIndex(context.stores[_HEADS], context.stores[_ENTRIES], self.index_key)
