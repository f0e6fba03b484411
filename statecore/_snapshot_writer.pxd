# cython: language_level=3
"""SnapshotWriter: streams one snapshot to a file object (see _snapshot_writer.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from statecore._keyfilter cimport FilterBits
from statecore._probe cimport Slot

cdef struct KeySearch:
    # What a key being added is compared with (probe_insert's ``match``, same_key).
    const uint32_t* key_hi      # high 32 bits of each written row's key hash
    const uint8_t* call_rows    # the rows of the write_rows call running, else NULL
    uint64_t call_first         # the row index of call_rows[0]; -1 outside a call
    uint64_t row_width
    uint64_t key_width
    uint64_t row                # the row index of the key being added
    uint64_t other              # set by a match: the row that has the key already
    uint64_t collisions         # pairs of keys with equal 64-bit hashes taken as distinct


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
    cdef Slot* slots
    cdef uint32_t* key_hi               # high 32 bits of each written row's key hash
    cdef uint8_t* block_buf
    cdef uint64_t block_fill
    cdef uint64_t* checksums
    cdef uint64_t blocks_done
    cdef KeySearch search
    cdef object _key_filter             # a KeyFilter the rows' keys are added to, or None
    cdef FilterBits* filter_bits        # its bits, or NULL

    cdef int slots_add(self, uint32_t tag, uint64_t row) noexcept nogil
    cdef int index_rows(self, const uint8_t* rows, Py_ssize_t m, uint32_t* tags,
                        Py_ssize_t* bad) noexcept nogil
    cdef uint64_t _full_hash(self, const uint32_t* tags, Py_ssize_t i) noexcept nogil
    cdef object _check_open(self)
    cdef object _feed(self, object flat)
    cdef object _flush_block(self)
    cdef object _emit(self, object chunk)
    cdef object _release(self)
