"""Processors and inputs shared by the harness's tests (tests/engine/test_harness.py, and with Spark
tests/spark/test_harness_vs_operator.py): the README's processor example loaded from the README
itself, an event-time processor with value, list and timers, and its input."""
import contextlib
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from pyspark_glue import StatefulProcessor

README = Path(__file__).resolve().parent.parent / "README.md"
KEY = np.dtype([("user", "<i8")])


def readme_blocks():
    """The README's processor example and its harness test, as written there."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "class Carts(StatefulProcessor)" in b)
    test = next(b for b in blocks if "Harness(Carts())" in b)
    return example, test


@contextlib.contextmanager
def readme_module(directory):
    """The README's example as a module file in ``directory``, imported (its classes pickle
    as a user's module's do, and Spark's workers get it by value)."""
    example, _ = readme_blocks()
    name = "readme_processor_example"
    path = Path(directory) / f"{name}.py"
    path.write_text(example.replace('"/data/state"', repr(str(Path(directory) / "unused"))))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


class Sessions(StatefulProcessor):
    """Event time: clicks per user until 10 s of silence (a timer after the last click), and
    the pages of each user (a list)."""

    key_columns = ["user"]
    key_schema = KEY
    output_schema = "user long, clicks long"
    time_mode = "event_time"
    event_time, delay = "ts", "5 seconds"

    def init(self, state):
        self.count = state.value("count", [("n", "<i8"), ("last", "<i8")])
        self.pages = state.list("pages", [("page", "<i8")])

    def handle_input(self, groups, timers):
        last = np.maximum.reduceat(groups.column("ts"), groups.starts)
        old, found = self.count.get(groups.keys)
        timers.delete(groups.keys[found], old["last"][found] + 10_000_000)
        new = np.zeros(len(groups), self.count.dtype)
        new["n"] = np.where(found, old["n"], 0) + groups.sizes
        new["last"] = np.where(found, np.maximum(old["last"], last), last)
        self.count.put(groups.keys, new)
        timers.register(groups.keys, new["last"] + 10_000_000)
        pages = np.zeros(groups.rows.num_rows, self.pages.dtype)
        pages["page"] = groups.column("page")
        self.pages.append(groups.keys[groups.group], pages)

    def handle_expired_timers(self, keys, times, timers):
        values, found = self.count.get(keys)
        self.count.clear(keys[found])
        return pa.RecordBatch.from_pydict({"user": keys["user"][found], "clicks": values["n"][found]})


def clicks(rng, batch, n=40, users=12):
    """``n`` clicks of batch ``batch``: 3 s of event time a batch, some up to 8 s late."""
    ts = 1_000_000 * (3 * batch + rng.uniform(-8, 2, n)) + 50_000_000
    return pa.table({"user": pa.array(rng.integers(0, users, n), pa.int64()),
                     "ts": pa.array(ts.astype(np.int64), pa.timestamp("us", "UTC")),
                     "page": pa.array(rng.integers(0, 50, n), pa.int64())})


def sorted_rows(table):
    """A table's (or a list of dicts') rows as a sorted list of tuples."""
    def plain(value):  # a struct (a window) as a tuple, so that rows sort
        return tuple(plain(v) for v in value.values()) if isinstance(value, dict) else value

    rows = table.to_pylist() if hasattr(table, "to_pylist") else table
    return sorted(plain(r) for r in rows)
