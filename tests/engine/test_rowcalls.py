"""The compiled per-row path: RowCodec converts exactly as RowSchema does (rows, and errors
of the same type and message), and a store's per-row get/put/remove (RowCalls) answer
what its batch path answers, on random workloads over every kind of base, with stores kept
open across commits (RowCalls keeps the walk of its version between calls); a get waits
for a merge that holds the provider's lock."""
import math
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from statecore.errors import IllegalStateError
from statecore.schema import RowSchema, key_value_schemas
from tests.store_support import commit_batch, open_provider, wait_until

INT_BOUNDS = {"i1": (-2**7, 2**7 - 1), "u1": (0, 2**8 - 1), "<i2": (-2**15, 2**15 - 1), "<u2": (0, 2**16 - 1),
              "<i4": (-2**31, 2**31 - 1), "<u4": (0, 2**32 - 1), "<i8": (-2**63, 2**63 - 1), "<u8": (0, 2**64 - 1)}
KINDS = ["?", *INT_BOUNDS, "<f4", "<f8", "S1", "S3", "S8"]


def outcome(fn, arg):
    """The row bytes ``fn(arg)`` returns, or the type and message of what it raises."""
    try:
        return fn(arg)
    except Exception as e:  # noqa: BLE001 -- the comparison is of any exception
        return type(e), str(e)


def same_values(a, b):
    """Equal tuples, floats compared by their bits (NaNs included)."""
    def bits(v):
        return ("f", struct.pack("<d", v)) if isinstance(v, float) else (type(v), v)
    return len(a) == len(b) and all(bits(x) == bits(y) for x, y in zip(a, b))


def field_value(code):
    """Values a field of dtype ``code`` takes, at its bounds and beyond, and some it refuses."""
    wrong = st.sampled_from([None, "1", 1j, [1], np.float64(1.5), np.int64(3), np.True_, np.int8(-1)])
    if code == "?":
        right = st.booleans()
    elif code in INT_BOUNDS:
        lo, hi = INT_BOUNDS[code]
        right = st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, lo - 1, hi + 1, 2**64, -2**64, 2**70]),
                          st.booleans())
    elif code.startswith("<f"):
        right = st.one_of(st.floats(), st.sampled_from([-0.0, 0.0, math.nan, -math.nan, math.inf, 3.5e38, 3.4028235e38,
                                                        1e39, 2**64, 2**1100, -7]),
                          st.floats(width=32), st.integers(-2**70, 2**70), st.booleans(),
                          # NaNs with payloads, both signs
                          st.integers(0, 2**52 - 1).map(lambda m: struct.unpack("<d", struct.pack(
                              "<Q", 0x7FF0_0000_0000_0001 | m | (m & 1) << 63))[0]))
    else:
        n = int(code[1:])
        right = st.one_of(st.binary(max_size=n + 2), st.binary(max_size=n).map(lambda b: b + b"\0"),
                          st.just(bytearray(b"x")))
    return st.one_of(right, right, right, wrong)


@st.composite
def schema_and_input(draw):
    codes = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
    key = draw(st.booleans())
    schema = RowSchema(np.dtype([(f"f{i}", c) for i, c in enumerate(codes)]), key=key)
    values = tuple(draw(field_value(c)) for c in codes)
    form = draw(st.sampled_from(["tuple", "tuple", "tuple", "short", "long", "bare", "list", "row bytes", "none"]))
    if form == "short":
        obj = values[:-1]
    elif form == "long":
        obj = values + (1,)
    elif form == "bare":
        obj = values[0]
    elif form == "list":
        obj = list(values)
    elif form == "row bytes":
        obj = draw(st.binary(min_size=schema.width - 1, max_size=schema.width + 1))
    elif form == "none":
        obj = None
    else:
        obj = values
    return schema, obj


@settings(max_examples=3000, deadline=None)
@given(schema_and_input())
def test_codec_encodes_as_the_schema_does_errors_included(case):
    schema, obj = case
    assert outcome(schema.codec.encode, obj) == outcome(schema.encode, obj)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(KINDS), max_size=5), st.booleans(), st.data())
def test_codec_decodes_as_the_schema_does(codes, key, data):
    schema = RowSchema(np.dtype([(f"f{i}", c) for i, c in enumerate(codes)]), key=key)
    row = data.draw(st.binary(min_size=schema.width, max_size=schema.width))
    assert same_values(schema.codec.decode(row), schema.decode(row))


def test_codec_decode_checks_the_row_width():
    schema = RowSchema(np.dtype([("k", "<i8")]))
    with pytest.raises(ValueError, match="8 bytes, got 7"):
        schema.codec.decode(b"1234567")


def test_key_codec_normalizes_zero_and_nans_of_both_float_widths():
    key = RowSchema(np.dtype([("a", "<f4"), ("b", "<f8")]), key=True)
    odd_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF0_0000_0000_0123))[0]
    for v in [(-0.0, -0.0), (math.nan, odd_nan), (-math.nan, 0.0), (1.5, -2.5)]:
        assert key.codec.encode(v) == key.encode(v) == key.rows(np.array([v], key.dtype)).tobytes()


# -- the store's per-row path against its batch path --------------------------------------
KEY = np.dtype([("id", "<i4"), ("x", "<f8"), ("tag", "S3")])
VALUE = np.dtype([("n", "<i8"), ("y", "<f4"), ("ok", "?"), ("name", "S5")])
KEY_SPACE = [(i, x, t) for i in (0, 1, -7) for x in (0.0, -0.0, 1.5, math.nan) for t in (b"", b"a", b"abc")]


def batch_of(keys):
    arr = np.zeros(len(keys), KEY)
    for i, k in enumerate(keys):
        arr[i] = k
    return arr


def check_per_row_equals_batch(store, model):
    """Every key of the key space: ``store.get`` equals ``get_batch`` and the model."""
    values, found = store.get_batch(batch_of(KEY_SPACE))
    key_schema, value_schema = key_value_schemas(KEY, VALUE)
    for k, v, f in zip(KEY_SPACE, values, found):
        got = store.get(k)
        assert (got is not None) == bool(f), k
        if got is not None:
            assert same_values(got, value_schema.decode(v.tobytes())), k
        want = model.get(key_schema.encode(k))
        assert (got is None and want is None) or same_values(got, want), (k, got, want)


ops = st.lists(st.tuples(st.sampled_from(["put", "put", "remove", "commit", "snapshot+reopen", "read old",
                                          "keep a reader"]),
                         st.sampled_from(KEY_SPACE),
                         st.tuples(st.integers(-2**63, 2**63 - 1), st.floats(width=32, allow_nan=False),
                                   st.booleans(), st.binary(max_size=5))),
               max_size=40)


_V1, _V2 = (1, 0.5, True, b"one"), (2, 0.25, False, b"two")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
# a reader kept open over the head while the next version merges into it
@example([("put", KEY_SPACE[0], _V1), ("commit", KEY_SPACE[0], _V1), ("keep a reader", KEY_SPACE[0], _V1),
          ("put", KEY_SPACE[0], _V2), ("remove", KEY_SPACE[1], _V2), ("commit", KEY_SPACE[0], _V2)])
def test_store_per_row_calls_equal_the_batch_path(tmp_path_factory, workload):
    root = tmp_path_factory.mktemp("rowcalls")
    provider = open_provider(root, KEY, VALUE, min_deltas_for_snapshot=0)
    key_schema, _ = key_value_schemas(KEY, VALUE)
    versions = {0: {}}  # version -> {key row: value tuple}
    version, model = 0, {}
    store = provider.get_store(0)
    kept = None  # (a read store kept open across the ops that follow, its version's model)
    try:
        for op, k, v in workload:
            if op == "put":
                store.put(k, v)
                model[key_schema.encode(k)] = (v[0], v[1], v[2], v[3].rstrip(b"\0"))
            elif op == "remove":
                store.remove(k)
                model.pop(key_schema.encode(k), None)
            elif op == "commit":
                version = store.commit()
                versions[version] = dict(model)
                store = provider.get_store(version)
            elif op == "snapshot+reopen":
                version = store.commit()
                versions = {version: dict(model)}
                if kept is not None:
                    kept[0].abort()
                    kept = None
                provider.do_maintenance()
                provider.close()
                provider = open_provider(root, KEY, VALUE, min_deltas_for_snapshot=0)
                store = provider.get_store(version)
            elif op == "read old":
                old = min(versions)
                reader = provider.get_read_store(old)
                check_per_row_equals_batch(reader, versions[old])
                reader.abort()
            elif op == "keep a reader":
                if kept is not None:
                    kept[0].abort()
                kept = (provider.get_read_store(version), versions[version])
            check_per_row_equals_batch(store, model)
            if kept is not None:
                check_per_row_equals_batch(*kept)
    finally:
        store.abort()
        if kept is not None:
            kept[0].abort()
        provider.close()


BAD_INPUTS = [
    (1, 2.0), (1, 2.0, b"abc", 4), None, (None, 1.0, b"a"), ("1", 1.0, b"a"), (True, 1.0, b"a"),
    (2**31, 1.0, b"a"), (1, "x", b"a"), (1, 1.0, b"abcd"), (1, 1.0, "abc"), 7, b"\0" * 5,
]


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=repr)
def test_bad_keys_and_values_raise_what_the_schema_raises_and_change_nothing(tmp_path, bad):
    provider = open_provider(tmp_path, KEY, VALUE)
    key_schema, value_schema = key_value_schemas(KEY, VALUE)
    store = provider.get_store(0)
    good_key, good_value = (1, 1.0, b"a"), (1, 1.0, True, b"v")
    store.put(good_key, good_value)
    want_key = outcome(key_schema.encode, bad)
    assert isinstance(want_key, tuple) and issubclass(want_key[0], Exception)
    assert outcome(store.get, bad) == want_key
    assert outcome(lambda k: store.put(k, good_value), bad) == want_key
    assert outcome(store.remove, bad) == want_key
    want_value = outcome(value_schema.encode, bad)
    if bad is not None:
        assert isinstance(want_value, tuple) and issubclass(want_value[0], Exception)
        assert outcome(lambda v: store.put(good_key, v), bad) == want_value
    assert store.get(good_key) == good_value
    assert store.metrics.num_keys == 1
    store.abort()
    provider.close()


def test_lifecycle_errors_of_the_per_row_calls(tmp_path):
    provider = open_provider(tmp_path, KEY, VALUE)
    store = provider.get_store(0)
    with pytest.raises(ValueError, match="Cannot put a null value"):
        store.put((1, 1.0, b"a"), None)
    store.put((1, 1.0, b"a"), (1, 1.0, True, b"v"))
    assert store.commit() == 1
    assert store.get((1, 1.0, b"a")) == (1, 1.0, True, b"v")  # a committed store still reads
    with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
        store.put((2, 1.0, b"a"), (1, 1.0, True, b"v"))
    with pytest.raises(IllegalStateError, match="Cannot remove after already committed or aborted"):
        store.remove((1, 1.0, b"a"))
    store = provider.get_store(1)
    store.put((2, 1.0, b"a"), (2, 1.0, True, b"v"))
    store.abort()
    assert store.get((2, 1.0, b"a")) is None  # the aborted updates are gone
    with pytest.raises(IllegalStateError, match="Cannot put after already committed or aborted"):
        store.put((2, 1.0, b"a"), (1, 1.0, True, b"v"))
    provider.close()


def test_wide_rows_take_the_heap_buffer(tmp_path):
    key, value = np.dtype([("k", "S300")]), np.dtype([("v", "S700"), ("n", "<i8")])
    provider = open_provider(tmp_path, key, value)
    store = provider.get_store(0)
    store.put(b"k" * 300, (b"v" * 700, 5))
    store.put(b"short", (b"", -1))
    assert store.get(b"k" * 300) == (b"v" * 700, 5) and store.get((b"short",)) == (b"", -1)
    store.remove(b"short")
    assert store.get(b"short") is None
    with pytest.raises(ValueError, match="holds at most 300 bytes, got 301"):
        store.get(b"k" * 301)
    store.abort()
    provider.close()


# -- the kept walk and the lock ------------------------------------------------------------
K1, K2, K3 = (1, 1.0, b"a"), (2, 1.0, b"a"), (3, 1.0, b"a")


def val(n):
    return (n, 1.0, True, b"v")


def test_a_kept_walk_follows_the_merges_after_it(tmp_path):
    provider = open_provider(tmp_path, KEY, VALUE)
    commit_batch(provider, 0, puts=[(K1, val(1)), (K2, val(2))])
    reader = provider.get_read_store(1)
    assert reader.get(K1) == val(1) and reader.get(K3) is None  # the walk is taken: the head
    # Version 2 merges into the same head, and keeps version 1 readable through an undo layer.
    commit_batch(provider, 1, puts=[(K1, val(10)), (K3, val(3))], removes=[K2])
    assert (reader.get(K1), reader.get(K2), reader.get(K3)) == (val(1), val(2), None)
    newest = provider.get_read_store(2)
    assert (newest.get(K1), newest.get(K2), newest.get(K3)) == (val(10), None, val(3))
    reader.abort()
    newest.abort()
    provider.close()


def test_a_get_waits_for_a_merge_holding_the_lock_then_reads_its_version(tmp_path):
    provider = open_provider(tmp_path, KEY, VALUE)
    commit_batch(provider, 0, puts=[(K1, val(1))])
    reader = provider.get_read_store(1)
    assert reader.get(K1) == val(1)
    results = []
    provider.held.lock.acquire()  # as a merge does
    try:
        t = threading.Thread(target=lambda: results.append(reader.get(K1)))
        t.start()
        wait_until(lambda: provider.held.lock.handoff, "the get blocks on the provider's lock")
        assert not results
        commit_batch(provider, 1, puts=[(K1, val(10))])  # takes the lock again (re-entrant)
    finally:
        provider.held.lock.release()
    t.join()
    assert results == [val(1)]
    reader.abort()
    provider.close()


def test_per_row_calls_after_many_removals_of_the_update_layers_puts(tmp_path):
    # Removing most of the puts rebuilds the puts table's negative filter: the keys left
    # are still found, the removed ones are not, and putting them again makes no duplicate.
    provider = open_provider(tmp_path, KEY, VALUE)
    store = provider.get_store(0)
    keys = [(i, 0.5, b"k") for i in range(3000)]
    for i, k in enumerate(keys):
        store.put(k, val(i))
    for k in keys[:2800]:
        store.remove(k)
    assert all(store.get(k) is None for k in keys[:2800])
    assert all(store.get(k) == val(i) for i, k in enumerate(keys) if i >= 2800)
    for i, k in enumerate(keys):
        store.put(k, val(-i))
    assert all(store.get(k) == val(-i) for i, k in enumerate(keys))
    assert store.metrics.num_keys == 3000 and len(list(store.iterator())) == 3000
    store.abort()
    provider.close()


def test_a_kept_walk_follows_the_merges_and_base_swaps_of_the_state_it_reads():
    # RowCalls over a State directly (no provider: no retain after a merge to count a change
    # for it): a merge and a new base must each make the kept walk be taken again.
    from types import SimpleNamespace

    from statecore._lock import ProviderLock
    from statecore._rowcalls import RowCalls
    from statecore._versions import FrozenView, State

    key_schema, value_schema = key_value_schemas(KEY, VALUE)

    def rows(schema, items):
        return np.frombuffer(b"".join(schema.encode(x) for x in items), np.uint8).reshape(len(items), schema.width)

    def merge(state, puts=(), removes=()):
        state.merge(rows(key_schema, [k for k, _ in puts]), rows(value_schema, [v for _, v in puts]),
                    rows(key_schema, list(removes)), bytes(16))

    def reader(state, version):
        return RowCalls(SimpleNamespace(state=state, version=version), ProviderLock(), key_schema, value_schema)

    state = State(key_schema, value_schema, None, 0, bytes(16), 0)
    merge(state, puts=[(K1, val(1))])
    r1 = reader(state, 1)
    assert r1.get(K1) == val(1) and r1.get(K2) is None  # the walk is taken: the head alone
    merge(state, puts=[(K1, val(10)), (K2, val(2))], removes=[])  # version 1 now reads an undo layer
    assert (r1.get(K1), r1.get(K2)) == (val(1), None)
    r2 = reader(state, 2)
    assert (r2.get(K1), r2.get(K2), r2.get(K3)) == (val(10), val(2), None)
    below = State(key_schema, value_schema, None, 0, bytes(16), 0)
    merge(below, puts=[(K3, val(3))])
    below.freeze_into_successor(1, keep_versions=False)
    state.base = FrozenView(below, 1)  # keys the head does not decide now come from it
    assert (r2.get(K1), r2.get(K3)) == (val(10), val(3))


def test_a_stores_lifecycle_is_one_field_and_its_calls_are_its_class(tmp_path):
    """A store's get/put/remove are the compiled calls of its class (nothing bound on the
    instance, nothing to keep in step) and its lifecycle is one field: after a commit, and
    after an abort, the per-row and the batch writes are refused alike, with Spark's
    wording; reads after a commit see the committed version, after an abort the opened one."""
    from statecore._rowcalls import RowCalls

    provider = open_provider(tmp_path, KEY, VALUE)
    store = provider.get_store(0)
    assert not {"get", "put", "remove"} & set(vars(store)), "per-row calls bound on the instance"
    assert type(store).put is RowCalls.put and type(provider.get_read_store(0)).get is RowCalls.get
    store.put(K1, val(1))
    assert store.updating and not store.has_committed
    assert store.commit() == 1
    assert store.has_committed and not store.updating and store.get(K1) == val(1)
    aborted = provider.get_store(1)
    aborted.put(K2, val(2))
    aborted.abort()
    assert not aborted.updating and not aborted.has_committed and aborted.get(K2) is None
    assert aborted.get(K1) == val(1)
    key_rows = np.zeros(1, KEY)
    for ended, verb in ((store, "committed"), (aborted, "aborted")):
        writes = [lambda: ended.put(K3, val(3)), lambda: ended.remove(K1),
                  lambda: ended.put_batch(key_rows, np.zeros(1, VALUE)), lambda: ended.remove_batch(key_rows),
                  ended.commit]
        for write in writes:
            with pytest.raises(IllegalStateError, match="after already committed or aborted"):
                write()
    assert provider.get_read_store(1).get(K3) is None
    provider.close()
