"""Event time through StatefulOperator, checked against Spark itself: the same files as
micro-batches through Spark's own operator and through statecore's built-in, the same rows
out, the same late rows dropped, across a stop and restart; the watermark records; state
that stays bounded; bad input refused before any store changes."""
import collections
import datetime
import os

import numpy as np
import pytest

from pyspark_glue import Deduplicate, StatefulOperator
from tests.event_time_support import SCHEMA, compare_with_spark

pytestmark = pytest.mark.slow  # scheduled first: tests/conftest.py


def dedup_batches(rng, n_batches, rows_per_batch, keys, step_s, jitter_s, late_fraction):
    """Batches of ``(id, ts, payload)``: event times advance ``step_s`` per batch with
    ``jitter_s`` of disorder; ``late_fraction`` of rows lag far behind (late, or on time for
    keys long forgotten); a key's rows within one batch are identical (which duplicate Spark
    keeps then does not matter), across batches they differ."""
    batches = []
    for b in range(n_batches):
        base = 100 + b * step_s
        ids = rng.integers(0, keys, rows_per_batch)
        ts = base + rng.uniform(-jitter_s, jitter_s, rows_per_batch)
        lagging = rng.random(rows_per_batch) < late_fraction
        ts[lagging] -= rng.uniform(2 * step_s, 6 * step_s, int(lagging.sum()))
        first = {}
        for i, t in zip(ids.tolist(), np.round(ts, 3).tolist()):
            first.setdefault(i, t)
        batches.append([(i, first[i], f"p{b}-{i}") for i in ids.tolist()])
    return batches


def as_multiset(rows):
    return collections.Counter(rows)


# Connect runs once per fn kind: the first case of each (the "any_spark" fixture, tests/conftest.py)
@pytest.mark.parametrize("any_spark,seed", [("classic", 0), ("classic", 1), ("connect", 0)], indirect=["any_spark"])
def test_deduplicate_matches_spark_dropDuplicatesWithinWatermark_across_a_restart(any_spark, tmp_path, seed):
    spark = any_spark
    rng = np.random.default_rng(seed)
    batches = dedup_batches(rng, n_batches=8, rows_per_batch=120, keys=60, step_s=4.0, jitter_s=3.0,
                            late_fraction=0.15)
    spark_seen, ours_seen = compare_with_spark(
        spark, tmp_path, batches, [(0, 5), (5, 8)],
        lambda df: df.withWatermark("ts", "5 seconds").dropDuplicatesWithinWatermark(["id"]),
        lambda: StatefulOperator(str(tmp_path / "state"), 0, 3, fn=Deduplicate(["id"], "ts", "5 seconds")))
    total_late = sum(e[2] for e in spark_seen)
    assert total_late > 0, "the input must have late rows for the test to mean anything"
    for theirs, ours in zip(spark_seen, ours_seen):
        assert as_multiset(ours[1]) == as_multiset(theirs[1]), f"batch {theirs[0]}"
        assert ours[2] == theirs[2], f"late rows of batch {theirs[0]}"
    kept = sum(len(e[1]) for e in spark_seen)
    assert 0 < kept < sum(len(b) for b in batches)


def test_watermarks_are_recorded_per_batch_and_replayed_by_a_re_execution(spark, tmp_path):
    op = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=Deduplicate(["id"], "ts", "10 seconds"))
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)

    def batch(*seconds):
        rows = [(i, t0 + datetime.timedelta(seconds=s), "x") for i, s in enumerate(seconds)]
        return spark.createDataFrame(rows, SCHEMA)

    epoch_ms = int(t0.timestamp() * 1000)
    op.process(batch(30, 50), 0)
    assert (op.last_progress["watermark_for_late_events_ms"], op.last_progress["watermark_for_eviction_ms"]) == (0, 0)
    assert op.last_progress["max_event_time_ms"] == epoch_ms + 50_000
    op.process(batch(20), 1)
    assert op.last_progress["watermark_for_late_events_ms"] == 0
    assert op.last_progress["watermark_for_eviction_ms"] == epoch_ms + 40_000
    op.process(batch(35, 41), 2)  # 35 is at or below 40: late
    assert op.last_progress["watermark_for_late_events_ms"] == epoch_ms + 40_000
    assert op.last_progress["late_rows"] == 1
    record = op.commit_record(2)["watermarks"]
    assert record == {"for_late_events_ms": epoch_ms + 40_000, "for_eviction_ms": epoch_ms + 40_000,
                      "max_event_time_us": (epoch_ms + 41_000) * 1000}
    op.process(batch(35, 41), 2)  # a re-execution: the same watermarks
    assert op.commit_record(2)["watermarks"] == record
    op.close()
    again = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=Deduplicate(["id"], "ts", "10 seconds"))
    again.process(batch(), 3, advance_watermark_to=t0 + datetime.timedelta(hours=1))
    assert again.last_progress["watermark_for_eviction_ms"] == epoch_ms + 3_600_000
    assert again.last_progress["state_keys"] == 0, "every key's expiry is below the advanced watermark"
    again.close()


def newest_snapshot_bytes(op):
    """Write a snapshot of the newest version of each of the operator's stores (as maintenance
    would) and return the bytes of those snapshots, summed."""
    from statecore import StateStoreConf, StateStoreId, create_and_init_provider

    stores = {op.store_name: (op.key_schema.dtype, op.value_schema.dtype), **op.fn.state_stores}
    total = 0
    for partition in range(op.num_partitions):
        for name, (key, value) in stores.items():
            store_id = StateStoreId(op.checkpoint_location, op.operator_id, partition, name)
            provider = create_and_init_provider(store_id, key, value, StateStoreConf(min_deltas_for_snapshot=0))
            record = op.commit_record(op.last_progress["batch_id"])
            winners = record["commit_ids"] if name == op.store_name else record["store_commit_ids"][name]
            provider.get_read_store(record["version"], winners[partition]).abort()  # load the newest version
            provider.do_maintenance()
            directory = store_id.store_checkpoint_location()
            snapshots = sorted((int(f.split("_")[0]), f) for f in os.listdir(directory) if f.endswith(".snapshot"))
            total += os.path.getsize(os.path.join(directory, snapshots[-1][1]))
            provider.close()
    return total


def test_state_stays_bounded_over_a_sliding_key_space(spark, tmp_path):
    """20 batches of 3000 rows over ids that slide by 500 a batch, event time a minute per
    batch, a 30 s delay: the live keys and the newest snapshots stay flat."""
    rng = np.random.default_rng(3)
    state = str(tmp_path / "state")
    op = StatefulOperator(state, 0, 2, fn=Deduplicate(["id"], "ts", "30 seconds"))
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    live, snapshot_bytes = [], {}
    for b in range(20):
        ids = rng.integers(b * 500, b * 500 + 2000, 3000)
        rows = [(int(i), t0 + datetime.timedelta(seconds=60 * b + float(s)), "x")
                for i, s in zip(ids, rng.uniform(0, 30, len(ids)))]
        op.process(spark.createDataFrame(rows, SCHEMA), b)
        live.append(op.last_progress["state_keys"])
        if b in (9, 19):
            snapshot_bytes[b] = newest_snapshot_bytes(op)
    op.close()
    assert max(live[4:]) <= 1.15 * min(live[4:]), live
    assert max(live) < 2500, live
    assert snapshot_bytes[19] <= 1.1 * snapshot_bytes[9], snapshot_bytes


def amount_batches(rng, n_batches, rows_per_batch, keys, step_s, jitter_s, late_fraction, null_fraction=0.1):
    """Rows ``{id, ts, amount}`` with event time advancing ``step_s`` per batch, some rows far
    behind, some amounts null."""
    batches = []
    for b in range(n_batches):
        ts = 100 + b * step_s + rng.uniform(-jitter_s, jitter_s, rows_per_batch)
        lagging = rng.random(rows_per_batch) < late_fraction
        ts[lagging] -= rng.uniform(2 * step_s, 5 * step_s, int(lagging.sum()))
        amounts = rng.integers(-50, 1000, rows_per_batch)
        nulls = rng.random(rows_per_batch) < null_fraction
        batches.append([{"id": int(i), "ts": round(float(t), 3), "amount": None if n else int(a)}
                        for i, t, a, n in zip(rng.integers(0, keys, rows_per_batch), ts, amounts, nulls)])
    return batches


AMOUNT_SCHEMA = "id long, ts timestamp, amount long"
WINDOW_AGGREGATES = {"n": ("count", "*"), "n_amount": ("count", "amount"), "total": ("sum", "amount"),
                     "lo": ("min", "amount"), "hi": ("max", "amount")}


@pytest.mark.parametrize("any_spark,window,slide,mode", [
    ("classic", "10 seconds", None, "append"), ("classic", "10 seconds", "4 seconds", "append"),
    ("classic", "6 seconds", "3 seconds", "update"), ("connect", "10 seconds", "4 seconds", "append")],
    indirect=["any_spark"])
def test_windowed_aggregate_matches_spark_across_a_restart(any_spark, tmp_path, window, slide, mode):
    spark = any_spark
    from pyspark.sql import functions as F

    from pyspark_glue import WindowedAggregate

    rng = np.random.default_rng(11)
    batches = amount_batches(rng, n_batches=8, rows_per_batch=150, keys=8, step_s=5.0, jitter_s=4.0,
                             late_fraction=0.1)

    def spark_query(df):
        w = F.window("ts", window, slide) if slide else F.window("ts", window)
        return (df.withWatermark("ts", "3 seconds").groupBy(w, "id")
                .agg(F.count("*").alias("n"), F.count("amount").alias("n_amount"), F.sum("amount").alias("total"),
                     F.min("amount").alias("lo"), F.max("amount").alias("hi")))

    def ours():
        return StatefulOperator(str(tmp_path / "state"), 0, 3, fn=WindowedAggregate(
            ["id"], "ts", "3 seconds", window, slide, aggregates=WINDOW_AGGREGATES, output_mode=mode))

    columns = ["id", "window", "n", "n_amount", "total", "lo", "hi"]
    original = spark.conf.get("spark.sql.streaming.outputMode", None)
    spark_seen, ours_seen = compare_with_spark(
        spark, tmp_path, batches, [(0, 5), (5, 8)],
        spark_query if mode == "append" else _in_update_mode(spark_query), ours, AMOUNT_SCHEMA, columns)
    assert sum(e[2] for e in spark_seen) > 0, "the input must have late rows for the test to mean anything"
    assert sum(len(e[1]) for e in spark_seen) > 10
    inputs = iter(batches)
    records = ours()
    for theirs, mine in zip(spark_seen, ours_seen):
        assert as_multiset(mine[1]) == as_multiset(theirs[1]), f"batch {theirs[0]}"
        # Late rows: statecore counts the (row, window) pairs it drops; Spark drops the same
        # pairs but counts them after its partial aggregation: one per (window, key).
        rows = next(inputs) if theirs[3] else []
        late_ms = records.commit_record(theirs[0])["watermarks"]["for_late_events_ms"]
        pairs = late_pairs(records.fn, rows, late_ms)
        assert mine[2] == len(pairs), f"late rows of batch {theirs[0]}"
        assert theirs[2] == len(set(pairs)), f"late (window, key) groups of batch {theirs[0]}"
    records.close()
    assert original == spark.conf.get("spark.sql.streaming.outputMode", None)


def late_pairs(windowed, rows, late_ms):
    """The ``(window start, id)`` of each (row, window) pair whose window ended at or before
    ``late_ms``, computed from the input rows alone."""
    epoch = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc).timestamp()
    times = np.array([round((epoch + r["ts"]) * 1_000_000) for r in rows], dtype=np.int64)
    which, starts = windowed.windows_of(times)
    late = starts + windowed.window_us <= late_ms * 1000
    return [(int(s), rows[w]["id"]) for w, s in zip(which[late], starts[late])]


class _in_update_mode:
    """A transform whose query the harness starts in update mode."""

    output_mode = "update"

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, df):
        return self.transform(df)


@pytest.mark.parametrize("any_spark,gap,keys", [("classic", "4 seconds", 40), ("classic", "2 seconds", 80),
                                                 ("connect", "4 seconds", 40)], indirect=["any_spark"])
def test_session_window_matches_spark_across_a_restart(any_spark, tmp_path, gap, keys):
    spark = any_spark
    from pyspark.sql import functions as F

    from pyspark_glue import SessionWindow

    rng = np.random.default_rng(5)
    batches = amount_batches(rng, n_batches=8, rows_per_batch=80, keys=keys, step_s=5.0, jitter_s=6.0,
                             late_fraction=0.1)

    def spark_query(df):
        return (df.withWatermark("ts", "3 seconds").groupBy(F.session_window("ts", gap), "id")
                .agg(F.count("*").alias("n"), F.count("amount").alias("n_amount"), F.sum("amount").alias("total"),
                     F.min("amount").alias("lo"), F.max("amount").alias("hi")))

    def ours():
        return StatefulOperator(str(tmp_path / "state"), 0, 3, fn=SessionWindow(
            ["id"], "ts", "3 seconds", gap, aggregates=WINDOW_AGGREGATES))

    columns = ["id", "session_window", "n", "n_amount", "total", "lo", "hi"]
    spark_seen, ours_seen = compare_with_spark(spark, tmp_path, batches, [(0, 5), (5, 8)], spark_query, ours,
                                               AMOUNT_SCHEMA, columns)
    assert sum(e[2] for e in spark_seen) > 0, "the input must have late rows for the test to mean anything"
    emitted = [row for e in spark_seen for row in e[1]]
    assert len(emitted) > 10 and any(row[2] > 1 for row in emitted), "sessions must merge rows"
    for theirs, mine in zip(spark_seen, ours_seen):
        assert as_multiset(mine[1]) == as_multiset(theirs[1]), f"batch {theirs[0]}"
        assert mine[2] == theirs[2], f"late rows of batch {theirs[0]}"


class _CountWithInitialState:
    """A processor: a running count per user, starting from an initial state DataFrame."""

    @staticmethod
    def make():
        from pyspark_glue import StatefulProcessor

        class RunningCount(StatefulProcessor):
            key_columns = ["id"]
            key_schema = np.dtype([("id", "<i8")])
            output_schema = "id long, n long"

            def init(self, state):
                self.n = state.value("n", [("n", "<i8")])

            def handle_initial_state(self, groups, timers):
                values = np.zeros(len(groups), dtype=self.n.dtype)
                values["n"] = np.add.reduceat(groups.column("n", np.int64), groups.starts)
                self.n.put(groups.keys, values)

            def handle_input(self, groups, timers):
                old, found = self.n.get(groups.keys)
                new = np.zeros(len(groups), dtype=self.n.dtype)
                new["n"] = np.where(found, old["n"], 0) + groups.sizes
                self.n.put(groups.keys, new)
                import pyarrow as pa
                return pa.RecordBatch.from_pydict({"id": groups.keys["id"], "n": new["n"]})

        return RunningCount()


def test_a_processor_starts_from_an_initial_state_dataframe(spark, tmp_path):
    initial = spark.createDataFrame([(1, 10), (2, 20), (2, 5), (9, 1)], "id long, n long")
    op = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=_CountWithInitialState.make(), initial_state=initial)
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    rows = [(1, t0, "a"), (1, t0, "b"), (3, t0, "c")]
    assert sorted(tuple(r) for r in op.process(spark.createDataFrame(rows, SCHEMA), 0).collect()) == [(1, 12), (3, 1)]
    rows = [(2, t0, "a"), (9, t0, "b")]
    assert sorted(tuple(r) for r in op.process(spark.createDataFrame(rows, SCHEMA), 1).collect()) == [(2, 26), (9, 2)]
    op.close()


def test_bad_event_time_input_is_refused_before_any_store_changes(spark, tmp_path):
    from pyspark_glue import SessionWindow, WindowedAggregate

    state = tmp_path / "state"
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    good = spark.createDataFrame([(1, t0, "a")], SCHEMA)
    with pytest.raises(ValueError, match="the event-time column 'when' is not in the DataFrame"):
        StatefulOperator(str(state), 0, 2, fn=Deduplicate(["id"], "when", "5 seconds")).process(good, 0)
    textual = spark.createDataFrame([(1, "2026-01-01", "a")], "id long, ts string, payload string")
    with pytest.raises(ValueError, match="the event-time column 'ts' must be a timestamp, not string"):
        StatefulOperator(str(state), 0, 2, fn=Deduplicate(["id"], "ts", "5 seconds")).process(textual, 0)
    with pytest.raises(ValueError, match="key column 'payload' is a string: give its width"):
        StatefulOperator(str(state), 0, 2, fn=Deduplicate(["payload"], "ts", "5 seconds")).process(good, 0)
    assert not state.exists() or not any(state.rglob("*.delta")), "no store may change"
    with pytest.raises(ValueError, match="the watermark delay must be >= 0"):
        Deduplicate(["id"], "ts", "-5 seconds")
    with pytest.raises(ValueError, match="must not be shorter than its slide"):
        WindowedAggregate(["id"], "ts", "5 seconds", "5 seconds", "10 seconds")
    with pytest.raises(ValueError, match="the session gap must be positive"):
        SessionWindow(["id"], "ts", "5 seconds", "0 seconds")
    with pytest.raises(ValueError, match="aggregate 'total': sum of column 'payload' \\(string\\) is not supported"):
        StatefulOperator(str(state), 0, 2, fn=WindowedAggregate(["id"], "ts", "5 seconds", "10 seconds",
                                                                aggregates={"total": ("sum", "payload")})
                         ).process(good, 0)
    with pytest.raises(TypeError, match="interval string"):
        WindowedAggregate(["id"], "ts", "5 seconds", 10)
    assert not state.exists() or not any(state.rglob("*.delta")), "no store may change"
