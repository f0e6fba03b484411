"""Expiring state by time: the ExpiryIndex against a scan of the state, in the same run.

    python -m bench.bench_expiry [--rows 10000000] [--fractions 0.01,0.05,0.2] [--repeat 3] [--json PATH]

A store of ``--rows`` keys, each with an expiry time (its value, as a deduplication or TTL
state keeps it), spread uniformly over a day, plus an ExpiryIndex of the same entries,
committed once. For each fraction f, one batch expires the keys whose time is in the first
f of the day: through the index (``pop_until``, then one batch lookup to check the entries
against the state and one batch remove), and the way Spark's own operators do it (iterate
every row of the state, compare its expiry, remove the expired ones; here with the store's
batch iterator, no Python per row). Each run opens the committed version and aborts, so
every run starts from the same state. The time of the index should grow with f; the scan's
stays that of the whole state.
"""
import shutil
import tempfile

import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.expiry import ExpiryIndex

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("expires", "<i8")])
DAY_US = 86_400 * 1_000_000


def build(root, rows, seed):
    """The state and its index at version 1; returns the providers and the expiry times."""
    rng = np.random.default_rng(seed)
    keys = np.zeros(rows, KEY)
    keys["k"] = rng.permutation(rows) * 11
    values = np.zeros(rows, VALUE)
    values["expires"] = rng.integers(0, DAY_US, rows)
    schemas = {"state": (KEY, VALUE), **ExpiryIndex.schemas(KEY)}
    conf = StateStoreConf(min_deltas_for_snapshot=1)
    providers = {name: create_and_init_provider(StateStoreId(root, 0, 0, store_name=name), key, value, conf)
                 for name, (key, value) in schemas.items()}
    stores = {name: p.get_store(0) for name, p in providers.items()}
    stores["state"].put_batch(keys, values)
    ExpiryIndex(stores["heads"], stores["entries"], KEY).add(values["expires"], keys)
    for store in stores.values():
        store.commit()
    for p in providers.values():  # snapshot version 1, then reopen from files: a state as a restart finds it
        p.do_maintenance()
        p.close()
    providers = {name: create_and_init_provider(StateStoreId(root, 0, 0, store_name=name), key, value, conf)
                 for name, (key, value) in schemas.items()}
    return providers, np.sort(values["expires"])


def expire_by_index(providers, limit):
    stores = {name: p.get_store(1) for name, p in providers.items()}
    times, keys = ExpiryIndex(stores["heads"], stores["entries"], KEY).pop_until(limit)
    values, found = stores["state"].get_batch(keys)
    stores["state"].remove_batch(keys[found & (values["expires"] == times)])
    for store in stores.values():
        store.abort()
    return len(keys)


def expire_by_scan(providers, limit):
    store = providers["state"].get_store(1)
    removed = 0
    for keys, values in store.iter_batches():
        expired = values["expires"] <= limit
        store.remove_batch(keys[expired])
        removed += int(expired.sum())
    store.abort()
    return removed


def main(argv=None):
    p = arg_parser(__doc__.splitlines()[0], rows=10_000_000, repeat=3)
    p.add_argument("--fractions", default="0.01,0.05,0.2")
    args = p.parse_args(argv)
    header = print_header(f"expiry: {args.rows:,} keys, index vs scan")
    root = tempfile.mkdtemp(prefix="statecore-bench-expiry-")
    try:
        providers, times = build(root, args.rows, args.seed)
        tables = []
        for fraction in (float(f) for f in args.fractions.split(",")):
            limit = int(times[int(len(times) * fraction) - 1])
            expected = int((times <= limit).sum())
            assert expire_by_index(providers, limit) == expected == expire_by_scan(providers, limit)
            table = Table(f"expire {fraction:.0%} ({expected:,} of {args.rows:,} keys)", expected, unit="rows")
            table.add("scan the state (Spark's operators)", measure(lambda: expire_by_scan(providers, limit),
                                                                    args.repeat))
            table.add("statecore ExpiryIndex", measure(lambda: expire_by_index(providers, limit), args.repeat))
            table.print()
            tables.append(table)
        for prov in providers.values():
            prov.close()
        if args.json:
            write_json(args.json, header, tables)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
