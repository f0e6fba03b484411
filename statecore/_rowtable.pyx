# cython: language_level=3
"""RowTable: the in-memory map of a store, over fixed-width binary rows.

Layout. Rows (key bytes then value bytes) live in an arena, one contiguous allocation
indexed by row number; rows never move, so cursors can hold row numbers across updates.
The index is an open-addressing table of 8-byte slots ``(tag, row + 1)`` with linear
probing and Robin Hood placement, the rule snapshots are built by too (``_probe.pxd``):
lookups of absent keys stop as soon as they pass a richer entry, and deletion shifts the
following entries back, so there are no tombstones and lookups do not degrade after many
delete/insert cycles. The table grows (doubles) at 3/4 load.

Negative filter. Beside the index, one 64-bit word per 16 slots in which each key sets two
bits, both chosen by its tag (the word by the tag's high bits, the bits by its low 12):
``table_may_hold`` answers most lookups of absent keys from it, 1/16 of the index's bytes,
without touching the index. It is built with the index (at each growth) and kept by every
insert; a removal leaves the key's bits set (still correct, only weaker), and the first
insert after more keys were removed than the table holds rebuilds it from the index.

Iteration. A :class:`RowCursor` visits each row that was live when it opened exactly once,
even while rows are put and removed: while any cursor is open, removed rows become
zombies (kept, not reused) and new rows are appended past every cursor's end.

Memory. Every buffer comes from ``malloc`` and is registered with tracemalloc under
:data:`TRACE_DOMAIN`; :meth:`RowTable.sizeof` is exactly the bytes allocated.

Thread-safety: none. Callers serialize all calls on one table; batch calls release the GIL,
so other Python threads run meanwhile, but they must not use the same table.

Its base, :class:`RowSource`, holds what SnapshotReader shares with it: the schemas, their
widths and the schema-level reads.

Length: about 800 lines, because a cdef class lives in one module: RowTable's nogil core
and its Python API, and its cursor, which reads the table's internals.
"""
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, qsort
from libc.math cimport log
from libc.string cimport memcpy, memset

from statecore._hash cimport key_hash, slot_tag
from statecore._probe cimport (
    MAX_ROWS, SC_PREFETCH, SLOT_PREFETCH_AHEAD, displacement, probe_erase, probe_find, probe_insert, probe_prefetch,
    slots_for,
)

import numpy as np

from statecore.rowsource import iter_batches, iter_items, lookup_batch, lookup_one
from statecore.schema import key_value_schemas

cdef extern from *:
    int __builtin_popcountll(unsigned long long) nogil
    int __builtin_ctzll(unsigned long long) nogil

cdef extern from "Python.h":
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size) nogil
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr) nogil

cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>

    /* Buffers of 1 MiB and more are mapped directly: on Linux they then grow with mremap
       (no copy, however large the arena), and huge pages are asked for, since the index and
       the arena are probed at random and would otherwise miss the TLB on most lookups.
       Sizes are rounded up to whole pages, and the rounded size is what gets accounted. */
    #define SC_BIG_BUFFER ((size_t)1 << 20)
    #define SC_PAGE ((size_t)4096)

    static size_t sc_mem_actual(size_t n) {
    #if defined(__linux__)
        return n >= SC_BIG_BUFFER ? (n + SC_PAGE - 1) & ~(SC_PAGE - 1) : n;
    #else
        return n;
    #endif
    }

    static void sc_mem_free(void* p, size_t actual) {
        if (p == NULL) return;
    #if defined(__linux__)
        if (actual >= SC_BIG_BUFFER) { munmap(p, actual); return; }
    #endif
        free(p);
    }

    /* Resize a buffer of `old_actual` bytes to hold `want` bytes, keeping its contents;
       NULL on failure (the old buffer is then untouched). */
    static void* sc_mem_resize(void* p, size_t old_actual, size_t want) {
        size_t actual = sc_mem_actual(want);
    #if defined(__linux__)
        if (actual >= SC_BIG_BUFFER) {
            void* q;
            if (p != NULL && old_actual >= SC_BIG_BUFFER) {
                q = mremap(p, old_actual, actual, MREMAP_MAYMOVE);
            } else {
                q = mmap(NULL, actual, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (q != MAP_FAILED && p != NULL) {
                    memcpy(q, p, old_actual < actual ? old_actual : actual);
                    sc_mem_free(p, old_actual);
                }
            }
            if (q == MAP_FAILED) return NULL;
    #if defined(MADV_HUGEPAGE)
            madvise(q, actual, MADV_HUGEPAGE);
    #endif
            return q;
        }
        if (p != NULL && old_actual >= SC_BIG_BUFFER) {
            void* q = malloc(actual ? actual : 1);
            if (q == NULL) return NULL;
            memcpy(q, p, actual);
            sc_mem_free(p, old_actual);
            return q;
        }
    #endif
        return realloc(p, actual ? actual : 1);
    }
    """
    size_t sc_mem_actual(size_t n) nogil
    void sc_mem_free(void* p, size_t actual) nogil
    void* sc_mem_resize(void* p, size_t old_actual, size_t want) nogil

# tracemalloc domain of every RowTable buffer ("SC" + 1), for tests of sizeof().
TRACE_DOMAIN = 0x53430001
cdef unsigned int _TRACE_DOMAIN = 0x53430001

cdef enum:
    MIN_ROWS = 16


@cython.boundscheck(False)
@cython.wraparound(False)
cdef double _estimate_distinct(const uint32_t* tags, Py_ssize_t n, uint64_t* bitmap,
                               uint64_t n_bits) noexcept nogil:
    """Distinct tags among ``n`` (linear counting over ``n_bits``, a power of two >= 2n).

    A batch of D distinct keys leaves the table with at least max(count, D) keys, whatever
    was there before, so reserving that much up front never over-allocates and spares the
    rehashes of growing step by step.
    """
    cdef Py_ssize_t i
    cdef uint64_t zeros = 0, w, mask = n_bits - 1
    for i in range(n):
        bitmap[(tags[i] & mask) >> 6] |= (<uint64_t>1) << (tags[i] & 63)
    for i in range(<Py_ssize_t>(n_bits >> 6)):
        w = bitmap[i]
        zeros += 64 - __builtin_popcountll(w)
    if zeros == 0:
        return <double>n
    return -(<double>n_bits) * log(<double>zeros / <double>n_bits)


cdef int _cmp_u32(const void* a, const void* b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t*>a)[0]
    cdef uint32_t y = (<const uint32_t*>b)[0]
    return (x > y) - (x < y)


cdef object _raise_code(int code):
    if code == TABLE_NO_MEMORY:
        raise MemoryError("RowTable could not allocate memory")
    if code == TABLE_FULL:
        raise OverflowError(f"RowTable holds at most {MAX_ROWS} rows")
    raise AssertionError(f"unknown RowTable code {code}")


@cython.auto_pickle(False)
cdef class RowSource:
    """What RowTable and SnapshotReader share: the two schemas and their widths, and the
    schema-level reads of :mod:`statecore.rowsource`, made of the primitives each subclass
    provides: ``get_row``, ``get_rows`` and ``cursor()``."""

    cdef void _set_schemas(self, key_schema, value_schema) except *:
        """Take two RowSchemas (the key schema made with ``key=True``) and their widths."""
        self.key_schema = key_schema
        self.value_schema = value_schema
        self.key_width = key_schema.width
        self.value_width = value_schema.width
        self.row_width = self.key_width + self.value_width

    cdef Py_ssize_t _lookup_size(self, const uint8_t[:, ::1] keys, uint8_t[:, ::1] values,
                                 uint8_t[::1] found) except -1:
        """The number of keys of a ``get_rows`` call, once its arrays are checked (ValueError)."""
        cdef Py_ssize_t n = keys.shape[0]
        if keys.shape[1] != self.key_width or values.shape[1] != self.value_width:
            raise ValueError(f"rows must be (n, {self.key_width}) keys and (n, {self.value_width}) values, "
                             f"got {keys.shape[1]} and {values.shape[1]} bytes")
        if values.shape[0] != n or found.shape[0] != n:
            raise ValueError(f"{n} keys but {values.shape[0]} value rows and {found.shape[0]} found flags")
        return n

    def get(self, key):
        """The value tuple of ``key`` (tuple, scalar, record or bytes), or None."""
        return lookup_one(self.get_row, self.key_schema, self.value_schema, key)

    def __contains__(self, key):
        return self.get_row(self.key_schema.encode(key)) is not None

    def get_batch(self, keys):
        """``(values, found)`` for a batch of keys; see :func:`statecore.rowsource.lookup_batch`."""
        return lookup_batch(self.get_rows, self.key_schema, self.value_schema, keys)

    def items(self):
        """Yield ``(key_tuple, value_tuple)`` for each row ``cursor()`` visits."""
        return iter_items(self.cursor(), self.key_schema, self.value_schema)

    def iter_batches(self, Py_ssize_t rows_per_batch=65536):
        """Yield ``(keys, values)`` structured-array copies covering each row ``cursor()``
        visits exactly once."""
        return iter_batches(self.cursor(), self.key_schema, self.value_schema, rows_per_batch)


@cython.final
cdef class RowTable(RowSource):
    """A hash map from key rows to value rows of two fixed-width schemas.

    Parameters
    ----------
    key_schema, value_schema : numpy structured dtype or RowSchema
        The value schema may have no fields (a set).
    capacity : int, optional
        Keys to size the table for up front.
    """

    def __cinit__(self, key_schema, value_schema, Py_ssize_t capacity=0):
        key_schema, value_schema = key_value_schemas(key_schema, value_schema)
        self._set_schemas(key_schema, value_schema)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if capacity:
            self._check(self.slots_reserve(<uint64_t>capacity))

    def __dealloc__(self):
        self.mem_release(<void**>&self.slots, &self.slots_bytes)
        self.mem_release(<void**>&self.filter, &self.filter_bytes)
        self.mem_release(<void**>&self.rows, &self.rows_bytes)
        self.mem_release(<void**>&self.row_state, &self.state_bytes)
        self.mem_release(<void**>&self.free_rows, &self.free_bytes)
        self.mem_release(<void**>&self.zombies, &self.zombie_bytes)

    cdef object _check(self, int code):
        if code < 0:
            _raise_code(code)

    # -- memory ---------------------------------------------------------------------------
    cdef int mem_resize(self, void** buf, size_t* cur_bytes, size_t new_bytes) noexcept nogil:
        """Grow or shrink one buffer, keeping its contents and the accounting exact."""
        cdef void* p = sc_mem_resize(buf[0], cur_bytes[0], new_bytes)
        cdef size_t actual = sc_mem_actual(new_bytes)
        if p == NULL:
            return TABLE_NO_MEMORY
        if buf[0] != NULL:
            PyTraceMalloc_Untrack(_TRACE_DOMAIN, <uintptr_t>buf[0])
        PyTraceMalloc_Track(_TRACE_DOMAIN, <uintptr_t>p, actual)
        self.allocated_bytes = self.allocated_bytes - cur_bytes[0] + actual
        buf[0] = p
        cur_bytes[0] = actual
        return TABLE_OK

    cdef void mem_release(self, void** buf, size_t* cur_bytes) noexcept nogil:
        if buf[0] != NULL:
            PyTraceMalloc_Untrack(_TRACE_DOMAIN, <uintptr_t>buf[0])
            sc_mem_free(buf[0], cur_bytes[0])
            self.allocated_bytes -= cur_bytes[0]
        buf[0] = NULL
        cur_bytes[0] = 0

    # -- index (the rule is _probe.pxd's) -----------------------------------------------
    cdef inline SlotIndex index(self) noexcept nogil:
        """What a probe of the index reads, as it is now (pointers move when buffers grow)."""
        cdef SlotIndex ix
        ix.slots = self.slots
        ix.rows = self.rows
        ix.mask = self.n_slots - 1
        ix.row_width = self.row_width
        ix.key_width = self.key_width
        ix.row_count = self.rows_used
        ix.max_displacement = self.max_displacement
        return ix

    cdef uint32_t table_find(self, const uint8_t* key, uint32_t tag, uint64_t* slot_out) noexcept nogil:
        """Row number + 1 of ``key``, or 0; ``slot_out`` gets its slot."""
        if self.n_slots == 0:
            return 0
        cdef SlotIndex ix = self.index()
        if probe_find(&ix, tag, key, NULL, NULL, slot_out) == 0:
            return 0
        return self.slots[slot_out[0]].row

    cdef inline void slots_insert(self, uint32_t tag, uint32_t row) noexcept nogil:
        # REQUIRES: a free slot exists and the key is not in the index.
        cdef uint64_t farthest
        cdef Slot carried
        carried.tag = tag
        carried.row = row
        probe_insert(self.slots, self.n_slots - 1, carried, NULL, NULL, &farthest)
        if farthest > self.max_displacement:
            self.max_displacement = <uint32_t>farthest
        self.filter[(<uint64_t>tag) >> self.filter_shift] |= filter_bits(tag)

    cdef void filter_rebuild(self) noexcept nogil:
        """Set the filter from the index alone (the bits of removed keys go)."""
        cdef uint64_t i
        cdef uint32_t tag
        memset(self.filter, 0, (self.n_slots >> 4) * sizeof(uint64_t))
        self.filter_stale = 0
        if self.count == 0:
            return
        for i in range(self.n_slots):
            if self.slots[i].row != 0:
                tag = self.slots[i].tag
                self.filter[(<uint64_t>tag) >> self.filter_shift] |= filter_bits(tag)

    cdef int slots_reserve(self, uint64_t n_keys) noexcept nogil:
        """Size the index (and its filter) for ``n_keys`` at no more than 3/4 load; rebuild
        both if it grows."""
        cdef uint64_t target = slots_for(n_keys, self.n_slots)
        if target == self.n_slots:
            return TABLE_OK
        cdef Slot* old = self.slots
        cdef uint64_t* old_filter = self.filter
        cdef uint64_t old_n = self.n_slots, i
        cdef size_t old_bytes = self.slots_bytes, old_filter_bytes = self.filter_bytes
        cdef uint64_t words = target >> 4  # target >= MIN_SLOTS = 16
        self.slots = NULL
        self.slots_bytes = 0
        self.filter = NULL
        self.filter_bytes = 0
        if (self.mem_resize(<void**>&self.slots, &self.slots_bytes, target * sizeof(Slot)) < 0
                or self.mem_resize(<void**>&self.filter, &self.filter_bytes, words * sizeof(uint64_t)) < 0):
            self.mem_release(<void**>&self.slots, &self.slots_bytes)
            self.slots = old
            self.slots_bytes = old_bytes
            self.filter = old_filter
            self.filter_bytes = old_filter_bytes
            return TABLE_NO_MEMORY
        memset(self.slots, 0, target * sizeof(Slot))
        memset(self.filter, 0, words * sizeof(uint64_t))
        self.n_slots = target
        self.filter_shift = 32 - __builtin_ctzll(words)  # words is a power of two
        self.filter_stale = 0
        self.max_displacement = 0
        for i in range(old_n):
            if old[i].row != 0:
                self.slots_insert(old[i].tag, old[i].row)
        self.mem_release(<void**>&old, &old_bytes)
        self.mem_release(<void**>&old_filter, &old_filter_bytes)
        return TABLE_OK

    # -- arena ----------------------------------------------------------------------------
    cdef int rows_reserve(self, uint64_t n_rows) noexcept nogil:
        """Size the arena for ``n_rows`` rows (never shrinks it)."""
        if n_rows <= self.rows_capacity:
            return TABLE_OK
        if n_rows > MAX_ROWS:
            return TABLE_FULL
        if self.mem_resize(<void**>&self.rows, &self.rows_bytes, n_rows * self.row_width) < 0:
            return TABLE_NO_MEMORY
        if self.mem_resize(<void**>&self.row_state, &self.state_bytes, n_rows) < 0:
            return TABLE_NO_MEMORY
        self.rows_capacity = n_rows
        return TABLE_OK

    cdef int row_alloc(self, uint32_t* row_out) noexcept nogil:
        cdef uint64_t new_cap
        cdef int rc
        if self.open_cursors == 0 and self.n_free > 0:
            self.n_free -= 1
            row_out[0] = self.free_rows[self.n_free]
            return TABLE_OK
        if self.rows_used == self.rows_capacity:
            if self.rows_capacity >= MAX_ROWS:
                return TABLE_FULL
            new_cap = self.rows_capacity + self.rows_capacity // 4  # cheap: big arenas grow by mremap
            if new_cap < MIN_ROWS:
                new_cap = MIN_ROWS
            if new_cap > MAX_ROWS:
                new_cap = MAX_ROWS
            rc = self.rows_reserve(new_cap)
            if rc < 0:
                return rc
        row_out[0] = <uint32_t>self.rows_used
        self.rows_used += 1
        return TABLE_OK

    cdef int _push_row(self, uint32_t** stack, uint64_t* n, uint64_t* capacity, size_t* nbytes,
                       uint32_t row) noexcept nogil:
        cdef uint64_t new_cap
        if n[0] == capacity[0]:
            new_cap = capacity[0] * 2 if capacity[0] else MIN_ROWS
            if self.mem_resize(<void**>stack, nbytes, new_cap * sizeof(uint32_t)) < 0:
                return TABLE_NO_MEMORY
            capacity[0] = new_cap
        stack[0][n[0]] = row
        n[0] += 1
        return TABLE_OK

    # -- single-row operations (nogil) ----------------------------------------------------
    cdef int table_put(self, const uint8_t* key, const uint8_t* value, uint32_t tag) noexcept nogil:
        """1 if the key was new, 0 if its value was overwritten, < 0 on error (table unchanged)."""
        cdef uint64_t pos
        cdef uint32_t row
        if not table_may_hold(self, tag):  # surely new: no probe before the insert's own
            return self.table_insert_new(key, value, tag)
        row = self.table_find(key, tag, &pos)
        if row != 0:
            if self.value_width:
                memcpy(self.rows + <uint64_t>(row - 1) * self.row_width + self.key_width,
                       value, self.value_width)
            return 0
        return self.table_insert_new(key, value, tag)

    cdef int table_insert_new(self, const uint8_t* key, const uint8_t* value, uint32_t tag) noexcept nogil:
        """Insert a key known to be absent: 1, or < 0 on error (table unchanged)."""
        cdef uint32_t row
        cdef uint8_t* dst
        cdef int rc
        rc = self.slots_reserve(self.count + 1)
        if rc < 0:
            return rc
        if self.filter_stale > self.count + 1024:
            # More keys were removed than the table holds: drop their bits before they
            # make the filter useless (amortized: a scan of the index per that many removals).
            self.filter_rebuild()
        rc = self.row_alloc(&row)
        if rc < 0:
            return rc
        dst = self.rows + <uint64_t>row * self.row_width
        memcpy(dst, key, self.key_width)
        if self.value_width:
            memcpy(dst + self.key_width, value, self.value_width)
        self.row_state[row] = ROW_LIVE
        self.slots_insert(tag, row + 1)
        self.count += 1
        return 1

    cdef int table_remove(self, const uint8_t* key, uint32_t tag) noexcept nogil:
        """1 if the key was removed, 0 if absent, < 0 on error (table unchanged)."""
        cdef uint64_t pos
        cdef uint32_t row = self.table_find(key, tag, &pos)
        cdef int rc
        if row == 0:
            return 0
        row -= 1
        if self.open_cursors > 0:
            rc = self._push_row(&self.zombies, &self.n_zombies, &self.zombie_capacity,
                                &self.zombie_bytes, row)
            if rc < 0:
                return rc
            self.row_state[row] = ROW_ZOMBIE
        else:
            rc = self._push_row(&self.free_rows, &self.n_free, &self.free_capacity,
                                &self.free_bytes, row)
            if rc < 0:
                return rc
            self.row_state[row] = ROW_FREE
        probe_erase(self.slots, self.n_slots - 1, pos)
        self.count -= 1
        self.filter_stale += 1  # its bits stay: the next insert may rebuild the filter
        return 1

    cdef void cursor_closed(self) noexcept nogil:
        cdef uint64_t i
        cdef uint32_t row
        self.open_cursors -= 1
        if self.open_cursors > 0:
            return
        for i in range(self.n_zombies):
            row = self.zombies[i]
            self.row_state[row] = ROW_FREE
            # Out of memory here only costs the row's reuse; it is never visited again.
            self._push_row(&self.free_rows, &self.n_free, &self.free_capacity, &self.free_bytes, row)
        self.n_zombies = 0

    # -- batch operations (nogil inner loops) ---------------------------------------------
    # REQUIRES (all three): row arrays have n rows of the right widths, checked by the
    # def methods below; tests/test_rowtable.py covers 0 rows, 1 row, the resize threshold
    # and wrap-around.
    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef void _hash_keys(self, const uint8_t* keys, Py_ssize_t n, uint32_t* tags) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(n):
            tags[i] = slot_tag(key_hash(keys + i * self.key_width, self.key_width))

    cdef inline void _prefetch(self, const uint32_t* tags, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
        if self.n_slots == 0:
            return
        cdef SlotIndex ix = self.index()
        probe_prefetch(&ix, tags, i, n)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef void _get_many(self, const uint8_t* keys, Py_ssize_t n, uint8_t* values, uint8_t* found,
                        uint32_t* tags) noexcept nogil:
        cdef Py_ssize_t i
        cdef uint64_t pos
        cdef uint32_t row
        cdef size_t kw = self.key_width, vw = self.value_width
        self._hash_keys(keys, n, tags)
        for i in range(n):
            self._prefetch(tags, i, n)
            row = self.table_find(keys + i * kw, tags[i], &pos)
            found[i] = row != 0
            if vw:
                if row != 0:
                    memcpy(values + i * vw, self.rows + <uint64_t>(row - 1) * self.row_width + kw, vw)
                else:
                    memset(values + i * vw, 0, vw)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int _reserve_for(self, const uint32_t* tags, Py_ssize_t n, uint64_t* bitmap,
                          uint64_t n_bits) noexcept nogil:
        """Size index and arena for a batch whose tags are known (see _estimate_distinct)."""
        cdef uint64_t at_least
        cdef int rc
        if bitmap == NULL:
            return TABLE_OK
        # unbiased, and capped by the batch size: all-distinct batches get exactly n
        at_least = <uint64_t>_estimate_distinct(tags, n, bitmap, n_bits)
        if at_least > <uint64_t>n:
            at_least = n
        if at_least <= self.count:
            return TABLE_OK
        rc = self.slots_reserve(at_least)
        if rc < 0:
            return rc
        # the arena too: rows beyond the free ones come from its end
        if self.rows_used + (at_least - self.count) > self.rows_capacity + self.n_free:
            return self.rows_reserve(self.rows_used + (at_least - self.count))
        return TABLE_OK

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef inline int _put_many(self, const uint8_t* keys, const uint8_t* values, Py_ssize_t n,
                              uint8_t* prior, uint8_t* found, uint32_t* tags, uint64_t* bitmap,
                              uint64_t n_bits) noexcept nogil:
        """Put ``values`` at ``keys``, one probe per key. Unless NULL (put_rows passes NULL
        for both), ``prior`` gets what was there (zeros where the key is new) and ``found`` 1
        where the key was present (exchange_rows)."""
        cdef Py_ssize_t i
        cdef int rc
        cdef uint64_t pos
        cdef uint32_t row
        cdef size_t kw = self.key_width, vw = self.value_width
        cdef uint8_t* dst
        self._hash_keys(keys, n, tags)
        rc = self._reserve_for(tags, n, bitmap, n_bits)
        if rc < 0:
            return rc
        for i in range(n):
            self._prefetch(tags, i, n)
            if i + SLOT_PREFETCH_AHEAD < n and self.filter != NULL:  # the word a new key sets
                SC_PREFETCH(&self.filter[(<uint64_t>tags[i + SLOT_PREFETCH_AHEAD]) >> self.filter_shift])
            row = self.table_find(keys + i * kw, tags[i], &pos)
            if found != NULL:
                found[i] = row != 0
            if row != 0:
                if vw:
                    dst = self.rows + <uint64_t>(row - 1) * self.row_width + kw
                    if prior != NULL:
                        memcpy(prior + i * vw, dst, vw)
                    memcpy(dst, values + i * vw, vw)
                continue
            if prior != NULL and vw:
                memset(prior + i * vw, 0, vw)
            rc = self.table_insert_new(keys + i * kw, values + i * vw if vw else NULL, tags[i])
            if rc < 0:
                return rc
        return TABLE_OK

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int _remove_many(self, const uint8_t* keys, Py_ssize_t n, uint32_t* tags,
                          Py_ssize_t* removed) noexcept nogil:
        cdef Py_ssize_t i
        cdef int rc
        self._hash_keys(keys, n, tags)
        for i in range(n):
            self._prefetch(tags, i, n)
            rc = self.table_remove(keys + i * self.key_width, tags[i])
            if rc < 0:
                return rc
            removed[0] += rc
        return TABLE_OK

    # -- raw rows: the store's interface --------------------------------------------------
    def _check_rows(self, rows, Py_ssize_t width, what):
        if rows.ndim != 2 or rows.shape[1] != width:
            raise ValueError(f"{what} must be an (n, {width}) uint8 array, got shape {rows.shape}")

    def _growth_bitmap(self, Py_ssize_t n):
        """Scratch bits for the distinct-key estimate when a batch of n may outgrow the table
        (empty when it cannot)."""
        if self.count + n <= self.capacity or n < 1024:
            return np.zeros(0, dtype=np.uint64)
        cdef uint64_t n_bits = 1024
        while n_bits < <uint64_t>(2 * n) and n_bits < (<uint64_t>1 << 28):
            n_bits *= 2
        return np.zeros(n_bits // 64, dtype=np.uint64)

    def get_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[:, ::1] values not None,
                 uint8_t[::1] found not None):
        """Look up ``keys`` (n, key_width) into ``values`` (n, value_width) and ``found`` (n,)."""
        cdef Py_ssize_t n = self._lookup_size(keys, values, found)
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        if n == 0:
            return
        cdef uint8_t* value_ptr = <uint8_t*>rows_ptr(values)
        with nogil:
            self._get_many(&keys[0, 0], n, value_ptr, &found[0], &tags[0])

    def put_rows(self, const uint8_t[:, ::1] keys not None, const uint8_t[:, ::1] values not None):
        """Insert or overwrite ``keys`` (n, key_width) with ``values`` (n, value_width); later
        duplicates win. On MemoryError the rows before the failing one stay applied."""
        cdef Py_ssize_t n = keys.shape[0]
        cdef int rc
        if keys.shape[1] != self.key_width or values.shape[1] != self.value_width:
            raise ValueError(f"rows must be (n, {self.key_width}) keys and (n, {self.value_width}) values, "
                             f"got {keys.shape[1]} and {values.shape[1]} bytes")
        if values.shape[0] != n:
            raise ValueError(f"{n} keys but {values.shape[0]} value rows")
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        if n == 0:
            return
        cdef const uint8_t* value_ptr = rows_ptr(values)
        cdef uint64_t[::1] bits = self._growth_bitmap(n)
        cdef uint64_t* bitmap_ptr = &bits[0] if bits.shape[0] else NULL
        cdef uint64_t n_bits = bits.shape[0] * 64
        with nogil:
            rc = self._put_many(&keys[0, 0], value_ptr, n, NULL, NULL, &tags[0], bitmap_ptr, n_bits)
        self._check(rc)

    def exchange_rows(self, const uint8_t[:, ::1] keys not None, const uint8_t[:, ::1] values not None,
                      uint8_t[:, ::1] prior not None, uint8_t[::1] found not None):
        """Put ``values`` at ``keys`` and return what was there: ``prior`` gets the old value and
        ``found`` 1 where the key was present (0 and zeros where it is new). One probe per key
        where a lookup then a put would take two. REQUIRES unique keys (else ``prior`` of a
        later duplicate is the earlier one's new value)."""
        cdef Py_ssize_t n = keys.shape[0]
        cdef int rc
        if keys.shape[1] != self.key_width or values.shape[1] != self.value_width or prior.shape[1] != self.value_width:
            raise ValueError(f"rows must be (n, {self.key_width}) keys and (n, {self.value_width}) values")
        if values.shape[0] != n or prior.shape[0] != n or found.shape[0] != n:
            raise ValueError(f"{n} keys but {values.shape[0]} values, {prior.shape[0]} prior rows, "
                             f"{found.shape[0]} found flags")
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        if n == 0:
            return
        cdef const uint8_t* value_ptr = rows_ptr(values)
        cdef uint8_t* prior_ptr = <uint8_t*>rows_ptr(prior)
        cdef uint64_t[::1] bits = self._growth_bitmap(n)
        cdef uint64_t* bitmap_ptr = &bits[0] if bits.shape[0] else NULL
        cdef uint64_t n_bits = bits.shape[0] * 64
        with nogil:
            rc = self._put_many(&keys[0, 0], value_ptr, n, prior_ptr, &found[0], &tags[0], bitmap_ptr, n_bits)
        self._check(rc)

    def remove_rows(self, const uint8_t[:, ::1] keys not None):
        """Remove ``keys`` (n, key_width); absent keys are ignored. Returns how many were removed."""
        cdef Py_ssize_t n = keys.shape[0], removed = 0
        cdef int rc
        if keys.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {keys.shape[1]} bytes")
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        if n == 0:
            return 0
        with nogil:
            rc = self._remove_many(&keys[0, 0], n, &tags[0], &removed)
        self._check(rc)
        return removed

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def export_rows(self):
        """``(keys, values)``: every live row, as new ``(n, key_width)`` and ``(n, value_width)``
        uint8 arrays, in one pass (arena order)."""
        cdef Py_ssize_t n = self.count, kw = self.key_width, vw = self.value_width, m = 0
        cdef uint64_t i
        keys = np.empty((n, kw), dtype=np.uint8)
        values = np.empty((n, vw), dtype=np.uint8)
        if n == 0:
            return keys, values
        cdef uint8_t[:, ::1] kdst = keys
        cdef uint8_t* vdst = <uint8_t*>rows_ptr(values)
        cdef const uint8_t* src
        with nogil:
            for i in range(self.rows_used):
                if self.row_state[i] == ROW_LIVE:
                    # REQUIRES: m < n: exactly `count` rows are live (table invariant)
                    src = self.rows + i * self.row_width
                    memcpy(&kdst[m, 0], src, kw)
                    if vw:
                        memcpy(vdst + m * vw, src + kw, vw)
                    m += 1
        return keys, values

    def get_row(self, const uint8_t[::1] key not None):
        """Value bytes of key bytes, or None."""
        cdef uint64_t pos
        cdef uint32_t row
        if key.shape[0] != self.key_width:
            raise ValueError(f"a key row is {self.key_width} bytes, got {key.shape[0]}")
        row = self.table_find(&key[0], slot_tag(key_hash(&key[0], self.key_width)), &pos)
        if row == 0:
            return None
        return PyBytes_FromStringAndSize(
            <char*>self.rows + <uint64_t>(row - 1) * self.row_width + self.key_width, self.value_width)

    def put_row(self, const uint8_t[::1] key not None, const uint8_t[::1] value not None):
        """Insert or overwrite one row given as bytes; True if the key was new."""
        if key.shape[0] != self.key_width or value.shape[0] != self.value_width:
            raise ValueError(f"a row is {self.key_width} key bytes and {self.value_width} value bytes, "
                             f"got {key.shape[0]} and {value.shape[0]}")
        cdef int rc = self.table_put(&key[0], &value[0] if self.value_width else NULL,
                                     slot_tag(key_hash(&key[0], self.key_width)))
        self._check(rc)
        return rc == 1

    def remove_row(self, const uint8_t[::1] key not None):
        """Remove one key given as bytes; True if it was there."""
        if key.shape[0] != self.key_width:
            raise ValueError(f"a key row is {self.key_width} bytes, got {key.shape[0]}")
        cdef int rc = self.table_remove(&key[0], slot_tag(key_hash(&key[0], self.key_width)))
        self._check(rc)
        return rc == 1

    # -- the schema-level API -------------------------------------------------------------
    def put(self, key, value):
        """Insert or overwrite; ``value`` is a tuple, scalar, record or bytes of the value schema."""
        if value is None:
            raise ValueError("Cannot put a null value")
        self.put_row(self.key_schema.encode(key), self.value_schema.encode(value))

    def remove(self, key):
        """Remove ``key``; True if it was there."""
        return self.remove_row(self.key_schema.encode(key))

    def __len__(self):
        return self.count

    def put_batch(self, keys, values=None):
        """Insert or overwrite a batch; ``values`` may be None for an empty value schema."""
        key_rows = self.key_schema.rows(keys)
        if values is None:
            if self.value_width:
                raise ValueError("Cannot put a null value")
            value_rows = np.empty((key_rows.shape[0], 0), dtype=np.uint8)
        else:
            value_rows = self.value_schema.rows(values)
        self.put_rows(key_rows, value_rows)

    def remove_batch(self, keys):
        """Remove a batch of keys; returns how many were present."""
        return self.remove_rows(self.key_schema.rows(keys))

    def cursor(self):
        """A :class:`RowCursor` over the rows live now (see the module docstring)."""
        return RowCursor(self)

    def reset(self):
        """Remove every row but keep the memory, for refilling with a batch of about the same
        size (no page faults, no growth)."""
        if self.open_cursors:
            raise RuntimeError("cannot reset a RowTable while a cursor is open")
        if self.n_slots:
            memset(self.slots, 0, self.n_slots * sizeof(Slot))
            memset(self.filter, 0, (self.n_slots >> 4) * sizeof(uint64_t))
        self.count = self.rows_used = self.n_free = self.n_zombies = 0
        self.max_displacement = 0
        self.filter_stale = 0

    def clear(self):
        """Remove every row and give the memory back."""
        if self.open_cursors:
            raise RuntimeError("cannot clear a RowTable while a cursor is open")
        self.mem_release(<void**>&self.slots, &self.slots_bytes)
        self.mem_release(<void**>&self.filter, &self.filter_bytes)
        self.mem_release(<void**>&self.rows, &self.rows_bytes)
        self.mem_release(<void**>&self.row_state, &self.state_bytes)
        self.mem_release(<void**>&self.free_rows, &self.free_bytes)
        self.mem_release(<void**>&self.zombies, &self.zombie_bytes)
        self.filter_stale = 0
        self.n_slots = self.count = self.rows_used = self.rows_capacity = 0
        self.n_free = self.free_capacity = self.n_zombies = self.zombie_capacity = 0
        self.max_displacement = 0

    # -- introspection --------------------------------------------------------------------
    def sizeof(self):
        """Bytes of memory this table has allocated (all of it traced under TRACE_DOMAIN)."""
        return self.allocated_bytes

    def __sizeof__(self):
        return object.__sizeof__(self) + self.allocated_bytes

    @property
    def capacity(self):
        """Keys the index holds before it grows."""
        return self.n_slots * 3 // 4

    @property
    def max_probe_len(self):
        """An upper bound on the slots any lookup inspects (max displacement + 1)."""
        return self.max_displacement + 1 if self.count else 0

    def probe_stats(self):
        """``{"mean": ..., "max": ...}`` displacement over live entries (scans the index)."""
        cdef uint64_t i, d, total = 0, worst = 0, mask = self.n_slots - 1
        for i in range(self.n_slots):
            if self.slots[i].row != 0:
                d = displacement(self.slots[i].tag, i, mask)
                total += d
                if d > worst:
                    worst = d
        return {"mean": total / self.count if self.count else 0.0, "max": worst,
                "slots": self.n_slots, "keys": self.count}


@cython.final
cdef class RowCursor:
    """Visits, in chunks, each row live when it opened exactly once, whatever is put or
    removed meanwhile. Close it (or exhaust it) so removed rows can be reused."""

    def __cinit__(self, RowTable table not None):
        cdef size_t nbytes
        self.table = table
        self.end = table.rows_used
        if table.n_zombies:
            nbytes = table.n_zombies * sizeof(uint32_t)
            self.predead = <uint32_t*>malloc(nbytes)
            if self.predead == NULL:
                raise MemoryError("RowCursor could not allocate memory")
            memcpy(self.predead, table.zombies, nbytes)
            qsort(self.predead, table.n_zombies, sizeof(uint32_t), _cmp_u32)
            self.n_predead = table.n_zombies
        table.open_cursors += 1
        self.is_open = True

    def __dealloc__(self):
        self.close_cursor()

    cdef void close_cursor(self) noexcept:
        if self.is_open:
            self.is_open = False
            free(self.predead)
            self.predead = NULL
            self.table.cursor_closed()

    def close(self):
        self.close_cursor()

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def next_rows(self, Py_ssize_t max_rows):
        """A copy of up to ``max_rows`` next rows as an (m, row_width) uint8 array, or None
        when done (the cursor then closes itself)."""
        if not self.is_open:
            return None
        cdef RowTable t = self.table
        cdef Py_ssize_t rw = t.row_width, m = 0
        out = np.empty((max_rows, rw), dtype=np.uint8)
        cdef uint8_t[:, ::1] dst = out
        cdef uint8_t state
        cdef bint visit
        with nogil:
            while self.pos < self.end and m < max_rows:
                state = t.row_state[self.pos]
                visit = state == ROW_LIVE
                if state == ROW_ZOMBIE:
                    while self.predead_pos < self.n_predead and self.predead[self.predead_pos] < self.pos:
                        self.predead_pos += 1
                    visit = not (self.predead_pos < self.n_predead
                                 and self.predead[self.predead_pos] == self.pos)
                if visit:
                    memcpy(&dst[m, 0], t.rows + self.pos * rw, rw)
                    m += 1
                self.pos += 1
        if m == 0:
            self.close_cursor()
            return None
        return out[:m]
