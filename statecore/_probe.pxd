# cython: language_level=3
"""The slot index and its one rule: where a key's slot is, and how a probe finds it.

RowTable's index and a snapshot's slot section are built and probed by these functions
only. A snapshot file depends on the rule (a reader finds a key only where the writer put
it), so it is written here once; docs/formats.md describes it as part of the format.

The rule. Slots are 8 bytes, ``(tag, row + 1)`` with ``tag = slot_tag(key_hash(key))`` and
row 0 for an empty slot; an index has a power of two of them, at least MIN_SLOTS, at most
3/4 full. A key's home slot is ``tag & (n_slots - 1)``; probing is linear, with Robin Hood
placement: an entry takes the slot of a richer one (nearer its own home than the entry is
to its home) and that one moves on. So a probe for an absent key stops at the first empty
slot or the first richer entry, and never goes past ``max_displacement`` (the farthest any
entry lies from its home). Distinct keys may share a tag, even their whole hash: a probe
compares the key bytes of every entry with its tag.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define SC_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)
    #else
    #define SC_PREFETCH(p) ((void)(p))
    #endif
    #define SC_MAX_ROWS 0xFFFFFFFEULL
    """
    void SC_PREFETCH(const void* p) nogil
    # The most rows an index addresses: row numbers are stored + 1 in a slot's u32.
    const unsigned long long MAX_ROWS "SC_MAX_ROWS"

cdef enum:
    MIN_SLOTS = 16
    # Batch lookups are software-pipelined: the home slot of lookup i + SLOT_PREFETCH_AHEAD
    # and the row of lookup i + ROW_PREFETCH_AHEAD are prefetched while lookup i runs.
    SLOT_PREFETCH_AHEAD = 16
    ROW_PREFETCH_AHEAD = 8

cdef struct Slot:
    # The slot of RowTable's index and of the snapshot format (8 bytes, little-endian).
    uint32_t tag    # slot_tag(key hash); its low bits pick the home slot
    uint32_t row    # row index + 1; 0 marks an empty slot

cdef struct SlotIndex:
    # What a probe reads: a RowTable's index and arena, or a mapped snapshot's sections.
    const Slot* slots
    const uint8_t* rows           # row i (key bytes, then value bytes) at rows + i * row_width
    uint64_t mask                 # n_slots - 1
    uint64_t row_width
    uint64_t key_width
    uint64_t row_count            # slots name rows 1..row_count (only those are prefetched)
    uint64_t max_displacement     # no entry lies farther from its home slot

# A probe's hook. probe_find calls ``check`` before it reads slot ``pos`` (row 0) and before
# it reads the key of the row a slot names (row = its index + 1); a code < 0 ends the probe.
# probe_insert calls ``match`` for an entry with the tag of the key being placed: 1 if that
# row has the key (the insert is refused), 0 if not.
ctypedef int (*probe_hook)(void* ctx, uint64_t pos, uint32_t row) noexcept nogil


cdef inline bint rows_equal(const uint8_t* a, const uint8_t* b, size_t width) noexcept nogil:
    """Byte equality, with the common key widths compared as machine words (inlined)."""
    cdef uint64_t x0, y0, x1, y1
    if width == 8:
        memcpy(&x0, a, 8)
        memcpy(&y0, b, 8)
        return x0 == y0
    if width == 16:
        memcpy(&x0, a, 8)
        memcpy(&y0, b, 8)
        memcpy(&x1, a + 8, 8)
        memcpy(&y1, b + 8, 8)
        return (x0 == y0) & (x1 == y1)
    return memcmp(a, b, width) == 0


cdef inline uint64_t slots_for(uint64_t n_keys, uint64_t n_slots) noexcept nogil:
    """The fewest slots, a power of two and at least ``n_slots`` and MIN_SLOTS, that hold
    ``n_keys`` at no more than 3/4 load."""
    # REQUIRES: n_slots is 0 or a power of two; n_keys * 4 does not overflow.
    if n_slots < MIN_SLOTS:
        n_slots = MIN_SLOTS
    while n_keys * 4 > n_slots * 3:
        n_slots *= 2
    return n_slots


cdef inline uint64_t home_slot(uint32_t tag, uint64_t mask) noexcept nogil:
    return tag & mask


cdef inline uint64_t displacement(uint32_t tag, uint64_t pos, uint64_t mask) noexcept nogil:
    """How far slot ``pos`` is from the home slot of ``tag``."""
    return (pos - (tag & mask)) & mask


cdef inline int probe_find(const SlotIndex* ix, uint32_t tag, const uint8_t* key, probe_hook check,
                           void* ctx, uint64_t* pos_out) noexcept nogil:
    """Look for ``key`` (whose tag is ``tag``): 1 with ``pos_out`` at its slot, 0 when it is
    absent, or the code < 0 of ``check`` (which may be NULL)."""
    cdef uint64_t pos = home_slot(tag, ix.mask), dist = 0
    cdef Slot s
    cdef int rc
    while dist <= ix.max_displacement:
        if check != NULL:
            rc = check(ctx, pos, 0)
            if rc < 0:
                return rc
        s = ix.slots[pos]
        if s.row == 0 or displacement(s.tag, pos, ix.mask) < dist:
            return 0  # empty, or a richer entry: the key would have displaced it
        if s.tag == tag:
            if check != NULL:
                rc = check(ctx, pos, s.row)
                if rc < 0:
                    return rc
            if rows_equal(ix.rows + <uint64_t>(s.row - 1) * ix.row_width, key, ix.key_width):
                pos_out[0] = pos
                return 1
        pos = (pos + 1) & ix.mask
        dist += 1
    return 0


cdef inline int probe_insert(Slot* slots, uint64_t mask, Slot carried, probe_hook match, void* ctx,
                             uint64_t* farthest_out) noexcept nogil:
    """Robin Hood placement of ``carried``: 0 once placed, with ``farthest_out`` the farthest
    from its home that an entry was put (for max_displacement). With ``match`` (else NULL),
    the entries with its tag are compared with it first, up to the first entry it displaces
    (where a lookup would stop): a code != 0 from ``match`` is returned, nothing changed."""
    # REQUIRES: an empty slot exists; without ``match``, the key is not in the index.
    cdef uint64_t pos = home_slot(carried.tag, mask), dist = 0, farthest = 0, resident
    cdef bint searching = match != NULL
    cdef Slot* s
    cdef int rc
    while True:
        s = &slots[pos]
        if s.row == 0:
            s[0] = carried
            farthest_out[0] = dist if dist > farthest else farthest
            return 0
        resident = displacement(s.tag, pos, mask)
        if resident < dist:
            searching = False  # from here on, ``carried`` is an entry displaced by the key
            carried, s[0] = s[0], carried
            if dist > farthest:
                farthest = dist
            dist = resident
        elif searching and s.tag == carried.tag:
            rc = match(ctx, pos, s.row)
            if rc != 0:
                return rc
        pos = (pos + 1) & mask
        dist += 1


cdef inline void probe_erase(Slot* slots, uint64_t mask, uint64_t pos) noexcept nogil:
    """Empty slot ``pos`` and shift the entries after it back one step (no tombstones)."""
    cdef uint64_t nxt = (pos + 1) & mask
    while slots[nxt].row != 0 and displacement(slots[nxt].tag, nxt, mask) != 0:
        slots[pos] = slots[nxt]
        pos = nxt
        nxt = (nxt + 1) & mask
    slots[pos].tag = 0
    slots[pos].row = 0


cdef inline void prefetch_row(const SlotIndex* ix, uint32_t tag) noexcept nogil:
    """Prefetch the row the first slot with ``tag`` names (its slots should have arrived)."""
    cdef uint64_t pos = home_slot(tag, ix.mask), dist = 0
    cdef Slot s
    while dist <= ix.max_displacement:
        s = ix.slots[pos]
        if s.row == 0:
            return
        if s.tag == tag:
            if s.row <= ix.row_count:
                SC_PREFETCH(ix.rows + <uint64_t>(s.row - 1) * ix.row_width)
            return
        pos = (pos + 1) & ix.mask
        dist += 1


cdef inline void probe_prefetch(const SlotIndex* ix, const uint32_t* tags, Py_ssize_t i,
                                Py_ssize_t n) noexcept nogil:
    """The software pipeline of a batch of ``n`` lookups by ``tags``, at lookup ``i``: the home
    slot of lookup i + SLOT_PREFETCH_AHEAD, and the row of lookup i + ROW_PREFETCH_AHEAD (its
    slots arrived meanwhile; found by tag alone). A prefetch never faults and never changes
    a result, so unchecked slot bytes (a snapshot's) may choose what to prefetch."""
    if i + SLOT_PREFETCH_AHEAD < n:
        SC_PREFETCH(&ix.slots[home_slot(tags[i + SLOT_PREFETCH_AHEAD], ix.mask)])
    if i + ROW_PREFETCH_AHEAD < n:
        prefetch_row(ix, tags[i + ROW_PREFETCH_AHEAD])
