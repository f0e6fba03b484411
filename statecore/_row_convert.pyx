# cython: language_level=3
"""RowConverter: how a row of one schema becomes a row of another, by an
:class:`~statecore.schema_evolution.EvolutionPlan`, compiled once into byte moves.

The one implementation of the conversion rules' arithmetic (docs/evolution.md, "The rules"):
a new row starts as a template (each added field's default, zeros elsewhere) and each carried
field is moved from its old offset: copied as it is (the same type, a bytes field widened and
NUL-padded, an unsigned int widened), sign-extended (a signed int widened), or converted to
float64 (a float32, an int of at most 32 bits). Rows are little-endian and packed, as
:class:`~statecore.schema.RowSchema` lays them out. Converting runs without the GIL, a row at
a time (a lookup's value) or over whole arrays.
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

import numpy as np

cdef enum:
    MOVE_COPY = 0         # the old bytes as they are (the rest of the new field stays zero)
    MOVE_SIGNED = 1       # a signed int widened: its sign extended
    MOVE_F4_F8 = 2        # float32 -> float64
    MOVE_SIGNED_F8 = 3    # a signed int of at most 32 bits -> float64
    MOVE_UNSIGNED_F8 = 4  # an unsigned int of at most 32 bits -> float64


cdef int _move_kind(old, new) except -1:
    """The move that takes a field of dtype ``old`` to ``new`` (a change the plan allowed)."""
    if old == new or (old.kind == "S" and new.kind == "S") or (old.kind == "u" and new.kind in "iu"):
        return MOVE_COPY
    if old.kind == "i" and new.kind == "i":
        return MOVE_SIGNED
    if new.kind == "f" and new.itemsize == 8 and old.itemsize <= 4:
        if old.kind == "f":
            return MOVE_F4_F8
        if old.kind == "i":
            return MOVE_SIGNED_F8
        if old.kind == "u":
            return MOVE_UNSIGNED_F8
    raise ValueError(f"no conversion from {old} to {new}: the plan's rules allow none")


cdef inline int64_t _signed(const uint8_t* p, Py_ssize_t size) noexcept nogil:
    cdef int8_t a
    cdef int16_t b
    cdef int32_t c
    if size == 1:
        memcpy(&a, p, 1)
        return a
    if size == 2:
        memcpy(&b, p, 2)
        return b
    memcpy(&c, p, 4)
    return c


cdef inline uint64_t _unsigned(const uint8_t* p, Py_ssize_t size) noexcept nogil:
    cdef uint64_t v = 0
    memcpy(&v, p, <size_t>size)  # little-endian: the low bytes
    return v


cdef inline int64_t _signed_n(const uint8_t* p, Py_ssize_t size) noexcept nogil:
    """The little-endian signed int of ``size`` (1 to 8) bytes at ``p``."""
    cdef uint64_t u = 0
    memcpy(&u, p, <size_t>size)
    if size < 8 and (u >> (8 * size - 1)) & 1:
        u |= (<uint64_t>-1) << (8 * size)
    return <int64_t>u


cdef inline bint _all_zero(const uint8_t* p, Py_ssize_t size) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(size):
        if p[i]:
            return False
    return True


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _move_column(const FieldMove* m, const uint8_t* src, Py_ssize_t ss, uint8_t* dst, Py_ssize_t ds,
                       Py_ssize_t n) noexcept nogil:
    """One move over ``n`` rows; the widths the compiler can see are spelled out."""
    cdef Py_ssize_t i
    cdef int64_t v
    cdef float f
    cdef double d
    src += m.src
    dst += m.dst
    if m.kind == MOVE_COPY:
        if m.src_size == 8:
            for i in range(n):
                memcpy(dst + i * ds, src + i * ss, 8)
        elif m.src_size == 4:
            for i in range(n):
                memcpy(dst + i * ds, src + i * ss, 4)
        elif m.src_size == 1:
            for i in range(n):
                dst[i * ds] = src[i * ss]
        else:
            for i in range(n):
                memcpy(dst + i * ds, src + i * ss, <size_t>m.src_size)
    elif m.kind == MOVE_SIGNED:
        for i in range(n):
            v = _signed(src + i * ss, m.src_size)
            memcpy(dst + i * ds, &v, <size_t>m.dst_size)  # little-endian: the low bytes
    elif m.kind == MOVE_F4_F8:
        for i in range(n):
            memcpy(&f, src + i * ss, 4)
            d = f
            memcpy(dst + i * ds, &d, 8)
    elif m.kind == MOVE_SIGNED_F8:
        for i in range(n):
            d = <double>_signed(src + i * ss, m.src_size)
            memcpy(dst + i * ds, &d, 8)
    else:
        for i in range(n):
            d = <double>_unsigned(src + i * ss, m.src_size)
            memcpy(dst + i * ds, &d, 8)


@cython.final
cdef class RowConverter:
    """Rows of ``plan.old`` as rows of ``plan.new`` (an EvolutionPlan), a row or an array at a time."""

    def __cinit__(self, plan):
        old_fields, new_fields = plan.old.dtype.fields, plan.new.dtype.fields
        self.old_width, self.new_width = plan.old.width, plan.new.width
        template = np.zeros(1, dtype=plan.new.dtype)
        moves = []
        for f in plan.fields:
            if f.added:
                template[f.name] = f.default
            else:
                moves.append((_move_kind(f.old_dtype, f.dtype), old_fields[f.source][1], new_fields[f.name][1],
                              f.old_dtype.itemsize, f.dtype.itemsize))
        self.template = template.tobytes()
        self.template_row = <const uint8_t*>self.template
        self.moves = <FieldMove*>PyMem_Malloc(max(len(moves), 1) * sizeof(FieldMove))
        if self.moves == NULL:
            raise MemoryError()
        for i, (kind, src, dst, src_size, dst_size) in enumerate(moves):
            self.moves[i].kind, self.moves[i].src, self.moves[i].dst = kind, src, dst
            self.moves[i].src_size, self.moves[i].dst_size = src_size, dst_size
        self.n_moves = len(moves)
        # Every old field carried exactly once, copied or sign-extended, nothing added: each new
        # row that some old row becomes tells that old row back (narrow_many).
        self.invertible = (not any(f.added for f in plan.fields)
                           and sum(m[3] for m in moves) == self.old_width
                           and all(m[0] in (MOVE_COPY, MOVE_SIGNED) for m in moves))

    def __dealloc__(self):
        PyMem_Free(self.moves)

    cdef void convert_row(self, const uint8_t* src, uint8_t* dst) noexcept nogil:
        """One old row at ``src`` as a new row at ``dst`` (the two do not overlap)."""
        self.convert_many(src, self.old_width, dst, self.new_width, 1)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef void convert_many(self, const uint8_t* src, Py_ssize_t src_stride, uint8_t* dst, Py_ssize_t dst_stride,
                           Py_ssize_t n) noexcept nogil:
        """``n`` old rows, ``src_stride`` bytes apart, as new rows ``dst_stride`` bytes apart:
        the template into every row, then each move over the whole column (one kind and width
        per loop)."""
        cdef Py_ssize_t i, j, nw = self.new_width
        if n <= 0 or nw == 0:
            return
        if dst_stride == nw:  # packed rows: the template doubled into place
            memcpy(dst, self.template_row, <size_t>nw)
            i = 1
            while i < n:
                j = min(i, n - i)
                memcpy(dst + i * nw, dst, <size_t>(j * nw))
                i += j
        else:
            for i in range(n):
                memcpy(dst + i * dst_stride, self.template_row, <size_t>nw)
        for j in range(self.n_moves):
            _move_column(&self.moves[j], src, src_stride, dst, dst_stride, n)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef void narrow_many(self, const uint8_t* src, Py_ssize_t src_stride, uint8_t* dst, Py_ssize_t dst_stride,
                          uint8_t* ok, Py_ssize_t n) noexcept nogil:
        """The inverse, for an ``invertible`` converter: ``n`` new rows as the old rows they
        come from, ``ok[i]`` 0 where new row i is no old row's conversion (an int out of the
        old field's range, a bytes field longer than the old one), its old row then
        meaningless. REQUIRES: ``invertible``."""
        cdef Py_ssize_t i, j
        cdef const FieldMove* m
        cdef const uint8_t* new_field
        cdef uint8_t* old_field
        cdef int64_t v, low
        for i in range(n):
            ok[i] = 1
        for j in range(self.n_moves):
            m = &self.moves[j]
            for i in range(n):
                new_field = src + i * src_stride + m.dst
                old_field = dst + i * dst_stride + m.src
                memcpy(old_field, new_field, <size_t>m.src_size)  # little-endian: the low bytes
                if m.src_size == m.dst_size:
                    continue
                if m.kind == MOVE_COPY:  # zero-extended: the rest must be zeros
                    if not _all_zero(new_field + m.src_size, m.dst_size - m.src_size):
                        ok[i] = 0
                else:  # sign-extended: the value must be the old bytes' sign extension
                    v = _signed_n(new_field, m.dst_size)
                    low = _signed_n(new_field, m.src_size)
                    if v != low:
                        ok[i] = 0

    def convert_rows(self, const uint8_t[:, ::1] rows not None):
        """``(n, old_width)`` uint8 rows as a new ``(n, new_width)`` uint8 array."""
        if rows.shape[1] != self.old_width:
            raise ValueError(f"rows are {rows.shape[1]} bytes wide; the old rows are {self.old_width}")
        cdef Py_ssize_t n = rows.shape[0]
        out = np.empty((n, self.new_width), dtype=np.uint8)
        cdef uint8_t[:, ::1] dst = out
        if n and self.new_width:
            with nogil:
                self.convert_many(&rows[0, 0] if self.old_width else NULL, self.old_width, &dst[0, 0], self.new_width,
                                  n)
        return out


def narrow_rows(RowConverter converter not None, const uint8_t[:, ::1] rows not None):
    """``(old rows, ok)`` of ``(n, new_width)`` rows: :meth:`RowConverter.narrow_many` over an
    array. ValueError if ``converter`` is not invertible or the rows are of another width."""
    if not converter.invertible:
        raise ValueError("this conversion cannot be undone: it drops, adds or converts a field")
    if rows.shape[1] != converter.new_width:
        raise ValueError(f"rows are {rows.shape[1]} bytes wide; the new rows are {converter.new_width}")
    cdef Py_ssize_t n = rows.shape[0]
    old = np.empty((n, converter.old_width), dtype=np.uint8)
    ok = np.empty(n, dtype=np.uint8)
    cdef uint8_t[:, ::1] dst = old
    cdef uint8_t[::1] flags = ok
    if n:
        with nogil:
            converter.narrow_many(&rows[0, 0], converter.new_width, &dst[0, 0], converter.old_width, &flags[0], n)
    return old, ok.view(np.bool_)
