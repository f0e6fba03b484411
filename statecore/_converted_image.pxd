# cython: language_level=3
"""ConvertedImage: a mapped snapshot of an older value schema read in a newer one (see _converted_image.pyx)."""
cimport cython
from libc.stdint cimport uint8_t, uint64_t

from statecore._row_convert cimport RowConverter
from statecore._rowtable cimport RowSource
from statecore._snapshot_reader cimport SnapshotReader


@cython.final
cdef class ConvertedImage(RowSource):
    cdef readonly SnapshotReader image    # the snapshot, in the schemas it was written with
    cdef readonly RowConverter values     # its values to the schema read in

    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1


@cython.final
cdef class ConvertedCursor:
    cdef object cursor                    # the image's SnapshotCursor
    cdef ConvertedImage source
