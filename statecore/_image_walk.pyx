# cython: language_level=3
"""The compiled walk of a version's images: its spill levels (each two mapped images, the rows
it puts and the keys it removes), newest first, over a bottom image; the batch lookups of
``statecore/_versions.pyx`` (``Sources.lookup``) hand it the keys no table decided.

The walk (``_walk``): each level's KeyFilters are asked first so that only the images
that may decide a key are probed. The bottom image's filter, once it has one, is asked too,
window by window while it pays (``filter_pays``): it rules out only absent keys, and a batch
of keys that are nearly all present gains nothing from it. A key is hashed once for every
level (the filters and the slot indexes use the same hash). The walk runs without the GIL in
two passes: the first hashes each key and finds the first level whose filters may hold it;
the second probes from there, prefetching the home slot of a key some lookups ahead in the
index it will start in. A filter's false "maybe" costs one probe and the walk goes on down.
Rules: ``docs/provider-rules.md``, "The read model". (A module of its own: it reads images
only, none of the typed versions of ``_versions``.)
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from statecore._hash cimport key_hash, slot_tag
from statecore._keyfilter cimport (
    FILTER_SAMPLE, FILTER_WINDOW, FilterBits, KeyFilter, filter_may_hold, filter_pays, filter_prefetch,
)
from statecore._mapping cimport Mapping
from statecore._probe cimport SC_PREFETCH, SlotIndex, home_slot, prefetch_row
from statecore._rowtable cimport rows_ptr
from statecore._snapshot_image cimport SNAP_OK, SnapError, SnapLayout, snapshot_announce_all, snapshot_find
from statecore._snapshot_reader cimport SnapshotReader, reader_key_filter


cdef enum:
    # While lookup i runs, the home slot of lookup i + SLOT_PREFETCH_AHEAD is prefetched in
    # the index it starts in, and the row of lookup i + ROW_PREFETCH_AHEAD (found by tag in
    # slots that arrived meanwhile), as the snapshot's own batch lookup does (_probe.pxd).
    SLOT_PREFETCH_AHEAD = 16
    ROW_PREFETCH_AHEAD = 8
    # Each level's filter block of key i + FILTER_PREFETCH_AHEAD, while key i's are read.
    FILTER_PREFETCH_AHEAD = 16

cdef struct Level:
    # One level as the nogil walk reads it; ``dels`` is used only when has_dels.
    SnapLayout puts
    SnapLayout dels
    const FilterBits* puts_filter   # NULL: no filter, every key may be there
    const FilterBits* dels_filter
    bint has_dels


cdef FilterBits NO_KEYS  # what an empty image holds (n_blocks 0: no key)


cdef inline const FilterBits* _filter_of(SnapshotReader image):
    """What the walk asks about ``image``: its key filter (which never changes once set, so
    the reader held keeps it alive); none for an empty image; NULL (every key may be there)
    for one without a filter."""
    if image.row_count == 0:
        return &NO_KEYS
    cdef KeyFilter key_filter = reader_key_filter(image)
    return NULL if key_filter is None else &key_filter.bits


cdef inline bint _may_hold(const FilterBits* f, uint64_t h) noexcept nogil:
    return f == NULL or filter_may_hold(f, h)


cdef inline uint32_t _next_candidate(const Level* levels, Py_ssize_t j, Py_ssize_t n_levels,
                                     const FilterBits* bottom_filter, uint64_t h) noexcept nogil:
    """Where a key of hash ``h`` is looked for next, from level ``j`` on: ``level << 2``, plus
    2 if that level's puts filter may hold it and 1 if its dels filter may; if no level's
    may, ``n_levels << 2`` (the snapshot), plus 2 if the snapshot's filter may hold it."""
    cdef bint puts, dels
    while j < n_levels:
        puts = _may_hold(levels[j].puts_filter, h)
        dels = levels[j].has_dels and _may_hold(levels[j].dels_filter, h)
        if puts or dels:
            return <uint32_t>((j << 2) | (puts << 1) | dels)
        j += 1
    return <uint32_t>((n_levels << 2) | (_may_hold(bottom_filter, h) << 1))


cdef inline const SlotIndex* _start_index(const Level* levels, Py_ssize_t n_levels, const SnapLayout* bottom,
                                          uint32_t where) noexcept nogil:
    """The index a lookup at ``where`` (as _next_candidate gives it) probes first (NULL: none)."""
    cdef Py_ssize_t j = where >> 2
    if j < n_levels:
        return &levels[j].puts.index if where & 2 else &levels[j].dels.index
    return &bottom.index if bottom != NULL and where & 2 else NULL


cdef inline void _prefetch_filters(const Level* levels, Py_ssize_t n_levels, uint64_t h) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n_levels):
        if levels[j].puts_filter != NULL:
            filter_prefetch(levels[j].puts_filter, h)
        if levels[j].has_dels and levels[j].dels_filter != NULL:
            filter_prefetch(levels[j].dels_filter, h)


cdef inline int _find_value(const SnapLayout* image, const uint8_t* key, uint32_t tag, uint8_t* value_out,
                            size_t vw, SnapError* err) noexcept nogil:
    """1 if ``image`` holds ``key`` (its value copied to ``value_out`` when vw > 0), 0 if
    not, or the code < 0 of the damage found (described in ``err``)."""
    cdef uint64_t row
    cdef int rc = snapshot_find(image, key, tag, &row, err)
    if rc < 0:
        return rc
    if row == 0:
        return 0
    if vw:
        memcpy(value_out, image.index.rows + (row - 1) * image.index.row_width + image.index.key_width, vw)
    return 1


# REQUIRES: keys n rows of kw bytes; values n rows of vw bytes (unused when vw is 0); found
# n entries; hashes and start n entries of scratch (start: where each key is looked for
# first, as _next_candidate gives it); levels n_levels entries. ``bottom`` NULL when nothing
# lies under the levels; ``bottom_filter`` its filter (NULL: every key may be there). On a
# code < 0, ``failed`` is the reader that raised: 2 * level (its puts), 2 * level + 1 (its
# dels), or 2 * n_levels (the bottom). The bottom's filter is asked window by window as long
# as it pays (``filter_pays``, on the keys no level's filter may hold); the levels' always are.
@cython.boundscheck(False)
@cython.wraparound(False)
cdef int _walk(const Level* levels, Py_ssize_t n_levels, const SnapLayout* bottom,
               const FilterBits* bottom_filter, const uint8_t* keys, Py_ssize_t n, size_t kw, size_t vw,
               uint8_t* values, uint8_t* found, uint64_t* hashes, uint32_t* start, SnapError* err,
               Py_ssize_t* failed) noexcept nogil:
    cdef Py_ssize_t i, j
    cdef uint64_t h
    cdef uint32_t tag, where
    cdef const SlotIndex* ix
    cdef const uint8_t* key
    cdef uint8_t* value
    cdef int rc, hit
    cdef const FilterBits* asked_bottom = bottom_filter
    cdef Py_ssize_t window_end = 0, reached = 0, ruled_out = 0
    for i in range(n):
        hashes[i] = key_hash(keys + <size_t>i * kw, kw)
    for i in range(n):
        if i == window_end:  # a new window: the bottom's filter is asked again, as long as it pays
            asked_bottom, reached, ruled_out = bottom_filter, 0, 0
            window_end = min(i + <Py_ssize_t>FILTER_WINDOW, n)
        if i + FILTER_PREFETCH_AHEAD < n:
            _prefetch_filters(levels, n_levels, hashes[i + FILTER_PREFETCH_AHEAD])
            if asked_bottom != NULL:
                filter_prefetch(asked_bottom, hashes[i + FILTER_PREFETCH_AHEAD])
        where = _next_candidate(levels, 0, n_levels, asked_bottom, hashes[i])
        if asked_bottom != NULL and (where >> 2) == <uint32_t>n_levels:
            reached += 1
            ruled_out += not (where & 2)
            if reached == FILTER_SAMPLE and not filter_pays(reached, ruled_out):
                asked_bottom = NULL  # the rest of the window is probed in the bottom unasked
        start[i] = where
    for i in range(n):
        if i + SLOT_PREFETCH_AHEAD < n:
            ix = _start_index(levels, n_levels, bottom, start[i + SLOT_PREFETCH_AHEAD])
            if ix != NULL:
                SC_PREFETCH(&ix.slots[home_slot(slot_tag(hashes[i + SLOT_PREFETCH_AHEAD]), ix.mask)])
        if i + ROW_PREFETCH_AHEAD < n:
            ix = _start_index(levels, n_levels, bottom, start[i + ROW_PREFETCH_AHEAD])
            if ix != NULL:
                prefetch_row(ix, slot_tag(hashes[i + ROW_PREFETCH_AHEAD]))
        h = hashes[i]
        tag = slot_tag(h)
        key = keys + <size_t>i * kw
        value = values + <size_t>i * vw if vw else NULL
        hit = 0
        where = start[i]
        while (where >> 2) < <uint32_t>n_levels:
            j = where >> 2
            if where & 2:
                rc = _find_value(&levels[j].puts, key, tag, value, vw, err)
                if rc < 0:
                    failed[0] = 2 * j
                    return rc
                if rc:
                    hit = 1
                    break
            if where & 1:
                rc = _find_value(&levels[j].dels, key, tag, NULL, 0, err)
                if rc < 0:
                    failed[0] = 2 * j + 1
                    return rc
                if rc:
                    break  # removed here: absent, whatever lies below
            where = _next_candidate(levels, j + 1, n_levels, bottom_filter, h)
        if (where >> 2) == <uint32_t>n_levels and where & 2 and bottom != NULL:
            hit = _find_value(bottom, key, tag, value, vw, err)
            if hit < 0:
                failed[0] = 2 * n_levels
                return hit
        found[i] = hit
        if not hit and vw:
            memset(value, 0, vw)
    return SNAP_OK



@cython.boundscheck(False)
@cython.wraparound(False)
cdef int images_lookup(list images, SnapshotReader bottom_reader, const uint8_t[:, ::1] keys,
                       uint8_t[:, ::1] values, uint8_t[::1] found) except -1:
    """Look ``keys`` (n, key_width) up through the levels' ``images`` (newest first, each level's
    puts then its dels, or None, as ``Sources.images`` holds them) and ``bottom_reader`` (or
    None) into ``values`` (zeros where not found) and ``found``. Raises what a SnapshotReader
    raises for a damaged or truncated image; ``values`` and ``found`` then hold nothing to use.
    REQUIRES: at least one level."""
    cdef SnapshotReader first = <SnapshotReader?>images[0]
    cdef Py_ssize_t n = first._lookup_size(keys, values, found)
    cdef Py_ssize_t n_levels = len(images) // 2, j, failed = -1
    if n == 0:
        return 0
    cdef list readers = []   # (reader, mapping) in the order ``failed`` counts them
    cdef Level* c_levels = <Level*>PyMem_Malloc(n_levels * sizeof(Level))
    cdef uint64_t* hashes = <uint64_t*>PyMem_Malloc(n * sizeof(uint64_t))
    cdef uint32_t* start = <uint32_t*>PyMem_Malloc(n * sizeof(uint32_t))
    cdef SnapLayout bottom
    cdef const FilterBits* bottom_filter = NULL
    cdef SnapError err
    cdef int rc
    cdef SnapshotReader r
    cdef Mapping m
    cdef bint has_bottom = bottom_reader is not None
    cdef uint8_t* value_ptr = <uint8_t*>rows_ptr(values)
    cdef size_t kw = <size_t>first.key_width, vw = <size_t>first.value_width
    try:
        if c_levels == NULL or hashes == NULL or start == NULL:
            raise MemoryError(f"cannot allocate the scratch of a lookup of {n} keys")
        for j in range(n_levels):
            r = images[2 * j]
            m = r._acquire()
            readers.append((r, m))
            c_levels[j].puts = r._layout_of(m)
            c_levels[j].puts_filter = _filter_of(r)
            r = images[2 * j + 1]  # None: the level removes nothing
            c_levels[j].has_dels = r is not None and r.row_count > 0
            if c_levels[j].has_dels:
                m = r._acquire()
                c_levels[j].dels = r._layout_of(m)
                c_levels[j].dels_filter = _filter_of(r)
            else:
                m = None
            readers.append((r, m))
        if has_bottom:
            m = bottom_reader._acquire()
            readers.append((bottom_reader, m))
            bottom = bottom_reader._layout_of(m)
            bottom_filter = _filter_of(bottom_reader)
        with nogil:
            if has_bottom and <uint64_t>n >= bottom.n_blocks:
                snapshot_announce_all(&bottom)  # as SnapshotReader.get_rows does
            rc = _walk(c_levels, n_levels, &bottom if has_bottom else NULL, bottom_filter,
                       &keys[0, 0], n, kw, vw, value_ptr, &found[0], hashes, start, &err, &failed)
        for r, m in readers:
            if m is not None and not m.sound():
                r._raise_truncated(m)
        if rc < 0:
            r = readers[failed][0]
            r._raise_for(&err)
    finally:
        PyMem_Free(c_levels)
        PyMem_Free(hashes)
        PyMem_Free(start)
    return 0
