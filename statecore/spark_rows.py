"""The bytes of Spark's HDFSBackedStateStoreProvider files, read without Spark: the lz4-java
block stream a delta or snapshot is compressed in, the records inside it, and the UnsafeRow
columns of their keys and values. :mod:`statecore.spark_import` builds the import on these.

What the formats are (checked against files Spark 4.3 wrote; described in
``docs/spark-state-store.md``, "The bytes of Spark's files"):

- the stream is a run of blocks, each ``b"LZ4Block"``, a token (method ``0x10`` stored or
  ``0x20`` lz4, ored with a level), the compressed and original lengths and an XXH32
  checksum (seed ``0x9747B28C``, top 4 bits cleared) of the original bytes, all int32
  little-endian, then the data; an end block has token method ``0x10`` and three zeros;
- inside, records are ``keyLen keyBytes valueLen valueBytes`` with big-endian int32
  lengths, a value length below 0 for a remove, and ``-1`` in the key length at the end;
- an UnsafeRow is a null bitset of ``ceil(n/64)`` 8-byte words, one 8-byte word per field
  (fixed-width values little-endian in the low bytes, variable-length ones as
  ``offset << 32 | length`` into the row), then the variable-length bytes.

Every row Spark writes is a multiple of 8 bytes long, so every record starts at a multiple
of 8 in the stream: :func:`records` reads files of equal-length puts (fixed-width schemas:
every snapshot, most deltas) at a fixed stride, finds the chain of records of the others
with numpy over the 8-aligned positions (pointer doubling), and falls back to a loop only
for files that break the rule (Spark before 2.3 appended 4 stray bytes to values).
"""
import struct
import zlib

import lz4.block
import numpy as np
import xxhash

__all__ = ["SparkFileError", "lz4_stream", "check_hadoop_crc", "max_crc_bytes", "records", "Records", "FieldType",
           "field_type", "RowColumns", "row_columns", "MAX_SPARK_FILE_BYTES"]

LZ4_MAGIC = b"LZ4Block"
_LZ4_HEADER = struct.Struct("<iii")  # compressed length, original length, checksum (after magic and token)
_LZ4_HEADER_SIZE = len(LZ4_MAGIC) + 1 + _LZ4_HEADER.size
_LZ4_SEED = 0x9747B28C
_METHOD_RAW, _METHOD_LZ4 = 0x10, 0x20
_HADOOP_CRC_MAGIC = b"crc\x00"
# The most bytes of a delta or snapshot read, and of what its lz4 blocks hold once decompressed:
# the import holds a file whole in memory (twice, with its records), so the size is checked
# before a byte is read (a sparse or endless file is refused, not read until memory runs out)
# and each block's stated length before it is decompressed.
MAX_SPARK_FILE_BYTES = 2 << 30


class SparkFileError(ValueError):
    """A Spark state file is not what its format says (the message names the file)."""


def lz4_stream(data, where):
    """The bytes an lz4-java block stream (``LZ4BlockOutputStream``) holds, every block's
    checksum checked; several streams one after another are read as one, as Spark does."""
    view = memoryview(data)
    out = []
    pos, ended, total = 0, False, 0
    while pos < len(view):
        if view[pos:pos + 8] != LZ4_MAGIC or pos + _LZ4_HEADER_SIZE > len(view):
            raise SparkFileError(f"{where}: no lz4 block at byte {pos} (not an lz4-compressed Spark state file, "
                                 f"or a damaged one)")
        token = view[pos + 8]
        compressed, original, checksum = _LZ4_HEADER.unpack_from(view, pos + 9)
        start = pos + _LZ4_HEADER_SIZE
        method = token & 0xF0
        if compressed < 0 or original < 0 or start + compressed > len(view):
            raise SparkFileError(f"{where}: the lz4 block at byte {pos} claims {compressed} bytes; the file is "
                                 f"truncated or damaged")
        if compressed == 0 and original == 0 and method == _METHOD_RAW:
            ended, pos = True, start  # the end block; another stream may follow
            continue
        total += original
        if total > MAX_SPARK_FILE_BYTES:
            raise SparkFileError(f"{where}: its lz4 blocks hold more than {MAX_SPARK_FILE_BYTES} bytes "
                                 f"(MAX_SPARK_FILE_BYTES), more than import-spark reads of one file")
        ended = False
        body = view[start:start + compressed]
        if method == _METHOD_RAW and compressed == original:
            block = bytes(body)
        elif method == _METHOD_LZ4:
            try:
                block = lz4.block.decompress(body, uncompressed_size=original)
            except lz4.block.LZ4BlockError as e:
                raise SparkFileError(f"{where}: the lz4 block at byte {pos} does not decompress: {e}") from None
        else:
            raise SparkFileError(f"{where}: the lz4 block at byte {pos} has token {token:#x} and lengths "
                                 f"{compressed}/{original}: not a block lz4-java writes")
        if len(block) != original or xxhash.xxh32_intdigest(block, _LZ4_SEED) & 0x0FFFFFFF != checksum:
            raise SparkFileError(f"{where}: the lz4 block at byte {pos} fails its checksum: the file is damaged")
        out.append(block)
        pos = start + compressed
    if not ended:
        raise SparkFileError(f"{where}: the lz4 stream has no end block: the file is truncated")
    return b"".join(out)


def max_crc_bytes(size):
    """The most bytes the Hadoop checksum file of a ``size``-byte file can hold: its 8-byte
    header and a 4-byte checksum per chunk, of at least one byte each."""
    return 8 + 4 * size


def check_hadoop_crc(data, crc, where):
    """Check ``data`` against its Hadoop checksum file (``.<name>.crc``: ``b"crc\\0"``, the
    bytes per checksum, then a big-endian CRC32 of each chunk), which Spark's local file
    system writes beside every file."""
    if len(crc) < 8 or crc[:4] != _HADOOP_CRC_MAGIC:
        raise SparkFileError(f"{where}: its checksum file is not a Hadoop .crc file")
    chunk = int.from_bytes(crc[4:8], "big")
    sums = np.frombuffer(crc, ">u4", offset=8, count=(len(crc) - 8) // 4)
    if chunk <= 0 or len(sums) != -(-len(data) // chunk):
        raise SparkFileError(f"{where}: its checksum file covers another length ({len(sums)} chunks of {chunk} "
                             f"bytes for {len(data)} bytes)")
    view = memoryview(data)
    for i, expected in enumerate(sums.tolist()):  # one call per chunk (512 bytes), not per row
        if zlib.crc32(view[i * chunk:(i + 1) * chunk]) != expected:
            raise SparkFileError(f"{where}: bytes {i * chunk}..{min(len(data), (i + 1) * chunk)} fail the file's "
                                 f".crc checksum: the file is damaged")


class Records:
    """The records of one decompressed file, in file order: ``key_starts``, ``key_lengths``,
    ``value_starts``, ``value_lengths`` (int64 arrays into ``buffer``, a uint8 array); a
    value length of -1 is a remove."""

    def __init__(self, buffer, key_starts, key_lengths, value_starts, value_lengths):
        self.buffer = buffer
        self.key_starts, self.key_lengths = key_starts, key_lengths
        self.value_starts, self.value_lengths = value_starts, value_lengths

    def __len__(self):
        return len(self.key_starts)

    @property
    def removes(self):
        return self.value_lengths < 0


def records(payload, where, snapshot=False):
    """The :class:`Records` of a decompressed delta or snapshot (``snapshot``: removes are
    an error, as Spark's reader has them)."""
    buffer = np.frombuffer(payload, np.uint8)
    found = _records_uniform(buffer)
    if found is None:
        found = _records_aligned(buffer)
    if found is None:
        found = _records_loop(payload, where)
    key_starts, key_lengths, value_lengths = found
    value_starts = key_starts + key_lengths + 4
    if snapshot and (value_lengths < 0).any():
        raise SparkFileError(f"{where}: Error reading snapshot file: value size cannot be "
                             f"{int(value_lengths[value_lengths < 0][0])}")
    value_lengths = np.where(value_lengths < 0, -1, value_lengths // 8 * 8)  # Spark's rounding (pre-2.3 rows)
    return Records(buffer, key_starts, key_lengths, value_starts, value_lengths)


def _records_uniform(buffer):
    """``(key_starts, key_lengths, value_lengths)`` when every record is a put with the first
    record's key and value lengths (fixed-width schemas without removes: every snapshot and
    most deltas), checked at every stride in one numpy pass; None otherwise."""
    size = len(buffer)
    if size < 4 or size % 4:
        return None
    words = buffer.view(">i4")
    key_length = int(words[0])
    if key_length < 0 or key_length % 8 or 4 + key_length + 4 > size - 4:
        return None
    value_length = int(words[(4 + key_length) // 4])
    stride = 8 + key_length + value_length
    if value_length < 0 or value_length % 8 or (size - 4) % stride or words[-1] != -1:
        return None
    starts = np.arange(0, size - 4, stride, dtype=np.int64)
    if not ((words[starts // 4] == key_length).all() and (words[(starts + 4 + key_length) // 4] == value_length).all()):
        return None
    count = len(starts)
    return starts + 4, np.full(count, key_length, np.int64), np.full(count, value_length, np.int64)


def _records_aligned(buffer):
    """``(key_starts, key_lengths, value_lengths)`` when every record starts at a multiple of
    8 and the chain from byte 0 ends at a -1; None otherwise (the loop then reads it and
    names what is wrong). Node ``i`` is byte ``8 i``; each node's successor is where the
    record starting there would end, and doubling the jumps marks the chain from node 0 in
    log2(records) numpy passes."""
    size = len(buffer)
    if size < 4 or size % 4:
        return None
    words = buffer.view(">i4")
    nodes = np.arange(0, size - 3, 8, dtype=np.int64)
    count = len(nodes)
    end_node, bad_node = count, count + 1
    key_lengths = words[nodes // 4].astype(np.int64)
    value_at = nodes + 4 + key_lengths
    ok = (key_lengths >= 0) & (key_lengths % 8 == 0) & (value_at + 4 <= size)
    value_lengths = np.full(count, -1, np.int64)
    value_lengths[ok] = words[value_at[ok] // 4]
    ends = value_at + 4 + np.maximum(value_lengths, 0)
    ok &= ((value_lengths % 8 == 0) | (value_lengths < 0)) & (ends <= size)
    successor = np.where(ok & (ends // 8 < count), ends // 8, bad_node)  # room left for the -1 at least
    successor = np.where(key_lengths == -1, end_node, successor)
    successor = np.append(successor, [end_node, bad_node])
    on_chain = np.zeros(count + 2, np.bool_)
    on_chain[0] = True
    jump = successor
    while not (on_chain[end_node] or on_chain[bad_node]):
        on_chain[jump[on_chain]] = True
        jump = jump[jump]
    if on_chain[bad_node]:
        return None
    chain = np.flatnonzero(on_chain[:count])
    chain = chain[key_lengths[chain] != -1]
    return nodes[chain] + 4, key_lengths[chain], value_lengths[chain]


def _records_loop(payload, where):
    """The records one at a time (files whose records are not 8-aligned, and damaged ones:
    this names the damage)."""
    key_starts, key_lengths, value_lengths = [], [], []
    pos, size = 0, len(payload)
    while True:
        if pos + 4 > size:
            raise SparkFileError(f"{where}: the records end at byte {pos} without the -1 end marker: the file is "
                                 f"truncated")
        key_length = int.from_bytes(payload[pos:pos + 4], "big", signed=True)
        if key_length == -1:
            break
        if key_length < 0:
            raise SparkFileError(f"{where}: key size cannot be {key_length} (byte {pos})")
        value_at = pos + 4 + key_length
        if value_at + 4 > size:
            raise SparkFileError(f"{where}: the record at byte {pos} runs past the end: the file is truncated")
        value_length = int.from_bytes(payload[value_at:value_at + 4], "big", signed=True)
        end = value_at + 4 + max(value_length, 0)
        if end > size:
            raise SparkFileError(f"{where}: the record at byte {pos} runs past the end: the file is truncated")
        key_starts.append(pos + 4)
        key_lengths.append(key_length)
        value_lengths.append(value_length)
        pos = end
    return (np.array(key_starts, np.int64), np.array(key_lengths, np.int64), np.array(value_lengths, np.int64))


# -- UnsafeRow columns -----------------------------------------------------------------------

class FieldType:
    """How a Spark field is stored in a row: ``dtype`` (numpy, for fixed-width fields) or
    ``variable`` (string or binary, stored after the fixed part); ``spark`` is its
    ``simpleString`` (as a DataFrame's column type reads)."""

    def __init__(self, spark, dtype=None, variable=False):
        self.spark, self.dtype, self.variable = spark, None if dtype is None else np.dtype(dtype), variable

    def __repr__(self):
        return f"FieldType({self.spark})"


# Spark's DataType JSON names of the fixed-width types, their numpy dtype in a row word, and
# their simpleString. timestamp and timestamp_ntz are microseconds, date days, since 1970.
_FIXED = {"integer": ("int", "<i4"), "long": ("bigint", "<i8"), "short": ("smallint", "<i2"),
          "byte": ("tinyint", "i1"), "boolean": ("boolean", "?"), "float": ("float", "<f4"),
          "double": ("double", "<f8"), "timestamp": ("timestamp", "<i8"),
          "timestamp_ntz": ("timestamp_ntz", "<i8"), "date": ("date", "<i4")}
_MAX_LONG_DECIMAL_DIGITS = 18  # Spark keeps decimals of up to 18 digits as an unscaled long in the row word


def field_type(name, spark_type):
    """The :class:`FieldType` of a field of Spark's schema JSON; SparkFileError naming the
    field for a type with no fixed width here (arrays, maps, structs, wide decimals...)."""
    if isinstance(spark_type, str):
        if spark_type in _FIXED:
            simple, dtype = _FIXED[spark_type]
            return FieldType(simple, dtype)
        if spark_type in ("string", "binary"):
            return FieldType(spark_type, variable=True)
        if spark_type.startswith("decimal(") and spark_type.endswith(")"):
            digits = spark_type[8:-1].split(",")[0].strip()
            if not digits.isascii() or not digits.isdigit() or len(digits) > 2:  # Spark's precision is at most 38
                raise SparkFileError(f"field '{name}' is {spark_type[:60]!r}: not a decimal type Spark writes")
            precision = int(digits)
            if precision <= _MAX_LONG_DECIMAL_DIGITS:
                return FieldType(spark_type, "<i8")  # the unscaled value
            raise SparkFileError(f"field '{name}' is {spark_type}: a decimal of more than "
                                 f"{_MAX_LONG_DECIMAL_DIGITS} digits has no fixed width in a row")
    kind = spark_type.get("type") if isinstance(spark_type, dict) else spark_type
    raise SparkFileError(f"field '{name}' is of type {kind}: only fixed-width types (int, long, short, byte, boolean, "
                         f"float, double, timestamp, date, decimal up to 18 digits) and strings can be imported")


class RowColumns:
    """The columns of ``count`` UnsafeRows: ``values[name]`` (fixed-width fields) or
    ``offsets[name]``/``lengths[name]`` (variable-length ones, into ``buffer``), and
    ``nulls[name]`` (bool)."""

    def __init__(self, buffer, count):
        self.buffer, self.count = buffer, count
        self.values, self.offsets, self.lengths, self.nulls = {}, {}, {}, {}

    def variable(self, name, width):
        """The variable-length field ``name`` as ``S<width>`` (every value must fit)."""
        lengths = self.lengths[name]
        out = np.zeros((len(lengths), width), np.uint8)
        take = np.arange(width) < lengths[:, None]
        index = self.offsets[name][:, None] + np.arange(width)
        out[take] = self.buffer[index[take]]
        return out.view(f"S{width}").ravel() if width else np.zeros(len(lengths), "S1")


def row_columns(buffer, starts, lengths, fields, where):
    """The :class:`RowColumns` of the rows at ``starts`` (``lengths`` bytes each) of
    ``buffer``; ``fields`` is ``[(name, FieldType)]``. SparkFileError if a row is shorter
    than its fixed part or a variable-length value points outside its row."""
    n_fields = len(fields)
    bitset = (n_fields + 63) // 64 * 8
    fixed_width = bitset + 8 * n_fields
    out = RowColumns(buffer, len(starts))
    if len(starts) and int(lengths.min()) < fixed_width:
        raise SparkFileError(f"{where}: a row of {int(lengths.min())} bytes is shorter than the {fixed_width} bytes "
                             f"of its schema's {n_fields} fields: the state schema does not describe these rows")
    fixed = buffer[starts[:, None] + np.arange(fixed_width)] if len(starts) else np.zeros((0, fixed_width), np.uint8)
    null_words = fixed[:, :bitset].copy().view("<u8")
    for i, (name, kind) in enumerate(fields):
        out.nulls[name] = ((null_words[:, i // 64] >> np.uint64(i % 64)) & np.uint64(1)).astype(np.bool_)
        word = fixed[:, bitset + 8 * i:bitset + 8 * i + 8]
        if not kind.variable:
            out.values[name] = word[:, :kind.dtype.itemsize].copy().view(kind.dtype).ravel()
            continue
        word = word.copy().view("<u8").ravel()
        offsets = (word >> np.uint64(32)).astype(np.int64)
        sizes = (word & np.uint64(0xFFFFFFFF)).astype(np.int64)
        present = ~out.nulls[name]
        if ((offsets < fixed_width) | (offsets + sizes > lengths))[present].any():
            raise SparkFileError(f"{where}: a value of field '{name}' points outside its row: the state schema "
                                 f"does not describe these rows")
        out.offsets[name] = np.where(present, starts + offsets, 0)
        out.lengths[name] = np.where(present, sizes, 0)
    return out
