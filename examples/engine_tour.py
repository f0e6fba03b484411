"""A tour of the compiled engine, without a store or Spark: ``python examples/engine_tour.py
[--keys N] [--dir PATH]``.

Builds the state of a running aggregation (count and sum per key) in a RowTable, writes
the batch's updates as a delta and the full state as a snapshot (each under a temporary
name, then renamed into place), reopens the snapshot in O(1) and probes it in place,
replays the delta onto an empty table, and checks that every path gives the same state:
the building blocks the versioned store (``statecore.provider``) is made of.
"""
import argparse
import os
import tempfile
import time

import numpy as np

from statecore import DeltaWriter, RowTable, SnapshotReader, apply_delta, write_snapshot

KEY = np.dtype([("user_id", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("total", "<f8")])


def write_atomically(path, write):
    """Write through ``write(fileobj)`` under a temporary name, fsync, then rename into place."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct keys (default %(default)s)")
    parser.add_argument("--dir", help="where to write the files (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        run(args.keys, args.dir or scratch)


def run(n_keys, directory):
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(42)
    events = np.zeros(2 * n_keys, KEY)
    events["user_id"] = rng.integers(0, n_keys, 2 * n_keys) * 7919
    amounts = rng.random(2 * n_keys) * 100

    # One micro-batch: aggregate inside the batch with numpy, then merge into the state.
    t0 = time.perf_counter()
    unique_ids, inverse = np.unique(events["user_id"], return_inverse=True)
    keys = unique_ids.astype(KEY)
    batch = np.zeros(len(keys), VALUE)
    batch["count"] = np.bincount(inverse)
    batch["total"] = np.bincount(inverse, weights=amounts)
    state = RowTable(KEY, VALUE)
    old, found = state.get_batch(keys)
    batch["count"] += np.where(found, old["count"], 0)
    batch["total"] += np.where(found, old["total"], 0.0)
    state.put_batch(keys, batch)
    t_merge = time.perf_counter() - t0
    print(f"merged {len(events):,} events into {len(state):,} keys in {t_merge * 1e3:.0f} ms "
          f"(table memory {state.sizeof() / 2**20:.1f} MiB)")

    delta_path = os.path.join(directory, "1.delta")
    snapshot_path = os.path.join(directory, "1.snapshot")
    key_rows = state.key_schema.rows(keys)
    value_rows = state.value_schema.rows(batch)

    def write_delta(f):
        writer = DeltaWriter(f, KEY, VALUE, store_version=1)
        writer.put_rows(key_rows, value_rows)
        writer.finish()

    t0 = time.perf_counter()
    delta_bytes = write_atomically(delta_path, write_delta)
    t_delta = time.perf_counter() - t0
    t0 = time.perf_counter()
    snapshot_bytes = write_atomically(snapshot_path, lambda f: write_snapshot(f, state, store_version=1))
    t_snapshot = time.perf_counter() - t0
    print(f"wrote {os.path.basename(delta_path)} ({delta_bytes / 2**20:.1f} MiB) in {t_delta * 1e3:.0f} ms, "
          f"{os.path.basename(snapshot_path)} ({snapshot_bytes / 2**20:.1f} MiB) in {t_snapshot * 1e3:.0f} ms")

    t0 = time.perf_counter()
    reader = SnapshotReader(snapshot_path, KEY, VALUE)
    first = reader.get(int(keys["user_id"][0]))
    t_open = time.perf_counter() - t0
    print(f"opened the snapshot and looked up one key in {t_open * 1e6:.0f} us: "
          f"user {keys['user_id'][0]} -> {first}")

    t0 = time.perf_counter()
    snap_values, snap_found = reader.get_batch(keys)
    t_get = time.perf_counter() - t0
    replayed = RowTable(KEY, VALUE)
    t0 = time.perf_counter()
    with open(delta_path, "rb") as f:
        apply_delta(f, replayed, path=delta_path)
    t_replay = time.perf_counter() - t0
    replay_values, replay_found = replayed.get_batch(keys)
    print(f"probed all {len(keys):,} keys in the mapped snapshot in {t_get * 1e3:.0f} ms; "
          f"replayed the delta in {t_replay * 1e3:.0f} ms")

    ok = (snap_found.all() and replay_found.all() and np.array_equal(snap_values, batch)
          and np.array_equal(replay_values, batch) and len(reader) == len(replayed) == len(state))
    reader.close()
    print("state identical in the table, the snapshot and the replayed delta:", "yes" if ok else "NO")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
