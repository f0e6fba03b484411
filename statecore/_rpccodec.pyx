# cython: language_level=3
"""The RPC value codec and frame envelope, compiled: what every ask and send pays on both
sides. In pure Python, encoding and decoding took about a quarter of a loopback round trip
(bench/bench_rpc.py); here one value is one C pass over the bytes.

The format is statecore.rpc's (its module docstring describes it byte by byte, and
tests/test_rpc.py pins this module against a pure-Python reference written from it). Errors
are those statecore.rpc documents: encoding raises TypeError naming an unsupported type (exact
types only: a subclass, set, bytearray or numpy scalar is refused), ValueError for an int
outside the signed 64-bit range or nesting deeper than ``MAX_DEPTH``; decoding raises
:class:`statecore.rpc.RpcProtocolError` for anything malformed, and never reads outside the
bytes it was given nor allocates much more than they could describe, whatever they say.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_FromDouble
from cpython.list cimport PyList_AsTuple, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    # Compact ASCII strings hold their utf-8 bytes already: no copy, and no utf-8 cache
    # is attached to the str (PyUnicode_AsUTF8AndSize would keep one for non-ASCII text).
    bint PyUnicode_IS_COMPACT_ASCII(object s)
    const void* PyUnicode_DATA(object s)
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    bytes PyUnicode_AsUTF8String(object s)
    str PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)
    const Py_ssize_t PY_SSIZE_T_MAX

__all__ = ["encode_value", "decode_value", "encode_frame", "decode_envelope", "type_name", "MAX_DEPTH",
           "ENVELOPE_BYTES"]

MAX_DEPTH = RPC_MAX_DEPTH
ENVELOPE_BYTES = RPC_ENVELOPE_BYTES

cdef enum:
    # Room on the C stack for a whole frame: a coordinator message is ~150 bytes, so the
    # common case makes no heap allocation besides the resulting bytes object.
    STACK_BYTES = 1024
    # Items a container's decoder allocates room for before it has decoded them. A count
    # is only checked against the bytes left, so larger containers grow as their items
    # arrive: otherwise nested hostile counts could each reserve 8 bytes per input byte.
    PREALLOCATE_ITEMS = 256


# -- errors --------------------------------------------------------------------------------------

cdef object _ProtocolError = None


cdef object _protocol_error(str message):
    """An RpcProtocolError. Looked up on first use, since statecore.rpc (which defines it)
    imports this module."""
    global _ProtocolError
    if _ProtocolError is None:
        from statecore.rpc import RpcProtocolError
        _ProtocolError = RpcProtocolError
    return _ProtocolError(message)


cdef object _truncated(const Reader* r):
    return _protocol_error(f"truncated value ({r.size - r.start} bytes)")


def type_name(t):
    """How messages name a type: ``set`` for a builtin, ``module.QualName`` otherwise."""
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# -- big-endian integers (shifts, so the host's byte order does not matter) ---------------------

cdef inline void _store_u16(uint8_t* p, uint16_t v) noexcept nogil:
    p[0] = <uint8_t>(v >> 8)
    p[1] = <uint8_t>v


cdef inline void _store_u32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>(v >> 24)
    p[1] = <uint8_t>(v >> 16)
    p[2] = <uint8_t>(v >> 8)
    p[3] = <uint8_t>v


cdef inline void _store_u64(uint8_t* p, uint64_t v) noexcept nogil:
    _store_u32(p, <uint32_t>(v >> 32))
    _store_u32(p + 4, <uint32_t>v)


cdef inline uint16_t _load_u16(const uint8_t* p) noexcept nogil:
    return <uint16_t>((<uint16_t>p[0] << 8) | p[1])


cdef inline uint32_t _load_u32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3]


cdef inline uint64_t _load_u64(const uint8_t* p) noexcept nogil:
    return (<uint64_t>_load_u32(p) << 32) | _load_u32(p + 4)


# -- encoding ------------------------------------------------------------------------------------

cdef inline void _writer_init(Writer* w, uint8_t* storage, Py_ssize_t capacity) noexcept nogil:
    w.data = storage
    w.size = 0
    w.capacity = capacity
    w.heap = False


cdef inline void _writer_free(Writer* w) noexcept:
    if w.heap:
        PyMem_Free(w.data)
        w.heap = False


cdef int _grow(Writer* w, Py_ssize_t extra) except -1:
    """Room for ``extra`` more bytes; the capacity at least doubles, so appends cost O(1)."""
    cdef Py_ssize_t need, capacity
    cdef uint8_t* data
    if extra > PY_SSIZE_T_MAX - w.size:
        raise MemoryError()
    need = w.size + extra
    capacity = w.capacity * 2 if w.capacity < PY_SSIZE_T_MAX // 2 else PY_SSIZE_T_MAX
    if capacity < need:
        capacity = need
    if w.heap:
        data = <uint8_t*>PyMem_Realloc(w.data, <size_t>capacity)
    else:
        data = <uint8_t*>PyMem_Malloc(<size_t>capacity)
        if data != NULL and w.size:
            memcpy(data, w.data, <size_t>w.size)
    if data == NULL:
        raise MemoryError()
    w.data = data
    w.capacity = capacity
    w.heap = True
    return 0


cdef inline uint8_t* _reserve(Writer* w, Py_ssize_t n) except NULL:
    """The next ``n`` bytes of the output, to be filled by the caller."""
    cdef uint8_t* p
    if n > w.capacity - w.size:
        _grow(w, n)
    p = w.data + w.size
    w.size += n
    return p


cdef int _put_counted(Writer* w, uint8_t tag, Py_ssize_t count, const void* data, Py_ssize_t n) except -1:
    """``tag | count u32``, then ``n`` bytes of ``data`` (a str, bytes or container header)."""
    cdef uint8_t* p
    if count > RPC_MAX_U32:
        raise ValueError(f"cannot encode a value of {count} items or bytes for RPC: lengths and counts are u32")
    p = _reserve(w, 5 + n)
    p[0] = tag
    _store_u32(p + 1, <uint32_t>count)
    if n:
        memcpy(p + 5, data, <size_t>n)
    return 0


cdef int _put_str(Writer* w, str s) except -1:
    cdef bytes utf8
    if PyUnicode_IS_COMPACT_ASCII(s):
        return _put_counted(w, TAG_STR, PyUnicode_GET_LENGTH(s), PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s))
    utf8 = PyUnicode_AsUTF8String(s)  # UnicodeEncodeError for lone surrogates, as str.encode()
    return _put_counted(w, TAG_STR, PyBytes_GET_SIZE(utf8), PyBytes_AS_STRING(utf8), PyBytes_GET_SIZE(utf8))


cdef inline bint _is_key_type(type t) noexcept:
    return t is str or t is int or t is bytes or t is float or t is bool or t is type(None)


cdef int _check_depth(int depth) except -1:
    if depth >= RPC_MAX_DEPTH:
        raise ValueError(f"cannot encode a value nested deeper than {RPC_MAX_DEPTH} containers for RPC")
    return 0


cdef int encode_into(Writer* w, object value, int depth) except -1:
    """Append the encoding of ``value``. Only exact types encode. No Python code runs while
    a container is walked, so its size cannot change between its count and its items."""
    cdef type t = type(value)
    cdef uint8_t* p
    cdef int overflow = 0
    cdef long long number
    cdef double real
    cdef uint64_t bits
    if t is str:
        return _put_str(w, <str>value)
    if t is int:
        number = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            raise ValueError(f"cannot encode int {value} for RPC: outside the signed 64-bit range")
        p = _reserve(w, 9)
        p[0] = TAG_INT
        _store_u64(p + 1, <uint64_t>number)
        return 0
    if t is tuple:
        _check_depth(depth)
        _put_counted(w, TAG_TUPLE, len(<tuple>value), NULL, 0)
        for item in <tuple>value:
            encode_into(w, item, depth + 1)
        return 0
    if value is None:
        _reserve(w, 1)[0] = TAG_NONE
        return 0
    if t is list:
        _check_depth(depth)
        _put_counted(w, TAG_LIST, len(<list>value), NULL, 0)
        for item in <list>value:
            encode_into(w, item, depth + 1)
        return 0
    if t is float:
        real = PyFloat_AS_DOUBLE(value)
        memcpy(&bits, &real, 8)  # the bits as they are, NaN payloads included (as struct does)
        p = _reserve(w, 9)
        p[0] = TAG_FLOAT
        _store_u64(p + 1, bits)
        return 0
    if t is bool:
        _reserve(w, 1)[0] = TAG_TRUE if value is True else TAG_FALSE
        return 0
    if t is bytes:
        return _put_counted(w, TAG_BYTES, PyBytes_GET_SIZE(value), PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    if t is dict:
        _check_depth(depth)
        _put_counted(w, TAG_DICT, len(<dict>value), NULL, 0)
        for key, item in (<dict>value).items():
            if not _is_key_type(type(key)):
                raise TypeError(f"cannot encode a dict key of type {type_name(type(key))} for RPC: keys must "
                                f"be None, bool, int, float, str or bytes")
            encode_into(w, key, depth + 1)
            encode_into(w, item, depth + 1)
        return 0
    raise TypeError(f"cannot encode a value of type {type_name(t)} for RPC: supported are None, bool, int, "
                    f"float, str, bytes, tuple, list and dict")


def encode_value(value):
    """The wire encoding of ``value`` (see statecore.rpc); TypeError for an unsupported type."""
    cdef uint8_t storage[STACK_BYTES]
    cdef Writer w
    _writer_init(&w, storage, STACK_BYTES)
    try:
        encode_into(&w, value, 0)
        return PyBytes_FromStringAndSize(<char*>w.data, w.size)
    finally:
        _writer_free(&w)


def encode_frame(uint8_t kind, uint64_t request_id, bytes name not None, value):
    """One complete frame, ``length u32 | kind | request_id | name_length | name | value``,
    ready for a single ``sendall``. ValueError if it would exceed 2**32 - 1 bytes."""
    cdef uint8_t storage[STACK_BYTES]
    cdef Writer w
    cdef uint8_t* p
    cdef Py_ssize_t name_length = PyBytes_GET_SIZE(name), size
    if name_length > 0xFFFF:
        raise ValueError("an endpoint name must be at most 65535 bytes of utf-8")
    _writer_init(&w, storage, STACK_BYTES)
    try:
        p = _reserve(&w, RPC_FRAME_HEADER_BYTES + name_length)
        p[4] = kind
        _store_u64(p + 5, request_id)
        _store_u16(p + 13, <uint16_t>name_length)
        if name_length:
            memcpy(p + RPC_FRAME_HEADER_BYTES, PyBytes_AS_STRING(name), <size_t>name_length)
        encode_into(&w, value, 0)
        size = w.size - 4
        if size > RPC_MAX_U32:
            raise ValueError(f"message of {size} bytes is too large for one RPC frame")
        _store_u32(w.data, <uint32_t>size)
        return PyBytes_FromStringAndSize(<char*>w.data, w.size)
    finally:
        _writer_free(&w)


# -- decoding ------------------------------------------------------------------------------------

cdef inline bint _is_key_tag(uint8_t tag) noexcept nogil:
    return (tag == TAG_STR or tag == TAG_INT or tag == TAG_NONE or tag == TAG_TRUE or tag == TAG_FALSE
            or tag == TAG_FLOAT or tag == TAG_BYTES)


cdef Py_ssize_t _container_count(Reader* r, int depth) except -1:
    """Read a container's ``tag | count`` (at ``r.pos``) and return the count, refusing excess
    depth and a count larger than the bytes left (every item takes at least one)."""
    cdef Py_ssize_t pos = r.pos, count
    if depth >= RPC_MAX_DEPTH:
        raise _protocol_error(f"value nested deeper than {RPC_MAX_DEPTH} containers")
    if r.size - pos < 5:
        raise _truncated(r)
    count = _load_u32(r.data + pos + 1)
    r.pos = pos + 5
    if count > r.size - r.pos:
        raise _truncated(r)
    return count


cdef list _decode_items(Reader* r, Py_ssize_t count, int depth):
    """The next ``count`` values, as a list."""
    cdef list items
    cdef Py_ssize_t i
    if count > PREALLOCATE_ITEMS:
        items = []
        for i in range(count):
            items.append(decode_from(r, depth))
        return items
    items = PyList_New(count)  # empty slots are NULL: the list never leaves here unfilled
    for i in range(count):
        item = decode_from(r, depth)
        Py_INCREF(item)
        PyList_SET_ITEM(items, i, item)
    return items


cdef tuple _decode_tuple(Reader* r, Py_ssize_t count, int depth):
    cdef tuple items
    cdef Py_ssize_t i
    if count > PREALLOCATE_ITEMS:
        return PyList_AsTuple(_decode_items(r, count, depth))
    items = PyTuple_New(count)
    for i in range(count):
        item = decode_from(r, depth)
        Py_INCREF(item)
        PyTuple_SET_ITEM(items, i, item)
    return items


cdef dict _decode_dict(Reader* r, Py_ssize_t count, int depth):
    cdef dict d = {}
    cdef Py_ssize_t i
    cdef uint8_t tag
    for i in range(count):
        if r.pos >= r.size:
            raise _truncated(r)
        tag = r.data[r.pos]
        if not _is_key_tag(tag):
            raise _protocol_error(f"dict key with tag {tag:#04x} at byte {r.pos}: keys must be scalars")
        key = decode_from(r, depth)
        d[key] = decode_from(r, depth)
        if len(d) != i + 1:
            raise _protocol_error(f"duplicate dict key {key!r}")
    return d


cdef object decode_from(Reader* r, int depth):
    """The value at ``r.pos``, leaving ``r.pos`` after it. Truncation and bad tags raise
    RpcProtocolError here; bad utf-8 raises UnicodeDecodeError (the caller words it)."""
    cdef Py_ssize_t pos = r.pos, length
    cdef const uint8_t* p
    cdef uint8_t tag
    cdef uint64_t bits
    cdef double real
    if pos >= r.size:
        raise _truncated(r)
    p = r.data + pos
    tag = p[0]
    if tag == TAG_STR or tag == TAG_BYTES:
        if r.size - pos < 5:
            raise _truncated(r)
        length = _load_u32(p + 1)
        if length > r.size - pos - 5:
            raise _truncated(r)
        r.pos = pos + 5 + length
        if tag == TAG_STR:
            return PyUnicode_DecodeUTF8(<const char*>(p + 5), length, NULL)
        return PyBytes_FromStringAndSize(<const char*>(p + 5), length)
    if tag == TAG_INT or tag == TAG_FLOAT:
        if r.size - pos < 9:
            raise _truncated(r)
        bits = _load_u64(p + 1)
        r.pos = pos + 9
        if tag == TAG_INT:
            return PyLong_FromLongLong(<int64_t>bits)
        memcpy(&real, &bits, 8)
        return PyFloat_FromDouble(real)
    if tag == TAG_NONE:
        r.pos = pos + 1
        return None
    if tag == TAG_TUPLE:
        return _decode_tuple(r, _container_count(r, depth), depth + 1)
    if tag == TAG_LIST:
        return _decode_items(r, _container_count(r, depth), depth + 1)
    if tag == TAG_TRUE or tag == TAG_FALSE:
        r.pos = pos + 1
        return tag == TAG_TRUE
    if tag == TAG_DICT:
        return _decode_dict(r, _container_count(r, depth), depth + 1)
    raise _protocol_error(f"unknown value tag {tag:#04x} at byte {pos}")


cdef object _decode_exactly(const uint8_t* data, Py_ssize_t size, Py_ssize_t pos):
    """The one value in ``data[pos:size]``; anything else is an RpcProtocolError."""
    cdef Reader r
    r.data, r.size, r.pos, r.start = data, size, pos, pos
    try:
        value = decode_from(&r, 0)
    except UnicodeDecodeError as e:
        raise _protocol_error(f"invalid utf-8 in a string: {e.reason}") from None
    if r.pos != size:
        raise _protocol_error(f"{size - r.pos} trailing bytes after the value")
    return value


def decode_value(data):
    """The value of ``encode_value``'s bytes (``data``: bytes or any C-contiguous bytes-like
    object); RpcProtocolError for anything malformed."""
    cdef Py_buffer view
    if type(data) is bytes:
        return _decode_exactly(<const uint8_t*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), 0)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _decode_exactly(<const uint8_t*>view.buf, view.len, 0)
    finally:
        PyBuffer_Release(&view)


cdef tuple _decode_envelope(const uint8_t* data, Py_ssize_t size):
    cdef uint8_t kind
    cdef uint64_t request_id
    cdef Py_ssize_t name_length, pos
    if size < RPC_ENVELOPE_BYTES:
        raise _protocol_error(f"frame of {size} bytes is shorter than an envelope")
    kind = data[0]
    request_id = _load_u64(data + 1)
    name_length = _load_u16(data + 9)
    pos = RPC_ENVELOPE_BYTES + name_length
    if kind < 1 or kind > 4:
        raise _protocol_error(f"unknown message kind {kind}")
    if pos > size:
        raise _protocol_error("truncated endpoint name")
    name = ""
    if name_length:
        try:
            name = PyUnicode_DecodeUTF8(<const char*>(data + RPC_ENVELOPE_BYTES), name_length, NULL)
        except UnicodeDecodeError:
            raise _protocol_error("endpoint name is not utf-8") from None
    return kind, request_id, name, _decode_exactly(data, size, pos)


def decode_envelope(body):
    """``(kind, request_id, name, value)`` of one frame body (the frame less its length);
    RpcProtocolError if it is malformed."""
    cdef Py_buffer view
    if type(body) is bytes:
        return _decode_envelope(<const uint8_t*>PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        return _decode_envelope(<const uint8_t*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
