# cython: language_level=3
"""Read-only file mappings guarded against SIGBUS (see _mapping.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint64_t


@cython.final
cdef class Mapping:
    cdef const uint8_t* base
    cdef size_t length
    cdef int guard                      # entry in the SIGBUS guard's table, or -1
    cdef uint64_t damaged_at            # set by the SIGBUS handler: file offset + 1
    cdef uint64_t canary_at             # offset of the file's last 8 bytes
    cdef uint64_t canary                # their value when the file was opened

    cdef uint64_t damage(self) noexcept nogil
    cdef bint sound(self) noexcept nogil


cdef void willneed(const uint8_t* base, uint64_t start, uint64_t end) noexcept nogil
