# cython: language_level=3
"""The snapshot format: its constants, header, footer and layout (see _snapshot_format.pyx)."""
cimport cython
from libc.stdint cimport uint32_t, uint64_t


@cython.final
cdef class PackedHeader:
    cdef readonly object block_size       # image bytes per stored block
    cdef readonly object image_size
    cdef readonly object n_blocks
    cdef readonly object checksum         # the container header's (it seeds the table's)


@cython.final
cdef class SnapshotHeader:
    cdef readonly object store_version
    cdef readonly bytes lineage
    cdef readonly object row_count
    cdef readonly object key_width
    cdef readonly object value_width
    cdef readonly object key_fingerprint
    cdef readonly object value_fingerprint
    cdef readonly object key_schema       # RowSchema, from the schema description
    cdef readonly object value_schema
    cdef readonly object file_size
    cdef readonly object n_slots
    cdef readonly object block_size
    cdef readonly object n_blocks
    cdef readonly object rows_offset
    cdef readonly object slots_offset
    cdef readonly object checksums_offset
    cdef readonly object checksum         # the header checksum (the footer keeps a copy)
    cdef readonly object format_version   # 1: the file is the image; 2: a packed container of it
    cdef readonly PackedHeader packed     # the container header of a version 2 file, else None


cdef struct SnapFooter:
    uint64_t table_checksum      # XXH64 of the checksums section
    uint64_t checksum            # the footer's own checksum: the file's last 8 bytes
    uint32_t max_displacement


cdef dict layout(row_count, key_width, value_width, block_size, n_slots=*)
cdef bytes header_page(key_schema, value_schema, store_version, row_count, bytes lineage, block_size,
                       dict plan, uint64_t* checksum_out)
cdef bytes footer_bytes(uint64_t table_checksum, uint64_t file_size, uint64_t header_checksum,
                        uint32_t max_displacement)
cdef SnapFooter check_footer(bytes footer, size, SnapshotHeader h, path) except *
