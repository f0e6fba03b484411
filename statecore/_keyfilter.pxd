# cython: language_level=3
"""KeyFilter: a split-block Bloom filter over key hashes, in memory (see _keyfilter.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from statecore._hash cimport key_hash
from statecore._probe cimport SC_PREFETCH

cdef enum:
    FILTER_WORDS = 8      # a block is 8 words of 32 bits (one 32-byte line); a key sets one bit in each
    FILTER_BITS_PER_KEY = 10

cdef extern from *:
    # Odd multipliers, one per word of a block: word j's bit of a key is the top 5 bits of
    # (low 32 bits of the key's hash) * salt j.
    """
    static const unsigned int SC_FILTER_SALT[8] = {
        0x47b6137bU, 0x44974d91U, 0x8824ad5bU, 0xa2b7289dU,
        0x705495c7U, 0x2df1424bU, 0x9efc4947U, 0x5c6bfb31U};
    """
    const uint32_t* FILTER_SALT "SC_FILTER_SALT"


cdef enum:
    HASHES_AHEAD = 16     # a batch check hashes (and prefetches the block of) this many keys ahead
    # A batch lookup decides window by window whether a filter is worth asking: it asks about
    # the first FILTER_SAMPLE keys of each window of FILTER_WINDOW, and about the rest of the
    # window only if filter_pays for that sample.
    FILTER_WINDOW = 4096
    FILTER_SAMPLE = 256


cdef inline bint filter_pays(Py_ssize_t asked, Py_ssize_t ruled_out) noexcept nogil:
    """Whether a filter that ruled out ``ruled_out`` of ``asked`` keys is worth asking about
    the keys that follow: when it rules out at least one in eight. Below that, nearly every
    key is present and probed anyway, and the filter's block is one more cache miss per key
    that saves almost nothing (on pages in memory; where pages are cold, a probe it saves
    is a page fault, hence a low bar)."""
    return ruled_out * 8 >= asked


cdef struct HashesAhead:
    # The ring of the hashes a batch check computed ahead of the key it asks about.
    uint64_t hashes[HASHES_AHEAD]


cdef struct FilterBits:
    # What a nogil probe reads. n_blocks == 0: the filter holds no key.
    uint32_t* words       # n_blocks * FILTER_WORDS words
    uint64_t n_blocks


cdef inline uint64_t filter_block(const FilterBits* f, uint64_t h) noexcept nogil:
    """The block of a key hash: the high 32 bits scaled to [0, n_blocks)."""
    return ((h >> 32) * f.n_blocks) >> 32


cdef inline bint filter_may_hold(const FilterBits* f, uint64_t h) noexcept nogil:
    """False only if no key with hash ``h`` was added; true for every one that was."""
    cdef const uint32_t* block
    cdef uint32_t low = <uint32_t>h, all_set = 1
    cdef int j
    if f.n_blocks == 0:
        return False
    block = f.words + filter_block(f, h) * FILTER_WORDS
    for j in range(FILTER_WORDS):  # no branch per word: each is set for about half the absent keys
        all_set &= block[j] >> ((low * FILTER_SALT[j]) >> 27)
    return all_set & 1


cdef inline void filter_prefetch(const FilterBits* f, uint64_t h) noexcept nogil:
    """Start loading the block of hash ``h`` (a batch reads it a few keys later)."""
    if f.n_blocks:
        SC_PREFETCH(f.words + filter_block(f, h) * FILTER_WORDS)


cdef inline void filter_add(FilterBits* f, uint64_t h) noexcept nogil:
    # REQUIRES: n_blocks > 0.
    cdef uint32_t* block = f.words + filter_block(f, h) * FILTER_WORDS
    cdef uint32_t low = <uint32_t>h
    cdef int j
    for j in range(FILTER_WORDS):
        block[j] |= (<uint32_t>1) << ((low * FILTER_SALT[j]) >> 27)


cdef inline void hashes_ahead_start(HashesAhead* ahead, const FilterBits* f, const uint8_t* rows,
                                    Py_ssize_t n, size_t stride, size_t kw) noexcept nogil:
    """Hash the first HASHES_AHEAD keys of ``rows`` and prefetch their blocks."""
    cdef Py_ssize_t i
    for i in range(min(n, <Py_ssize_t>HASHES_AHEAD)):
        ahead.hashes[i] = key_hash(rows + <size_t>i * stride, kw)
        filter_prefetch(f, ahead.hashes[i])


cdef inline uint64_t hashes_ahead_next(HashesAhead* ahead, const FilterBits* f, const uint8_t* rows,
                                       Py_ssize_t i, Py_ssize_t n, size_t stride, size_t kw) noexcept nogil:
    """Key ``i``'s hash; its place in the ring goes to key i + HASHES_AHEAD, whose block is
    prefetched. REQUIRES: called for i = 0, 1, ... in turn, after hashes_ahead_start."""
    cdef uint64_t h = ahead.hashes[i % HASHES_AHEAD]
    cdef Py_ssize_t j = i + HASHES_AHEAD
    if j < n:
        ahead.hashes[i % HASHES_AHEAD] = key_hash(rows + <size_t>j * stride, kw)
        filter_prefetch(f, ahead.hashes[i % HASHES_AHEAD])
    return h


@cython.final
cdef class KeyFilter:
    cdef FilterBits bits
    cdef readonly Py_ssize_t key_width
    cdef readonly uint64_t capacity      # the keys it was sized for

    cdef int _check_rows(self, const uint8_t[:, ::1] rows) except -1
