"""The expiry index: entries ``(time, key)`` found by time, in work proportional to what expires.

Event-time state (timers, TTL, windows, dedup ids) must be dropped when the watermark passes
it, without scanning the state. :class:`ExpiryIndex` files each entry under the time bucket
``time >> bucket_shift`` in a :class:`~statecore.keyed_lists.KeyedLists` (one list per
bucket), and remembers the lowest bucket that may hold entries. :meth:`pop_until` reads the
buckets from there up to the limit's bucket, takes every entry at or below the limit and
removes it; only the limit's own bucket can hold entries it keeps. Its cost is the entries it
returns plus one lookup per bucket of elapsed time, or, when the time jumped further than
there are non-empty buckets, one pass over the bucket heads (never the entries).

The index does not delete entries when their key's state changes: the caller checks what
:meth:`pop_until` returns against its state and ignores entries that are no longer current
(the design and the costs are in ``docs/event-time.md``).
"""
import numpy as np

from statecore.keyed_lists import COUNT_FIELD, KeyedLists

__all__ = ["ExpiryIndex", "TIME_FIELD", "DEFAULT_BUCKET_SHIFT"]

TIME_FIELD = "__time"
DEFAULT_BUCKET_SHIFT = 20  # in microseconds: buckets of about a second
_BUCKET = np.dtype([("bucket", "<i8")])
# Bookkeeping rows in the heads store, below every real bucket (times are >= 0).
_LOW = np.iinfo(np.int64).min  # count: the lowest bucket that may hold entries
_NON_EMPTY = _LOW + 1  # count: how many buckets hold entries
_SHIFT = _LOW + 2  # count: the bucket shift the index was built with
_META = np.array([(_LOW,), (_NON_EMPTY,), (_SHIFT,)], dtype=_BUCKET)
_SCAN_MIN_BUCKETS = 4096  # a jump over fewer buckets than this is looked up bucket by bucket


class ExpiryIndex:
    """Entries of ``key_dtype`` keys, each with an int64 time >= 0, over a ``heads`` and an
    ``entries`` store (:meth:`schemas`). Times are in the caller's unit (statecore's event
    time: microseconds); ``bucket_shift`` sets the bucket width to ``2**bucket_shift``."""

    def __init__(self, heads, entries, key_dtype, bucket_shift=DEFAULT_BUCKET_SHIFT):
        if not isinstance(bucket_shift, int) or not 0 <= bucket_shift <= 62:
            raise ValueError(f"bucket_shift must be an int in [0, 62], got {bucket_shift!r}")
        self.key_dtype = np.dtype(key_dtype)
        self.item_dtype = self._item_dtype(self.key_dtype)
        self.lists = KeyedLists(heads, entries, _BUCKET, self.item_dtype)
        self.heads = heads
        low, non_empty, shift = self._meta()
        if shift is not None and shift != bucket_shift:
            raise ValueError(f"this expiry index was built with bucket_shift={shift}, not {bucket_shift}")
        self.bucket_shift = bucket_shift
        self._low, self._non_empty = low, non_empty
        self._shift_recorded = shift is not None

    @staticmethod
    def _item_dtype(key_dtype):
        if TIME_FIELD in (key_dtype.names or ()):
            raise ValueError(f"a key may not have a field named {TIME_FIELD!r}")
        return np.dtype([(TIME_FIELD, "<i8")] + key_dtype.descr)

    @classmethod
    def schemas(cls, key_dtype):
        """``{"heads": (key, value), "entries": (key, value)}``: the dtypes of the two stores."""
        return KeyedLists.schemas(_BUCKET, cls._item_dtype(np.dtype(key_dtype)))

    def _meta(self):
        values, found = self.heads.get_batch(_META)
        counts = values[COUNT_FIELD]
        low = int(counts[0]) if found[0] else None
        non_empty = int(counts[1]) if found[1] else 0
        shift = int(counts[2]) if found[2] else None
        return low, non_empty, shift

    def _save_meta(self):
        meta = [(_NON_EMPTY, self._non_empty), (_SHIFT, self.bucket_shift)]
        if self._low is not None:
            meta.append((_LOW, self._low))
        keys = np.array([(k,) for k, _ in meta], dtype=_BUCKET)
        values = np.array([(v,) for _, v in meta], dtype=self.heads_value_dtype)
        self.heads.put_batch(keys, values)
        self._shift_recorded = True

    @property
    def heads_value_dtype(self):
        return np.dtype([(COUNT_FIELD, "<i8")])

    def __len__(self):
        """The number of entries (stale ones included)."""
        if not self._non_empty:
            return 0
        return int(self.lists.counts(self._non_empty_buckets(self._low, np.iinfo(np.int64).max)[0]).sum())

    @property
    def low_bucket(self):
        """The lowest bucket that may hold entries (None: the index is empty)."""
        return self._low if self._non_empty else None

    def add(self, times, keys):
        """File ``keys[i]`` under ``times[i]`` (int64, >= 0). A key may be filed several times."""
        times = np.asarray(times, dtype=np.int64)
        if len(times) != len(keys):
            raise ValueError(f"{len(times)} times but {len(keys)} keys")
        if not len(times):
            return
        if times.min() < 0:
            raise ValueError(f"expiry times must be >= 0, got {int(times.min())}")
        items = np.empty(len(times), dtype=self.item_dtype)
        items[TIME_FIELD] = times
        for name in self.key_dtype.names:
            items[name] = keys[name]
        owners = np.empty(len(times), dtype=_BUCKET)
        owners["bucket"] = times >> self.bucket_shift
        was_empty = not self._non_empty
        self._non_empty += len(self.lists.append(owners, items))
        lowest = int(owners["bucket"].min())
        self._low = lowest if was_empty or self._low is None else min(self._low, lowest)
        self._save_meta()

    def _non_empty_buckets(self, low, high):
        """``(buckets, counts)`` of the buckets in ``[low, high]`` that hold entries."""
        span = high - low + 1
        if span <= max(_SCAN_MIN_BUCKETS, 4 * self._non_empty):
            candidates = np.empty(span, dtype=_BUCKET)
            candidates["bucket"] = np.arange(low, high + 1, dtype=np.int64)
            counts = self.lists.counts(candidates)
            present = counts > 0
            return candidates[present], counts[present]
        found, counts = [], []  # a jump past more buckets than hold entries: read the heads instead
        for keys, values in self.heads.iter_batches():
            b = keys["bucket"]
            mine = (b >= low) & (b <= high) & (b > _SHIFT)
            found.append(keys[mine])
            counts.append(values[COUNT_FIELD][mine])
        buckets = np.concatenate(found) if found else np.empty(0, dtype=_BUCKET)
        counts = np.concatenate(counts) if counts else np.empty(0, dtype=np.int64)
        order = np.argsort(buckets["bucket"], kind="stable")
        return buckets[order], counts[order].astype(np.int64)

    def pop_until(self, limit):
        """Remove and return every entry whose time is at or below ``limit``: ``(times,
        keys)``, in bucket order (times within a bucket unordered)."""
        limit = int(limit)
        empty = (np.empty(0, dtype=np.int64), np.empty(0, dtype=self.key_dtype))
        if not self._non_empty or limit < 0:
            return empty
        high = limit >> self.bucket_shift
        if self._low > high:
            return empty
        buckets, counts = self._non_empty_buckets(self._low, high)
        if not len(buckets):
            self._low = high
            self._save_meta()
            return empty
        which, items = self.lists.read(buckets, counts)
        expired = items[TIME_FIELD] <= limit
        last = len(buckets) - 1
        kept_in_last = (which == last) & ~expired
        if kept_in_last.any():  # the limit's own bucket keeps its later entries
            emptied = np.arange(last)
            self.lists.clear(buckets[emptied], counts[emptied])
            self.lists.replace(buckets[last:], np.zeros(int(kept_in_last.sum()), dtype=np.int64),
                               items[kept_in_last], counts[last:])
            self._non_empty -= last
        else:
            self.lists.clear(buckets, counts)
            self._non_empty -= len(buckets)
        self._low = high
        self._save_meta()
        out = items[expired]
        keys = np.empty(len(out), dtype=self.key_dtype)
        for name in self.key_dtype.names:
            keys[name] = out[name]
        return out[TIME_FIELD].copy(), keys
