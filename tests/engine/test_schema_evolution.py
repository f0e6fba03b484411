"""Schema evolution (statecore.schema_evolution): the allowed changes of a store's value and
key schemas, each checked on converted rows against values computed here, the refused ones
named with their rule, and a property over random allowed plans."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.errors import SchemaMismatchError
from statecore.schema import RowSchema
from statecore.schema_evolution import EvolutionPlan, SchemaEvolutionError, convert, plan

SIGNED = ["i1", "<i2", "<i4", "<i8"]
UNSIGNED = ["u1", "<u2", "<u4", "<u8"]


def rows_of(dtype, values, key=False):
    """The rows of ``values`` (a list of tuples) under ``dtype``, as a store holds them."""
    schema = RowSchema(np.dtype(dtype), key=key)
    return schema.rows(np.array(values, dtype=schema.dtype))


def read_back(evolution, rows):
    """The converted rows' values, per new field, as Python lists (trailing NULs stripped)."""
    out = evolution.new.from_rows(rows)
    return {name: out[name].tolist() for name in evolution.new.names}


def refusal(old, new, **kwargs):
    with pytest.raises(SchemaEvolutionError) as info:
        plan(old, new, **kwargs)
    return info.value


# -- allowed changes -------------------------------------------------------------------------

def test_a_query_restarted_with_the_same_schema_gets_the_identity_plan():
    dtype = np.dtype([("total", "<i8"), ("name", "S4"), ("ratio", "<f8")])
    evolution = plan(dtype, dtype)
    assert evolution.is_identity and not evolution.changes_bytes
    assert evolution.describe() == [] and evolution.dropped == ()
    rows = rows_of(dtype, [(1, b"a", 0.5), (-7, b"abcd", -1.25)])
    assert np.array_equal(convert(evolution, rows), rows)


def test_a_value_field_added_with_the_users_default_and_others_with_zero_or_empty():
    old = np.dtype([("total", "<i8")])
    new = np.dtype([("total", "<i8"), ("n", "<i4"), ("label", "S3"), ("seen", "?"), ("mean", "<f4"),
                    ("zero", "<u2"), ("empty", "S2")])
    evolution = plan(old, new, defaults={"n": -5, "label": b"ab", "seen": True, "mean": 2})
    assert evolution.changes_bytes and not evolution.reordered
    assert "value field 'n' added, default -5" in evolution.describe()
    assert "value field 'zero' added, default 0" in evolution.describe()
    assert "value field 'empty' added, default b''" in evolution.describe()
    got = read_back(evolution, convert(evolution, rows_of(old, [(3,), (2**40,)])))
    assert got == {"total": [3, 2**40], "n": [-5, -5], "label": [b"ab", b"ab"], "seen": [True, True],
                   "mean": [2.0, 2.0], "zero": [0, 0], "empty": [b"", b""]}


def test_a_value_field_dropped_leaves_the_others_as_they_were():
    old = np.dtype([("a", "<i4"), ("gone", "<f8"), ("b", "S2")])
    new = np.dtype([("a", "<i4"), ("b", "S2")])
    evolution = plan(old, new)
    assert evolution.dropped == ("gone",) and evolution.describe() == ["value field 'gone' dropped"]
    got = read_back(evolution, convert(evolution, rows_of(old, [(1, 9.5, b"x"), (-1, 0.0, b"yz")])))
    assert got == {"a": [1, -1], "b": [b"x", b"yz"]}


def test_value_fields_reordered_keep_their_values():
    old = np.dtype([("a", "<i2"), ("b", "<f8"), ("c", "S3")])
    new = np.dtype([("c", "S3"), ("a", "<i2"), ("b", "<f8")])
    evolution = plan(old, new)
    assert evolution.reordered and evolution.changes_bytes
    assert evolution.describe() == ["value fields reordered: c, a, b"]
    got = read_back(evolution, convert(evolution, rows_of(old, [(5, 0.25, b"abc"), (-300, 1e300, b"")])))
    assert got == {"c": [b"abc", b""], "a": [5, -300], "b": [0.25, 1e300]}


def test_a_value_field_renamed_by_the_map_keeps_the_row_bytes():
    old = np.dtype([("total", "<i8"), ("n", "<i4")])
    new = np.dtype([("sum", "<i8"), ("n", "<i4")])
    evolution = plan(old, new, renames={"total": "sum"})
    assert not evolution.changes_bytes and not evolution.is_identity
    assert evolution.describe() == ["value field 'total' renamed to 'sum'"]
    rows = rows_of(old, [(10, 1), (-4, 2)])
    assert np.array_equal(convert(evolution, rows), rows)
    assert read_back(evolution, convert(evolution, rows)) == {"sum": [10, -4], "n": [1, 2]}


def test_a_renamed_value_field_absent_from_the_map_is_a_drop_and_an_add():
    """A field renamed without the map: its values are not carried, the new name starts at zero."""
    evolution = plan(np.dtype([("total", "<i8")]), np.dtype([("sum", "<i8")]))
    assert evolution.dropped == ("total",) and evolution.fields[0].added
    assert read_back(evolution, convert(evolution, rows_of([("total", "<i8")], [(10,)]))) == {"sum": [0]}


def test_two_value_fields_swap_names_through_the_map():
    old = np.dtype([("a", "<i4"), ("b", "<i4")])
    evolution = plan(old, old, renames={"a": "b", "b": "a"})
    assert evolution.changes_bytes and evolution.dropped == ()
    assert read_back(evolution, convert(evolution, rows_of(old, [(1, 2)]))) == {"a": [2], "b": [1]}


WIDENINGS = ([(a, b) for chain in (SIGNED, UNSIGNED) for i, a in enumerate(chain) for b in chain[i + 1:]]
             + [(u, s) for u in UNSIGNED for s in SIGNED if np.dtype(s).itemsize > np.dtype(u).itemsize])


@pytest.mark.parametrize("old_type,new_type", WIDENINGS)
def test_an_int_value_field_widened_keeps_its_extremes(old_type, new_type):
    bits = 8 * np.dtype(old_type).itemsize
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if np.dtype(old_type).kind == "i" else (0, 2 ** bits - 1)
    old, new = np.dtype([("v", old_type)]), np.dtype([("v", new_type)])
    evolution = plan(old, new)
    assert evolution.fields[0].widened and evolution.changes_bytes
    got = read_back(evolution, convert(evolution, rows_of(old, [(low,), (0,), (high,)])))
    assert got == {"v": [low, 0, high]}


@pytest.mark.parametrize("old_type", ["i1", "<i2", "<i4", "u1", "<u2", "<u4"])
def test_an_int_value_field_of_up_to_32_bits_widens_exactly_to_float64(old_type):
    info = np.iinfo(np.dtype(old_type))
    old, new = np.dtype([("v", old_type)]), np.dtype([("v", "<f8")])
    evolution = plan(old, new)
    assert evolution.describe() == [f"value field 'v' widened {np.dtype(old_type).name} -> float64"]
    got = read_back(evolution, convert(evolution, rows_of(old, [(int(info.min),), (int(info.max),), (1,)])))
    assert got["v"] == [float(int(info.min)), float(int(info.max)), 1.0]


def test_a_float32_value_field_widens_to_float64_exactly():
    old, new = np.dtype([("x", "<f4")]), np.dtype([("x", "<f8")])
    values = [0.1, -3.4e38, 1e-45, float("inf"), -0.0]
    stored = np.array(values, dtype="<f4")
    evolution = plan(old, new)
    got = read_back(evolution, convert(evolution, rows_of(old, [(v,) for v in stored])))
    assert got["x"] == [float(v) for v in stored.tolist()]  # float32 values, as Python floats
    assert got["x"][0] != 0.1  # the float32 nearest 0.1, not 0.1


def test_a_bytes_value_field_widens_zero_padded():
    old, new = np.dtype([("tag", "S4"), ("n", "u1")]), np.dtype([("tag", "S8"), ("n", "u1")])
    evolution = plan(old, new)
    rows = convert(evolution, rows_of(old, [(b"abcd", 1), (b"a", 2), (b"", 3)]))
    assert rows.shape == (3, 9)
    assert bytes(rows[0]) == b"abcd\0\0\0\0\x01" and bytes(rows[1]) == b"a" + b"\0" * 7 + b"\x02"
    assert read_back(evolution, rows) == {"tag": [b"abcd", b"a", b""], "n": [1, 2, 3]}


def test_a_value_field_renamed_and_widened_in_one_step():
    evolution = plan(np.dtype([("total", "<i4")]), np.dtype([("sum", "<i8")]), renames={"total": "sum"})
    assert evolution.describe() == ["value field 'total' renamed to 'sum', widened int32 -> int64"]
    got = read_back(evolution, convert(evolution, rows_of([("total", "<i4")], [(-(2**31),)])))
    assert got == {"sum": [-(2**31)]}


def test_a_value_schema_with_no_fields_gains_one_and_one_loses_all():
    """A set's value schema (no field) given a counter, and a counter's value dropped to a set."""
    empty, counter = np.dtype([]), np.dtype([("n", "<i8")])
    grown = plan(empty, counter, defaults={"n": 1})
    assert read_back(grown, convert(grown, np.empty((3, 0), np.uint8))) == {"n": [1, 1, 1]}
    shrunk = plan(counter, empty)
    assert convert(shrunk, rows_of(counter, [(5,), (6,)])).shape == (2, 0)


# -- keys -------------------------------------------------------------------------------------

def test_a_key_field_renamed_by_the_map_is_no_rekey():
    old = np.dtype([("user", "<i8"), ("tag", "S4")])
    new = np.dtype([("user_id", "<i8"), ("tag", "S4")])
    evolution = plan(old, new, renames={"user": "user_id"}, key=True)
    assert evolution.key and evolution.new.key and not evolution.changes_bytes
    rows = rows_of(old, [(1, b"a"), (2, b"bb")], key=True)
    assert np.array_equal(convert(evolution, rows), rows)


def test_a_key_widened_from_int32_to_int64_is_a_rekey():
    old = np.dtype([("user", "<i4"), ("tag", "S2")])
    new = np.dtype([("user", "<i8"), ("tag", "S6")])
    evolution = plan(old, new, key=True)
    assert evolution.changes_bytes
    assert evolution.describe() == ["key field 'user' widened int32 -> int64", "key field 'tag' widened S2 -> S6",
                                    "every key row is re-keyed (its bytes and hash change)"]
    rows = convert(evolution, rows_of(old, [(-1, b"ab"), (2**31 - 1, b"")], key=True))
    assert read_back(evolution, rows) == {"user": [-1, 2**31 - 1], "tag": [b"ab", b""]}
    # The re-keyed rows are the rows the new key schema makes of the same keys.
    assert np.array_equal(rows, rows_of(new, [(-1, b"ab"), (2**31 - 1, b"")], key=True))


@pytest.mark.parametrize("new_id,renames", [(("id", "<i4"), None), (("user", "<i2"), {"id": "user"})])
def test_key_rows_with_unnormalized_floats_and_bools_come_out_normalized(new_id, renames):
    """Key rows read from a view (a -0.0, a NaN with a payload, a bool byte of 2) through a re-key,
    and through a rename that keeps the bytes: what comes out is what RowSchema(key=True) makes
    of the same keys."""
    old = np.dtype([("id", "<i2"), ("x", "<f8"), ("flag", "?")])
    new = np.dtype([new_id, ("x", "<f8"), ("flag", "?")])
    raw = np.zeros(2, old)
    raw["id"] = [1, 2]
    raw["x"] = [-0.0, 0.0]
    raw["x"].view("<u8")[1] = 0x7FF8_0000_0000_0042  # a NaN other than the canonical one
    raw["flag"].view(np.uint8)[:] = [2, 0]
    rows = raw.view(np.uint8).reshape(2, -1)
    evolution = plan(old, new, renames=renames, key=True)
    assert evolution.changes_bytes == (renames is None)
    out = evolution.new.from_rows(convert(evolution, rows))
    assert out["x"].view("<u8").tolist() == [0, 0x7FF8_0000_0000_0000]
    assert out["flag"].view(np.uint8).tolist() == [1, 0]
    assert out[new_id[0]].tolist() == [1, 2]
    assert raw["flag"].view(np.uint8).tolist() == [2, 0]  # the caller's rows are not written


# -- refused changes --------------------------------------------------------------------------

@pytest.mark.parametrize("old_type,new_type,rule", [
    ("<i8", "<i4", "narrows"),
    ("<u4", "<u2", "narrows"),
    ("u1", "i1", "narrows"),  # an int8 cannot hold 255
    ("<u4", "<i4", "narrows"),
    ("i1", "<u2", "signed int does not become unsigned"),
    ("<i8", "<f8", "not exact"),
    ("<u8", "<f8", "not exact"),
    ("<i4", "<f4", "not exact"),
    ("<f8", "<f4", "narrows"),
    ("<f8", "<i8", "a float does not become an int"),
    ("<f4", "<i8", "a float does not become an int"),
    ("?", "i1", "a bool field stays a bool"),
    ("<i4", "?", "a bool field stays a bool"),
    ("<i4", "S8", "between bytes and numbers"),
    ("S8", "<i8", "between bytes and numbers"),
    ("S8", "S4", "bytes fields only widen"),
])
def test_a_value_field_changed_against_the_rules_is_named_with_its_rule(old_type, new_type, rule):
    error = refusal(np.dtype([("keep", "<i8"), ("v", old_type)]), np.dtype([("keep", "<i8"), ("v", new_type)]))
    assert len(error.problems) == 1
    field, broken = error.problems[0]
    assert field == "v" and rule in broken
    assert "value field 'v': " in str(error) and rule in str(error)
    assert "statecore rewrite" in str(error)


@pytest.mark.parametrize("old_type,new_type", [("<f4", "<f8"), ("<i4", "<f8")])
def test_a_float_key_field_is_not_widened_nor_a_key_widened_into_a_float(old_type, new_type):
    error = refusal(np.dtype([("x", old_type)]), np.dtype([("x", new_type)]), key=True)
    assert error.kind == "key" and error.problems[0][0] == "x"
    assert "a float key field stays as it is" in error.problems[0][1]
    # The same change is allowed for a value field.
    assert plan(np.dtype([("x", old_type)]), np.dtype([("x", new_type)])).changes_bytes


def test_a_float_key_field_may_be_renamed():
    evolution = plan(np.dtype([("x", "<f8")]), np.dtype([("y", "<f8")]), renames={"x": "y"}, key=True)
    assert not evolution.changes_bytes


def test_a_key_field_added_or_dropped_is_refused():
    """A query that now groups by (user, day) where the state was kept per user, and back."""
    per_user, per_user_day = np.dtype([("user", "<i8")]), np.dtype([("user", "<i8"), ("day", "<i4")])
    added = refusal(per_user, per_user_day, key=True)
    assert added.problems[0][0] == "day" and added.problems[0][1].startswith("added")
    dropped = refusal(per_user_day, per_user, key=True)
    assert dropped.problems[0][0] == "day" and dropped.problems[0][1].startswith("dropped")
    assert "key field 'day': dropped" in str(dropped)


def test_a_key_field_renamed_without_the_map_is_refused_and_the_map_suggested():
    error = refusal(np.dtype([("user", "<i8")]), np.dtype([("user_id", "<i8")]), key=True)
    problems = dict(error.problems)
    assert set(problems) == {"user_id", "user"}
    assert "name it in renames" in problems["user_id"] and problems["user"].startswith("dropped")


def test_key_fields_reordered_are_refused_naming_each_moved_field():
    error = refusal(np.dtype([("a", "<i4"), ("b", "<i4"), ("c", "S2")]),
                    np.dtype([("b", "<i4"), ("a", "<i4"), ("c", "S2")]), key=True)
    assert [field for field, _ in error.problems] == ["b", "a"]
    assert all("keeps its fields' order" in rule for _, rule in error.problems)


def test_a_key_gets_no_defaults():
    error = refusal(np.dtype([("user", "<i8")]), np.dtype([("user", "<i8"), ("n", "<i4")]), key=True,
                    defaults={"n": 1})
    assert [field for field, _ in error.problems] == ["n"]


@pytest.mark.parametrize("new_type,default,message", [
    ("<i4", "3", "takes an int"),
    ("<i4", 2**31, "cannot hold"),
    ("u1", -1, "cannot hold"),
    ("<i8", True, "takes an int"),
    ("?", 1, "takes a bool"),
    ("S2", b"abc", "at most 2 bytes"),
    ("S2", "ab", "takes bytes"),
    ("<f4", 1e39, "cannot hold"),
])
def test_a_default_of_the_wrong_type_or_out_of_range_is_refused_naming_the_field(new_type, default, message):
    error = refusal(np.dtype([("k", "<i8")]), np.dtype([("k", "<i8"), ("added", new_type)]),
                    defaults={"added": default})
    assert len(error.problems) == 1 and error.problems[0][0] == "added"
    assert "default" in error.problems[0][1] and message in error.problems[0][1]


def test_a_default_for_a_field_that_is_not_added_is_refused():
    old, new = np.dtype([("a", "<i4")]), np.dtype([("a", "<i8")])
    error = refusal(old, new, defaults={"a": 1, "nowhere": 2})
    assert dict(error.problems).keys() == {"a", "nowhere"}
    assert "not added" in dict(error.problems)["a"] and "no such field" in dict(error.problems)["nowhere"]


def test_a_renames_entry_naming_a_missing_field_is_refused():
    old, new = np.dtype([("a", "<i4"), ("b", "<i4")]), np.dtype([("a", "<i4"), ("c", "<i4")])
    error = refusal(old, new, renames={"typo": "c"})
    assert dict(error.problems) == {"typo": "renames maps it to 'c', but the old schema has no field 'typo'"}
    error = refusal(old, new, renames={"b": "typo"})
    assert dict(error.problems) == {"b": "renames maps it to 'typo', but the new schema has no field 'typo'"}


def test_two_fields_renamed_to_one_name_are_refused():
    error = refusal(np.dtype([("a", "<i4"), ("b", "<i4")]), np.dtype([("c", "<i4")]), renames={"a": "c", "b": "c"})
    assert dict(error.problems)["c"] == "renames maps several old fields to it: 'a', 'b'"


def test_every_broken_field_is_listed_in_one_error():
    """A query changed in four ways at once: one error, four fields, four rules."""
    old = np.dtype([("total", "<i8"), ("flag", "?"), ("name", "S8"), ("ok", "<i4")])
    new = np.dtype([("total", "<i4"), ("flag", "u1"), ("name", "S4"), ("ok", "<i8"), ("n", "<i2")])
    error = refusal(old, new, defaults={"n": 70000})
    assert [field for field, _ in error.problems] == ["total", "flag", "name", "n"]
    text = str(error)
    assert text.startswith("the value schema cannot change from [['total', '<i8']")
    assert "4 fields break the rules" in text
    for field in ("total", "flag", "name", "n"):
        assert f"value field '{field}': " in text
    assert text.endswith("`statecore rewrite` (docs/evolution.md).")


def test_the_refusal_is_a_schema_mismatch_and_survives_pickling():
    """Existing callers catch SchemaMismatchError; a worker's error travels pickled to the driver."""
    error = refusal(np.dtype([("v", "<i8")]), np.dtype([("v", "<i4")]))
    assert isinstance(error, SchemaMismatchError) and isinstance(error, TypeError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is SchemaEvolutionError and again.problems == error.problems and str(again) == str(error)


@pytest.mark.parametrize("rows,error,message", [
    (np.zeros((2, 5), np.uint8), ValueError, "rows are 5 bytes wide; rows of the old schema"),
    (np.zeros(8, np.uint8), TypeError, "2-D uint8"),
    (np.zeros((2, 8), np.int8), TypeError, "2-D uint8"),
    ([[0] * 8], TypeError, "2-D uint8"),
])
def test_rows_of_another_width_or_type_are_refused_naming_the_width(rows, error, message):
    evolution = plan(np.dtype([("v", "<i8")]), np.dtype([("v", "<i8"), ("n", "<i4")]))
    with pytest.raises(error, match=message):
        convert(evolution, rows)


def test_plans_are_immutable():
    evolution = plan(np.dtype([("v", "<i4")]), np.dtype([("v", "<i8")]))
    assert isinstance(evolution, EvolutionPlan)
    with pytest.raises(AttributeError):
        evolution.changes_bytes = False
    with pytest.raises(AttributeError):
        evolution.fields[0].source = "w"


# -- a property over random allowed plans -----------------------------------------------------

NUMERIC_WIDENINGS = {t: [t] + [b for a, b in WIDENINGS if a == t] for t in SIGNED + UNSIGNED}
for _t in ["i1", "<i2", "<i4", "u1", "<u2", "<u4"]:
    NUMERIC_WIDENINGS[_t].append("<f8")
NUMERIC_WIDENINGS.update({"<f4": ["<f4", "<f8"], "<f8": ["<f8"], "?": ["?"]})
KINDS = sorted(NUMERIC_WIDENINGS) + ["S1", "S3", "S8"]


def _targets(old_type):
    if old_type.startswith("S"):
        return [f"S{m}" for m in range(int(old_type[1:]), 12)]
    return NUMERIC_WIDENINGS[old_type]


def _random_values(dtype, n, rng):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max), n, dtype=dtype, endpoint=True)
    if dtype.kind == "f":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    raw = rng.integers(1, 256, (n, dtype.itemsize), dtype=np.uint8)
    raw[np.arange(dtype.itemsize) >= rng.integers(0, dtype.itemsize + 1, n)[:, None]] = 0  # NUL-padded
    return raw.reshape(-1).view(dtype)


@st.composite
def allowed_changes(draw):
    """A random old value schema and an allowed new one: each old field kept, widened, renamed
    or dropped, fields added with or without a default, the whole in a random order."""
    old_types = draw(st.lists(st.sampled_from(KINDS), min_size=0, max_size=6))
    old = [(f"f{i}", t) for i, t in enumerate(old_types)]
    new, renames, expected_from = [], {}, {}
    for name, t in old:
        fate = draw(st.sampled_from(["keep", "rename", "drop"]))
        if fate == "drop":
            continue
        target = f"r{name}" if fate == "rename" else name
        if fate == "rename":
            renames[name] = target
        new.append((target, draw(st.sampled_from(_targets(t)))))
        expected_from[target] = name
    defaults = {}
    for i in range(draw(st.integers(0, 3))):
        t = draw(st.sampled_from(KINDS))
        if draw(st.booleans()):
            defaults[f"a{i}"] = _random_values(t, 1, np.random.default_rng(i)).tolist()[0]
        new.append((f"a{i}", t))
    new = draw(st.permutations(new))
    return np.dtype(old), np.dtype(list(new)), renames, defaults, expected_from


@settings(derandomize=True, database=None, max_examples=200, deadline=None)
@given(allowed_changes(), st.integers(0, 2**32 - 1), st.integers(0, 40))
def test_random_allowed_changes_convert_to_the_old_values_or_the_defaults(change, seed, n):
    old, new, renames, defaults, expected_from = change
    rng = np.random.default_rng(seed)
    before = np.zeros(n, RowSchema(old).dtype)
    for name in old.names:
        before[name] = _random_values(old[name], n, rng)
    evolution = plan(old, new, renames=renames, defaults=defaults)
    rows = convert(evolution, RowSchema(old).rows(before))
    assert rows.shape == (n, RowSchema(new).width)
    after = evolution.new.from_rows(rows)
    for name in new.names:
        if name in expected_from:  # Python's ints and floats: a widened value equals the old one exactly
            assert after[name].tolist() == before[expected_from[name]].tolist(), name
        else:
            zero = np.zeros(1, new[name])[0].item()
            assert after[name].tolist() == [defaults.get(name, zero)] * n, name
    assert set(evolution.dropped) == set(old.names) - set(expected_from.values())
