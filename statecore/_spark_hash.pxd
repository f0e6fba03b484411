# cython: language_level=3
"""Spark's Murmur3_x86_32 over whole key columns, compiled (see _spark_hash.pyx)."""
from libc.stdint cimport uint32_t


cdef inline uint32_t rotl32(uint32_t x, int r) noexcept nogil:
    return (x << r) | (x >> (32 - r))


cdef inline uint32_t mix_k1(uint32_t k1) noexcept nogil:
    return rotl32(k1 * <uint32_t>0xCC9E2D51U, 15) * <uint32_t>0x1B873593U


cdef inline uint32_t mix_h1(uint32_t h1, uint32_t k1) noexcept nogil:
    return rotl32(h1 ^ k1, 13) * <uint32_t>5U + <uint32_t>0xE6546B64U


cdef inline uint32_t fmix(uint32_t h1, uint32_t length) noexcept nogil:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 *= <uint32_t>0x85EBCA6BU
    h1 ^= h1 >> 13
    h1 *= <uint32_t>0xC2B2AE35U
    return h1 ^ (h1 >> 16)
