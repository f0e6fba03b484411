# cython: language_level=3
"""XXH64 over raw bytes, inline and nogil, for every module that hashes keys or checksums.

Files depend on these values (slot positions in snapshots, block checksums), so they are
pinned by golden tests against the ``xxhash`` package (tests/test_hash.py). The algorithm
is the published XXH64 specification; reads are little-endian and unaligned-safe.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef enum:
    # Identifies the key hash in file headers: XXH64 with seed 0, positions from the low
    # 32 bits. A new hash gets a new id; readers refuse ids they do not know.
    HASH_ID_XXH64 = 1

cdef extern from *:
    # The five XXH64 primes of the published specification.
    """
    #define XXH_P1 0x9E3779B185EBCA87ULL
    #define XXH_P2 0xC2B2AE3D27D4EB4FULL
    #define XXH_P3 0x165667B19E3779F9ULL
    #define XXH_P4 0x85EBCA77C2B2AE63ULL
    #define XXH_P5 0x27D4EB2F165667C5ULL
    """
    const uint64_t XXH_P1
    const uint64_t XXH_P2
    const uint64_t XXH_P3
    const uint64_t XXH_P4
    const uint64_t XXH_P5


cdef inline uint64_t _rotl64(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t _read64(const uint8_t* p) noexcept nogil:
    # REQUIRES: a little-endian host (checked once at import of statecore._hash).
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint32_t _read32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint64_t _xxh_round(uint64_t acc, uint64_t lane) noexcept nogil:
    acc = acc + lane * XXH_P2
    acc = _rotl64(acc, 31)
    return acc * XXH_P1


cdef inline uint64_t _xxh_merge(uint64_t acc, uint64_t v) noexcept nogil:
    acc = acc ^ _xxh_round(0, v)
    return acc * XXH_P1 + XXH_P4


cdef inline uint64_t xxh64(const void* data, size_t length, uint64_t seed) noexcept nogil:
    """XXH64 of ``length`` bytes at ``data``."""
    cdef const uint8_t* p = <const uint8_t*>data
    cdef const uint8_t* end = p + length
    cdef const uint8_t* limit
    cdef uint64_t v1, v2, v3, v4, h
    if length >= 32:
        limit = end - 32
        v1 = seed + XXH_P1 + XXH_P2
        v2 = seed + XXH_P2
        v3 = seed
        v4 = seed - XXH_P1
        while p <= limit:
            v1 = _xxh_round(v1, _read64(p))
            v2 = _xxh_round(v2, _read64(p + 8))
            v3 = _xxh_round(v3, _read64(p + 16))
            v4 = _xxh_round(v4, _read64(p + 24))
            p += 32
        h = _rotl64(v1, 1) + _rotl64(v2, 7) + _rotl64(v3, 12) + _rotl64(v4, 18)
        h = _xxh_merge(h, v1)
        h = _xxh_merge(h, v2)
        h = _xxh_merge(h, v3)
        h = _xxh_merge(h, v4)
    else:
        h = seed + XXH_P5
    h = h + <uint64_t>length
    while p + 8 <= end:
        h = h ^ _xxh_round(0, _read64(p))
        h = _rotl64(h, 27) * XXH_P1 + XXH_P4
        p += 8
    if p + 4 <= end:
        h = h ^ (<uint64_t>_read32(p) * XXH_P1)
        h = _rotl64(h, 23) * XXH_P2 + XXH_P3
        p += 4
    while p < end:
        h = h ^ (<uint64_t>p[0] * XXH_P5)
        h = _rotl64(h, 11) * XXH_P1
        p += 1
    h = h ^ (h >> 33)
    h = h * XXH_P2
    h = h ^ (h >> 29)
    h = h * XXH_P3
    h = h ^ (h >> 32)
    return h


cdef inline uint64_t key_hash(const void* key, size_t key_width) noexcept nogil:
    """The hash of a key row: what tables and snapshot slots are positioned by."""
    return xxh64(key, key_width, 0)


cdef inline uint32_t slot_tag(uint64_t h) noexcept nogil:
    """The 32 bits of a key hash kept in a slot; its low bits pick the home slot."""
    return <uint32_t>h


cdef inline uint64_t checksum(const uint8_t[::1] data, uint64_t seed=0) noexcept:
    """XXH64 of a bytes-like object (the checksum of the file formats), without the GIL."""
    cdef const uint8_t* p = &data[0] if data.shape[0] else NULL
    cdef size_t n = <size_t>data.shape[0]
    cdef uint64_t h
    with nogil:
        h = xxh64(p, n, seed)
    return h
