# cython: language_level=3
"""Packed snapshots (version 2): an image compressed while it is written, and unpacked again
into an image file to be mapped. The container's layout and its checks are
``_snapshot_format``'s; docs/formats.md ("Snapshot, version 2") describes it.

:class:`PackWriter` is a file object that a :class:`SnapshotWriter` writes its image into:
it keeps the header page as it is and compresses the rest a block at a time as the bytes
come, so an image is never written twice. :func:`unpack_snapshot` checks a packed file's
header, footer and block table, then each block's checksum before it decompresses the block
(or, without a destination, only checks): damage raises StateCorruptionError naming the
path and the byte offset in the packed file, and no byte of a block is used before its
checksum matched. lz4 and the checksums run without the GIL.
"""
cimport cython
from libc.stdint cimport uint8_t, uint64_t

from statecore._hash cimport xxh64

import collections
import concurrent.futures
import os

import lz4.block

from statecore._snapshot_format import (
    DEFAULT_PACK_BLOCK_SIZE, HEADER_SIZE, MAX_PACK_BLOCK_SIZE, MIN_PACK_BLOCK_SIZE, PACK_FOOTER_SIZE,
    PACK_STORED_LZ4, PACK_STORED_RAW, SNAPSHOT_HEADER_SIZE,
    check_pack_footer, pack_entry_bytes, pack_footer_bytes, pack_header_bytes, pack_table,
    pack_table_checksum, pack_table_offset, read_snapshot_header,
)
from statecore.errors import StateCorruptionError

_lz4_compress = lz4.block.compress
_lz4_decompress = lz4.block.decompress
_LZ4BlockError = lz4.block.LZ4BlockError
# Bytes read from the source at a time while unpacking (several blocks per read on a
# remote file system).
_READ_AHEAD = 4 << 20
# Blocks handed to a PackWriter's packing thread and not yet written: the writer's caller
# (indexing and checksumming the rows) runs beside lz4 on another core.
PACK_AHEAD = 16
# Blocks unpacked and not yet written to the image: the unpacker decompresses the next blocks
# while a thread of its own writes them.
UNPACK_AHEAD = 16


cdef uint64_t _checksum(const uint8_t[::1] data):
    cdef uint64_t h
    with nogil:
        h = xxh64(&data[0] if data.shape[0] else NULL, <size_t>data.shape[0], 0)
    return h


def _write_all(fileobj, data):
    """``fileobj.write(data)``, again for what a partial write left over."""
    view = memoryview(data).cast("B")
    while len(view):
        done = fileobj.write(view)
        if done is None or done >= len(view):
            return
        if done <= 0:
            raise OSError(f"{type(fileobj).__name__}.write() wrote nothing")
        view = view[done:]


def _packed_block(block, image=None, head=None):
    """``(stored bytes, method, checksum)`` of one block: lz4, or the block as it is where
    lz4 would not shrink it. ``head`` (if any), then the block, go to ``image`` (if any)
    first. On the packing thread; lz4, the checksum and a file's write release the GIL."""
    if image is not None:
        if head is not None:
            _write_all(image, head)
        _write_all(image, block)
    packed = _lz4_compress(block, store_size=False)
    if len(packed) < len(block):
        return packed, PACK_STORED_LZ4, _checksum(packed)
    return block, PACK_STORED_RAW, _checksum(block)


@cython.final
cdef class PackWriter:
    """A write-only binary file object that packs the image written into it into ``fileobj``.

    The first HEADER_SIZE bytes written must be an image's header page (a SnapshotWriter
    writes it first): the container header and that page go out at once, then every
    ``block_size`` bytes of the image are compressed and written as they complete; the
    image's last byte writes the last block, the block table and the footer. :meth:`finish`
    checks that the whole image came. The file objects are neither flushed nor closed. Blocks
    are compressed on a thread of the writer's own (PACK_AHEAD in flight) while the caller
    goes on; they are written in order, from the caller's thread.

    ``image``, a second file object (or None), is given the image itself, byte for byte, from
    the packing thread, block by block before each is compressed: the local image of the new
    snapshot (statecore/snapshot_files.py), written beside the caller's indexing instead of
    after it. Its errors reach the caller as the packing's do.
    """
    def __cinit__(self, fileobj, block_size=DEFAULT_PACK_BLOCK_SIZE, image=None):
        if not callable(getattr(fileobj, "write", None)):
            raise TypeError(f"fileobj must have a write() method, got {type(fileobj).__name__}")
        if image is not None and not callable(getattr(image, "write", None)):
            raise TypeError(f"image must have a write() method, got {type(image).__name__}")
        if not (block_size & (block_size - 1) == 0 and MIN_PACK_BLOCK_SIZE <= block_size <= MAX_PACK_BLOCK_SIZE):
            raise ValueError(f"block_size must be a power of two in [{MIN_PACK_BLOCK_SIZE}, "
                             f"{MAX_PACK_BLOCK_SIZE}], got {block_size}")
        self.fileobj = fileobj
        self.image = image
        self.block_size = block_size
        self.pending = bytearray()
        self.table = []
        self.tail = b""
        self.in_flight = collections.deque()

    def writable(self):
        return True

    cdef _emit(self, data):
        self.bytes_out += len(memoryview(data).cast("B"))
        _write_all(self.fileobj, data)

    cdef _pack_block(self, block):
        """Hand one block of image bytes (copied: the caller's buffer is reused) to the
        packing thread; the oldest of more than PACK_AHEAD blocks in flight is written."""
        block = bytes(block)
        if self.packer is None:
            self.packer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="statecore-pack")
        self.in_flight.append((block, self.packer.submit(_packed_block, block, self.image, self.image_head)))
        self.image_head = None
        if len(self.in_flight) > PACK_AHEAD:
            self._write_packed()

    cdef _write_packed(self):
        """Write the oldest block in flight once packed; its entry goes to the table."""
        block, done = self.in_flight.popleft()
        try:
            packed, method, checksum = done.result()
        except BaseException:
            self.abandon()
            raise
        self.table.append(pack_entry_bytes(len(packed), method, checksum))
        self.tail = (self.tail + block[-8:])[-8:]
        self._emit(packed)

    def write(self, data):
        """Take image bytes; returns how many (all of them). ValueError past the image's end."""
        if self.abandoned:
            raise ValueError("this PackWriter was abandoned after an error")
        if self.done:
            raise ValueError("this PackWriter has written its whole image")
        view = memoryview(data).cast("B")
        n = len(view)
        if self.header is None:
            self.pending += view
            if len(self.pending) < HEADER_SIZE:
                return n
            page = bytes(self.pending[:HEADER_SIZE])
            self.header = read_snapshot_header(page, "<the image being packed>")
            if self.header.packed is not None:
                raise ValueError("the image given to PackWriter is a packed snapshot already")
            self.image_size = self.header.file_size
            head = pack_header_bytes(self.block_size, self.image_size, page)
            self.packed = read_snapshot_header(head + page, "<the snapshot being packed>").packed
            self._emit(head)
            self._emit(page)
            if self.image is not None:
                self.image_head = page  # written before the first block, on the packing thread
            rest = memoryview(self.pending)[HEADER_SIZE:]
            self.image_bytes = HEADER_SIZE
            self.pending = bytearray()
            self._take(rest)
            return n
        self._take(view)
        return n

    cdef _take(self, view):
        cdef Py_ssize_t n = len(view), pos = 0, bs = self.block_size, take
        if self.image_bytes + n > self.image_size:
            raise ValueError(f"the image is {self.image_size} bytes; {self.image_bytes} were written and "
                             f"{n} more were given")
        if len(self.pending):
            take = min(bs - len(self.pending), n)
            self.pending += view[:take]
            pos = take
            if len(self.pending) == bs:
                self._pack_block(self.pending)
                self.pending = bytearray()
        while n - pos >= bs:
            self._pack_block(view[pos:pos + bs])
            pos += bs
        if pos < n:
            self.pending += view[pos:]
        self.image_bytes += n
        if self.image_bytes == self.image_size:
            self._close_image()

    cdef _close_image(self):
        if len(self.pending):
            self._pack_block(self.pending)
            self.pending = bytearray()
        while self.in_flight:
            self._write_packed()
        if self.packer is not None:
            self.packer.shutdown()
            self.packer = None
        if len(self.table) != self.packed.n_blocks:
            raise AssertionError(f"PackWriter made {len(self.table)} blocks, not {self.packed.n_blocks}")
        table = b"".join(self.table)
        self._emit(table)
        # The image's footer checksum is its last 8 bytes, in the last block packed.
        size = self.bytes_out + PACK_FOOTER_SIZE
        self._emit(pack_footer_bytes(size, pack_table_checksum(table, self.packed), self.packed,
                                     int.from_bytes(self.tail, "little")))
        self.done = True

    def abandon(self):
        """Stop the packing thread after an error, here or in the caller: blocks not yet begun
        are dropped, the one being packed is waited for, so that neither file object is
        written once this returns. The writer takes no more bytes."""
        self.abandoned = True
        for _, future in self.in_flight:
            future.cancel()
        self.in_flight.clear()
        if self.packer is not None:
            self.packer.shutdown(wait=True)
            self.packer = None

    def finish(self):
        """Check that the whole image was written; returns the packed size in bytes."""
        if self.abandoned:
            raise ValueError("this PackWriter was abandoned after an error")
        if not self.done:
            raise ValueError(f"the image is {self.image_size} bytes, but {self.image_bytes} were written")
        return self.bytes_out


class _WriteBehind:
    """Writes to a file object from a thread of its own, in the order given, while the caller
    goes on; at most UNPACK_AHEAD writes wait. A write's error reaches the caller at a later
    write or at :meth:`close`, with the thread stopped first (the writes after it dropped)."""

    def __init__(self, fileobj):
        self.fileobj = fileobj
        self.thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="statecore-unpack")
        self.pending = collections.deque()

    def write(self, data):
        self.pending.append(self.thread.submit(_write_all, self.fileobj, data))
        if len(self.pending) > UNPACK_AHEAD:
            self._wait_oldest()

    def _wait_oldest(self):
        try:
            self.pending.popleft().result()
        except BaseException:
            self.abandon()
            raise

    def close(self):
        """Wait for every write; the thread ends, whether or not one failed."""
        while self.pending:
            self._wait_oldest()
        self.thread.shutdown()

    def abandon(self):
        """Drop the writes not begun and wait for the one running: the file object is not
        written once this returns."""
        for future in self.pending:
            future.cancel()
        self.pending.clear()
        self.thread.shutdown(wait=True)


def unpack_snapshot(source, dest, path):
    """Check a packed snapshot read from ``source`` and write its image to ``dest``.

    ``source`` is a binary file object that can seek (a local file, an fsspec file);
    ``dest`` anything with ``write()``, or None to check every block's checksum without
    decompressing. ``path`` is the name errors give. Returns the checked
    :class:`SnapshotHeader` (``packed`` set). StateCorruptionError naming ``path`` and the
    offset on any damage (and ``dest`` then holds bytes that must be discarded); ValueError
    if the file is an image, not a packed snapshot.
    """
    source.seek(0)
    head = _read_exactly(source, SNAPSHOT_HEADER_SIZE, 0, path)
    h = read_snapshot_header(head, path)
    if h.packed is None:
        raise ValueError(f"{path} is a snapshot image (version 1), not a packed snapshot")
    size = source.seek(0, os.SEEK_END)
    table_at = pack_table_offset(size, h)
    footer_at = size - PACK_FOOTER_SIZE
    if table_at < SNAPSHOT_HEADER_SIZE:
        check_pack_footer(b"", size, h, path)  # raises: too short for its table and footer
    source.seek(table_at)
    tail = _read_exactly(source, size - table_at, table_at, path)
    table_checksum, image_footer_checksum = check_pack_footer(tail[footer_at - table_at:], size, h, path)
    blocks = pack_table(tail[:footer_at - table_at], size, h, table_checksum, path)
    if dest is None:
        _unpack_blocks(source, None, path, blocks, table_at, footer_at, image_footer_checksum)
        return h
    out = _WriteBehind(dest)
    try:
        out.write(head[SNAPSHOT_HEADER_SIZE - HEADER_SIZE:])
        _unpack_blocks(source, out, path, blocks, table_at, footer_at, image_footer_checksum)
    except BaseException:
        # ``dest`` gets the blocks checked before the damage, and nothing once this raises
        try:
            out.close()
        except BaseException:
            pass  # a write's error too: the first error is the one to report
        raise
    out.close()
    return h


cdef _unpack_blocks(source, dest, path, blocks, table_at, footer_at, image_footer_checksum):
    """unpack_snapshot's blocks, each checked, then decompressed and written to ``dest``
    (unless None)."""
    source.seek(SNAPSHOT_HEADER_SIZE)
    buf, buf_at = b"", SNAPSHOT_HEADER_SIZE   # bytes read ahead, and where they start
    tail = b""                                 # the image's last 8 bytes so far
    for i, (offset, stored_size, method, stored_checksum, raw_size) in enumerate(blocks):
        end = buf_at + len(buf)               # the source's position
        if offset + stored_size > end:
            more = max(offset + stored_size - end, min(_READ_AHEAD, table_at - end))
            buf = buf[offset - buf_at:] + _read_exactly(source, more, end, path)
            buf_at = offset
        stored = memoryview(buf)[offset - buf_at:offset - buf_at + stored_size]
        actual = _checksum(stored)
        if actual != stored_checksum:
            raise StateCorruptionError(path, offset, f"packed block {i} checksum mismatch "
                                                     f"(expected 0x{stored_checksum:016x}, got 0x{actual:016x})")
        if dest is None:
            continue
        if method == PACK_STORED_LZ4:
            try:
                raw = _lz4_decompress(stored, uncompressed_size=raw_size)  # releases the GIL
            except _LZ4BlockError as e:
                raise StateCorruptionError(path, offset, f"lz4 could not decompress packed block {i}: {e}") from None
            if len(raw) != raw_size:
                raise StateCorruptionError(path, offset, f"packed block {i} decompressed to {len(raw)} bytes, "
                                                         f"not {raw_size}")
        else:
            raw = stored
        dest.write(raw)
        tail = (tail + bytes(raw[-8:]))[-8:]
    if dest is not None:
        if int.from_bytes(tail, "little") != image_footer_checksum:
            raise StateCorruptionError(path, footer_at + 32, "the image unpacked does not end with the "
                                                             "footer the container names")


cdef bytes _read_exactly(source, Py_ssize_t n, at, path):
    data = source.read(n)
    if len(data) != n:
        raise StateCorruptionError(path, at + len(data), f"the file ended (or shrank) while it was read: "
                                                         f"{n} bytes wanted at byte {at}")
    return data
