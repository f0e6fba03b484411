"""The expiry index: entries ``(time, key)`` found by time, in work proportional to what expires.

Event-time state (timers, TTL, windows, dedup ids) must be dropped when the watermark passes
it, without scanning the state. :class:`ExpiryIndex` files each entry under the time bucket
``time >> bucket_shift`` in a :class:`~statecore.keyed_lists.KeyedLists` (one list per
bucket), and remembers the lowest bucket that may hold entries. A list item is a *chunk* of
up to :attr:`ExpiryIndex.per_chunk` entries (a count and the entries' packed bytes): every
chunk of a bucket is full but its last, so the stores handle one row per chunk, not per entry. :meth:`pop_until` reads the
buckets from there up to the limit's bucket, takes every entry at or below the limit and
removes it; only the limit's own bucket can hold entries it keeps. Its cost is the entries it
returns plus one lookup per bucket of elapsed time, or, when the time jumped further than
there are non-empty buckets, one pass over the bucket heads (never the entries).

The index does not delete entries when their key's state changes: the caller checks what
:meth:`pop_until` returns against its state and ignores entries that are no longer current
(the design and the costs are in ``docs/event-time.md``).
"""
import numpy as np

from statecore.keyed_lists import COUNT_FIELD, KeyedLists, positions as _positions
from statecore.schema import as_schema

__all__ = ["ExpiryIndex", "TIME_FIELD", "DEFAULT_BUCKET_SHIFT"]

TIME_FIELD = "__time"
DEFAULT_BUCKET_SHIFT = 20  # in microseconds: buckets of about a second
_BUCKET = np.dtype([("bucket", "<i8")])
# Bookkeeping rows in the heads store, below every real bucket (times are >= 0).
_LOW = np.iinfo(np.int64).min  # count: the lowest bucket that may hold entries
_NON_EMPTY = _LOW + 1  # count: how many buckets hold entries
_SHIFT = _LOW + 2  # count: the bucket shift the index was built with
_ENTRIES = _LOW + 3  # count: how many entries the index holds
_META = np.array([(_LOW,), (_NON_EMPTY,), (_SHIFT,), (_ENTRIES,)], dtype=_BUCKET)
_SCAN_MIN_BUCKETS = 4096  # a jump over fewer buckets than this is looked up bucket by bucket
_CHUNK_BYTES = 1024  # the packed entries of one chunk, at most (and at most _CHUNK_ENTRIES)
_CHUNK_ENTRIES = 64
_FILL, _PACKED = "__fill", "__packed"


class ExpiryIndex:
    """Entries of ``key_dtype`` keys, each with an int64 time >= 0, over a ``heads`` and an
    ``entries`` store (:meth:`schemas`). Times are in the caller's unit (statecore's event
    time: microseconds); ``bucket_shift`` sets the bucket width to ``2**bucket_shift``."""

    def __init__(self, heads, entries, key_dtype, bucket_shift=DEFAULT_BUCKET_SHIFT):
        if not isinstance(bucket_shift, int) or not 0 <= bucket_shift <= 62:
            raise ValueError(f"bucket_shift must be an int in [0, 62], got {bucket_shift!r}")
        self.key_dtype = np.dtype(key_dtype)
        self._key_schema = as_schema(self.key_dtype)
        self.item_dtype = self._item_dtype(self.key_dtype)
        self.per_chunk = self._per_chunk(self.item_dtype)
        self.chunk_dtype = self._chunk_dtype(self.item_dtype)
        self.lists = KeyedLists(heads, entries, _BUCKET, self.chunk_dtype)
        self.heads = heads
        low, non_empty, shift, count = self._meta()
        if shift is not None and shift != bucket_shift:
            raise ValueError(f"this expiry index was built with bucket_shift={shift}, not {bucket_shift}")
        self.bucket_shift = bucket_shift
        self._low, self._non_empty, self._count = low, non_empty, count

    @staticmethod
    def _item_dtype(key_dtype):
        if TIME_FIELD in (key_dtype.names or ()):
            raise ValueError(f"a key may not have a field named {TIME_FIELD!r}")
        return np.dtype([(TIME_FIELD, "<i8")] + key_dtype.descr)

    @staticmethod
    def _per_chunk(item_dtype):
        return max(1, min(_CHUNK_ENTRIES, _CHUNK_BYTES // item_dtype.itemsize))

    @classmethod
    def _chunk_dtype(cls, item_dtype):
        return np.dtype([(_FILL, "<i8"), (_PACKED, f"S{cls._per_chunk(item_dtype) * item_dtype.itemsize}")])

    @classmethod
    def schemas(cls, key_dtype):
        """``{"heads": (key, value), "entries": (key, value)}``: the dtypes of the two stores."""
        return KeyedLists.schemas(_BUCKET, cls._chunk_dtype(cls._item_dtype(np.dtype(key_dtype))))

    @staticmethod
    def recorded_shift(heads):
        """The bucket shift an index over the ``heads`` store was built with (None: none yet)."""
        values, found = heads.get_batch(_META[2:3])
        return int(values[COUNT_FIELD][0]) if found[0] else None

    @classmethod
    def entries_of_chunks(cls, key_dtype, chunks):
        """``(times, keys)`` of every entry held in rows of the entries store (``chunks``: its
        values): what an index holds, read without its buckets (to move it elsewhere)."""
        key_dtype = np.dtype(key_dtype)
        items, _ = _unpack(cls._item_dtype(key_dtype), chunks)
        return _split(items, key_dtype)

    def _meta(self):
        values, found = self.heads.get_batch(_META)
        counts = values[COUNT_FIELD]
        low = int(counts[0]) if found[0] else None
        non_empty = int(counts[1]) if found[1] else 0
        shift = int(counts[2]) if found[2] else None
        count = int(counts[3]) if found[3] else 0
        return low, non_empty, shift, count

    def _save_meta(self):
        meta = [(_NON_EMPTY, self._non_empty), (_SHIFT, self.bucket_shift), (_ENTRIES, self._count)]
        if self._low is not None:
            meta.append((_LOW, self._low))
        keys = np.array([(k,) for k, _ in meta], dtype=_BUCKET)
        values = np.array([(v,) for _, v in meta], dtype=[(COUNT_FIELD, "<i8")])
        self.heads.put_batch(keys, values)

    def __len__(self):
        """The number of entries (stale ones included)."""
        return self._count

    # -- chunks --------------------------------------------------------------------------------

    def _unpack(self, chunks):
        """The entries of ``chunks`` in order, and the chunk each came from."""
        return _unpack(self.item_dtype, chunks)

    def _pack(self, counts, items):
        """``items`` (grouped by list, ``counts[i]`` for list i, in order) as full chunks and
        each list's last partial one: ``(chunks, chunks per list)``."""
        c = self.per_chunk
        per_list = -(-counts // c)
        first_chunk = np.cumsum(per_list) - per_list
        position = _positions(counts)
        slot = np.repeat(first_chunk, counts) * c + position
        buffer = np.zeros(int(per_list.sum()) * c, dtype=self.item_dtype)
        buffer[slot] = items
        chunks = np.empty(len(buffer) // c, dtype=self.chunk_dtype)
        chunks[_FILL] = np.bincount(slot // c, minlength=len(chunks))
        chunks[_PACKED] = buffer.view(chunks.dtype[_PACKED])
        return chunks, per_list

    # -- adding and popping ----------------------------------------------------------------------

    def add(self, times, keys):
        """File ``keys[i]`` under ``times[i]`` (int64, >= 0). A key may be filed several times.
        ``times`` must be integers and ``keys`` a structured array of the key's fields and
        dtypes: anything else is a TypeError naming it, never a silent cast (a float time or
        key field would be truncated and the entry filed under another time or key)."""
        times = _checked_times(times)
        if not isinstance(keys, np.ndarray) or keys.dtype.names is None:
            raise TypeError(f"expiry keys must be a numpy structured array of {self.key_dtype}, "
                            f"got {type(keys).__name__}")
        self._key_schema.check_dtype(keys.dtype)
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
        buckets = times >> self.bucket_shift
        order = np.argsort(buckets, kind="stable")
        buckets, items = buckets[order], items[order]
        starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
        owners = np.empty(len(starts), dtype=_BUCKET)
        owners["bucket"] = buckets[starts]
        added = np.diff(np.append(starts, len(buckets)))
        held = self.lists.counts(owners)
        # A bucket's last chunk, if not full, takes the first of the new entries: read it and
        # write it again with them.
        last = np.flatnonzero(held > 0)
        tail_chunks = np.empty(0, dtype=self.chunk_dtype)
        if len(last):
            tail_chunks = self.lists.entries_at(owners[last], held[last] - 1)
        open_tail = tail_chunks[_FILL] < self.per_chunk if len(last) else np.zeros(0, dtype=bool)
        reopened = last[open_tail]
        tail_items, tail_of = self._unpack(tail_chunks[open_tail])
        carried = np.zeros(len(owners), dtype=np.int64)
        carried[reopened] = tail_chunks[_FILL][open_tail]
        owner_of_item = np.concatenate([reopened[tail_of], np.repeat(np.arange(len(owners)), added)])
        merged = np.argsort(owner_of_item, kind="stable")  # each bucket: its old tail, then the new
        chunks, per_list = self._pack(carried + added, np.concatenate([tail_items, items])[merged])
        first_seq = held - (carried > 0)
        seqs = np.repeat(first_seq, per_list) + _positions(per_list)
        self.lists.put_at(owners[np.repeat(np.arange(len(owners)), per_list)], seqs, chunks)
        self.lists.set_counts(owners, first_seq + per_list)
        was_empty = not self._non_empty
        self._non_empty += int((held == 0).sum())
        self._count += len(times)
        lowest = int(owners["bucket"][0])
        self._low = lowest if was_empty or self._low is None else min(self._low, lowest)
        self._save_meta()

    def _non_empty_buckets(self, low, high):
        """``(buckets, counts)`` of the buckets in ``[low, high]`` that hold entries (counts in chunks)."""
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
            mine = (b >= low) & (b <= high) & (b > _ENTRIES)
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
        which, chunks = self.lists.read(buckets, counts)
        items, chunk_of = self._unpack(chunks)
        expired = items[TIME_FIELD] <= limit
        last = len(buckets) - 1
        kept_in_last = (which[chunk_of] == last) & ~expired
        if kept_in_last.any():  # the limit's own bucket keeps its later entries
            emptied = np.arange(last)
            self.lists.clear(buckets[emptied], counts[emptied])
            kept, per_list = self._pack(np.array([int(kept_in_last.sum())]), items[kept_in_last])
            self.lists.replace(buckets[last:], np.zeros(len(kept), dtype=np.int64), kept, counts[last:])
            self._non_empty -= last
        else:
            self.lists.clear(buckets, counts)
            self._non_empty -= len(buckets)
        self._low = high
        out = items[expired]
        self._count -= len(out)
        self._save_meta()
        return _split(out, self.key_dtype)


def _checked_times(times):
    """``times`` as a 1-D int64 array; TypeError unless they are integers, ValueError past int64."""
    arr = np.asarray(times)
    if arr.ndim != 1:
        raise ValueError(f"expiry times must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"expiry times must be integers (int64, in the index's unit), got {arr.dtype} "
                        f"values such as {arr[0]!r}")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"expiry times must fit in int64, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def _unpack(item_dtype, chunks):
    """The entries packed in ``chunks`` (rows of the entries store's values), in order, and
    the chunk each came from."""
    per_chunk = ExpiryIndex._per_chunk(item_dtype)
    items = np.ascontiguousarray(chunks[_PACKED]).view(item_dtype)
    valid = (np.arange(per_chunk)[None, :] < chunks[_FILL][:, None]).ravel()
    return items[valid], np.repeat(np.arange(len(chunks), dtype=np.int64), chunks[_FILL])


def _split(items, key_dtype):
    """``(times, keys)`` of index entries."""
    keys = np.empty(len(items), dtype=key_dtype)
    for name in key_dtype.names:
        keys[name] = items[name]
    return items[TIME_FIELD].copy(), keys
