# cython: language_level=3
"""RowConverter: an evolution plan compiled to byte moves over fixed-layout rows (see _row_convert.pyx)."""
cimport cython
from libc.stdint cimport uint8_t


cdef struct FieldMove:
    int kind                # MOVE_COPY, MOVE_SIGNED, MOVE_F4_F8, MOVE_SIGNED_F8, MOVE_UNSIGNED_F8
    Py_ssize_t src          # the field's offset in an old row
    Py_ssize_t dst          # its offset in a new row
    Py_ssize_t src_size     # its old width in bytes
    Py_ssize_t dst_size     # its new width in bytes


@cython.final
cdef class RowConverter:
    cdef readonly Py_ssize_t old_width
    cdef readonly Py_ssize_t new_width
    cdef FieldMove* moves
    cdef Py_ssize_t n_moves
    cdef bytes template               # a new row: each added field's default, zeros elsewhere
    cdef const uint8_t* template_row  # its bytes (alive as long as ``template``)
    cdef readonly bint invertible     # each new row tells the old row it came from (narrow_many)

    cdef void convert_row(self, const uint8_t* src, uint8_t* dst) noexcept nogil
    cdef void convert_many(self, const uint8_t* src, Py_ssize_t src_stride, uint8_t* dst, Py_ssize_t dst_stride,
                           Py_ssize_t n) noexcept nogil
    cdef void narrow_many(self, const uint8_t* src, Py_ssize_t src_stride, uint8_t* dst, Py_ssize_t dst_stride,
                          uint8_t* ok, Py_ssize_t n) noexcept nogil
