# cython: language_level=3
"""Python access to the key hash and checksum (the C functions live in ``_hash.pxd``)."""
import sys

import numpy as np

from libc.stdint cimport uint8_t, uint64_t

if sys.byteorder != "little":  # rows and file formats are little-endian; see _hash.pxd
    raise ImportError("statecore needs a little-endian host")

HASH_ID = HASH_ID_XXH64


def xxh64_digest(const uint8_t[::1] data not None, uint64_t seed=0):
    """XXH64 of a bytes-like object, as an unsigned int (equals ``xxhash.xxh64_intdigest``)."""
    cdef uint64_t h
    with nogil:
        h = xxh64(&data[0] if data.shape[0] else NULL, <size_t>data.shape[0], seed)
    return h


def hash_rows(const uint8_t[:, ::1] rows not None):
    """Key hash of every row of a C-contiguous ``(n, width)`` uint8 array, as uint64."""
    cdef Py_ssize_t n = rows.shape[0], width = rows.shape[1], i
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] hashes = out
    with nogil:
        for i in range(n):
            hashes[i] = key_hash(&rows[i, 0] if width else NULL, <size_t>width)
    return out
