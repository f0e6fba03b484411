"""A StatefulOperator whose state schemas change between runs, on real Spark (docs/evolution.md):
a query runs some batches, stops, its fn changes, it restarts and runs more. Each allowed change
gives the state and output the evolution rule defines (computed here, in Python, from the
input); an old version read afterwards comes in the schemas asked for; each refused change
fails before a file is written."""
import os

import numpy as np
import pytest

from statecore import SchemaChanges, SchemaEvolutionError

from pyspark_glue import StatefulOperator, column_to_numpy, keys_from_arrow, read_state
from pyspark_glue.aggregates import group_rows
from pyspark_glue.arrow import column
from pyspark_glue.operator_fn import OperatorFunction, TaskHandler

from tests.glue_support import INPUT_DDL, events

pytestmark = pytest.mark.spark

KEY_V1 = np.dtype([("user", "<i8"), ("region", "S4")])
VALUE_V1 = np.dtype([("count", "<i4"), ("sum", "<i4")])


class Totals(OperatorFunction):
    """A running count and sum of ``amount`` per key in fields named by ``fields`` ({"count":
    name, "sum": name, "max": name or absent}); the key read from the columns named like its
    fields. Emits every key it updated with its new value."""

    def __init__(self, key, value, fields, schema_changes=None):
        self.key_schema, self.value_schema, self.fields = key, value, fields
        self.key_columns = list(key.names)
        self.schema_changes = schema_changes
        self.output_schema = None

    def open(self, context):
        return TotalsTask(self, context)


class TotalsTask(TaskHandler):
    def process(self, batch):
        fn = self.fn
        keys = keys_from_arrow(batch, fn.key_schema)
        if not len(keys):
            return None
        amounts = column_to_numpy(column(batch, "amount"), np.int64, "amount")
        order, starts = group_rows(keys)
        distinct = keys[order[starts]]
        old, found = self.store.get_batch(distinct)
        new = old.copy()
        f = fn.fields
        new[f["count"]] = np.where(found, old[f["count"]], 0) + np.diff(np.append(starts, len(keys)))
        new[f["sum"]] = np.where(found, old[f["sum"]], 0) + np.add.reduceat(amounts[order], starts)
        if "max" in f:
            batch_max = np.maximum.reduceat(amounts[order], starts)
            new[f["max"]] = np.where(found, np.maximum(old[f["max"]], batch_max), batch_max)
        self.store.put_batch(distinct, new)
        return None


def run(spark, root, fn, tables, first_batch, rename_columns=None):
    """One run of an operator over ``tables`` (one batch each, from ``first_batch``), closed after."""
    op = StatefulOperator(root, 0, 3, fn=fn, coordinator=False)
    try:
        for i, t in enumerate(tables):
            df = spark.createDataFrame(t.to_pandas(), INPUT_DDL)
            for old, new in (rename_columns or {}).items():
                df = df.withColumnRenamed(old, new)
            op.process(df, first_batch + i, read_output=False)
    finally:
        op.close()


def rows_of(tables):
    for t in tables:
        yield from zip(*(t.column(c).to_pylist() for c in ("user", "region", "amount")))


def state_of(spark, root, key_names, value_names, version=None):
    df = read_state(spark, root, 0, version=version)
    return {tuple(r[k] for k in key_names): tuple(r[v] for v in value_names) for r in df.collect()}


def file_times(root):
    out = {}
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            out[path] = os.stat(path).st_mtime_ns
    return out


def test_values_renamed_widened_reordered_and_added_carry_the_state_on(spark, tmp_path):
    """count -> n and sum -> total, both int32 -> int64, total moved first, max_amount added
    with the default -1 (unknown for rows merged before it existed): after the restart every
    key's n and total are over all its rows, its max over the rows since."""
    root = str(tmp_path / "state")
    before, after = [events(1, 400), events(2, 400)], [events(3, 400), events(4, 300)]
    run(spark, root, Totals(KEY_V1, VALUE_V1, {"count": "count", "sum": "sum"}), before, 0)
    value_v2 = np.dtype([("total", "<i8"), ("n", "<i8"), ("max_amount", "<i8")])
    changes = SchemaChanges(renames={"count": "n", "sum": "total"}, defaults={"max_amount": -1})
    run(spark, root, Totals(KEY_V1, value_v2, {"count": "n", "sum": "total", "max": "max_amount"}, changes),
        after, 2)
    expected = {}
    for i, (user, region, amount) in enumerate(rows_of(before + after)):
        n, total, top = expected.get((user, region), (0, 0, -1))
        late = i >= sum(t.num_rows for t in before)
        expected[(user, region)] = (n + 1, total + amount, max(top, amount) if late else top)
    got = state_of(spark, root, ("user", "region"), ("n", "total", "max_amount"))
    assert {(u, r.decode()): v for (u, r), v in got.items()} == expected
    # the state of batch 1, written under the old schemas, read in the new ones
    old = {}
    for user, region, amount in rows_of(before):
        n, total = old.get((user, region), (0, 0))
        old[(user, region)] = (n + 1, total + amount)
    got = state_of(spark, root, ("user", "region"), ("n", "total", "max_amount"), version=2)
    assert {(u, r.decode()): v for (u, r), v in got.items()} == {k: (n, t, -1) for k, (n, t) in old.items()}
    # a third run, declaring nothing more, goes on from the new schemas
    run(spark, root, Totals(KEY_V1, value_v2, {"count": "n", "sum": "total", "max": "max_amount"}, changes),
        [events(5, 100)], 4)
    for user, region, amount in rows_of([events(5, 100)]):
        n, total, top = expected.get((user, region), (0, 0, -1))
        expected[(user, region)] = (n + 1, total + amount, max(top, amount))
    got = state_of(spark, root, ("user", "region"), ("n", "total", "max_amount"))
    assert {(u, r.decode()): v for (u, r), v in got.items()} == expected


def test_a_key_field_renamed_and_widened_is_rekeyed_and_found_by_the_new_query(spark, tmp_path):
    """region (S4) becomes area (S8), its input column renamed: every key is re-keyed once
    and the rows of the new run add to the totals of the old (the column's Spark type, and so
    each key's partition, is unchanged); the value fields widened and swapped at the same time."""
    root = str(tmp_path / "state")
    before, after = [events(11, 500), events(12, 500)], [events(13, 500)]
    run(spark, root, Totals(KEY_V1, VALUE_V1, {"count": "count", "sum": "sum"}), before, 0)
    key_v2 = np.dtype([("user", "<i8"), ("area", "S8")])
    fn = Totals(key_v2, np.dtype([("sum", "<i8"), ("count", "<i8")]), {"count": "count", "sum": "sum"},
                SchemaChanges(renames={"region": "area"}))
    run(spark, root, fn, after, 2, rename_columns={"region": "area"})
    expected = {}
    for user, region, amount in rows_of(before + after):
        count, total = expected.get((user, region), (0, 0))
        expected[(user, region)] = (count + 1, total + amount)
    got = state_of(spark, root, ("user", "area"), ("count", "sum"))
    assert {(u, a.decode()): v for (u, a), v in got.items()} == expected


def test_a_dropped_value_field_is_gone_and_the_rest_carries_on(spark, tmp_path):
    root = str(tmp_path / "state")
    before, after = [events(21, 300)], [events(22, 300)]
    run(spark, root, Totals(KEY_V1, VALUE_V1, {"count": "count", "sum": "sum"}), before, 0)
    only_count = np.dtype([("count", "<i4"), ("sum2", "<i8")])  # sum dropped, sum2 added (no rename declared)
    run(spark, root, Totals(KEY_V1, only_count, {"count": "count", "sum": "sum2"}), after, 1)
    expected = {}
    for i, (user, region, amount) in enumerate(rows_of(before + after)):
        count, total = expected.get((user, region), (0, 0))
        expected[(user, region)] = (count + 1, total + (amount if i >= before[0].num_rows else 0))
    got = state_of(spark, root, ("user", "region"), ("count", "sum2"))
    assert {(u, r.decode()): v for (u, r), v in got.items()} == expected


@pytest.mark.parametrize("key, value, problems", [
    (KEY_V1, np.dtype([("count", "<i2"), ("sum", "<i4")]), ["value field 'count'", "narrows"]),
    (KEY_V1, np.dtype([("count", "<f4"), ("sum", "<i4")]), ["value field 'count'", "not exact"]),
    (np.dtype([("user", "<i8"), ("region", "S4"), ("day", "<i4")]), VALUE_V1, ["key field 'day'", "added"]),
    (np.dtype([("user", "<i4"), ("region", "S4")]), VALUE_V1, ["key field 'user'", "narrows"]),
], ids=["value narrowed", "value to an inexact float", "key field added", "key narrowed"])
def test_a_refused_change_fails_before_anything_is_written(spark, tmp_path, key, value, problems):
    root = str(tmp_path / "state")
    run(spark, root, Totals(KEY_V1, VALUE_V1, {"count": "count", "sum": "sum"}), [events(31, 200)], 0)
    before = file_times(root)
    table = events(32, 200)
    if "day" in key.names:
        import pyarrow as pa
        table = table.append_column("day", pa.array(np.zeros(table.num_rows, np.int32)))
    fn = Totals(key, value, {"count": "count", "sum": "sum"})
    fn.key_columns = ["user", "region"]  # rows routed as before: the key schema is what changed
    op = StatefulOperator(root, 0, 3, fn=fn, coordinator=False)
    ddl = INPUT_DDL + (", day int" if "day" in key.names else "")
    with pytest.raises(SchemaEvolutionError) as e:
        op.process(spark.createDataFrame(table.to_pandas(), ddl), 1, read_output=False)
    op.close()
    message = str(e.value)
    assert message.startswith("operator 0 at ")
    for problem in problems:
        assert problem in message
    assert "statecore rewrite" in message
    after = file_times(root)
    assert {p: t for p, t in after.items() if "_lock" not in p} == {p: t for p, t in before.items() if "_lock" not in p}


def test_a_running_aggregate_whose_sum_widens_carries_its_totals_on(spark, tmp_path):
    """A built-in whose sum grows from int32 to int64 between runs: a widening, made in place."""
    from pyspark_glue import RunningAggregate

    root = str(tmp_path / "state")
    before, after = [events(41, 300)], [events(42, 300)]
    for tables, first, sum_dtype in ((before, 0, "<i4"), (after, 1, "<i8")):
        agg = RunningAggregate(KEY_V1, "amount", sum_dtype=sum_dtype, emit=False)
        op = StatefulOperator(root, 0, 3, ["user", "region"], KEY_V1, agg.value_schema, agg, None, coordinator=False)
        for i, t in enumerate(tables):
            op.process(spark.createDataFrame(t.to_pandas(), INPUT_DDL), first + i, read_output=False)
        op.close()
    expected = {}
    for user, region, amount in rows_of(before + after):
        count, total = expected.get((user, region), (0, 0))
        expected[(user, region)] = (count + 1, total + amount)
    got = state_of(spark, root, ("user", "region"), ("count", "sum"))
    assert {(u, r.decode()): v for (u, r), v in got.items()} == expected


def test_an_aggregate_added_to_a_windowed_aggregate_is_refused_naming_it(spark, tmp_path):
    """The rows already merged into a window are not kept: a new aggregate's value over them is
    unknown, so the change is refused (the rules alone would add it as zero: a wrong answer)."""
    from pyspark_glue import WindowedAggregate

    root = str(tmp_path / "state")
    ddl = "user long, region string, amount long, ts timestamp"

    def frame(seed):
        t = events(seed, 200).to_pandas()
        t["ts"] = np.datetime64("2026-01-01T00:00:00") + np.arange(len(t)).astype("timedelta64[s]")
        return spark.createDataFrame(t, ddl)

    def operator(aggregates):
        fn = WindowedAggregate(["user"], "ts", "10 minutes", "5 minutes", aggregates=aggregates)
        return StatefulOperator(root, 0, 2, fn=fn, coordinator=False)

    op = operator({"n": ("count", "*")})
    op.process(frame(51), 0, read_output=False)
    op.close()
    before = file_times(root)
    op = operator({"n": ("count", "*"), "top": ("max", "amount")})
    with pytest.raises(SchemaEvolutionError) as e:
        op.process(frame(52), 1, read_output=False)
    op.close()
    assert "(WindowedAggregate)" in str(e.value) and "value field 'top" in str(e.value)
    assert "aggregate added to a built-in" in str(e.value)
    after = file_times(root)
    assert {p: t for p, t in after.items() if "_lock" not in p} == {p: t for p, t in before.items() if "_lock" not in p}


def test_a_processor_state_variable_retyped_between_runs_carries_on(spark, tmp_path):
    """A StatefulProcessor's ValueState is a store of its own: its value widened (sum int32 ->
    int64) with a field added (rows, declared default 0 under the variable's store name) at a
    restart; a variable added at the same time starts empty."""
    from pyspark_glue import StatefulProcessor

    key = np.dtype([("user", "<i8")])

    class Sums(StatefulProcessor):
        key_columns, key_schema, time_mode = ["user"], key, "none"
        value = np.dtype([("sum", "<i4")])

        def init(self, state):
            self.total = state.value("total", self.value)
            if "rows" in self.value.names:
                self.seen = state.value("seen", [("first_amount", "<i8")])

        def handle_input(self, groups, timers):
            amounts = groups.column("amount")
            old, found = self.total.get(groups.keys)
            new = np.zeros(len(groups), self.total.dtype)
            new["sum"] = np.where(found, old["sum"], 0) + np.add.reduceat(amounts, groups.starts)
            if "rows" in self.value.names:
                new["rows"] = np.where(found, old["rows"], 0) + groups.sizes
                _, had = self.seen.get(groups.keys)
                first = np.zeros(int((~had).sum()), self.seen.dtype)
                first["first_amount"] = amounts[groups.starts][~had]
                self.seen.put(groups.keys[~had], first)
            self.total.put(groups.keys, new)

    class SumsWithRows(Sums):
        value = np.dtype([("rows", "<i8"), ("sum", "<i8")])
        schema_changes = {"total": SchemaChanges(defaults={"rows": 0})}

    root = str(tmp_path / "state")
    before, after = [events(61, 300)], [events(62, 300)]
    run(spark, root, Sums(), before, 0)
    run(spark, root, SumsWithRows(), after, 1)
    expected = {}
    for i, (user, _, amount) in enumerate(rows_of(before + after)):
        rows, total = expected.get(user, (0, 0))
        expected[user] = (rows + (i >= before[0].num_rows), total + amount)
    got = read_state(spark, root, 0, store_name="total").collect()
    assert {r["user"]: (r["rows"], r["sum"]) for r in got} == expected
    seen = read_state(spark, root, 0, store_name="seen").collect()
    assert {r["user"] for r in seen} == {user for user, _, _ in rows_of(after)}


def test_a_schema_change_after_a_repartition_keeps_its_record(spark, tmp_path):
    """_operator.json replaced after the first batch under new schemas keeps what else it
    recorded: here the repartition's switch (a batch at or before it still may not run again,
    and the record of its batch is still the switch's)."""
    import json

    from statecore.operator_files import REPARTITION_KEY, read_commit_record, commit_log
    from statecore.repartition import repartition

    root = str(tmp_path / "state")
    run(spark, root, Totals(KEY_V1, VALUE_V1, {"count": "count", "sum": "sum"}), [events(71, 200)], 0)
    repartition(root, 0, 3)
    wide = np.dtype([("count", "<i8"), ("sum", "<i8")])
    run(spark, root, Totals(KEY_V1, wide, {"count": "count", "sum": "sum"}), [events(72, 200)], 1)
    with open(os.path.join(root, "0", "_operator.json")) as f:
        metadata = json.load(f)
    assert REPARTITION_KEY in metadata and metadata["value_schema"] == [["count", "<i8"], ["sum", "<i8"]]
    assert read_commit_record(commit_log(os.path.join(root, "0")), 0, metadata) is not None
    op = StatefulOperator(root, 0, 3, fn=Totals(KEY_V1, wide, {"count": "count", "sum": "sum"}), coordinator=False)
    with pytest.raises(ValueError, match="repartitioned from 3 to 3 partitions after batch 0: batch 0 cannot run"):
        op.process(spark.createDataFrame(events(73, 10).to_pandas(), INPUT_DDL), 0, read_output=False)
    op.close()


def test_a_refused_change_of_a_processor_variable_fails_on_the_driver_writing_nothing(spark, tmp_path):
    """A state variable's value narrowed (int64 -> int32): refused before the job, naming the
    variable's store, with no file written (its stores are not the operator's own, whose
    schemas _operator.json records: the driver reads partition 0's schema history)."""
    from pyspark_glue import StatefulProcessor

    class Counter(StatefulProcessor):
        key_columns, key_schema, time_mode = ["user"], np.dtype([("user", "<i8")]), "none"
        value = np.dtype([("n", "<i8")])

        def init(self, state):
            self.counts = state.value("counts", self.value)

        def handle_input(self, groups, timers):
            old, found = self.counts.get(groups.keys)
            new = np.zeros(len(groups), self.counts.dtype)
            new["n"] = np.where(found, old["n"], 0) + groups.sizes
            self.counts.put(groups.keys, new)

    class Narrowed(Counter):
        value = np.dtype([("n", "<i4")])

    root = str(tmp_path / "state")
    run(spark, root, Counter(), [events(81, 100)], 0)
    before = file_times(root)
    op = StatefulOperator(root, 0, 3, fn=Narrowed(), coordinator=False)
    with pytest.raises(SchemaEvolutionError) as e:
        op.process(spark.createDataFrame(events(82, 100).to_pandas(), INPUT_DDL), 1, read_output=False)
    op.close()
    assert "store 'counts'" in str(e.value) and "value field 'n'" in str(e.value)
    after = file_times(root)
    assert {p: t for p, t in after.items() if "_lock" not in p} == {p: t for p, t in before.items() if "_lock" not in p}
