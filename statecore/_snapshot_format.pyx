# cython: language_level=3
"""The snapshot formats: version 1 (the image: its constants, the header and footer, encoded
here and checked here, and the layout every offset follows from) and version 2 (the packed
container: an image's header page, then the rest of the image in lz4 blocks; its header,
block table and footer, encoded and checked here). The formats are described in
docs/formats.md; the slot index inside an image follows the rule of ``_probe.pxd``.

:func:`read_snapshot_header` is the only parser of either header (the reader uses it, then
:func:`check_footer`; ``_snapshot_pack`` then :func:`check_pack_footer` and
:func:`pack_table`); the writers encode them with :func:`header_page`, :func:`footer_bytes`
and :func:`pack_header_bytes`, :func:`pack_table_bytes`, :func:`pack_footer_bytes`.
"""
cimport cython
from libc.stdint cimport uint32_t, uint64_t

from statecore cimport _probe
from statecore._delta_format cimport header_bytes, lz4_bound
from statecore._hash cimport HASH_ID_XXH64, checksum

import json
import os
import struct

from statecore.errors import StateCorruptionError
from statecore.schema import RowSchema

MAGIC = b"SCSNAP\0\x01"
FOOTER_MAGIC = b"SCSNEND\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
FOOTER_SIZE = 64
DEFAULT_BLOCK_SIZE = 65536
MIN_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 1 << 30
MIN_SLOTS = _probe.MIN_SLOTS
SLOTS_ALIGN = 64
MAX_ROWS = _probe.MAX_ROWS

# The fixed fields of the header, then of the footer (offsets in docs/formats.md).
_HEADER = struct.Struct("<8sIIIIQQQQQIIIQQQQQ16sI")
_FOOTER = struct.Struct("<8sQQQI20x")
_U64 = struct.Struct("<Q")
_HEADER_CHECKSUM_AT = HEADER_SIZE - 8
_FOOTER_CHECKSUM_AT = FOOTER_SIZE - 8
_MAX_SCHEMA_JSON = _HEADER_CHECKSUM_AT - _HEADER.size

assert _HEADER.size == 136 and _FOOTER.size == 56

# Version 2, the packed container (docs/formats.md, "Snapshot, version 2").
PACKED_FORMAT_VERSION = 2
PACK_HEADER_SIZE = 64
PACK_FOOTER_SIZE = 64
PACK_ENTRY_SIZE = 16
PACK_FOOTER_MAGIC = b"SCPKEND\x02"
PACK_CODEC_LZ4 = 1
PACK_STORED_RAW = 0     # a block's method: its bytes as they are (lz4 would not shrink them)
PACK_STORED_LZ4 = 1     # lz4 block format, no size prefix
DEFAULT_PACK_BLOCK_SIZE = 256 << 10
MIN_PACK_BLOCK_SIZE = 4096
MAX_PACK_BLOCK_SIZE = 16 << 20   # what an unpacker allocates per block at most, whatever a header says
# What read_snapshot_header needs of either version: read this many bytes.
SNAPSHOT_HEADER_SIZE = PACK_HEADER_SIZE + HEADER_SIZE
_PACK_HEADER = struct.Struct("<8sIIIIQQQQ")
_PACK_FOOTER = struct.Struct("<8sQQQQ16x")
_PACK_ENTRY = struct.Struct("<IB3sQ")
assert _PACK_HEADER.size + 8 == PACK_HEADER_SIZE and _PACK_FOOTER.size + 8 == PACK_FOOTER_SIZE
assert _PACK_ENTRY.size == PACK_ENTRY_SIZE


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def is_block_size(n):
    """Whether ``n`` is a block size the format allows."""
    return _is_pow2(n) and MIN_BLOCK_SIZE <= n <= MAX_BLOCK_SIZE


cdef dict layout(row_count, key_width, value_width, block_size, n_slots=None):
    """Every size and offset of a snapshot, from what its header states up front (Python
    ints: no overflow, whatever a damaged header says). ``n_slots`` defaults to the fewest
    that hold ``row_count`` keys."""
    if n_slots is None:
        n_slots = _probe.slots_for(row_count, MIN_SLOTS)
    rows_end = HEADER_SIZE + row_count * (key_width + value_width)
    slots_offset = -(-rows_end // SLOTS_ALIGN) * SLOTS_ALIGN
    checksums_offset = slots_offset + n_slots * 8
    n_blocks = -(-(checksums_offset - HEADER_SIZE) // block_size)
    return {
        "n_slots": n_slots, "rows_offset": HEADER_SIZE, "rows_end": rows_end, "slots_offset": slots_offset,
        "checksums_offset": checksums_offset, "n_blocks": n_blocks,
        "file_size": checksums_offset + n_blocks * 8 + FOOTER_SIZE,
    }


def _schema_json(key_schema, value_schema):
    return json.dumps({"key": key_schema.describe(), "value": value_schema.describe()},
                      separators=(",", ":")).encode("utf-8")


cdef bytes header_page(key_schema, value_schema, store_version, row_count, bytes lineage, block_size,
                       dict plan, uint64_t* checksum_out):
    """The header page; ``checksum_out`` gets its checksum. ValueError if the schemas'
    description does not fit."""
    schema_json = _schema_json(key_schema, value_schema)
    if len(schema_json) > _MAX_SCHEMA_JSON:
        raise ValueError(f"the schemas' description is {len(schema_json)} bytes; a snapshot header "
                         f"holds at most {_MAX_SCHEMA_JSON}")
    header = bytearray(HEADER_SIZE)
    _HEADER.pack_into(header, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, key_schema.width, value_schema.width,
                      key_schema.fingerprint, value_schema.fingerprint, store_version, row_count,
                      plan["n_slots"], HASH_ID_XXH64, 0, block_size, plan["n_blocks"], plan["rows_offset"],
                      plan["slots_offset"], plan["checksums_offset"], plan["file_size"], lineage,
                      len(schema_json))
    header[_HEADER.size:_HEADER.size + len(schema_json)] = schema_json
    checksum_out[0] = checksum(header[:_HEADER_CHECKSUM_AT])
    _U64.pack_into(header, _HEADER_CHECKSUM_AT, checksum_out[0])
    return bytes(header)


cdef bytes footer_bytes(uint64_t table_checksum, uint64_t file_size, uint64_t header_checksum,
                        uint32_t max_displacement):
    footer = bytearray(FOOTER_SIZE)
    _FOOTER.pack_into(footer, 0, FOOTER_MAGIC, table_checksum, file_size, header_checksum, max_displacement)
    _U64.pack_into(footer, _FOOTER_CHECKSUM_AT, checksum(footer[:_FOOTER_CHECKSUM_AT]))
    return bytes(footer)


# -- the header ---------------------------------------------------------------------------
@cython.final
cdef class PackedHeader:
    """The checked container header of a packed snapshot (version 2); immutable. The image
    it holds is ``image_size`` bytes: its header page, stored as it is after this header,
    then ``n_blocks`` blocks of ``block_size`` image bytes (the last one short)."""

    def __repr__(self):
        return (f"PackedHeader(image_size={self.image_size}, block_size={self.block_size}, "
                f"n_blocks={self.n_blocks})")


@cython.final
cdef class SnapshotHeader:
    """The checked header of a snapshot (:func:`read_snapshot_header`); immutable.

    ``lineage`` is the 16 bytes the writer was given; the store writes its commit id first,
    which ``commit_id`` returns.
    """

    @property
    def commit_id(self):
        """lineage[:8]."""
        return self.lineage[:8]

    def __repr__(self):
        return (f"SnapshotHeader(store_version={self.store_version}, lineage={self.lineage.hex()}, "
                f"row_count={self.row_count}, key_width={self.key_width}, "
                f"value_width={self.value_width}, file_size={self.file_size})")


def read_snapshot_header(data, path=None):
    """Check and decode the header of a snapshot of either version: a :class:`SnapshotHeader`.

    ``data`` (bytes-like) holds at least the file's first HEADER_SIZE bytes (an image,
    version 1) or SNAPSHOT_HEADER_SIZE bytes (a packed snapshot, version 2: its container
    header, then its image's header page); reading SNAPSHOT_HEADER_SIZE bytes serves both.
    ``path`` is the name errors give (see ``_delta_format.header_bytes``). The header
    describes the image either way; ``packed`` is the container's :class:`PackedHeader`, or
    None for an image. StateCorruptionError if the header is truncated, or if any check of
    what the header alone decides fails: magic, format version, checksums, header size,
    codec, hash id, reserved fields, widths, and every size and offset against each other
    (a reader then checks them against the file and its footer).
    """
    name = os.fspath(path) if path is not None else "<snapshot bytes>"
    view = memoryview(data).cast("B")
    if (len(view) >= 12 and view[:8] == MAGIC
            and int.from_bytes(view[8:12], "little") == PACKED_FORMAT_VERSION):
        return _packed_header(header_bytes(view, SNAPSHOT_HEADER_SIZE, name), name)
    return _image_header(header_bytes(view, HEADER_SIZE, name), name, 0)


def _checked_sum(buf, at, path, offset, what):
    """The u64 checksum stored at ``at`` in ``buf`` (a header or footer read from byte
    ``offset`` of ``path``), which must be the checksum of the bytes before it."""
    stored = _U64.unpack_from(buf, at)[0]
    actual = checksum(buf[:at])
    if stored != actual:
        raise StateCorruptionError(path, offset + at, f"{what} checksum mismatch "
                                                      f"(expected 0x{stored:016x}, got 0x{actual:016x})")
    return stored


def _packed_header(bytes head, name):
    """The checked header of a packed snapshot: the container header, then the image's page."""
    def corrupt(offset, reason):
        return StateCorruptionError(name, offset, reason)

    (_, _, header_size, codec, block_size, image_size, n_blocks, page_checksum,
     reserved) = _PACK_HEADER.unpack_from(head)
    stored = _checked_sum(head, _PACK_HEADER.size, name, 0, "container header")
    if header_size != PACK_HEADER_SIZE:
        raise corrupt(12, f"container header size {header_size} (expected {PACK_HEADER_SIZE})")
    if codec != PACK_CODEC_LZ4:
        raise corrupt(16, f"unknown snapshot codec {codec} (this reader knows {PACK_CODEC_LZ4}, lz4)")
    if not (_is_pow2(block_size) and MIN_PACK_BLOCK_SIZE <= block_size <= MAX_PACK_BLOCK_SIZE):
        raise corrupt(20, f"packed block size {block_size} is not a power of two in "
                          f"[{MIN_PACK_BLOCK_SIZE}, {MAX_PACK_BLOCK_SIZE}]")
    if reserved != 0:
        raise corrupt(48, f"reserved container header field is {reserved}, not 0")
    cdef SnapshotHeader h = _image_header(head[PACK_HEADER_SIZE:], name, PACK_HEADER_SIZE)
    if page_checksum != h.checksum:
        raise corrupt(40, f"the container names header page 0x{page_checksum:016x}, "
                          f"it holds 0x{h.checksum:016x}")
    if image_size != h.file_size:
        raise corrupt(24, f"the container holds an image of {image_size} bytes, its header page "
                          f"says {h.file_size}")
    expected_blocks = -(-(image_size - HEADER_SIZE) // block_size)
    if n_blocks != expected_blocks:
        raise corrupt(32, f"{n_blocks} packed blocks (expected {expected_blocks} of {block_size} bytes)")
    cdef PackedHeader ph = PackedHeader.__new__(PackedHeader)
    ph.block_size = block_size
    ph.image_size = image_size
    ph.n_blocks = n_blocks
    ph.checksum = stored
    h.packed = ph
    h.format_version = PACKED_FORMAT_VERSION
    return h


def _image_header(bytes header, name, base):
    """The checked header page of an image, found at byte ``base`` of the file (errors name
    offsets in the file)."""
    def corrupt(offset, reason):
        return StateCorruptionError(name, base + offset, reason)

    if header[:8] != MAGIC:
        raise corrupt(0, f"bad magic {header[:8]!r} (expected {MAGIC!r}): not a snapshot")
    (_, version, header_size, kw, vw, key_fp, value_fp, store_version, row_count, n_slots, hash_id,
     reserved, block_size, n_blocks, rows_offset, slots_offset, checksums_offset, file_size,
     lineage, json_len) = _HEADER.unpack_from(header)
    if version != FORMAT_VERSION:
        raise corrupt(8, f"unknown snapshot format version {version} (this reader knows versions "
                         f"{FORMAT_VERSION} and {PACKED_FORMAT_VERSION})")
    stored = _checked_sum(header, _HEADER_CHECKSUM_AT, name, base, "header")
    # Sizes and offsets against each other and against the layout (Python ints: no overflow).
    if header_size != HEADER_SIZE:
        raise corrupt(12, f"header size {header_size} (expected {HEADER_SIZE})")
    if hash_id != HASH_ID_XXH64:
        raise corrupt(64, f"unknown key hash id {hash_id} (this reader knows {HASH_ID_XXH64}, XXH64)")
    if reserved != 0:
        raise corrupt(68, f"reserved header field is {reserved}, not 0")
    if kw == 0:
        raise corrupt(16, "key width is 0")
    if row_count > MAX_ROWS:
        raise corrupt(48, f"row count {row_count} is more than a snapshot holds ({MAX_ROWS})")
    if n_slots < MIN_SLOTS or not _is_pow2(n_slots):
        raise corrupt(56, f"slot count {n_slots} is not a power of two >= {MIN_SLOTS}")
    if n_slots < _probe.slots_for(row_count, MIN_SLOTS):
        raise corrupt(56, f"{n_slots} slots cannot hold {row_count} rows at 3/4 load")
    if not is_block_size(block_size):
        raise corrupt(72, f"block size {block_size} is not a power of two in "
                          f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    if rows_offset != HEADER_SIZE:
        raise corrupt(84, f"rows section at byte {rows_offset} (expected {HEADER_SIZE})")
    plan = layout(row_count, kw, vw, block_size, n_slots)
    if slots_offset != plan["slots_offset"]:
        raise corrupt(92, f"slots section at byte {slots_offset} (expected {plan['slots_offset']}: "
                          f"{row_count} rows of {kw + vw} bytes end at byte {plan['rows_end']})")
    if checksums_offset != plan["checksums_offset"]:
        raise corrupt(100, f"checksums section at byte {checksums_offset} "
                           f"(expected {plan['checksums_offset']})")
    if n_blocks != plan["n_blocks"]:
        raise corrupt(76, f"{n_blocks} blocks (expected {plan['n_blocks']} of {block_size} bytes)")
    if file_size != plan["file_size"]:
        raise corrupt(108, f"the sections end at byte {plan['file_size'] - FOOTER_SIZE}, but the footer "
                           f"is at byte {file_size - FOOTER_SIZE}")
    if json_len > _MAX_SCHEMA_JSON:
        raise corrupt(132, f"schema description of {json_len} bytes does not fit the header")
    try:
        described = json.loads(header[_HEADER.size:_HEADER.size + json_len].decode("utf-8"))
        key_schema = RowSchema.from_description(described["key"])
        value_schema = RowSchema.from_description(described["value"])
    except Exception as e:  # behind a valid checksum: only a broken writer gets here
        raise corrupt(_HEADER.size, f"unreadable schema description: {e!r}") from None
    if key_schema.width != kw or value_schema.width != vw:
        raise corrupt(_HEADER.size, f"the schema description gives rows of {key_schema.width} + "
                                    f"{value_schema.width} bytes, the header {kw} + {vw}")
    if key_schema.fingerprint != key_fp or value_schema.fingerprint != value_fp:
        raise corrupt(_HEADER.size, "the schema description does not match the header's fingerprints")
    cdef SnapshotHeader h = SnapshotHeader.__new__(SnapshotHeader)
    h.store_version = store_version
    h.lineage = lineage
    h.row_count = row_count
    h.key_width = kw
    h.value_width = vw
    h.key_fingerprint = key_fp
    h.value_fingerprint = value_fp
    h.key_schema = key_schema
    h.value_schema = value_schema
    h.file_size = file_size
    h.n_slots = n_slots
    h.block_size = block_size
    h.n_blocks = n_blocks
    h.rows_offset = rows_offset
    h.slots_offset = slots_offset
    h.checksums_offset = checksums_offset
    h.checksum = stored
    h.format_version = FORMAT_VERSION
    h.packed = None
    return h


cdef SnapFooter check_footer(bytes footer, size, SnapshotHeader h, path) except *:
    """Check the footer of a file of ``size`` bytes against itself, the file and the checked
    header ``h``; StateCorruptionError naming ``path`` if anything is wrong."""
    cdef SnapFooter f
    if h.file_size != size:
        raise StateCorruptionError(path, 108, f"the header says the file is {h.file_size} bytes, "
                                              f"but it is {size} bytes")
    footer_at = size - FOOTER_SIZE
    if footer[:8] != FOOTER_MAGIC:
        raise StateCorruptionError(path, footer_at, f"bad footer magic {footer[:8]!r} "
                                                    f"(expected {FOOTER_MAGIC!r})")
    stored = _checked_sum(footer, _FOOTER_CHECKSUM_AT, path, footer_at, "footer")
    _, table_checksum, file_size, header_checksum, max_displacement = _FOOTER.unpack_from(footer)
    if file_size != size:
        raise StateCorruptionError(path, footer_at + 16, f"the footer says the file is {file_size} "
                                                         f"bytes, but it is {size} bytes")
    if header_checksum != h.checksum:
        raise StateCorruptionError(path, footer_at + 24, "the footer belongs to another header")
    if max_displacement >= h.n_slots:
        raise StateCorruptionError(path, footer_at + 32, f"max displacement {max_displacement} is not "
                                                         f"below the {h.n_slots} slots")
    f.table_checksum = table_checksum
    f.checksum = stored
    f.max_displacement = max_displacement
    return f


# -- the packed container (version 2) -------------------------------------------------------
def pack_header_bytes(block_size, image_size, bytes page):
    """The container header of a packed snapshot of the image whose header page is ``page``
    (``image_size`` bytes in all, stored in blocks of ``block_size``)."""
    n_blocks = -(-(image_size - HEADER_SIZE) // block_size)
    page_checksum = _U64.unpack_from(page, _HEADER_CHECKSUM_AT)[0]
    body = _PACK_HEADER.pack(MAGIC, PACKED_FORMAT_VERSION, PACK_HEADER_SIZE, PACK_CODEC_LZ4, block_size,
                             image_size, n_blocks, page_checksum, 0)
    return body + _U64.pack(checksum(body))


def pack_entry_bytes(stored_size, method, uint64_t stored_checksum):
    """One entry of the block table: the stored size, the method, the stored bytes' xxh64."""
    return _PACK_ENTRY.pack(stored_size, method, bytes(3), stored_checksum)


def pack_table_checksum(table, PackedHeader ph):
    """The block table's checksum, seeded with the container header's (it ties the table to it)."""
    return checksum(table, ph.checksum)


def pack_footer_bytes(file_size, table_checksum, PackedHeader ph, image_footer_checksum):
    body = _PACK_FOOTER.pack(PACK_FOOTER_MAGIC, file_size, table_checksum, ph.checksum, image_footer_checksum)
    return body + _U64.pack(checksum(body))


def pack_table_offset(size, SnapshotHeader h):
    """Where the block table of a packed snapshot of ``size`` bytes starts."""
    return size - PACK_FOOTER_SIZE - h.packed.n_blocks * PACK_ENTRY_SIZE


def check_pack_footer(footer, size, SnapshotHeader h, path):
    """Check the footer of a packed snapshot of ``size`` bytes against itself, the file and
    the checked header ``h``: ``(table_checksum, image_footer_checksum)``.
    StateCorruptionError naming ``path`` if anything is wrong."""
    cdef PackedHeader ph = h.packed
    least = SNAPSHOT_HEADER_SIZE + ph.n_blocks * PACK_ENTRY_SIZE + PACK_FOOTER_SIZE
    if size < least:
        raise StateCorruptionError(path, size, f"the file is {size} bytes; a packed snapshot of "
                                               f"{ph.n_blocks} blocks has at least {least}")
    footer_at = size - PACK_FOOTER_SIZE
    if footer[:8] != PACK_FOOTER_MAGIC:
        raise StateCorruptionError(path, footer_at, f"bad footer magic {bytes(footer[:8])!r} "
                                                    f"(expected {PACK_FOOTER_MAGIC!r})")
    _checked_sum(footer, _PACK_FOOTER.size, path, footer_at, "footer")
    _, file_size, table_checksum, header_checksum, image_footer_checksum = _PACK_FOOTER.unpack_from(footer)
    if file_size != size:
        raise StateCorruptionError(path, footer_at + 8, f"the footer says the file is {file_size} "
                                                        f"bytes, but it is {size} bytes")
    if header_checksum != ph.checksum:
        raise StateCorruptionError(path, footer_at + 24, "the footer belongs to another container header")
    return table_checksum, image_footer_checksum


def pack_table(table, size, SnapshotHeader h, table_checksum, path):
    """Check the block table of a packed snapshot of ``size`` bytes (``table``: its bytes)
    against the footer's checksum and the layout: ``[(offset, stored_size, method,
    stored_checksum, raw_size)]``, one per block, in image order. StateCorruptionError
    naming ``path`` and the entry if anything is wrong."""
    cdef PackedHeader ph = h.packed
    at = pack_table_offset(size, h)
    actual = checksum(table, ph.checksum)
    if actual != table_checksum:
        raise StateCorruptionError(path, at, f"block table does not match the footer "
                                             f"(expected 0x{table_checksum:016x}, got 0x{actual:016x})")
    blocks = []
    offset = SNAPSHOT_HEADER_SIZE
    left = ph.image_size - HEADER_SIZE
    for i in range(ph.n_blocks):
        stored_size, method, reserved, stored_checksum = _PACK_ENTRY.unpack_from(table, i * PACK_ENTRY_SIZE)
        entry_at = at + i * PACK_ENTRY_SIZE
        raw_size = min(ph.block_size, left)
        left -= raw_size
        if reserved != bytes(3):
            raise StateCorruptionError(path, entry_at + 5, f"block {i}: reserved bytes are not 0")
        if method == PACK_STORED_RAW:
            possible = stored_size == raw_size
        elif method == PACK_STORED_LZ4:
            possible = 0 < stored_size <= lz4_bound(raw_size)
        else:
            raise StateCorruptionError(path, entry_at + 4, f"block {i}: unknown method {method}")
        if not possible:
            raise StateCorruptionError(path, entry_at, f"block {i}: {stored_size} stored bytes cannot "
                                                       f"hold {raw_size} image bytes")
        blocks.append((offset, stored_size, method, stored_checksum, raw_size))
        offset += stored_size
    if offset != at:
        raise StateCorruptionError(path, at, f"the stored blocks end at byte {offset}, the table "
                                             f"starts at byte {at}")
    return blocks
