# cython: language_level=3
"""RowCodec: one RowSchema's per-row conversions, compiled (see _rowcodec.pyx)."""
cimport cython
from libc.stdint cimport uint8_t


cdef struct FieldSpec:
    int kind            # a FIELD_* code of _rowcodec.pyx
    Py_ssize_t offset   # byte offset in the row
    Py_ssize_t size     # bytes (the n of S<n>)
    bint normalize      # a float field of a key: -0.0 and NaNs made canonical


@cython.final
cdef class RowCodec:
    cdef readonly object schema
    cdef readonly Py_ssize_t width
    cdef Py_ssize_t n_fields
    cdef FieldSpec* fields
    cdef object _slow_encode        # schema.encode: the rules' one implementation

    cdef int encode_into(self, obj, uint8_t* out) except -1
    cdef bint _encode_fast(self, obj, uint8_t* out) noexcept
    cdef tuple decode_from(self, const uint8_t* row)
