# cython: language_level=3
"""The compiled walk of a version's images (see _image_walk.pyx)."""
from libc.stdint cimport uint8_t

from statecore._snapshot_reader cimport SnapshotReader


cdef int images_lookup(list images, SnapshotReader bottom_reader, const uint8_t[:, ::1] keys,
                       uint8_t[:, ::1] values, uint8_t[::1] found) except -1
