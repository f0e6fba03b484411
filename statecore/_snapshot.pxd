# cython: language_level=3
"""Snapshot files, one import for all of them (see _snapshot.pyx).

The C-level declarations live with their parts, to be cimported from there:
_snapshot_format.pxd (SnapshotHeader, the footer, the layout), _snapshot_writer.pxd,
_snapshot_reader.pxd, _mapping.pxd and _probe.pxd (the slot index).
"""
