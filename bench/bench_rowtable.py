"""RowTable against the fastest plain-dict code for the same numpy input.

    python -m bench.bench_rowtable --rows 1000000 --repeat 7 [--json PATH]

State-like rows: int64 keys drawn without replacement from 4x their number (random
order), values (count int64, sum float64). The dict rows include the conversion from and
to numpy that a dict-based store has to pay for the same batch in and the same arrays out.
Then RowTable alone with float64 keys (random normals), which a key schema checks for
-0.0 and NaNs to normalize on the way in.
"""
import threading

import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import RowTable

KEY = np.dtype([("k", "<i8")])
FLOAT_KEY = np.dtype([("x", "<f8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    keys = np.zeros(n, KEY)
    keys["k"] = rng.permutation(4 * n)[:n]
    values = np.zeros(n, VALUE)
    values["count"] = rng.integers(0, 1000, n)
    values["sum"] = rng.random(n) * 100
    hits = keys[rng.integers(0, n, n)]
    misses = np.zeros(n, KEY)
    misses["k"] = -1 - rng.permutation(4 * n)[:n]
    return keys, values, hits, misses


def dict_put(keys, values):
    return dict(zip(keys["k"].tolist(), zip(values["count"].tolist(), values["sum"].tolist())))


def dict_get_batch(d, keys):
    got = list(map(d.get, keys["k"].tolist()))
    found = np.fromiter((v is not None for v in got), bool, len(got))
    count = np.fromiter((v[0] if v is not None else 0 for v in got), np.int64, len(got))
    total = np.fromiter((v[1] if v is not None else 0.0 for v in got), np.float64, len(got))
    return count, total, found


def float_key_tables(n, repeat, seed, values):
    """put_batch, get_batch and scalar get with float64 keys (none of them -0.0 or NaN)."""
    rng = np.random.default_rng(seed + 1)
    keys = np.zeros(n, FLOAT_KEY)
    keys["x"] = rng.standard_normal(n)
    hits = keys[rng.integers(0, n, n)]
    holder, tables = {}, []
    t = Table(f"float64 keys: put / get {n:,}", n)
    t.add("RowTable.put_batch (presized)",
          measure(lambda: holder["t"].put_batch(keys, values), repeat,
                  setup=lambda: holder.__setitem__("t", RowTable(FLOAT_KEY, VALUE, capacity=n))))
    table = RowTable(FLOAT_KEY, VALUE)
    table.put_batch(keys, values)
    t.add("RowTable.get_batch (hits, random order)", measure(lambda: table.get_batch(hits), repeat))
    tables.append(t)
    m = min(n, 200_000)
    scalar_keys = hits["x"][:m].tolist()
    t = Table(f"float64 keys: scalar get, {m:,} calls", m, unit="calls")
    t.add("RowTable.get (-> tuple)", measure(lambda: [table.get(k) for k in scalar_keys], repeat))
    tuple_keys = [(k,) for k in scalar_keys]
    t.add("RowTable.get((x,)) (-> tuple)", measure(lambda: [table.get(k) for k in tuple_keys], repeat))
    tables.append(t)
    return tables


def main():
    args = arg_parser(__doc__.splitlines()[0]).parse_args()
    n, repeat = args.rows, args.repeat
    header = print_header(f"RowTable vs dict, {n:,} rows, repeat {repeat}")
    keys, values, hits, misses = make_data(n, args.seed)
    tables = []

    t = Table(f"put {n:,} new keys", n)
    holder = {}
    t.add("dict(zip(keys, zip(count, sum)))", measure(lambda: dict_put(keys, values), repeat))
    t.add("RowTable.put_batch (empty table)",
          measure(lambda: holder["t"].put_batch(keys, values), repeat,
                  setup=lambda: holder.__setitem__("t", RowTable(KEY, VALUE))))
    t.add("RowTable.put_batch (presized)",
          measure(lambda: holder["t"].put_batch(keys, values), repeat,
                  setup=lambda: holder.__setitem__("t", RowTable(KEY, VALUE, capacity=n))))
    tables.append(t)

    d = dict_put(keys, values)
    table = RowTable(KEY, VALUE)
    table.put_batch(keys, values)

    t = Table(f"overwrite {n:,} existing keys", n)
    t.add("dict.update(zip(keys, zip(count, sum)))",
          measure(lambda: d.update(zip(keys["k"].tolist(), zip(values["count"].tolist(),
                                                              values["sum"].tolist()))), repeat))
    t.add("RowTable.put_batch", measure(lambda: table.put_batch(keys, values), repeat))
    tables.append(t)

    for label, query in (("hits", hits), ("misses", misses)):
        t = Table(f"get {n:,} {label} (random order)", n)
        t.add("dict.get -> numpy arrays", measure(lambda: dict_get_batch(d, query), repeat))
        t.add("list(map(dict.get, keys)) only", measure(lambda: list(map(d.get, query["k"].tolist())), repeat))
        t.add("RowTable.get_batch", measure(lambda: table.get_batch(query), repeat))
        krows = query.view(np.uint8).reshape(n, 8)
        out = np.empty((n, 16), np.uint8)
        found = np.empty(n, np.uint8)
        t.add("RowTable.get_rows (preallocated out)", measure(lambda: table.get_rows(krows, out, found), repeat))
        tables.append(t)

    m = min(n, 200_000)
    scalar_keys = hits["k"][:m].tolist()
    t = Table(f"scalar get, {m:,} calls", m, unit="calls")
    t.add("dict.get", measure(lambda: [d.get(k) for k in scalar_keys], repeat))
    t.add("RowTable.get (-> tuple)", measure(lambda: [table.get(k) for k in scalar_keys], repeat))
    tuple_keys = [(k,) for k in scalar_keys]
    t.add("RowTable.get((k,)) (-> tuple)", measure(lambda: [table.get(k) for k in tuple_keys], repeat))
    raw = [k.to_bytes(8, "little", signed=True) for k in scalar_keys]
    t.add("RowTable.get_row (bytes -> bytes)", measure(lambda: [table.get_row(k) for k in raw], repeat))
    tables.append(t)

    # The GIL is released inside batch calls: two threads reading halves of the batch
    # should take about half the time of one thread doing all of it.
    halves = [hits[: n // 2], hits[n // 2:]]

    def two_threads():
        threads = [threading.Thread(target=table.get_batch, args=(h,)) for h in halves]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    t = Table(f"get_batch {n:,} hits: GIL release", n)
    t.add("1 thread", measure(lambda: table.get_batch(hits), repeat))
    t.add("2 threads, half each", measure(two_threads, repeat))
    tables.append(t)

    tables += float_key_tables(n, repeat, args.seed, values)

    for t in tables:
        t.print()
    stats = table.probe_stats()
    print(f"\nindex: {stats['slots']:,} slots for {stats['keys']:,} keys, mean displacement "
          f"{stats['mean']:.2f}, max {stats['max']}; table memory {table.sizeof() / 2**20:.1f} MiB "
          f"for {n * 24 / 2**20:.1f} MiB of raw rows")
    if args.json:
        write_json(args.json, header, tables, {"probe_stats": stats, "sizeof": table.sizeof()})


if __name__ == "__main__":
    main()
