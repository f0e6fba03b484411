"""The processing-time clock: where a batch's processing time comes from.

A :class:`~pyspark_glue.StatefulOperator` reads its clock once per batch, on the driver, when
the batch begins; every task of the batch gets that time (``batch_timestamp_ms``), and a
processor in ``"processing_time"`` mode fires timers and ends TTLs against it. The default is
the driver's wall clock (what Spark uses); a :class:`ManualClock` is set by hand, so that a
test or a replay decides exactly when each batch happens (``docs/processor.md``, "Clocks").
A clock only needs ``now_ms()``.
"""
import datetime
import threading
import time

from pyspark_glue.event_time import parse_duration_us

__all__ = ["WallClock", "ManualClock", "as_millis"]


def as_millis(when, what):
    """``when`` (a ``datetime``, naive meaning UTC, or int milliseconds since the epoch, >= 0)
    in milliseconds; TypeError naming ``what`` otherwise."""
    if isinstance(when, datetime.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return int(when.timestamp() * 1000)
    if isinstance(when, int) and not isinstance(when, bool) and when >= 0:
        return when
    raise TypeError(f"{what} must be a datetime or int milliseconds >= 0, got {when!r}")


class WallClock:
    """The machine's clock: ``time.time()`` in milliseconds."""

    def now_ms(self):
        return int(time.time() * 1000)

    def __repr__(self):
        return "WallClock()"


class ManualClock:
    """A clock that moves only when told: :meth:`set` or :meth:`advance`. It never goes
    back (Spark's batch timestamps do not): setting an earlier time is a ValueError."""

    def __init__(self, start=0):
        self._lock = threading.Lock()
        self._now_ms = as_millis(start, "the clock's start")

    def now_ms(self):
        with self._lock:
            return self._now_ms

    def set(self, when):
        """Move the clock to ``when`` (a ``datetime`` or int milliseconds), not before now."""
        ms = as_millis(when, "the clock's time")
        with self._lock:
            if ms < self._now_ms:
                raise ValueError(f"the clock is at {self._now_ms} ms and does not go back to {ms} ms")
            self._now_ms = ms

    def advance(self, duration):
        """Move the clock on by ``duration`` (``"10 seconds"``, a ``timedelta``, or int ms)."""
        if isinstance(duration, int) and not isinstance(duration, bool):
            if duration < 0:
                raise ValueError(f"the clock does not go back: advance({duration})")
            ms = duration
        else:
            us = parse_duration_us(duration, "the clock's advance")
            if us % 1000:
                raise ValueError(f"the clock counts whole milliseconds: {duration!r} is {us} microseconds")
            ms = us // 1000
        with self._lock:
            self._now_ms += ms

    def __reduce__(self):
        """Pickles as a clock at the same time (its lock is made again): an operator's clock
        travels with it to a Spark Connect server's Python process."""
        return ManualClock, (self.now_ms(),)

    def __repr__(self):
        return f"ManualClock({self.now_ms()})"
