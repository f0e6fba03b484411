# cython: language_level=3
"""ConvertedImage: a mapped snapshot written under older schemas, read in newer ones, its rows
converted as they are read (docs/evolution.md, "How a store follows a changed query").

A change needs no new copy of the state when the snapshot can be probed in place: the values
changed and the keys' bytes kept (key fields at most renamed), or the keys widened too (ints,
bytes), every old key then becoming exactly one new key. A probe of a value change uses the
same keys and hashes; a probe of a re-key narrows each new key back to the old key it would
come from (none, where it is out of the old field's range) and probes with that key's own
hash. Each value found is converted by the plan's :class:`~statecore._row_convert.RowConverter`,
a row at a time (``find_into``, the per-row rule) or a batch at a time (``get_rows``, the
cursor, which converts keys too). So the first batch after such a change costs what the keys
it reads cost, not the whole state. It serves where a SnapshotReader serves as the bottom of a
State's versions (statecore/_versions.pyx) and offers what that role reads: lookups, marks, a
cursor, the key filter (none for a re-key: the image's is of the old keys), verification;
everything else is the image's.
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memset

import numpy as np

from statecore._hash cimport key_hash
from statecore._row_convert import narrow_rows
from statecore._rowtable cimport rows_ptr

cdef enum:
    STACK_VALUE_BYTES = 256  # old value rows up to this width are converted through a buffer on the stack


@cython.final
cdef class ConvertedImage(RowSource):
    """``image`` (a SnapshotReader) read in ``key_schema`` and ``value_schema``: its values
    converted by ``values`` (a RowConverter from the image's value schema), its keys by
    ``keys`` (an invertible RowConverter from the image's key schema: a re-key), or as they
    are (None: the same bytes)."""

    def __init__(self, SnapshotReader image not None, RowConverter values not None, key_schema, value_schema,
                 RowConverter keys=None):
        if keys is None and key_schema.width != image.key_width:
            raise ValueError(f"the key schema {key_schema.describe()} is {key_schema.width} bytes wide; the "
                             f"image's keys are {image.key_width}, and no key conversion is given")
        if keys is not None and (not keys.invertible or keys.old_width != image.key_width
                                 or keys.new_width != key_schema.width):
            raise ValueError(f"the key conversion takes {keys.old_width}-byte keys to {keys.new_width}"
                             f"{'' if keys.invertible else ' and cannot be undone'}; the image's are "
                             f"{image.key_width}, the schema read in {key_schema.width}")
        if values.old_width != image.value_width or values.new_width != value_schema.width:
            raise ValueError(f"the conversion takes {values.old_width}-byte values to {values.new_width}; the image's "
                             f"are {image.value_width}, the schema read in {value_schema.width}")
        self.image = image
        self.values = values
        self.keys = keys
        self._set_schemas(key_schema, value_schema)

    def __repr__(self):
        keys = f"keys {self.image.key_schema.describe()} -> {self.key_schema.describe()}, " if self.keys else ""
        return f"ConvertedImage({self.image!r}, {keys}values {self.image.value_schema.describe()} -> " \
               f"{self.value_schema.describe()})"

    # -- what the image answers as it is: its keys, the key filter, marks, verify, close ------
    def __len__(self):
        return self.image.row_count

    def __getattr__(self, name):  # row_count, verify, close, the header's fields...
        return getattr(self.image, name)

    @property
    def key_filter(self):
        """The image's key filter where keys keep their bytes; None for a re-key (it is of the
        old keys)."""
        return self.image.key_filter if self.keys is None else None

    def build_key_filter(self):
        if self.keys is None:
            self.image.build_key_filter()

    def mark_rows(self, const uint8_t[:, ::1] keys not None, mask):
        """SnapshotReader.mark_rows with keys of the schema read in (a re-key's narrowed to the
        old keys they would come from; those out of range mark nothing)."""
        if self.keys is None:
            return self.image.mark_rows(keys, mask)
        old_keys, ok = narrow_rows(self.keys, keys)
        return self.image.mark_rows(old_keys if ok.all() else np.ascontiguousarray(old_keys[ok]), mask)

    # -- values, converted ----------------------------------------------------------------
    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """SnapshotReader.find_into, the value converted into ``value_out``; a re-key's key
        narrowed first and probed with its own hash (``h`` is the new key's)."""
        cdef uint8_t stack[STACK_VALUE_BYTES]
        cdef uint8_t* old_key = stack
        cdef uint8_t ok = 1
        if self.keys is None:
            return self._find_old(key, h, value_out)
        if self.keys.old_width > STACK_VALUE_BYTES:
            old_key = <uint8_t*>PyMem_Malloc(self.keys.old_width)
            if old_key == NULL:
                raise MemoryError()
        try:
            self.keys.narrow_many(key, self.keys.new_width, old_key, self.keys.old_width, &ok, 1)
            return self._find_old(old_key, key_hash(old_key, <size_t>self.keys.old_width), value_out) if ok else 0
        finally:
            if old_key != stack:
                PyMem_Free(old_key)

    cdef int _find_old(self, const uint8_t* old_key, uint64_t h, uint8_t* value_out) except -1:
        """The image's find_into of a key of its own (hash ``h``), the value converted into
        ``value_out``."""
        cdef uint8_t stack[STACK_VALUE_BYTES]
        cdef uint8_t* old = stack
        cdef int found
        if value_out == NULL:
            return self.image.find_into(old_key, h, NULL)
        if self.values.old_width > STACK_VALUE_BYTES:
            old = <uint8_t*>PyMem_Malloc(self.values.old_width)
            if old == NULL:
                raise MemoryError()
        try:
            found = self.image.find_into(old_key, h, old)
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
        """SnapshotReader.get_rows, each value found converted (zeros where not found); a
        re-key's keys narrowed first (one out of the old field's range is not found)."""
        cdef Py_ssize_t n = self._lookup_size(keys, values, found), i
        old_values = np.empty((n, self.values.old_width), dtype=np.uint8)
        if self.keys is None:
            self.image.get_rows(keys, old_values, found)
        else:
            old_keys, ok = narrow_rows(self.keys, keys)
            self.image.get_rows(old_keys, old_values, found)
            np.bitwise_and(np.asarray(found), ok.view(np.uint8), out=np.asarray(found))
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
        if self.keys is not None:
            old_keys, ok = narrow_rows(self.keys, np.frombuffer(key, dtype=np.uint8).reshape(1, -1))
            if not ok[0]:
                return None
            key = old_keys.tobytes()
        old = self.image.get_row(key)
        if old is None:
            return None
        return self.values.convert_rows(np.frombuffer(old, dtype=np.uint8).reshape(1, -1)).tobytes()

    def cursor(self):
        return ConvertedCursor(self)


@cython.final
cdef class ConvertedCursor:
    """The image's cursor, each chunk's values (and a re-key's keys) converted:
    SnapshotCursor's ``next_rows``."""

    def __cinit__(self, ConvertedImage source not None):
        self.source = source
        self.cursor = source.image.cursor()

    def next_rows(self, Py_ssize_t max_rows, skip=None):
        chunk = self.cursor.next_rows(max_rows, skip)
        if chunk is None:
            return None
        cdef ConvertedImage s = self.source
        cdef Py_ssize_t m = chunk.shape[0], kw = s.key_width, ow = s.values.old_width, nw = s.value_width
        cdef Py_ssize_t okw = s.image.key_width
        out = np.empty((m, kw + nw), dtype=np.uint8)
        if s.keys is None:
            out[:, :kw] = chunk[:, :kw]
        cdef const uint8_t* src = <const uint8_t*>rows_ptr(chunk)
        cdef uint8_t* dst = <uint8_t*>rows_ptr(out)
        if m:
            with nogil:
                if s.keys is not None:
                    s.keys.convert_many(src, okw + ow, dst, kw + nw, m)
                if nw:
                    s.values.convert_many(src + okw, okw + ow, dst + kw, kw + nw, m)
        return out
