"""``statecore verify`` of a whole checkpoint against reading its files' bytes.

    python -m bench.bench_verify --keys 10000000 --repeat 5 [--dir DIR] [--json PATH]

The checkpoint: 4 partitions of an operator, int64 keys and two int64 values; each partition
commits all its keys (version 1), maintenance writes a snapshot of it, then three versions
each update 5% of the keys (deltas 2..4). The anchor reads every file of the checkpoint with
plain ``readinto`` calls (the bytes verify must look at, and nothing else); ``verify`` checks
every checksum (decompressing the deltas, and the snapshot's blocks; ``--deep`` also looks
every snapshot row up in its index) and every version's lineage. Both run warm (the files
in the page cache), in this process, one after the other.
"""
import argparse
import os
import shutil
import tempfile

import numpy as np

from bench._common import Table, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.checkpoint_scan import scan_checkpoint
from statecore.checkpoint_verify import verify_checkpoint

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("total", "<i8")])
PARTITIONS = 4
UPDATES = 3  # deltas after the snapshot
UPDATE_SHARE = 0.05
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: i -> i * GOLDEN mod 2**64 is a bijection
CHUNK = 1 << 20


def keys_of(numbers):
    keys = np.empty(len(numbers), KEY)
    with np.errstate(over="ignore"):
        keys["k"] = (numbers.astype(np.uint64) * GOLDEN).view(np.int64)
    return keys


def values_of(numbers, version):
    values = np.empty(len(numbers), VALUE)
    values["count"] = version
    values["total"] = numbers * 3 + version
    return values


def build(root, n_keys, seed):
    """The checkpoint under ``root``; returns its files' paths."""
    conf = StateStoreConf(min_deltas_for_snapshot=0, min_versions_to_retain=100)
    rng = np.random.default_rng(seed)
    for p in range(PARTITIONS):
        numbers = np.arange(p, n_keys, PARTITIONS, dtype=np.int64)
        provider = create_and_init_provider(StateStoreId(root, 0, p), KEY, VALUE, conf)
        store = provider.get_store(0)
        for start in range(0, len(numbers), CHUNK):
            part = numbers[start:start + CHUNK]
            store.put_batch(keys_of(part), values_of(part, 1))
        store.commit()
        provider.do_maintenance()  # the snapshot of version 1
        for v in range(2, 2 + UPDATES):
            store = provider.get_store(v - 1)
            part = rng.choice(numbers, int(len(numbers) * UPDATE_SHARE), replace=False)
            store.put_batch(keys_of(part), values_of(part, v))
            store.commit()
        provider.close()
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def read_bytes(paths, buf):
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description="statecore verify vs reading the checkpoint's bytes")
    p.add_argument("--keys", type=int, default=10_000_000, help="keys in the checkpoint (default %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    header = print_header(f"verify a checkpoint of {args.keys:,} keys ({PARTITIONS} partitions, a snapshot and "
                          f"{UPDATES + 1} deltas each) against reading its files")
    work = tempfile.mkdtemp(prefix="bench_verify_", dir=args.dir)
    try:
        root = os.path.join(work, "state")
        paths = build(root, args.keys, args.seed)
        size = sum(os.path.getsize(path) for path in paths)
        print(f"# {len(paths)} files, {size / 2**20:.1f} MiB")
        buf = bytearray(1 << 20)
        assert read_bytes(paths, buf) == size  # warm the page cache

        def verify(deep=False):
            report = verify_checkpoint(scan_checkpoint(root), deep=deep)
            assert report.sound, report.problems
            assert report.files == len(paths)

        verify()
        table = Table(f"verify {args.keys:,} keys, {size / 2**20:.0f} MiB", size, unit="B")
        table.add("read the files' bytes", measure(lambda: read_bytes(paths, buf), args.repeat))
        table.add("statecore verify", measure(verify, args.repeat))
        table.add("statecore verify --deep", measure(lambda: verify(deep=True), args.repeat))
        table.print()
        summary = table.summary()
        ratio = summary[1]["median_ms"] / summary[0]["median_ms"]
        print(f"\nverify / read: {ratio:.2f}x (target: within 2x)")
        if args.json:
            write_json(args.json, header, [table], extra={"keys": args.keys, "bytes": size, "files": len(paths),
                                                          "verify_over_read": ratio})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
