"""The versioned store on local files, against what a Python user would do instead (pickle a
dict of the state each batch), in the same run.

    python -m bench.bench_store --rows 1000000 --repeat 5 [--big-rows 10000000] [--json PATH]

1. commit of ``--rows`` updated rows vs pickle + lz4 + fsync of the equivalent dict;
2. reopening a ``--big-rows`` state from a snapshot plus 5 deltas and one lookup vs
   ``pickle.load`` of the dict;
3. a micro-batch loop of 100 batches (get_store, 100k upserts through the batch API,
   commit) over 1M keys with the maintenance thread running;
4. memory: the provider's tables and the process's peak RSS against the raw row bytes, in
   that loop and in the same loop over 10k and 100k keys (batches of a tenth of the keys).
"""
import gc
import os
import pickle
import resource
import shutil
import tempfile
import time
import uuid

import lz4.frame
import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, StateStoreProviderId, create_and_init_provider, registry

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
ROW_BYTES = KEY.itemsize + VALUE.itemsize


def batch(rng, n, key_space):
    keys = np.zeros(n, KEY)
    keys["k"] = rng.choice(key_space, n, replace=False) if n <= key_space else rng.integers(0, key_space, n)
    values = np.zeros(n, VALUE)
    values["count"] = rng.integers(0, 1000, n)
    values["sum"] = rng.random(n)
    return keys, values


def fill(provider, rows, rng):
    keys = np.zeros(rows, KEY)
    keys["k"] = np.arange(rows) * 7
    values = np.zeros(rows, VALUE)
    values["count"] = 1
    store = provider.get_store(0)
    store.put_batch(keys, values)
    store.commit()
    return keys


def as_dict(keys, values):
    return dict(zip(keys["k"].tolist(), zip(values["count"].tolist(), values["sum"].tolist())))


def pickle_lz4_fsync(d, path):
    with open(path, "wb") as f:
        f.write(lz4.frame.compress(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL)))
        f.flush()
        os.fsync(f.fileno())


def micro_batch_loop(root, rng, key_space, batch_rows, n_batches):
    """get_store + put_batch + commit of ``n_batches`` batches of ``batch_rows`` upserts over
    ``key_space`` keys, through the registry with its maintenance thread (1 s period); the
    provider's table bytes over the raw rows after each commit, untimed."""
    registry.stop()
    conf = StateStoreConf(maintenance_interval_s=1.0)
    pid = StateStoreProviderId(StateStoreId(root, 0, 0), uuid.uuid4())
    batches = [batch(rng, batch_rows, key_space) for _ in range(n_batches)]
    per_batch, memory, sampling = [], [], 0.0
    t0 = time.perf_counter()
    for v, (k, val) in enumerate(batches):
        b0 = time.perf_counter()
        s = registry.get(pid, KEY, VALUE, v, conf)
        s.put_batch(k, val)
        s.commit()
        b1 = time.perf_counter()
        per_batch.append(b1 - b0)
        m = s.metrics
        memory.append(m.memory_used_bytes / max(m.num_keys * ROW_BYTES, 1))
        sampling += time.perf_counter() - b1
    elapsed = time.perf_counter() - t0 - sampling
    final = registry.get_read_only(pid, KEY, VALUE, n_batches, conf)
    out = {"elapsed": elapsed, "per_batch": per_batch, "memory": memory, "batches": batches,
           "live": final.metrics.num_keys, "provider_bytes": final.metrics.memory_used_bytes,
           "snapshots": [f for f in os.listdir(f"{root}/0/0") if f.endswith(".snapshot")]}
    registry.stop()
    return out


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = arg_parser(__doc__.splitlines()[0], rows=1_000_000, repeat=5)
    p.add_argument("--big-rows", type=int, default=10_000_000, help="rows of the reopened state")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--batch-rows", type=int, default=100_000)
    args = p.parse_args()
    header = print_header(f"versioned store on local files; rows {args.rows:,}, big {args.big_rows:,}")
    rng = np.random.default_rng(args.seed)
    scratch = tempfile.mkdtemp(prefix="statecore-bench-")
    tables, extra = [], {}
    try:
        # 3. the micro-batch loop with maintenance running (first: a fresh process heap)
        rss_before = rss_mib()
        loop_run = micro_batch_loop(f"{scratch}/loop", rng, 1_000_000, args.batch_rows, args.batches)
        elapsed, per_batch, memory_samples = loop_run["elapsed"], loop_run["per_batch"], loop_run["memory"]
        batches, live, provider_bytes = loop_run["batches"], loop_run["live"], loop_run["provider_bytes"]
        snapshots = loop_run["snapshots"]
        # smaller states, each batch a tenth of the keys: the memory only
        small = {n: micro_batch_loop(f"{scratch}/small{n}", rng, n, n // 10, args.batches)
                 for n in (10_000, 100_000)}
        upserts = args.batches * args.batch_rows
        # the same batches on a provider no thread maintains (its commits spill past the hard limit)
        bare = create_and_init_provider(StateStoreId(f"{scratch}/bare", 0, 0), KEY, VALUE, StateStoreConf())
        t1 = time.perf_counter()
        for v, (k, val) in enumerate(batches):
            s = bare.get_store(v)
            s.put_batch(k, val)
            s.commit()
        bare_elapsed = time.perf_counter() - t1
        del bare
        t = Table(f"micro-batch loop: {args.batches} x {args.batch_rows:,} upserts", upserts, unit="upserts")
        t.add("get_store + put_batch + commit, maintenance on", [elapsed])
        t.add("the same, no maintenance thread (commits spill)", [bare_elapsed])
        tables.append(t)
        skip = min(10, len(memory_samples) // 2)  # the first batches, while the state still grows
        extra["loop"] = {
            "upserts_per_s": upserts / elapsed, "batch_ms_median": float(np.median(per_batch) * 1e3),
            "batch_ms_p99": float(np.percentile(per_batch, 99) * 1e3), "live_keys": live,
            "raw_row_bytes": live * ROW_BYTES, "provider_table_bytes": provider_bytes,
            "snapshots_written": sorted(snapshots), "peak_rss_mib_before": rss_before,
            "peak_rss_mib_after": rss_mib(),
            "memory_ratio_from_batch": skip + 1,
            "memory_ratio_median": float(np.median(memory_samples[skip:])),
            "memory_ratio_max": float(np.max(memory_samples[skip:])),
            "memory_at": {str(n): {"batch_rows": n // 10, "median": float(np.median(r["memory"][skip:])),
                                   "max": float(np.max(r["memory"][skip:])), "live_keys": r["live"]}
                          for n, r in small.items()},
        }
        # 1. commit of N updated rows
        n = args.rows
        provider = create_and_init_provider(StateStoreId(f"{scratch}/commit", 0, 0), KEY, VALUE,
                                            StateStoreConf())
        keys = fill(provider, n, rng)
        values = np.zeros(n, VALUE)
        values["count"] = 2
        version = [1]
        stores = []

        def prepare():
            s = provider.get_store(version[0])
            s.put_batch(keys, values)
            stores.append(s)

        def do_commit():
            version[0] = stores.pop().commit()

        d = as_dict(keys, values)
        t = Table(f"commit {n:,} updated rows (durable)", n)
        t.add("pickle + lz4 + fsync of the dict", measure(lambda: pickle_lz4_fsync(d, f"{scratch}/dict.pkl.lz4"),
                                                           args.repeat))
        t.add("StateStore.commit (delta + fsync + merge)", measure(do_commit, args.repeat, setup=prepare))
        tables.append(t)
        del d, provider
        gc.collect()

        # 2. reopen a big state from a snapshot + 5 deltas, one lookup
        big = args.big_rows
        root = f"{scratch}/reopen"
        conf = StateStoreConf(min_deltas_for_snapshot=0)
        provider = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
        big_keys = fill(provider, big, rng)
        provider.do_maintenance()  # 1.snapshot
        for v in range(1, 6):
            k, val = batch(rng, 100_000, big)
            k["k"] *= 7
            s = provider.get_store(v)
            s.put_batch(k, val)
            s.commit()
        files = sorted(os.listdir(f"{root}/0/0"))
        del provider
        gc.collect()
        probe = int(big_keys["k"][big // 2])

        def reopen():
            fresh = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
            assert fresh.get_read_store(6).get(probe) is not None

        pk_keys = big_keys.copy()
        pk_vals = np.zeros(big, VALUE)
        pk_vals["count"] = 1
        with open(f"{scratch}/big.pkl", "wb") as f:
            pickle.dump(as_dict(pk_keys, pk_vals), f, protocol=pickle.HIGHEST_PROTOCOL)
        del pk_keys, pk_vals
        gc.collect()

        def unpickle():
            with open(f"{scratch}/big.pkl", "rb") as f:
                assert pickle.load(f).get(probe) is not None

        t = Table(f"reopen {big:,} keys (snapshot + 5 deltas of 100k) + 1 lookup", 1, unit="opens")
        t.add("pickle.load(dict) + lookup", measure(unpickle, max(2, args.repeat // 2)))
        t.add("new provider + get_read_store(6) + get", measure(reopen, args.repeat))
        tables.append(t)
        extra["reopen_files"] = files
        os.remove(f"{scratch}/big.pkl")
        shutil.rmtree(root)

    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    for t in tables:
        t.print()
    loop = extra["loop"]
    print(f"\nloop: {loop['upserts_per_s'] / 1e6:.2f} M upserts/s; batch median {loop['batch_ms_median']:.1f} ms, "
          f"p99 {loop['batch_ms_p99']:.1f} ms; snapshots {loop['snapshots_written']}")
    print(f"memory: {loop['live_keys']:,} live keys = {loop['raw_row_bytes'] / 2**20:.1f} MiB of raw rows; "
          f"provider tables after each commit (batches {loop['memory_ratio_from_batch']}-{args.batches}; snapshot pages "
          f"not counted): median "
          f"{loop['memory_ratio_median']:.2f}x, max {loop['memory_ratio_max']:.2f}x of the raw rows; at the end "
          f"{loop['provider_table_bytes'] / 2**20:.1f} MiB; peak RSS {loop['peak_rss_mib_before']:.0f} -> "
          f"{loop['peak_rss_mib_after']:.0f} MiB")
    for n, r in loop["memory_at"].items():
        print(f"memory at {int(n):,} keys ({r['batch_rows']:,}-row batches): provider tables after each commit "
              f"(batches {loop['memory_ratio_from_batch']}-{args.batches}): median {r['median']:.2f}x, "
              f"max {r['max']:.2f}x of the raw rows")
    print(f"reopen files: {extra['reopen_files']}")
    if args.json:
        write_json(args.json, header, tables, extra)


if __name__ == "__main__":
    main()
