# cython: language_level=3
"""The read model, compiled: a version's flattened sources and the one rule (see _versions.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from statecore._rowtable cimport RowTable, table_may_hold
from statecore._snapshot_reader cimport SnapshotReader


cdef inline int table_find_value(RowTable t, const uint8_t* key, uint32_t tag, uint8_t* value_out) noexcept:
    """1 if ``t`` holds the key, else 0; its value is copied to ``value_out`` unless NULL."""
    cdef uint64_t pos
    cdef uint32_t row
    if not table_may_hold(t, tag):  # empty, or the filter rules the key out
        return 0
    row = t.table_find(key, tag, &pos)
    if row == 0:
        return 0
    if value_out != NULL:
        memcpy(value_out, t.rows + <uint64_t>(row - 1) * t.row_width + t.key_width, t.value_width)
    return 1


@cython.final
cdef class FrozenView:
    cdef readonly object state        # a frozen State
    cdef readonly object version      # the version of it seen


@cython.final
cdef class Sources:
    cdef readonly tuple layers        # non-empty Layers, newest first
    cdef readonly tuple levels        # Spills standing on something, newest first
    cdef readonly SnapshotReader bottom
    cdef list tables                  # the layers' RowTables: puts, dels, puts, dels, ...
    cdef list images                  # the levels' images: puts, dels (or None), ...

    cdef int find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1
