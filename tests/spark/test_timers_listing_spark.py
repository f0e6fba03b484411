"""Listing timers on Spark: a state variable and the listing's stores added to a running query,
and a variable removed and declared again. The listing itself, without Spark:
tests/engine/test_timers_listing.py."""
import datetime
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from statecore import StateStoreId
from statecore.cli import main as cli_main
from pyspark_glue.processor import StatefulProcessor

from tests.engine.test_timers_listing import register_as_before


def upgraded_processors():
    """``(Before, After)``: a running count per id that registers a timer per row's batch,
    written as the code before the timers' listing had it (the timers' old stores, the old
    register), and the same processor after an upgrade that adds a ``last`` value variable and
    outputs how many timers each id lists."""
    import pyarrow as pa

    class Before(StatefulProcessor):
        key_columns = ["id"]
        key_schema = np.dtype([("id", "<i8")])
        output_schema = "id long, n long, last string, timers long"

        def init(self, state):
            self.n = state.value("n", [("n", "<i8")])

        @property
        def state_stores(self):
            stores = dict(StatefulProcessor.state_stores.fget(self))
            return {name: s for name, s in stores.items() if not name.startswith("__timers.key")}

        def count(self, groups):
            old, found = self.n.get(groups.keys)
            new = np.zeros(len(groups), dtype=self.n.dtype)
            new["n"] = np.where(found, old["n"], 0) + groups.sizes
            self.n.put(groups.keys, new)
            return new["n"], groups.column("ts")[groups.starts]

        def open(self, context):
            self.stores = context.stores  # for the task's copy, which the handlers run on
            return super().open(context)

        def handle_input(self, groups, timers):
            n, times = self.count(groups)
            register_as_before(self.stores, self.key_schema, groups.keys, times)
            return pa.RecordBatch.from_pydict({"id": groups.keys["id"], "n": n, "last": [None] * len(n),
                                               "timers": [-1] * len(n)})

    class After(Before):
        state_stores = StatefulProcessor.state_stores

        def init(self, state):
            super().init(state)
            self.last = state.value("last", [("payload", "S8")])

        def handle_input(self, groups, timers):
            n, times = self.count(groups)
            timers.register(groups.keys, times)
            last = np.zeros(len(groups), dtype=self.last.dtype)
            last["payload"] = groups.column("payload").astype("S8")[groups.starts]
            self.last.put(groups.keys, last)
            which, _ = timers.list(groups.keys)
            return pa.RecordBatch.from_pydict({"id": groups.keys["id"], "n": n,
                                               "last": last["payload"].astype(str),
                                               "timers": np.bincount(which, minlength=len(groups))})

    return Before, After


def test_a_variable_and_the_timers_listing_added_to_a_running_query(spark, tmp_path):
    """A processor run two batches, then restarted with a new value variable and the timers'
    new listing stores: batch 2 starts them empty (the listing filled from the timers already
    registered), the new variable works, the old state is intact; a restart after that reads
    everything back, read_state of the new variable too."""
    from pyspark_glue import StatefulOperator, read_state

    before, after = upgraded_processors()
    root = str(tmp_path / "state")
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)

    def run(fn, b, ids):
        op = StatefulOperator(root, 0, 2, fn=fn())
        rows = [(i, t0 + datetime.timedelta(seconds=b), f"b{b}-{i}") for i in ids]
        out = sorted(tuple(r) for r in op.process(spark.createDataFrame(rows, "id long, ts timestamp, payload string"),
                                                   b).collect())
        op.close()
        return out

    assert run(before, 0, [1, 2, 3, 3]) == [(1, 1, None, -1), (2, 1, None, -1), (3, 2, None, -1)]
    assert run(before, 1, [1, 4]) == [(1, 2, None, -1), (4, 1, None, -1)]
    # the restart with the upgrade: id 1 has timers at t0+0s, t0+1s (written before) and t0+2s
    assert run(after, 2, [1, 2, 5]) == [(1, 3, "b2-1", 3), (2, 2, "b2-2", 2), (5, 1, "b2-5", 1)]
    assert run(after, 3, [1, 3, 5]) == [(1, 4, "b3-1", 4), (3, 3, "b3-3", 2), (5, 2, "b3-5", 2)]
    last = {r["id"]: r["payload"] for r in read_state(spark, root, 0, "last").collect()}
    assert last == {1: b"b3-1", 2: b"b2-2", 3: b"b3-3", 5: b"b3-5"}
    n = {r["id"]: r["n"] for r in read_state(spark, root, 0, "n").collect()}
    assert n == {1: 4, 2: 2, 3: 3, 4: 1, 5: 2}
    listing = {r["id"]: r["count"] for r in read_state(spark, root, 0, "__timers.keys").collect()}
    assert listing == {1: 4, 2: 2, 3: 2, 4: 1, 5: 2}, "timers registered before the upgrade are listed"
    result = CliRunner().invoke(cli_main, ["verify", root, "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and json.loads(result.output)["sound"], result.output


def test_a_variable_removed_and_declared_again_is_refused_until_its_directory_is_moved(spark, tmp_path):
    """A query drops its ``extra`` variable for a batch, then declares it again: the store's
    directory holds versions no record names, so the batch fails naming the directory, writes
    no record and changes no state; once the directory is moved away, ``extra`` starts empty."""
    import pyarrow as pa
    from pyspark_glue import StatefulOperator

    class Counter(StatefulProcessor):
        key_columns = ["id"]
        key_schema = np.dtype([("id", "<i8")])
        output_schema = "id long, n long, extra long"
        with_extra = True

        def init(self, state):
            self.n = state.value("n", [("n", "<i8")])
            if self.with_extra:
                self.extra = state.value("extra", [("n", "<i8")])

        def handle_input(self, groups, timers):
            old, found = self.n.get(groups.keys)
            new = np.zeros(len(groups), dtype=self.n.dtype)
            new["n"] = np.where(found, old["n"], 0) + groups.sizes
            self.n.put(groups.keys, new)
            extra = np.full(len(groups), -1)
            if self.with_extra:
                had, there = self.extra.get(groups.keys)
                values = np.zeros(len(groups), dtype=self.extra.dtype)
                values["n"] = extra = np.where(there, had["n"], 0) + 1
                self.extra.put(groups.keys, values)
            return pa.RecordBatch.from_pydict({"id": groups.keys["id"], "n": new["n"], "extra": extra})

    root = str(tmp_path / "state")
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)

    def run(with_extra, b):
        fn = Counter()
        fn.with_extra = with_extra
        op = StatefulOperator(root, 0, 2, fn=fn)
        try:
            df = spark.createDataFrame([(i, t0, "p") for i in (1, 2)], "id long, ts timestamp, payload string")
            return sorted(tuple(r) for r in op.process(df, b).collect())
        finally:
            op.close()

    assert run(True, 0) == [(1, 1, 1), (2, 1, 1)]
    assert run(False, 1) == [(1, 2, -1), (2, 2, -1)]
    with pytest.raises(Exception, match=r"extra is new to the operator at version 2 .*holds version 1 that no record"):
        run(True, 2)
    op = StatefulOperator(root, 0, 2, fn=Counter())
    assert op.commit_record(2) is None, "the failed batch wrote no record"
    op.close()
    for p in (0, 1):
        extra = StateStoreId(root, 0, p, store_name="extra").store_checkpoint_location()
        os.rename(extra, str(tmp_path / f"extra-{p}-kept"))
    assert run(True, 2) == [(1, 3, 1), (2, 3, 1)], "n went on from batch 1; extra started empty"
