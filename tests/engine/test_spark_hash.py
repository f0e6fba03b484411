"""statecore.spark_hash's compiled mixing against a plain-Python Murmur3_x86_32 written from
Spark's rules (the module docstring): every fixed-width type, strings with trailing NULs and
bytes past 0x7f, chained columns, nulls, and pmod of negative hashes. The Spark test in
tests/spark/test_repartition_spark.py pins the same function against Spark itself."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from statecore.spark_hash import SEED, spark_hash, spark_partition

MASK = 0xFFFFFFFF


def rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & MASK


def mix_k1(k1):
    return (rotl((k1 * 0xCC9E2D51) & MASK, 15) * 0x1B873593) & MASK


def mix_h1(h1, k1):
    return (rotl(h1 ^ k1, 13) * 5 + 0xE6546B64) & MASK


def fmix(h1, length):
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & MASK
    return h1 ^ (h1 >> 16)


def hash_int(bits32, seed):
    return fmix(mix_h1(seed, mix_k1(bits32 & MASK)), 4)


def hash_long(bits64, seed):
    bits64 &= (1 << 64) - 1
    return fmix(mix_h1(mix_h1(seed, mix_k1(bits64 & MASK)), mix_k1(bits64 >> 32)), 8)


def hash_bytes(data, seed):
    data = data.rstrip(b"\0")
    aligned = len(data) - len(data) % 4
    h = seed
    for j in range(0, aligned, 4):
        h = mix_h1(h, mix_k1(struct.unpack("<I", data[j:j + 4])[0]))
    for b in data[aligned:]:
        h = mix_h1(h, mix_k1((b - 256 if b > 127 else b) & MASK))
    return fmix(h, len(data))


def reference(value, spark_type, seed):
    if spark_type == "int":
        return hash_int(value, seed)
    if spark_type == "bigint":
        return hash_long(value, seed)
    if spark_type == "double":
        v = 0.0 if value == 0 else value
        bits = 0x7FF8000000000000 if v != v else struct.unpack("<Q", struct.pack("<d", v))[0]
        return hash_long(bits, seed)
    if spark_type == "float":
        v = np.float32(value)
        v = np.float32(0) if v == 0 else v
        bits = 0x7FC00000 if v != v else struct.unpack("<I", struct.pack("<f", v))[0]
        return hash_int(bits, seed)
    return hash_bytes(value, seed)


def as_int32(h):
    return h - (1 << 32) if h >= 1 << 31 else h


COLUMNS = {
    "int": (st.integers(-2**31, 2**31 - 1), np.int32),
    "bigint": (st.integers(-2**63, 2**63 - 1), np.int64),
    "double": (st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0]), np.float64),
    "float": (st.floats(width=32, allow_nan=True) | st.sampled_from([0.0, -0.0]), np.float32),
    "string": (st.binary(max_size=11), "S11"),
}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(sorted(COLUMNS)), min_size=1, max_size=3).flatmap(
    lambda types: st.tuples(st.just(types), st.lists(st.tuples(*[COLUMNS[t][0] for t in types]), max_size=40))))
def test_spark_hash_equals_the_plain_python_rules(case):
    types, rows = case
    columns = [np.array([row[j] for row in rows], dtype=COLUMNS[t][1]) for j, t in enumerate(types)]
    expected = []
    for i in range(len(rows)):
        h = SEED
        for t, column in zip(types, columns):
            value = column[i].item() if t != "string" else bytes(column[i])
            h = reference(value, t, h)
        expected.append(as_int32(h))
    assert spark_hash(columns, types).tolist() == expected


def test_known_values_and_pmod_of_negative_hashes():
    assert spark_hash([np.array([1], np.int64)], ["bigint"]).tolist() == [-1712319331]  # Spark's hash(1L)
    keys = np.arange(-5000, 5000, dtype=np.int64)
    hashes = spark_hash([keys], ["bigint"]).astype(np.int64)
    assert (hashes < 0).any()
    for n in (1, 2, 7, 200):
        assert spark_partition([keys], ["bigint"], n).tolist() == [h % n for h in hashes.tolist()]  # Python's % is pmod
    with pytest.raises(ValueError, match="num_partitions"):
        spark_partition([keys], ["bigint"], 0)


def test_a_null_leaves_the_running_hash_as_it_was():
    a = np.array([3, 4], np.int64)
    b = np.array([7, 8], np.int32)
    with_null = spark_hash([a, b], ["bigint", "int"], [None, np.array([True, False])])
    assert with_null[1] == spark_hash([a[1:]], ["bigint"])[0]
    assert with_null[0] == spark_hash([a[:1], b[:1]], ["bigint", "int"])[0]
