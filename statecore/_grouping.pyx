# cython: language_level=3
"""Groups of equal rows, by hash: what a batch of raw rows is aggregated by before it meets
the store.

``group_key_rows`` puts each row's key bytes through XXH64 (``statecore._hash``) into an
open-addressing index of group numbers, numbered in order of first appearance, then places
the rows group by group with one counting pass: O(n), with no comparison sort. Groups come
in the order their first row does, and a group's rows in input order. Rows are equal when
their bytes are (the caller gives key rows in the store's canonical form, where equal keys
have equal bytes).
"""
cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp

from statecore._hash cimport key_hash
from statecore._probe cimport SC_PREFETCH

import numpy as np


@cython.boundscheck(False)
@cython.wraparound(False)
def group_key_rows(const uint8_t[:, ::1] rows not None):
    """``(order, starts)`` grouping the equal rows of ``rows`` ((n, w) uint8): group ``g`` is
    ``order[starts[g]:starts[g+1]]`` (the last one ends at n), groups in order of their first
    row, each group's rows in input order; so ``order[starts]`` is each group's first row,
    ascending. Both are intp arrays."""
    cdef Py_ssize_t n = rows.shape[0], w = rows.shape[1]
    order_array = np.empty(n, dtype=np.intp)
    if n == 0:
        return order_array, np.zeros(0, dtype=np.intp)
    if n >= 0xFFFFFFFF:
        raise ValueError(f"cannot group {n} rows: at most {0xFFFFFFFF - 1} at once")
    if w == 0:  # every row has the same (empty) key
        order_array[:] = np.arange(n, dtype=np.intp)
        return order_array, np.zeros(1, dtype=np.intp)
    cdef uint64_t n_slots = 16
    while n_slots < <uint64_t>(MIN_SLOTS_PER_ROW * n):
        n_slots *= 2
    cdef uint64_t mask = n_slots - 1
    # A slot holds the low 32 bits of its key's hash above its group's number + 1 (0: empty).
    cdef uint64_t[::1] slots = np.zeros(n_slots, dtype=np.uint64)
    cdef uint64_t[::1] hashes = np.empty(n, dtype=np.uint64)
    cdef int64_t[::1] group_of = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] first_row = np.empty(n, dtype=np.int64)
    cdef Py_ssize_t[::1] order = order_array
    cdef const uint8_t* base = &rows[0, 0]
    cdef const uint8_t* row
    cdef uint64_t h, s, entry
    cdef uint32_t tag
    cdef int64_t g, n_groups = 0
    cdef Py_ssize_t i
    with nogil:
        for i in range(n):  # hashed first, so that each row's slot is fetched a few rows ahead
            hashes[i] = key_hash(base + i * w, <size_t>w)
        for i in range(n):
            if i + PREFETCH_ROWS_AHEAD < n:
                SC_PREFETCH(&slots[(hashes[i + PREFETCH_ROWS_AHEAD] >> 32) & mask])
            row = base + i * w
            h = hashes[i]
            tag = <uint32_t>h
            s = (h >> 32) & mask
            while True:
                entry = slots[s]
                if entry == 0:
                    g = n_groups
                    n_groups += 1
                    slots[s] = (<uint64_t>tag << 32) | <uint64_t>(g + 1)
                    first_row[g] = i
                    break
                g = <int64_t>(entry & <uint64_t>0xFFFFFFFFU) - 1
                if <uint32_t>(entry >> 32) == tag and memcmp(base + first_row[g] * w, row, <size_t>w) == 0:
                    break
                s = (s + 1) & mask
            group_of[i] = g
    starts_array = np.empty(n_groups, dtype=np.intp)
    cdef Py_ssize_t[::1] starts = starts_array
    cdef int64_t[::1] fill = np.zeros(n_groups, dtype=np.int64)
    cdef int64_t total = 0
    with nogil:
        for i in range(n):
            fill[group_of[i]] += 1
        for g in range(n_groups):  # each group's count becomes where its rows begin
            starts[g] = total
            total += fill[g]
            fill[g] = starts[g]
        for i in range(n):
            g = group_of[i]
            order[fill[g]] = i
            fill[g] += 1
    return order_array, starts_array
