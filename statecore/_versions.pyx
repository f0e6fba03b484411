# cython: language_level=3
"""The read model: what one version of a provider's in-memory state is made of, and the one
rule that reads it (per row, in batches, and whole).

A version's *sources* are flattened once into a :class:`Sources`, newest first:

- *tables*: the non-empty layers (statecore/layers.py) that decide keys at that version: the
  undo layers of the newer versions (oldest first: the undo of v+1 holds the value at v),
  the head, and, where the base is a :class:`FrozenView` (a frozen State seen at a version),
  that State's own layers at that version, and so on down;
- *levels*: the :class:`Spill`\ s at the bottom of that chain that stand on something (each
  two mapped images: the rows it puts, the keys it removes);
- the *bottom image*: the mapped snapshot under them, or a whole spill's image (every row
  of its version), or nothing.

Tables always come before images: a Spill never stands over a table. The rule is: **the
first source that decides a key wins** (a put gives its value; a removal, absence); a key no
source decides is absent. It is written here once, with three entry points:
``Sources.find`` (the stores' per-row calls, statecore/_rowcalls.pyx), ``Sources.lookup``
(batches: the tables narrowed to the keys still undecided, then the images in one nogil walk
below) and ``Sources.rows`` (iteration: each source's rows that no newer source decides).
Whatever tells the kinds of base apart (a SnapshotReader, a Spill, a FrozenView, or nothing)
is in this module too, as the functions at its end.

The image walk (``_walk``): each level's KeyFilters are asked first so that only the images
that may decide a key are probed. The bottom image's filter, once it has one, is asked too,
window by window while it pays (``filter_pays``): it rules out only absent keys, and a batch
of keys that are nearly all present gains nothing from it. A key is hashed once for every
level (the filters and the slot indexes use the same hash). The walk runs without the GIL in
two passes: the first hashes each key and finds the first level whose filters may hold it;
the second probes from there, prefetching the home slot of a key some lookups ahead in the
index it will start in. A filter's false "maybe" costs one probe and the walk goes on down.
Rules: ``docs/provider-rules.md``, "The read model". (About 700 lines: the types, the rule's
three entry points and the compiled image walk they share are one unit; split, each part
would read the others' internals.)
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

import numpy as np

from statecore._hash cimport key_hash, slot_tag
from statecore._keyfilter cimport (
    FILTER_SAMPLE, FILTER_WINDOW, FilterBits, KeyFilter, filter_may_hold, filter_pays, filter_prefetch,
)
from statecore._mapping cimport Mapping
from statecore._probe cimport SC_PREFETCH, SlotIndex, home_slot, prefetch_row
from statecore._rowtable cimport RowTable, rows_ptr
from statecore._snapshot_image cimport SNAP_OK, SnapError, SnapLayout, snapshot_announce_all, snapshot_find
from statecore._snapshot_reader cimport SnapshotReader, reader_key_filter

__all__ = ["Sources", "FrozenView", "Spill", "sources_of", "base_sources", "take_rows", "put_rows_at", "no_values",
           "below_sources", "base_count", "bottom_snapshot", "snapshot_version", "filter_bytes", "spilled_base",
           "changed_since_bottom", "stands_on_frozen", "is_view_of", "frozen_below", "spill_chain",
           "replace_in_chain", "describe_base"]

CHUNK_ROWS = 1 << 16


def take_rows(rows, index):
    """``rows[index]`` for an (n, w) uint8 row array, as one memcpy per row (a void view)."""
    w = rows.shape[1]
    if w == 0:
        index = np.asarray(index)
        return no_values(int(index.sum()) if index.dtype == np.bool_ else index.size)
    return rows.view(f"V{w}").ravel()[index].view(np.uint8).reshape(-1, w)


def put_rows_at(dst, index, src):
    """``dst[index] = src`` for (n, w) uint8 row arrays, one memcpy per row."""
    w = dst.shape[1]
    if w:
        dst.view(f"V{w}").ravel()[index] = src.view(f"V{w}").ravel()


def no_values(n):
    return np.empty((n, 0), dtype=np.uint8)


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
cdef int _images_lookup(list levels, SnapshotReader bottom_reader, const uint8_t[:, ::1] keys,
                        uint8_t[:, ::1] values, uint8_t[::1] found) except -1:
    """Look ``keys`` (n, key_width) up through ``levels`` (Spills, newest first, each standing
    on something) and ``bottom_reader`` (or None) into ``values`` (zeros where not found) and
    ``found``. Raises what a SnapshotReader raises for a damaged or truncated image; ``values``
    and ``found`` then hold nothing to use. REQUIRES: at least one level."""
    cdef SnapshotReader first = levels[0].puts
    cdef Py_ssize_t n = first._lookup_size(keys, values, found)
    cdef Py_ssize_t n_levels = len(levels), j, failed = -1
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
            level = levels[j]
            r = level.puts
            m = r._acquire()
            readers.append((r, m))
            c_levels[j].puts = r._layout_of(m)
            c_levels[j].puts_filter = _filter_of(r)
            r = level.dels
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


# -- the typed parts of a version ---------------------------------------------------------------
@cython.final
cdef class FrozenView:
    """A frozen State seen at one of its versions: the base of a newer State."""

    def __init__(self, state, version):
        self.state = state
        self.version = version

    @property
    def num_keys(self):
        return self.state.count(self.version)

    def __repr__(self):
        return f"FrozenView(version={self.version})"


class Spill:
    """Version ``version`` (attempt ``commit_id``, ``num_keys`` keys) as ``puts`` and ``dels``
    (SnapshotReaders, each with the KeyFilter of its keys its writer filled, which lookups
    ask to skip the level) over ``lower`` (a SnapshotReader, a Spill over one, or None);
    ``dels`` is None when ``lower`` is. Written by statecore/spill.py. (A Python class, not
    a cdef one: nothing reads it per row, its levels are flattened into Sources once, and
    tests replace its ``rows`` to interleave work with a snapshot being written.)"""

    __slots__ = ("puts", "dels", "lower", "version", "commit_id", "num_keys")

    def __init__(self, puts, dels, lower, version, commit_id, num_keys):
        self.puts = puts
        self.dels = dels
        self.lower = lower
        self.version = version
        self.commit_id = commit_id
        self.num_keys = num_keys

    def __repr__(self):
        return (f"Spill(version={self.version}, keys={self.num_keys}, puts={self.puts.row_count}, "
                f"dels={self.dels.row_count if self.dels is not None else 0})")

    @property
    def own_changed(self):
        """Keys this level decides."""
        return self.puts.row_count + (self.dels.row_count if self.dels is not None else 0)

    @property
    def whole(self):
        """Whether this spill holds every row of its version (it stands on nothing): the
        bottom image of the levels above it, as a snapshot is."""
        return self.lower is None

    @property
    def changed(self):
        """Keys this spill and the levels below it decide over their bottom image (a snapshot,
        or a whole spill): the changes since it (a key changed in two levels counts twice);
        none for a whole spill itself."""
        return sum(level.own_changed for level in base_sources(self).levels)

    @property
    def filter_bytes(self):
        """Heap bytes of the key filters of this level and the levels below it, the
        snapshot's included."""
        return filter_bytes(self)

    def lookup(self, key_rows):
        """``(value_rows, found)`` of ``key_rows`` at this spill's version."""
        return base_sources(self).lookup(key_rows, self.puts.value_width)

    def rows(self, chunk_rows=CHUNK_ROWS):
        """Every row of the version, each key once (``Sources.rows``)."""
        return base_sources(self).rows(chunk_rows)


cdef inline bint _is_spill(base):
    return type(base) is Spill


@cython.final
cdef class Sources:
    """The sources of one version, flattened, newest first (see the module docstring):
    ``layers`` (non-empty Layers), ``levels`` (Spills standing on something), ``bottom``
    (a SnapshotReader, or None). Built under the provider's lock; immutable after."""

    def __init__(self, layers, levels, bottom):
        self.layers = tuple(layers)
        self.levels = tuple(levels)
        self.bottom = bottom
        self.tables = []
        for layer in self.layers:  # an undo layer kept as arrays gets its tables here, once
            self.tables.append(layer.puts)
            self.tables.append(layer.dels)
        self.images = []
        for level in self.levels:
            self.images.append(level.puts)
            self.images.append(level.dels)

    def __repr__(self):
        return f"Sources(tables={len(self.layers)}, levels={len(self.levels)}, bottom={self.bottom is not None})"

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """The per-row rule: 1 (the value copied to ``value_out``) if the first source that
        decides the key puts it, 0 if it removes it or no source decides it. REQUIRES: the
        provider's lock held, or every State read frozen."""
        cdef uint32_t tag = slot_tag(h)
        cdef Py_ssize_t i, n = len(self.tables)
        cdef RowTable puts
        cdef list tables = self.tables, images = self.images
        for i in range(0, n, 2):
            puts = <RowTable>tables[i]
            if table_find_value(puts, key, tag, value_out if puts.value_width else NULL):
                return 1
            if table_find_value(<RowTable>tables[i + 1], key, tag, NULL):
                return 0
        n = len(images)
        for i in range(0, n, 2):
            if (<SnapshotReader>images[i]).find_into(key, h, value_out):
                return 1
            dels = images[i + 1]
            if dels is not None and (<SnapshotReader>dels).find_into(key, h, NULL):
                return 0
        if self.bottom is not None:
            return self.bottom.find_into(key, h, value_out)
        return 0

    def lookup(self, key_rows, Py_ssize_t vw, extra_layers=()):
        """``(value_rows, found)`` of ``key_rows`` (values ``vw`` bytes wide) under
        ``extra_layers`` (a store's update layer, newer than every source): the batch rule.
        Each table is probed with the keys no newer one decided; the rest go through the
        images in one walk."""
        n = key_rows.shape[0]
        values = found = None  # made by the first table that holds anything
        pending = None  # indices still undecided; None: all of them (no gather needed)
        for layer in (*extra_layers, *self.layers):
            if not len(layer):
                continue
            if values is None:
                values = np.zeros((n, vw), dtype=np.uint8)
                put_found, decided = layer.probe(key_rows, values)  # nothing found yet: write in place
                found = put_found.copy()
                pending = np.flatnonzero(~decided)
                continue
            if pending.size == 0:
                break
            sub_values = np.empty((pending.size, vw), dtype=np.uint8)
            put_found, decided = layer.probe(take_rows(key_rows, pending), sub_values)
            hit = pending[put_found]
            put_rows_at(values, hit, take_rows(sub_values, put_found))
            found[hit] = True
            pending = pending[~decided]
        has_images = bool(self.levels) or self.bottom is not None
        if values is None:  # no table holds anything: the images decide every key
            if has_images:
                return self._image_lookup(key_rows, vw)
            return np.zeros((n, vw), dtype=np.uint8), np.zeros(n, dtype=np.bool_)
        if has_images and pending.size:
            image_values, image_found = self._image_lookup(take_rows(key_rows, pending), vw)
            put_rows_at(values, pending, image_values)
            found[pending] = image_found
        return values, found

    def _image_lookup(self, key_rows, Py_ssize_t vw):
        n = key_rows.shape[0]
        values = np.empty((n, vw), dtype=np.uint8)  # every row written: zeros where not found
        found = np.empty(n, dtype=np.uint8)
        if self.levels:
            _images_lookup(list(self.levels), self.bottom, key_rows, values, found)
        else:
            self.bottom.get_rows(key_rows, values, found)
        return values, found.view(np.bool_)

    def rows(self, chunk_rows=CHUNK_ROWS, extra_layers=()):
        """Yield ``(n, row_width)`` uint8 chunks of every row, each key once: each table's
        puts that no newer table decides, then each level's puts that no newer level decides,
        then the bottom's rows that no level decides, the image rows less those any table
        decides. An image's rows a newer image overrides are found by probing the newer keys
        in it (a mask of its rows), never the other way round."""
        layers = [layer for layer in (*extra_layers, *self.layers) if len(layer)]
        kw = None
        for i, layer in enumerate(layers):
            kw = layer.key_schema.width
            cursor = layer.puts.cursor()
            while (chunk := cursor.next_rows(chunk_rows)) is not None:
                keep = ~_decided_by(layers[:i], np.ascontiguousarray(chunk[:, :kw]))
                if keep.any():
                    yield chunk[keep]
        for chunk in self._image_rows(chunk_rows):
            if not layers:
                yield chunk
                continue
            keep = ~_decided_by(layers, np.ascontiguousarray(chunk[:, :kw]))
            if keep.any():
                yield chunk[keep]

    def _image_rows(self, chunk_rows):
        newer = []
        for level in self.levels:
            yield from unshadowed(level.puts, newer, chunk_rows)[1]
            newer += [image for image in (level.puts, level.dels) if image is not None]
        if self.bottom is not None and self.bottom.row_count:
            yield from unshadowed(self.bottom, newer, chunk_rows)[1]


def _decided_by(layers, key_rows):
    n = key_rows.shape[0]
    decided = np.zeros(n, dtype=np.bool_)
    for layer in layers:
        scratch = np.empty((n, layer.puts.value_width), dtype=np.uint8)
        decided |= layer.probe(key_rows, scratch)[1]
    return decided


def unshadowed(image, newer, chunk_rows):
    """``(count, chunks)`` of the rows of ``image`` (a SnapshotReader) whose keys none of the
    ``newer`` sources (RowTables or SnapshotReaders) holds: found by probing the newer keys
    in ``image`` (those its key filter, if any, may hold), a mask of its rows."""
    kw = image.key_width
    image_filter = image.key_filter
    mask = np.zeros(image.row_count, dtype=np.uint8)
    for source in newer:
        for chunk in cursor_chunks(source, chunk_rows):
            keys = image_filter.keys_it_may_hold(chunk) if image_filter is not None else chunk[:, :kw]
            image.mark_rows(np.ascontiguousarray(keys), mask)
    return image.row_count - int(np.count_nonzero(mask)), cursor_chunks(image, chunk_rows, skip=mask)


def cursor_chunks(source, chunk_rows, skip=None):
    """The non-empty row chunks of ``source``'s cursor (less the rows ``skip`` marks)."""
    cursor = source.cursor()
    kwargs = {} if skip is None else {"skip": skip}
    while (chunk := cursor.next_rows(chunk_rows, **kwargs)) is not None:
        if chunk.shape[0]:
            yield chunk


# -- flattening: the one place that tells the kinds of base apart ---------------------------------
def sources_of(state, version):
    """The :class:`Sources` of ``version`` of ``state`` (a State holding it): its layers at
    that version, then, down every FrozenView base, the frozen State's at its version, then
    the images under the last base. REQUIRES: the provider's lock held (or every State read
    frozen)."""
    layers = []
    while True:
        for layer in state.layers_for(version):
            if len(layer):
                layers.append(layer)
        base = state.base
        if type(base) is not FrozenView:
            break
        state, version = (<FrozenView>base).state, (<FrozenView>base).version
    return _over_images(layers, base)


def base_sources(base):
    """The :class:`Sources` of a base that is no FrozenView (a SnapshotReader, a Spill, or
    None): its images alone."""
    return _over_images([], base)


cdef Sources _over_images(list layers, base):
    levels, bottom = spill_chain(base)
    if levels and levels[-1].whole:  # a whole spill: its puts are every row of its version
        bottom = levels.pop().puts
    return Sources(layers, levels, bottom)


def spill_chain(base):
    """``(spills, below)``: the Spills from ``base`` down (newest first; a whole one last, if
    any), and what the last stands on (a SnapshotReader, or None)."""
    levels = []
    node = base
    while _is_spill(node):
        levels.append(node)
        node = node.lower
    return levels, node


def base_count(base):
    """Keys in the version ``base`` holds (0: no base)."""
    if base is None:
        return 0
    if type(base) is SnapshotReader:
        return base.row_count
    return base.num_keys  # a Spill, or a FrozenView


def bottom_snapshot(base):
    """The mapped snapshot at the bottom of ``base`` (a SnapshotReader, or a Spill over
    one), or None (nothing under the levels, or another kind of base)."""
    node = spill_chain(base)[1]
    return node if type(node) is SnapshotReader else None


def snapshot_version(base):
    """The version of the snapshot a State's base stands on, down any frozen States (0: none)."""
    while type(base) is FrozenView:
        base = (<FrozenView>base).state.base
    node = spill_chain(base)[1]
    return node.store_version if node is not None else 0


def filter_bytes(base):
    """Heap bytes of the key filters of ``base`` (a SnapshotReader, a Spill and the levels
    under it, or anything else: 0)."""
    if _is_spill(base):
        return filter_bytes(base.puts) + filter_bytes(base.dels) + filter_bytes(base.lower)
    if type(base) is SnapshotReader:
        keys = base.key_filter
        return keys.nbytes if keys is not None else 0
    return 0


def spilled_base(base):
    """``base`` if it is a Spill, else None."""
    return base if _is_spill(base) else None


def changed_since_bottom(base):
    """Keys the spilled levels of ``base`` decide over their bottom image (0: no levels)."""
    return base.changed if _is_spill(base) else 0


def stands_on_frozen(base):
    """Whether ``base`` is a frozen State (a FrozenView)."""
    return type(base) is FrozenView


def is_view_of(base, state, version):
    """Whether ``base`` is ``state`` seen at ``version``."""
    return type(base) is FrozenView and (<FrozenView>base).state is state and (<FrozenView>base).version == version


def frozen_below(state):
    """The frozen State ``state`` stands on (through a FrozenView), or None."""
    base = state.base
    return (<FrozenView>base).state if type(base) is FrozenView else None


def replace_in_chain(state, is_old, new):
    """Make ``new`` the base of the State (``state`` first, then down the chain of frozen
    ones) whose base ``is_old``, or the ``lower`` of the level of its spills that stands on
    it: the same version, now mapped. Either change is counted in the States' change counter
    first. Whether one was found. REQUIRES: the provider's lock held."""
    node = state
    while node is not None:
        base = node.base
        if is_old(base):
            node.base = new
            return True
        level = base
        while _is_spill(level):  # the levels of spills, newest first
            if is_old(level.lower):
                node.count_base_change()
                level.lower = new
                return True
            level = level.lower
        node = frozen_below(node)
    return False


def describe_base(base):
    """What ``base`` is, as a dict (for ``State.describe``)."""
    if base is None:
        return {"kind": "none"}
    if type(base) is SnapshotReader:
        return {"kind": "snapshot", "version": base.store_version, "rows": base.row_count,
                "filter": base.key_filter is not None}
    if type(base) is FrozenView:
        return {"kind": "frozen", "version": (<FrozenView>base).version,
                "state": (<FrozenView>base).state.describe()}
    levels, below = spill_chain(base)
    return {"kind": "spill", "version": base.version,
            "levels": [{"version": s.version, "puts": s.puts.row_count,
                        "dels": s.dels.row_count if s.dels is not None else 0, "whole": s.whole}
                       for s in levels],
            "below": describe_base(below)}


def below_sources(state):
    """The :class:`Sources` of what ``state``'s head stands on: its base alone (a frozen
    State's at its version, down the chain, or the images). REQUIRES: as sources_of."""
    base = state.base
    if type(base) is FrozenView:
        return sources_of((<FrozenView>base).state, (<FrozenView>base).version)
    return base_sources(base)
