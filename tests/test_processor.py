"""StatefulProcessor: a processor with value, list and map state, TTL and event-time timers,
run over random micro-batches through the operator's task protocol (open, each Arrow batch,
finish, commit of every store, a reload from files now and then) and checked against a
plain-Python model of the documented rules (docs/processor.md): late rows dropped; the input
handled, then the timers at or before the eviction watermark fired (deleted ones not), then
what the TTL ended removed; a TTL'd row is absent as soon as its time has come."""
import datetime
import json
import os

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.cli import main as cli_main
from statecore.expiry import ExpiryIndex
from statecore.files import open_store_files
from statecore.schema import key_value_schemas
from statecore.snapshot_at import start_empty
from pyspark_glue.event_time import Watermarks
from pyspark_glue.operator_task import PartitionContext
from pyspark_glue.processor import StatefulProcessor
from pyspark_glue.state_vars import LISTING_BOUND, StateHandle

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


class Partition:
    """The stores of one partition, opened at a version and committed together, as a task does
    (``only``: just those of the processor's stores, as code before some existed had)."""

    def __init__(self, root, processor, only=None):
        stores = dict(processor.state_stores, default=(processor.key_schema, processor.value_schema))
        self.root, self.version = root, 0
        self.schemas = {n: s for n, s in stores.items() if only is None or n in only}
        self.all_schemas = stores
        self.providers = {}

    def open(self, new=()):
        """Every store at the version; the stores named in ``new`` are added, started empty at
        it as the operator starts a store new to it."""
        started = {}
        for name in new:
            key, value = key_value_schemas(*self.all_schemas[name])
            files = open_store_files(StateStoreId(self.root, 0, 0, store_name=name).store_checkpoint_location())
            started[name] = start_empty(files, self.version, key, value, StateStoreConf().compression)
            self.schemas[name] = self.all_schemas[name]
        for name, (key, value) in self.schemas.items():
            if name not in self.providers:
                self.providers[name] = create_and_init_provider(StateStoreId(self.root, 0, 0, store_name=name),
                                                                key, value, StateStoreConf())
        return {name: p.get_store(self.version, started[name]) if name in started else p.get_store(self.version)
                for name, p in self.providers.items()}

    def commit(self, stores):
        for store in stores.values():
            store.commit()
        self.version += 1

    def reload(self):
        for p in self.providers.values():
            p.close()
        self.providers = {}


def arrow_rows(rows):
    return pa.RecordBatch.from_pydict({
        "user": pa.array([r[0] for r in rows], pa.int64()),
        "ts": pa.array([r[1] for r in rows], pa.timestamp("us", "UTC")),
        "page": pa.array([r[2] for r in rows], pa.int32())})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processor_with_timers_and_ttl_matches_the_model(tmp_path, seed):
    rng = np.random.default_rng(seed)
    processor, model = Inactivity(), Model()
    partition = Partition(str(tmp_path), processor)
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
        processor.open(context)
        half = len(rows) // 2
        for chunk in (rows[:half], rows[half:]):  # the rows come in two Arrow batches
            if chunk:
                processor(stores["default"], arrow_rows(chunk))
        out = processor.finish(stores["default"])
        partition.commit(stores)
        got = sorted(tuple(r.values()) for part in (out or []) for r in pa.Table.from_batches(
            [part] if isinstance(part, pa.RecordBatch) else part.to_batches()).to_pylist())
        expected = model.batch(rows, late_ms * 1000, watermark * 1000)
        assert got == expected, f"batch {b}"
        assert context.late_rows == sum(1 for r in rows if r[1] <= late_ms * 1000)
        fired += len(got)
        if b % 7 == 6:
            partition.reload()
        # the state itself, read back through the variables, matches the model's
        stores = partition.open()
        check = Inactivity()
        check.open(PartitionContext(0, b + 1, stores, "default", Watermarks(watermark, watermark)))
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
        self.now_us = context.batch_timestamp_ms * 1000
        super().open(context)


def test_processing_time_timers_and_ttl_follow_the_batch_timestamp(tmp_path):
    processor = Reminder()
    partition = Partition(str(tmp_path), processor)
    fired = []
    # (batch timestamp ms, rows): a reminder is due 1 s after its batch, the value lives 2 s
    for b, (now_ms, rows) in enumerate([(10_000, [(1, 0, 7), (2, 0, 8)]), (10_500, [(3, 0, 9)]),
                                        (11_000, []), (11_600, []), (12_400, []), (13_100, [])]):
        stores = partition.open()
        processor.open(PartitionContext(0, b, stores, "default", None, now_ms))
        if rows:
            processor(stores["default"], arrow_rows(rows))
        out = processor.finish(stores["default"])
        partition.commit(stores)
        fired.append(sorted(tuple(r.values()) for part in (out or []) for r in pa.Table.from_batches(
            [part] if isinstance(part, pa.RecordBatch) else part.to_batches()).to_pylist()))
    # 11.0 s: users 1 and 2 (due 11.0); 11.6 s: user 3 (due 11.5); their values (written at
    # 10.0 and 10.5, living until 12.0 and 12.5) still there
    assert fired == [[], [], [(1, 7), (2, 8)], [(3, 9)], [], []]
    stores = partition.open()
    assert stores["last"].metrics.num_keys == 0, "the TTL (12.0 s, 12.5 s) ended by 13.1 s"
    for store in stores.values():
        store.abort()


# -- listing timers (Timers.list, Spark's listTimers) ------------------------------------------------

class TimersOnly(StatefulProcessor):
    """No variables: the timers' stores alone."""

    key_columns = ["user"]
    key_schema = KEY


BEFORE_LISTING = ("__timers", "__timers.heads", "__timers.entries")  # the timers' stores before the listing


def register_as_before(stores, key_dtype, keys, times):
    """What ``Timers.register`` did before timers could be listed: each (new) timer into
    ``__timers`` and the expiry index, nothing else."""
    full = np.zeros(len(keys), dtype=key_dtype.descr + [("__timer", "<i8")])
    for name in key_dtype.names:
        full[name] = keys[name]
    full["__timer"] = times
    stores["__timers"].put_batch(full, None)
    ExpiryIndex(stores["__timers.heads"], stores["__timers.entries"], key_dtype).add(times, keys)


def listed(timers, users):
    """{user: [times]} as ``Timers.list`` gives them for ``users`` (distinct)."""
    keys = np.array([(u,) for u in users], dtype=KEY)
    which, times = timers.list(keys)
    out = {}
    for w, t in zip(which, times):
        out.setdefault(int(keys[w]["user"]), []).append(int(t))
    return out


def listing_lengths(stores):
    """{user: entries in the timers' listing}, stale ones included."""
    return {int(k["user"]): int(v["count"]) for keys, values in stores["__timers.keys"].iter_batches()
            for k, v in zip(keys, values)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_listing_timers_matches_a_model_of_register_delete_and_fire(tmp_path, seed):
    """A processor that registers, deletes, registers again (the same timer, or one deleted
    earlier) and fires timers over 40 batches, committing and now and then reloading from
    files: every key's listed timers are exactly the registered ones, by time."""
    rng = np.random.default_rng(seed)
    partition = Partition(str(tmp_path), TimersOnly())
    model = set()
    clock = 0
    for b in range(40):
        stores = partition.open()
        timers = StateHandle(KEY, stores, clock).timers
        n = int(rng.integers(0, 25))
        users = rng.integers(0, 12, n)
        times = clock + rng.integers(0, 40, n)  # repeats: timers registered twice in one call
        timers.register(np.array([(u,) for u in users], dtype=KEY), times)
        model |= {(int(u), int(t)) for u, t in zip(users, times)}
        gone = [x for x in sorted(model) if rng.random() < 0.2]
        if gone:
            timers.delete(np.array([(u,) for u, _ in gone], dtype=KEY), np.array([t for _, t in gone]))
            model -= set(gone)
        clock += int(rng.integers(0, 8))
        keys, fired = timers.pop_due(clock)
        assert sorted(zip(keys["user"].tolist(), fired.tolist())) == sorted(x for x in model if x[1] <= clock)
        model = {x for x in model if x[1] > clock}
        asked = sorted({int(u) for u in rng.integers(0, 14, 8)})  # keys with and without timers
        expected = {u: sorted(t for v, t in model if v == u) for u in asked}
        assert listed(timers, asked) == {u: ts for u, ts in expected.items() if ts}, f"batch {b}"
        assert listed(timers, asked) == {u: ts for u, ts in expected.items() if ts}, "a second listing agrees"
        partition.commit(stores)
        if b % 9 == 8:
            partition.reload()
    stores = partition.open()
    every = sorted({u for u, _ in model} | {0, 11})
    assert listed(StateHandle(KEY, stores).timers, every) == {u: sorted(t for v, t in model if v == u)
                                                              for u in every if any(v == u for v, _ in model)}
    for store in stores.values():
        store.abort()


def test_a_timer_moved_every_batch_for_months_keeps_a_short_listing(tmp_path):
    """A key whose inactivity timer moves every batch (delete the old one, register the next)
    for 300 batches, never listed: its listing stays under LISTING_BOUND entries; a key with
    20 live timers, one of them moved each batch, stays under 4 x 20; both list right."""
    partition = Partition(str(tmp_path), TimersOnly())
    busy = np.array([(1,)], dtype=KEY)
    many = np.array([(2,)] * 20, dtype=KEY)
    live = list(range(1000, 1020))
    stores = partition.open()
    StateHandle(KEY, stores).timers.register(many, np.array(live))
    partition.commit(stores)
    longest = {1: 0, 2: 0}
    for b in range(300):
        stores = partition.open()
        timers = StateHandle(KEY, stores).timers
        if b:
            timers.delete(busy, [10_000 + b - 1])
        timers.register(busy, [10_000 + b])
        timers.delete(many[:1], [live[b % 20]])
        live[b % 20] = 2000 + b
        timers.register(many[:1], [live[b % 20]])
        for user, n in listing_lengths(stores).items():
            longest[user] = max(longest[user], n)
        partition.commit(stores)
    assert longest[1] < LISTING_BOUND
    assert 20 <= longest[2] < 4 * 20
    stores = partition.open()
    assert listed(StateHandle(KEY, stores).timers, [1, 2]) == {1: [10_299], 2: sorted(live)}
    for store in stores.values():
        store.abort()


def test_a_checkpoint_written_before_the_listing_lists_its_timers_after_the_upgrade(tmp_path):
    """A processor checkpoint written by the code before timers could be listed (the timers'
    stores without the listing's): after the upgrade the listing's stores start empty (as the
    operator starts a store new to it) and the processor's open fills them once from
    __timers; the timers then list, and fire, as registered."""
    partition = Partition(str(tmp_path), TimersOnly(), only={*BEFORE_LISTING, "default"})
    stores = partition.open()
    registered = {(u, 100 * u + i) for u in range(6) for i in range(u % 3 + 1)}
    register_as_before(stores, KEY, np.array([(u,) for u, _ in sorted(registered)], dtype=KEY),
                       np.array([t for _, t in sorted(registered)], dtype=np.int64))
    partition.commit(stores)

    stores = partition.open(new={"__timers.keys", "__timers.key_entries"})
    processor = TimersOnly()
    processor.open(PartitionContext(0, partition.version, stores, "default", None,
                                    new_stores={"__timers.keys", "__timers.key_entries"}))
    expected = {u: sorted(t for v, t in registered if v == u) for u in range(6)}
    assert listed(processor._task["handle"].timers, range(8)) == expected
    partition.commit(stores)
    partition.reload()
    stores = partition.open()
    timers = StateHandle(KEY, stores).timers
    assert listed(timers, range(8)) == expected, "the filled listing was committed"
    keys, times = timers.pop_due(250)
    assert sorted(zip(keys["user"].tolist(), times.tolist())) == sorted(x for x in registered if x[1] <= 250)
    for store in stores.values():
        store.abort()


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

        def handle_input(self, groups, timers):
            n, times = self.count(groups)
            register_as_before(self._task["handle"]._stores, self.key_schema, groups.keys, times)
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
