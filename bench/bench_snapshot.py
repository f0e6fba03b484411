"""Snapshot files: write throughput, open + first lookup at two sizes, batch lookups.

    python -m bench.bench_snapshot --rows 1000000 --repeat 7 [--big-rows 10000000] [--cold] [--json PATH]

Rows are an int64 key and an (int64, float64) value: 24 bytes. Files go to a temporary
directory (``--dir``) on the local disk; writes are timed up to close(), without fsync, so
they measure the page cache, not the disk.

``--cold`` evicts the file's pages before each timed open (``posix_fadvise(DONTNEED)`` on
the file, after an fsync; per file, so other work on the machine keeps its cache). Without
it every figure is warm: the file is in the page cache, but each new reader still checks
the checksums of every block it touches.
"""
import os
import pickle
import shutil
import statistics
import tempfile
import tracemalloc

import numpy as np

from bench._common import Table, arg_parser, measure, measure_alternated, print_header, write_json
from statecore import _snapshot_writer
from statecore._rowtable import RowTable
from statecore._snapshot import SnapshotReader, SnapshotWriter, write_snapshot

KEY_DTYPE = np.dtype([("k", "<i8")])
VALUE_DTYPE = np.dtype([("count", "<i8"), ("total", "<f8")])
ROW_BYTES = KEY_DTYPE.itemsize + VALUE_DTYPE.itemsize
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: i -> i * GOLDEN mod 2**64 is a bijection
CHUNK = 1 << 20


def keys_for(start, stop):
    """Distinct, well-spread int64 keys for row numbers [start, stop)."""
    with np.errstate(over="ignore"):
        return (np.arange(start, stop, dtype=np.uint64) * GOLDEN).view(np.int64)


def batch(start, stop, seed):
    keys = np.empty(stop - start, dtype=KEY_DTYPE)
    keys["k"] = keys_for(start, stop)
    values = np.empty(stop - start, dtype=VALUE_DTYPE)
    values["count"] = np.arange(start, stop)
    values["total"] = np.random.default_rng([seed, start]).random(stop - start)
    return keys, values


def rows_of(keys, values):
    return np.concatenate([keys.view(np.uint8).reshape(-1, KEY_DTYPE.itemsize),
                           values.view(np.uint8).reshape(-1, VALUE_DTYPE.itemsize)], axis=1)


def evict(path):
    """Drop ``path``'s pages from the page cache (clean pages only: fsync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_big_snapshot(path, n, seed):
    """A snapshot of n rows streamed straight from generated chunks (no RowTable)."""
    with open(path, "wb") as f:
        writer = SnapshotWriter(f, KEY_DTYPE, VALUE_DTYPE, n, 1)
        for start in range(0, n, CHUNK):
            writer.write_rows(rows_of(*batch(start, min(n, start + CHUNK), seed)))
        return writer.finish()


class NullSink:
    """A file object that takes every write and keeps nothing."""

    def write(self, data):
        return None


def scratch_table(n, repeat, seed):
    """The writer's working buffers (slot index, key hashes) on the heap or mapped from an
    unlinked file, one big snapshot to a null sink: the rows alone are hashed, indexed and
    checksummed. The two alternate round by round."""
    rows = np.concatenate([rows_of(*batch(start, min(n, start + CHUNK), seed)) for start in range(0, n, CHUNK)])

    def write(threshold):
        def run():
            saved = _snapshot_writer.FILE_BACKED_SCRATCH_BYTES
            _snapshot_writer.FILE_BACKED_SCRATCH_BYTES = threshold
            try:
                writer = SnapshotWriter(NullSink(), KEY_DTYPE, VALUE_DTYPE, n, 1)
                for start in range(0, n, CHUNK):
                    writer.write_rows(rows[start:start + CHUNK])
                writer.finish()
            finally:
                _snapshot_writer.FILE_BACKED_SCRATCH_BYTES = saved
        return run

    t = Table(f"write {n:,} rows to a null sink: where the writer's scratch lives", n)
    cases = (("scratch on the heap (the default below an eighth of memory)", write(1 << 62)),
             ("scratch mapped from an unlinked file (every size)", write(0)))
    for (name, _), times in zip(cases, measure_alternated([fn for _, fn in cases], repeat)):
        t.add(name, times)
    return t


def main():
    p = arg_parser("snapshot write, open and lookup vs pickle / np.save / RowTable / dict")
    p.add_argument("--big-rows", type=int, default=10_000_000,
                   help="rows of the second snapshot for open + first lookup (default %(default)s)")
    p.add_argument("--cold", action="store_true",
                   help="evict the file from the page cache before each open")
    p.add_argument("--dir", default=None, help="where to write files (default: a temporary directory)")
    args = p.parse_args()
    header = print_header("statecore snapshot benchmark" + (" (cold opens)" if args.cold else " (warm)"))
    n, repeat = args.rows, args.repeat
    workdir = tempfile.mkdtemp(prefix="bench_snapshot_", dir=args.dir)
    tables, extra = [], {}
    try:
        keys, values = batch(0, n, args.seed)
        table = RowTable(KEY_DTYPE, VALUE_DTYPE, n)
        table.put_batch(keys, values)
        model = dict(zip(keys["k"].tolist(), zip(values["count"].tolist(), values["total"].tolist())))
        structured = np.empty(n, dtype=[("k", "<i8"), ("count", "<i8"), ("total", "<f8")])
        for name, column in (("k", keys["k"]), ("count", values["count"]), ("total", values["total"])):
            structured[name] = column
        snap_path = os.path.join(workdir, "1.snapshot")
        pickle_path = os.path.join(workdir, "state.pickle")
        npy_path = os.path.join(workdir, "rows.npy")

        # -- write ---------------------------------------------------------------------
        def write_pickle():
            with open(pickle_path, "wb") as f:
                pickle.dump(model, f, protocol=pickle.HIGHEST_PROTOCOL)

        def write_npy():
            with open(npy_path, "wb") as f:
                np.save(f, structured)

        def write_snap():
            with open(snap_path, "wb") as f:
                write_snapshot(f, table, 1)

        t = Table(f"write {n:,} rows ({n * ROW_BYTES / 1e6:.0f} MB of rows) to a local file", n * ROW_BYTES,
                  unit="B")
        t.add("pickle.dump(dict)", measure(write_pickle, repeat))
        t.add("np.save(structured rows; no index)", measure(write_npy, repeat))
        t.add("statecore write_snapshot(RowTable)", measure(write_snap, repeat))
        t.print()
        tables.append(t)
        sizes = {name: os.path.getsize(path) for name, path in
                 [("pickle", pickle_path), ("npy", npy_path), ("snapshot", snap_path)]}
        print("file sizes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))
        extra["file_sizes"] = sizes
        # The writer's own memory (slot index, per-row hash bits, one block) and the cursor's
        # chunks: numpy reports its buffers to tracemalloc.
        tracemalloc.start()
        write_snap()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"write_snapshot peak traced memory: {peak / 1e6:.1f} MB ({peak / n:.1f} bytes per row)")
        extra["write_snapshot_peak_traced_bytes"] = peak

        # -- open + first lookup -------------------------------------------------------
        big_path = os.path.join(workdir, "big.snapshot")
        big_npy = os.path.join(workdir, "big.npy")
        sizes_to_open = [(n, snap_path, npy_path)]
        if args.big_rows:
            info = write_big_snapshot(big_path, args.big_rows, args.seed)
            big_structured = np.empty(args.big_rows, dtype=structured.dtype)
            for start in range(0, args.big_rows, CHUNK):
                k, v = batch(start, min(args.big_rows, start + CHUNK), args.seed)
                big_structured["k"][start:start + len(k)] = k["k"]
                big_structured["count"][start:start + len(k)] = v["count"]
                big_structured["total"][start:start + len(k)] = v["total"]
            np.save(big_npy, big_structured)
            del big_structured
            print(f"\n{args.big_rows:,}-row snapshot: {info['file_size'] / 1e6:.0f} MB, "
                  f"{info['n_slots']:,} slots, max displacement {info['max_displacement']}")
            sizes_to_open.append((args.big_rows, big_path, big_npy))

        rng = np.random.default_rng(args.seed)
        for rows, path, npy in sizes_to_open:
            probe = keys_for(0, rows)[rng.integers(0, rows, size=repeat)]
            probe_bytes = [np.int64(k).tobytes() for k in probe]
            it = iter(range(10**9))

            def open_and_lookup():
                reader = SnapshotReader(path, KEY_DTYPE, VALUE_DTYPE)
                assert reader.get_row(probe_bytes[next(it) % repeat]) is not None
                reader.close()

            def load_npy():
                arr = np.load(npy)
                assert arr.shape[0] == rows

            def load_pickle():
                with open(pickle_path, "rb") as f:
                    state = pickle.load(f)
                assert state.get(int(probe[0])) is not None

            setup = (lambda p=path: evict(p)) if args.cold else None
            t = Table(f"open + first lookup, {rows:,} keys{' (cold)' if args.cold else ''}", 1, unit="ops")
            if rows == n:
                evict_pickle = (lambda: evict(pickle_path)) if args.cold else None
                t.add("pickle.load(dict) + lookup", measure(load_pickle, repeat, evict_pickle))
            t.add("np.load(.npy) (read all rows; no index)",
                  measure(load_npy, min(repeat, 3), (lambda p=npy: evict(p)) if args.cold else None))
            t.add("statecore SnapshotReader() + get_row", measure(open_and_lookup, repeat, setup))
            t.print()
            tables.append(t)
            extra[f"open_first_lookup_median_ms_{rows}"] = statistics.median(t.rows[-1][1]) * 1e3

        # -- batch lookups -------------------------------------------------------------
        lookup = keys[np.random.default_rng(args.seed + 1).permutation(n)]
        lookup_list = lookup["k"].tolist()
        state = {}

        def dict_lookups():
            get = model.get
            return [get(k) for k in lookup_list]

        def fresh_reader():
            if "reader" in state:
                state["reader"].close()
            if args.cold:
                evict(snap_path)
            state["reader"] = SnapshotReader(snap_path, KEY_DTYPE, VALUE_DTYPE)

        def snapshot_lookups():
            _, found = state["reader"].get_batch(lookup)
            assert found.all()

        t = Table(f"get_batch of {n:,} hits in random order", n)
        t.add("dict.get per key (Python loop)", measure(dict_lookups, repeat))
        t.add("RowTable.get_batch (in memory)", measure(lambda: table.get_batch(lookup), repeat))
        t.add("snapshot get_batch, new reader (checks every block)" + (" cold" if args.cold else ""),
              measure(snapshot_lookups, repeat, fresh_reader))
        t.add("snapshot get_batch, same reader (blocks checked)", measure(snapshot_lookups, repeat))
        t.print()
        tables.append(t)
        state["reader"].close()

        # -- the same with a tenth of the keys absent: the key filter rules most of them out
        mixed = lookup.copy()
        mixed["k"][: n // 10] = -1 - np.arange(n // 10)  # none of the well-spread keys (asserted below)
        mixed = mixed[np.random.default_rng(args.seed + 2).permutation(n)]
        mixed_list = mixed["k"].tolist()
        plain = SnapshotReader(snap_path, KEY_DTYPE, VALUE_DTYPE)
        filtered = SnapshotReader(snap_path, KEY_DTYPE, VALUE_DTYPE)
        filtered.build_key_filter()

        def mixed_lookups(reader):
            _, found = reader.get_batch(mixed)
            assert int(found.sum()) == n - n // 10

        t = Table(f"get_batch of {n:,} keys, a tenth of them absent", n)
        t.add("dict.get per key (Python loop)", measure(lambda: [model.get(k) for k in mixed_list], repeat))
        t.add("snapshot get_batch, no key filter", measure(lambda: mixed_lookups(plain), repeat))
        t.add("snapshot get_batch, its key filter asked first", measure(lambda: mixed_lookups(filtered), repeat))
        t.print()
        tables.append(t)
        plain.close()
        filtered.close()

        if args.big_rows:
            t = scratch_table(args.big_rows, repeat, args.seed)
            t.print()
            tables.append(t)

        if args.json:
            write_json(args.json, header, tables, extra)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
