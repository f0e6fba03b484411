"""Event time: durations, the event-time column, and the watermark rule of Spark 4.

Times inside statecore are int64 microseconds since the epoch (Spark's timestamps); the
watermark, as in Spark, is kept in milliseconds. A batch has two watermarks: rows at or
below the *previous* batch's watermark are late, state at or below the *current* one is
evicted (``docs/event-time.md``).
"""
import dataclasses
import datetime
import re

import numpy as np
import pyarrow as pa

__all__ = ["parse_duration_us", "Watermarks", "next_watermark_ms", "batch_watermarks", "check_event_time_column", "event_times_us",
           "MICROS_PER_MILLI"]

MICROS_PER_MILLI = 1000
_UNIT_MICROS = {
    "microsecond": 1, "millisecond": 1000, "second": 1_000_000, "minute": 60_000_000, "hour": 3_600_000_000,
    "day": 86_400_000_000, "week": 7 * 86_400_000_000,
    # Spark counts a month as 31 days in a watermark delay (and a year as 12 of them).
    "month": 31 * 86_400_000_000, "year": 12 * 31 * 86_400_000_000,
}
_ALIASES = {"us": "microsecond", "ms": "millisecond", "s": "second", "sec": "second", "min": "minute",
            "h": "hour", "d": "day", "w": "week"}
_TERM = re.compile(r"\s*([+-]?\d+)\s*([a-z]+)\s*")


def parse_duration_us(value, what, *, positive=False, months=True):
    """``value`` (a Spark interval string such as ``"10 seconds"`` or ``"1 hour 30 minutes"``,
    or a ``datetime.timedelta``) in microseconds. ValueError naming ``what`` if it is not one,
    is negative (or not positive when ``positive``), or uses months or years where
    ``months`` is False (windows and gaps: Spark refuses them there too)."""
    if isinstance(value, datetime.timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    elif isinstance(value, str):
        text = value.strip().lower()
        if text.startswith("interval"):
            text = text[len("interval"):]
        micros, pos = 0, 0
        while pos < len(text):
            m = _TERM.match(text, pos)
            if not m:
                raise ValueError(f"{what} {value!r} is not an interval such as '10 seconds' or '1 hour 30 minutes'")
            word = m.group(2)
            unit = _ALIASES.get(word) or (word[:-1] if word.endswith("s") else word)
            if unit not in _UNIT_MICROS:
                raise ValueError(f"{what} {value!r}: unknown unit {m.group(2)!r} (use microseconds, milliseconds, "
                                 f"seconds, minutes, hours, days or weeks)")
            if unit in ("month", "year") and not months:
                raise ValueError(f"{what} {value!r}: months and years have no fixed length here (as in Spark)")
            micros += int(m.group(1)) * _UNIT_MICROS[unit]
            pos = m.end()
        if pos == 0:
            raise ValueError(f"{what} {value!r} is empty")
    else:
        raise TypeError(f"{what} must be an interval string such as '10 seconds' or a datetime.timedelta, "
                        f"got {type(value).__name__}")
    if micros < 0 or (positive and micros == 0):
        raise ValueError(f"{what} must be {'positive' if positive else '>= 0'}, got {value!r}")
    return micros


@dataclasses.dataclass(frozen=True)
class Watermarks:
    """The two watermarks of a batch, in milliseconds: rows whose event time is at or below
    ``for_late_events`` are late; state that expires at or below ``for_eviction`` goes."""

    for_late_events: int
    for_eviction: int

    @property
    def for_late_events_us(self):
        return self.for_late_events * MICROS_PER_MILLI

    @property
    def for_eviction_us(self):
        return self.for_eviction * MICROS_PER_MILLI


def next_watermark_ms(previous_ms, max_event_time_us, delay_us):
    """The watermark after a batch whose largest event time was ``max_event_time_us`` (None:
    no rows): Spark's ``max(previous, max event time in ms - delay)``, never below 0."""
    if max_event_time_us is None:
        return previous_ms
    return max(previous_ms, max_event_time_us // MICROS_PER_MILLI - delay_us // MICROS_PER_MILLI, 0)


def batch_watermarks(previous, delay_us, advance_to_ms=None):
    """The :class:`Watermarks` of a batch from the previous batch's (a batch record's
    ``watermarks``: ``for_eviction_ms`` and ``max_event_time_us``; None for the first batch):
    late rows against the previous eviction watermark; eviction at that one advanced by the
    previous batch's largest event time less the delay, and raised to ``advance_to_ms``."""
    if previous is None:
        late = eviction = 0
    else:
        late = previous["for_eviction_ms"]
        eviction = next_watermark_ms(late, previous["max_event_time_us"], delay_us)
    if advance_to_ms is not None:
        eviction = max(eviction, advance_to_ms)
    return Watermarks(late, eviction)


def check_event_time_column(spark_schema, column):
    """ValueError naming ``column`` unless it is a timestamp column of ``spark_schema``."""
    from pyspark.sql.types import TimestampNTZType, TimestampType

    fields = {f.name: f for f in spark_schema.fields}
    if column not in fields:
        raise ValueError(f"the event-time column '{column}' is not in the DataFrame (columns: {list(fields)})")
    if not isinstance(fields[column].dataType, (TimestampType, TimestampNTZType)):
        raise ValueError(f"the event-time column '{column}' must be a timestamp, not "
                         f"{fields[column].dataType.simpleString()} (cast it with to_timestamp)")


def event_times_us(batch, column):
    """The event times of an Arrow batch's rows, int64 microseconds; ValueError on nulls."""
    i = batch.schema.get_field_index(column)
    if i < 0:
        raise ValueError(f"the event-time column '{column}' is missing from the rows")
    col = batch.column(i)
    if col.null_count:
        raise ValueError(f"the event-time column '{column}' has {col.null_count} null value(s): rows need an "
                         f"event time (filter them out first)")
    if not pa.types.is_timestamp(col.type):
        raise ValueError(f"the event-time column '{column}' must be a timestamp, not {col.type}")
    if col.type.unit != "us":
        col = col.cast(pa.timestamp("us", col.type.tz))
    return np.asarray(col.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
