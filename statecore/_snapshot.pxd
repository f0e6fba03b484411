# cython: language_level=3
"""Snapshot files: the writer and the mmap reader of one store version (see _snapshot.pyx,
whose module docstring is the format's description)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef struct SnapSlot:
    # On-disk slot, 8 bytes little-endian; declared here, not taken from RowTable's Slot,
    # because the file format must not change when the in-memory table does.
    uint32_t tag    # slot_tag(key_hash(key)); its low bits pick the home slot
    uint32_t row    # row index + 1; 0 marks an empty slot

# Codes returned by nogil functions; SnapshotReader._raise_for / the writer map them.
cdef enum:
    SNAP_OK = 0
    SNAP_BAD_TABLE = -1       # the checksum table does not match the footer
    SNAP_BAD_BLOCK = -2       # a data block does not match its checksum
    SNAP_BAD_SLOT = -3        # a slot names a row past row_count
    SNAP_BAD_INDEX = -4       # verify(): the slot index is not a permutation of the rows
    SNAP_DUPLICATE = -5       # writer: a key came twice

cdef struct SnapError:
    int code
    const char* what          # a static C string saying what was wrong (SNAP_BAD_INDEX)
    uint64_t offset           # byte offset of the damage in the file
    uint64_t expected         # what was expected (checksum, count), for the message
    uint64_t got              # what was found

cdef struct SnapLayout:
    # Everything a nogil lookup needs. Readers copy it onto the stack per call and set
    # `base` from a memoryview they hold, so close() cannot unmap under a running call.
    const uint8_t* base
    uint8_t* verified         # one flag per data block (1 = checksum matched)
    uint8_t* table_ok         # 1 once the checksum table matched the footer
    uint64_t row_count
    uint64_t n_slots
    uint64_t rows_offset
    uint64_t slots_offset
    uint64_t checksums_offset
    uint64_t n_blocks
    uint64_t table_checksum
    uint64_t key_width
    uint64_t value_width
    uint64_t row_width
    uint32_t max_displacement
    uint32_t block_shift


@cython.final
cdef class SnapshotWriter:
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef readonly uint64_t row_count
    cdef readonly uint64_t store_version
    cdef readonly uint64_t rows_written
    cdef readonly uint64_t n_slots
    cdef readonly uint64_t n_blocks
    cdef readonly uint64_t file_size
    cdef readonly uint32_t block_size
    cdef readonly uint32_t max_displacement
    cdef readonly uint64_t hash_collisions  # pairs of keys with equal 64-bit hashes taken as distinct
    cdef readonly Py_ssize_t key_width
    cdef readonly Py_ssize_t value_width
    cdef readonly Py_ssize_t row_width

    cdef object fileobj
    cdef uint64_t rows_offset, slots_offset, checksums_offset
    cdef uint64_t header_checksum
    cdef uint64_t bytes_out             # bytes handed to fileobj.write so far
    cdef int state                      # WRITER_OPEN / WRITER_DONE / WRITER_FAILED

    cdef object _slots_arr              # owners of the buffers below (numpy arrays)
    cdef object _key_hi_arr
    cdef object _block_arr
    cdef object _checksums_arr
    cdef SnapSlot* slots
    cdef uint32_t* key_hi               # high 32 bits of each written row's key hash
    cdef uint8_t* block_buf
    cdef uint64_t block_fill
    cdef uint64_t* checksums
    cdef uint64_t blocks_done
    cdef const uint8_t* call_rows       # the rows of the write_rows call running, else NULL
    cdef uint64_t call_first            # the row index of call_rows[0]; -1 outside a call

    cdef bint same_key(self, uint64_t r, uint64_t new) noexcept nogil
    cdef int slots_add(self, uint32_t tag, uint32_t hi, uint32_t row, uint32_t* other) noexcept nogil
    cdef int index_rows(self, const uint8_t* rows, Py_ssize_t m, uint32_t* tags,
                        Py_ssize_t* bad, uint32_t* other) noexcept nogil
    cdef object _check_open(self)
    cdef object _feed(self, object flat)
    cdef object _flush_block(self)
    cdef object _emit(self, object chunk)
    cdef object _release(self)


@cython.final
cdef class _Mapping:
    cdef const uint8_t* base
    cdef size_t length
    cdef int guard                      # entry in the SIGBUS guard's table, or -1
    cdef uint64_t damaged_at            # set by the SIGBUS handler: file offset + 1
    cdef uint64_t canary_at             # offset of the file's last 8 bytes
    cdef uint64_t canary                # their value when the file was opened

    cdef uint64_t damage(self) noexcept nogil
    cdef bint sound(self) noexcept nogil


@cython.final
cdef class SnapshotReader:
    cdef readonly object path
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef readonly bytes lineage
    cdef readonly uint64_t store_version
    cdef readonly uint64_t row_count
    cdef readonly uint64_t file_size
    cdef readonly uint64_t n_slots
    cdef readonly uint64_t n_blocks
    cdef readonly uint32_t block_size
    cdef readonly uint32_t max_displacement
    cdef readonly Py_ssize_t key_width
    cdef readonly Py_ssize_t value_width
    cdef readonly Py_ssize_t row_width

    cdef readonly object header         # the SnapshotHeader read_snapshot_header checked
    cdef _Mapping _mapping              # None once closed; each call holds its own reference
    cdef uint64_t _footer_checksum      # the file's last 8 bytes, as read on open
    cdef bint _closed
    cdef SnapLayout layout              # base is NULL here: see SnapLayout
    cdef uint8_t* verified
    cdef uint8_t table_ok

    cdef object _corrupt(self, offset, reason)
    cdef object _check(self, bytes header, bytes footer, size, key_schema, value_schema,
                       expected_lineage)
    cdef _Mapping _acquire(self)
    cdef object _raise_truncated(self, _Mapping mapping)
    cdef object _raise_for(self, const SnapError* err)


@cython.final
cdef class SnapshotCursor:
    cdef SnapshotReader reader
    cdef uint64_t pos
    cdef uint64_t end
