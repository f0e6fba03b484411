"""Custom stateful logic with event-time timers: statecore's StatefulProcessor against Spark's
Python APIs, ``applyInPandasWithState`` (``EventTimeTimeout``) and
``transformWithStateInPandas`` (event-time timers).

``python -m bench.bench_processor [--keys 100000] [--rows 1000000] [--slow-rows 20000]
[--batches 8] [--contenders statecore,pandas_state,tws_pandas] [--json PATH]``
(``--quick``: tiny, a smoke test.)

The logic, the same in all three: per key, count the rows and remember the latest event
time; a timer ``--timeout-s`` (30 s) after it emits ``(key, count)`` and forgets the key; each
new row of the key moves the timer. The input is :mod:`bench.bench_event_time`'s (a 60 s
slice of event time per batch, 3% of rows 3-4 slices behind, watermark delay 10 s), so the
keys silent for a batch time out in the next. Each contender runs in its own process with
its own Spark session (:mod:`bench.race`'s machinery); Spark's contenders keep their state on
RocksDB (``transformWithStateInPandas`` needs it; ``applyInPandasWithState`` on HDFS, as in
the race). statecore runs ``--rows`` rows per batch; the per-key Python contenders, far
slower, ``--slow-rows`` (the same key space), and are compared in rows/s: the median over
batches 3..N of rows over ``triggerExecution``.
"""
import argparse
import functools
import json
import os
import shutil
import sys

import numpy as np

from bench import RACE_DATA_DIR, race
from bench.bench_event_time import INPUT_DDL, write_event_batches

MODULE = "bench.bench_processor"
CONTENDERS = ("statecore", "pandas_state", "tws_pandas")
OUTPUT_DDL = "key long, count long"


def statecore_processor(timeout_s, delay_s):
    from pyspark_glue import StatefulProcessor

    timeout_us = int(timeout_s * 1_000_000)

    class Inactivity(StatefulProcessor):
        key_columns = ["key"]
        key_schema = np.dtype([("key", "<i8")])
        output_schema = OUTPUT_DDL
        time_mode = "event_time"
        event_time = "ts"
        delay = f"{int(delay_s)} seconds"

        def init(self, state):
            self.seen = state.value("seen", [("count", "<i8"), ("last", "<i8")])

        def handle_input(self, groups, timers):
            last = np.maximum.reduceat(groups.column("ts"), groups.starts)
            old, found = self.seen.get(groups.keys)
            timers.delete(groups.keys[found], old["last"][found] + timeout_us)
            new = np.empty(len(groups), dtype=self.seen.dtype)
            new["count"] = np.where(found, old["count"], 0) + groups.sizes
            new["last"] = np.where(found, np.maximum(old["last"], last), last)
            self.seen.put(groups.keys, new)
            timers.register(groups.keys, new["last"] + timeout_us)

        def handle_expired_timers(self, keys, times, timers):
            import pyarrow as pa

            values, found = self.seen.get(keys)
            self.seen.clear(keys[found])
            return pa.RecordBatch.from_pydict({"key": keys["key"][found], "count": values["count"][found]})

    return Inactivity()


def _pandas_inactivity(timeout_ms):
    def inactivity(key, pdfs, state):
        import pandas as pd

        if state.hasTimedOut:
            count, _ = state.get
            state.remove()
            yield pd.DataFrame({"key": [key[0]], "count": [count]})
            return
        count, last = state.get if state.exists else (0, -1)
        for pdf in pdfs:
            count += len(pdf)
            last = max(last, int(pdf["ts"].max().timestamp() * 1000))
        state.update((count, last))
        state.setTimeoutTimestamp(max(last + timeout_ms, state.getCurrentWatermarkMs() + 1))
        yield pd.DataFrame({"key": [], "count": []}).astype("int64")

    return inactivity


def _tws_inactivity(timeout_ms):
    from pyspark.sql.streaming import StatefulProcessor

    class Inactivity(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.seen = handle.getValueState("seen", "count long, last long")

        def handleInputRows(self, key, rows, timerValues):
            import pandas as pd

            count, last = self.seen.get() if self.seen.exists() else (0, -1)
            if last >= 0:
                self.handle.deleteTimer(last + timeout_ms)
            for pdf in rows:
                count += len(pdf)
                last = max(last, int(pdf["ts"].max().timestamp() * 1000))
            self.seen.update((count, last))
            self.handle.registerTimer(last + timeout_ms)
            yield pd.DataFrame({"key": [], "count": []}).astype("int64")

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
            import pandas as pd

            count, _ = self.seen.get()
            self.seen.clear()
            yield pd.DataFrame({"key": [key[0]], "count": [count]})

        def close(self):
            pass

    return Inactivity()


def start_query(settings, spark, contender, source, checkpoint, state_root):
    """:func:`bench.race.start_query` for the processors: ``settings`` is ``(timeout_s, delay_s)``."""
    timeout_s, delay_s = settings
    events = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
    operator = None
    if contender == "statecore":
        from pyspark_glue import StatefulOperator

        operator = StatefulOperator(state_root, 0, 2, fn=statecore_processor(timeout_s, delay_s))
        writer = race.operator_writer(events, operator)
    else:
        from pyspark.sql.streaming.state import GroupStateTimeout

        watermarked = events.withWatermark("ts", f"{int(delay_s)} seconds").groupBy("key")
        timeout_ms = int(timeout_s * 1000)
        if contender == "pandas_state":
            out = watermarked.applyInPandasWithState(_pandas_inactivity(timeout_ms), OUTPUT_DDL,
                                                     "count long, last long", "Append",
                                                     GroupStateTimeout.EventTimeTimeout)
        elif contender == "tws_pandas":
            out = watermarked.transformWithStateInPandas(_tws_inactivity(timeout_ms), OUTPUT_DDL, "Append",
                                                         "EventTime")
        else:
            raise ValueError(f"unknown contender {contender!r}")
        writer = out.writeStream.outputMode("append").format("noop")
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    return query, operator


def _worker_main(argv):
    p = argparse.ArgumentParser()
    for a in ("name", "contender", "source", "work", "driver_memory", "out"):
        p.add_argument(f"--{a.replace('_', '-')}", required=True)
    for a in ("timeout-s", "delay-s"):
        p.add_argument(f"--{a}", type=float, required=True)
    args = p.parse_args(argv)
    result = race.run_streaming(args, start_query=functools.partial(start_query, (args.timeout_s, args.delay_s)))
    with open(args.out, "w") as f:
        json.dump(result, f)
    race.end_jvm()


def run_contender(args, root, files, rows, contender):
    work = os.path.join(root, contender)
    shutil.rmtree(work, ignore_errors=True)
    source = os.path.join(work, "input")
    race.link_inputs(files, source)
    raw = race.run_in_process(contender, contender, source, work, args.driver_memory, args.timeout, module=MODULE,
                              extra_args=["--timeout-s", str(args.timeout_s), "--delay-s", str(args.delay_s)])
    s = race.summarize(raw, rows, min(2, len(raw["batches"]) - 1))
    s["rows_per_batch"] = rows
    return s


def run(args):
    from bench._common import print_header

    header = print_header("custom logic with event-time timers: statecore StatefulProcessor vs "
                          "applyInPandasWithState and transformWithStateInPandas, local[2]")

    def body(root):
        results = {"machine": header, "argv": sys.argv, "settings": vars(args), "contenders": {}}
        for contender in args.contenders:
            rows = args.rows if contender == "statecore" else args.slow_rows
            data = os.path.join(args.data, f"events-k{args.keys}-r{rows}-b{args.batches}-s60-l0.03-seed{args.seed}")
            files = write_event_batches(data, args.batches, rows, args.keys, 60.0, 0.03, seed=args.seed)
            print(f"  {contender}: {rows:,} rows a batch over {args.keys:,} keys ...", flush=True)
            s = results["contenders"][contender] = run_contender(args, root, files, rows, contender)
            print(f"    {s['batch_s']:.2f} s/batch, {s['rows_per_s']:,.0f} rows/s (batches: "
                  f"{' '.join(f'{x:.2f}' for x in s['batch_seconds'])})", flush=True)
        ours = results["contenders"].get("statecore")
        print(f"\n{'contender':<14} {'rows/batch':>11} {'s/batch':>8} {'rows/s':>12} {'statecore is':>13}")
        for name, s in results["contenders"].items():
            ratio = f"{ours['rows_per_s'] / s['rows_per_s']:.0f}x" if ours and name != "statecore" else ""
            print(f"{name:<14} {s['rows_per_batch']:>11,} {s['batch_s']:>8.2f} {s['rows_per_s']:>12,.0f} {ratio:>13}")
        return results

    return race.in_work_dir(args, "statecore-processor-", body)


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--rows", type=int, default=1_000_000, help="statecore's rows per batch (default %(default)s)")
    p.add_argument("--slow-rows", type=int, default=20_000, help="the Python-per-key contenders' rows per batch")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--contenders", type=lambda s: [c for c in s.split(",") if c], default=list(CONTENDERS))
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--delay-s", type=float, default=10.0)
    p.add_argument("--driver-memory", default="8g")
    p.add_argument("--data", default=RACE_DATA_DIR)
    p.add_argument("--work", default=None)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contender process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true")
    return p


def quick_args(p):
    """The settings of ``--quick``: every contender, tiny."""
    return p.parse_args(["--keys", "2000", "--rows", "20000", "--slow-rows", "2000", "--batches", "4",
                         "--driver-memory", "2g"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        return _worker_main(argv[1:])
    args = race.parse_main_args(parser(), argv, quick_args, keep=("json", "contenders"))
    for c in args.contenders:
        if c not in CONTENDERS:
            raise SystemExit(f"unknown contender {c!r} (from {', '.join(CONTENDERS)})")
    return run(args)


if __name__ == "__main__":
    main()
