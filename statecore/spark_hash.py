"""Spark's ``hash()`` over a store's key columns, in numpy: the partition a
:class:`~pyspark_glue.StatefulOperator` routes a key to, computed without Spark.

The operator routes a row to ``pmod(hash(key columns), num_partitions)`` (Spark's
``HashPartitioning`` and its ``hash`` expression agree: Murmur3_x86_32 with seed 42, chained
column after column, each column's hash the seed of the next). Repartitioning a checkpoint
must put every key where the operator will look for it, so this module reproduces Spark's
per-type rules (``org.apache.spark.unsafe.hash.Murmur3_x86_32`` and the SQL hash function):

- boolean (as 1/0), tinyint, smallint, int, date: ``hashInt`` of the value as a 32-bit int;
- bigint, timestamp, timestamp_ntz (microseconds): ``hashLong``;
- float, double: -0.0 hashed as 0.0, then the IEEE bits with every NaN as Java's canonical
  NaN (``floatToIntBits`` / ``doubleToLongBits``), through ``hashInt`` / ``hashLong``;
- string (UTF-8 bytes), binary: ``hashUnsafeBytes``: the 4-byte little-endian words first,
  then each remaining byte on its own, sign-extended, as a whole round (Spark's variant,
  not standard murmur3's tail), finished with the byte length.

Store keys have no nulls (a null would leave the running hash unchanged in Spark). String
and binary key fields are fixed-width ``S<n>``, NUL-padded: the bytes hashed are the value
without its trailing NULs, which is the value Spark saw unless it ended in NUL bytes itself.
Everything is vectorized over whole columns (uint32 arithmetic wraps as Java's int does).
"""
import numpy as np

__all__ = ["SEED", "HASHABLE_TYPES", "FIXED_WIDTH_TYPES", "spark_hash", "spark_partition"]

SEED = 42
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
_INT_TYPES = ("boolean", "tinyint", "smallint", "int", "date")
_LONG_TYPES = ("bigint", "timestamp", "timestamp_ntz")
FIXED_WIDTH_TYPES = (*_INT_TYPES, *_LONG_TYPES, "float", "double")  # hashed from their values alone
HASHABLE_TYPES = (*FIXED_WIDTH_TYPES, "string", "binary")


def _rotl(x, r):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_k1(k1):
    return _rotl(k1 * _C1, 15) * _C2


def _mix_h1(h1, k1):
    h1 = _rotl(h1 ^ k1, 13)
    return h1 * np.uint32(5) + np.uint32(0xE6546B64)


def _fmix(h1, length):
    h1 = h1 ^ length
    h1 = h1 ^ (h1 >> np.uint32(16))
    h1 = h1 * np.uint32(0x85EBCA6B)
    h1 = h1 ^ (h1 >> np.uint32(13))
    h1 = h1 * np.uint32(0xC2B2AE35)
    return h1 ^ (h1 >> np.uint32(16))


def _hash_int(values, seed):
    """``hashInt`` of int32 values (as uint32 bits) over per-row seeds."""
    return _fmix(_mix_h1(seed, _mix_k1(values)), np.uint32(4))


def _hash_long(values, seed):
    bits = values.view(np.uint64) if values.dtype.itemsize == 8 else values.astype(np.int64).view(np.uint64)
    low = (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    high = (bits >> np.uint64(32)).astype(np.uint32)
    return _fmix(_mix_h1(_mix_h1(seed, _mix_k1(low)), _mix_k1(high)), np.uint32(8))


def _hash_bytes(column, seed):
    """``hashUnsafeBytes`` of each ``S<n>`` value without its trailing NULs."""
    n = len(column)
    width = column.dtype.itemsize
    raw = np.ascontiguousarray(column).view(np.uint8).reshape(n, width)
    nonzero = raw != 0
    # length = position after the last non-NUL byte (0 for an empty value)
    last = width - np.argmax(nonzero[:, ::-1], axis=1)
    lengths = np.where(nonzero.any(axis=1), last, 0).astype(np.int64)
    h1 = seed.copy()
    padded = raw if width % 4 == 0 else np.pad(raw, ((0, 0), (0, 4 - width % 4)))
    words = np.ascontiguousarray(padded).view("<u4")  # (n, ceil(width / 4)) little-endian words
    aligned = lengths - lengths % 4
    for j in range(width // 4):
        take = aligned >= 4 * (j + 1)
        if not take.any():
            break
        h1 = np.where(take, _mix_h1(h1, _mix_k1(words[:, j])), h1)
    signed = raw.view(np.int8)
    for i in range(width):
        take = (i >= aligned) & (i < lengths)
        if not take.any():
            continue
        k1 = signed[:, i].astype(np.int32).view(np.uint32)
        h1 = np.where(take, _mix_h1(h1, _mix_k1(k1)), h1)
    return _fmix(h1, lengths.astype(np.uint32))


def _column_hash(values, spark_type, seed):
    if spark_type in _INT_TYPES:
        return _hash_int(values.astype(np.int32).view(np.uint32), seed)
    if spark_type in _LONG_TYPES:
        return _hash_long(values.astype(np.int64), seed)
    if spark_type == "float":
        v = values.astype(np.float32)
        bits = np.where(v == 0, np.float32(0), v).view(np.uint32)  # -0.0 as 0.0
        bits = np.where(np.isnan(v), np.uint32(0x7FC00000), bits)  # floatToIntBits' NaN
        return _hash_int(bits, seed)
    if spark_type == "double":
        v = values.astype(np.float64)
        bits = np.where(v == 0, np.float64(0), v).view(np.uint64)
        bits = np.where(np.isnan(v), np.uint64(0x7FF8000000000000), bits)  # doubleToLongBits' NaN
        return _hash_long(bits, seed)
    if spark_type in ("string", "binary"):
        if values.dtype.kind != "S":
            raise TypeError(f"a {spark_type} key column is held in an S<n> field, not {values.dtype}")
        return _hash_bytes(values, seed)
    raise ValueError(f"Spark type {spark_type!r} is not one statecore can hash (it hashes {', '.join(HASHABLE_TYPES)})")


def spark_hash(columns, spark_types, valid=None):
    """Spark's ``hash(c1, c2, ...)`` (int32 per row) of 1-D numpy ``columns`` whose Spark types
    are ``spark_types`` (simple type names as ``DataType.simpleString()`` gives them).
    ``valid``: per column, None or a bool mask; where it is False the value is null and, as in
    Spark, leaves the running hash unchanged."""
    columns = list(columns)
    if len(columns) != len(spark_types) or not columns:
        raise ValueError(f"{len(columns)} columns for {len(spark_types)} Spark types")
    valid = [None] * len(columns) if valid is None else list(valid)
    n = len(columns[0])
    h = np.full(n, SEED, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for values, spark_type, mask in zip(columns, spark_types, valid):
            if len(values) != n:
                raise ValueError("key columns of different lengths")
            hashed = _column_hash(np.asarray(values), spark_type, h)
            h = hashed if mask is None else np.where(mask, hashed, h)
    return h.view(np.int32)


def spark_partition(columns, spark_types, num_partitions, valid=None):
    """``pmod(hash(columns), num_partitions)`` per row (int64 in ``[0, num_partitions)``)."""
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
    return np.mod(spark_hash(columns, spark_types, valid).astype(np.int64), num_partitions)
