"""KeyedLists and ExpiryIndex against plain-Python models, over real stores committed and
reopened between steps; and the work an expiry does, counted in rows the stores are asked for."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.expiry import ExpiryIndex
from statecore.keyed_lists import KeyedLists

KEY = np.dtype([("k", "<i8")])
ITEM = np.dtype([("v", "<i4"), ("w", "<f8")])
OWNER = np.dtype([("o", "<i4"), ("f", "<f8")])


class Stores:
    """The named stores of one partition, opened at one version and committed together."""

    def __init__(self, root, schemas):
        self.providers = {name: create_and_init_provider(StateStoreId(str(root), 0, 0, store_name=name), key, value,
                                                         StateStoreConf(min_deltas_for_snapshot=3))
                          for name, (key, value) in schemas.items()}
        self.version = 0
        self.open()

    def open(self):
        self.stores = {name: p.get_store(self.version) for name, p in self.providers.items()}

    def commit(self):
        for store in self.stores.values():
            store.commit()
        self.version += 1
        self.open()

    def abort(self):
        for store in self.stores.values():
            store.abort()
        self.open()

    def close(self):
        for store in self.stores.values():
            store.abort()
        for p in self.providers.values():
            p.close()


def owners_of(pairs):
    return np.array(pairs, dtype=OWNER)


class KeyedListsModel(RuleBasedStateMachine):
    """Random appends, clears and replacements, committed or aborted, against a dict of lists."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.stores = Stores(self.tmp.name, KeyedLists.schemas(OWNER, ITEM))
        self.model, self.committed = {}, {}

    def lists(self):
        return KeyedLists(self.stores.stores["heads"], self.stores.stores["entries"], OWNER, ITEM)

    owner = st.tuples(st.integers(0, 5), st.sampled_from([0.0, -0.0, 1.5]))

    @rule(appends=st.lists(st.tuples(owner, st.integers(-9, 9)), max_size=12))
    def append(self, appends):
        if not appends:
            return
        owners = owners_of([o for o, _ in appends])
        items = np.array([(v, v / 2) for _, v in appends], dtype=ITEM)
        self.lists().append(owners, items)
        for (o, f), v in appends:
            self.model.setdefault((o, f + 0.0), []).append(v)

    @rule(which=st.lists(owner, max_size=4, unique_by=lambda o: (o[0], o[1] + 0.0)))
    def clear(self, which):
        self.lists().clear(owners_of(which))
        for o, f in which:
            self.model.pop((o, f + 0.0), None)

    @rule(owner=owner, keep=st.integers(0, 3), extra=st.lists(st.integers(-9, 9), max_size=3))
    def replace(self, owner, keep, extra):
        key = (owner[0], owner[1] + 0.0)
        new = self.model.get(key, [])[:keep] + extra
        items = np.array([(v, v / 2) for v in new], dtype=ITEM)
        self.lists().replace(owners_of([owner]), np.zeros(len(new), dtype=np.int64), items)
        if new:
            self.model[key] = new
        else:
            self.model.pop(key, None)

    @rule()
    def commit(self):
        self.stores.commit()
        self.committed = {k: list(v) for k, v in self.model.items()}

    @rule()
    def abort(self):
        self.stores.abort()
        self.model = {k: list(v) for k, v in self.committed.items()}

    @invariant()
    def lists_match(self):
        owners = owners_of([(o, f) for o in range(6) for f in (0.0, 1.5)])
        which, items = self.lists().read(owners)
        got = {}
        for w, item in zip(which, items):
            got.setdefault((int(owners[w]["o"]), float(owners[w]["f"])), []).append(int(item["v"]))
        assert got == self.model

    def teardown(self):
        self.stores.close()
        self.tmp.cleanup()


TestKeyedLists = KeyedListsModel.TestCase
TestKeyedLists.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow], derandomize=True)


class ExpiryModel(RuleBasedStateMachine):
    """Random adds and pops, committed, aborted or reopened, against a sorted list of entries."""

    key_dtype = KEY  # 64 entries a chunk

    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.stores = Stores(self.tmp.name, ExpiryIndex.schemas(self.key_dtype))
        self.model, self.committed = [], []

    @initialize(shift=st.integers(0, 4))
    def choose_shift(self, shift):
        self.shift = shift

    def index(self):
        return ExpiryIndex(self.stores.stores["heads"], self.stores.stores["entries"], self.key_dtype,
                           bucket_shift=self.shift)

    @rule(entries=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 20)), max_size=10))
    def add(self, entries):
        times = np.array([t for t, _ in entries], dtype=np.int64)
        keys = np.zeros(len(entries), dtype=self.key_dtype)
        keys["k"] = [k for _, k in entries]
        self.index().add(times, keys)
        self.model += entries

    @rule(data=st.data())
    def pop(self, data):
        """Up to a random time, or exactly an entry's time (ties expire), or past them all."""
        choices = [st.integers(-5, 320), st.just(10**15)]
        if self.model:
            choices.append(st.sampled_from([t for t, _ in self.model]))
        limit = data.draw(st.one_of(*choices), label="limit")
        times, keys = self.index().pop_until(limit)
        got = sorted(zip(times.tolist(), keys["k"].tolist()))
        expected = sorted(e for e in self.model if e[0] <= limit)
        assert got == expected
        self.model = [e for e in self.model if e[0] > limit]

    @rule()
    def commit(self):
        self.stores.commit()
        self.committed = list(self.model)

    @rule()
    def abort(self):
        self.stores.abort()
        self.model = list(self.committed)

    @invariant()
    def size_matches(self):
        assert len(self.index()) == len(self.model)

    def teardown(self):
        self.stores.close()
        self.tmp.cleanup()


class ExpiryModelSmallChunks(ExpiryModel):
    """Wide keys: 8 entries a chunk, so buckets span several chunks and adds reopen a bucket's
    last chunk."""

    key_dtype = np.dtype([("k", "<i8"), ("pad", "S100")])


class ExpiryModelOneEntryChunks(ExpiryModel):
    """Keys so wide that a chunk holds one entry."""

    key_dtype = np.dtype([("k", "<i8"), ("pad", "S1000")])


_EXPIRY_SETTINGS = settings(max_examples=40, stateful_step_count=25, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow], derandomize=True)
TestExpiry = ExpiryModel.TestCase
TestExpiry.settings = _EXPIRY_SETTINGS
TestExpirySmallChunks = ExpiryModelSmallChunks.TestCase
TestExpirySmallChunks.settings = _EXPIRY_SETTINGS
TestExpiryOneEntryChunks = ExpiryModelOneEntryChunks.TestCase
TestExpiryOneEntryChunks.settings = _EXPIRY_SETTINGS


def test_chunks_per_key_width():
    assert ExpiryIndex.schemas(KEY)["entries"][1].itemsize == 8 + 64 * 16
    assert ExpiryIndex.schemas(ExpiryModelSmallChunks.key_dtype)["entries"][1].itemsize == 8 + 8 * 116
    assert ExpiryIndex.schemas(ExpiryModelOneEntryChunks.key_dtype)["entries"][1].itemsize == 8 + 1016


class CountingStore:
    """A store that counts the rows it is asked to look up, write or remove."""

    def __init__(self, store):
        self.store, self.rows = store, 0

    def get_batch(self, keys):
        self.rows += len(keys)
        return self.store.get_batch(keys)

    def put_batch(self, keys, values):
        self.rows += len(keys)
        return self.store.put_batch(keys, values)

    def remove_batch(self, keys):
        self.rows += len(keys)
        return self.store.remove_batch(keys)

    def iter_batches(self, rows_per_batch=65536):
        for keys, values in self.store.iter_batches(rows_per_batch):
            self.rows += len(keys)
            yield keys, values


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.2])
def test_an_expiry_touches_rows_in_proportion_to_what_expires(tmp_path, fraction):
    """100k entries over 1000 buckets; popping a fraction of them asks the stores for about
    that fraction of the rows (each expired entry read and removed, its buckets looked up and
    cleared), never for all of them, and again after a commit and a reload."""
    n, shift = 100_000, 10
    rng = np.random.default_rng(7)
    times = rng.integers(0, 1000 << shift, n)
    keys = np.zeros(n, dtype=KEY)
    keys["k"] = np.arange(n)
    stores = Stores(tmp_path, ExpiryIndex.schemas(KEY))
    ExpiryIndex(stores.stores["heads"], stores.stores["entries"], KEY, bucket_shift=shift).add(times, keys)
    stores.commit()
    stores.providers["entries"].close()  # reload from files: the index needs nothing in memory
    stores.providers = dict(stores.providers)
    stores.providers["entries"] = create_and_init_provider(
        StateStoreId(str(tmp_path), 0, 0, store_name="entries"), *ExpiryIndex.schemas(KEY)["entries"],
        StateStoreConf())
    stores.open()
    heads, entries = CountingStore(stores.stores["heads"]), CountingStore(stores.stores["entries"])
    index = ExpiryIndex(heads, entries, KEY, bucket_shift=shift)
    limit = int(np.sort(times)[int(n * fraction)])  # an entry's own time: ties expire
    got_times, got_keys = index.pop_until(limit)
    expected = np.flatnonzero(times <= limit)
    assert sorted(got_keys["k"].tolist()) == expected.tolist()
    assert (got_times == times[got_keys["k"]]).all()
    expired, buckets = len(expected), (limit >> shift) + 1
    # entries: read + removed (+ the kept part of the last bucket rewritten); heads: looked up,
    # cleared, and the bookkeeping rows
    assert entries.rows <= 2 * expired + 2 * (n // 1000) + 10, (entries.rows, expired)
    assert heads.rows <= 2 * buckets + 10, (heads.rows, buckets)
    assert entries.rows < n / 2
    stores.commit()
    remaining = ExpiryIndex(stores.stores["heads"], stores.stores["entries"], KEY, bucket_shift=shift)
    assert len(remaining) == n - expired
    stores.close()


def test_a_jump_far_ahead_reads_the_bucket_heads_not_every_bucket(tmp_path):
    """Entries at times 0 and 2**60: popping everything must not look up 2**40 buckets."""
    stores = Stores(tmp_path, ExpiryIndex.schemas(KEY))
    heads = CountingStore(stores.stores["heads"])
    index = ExpiryIndex(heads, stores.stores["entries"], KEY, bucket_shift=20)
    index.add(np.array([0, 5, 2**60], dtype=np.int64), np.array([(1,), (2,), (3,)], dtype=KEY))
    times, keys = index.pop_until(2**61)
    assert sorted(keys["k"].tolist()) == [1, 2, 3] and len(index) == 0
    assert heads.rows < 100
    stores.close()


def test_bad_input_is_refused_before_anything_changes(tmp_path):
    stores = Stores(tmp_path, ExpiryIndex.schemas(KEY))
    index = ExpiryIndex(stores.stores["heads"], stores.stores["entries"], KEY, bucket_shift=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        index.add(np.array([3, -1]), np.zeros(2, dtype=KEY))
    with pytest.raises(ValueError, match="2 times but 1 keys"):
        index.add(np.array([3, 4]), np.zeros(1, dtype=KEY))
    assert len(index) == 0
    index.add(np.array([3]), np.zeros(1, dtype=KEY))
    stores.commit()
    with pytest.raises(ValueError, match="built with bucket_shift=4, not 5"):
        ExpiryIndex(stores.stores["heads"], stores.stores["entries"], KEY, bucket_shift=5)
    stores.close()


def test_float_times_and_float_key_fields_are_refused_not_truncated(tmp_path):
    """A caller passing event times as floats (seconds, 1.9) or a key column cast to float
    would have its entries filed under other times and keys: a TypeError names what was
    wrong, and nothing is filed."""
    stores = Stores(tmp_path, ExpiryIndex.schemas(KEY))
    index = ExpiryIndex(stores.stores["heads"], stores.stores["entries"], KEY, bucket_shift=4)
    with pytest.raises(TypeError, match="times must be integers.*float64"):
        index.add(np.array([1.9, 2.0]), np.zeros(2, dtype=KEY))
    with pytest.raises(TypeError, match="times must be integers"):
        index.add([True], np.zeros(1, dtype=KEY))
    with pytest.raises(TypeError, match="field 'k' has dtype <f8"):
        index.add(np.array([3]), np.array([(1.5,)], dtype=[("k", "<f8")]))
    with pytest.raises(TypeError, match="structured array"):
        index.add(np.array([3]), np.array([1]))
    with pytest.raises(ValueError, match="fit in int64"):
        index.add(np.array([2**64 - 1], dtype=np.uint64), np.zeros(1, dtype=KEY))
    assert len(index) == 0
    index.add(np.array([3], dtype=np.uint32), np.zeros(1, dtype=KEY))
    index.add([], np.zeros(0, dtype=KEY))
    assert len(index) == 1
    stores.close()


def test_adds_fill_each_buckets_last_chunk_before_opening_another(tmp_path):
    """8 entries a chunk: two buckets get 3 entries each, then 2 and 10 more in one add (both
    last chunks reopened, one bucket growing to 2 chunks); each pop returns exactly its entries,
    and the stores hold one row per chunk."""
    wide = ExpiryModelSmallChunks.key_dtype
    stores = Stores(tmp_path, ExpiryIndex.schemas(wide))
    index = ExpiryIndex(stores.stores["heads"], stores.stores["entries"], wide, bucket_shift=4)
    model = []

    def add(entries):
        keys = np.zeros(len(entries), dtype=wide)
        keys["k"] = [k for _, k in entries]
        index.add(np.array([t for t, _ in entries], dtype=np.int64), keys)
        model.extend(entries)

    add([(5 * 16 + i, i) for i in range(3)] + [(9 * 16 + i, 100 + i) for i in range(3)])
    add([(9 * 16 + 3 + i % 10, 200 + i) for i in range(10)] + [(5 * 16 + 5, 7), (5 * 16 + 6, 8)])
    assert index.lists.counts(np.array([(5,), (9,)], dtype=index.lists.owner_dtype)).tolist() == [1, 2]
    assert len(index) == 18
    for limit in (5 * 16 + 15, 9 * 16 + 6, 10**9):
        times, keys = index.pop_until(limit)
        assert sorted(zip(times.tolist(), keys["k"].tolist())) == sorted(e for e in model if e[0] <= limit)
        model = [e for e in model if e[0] > limit]
        assert len(index) == len(model)
        stores.commit()
        index = ExpiryIndex(stores.stores["heads"], stores.stores["entries"], wide, bucket_shift=4)
    assert sum(len(keys) for keys, _ in stores.stores["entries"].iter_batches()) == 0
    stores.close()
