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
  NaN (``floatToIntBits`` / ``doubleToLongBits``), through ``hashInt`` / ``hashLong``: the
  bits a float key field holds (``statecore._float_keys``);
- string (UTF-8 bytes), binary: ``hashUnsafeBytes``: the 4-byte little-endian words first,
  then each remaining byte on its own, sign-extended, as a whole round (Spark's variant,
  not standard murmur3's tail), finished with the byte length.

Store keys have no nulls (a null would leave the running hash unchanged in Spark). String
and binary key fields are fixed-width ``S<n>``, NUL-padded: the bytes hashed are the value
without its trailing NULs, which is the value Spark saw unless it ended in NUL bytes itself.
This module picks each type's bits; the mixing runs compiled over whole columns, without
the GIL (``statecore/_spark_hash.pyx``).
"""
import numpy as np

from statecore._float_keys import FLOAT_KEY_BITS, normalize_bits
from statecore._spark_hash import hash_bytes, hash_words32, hash_words64, pmod

__all__ = ["SEED", "HASHABLE_TYPES", "FIXED_WIDTH_TYPES", "spark_hash", "spark_partition"]

SEED = 42
_INT_TYPES = ("boolean", "tinyint", "smallint", "int", "date")
_LONG_TYPES = ("bigint", "timestamp", "timestamp_ntz")
FIXED_WIDTH_TYPES = (*_INT_TYPES, *_LONG_TYPES, "float", "double")  # hashed from their values alone
HASHABLE_TYPES = (*FIXED_WIDTH_TYPES, "string", "binary")


def _key_bits(values, float_type):
    """The bits of ``values`` as ``float_type`` as a float key holds them (a new array):
    Spark hashes exactly those (``statecore._float_keys``)."""
    bits = np.array(values, dtype=float_type).view(FLOAT_KEY_BITS[np.dtype(float_type)][0])
    normalize_bits(bits)
    return bits


def _column_hash(values, spark_type, seed):
    """The running hashes ``seed`` (uint32 per row) continued by one column, as a new array."""
    h = np.array(seed, dtype=np.uint32)
    if spark_type in _INT_TYPES:
        hash_words32(np.ascontiguousarray(values.astype(np.int32, copy=False)).view(np.uint32), h)
    elif spark_type in _LONG_TYPES:
        hash_words64(np.ascontiguousarray(values.astype(np.int64, copy=False)).view(np.uint64), h)
    elif spark_type == "float":  # floatToIntBits of the value, -0.0 as 0.0: a float key's bits
        hash_words32(_key_bits(values, np.float32), h)
    elif spark_type == "double":  # doubleToLongBits, -0.0 as 0.0
        hash_words64(_key_bits(values, np.float64), h)
    elif spark_type in ("string", "binary"):
        if values.dtype.kind != "S":
            raise TypeError(f"a {spark_type} key column is held in an S<n> field, not {values.dtype}")
        hash_bytes(np.ascontiguousarray(values).view(np.uint8).reshape(len(values), values.dtype.itemsize), h)
    else:
        raise ValueError(f"Spark type {spark_type!r} is not one statecore can hash (it hashes "
                         f"{', '.join(HASHABLE_TYPES)})")
    return h


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
    return pmod(spark_hash(columns, spark_types, valid).view(np.uint32), num_partitions)
