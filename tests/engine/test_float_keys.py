"""Float key normalization, golden: every path that makes key rows gives the same bytes.

A user's key of -0.0, or a NaN that came out of some arithmetic with any payload and sign,
must be one key with 0.0 or with every other NaN, as Spark groups them, however the key
reaches the store: per row through RowSchema (Python), per row through the compiled
RowCodec, or as a batch. The expected bits come from the IEEE 754 layout written out
below, not from statecore's table, so a path (or the table) that drifts fails here.
"""
import struct

import numpy as np
import pytest

from statecore._float_keys import FLOAT_KEY_BITS, key_bits
from statecore._spark_hash import hash_words32, hash_words64
from statecore.schema import RowSchema
from statecore.spark_hash import SEED, spark_hash

# width in bytes -> (exponent bits, fraction bits), IEEE 754 binary32 and binary64
IEEE = {4: (8, 23), 8: (11, 52)}


def ieee(width, sign, exponent, fraction):
    """The bits of the float with these fields."""
    exp_bits, frac_bits = IEEE[width]
    return (sign << (exp_bits + frac_bits)) | (exponent << frac_bits) | fraction


def expected_key_bits(width, bits):
    """What a key holds, from the IEEE fields: -0.0 is +0.0; a NaN (exponent all ones,
    fraction not zero) is the canonical NaN: sign clear, only the quiet bit of the fraction
    set; everything else (subnormals and infinities too) keeps its bits."""
    exp_bits, frac_bits = IEEE[width]
    top = (1 << exp_bits) - 1
    sign, exponent, fraction = bits >> (exp_bits + frac_bits), (bits >> frac_bits) & top, bits & ((1 << frac_bits) - 1)
    if sign == 1 and exponent == 0 and fraction == 0:
        return 0
    if exponent == top and fraction != 0:
        return ieee(width, 0, top, 1 << (frac_bits - 1))
    return bits


def cases(width):
    """Bit patterns of every kind of float: zeros, infinities, quiet and signalling NaNs with
    several payloads and both signs, subnormals, normals."""
    exp_bits, frac_bits = IEEE[width]
    top, quiet = (1 << exp_bits) - 1, 1 << (frac_bits - 1)
    most = (1 << frac_bits) - 1
    out = []
    for sign in (0, 1):
        out += [ieee(width, sign, 0, 0), ieee(width, sign, top, 0)]                      # zero, infinity
        out += [ieee(width, sign, top, quiet | p) for p in (0, 1, 0x2345, most >> 1)]    # quiet NaNs
        out += [ieee(width, sign, top, p) for p in (1, 0x5A5A, quiet - 1, quiet >> 3)]   # signalling NaNs
        out += [ieee(width, sign, 0, p) for p in (1, 0x1234, most)]                      # subnormals
        out += [ieee(width, sign, 1, 0), ieee(width, sign, (1 << (exp_bits - 1)) - 1, 0x40),
                ieee(width, sign, top - 1, most)]                                        # normals
    return out


FLOAT = {4: np.dtype("<f4"), 8: np.dtype("<f8")}
BITS = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
SPARK_TYPE = {4: "float", 8: "double"}
# a float field alone, and one among others (at an odd offset: a strided column in a batch)
LAYOUTS = {
    "alone": lambda f: np.dtype([("x", f)]),
    "among others": lambda f: np.dtype([("id", "<i2"), ("tag", "S3"), ("x", f), ("flag", "?")]),
}
WIDTHS = [4, 8]


def key_batch(schema, width, bits):
    """A batch of the schema whose float field holds exactly ``bits``, the rest fixed."""
    batch = np.zeros(len(bits), schema.dtype)
    batch["x"] = np.array(bits, BITS[width]).view(FLOAT[width])
    if "id" in schema.names:
        batch["id"], batch["tag"], batch["flag"] = 7, b"ab", True
    return batch


def field_bits(schema, width, rows):
    """The float field's bits in each of these key rows."""
    return [int(b) for b in schema.from_rows(np.asarray(rows)).copy()["x"].view(BITS[width])]


def test_the_table_is_ieee_754s_sign_infinity_and_canonical_nan():
    for width, dtype in FLOAT.items():
        exp_bits, frac_bits = IEEE[width]
        top = (1 << exp_bits) - 1
        bits_dtype, sign, inf, nan = FLOAT_KEY_BITS[dtype]
        assert bits_dtype == BITS[width]
        assert (sign, inf, nan) == (ieee(width, 1, 0, 0), ieee(width, 0, top, 0),
                                    ieee(width, 0, top, 1 << (frac_bits - 1)))
        assert nan == int(np.array([np.nan], dtype).view(bits_dtype)[0])  # numpy's own NaN


@pytest.mark.parametrize("width", WIDTHS)
def test_the_compiled_rule_on_every_kind_of_float(width):
    for bits in cases(width):
        assert key_bits(bits, width) == expected_key_bits(width, bits), hex(bits)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("width", WIDTHS)
def test_a_negative_zero_or_a_nan_of_any_payload_is_one_key_by_every_path(width, layout):
    """-0.0, NaNs of every payload and sign, infinities and subnormals: the Python per-row
    encode, the compiled per-row encode and the batch give the same key rows, and those are
    the IEEE table's."""
    schema = RowSchema(LAYOUTS[layout](FLOAT[width]), key=True)
    bits = cases(width)
    want = [expected_key_bits(width, b) for b in bits]
    batch = key_batch(schema, width, bits)
    expected_rows = key_batch(schema, width, want).view(np.uint8).reshape(len(bits), schema.width)

    batch_rows = schema.rows(batch)
    assert field_bits(schema, width, batch_rows) == want
    assert np.array_equal(batch_rows, expected_rows)
    for b, w in zip(bits, want):  # each alone: no other value in the batch to give it away
        assert field_bits(schema, width, schema.rows(key_batch(schema, width, [b] * 3))) == [w] * 3, hex(b)

    per_row = [schema.encode(record) for record in batch]          # numpy records: exact bits
    per_row_bytes = [schema.encode(record.tobytes()) for record in batch] if layout == "among others" else per_row
    assert per_row == per_row_bytes == [r.tobytes() for r in expected_rows]

    # Python floats: exact bits for float64; a float32 field gets the value cast (a
    # signalling NaN comes out quiet, still a NaN of the same sign: the same key)
    values = [float(v) for v in batch["x"]]
    rest = (7, b"ab") if layout == "among others" else ()
    tuples = [(*rest, v, True) if rest else (v,) for v in values]
    python_rows = [schema.encode(t) for t in tuples]
    compiled_rows = [schema.codec.encode(t) for t in tuples]
    assert python_rows == compiled_rows == [r.tobytes() for r in expected_rows]
    if width == 8:  # a Python float keeps a float64's bits: the raw bits reached each path
        assert [struct.unpack("<Q", struct.pack("<d", v))[0] for v in values] == bits


@pytest.mark.parametrize("width", WIDTHS)
def test_spark_hashes_of_every_paths_keys_are_the_hashes_of_the_canonical_bits(width):
    """Repartitioning routes a key by Spark's hash: the raw floats, and the key rows of each
    path read back, hash as Spark hashes the canonical bits (``floatToIntBits``, -0.0 as 0)."""
    schema = RowSchema(LAYOUTS["alone"](FLOAT[width]), key=True)
    bits = cases(width)
    want = np.array([expected_key_bits(width, b) for b in bits], BITS[width])
    h = np.full(len(bits), SEED, np.uint32)
    (hash_words32 if width == 4 else hash_words64)(want, h)
    expected = h.view(np.int32)

    raw = key_batch(schema, width, bits)["x"]
    kinds = {
        "raw floats": raw,
        "batch rows": schema.from_rows(schema.rows(key_batch(schema, width, bits)))["x"],
        "python rows": schema.from_rows(np.frombuffer(b"".join(schema.encode(r) for r in key_batch(
            schema, width, bits)), np.uint8).reshape(len(bits), -1))["x"],
        "compiled rows": schema.from_rows(np.frombuffer(b"".join(schema.codec.encode((float(v),)) for v in raw),
                                                        np.uint8).reshape(len(bits), -1))["x"],
    }
    for label, column in kinds.items():
        assert np.array_equal(spark_hash([column], [SPARK_TYPE[width]]), expected), label
