# cython: language_level=3
"""RowCalls: a store's per-row get, put and remove, compiled (see _rowcalls.pyx)."""
cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from statecore._lock cimport ProviderLock
from statecore._rowcodec cimport RowCodec
from statecore._rowtable cimport RowTable
from statecore._versions cimport Sources, State


cdef class RowCalls:
    cdef RowCodec key_codec
    cdef RowCodec value_codec
    cdef Py_ssize_t key_width
    cdef Py_ssize_t value_width
    cdef State state                  # the pinned version's State, and the version
    cdef int64_t version
    cdef ProviderLock lock            # the provider's lock, taken from C per lookup
    cdef object changes               # state.changes, and its count when the walk was taken
    cdef const uint64_t* changes_at
    cdef uint64_t sources_at
    cdef Sources sources              # the version's flattened sources (None: not taken yet)
    cdef RowTable puts                # the store's update layer, or None (a read store)
    cdef RowTable dels
    cdef readonly int status           # READING, UPDATING, COMMITTED or ABORTED (_rowcalls.pyx)

    cdef int _follow(self, view) except -1
    @cython.final
    cdef int _take_sources(self) except -1
    @cython.final
    cdef int _require_updating(self, verb) except -1
    @cython.final
    cdef int _find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1
