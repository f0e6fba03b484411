"""The event-time race: deduplication, tumbling windows and session windows, Spark's own
streaming operators against statecore's built-ins.

``python -m bench.bench_event_time [--keys 100000,1000000] [--rows 1000000] [--batches 10]
[--queries dedup,window,session] [--contenders floor,hdfs,rocksdb,statecore] [--json PATH]``
(``python -m bench`` runs it with the others; ``--quick`` shrinks everything: a smoke test.)

The input, the same files for every query and contender: micro-batches of ``--rows`` rows
``(key long, ts timestamp, amount long)`` read from parquet (one file per trigger), ``key``
uniform over ``--keys`` keys, ``amount`` 1..100. Batch ``i`` covers its own slice of event
time, ``[i * slice, (i + 1) * slice)`` (``--slice-s``, default 60 s), so the watermark moves a
slice per batch and each batch closes the windows, sessions and dedup entries of the ones
before it; ``--late`` (default 3%) of a batch's rows lag 3 to 4 slices behind, which from
the third batch on is behind the watermark: late, dropped and counted. The queries, each on
``local[2]`` with 2 state partitions, append mode, watermark delay ``--delay`` (10 s):

- ``dedup``: Spark ``withWatermark("ts", delay).dropDuplicatesWithinWatermark(["key"])``
  against ``StatefulOperator(fn=Deduplicate(["key"], "ts", delay))``;
- ``window``: Spark ``withWatermark(...).groupBy(window("ts", W), "key").agg(count, sum)``
  against ``WindowedAggregate(["key"], "ts", delay, W, aggregates={"n": ("count", "*"),
  "total": ("sum", "amount")})`` (``--window``, 30 s, tumbling: two windows a slice);
- ``session``: Spark ``withWatermark(...).groupBy(session_window("ts", gap), "key").agg(count,
  sum)`` against ``SessionWindow(["key"], "ts", delay, gap, aggregates=...)`` (``--gap``, 10 s).

Contenders, each in a fresh Python process with its own Spark session (:mod:`bench.race`'s
machinery: its session settings, worker processes, progress timing and memory sampling):
``hdfs`` and ``rocksdb``, Spark's query on its HDFS-backed and RocksDB state store providers
(``rocksdb_changelog``, RocksDB with changelog checkpointing, on request); ``statecore``, the
built-in in ``foreachBatch``; ``floor``, the same query on each file as a plain batch job with
no state (``dropDuplicates`` for dedup): what no stateful query can beat. Spark's queries write
to the ``noop`` sink; statecore's operator writes its output as parquet files (its
materialized output), which is more work, not less. Batches without data are off
(``spark.sql.streaming.noDataMicroBatches.enabled=false``, as in the race), so both run the
same batches and close windows in the next data batch.

Per query, key space and contender: the time of each batch (``triggerExecution`` of the
streaming progress; the job's wall time for the floor), rows/s as the median over batches
3..N, state commit time, the bytes of state files after the last batch, the state's rows then
(Spark's ``numRowsTotal``; statecore's default store: the same keys and (window, key) rows for
dedup and windows, but keys with open sessions where Spark counts sessions), the rows dropped
as late (Spark's ``numRowsDroppedByWatermark``; statecore's ``late_rows``: for windows
statecore counts (row, window) pairs, Spark the (window, key) groups after its partial
aggregation), the peak memory of the JVM and of the Python workers; and statecore's speed and
state bytes relative to each Spark provider and to the floor.
"""
import argparse
import functools
import json
import os
import shutil
import sys
import time

import numpy as np

from bench import RACE_DATA_DIR, race

MODULE = "bench.bench_event_time"
INPUT_DDL = "key long, ts timestamp, amount long"
QUERIES = ("dedup", "window", "session")
CONTENDERS = ("floor", "hdfs", "rocksdb", "rocksdb_changelog", "statecore")
DEFAULT_CONTENDERS = ("floor", "hdfs", "rocksdb", "statecore")
AGGREGATES = {"n": ("count", "*"), "total": ("sum", "amount")}
T0_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z: event time starts here
_US = 1_000_000


# -- input -------------------------------------------------------------------------------------------

def write_event_batches(directory, batches, rows, keys, slice_s, late_fraction, seed=0):
    """``batches`` parquet files of ``rows`` rows ``(key, ts, amount)``: ``key`` uniform in
    [0, keys), ``amount`` 1..100, ``ts`` uniform over batch ``i``'s slice of event time
    ``T0 + [i * slice_s, (i + 1) * slice_s)`` except ``late_fraction`` of the rows, 3 to 4
    slices earlier. Row groups of a quarter batch (both cores read each file), as the race's
    inputs; modification times a second apart, in order (Spark's file source takes files in
    the order of their millisecond mtimes, and small files are written within one). Reused
    when already there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    names = [f"batch-{i:05d}.parquet" for i in range(batches)]
    if os.path.exists(os.path.join(directory, "_complete")):
        return [os.path.join(directory, n) for n in names]
    rng = np.random.default_rng(seed)
    slice_us = int(slice_s * _US)
    first_mtime_ns = time.time_ns() - (batches + 1) * 1_000_000_000
    for i, name in enumerate(names):
        key = rng.integers(0, keys, rows, dtype=np.int64)
        ts = T0_US + i * slice_us + rng.integers(0, slice_us, rows, dtype=np.int64)
        lagging = rng.random(rows) < late_fraction
        ts[lagging] -= rng.integers(3 * slice_us, 4 * slice_us, int(lagging.sum()), dtype=np.int64)
        table = pa.table({"key": key, "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                          "amount": rng.integers(1, 101, rows, dtype=np.int64)})
        tmp = os.path.join(directory, f".{name}.tmp")
        pq.write_table(table, tmp, row_group_size=max(1, rows // 4))
        os.replace(tmp, os.path.join(directory, name))
        mtime_ns = first_mtime_ns + i * 1_000_000_000
        os.utime(os.path.join(directory, name), ns=(mtime_ns, mtime_ns))
    open(os.path.join(directory, "_complete"), "w").close()
    return [os.path.join(directory, n) for n in names]


# -- the queries ---------------------------------------------------------------------------------------

def _seconds(s):
    """A Spark interval string for ``s`` seconds (whole milliseconds when not whole seconds)."""
    return f"{int(s)} seconds" if s == int(s) else f"{round(s * 1000)} milliseconds"


def spark_query(query, events, delay_s, window_s, gap_s):
    """Spark's own query over the stream ``events``; with ``delay_s`` None, the floor's:
    the same over a batch DataFrame, without the watermark (``dropDuplicates`` for dedup)."""
    from pyspark.sql import functions as F

    watermarked = events if delay_s is None else events.withWatermark("ts", _seconds(delay_s))
    aggregates = [F.count(F.lit(1)).alias("n"), F.sum("amount").alias("total")]
    if query == "dedup":
        if delay_s is None:
            return events.dropDuplicates(["key"])
        return watermarked.dropDuplicatesWithinWatermark(["key"])
    if query == "window":
        return watermarked.groupBy(F.window("ts", _seconds(window_s)), "key").agg(*aggregates)
    if query == "session":
        return watermarked.groupBy(F.session_window("ts", _seconds(gap_s)), "key").agg(*aggregates)
    raise ValueError(f"unknown query {query!r}")


def statecore_fn(query, delay_s, window_s, gap_s):
    """statecore's built-in for ``query``."""
    from pyspark_glue import Deduplicate, SessionWindow, WindowedAggregate

    delay = _seconds(delay_s)
    if query == "dedup":
        return Deduplicate(["key"], "ts", delay)
    if query == "window":
        return WindowedAggregate(["key"], "ts", delay, _seconds(window_s), aggregates=AGGREGATES)
    if query == "session":
        return SessionWindow(["key"], "ts", delay, _seconds(gap_s), aggregates=AGGREGATES)
    raise ValueError(f"unknown query {query!r}")


def start_query(settings, spark, contender, source, checkpoint, state_root):
    """:func:`bench.race.start_query` for the event-time queries: ``settings`` is
    ``(query, delay_s, window_s, gap_s)``."""
    events = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
    operator = None
    if contender == "statecore":
        from pyspark_glue import StatefulOperator

        operator = StatefulOperator(state_root, 0, 2, fn=statecore_fn(*settings))
        writer = race.operator_writer(events, operator)
    elif contender in ("hdfs", "rocksdb", "rocksdb_changelog"):
        writer = spark_query(settings[0], events, *settings[1:]).writeStream.outputMode("append").format("noop")
    else:
        raise ValueError(f"unknown contender {contender!r}")
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    return query, operator


def worker_args(query, delay_s, window_s, gap_s):
    """The arguments of :func:`_worker_main` beyond the race's common ones."""
    return ["--query", query, "--delay-s", str(delay_s), "--window-s", str(window_s), "--gap-s", str(gap_s)]


def _worker_main(argv):
    p = argparse.ArgumentParser()
    for a in ("name", "contender", "source", "work", "driver_memory", "out", "query"):
        p.add_argument(f"--{a.replace('_', '-')}", required=True)
    for a in ("delay-s", "window-s", "gap-s"):
        p.add_argument(f"--{a}", type=float, required=True)
    args = p.parse_args(argv)
    settings = (args.query, args.delay_s, args.window_s, args.gap_s)
    if args.contender == "floor":
        def floor_query(df):
            return spark_query(args.query, df, None, args.window_s, args.gap_s)

        result = race.run_floor(args, schema=INPUT_DDL, query=floor_query)
    else:
        result = race.run_streaming(args, start_query=functools.partial(start_query, settings))
    with open(args.out, "w") as f:
        json.dump(result, f)
    race.end_jvm()


# -- the race ------------------------------------------------------------------------------------------

def run_contender(args, root, files, query, keys, contender):
    """One contender on one query and key space, in its own process; its summary."""
    work = os.path.join(root, f"{query}-{contender}-k{keys}")
    shutil.rmtree(work, ignore_errors=True)
    source = os.path.join(work, "input")
    race.link_inputs(files, source)
    raw = race.run_in_process(f"{query}-{contender}-k{keys}", contender, source, work, args.driver_memory,
                              args.timeout, module=MODULE,
                              extra_args=worker_args(query, args.delay_s, args.window_s, args.gap_s))
    if len(raw["batches"]) != args.batches:
        raise RuntimeError(f"{query} {contender} with {keys} keys ran {len(raw['batches'])} batches, "
                           f"not {args.batches}: {raw['batches']}")
    s = race.summarize(raw, args.rows, min(2, len(raw["batches"]) - 1))
    s["rows_per_batch"] = args.rows
    s["process_s"] = raw["process_s"]
    if contender != "floor":
        s["state_bytes"] = raw["state_bytes"]
        s["checkpoint_bytes"] = raw["checkpoint_bytes"] + raw["state_bytes"] * (contender == "statecore")
        s["late_rows"] = sum(b.get("late_rows", 0) for b in raw["batches"])
        s["state_keys"] = raw["batches"][-1].get("state_keys")
    return s


def run_race(args, root, header):
    results = {"machine": header, "argv": sys.argv, "settings": vars(args), "queries": {}, "ratios": {}}
    for keys in args.keys:
        data = os.path.join(args.data, f"events-k{keys}-r{args.rows}-b{args.batches}-s{args.slice_s:g}"
                                       f"-l{args.late:g}-seed{args.seed}")
        files = write_event_batches(data, args.batches, args.rows, keys, args.slice_s, args.late, seed=args.seed)
        for query in args.queries:
            table = results["queries"].setdefault(query, {}).setdefault(str(keys), {})
            for contender in args.contenders:
                print(f"  {query} K={keys:,} {contender} ...", flush=True)
                s = table[contender] = run_contender(args, root, files, query, keys, contender)
                extra = ("" if contender == "floor" else
                         f", state {s['state_bytes'] / 2**20:.1f} MiB, {s['state_keys'] or 0:,} state rows at the end, "
                         f"{s['late_rows']:,} late")
                print(f"    {s['batch_s']:.2f} s/batch, {s['rows_per_s']:,.0f} rows/s, commit "
                      f"{s['commit_s'] * 1e3:.0f} ms{extra}, JVM {s['jvm_peak_mib']:.0f} MiB, workers "
                      f"{s['python_workers_peak_mib']:.0f} MiB (batches: "
                      f"{' '.join(f'{x:.2f}' for x in s['batch_seconds'])})", flush=True)
    for query, tables in results["queries"].items():
        results["ratios"][query] = race.add_ratios({"race": tables, "restart": {}})["ratios"]
    return results


def print_tables(results):
    s = results["settings"]
    titles = {"dedup": "dropDuplicatesWithinWatermark vs Deduplicate",
              "window": f"tumbling {s['window_s']:g} s windows, count and sum, vs WindowedAggregate",
              "session": f"session windows, gap {s['gap_s']:g} s, count and sum, vs SessionWindow"}
    for query, tables in results["queries"].items():
        print(f"\n## {query}: {titles[query]} (delay {s['delay_s']:g} s, {s['slice_s']:g} s of event time a batch)")
        race.print_tables({"race": tables, "restart": {}, "ratios": results["ratios"].get(query, {})})
        for keys, table in tables.items():
            late = ", ".join(f"{c} {t['late_rows']:,}" for c, t in table.items() if "late_rows" in t)
            if late:
                print(f"K = {int(keys):,}: rows dropped as late over all batches: {late}")


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    names = lambda choices: lambda s: [_choice(x, choices) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--keys", type=ints, default=[100_000, 1_000_000], help="key spaces K (default 100000,1000000)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per micro-batch (default %(default)s)")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--queries", type=names(QUERIES), default=list(QUERIES),
                   help=f"which queries (default {','.join(QUERIES)})")
    p.add_argument("--contenders", type=names(CONTENDERS), default=list(DEFAULT_CONTENDERS),
                   help=f"from {','.join(CONTENDERS)} (default {','.join(DEFAULT_CONTENDERS)})")
    p.add_argument("--slice-s", type=float, default=60.0, help="seconds of event time per batch (default %(default)s)")
    p.add_argument("--delay-s", type=float, default=10.0, help="the watermark delay (default %(default)s)")
    p.add_argument("--window-s", type=float, default=30.0, help="the tumbling window (default %(default)s)")
    p.add_argument("--gap-s", type=float, default=10.0, help="the session gap (default %(default)s)")
    p.add_argument("--late", type=float, default=0.03, help="share of rows 3-4 slices behind (default %(default)s)")
    p.add_argument("--driver-memory", default="12g")
    p.add_argument("--data", default=RACE_DATA_DIR,
                   help="where input files are generated once and reused")
    p.add_argument("--work", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contender process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="every query and contender, tiny (a smoke test)")
    return p


def _choice(name, choices):
    if name not in choices:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(choices)}")
    return name


def check_args(p, args):
    """The input's late rows must be late and each batch must close what came before it."""
    if args.batches < 3:
        p.error("--batches must be at least 3 (batches 3..N are measured)")
    if args.slice_s * _US % 1 or args.window_s * _US % 1 or args.slice_s % args.window_s:
        p.error("--slice-s must be a whole number of --window-s windows (whole microseconds)")
    if args.delay_s + max(args.window_s, args.gap_s) >= args.slice_s:
        p.error("--delay-s plus the larger of --window-s and --gap-s must be less than --slice-s, so that rows "
                "3 slices behind are late and each batch closes the previous one's first window")


def quick_args(p):
    """The settings of ``--quick``: every query and default contender, tiny."""
    return p.parse_args(["--keys", "10000", "--rows", "50000", "--batches", "5", "--driver-memory", "2g"])


def run(args):
    """The event-time race with ``args`` from :func:`parser`; returns the results dict."""
    from bench._common import print_header

    header = print_header("event-time race: dedup, tumbling and session windows, Spark's state stores vs "
                          "statecore's built-ins, local[2], 2 state partitions")

    def body(root):
        results = run_race(args, root, header)
        print_tables(results)
        return results

    return race.in_work_dir(args, "statecore-event-time-", body)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        return _worker_main(argv[1:])
    p = parser()
    args = race.parse_main_args(p, argv, quick_args)
    check_args(p, args)
    run(args)


if __name__ == "__main__":
    main()
