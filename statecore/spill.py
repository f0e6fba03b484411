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
(``statecore/_versions.pyx``, where the Spill type and the lookup rule live). Maintenance
writes the next snapshot from a spill alone (:meth:`Spill.rows`), holding no frozen head in memory;
a spill made meanwhile stands over the one written, never taking it in, until the snapshot
replaces it (the one change a Spill ever sees: ``lower`` becomes the same version, mapped
from the snapshot). Rules: ``docs/provider-rules.md``.
"""
import contextlib
import os

from statecore._keyfilter import KeyFilter
from statecore._snapshot import SnapshotReader, SnapshotWriter
from statecore._versions import Spill, bottom_snapshot, cursor_chunks, filter_bytes, spill_chain, unshadowed
from statecore.lineage import image_lineage

__all__ = ["Spill", "bottom_snapshot", "filter_bytes", "spill_file_maker", "spill_head", "spill_rows"]

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


def spill_file_maker(files, version):
    """``new_file()`` for a spill of ``version`` of the store whose StoreFiles are ``files``: a
    new local image file in its cache directory, open for writing."""
    return lambda: files.new_image_file(f"spill-{version}")


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
    for level in spill_chain(base)[0]:
        if level is written or level.own_changed > TAKE_IN_RATIO * size:
            break
        taken.append(level)
        size += level.own_changed
        lower = level.lower
    ks, vs = head.key_schema, head.value_schema

    def image_of(kind, schema_v):
        # the head's table, then each taken level's image, less what a newer source decides
        newer = [head.puts, head.dels]
        table = getattr(head, kind)
        count, parts = len(table), [cursor_chunks(table, CHUNK_ROWS)]
        for level in taken:
            image = getattr(level, kind)
            if image is not None and image.row_count:
                kept, chunks = unshadowed(image, newer, CHUNK_ROWS)
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
