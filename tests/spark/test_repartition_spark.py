"""Repartitioning on Spark: Spark's hash in numpy against Spark's own, and a query that runs on
4 partitions, is moved to 7 then 2 (locally and as a Spark job) and goes on with the same
state; an event-time operator moved with its expiry index. The local rewrite, the command,
its kills and its bad input: tests/engine/test_repartition.py."""
import shutil

import numpy as np
import pytest

from statecore.spark_hash import spark_hash, spark_partition
from statecore import repartition as engine

from tests.engine.test_repartition import cli, killed_run


def _hash_table(n, seed):
    """Columns of every hashable type, with negatives, -0.0, NaNs, infinities, empty, multi-byte
    and long strings."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    doubles = rng.normal(0, 1e6, n)
    doubles[:8] = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 5e-324, -1.5]
    floats = doubles.astype(np.float32)
    alphabet = list("abcXYZ09 ") + ["é", "ß", "中", "😀"]
    strings = ["".join(rng.choice(alphabet, rng.integers(0, 40))) for _ in range(n)]
    strings[:3] = ["", "a" * 200, "abc"]
    binaries = [bytes(rng.integers(1, 256, rng.integers(0, 23), dtype=np.uint8)) for _ in range(n)]
    return pa.table({
        "b": pa.array(rng.integers(0, 2, n).astype(bool)),
        "i8": pa.array(rng.integers(-128, 128, n).astype(np.int8)),
        "i16": pa.array(rng.integers(-2**15, 2**15, n).astype(np.int16)),
        "i32": pa.array(rng.integers(-2**31, 2**31, n).astype(np.int32)),
        "i64": pa.array(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)),
        "f32": pa.array(floats), "f64": pa.array(doubles),
        "s": pa.array(strings, pa.string()), "bin": pa.array(binaries, pa.binary()),
        "d": pa.array(rng.integers(-100_000, 100_000, n).astype(np.int32)).cast(pa.date32()),
        "ts": pa.array(rng.integers(-2**50, 2**50, n)).cast(pa.timestamp("us", "UTC")),
    })


def _numpy_column(column):
    """A Spark-returned Arrow column as the store holds it: numbers, days, microseconds, S<n>."""
    import pyarrow as pa

    t = column.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        values = [v.encode() if isinstance(v, str) else v for v in column.to_pylist()]
        return np.array(values, dtype=f"S{max(1, max(len(v) for v in values))}")
    if pa.types.is_date32(t):
        return column.cast(pa.int32()).to_numpy()
    if pa.types.is_timestamp(t):
        return column.cast(pa.int64()).to_numpy()
    return column.to_numpy(zero_copy_only=False)


def test_spark_hash_equals_spark_on_every_key_type(spark):
    n = 3000
    table = _hash_table(n, seed=11)
    df = spark.createDataFrame(table)  # from Arrow: NaN stays NaN (pandas would make it null)
    df = df.selectExpr("b", "cast(i8 as tinyint) i8", "cast(i16 as smallint) i16", "cast(i32 as int) i32", "i64",
                       "cast(f32 as float) f32", "f64", "s", "bin", "cast(d as date) d", "ts",
                       "cast(ts as timestamp_ntz) ntz")
    singles = [c for c in df.columns]
    combos = [("i64", "s"), ("s", "bin", "i32"), ("f64", "f32", "d", "ts", "b"), ("i8", "i16", "ntz")]
    exprs = [f"hash(`{c}`) h_{c}" for c in singles]
    exprs += [f"hash({', '.join(c)}) h_{'_'.join(c)}" for c in combos]
    exprs += [f"pmod(hash(i64, s), {m}) p_{m}" for m in (1, 7, 200)]
    out = df.selectExpr("*", *exprs).toArrow()
    types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    columns = {c: _numpy_column(out.column(c)) for c in singles}
    assert types["ntz"] == "timestamp_ntz" and types["d"] == "date" and types["i8"] == "tinyint"
    assert np.isnan(columns["f64"]).sum() == np.isnan(columns["f32"]).sum() == 2  # NaNs reached Spark as NaN
    assert np.signbit(columns["f64"][1]) and (columns["s"] == b"").any()
    for c in singles:
        np.testing.assert_array_equal(spark_hash([columns[c]], [types[c]]), out.column(f"h_{c}").to_numpy(),
                                      err_msg=c)
    for combo in combos:
        got = spark_hash([columns[c] for c in combo], [types[c] for c in combo])
        np.testing.assert_array_equal(got, out.column(f"h_{'_'.join(combo)}").to_numpy(), err_msg=str(combo))
    for m in (1, 7, 200):
        got = spark_partition([columns["i64"], columns["s"]], [types["i64"], types["s"]], m)
        np.testing.assert_array_equal(got, out.column(f"p_{m}").to_numpy())
    # a wider S<n> field (NUL padding) hashes the same value
    wide = columns["s"].astype("S300")
    np.testing.assert_array_equal(spark_hash([wide], ["string"]), out.column("h_s").to_numpy())


def test_query_moves_from_4_to_7_to_2_partitions_and_keeps_its_state(spark, tmp_path):
    from pyspark.sql import functions as F

    from pyspark_glue import read_state, repartition_state
    from tests.glue_support import events_df, make_operator, spark_group_by, state_dict

    root = str(tmp_path / "state")
    dfs = [events_df(spark, seed=40 + i, n=400, users=60) for i in range(10)]
    with make_operator(root, num_partitions=4) as op:
        for b in range(5):
            op.process(dfs[b], b)
    after_five = state_dict(read_state(spark, root, 0))
    assert after_five == spark_group_by(dfs[:5])

    killed_run(root, "rename", "*.snapshot", 3, to=7)  # killed half-way: still 4, same state
    state = read_state(spark, root, 0)
    assert sorted({r["partition_id"] for r in state.collect()}) == [0, 1, 2, 3]
    assert state_dict(state) == after_five

    moved = cli("repartition", root, "--operator", "0", "--to", "7", "--json")
    assert moved.exit_code == 0, moved.output
    state = read_state(spark, root, 0)
    assert state_dict(state) == after_five
    misrouted = state.where(F.expr("partition_id != pmod(hash(user, region), 7)")).count()
    assert misrouted == 0 and state.select("partition_id").distinct().count() == 7

    # The Spark job and the local rewrite leave the same state in the same partitions.
    local = str(tmp_path / "local")
    shutil.copytree(root, local)
    assert cli("repartition", local, "--operator", "0", "--to", "2").exit_code == 0
    result = repartition_state(spark, root, 0, 2)
    assert result["to_partitions"] == 2 and result["stores"]["default"]["rows"] == len(after_five)
    by_partition = sorted(tuple(r) for r in read_state(spark, root, 0).collect())
    assert by_partition == sorted(tuple(r) for r in read_state(spark, local, 0).collect())

    with pytest.raises(ValueError, match="num_partitions=2"):
        make_operator(root, num_partitions=4).process(dfs[5], 5)
    with make_operator(root, num_partitions=2) as op:
        with pytest.raises(ValueError, match="repartitioned"):
            op.process(dfs[4], 4)
        for b in range(5, 10):
            op.process(dfs[b], b)
    assert state_dict(read_state(spark, root, 0)) == spark_group_by(dfs)


def _dedup_batch(spark, b):
    """Batch ``b`` of the dedup query: 60 rows of 25 ids, event times in the batch's own 20 s
    (so keys expire two batches on), some ids repeated within the batch."""
    import datetime

    rng = np.random.default_rng(100 + b)
    base = datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=20 * b)
    rows = [(int(rng.integers(0, 25)), base + datetime.timedelta(milliseconds=int(rng.integers(0, 20000))),
             int(rng.integers(0, 1000))) for _ in range(60)]
    return spark.createDataFrame(rows, "id long, ts timestamp, v long")


def _event_time_fn(kind):
    from pyspark_glue import Deduplicate, SessionWindow, WindowedAggregate

    aggregates = {"n": ("count", "*"), "total": ("sum", "v")}
    if kind == "dedup":
        return Deduplicate(["id"], "ts", "10 seconds")
    if kind == "window":
        return WindowedAggregate(["id"], "ts", "10 seconds", "10 seconds", aggregates=aggregates)
    return SessionWindow(["id"], "ts", "10 seconds", "3 seconds", aggregates=aggregates)


@pytest.mark.parametrize("kind", ["dedup", "window", "session"])
def test_an_event_time_operator_moves_with_its_expiry_index(spark, tmp_path, kind):
    """A Deduplicate, WindowedAggregate or SessionWindow (state, and its expiry index) runs 3
    batches on 4 partitions, is repartitioned to 3 (the index rebuilt from its entries in the
    partition of each key) and runs 3 more: every later batch's output, late rows and
    watermarks, and the final state, equal those of the same query run on 3 partitions from
    the start: the moved index evicts (and emits) what it should."""
    from pyspark_glue import StatefulOperator, read_state

    def operator(root, partitions):
        return StatefulOperator(root, 0, partitions, fn=_event_time_fn(kind))

    def rows(df):
        return sorted(tuple(r) for r in df.collect())

    moved, direct = str(tmp_path / "moved"), str(tmp_path / "direct")
    before, reference = operator(moved, 4), operator(direct, 3)
    for b in range(3):
        before.process(_dedup_batch(spark, b), b)
        reference.process(_dedup_batch(spark, b), b)
    before.close()
    summary = engine.repartition(moved, 0, 3)
    assert {"default", "expiry_entries", "expiry_heads"} <= set(summary["stores"])
    after = operator(moved, 3)
    for b in range(3, 6):
        out = rows(after.process(_dedup_batch(spark, b), b))
        expected = rows(reference.process(_dedup_batch(spark, b), b))
        assert out == expected, b
        for field in ("late_rows", "watermark_for_eviction_ms", "state_keys"):
            assert after.last_progress[field] == reference.last_progress[field], (b, field)
    assert rows(read_state(spark, moved, 0)) == rows(read_state(spark, direct, 0))
    if kind == "dedup":
        assert after.last_progress["state_keys"] < 25  # keys were evicted through the moved index
    after.close()
    reference.close()
