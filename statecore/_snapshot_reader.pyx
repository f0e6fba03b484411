# cython: language_level=3
"""SnapshotReader and SnapshotCursor: a snapshot memory-mapped read-only, probed and iterated
in place, its bytes checked lazily. The format is ``_snapshot_format``'s; the nogil work on
the mapped bytes is ``_snapshot_image``'s, the mapping ``_mapping``'s; docs/formats.md
("Reading a snapshot") describes the lazy verification, the I/O and what a file truncated
while mapped does.

Opening reads and checks the header and the footer only, whatever the number of rows. A data
block is checked against its checksum the first time a call touches it (the checksum table
first), and a byte is never used before its block matched: damage raises
:class:`~statecore.errors.StateCorruptionError` naming the path and the byte offset, on
open or on the call that touches it, never a crash and never a wrong value.

Thread-safety: a reader may be shared by threads for every read (lookups, cursors, verify);
batch calls release the GIL. The only state reads change is the verified-block map, one
byte per block set with relaxed atomic stores: two threads may both check the same block,
which is harmless. close() may be called while another thread's call is running: that call
keeps the mapping alive until it returns.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from statecore._delta_format cimport header_field, lineage_bytes
from statecore._hash cimport key_hash, slot_tag
from statecore._keyfilter cimport FilterBits, KeyFilter, filter_may_hold
from statecore._probe cimport Slot
from statecore._rowtable cimport RowSource, rows_ptr
from statecore._snapshot_format cimport SnapFooter, SnapshotHeader, check_footer
from statecore._snapshot_image cimport (
    SNAP_BAD_BLOCK, SNAP_BAD_INDEX, SNAP_BAD_SLOT, SNAP_BAD_TABLE, SNAP_OK, snapshot_find, snapshot_get_many,
    snapshot_mark_many, snapshot_touch, snapshot_verified_blocks, snapshot_verify,
)

import os

import numpy as np

from statecore._snapshot_format import (
    FOOTER_SIZE, HEADER_SIZE, MAGIC, PACKED_FORMAT_VERSION, read_snapshot_header,
)
from statecore.errors import SchemaMismatchError, StateCorruptionError
from statecore.files import open_regular_file
from statecore.schema import as_schema


# -- the reader ---------------------------------------------------------------------------
@cython.final
cdef class SnapshotReader(RowSource):
    """A snapshot file, memory-mapped read-only; lookups and iteration in place.

    Opening reads and checks the header and the footer only (O(1) whatever the size); data
    blocks are checked on first touch (see the module docstring). Everything returned is a
    copy (bytes, tuples, arrays), so nothing outlives the mapping. The API mirrors RowTable
    (their shared reads are RowSource's); the fields of ``header`` (store_version, lineage,
    commit_id, n_blocks, ...) are the reader's attributes too.

    Parameters
    ----------
    path : str or os.PathLike
        A local file (remote files are copied to a local cache first, by the caller).
    shown : str, optional
        The name errors give for the file (attribute ``shown``): the remote snapshot's URL
        when ``path`` is its local copy, so that damage names the file the store holds.
        Defaults to ``path``.
    key_schema, value_schema : numpy structured dtype or RowSchema, optional
        The schemas the caller expects; by default, those recorded in the file.
    expected_lineage : 16 bytes or uuid.UUID, optional
        The lineage the snapshot must belong to.

    Raises
    ------
    StateCorruptionError
        If the file is damaged (or belongs to another lineage); names the path and offset.
    SchemaMismatchError
        If a schema given differs from the file's; the message names which one.
    UnsafeFileError
        If the path is not a regular file (a FIFO, a device, a directory), before it is read.
    OSError
        If the file cannot be opened.
    """

    def __cinit__(self, path, key_schema=None, value_schema=None, expected_lineage=None, shown=None):
        self.path = os.fspath(path)
        self.shown = self.path if shown is None else shown
        self._closed = True
        if expected_lineage is not None:
            expected_lineage = lineage_bytes(expected_lineage, "expected_lineage")
        # The one rule for opening a state file: a FIFO, a device or a directory is refused on
        # the open descriptor, without waiting (UnsafeFileError), before anything is mapped.
        with open_regular_file(self.path) as f:
            fd = f.fileno()
            self._open(fd, os.fstat(fd).st_size, key_schema, value_schema, expected_lineage)
        self._closed = False

    def __dealloc__(self):
        free(self.verified)
        self.verified = NULL

    cdef object _corrupt(self, offset, reason):
        return StateCorruptionError(self.shown, offset, reason)

    cdef object _open(self, int fd, size, key_schema, value_schema, expected_lineage):
        """Check the header (read_snapshot_header) and the footer (check_footer) against the
        file and the caller's expectations, set up the reader's fields, map the file."""
        if size < HEADER_SIZE + FOOTER_SIZE:
            raise self._corrupt(size, f"the file is {size} bytes; a snapshot has at least "
                                      f"{HEADER_SIZE + FOOTER_SIZE}")
        # Header and footer by pread: two small reads, whatever the device's readahead.
        header = os.pread(fd, HEADER_SIZE, 0)
        footer = os.pread(fd, FOOTER_SIZE, size - FOOTER_SIZE)
        if len(header) != HEADER_SIZE or len(footer) != FOOTER_SIZE:
            raise self._corrupt(size, "the file shrank while it was opened")
        if header[:8] == MAGIC and int.from_bytes(header[8:12], "little") == PACKED_FORMAT_VERSION:
            raise self._corrupt(8, "format version 2, a packed snapshot, not an image: it is mapped through "
                                   "its unpacked image (statecore.unpack_snapshot)")
        cdef SnapshotHeader h = read_snapshot_header(header, self.shown)
        cdef SnapFooter f = check_footer(footer, size, h, self.shown)
        if key_schema is not None:
            key_schema = as_schema(key_schema, key=True)
            if key_schema.fingerprint != h.key_fingerprint:
                raise SchemaMismatchError(f"key schema mismatch in snapshot '{self.shown}': the file has "
                                          f"{h.key_schema.describe()}, expected {key_schema.describe()}")
        if value_schema is not None:
            value_schema = as_schema(value_schema)
            if value_schema.fingerprint != h.value_fingerprint:
                raise SchemaMismatchError(f"value schema mismatch in snapshot '{self.shown}': the file has "
                                          f"{h.value_schema.describe()}, "
                                          f"expected {value_schema.describe()}")
        if expected_lineage is not None and expected_lineage != h.lineage:
            raise self._corrupt(116, f"snapshot belongs to another lineage "
                                     f"(expected {expected_lineage.hex()}, found {h.lineage.hex()})")

        self.verified = <uint8_t*>calloc(h.n_blocks, 1)
        if self.verified == NULL:
            raise MemoryError(f"cannot allocate the verified-block map of {h.n_blocks} blocks")
        self.header = h
        self._set_schemas(key_schema if key_schema is not None else as_schema(h.key_schema, key=True),
                          value_schema if value_schema is not None else h.value_schema)
        self.row_count = h.row_count
        self.max_displacement = f.max_displacement
        self.table_ok = 0
        self.layout.base = NULL
        self.layout.verified = self.verified
        self.layout.table_ok = &self.table_ok
        self.layout.rows_offset = h.rows_offset
        self.layout.slots_offset = h.slots_offset
        self.layout.checksums_offset = h.checksums_offset
        self.layout.n_blocks = h.n_blocks
        self.layout.table_checksum = f.table_checksum
        self.layout.block_shift = h.block_size.bit_length() - 1
        self.layout.index.mask = h.n_slots - 1
        self.layout.index.row_width = self.row_width
        self.layout.index.key_width = self.key_width
        self.layout.index.row_count = self.row_count
        self.layout.index.max_displacement = f.max_displacement
        self._mapping = Mapping(fd, size, f.checksum)

    cdef Mapping _acquire(self):
        """The mapping, held by the caller for the length of its call (see close()). The
        caller checks ``mapping.sound()`` after its work, before it returns anything read
        from the mapping or raises about it."""
        if self._closed:
            raise ValueError(f"I/O operation on a closed SnapshotReader ('{self.path}')")
        return self._mapping

    cdef SnapLayout _layout_of(self, Mapping mapping):
        """The layout, for one call, on the mapping that call holds."""
        cdef SnapLayout lay = self.layout
        lay.base = mapping.base
        lay.index.slots = <const Slot*>(mapping.base + lay.slots_offset)
        lay.index.rows = mapping.base + lay.rows_offset
        return lay

    cdef object _raise_truncated(self, Mapping mapping):
        """The error for a mapping that is not sound."""
        cdef uint64_t at = mapping.damage()
        raise StateCorruptionError(self.shown, at - 1 if at else mapping.canary_at,
                                   "the file was truncated while mapped")

    cdef object _raise_for(self, const SnapError* err):
        cdef uint64_t block
        if err.code == SNAP_BAD_TABLE:
            reason = (f"checksum table does not match the footer (expected 0x{err.expected:016x}, "
                      f"got 0x{err.got:016x})")
        elif err.code == SNAP_BAD_BLOCK:
            block = (err.offset - self.layout.rows_offset) >> self.layout.block_shift
            reason = (f"data block {block} checksum mismatch (expected 0x{err.expected:016x}, "
                      f"got 0x{err.got:016x})")
        elif err.code == SNAP_BAD_SLOT:
            reason = f"a slot names row {err.got} of {err.expected}"
        elif err.code == SNAP_BAD_INDEX:
            reason = f"{err.what.decode()} (expected {err.expected}, found {err.got})"
        else:
            raise AssertionError(f"unknown snapshot code {err.code}")
        raise StateCorruptionError(self.shown, err.offset, reason)

    # -- raw rows -------------------------------------------------------------------------
    def get_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[:, ::1] values not None,
                 uint8_t[::1] found not None, bint filtered=True):
        """Look up ``keys`` (n, key_width) into ``values`` (n, value_width; zeros where not
        found) and ``found`` (n,), asking the key filter first if there is one (``filtered``
        False: probe every key). Raises StateCorruptionError if a touched block is damaged
        or the file was truncated; ``values`` and ``found`` then hold nothing to use."""
        cdef Mapping mapping = self._acquire()
        cdef Py_ssize_t n = self._lookup_size(keys, values, found)
        if n == 0:
            return
        cdef KeyFilter key_filter = self._filter if filtered else None  # held for the call
        cdef const FilterBits* filter_bits = NULL if key_filter is None else &key_filter.bits
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        cdef uint8_t* value_ptr = <uint8_t*>rows_ptr(values)
        cdef SnapLayout lay = self._layout_of(mapping)
        cdef SnapError err
        cdef int rc
        with nogil:
            rc = snapshot_get_many(&lay, &keys[0, 0], n, value_ptr, &found[0], &tags[0],
                                   filter_bits, &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def mark_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[::1] mask not None):
        """Set ``mask[i] = 1`` for the file-order row index ``i`` of every key found: which
        rows a set of changed keys overrides, found by probing the changed keys rather than
        by probing every row of the snapshot elsewhere (writing a newer snapshot). After a
        StateCorruptionError, ``mask`` holds nothing to use."""
        cdef Mapping mapping = self._acquire()
        cdef Py_ssize_t n = keys.shape[0]
        if keys.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {keys.shape[1]} bytes")
        if <uint64_t>mask.shape[0] != self.row_count:
            raise ValueError(f"the mask needs {self.row_count} entries (one per row), got {mask.shape[0]}")
        if n == 0 or self.row_count == 0:
            return
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        cdef SnapLayout lay = self._layout_of(mapping)
        cdef SnapError err
        cdef int rc
        with nogil:
            rc = snapshot_mark_many(&lay, &keys[0, 0], n, &mask[0], &tags[0], &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def get_row(self, const uint8_t[::1] key not None):
        """Value bytes of key bytes, or None."""
        if key.shape[0] != self.key_width:
            raise ValueError(f"a key row is {self.key_width} bytes, got {key.shape[0]}")
        value = PyBytes_FromStringAndSize(NULL, self.value_width)
        if self.find_into(&key[0], key_hash(&key[0], <size_t>self.key_width), <uint8_t*>PyBytes_AS_STRING(value)):
            return value
        return None

    cdef int find_into(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """1 and the value copied to ``value_out`` if the ``key_width`` bytes at ``key`` (of
        hash ``h``) are a key here, else 0: the per-row probe of get_row and of the stores'
        compiled per-row path, which asks the key filter first if there is one. Raises as
        get_rows does."""
        cdef Mapping mapping = self._acquire()  # raises when closed, whatever the filter says
        cdef KeyFilter key_filter = self._filter
        if key_filter is not None and not filter_may_hold(&key_filter.bits, h):
            return 0
        cdef uint32_t tag = slot_tag(h)
        cdef SnapLayout lay = self._layout_of(mapping)
        cdef SnapError err
        cdef uint64_t row
        cdef int rc = snapshot_find(&lay, key, tag, &row, &err)
        cdef bint found = rc == SNAP_OK and row != 0
        if found and self.value_width:
            memcpy(value_out, lay.index.rows + (row - 1) * lay.index.row_width + lay.index.key_width,
                   self.value_width)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)
        return found

    # -- the key filter ----------------------------------------------------------------------
    def set_key_filter(self, KeyFilter key_filter not None):
        """Ask ``key_filter`` first from now on: it must hold every key here, as the filter a
        SnapshotWriter filled while writing this image does (a spill's images get theirs so).
        ValueError for another key width, or if the reader has a filter already."""
        if key_filter.key_width != self.key_width:
            raise ValueError(f"a key filter of {key_filter.key_width}-byte keys for a snapshot of "
                             f"{self.key_width}-byte keys")
        if self._filter is not None:
            raise ValueError(f"the snapshot '{self.path}' has a key filter already")
        self._filter = key_filter

    def build_key_filter(self, Py_ssize_t chunk_rows=1 << 16):
        """Build the :class:`~statecore._keyfilter.KeyFilter` of every key here, from the rows
        themselves (each block checked against its checksum as it is read), and ask it first
        from then on: a key it rules out is absent without a probe of the mapped slots. Once:
        a reader that has one keeps it. Raises StateCorruptionError for a damaged block, and
        then has none."""
        if self._filter is not None:
            return
        cdef KeyFilter built = KeyFilter(self.key_width, self.row_count)
        cursor = self.cursor()
        while (chunk := cursor.next_rows(chunk_rows)) is not None:
            built.add_rows(chunk)
        self._filter = built

    @property
    def key_filter(self):
        """The KeyFilter lookups ask first (:meth:`set_key_filter`, :meth:`build_key_filter`),
        or None. Once set, it never changes."""
        return self._filter

    # -- the schema-level API (the rest is RowSource's) ------------------------------------
    def __len__(self):
        return self.row_count

    def cursor(self):
        """A :class:`SnapshotCursor` over every row, in file order."""
        cdef Mapping mapping = self._acquire()
        if not mapping.sound():
            self._raise_truncated(mapping)
        return SnapshotCursor(self)

    def __getattr__(self, name):
        return header_field(self, self.header, name)

    # -- checks ---------------------------------------------------------------------------
    def verify(self, bint index=True):
        """Check every checksum (they cover the rows and the slots) and, unless ``index`` is
        false, the slot index: consistent with the header, and a lookup of each row's key
        finds that row (so no key is in two rows; one random row read per row). Raises
        StateCorruptionError. ``index=False`` is what lookups would check lazily, done at
        once (a snapshot just written, made ready before it is used)."""
        cdef Mapping mapping = self._acquire()
        seen_arr = np.zeros(self.row_count // 8 + 1, dtype=np.uint8)
        cdef uint8_t[::1] seen = seen_arr
        cdef SnapLayout lay = self._layout_of(mapping)
        cdef SnapError err
        cdef int rc
        with nogil:
            rc = snapshot_verify(&lay, &seen[0] if index else NULL, &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def verified_blocks(self):
        """How many data blocks were checked so far. Visible for tests (lazy verification)."""
        return snapshot_verified_blocks(&self.layout)

    # -- lifetime -------------------------------------------------------------------------
    @property
    def closed(self):
        return self._closed

    def close(self):
        """Release the mapping; later calls raise ValueError. Calling it twice is harmless.

        A call running in another thread holds the mapping until it returns: the last
        reference to the mapping unmaps it."""
        if self._closed:
            return
        self._closed = True
        self._mapping = None

    def __enter__(self):
        self._acquire()
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"{self.row_count} rows"
        return f"SnapshotReader('{self.path}', version {self.header.store_version}, {state})"


# REQUIRES: src holds m rows of w bytes, skip m entries, dst room for the unskipped rows:
# checked by SnapshotCursor.next_rows (tests/test_snapshot.py covers skips at the ends).
@cython.boundscheck(False)
@cython.wraparound(False)
cdef void copy_unskipped(const uint8_t* src, const uint8_t* skip, uint64_t m, uint64_t w,
                         uint8_t* dst) noexcept nogil:
    cdef uint64_t i, run_start = 0, out = 0
    # copy maximal runs of kept rows with one memcpy each
    for i in range(m + 1):
        if i == m or skip[i]:
            if i > run_start:
                memcpy(dst + out * w, src + run_start * w, (i - run_start) * w)
                out += i - run_start
            run_start = i + 1


@cython.final
cdef class SnapshotCursor:
    """Walks a snapshot's rows in file order, in chunks; each chunk is a copy."""

    def __cinit__(self, SnapshotReader reader not None):
        self.reader = reader
        self.pos = 0
        self.end = reader.row_count

    def next_rows(self, Py_ssize_t max_rows, skip=None):
        """A copy of the next rows (up to ``max_rows`` of them) as an (m, row_width) uint8
        array, or None when done. With ``skip`` (a uint8 array, one entry per row of the
        file), rows whose entry is nonzero are left out of the copy, so a chunk may hold
        fewer rows, or none. Raises StateCorruptionError if a block they lie in is damaged."""
        if max_rows <= 0:
            raise ValueError(f"max_rows must be > 0, got {max_rows}")
        cdef SnapshotReader r = self.reader
        cdef Mapping mapping = r._acquire()
        cdef const uint8_t[::1] skip_view
        if skip is not None:
            skip_view = skip
            if <uint64_t>skip_view.shape[0] != r.row_count:
                raise ValueError(f"skip needs {r.row_count} entries (one per row), got {skip_view.shape[0]}")
        if self.pos >= self.end:
            return None
        cdef uint64_t m = min(<uint64_t>max_rows, self.end - self.pos)
        cdef SnapLayout lay = r._layout_of(mapping)
        cdef SnapError err
        cdef int rc
        cdef uint64_t rw = lay.index.row_width
        cdef uint64_t start = lay.rows_offset + self.pos * rw
        cdef uint64_t length = m * rw
        cdef uint64_t kept = m
        if skip is not None:
            kept = m - <uint64_t>np.count_nonzero(skip[self.pos:self.pos + m])
        out = np.empty((kept, rw), dtype=np.uint8)
        cdef uint8_t* dst = <uint8_t*>rows_ptr(out)
        with nogil:
            rc = snapshot_touch(&lay, start, length, &err)
            if rc == SNAP_OK:
                if kept == m:
                    if m:
                        memcpy(dst, lay.base + start, length)
                else:
                    copy_unskipped(lay.base + start, &skip_view[self.pos], m, rw, dst)
        if not mapping.sound():
            r._raise_truncated(mapping)
        if rc < 0:
            r._raise_for(&err)
        self.pos += m
        return out
