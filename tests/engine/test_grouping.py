"""Grouping equal key rows by hash (statecore._grouping) and the structured-array grouping
every ready-made fn shares (pyspark_glue.aggregates.group_rows), against a dict model."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from statecore.grouping import group_rows
from statecore._grouping import group_key_rows


def model_groups(keys):
    """Each distinct key's row numbers, in order of first appearance, as lists."""
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def groups_of(order, starts):
    ends = np.append(starts[1:], len(order))
    return [order[a:b].tolist() for a, b in zip(starts, ends)]


@settings(max_examples=200, deadline=None)
@given(width=st.integers(0, 20), n=st.integers(0, 300), distinct=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_group_key_rows_equals_the_dict_model(width, n, distinct, seed):
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, (distinct, width), dtype=np.uint8)
    rows = np.ascontiguousarray(palette[rng.integers(0, distinct, n)])
    order, starts = group_key_rows(rows)
    assert order.dtype == starts.dtype == np.intp
    assert groups_of(order, starts) == model_groups([r.tobytes() for r in rows])


def test_group_key_rows_at_sizes_that_grow_the_index():
    rng = np.random.default_rng(7)
    for n in (1, 15, 16, 17, 1000, 70_001):
        keys = rng.integers(0, max(1, n // 3), n).astype("<i8")
        order, starts = group_key_rows(keys.view(np.uint8).reshape(n, 8))
        assert groups_of(order, starts) == model_groups(keys.tolist())


def test_group_key_rows_refuses_rows_that_are_not_a_contiguous_matrix():
    with pytest.raises(ValueError):
        group_key_rows(np.zeros((4, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises((ValueError, TypeError)):
        group_key_rows(np.zeros(8, dtype=np.uint8))


def test_group_rows_of_structured_keys():
    key = np.dtype([("user", "<i4"), ("region", "S3"), ("score", "<f8")])
    keys = np.array([(1, b"eu", 0.0), (2, b"us", 1.5), (1, b"eu", -0.0), (1, b"eu", np.nan),
                     (2, b"us", 1.5), (1, b"eu", float("-nan")), (1, b"us", 0.0)], dtype=key)
    order, starts = group_rows(keys)
    # -0.0 is 0.0 and every NaN is one key, as in the store's key rows
    assert groups_of(order, starts) == [[0, 2], [1, 4], [3, 5], [6]]


def test_group_rows_of_one_integer_field_taken_from_a_wider_array():
    wide = np.zeros(6, dtype=[("k", "<i8"), ("v", "<f8")])
    wide["k"] = [5, 3, 5, 9, 3, 5]
    order, starts = group_rows(wide[["k"]])
    assert groups_of(order, starts) == [[0, 2, 5], [1, 4], [3]]
    order, starts = group_rows(np.zeros(0, dtype=[("k", "<i8")]))
    assert order.shape == starts.shape == (0,)
