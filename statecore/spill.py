"""Spilled heads: what a State changed since its mapped snapshot, written out as local images
and mapped, so that the head held in memory stays small whatever the timing of snapshots.

A :class:`Spill` stands where a State's base stands and holds one version: the rows put
since ``lower`` (an image over the store's schemas), the keys removed since (an image of keys
only; none when nothing lies below to hide), and ``lower`` itself (the mapped snapshot, a
spill being written out as a snapshot, or nothing). It lives in the page cache, not the heap:
its files are unlinked once mapped, so a crash leaves nothing behind (they are no checkpoint:
the deltas are). A new spill takes in the older spill's changes (the head's win), so a base is
one spill over a snapshot, and maintenance writes the next snapshot from a spill alone
(:meth:`Spill.rows`) without holding a frozen head in memory. While it does, the head may be
spilled again, over that spill: a second level, until the snapshot replaces the lower spill
(the one change a Spill ever sees: ``lower`` becomes the same version, mapped from the
snapshot). Rules: ``docs/provider-rules.md``.
"""
import os

import numpy as np

from statecore._snapshot import SnapshotReader, SnapshotWriter
from statecore.layers import no_values, take_rows

__all__ = ["Spill", "spill_head", "spill_rows"]

CHUNK_ROWS = 1 << 16


class Spill:
    """Version ``version`` (attempt ``commit_id``, ``num_keys`` keys) as ``puts`` and ``dels``
    (SnapshotReaders) over ``lower`` (a SnapshotReader, a Spill over one, or None); ``dels``
    is None when ``lower`` is."""

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
    def changed(self):
        """Keys this spill (and a spill below it) decides: the changes since the snapshot."""
        own = self.puts.row_count + (self.dels.row_count if self.dels is not None else 0)
        return own + (self.lower.changed if isinstance(self.lower, Spill) else 0)

    def lookup(self, key_rows):
        """``(value_rows, found)`` of ``key_rows``: the puts, then what the dels leave to ``lower``."""
        n = key_rows.shape[0]
        lower = self.lower
        values = np.zeros((n, self.puts.value_width), dtype=np.uint8)
        found = np.zeros(n, dtype=np.uint8)
        self.puts.get_rows(key_rows, values, found)
        found = found.view(np.bool_)
        if lower is None:
            return values, found
        rest = np.flatnonzero(~found)
        if rest.size == 0:
            return values, found
        rest_keys = take_rows(key_rows, rest)
        if self.dels is not None and self.dels.row_count:
            hidden = np.zeros(rest.size, dtype=np.uint8)
            self.dels.get_rows(rest_keys, no_values(rest.size), hidden)
            keep = ~hidden.view(np.bool_)
            rest, rest_keys = rest[keep], take_rows(rest_keys, keep)
        if rest.size:
            lower_values, lower_found = _lookup(lower, rest_keys)
            if self.puts.value_width:
                values[rest] = lower_values
            found[rest] = lower_found
        return values, found

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
        """Every row of the version, each key once: the puts, then the rows of ``lower`` that
        no put or del overrides (over a snapshot: found by probing the changed keys in it)."""
        yield from _cursor_chunks(self.puts, chunk_rows)
        lower = self.lower
        kw = self.puts.key_width
        if isinstance(lower, Spill):
            for chunk in lower.rows(chunk_rows):
                keys = np.ascontiguousarray(chunk[:, :kw])
                keep = ~(_holds(self.puts, keys) | _holds(self.dels, keys))
                if keep.any():
                    yield chunk[keep]
            return
        if lower is None or not lower.row_count:
            return
        overridden = np.zeros(lower.row_count, dtype=np.uint8)
        for image in (self.puts, self.dels):
            if image is not None:
                for chunk in _cursor_chunks(image, chunk_rows):
                    lower.mark_rows(np.ascontiguousarray(chunk[:, :kw]), overridden)
        yield from _cursor_chunks(lower, chunk_rows, skip=overridden)


def spill_rows(new_file, key_schema, value_schema, version, commit_id, chunks, num_keys):
    """A Spill of every row of a version (``chunks``, ``num_keys`` rows) over nothing: for a
    State whose base is not mapped (a frozen State), where no changes can be told apart."""
    puts = _write_image(new_file, key_schema, value_schema, version, num_keys, chunks)
    return Spill(puts, None, None, version, commit_id, num_keys)


def spill_head(new_file, head, base, version, commit_id, num_keys, written=None):
    """A Spill of version ``version`` (attempt ``commit_id``, ``num_keys`` keys) of a frozen State: its ``head`` (a
    Layer) over its ``base`` (None, a SnapshotReader or a Spill), the older spill's changes
    taken in where the head does not decide them; but over ``written`` (the spill a snapshot
    is being written from), never taking it in. ``new_file()`` gives a new local file open
    for binary writing."""
    older = base if isinstance(base, Spill) and base is not written else None
    lower = older.lower if older is not None else base  # a snapshot, or the spill it is written from
    ks, vs = head.key_schema, head.value_schema
    puts, dels = head.puts, head.dels
    kw = ks.width

    def overridden_in(image):
        # rows of the older spill's `image` that the head decides
        mask = np.zeros(image.row_count, dtype=np.uint8)
        for table in (puts, dels):
            for chunk in _cursor_chunks(table, CHUNK_ROWS):
                image.mark_rows(np.ascontiguousarray(chunk[:, :kw]), mask)
        return mask

    def image_of(table, older_image, schema_v):
        chunks = [_cursor_chunks(table, CHUNK_ROWS)]
        count = len(table)
        if older_image is not None and older_image.row_count:
            mask = overridden_in(older_image)
            count += older_image.row_count - int(np.count_nonzero(mask))
            chunks.append(_cursor_chunks(older_image, CHUNK_ROWS, skip=mask))
        return _write_image(new_file, ks, schema_v, version, count, (c for it in chunks for c in it))

    put_image = image_of(puts, older.puts if older is not None else None, vs)
    del_image = None
    if lower is not None:
        del_image = image_of(dels, older.dels if older is not None else None, dels.value_schema)
    return Spill(put_image, del_image, lower, version, commit_id, num_keys)


def _write_image(new_file, key_schema, value_schema, version, row_count, chunks):
    """Write ``row_count`` rows as an image in a new local file, map it (every block checked
    now, on the caller's thread, not on first touch by a lookup) and unlink the file."""
    f = new_file()
    path = f.name
    try:
        with f:
            writer = SnapshotWriter(f, key_schema, value_schema, row_count, version)
            for chunk in chunks:
                if chunk.shape[0]:
                    writer.write_rows(chunk)
            writer.finish()
        reader = SnapshotReader(path, key_schema, value_schema)
        reader.verify(index=False)
        return reader
    finally:
        os.unlink(path)


def _lookup(base, key_rows):
    """``(value_rows, found)`` from a SnapshotReader or a Spill."""
    if isinstance(base, Spill):
        return base.lookup(key_rows)
    n = key_rows.shape[0]
    values = np.zeros((n, base.value_width), dtype=np.uint8)
    found = np.zeros(n, dtype=np.uint8)
    base.get_rows(key_rows, values, found)
    return values, found.view(np.bool_)


def _holds(image, key_rows):
    """Which ``key_rows`` the image (a SnapshotReader, or None) holds."""
    n = key_rows.shape[0]
    found = np.zeros(n, dtype=np.uint8)
    if image is not None and image.row_count:
        image.get_rows(key_rows, np.empty((n, image.value_width), np.uint8), found)
    return found.view(np.bool_)


def _cursor_chunks(source, chunk_rows, skip=None):
    cursor = source.cursor()
    kwargs = {} if skip is None else {"skip": skip}
    while (chunk := cursor.next_rows(chunk_rows, **kwargs)) is not None:
        if chunk.shape[0]:
            yield chunk

