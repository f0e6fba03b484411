"""RowSchema: allowed dtypes, canonical rows, strict conversions, fingerprints."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.schema import RowSchema, key_value_schemas

KEY = np.dtype([("user", "<i8"), ("tag", "S4"), ("flag", "?")])


def test_canonical_layout_is_packed_little_endian():
    s = RowSchema(np.dtype({"names": ["a", "b"], "formats": [">i4", "<f8"], "offsets": [0, 8], "itemsize": 24}))
    assert s.width == 12
    assert s.dtype == np.dtype([("a", "<i4"), ("b", "<f8")])
    assert s.encode((1, 2.5)) == np.array([(1, 2.5)], dtype=s.dtype).tobytes()


@pytest.mark.parametrize("bad,field", [
    (np.dtype([("k", "<i8"), ("name", "<U4")]), "name"),
    (np.dtype([("k", "O")]), "k"),
    (np.dtype([("k", "<i8", (2,))]), "k"),
    (np.dtype([("k", "<f2")]), "k"),
    (np.dtype([("k", "<c16")]), "k"),
    (np.dtype([("k", "<M8[s]")]), "k"),
    (np.dtype([("k", [("x", "<i4")])]), "k"),
])
def test_refuses_non_fixed_width_fields_naming_them(bad, field):
    with pytest.raises(TypeError, match=f"field '{field}'"):
        RowSchema(bad)


def test_refuses_plain_dtype():
    with pytest.raises(TypeError, match="structured"):
        RowSchema(np.int64)


def test_empty_schema_is_allowed():
    s = RowSchema(np.dtype([]))
    assert s.width == 0 and s.encode(()) == b"" and s.decode(b"") == ()


def test_every_allowed_kind_round_trips():
    kinds = ["?", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f4", "<f8", "S3"]
    dt = np.dtype([(f"f{i}", k) for i, k in enumerate(kinds)])
    s = RowSchema(dt)
    values = (True, -3, 250, -300, 60000, -70000, 4000000000, -(2**62), 2**63 + 5, 1.5, -2.25, b"ab")
    row = s.encode(values)
    assert row == np.array([values], dtype=dt).tobytes()
    assert s.decode(row) == values


def test_scalar_record_bytes_inputs():
    s = RowSchema(np.dtype([("k", "<i8")]))
    assert s.encode(5) == s.encode((5,)) == s.encode(np.int64(5)) == (5).to_bytes(8, "little")
    rec = np.array([(5,)], dtype=[("k", ">i8")])[0]
    assert s.encode(rec) == s.encode(5)
    assert s.encode((5).to_bytes(8, "little")) == s.encode(5)
    with pytest.raises(ValueError, match="8 bytes"):
        s.encode(b"abc")


def test_single_bytes_field_takes_value_bytes():
    s = RowSchema(np.dtype([("id", "S8")]))
    assert s.encode(b"abc") == b"abc\0\0\0\0\0"
    assert s.decode(s.encode(b"abc")) == (b"abc",)
    with pytest.raises(ValueError, match="at most 8 bytes"):
        s.encode(b"123456789")


@pytest.mark.parametrize("value,exc,field", [
    ((1.5, b"ab", True), TypeError, "user"),
    (("x", b"ab", True), TypeError, "user"),
    ((1, "ab", True), TypeError, "tag"),
    ((1, b"abcde", True), ValueError, "tag"),
    ((1, b"ab", 1), TypeError, "flag"),
    ((2**64, b"ab", True), ValueError, "user"),
])
def test_no_silent_casts_and_errors_name_the_field(value, exc, field):
    with pytest.raises(exc, match=f"'{field}'"):
        RowSchema(KEY).encode(value)


def test_wrong_arity():
    with pytest.raises(TypeError, match="3 fields"):
        RowSchema(KEY).encode((1, b"a"))


def test_rows_zero_copy_for_canonical_arrays():
    s = RowSchema(KEY)
    arr = np.zeros(10, dtype=s.dtype)
    rows = s.rows(arr)
    assert rows.shape == (10, s.width) and np.shares_memory(rows, arr)
    arr.flags.writeable = False
    assert not s.rows(arr).flags.writeable


def test_rows_from_other_layouts_and_mappings():
    s = RowSchema(KEY)
    aligned = np.zeros(3, dtype=np.dtype(KEY, align=True))
    aligned["user"] = [1, 2, 3]
    big = np.zeros(3, dtype=[("user", ">i8"), ("tag", "S4"), ("flag", "?")])
    big["user"] = [1, 2, 3]
    cols = {"user": np.array([1, 2, 3]), "tag": np.zeros(3, "S4"), "flag": np.zeros(3, bool)}
    expected = s.rows(np.array([(1, b"", False), (2, b"", False), (3, b"", False)], dtype=s.dtype))
    for batch in (aligned, big, cols, np.ascontiguousarray(aligned)[::1]):
        assert np.array_equal(s.rows(batch), expected)


@pytest.mark.parametrize("batch,match", [
    (np.zeros(2, dtype=[("user", "<i4"), ("tag", "S4"), ("flag", "?")]), "field 'user' has dtype <i4"),
    (np.zeros(2, dtype=[("user", "<i8"), ("tag", "S5"), ("flag", "?")]), "field 'tag'"),
    (np.zeros(2, dtype=[("user", "<i8"), ("tag", "S4")]), "field 'flag' is missing"),
    ({"user": np.zeros(2, "<i8"), "tag": np.zeros(2, "S4"), "flag": np.zeros(2, bool), "x": np.zeros(2)},
     "field 'x' is not in the schema"),
    ({"user": np.zeros(2, "<f8"), "tag": np.zeros(2, "S4"), "flag": np.zeros(2, bool)}, "field 'user'"),
    (np.zeros(2, dtype="<i8"), "structured array or a mapping"),
    ([1, 2], "structured array or a mapping"),
])
def test_batch_type_errors_name_the_field(batch, match):
    with pytest.raises(TypeError, match=match):
        RowSchema(KEY).rows(batch)


def test_batch_length_mismatch_in_mapping():
    with pytest.raises(ValueError, match="different lengths"):
        RowSchema(KEY).rows({"user": np.zeros(2, "<i8"), "tag": np.zeros(3, "S4"), "flag": np.zeros(2, bool)})


def test_single_field_plain_array():
    s = RowSchema(np.dtype([("k", "<i8")]))
    assert np.array_equal(s.rows(np.arange(3)), np.arange(3).view(np.uint8).reshape(3, 8))
    with pytest.raises(TypeError, match="field 'k'"):
        s.rows(np.arange(3, dtype=np.int32))


def test_fingerprint_is_pinned_and_layout_sensitive():
    # Golden: files carry this number; changing how it is computed breaks old files.
    assert RowSchema(np.dtype([("k", "<i8")])).fingerprint == 0x9280C543613E0205
    a = RowSchema(np.dtype([("k", "<i8")]))
    assert a.fingerprint == RowSchema(np.dtype([("k", ">i8")])).fingerprint
    assert a.fingerprint != RowSchema(np.dtype([("k", "<i4")])).fingerprint
    assert a.fingerprint != RowSchema(np.dtype([("j", "<i8")])).fingerprint


def test_description_round_trip():
    s = RowSchema(KEY)
    assert RowSchema.from_description(s.describe()) == s


# -- per-row strictness: no bool or float where the field does not hold one -----------------
NUMS = np.dtype([("n", "<i8"), ("u", "u1"), ("x", "<f8"), ("y", "<f4")])


@pytest.mark.parametrize("schema", [RowSchema(NUMS), RowSchema(NUMS, key=True)], ids=["value", "key"])
@pytest.mark.parametrize("value,field", [
    ((True, 1, 1.0, 1.0), "n"),
    ((np.True_, 1, 1.0, 1.0), "n"),
    ((1.0, 1, 1.0, 1.0), "n"),
    ((np.float64(1.0), 1, 1.0, 1.0), "n"),
    ((1, False, 1.0, 1.0), "u"),
    ((1, 1.5, 1.0, 1.0), "u"),
    ((1, 1, True, 1.0), "x"),
    ((1, 1, np.True_, 1.0), "x"),
    ((1, 1, 1.0, False), "y"),
    ((1, 1, "1.0", 1.0), "x"),
    ((1, 1, 1.0, np.array(1.0)), "y"),
])
def test_per_row_refuses_bools_and_floats_where_the_field_does_not_hold_them(schema, value, field):
    for row in (value, list(value)):
        with pytest.raises(TypeError, match=rf"field '{field}' .*of the schema \('n', 'u', 'x', 'y'\)"):
            schema.encode(row)


@pytest.mark.parametrize("dtype,value", [("<i8", True), ("<i8", 2.0), ("<u2", np.False_), ("<f8", True),
                                         ("<f4", np.True_), ("<i4", np.float32(3))])
def test_per_row_bare_scalars_are_checked_too(dtype, value):
    schema = RowSchema(np.dtype([("only", dtype)]))
    for s in (schema, RowSchema(schema.dtype, key=True)):
        with pytest.raises(TypeError, match="field 'only'"):
            s.encode(value)


def test_per_row_takes_numpy_scalars_of_the_fields_kind_and_ints_for_floats():
    s = RowSchema(NUMS)
    expected = np.array([(-3, 7, 2.0, 0.5)], NUMS).tobytes()
    for row in [(-3, 7, 2.0, 0.5), (np.int64(-3), np.uint8(7), np.float64(2.0), np.float32(0.5)),
                (np.int32(-3), 7, 2, 0.5), (-3, np.int8(7), np.int64(2), np.float64(0.5))]:
        assert s.encode(row) == expected
    assert RowSchema(np.dtype([("x", "<f8")])).encode(3) == np.array([3.0]).tobytes()
    flags = RowSchema(np.dtype([("b", "?"), ("i", "<i2")]))
    assert flags.encode((np.True_, np.int16(2))) == flags.encode((True, 2)) == b"\x01\x02\x00"


def test_per_row_range_errors_name_the_field():
    with pytest.raises(ValueError, match="field 'u'"):
        RowSchema(NUMS).encode((1, 256, 1.0, 1.0))
    with pytest.raises(ValueError, match="field 'y'"):
        RowSchema(NUMS).encode((1, 1, 1.0, 1e300))


# -- float keys normalized as Spark normalizes grouping keys -------------------------------
F8 = np.dtype("<f8")
F4 = np.dtype("<f4")
NAN8 = np.array([0x7FF8_0000_0000_0000], "<u8").view(F8)[0]


def floats_from_bits(bits, dtype):
    """numpy floats with exactly these bits (NaN payloads kept)."""
    return np.array(bits, dtype.str.replace("f", "u")).view(dtype)


# -0.0, then NaNs: a payload, the sign bit, a signalling NaN, the x86 default NaN.
ODD8 = floats_from_bits([0x8000_0000_0000_0000, 0x7FF8_0000_0000_0001, 0xFFF8_0000_0000_0000,
                         0x7FF0_0000_0000_0001, 0xFFF8_0000_0000_0005], F8)
ODD4 = floats_from_bits([0x8000_0000, 0x7FC0_0001, 0xFFC0_0000, 0x7F80_0001, 0xFFFF_FFFF], F4)
CANON8 = np.array([0.0, np.nan, np.nan, np.nan, np.nan], F8)
CANON4 = np.array([0.0, np.nan, np.nan, np.nan, np.nan], F4)
MIXED = np.dtype([("id", "<i4"), ("x", "<f8"), ("y", "<f4"), ("tag", "S2")])


def mixed_rows(x, y):
    out = np.zeros(len(x), MIXED)
    out["id"] = np.arange(len(x))
    out["x"], out["y"], out["tag"] = x, y, b"t"
    return out


def test_key_value_schemas_marks_the_key_and_only_the_key():
    key, value = key_value_schemas(MIXED, MIXED)
    assert key.key and not value.key and key == value and key.fingerprint == value.fingerprint
    again, plain = key_value_schemas(key, key)
    assert again is key and not plain.key
    assert "key=True" in repr(key)


def test_key_rows_per_row_normalize_zero_and_nans_in_every_input_form():
    key, value = key_value_schemas(MIXED, MIXED)
    odd, canon = mixed_rows(ODD8, ODD4), mixed_rows(CANON8, CANON4)
    assert canon.tobytes() != odd.tobytes()
    for i in range(len(odd)):
        want = canon[i].tobytes()
        rec = odd[i]
        raw = rec.tobytes()
        for form in (rec, raw, rec.item(), list(rec.item()), odd[i:i + 1],
                     (int(rec["id"]), float(rec["x"]), rec["y"], b"t")):
            assert key.encode(form) == want, (i, form)
        assert value.encode(rec) == raw and value.encode(raw) == raw  # values keep their bytes


@pytest.mark.parametrize("dtype,odd,canon", [(F8, ODD8, CANON8), (F4, ODD4, CANON4)])
def test_one_float_field_key_per_row(dtype, odd, canon):
    key = RowSchema(np.dtype([("x", dtype)]), key=True)
    for v, c in zip(odd, canon):
        assert key.encode(v) == key.encode(float(v)) == key.encode((v,)) == c.tobytes()
    assert key.encode(-0.0) == key.encode(0) == bytes(dtype.itemsize)
    assert key.encode(1.5) == np.array([1.5], dtype).tobytes()


def test_key_batches_normalize_without_writing_the_callers_array():
    key, value = key_value_schemas(MIXED, MIXED)
    odd, canon = mixed_rows(ODD8, ODD4), mixed_rows(CANON8, CANON4)
    expected = canon.view(np.uint8).reshape(len(canon), -1)
    before = odd.tobytes()
    batches = {
        "canonical": odd,
        "read-only": np.frombuffer(odd.tobytes(), MIXED),
        "aligned": odd.astype(np.dtype(MIXED, align=True)),
        "big-endian": odd.astype(MIXED.newbyteorder(">")),
        "strided": np.repeat(odd, 2)[::2],
        "columns": {name: odd[name].copy() for name in MIXED.names},
    }
    for label, batch in batches.items():
        snapshot = (batch.tobytes() if isinstance(batch, np.ndarray)
                    else {n: c.tobytes() for n, c in batch.items()})
        assert np.array_equal(key.rows(batch), expected), label
        assert snapshot == (batch.tobytes() if isinstance(batch, np.ndarray)
                            else {n: c.tobytes() for n, c in batch.items()}), label
    assert odd.tobytes() == before
    assert np.array_equal(value.rows(odd), odd.view(np.uint8).reshape(len(odd), -1))  # values keep bytes
    one = RowSchema(np.dtype([("x", "<f4")]), key=True)
    plain = ODD4.copy()
    assert np.array_equal(one.rows(plain).view(np.uint32).ravel(), CANON4.view(np.uint32))
    assert np.array_equal(plain.view(np.uint32), ODD4.view(np.uint32))


def test_key_batches_stay_zero_copy_when_already_normalized():
    key = RowSchema(MIXED, key=True)
    clean = mixed_rows(np.array([1.5, 0.0, np.nan, -np.inf]), np.array([0.0, -2.0, np.nan, np.inf]))
    assert np.shares_memory(key.rows(clean), clean)
    ints = RowSchema(KEY, key=True)
    arr = np.zeros(4, KEY)
    assert np.shares_memory(ints.rows(arr), arr)
    clean.flags.writeable = False
    assert not key.rows(clean).flags.writeable


# Float bit patterns: every kind of float, NaNs with any payload and sign, both zeros.
float64_bits = st.one_of(st.integers(0, 2**64 - 1),
                         st.sampled_from([0, 2**63, 0x7FF8 << 48, 0xFFF8 << 48]),
                         st.integers(0, 2**52 - 1).map(lambda m: (0x7FF << 52) | m | 1),
                         st.integers(0, 2**52 - 1).map(lambda m: (0xFFF << 52) | m | 1))


@settings(derandomize=True, database=None, max_examples=300, deadline=None)
@given(st.lists(st.tuples(float64_bits, st.integers(0, 2**32 - 1)), min_size=1, max_size=40))
def test_key_bytes_are_equal_exactly_when_spark_groups_the_floats_together(pairs):
    key = RowSchema(np.dtype([("x", "<f8"), ("y", "<f4")]), key=True)
    batch = np.zeros(len(pairs), key.dtype)
    batch["x"] = floats_from_bits([a for a, _ in pairs], F8)
    batch["y"] = floats_from_bits([b for _, b in pairs], F4)
    rows = key.rows(batch)
    for i in range(len(pairs)):
        assert key.encode(batch[i]) == key.encode(batch[i].item()) == rows[i].tobytes()  # row == batch
        for j in range(i + 1):
            same = all(a == b or (np.isnan(a) and np.isnan(b))
                       for a, b in zip(batch[i].item(), batch[j].item()))
            assert (rows[i].tobytes() == rows[j].tobytes()) == same
    assert np.array_equal(key.rows(key.from_rows(rows)), rows)  # normalizing twice changes nothing


def _bools_with_byte(raw):
    """A bool array whose bytes are ``raw``: numpy keeps any byte in a bool viewed from others."""
    return np.frombuffer(bytes(raw), dtype=np.bool_)


def test_a_bool_key_byte_above_one_is_the_true_key_per_row_and_per_batch():
    """A key array built by viewing other bytes as bool (a byte 0x02) is the key True, not a
    second key beside it."""
    dtype = np.dtype([("flag", "?"), ("id", "<i8")])
    key = RowSchema(dtype, key=True)
    odd = np.zeros(3, dtype)
    odd["flag"] = _bools_with_byte([2, 1, 0xFF])
    odd["id"] = 7
    assert odd.view(np.uint8).reshape(3, -1)[:, 0].tolist() == [2, 1, 0xFF]
    true_row = key.encode((True, 7))
    for i in range(3):
        assert key.encode(odd[i]) == key.encode(odd[i].tobytes()) == true_row, i
    rows = key.rows(odd)
    assert rows[:, 0].tolist() == [1, 1, 1]
    assert odd.view(np.uint8).reshape(3, -1)[:, 0].tolist() == [2, 1, 0xFF]  # the caller's array as it was
    assert RowSchema(dtype).encode(odd[0].tobytes()) == odd[0].tobytes()  # values keep their bytes
    one = RowSchema(np.dtype([("b", "?")]), key=True)
    assert one.rows(_bools_with_byte([0, 3])).ravel().tolist() == [0, 1]
    clean = np.zeros(2, dtype)
    clean["flag"] = [True, False]
    assert np.shares_memory(key.rows(clean), clean)  # no copy when every byte is 0 or 1
