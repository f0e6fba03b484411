"""Spilled heads: what a State changed since its mapped snapshot, written out as local images
and mapped, so that the head held in memory stays small whatever the timing of snapshots.

A :class:`Spill` stands where a State's base stands and holds one version: the rows put
since ``lower`` (an image over the store's schemas), the keys removed since (an image of keys
only; none when nothing lies below to hide), and ``lower`` itself (an older spill, the mapped
snapshot, or nothing). It lives in the page cache, not the heap: its files are unlinked once
mapped, so a crash leaves nothing behind (they are no checkpoint: the deltas are).

Spills stack up as levels over the snapshot, and a new spill takes in the newest levels
while each is no bigger than TAKE_IN_RATIO times what it holds so far (the head's win):
levels grow geometrically downwards, a change is rewritten a logarithmic number of times
before a snapshot takes it, a spill costs a few times what the head holds, and a base is a
few levels deep. Each level's images keep KeyFilters of their keys in memory (their
readers' ``key_filter``), so that a lookup probes only the levels that may decide a key
(``statecore/_levels.pyx``). Maintenance writes the next snapshot from a spill alone
(:meth:`Spill.rows`), holding no frozen head in memory;
a spill made meanwhile stands over the one written, never taking it in, until the snapshot
replaces it (the one change a Spill ever sees: ``lower`` becomes the same version, mapped
from the snapshot). Rules: ``docs/provider-rules.md``.
"""
import contextlib
import os

import numpy as np

from statecore._levels import get_rows as get_rows_through_levels
from statecore._keyfilter import KeyFilter
from statecore._snapshot import SnapshotReader, SnapshotWriter
from statecore.lineage import image_lineage

__all__ = ["Spill", "bottom_snapshot", "filter_bytes", "spill_head", "spill_rows"]

CHUNK_ROWS = 1 << 16
# An image of more rows gets no KeyFilter (a whole spill of a large state; levels are
# smaller; maintenance builds none for a larger snapshot either): its filter would put
# more than a tenth of the rows' bytes on the heap, and building one for a snapshot read
# from files would bring the whole state into memory once.
KEY_FILTER_MAX_ROWS = 1 << 23
# A new spill takes in a level no bigger than this many times what it holds so far. At 1 (a
# binary counter) heads of nearly equal sizes stack without end (each a few keys smaller
# than the level below); at 2 a level is always taken in by two heads of its size.
TAKE_IN_RATIO = 2


def bottom_snapshot(base):
    """The mapped snapshot at the bottom of ``base`` (a SnapshotReader, or a Spill over
    one), or None (nothing under the levels, or another kind of base)."""
    while isinstance(base, Spill):
        base = base.lower
    return base if isinstance(base, SnapshotReader) else None


def filter_bytes(base):
    """Heap bytes of the key filters of ``base`` (a SnapshotReader, a Spill, or None)."""
    if isinstance(base, Spill):
        return base.filter_bytes
    keys = base.key_filter if isinstance(base, SnapshotReader) else None
    return keys.nbytes if keys is not None else 0


class Spill:
    """Version ``version`` (attempt ``commit_id``, ``num_keys`` keys) as ``puts`` and ``dels``
    (SnapshotReaders, each with the KeyFilter of its keys its writer filled, which lookups
    ask to skip the level) over ``lower`` (a SnapshotReader, a Spill over one, or None);
    ``dels`` is None when ``lower`` is."""

    __slots__ = ("puts", "dels", "lower", "version", "commit_id", "num_keys")

    def __init__(self, puts, dels, lower, version, commit_id, num_keys):
        self.puts = puts
        self.dels = dels
        self.lower = lower
        self.version = version
        self.commit_id = commit_id
        self.num_keys = num_keys

    def __repr__(self):
        return (f"Spill(version={self.version}, keys={self.num_keys}, puts={self.puts.row_count}, "
                f"dels={self.dels.row_count if self.dels is not None else 0})")

    @property
    def own_changed(self):
        """Keys this level decides."""
        return self.puts.row_count + (self.dels.row_count if self.dels is not None else 0)

    @property
    def whole(self):
        """Whether this spill holds every row of its version (it stands on nothing): the
        bottom image of the levels above it, as a snapshot is."""
        return self.lower is None

    @property
    def changed(self):
        """Keys this spill and the levels below it decide over their bottom image (a snapshot,
        or a whole spill): the changes since it (a key changed in two levels counts twice);
        none for a whole spill itself."""
        if self.whole:
            return 0
        return self.own_changed + (self.lower.changed if isinstance(self.lower, Spill) else 0)

    def lookup(self, key_rows):
        """``(value_rows, found)`` of ``key_rows``: each key's newest level that puts or
        removes it decides, else the snapshot below (compiled: ``statecore._levels``)."""
        n = key_rows.shape[0]
        values = np.empty((n, self.puts.value_width), dtype=np.uint8)
        found = np.empty(n, dtype=np.uint8)
        get_rows_through_levels(self, key_rows, values, found)
        return values, found.view(np.bool_)

    @property
    def filter_bytes(self):
        """Heap bytes of the key filters of this level and the levels below it, the
        snapshot's included."""
        return filter_bytes(self.puts) + filter_bytes(self.dels) + filter_bytes(self.lower)

    def get_row(self, key):
        """Value bytes of one key (bytes), or None."""
        lower = self.lower
        value = self.puts.get_row(key)
        if value is not None or lower is None:
            return value
        if self.dels is not None and self.dels.get_row(key) is not None:
            return None
        return lower.get_row(key)  # a SnapshotReader or a Spill

    def rows(self, chunk_rows=CHUNK_ROWS):
        """Every row of the version, each key once: each level's puts that no newer level
        decides, then the snapshot's rows that no level overrides (found by probing the
        changed keys in the older images, never the other way round)."""
        levels, bottom = _levels(self)
        for j, level in enumerate(levels):
            newer = [image for above in levels[:j] for image in (above.puts, above.dels) if image is not None]
            yield from _unshadowed(level.puts, newer, chunk_rows)[1]
        if bottom is not None and bottom.row_count:
            changed = [image for level in levels for image in (level.puts, level.dels) if image is not None]
            yield from _unshadowed(bottom, changed, chunk_rows)[1]


def spill_rows(new_file, key_schema, value_schema, version, commit_id, chunks, num_keys, publish=None):
    """A whole Spill: every row of a version (``chunks``, ``num_keys`` rows) over nothing. For
    a State whose base is not mapped (a frozen State), where no changes can be told apart,
    and for maintenance to compact the levels of a spill whose changes outgrew the state.
    ``publish(path)``, if given, may take the image's file before it is unlinked (a whole
    image is the version itself: other processes may map it)."""
    puts = _write_image(new_file, key_schema, value_schema, version, commit_id, num_keys, chunks, publish)
    return Spill(puts, None, None, version, commit_id, num_keys)


def spill_head(new_file, head, base, version, commit_id, num_keys, written=None, publish=None):
    """A Spill of version ``version`` (attempt ``commit_id``, ``num_keys`` keys) of a frozen
    State: its ``head`` (a Layer) over its ``base`` (None, a SnapshotReader or a Spill),
    taking in the newest levels of spills while each is no bigger than TAKE_IN_RATIO times
    what the new spill holds so far; never ``written`` (the spill a snapshot is being written
    from) or what lies below it. ``new_file()`` gives a new local file open for binary
    writing. ``publish`` as spill_rows', for a spill that turns out whole."""
    taken, lower = [], base
    size = len(head)
    while isinstance(lower, Spill) and lower is not written and lower.own_changed <= TAKE_IN_RATIO * size:
        taken.append(lower)
        size += lower.own_changed
        lower = lower.lower
    ks, vs = head.key_schema, head.value_schema

    def image_of(kind, schema_v):
        # the head's table, then each taken level's image, less what a newer source decides
        newer = [head.puts, head.dels]
        table = getattr(head, kind)
        count, parts = len(table), [_cursor_chunks(table, CHUNK_ROWS)]
        for level in taken:
            image = getattr(level, kind)
            if image is not None and image.row_count:
                kept, chunks = _unshadowed(image, newer, CHUNK_ROWS)
                count += kept
                parts.append(chunks)
            newer += [i for i in (level.puts, level.dels) if i is not None]
        return _write_image(new_file, ks, schema_v, version, commit_id, count, (c for part in parts for c in part),
                            publish if lower is None else None)

    put_image = image_of("puts", vs)
    del_image = None
    if lower is not None:  # tombstones hide only what lies below
        del_image = image_of("dels", head.dels.value_schema)
    return Spill(put_image, del_image, lower, version, commit_id, num_keys)


def _write_image(new_file, key_schema, value_schema, version, commit_id, row_count, chunks, publish=None):
    """The reader of ``row_count`` rows of version ``version`` (attempt ``commit_id``, in its
    header) written as an image in a new local file, mapped (every block checked now, on the
    caller's thread, not on first touch by a lookup) with the key filter its writer filled,
    the file unlinked unless ``publish(path)`` took it."""
    f = new_file()
    path = f.name
    key_filter = KeyFilter(key_schema.width, row_count) if 0 < row_count <= KEY_FILTER_MAX_ROWS else None
    try:
        with f:
            writer = SnapshotWriter(f, key_schema, value_schema, row_count, version, lineage=image_lineage(commit_id),
                                    key_filter=key_filter)
            for chunk in chunks:
                if chunk.shape[0]:
                    writer.write_rows(chunk)
            writer.finish()
        reader = SnapshotReader(path, key_schema, value_schema)
        reader.verify(index=False)
        if key_filter is not None:
            reader.set_key_filter(key_filter)
        if publish is not None:
            publish(path)
        return reader
    finally:
        with contextlib.suppress(FileNotFoundError):  # published: renamed away
            os.unlink(path)


def _levels(spill):
    """``(levels, bottom)``: the spills from ``spill`` down (newest first), and the snapshot
    (or None) under them."""
    levels, node = [], spill
    while isinstance(node, Spill):
        levels.append(node)
        node = node.lower
    return levels, node


def _unshadowed(image, newer, chunk_rows):
    """``(count, chunks)`` of the rows of ``image`` (a SnapshotReader) whose keys none of the
    ``newer`` sources (RowTables or SnapshotReaders) holds: found by probing the newer keys
    in ``image`` (those its key filter, if any, may hold), a mask of its rows."""
    kw = image.key_width
    image_filter = image.key_filter
    mask = np.zeros(image.row_count, dtype=np.uint8)
    for source in newer:
        for chunk in _cursor_chunks(source, chunk_rows):
            keys = image_filter.keys_it_may_hold(chunk) if image_filter is not None else chunk[:, :kw]
            image.mark_rows(np.ascontiguousarray(keys), mask)
    return image.row_count - int(np.count_nonzero(mask)), _cursor_chunks(image, chunk_rows, skip=mask)


def _cursor_chunks(source, chunk_rows, skip=None):
    cursor = source.cursor()
    kwargs = {} if skip is None else {"skip": skip}
    while (chunk := cursor.next_rows(chunk_rows, **kwargs)) is not None:
        if chunk.shape[0]:
            yield chunk

