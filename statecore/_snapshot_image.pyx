# cython: language_level=3
"""A mapped snapshot's bytes, without the GIL: data blocks checked against their checksums
on first touch, probes by the rule of ``_probe.pxd``, batch lookups and the full check of
verify(). Everything here works on a SnapLayout a reader call holds (``_snapshot_reader``);
what is checked when is described in docs/formats.md ("Reading a snapshot").
"""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from statecore._hash cimport key_hash, slot_tag, xxh64
from statecore._keyfilter cimport (
    FILTER_SAMPLE, FILTER_WINDOW, FilterBits, HashesAhead, filter_may_hold, filter_pays, hashes_ahead_next,
    hashes_ahead_start,
)
from statecore._mapping cimport willneed
from statecore._probe cimport (
    ROW_PREFETCH_AHEAD, SC_PREFETCH, Slot, SlotIndex, displacement, probe_find, probe_prefetch,
)

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define SNAP_LOAD_FLAG(p) __atomic_load_n((p), __ATOMIC_RELAXED)
    #define SNAP_STORE_FLAG(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
    #else
    #define SNAP_LOAD_FLAG(p) (*(volatile uint8_t*)(p))
    #define SNAP_STORE_FLAG(p, v) (*(volatile uint8_t*)(p) = (v))
    #endif
    """
    uint8_t SNAP_LOAD_FLAG(uint8_t* p) nogil
    void SNAP_STORE_FLAG(uint8_t* p, uint8_t v) nogil

cdef enum:
    VERIFY_WINDOW_BYTES = 4 << 20   # verify() reads ahead this much


cdef inline int snap_error(SnapError* err, int code, uint64_t offset, uint64_t expected,
                           uint64_t got) noexcept nogil:
    """Fill ``err`` and return ``code``: how every nogil function here reports damage."""
    err.code = code
    err.offset = offset
    err.expected = expected
    err.got = got
    return code


# -- lazy verification (nogil) ------------------------------------------------------------
cdef int snapshot_verify_block(const SnapLayout* s, uint64_t b, SnapError* err) noexcept nogil:
    """Check data block ``b`` (and, first, the checksum table) and mark it verified."""
    cdef uint64_t start, length, expected, got
    if not SNAP_LOAD_FLAG(s.table_ok):
        willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
        got = xxh64(s.base + s.checksums_offset, s.n_blocks * 8, 0)
        if got != s.table_checksum:
            return snap_error(err, SNAP_BAD_TABLE, s.checksums_offset, s.table_checksum, got)
        SNAP_STORE_FLAG(s.table_ok, 1)
    start = s.rows_offset + (b << s.block_shift)
    length = s.checksums_offset - start
    if length > (<uint64_t>1 << s.block_shift):
        length = <uint64_t>1 << s.block_shift
    memcpy(&expected, s.base + s.checksums_offset + b * 8, 8)
    got = xxh64(s.base + start, length, 0)
    if got != expected:
        return snap_error(err, SNAP_BAD_BLOCK, start, expected, got)
    SNAP_STORE_FLAG(&s.verified[b], 1)
    return SNAP_OK


cdef inline uint64_t snapshot_block_start(const SnapLayout* s, uint64_t b) noexcept nogil:
    """Where block ``b`` starts; the end of the data region for b >= n_blocks."""
    cdef uint64_t start
    if b >= s.n_blocks:
        return s.checksums_offset
    start = s.rows_offset + (b << s.block_shift)
    return start if start < s.checksums_offset else s.checksums_offset


cdef inline int touch(const SnapLayout* s, uint64_t offset, uint64_t length, SnapError* err) noexcept nogil:
    """Make sure every block holding bytes [offset, offset + length) was verified."""
    # REQUIRES: rows_offset <= offset, length >= 1, offset + length <= checksums_offset.
    cdef uint64_t b = (offset - s.rows_offset) >> s.block_shift
    cdef uint64_t last = (offset + length - 1 - s.rows_offset) >> s.block_shift
    cdef bint announced = False
    cdef int rc
    while b <= last:
        if not SNAP_LOAD_FLAG(&s.verified[b]):
            if not announced:  # one read for the blocks still to check (and the table)
                if not SNAP_LOAD_FLAG(s.table_ok):
                    willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
                willneed(s.base, snapshot_block_start(s, b), snapshot_block_start(s, last + 1))
                announced = True
            rc = snapshot_verify_block(s, b, err)
            if rc < 0:
                return rc
        b += 1
    return SNAP_OK


cdef uint64_t snapshot_verified_blocks(const SnapLayout* s) noexcept nogil:
    """How many data blocks were checked so far."""
    cdef uint64_t b, total = 0
    for b in range(s.n_blocks):
        total += SNAP_LOAD_FLAG(&s.verified[b])
    return total


cdef void snapshot_announce_all(const SnapLayout* s) noexcept nogil:
    """Start reading every block not checked yet, and the checksum table if it is not."""
    cdef uint64_t b = 0, first
    if not SNAP_LOAD_FLAG(s.table_ok):
        willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
    while b < s.n_blocks:
        while b < s.n_blocks and SNAP_LOAD_FLAG(&s.verified[b]):
            b += 1
        first = b
        while b < s.n_blocks and not SNAP_LOAD_FLAG(&s.verified[b]):
            b += 1
        if b > first:
            willneed(s.base, snapshot_block_start(s, first), snapshot_block_start(s, b))


# -- lookups (nogil) ----------------------------------------------------------------------
cdef struct MappedProbe:
    # The context of a probe of a mapped snapshot (its ``check`` hook, check_mapped).
    const SnapLayout* layout
    SnapError* err


cdef int check_mapped(void* ctx, uint64_t pos, uint32_t row) noexcept nogil:
    """The probe's check: slot ``pos`` (row 0), or the row a slot names, is in blocks that
    match their checksums, and that row exists."""
    cdef const SnapLayout* s = (<MappedProbe*>ctx).layout
    cdef SnapError* err = (<MappedProbe*>ctx).err
    if row == 0:
        return touch(s, s.slots_offset + pos * sizeof(Slot), sizeof(Slot), err)
    if row > s.index.row_count:  # cannot pass a checksum; checked all the same
        return snap_error(err, SNAP_BAD_SLOT, s.slots_offset + pos * sizeof(Slot), s.index.row_count, row)
    return touch(s, s.rows_offset + <uint64_t>(row - 1) * s.index.row_width,
                          s.index.row_width, err)


cdef inline int find(const SnapLayout* s, const uint8_t* key, uint32_t tag, uint64_t* row_out,
                     SnapError* err) noexcept nogil:
    """Set ``row_out`` to the row index + 1 of ``key``, or 0; < 0 if damage was found."""
    cdef MappedProbe ctx
    cdef uint64_t pos
    cdef int rc
    ctx.layout = s
    ctx.err = err
    rc = probe_find(&s.index, tag, key, check_mapped, &ctx, &pos)
    row_out[0] = s.index.slots[pos].row if rc > 0 else 0
    return rc if rc < 0 else SNAP_OK


cdef int snapshot_touch(const SnapLayout* s, uint64_t offset, uint64_t length, SnapError* err) noexcept nogil:
    return touch(s, offset, length, err)


cdef int snapshot_find(const SnapLayout* s, const uint8_t* key, uint32_t tag, uint64_t* row_out,
                       SnapError* err) noexcept nogil:
    return find(s, key, tag, row_out, err)


# REQUIRES: keys holds n rows of key_width bytes, tags n entries; values n rows of
# value_width bytes (NULL when value_width is 0) and found n entries, or both NULL; mask
# row_count entries, or NULL; key_filter NULL, or (with found) the filter of every key in
# the image. Checked by SnapshotReader.get_rows and mark_rows; tests/test_snapshot.py
# covers 0 keys, 1 key and misses (get_rows, with and without a filter), hits and misses
# (mark_rows), and batches longer than the prefetch distance (both).
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline int find_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint32_t* tags,
                          uint8_t* values, uint8_t* found, uint8_t* mask, const FilterBits* key_filter,
                          SnapError* err) noexcept nogil:
    """The batch lookup of snapshot_get_many and snapshot_mark_many: hash every key, then
    find them in turn (pipelined). For key i, ``found[i]`` and its value (zeros if absent)
    into ``values``, and ``mask[row - 1]`` = 1 for the row it is in; a NULL output is
    skipped (get_many passes mask NULL, mark_many values and found). A key ``key_filter``
    rules out is not probed (``found`` holds the filter's answers until each key's turn);
    the filter is asked window by window, as long as it pays (``filter_pays``)."""
    cdef Py_ssize_t i, w, end, sample_end, ruled_out
    cdef bint asking
    cdef uint64_t row, h
    cdef size_t kw = s.index.key_width, vw = s.index.row_width - kw
    cdef int rc
    cdef HashesAhead ahead
    cdef const uint8_t* window
    if key_filter == NULL:
        for i in range(n):
            tags[i] = slot_tag(key_hash(keys + <size_t>i * kw, kw))
    else:  # each key hashed once, for its slot and its filter block (prefetched ahead)
        w = 0
        while w < n:  # window by window: the filter is asked about the rest only if it pays
            end = min(w + <Py_ssize_t>FILTER_WINDOW, n)
            sample_end = min(w + <Py_ssize_t>FILTER_SAMPLE, end)
            window = keys + <size_t>w * kw
            hashes_ahead_start(&ahead, key_filter, window, end - w, kw, kw)
            ruled_out, asking = 0, True
            for i in range(w, end):
                if i == sample_end:
                    asking = filter_pays(sample_end - w, ruled_out)
                if asking:
                    h = hashes_ahead_next(&ahead, key_filter, window, i - w, end - w, kw, kw)
                    found[i] = filter_may_hold(key_filter, h)
                    ruled_out += not found[i]
                else:
                    h = key_hash(keys + <size_t>i * kw, kw)
                    found[i] = 1  # not asked: probed
                tags[i] = slot_tag(h)
            w = end
    for i in range(n):
        probe_prefetch(&s.index, tags, i, n)
        if key_filter != NULL and not found[i]:
            row = 0
        else:
            rc = find(s, keys + <size_t>i * kw, tags[i], &row, err)
            if rc < 0:
                return rc
        if mask != NULL and row != 0:
            mask[row - 1] = 1
        if found != NULL:
            found[i] = row != 0
            if vw:
                if row != 0:
                    memcpy(values + <size_t>i * vw, s.index.rows + (row - 1) * s.index.row_width + kw, vw)
                else:
                    memset(values + <size_t>i * vw, 0, vw)
    return SNAP_OK


cdef int snapshot_get_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* values,
                           uint8_t* found, uint32_t* tags, const FilterBits* key_filter,
                           SnapError* err) noexcept nogil:
    if <uint64_t>n >= s.n_blocks:
        # A batch this large touches most blocks: one read of everything beats a read per
        # block (the mapping has no readahead). Cheap when the pages are cached already.
        snapshot_announce_all(s)
    return find_many(s, keys, n, tags, values, found, NULL, key_filter, err)


cdef int snapshot_mark_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* mask,
                            uint32_t* tags, SnapError* err) noexcept nogil:
    return find_many(s, keys, n, tags, NULL, NULL, mask, NULL, err)


cdef inline int index_error(SnapError* err, uint64_t offset, const char* what, uint64_t expected,
                            uint64_t got) noexcept nogil:
    err.what = what
    return snap_error(err, SNAP_BAD_INDEX, offset, expected, got)


cdef int snapshot_verify(const SnapLayout* s, uint8_t* seen, SnapError* err) noexcept nogil:
    """Every block, then the index: each slot names a row in range, within max_displacement
    of its home, no row twice, row_count rows in all, and a lookup of each row's key finds
    that row (so no key is in two rows). ``seen``: row_count bits, zeroed; NULL checks the
    blocks only."""
    cdef const SlotIndex* ix = &s.index
    cdef uint64_t b, pos, r, d, count = 0, offset, found
    cdef uint64_t window = (<uint64_t>VERIFY_WINDOW_BYTES) >> s.block_shift
    cdef const uint8_t* key
    cdef uint32_t tag
    cdef Slot slot
    cdef int rc
    if window == 0:
        window = 1
    for b in range(s.n_blocks):
        if b % window == 0:  # read this window and the next while hashing
            willneed(s.base, snapshot_block_start(s, b), snapshot_block_start(s, b + 2 * window))
        if not SNAP_LOAD_FLAG(&s.verified[b]):
            rc = snapshot_verify_block(s, b, err)
            if rc < 0:
                return rc
    if seen == NULL:
        return SNAP_OK
    for pos in range(ix.mask + 1):
        if pos + ROW_PREFETCH_AHEAD <= ix.mask:  # the rows are read in slot order: at random
            slot = ix.slots[pos + ROW_PREFETCH_AHEAD]
            if slot.row != 0 and slot.row <= ix.row_count:
                SC_PREFETCH(ix.rows + <uint64_t>(slot.row - 1) * ix.row_width)
        offset = s.slots_offset + pos * sizeof(Slot)
        slot = ix.slots[pos]
        if slot.row == 0:
            continue
        if slot.row > ix.row_count:
            return snap_error(err, SNAP_BAD_SLOT, offset, ix.row_count, slot.row)
        d = displacement(slot.tag, pos, ix.mask)
        if d > ix.max_displacement:
            return index_error(err, offset, "an entry lies farther from its home slot than max_displacement",
                               ix.max_displacement, d)
        r = slot.row - 1
        if seen[r >> 3] & (1 << (r & 7)):
            return index_error(err, offset, "two slots name the same row", 1, 2)
        seen[r >> 3] |= <uint8_t>(1 << (r & 7))
        count += 1
        # A lookup of the row's key must end here: the tag is the key's, the entry is
        # reachable, and no entry before it holds the same key (entries with the same
        # hash but other keys are passed over, as lookups do).
        key = ix.rows + r * ix.row_width
        tag = slot_tag(key_hash(key, ix.key_width))
        if tag != slot.tag:
            return index_error(err, offset, "a slot's tag is not the hash of its row's key", tag, slot.tag)
        rc = find(s, key, tag, &found, err)
        if rc < 0:
            return rc
        if found != slot.row:
            if found:
                return index_error(err, offset, "two rows have the same key: a lookup of this row's key "
                                   "finds another row", slot.row - 1, found - 1)
            return index_error(err, offset, "a lookup of a row's key does not reach the row's slot "
                               "(rows found)", 1, 0)
    if count != ix.row_count:
        return index_error(err, s.slots_offset, "the slots do not name every row", ix.row_count, count)
    return SNAP_OK
