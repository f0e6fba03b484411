"""Per-row store calls (``get``, ``put`` with tuples, as RDD-level code makes them) against a
Python dict holding the same tuples, in the same run.

    python -m bench.bench_rowcalls --rows 200000 --repeat 7 [--json PATH]

For two schemas (numeric: key (int64,), value (int64, float64); with bytes: key (int64,
S8), value (int64, S12)), each row of a table is one Python loop of ``--rows`` calls, the
same loop for the dict and the store: ``put`` of new keys (a fresh dict, a fresh store per
run, untimed), then ``get`` of hits (random order, fresh key tuples, as data hands them
in) and of misses. The store is read over an empty base (the keys committed into memory,
the store opened at that version) and over a snapshot (the provider reopened from its
files after maintenance wrote one), before and after a maintenance pass of the reopened
provider built the snapshot's key filter. ``relative`` is the dict's time over the row's: 1.0X
or more is as fast as the dict.
"""
import shutil
import tempfile

import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider

SCHEMAS = {
    "numeric": (np.dtype([("k", "<i8")]), np.dtype([("count", "<i8"), ("sum", "<f8")])),
    "bytes": (np.dtype([("k", "<i8"), ("name", "S8")]), np.dtype([("count", "<i8"), ("note", "S12")])),
}


def make_tuples(kind, n, seed):
    """(keys, values, hits, misses): lists of tuples; hits are new tuple objects."""
    rng = np.random.default_rng(seed)
    ks = rng.permutation(4 * n)[:n].tolist()
    counts = rng.integers(0, 1000, n).tolist()
    if kind == "numeric":
        def key(k):
            return (k,)
        values = list(zip(counts, (rng.random(n) * 100).tolist()))
    else:
        def key(k):
            return (k, b"u%07d" % (k % 10_000_000))
        values = [(c, b"note-%d" % c) for c in counts]
    keys = [key(k) for k in ks]
    hits = [key(k) for k in rng.choice(ks, n).tolist()]
    misses = [key(-1 - k) for k in rng.permutation(4 * n)[:n].tolist()]
    return keys, values, hits, misses


def put_all(put, keys, values):
    for k, v in zip(keys, values):
        put(k, v)


def get_all(get, keys):
    for k in keys:
        get(k)


def open_provider(root, key, value, cache_dir=None):
    """A provider of ``root``; ``cache_dir``: its own local image cache, so that it reads the
    snapshot files as another executor would, not the whole image the writer published."""
    return create_and_init_provider(StateStoreId(root, 0, 0), key, value,
                                    StateStoreConf(min_deltas_for_snapshot=0, local_cache_dir=cache_dir))


def schema_tables(kind, n, repeat, seed, scratch):
    key, value = SCHEMAS[kind]
    keys, values, hits, misses = make_tuples(kind, n, seed)
    root = tempfile.mkdtemp(dir=scratch)
    provider = open_provider(root, key, value)
    holder = {}
    tables = []

    def fresh_dict():
        holder["d"] = {}

    def fresh_store():
        if "s" in holder:
            holder["s"].abort()
        holder["s"] = provider.get_store(0)

    t = Table(f"{kind}: put {n:,} new keys", n, unit="calls")
    t.add("dict: d[k] = v", measure(lambda: put_all(holder["d"].__setitem__, keys, values), repeat, setup=fresh_dict))
    t.add("store.put(k, v)", measure(lambda: put_all(holder["s"].put, keys, values), repeat, setup=fresh_store))
    tables.append(t)

    d = dict(zip(keys, values))
    writer = holder.pop("s")  # every key in its update layer, not committed
    readers = {"update layer (this store's puts)": writer}
    committer = provider.get_store(0)
    put_all(committer.put, keys, values)
    version = committer.commit()
    readers["empty base (committed, in memory)"] = provider.get_store(version)
    provider.do_maintenance()
    reopened = open_provider(root, key, value, tempfile.mkdtemp(dir=scratch))
    readers["snapshot base (reopened)"] = reopened.get_store(version)
    base = readers["snapshot base (reopened)"]._view.state.base
    assert type(base).__name__ == "SnapshotReader", f"the reopened store reads {base!r}, not a snapshot"
    assert base.key_filter is None
    filtered = open_provider(root, key, value, tempfile.mkdtemp(dir=scratch))
    filtered.get_read_store(version).abort()
    filtered.do_maintenance()  # the snapshot under the state gets its key filter
    readers["snapshot base with its key filter"] = filtered.get_store(version)
    assert readers["snapshot base with its key filter"]._view.state.base.key_filter is not None
    for k, v in zip(hits[:100], (d[k] for k in hits[:100])):
        assert all(r.get(k) == v for r in readers.values()), k
    for label, query in (("hits", hits), ("misses", misses)):
        t = Table(f"{kind}: get {n:,} {label}, random order", n, unit="calls")
        t.add("dict: d.get(k)", measure(lambda: get_all(d.get, query), repeat))
        for where, store in readers.items():
            t.add(f"store.get(k), {where}", measure(lambda: get_all(store.get, query), repeat))
        tables.append(t)
    for store in readers.values():
        store.abort()
    provider.close()
    reopened.close()
    filtered.close()
    return tables


def main():
    args = arg_parser(__doc__.splitlines()[0], rows=200_000, repeat=7).parse_args()
    header = print_header(f"per-row store calls vs dict, {args.rows:,} keys, repeat {args.repeat}")
    scratch = tempfile.mkdtemp(prefix="statecore-bench-")
    try:
        tables = []
        for kind in SCHEMAS:
            tables += schema_tables(kind, args.rows, args.repeat, args.seed, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for t in tables:
        t.print()
    if args.json:
        write_json(args.json, header, tables)


if __name__ == "__main__":
    main()
