"""Two Python workers taking a store's batches in turn, as Spark's workers of one executor do:
the open of each batch when the worker holds an older version, against the worker that holds
the newest one and against a load from files.

    python -m bench.bench_workers [--keys 500000] [--batch-rows 100000] [--batches 20] [--json PATH]

Each mode runs the same batches (``--batch-rows`` random upserts of ``--keys`` keys, after a
first version holding every key) on a checkpoint of its own, a maintenance pass (spill,
compaction, snapshot, cleanup) after every commit, as a worker's maintenance thread runs
one, and times ``get_store`` (the open), the batch's ``put_batch`` and ``commit`` separately:

- ``one worker``: one provider takes every batch (each open finds the version in memory);
- ``two workers, published images``: two providers alternate; each opens the version the
  other committed by mapping the whole image the other's maintenance published for it
  (when its spill was whole), else from the version it holds by the deltas since;
- ``two workers, roll forward``: the same with no image published: always by the deltas;
- ``load from files``: a new provider per batch (snapshot + deltas since), which is what a
  worker holding an older version did before it could roll forward.
"""
import shutil
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import numpy as np

from bench._common import Table, arg_parser, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.provider import FileStateStoreProvider

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
CONF = StateStoreConf()


def batches(rng, key_space, rows, n):
    out = []
    for _ in range(n):
        keys = np.zeros(rows, KEY)
        keys["k"] = rng.choice(key_space, rows, replace=False)
        values = np.zeros(rows, VALUE)
        values["count"] = rng.integers(0, 1000, rows)
        values["sum"] = rng.random(rows)
        out.append((keys, values))
    return out


def run(mode, root, first, work):
    """Per-batch (open, put, commit) seconds of ``work`` in ``mode``; the final contents'
    checksum (every mode must end with the same state)."""
    def provider():
        return create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, CONF)

    workers = [provider(), provider()]
    store = workers[0].get_store(0)
    store.put_batch(*first)
    store.commit()
    times = []
    for i, (keys, values) in enumerate(work):
        if mode == "one worker":
            p = workers[0]
        elif mode.startswith("two workers"):
            p = workers[(i + 1) % 2]
        else:
            p = provider()
        t0 = time.perf_counter()
        store = p.get_store(i + 1)
        t1 = time.perf_counter()
        store.put_batch(keys, values)
        t2 = time.perf_counter()
        store.commit()
        t3 = time.perf_counter()
        times.append((t1 - t0, t2 - t1, t3 - t2))
        p.do_maintenance()
    final = provider().get_read_store(len(work) + 1)
    total = 0.0
    for keys, values in final.iter_batches():
        total += float(values["sum"].sum()) + float(keys["k"].sum())
    return np.array(times), total


def main():
    p = arg_parser(__doc__.splitlines()[0], rows=0, repeat=1)
    p.add_argument("--keys", type=int, default=500_000)
    p.add_argument("--batch-rows", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=20)
    args = p.parse_args()
    header = print_header(f"two workers on one store: {args.keys:,} keys, {args.batches} batches of "
                          f"{args.batch_rows:,} upserts")
    rng = np.random.default_rng(args.seed)
    first_keys = np.zeros(args.keys, KEY)
    first_keys["k"] = np.arange(args.keys)
    first = (first_keys, np.zeros(args.keys, VALUE))
    work = batches(rng, args.keys, args.batch_rows, args.batches)
    scratch = tempfile.mkdtemp(prefix="statecore-bench-workers-")
    results, sums = {}, set()
    try:
        for i, mode in enumerate(["one worker", "two workers, published images", "two workers, roll forward",
                                  "load from files"]):
            unpublished = mock.patch.object(FileStateStoreProvider, "publish_image", lambda *args: None)
            with unpublished if mode in ("two workers, roll forward", "load from files") else nullcontext():
                times, total = run(mode, f"{scratch}/{i}", first, work)
            results[mode] = times
            sums.add(round(total, 3))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert len(sums) == 1, f"the modes ended with different states: {sums}"
    tables = []
    for column, title in enumerate(["get_store (the open)", "put_batch", "commit"]):
        t = Table(f"{title}, per batch (batches 2..)", 1, unit="batches")
        for mode, times in results.items():
            t.add(mode, list(times[1:, column]))
        tables.append(t)
    for t in tables:
        t.print()
    if args.json:
        write_json(args.json, header, tables)


if __name__ == "__main__":
    main()
