# cython: language_level=3
"""The read model, compiled: the in-memory versions as typed objects (a layer, a version stack,
a spill, a frozen view), a version's flattened sources and the one rule (see _versions.pyx)."""
cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from statecore._rowtable cimport RowTable, table_may_hold
from statecore._converted_image cimport ConvertedImage
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
cdef class Layer:
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef RowTable _puts               # None until the tables are made (an undo layer kept as arrays)
    cdef RowTable _dels
    cdef tuple _pending               # an undo layer's (keys, values, present), or None

    cdef int _materialize(self) except -1
    cdef RowTable puts_table(self)
    cdef RowTable dels_table(self)
    cdef Py_ssize_t size(self) except -1
    cpdef tuple probe(self, key_rows, values_out)


@cython.final
cdef class Spill:
    cdef readonly SnapshotReader puts
    cdef readonly SnapshotReader dels # None when lower is
    cdef readonly object lower        # a SnapshotReader, a Spill, or None; swapped by replace_in_chain
    cdef readonly int64_t version
    cdef readonly bytes commit_id
    cdef readonly int64_t num_keys


@cython.final
cdef class State:
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef readonly object changes      # the provider's change counter: a uint64 array of one
    cdef uint64_t[::1] _counter       # the same memory, counted in C
    cdef object _base                 # a SnapshotReader, a Spill, a FrozenView, or None
    cdef readonly Layer head
    cdef readonly int64_t version
    cdef dict _undo                   # version -> Layer: the undo of the merge that made it
    cdef dict _commit_ids             # version -> commit id
    cdef dict _num_keys               # version -> key count (None: not counted yet)
    cdef dict _pins                   # version -> open stores reading it
    cdef readonly bint frozen
    cdef readonly object pending      # a merged version whose delta is not durable yet, or None
    cdef readonly Py_ssize_t iterating
    cdef readonly object spill_asked_at
    cdef readonly object adopted_head

    cdef int _set_base(self, base) except -1
    cdef int _count_base_change(self) except -1
    cdef int _changed(self) except -1
    cdef int _refuse_if_frozen(self) except -1


@cython.final
cdef class FrozenView:
    cdef readonly State state         # a frozen State
    cdef readonly int64_t version     # the version of it seen


@cython.final
cdef class Sources:
    cdef readonly tuple layers        # non-empty Layers, newest first
    cdef readonly tuple levels        # Spills standing on something, newest first
    cdef readonly object bottom       # the bottom image: a SnapshotReader or a ConvertedImage, or None
    cdef SnapshotReader bottom_image  # the bottom, when it is a SnapshotReader
    cdef ConvertedImage bottom_converted  # the bottom, when it is a ConvertedImage
    cdef list tables                  # the layers' RowTables: puts, dels, puts, dels, ...
    cdef list images                  # the levels' images: puts, dels (or None), ...

    cdef int find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1
    cdef int find_in_images(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1


cdef Sources state_sources(State state, int64_t version)
