"""RowSchema: allowed dtypes, canonical rows, strict conversions, fingerprints."""
import numpy as np
import pytest

from statecore.schema import RowSchema

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
    ((1.5, b"ab", True), ValueError, "user"),
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
