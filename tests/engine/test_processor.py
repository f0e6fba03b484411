"""StatefulProcessor: a processor with value, list and map state, TTL and event-time timers,
run over random micro-batches through the operator's task protocol (open, each Arrow batch,
finish, commit of every store, a reload from files now and then) and checked against a
plain-Python model of the documented rules (docs/processor.md): late rows dropped; the input
handled, then the timers at or before the eviction watermark fired (deleted ones not), then
what the TTL ended removed; a TTL'd row is absent as soon as its time has come."""
import datetime

import numpy as np
import pyarrow as pa
import pytest

from pyspark_glue.event_time import Watermarks
from pyspark_glue.operator_fn import PartitionContext
from pyspark_glue.processor import StatefulProcessor
from tests.store_support import Partition

KEY = np.dtype([("user", "<i8")])
TIMEOUT_US = 10_000_000
TTL_US = 25_000_000


class Inactivity(StatefulProcessor):
    """Per user: clicks counted since the user's session began; a timer 10 s after the last
    click emits ``(user, clicks, last)`` and forgets the count; the timestamps of the last 25 s
    of clicks (a TTL'd list) and hits per page (a TTL'd map) are kept beside it."""

    key_columns = ["user"]
    key_schema = KEY
    time_mode = "event_time"
    event_time = "ts"
    delay = "5 seconds"

    def init(self, state):
        self.count = state.value("count", [("n", "<i8"), ("last", "<i8")])
        self.recent = state.list("recent", [("t", "<i8")], ttl=datetime.timedelta(microseconds=TTL_US))
        self.pages = state.map("pages", [("page", "<i4")], [("hits", "<i8")], ttl="25 seconds")

    def handle_input(self, groups, timers):
        ts = groups.column("ts")
        last = np.maximum.reduceat(ts, groups.starts)
        old, found = self.count.get(groups.keys)
        timers.delete(groups.keys[found], old["last"][found] + TIMEOUT_US)
        new = np.zeros(len(groups), dtype=self.count.dtype)
        new["n"] = np.where(found, old["n"], 0) + groups.sizes
        new["last"] = np.where(found, np.maximum(old["last"], last), last)
        self.count.put(groups.keys, new)
        timers.register(groups.keys, new["last"] + TIMEOUT_US)
        items = np.zeros(len(ts), dtype=self.recent.dtype)
        items["t"] = ts
        self.recent.append(groups.keys[groups.group], items)
        pages = np.zeros(len(ts), dtype=self.pages.user_key_dtype)
        pages["page"] = groups.column("page")
        hits, had = self.pages.get(groups.keys[groups.group], pages)
        # one row per (user, page): the count of this batch's hits plus what was there
        pairs = np.rec.fromarrays([groups.group, pages["page"]], names="g,p")
        _, first, counts = np.unique(pairs, return_index=True, return_counts=True)
        values = np.zeros(len(first), dtype=self.pages.dtype)
        values["hits"] = np.where(had[first], hits["hits"][first], 0) + counts
        self.pages.put(groups.keys[groups.group[first]], pages[first], values)
        return None

    def handle_expired_timers(self, keys, times, timers):
        values, found = self.count.get(keys)
        self.count.clear(keys[found])
        return pa.RecordBatch.from_pydict({"user": keys["user"][found], "clicks": values["n"][found],
                                           "last": values["last"][found]})


class Model:
    """The same processor as plain Python over dicts, by the documented rules."""

    def __init__(self):
        self.count, self.timers, self.recent, self.pages = {}, set(), {}, {}

    def batch(self, rows, late_us, clock_us):
        rows = [r for r in rows if r[1] > late_us]
        for user in sorted({r[0] for r in rows}):
            mine = [r for r in rows if r[0] == user]
            last = max(t for _, t, _ in mine)
            if user in self.count:
                n, old_last = self.count[user]
                self.timers.discard((user, old_last + TIMEOUT_US))
                self.count[user] = (n + len(mine), max(old_last, last))
            else:
                self.count[user] = (len(mine), last)
            self.timers.add((user, self.count[user][1] + TIMEOUT_US))
            self.recent.setdefault(user, []).extend((t, clock_us + TTL_US) for _, t, _ in mine)
            for _, _, page in mine:
                hits, expires = self.pages.get((user, page), (0, 0))
                if expires <= clock_us:
                    hits = 0
                self.pages[(user, page)] = (hits + 1, clock_us + TTL_US)
        out = []
        for user, t in sorted(t for t in self.timers if t[1] <= clock_us):
            self.timers.discard((user, t))
            if user in self.count:
                out.append((user,) + self.count.pop(user))
        for user in list(self.recent):
            self.recent[user] = [e for e in self.recent[user] if e[1] > clock_us]
            if not self.recent[user]:
                del self.recent[user]
        self.pages = {k: v for k, v in self.pages.items() if v[1] > clock_us}
        return sorted(out)


def processor_partition(root, processor):
    """The stores of one partition of ``processor``: its variables' and its default store."""
    return Partition(root, dict(processor.state_stores, default=(processor.key_schema, processor.value_schema)))


def output_rows(out):
    """The rows of what ``finish`` returned (batches, tables or None), as sorted tuples."""
    return sorted(tuple(r.values()) for part in (out or []) for r in pa.Table.from_batches(
        [part] if isinstance(part, pa.RecordBatch) else part.to_batches()).to_pylist())


def arrow_rows(rows):
    return pa.RecordBatch.from_pydict({
        "user": pa.array([r[0] for r in rows], pa.int64()),
        "ts": pa.array([r[1] for r in rows], pa.timestamp("us", "UTC")),
        "page": pa.array([r[2] for r in rows], pa.int32())})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processor_with_timers_and_ttl_matches_the_model(tmp_path, seed):
    rng = np.random.default_rng(seed)
    processor, model = Inactivity(), Model()
    partition = processor_partition(tmp_path, processor)
    max_event, watermark, fired, expired_pages, pages_before = 0, 0, 0, 0, set()
    for b in range(30):
        late_ms = watermark
        watermark = max(watermark, max_event // 1000 - 5_000)
        if b >= 25:  # the end of a bounded run: empty batches with the watermark advanced
            watermark += 20_000
        n = 0 if b >= 25 else 15
        rows = [(int(u), int(t), int(p)) for u, t, p in zip(
            rng.integers(0, 30, n), 1_000_000 * (3 * b + rng.uniform(-8, 2, n)) + 50_000_000,
            rng.integers(0, 4, n))]
        max_event = max([max_event] + [t for _, t, _ in rows])
        stores = partition.open()
        context = PartitionContext(0, b, stores, "default", Watermarks(late_ms, watermark))
        task = processor.open(context)
        half = len(rows) // 2
        for chunk in (rows[:half], rows[half:]):  # the rows come in two Arrow batches
            if chunk:
                task.process(arrow_rows(chunk))
        out = task.finish()
        partition.commit(stores)
        got = output_rows(out)
        expected = model.batch(rows, late_ms * 1000, watermark * 1000)
        assert got == expected, f"batch {b}"
        assert context.late_rows == sum(1 for r in rows if r[1] <= late_ms * 1000)
        fired += len(got)
        if b % 7 == 6:
            partition.reload()
        # the state itself, read back through the variables, matches the model's
        stores = partition.open()
        # a task's copy of the processor, its variables bound to the stores
        check = Inactivity().open(PartitionContext(0, b + 1, stores, "default", Watermarks(watermark, watermark)))
        check = check.processor
        users = np.array([(u,) for u in range(30)], dtype=KEY)
        values, found = check.count.get(users)
        assert {int(u["user"]): (int(v["n"]), int(v["last"])) for u, v, f in zip(users, values, found) if f} \
            == model.count
        which, items = check.recent.get(users)
        recent = {}
        for w, t in zip(which, items["t"]):
            recent.setdefault(int(users[w]["user"]), []).append(int(t))
        assert recent == {u: [t for t, _ in e] for u, e in model.recent.items()}
        which, pages, hits = check.pages.items(users)
        assert {(int(users[w]["user"]), int(p["page"])): int(h["hits"]) for w, p, h in zip(which, pages, hits)} \
            == {k: v[0] for k, v in model.pages.items()}
        # what the TTL ended has left the stores, not only the reads
        assert stores["pages"].metrics.num_keys == len(model.pages)
        assert stores["recent.entries"].metrics.num_keys == sum(len(e) for e in model.recent.values())
        expired_pages += len(pages_before - set(model.pages))
        pages_before = set(model.pages)
        for store in stores.values():
            store.abort()
    assert expired_pages > 5, "TTLs must end for the test to mean anything"
    assert fired > 5, "timers must fire for the test to mean anything"


def test_a_state_variable_a_store_cannot_hold_is_refused_naming_it():
    class Bad(StatefulProcessor):
        key_columns = ["user"]
        key_schema = KEY

        def init(self, state):
            state.value("profile", [("name", "U10")])

    with pytest.raises(TypeError, match="state variable 'profile': field 'name'"):
        Bad().state_stores

    class Twice(Bad):
        def init(self, state):
            state.value("a", [("n", "<i8")])
            state.list("a", [("n", "<i8")])

    with pytest.raises(ValueError, match="'a' is declared twice"):
        Twice().state_stores


class Reminder(StatefulProcessor):
    """Processing time: each input arms a reminder 1 s of wall time later; a TTL'd value
    remembers the last row for 2 s of wall time."""

    key_columns = ["user"]
    key_schema = KEY
    time_mode = "processing_time"

    def init(self, state):
        self.last = state.value("last", [("page", "<i4")], ttl="2 seconds")

    def handle_input(self, groups, timers):
        pages = np.zeros(len(groups), dtype=self.last.dtype)
        pages["page"] = groups.column("page")[groups.starts]
        self.last.put(groups.keys, pages)
        timers.register(groups.keys, np.full(len(groups), self.now_us + 1_000_000))

    def handle_expired_timers(self, keys, times, timers):
        values, found = self.last.get(keys)
        return pa.RecordBatch.from_pydict({"user": keys["user"], "page": np.where(found, values["page"], -1)})

    def open(self, context):
        self.now_us = context.batch_timestamp_ms * 1000  # before the task's copy is made
        return super().open(context)


def test_processing_time_timers_and_ttl_follow_the_batch_timestamp(tmp_path):
    processor = Reminder()
    partition = processor_partition(tmp_path, processor)
    fired = []
    # (batch timestamp ms, rows): a reminder is due 1 s after its batch, the value lives 2 s
    for b, (now_ms, rows) in enumerate([(10_000, [(1, 0, 7), (2, 0, 8)]), (10_500, [(3, 0, 9)]),
                                        (11_000, []), (11_600, []), (12_400, []), (13_100, [])]):
        stores = partition.open()
        task = processor.open(PartitionContext(0, b, stores, "default", None, now_ms))
        if rows:
            task.process(arrow_rows(rows))
        out = task.finish()
        partition.commit(stores)
        fired.append(output_rows(out))
    # 11.0 s: users 1 and 2 (due 11.0); 11.6 s: user 3 (due 11.5); their values (written at
    # 10.0 and 10.5, living until 12.0 and 12.5) still there
    assert fired == [[], [], [(1, 7), (2, 8)], [(3, 9)], [], []]
    stores = partition.open()
    assert stores["last"].metrics.num_keys == 0, "the TTL (12.0 s, 12.5 s) ended by 13.1 s"
    for store in stores.values():
        store.abort()


class PageHits(StatefulProcessor):
    """Processing time: each input puts its pages into a map with a 1 s TTL, then lists the
    map (``(user, page, hits)``): written before it is read, as a processor that only
    records pages and reports them does."""

    key_columns = ["user"]
    key_schema = KEY
    time_mode = "processing_time"

    def init(self, state):
        self.pages = state.map("pages", [("page", "<i4")], [("hits", "<i8")], ttl="1 second")

    def handle_input(self, groups, timers):
        pages = np.zeros(len(groups), dtype=self.pages.user_key_dtype)
        pages["page"] = groups.column("page")[groups.starts]
        self.pages.put(groups.keys, pages, np.ones(len(groups), dtype=self.pages.dtype))
        which, listed, hits = self.pages.items(groups.keys)
        return pa.RecordBatch.from_pydict({"user": groups.keys["user"][which], "page": listed["page"],
                                           "hits": hits["hits"]})


def test_a_map_entry_whose_ttl_ended_is_listed_once_when_put_again(tmp_path):
    """A map entry that expired (and left the store at the end of a batch without input for
    its key), put again before the map is listed: listed once, as Spark's
    transformWithStateInPandas lists it, not once per time it was put."""
    processor = PageHits()
    partition = processor_partition(str(tmp_path), processor)
    listed = []
    for b, (now_ms, rows) in enumerate([(10_000, [(1, 0, 7)]), (20_000, [(2, 0, 8)]), (30_000, [(1, 0, 7)])]):
        stores = partition.open()
        task = processor.open(PartitionContext(0, b, stores, "default", None, now_ms))
        task.process(arrow_rows(rows))
        out = task.finish()
        partition.commit(stores)
        listed.append(output_rows(out))
    # user 1's page 7 expired at 11 s and left the store at the end of batch 1 (20 s)
    assert listed == [[(1, 7, 1)], [(2, 8, 1)], [(1, 7, 1)]]


class Snooze(StatefulProcessor):
    """Event time: each input arms an alarm at its event time; an alarm that fires emits
    ``(user, time)`` and arms a snooze 1 s later, at or before the watermark here."""

    key_columns = ["user"]
    key_schema = KEY
    time_mode = "event_time"
    event_time = "ts"
    delay = "0 seconds"

    def handle_input(self, groups, timers):
        timers.register(groups.keys, groups.column("ts")[groups.starts])

    def handle_expired_timers(self, keys, times, timers):
        timers.register(keys, times + 1_000_000)
        return pa.RecordBatch.from_pydict({"user": keys["user"], "time": times})


class Rearm(Snooze):
    """An alarm that fires registers itself again, at the same time."""

    def handle_expired_timers(self, keys, times, timers):
        timers.register(keys, times)
        return pa.RecordBatch.from_pydict({"user": keys["user"], "time": times})


def fired_over_batches(tmp_path, processor):
    """What ``processor`` emits in four batches: user 1's row at 5 s, then none, with the
    watermark at 10 s from the second batch on."""
    partition = processor_partition(str(tmp_path), processor)
    fired = []
    for b, (watermark_ms, rows) in enumerate([(0, [(1, 5_000_000, 0)]), (10_000, []), (10_000, []), (10_000, [])]):
        stores = partition.open()
        task = processor.open(PartitionContext(0, b, stores, "default", Watermarks(watermark_ms, watermark_ms)))
        if rows:
            task.process(arrow_rows(rows))
        out = task.finish()
        partition.commit(stores)
        fired.append(output_rows(out))
    return fired


def test_a_timer_the_timer_handler_registers_fires_in_a_later_batch_even_when_due(tmp_path):
    """A snooze registered by handle_expired_timers, already at or before the watermark: it
    fires in the next batch, not in the same one (Spark's transformWithStateInPandas fires the
    timers due when its timer step begins, once; tests/spark/test_processor_vs_spark.py)."""
    assert fired_over_batches(tmp_path, Snooze()) == [[], [(1, 5_000_000)], [(1, 6_000_000)], [(1, 7_000_000)]]


def test_a_fired_timer_registered_again_by_its_handler_does_not_fire_again(tmp_path):
    """A handler that registers the expired timer's own (key, time) again: the timer is gone
    after the call all the same, as in Spark's transformWithStateInPandas, which deletes a
    fired timer after its handler returns."""
    assert fired_over_batches(tmp_path, Rearm()) == [[], [(1, 5_000_000)], [], []]
