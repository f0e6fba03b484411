# cython: language_level=3
"""Python access to float key normalization (the table and the rule live in ``_float_keys.pxd``).

``FLOAT_KEY_BITS`` is the table for Python code; ``key_bits`` is the rule for one value's
bits (RowSchema's per-row path), ``needs_normalizing`` and ``normalize_bits`` for a whole
column of bits, strided or not (RowSchema's batch path, spark_hash).
"""
cimport cython
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.string cimport memcpy

import numpy as np

__all__ = ["FLOAT_KEY_BITS", "key_bits", "needs_normalizing", "normalize_bits"]

ctypedef fused word:
    uint32_t
    uint64_t


cdef inline word _load(const char* at, word kind) noexcept nogil:
    """The word at ``at``: a column of a packed record may sit at any address (memcpy: no
    misaligned load)."""
    memcpy(&kind, at, sizeof(word))
    return kind


cdef inline uint32_t _load32(const char* at) noexcept nogil:
    cdef uint32_t w
    memcpy(&w, at, 4)
    return w


# float dtype -> (unsigned dtype of its bits, sign bit alone, +inf's bits, canonical NaN's bits)
FLOAT_KEY_BITS = {
    np.dtype("<f4"): (np.dtype("<u4"), SC_F32_SIGN, SC_F32_INF, SC_F32_NAN),
    np.dtype("<f8"): (np.dtype("<u8"), SC_F64_SIGN, SC_F64_INF, SC_F64_NAN),
}


def key_bits(uint64_t bits, int width):
    """The bits a key field of ``width`` bytes (4 or 8) holds for a float of these bits."""
    if width == 4:
        if bits > 0xFFFFFFFFU:
            raise ValueError(f"{bits:#x} is not the bits of a 4-byte float")
        return key_bits32(<uint32_t>bits)
    if width == 8:
        return key_bits64(bits)
    raise ValueError(f"a float key field is 4 or 8 bytes wide, not {width}")


@cython.boundscheck(False)
@cython.wraparound(False)
def needs_normalizing(const word[:] bits not None):
    """Whether a key holds any of these float bits (a uint32 or uint64 view of a float column,
    any stride) otherwise: False means the column is already as keys hold it."""
    cdef Py_ssize_t i, n = bits.shape[0], stride = bits.strides[0]
    cdef const char* at
    cdef word w = 0
    cdef int maybe = 0
    cdef bint found = False
    if n == 0:
        return False
    at = <const char*>&bits[0]
    if stride == sizeof(word):  # a column alone: a vectorized look for candidates first
        with nogil:
            for i in range(n):
                if word is uint32_t:
                    maybe |= may_change32(_load32(at + 4 * i))
                else:  # little-endian: a float64's upper half is its second word
                    maybe |= may_change64(_load32(at + 8 * i + 4))
        if not maybe:
            return False
    with nogil:
        for i in range(n):
            w = _load(at + i * stride, w)
            if word is uint32_t:
                found = key_bits32(w) != w
            else:
                found = key_bits64(w) != w
            if found:
                break
    return found


@cython.boundscheck(False)
@cython.wraparound(False)
def normalize_bits(word[:] bits not None):
    """Rewrite these float bits (a writable uint32 or uint64 view, any stride) as a key holds
    them; returns how many changed."""
    cdef Py_ssize_t i, n = bits.shape[0], stride = bits.strides[0], count = 0
    cdef char* at
    cdef word w = 0, canon
    if n == 0:
        return 0
    at = <char*>&bits[0]
    with nogil:
        for i in range(n):
            w = _load(at + i * stride, w)
            if word is uint32_t:
                canon = key_bits32(w)
            else:
                canon = key_bits64(w)
            if canon != w:
                memcpy(at + i * stride, &canon, sizeof(word))
                count += 1
    return count
