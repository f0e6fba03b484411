# cython: language_level=3
"""KeyFilter: which keys a mapped image (a spilled level, a snapshot) certainly does not
hold, answered from memory.

A lookup through spilled levels (statecore/spill.py) would otherwise probe each level's
mapped slot index, a likely cache miss per level, for every key, though most keys are
decided lower down. The filter is a split-block Bloom filter over the keys' XXH64 hashes
(the hash the slot indexes use, computed once per key for every level): a key picks one
32-byte block by the hash's high 32 bits and sets one bit in each of its 8 words, chosen
from the low 32 bits by a per-word multiplier (``FILTER_SALT``). At FILTER_BITS_PER_KEY
bits a key, about one absent key in a hundred is answered "maybe" and probed for nothing.
A batch check hashes each key HASHES_AHEAD keys before it asks about it, and prefetches
that key's block meanwhile (a filter bigger than the caches costs a memory read a key).
A filter is filled with the keys it covers as their image is written (or, for a snapshot
read from files, from its rows: ``SnapshotReader.build_key_filter``), and never changes.
"""
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memset

import numpy as np

cdef class KeyFilter:
    """A filter over keys of ``key_width`` bytes, sized for ``capacity`` keys (more may be
    added: the filter stays correct, only less selective)."""

    def __cinit__(self, Py_ssize_t key_width, uint64_t capacity):
        if key_width <= 0:
            raise ValueError(f"key_width must be positive, got {key_width}")
        self.key_width = key_width
        self.capacity = capacity
        self.bits.n_blocks = (capacity * FILTER_BITS_PER_KEY + 32 * FILTER_WORDS - 1) // (32 * FILTER_WORDS)
        self.bits.words = NULL
        if self.bits.n_blocks:
            self.bits.words = <uint32_t*>PyMem_Malloc(self.bits.n_blocks * FILTER_WORDS * sizeof(uint32_t))
            if self.bits.words == NULL:
                raise MemoryError(f"cannot allocate a key filter for {capacity} keys")
            memset(self.bits.words, 0, self.bits.n_blocks * FILTER_WORDS * sizeof(uint32_t))

    def __dealloc__(self):
        PyMem_Free(self.bits.words)

    @property
    def nbytes(self):
        """The heap bytes of the filter's bits."""
        return self.bits.n_blocks * FILTER_WORDS * sizeof(uint32_t)

    def add_rows(self, const uint8_t[:, ::1] rows not None):
        """Add the keys of ``rows`` ((n, key_width) keys, or wider rows whose first
        key_width bytes are the key). A spill's filter is filled by its SnapshotWriter."""
        cdef Py_ssize_t i, n = rows.shape[0]
        cdef size_t kw = <size_t>self.key_width, stride = <size_t>rows.shape[1]
        if n == 0:
            return
        self._check_rows(rows)
        if self.bits.n_blocks == 0:
            raise ValueError("a filter sized for no keys cannot take any")
        cdef const uint8_t* p = &rows[0, 0]
        with nogil:
            for i in range(n):
                filter_add(&self.bits, key_hash(p + <size_t>i * stride, kw))

    def keys_it_may_hold(self, const uint8_t[:, ::1] rows not None):
        """The keys of ``rows`` (as add_rows takes them) that the filter may hold, as a new
        (m, key_width) array: what is worth probing in the image the filter covers."""
        cdef Py_ssize_t i, m = 0, n = rows.shape[0]
        cdef size_t kw = <size_t>self.key_width, stride
        self._check_rows(rows)
        out = np.empty((n, self.key_width), dtype=np.uint8)
        if n == 0:
            return out
        cdef uint8_t[:, ::1] o = out
        cdef const uint8_t* p = &rows[0, 0]
        cdef HashesAhead ahead
        stride = <size_t>rows.shape[1]
        with nogil:
            hashes_ahead_start(&ahead, &self.bits, p, n, stride, kw)
            for i in range(n):
                if filter_may_hold(&self.bits, hashes_ahead_next(&ahead, &self.bits, p, i, n, stride, kw)):
                    memcpy(&o[m, 0], p + <size_t>i * stride, kw)
                    m += 1
        return out[:m]

    cdef int _check_rows(self, const uint8_t[:, ::1] rows) except -1:
        if rows.shape[1] < self.key_width:
            raise ValueError(f"rows must hold a {self.key_width}-byte key, got {rows.shape[1]} bytes")
        return 0

    def may_hold_rows(self, const uint8_t[:, ::1] keys not None):
        """A bool array: False where the key was certainly never added."""
        cdef Py_ssize_t i, n = keys.shape[0]
        cdef size_t kw = <size_t>self.key_width
        if keys.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {keys.shape[1]} bytes")
        out = np.zeros(n, dtype=np.uint8)
        cdef uint8_t[::1] o = out
        if n == 0:
            return out.view(np.bool_)
        cdef const uint8_t* p = &keys[0, 0]
        cdef HashesAhead ahead
        with nogil:
            hashes_ahead_start(&ahead, &self.bits, p, n, kw, kw)
            for i in range(n):
                o[i] = filter_may_hold(&self.bits, hashes_ahead_next(&ahead, &self.bits, p, i, n, kw, kw))
        return out.view(np.bool_)
