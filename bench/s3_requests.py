"""The S3 requests of each kind a partition's store makes per batch, counted at a local S3 server.

    python -m bench.s3_requests [--keys 1000000] [--upserts 100000] [--batches 8] [--latency-ms 0]

A store on a bucket of :class:`bench.s3_server.S3Server` (moto on 127.0.0.1) is loaded with
``--keys`` keys (version 1, one batch), then runs ``--batches`` batches of ``--upserts`` upserts of
existing keys (seeded), the race's per-partition workload: ``get_store``, ``put_batch``,
``commit``, as a task does. Run twice: without maintenance, then with a maintenance pass after
each batch (snapshots every ``min_deltas_for_snapshot`` batches, and cleanup). The server counts
every request by kind (:func:`bench.s3_server.request_kind`); printed per batch (the mean over
the steady-state batches, after the first) with the mean batch time; ``--latency-ms`` delays
every request by that much; ``--local`` runs the same on the local disk, for its batch time.
"""
import argparse
import statistics
import tempfile
import time

import numpy as np

from bench.s3_server import REQUEST_KINDS, S3Server
from statecore import StateStoreConf, StateStoreId, create_and_init_provider

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])


def run(server, keys, upserts, batches, maintain, cache_dir, local=False):
    """``(requests per steady-state batch {kind: mean}, mean batch seconds)``; ``local``: the
    store on the local disk instead (no requests)."""
    if local:
        url, options = f"{cache_dir}/state", None
    else:
        url, options = f"s3://{server.new_bucket()}/state", server.storage_options()
    conf = StateStoreConf(storage_options=options, local_cache_dir=cache_dir)
    p = create_and_init_provider(StateStoreId(url, 0, 0), KEY, VALUE, conf)
    rng = np.random.default_rng(36)
    all_keys = np.zeros(keys, KEY)
    all_keys["k"] = np.arange(keys)
    values = np.zeros(keys, VALUE)
    store = p.get_store(0)
    store.put_batch(all_keys, values)
    store.commit()
    commit_id = store.commit_id
    per_batch, seconds = [], []
    for v in range(1, batches + 1):
        batch_keys = np.zeros(upserts, KEY)
        batch_keys["k"] = rng.integers(0, keys, upserts)
        batch_values = np.zeros(upserts, VALUE)
        batch_values["count"] = v
        server.counter.reset()
        start = time.perf_counter()
        store = p.get_store(v, commit_id)  # the attempt a driver records, as the operator opens
        store.put_batch(batch_keys, batch_values)
        store.commit()
        commit_id = store.commit_id
        if maintain:
            p.do_maintenance()
        seconds.append(time.perf_counter() - start)
        per_batch.append(server.counter.snapshot())
    p.close()
    steady = per_batch[1:] or per_batch
    means = {kind: statistics.mean(c.get(kind, 0) for c in steady) for kind in REQUEST_KINDS}
    return means, statistics.mean(seconds[1:] or seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--upserts", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--local", action="store_true", help="the store on the local disk (batch times only)")
    args = parser.parse_args(argv)
    server = S3Server().start()
    try:
        server.counter.latency_s = args.latency_ms / 1000
        print(f"keys {args.keys}, upserts {args.upserts} a batch, {args.batches} batches, "
              f"{args.latency_ms:g} ms a request; requests per steady-state batch:")
        print(f"  {'maintenance':<12}" + "".join(f"{k:>8}" for k in REQUEST_KINDS) + f"{'batch s':>10}")
        for maintain in (False, True):
            with tempfile.TemporaryDirectory(prefix="statecore-s3-bench-") as cache_dir:
                means, secs = run(server, args.keys, args.upserts, args.batches, maintain, cache_dir, args.local)
            print(f"  {'with' if maintain else 'without':<12}" + "".join(f"{means[k]:>8.2f}" for k in REQUEST_KINDS)
                  + f"{secs:>10.3f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
