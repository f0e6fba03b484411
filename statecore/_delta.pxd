# cython: language_level=3
"""Delta files: DeltaWriter and DeltaReader (see _delta.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint64_t

from statecore cimport _delta_format


@cython.final
cdef class DeltaWriter:
    cdef object _write
    cdef readonly object key_schema
    cdef readonly object value_schema
    cdef readonly object store_version
    cdef readonly bytes lineage
    cdef readonly str compression
    cdef readonly Py_ssize_t key_width
    cdef readonly Py_ssize_t value_width
    cdef readonly Py_ssize_t block_bytes
    cdef bint _lz4
    cdef uint8_t* _buf               # the pending block: keys at 0, values at _put_cap * key_width
    cdef Py_ssize_t _put_cap         # records in a full puts block
    cdef Py_ssize_t _remove_cap      # records in a full removes block
    cdef int _pending_kind
    cdef Py_ssize_t _pending_n
    cdef uint64_t _n_puts, _n_removes, _n_blocks, _bytes_written, _header_checksum
    cdef bytearray _block_checksums  # each block's payload checksum as u64, for the trailer
    cdef bint _finished
    cdef bint _broken                # a write failed: the file holds part of a block

    cdef void _write_all(self, data) except *
    cdef void _check_open(self) except *
    cdef void _append(self, int kind, const uint8_t* keys, const uint8_t* values,
                      Py_ssize_t n) except *
    cdef void _flush(self) except *
    cdef void _emit(self, int kind, Py_ssize_t n, const uint8_t* raw) except *


@cython.final
cdef class DeltaReader:
    cdef object _view              # memoryview of a bytes-like source, else None
    cdef object _read              # read method of a file source, else None
    cdef Py_ssize_t _pos           # offset of the next unread byte
    cdef readonly str path
    cdef readonly _delta_format.DeltaHeader header   # its fields are the reader's attributes too
    cdef bint _lz4
    cdef bytearray _block_checksums
    cdef uint64_t _seen_blocks, _seen_puts, _seen_removes
    cdef bint _done
    cdef object _error             # the error that stopped iteration: raised again if asked
    cdef bytes _trailer_magic      # the trailer of the header's format version (TRAILERS)
    cdef object _trailer_struct
    cdef Py_ssize_t _trailer_size
    cdef bint _trailer_counts_keys
    cdef object _num_keys          # the trailer's key count, once read (None: not recorded)

    cdef object _corrupt(self, offset, reason)
    cdef object _take(self, Py_ssize_t n, str what)
    cdef bint _at_end(self) except -1
    cdef void _read_header(self, key_schema, value_schema, expected_lineage) except *
    cdef void _check_schema(self, str which, schema, Py_ssize_t width, fingerprint) except *
    cdef object _read_block(self, Py_ssize_t at, head, bint decode=*)
    cdef void _read_trailer(self, Py_ssize_t at, head) except *
