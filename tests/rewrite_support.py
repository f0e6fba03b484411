"""Transforms for ``statecore rewrite``'s tests (tests/engine/test_rewrite.py), importable as
``tests.rewrite_support:<name>`` by the command, in the test's process and in the child
processes the kill tests start. Each has a twin in plain Python (``*_rule``) that the tests
apply to the state before, to compute the state expected after independently."""
import numpy as np

NEW_KEY = np.dtype([("user", "<i8"), ("region", "S8")])
NEW_VALUE = np.dtype([("events", "<i8"), ("sum", "<f8")])


def drop_and_double(keys, values):
    """Drop the users divisible by 3; double every sum (the schemas stay)."""
    keep = keys["user"] % 3 != 0
    values = values[keep].copy()
    values["sum"] *= 2
    return keys[keep], values


def drop_and_double_rule(key, value):
    user, _ = key
    return None if user % 3 == 0 else (key, (value[0], value[1] * 2))


def reshape(keys, values):
    """A change the schema rules refuse: the region key widened to S8, the count renamed to
    events, the sum turned into a float holding the mean; users below -900 dropped."""
    keep = keys["user"] >= -900
    keys, values = keys[keep], values[keep]
    new_keys = np.zeros(len(keys), NEW_KEY)
    new_keys["user"], new_keys["region"] = keys["user"], keys["region"]
    new_values = np.zeros(len(keys), NEW_VALUE)
    new_values["events"] = values["count"]
    new_values["sum"] = values["sum"] / values["count"]
    return new_keys, new_values


def reshape_rule(key, value):
    user, _ = key
    return None if user < -900 else (key, (value[0], value[1] / value[0]))


def every_region_eu(keys, values):
    """Every key's region becomes "eu": keys that were distinct collide."""
    keys = keys.copy()
    keys["region"] = b"eu"
    return keys, values


def lengths_differ(keys, values):
    return keys, values[:-1]


CALLS = [0]


def dtype_per_batch(keys, values):
    """An int sum for the first batch, a float one after: the schemas differ between batches."""
    CALLS[0] += 1
    out = np.zeros(len(values), [("sum", "<i8" if CALLS[0] == 1 else "<f8")])
    return keys, out


def not_arrays(keys, values):
    return list(keys), values


def fails(keys, values):
    raise KeyError("no such column: amount")


NOT_CALLABLE = 42


SPARK_VALUE = np.dtype([("events", "<i8"), ("total", "<f8")])


def for_spark_query(keys, values):
    """The Spark test's transform: users divisible by 3 dropped; the count renamed events, the
    sum a float named total, half a unit added (a schema change the rules refuse)."""
    keep = keys["user"] % 3 != 0
    out = np.zeros(int(keep.sum()), SPARK_VALUE)
    out["events"], out["total"] = values["count"][keep], values["sum"][keep] + 0.5
    return keys[keep], out


def for_spark_query_rule(key, value):
    return None if key[0] % 3 == 0 else (key, (value[0], value[1] + 0.5))


def object_values(keys, values):
    """A value field no store holds (Python objects)."""
    out = np.zeros(len(values), [("note", object)])
    return keys, out
