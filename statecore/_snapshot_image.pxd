# cython: language_level=3
"""A mapped snapshot's bytes, without the GIL (see _snapshot_image.pyx)."""
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from statecore._keyfilter cimport FilterBits
from statecore._probe cimport SlotIndex

# Codes returned by nogil functions; SnapshotReader._raise_for maps them to exceptions.
cdef enum:
    SNAP_OK = 0
    SNAP_BAD_TABLE = -1       # the checksum table does not match the footer
    SNAP_BAD_BLOCK = -2       # a data block does not match its checksum
    SNAP_BAD_SLOT = -3        # a slot names a row past row_count
    SNAP_BAD_INDEX = -4       # verify(): the slot index is not a permutation of the rows

cdef struct SnapError:
    int code
    const char* what          # a static C string saying what was wrong (SNAP_BAD_INDEX)
    uint64_t offset           # byte offset of the damage in the file
    uint64_t expected         # what was expected (checksum, count), for the message
    uint64_t got              # what was found

cdef struct SnapLayout:
    # Everything a nogil call needs. Readers copy it onto the stack per call and point it at
    # the mapping they hold (SnapshotReader._layout_of), so close() cannot unmap under a
    # running call.
    const uint8_t* base
    SlotIndex index           # the slots and rows sections; widths, row_count, max_displacement
    uint8_t* verified         # one flag per data block (1 = checksum matched)
    uint8_t* table_ok         # 1 once the checksum table matched the footer
    uint64_t rows_offset
    uint64_t slots_offset
    uint64_t checksums_offset
    uint64_t n_blocks
    uint64_t table_checksum
    uint32_t block_shift


cdef int snapshot_touch(const SnapLayout* s, uint64_t offset, uint64_t length, SnapError* err) noexcept nogil
cdef int snapshot_find(const SnapLayout* s, const uint8_t* key, uint32_t tag, uint64_t* row_out,
                       SnapError* err) noexcept nogil
cdef int snapshot_get_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* values,
                           uint8_t* found, uint32_t* tags, const FilterBits* key_filter,
                           SnapError* err) noexcept nogil
cdef int snapshot_mark_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* mask,
                            uint32_t* tags, SnapError* err) noexcept nogil
cdef int snapshot_verify(const SnapLayout* s, uint8_t* seen, SnapError* err) noexcept nogil
cdef uint64_t snapshot_verified_blocks(const SnapLayout* s) noexcept nogil
cdef void snapshot_announce_all(const SnapLayout* s) noexcept nogil
