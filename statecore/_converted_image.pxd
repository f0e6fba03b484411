# cython: language_level=3
"""ConvertedImage: a mapped snapshot of older schemas read in newer ones (see _converted_image.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint64_t

from statecore._row_convert cimport RowConverter
from statecore._rowtable cimport RowSource
from statecore._snapshot_reader cimport SnapshotReader


@cython.final
cdef class ConvertedImage(RowSource):
    cdef readonly SnapshotReader image    # the snapshot, in the schemas it was written with
    cdef readonly RowConverter values     # its values to the schema read in
    cdef readonly RowConverter keys       # its keys to the key schema read in (a re-key), or None

    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1
    cdef int _find_old(self, const uint8_t* old_key, uint64_t h, uint8_t* value_out) except -1


@cython.final
cdef class ConvertedCursor:
    cdef object cursor                    # the image's SnapshotCursor
    cdef ConvertedImage source
