"""Continuous execution on local Spark: epoch commit latency and rows/s per task.

    python -m bench.bench_continuous [--intervals 100,1000] [--seconds 10] [--warmup 3]
                                     [--partitions 2] [--batch-rows 4096] [--keys 100000] [--json PATH]

For each epoch interval: a continuous query (pyspark_glue.continuous) over an unthrottled
GeneratorSource, ``fn`` = RunningAggregate (a running count and sum per key, emitting each
key updated in the epoch once, to the epoch-keyed parquet sink), one long-running task per
partition on local[<partitions>]. After the tasks are up (first commit) and ``--warmup``
seconds, the epochs the driver ends during ``--seconds`` are measured:

- commit latency: from the driver's ``increment_and_get_epoch`` that ends epoch ``e`` to
  ``query.commit(e)`` (the commits-log entry written): the tasks' poll delay, closing the
  epoch (``fn.finish``, the parquet file, the store commit with its fsync), the RPCs, and
  the driver's offsets log, sink commit and commits log;
- rows/s per task: the rows each partition committed between the first and the last
  measured epoch over the driver time between their ends.

The tasks take every core they are given; the machine should be otherwise idle.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from bench._common import print_header

KEY = np.dtype([("key", "<i8")])


def session(cores):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{cores}]").appName("bench-continuous")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def measure(spark, interval_ms, args):
    from pyspark_glue import RunningAggregate
    from pyspark_glue.continuous import GeneratorSource, start_continuous

    agg = RunningAggregate(KEY, "value")
    source = GeneratorSource(args.partitions, batch_rows=args.batch_rows, keys_per_partition=args.keys)
    checkpoint = tempfile.mkdtemp(prefix="bench-continuous-")
    query = start_continuous(spark, source, agg, checkpoint, KEY, agg.value_schema, agg.output_schema,
                             epoch_interval_ms=interval_ms)
    try:
        if not query.wait_for(lambda q: q.last_committed_epoch >= 1, 120):
            raise RuntimeError(f"no epoch committed within 120 s: {query.exception()}")
        time.sleep(args.warmup)  # past the burst of epochs that ended while the tasks started
        start = time.monotonic()
        time.sleep(args.seconds)
        end = time.monotonic()
        last = query.progress["current_epoch"] - 1  # ended by the driver
        if not query.wait_for(lambda q: q.last_committed_epoch >= last, 60):
            raise RuntimeError(f"epoch {last} not committed within 60 s: {query.exception()}")
        epochs = [e for e in query.progress["recent_epochs"]
                  if e["ended_at"] is not None and start <= e["ended_at"] <= end]
    finally:
        query.stop()
        shutil.rmtree(checkpoint, ignore_errors=True)
    if len(epochs) < 2:
        raise RuntimeError(f"only {len(epochs)} epoch(s) measured at {interval_ms} ms: raise --seconds")
    latencies = np.array([e["latency_s"] for e in epochs]) * 1e3
    first, last = epochs[0], epochs[-1]
    span = last["ended_at"] - first["ended_at"]
    per_task = [(b - a) / span for a, b in zip(first["offsets"], last["offsets"])]
    return {"interval_ms": interval_ms, "epochs": len(epochs), "latency_p50_ms": float(np.percentile(latencies, 50)),
            "latency_p99_ms": float(np.percentile(latencies, 99)), "latency_max_ms": float(latencies.max()),
            "rows_per_s_per_task": per_task, "rows_per_s_total": float(sum(per_task))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--intervals", default="100,1000", help="epoch intervals in ms (default %(default)s)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per interval (default %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds after the first commit (default %(default)s)")
    p.add_argument("--partitions", type=int, default=2, help="tasks = local cores (default %(default)s)")
    p.add_argument("--batch-rows", type=int, default=4096, help="rows per source batch (default %(default)s)")
    p.add_argument("--keys", type=int, default=100_000, help="distinct keys per partition (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    header = print_header("continuous execution: epoch commit latency and rows/s per task")
    print(f"# local[{args.partitions}], {args.partitions} tasks, batches of {args.batch_rows} rows, {args.keys} keys "
          f"per partition, RunningAggregate emitting to the parquet sink; {args.seconds:g} s measured after "
          f"{args.warmup:g} s warm-up")
    spark = session(args.partitions)
    results = []
    try:
        for interval in (int(x) for x in args.intervals.split(",")):
            results.append(measure(spark, interval, args))
    finally:
        spark.stop()
    print(f"\n{'interval ms':>11} {'epochs':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  rows/s per task")
    for r in results:
        tasks = ", ".join(f"{x / 1e3:,.0f}k" for x in r["rows_per_s_per_task"])
        print(f"{r['interval_ms']:>11} {r['epochs']:>6} {r['latency_p50_ms']:>8.1f} {r['latency_p99_ms']:>8.1f} "
              f"{r['latency_max_ms']:>8.1f}  {tasks} (total {r['rows_per_s_total'] / 1e3:,.0f}k)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": header, "argv": sys.argv, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
