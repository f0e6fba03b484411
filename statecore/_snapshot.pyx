# cython: language_level=3
"""Snapshot files: the full state of one store version, written once, then memory-mapped and
probed in place. This module is their public names in one import; the format is described
in docs/formats.md.

Where each part lives:

- ``_snapshot_format``: the constants, the header and footer, the layout (SnapshotHeader,
  read_snapshot_header);
- ``_probe.pxd``: the slot index's rule (Robin Hood probing), shared with RowTable;
- ``_snapshot_writer``: SnapshotWriter, write_snapshot;
- ``_snapshot_pack``: PackWriter, unpack_snapshot (version 2, the packed container);
- ``_snapshot_reader``: SnapshotReader, SnapshotCursor;
- ``_snapshot_image``: the reader's nogil work on the mapped bytes (lazy verification,
  lookups, verify());
- ``_mapping``: the read-only mapping and its SIGBUS guard.
"""
from statecore._mapping import _guarded_mappings
from statecore._snapshot_format import (
    DEFAULT_BLOCK_SIZE, DEFAULT_PACK_BLOCK_SIZE, FOOTER_MAGIC, FOOTER_SIZE, FORMAT_VERSION, HEADER_SIZE, MAGIC,
    MAX_BLOCK_SIZE, MAX_ROWS, MIN_BLOCK_SIZE, MIN_SLOTS, PACK_FOOTER_SIZE, PACK_HEADER_SIZE, PACKED_FORMAT_VERSION,
    SLOTS_ALIGN, SNAPSHOT_HEADER_SIZE, PackedHeader, SnapshotHeader, read_snapshot_header,
)
from statecore._snapshot_pack import PackWriter, unpack_snapshot
from statecore._snapshot_reader import SnapshotCursor, SnapshotReader
from statecore._snapshot_writer import SnapshotWriter, write_snapshot

__all__ = ["SnapshotWriter", "SnapshotReader", "SnapshotCursor", "SnapshotHeader", "PackedHeader", "PackWriter",
           "unpack_snapshot", "write_snapshot",
           "read_snapshot_header", "MAGIC", "FOOTER_MAGIC", "FORMAT_VERSION", "HEADER_SIZE",
           "SNAPSHOT_HEADER_SIZE", "FOOTER_SIZE", "DEFAULT_BLOCK_SIZE", "PACKED_FORMAT_VERSION", "PACK_HEADER_SIZE",
           "PACK_FOOTER_SIZE", "DEFAULT_PACK_BLOCK_SIZE"]
