# cython: language_level=3
"""The delta format: DeltaHeader and the helpers of both file formats' headers (see
_delta_format.pyx)."""
cimport cython
from libc.stdint cimport uint64_t


@cython.final
cdef class DeltaHeader:
    cdef readonly int format_version
    cdef readonly object store_version
    cdef readonly bytes lineage
    cdef readonly str compression
    cdef readonly Py_ssize_t key_width
    cdef readonly Py_ssize_t value_width
    cdef readonly object key_fingerprint
    cdef readonly object value_fingerprint
    cdef readonly object checksum       # the header checksum (it seeds the blocks checksum)


cdef bytes lineage_bytes(object lineage, str what)
cdef bytes header_bytes(data, Py_ssize_t size, name)
cdef object header_field(reader, header, str name)
cdef bytes sealed(bytes body, uint64_t seed=*)
cdef Py_ssize_t lz4_bound(Py_ssize_t raw_size)
