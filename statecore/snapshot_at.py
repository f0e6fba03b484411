"""A store's state written whole at a chosen version, outside any commit: the snapshots
``statecore repartition`` writes into each new partition, and the empty state a store new to a
running operator starts from (``docs/lineage.md``, "A store new to a running operator").

Either is a snapshot ``<version>_<new id>.snapshot`` beside the store's schema file, checked
whole once it is durable (every checksum of the file read back), before anything relies on it:
a load of that attempt then needs no file before it.
"""
import os

from statecore.errors import StateCorruptionError, UnrecordedStateError
from statecore.files import open_store_files
from statecore.lineage import file_name, image_lineage
from statecore.schema_file import SCHEMA_FILE, read_store_schemas, schema_file_bytes
from statecore.schema import key_value_schemas
from statecore.snapshot_files import check_snapshot, write_snapshot_file

__all__ = ["write_snapshot_at", "start_empty", "start_store_empty"]


def write_snapshot_at(files, version, commit_id, key_schema, value_schema, chunks, row_count, compression,
                      schema_bytes=None, schema_file=True):
    """Write the rows of ``chunks`` (``row_count`` in all) as attempt ``commit_id`` (8 bytes)
    of ``version`` of the store directory ``files``, and check the file whole. The schema file
    is written first if there is none (``schema_bytes``, by default the provider's record of
    the schemas); one that records other schemas is StateCorruptionError, nothing written.
    ``schema_file`` False leaves the schema file alone, unread (a rewrite's snapshots in new
    schemas, which its caller records in the history once they are switched to)."""
    files.mkdirs()
    recorded = read_store_schemas(files) if schema_file else None
    if recorded is None and schema_file:
        payload = schema_bytes if schema_bytes is not None else schema_file_bytes(key_schema, value_schema)
        try:
            files.write_atomic(SCHEMA_FILE, lambda f: f.write(payload), overwrite=False)
        except FileExistsError:  # another writer was first: its record must agree
            recorded = read_store_schemas(files)
    if recorded is not None and recorded != (key_schema, value_schema):
        raise StateCorruptionError(files.path(SCHEMA_FILE), None,
                                   f"the store records other schemas than the ones being written "
                                   f"({key_schema.describe()} -> {value_schema.describe()})")
    name = file_name(version, commit_id, "snapshot")
    write_snapshot_file(files, name, key_schema, value_schema, row_count, version, image_lineage(commit_id), chunks,
                        compression)
    # Every checksum of the file as it now is, read back: an image's blocks, or a packed
    # snapshot's packed blocks (not unpacked: its image's own checksums are checked by every
    # open, before a row is used).
    header = check_snapshot(files, name, key_schema, value_schema)
    if header.store_version != version or header.commit_id != commit_id or header.row_count != row_count:
        raise StateCorruptionError(files.path(name), None, "the snapshot written is not the one meant")
    return row_count


def start_empty(files, version, key_schema, value_schema, compression):
    """Start the store directory ``files`` empty at ``version``: an empty snapshot under a new
    commit id (returned, 8 bytes). Files of versions at or above ``version`` are what an earlier
    attempt or run of the same batch left (no record names them) and stay for the store's own
    rules to delete; a file of an older version is state that was there before the batch and
    no record names: UnrecordedStateError, nothing written."""
    older = sorted({f.version for f in files.list_versions() if f.version < version})
    if older:
        held = f"version {older[0]}" if len(older) == 1 else f"versions {older[0]}..{older[-1]}"
        raise UnrecordedStateError(
            f"store {files.location} is new to the operator at version {version} (the previous batch's record "
            f"does not name it), but it holds {held} that no record names (a state "
            f"variable removed and declared again?); starting it empty would hide them. To start the store empty, "
            f"move that directory away (or delete it); nothing was written")
    commit_id = os.urandom(8)
    write_snapshot_at(files, version, commit_id, key_schema, value_schema, [], 0, compression)
    return commit_id


def start_store_empty(store_id, version, key_dtype, value_dtype, conf):
    """:func:`start_empty` for the store of ``store_id`` (a StateStoreId) with ``conf``'s
    storage options and compression; returns the new attempt's id in hex."""
    files = open_store_files(store_id.store_checkpoint_location(), conf.storage_options, conf.local_cache_dir)
    key_schema, value_schema = key_value_schemas(key_dtype, value_dtype)
    return start_empty(files, version, key_schema, value_schema, conf.compression).hex()
