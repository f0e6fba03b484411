# cython: language_level=3
"""RowTable: an open-addressing hash table over fixed-width binary rows, and RowSource, what
it shares with SnapshotReader (see _rowtable.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from statecore._probe cimport Slot, SlotIndex

cdef enum:
    ROW_FREE = 0
    ROW_LIVE = 1
    ROW_ZOMBIE = 2   # removed while an iterator was open; kept until the last one closes

# Codes returned by nogil functions; _raise_code() maps them to exceptions.
cdef enum:
    TABLE_OK = 0
    TABLE_NO_MEMORY = -1
    TABLE_FULL = -2


cdef inline const uint8_t* rows_ptr(const uint8_t[:, ::1] rows) noexcept:
    """First byte of an (n, width) row array, or NULL when it holds no bytes."""
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return NULL
    return &rows[0, 0]


cdef class RowSource:
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef readonly Py_ssize_t key_width
    cdef readonly Py_ssize_t value_width
    cdef readonly Py_ssize_t row_width

    cdef void _set_schemas(self, key_schema, value_schema) except *
    cdef Py_ssize_t _lookup_size(self, const uint8_t[:, ::1] keys, uint8_t[:, ::1] values,
                                 uint8_t[::1] found) except -1


@cython.final
cdef class RowTable(RowSource):
    cdef Slot* slots
    cdef uint64_t n_slots           # a power of two, or 0 before the first insert
    cdef uint32_t max_displacement  # an upper bound on every entry's distance from home
    cdef uint64_t count

    cdef uint64_t* filter           # the negative filter: n_slots / 16 words (see table_may_hold)
    cdef uint32_t filter_shift      # a tag's word: tag >> filter_shift
    cdef uint64_t filter_stale      # keys removed since the filter was built (their bits stay)

    cdef uint8_t* rows              # the arena: row i at rows + i * row_width (key, then value)
    cdef uint8_t* row_state         # ROW_FREE / ROW_LIVE / ROW_ZOMBIE per arena row
    cdef uint64_t rows_used         # high-water mark of the arena
    cdef uint64_t rows_capacity

    cdef uint32_t* free_rows        # stack of reusable arena rows
    cdef uint64_t n_free
    cdef uint64_t free_capacity

    cdef uint32_t* zombies          # rows removed while iterators were open, in removal order
    cdef uint64_t n_zombies
    cdef uint64_t zombie_capacity

    cdef int open_cursors
    cdef size_t allocated_bytes
    cdef size_t slots_bytes, rows_bytes, state_bytes, free_bytes, zombie_bytes, filter_bytes

    cdef int mem_resize(self, void** buf, size_t* cur_bytes, size_t new_bytes) noexcept nogil
    cdef void mem_release(self, void** buf, size_t* cur_bytes) noexcept nogil
    cdef int slots_reserve(self, uint64_t n_keys) noexcept nogil
    cdef inline void slots_insert(self, uint32_t tag, uint32_t row) noexcept nogil
    cdef void filter_rebuild(self) noexcept nogil
    cdef int rows_reserve(self, uint64_t n_rows) noexcept nogil
    cdef int row_alloc(self, uint32_t* row_out) noexcept nogil
    cdef int _push_row(self, uint32_t** stack, uint64_t* n, uint64_t* capacity, size_t* nbytes,
                       uint32_t row) noexcept nogil
    cdef object _check(self, int code)
    cdef void _hash_keys(self, const uint8_t* keys, Py_ssize_t n, uint32_t* tags) noexcept nogil
    cdef inline SlotIndex index(self) noexcept nogil
    cdef inline void _prefetch(self, const uint32_t* tags, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    cdef void _get_many(self, const uint8_t* keys, Py_ssize_t n, uint8_t* values, uint8_t* found,
                        uint32_t* tags) noexcept nogil
    cdef inline int _put_many(self, const uint8_t* keys, const uint8_t* values, Py_ssize_t n,
                              uint8_t* prior, uint8_t* found, uint32_t* tags, uint64_t* bitmap,
                              uint64_t n_bits) noexcept nogil
    cdef int _reserve_for(self, const uint32_t* tags, Py_ssize_t n, uint64_t* bitmap,
                          uint64_t n_bits) noexcept nogil
    cdef int _remove_many(self, const uint8_t* keys, Py_ssize_t n, uint32_t* tags,
                          Py_ssize_t* removed) noexcept nogil

    cdef uint32_t table_find(self, const uint8_t* key, uint32_t tag, uint64_t* slot_out) noexcept nogil
    cdef int table_put(self, const uint8_t* key, const uint8_t* value, uint32_t tag) noexcept nogil
    cdef int table_insert_new(self, const uint8_t* key, const uint8_t* value, uint32_t tag) noexcept nogil
    cdef int table_remove(self, const uint8_t* key, uint32_t tag) noexcept nogil
    cdef void cursor_closed(self) noexcept nogil


@cython.final
cdef class RowCursor:
    cdef RowTable table
    cdef uint64_t pos
    cdef uint64_t end
    cdef uint32_t* predead      # zombies that existed when the cursor opened: not ours to visit
    cdef uint64_t n_predead
    cdef uint64_t predead_pos
    cdef bint is_open

    cdef void close_cursor(self) noexcept


cdef inline uint64_t filter_bits(uint32_t tag) noexcept nogil:
    """The two bits a key sets in its filter word: chosen by the tag's low 12 bits (its word
    by the high ones)."""
    return ((<uint64_t>1) << (tag & 63)) | ((<uint64_t>1) << ((tag >> 6) & 63))


cdef inline bint table_may_hold(RowTable t, uint32_t tag) noexcept nogil:
    """False if ``t`` surely holds no key with this tag: a probe of its negative filter, a
    word per 16 slots (1/16 of the index's bytes, so it stays in cache when the index does
    not). True is no answer (a probe of the index decides)."""
    cdef uint64_t bits
    if t.count == 0:
        return False
    bits = filter_bits(tag)
    return (t.filter[(<uint64_t>tag) >> t.filter_shift] & bits) == bits
