# cython: language_level=3
"""The mixing of Spark's ``Murmur3_x86_32`` (``hashInt``, ``hashLong``, ``hashUnsafeBytes``)
over whole columns, without the GIL: each row's hash continues from the running hash of its
row (``h``, updated in place), as Spark chains the key columns. Which bits each Spark type
hashes (floats' -0.0 and NaN, the bytes of a NUL-padded string) is decided by
:mod:`statecore.spark_hash`, whose docstring states the rules; its Spark test pins both.
"""
cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

import numpy as np


@cython.boundscheck(False)
@cython.wraparound(False)
def hash_words32(const uint32_t[::1] values not None, uint32_t[::1] h not None):
    """``h[i] = hashInt(values[i], seed=h[i])``: 4-byte values (ints, dates, float bits)."""
    cdef Py_ssize_t i, n = values.shape[0]
    if h.shape[0] != n:
        raise ValueError(f"{n} values for {h.shape[0]} running hashes")
    with nogil:
        for i in range(n):
            h[i] = fmix(mix_h1(h[i], mix_k1(values[i])), 4)


@cython.boundscheck(False)
@cython.wraparound(False)
def hash_words64(const uint64_t[::1] values not None, uint32_t[::1] h not None):
    """``h[i] = hashLong(values[i], seed=h[i])``: 8-byte values (longs, timestamps, double
    bits), the low word first."""
    cdef Py_ssize_t i, n = values.shape[0]
    cdef uint64_t v
    if h.shape[0] != n:
        raise ValueError(f"{n} values for {h.shape[0]} running hashes")
    with nogil:
        for i in range(n):
            v = values[i]
            h[i] = fmix(mix_h1(mix_h1(h[i], mix_k1(<uint32_t>v)), mix_k1(<uint32_t>(v >> 32))), 8)


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)
def hash_bytes(const uint8_t[:, ::1] rows not None, uint32_t[::1] h not None):
    """``h[i] = hashUnsafeBytes(row i without its trailing NULs, seed=h[i])``: the 4-byte
    little-endian words first, then each remaining byte on its own, sign-extended, as a
    whole round (Spark's tail, not standard murmur3's), finished with the byte length."""
    cdef Py_ssize_t i, n = rows.shape[0], width = rows.shape[1], length, aligned, j
    cdef const uint8_t* row
    cdef uint32_t acc, word
    if h.shape[0] != n:
        raise ValueError(f"{n} values for {h.shape[0]} running hashes")
    if n == 0:
        return
    with nogil:
        for i in range(n):
            row = &rows[i, 0] if width else NULL
            length = width
            while length > 0 and row[length - 1] == 0:
                length -= 1
            aligned = length - length % 4
            acc = h[i]
            for j in range(0, aligned, 4):
                memcpy(&word, row + j, 4)  # little-endian: importing statecore refuses other hosts
                acc = mix_h1(acc, mix_k1(word))
            for j in range(aligned, length):
                acc = mix_h1(acc, mix_k1(<uint32_t><int32_t>(<int8_t>row[j])))
            h[i] = fmix(acc, <uint32_t>length)


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)  # C's remainder, its sign fixed below (n >= 1 is checked first)
def pmod(const uint32_t[::1] h not None, int64_t n):
    """``pmod(hash, n)`` per row (int64 in ``[0, n)``), ``hash`` being ``h`` as Java's int."""
    cdef Py_ssize_t i, m = h.shape[0]
    cdef int64_t r
    if n < 1:
        raise ValueError(f"a modulus must be >= 1, got {n}")
    out = np.empty(m, dtype=np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        for i in range(m):
            r = (<int64_t><int32_t>h[i]) % n
            o[i] = r + n if r < 0 else r
    return out
