"""Snapshot files of a store directory: written in the layout the conf's compression asks for,
opened as a mapped image whatever their layout.

A snapshot file is an image (format version 1, written with ``compression="none"``), mapped
where it lies, or a packed snapshot (version 2, ``"lz4"``) whose image is unpacked once into
the local cache (:meth:`statecore.files.StoreFiles.local_image_for_mapping`) and mapped
there: lookups and iteration are the same :class:`SnapshotReader` work either way, and a
checkpoint may hold both. Every reader of snapshot files in a store directory (the provider,
maintenance, verify, repartition) goes through here; the formats are ``_snapshot``'s.
"""
import logging
import os

from statecore._snapshot import (
    SNAPSHOT_HEADER_SIZE, PackWriter, SnapshotReader, SnapshotWriter, read_snapshot_header, unpack_snapshot,
)
from statecore.errors import SchemaMismatchError, StateCorruptionError
from statecore.schema import as_schema

__all__ = ["write_snapshot_file", "read_header", "open_snapshot", "check_snapshot"]

log = logging.getLogger(__name__)


def write_snapshot_file(files, name, key_schema, value_schema, row_count, version, lineage, chunks,
                        compression, on_flushed=None, keep_image=False, key_filter=None):
    """Write the rows of ``chunks`` (uint8 row arrays, ``row_count`` rows in all) as snapshot
    ``name`` of ``files``, atomically: the image with ``compression="none"``, packed while
    it is written with ``"lz4"``. ``on_flushed(path)`` is called with the temporary image
    before it is renamed, for an image on the local filesystem only (see
    :meth:`StoreFiles.write_atomic`). With ``keep_image``, a packed snapshot's image is
    written beside it into the local cache as the image of the new file (the writer maps it
    next: nothing to unpack). ``key_filter`` (a KeyFilter) is filled with the keys written,
    as SnapshotWriter fills it. Returns the file's size in bytes."""
    if compression not in ("lz4", "none"):
        raise ValueError(f"compression must be 'lz4' or 'none', got {compression!r}")
    packed = compression == "lz4"
    image = files.new_image_file(name) if packed and keep_image else None

    def write(f):
        target = PackWriter(f, image=image) if packed else f
        try:
            writer = SnapshotWriter(target, key_schema, value_schema, row_count, version, lineage=lineage,
                                    key_filter=key_filter)
            for chunk in chunks:
                writer.write_rows(chunk)
            info = writer.finish()
            if packed:
                target.finish()
        except BaseException:
            if packed:
                target.abandon()  # its thread done with both files before they are removed
            raise
        return info

    try:
        size = files.write_atomic(name, write, on_flushed=None if packed else on_flushed)
        if image is not None:
            image.close()
            try:
                files.adopt_image(name, image.name)
            except OSError as e:  # only a shortcut: opening the snapshot unpacks it instead
                log.warning("could not keep the image of %s: %s", files.path(name), e)
    finally:
        if image is not None:
            image.close()
            _remove(image.name)  # adopted (renamed away) or abandoned
    return size


def read_header(files, name):
    """The checked header of snapshot ``name`` of ``files`` (either version), read alone."""
    return read_snapshot_header(files.read_range(name, 0, SNAPSHOT_HEADER_SIZE), files.path(name))


def open_snapshot(files, name, key_schema=None, value_schema=None):
    """A :class:`SnapshotReader` over snapshot ``name`` of ``files``: the file itself (or its
    local copy) for an image, its unpacked image in the local cache for a packed snapshot.

    A packed snapshot's damage raises StateCorruptionError naming the snapshot's path and the
    offset in it, before any of its bytes is used; so does a cached image that does not hold
    what the snapshot does (made again once first). SchemaMismatchError as SnapshotReader's.
    """
    path = files.path(name)
    header = read_header(files, name)
    if header.packed is None:
        return SnapshotReader(files.local_path_for_mapping(name), key_schema, value_schema, shown=path)
    _check_schemas(header, path, key_schema, value_schema)

    def make(source, dest):
        unpack_snapshot(source, dest, path)

    why = None
    for _ in range(2):
        image = files.local_image_for_mapping(name, header.file_size, make)
        try:
            reader = SnapshotReader(image, key_schema, value_schema)
        except StateCorruptionError as e:
            why = f"{e.reason} (at byte {e.offset} of its image {image})"
        else:
            if reader.header.checksum == header.checksum:
                return reader
            reader.close()
            why = f"its image {image} holds another snapshot"
        _remove(image)  # made again from the snapshot, once
    raise StateCorruptionError(path, None, f"the image unpacked from this snapshot is damaged: {why}")


def check_snapshot(files, name, key_schema=None, value_schema=None, deep=False):
    """Check snapshot ``name`` of ``files`` whole without using a row: every block checksum
    (of the image, or of the packed blocks); with ``deep``, also the image's slot index (a
    packed snapshot is unpacked into the cache for it). Returns its checked header.
    StateCorruptionError naming the path and offset; SchemaMismatchError."""
    header = read_header(files, name)
    if header.packed is None or deep:
        with open_snapshot(files, name, key_schema, value_schema) as reader:
            reader.verify(index=deep)
        return header
    path = files.path(name)
    _check_schemas(header, path, key_schema, value_schema)
    with files.open_read(name) as source:
        return unpack_snapshot(source, None, path)


def _check_schemas(header, path, key_schema, value_schema):
    """SnapshotReader's schema check, for a packed snapshot before it is unpacked."""
    for what, given, fingerprint, recorded in (("key", key_schema, header.key_fingerprint, header.key_schema),
                                               ("value", value_schema, header.value_fingerprint,
                                                header.value_schema)):
        if given is not None:
            schema = as_schema(given, key=what == "key")
            if schema.fingerprint != fingerprint:
                raise SchemaMismatchError(f"{what} schema mismatch in snapshot '{path}': the file has "
                                          f"{recorded.describe()}, expected {schema.describe()}")


def _remove(path):
    try:
        os.unlink(path)
    except OSError:
        pass
