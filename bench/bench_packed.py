"""Packed snapshots (compression "lz4") against images ("none") and raw lz4 of the same bytes:
file sizes, write, open, lookups; then a store's checkpoint bytes with either setting.

    python -m bench.bench_packed --sizes 100000,1000000,10000000 --repeat 5 [--json PATH]
    python -m bench.bench_packed --sizes 0 --checkpoint-keys 500000 --batches 10   # checkpoint only

Rows are the race's statecore partition: an int64 key, a (count int64, sum int64) value.
Per size: the image written by SnapshotWriter, the same image packed while written
(SnapshotWriter into PackWriter), and the anchor, lz4 of the image's bytes in memory in the
same 256 KiB blocks (no checksums, no file); then the open (+ one lookup) of the image mapped
in place, of the packed file the first time (unpacked into the image cache, fsynced, mapped)
and again (the cached image), beside lz4 decompression of the same bytes in memory; then
get_batch of 100k keys on the image and on the packed file's image (the same reader work).
Files go to a temporary directory (``--dir``), warm: writes are timed without fsync, except
the image cache's own fsync, which is part of a first open.

The checkpoint part runs a provider loop like the race's statecore partition: ``--batches``
batches of ``--updates`` upserts (count + 1, sum + value) drawn over ``--checkpoint-keys``
keys, maintenance after each commit, once per compression, and reports the store
directory's bytes at the end (deltas, snapshots) and the time per batch.
"""
import os
import shutil
import tempfile
import time

import lz4.block
import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore._snapshot import DEFAULT_PACK_BLOCK_SIZE, PackWriter, SnapshotReader, SnapshotWriter
from statecore.files import StoreFiles
from statecore.snapshot_files import open_snapshot

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<i8")])
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: i -> i * GOLDEN mod 2**64 is a bijection
CHUNK = 1 << 20
LOOKUPS = 100_000


def keys_for(start, stop):
    with np.errstate(over="ignore"):
        return (np.arange(start, stop, dtype=np.uint64) * GOLDEN).view(np.int64)


def rows(start, stop, seed):
    """Rows [start, stop) as (m, 24) uint8: spread keys, counts 1..30, sums of counts * 0..999."""
    rng = np.random.default_rng([seed, start])
    out = np.empty(stop - start, dtype=[("k", "<i8"), ("count", "<i8"), ("sum", "<i8")])
    out["k"] = keys_for(start, stop)
    out["count"] = rng.integers(1, 31, stop - start)
    out["sum"] = out["count"] * rng.integers(0, 1000, stop - start)
    return out.view(np.uint8).reshape(-1, 24)


def write_image(fileobj, n, seed):
    writer = SnapshotWriter(fileobj, KEY, VALUE, n, 1, lineage=b"B" * 16)
    for start in range(0, n, CHUNK):
        writer.write_rows(rows(start, min(n, start + CHUNK), seed))
    writer.finish()


def lz4_blocks(data):
    view = memoryview(data)
    return [lz4.block.compress(view[i:i + DEFAULT_PACK_BLOCK_SIZE], store_size=False)
            for i in range(0, len(view), DEFAULT_PACK_BLOCK_SIZE)]


def sizes_part(n, repeat, seed, workdir, tables, extra):
    image_name, packed_name = "1_" + "ab" * 8 + ".snapshot", "2_" + "ab" * 8 + ".snapshot"
    store = os.path.join(workdir, f"store-{n}")
    cache = os.path.join(workdir, f"cache-{n}")
    os.makedirs(store)
    files = StoreFiles(store, local_cache_dir=cache)
    image_path, packed_path = files.path(image_name), files.path(packed_name)

    def write_plain():
        with open(image_path, "wb") as f:
            write_image(f, n, seed)

    def write_packed():
        with open(packed_path, "wb") as f:
            packer = PackWriter(f)
            write_image(packer, n, seed)
            packer.finish()

    with open(image_path, "wb") as f:
        write_image(f, n, seed)
    with open(image_path, "rb") as f:
        image = f.read()
    compressed = lz4_blocks(image)
    lz4_bytes = sum(len(c) for c in compressed)

    t = Table(f"write {n:,} rows", n)
    t.add("image (SnapshotWriter, 'none')", measure(write_plain, repeat))
    t.add("packed while written (+ PackWriter, 'lz4')", measure(write_packed, repeat))
    t.add("anchor: lz4 of the image's bytes in memory", measure(lambda: lz4_blocks(image), repeat))
    t.print()
    tables.append(t)
    sizes = {"image": os.path.getsize(image_path), "packed": os.path.getsize(packed_path), "raw_lz4": lz4_bytes}
    print(f"sizes at {n:,} rows: image {sizes['image'] / 2**20:.2f} MiB, packed {sizes['packed'] / 2**20:.2f} MiB "
          f"({sizes['image'] / sizes['packed']:.2f}x smaller), raw lz4 of the same bytes "
          f"{lz4_bytes / 2**20:.2f} MiB ({sizes['image'] / lz4_bytes:.2f}x)")
    extra.setdefault("sizes", {})[n] = sizes

    probe = np.zeros(1, KEY)
    probe["k"] = keys_for(n // 2, n // 2 + 1) if n else 0
    probe_row = probe.view(np.uint8).reshape(-1)

    def open_image():
        with SnapshotReader(image_path, KEY, VALUE) as r:
            r.get_row(probe_row)

    def open_packed():
        with open_snapshot(files, packed_name, KEY, VALUE) as r:
            r.get_row(probe_row)

    def drop_images():
        shutil.rmtree(cache, ignore_errors=True)

    t = Table(f"open + first lookup, {n:,} rows", n)
    t.add("image, mapped in place", measure(open_image, repeat))
    t.add("packed, first open (unpack + fsync + map)", measure(open_packed, repeat, drop_images))
    t.add("packed, image cached", measure(open_packed, repeat))
    t.add("anchor: lz4 decompress of the same bytes in memory",
          measure(lambda: [lz4.block.decompress(c, uncompressed_size=DEFAULT_PACK_BLOCK_SIZE) for c in compressed],
                  repeat))
    t.print()
    tables.append(t)

    if n:
        lookup = np.zeros(min(LOOKUPS, n), KEY)
        lookup["k"] = keys_for(0, n)[np.random.default_rng(seed).permutation(n)[:len(lookup)]]
        readers = {"image": SnapshotReader(image_path, KEY, VALUE),
                   "packed": open_snapshot(files, packed_name, KEY, VALUE)}
        for r in readers.values():
            r.verify(index=False)  # every block checked: lookups alone are timed
        t = Table(f"get_batch of {len(lookup):,} hits, {n:,} rows", len(lookup))
        t.add("image reader", measure(lambda: readers["image"].get_batch(lookup), repeat))
        t.add("packed snapshot's image reader", measure(lambda: readers["packed"].get_batch(lookup), repeat))
        t.print()
        tables.append(t)
        for r in readers.values():
            r.close()
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)


def checkpoint_part(args, workdir, extra):
    """A provider loop as the race's statecore partition; the store's bytes at the end."""
    print(f"\ncheckpoint after {args.batches} batches of {args.updates:,} upserts over {args.checkpoint_keys:,} "
          f"keys (maintenance after each commit)")
    print(f"{'compression':<12} {'total MiB':>10} {'deltas MiB':>11} {'snapshots MiB':>14} {'files':>6} "
          f"{'s/batch':>8}")
    for compression in ("none", "lz4"):
        root = os.path.join(workdir, f"ckpt-{compression}")
        conf = StateStoreConf(compression=compression, local_cache_dir=os.path.join(workdir, f"cache-{compression}"))
        p = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
        rng = np.random.default_rng(args.seed)
        all_keys = keys_for(0, args.checkpoint_keys)
        t0 = time.perf_counter()
        for v in range(args.batches):
            picked = np.unique(rng.integers(0, args.checkpoint_keys, args.updates))
            keys = np.zeros(len(picked), KEY)
            keys["k"] = all_keys[picked]
            store = p.get_store(v)
            old, found = store.get_batch(keys)
            new = np.zeros(len(keys), VALUE)
            new["count"] = np.where(found, old["count"], 0) + 1
            new["sum"] = np.where(found, old["sum"], 0) + rng.integers(0, 1000, len(keys))
            store.put_batch(keys, new)
            store.commit()
            p.do_maintenance()
        per_batch = (time.perf_counter() - t0) / args.batches
        p.close()
        store_dir = os.path.join(root, "0", "0")
        names = os.listdir(store_dir)
        by_kind = {"delta": 0, "snapshot": 0}
        total = 0
        for name in names:
            size = os.path.getsize(os.path.join(store_dir, name))
            total += size
            kind = name.rsplit(".", 1)[-1]
            if kind in by_kind:
                by_kind[kind] += size
        print(f"{compression:<12} {total / 2**20:>10.2f} {by_kind['delta'] / 2**20:>11.2f} "
              f"{by_kind['snapshot'] / 2**20:>14.2f} {len(names):>6} {per_batch:>8.2f}")
        extra.setdefault("checkpoint", {})[compression] = {"total": total, **by_kind, "files": len(names),
                                                           "s_per_batch": per_batch}


def main():
    p = arg_parser("packed snapshots vs images vs raw lz4; checkpoint bytes per compression", repeat=5)
    p.add_argument("--sizes", default="100000,1000000,10000000", help="rows per snapshot, comma-separated "
                   "(0 skips this part)")
    p.add_argument("--checkpoint-keys", type=int, default=500_000)
    p.add_argument("--updates", type=int, default=316_000, help="upserts drawn per batch (default %(default)s)")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--dir", default=None, help="where to write files (default: a temporary directory)")
    args = p.parse_args()
    header = print_header("statecore packed snapshot benchmark (warm)")
    workdir = tempfile.mkdtemp(prefix="bench_packed_", dir=args.dir)
    tables, extra = [], {}
    try:
        for n in (int(s) for s in args.sizes.split(",") if int(s) > 0):
            sizes_part(n, args.repeat, args.seed, workdir, tables, extra)
        if args.batches > 0:
            checkpoint_part(args, workdir, extra)
        if args.json:
            write_json(args.json, header, tables, extra)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
