# cython: language_level=3
"""Packed snapshots: PackWriter and the unpacker (see _snapshot_pack.pyx)."""
cimport cython
from libc.stdint cimport uint64_t


@cython.final
cdef class PackWriter:
    cdef object fileobj
    cdef object image             # a file object given the image as it is, or None
    cdef object image_head        # the header page, for ``image`` with the first block
    cdef object header            # the image's checked SnapshotHeader, once its page came
    cdef object packed            # its PackedHeader
    cdef bytearray pending        # image bytes not yet packed (less than a block, or the page)
    cdef list table               # the block table's entries so far
    cdef bytes tail               # the image's last 8 bytes packed so far
    cdef readonly uint64_t block_size
    cdef readonly uint64_t image_bytes    # image bytes taken
    cdef readonly uint64_t bytes_out      # packed bytes written
    cdef uint64_t image_size
    cdef bint done
    cdef bint abandoned           # after an error: takes no more bytes
    cdef object packer            # the packing thread (a one-worker executor), from the first block on
    cdef object in_flight         # (block, future of its packing) not yet written, oldest first

    cdef _emit(self, data)
    cdef _pack_block(self, block)
    cdef _write_packed(self)
    cdef _take(self, view)
    cdef _close_image(self)
