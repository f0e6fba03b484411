# cython: language_level=3
"""RowCodec: the per-row conversions of one :class:`~statecore.schema.RowSchema`, compiled.

``encode_into`` writes the row bytes of a tuple (or a bare scalar, for a one-field schema)
straight into a caller's buffer; ``decode_from`` makes the tuple of a row. The rules are
RowSchema's, and they live there only: the compiled path takes just the inputs whose
outcome is plain (an exact tuple of exact ints, floats, bools and bytes, each in its
field's range) and hands everything else (numpy scalars and records, lists, bytes rows,
subclasses, and every value it would refuse) to ``RowSchema.encode``, which converts it or
raises its own error. So a refused input raises exactly what RowSchema raises. The fast
path may write part of the buffer before it gives up; the fallback then writes the whole
row or raises, and a caller uses the buffer only after a call that returned.
"""
cimport cython
from cpython.bool cimport PyBool_FromLong
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_CheckExact, PyFloat_FromDouble
from cpython.long cimport PyLong_CheckExact, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_CheckExact, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_New, PyTuple_SET_ITEM
from libc.math cimport isinf
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from statecore._float_keys cimport key_bits32, key_bits64

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    # The conversions the fast path tries, declared without an exception check: a failure
    # is cleared on the spot and the value left to RowSchema.
    double _as_double "PyLong_AsDouble"(object v)
    long long _as_long_long "PyLong_AsLongLongAndOverflow"(object v, int* overflow)
    unsigned long long _as_unsigned "PyLong_AsUnsignedLongLong"(object v)

cdef extern from *:
    """
    /* A little-endian host is assumed, as statecore._hash checks at import. */
    static inline double sc_f32_to_f64(const uint8_t* p) { float f; memcpy(&f, p, 4); return (double)f; }

    /* The value of an exact int that fits one internal digit (|v| < 2**30), read from the
       object without a call: 1 and *out set, or 0 for any other int (then converted by
       PyLong_AsLongLongAndOverflow). */
    static inline int sc_small_int(PyObject* v, long long* out) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject*)v)) return 0;
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject*)v);
        return 1;
    #else
        Py_ssize_t size = Py_SIZE(v);
        if (size == 0) { *out = 0; return 1; }
        if (size == 1) { *out = (long long)((PyLongObject*)v)->ob_digit[0]; return 1; }
        if (size == -1) { *out = -(long long)((PyLongObject*)v)->ob_digit[0]; return 1; }
        return 0;
    #endif
    }
    """
    double sc_f32_to_f64(const uint8_t* p) noexcept nogil
    int sc_small_int(PyObject* v, long long* out) noexcept

cdef enum:
    FIELD_BOOL = 0
    FIELD_I8 = 1
    FIELD_I16 = 2
    FIELD_I32 = 3
    FIELD_I64 = 4
    FIELD_U8 = 5
    FIELD_U16 = 6
    FIELD_U32 = 7
    FIELD_U64 = 8
    FIELD_F32 = 9
    FIELD_F64 = 10
    FIELD_BYTES = 11

# numpy dtype.str of a canonical field -> its FIELD_* code
_KINDS = {"|b1": FIELD_BOOL, "|i1": FIELD_I8, "<i2": FIELD_I16, "<i4": FIELD_I32, "<i8": FIELD_I64,
          "|u1": FIELD_U8, "<u2": FIELD_U16, "<u4": FIELD_U32, "<u8": FIELD_U64,
          "<f4": FIELD_F32, "<f8": FIELD_F64}


cdef inline bint _signed_in(long long x, int kind) noexcept:
    if kind == FIELD_I8:
        return -128 <= x <= 127
    if kind == FIELD_I16:
        return -32768 <= x <= 32767
    if kind == FIELD_I32:
        return -2147483648 <= x <= 2147483647
    if kind == FIELD_U8:
        return 0 <= x <= 255
    if kind == FIELD_U16:
        return 0 <= x <= 65535
    if kind == FIELD_U32:
        return 0 <= x <= 4294967295
    return True  # FIELD_I64: every long long


cdef inline void _store_int(uint8_t* p, long long x, Py_ssize_t size) noexcept:
    cdef int8_t a
    cdef int16_t b
    cdef int32_t c
    cdef int64_t d
    if size == 1:
        a = <int8_t>x
        memcpy(p, &a, 1)
    elif size == 2:
        b = <int16_t>x
        memcpy(p, &b, 2)
    elif size == 4:
        c = <int32_t>x
        memcpy(p, &c, 4)
    else:
        d = <int64_t>x
        memcpy(p, &d, 8)


cdef inline void _normalize64(uint8_t* p) noexcept:
    """A float64 key field as Spark groups it (``_float_keys.pxd``)."""
    cdef uint64_t bits
    memcpy(&bits, p, 8)
    bits = key_bits64(bits)
    memcpy(p, &bits, 8)


cdef inline void _normalize32(uint8_t* p) noexcept:
    """A float32 key field as Spark groups it (``_float_keys.pxd``)."""
    cdef uint32_t bits
    memcpy(&bits, p, 4)
    bits = key_bits32(bits)
    memcpy(p, &bits, 4)


@cython.final
cdef class RowCodec:
    """The compiled per-row conversions of ``schema`` (a RowSchema); see the module docstring.

    ``encode(obj)`` and ``decode(row)`` are the Python face, equal to ``schema.encode`` and
    ``schema.decode``; stores call ``encode_into`` and ``decode_from`` on their buffers.
    """

    def __cinit__(self, schema):
        cdef Py_ssize_t i
        self.schema = schema
        self.width = schema.width
        self._slow_encode = schema.encode
        self.n_fields = len(schema.fields)
        self.fields = <FieldSpec*>PyMem_Malloc(max(self.n_fields, 1) * sizeof(FieldSpec))
        if self.fields == NULL:
            raise MemoryError("RowCodec could not allocate its field table")
        for i, (name, f) in enumerate(schema.fields):
            self.fields[i].offset = schema.dtype.fields[name][1]
            self.fields[i].size = f.itemsize
            self.fields[i].kind = FIELD_BYTES if f.kind == "S" else _KINDS[f.str]
            self.fields[i].normalize = schema.key and f.kind == "f"

    def __dealloc__(self):
        PyMem_Free(self.fields)
        self.fields = NULL

    # -- encode ---------------------------------------------------------------------------
    cdef int encode_into(self, obj, uint8_t* out) except -1:
        """Write the row of ``obj`` at ``out`` (``width`` bytes); raises what RowSchema.encode
        raises for an input it refuses."""
        if self._encode_fast(obj, out):
            return 0
        row = self._slow_encode(obj)  # converts what the fast path leaves, or raises
        # REQUIRES: RowSchema.encode returns exactly ``width`` bytes
        if self.width:
            memcpy(out, PyBytes_AS_STRING(row), self.width)
        return 0

    cdef bint _encode_fast(self, obj, uint8_t* out) noexcept:
        """True if ``obj`` is a plain input whose row is now at ``out``; False (no error set)
        for anything RowSchema must decide."""
        cdef Py_ssize_t i
        if PyTuple_CheckExact(obj):
            if PyTuple_GET_SIZE(obj) != self.n_fields:
                return False
            for i in range(self.n_fields):
                if not _encode_field(&self.fields[i], PyTuple_GET_ITEM(obj, i), out):
                    return False
            return True
        if self.n_fields != 1:
            return False
        # a bare scalar: what RowSchema takes as the one field's value (bytes only for S<n>:
        # for another field, bytes are a whole row, which RowSchema checks)
        if PyBytes_CheckExact(obj) and self.fields[0].kind != FIELD_BYTES:
            return False
        return _encode_field(&self.fields[0], <PyObject*>obj, out)

    def encode(self, obj):
        """The row bytes of ``obj``: ``schema.encode(obj)``, through the compiled path."""
        row = PyBytes_FromStringAndSize(NULL, self.width)
        self.encode_into(obj, <uint8_t*>PyBytes_AS_STRING(row))
        return row

    # -- decode ---------------------------------------------------------------------------
    cdef tuple decode_from(self, const uint8_t* row):
        """The tuple of the row at ``row``: ``schema.decode`` (bytes without trailing NULs)."""
        cdef Py_ssize_t i
        cdef tuple out = PyTuple_New(self.n_fields)
        cdef object v
        for i in range(self.n_fields):
            v = _decode_field(&self.fields[i], row)
            Py_INCREF(v)
            PyTuple_SET_ITEM(out, i, v)
        # It holds ints, floats, bools and bytes only, so no reference cycle can pass through
        # it: the collector would untrack it on its first pass (as it does every such tuple);
        # untracked now, it costs the young-generation collections nothing.
        PyObject_GC_UnTrack(<PyObject*>out)
        return out

    def decode(self, const uint8_t[::1] row not None):
        """``schema.decode(row)`` for row bytes of exactly ``width``."""
        if row.shape[0] != self.width:
            raise ValueError(f"a row of {self.schema.names} is {self.width} bytes, got {row.shape[0]}")
        if self.width == 0:
            return self.decode_from(NULL)
        return self.decode_from(&row[0])


cdef inline bint _encode_field(const FieldSpec* f, PyObject* v_ptr, uint8_t* out) noexcept:
    """Write one plain value at its offset; False (no error set) if RowSchema must decide."""
    cdef object v = <object>v_ptr
    cdef uint8_t* p = out + f.offset
    cdef int overflow = 0
    cdef long long x
    cdef unsigned long long u
    cdef double d
    cdef float s
    cdef Py_ssize_t n
    cdef int kind = f.kind
    if kind == FIELD_BOOL:
        if v is True:
            p[0] = 1
        elif v is False:
            p[0] = 0
        else:
            return False
        return True
    if kind == FIELD_BYTES:
        if not PyBytes_CheckExact(v):
            return False
        n = PyBytes_GET_SIZE(v)
        if n > f.size:
            return False
        memcpy(p, PyBytes_AS_STRING(v), n)
        memset(p + n, 0, f.size - n)
        return True
    if kind == FIELD_F64 or kind == FIELD_F32:
        if PyFloat_CheckExact(v):
            d = PyFloat_AS_DOUBLE(v)
        elif PyLong_CheckExact(v):
            d = _as_double(v)
            if d == -1.0 and PyErr_Occurred() != NULL:
                PyErr_Clear()
                return False
        else:
            return False
        if kind == FIELD_F64:
            memcpy(p, &d, 8)
            if f.normalize:
                _normalize64(p)
        else:
            s = <float>d
            if isinf(s) and not isinf(d):
                return False  # struct's overflow: RowSchema names the field
            memcpy(p, &s, 4)
            if f.normalize:
                _normalize32(p)
        return True
    if not PyLong_CheckExact(v):
        return False
    if sc_small_int(v_ptr, &x):
        if kind == FIELD_U64:
            if x < 0:
                return False
        elif not _signed_in(x, kind):
            return False
        _store_int(p, x, f.size)
        return True
    if kind == FIELD_U64:
        u = _as_unsigned(v)
        if u == <unsigned long long>-1 and PyErr_Occurred() != NULL:
            PyErr_Clear()
            return False
        memcpy(p, &u, 8)
        return True
    x = _as_long_long(v, &overflow)
    if overflow or (x == -1 and PyErr_Occurred() != NULL):
        PyErr_Clear()
        return False
    if not _signed_in(x, kind):
        return False
    _store_int(p, x, f.size)
    return True


cdef object _decode_field(const FieldSpec* f, const uint8_t* row):
    cdef const uint8_t* p = row + f.offset
    cdef int8_t a
    cdef int16_t b
    cdef int32_t c
    cdef int64_t d
    cdef uint16_t ub
    cdef uint32_t uc
    cdef uint64_t ud
    cdef double x
    cdef Py_ssize_t n
    cdef int kind = f.kind
    if kind == FIELD_I64:
        memcpy(&d, p, 8)
        return PyLong_FromLongLong(d)
    if kind == FIELD_F64:
        memcpy(&x, p, 8)
        return PyFloat_FromDouble(x)
    if kind == FIELD_BYTES:
        n = f.size
        while n > 0 and p[n - 1] == 0:
            n -= 1
        return PyBytes_FromStringAndSize(<const char*>p, n)
    if kind == FIELD_BOOL:
        return PyBool_FromLong(p[0] != 0)
    if kind == FIELD_F32:
        return PyFloat_FromDouble(sc_f32_to_f64(p))
    if kind == FIELD_I8:
        memcpy(&a, p, 1)
        return PyLong_FromLongLong(a)
    if kind == FIELD_I16:
        memcpy(&b, p, 2)
        return PyLong_FromLongLong(b)
    if kind == FIELD_I32:
        memcpy(&c, p, 4)
        return PyLong_FromLongLong(c)
    if kind == FIELD_U8:
        return PyLong_FromLongLong(p[0])
    if kind == FIELD_U16:
        memcpy(&ub, p, 2)
        return PyLong_FromLongLong(ub)
    if kind == FIELD_U32:
        memcpy(&uc, p, 4)
        return PyLong_FromLongLong(uc)
    memcpy(&ud, p, 8)
    return PyLong_FromUnsignedLongLong(ud)
