# cython: language_level=3
"""ConvertedImage: a mapped snapshot written under an older value schema, read in a newer one,
its values converted as they are read (docs/evolution.md, "How a store follows a changed
query").

A change that keeps every key's bytes (values changed, key fields at most renamed) needs no
new copy of the state: the snapshot is probed in place with the same keys and hashes, and each
value it gives is converted by the plan's :class:`~statecore._row_convert.RowConverter`, a row
at a time (``find_into``, the per-row rule) or a batch at a time (``get_rows``, the cursor).
So the first batch after such a change costs what the keys it reads cost, not the whole
state. It serves where a SnapshotReader serves as the bottom of a State's versions
(statecore/_versions.pyx) and offers what that role reads: lookups, marks, a cursor, the key
filter, verification; everything else is the image's.
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memset

import numpy as np

from statecore._rowtable cimport rows_ptr

cdef enum:
    STACK_VALUE_BYTES = 256  # old value rows up to this width are converted through a buffer on the stack


@cython.final
cdef class ConvertedImage(RowSource):
    """``image`` (a SnapshotReader) with keys of ``key_schema`` (the same bytes as the image's)
    and values converted by ``values`` (a RowConverter from the image's value schema) into
    ``value_schema``."""

    def __init__(self, SnapshotReader image not None, RowConverter values not None, key_schema, value_schema):
        if key_schema.width != image.key_width:
            raise ValueError(f"the key schema {key_schema.describe()} is {key_schema.width} bytes wide; the "
                             f"image's keys are {image.key_width}: a re-key is converted whole, not read through")
        if values.old_width != image.value_width or values.new_width != value_schema.width:
            raise ValueError(f"the conversion takes {values.old_width}-byte values to {values.new_width}; the image's "
                             f"are {image.value_width}, the schema read in {value_schema.width}")
        self.image = image
        self.values = values
        self._set_schemas(key_schema, value_schema)

    def __repr__(self):
        return f"ConvertedImage({self.image!r}, values {self.image.value_schema.describe()} -> " \
               f"{self.value_schema.describe()})"

    # -- what the image answers as it is: its keys, the key filter, marks, verify, close ------
    def __len__(self):
        return self.image.row_count

    def __getattr__(self, name):  # row_count, key_filter, mark_rows, verify, close, the header's fields...
        return getattr(self.image, name)

    # -- values, converted ----------------------------------------------------------------
    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """SnapshotReader.find_into, the value converted into ``value_out``."""
        cdef uint8_t stack[STACK_VALUE_BYTES]
        cdef uint8_t* old = stack
        cdef int found
        if value_out == NULL:
            return self.image.find_into(key, h, NULL)
        if self.values.old_width > STACK_VALUE_BYTES:
            old = <uint8_t*>PyMem_Malloc(self.values.old_width)
            if old == NULL:
                raise MemoryError()
        try:
            found = self.image.find_into(key, h, old)
            if found:
                self.values.convert_row(old, value_out)
        finally:
            if old != stack:
                PyMem_Free(old)
        return found

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def get_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[:, ::1] values not None,
                 uint8_t[::1] found not None):
        """SnapshotReader.get_rows, each value found converted (zeros where not found)."""
        cdef Py_ssize_t n = self._lookup_size(keys, values, found), i
        old_values = np.empty((n, self.values.old_width), dtype=np.uint8)
        self.image.get_rows(keys, old_values, found)
        cdef const uint8_t* src = <const uint8_t*>rows_ptr(old_values)
        cdef uint8_t* dst = <uint8_t*>rows_ptr(values)
        cdef Py_ssize_t ow = self.values.old_width, nw = self.value_width
        if n == 0 or nw == 0:
            return
        with nogil:  # every row converted column by column, then the keys not found zeroed
            self.values.convert_many(src, ow, dst, nw, n)
            for i in range(n):
                if not found[i]:
                    memset(dst + i * nw, 0, <size_t>nw)

    def get_row(self, key):
        old = self.image.get_row(key)
        if old is None:
            return None
        return self.values.convert_rows(np.frombuffer(old, dtype=np.uint8).reshape(1, -1)).tobytes()

    def cursor(self):
        return ConvertedCursor(self)


@cython.final
cdef class ConvertedCursor:
    """The image's cursor, each chunk's values converted: SnapshotCursor's ``next_rows``."""

    def __cinit__(self, ConvertedImage source not None):
        self.source = source
        self.cursor = source.image.cursor()

    def next_rows(self, Py_ssize_t max_rows, skip=None):
        chunk = self.cursor.next_rows(max_rows, skip)
        if chunk is None:
            return None
        cdef ConvertedImage s = self.source
        cdef Py_ssize_t m = chunk.shape[0], kw = s.key_width, ow = s.values.old_width, nw = s.value_width
        out = np.empty((m, kw + nw), dtype=np.uint8)
        out[:, :kw] = chunk[:, :kw]
        cdef const uint8_t* src = <const uint8_t*>rows_ptr(chunk)
        cdef uint8_t* dst = <uint8_t*>rows_ptr(out)
        if m and nw:
            with nogil:
                s.values.convert_many(src + kw, kw + ow, dst + kw, kw + nw, m)
        return out
