"""statecore's StatefulProcessor against Spark's ``transformWithStateInPandas``, batch by batch.

The same logic is written twice, once per key for Spark (RocksDB state, as Spark's TWS needs)
and once over whole batches for statecore; both queries read the same parquet files, one
file per micro-batch (``maxFilesPerTrigger=1``, ``availableNow``), and each batch's output
rows, sorted, must be equal (map iteration order differs by design, hence the sort).

Spark's query runs with ``spark.sql.streaming.noDataMicroBatches.enabled=false``. With it
on, an event-time TWS query runs a batch without data when its watermark has moved and no
new file is waiting, to fire the timers it makes due (run over the event-time scenario's
files: an eighth batch after the seventh file, firing u8's timer); a ``foreachBatch`` query
never runs one, so the batch ids of the two would drift apart after a pause in the input.
With it off, Spark fires due timers in the next batch that has data, as statecore does, and
batch ``b`` is file ``b`` on both sides: the tests check Spark's batch ids and each batch's
input rows, which differ from file to file.
"""
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from pyspark_glue import StatefulOperator
from tests.event_time_support import run_spark_phase, run_statecore_phase, session_settings
from tests.glue_support import write_parquet

pytestmark = pytest.mark.slow  # scheduled first: tests/conftest.py

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
OUTPUT_DDL = "user long, kind string, a long, b long"
COLUMNS = ["user", "kind", "a", "b"]
T0_MS = 1_767_225_600_000  # 2026-01-01 00:00 UTC
TIMEOUT_MS = 30_000
SNOOZE_MS = 5_001
DELAY = "10 seconds"


def at(seconds):
    """Event time ``seconds`` after :data:`T0_MS`, in milliseconds."""
    return T0_MS + round(seconds * 1000)


def output_batch(users, kind, a, b):
    """Output rows of :data:`OUTPUT_DDL`: columns ``users``, ``a``, ``b``, every row of ``kind``."""
    return pa.RecordBatch.from_pydict({"user": pa.array(np.asarray(users, np.int64)),
                                       "kind": pa.array([kind] * len(users), pa.string()),
                                       "a": pa.array(np.asarray(a, np.int64)), "b": pa.array(np.asarray(b, np.int64))})


def write_batches(directory, tables):
    """One parquet file per micro-batch, written up front; modification times in batch order
    (the file source takes files by modification time)."""
    names = []
    for b, table in enumerate(tables):
        name = f"batch-{b:04d}.parquet"
        write_parquet(directory, name, table)
        os.utime(os.path.join(directory, name), (1_000_000 + 10 * b,) * 2)
        names.append(name)
    return names


def run_both(spark, tmp_path, tables, phases, spark_query, make_operator, schema):
    """Both queries over ``tables`` (one file each), phase by phase: before each phase its
    files move into the input directory both queries read, then Spark's query and a new
    statecore operator and query run from their checkpoints (a restart between phases).
    Returns ``(spark_seen, ours_seen)``: ``[batch_id, rows, late_rows, input_rows]`` each."""
    staged, source = str(tmp_path / "staged"), str(tmp_path / "in")
    names = write_batches(staged, tables)
    os.makedirs(source)
    spark_seen, ours_seen = [], []
    settings = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB, "spark.sql.shuffle.partitions": "1",
                "spark.sql.streaming.noDataMicroBatches.enabled": "false"}
    with session_settings(spark, settings):
        for lo, hi in phases:
            for name in names[lo:hi]:
                os.replace(os.path.join(staged, name), os.path.join(source, name))
            run_spark_phase(spark, source, str(tmp_path / "spark-ckpt"), spark_query, spark_seen, schema, COLUMNS,
                            fmt="parquet")
            operator = make_operator()
            try:
                run_statecore_phase(spark, source, str(tmp_path / "ours-ckpt"), operator, ours_seen, schema, COLUMNS,
                                    fmt="parquet")
            finally:
                operator.close()
    sizes = [t.num_rows for t in tables]
    assert len(set(sizes)) == len(sizes), "each file needs its own row count for the check below to mean anything"
    for seen in (spark_seen, ours_seen):
        assert [e[0] for e in seen] == list(range(len(tables))), "one batch per file, no batch without data"
        assert [e[3] for e in seen] == sizes, "batch b read exactly file b"
    return spark_seen, ours_seen


def assert_same_batches(spark_seen, ours_seen):
    """Each batch's output rows, sorted, equal on both sides; the message names every batch
    that differs and the rows only one side emitted."""
    differences = []
    for theirs, ours in zip(spark_seen, ours_seen):
        extra, missing = Counter(ours[1]) - Counter(theirs[1]), Counter(theirs[1]) - Counter(ours[1])
        if extra or missing:
            differences.append(f"batch {theirs[0]}: only statecore emitted {sorted(extra.elements())}, "
                               f"only Spark {sorted(missing.elements())}")
    assert not differences, "statecore's output differs from Spark's: " + "; ".join(differences)


# -- event time: value, list and map state, timers, late rows, initial state, a restart -----------

EVENT_DDL = "user long, ts timestamp, ms long, page long, drop boolean"
INITIAL_DDL = "user long, n long, page long, alarm long"


def spark_activity():
    """Per user (Spark's TWS): ``total`` (rows, last event time), ``times`` (a list of every
    row's event time), ``pages`` (a map page -> hits; a ``drop`` row removes its page before
    the batch's hits are counted). A timer ``TIMEOUT_MS`` after the last event, moved by each
    new input, emits ``("timer", time, rows or -1)`` and forgets ``total``; a timer at a whole
    second also arms a snooze 5.001 s later, and one at 1 ms past a second (a snooze) registers
    itself again (which Spark undoes: it deletes a fired timer after its handler). Each input
    emits ``("input", rows, last)``, the whole list and the whole map. The initial state sets
    ``total``, one page at 100 hits and an alarm timer."""
    import pandas as pd
    from pyspark.sql.streaming import StatefulProcessor

    def frame(rows):
        return pd.DataFrame(rows, columns=COLUMNS).astype({"user": "int64", "a": "int64", "b": "int64"})

    class Activity(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.total = handle.getValueState("total", "n long, last long")
            self.times = handle.getListState("times", "t long")
            self.pages = handle.getMapState("pages", "page long", "hits long")

        def handleInitialState(self, key, initial, timerValues):
            for row in initial.itertuples():
                self.total.update((int(row.n), 0))
                self.pages.updateValue((int(row.page),), (100,))
                self.handle.registerTimer(int(row.alarm))

        def handleInputRows(self, key, rows, timerValues):
            pdf = pd.concat(list(rows), ignore_index=True)
            n, last = self.total.get() if self.total.exists() else (0, 0)
            if self.total.exists():
                self.handle.deleteTimer(last + TIMEOUT_MS)
            n, last = n + len(pdf), max(last, int(pdf["ms"].max()))
            self.total.update((n, last))
            self.handle.registerTimer(last + TIMEOUT_MS)
            self.times.appendList([(int(t),) for t in pdf["ms"]])
            for page in pdf.loc[pdf["drop"], "page"]:
                self.pages.removeKey((int(page),))
            for page, count in pdf.loc[~pdf["drop"], "page"].value_counts().items():
                old = self.pages.getValue((int(page),))
                self.pages.updateValue((int(page),), ((old[0] if old else 0) + int(count),))
            user = int(key[0])
            out = [(user, "input", n, last)]
            out += [(user, "list", int(t), 0) for (t,) in self.times.get()]
            out += [(user, "page", int(k[0]), int(v[0])) for k, v in self.pages.iterator()]
            yield frame(out)

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
            n = self.total.get()[0] if self.total.exists() else -1
            self.total.clear()
            if expiredTimerInfo.getExpiryTimeInMs() % 1000 == 0:
                self.handle.registerTimer(expiredTimerInfo.getExpiryTimeInMs() + SNOOZE_MS)
            if expiredTimerInfo.getExpiryTimeInMs() % 1000 == 1:
                self.handle.registerTimer(expiredTimerInfo.getExpiryTimeInMs())
            yield frame([(int(key[0]), "timer", expiredTimerInfo.getExpiryTimeInMs(), n)])

        def close(self):
            pass

    return Activity()


def statecore_activity():
    """:func:`spark_activity` over whole batches (times in microseconds for the timers)."""
    from pyspark_glue import StatefulProcessor

    class Activity(StatefulProcessor):
        key_columns = ["user"]
        key_schema = np.dtype([("user", "<i8")])
        output_schema = OUTPUT_DDL
        time_mode = "event_time"
        event_time = "ts"
        delay = DELAY

        def init(self, state):
            self.total = state.value("total", [("n", "<i8"), ("last", "<i8")])
            self.times = state.list("times", [("t", "<i8")])
            self.pages = state.map("pages", [("page", "<i8")], [("hits", "<i8")])

        def handle_initial_state(self, groups, timers):
            totals = np.zeros(len(groups), self.total.dtype)
            totals["n"] = groups.column("n", np.int64)[groups.starts]
            self.total.put(groups.keys, totals)
            pages = np.zeros(len(groups), self.pages.user_key_dtype)
            pages["page"] = groups.column("page", np.int64)[groups.starts]
            hits = np.full(len(groups), 100, self.pages.dtype)
            self.pages.put(groups.keys, pages, hits)
            timers.register(groups.keys, groups.column("alarm", np.int64)[groups.starts] * 1000)

        def handle_input(self, groups, timers):
            ms, drop = groups.column("ms", np.int64), groups.column("drop", np.bool_)
            old, found = self.total.get(groups.keys)
            timers.delete(groups.keys[found], (old["last"][found] + TIMEOUT_MS) * 1000)
            new = np.zeros(len(groups), self.total.dtype)
            new["n"] = np.where(found, old["n"], 0) + groups.sizes
            new["last"] = np.maximum(np.where(found, old["last"], 0), np.maximum.reduceat(ms, groups.starts))
            self.total.put(groups.keys, new)
            timers.register(groups.keys, (new["last"] + TIMEOUT_MS) * 1000)
            items = np.zeros(len(ms), self.times.dtype)
            items["t"] = ms
            self.times.append(groups.keys[groups.group], items)
            pages = np.zeros(len(ms), self.pages.user_key_dtype)
            pages["page"] = groups.column("page", np.int64)
            self.pages.remove(groups.keys[groups.group[drop]], pages[drop])
            kept = np.flatnonzero(~drop)
            pairs = np.rec.fromarrays([groups.group[kept], pages["page"][kept]], names="g,p")
            _, first, counts = np.unique(pairs, return_index=True, return_counts=True)
            rows = kept[first]
            owners = groups.keys[groups.group[rows]]
            hits, had = self.pages.get(owners, pages[rows])
            values = np.zeros(len(rows), self.pages.dtype)
            values["hits"] = np.where(had, hits["hits"], 0) + counts
            self.pages.put(owners, pages[rows], values)
            which, listed = self.times.get(groups.keys)
            owner, page_keys, page_hits = self.pages.items(groups.keys)
            users = groups.keys["user"]
            return pa.Table.from_batches([
                output_batch(users, "input", new["n"], new["last"]),
                output_batch(users[which], "list", listed["t"], np.zeros(len(which))),
                output_batch(users[owner], "page", page_keys["page"], page_hits["hits"])])

        def handle_expired_timers(self, keys, times, timers):
            order = np.argsort(times, kind="stable")  # Spark fires a key's timers in time order, one by one
            keys, times = keys[order], times[order]
            values, found = self.total.get(keys)
            first = np.zeros(len(keys), dtype=bool)
            first[np.unique(keys, return_index=True)[1]] = True  # later timers of a key find total cleared
            self.total.clear(keys[found])
            whole = (times // 1000) % 1000 == 0
            timers.register(keys[whole], times[whole] + SNOOZE_MS * 1000)
            again = (times // 1000) % 1000 == 1
            timers.register(keys[again], times[again])
            return output_batch(keys["user"], "timer", times // 1000, np.where(found & first, values["n"], -1))

    return Activity()


def event(user, seconds, page, drop=False):
    return {"user": user, "ts": at(seconds) * 1000, "ms": at(seconds), "page": page, "drop": drop}


def event_table(rows):
    columns = {name: [r[name] for r in rows] for name in ("user", "ts", "ms", "page", "drop")}
    return pa.table({"user": pa.array(columns["user"], pa.int64()),
                     "ts": pa.array(columns["ts"], pa.timestamp("us", "UTC")),
                     "ms": pa.array(columns["ms"], pa.int64()), "page": pa.array(columns["page"], pa.int64()),
                     "drop": pa.array(columns["drop"], pa.bool_())})


# Watermark(b) = (largest event time before batch b) - 10 s; rows at or below watermark(b-1)
# are late in batch b; a timer is due in batch b at or below watermark(b) (if Spark agrees).
INITIAL = [(1, 5, 7, at(15)), (9, 1, 9, at(35))]  # user, n, page, alarm
EVENT_BATCHES = [
    # 0: watermark 0 (before 2026). u1 starts from its initial state.
    [event(1, 0, 1), event(1, 2, 1), event(2, 1, 2), event(3, 3, 1)],
    # 1: u1 removes page 7 (the initial state's) and puts it again: the map listed at once
    [event(1, 5, 7, drop=True), event(1, 6, 7), event(3, 12, 2), event(4, 12.001, 1), event(5, 20, 3)],
    # 2: watermark 10 s; u2's timer moves from 31 s to 55 s
    [event(2, 25, 2), event(6, 30, 1)],
    # -- restart --
    # 3: watermark 20 s: u1's alarm (15 s) fires; its snooze (20.001 s) waits. Late at or below
    #    10 s: u3's row at 10 s, u4's and u2's (1 s, 3 s); u3's at 10.001 s is kept. u1's map
    #    listed in a later batch.
    [event(3, 10, 5), event(3, 10.001, 5), event(1, 26, 7), event(6, 31, 1), event(4, 1, 1), event(2, 3, 3)],
    # 4: watermark 21 s: u1's snooze fires
    [event(5, 40, 3), event(2, 52, 2), event(7, 50, 4)],
    # 5: watermark 42 s: u3's timer is exactly at it, u4's 1 ms after it; u9's alarm (35 s) has no input,
    #    and the snooze it arms (40.001 s) is at or below the watermark already.
    #    Late at or below 21 s: u8's row at 21 s, not the one at 21.001 s.
    [event(1, 60, 7), event(7, 61, 1), event(8, 21, 1), event(8, 21.001, 2), event(2, 53, 2), event(5, 41, 3),
     event(6, 44, 1)],
    # 6: watermark 51 s: u4's timer (42.001 s) fires now, as do u9's snooze and u3's (47.001 s)
    [event(1, 62, 1)],
]


def test_event_time_processor_matches_transformWithStateInPandas_batch_by_batch(spark, tmp_path):
    """A click stream per user with value, list and map state, timers moved by new clicks, late
    clicks, an initial state and a restart after batch 2: statecore's output equals Spark's in
    every batch, including a map entry removed and put again in one batch (u1, page 7), listed
    then and in later batches, a timer exactly at the watermark (u3, 42 s), a timer the timer
    handler registers at or below the watermark (u9's snooze: the next batch), and a fired
    timer its handler registers again (u1's snooze: gone all the same)."""
    tables = [event_table(rows) for rows in EVENT_BATCHES]
    initial = spark.createDataFrame(INITIAL, INITIAL_DDL)

    def spark_query(df):
        return (df.withWatermark("ts", DELAY).groupBy("user")
                .transformWithStateInPandas(spark_activity(), OUTPUT_DDL, "Append", "EventTime",
                                            initialState=initial.groupBy("user")))

    def ours():
        return StatefulOperator(str(tmp_path / "state"), 0, 2, fn=statecore_activity(), initial_state=initial)

    spark_seen, ours_seen = run_both(spark, tmp_path, tables, [(0, 3), (3, len(tables))], spark_query, ours,
                                     EVENT_DDL)
    fired = {b: sorted((r[0], r[2]) for r in rows if r[1] == "timer") for b, rows, _, _ in spark_seen}
    # the scenario's premises, on Spark's side: the alarm in batch 3, the timer at the
    # watermark in batch 5 (Spark fires timers at or below it), the one 1 ms above in batch 6
    assert fired[3] == [(1, at(15))] and (3, at(42)) in fired[5] and (4, at(42.001)) in fired[6], fired
    assert (4, at(42.001)) not in fired[5] and (9, at(35)) in fired[5], fired
    assert (1, at(20.001)) in fired[4] and (9, at(40.001)) in fired[6] and (3, at(47.001)) in fired[6], fired
    assert [t for b in fired for user, t in fired[b] if user == 1] == [at(15), at(20.001)], "a snooze fired twice"
    assert not any(user == 2 and t == at(31) for b in fired for user, t in fired[b]), "u2's moved timer fired"
    listed = {(r[0], r[2]) for _, rows, _, _ in spark_seen for r in rows if r[1] == "list"}
    late = {(3, at(10)), (4, at(1)), (2, at(3)), (8, at(21))}  # at or below the previous watermark
    assert not late & listed and {(3, at(10.001)), (8, at(21.001))} <= listed
    assert [e[2] for e in ours_seen] == [0, 0, 0, 3, 0, 1, 0] == [e[2] for e in spark_seen]
    assert_same_batches(spark_seen, ours_seen)


# -- processing time: TTL on value, list and map state --------------------------------------------

RECALL_DDL = "user long, x long"
TTLS = {"tiny": (1, "1 millisecond"), "huge": (3_600_000, "1 hour")}  # gone by the next batch / never here


def spark_recall():
    """Per user (Spark's TWS, processing time): a value, a list and a map per TTL in
    :data:`TTLS`. Each input first emits what it reads (``value_<ttl>`` or -1, every
    ``list_<ttl>`` item, every ``map_huge`` entry), then writes the batch's largest ``x`` to
    the values, every ``x`` to the lists, and per ``x % 3`` its largest ``x`` to the maps, and
    emits the tiny value and map read back (``value_tiny_after``, ``map_tiny_after``: alive in
    the batch that wrote them). The tiny map is listed only after the writes, so an entry
    whose TTL ended is put again before the map is listed (u2's in batch 2)."""
    import pandas as pd
    from pyspark.sql.streaming import StatefulProcessor

    class Recall(StatefulProcessor):
        def init(self, handle):
            self.values = {name: handle.getValueState(f"value_{name}", "x long", ms) for name, (ms, _) in TTLS.items()}
            self.lists = {name: handle.getListState(f"list_{name}", "x long", ms) for name, (ms, _) in TTLS.items()}
            self.maps = {name: handle.getMapState(f"map_{name}", "k long", "x long", ms)
                         for name, (ms, _) in TTLS.items()}

        def handleInputRows(self, key, rows, timerValues):
            pdf = pd.concat(list(rows), ignore_index=True)
            user, xs = int(key[0]), [int(x) for x in pdf["x"]]
            out = []
            for name in TTLS:
                value = self.values[name]
                out.append((user, f"value_{name}", value.get()[0] if value.exists() else -1, 0))
                out += [(user, f"list_{name}", int(x), 0) for (x,) in self.lists[name].get()]
            out += [(user, "map_huge", int(k[0]), int(v[0])) for k, v in self.maps["huge"].iterator()]
            for name in TTLS:
                self.values[name].update((max(xs),))
                self.lists[name].appendList([(x,) for x in xs])
                for k in sorted({x % 3 for x in xs}):
                    self.maps[name].updateValue((k,), (max(x for x in xs if x % 3 == k),))
            out.append((user, "value_tiny_after", self.values["tiny"].get()[0], 0))
            out += [(user, "map_tiny_after", int(k[0]), int(v[0])) for k, v in self.maps["tiny"].iterator()]
            yield pd.DataFrame(out, columns=COLUMNS).astype({"user": "int64", "a": "int64", "b": "int64"})

        def close(self):
            pass

    return Recall()


def statecore_recall():
    """:func:`spark_recall` over whole batches."""
    from pyspark_glue import StatefulProcessor

    class Recall(StatefulProcessor):
        key_columns = ["user"]
        key_schema = np.dtype([("user", "<i8")])
        output_schema = OUTPUT_DDL
        time_mode = "processing_time"

        def init(self, state):
            self.values = {name: state.value(f"value_{name}", [("x", "<i8")], ttl) for name, (_, ttl) in TTLS.items()}
            self.lists = {name: state.list(f"list_{name}", [("x", "<i8")], ttl) for name, (_, ttl) in TTLS.items()}
            self.maps = {name: state.map(f"map_{name}", [("k", "<i8")], [("x", "<i8")], ttl)
                         for name, (_, ttl) in TTLS.items()}

        def handle_input(self, groups, timers):
            keys, users = groups.keys, groups.keys["user"]
            out = []
            for name in TTLS:
                values, found = self.values[name].get(keys)
                out.append(output_batch(users, f"value_{name}", np.where(found, values["x"], -1), np.zeros(len(keys))))
                which, items = self.lists[name].get(keys)
                out.append(output_batch(users[which], f"list_{name}", items["x"], np.zeros(len(which))))
            owner, map_keys, map_values = self.maps["huge"].items(keys)
            out.append(output_batch(users[owner], "map_huge", map_keys["k"], map_values["x"]))
            xs = groups.column("x", np.int64)
            largest = np.zeros(len(keys), np.dtype([("x", "<i8")]))
            largest["x"] = np.maximum.reduceat(xs, groups.starts)
            items = np.zeros(len(xs), np.dtype([("x", "<i8")]))
            items["x"] = xs
            pairs = np.rec.fromarrays([groups.group, xs % 3], names="g,k")
            distinct, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
            per_pair = np.full(len(distinct), np.iinfo(np.int64).min)
            np.maximum.at(per_pair, inverse.ravel(), xs)
            map_keys = np.zeros(len(distinct), np.dtype([("k", "<i8")]))
            map_keys["k"] = distinct["k"]
            map_values = np.zeros(len(distinct), np.dtype([("x", "<i8")]))
            map_values["x"] = per_pair
            for name in TTLS:
                self.values[name].put(keys, largest)
                self.lists[name].append(keys[groups.group], items)
                self.maps[name].put(keys[groups.group[first]], map_keys, map_values)
            after, _ = self.values["tiny"].get(keys)
            out.append(output_batch(users, "value_tiny_after", after["x"], np.zeros(len(keys))))
            owner, map_keys, map_values = self.maps["tiny"].items(keys)
            out.append(output_batch(users[owner], "map_tiny_after", map_keys["k"], map_values["x"]))
            return pa.Table.from_batches(out)

    return Recall()


RECALL_BATCHES = [  # (user, x); u1 in consecutive batches, u2 with gaps, u4 only late on
    [(1, 1), (1, 2), (2, 3)],
    [(1, 4), (3, 5)],
    [(2, 6), (3, 7), (3, 8), (1, 9)],
    [(4, 10)],
    [(1, 11), (2, 12), (3, 13), (4, 14), (4, 15)],
]


def test_processing_time_ttl_matches_transformWithStateInPandas_batch_by_batch(any_spark, tmp_path):
    """Value, list and map state with a 1 ms TTL (gone in the next batch) and a 1 hour TTL
    (kept throughout), read before each write: what expired shows in each batch's output,
    and statecore's equals Spark's; under a classic session and under Spark Connect."""
    spark = any_spark
    tables = [pa.table({"user": pa.array([u for u, _ in rows], pa.int64()), "x": pa.array([x for _, x in rows],
                                                                                         pa.int64())})
              for rows in RECALL_BATCHES]

    def spark_query(df):
        return df.groupBy("user").transformWithStateInPandas(spark_recall(), OUTPUT_DDL, "Append", "ProcessingTime")

    def ours():
        return StatefulOperator(str(tmp_path / "state"), 0, 2, fn=statecore_recall())

    spark_seen, ours_seen = run_both(spark, tmp_path, tables, [(0, len(tables))], spark_query, ours, RECALL_DDL)
    kinds = Counter(r[1] for _, rows, _, _ in spark_seen for r in rows)
    # the scenario's premise on Spark's side: tiny state never survives to the next batch, huge state does
    assert kinds["list_huge"] > 0 and kinds["map_huge"] > 0 and not kinds["list_tiny"]
    assert sorted(r for _, rows, _, _ in spark_seen[2:3] for r in rows if r[:2] == (2, "map_tiny_after")) \
        == [(2, "map_tiny_after", 0, 6)]
    assert {r[2] for _, rows, _, _ in spark_seen for r in rows if r[1] == "value_tiny"} == {-1}
    assert_same_batches(spark_seen, ours_seen)
