# cython: language_level=3
"""Delta files: the puts and removes of one store version, lz4-compressed in checksummed blocks.

This module writes and reads delta files: :class:`DeltaWriter` encodes records onto any
binary file object that has ``write()`` (no seeking, so fsspec remote files work), and
:class:`DeltaReader` decodes a delta from bytes or from a file object read front to back.
Replaying a delta's blocks in order onto the previous version's state gives the version it
produces (:func:`apply_delta`). The format (constants, the header and its parser
:func:`read_delta_header`) is ``_delta_format``'s, exported here too; docs/formats.md
describes it. The files and their names belong to the Python layer.

Damage is never data. Every byte is under a checksum (XXH64, ``statecore._hash``) that is
checked before the byte is used: a truncated, damaged or spliced delta raises
:class:`statecore.errors.StateCorruptionError` naming the file and the byte offset.

Thread-safety: a writer or reader is used by one thread at a time. lz4 compression and
decompression and the checksum loops release the GIL, so other threads run meanwhile.
(About 600 lines: the writer and the reader of one format, each the other's test.)
"""
cimport cython
from cpython.buffer cimport PyBUF_READ
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memmove

from statecore._delta_format cimport header_field, lineage_bytes, lz4_bound, sealed
from statecore._hash cimport checksum, xxh64
from statecore._rowtable cimport rows_ptr

import io

import lz4.block
import numpy as np

# The format's names, used here and exported from here as before.
from statecore._delta_format import (
    BLOCK_HEADER_SIZE, BLOCK_HEADER_STRUCT, BLOCK_PUTS, BLOCK_REMOVES, COMPRESSION_CODES, COMPRESSION_LZ4,
    COMPRESSION_NONE, DEFAULT_BLOCK_BYTES, DELTA_HEADER_SIZE, FORMAT_VERSION, HEADER_SIZE, HEADER_STRUCT,
    MAGIC, MAX_BLOCK_RAW_SIZE, NUM_KEYS_UNKNOWN, TRAILER_MAGIC, TRAILER_SIZE, TRAILER_STRUCT, TRAILERS, U64,
    DeltaHeader, read_delta_header,
)
from statecore.errors import IllegalStateError, SchemaMismatchError, StateCorruptionError
from statecore.schema import as_schema, key_value_schemas

__all__ = [
    "BLOCK_PUTS", "BLOCK_REMOVES", "DEFAULT_BLOCK_BYTES", "DELTA_HEADER_SIZE", "FORMAT_VERSION",
    "HEADER_SIZE", "MAX_BLOCK_RAW_SIZE", "NUM_KEYS_UNKNOWN", "DeltaHeader", "DeltaReader", "DeltaWriter", "apply_delta",
    "encode_delta", "read_delta", "read_delta_header",
]

cdef int _PUTS = BLOCK_PUTS
cdef int _REMOVES = BLOCK_REMOVES

_lz4_compress = lz4.block.compress
_lz4_decompress = lz4.block.decompress
_LZ4BlockError = lz4.block.LZ4BlockError


# -- writing --------------------------------------------------------------------------------

@cython.final
cdef class DeltaWriter:
    """Encodes the puts and removes of one store version onto a binary file object.

    Records are kept in the order of the calls; consecutive calls of one kind share blocks.
    The header is written at once, each block when it fills, the trailer by :meth:`finish`.
    Nothing is seeked, so the file may be an fsspec remote file. The writer does not close
    the file.

    Parameters
    ----------
    fileobj : binary file object
        Anything with ``write(bytes)``.
    key_schema, value_schema : RowSchema or numpy structured dtype
        The value schema may have no fields (width 0).
    store_version : int
        The version this delta produces (0 <= store_version < 2**64).
    lineage : bytes (16) or uuid.UUID
        An id stored in the header that readers can require (``expected_lineage``).
    compression : {"lz4", "none"}
    block_bytes : int
        Raw bytes per block the writer aims for (a block holds at least one record), at most
        MAX_BLOCK_RAW_SIZE.

    Raises
    ------
    TypeError
        If the key schema has no fields.
    ValueError
        For a bad version, lineage, compression or block size, or rows wider than a block.
    """

    def __init__(self, fileobj, key_schema, value_schema, store_version, lineage=bytes(16),
                 compression="lz4", block_bytes=DEFAULT_BLOCK_BYTES):
        if self._buf != NULL:  # __init__ called again
            PyMem_Free(self._buf)
            self._buf = NULL
        self._write = fileobj.write
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.key_width = self.key_schema.width
        self.value_width = self.value_schema.width
        if not isinstance(store_version, int) or not 0 <= store_version < (1 << 64):
            raise ValueError(f"store_version must be an int in [0, 2**64), got {store_version!r}")
        self.store_version = int(store_version)
        self.lineage = lineage_bytes(lineage, "lineage")
        if compression not in COMPRESSION_CODES:
            raise ValueError(f"compression must be one of {sorted(COMPRESSION_CODES)}, got {compression!r}")
        self.compression = compression
        self._lz4 = compression == "lz4"
        if not isinstance(block_bytes, int) or not 1 <= block_bytes <= MAX_BLOCK_RAW_SIZE:
            raise ValueError(f"block_bytes must be an int in [1, {MAX_BLOCK_RAW_SIZE}], got {block_bytes!r}")
        if self.key_width + self.value_width > MAX_BLOCK_RAW_SIZE:
            raise ValueError(f"rows of {self.key_width + self.value_width} bytes exceed the "
                             f"{MAX_BLOCK_RAW_SIZE}-byte block limit")
        self.block_bytes = block_bytes
        self._put_cap = max(1, block_bytes // (self.key_width + self.value_width))
        self._remove_cap = max(1, block_bytes // self.key_width)
        cdef Py_ssize_t buf_size = max(self._put_cap * (self.key_width + self.value_width),
                                       self._remove_cap * self.key_width)
        self._buf = <uint8_t*>PyMem_Malloc(buf_size)
        if self._buf == NULL:
            raise MemoryError(f"DeltaWriter could not allocate a {buf_size}-byte block buffer")
        self._pending_kind = 0
        self._pending_n = 0
        self._n_puts = self._n_removes = self._n_blocks = self._bytes_written = 0
        self._block_checksums = bytearray()
        self._finished = False
        self._broken = False
        header = sealed(HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, COMPRESSION_CODES[compression], 0,
                                      self.key_width, self.value_width, 0,
                                      self.key_schema.fingerprint, self.value_schema.fingerprint,
                                      self.store_version, self.lineage))
        self._header_checksum = U64.unpack_from(header, HEADER_SIZE - 8)[0]
        self._write_all(header)

    def __dealloc__(self):
        PyMem_Free(self._buf)
        self._buf = NULL

    cdef void _write_all(self, data) except *:
        """Write all of ``data`` (a raw file may write less than asked)."""
        cdef Py_ssize_t n = len(data)
        try:
            written = self._write(data)
            if written is not None and written < n:
                view = memoryview(data)
                while written < n:
                    step = self._write(view[written:])
                    if not step:
                        raise OSError(f"the file accepted {written} of {n} bytes")
                    written += step
        except BaseException:
            self._broken = True
            raise
        self._bytes_written += <uint64_t>n

    cdef void _check_open(self) except *:
        if self._finished:
            raise IllegalStateError("Cannot write to a delta after finish()")
        if self._broken:
            raise IllegalStateError("Cannot write to a delta after a write to its file failed")

    def put_rows(self, keys, values=None):
        """Append puts: ``keys`` (n, key_width) and ``values`` (n, value_width) C-contiguous
        uint8 arrays (read-only arrays work). ``values`` may be None for an empty value
        schema. The rows are copied before this returns."""
        self._check_open()
        cdef const uint8_t[:, ::1] k = keys
        cdef const uint8_t[:, ::1] v
        if k.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {k.shape[1]} bytes")
        if values is None:
            if self.value_width:
                raise ValueError("Cannot put a null value")
            self._append(_PUTS, rows_ptr(k), NULL, k.shape[0])
            return
        v = values
        if v.shape[1] != self.value_width:
            raise ValueError(f"values must be (n, {self.value_width}) rows, got {v.shape[1]} bytes")
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"{k.shape[0]} keys but {v.shape[0]} value rows")
        self._append(_PUTS, rows_ptr(k), rows_ptr(v), k.shape[0])

    def remove_rows(self, keys):
        """Append removes: ``keys`` (n, key_width) C-contiguous uint8 (read-only arrays work)."""
        self._check_open()
        cdef const uint8_t[:, ::1] k = keys
        if k.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {k.shape[1]} bytes")
        self._append(_REMOVES, rows_ptr(k), NULL, k.shape[0])

    cdef void _append(self, int kind, const uint8_t* keys, const uint8_t* values,
                      Py_ssize_t n) except *:
        # REQUIRES: keys holds n key rows and values n value rows (NULL if the value width
        # is 0 or kind is _REMOVES); checked by put_rows / remove_rows.
        cdef Py_ssize_t kw = self.key_width, vw = self.value_width if kind == _PUTS else 0
        cdef Py_ssize_t cap = self._put_cap if kind == _PUTS else self._remove_cap
        cdef Py_ssize_t i = 0, take, at
        if n == 0:
            return
        if self._pending_n and self._pending_kind != kind:
            self._flush()
        while i < n:
            if self._pending_n == 0 and vw == 0 and n - i >= cap:
                # A full block of key rows is already laid out in the caller's array: no copy.
                self._emit(kind, cap, keys + i * kw)
                i += cap
                continue
            take = min(cap - self._pending_n, n - i)
            at = self._pending_n
            with nogil:
                memcpy(self._buf + at * kw, keys + i * kw, <size_t>(take * kw))
                if vw:
                    memcpy(self._buf + cap * kw + at * vw, values + i * vw, <size_t>(take * vw))
            self._pending_kind = kind
            self._pending_n += take
            i += take
            if self._pending_n == cap:
                self._flush()

    cdef void _flush(self) except *:
        """Emit the pending block, if any."""
        cdef Py_ssize_t n = self._pending_n
        cdef Py_ssize_t kw = self.key_width, vw = self.value_width
        if n == 0:
            return
        if self._pending_kind == _PUTS and vw and n < self._put_cap:
            # A short block: close the gap between its keys and its values.
            memmove(self._buf + n * kw, self._buf + self._put_cap * kw, <size_t>(n * vw))
        self._pending_n = 0
        self._emit(self._pending_kind, n, self._buf)

    cdef void _emit(self, int kind, Py_ssize_t n, const uint8_t* raw) except *:
        """Compress, checksum and write one block of ``n`` records laid out at ``raw``."""
        cdef Py_ssize_t raw_size = n * (self.key_width + (self.value_width if kind == _PUTS else 0))
        cdef bytes payload
        cdef uint64_t csum
        cdef const char* p
        cdef size_t stored
        if self._lz4:
            view = PyMemoryView_FromMemory(<char*>raw, raw_size, PyBUF_READ)
            try:
                payload = _lz4_compress(view, store_size=False)  # releases the GIL
            except BaseException:
                self._broken = True  # the block's records are gone from the buffer
                raise
            finally:
                view.release()
        else:
            # A copy, so the file may keep what it is given (io only promises it will not).
            payload = PyBytes_FromStringAndSize(<const char*>raw, raw_size)
        p = PyBytes_AS_STRING(payload)
        stored = <size_t>PyBytes_GET_SIZE(payload)
        with nogil:
            csum = xxh64(p, stored, 0)
        self._write_all(sealed(BLOCK_HEADER_STRUCT.pack(kind, 0, 0, n, raw_size, stored, csum)))
        self._write_all(payload)
        self._block_checksums += U64.pack(csum)
        self._n_blocks += 1
        if kind == _PUTS:
            self._n_puts += <uint64_t>n
        else:
            self._n_removes += <uint64_t>n

    def finish(self, num_keys=None):
        """Write the pending block and the trailer, which records ``num_keys``, the key count
        of the version the delta produces (None: not known). Returns ``dict(n_puts,
        n_removes, n_blocks, bytes_written)``. The file is neither flushed nor closed."""
        if num_keys is not None and (not isinstance(num_keys, int) or isinstance(num_keys, bool)
                                     or not 0 <= num_keys < NUM_KEYS_UNKNOWN):
            raise ValueError(f"num_keys must be None or an int in [0, 2**64 - 1), got {num_keys!r}")
        self._check_open()
        self._flush()
        blocks_checksum = checksum(self._block_checksums, self._header_checksum)
        self._write_all(sealed(TRAILER_STRUCT.pack(
            TRAILER_MAGIC, self._n_blocks, self._n_puts, self._n_removes,
            NUM_KEYS_UNKNOWN if num_keys is None else num_keys, blocks_checksum)))
        self._finished = True
        PyMem_Free(self._buf)
        self._buf = NULL
        return {"n_puts": self._n_puts, "n_removes": self._n_removes, "n_blocks": self._n_blocks,
                "bytes_written": self._bytes_written}

    @property
    def finished(self):
        return self._finished


def encode_delta(key_schema, value_schema, store_version, puts=None, removes=None,
                 lineage=bytes(16), compression="lz4", block_bytes=DEFAULT_BLOCK_BYTES, num_keys=None):
    """The bytes of a delta holding ``puts`` (a ``(keys, values)`` pair of row arrays), then
    ``removes`` (key rows); either may be None. See :class:`DeltaWriter`."""
    out = io.BytesIO()
    writer = DeltaWriter(out, key_schema, value_schema, store_version, lineage=lineage,
                         compression=compression, block_bytes=block_bytes)
    if puts is not None:
        keys, values = puts
        writer.put_rows(keys, values)
    if removes is not None:
        writer.remove_rows(removes)
    writer.finish(num_keys)
    return out.getvalue()


# -- reading --------------------------------------------------------------------------------

def _source_name(source):
    for attr in ("path", "name"):
        name = getattr(source, attr, None)
        if isinstance(name, (str, bytes)) and name:
            return name if isinstance(name, str) else name.decode(errors="replace")
    return "<delta bytes>"


@cython.final
cdef class DeltaReader:
    """Decodes a delta, checking every byte before it is used.

    The header is read and checked on construction. Iterating yields one
    ``(kind, keys, values)`` per block, in file order: ``kind`` is BLOCK_PUTS or
    BLOCK_REMOVES, ``keys`` a new (m, key_width) uint8 array, ``values`` a new
    (m, value_width) uint8 array for puts and None for removes. Iteration ends after the
    trailer and the end of the file were checked, so damage near the end is found only
    after earlier blocks were yielded: to apply a delta all or nothing, use
    :func:`read_delta` or :func:`apply_delta`. The checked header is ``header`` (a
    :class:`DeltaHeader`); its fields are also the reader's attributes.

    Parameters
    ----------
    source : bytes-like or binary file object
        A file object is read sequentially with ``read(n)`` (fsspec files work).
    key_schema, value_schema : RowSchema or dtype, optional
        When given, the file's widths and schema fingerprints must match.
    path : str, optional
        The name errors give; defaults to the file object's ``path`` or ``name``.
    expected_lineage : bytes (16) or uuid.UUID, optional
        When given, the header's lineage must equal it.

    Raises
    ------
    StateCorruptionError
        Damage, truncation, an unknown format version, or a lineage mismatch.
    SchemaMismatchError
        The key or value schema differs from the file's.
    """

    def __init__(self, source, key_schema=None, value_schema=None, path=None, expected_lineage=None):
        try:
            self._view = memoryview(source).cast("B")
            self._read = None
        except TypeError:
            if not hasattr(source, "read"):
                raise TypeError(f"a delta source is bytes-like or a binary file object, "
                                f"got {type(source).__name__}") from None
            self._view = None
            self._read = source.read
        self.path = str(path) if path is not None else _source_name(source)
        self._pos = 0
        self._block_checksums = bytearray()
        self._seen_blocks = self._seen_puts = self._seen_removes = 0
        self._done = False
        self._error = None
        self._num_keys = None
        self._read_header(key_schema, value_schema, expected_lineage)

    # -- bytes in ---------------------------------------------------------------------------
    cdef object _corrupt(self, offset, reason):
        return StateCorruptionError(self.path, offset, reason)

    cdef object _take(self, Py_ssize_t n, str what):
        """Exactly ``n`` next bytes (bytes or a memoryview), or StateCorruptionError."""
        cdef Py_ssize_t got, start = self._pos
        if self._view is not None:
            got = min(n, len(self._view) - start)
            if got == n:
                self._pos = start + n
                return self._view[start:start + n]
        else:
            data = self._read(n)
            got = len(data) if data else 0
            if got < n and got:
                chunks = [data]
                while got < n:
                    more = self._read(n - got)
                    if not more:
                        break
                    chunks.append(more)
                    got += len(more)
                data = b"".join(chunks)
            if got == n:
                self._pos = start + n
                return data
            if got > n:
                raise ValueError(f"the file's read({n}) returned {got} bytes")
        raise self._corrupt(start + got, f"truncated: {what} needs {n} bytes, the file ends after {got}")

    cdef bint _at_end(self) except -1:
        if self._view is not None:
            return self._pos == len(self._view)
        return not self._read(1)

    # -- header -----------------------------------------------------------------------------
    cdef void _read_header(self, key_schema, value_schema, expected_lineage) except *:
        cdef _delta_format.DeltaHeader h = read_delta_header(self._take(HEADER_SIZE, "the header"), self.path)
        self.header = h
        self._lz4 = h.compression == "lz4"
        self._trailer_magic, self._trailer_struct, self._trailer_counts_keys = TRAILERS[h.format_version]
        self._trailer_size = self._trailer_struct.size + 8
        self._check_schema("key", key_schema, h.key_width, h.key_fingerprint)
        self._check_schema("value", value_schema, h.value_width, h.value_fingerprint)
        if expected_lineage is not None:
            expected = lineage_bytes(expected_lineage, "expected_lineage")
            if expected != h.lineage:
                raise self._corrupt(48, f"lineage mismatch: the delta belongs to {h.lineage.hex()}, "
                                        f"expected {expected.hex()}")

    def __getattr__(self, name):
        return header_field(self, self.header, name)

    cdef void _check_schema(self, str which, schema, Py_ssize_t width, fingerprint) except *:
        if schema is None:
            return
        schema = as_schema(schema)
        if schema.width != width or schema.fingerprint != fingerprint:
            raise SchemaMismatchError(
                f"{which} schema mismatch in delta '{self.path}': the file has {which} rows of {width} "
                f"bytes (fingerprint 0x{fingerprint:016x}), expected {schema.describe()} of "
                f"{schema.width} bytes (fingerprint 0x{schema.fingerprint:016x})")

    # -- blocks -----------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._error is not None:  # the position is lost: never read on past damage
            raise self._error
        cdef Py_ssize_t at = self._pos
        try:
            head = self._take(BLOCK_HEADER_SIZE, "a block header or the trailer")
            if head[:8] == self._trailer_magic:  # a block's first byte is its kind, 1 or 2
                self._read_trailer(at, head)
                raise StopIteration
            return self._read_block(at, head)
        except StopIteration:
            raise
        except BaseException as e:
            self._error = e
            raise

    cdef object _read_block(self, Py_ssize_t at, head, bint decode=True):
        cdef Py_ssize_t record_width, kw = self.header.key_width, vw = self.header.value_width
        kind, reserved1, reserved2, n, raw_size, stored_size, payload_checksum = \
            BLOCK_HEADER_STRUCT.unpack_from(head, 0)
        stored = U64.unpack_from(head, BLOCK_HEADER_SIZE - 8)[0]
        computed = checksum(head[:BLOCK_HEADER_SIZE - 8])
        if stored != computed:
            raise self._corrupt(at, f"block header checksum mismatch (stored 0x{stored:016x}, "
                                    f"computed 0x{computed:016x})")
        if kind != BLOCK_PUTS and kind != BLOCK_REMOVES:
            raise self._corrupt(at, f"unknown block kind {kind}")
        if reserved1 or reserved2:
            raise self._corrupt(at + 1, "reserved block header bytes are not zero")
        record_width = kw + (vw if kind == BLOCK_PUTS else 0)
        if n == 0 or raw_size != n * record_width or raw_size > MAX_BLOCK_RAW_SIZE:
            raise self._corrupt(at + 4, f"a block of {n} records of {record_width} bytes cannot have "
                                        f"{raw_size} raw bytes (at most {MAX_BLOCK_RAW_SIZE})")
        if self._lz4:
            impossible = stored_size == 0 or stored_size > lz4_bound(raw_size)
        else:
            impossible = stored_size != raw_size
        if impossible:
            raise self._corrupt(at + 12, f"a {self.header.compression} block of {raw_size} raw bytes cannot "
                                         f"store {stored_size} bytes")
        payload = self._take(stored_size, "a block payload")
        computed = checksum(payload)
        if computed != payload_checksum:
            raise self._corrupt(at + BLOCK_HEADER_SIZE,
                                f"block payload checksum mismatch (stored 0x{payload_checksum:016x}, "
                                f"computed 0x{computed:016x})")
        if not decode:  # check(decode=False): the stored bytes matched their checksum
            self._block_checksums += U64.pack(payload_checksum)
            self._seen_blocks += 1
            if kind == BLOCK_REMOVES:
                self._seen_removes += n
            else:
                self._seen_puts += n
            return None
        if self._lz4:
            try:
                raw = _lz4_decompress(payload, uncompressed_size=raw_size, return_bytearray=True)
            except _LZ4BlockError as e:
                raise self._corrupt(at + BLOCK_HEADER_SIZE, f"lz4 could not decompress the block: {e}") from None
            if len(raw) != raw_size:
                raise self._corrupt(at + BLOCK_HEADER_SIZE, f"the block decompressed to {len(raw)} bytes, "
                                                            f"expected {raw_size}")
            rows = np.frombuffer(raw, dtype=np.uint8)
        else:
            rows = np.frombuffer(payload, dtype=np.uint8).copy()
        self._block_checksums += U64.pack(payload_checksum)
        self._seen_blocks += 1
        keys = rows[:n * kw].reshape(n, kw)
        if kind == BLOCK_REMOVES:
            self._seen_removes += n
            return (BLOCK_REMOVES, keys, None)
        self._seen_puts += n
        return (BLOCK_PUTS, keys, rows[n * kw:].reshape(n, vw))

    cdef void _read_trailer(self, Py_ssize_t at, head) except *:
        cdef Py_ssize_t size = self._trailer_size
        trailer = bytes(head) + bytes(self._take(size - BLOCK_HEADER_SIZE, "the trailer"))
        fields = self._trailer_struct.unpack_from(trailer, 0)
        n_blocks, n_puts, n_removes, blocks_checksum = fields[1], fields[2], fields[3], fields[-1]
        stored = U64.unpack_from(trailer, size - 8)[0]
        computed = checksum(trailer[:size - 8])
        if stored != computed:
            raise self._corrupt(at, f"trailer checksum mismatch (stored 0x{stored:016x}, "
                                    f"computed 0x{computed:016x})")
        if (n_blocks, n_puts, n_removes) != (self._seen_blocks, self._seen_puts, self._seen_removes):
            raise self._corrupt(at, f"the trailer counts {n_blocks} blocks, {n_puts} puts and {n_removes} "
                                    f"removes; the file holds {self._seen_blocks}, {self._seen_puts} and "
                                    f"{self._seen_removes}")
        computed = checksum(self._block_checksums, self.header.checksum)
        if computed != blocks_checksum:
            raise self._corrupt(at, "blocks checksum mismatch: a block was dropped, reordered or "
                                    f"replaced (stored 0x{blocks_checksum:016x}, computed 0x{computed:016x})")
        if not self._at_end():
            raise self._corrupt(at + size, "bytes follow the trailer")
        if self._trailer_counts_keys and fields[4] != NUM_KEYS_UNKNOWN:
            self._num_keys = fields[4]
        self._done = True

    def check(self, bint decode=True):
        """Read the rest of the delta, checking everything iteration checks, and return
        ``(n_blocks, n_puts, n_removes)``. ``decode=False`` skips decompressing the payloads:
        every stored byte is still checked against its checksum, the counts against the
        trailer and the end of the file, but an lz4 stream that the writer itself got wrong
        (and checksummed) would go unnoticed. Raises as iteration does."""
        cdef Py_ssize_t at
        while not self._done:
            if self._error is not None:
                raise self._error
            at = self._pos
            try:
                head = self._take(BLOCK_HEADER_SIZE, "a block header or the trailer")
                if head[:8] == self._trailer_magic:
                    self._read_trailer(at, head)
                else:
                    self._read_block(at, head, decode)
            except BaseException as e:
                self._error = e
                raise
        return self._seen_blocks, self._seen_puts, self._seen_removes

    # -- state ------------------------------------------------------------------------------
    @property
    def finished(self):
        """True once the trailer and the end of the file were checked."""
        return self._done

    @property
    def n_puts(self):
        """Put records in the delta, once fully read (None before)."""
        return self._seen_puts if self._done else None

    @property
    def n_removes(self):
        """Remove records in the delta, once fully read (None before)."""
        return self._seen_removes if self._done else None

    @property
    def num_keys(self):
        """The key count of the version the delta produces, as its writer recorded it, once
        fully read; None before, and when not recorded (format version 1, or not known)."""
        return self._num_keys

    @property
    def n_blocks(self):
        """Blocks in the delta, once fully read (None before)."""
        return self._seen_blocks if self._done else None


def read_delta(source, key_schema=None, value_schema=None, path=None, expected_lineage=None):
    """All blocks of a delta as a list of ``(kind, keys, values)``, after the whole file,
    trailer included, was checked. Arguments and errors as :class:`DeltaReader`."""
    return list(DeltaReader(source, key_schema, value_schema, path=path, expected_lineage=expected_lineage))


def apply_delta(source, table, path=None, expected_lineage=None, key_schema=None, value_schema=None):
    """Replay a delta onto ``table`` (a RowTable), all or nothing where damage is concerned.

    The whole delta is decoded and checked (every block and the trailer) before the first
    row reaches the table, so a damaged delta leaves the table as it was. A delta is one
    micro-batch of updates, so holding it decoded in memory is fine. The schemas default
    to the table's. A MemoryError while applying leaves the blocks before it applied.

    Returns
    -------
    dict
        ``store_version``, ``lineage``, ``n_puts``, ``n_removes``, ``n_blocks``.
    """
    reader = DeltaReader(source, key_schema if key_schema is not None else table.key_schema,
                         value_schema if value_schema is not None else table.value_schema,
                         path=path, expected_lineage=expected_lineage)
    blocks = list(reader)
    start = 0
    while start < len(blocks):
        kind = blocks[start][0]
        end = start + 1
        while end < len(blocks) and blocks[end][0] == kind:
            end += 1
        # One call per run of same-kind blocks, not per block: a batch put sizes the table
        # once for the whole run instead of growing it step by step, for one more copy of
        # the run. Order is kept.
        run = blocks[start:end]
        keys = run[0][1] if len(run) == 1 else np.concatenate([b[1] for b in run])
        if kind == BLOCK_PUTS:
            table.put_rows(keys, run[0][2] if len(run) == 1 else np.concatenate([b[2] for b in run]))
        else:
            table.remove_rows(keys)
        for i in range(start, end):
            blocks[i] = None  # let the decoded blocks go as they are applied
        del run, keys
        start = end
    return {"store_version": reader.store_version, "lineage": reader.lineage,
            "n_puts": reader.n_puts, "n_removes": reader.n_removes, "n_blocks": reader.n_blocks}
