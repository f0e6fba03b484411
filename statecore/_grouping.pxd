# cython: language_level=3
"""Grouping equal key rows by hash, in one pass (see _grouping.pyx)."""

cdef enum:
    # The index has at least this many slots per row (a power of two): probes stay short.
    MIN_SLOTS_PER_ROW = 2
    # A row's slot is prefetched this many rows before it is probed.
    PREFETCH_ROWS_AHEAD = 8
