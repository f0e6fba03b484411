# cython: language_level=3
"""SnapshotWriter and write_snapshot: one snapshot streamed to a binary file object, which
needs only ``write()``. The format is ``_snapshot_format``'s (docs/formats.md); the slot
index is built by the rule of ``_probe.pxd`` while rows stream.

Thread-safety: a SnapshotWriter is used by one thread; write_rows releases the GIL while
it hashes and indexes a chunk.
"""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from statecore._delta_format cimport lineage_bytes
from statecore._hash cimport checksum, key_hash, slot_tag, xxh64
from statecore._keyfilter cimport KeyFilter, filter_add, filter_prefetch
from statecore._probe cimport (
    SC_PREFETCH, SLOT_PREFETCH_AHEAD, home_slot, probe_insert, rows_equal,
)
from statecore._snapshot_format cimport footer_bytes, header_page, layout

import mmap
import operator
import os
import tempfile

import numpy as np

from statecore._snapshot_format import (
    DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, MAX_ROWS, MIN_BLOCK_SIZE, is_block_size,
)
from statecore.schema import key_value_schemas

cdef enum:
    WRITE_CHUNK_ROWS = 65536

cdef enum:
    WRITER_OPEN = 0
    WRITER_DONE = 1
    WRITER_FAILED = 2


cdef int same_key(void* ctx, uint64_t pos, uint32_t row) noexcept nogil:
    """probe_insert's match while a key is added (``ctx`` is its KeySearch): 1 if row ``row``
    (index + 1) has that key, else 0.

    Only a row with the same 64-bit hash can (the tag matched; ``key_hi`` holds the rest).
    Its bytes decide when it is in the current write_rows call. Rows of earlier calls are
    not kept: on 4- and 8-byte keys XXH64 is one-to-one (every step of it on one 4- or
    8-byte input is invertible), so equal hashes are equal keys; on other widths the keys
    are taken as distinct, as the tables snapshots are written from guarantee, and
    SnapshotReader.verify() finds a key written twice.
    """
    cdef KeySearch* s = <KeySearch*>ctx
    cdef uint64_t r = row - 1
    cdef bint same
    if s.key_hi[r] != s.key_hi[s.row]:
        return 0
    if r >= s.call_first:
        same = rows_equal(s.call_rows + (r - s.call_first) * s.row_width,
                          s.call_rows + (s.row - s.call_first) * s.row_width, s.key_width)
    else:
        same = s.key_width == 4 or s.key_width == 8
    if same:
        s.other = r
        return 1
    s.collisions += 1
    return 0


@cython.final
cdef class SnapshotWriter:
    """Streams one snapshot to a binary file object, which needs only ``write()``.

    The header goes out at once (everything in it follows from ``row_count``), rows as they
    come, a block at a time; the slot index is built in memory while rows stream (each key
    is hashed as it arrives; no second pass, no copy of the rows) and written by
    :meth:`finish`, with the checksums and the footer. Memory: 8 bytes per slot, 4 bytes per
    row and one block. The file object is neither flushed nor closed: the caller owns it
    (write to a temporary name, then rename). After an error the writer refuses further
    calls and the bytes written so far must be discarded.

    Parameters
    ----------
    fileobj : binary file object
        Anything with ``write(bytes_like)``; a return value below the length given is taken
        as a partial write and the rest is written again.
    key_schema, value_schema : numpy structured dtype or RowSchema
        The value schema may have no fields (a set).
    row_count : int
        Exactly how many rows will be written (at most 2**32 - 2).
    store_version : int
        The store version this snapshot holds (>= 0).
    lineage : 16 bytes or uuid.UUID
        Ties the snapshot to one store lineage; readers may require it.
    block_size : int
        Bytes per checksummed block, a power of two in [64, 2**30].
    key_filter : KeyFilter or None
        Each row's key is added to it, from the hash the slot index is built with (a spill's
        level keeps it, statecore/spill.py).

    Raises
    ------
    ValueError
        On a row count, version, lineage or block size out of range.
    TypeError
        If the key schema has no field.
    """

    def __cinit__(self, fileobj, key_schema, value_schema, row_count, store_version,
                  lineage=bytes(16), block_size=DEFAULT_BLOCK_SIZE, KeyFilter key_filter=None):
        if not callable(getattr(fileobj, "write", None)):
            raise TypeError(f"fileobj must have a write() method, got {type(fileobj).__name__}")
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.key_width = self.key_schema.width
        self.value_width = self.value_schema.width
        self.row_width = self.key_width + self.value_width
        row_count = operator.index(row_count)
        if not 0 <= row_count <= MAX_ROWS:
            raise ValueError(f"row_count must be in [0, {MAX_ROWS}], got {row_count}")
        store_version = operator.index(store_version)
        if not 0 <= store_version < (1 << 64):
            raise ValueError(f"store_version must be in [0, 2**64), got {store_version}")
        lineage = lineage_bytes(lineage, "lineage")
        block_size = operator.index(block_size)
        if not is_block_size(block_size):
            raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                             f"got {block_size}")
        plan = layout(row_count, self.key_width, self.value_width, block_size)
        header = header_page(self.key_schema, self.value_schema, store_version, row_count, lineage,
                             block_size, plan, &self.header_checksum)
        self.fileobj = fileobj
        self._key_filter = key_filter
        self.filter_bits = NULL
        if key_filter is not None:
            if key_filter.key_width != self.key_width:
                raise ValueError(f"the key filter is for {key_filter.key_width}-byte keys, not {self.key_width}")
            if row_count and not key_filter.bits.n_blocks:
                raise ValueError("the key filter is sized for no keys")
            self.filter_bits = &key_filter.bits
        self.row_count = row_count
        self.store_version = store_version
        self.block_size = block_size
        self.n_slots = plan["n_slots"]
        self.n_blocks = plan["n_blocks"]
        self.rows_offset = plan["rows_offset"]
        self.slots_offset = plan["slots_offset"]
        self.checksums_offset = plan["checksums_offset"]
        self.file_size = plan["file_size"]

        # numpy owns the buffers (np.zeros of a large size is lazily zeroed by the kernel);
        # the two that grow with the rows are file-backed past a size (see _scratch_array).
        self._slots_arr = _scratch_array((self.n_slots, 2), np.dtype("<u4"))
        self._key_hi_arr = _scratch_array((max(row_count, 1),), np.dtype(np.uint32))
        self._block_arr = np.empty(block_size, dtype=np.uint8)
        self._checksums_arr = np.empty(self.n_blocks, dtype="<u8")
        cdef uint32_t[:, ::1] slots_view = self._slots_arr
        cdef uint32_t[::1] key_hi_view = self._key_hi_arr
        cdef uint8_t[::1] block_view = self._block_arr
        cdef uint64_t[::1] checksums_view = self._checksums_arr
        self.slots = <Slot*>&slots_view[0, 0]
        self.key_hi = &key_hi_view[0]
        self.block_buf = &block_view[0]
        self.checksums = &checksums_view[0]
        self.search.key_hi = self.key_hi
        self.search.call_rows = NULL
        self.search.call_first = <uint64_t>-1
        self.search.row_width = self.row_width
        self.search.key_width = self.key_width
        self.search.collisions = 0
        self.state = WRITER_OPEN
        try:
            self._emit(header)
        except BaseException:
            self.state = WRITER_FAILED
            raise

    cdef object _check_open(self):
        if self.state == WRITER_DONE:
            raise ValueError("this SnapshotWriter has finished")
        if self.state == WRITER_FAILED:
            raise ValueError("this SnapshotWriter failed earlier; discard what it wrote")

    # -- the slot index (the rule is _probe.pxd's) -------------------------------------
    cdef int slots_add(self, uint32_t tag, uint64_t row) noexcept nogil:
        """Robin Hood insert of row index ``row`` (a row of the current write_rows call): 0, or
        1 if its key is in the index already (``search.other`` is then that row)."""
        cdef uint64_t farthest
        cdef Slot carried
        carried.tag = tag
        carried.row = <uint32_t>(row + 1)
        self.search.row = row
        if probe_insert(self.slots, self.n_slots - 1, carried, same_key, &self.search, &farthest):
            return 1
        if farthest > self.max_displacement:
            self.max_displacement = <uint32_t>farthest
        return 0

    # REQUIRES: rows_written + m <= row_count and rows is (m, row_width), both checked by
    # write_rows; tests/test_snapshot.py covers 0 rows, 1 row, the exact 3/4 load and
    # chunks of every size.
    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int index_rows(self, const uint8_t* rows, Py_ssize_t m, uint32_t* tags,
                        Py_ssize_t* bad) noexcept nogil:
        cdef Py_ssize_t i
        cdef uint64_t h
        cdef size_t kw = self.key_width, rw = self.row_width
        cdef uint64_t mask = self.n_slots - 1
        for i in range(m):
            h = key_hash(rows + <size_t>i * rw, kw)
            tags[i] = slot_tag(h)
            self.key_hi[self.rows_written + <uint64_t>i] = <uint32_t>(h >> 32)
        for i in range(m):
            if i + SLOT_PREFETCH_AHEAD < m:
                SC_PREFETCH(&self.slots[home_slot(tags[i + SLOT_PREFETCH_AHEAD], mask)])
                if self.filter_bits != NULL:
                    filter_prefetch(self.filter_bits, self._full_hash(tags, i + SLOT_PREFETCH_AHEAD))
            if self.slots_add(tags[i], self.rows_written + <uint64_t>i):
                bad[0] = i
                return 1
            if self.filter_bits != NULL:
                filter_add(self.filter_bits, self._full_hash(tags, i))
        return 0

    cdef inline uint64_t _full_hash(self, const uint32_t* tags, Py_ssize_t i) noexcept nogil:
        """The key hash of row i of the call being indexed (its tag and its key_hi)."""
        return (<uint64_t>self.key_hi[self.rows_written + <uint64_t>i] << 32) | tags[i]

    # -- output ---------------------------------------------------------------------------
    cdef object _emit(self, object chunk):
        """Hand ``chunk`` to fileobj.write, again for what a partial write left over."""
        view = memoryview(chunk).cast("B")
        cdef Py_ssize_t n = len(view), done
        self.bytes_out += <uint64_t>n
        while n:
            done_obj = self.fileobj.write(view)
            if done_obj is None:  # file objects that do not report a count wrote it all
                return
            done = done_obj
            if done >= n:
                return
            if done <= 0:
                raise OSError(f"{type(self.fileobj).__name__}.write() wrote nothing")
            view = view[done:]
            n -= done

    cdef object _feed(self, object flat):
        """Append bytes of the data region: whole blocks are checksummed and written straight
        from ``flat`` (1-D uint8), the rest goes through the block buffer."""
        cdef const uint8_t[::1] src = flat
        cdef uint64_t n = src.shape[0], pos = 0, take, k, j, bs = self.block_size
        cdef const uint8_t* p
        if n == 0:
            return
        if self.block_fill:
            take = min(bs - self.block_fill, n)
            memcpy(self.block_buf + self.block_fill, &src[0], take)
            self.block_fill += take
            pos = take
            if self.block_fill == bs:
                self._flush_block()
        k = (n - pos) // bs
        if k:
            if self.blocks_done + k > self.n_blocks:
                raise AssertionError("snapshot writer fed more data than its header announced")
            p = &src[pos]
            with nogil:
                for j in range(k):
                    self.checksums[self.blocks_done + j] = xxh64(p + j * bs, bs, 0)
            self._emit(flat[pos:pos + k * bs])
            self.blocks_done += k
            pos += k * bs
        if pos < n:
            memcpy(self.block_buf, &src[pos], n - pos)
            self.block_fill = n - pos

    cdef object _flush_block(self):
        if self.blocks_done >= self.n_blocks:
            raise AssertionError("snapshot writer fed more data than its header announced")
        self.checksums[self.blocks_done] = xxh64(self.block_buf, self.block_fill, 0)
        self._emit(self._block_arr[:self.block_fill])
        self.blocks_done += 1
        self.block_fill = 0

    # -- the public interface -------------------------------------------------------------
    def write_rows(self, rows):
        """Append rows: a C-contiguous ``(m, row_width)`` uint8 array (or anything
        ``numpy.asarray`` turns into one), such as ``RowTable.cursor().next_rows(k)``.

        Raises
        ------
        ValueError
            On a wrong row width, more rows than announced, or a key written before. Keys
            with equal 64-bit XXH64 are compared by their bytes within one call; a key of an
            earlier call (those rows are not kept) is found again by its hash for 4- and
            8-byte keys, on which XXH64 is one-to-one, and not for other widths, whose rows
            the caller must keep unique (as RowTable does). Distinct keys are never refused.
        TypeError
            If ``rows`` is not uint8.
        """
        self._check_open()
        arr = np.asarray(rows)
        if arr.dtype != np.uint8:
            raise TypeError(f"rows must be a uint8 array, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[1] != self.row_width:
            raise ValueError(f"rows must be an (m, {self.row_width}) uint8 array ({self.key_width} key + "
                             f"{self.value_width} value bytes), got shape {arr.shape}")
        arr = np.ascontiguousarray(arr)
        cdef Py_ssize_t m = arr.shape[0], bad = 0
        cdef int rc
        if m == 0:
            return
        if self.rows_written + <uint64_t>m > self.row_count:
            raise ValueError(f"the snapshot was announced with {self.row_count} rows; "
                             f"{self.rows_written} were written and {m} more were given")
        cdef const uint8_t[:, ::1] view = arr
        cdef uint32_t[::1] tags = np.empty(m, dtype=np.uint32)
        self.search.call_rows = &view[0, 0]
        self.search.call_first = self.rows_written
        with nogil:
            rc = self.index_rows(&view[0, 0], m, &tags[0], &bad)
        self.search.call_rows = NULL
        self.search.call_first = <uint64_t>-1
        if rc:
            self.state = WRITER_FAILED
            first = self.rows_written + <uint64_t>bad
            raise ValueError(f"duplicate key: row {first} has the key of row {self.search.other} "
                             f"({arr[bad, :self.key_width].tobytes().hex()})")
        try:
            self._feed(arr.reshape(-1))
        except BaseException:
            self.state = WRITER_FAILED
            raise
        self.rows_written += <uint64_t>m

    def finish(self):
        """Write the slots, the checksums and the footer.

        Returns
        -------
        dict
            ``file_size``, ``n_slots``, ``max_displacement``, ``row_count``, ``n_blocks``,
            ``hash_collisions`` (pairs of keys with equal 64-bit hashes taken as distinct).

        Raises
        ------
        ValueError
            If fewer rows were written than announced (the writer stays open).
        """
        self._check_open()
        if self.rows_written != self.row_count:
            raise ValueError(f"the snapshot was announced with {self.row_count} rows, "
                             f"but {self.rows_written} were written")
        try:
            padding = self.slots_offset - (self.rows_offset + self.row_count * <uint64_t>self.row_width)
            self._feed(np.zeros(padding, dtype=np.uint8))
            self._feed(self._slots_arr.view(np.uint8).reshape(-1))
            if self.block_fill:
                self._flush_block()
            if self.blocks_done != self.n_blocks:
                raise AssertionError(f"snapshot writer made {self.blocks_done} blocks, not {self.n_blocks}")
            table = self._checksums_arr.view(np.uint8)
            self._emit(table)
            self._emit(footer_bytes(checksum(table), self.file_size, self.header_checksum,
                                    self.max_displacement))
            if self.bytes_out != self.file_size:
                raise AssertionError(f"snapshot writer wrote {self.bytes_out} bytes, not {self.file_size}")
        except BaseException:
            self.state = WRITER_FAILED
            raise
        self.state = WRITER_DONE
        self._release()
        return {"file_size": self.file_size, "n_slots": self.n_slots,
                "max_displacement": self.max_displacement, "row_count": self.row_count,
                "n_blocks": self.n_blocks, "hash_collisions": self.search.collisions}

    @property
    def hash_collisions(self):
        """Pairs of keys with equal 64-bit hashes taken as distinct."""
        return self.search.collisions

    cdef object _release(self):
        self.slots = NULL
        self.key_hi = self.search.key_hi = NULL
        self.block_buf = NULL
        self.checksums = NULL
        self._slots_arr = self._key_hi_arr = self._block_arr = self._checksums_arr = None


# Working buffers larger than this are mapped from an unlinked temporary file instead of
# taken from the heap: the kernel can then write them out and drop them under memory
# pressure, so writing the snapshot of a state larger than memory does not need the slot
# index of that state in resident memory. Below it they stay on the heap: a file mapping's
# pages are allocated by the file system as they are first written, and its dirty pages are
# written back to disk, work that a slot index which fits in memory has no need of
# (bench_snapshot's scratch table). An eighth of physical memory, and at least 64 MiB.
FILE_BACKED_SCRATCH_BYTES = max(64 << 20, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)


def _scratch_array(shape, dtype):
    """A zeroed array of ``shape``: on the heap, or past FILE_BACKED_SCRATCH_BYTES mapped
    from an unlinked file in the temporary directory (its pages are the kernel's to evict;
    the file goes with the mapping)."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes <= FILE_BACKED_SCRATCH_BYTES:
        return np.zeros(shape, dtype=dtype)
    with tempfile.TemporaryFile(prefix="statecore-snapshot-index-") as f:
        f.truncate(nbytes)  # a sparse file: reads as zeros
        return np.ndarray(shape, dtype=dtype, buffer=mmap.mmap(f.fileno(), nbytes))


def write_snapshot(fileobj, table, store_version, lineage=bytes(16), block_size=DEFAULT_BLOCK_SIZE):
    """Stream a RowTable into ``fileobj`` as a snapshot; returns :meth:`SnapshotWriter.finish`'s
    dict. The rows are those live when the table's cursor opens (``len(table)`` of them)."""
    cursor = table.cursor()
    try:
        writer = SnapshotWriter(fileobj, table.key_schema, table.value_schema, len(table),
                                store_version, lineage, block_size)
        while True:
            chunk = cursor.next_rows(WRITE_CHUNK_ROWS)
            if chunk is None:
                break
            writer.write_rows(chunk)
        return writer.finish()
    finally:
        cursor.close()
