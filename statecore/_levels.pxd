# cython: language_level=3
"""Lookups through stacked spill levels, compiled (see _levels.pyx)."""
from libc.stdint cimport uint8_t, uint64_t

cdef int spill_find(spill, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1
