"""Listing timers (``Timers.list``, Spark's ``listTimers``): the listing against a model of
register, delete, register again and fire; its bound when a timer moves every batch; a
partition's first ``list`` filling it (also on a checkpoint written before the listing
existed). With Spark, variables and the listing's stores added to a running query:
tests/spark/test_timers_listing_spark.py."""
import numpy as np
import pytest

from statecore.expiry import ExpiryIndex
from pyspark_glue.operator_fn import PartitionContext
from pyspark_glue.processor import StatefulProcessor
from pyspark_glue.state_vars import LISTING_BOUND, StateHandle
from tests.store_support import Partition

KEY = np.dtype([("user", "<i8")])

class TimersOnly(StatefulProcessor):
    """No variables: the timers' stores alone."""

    key_columns = ["user"]
    key_schema = KEY


BEFORE_LISTING = ("__timers", "__timers.heads", "__timers.entries")  # the timers' stores before the listing
LISTING = ("__timers.keys", "__timers.key_entries")


def timers_partition(root, only=None):
    """``(partition, schemas)``: the stores of one partition of :class:`TimersOnly` (``only``:
    just those), and every store's schemas."""
    processor = TimersOnly()
    schemas = dict(processor.state_stores, default=(processor.key_schema, processor.value_schema))
    return Partition(root, {n: s for n, s in schemas.items() if only is None or n in only}), schemas


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
    partition, _ = timers_partition(tmp_path)
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
        assert timers.exists(keys, fired).all(), "a due timer stays registered until its handler returns"
        timers.delete(keys, fired)  # as the processor does after its handler
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
    for 300 batches, in a partition that keeps its listing but never lists this key: its listing stays under LISTING_BOUND entries; a key with
    20 live timers, one of them moved each batch, stays under 4 x 20; both list right."""
    partition, _ = timers_partition(tmp_path)
    busy = np.array([(1,)], dtype=KEY)
    many = np.array([(2,)] * 20, dtype=KEY)
    live = list(range(1000, 1020))
    stores = partition.open()
    timers = StateHandle(KEY, stores).timers
    timers.register(many, np.array(live))
    assert listed(timers, [2]) == {2: live}  # the partition keeps its listing from here on
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
    partition, schemas = timers_partition(tmp_path, only={*BEFORE_LISTING, "default"})
    stores = partition.open()
    registered = {(u, 100 * u + i) for u in range(6) for i in range(u % 3 + 1)}
    register_as_before(stores, KEY, np.array([(u,) for u, _ in sorted(registered)], dtype=KEY),
                       np.array([t for _, t in sorted(registered)], dtype=np.int64))
    partition.commit(stores)

    for name in LISTING:
        partition.start_empty(name, *schemas[name])
    stores = partition.open()
    processor = TimersOnly()
    task = processor.open(PartitionContext(0, partition.version, stores, "default", None, new_stores=set(LISTING)))
    expected = {u: sorted(t for v, t in registered if v == u) for u in range(6)}
    assert listed(task.handle.timers, range(8)) == expected
    partition.commit(stores)
    partition.reload()
    stores = partition.open()
    timers = StateHandle(KEY, stores).timers
    assert listed(timers, range(8)) == expected, "the filled listing was committed"
    keys, times = timers.pop_due(250)
    assert sorted(zip(keys["user"].tolist(), times.tolist())) == sorted(x for x in registered if x[1] <= 250)
    for store in stores.values():
        store.abort()


def test_a_partition_that_never_lists_keeps_no_listing_and_its_first_list_fills_it(tmp_path):
    """Registers in a partition that has never listed write nothing to the listing (a
    processor that never lists pays nothing for it); the first list, in a batch that is then
    aborted, fills it and marks it kept only in that batch; the next batch's first list fills
    it again, and from then on registers keep it."""
    partition, _ = timers_partition(tmp_path)
    stores = partition.open()
    timers = StateHandle(KEY, stores).timers
    timers.register(np.array([(1,), (2,), (1,)], dtype=KEY), [10, 20, 30])
    partition.commit(stores)
    assert partition.open()["__timers.key_entries"].metrics.num_keys == 0, "registers wrote no listing"

    stores = partition.open()
    assert listed(StateHandle(KEY, stores).timers, [1, 2, 3]) == {1: [10, 30], 2: [20]}
    for store in stores.values():
        store.abort()
    stores = partition.open()
    assert stores["__timers.key_entries"].metrics.num_keys == 0, "the aborted batch's listing is gone"
    timers = StateHandle(KEY, stores).timers
    assert listed(timers, [1]) == {1: [10, 30]}
    timers.register(np.array([(3,)], dtype=KEY), [5])
    partition.commit(stores)
    partition.reload()
    stores = partition.open()
    assert listed(StateHandle(KEY, stores).timers, [1, 2, 3]) == {1: [10, 30], 2: [20], 3: [5]}
    for store in stores.values():
        store.abort()
