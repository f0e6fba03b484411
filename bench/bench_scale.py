"""The scale curve: per-batch time and resident memory of one partition holding
K keys, for several K, with the page cache of the state's files dropped before it opens.

    python -m bench.bench_scale --keys 1000000,10000000,100000000 --batch-rows 100000 --batches 30

For each K, fresh interpreters, so that each one's RSS is its own:

1. build: version 1 of a store of K keys (int64 key, two int64-wide values: 24-byte rows, as
   in bench_store), written in chunks through the writers the provider itself uses: the delta
   of version 1 (DeltaWriter) and its snapshot (SnapshotWriter), under the provider's file
   names, with its schema file. Memory stays bounded by the snapshot writer's slot index.
   The provider then opens it as it opens any checkpoint (checked: key count, lookups).
2. run: every file of the store is evicted from the page cache (posix_fadvise DONTNEED);
   open = provider init + get_store of the newest version; then ``--batches`` batches of
   ``--batch-rows`` random keys (half present, half new, seeded): get_batch, put_batch of
   the updated values, commit, each timed, then the provider's do_maintenance (what the
   registry's maintenance thread runs), timed apart. After each batch: VmRSS, RssAnon,
   RssFile, and the bytes of the store's files on disk; a sampler thread keeps the peak
   RssAnon of batches and of maintenance.
3. probe: 100k random lookups on the last snapshot alone, every page resident (ns per key).
4. anchor, for the smallest K only if it is <= 1M: the same batches against a Python dict.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench._common import print_header
from statecore._snapshot_format import DEFAULT_BLOCK_SIZE

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
ROW_BYTES = KEY.itemsize + VALUE.itemsize
BUILD_CHUNK = 1 << 20
MiB = 1 << 20


# -- measuring --------------------------------------------------------------------------------
def proc_status():
    """VmRSS, RssAnon, RssFile, VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out


class AnonPeak:
    """Samples RssAnon every ``period_s`` on a thread; ``take()`` returns the peak since the
    last take (the kernel keeps only the peak of the whole RSS, file pages included)."""

    def __init__(self, period_s=0.02):
        self.period_s = period_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anon-peak", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.period_s):
            anon = proc_status()["RssAnon"]
            with self._lock:
                self._peak = max(self._peak, anon)

    def take(self):
        anon = proc_status()["RssAnon"]
        with self._lock:
            peak, self._peak = max(self._peak, anon), 0
        return peak

    def stop(self):
        self._stop.set()
        self._thread.join()


def store_files(store_dir):
    return [e for e in os.scandir(store_dir) if e.is_file()]


def disk_bytes(store_dir):
    return sum(e.stat().st_size for e in store_files(store_dir))


def evict(store_dir):
    """Drop the store's files from the page cache (their pages are clean: written durably)."""
    for e in store_files(store_dir):
        fd = os.open(e.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(store_dir):
    """Bytes of the store's files in the page cache (fincore), or None without it."""
    names = [e.path for e in store_files(store_dir)]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *names],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(x) for x in out.split())


# -- the state and the batches ------------------------------------------------------------
def key_of(i):
    """The keys of the built state are the even numbers 2i, i < K; new keys are odd."""
    return 2 * i


def batches(seed, keys, n_batches, batch_rows):
    """The seeded batches, the same for the store and the dict: ``(keys, increments)``,
    half of the keys drawn from the state, half new (random odd numbers)."""
    rng = np.random.default_rng([seed, keys])
    for _ in range(n_batches):
        present = batch_rows // 2
        k = np.empty(batch_rows, np.int64)
        k[:present] = key_of(rng.integers(0, keys, present))
        k[present:] = 2 * rng.integers(keys, 1 << 61, batch_rows - present) + 1
        rng.shuffle(k)
        yield k, rng.random(batch_rows)


def build(store_dir, root, keys, compression, block_size):
    """Version 1 of a store of ``keys`` keys: its delta and its snapshot, streamed in chunks
    through the provider's writers, under the provider's names."""
    from statecore import StateStoreConf, StateStoreId, create_and_init_provider
    from statecore._delta import DeltaWriter
    from statecore._snapshot import SnapshotWriter
    from statecore.lineage import ROOT_COMMIT_ID, file_name

    peak = AnonPeak()
    conf = StateStoreConf(compression=compression)
    provider = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
    provider.write_schema_file(1)
    commit_id = os.urandom(8)

    def chunks():
        for start in range(0, keys, BUILD_CHUNK):
            i = np.arange(start, min(start + BUILD_CHUNK, keys), dtype=np.int64)
            k = np.zeros(i.size, KEY)
            k["k"] = key_of(i)
            v = np.zeros(i.size, VALUE)
            v["count"] = 1
            v["sum"] = i * 0.5
            yield k, v

    def write_delta(f):
        w = DeltaWriter(f, KEY, VALUE, 1, lineage=commit_id + ROOT_COMMIT_ID, compression=compression)
        for k, v in chunks():
            w.put_rows(k.view(np.uint8).reshape(-1, KEY.itemsize), v.view(np.uint8).reshape(-1, VALUE.itemsize))
        w.finish()

    def write_snapshot(f):
        w = SnapshotWriter(f, KEY, VALUE, keys, 1, lineage=commit_id + bytes(8), block_size=block_size)
        rows = np.empty((BUILD_CHUNK, ROW_BYTES), np.uint8)
        for k, v in chunks():
            n = k.size
            rows[:n, :KEY.itemsize] = k.view(np.uint8).reshape(-1, KEY.itemsize)
            rows[:n, KEY.itemsize:] = v.view(np.uint8).reshape(-1, VALUE.itemsize)
            w.write_rows(rows[:n])
        w.finish()

    t0 = time.perf_counter()
    provider.files.write_atomic(file_name(1, commit_id, "delta"), write_delta)
    t1 = time.perf_counter()
    delta_anon = peak.take()
    provider.files.write_atomic(file_name(1, commit_id, "snapshot"), write_snapshot)
    t2 = time.perf_counter()
    snapshot_anon = peak.take()
    peak.stop()
    del provider
    # The checkpoint opens as any other: the key count and a few keys, present and absent.
    check = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
    store = check.get_read_store(1)
    assert store.metrics.num_keys == keys, store.metrics.num_keys
    probe = np.zeros(3, KEY)
    probe["k"] = [key_of(0), key_of(keys - 1), 1]
    values, found = store.get_batch(probe)
    assert found.tolist() == [True, True, False] and values["count"][0] == 1, (values, found)
    store.abort()
    return {"delta_s": t1 - t0, "snapshot_s": t2 - t1, "peak_anon_delta": delta_anon,
            "peak_anon_snapshot": snapshot_anon, "vm_hwm": proc_status()["VmHWM"],
            "disk_bytes": disk_bytes(store_dir)}


def run(store_dir, root, keys, n_batches, batch_rows, seed, compression):
    """Open the built state cold, then the batches with maintenance between them."""
    evict(store_dir)
    cached_after_evict = cached_bytes(store_dir)
    status0 = proc_status()
    from statecore import StateStoreConf, StateStoreId, create_and_init_provider
    peak = AnonPeak()
    conf = StateStoreConf(compression=compression)  # else Spark's defaults: a snapshot after more than 10 deltas
    work = batches(seed, keys, n_batches, batch_rows)  # each drawn before its batch, untimed
    peak.take()
    t0 = time.perf_counter()
    provider = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, conf)
    store = provider.get_store(1)
    open_s = time.perf_counter() - t0
    status_open = proc_status()
    rows = []
    version = 1
    for k, x in work:
        b0 = time.perf_counter()
        if store is None:  # the first batch uses the store the open returned
            store = provider.get_store(version)
        b1 = time.perf_counter()
        keys_arr = np.zeros(k.size, KEY)
        keys_arr["k"] = k
        old, found = store.get_batch(keys_arr)
        new = np.zeros(k.size, VALUE)
        new["count"] = np.where(found, old["count"], 0) + 1
        new["sum"] = np.where(found, old["sum"], 0.0) + x
        store.put_batch(keys_arr, new)
        b2 = time.perf_counter()
        version = store.commit()
        b3 = time.perf_counter()
        batch_anon = peak.take()
        st = proc_status()
        m0 = time.perf_counter()
        provider.do_maintenance()
        m1 = time.perf_counter()
        maint_anon = peak.take()
        st_m = proc_status()
        rows.append({"version": version, "open_s": b1 - b0, "update_s": b2 - b1,
                     "commit_s": b3 - b2, "batch_s": b3 - b0,
                     "maintenance_s": m1 - m0, "rss": st["VmRSS"], "anon": st["RssAnon"], "file": st["RssFile"],
                     "peak_anon_batch": batch_anon, "peak_anon_maintenance": maint_anon,
                     "rss_after_maintenance": st_m["VmRSS"], "anon_after_maintenance": st_m["RssAnon"],
                     "file_after_maintenance": st_m["RssFile"], "disk_bytes": disk_bytes(store_dir)})
        store = None
    peak.stop()
    final = provider.get_read_store(version)
    num_keys = final.metrics.num_keys
    final.abort()
    return {"open_s": open_s, "status_before_open": status0, "status_after_open": status_open,
            "cached_after_evict": cached_after_evict, "batches": rows, "num_keys": num_keys,
            "files": sorted(e.name for e in store_files(store_dir))}


def probe(store_dir, keys, repeat, seed):
    """ns per key of 100k random lookups on the mapped snapshot alone, every page resident:
    what a base probe costs at this K, without the batch around it."""
    from statecore.files import open_store_files
    from statecore.snapshot_files import open_snapshot
    name = next(e.name for e in store_files(store_dir) if e.name.endswith(".snapshot"))
    reader = open_snapshot(open_store_files(store_dir), name, KEY, VALUE)  # a packed one through its image
    reader.verify(index=False)  # reads and maps every block
    rng = np.random.default_rng([seed, keys, 1])
    values = np.zeros((100_000, VALUE.itemsize), np.uint8)
    found = np.zeros(100_000, np.uint8)
    out = {}
    for present in (True, False):
        times = []
        for _ in range(repeat):
            k = np.zeros(100_000, KEY)
            k["k"] = key_of(rng.integers(0, keys, k.size)) if present else 2 * rng.integers(keys, 1 << 61, k.size) + 1
            rows = k.view(np.uint8).reshape(-1, KEY.itemsize)
            t0 = time.perf_counter()
            reader.get_rows(rows, values, found)
            times.append(time.perf_counter() - t0)
        assert found.all() if present else not found.any()
        out["present" if present else "absent"] = float(np.median(times)) / k.size * 1e9
    reader.close()
    return out


def run_dict(keys, n_batches, batch_rows, seed):
    """The same batches against a dict of the same state (key -> (count, sum))."""
    status0 = proc_status()
    t0 = time.perf_counter()
    i = np.arange(keys, dtype=np.int64)
    d = dict(zip(key_of(i).tolist(), zip(np.ones(keys, np.int64).tolist(), (i * 0.5).tolist())))
    del i
    build_s = time.perf_counter() - t0
    rows = []
    for k, x in batches(seed, keys, n_batches, batch_rows):
        b0 = time.perf_counter()
        get = d.get
        for key, inc in zip(k.tolist(), x.tolist()):
            old = get(key)
            d[key] = (1, inc) if old is None else (old[0] + 1, old[1] + inc)
        rows.append({"batch_s": time.perf_counter() - b0, **proc_status()})
    return {"build_s": build_s, "status_before": status0, "batches": rows, "num_keys": len(d)}


# -- the driver ---------------------------------------------------------------------------
def worker(argv):
    job = json.loads(argv)
    kind = job.pop("kind")
    if kind == "build":
        out = build(**job)
    elif kind == "run":
        out = run(**job)
    elif kind == "probe":
        out = probe(**job)
    else:
        out = run_dict(**job)
    sys.stdout.write("\n@@RESULT " + json.dumps(out) + "\n")


def in_fresh_process(job):
    cmd = [sys.executable, "-m", "bench.bench_scale", "--worker", json.dumps(job)]
    proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['kind']} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@RESULT "))
    return json.loads(line[len("@@RESULT "):])


def summarize(keys, built, ran):
    b = ran["batches"]
    times = np.array([r["batch_s"] for r in b])
    last = b[-1]
    state = last["disk_bytes"]
    return {
        "keys": keys, "raw_mib": keys * ROW_BYTES / MiB, "open_s": ran["open_s"],
        "first_ms": times[0] * 1e3, "median_ms": float(np.median(times) * 1e3),
        "p95_ms": float(np.percentile(times, 95) * 1e3), "max_ms": float(times.max() * 1e3),
        "update_median_ms": float(np.median([r["update_s"] for r in b]) * 1e3),
        "commit_median_ms": float(np.median([r["commit_s"] for r in b]) * 1e3),
        "maintenance_max_s": max(r["maintenance_s"] for r in b),
        "maintenance_total_s": sum(r["maintenance_s"] for r in b),
        "rss_mib": last["rss"] / MiB, "anon_mib": last["anon"] / MiB, "file_mib": last["file"] / MiB,
        "peak_anon_batch_mib": max(r["peak_anon_batch"] for r in b) / MiB,
        "peak_anon_maintenance_mib": max(r["peak_anon_maintenance"] for r in b) / MiB,
        "max_file_mib": max(max(r["file"], r["file_after_maintenance"]) for r in b) / MiB,
        "state_mib": state / MiB, "rss_per_state": last["rss"] / state, "anon_per_state": last["anon"] / state,
        "build_s": built["delta_s"] + built["snapshot_s"],
        "build_peak_anon_mib": max(built["peak_anon_delta"], built["peak_anon_snapshot"]) / MiB,
        "cached_after_evict_mib": (ran["cached_after_evict"] or 0) / MiB,
        "anon_after_open_mib": ran["status_after_open"]["RssAnon"] / MiB,
        "anon_before_open_mib": ran["status_before_open"]["RssAnon"] / MiB,
        "file_before_open_mib": ran["status_before_open"]["RssFile"] / MiB,
        "file_after_open_mib": ran["status_after_open"]["RssFile"] / MiB,
    }


def print_table(rows, dict_row):
    print("\nK keys: open = provider init + get_store, cold (page cache of the files dropped); "
          "batch = get_store + get_batch + put_batch + commit of the batch's keys;\n"
          "RSS after the last batch (anon / file); state = the store's files on disk; maintenance apart")
    head = (f"{'K':>11} {'raw MiB':>8} {'open s':>7} {'1st ms':>7} {'med ms':>7} {'p95 ms':>7} "
            f"{'RSS MiB (anon/file)':>20} {'pk anon b/m':>12} {'state MiB':>9} {'RSS/state':>9} "
            f"{'anon/state':>10} {'maint max s':>11}")
    print(head)
    for r in rows:
        print(f"{r['keys']:>11,} {r['raw_mib']:>8.0f} {r['open_s']:>7.3f} {r['first_ms']:>7.0f} "
              f"{r['median_ms']:>7.1f} {r['p95_ms']:>7.1f} "
              f"{r['rss_mib']:>7.0f} ({r['anon_mib']:.0f}/{r['file_mib']:.0f}) "
              f"{r['peak_anon_batch_mib']:>5.0f}/{r['peak_anon_maintenance_mib']:<6.0f} {r['state_mib']:>9.0f} "
              f"{r['rss_per_state']:>9.2f} {r['anon_per_state']:>10.3f} {r['maintenance_max_s']:>11.2f}")
    if dict_row is not None:
        print(f"{'dict ' + format(dict_row['keys'], ','):>11} {dict_row['raw_mib']:>8.0f} "
              f"{dict_row['build_s']:>7.3f} {dict_row['first_ms']:>7.0f} {dict_row['median_ms']:>7.1f} "
              f"{dict_row['p95_ms']:>7.1f} {dict_row['rss_mib']:>7.0f} ({dict_row['anon_mib']:.0f}/"
              f"{dict_row['file_mib']:.0f})   (dict: 'open s' is building it from arrays)")
    print("\nbuild (version 1's delta + snapshot through the provider's writers):")
    for r in rows:
        print(f"  {r['keys']:>11,} keys: {r['build_s']:.1f} s, peak RssAnon {r['build_peak_anon_mib']:.0f} MiB; "
              f"cached after eviction {r['cached_after_evict_mib']:.1f} MiB; RssAnon before/after open "
              f"{r['anon_before_open_mib']:.0f}/{r['anon_after_open_mib']:.0f} MiB, RssFile "
              f"{r['file_before_open_mib']:.0f}/{r['file_after_open_mib']:.0f} MiB; update/commit median "
              f"{r['update_median_ms']:.1f}/{r['commit_median_ms']:.1f} ms; max RssFile {r['max_file_mib']:.0f} MiB; "
              f"maintenance total {r['maintenance_total_s']:.1f} s; mapped probe, all resident: "
              f"{r['probe_present_ns']:.0f} ns present / {r['probe_absent_ns']:.0f} ns absent key")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=lambda s: [int(x) for x in s.split(",")], default=[1_000_000, 10_000_000])
    p.add_argument("--batch-rows", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compression", default="lz4")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="checksummed block of the built snapshot (maintenance's use the default)")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the stores are built (deleted after)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    header = print_header(f"scale curve: {args.batches} batches of {args.batch_rows:,} upserts; K = "
                          f"{', '.join(format(k, ',') for k in args.keys)}")
    rows, raw, dict_row = [], {}, None
    for keys in args.keys:
        scratch = tempfile.mkdtemp(prefix="statecore-scale-", dir=args.tmp)
        root = f"{scratch}/ckpt"
        store_dir = f"{root}/0/0"
        try:
            built = in_fresh_process({"kind": "build", "store_dir": store_dir, "root": root, "keys": keys,
                                      "compression": args.compression, "block_size": args.block_size})
            print(f"built {keys:,} keys in {built['delta_s'] + built['snapshot_s']:.1f} s", flush=True)
            ran = in_fresh_process({"kind": "run", "store_dir": store_dir, "root": root, "keys": keys,
                                    "n_batches": args.batches, "batch_rows": args.batch_rows, "seed": args.seed,
                                    "compression": args.compression})
            probed = in_fresh_process({"kind": "probe", "store_dir": store_dir, "keys": keys, "repeat": 20,
                                       "seed": args.seed})
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rows.append({**summarize(keys, built, ran), "probe_present_ns": probed["present"],
                     "probe_absent_ns": probed["absent"]})
        raw[keys] = {"build": built, "run": ran}
        print(f"ran {keys:,} keys: open {ran['open_s']:.3f} s", flush=True)
    small = min(args.keys)
    if small <= 1_000_000:
        d = in_fresh_process({"kind": "dict", "keys": small, "n_batches": args.batches,
                              "batch_rows": args.batch_rows, "seed": args.seed})
        t = np.array([r["batch_s"] for r in d["batches"]])
        last = d["batches"][-1]
        dict_row = {"keys": small, "raw_mib": small * ROW_BYTES / MiB, "build_s": d["build_s"],
                    "first_ms": t[0] * 1e3, "median_ms": float(np.median(t) * 1e3),
                    "p95_ms": float(np.percentile(t, 95) * 1e3), "rss_mib": last["VmRSS"] / MiB,
                    "anon_mib": last["RssAnon"] / MiB, "file_mib": last["RssFile"] / MiB}
        raw["dict"] = d
    print_table(rows, dict_row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": header, "argv": sys.argv, "rows": rows, "dict": dict_row, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
