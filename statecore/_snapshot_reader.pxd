# cython: language_level=3
"""SnapshotReader: a snapshot memory-mapped and probed in place (see _snapshot_reader.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from statecore._keyfilter cimport KeyFilter
from statecore._mapping cimport Mapping
from statecore._rowtable cimport RowSource
from statecore._snapshot_image cimport SnapError, SnapLayout


@cython.final
cdef class SnapshotReader(RowSource):
    cdef readonly object path
    cdef readonly object shown          # the name errors give (the remote file of a local copy)
    cdef readonly object header         # the checked SnapshotHeader; its fields are the reader's too
    cdef readonly uint64_t row_count
    cdef readonly uint32_t max_displacement
    cdef Mapping _mapping               # None once closed; each call holds its own reference
    cdef bint _closed
    cdef SnapLayout layout              # base is NULL here: see SnapLayout
    cdef uint8_t* verified
    cdef uint8_t table_ok
    cdef KeyFilter _filter              # of every key, once built from the rows; else None

    cdef object _corrupt(self, offset, reason)
    cdef object _open(self, int fd, size, key_schema, value_schema, expected_lineage)
    cdef Mapping _acquire(self)
    cdef SnapLayout _layout_of(self, Mapping mapping)
    cdef object _raise_truncated(self, Mapping mapping)
    cdef object _raise_for(self, const SnapError* err)
    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1


cdef inline KeyFilter reader_key_filter(SnapshotReader reader):
    """The reader's key filter, or None: set once and never changed, so a caller that holds
    the reader may keep a pointer into its bits."""
    return reader._filter


@cython.final
cdef class SnapshotCursor:
    cdef SnapshotReader reader
    cdef uint64_t pos
    cdef uint64_t end
