# cython: language_level=3
"""The delta format, versions 1 and 2: its constants and record layouts, the header (DeltaHeader,
:func:`read_delta_header`, its only parser), and what the headers of both file formats
share: the 16-byte lineage field (:func:`lineage_bytes`), how a parser takes its bytes
(:func:`header_bytes`) and how a reader shows its header's fields (:func:`header_field`).
The format is described in docs/formats.md; ``_delta`` writes and reads it.
"""
cimport cython
from libc.stdint cimport uint64_t

from statecore._hash cimport checksum

import struct
import uuid

from statecore.errors import StateCorruptionError

MAGIC = b"SCDELTA\x01"
FORMAT_VERSION = 2                # what writers write; readers read every version of TRAILERS
HEADER_SIZE = 72
DELTA_HEADER_SIZE = HEADER_SIZE   # what read_delta_header needs: read this many bytes
BLOCK_HEADER_SIZE = 32
TRAILER_MAGIC = b"SCDEND\x00\x02"
TRAILER_SIZE = 56
# The trailer of version 2 records the key count of the version the delta produces; this
# value says the writer did not know it.
NUM_KEYS_UNKNOWN = (1 << 64) - 1
BLOCK_PUTS = 1
BLOCK_REMOVES = 2
COMPRESSION_NONE = 0
COMPRESSION_LZ4 = 1
COMPRESSION_CODES = {"none": COMPRESSION_NONE, "lz4": COMPRESSION_LZ4}
COMPRESSION_NAMES = {COMPRESSION_NONE: "none", COMPRESSION_LZ4: "lz4"}

# The most raw bytes one block may hold: what a reader allocates at most per block, whatever
# a damaged length says. Writers choose smaller blocks (block_bytes); this bounds them all.
MAX_BLOCK_RAW_SIZE = 4 << 20
# Raw bytes per block the writer aims for (why this size: docs/formats.md, measured with
# bench/bench_delta.py).
DEFAULT_BLOCK_BYTES = 512 << 10

HEADER_STRUCT = struct.Struct("<8sHBBIIIQQQ16s")    # bytes 0..63 of the header
BLOCK_HEADER_STRUCT = struct.Struct("<BBHIIIQ")      # bytes 0..23 of a block header
TRAILER_STRUCT = struct.Struct("<8sQQQQQ")           # bytes 0..47 of the trailer
U64 = struct.Struct("<Q")
assert HEADER_STRUCT.size + 8 == HEADER_SIZE and BLOCK_HEADER_STRUCT.size + 8 == BLOCK_HEADER_SIZE
assert TRAILER_STRUCT.size + 8 == TRAILER_SIZE

# Per format version: the trailer's magic, its struct (every field but the final checksum,
# which follows it) and whether it records the key count (between the removes and the
# blocks checksum). Version 1 is version 2 without the key count.
TRAILERS = {
    1: (b"SCDEND\x00\x01", struct.Struct("<8sQQQQ"), False),
    2: (TRAILER_MAGIC, TRAILER_STRUCT, True),
}


cdef bytes sealed(bytes body, uint64_t seed=0):
    """``body`` followed by its xxh64 as u64: how every header and the trailer end."""
    return body + U64.pack(checksum(body, seed))


cdef Py_ssize_t lz4_bound(Py_ssize_t raw_size):
    """The most bytes lz4 block compression can produce from ``raw_size`` bytes (LZ4_COMPRESSBOUND)."""
    return raw_size + raw_size // 255 + 16


cdef bytes lineage_bytes(object lineage, str what):
    """The 16 bytes of a lineage given as bytes-like or a uuid.UUID: the lineage field of a
    delta's or a snapshot's header. TypeError or ValueError naming ``what``."""
    if isinstance(lineage, uuid.UUID):
        return lineage.bytes
    try:
        raw = bytes(memoryview(lineage))
    except TypeError:
        raise TypeError(f"{what} must be 16 bytes or a uuid.UUID, got {type(lineage).__name__}") from None
    if len(raw) != 16:
        raise ValueError(f"{what} must be 16 bytes, got {len(raw)}")
    return raw


cdef bytes header_bytes(data, Py_ssize_t size, name):
    """The header a parser checks: the first ``size`` bytes of ``data`` (bytes-like; bytes
    after them are ignored). Fewer raise StateCorruptionError naming ``name``, "truncated"."""
    view = memoryview(data).cast("B")
    if len(view) < size:
        raise StateCorruptionError(name, len(view), f"truncated: the header needs {size} bytes, "
                                                    f"the file ends after {len(view)}")
    return bytes(view[:size])


cdef object header_field(reader, header, str name):
    """The one rule of both readers' ``__getattr__``: a field of the reader's checked header
    (``store_version``, ``lineage``, ``commit_id``, ...) is the reader's attribute too."""
    if header is not None and not name.startswith("_") and hasattr(type(header), name):
        return getattr(header, name)
    raise AttributeError(f"'{type(reader).__name__}' object has no attribute '{name}'")


@cython.final
cdef class DeltaHeader:
    """The checked header of a delta (:func:`read_delta_header`); immutable.

    ``lineage`` is the 16 bytes the writer was given; the store writes its commit id and
    then its parent's, which ``commit_id`` and ``parent_id`` return.
    """

    @property
    def commit_id(self):
        """lineage[:8]."""
        return self.lineage[:8]

    @property
    def parent_id(self):
        """lineage[8:16]."""
        return self.lineage[8:]

    def __repr__(self):
        return (f"DeltaHeader(format_version={self.format_version}, store_version={self.store_version}, "
                f"lineage={self.lineage.hex()}, "
                f"key_width={self.key_width}, value_width={self.value_width}, "
                f"compression={self.compression!r})")


def read_delta_header(data, path=None):
    """Check and decode the header of a delta: a :class:`DeltaHeader`.

    ``data`` (bytes-like) holds at least the file's first HEADER_SIZE bytes, ``path`` is the
    name errors give (see :func:`header_bytes`). StateCorruptionError if the header is
    truncated, or for a wrong magic, an unknown format version, a checksum mismatch, an
    unknown compression, nonzero reserved bytes or impossible widths.
    """
    name = str(path) if path is not None else "<delta bytes>"
    head = header_bytes(data, HEADER_SIZE, name)
    (magic, version, compression, reserved1, key_width, value_width, reserved2, key_fp, value_fp,
     store_version, lineage) = HEADER_STRUCT.unpack_from(head, 0)
    stored = U64.unpack_from(head, HEADER_SIZE - 8)[0]
    computed = checksum(head[:HEADER_SIZE - 8])
    if magic != MAGIC:
        raise StateCorruptionError(name, 0, f"not a statecore delta: magic {magic!r}, expected {MAGIC!r}")
    if version not in TRAILERS:
        hint = "" if stored == computed else " (or a damaged header: its checksum does not match)"
        raise StateCorruptionError(name, 8, f"unknown delta format version {version}; this build reads "
                                            f"versions {', '.join(map(str, sorted(TRAILERS)))}{hint}")
    if stored != computed:
        raise StateCorruptionError(name, HEADER_SIZE - 8, f"header checksum mismatch (stored 0x{stored:016x}, "
                                                          f"computed 0x{computed:016x})")
    if compression not in COMPRESSION_NAMES:
        raise StateCorruptionError(name, 10, f"unknown compression code {compression}")
    if reserved1 or reserved2:
        raise StateCorruptionError(name, 11, "reserved header bytes are not zero")
    if key_width == 0:
        raise StateCorruptionError(name, 12, "key width is 0")
    if key_width + value_width > MAX_BLOCK_RAW_SIZE:
        raise StateCorruptionError(name, 12, f"rows of {key_width + value_width} bytes exceed the "
                                             f"{MAX_BLOCK_RAW_SIZE}-byte block limit")
    cdef DeltaHeader h = DeltaHeader.__new__(DeltaHeader)
    h.format_version = version
    h.store_version = store_version
    h.lineage = lineage
    h.compression = COMPRESSION_NAMES[compression]
    h.key_width = key_width
    h.value_width = value_width
    h.key_fingerprint = key_fp
    h.value_fingerprint = value_fp
    h.checksum = stored
    return h
