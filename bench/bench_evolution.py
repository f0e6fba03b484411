"""Converting a store's rows to an evolved schema: ``statecore.schema_evolution.convert``
against its plain numpy anchor, the same structured-array field copies written by hand; and a
query's first batch after its state's schemas changed against the same batch without a change.

    python -m bench.bench_evolution [--rows 1000000] [--repeat 7] [--rekey-keys N] [--json PATH]

Two changes, each over ``--rows`` rows: a value schema widened (int32 -> int64, float32 ->
float64, S8 -> S16), reordered, a field dropped and one added with a default; and a key
schema widened (int32 -> int64, S4 -> S8: a re-key, the result normalized as key rows are).
The anchor copies the fields between structured arrays it already holds; ``convert`` starts
from and ends with ``(n, width)`` uint8 rows, as stores hold them. The two are checked to
give the same bytes.

The first batch after a restart: a store of ``--rows`` keys (a snapshot, then three versions
of 10% upserts) is opened by a fresh provider at its newest version, a batch of 10% upserts
put and committed. The anchors: the schemas the store was written with, and a store written
under the new value schema from the start (no evolution, rows as wide); the others ask for a
changed value schema (the snapshot read in place, each value converted as it is read)
and a widened key (the snapshot read in place too, each key narrowed back to probe it). Each runs on its own copy of the store;
the four run in turn, round by round.

An eager re-key (``--rekey-keys``, default ``--rows``): a store of one snapshot opened with its
key widened (read in place), a batch committed and maintenance's snapshot of it written (every
row re-keyed), against bench_repartition's anchor over the store's files (read, lz4 round trip,
write as many bytes, fsynced). Each run starts from a fresh copy.
"""
import functools
import logging
import os
import shutil
import tempfile

import numpy as np

from bench._common import Table, arg_parser, measure, measure_alternated, print_header, write_json
from bench.bench_repartition import move_bytes
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.schema import RowSchema
from statecore.schema_evolution import convert, plan

VALUE_OLD = np.dtype([("count", "<i4"), ("sum", "<f4"), ("name", "S8"), ("flag", "?"), ("gone", "<i8")])
VALUE_NEW = np.dtype([("name", "S16"), ("count", "<i8"), ("sum", "<f8"), ("flag", "?"), ("n", "<i4")])
KEY_OLD = np.dtype([("user", "<i4"), ("tag", "S4")])
KEY_NEW = np.dtype([("user", "<i8"), ("tag", "S8")])


def field_copies(src, new_dtype, defaults):
    """The anchor: a new structured array, each field copied from ``src`` or set to its default."""
    out = np.zeros(len(src), dtype=new_dtype)
    for name in new_dtype.names:
        out[name] = defaults[name] if name in defaults else src[name]
    return out


def random_rows(schema, n, rng):
    values = np.zeros(n, dtype=schema.dtype)
    for name, dtype in schema.fields:
        if dtype.kind == "S":
            values[name] = rng.integers(0, 2**31, n).astype(f"S{dtype.itemsize}")
        elif dtype.kind == "b":
            values[name] = rng.integers(0, 2, n).astype(bool)
        else:
            values[name] = rng.integers(-(2**20), 2**20, n).astype(dtype)
    return values, schema.rows(values)


def conversion_table(title, old, new, defaults, n, repeat, rng, key=False):
    old_schema = RowSchema(old, key=key)
    src, rows = random_rows(old_schema, n, rng)
    evolution = plan(old, new, defaults=defaults, key=key)
    expected = field_copies(src, evolution.new.dtype, defaults)
    assert np.array_equal(convert(evolution, rows), expected.view(np.uint8).reshape(n, -1))
    print(f"\n{title}: " + "; ".join(evolution.describe()))
    table = Table(f"{title}: {n:,} rows", n)
    table.add("numpy field copies between structured arrays (anchor)",
              measure(lambda: field_copies(src, evolution.new.dtype, defaults), repeat))
    table.add("convert(plan, rows), the plan made once", measure(lambda: convert(evolution, rows), repeat))
    table.add("plan(...) then convert", measure(
        lambda: convert(plan(old, new, defaults=defaults, key=key), rows), repeat))
    return table


STORE_KEY = np.dtype([("user", "<i4")])
STORE_VALUE = np.dtype([("count", "<i4"), ("sum", "<f4"), ("name", "S8")])
STORE_VALUE_NEW = np.dtype([("name", "S16"), ("count", "<i8"), ("sum", "<f8"), ("n", "<i4")])
STORE_KEY_NEW = np.dtype([("user", "<i8")])


def _upserts(n, batch, seed, key, value):
    rng = np.random.default_rng(seed)
    keys = np.zeros(batch, key)
    keys["user"] = rng.choice(n, batch, replace=False)
    values = np.zeros(batch, value)
    values["count"] = rng.integers(0, 1000, batch)
    values["sum"] = rng.random(batch)
    values["name"] = b"upsert"
    return keys, values


def _provider(root, key, value):
    return create_and_init_provider(StateStoreId(root, 0, 0), key, value, StateStoreConf())


def _written_store(root, n, value=STORE_VALUE, upsert_versions=3):
    """A store of ``n`` keys under schemas (STORE_KEY, ``value``): version 1 (snapshotted),
    then ``upsert_versions`` of 10% upserts."""
    p = create_and_init_provider(StateStoreId(root, 0, 0), STORE_KEY, value,
                                 StateStoreConf(min_deltas_for_snapshot=0))
    keys, values = np.zeros(n, STORE_KEY), np.zeros(n, value)
    keys["user"] = np.arange(n)
    values["count"], values["name"] = 1, b"first"
    store = p.get_store(0)
    store.put_batch(keys, values)
    store.commit()
    p.do_maintenance()  # the snapshot of version 1
    for v in range(1, 1 + upsert_versions):
        store = p.get_store(v)
        store.put_batch(*_upserts(n, n // 10, v, STORE_KEY, value))
        store.commit()
    p.close()


def first_batch_table(n, repeat):
    """A query's first batch after a restart, with and without its state's schemas changed,
    the cases run in turn round by round. Two anchors: the store as it was written (the old
    schemas), and a store written under the new value schema from the start (what the changed
    query costs with no evolution: its rows are wider)."""
    table = Table(f"first batch after a restart: {n:,} keys, {n // 10:,} upserts", n // 10)
    logging.getLogger("statecore").setLevel(logging.ERROR)  # each run commits version 5 again: warned of
    cases = (("the schemas it was written with (anchor)", STORE_KEY, STORE_VALUE, False),
             ("a store of the new value schema from the start, no evolution", STORE_KEY, STORE_VALUE_NEW, True),
             ("a changed value schema: the snapshot read in place, its values converted as read", STORE_KEY,
              STORE_VALUE_NEW, False),
             ("a widened key: the snapshot read in place, each key narrowed to probe it", STORE_KEY_NEW, STORE_VALUE,
              False))
    with tempfile.TemporaryDirectory(prefix="bench-evolution-") as tmp:
        source, native = os.path.join(tmp, "source"), os.path.join(tmp, "native")
        _written_store(source, n)
        _written_store(native, n, STORE_VALUE_NEW)
        runs = []
        for i, (_, key, value, from_start) in enumerate(cases):
            root = os.path.join(tmp, f"copy-{i}")
            shutil.copytree(native if from_start else source, root)
            runs.append(functools.partial(_first_batch, root, key, value, _upserts(n, n // 10, 99, key, value)))
        for (name, key, value, _), run, times in zip(cases, runs, measure_alternated(runs, repeat)):
            table.add(name, times)
            _check_first_batch(run.args[0], key, value, run.args[3], n)
    return table


def _first_batch(root, key, value, batch):
    """A fresh provider of the store at ``root`` opens its newest version, puts ``batch``, commits."""
    p = _provider(root, key, value)
    store = p.get_store(4)
    store.put_batch(*batch)
    store.commit()
    p.close()


def _check_first_batch(root, key, value, batch, n):
    """The version the runs committed holds every key, the batch's values for its keys."""
    p = _provider(root, key, value)
    store = p.get_read_store(5)
    try:
        values, found = store.get_batch(batch[0])
        assert found.all() and np.array_equal(values, batch[1])
        assert sum(len(k) for k, _ in store.iter_batches(1 << 20)) == n
    finally:
        store.abort()
        p.close()


def rekey_table(n, repeat):
    """A key widened over a store of ``n`` keys (one snapshot): the first load reads it in place,
    a batch commits, and maintenance writes the snapshot under the new schemas, every row
    re-keyed; against reading, lz4 round-tripping and writing the store's files' bytes
    (bench_repartition's anchor), and against the same steps with no schema change (a snapshot
    of the same state: what any snapshot of it costs). The three alternate round by round."""
    table = Table(f"an eager re-key: {n:,} keys, int32 -> int64, to its new snapshot", n, unit="keys")
    logging.getLogger("statecore").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-evolution-rekey-") as tmp:
        source, copy, anchor_out = (os.path.join(tmp, name) for name in ("source", "copy", "anchor"))
        _written_store(source, n, upsert_versions=0)
        files = [os.path.join(source, "0", "0", name) for name in os.listdir(os.path.join(source, "0", "0"))
                 if name.endswith((".snapshot", ".delta"))]

        def fresh():
            shutil.rmtree(copy, ignore_errors=True)
            shutil.rmtree(anchor_out, ignore_errors=True)
            shutil.copytree(source, copy)
            os.sync()  # the copy's writeback done before the clock starts, not billed to the timed run

        def rekey():
            q = _provider(copy, STORE_KEY_NEW, STORE_VALUE)
            q.get_store(1).commit()  # version 2: the first under the new schemas
            q.do_maintenance()  # its snapshot, the change made durable whole
            q.close()

        def unchanged():
            q = create_and_init_provider(StateStoreId(copy, 0, 0), STORE_KEY, STORE_VALUE,
                                         StateStoreConf(min_deltas_for_snapshot=0))
            q.get_store(1).commit()
            q.do_maintenance()  # a snapshot of version 2, due at once
            q.close()

        cases = (("anchor: read files + lz4 round trip + write as many bytes", lambda: move_bytes(files, anchor_out)),
                 ("the same steps, no schema change: a snapshot of the same state", unchanged),
                 ("load (read in place), commit, maintenance's snapshot re-keying every row", rekey))
        for (name, _), times in zip(cases, measure_alternated([fn for _, fn in cases], repeat, fresh)):
            table.add(name, times)
        q = _provider(copy, STORE_KEY_NEW, STORE_VALUE)  # the last run's state: every key, re-keyed
        store = q.get_read_store(2)
        try:
            keys = np.zeros(n, STORE_KEY_NEW)
            keys["user"] = np.arange(n)
            values, found = store.get_batch(keys)
            assert found.all() and (values["count"] == 1).all()
            snapshots = [name for name in os.listdir(os.path.join(copy, "0", "0")) if name.endswith(".snapshot")]
            assert any(name.startswith("2_") for name in snapshots), snapshots  # the change made durable whole
        finally:
            store.abort()
            q.close()
    return table


def main(argv=None):
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--rekey-keys", type=int, default=None, help="keys of the re-key table (default: --rows)")
    args = parser.parse_args(argv)
    header = print_header(f"schema evolution: {args.rows:,} rows converted")
    rng = np.random.default_rng(args.seed)
    tables = [conversion_table("value schema", VALUE_OLD, VALUE_NEW, {"n": 1}, args.rows, args.repeat, rng),
              conversion_table("key schema (a re-key)", KEY_OLD, KEY_NEW, {}, args.rows, args.repeat, rng, key=True),
              first_batch_table(args.rows, args.repeat),
              rekey_table(args.rekey_keys or args.rows, args.repeat)]
    for table in tables:
        table.print()
    if args.json:
        write_json(args.json, header, tables)


if __name__ == "__main__":
    main()
