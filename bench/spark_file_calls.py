"""Spark's own state stores' file-system calls per batch and partition, counted in the JVM.

    python -m bench.spark_file_calls [--contenders hdfs,rocksdb_changelog] [--keys 100000] [--rows 10000]
                                     [--batches 130] [--maintenance-interval 1s] [--json PATH]

The race's query (:mod:`bench.race`: a running count and sum per key, ``groupBy().agg()``, one
parquet file per trigger, ``local[2]``, 2 shuffle partitions) on Spark's own state store, with its
checkpoint on ``count://``: the local disk through :file:`bench/java/statecorebench/CountingFileSystem.java`
(compiled here with ``javac`` against PySpark's jars, put on the driver's class path), which records
every call Spark makes of it. Spark's checkpoint file manager reaches it through Hadoop's
FileContext, as it reaches S3A (the file system registers an ``AbstractFileSystem`` too), so the
calls are those an S3A checkpoint would be sent; :func:`s3a_requests` turns each into S3
requests by S3A's documented costs (docs/object-storage.md, "Against Spark's HDFS state store").

Each contender runs twice, each in its own process: without maintenance (its interval an hour)
and with it every ``--maintenance-interval`` (Spark's default is 60 s; a run of a few minutes
needs a shorter one to see it at all). Calls are counted per batch (the batch id Spark sets on
the calling thread; a maintenance thread's call goes to the batch running when it was made), per
state-store partition (``<checkpoint>/state/<operator>/<partition>/...``; ``op`` for the
operator's own ``_metadata``) and apart from Spark's own logs (offsets, commits, sources,
metadata). The per-batch figures are means over the steady batches: every batch but the first
(which creates the directories) and the last (whose maintenance is cut short). They do not
depend on the number of keys or rows, so the defaults are small; the number of batches is
past Spark's default retention (``minBatchesToRetain``, 100), so that cleanup's deletes show.
"""
import argparse
import collections
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench import RACE_DATA_DIR, race
from bench._common import print_header
from bench.fs_counts import LIST_PAGE_KEYS, REQUEST_KINDS

HERE = os.path.dirname(os.path.abspath(__file__))
JAVA_SOURCE = os.path.join(HERE, "java", "statecorebench", "CountingFileSystem.java")
FS_CLASS = "statecorebench.CountingFileSystem"
SCHEME = "count"
MODULE = "bench.spark_file_calls"
CONTENDERS = ("hdfs", "rocksdb", "rocksdb_changelog")
# the calls the counting file system records, as the tables show them
CALL_KINDS = ("create", "rename", "getFileStatus", "listStatus", "open", "delete", "mkdirs")
QUERY_THREAD = "stream execution thread"  # the name of the thread that runs a query's batches
NO_MAINTENANCE = "1h"  # an interval no run reaches: Spark's maintenance never runs
Call = collections.namedtuple("Call", "ms batch thread caller call outcome paths")


# -- the counting file system --------------------------------------------------------------------------

def pyspark_jars():
    """The jar files of the installed PySpark (what Spark's JVM runs on)."""
    import pyspark

    jars = sorted(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "*.jar")))
    if not jars:
        raise RuntimeError("PySpark's jars/ folder holds no jar: is the pyspark package whole?")
    return jars


def compile_counting_fs(out_dir):
    """Compile :data:`JAVA_SOURCE` into ``out_dir`` (a class folder for the driver's class path)."""
    javac = shutil.which("javac")
    if javac is None:
        raise RuntimeError("bench.spark_file_calls needs javac (a JDK 17 or newer) on PATH to compile "
                           f"{os.path.relpath(JAVA_SOURCE, os.path.dirname(HERE))}")
    os.makedirs(out_dir, exist_ok=True)
    done = subprocess.run([javac, "-Xlint:all,-path", "-Werror", "-d", out_dir, "-cp", os.pathsep.join(pyspark_jars()),
                           JAVA_SOURCE], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"javac failed on {JAVA_SOURCE}:\n{done.stdout}{done.stderr}")
    return out_dir


def counting_settings(classes_dir, maintenance_interval):
    """The Spark settings that put the counting file system under ``count://`` and set the
    state store's maintenance interval."""
    return {"spark.driver.extraClassPath": classes_dir,
            f"spark.hadoop.fs.{SCHEME}.impl": FS_CLASS,
            f"spark.hadoop.fs.AbstractFileSystem.{SCHEME}.impl": FS_CLASS + "$Abstract",
            "spark.sql.streaming.stateStore.maintenanceInterval": maintenance_interval}


# -- reading the records -------------------------------------------------------------------------------

def parse_records(text):
    """The records of :meth:`CountingFileSystem.drain`, each a :data:`Call`. Only a task's thread
    and the query's own thread (``stream execution thread ...``) say which batch they work for;
    a call on any other thread (a maintenance thread, the log purge, the query's start) goes to
    the batch of the last call before it made on one of those (the first batch if none was).
    The other threads may carry a batch id, but a stale one: Spark's local properties are
    inherited by a new thread, so a pool started during batch 0 says 0 for ever."""
    calls = []
    for line in text.splitlines():
        if not line:
            continue
        ms, batch, thread, caller, call, outcome, *paths = line.split("\t")
        calls.append(Call(int(ms), int(batch), thread, caller, call, outcome, tuple(paths)))
    calls.sort(key=lambda c: c.ms)  # threads append in about time order; make it exact

    def own_batch(c):
        return c.batch >= 0 and (origin_of(c) == "task" or c.thread.startswith(QUERY_THREAD))

    current = next((c.batch for c in calls if own_batch(c)), 0)
    out = []
    for c in calls:
        if own_batch(c):
            current = c.batch
            out.append(c)
        else:
            out.append(c._replace(batch=current))
    return out


def is_maintenance(call):
    return call.thread.startswith("state-store-maintenance")


def area_of(path, checkpoint):
    """``("state", partition)`` for a state file (partition ``"op"`` for the operator's own
    metadata, also its schema file, which Spark keeps in partition 0's ``_metadata``),
    ``("log", name)`` for Spark's own files (offsets, commits, sources, metadata), or ``None``
    outside the checkpoint."""
    rel = os.path.relpath(path, checkpoint)
    if rel.startswith(".."):
        return None
    parts = rel.split(os.sep)
    if parts[0] != "state":
        return ("log", parts[0] if parts[0] != "." else "root")
    if len(parts) >= 3 and parts[2].isdigit() and parts[3:4] != ["_metadata"]:
        return ("state", int(parts[2]))
    return ("state", "op")


def origin_of(call):
    """``maintenance`` for Spark's maintenance threads, ``task`` for a task, else ``driver``."""
    if is_maintenance(call):
        return "maintenance"
    return "task" if call.thread.startswith("Executor task launch worker") else "driver"


# -- what each call costs on S3 -------------------------------------------------------------------------

def _cost(**kinds):
    out = dict.fromkeys(REQUEST_KINDS, 0)
    out.update(kinds)
    return out


# A getFileStatus under S3A: a HEAD of the key; a directory, or nothing, needs a LIST of the prefix too.
STATUS_COSTS = {"file": _cost(HEAD=1), "dir": _cost(HEAD=1, LIST=1), "missing": _cost(HEAD=1, LIST=1)}


def s3a_requests(call):
    """``{kind: n}``: the S3 requests S3A sends for one recorded ``call`` (the table and its sources:
    docs/object-storage.md, "Against Spark's HDFS state store")."""
    kind, outcome = call.call, call.outcome
    if kind in ("getFileStatus", "exists"):
        return dict(STATUS_COSTS[outcome])
    if kind == "create":  # overwrite: only the probe that no directory is there, then the upload
        return _cost(LIST=1, PUT=1)
    if kind == "create-no-overwrite":  # the full status probe, then the upload
        return _cost(HEAD=1, LIST=1, PUT=1)
    if kind == "rename":
        same_dir = os.path.dirname(call.paths[0]) == os.path.dirname(call.paths[1])
        # source probe (HEAD), destination probe (HEAD + LIST), the copy's own HEAD, COPY, DELETE of
        # the source; into another directory also a HEAD of the destination's parent and a LIST of the
        # source's parent (is a marker needed there now)
        return _cost(HEAD=3, LIST=1, COPY=1, DELETE=1) if same_dir else _cost(HEAD=4, LIST=2, COPY=1, DELETE=1)
    if kind == "listStatus":
        entries = 0 if outcome == "missing" else int(outcome)
        return _cost(LIST=max(1, math.ceil(entries / LIST_PAGE_KEYS)))
    if kind == "open":  # a status probe, then the GET that reads the object
        return _cost(HEAD=1, GET=1)
    if kind == "delete":
        if outcome == "file":
            return _cost(HEAD=1, DELETE=1)
        return _cost(HEAD=1, LIST=1, DELETE=1 if outcome == "dir" else 0)  # nothing to delete if missing
    if kind == "mkdirs":  # a status probe; a new directory also gets its marker object
        return _cost(HEAD=1, LIST=1, PUT=1 if outcome == "missing" else 0)
    raise ValueError(f"no S3A cost known for the call {kind!r} on {call.paths}")


def call_kind(call):
    """The column of :data:`CALL_KINDS` a recorded call is counted in."""
    return {"exists": "getFileStatus", "create-no-overwrite": "create"}.get(call.call, call.call)


# -- counting --------------------------------------------------------------------------------------------

def count_calls(calls, checkpoint):
    """``{"state": {batch: {partition: {kind: n}}}, "log": {batch: {kind: n}}, "requests": ...}``
    (the same for S3 requests), and per origin (task, maintenance, driver) for state files."""
    state = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    state_requests = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    by_origin = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    log = collections.defaultdict(collections.Counter)
    log_requests = collections.defaultdict(collections.Counter)
    callers = collections.Counter()
    for c in calls:
        area = area_of(c.paths[0], checkpoint)
        if area is None:
            continue
        kind, requests = call_kind(c), s3a_requests(c)
        if area[0] == "state":
            state[c.batch][area[1]][kind] += 1
            state_requests[c.batch][area[1]].update(requests)
            by_origin[c.batch][origin_of(c)][kind] += 1
            callers[f"{origin_of(c)} {c.caller} {c.call}"] += 1
        else:
            log[c.batch][kind] += 1
            log_requests[c.batch].update(requests)
    return {"state": state, "state_requests": state_requests, "state_by_origin": by_origin, "log": log,
            "log_requests": log_requests, "state_callers": dict(callers.most_common())}


def steady_batches(batches):
    """The batches a per-batch mean is taken over: all but the first and the last (all if fewer than 3)."""
    batches = sorted(batches)
    return batches[1:-1] if len(batches) >= 3 else batches


def mean_per_batch(per_batch, batches, keys):
    """``{key: mean over batches}`` of ``per_batch[batch][key]`` counters, for each of ``keys``."""
    return {k: statistics.mean(per_batch.get(b, {}).get(k, 0) for b in batches) for k in keys}


def summarize(counts, partitions):
    """Per steady batch: calls and S3 requests per state partition, the operator's own, the log's."""
    batches = steady_batches(set(counts["state"]) | set(counts["log"]))

    def per_partition(table, keys):
        return {str(p): mean_per_batch({b: table[b].get(p, {}) for b in table}, batches, keys)
                for p in [*range(partitions), "op"]}

    return {"steady_batches": batches,
            "state_calls": per_partition(counts["state"], CALL_KINDS),
            "state_requests": per_partition(counts["state_requests"], REQUEST_KINDS),
            "state_calls_by_origin": {o: mean_per_batch({b: counts["state_by_origin"][b].get(o, {})
                                                         for b in counts["state_by_origin"]}, batches, CALL_KINDS)
                                      for o in ("task", "maintenance", "driver")},
            "log_calls": mean_per_batch(counts["log"], batches, CALL_KINDS),
            "log_requests": mean_per_batch(counts["log_requests"], batches, REQUEST_KINDS)}


# -- one run (worker process) ----------------------------------------------------------------------------

def run_worker(args):
    """One contender's query on the counting file system; returns the records and the batches."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    conf = race.spark_settings(args.name, args.contender, args.driver_memory)
    conf.update(counting_settings(args.classes, args.maintenance_interval))
    builder = SparkSession.builder.master("local[2]")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    checkpoint = os.path.join(args.work, "checkpoint")
    recorder = spark._jvm.statecorebench.CountingFileSystem
    recorder.drain()  # nothing of an earlier session in this JVM
    query, _ = race.start_query(spark, args.contender, args.source, f"{SCHEME}://{checkpoint}", None)
    query.awaitTermination()
    exc = query.exception()
    if exc is not None:
        raise RuntimeError(f"{args.contender} failed: {exc}")
    records = recorder.drain()
    progress = [p for p in race._progress(query) if p.get("numInputRows")]
    spark.stop()
    return {"checkpoint": checkpoint, "records": records, "partitions": int(conf["spark.sql.shuffle.partitions"]),
            "batch_seconds": [p["durationMs"]["triggerExecution"] / 1e3 for p in progress],
            "maintenance_interval": args.maintenance_interval}


def _worker_main(argv):
    p = argparse.ArgumentParser()
    for a in ("name", "contender", "source", "work", "driver_memory", "out", "classes", "maintenance_interval"):
        p.add_argument(f"--{a.replace('_', '-')}", required=True)
    args = p.parse_args(argv)
    result = run_worker(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    race.end_jvm()


def measure(contender, maintenance_interval, source, work, classes, driver_memory="2g", timeout=1800):
    """Run ``contender`` in its own process with ``maintenance_interval``; its counted calls,
    summarized (:func:`summarize`), with the raw counts per batch."""
    name = f"{contender}-{maintenance_interval}"
    result = race.run_in_process(name, contender, source, os.path.join(work, name), driver_memory, timeout,
                                 module=MODULE, extra_args=["--classes", classes,
                                                            "--maintenance-interval", maintenance_interval])
    calls = parse_records(result["records"])
    counts = count_calls(calls, result["checkpoint"])
    summary = summarize(counts, result["partitions"])
    summary.update(contender=contender, maintenance_interval=maintenance_interval,
                   batch_seconds=result["batch_seconds"], calls_recorded=len(calls),
                   state_callers=counts["state_callers"],
                   per_batch={str(b): {str(p): dict(k) for p, k in parts.items()}
                              for b, parts in counts["state"].items()})
    return summary


def _table(title, rows, kinds):
    print(f"\n{title}")
    print(f"  {'':<34}" + "".join(f"{k:>14}" for k in kinds))
    for label, values in rows:
        print(f"  {label:<34}" + "".join(f"{values.get(k, 0):>14.2f}" for k in kinds))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="hdfs,rocksdb_changelog",
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rows", type=int, default=10_000, help="rows a batch")
    parser.add_argument("--batches", type=int, default=130)
    parser.add_argument("--maintenance-interval", default="1s", help="Spark's interval for the runs with maintenance")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}: pick from {', '.join(CONTENDERS)}")
    header = print_header("Spark's state stores: file-system calls and S3 requests per batch")
    print(f"# {args.batches} batches of {args.rows} rows over {args.keys} keys; maintenance every "
          f"{args.maintenance_interval} or never ({NO_MAINTENANCE}); means over batches 2..{args.batches - 1}")
    files = race.write_batches(os.path.join(RACE_DATA_DIR, f"calls-k{args.keys}-r{args.rows}-b{args.batches}"),
                               args.batches, args.rows, args.keys)
    runs = []
    with tempfile.TemporaryDirectory(prefix="statecore-spark-calls-") as work:
        classes = compile_counting_fs(os.path.join(work, "classes"))
        source = os.path.join(work, "input")
        race.link_inputs(files, source)
        for contender in contenders:
            for interval in (NO_MAINTENANCE, args.maintenance_interval):
                s = measure(contender, interval, source, work, classes, args.driver_memory)
                runs.append(s)
                label = f"{contender}, maintenance {'never' if interval == NO_MAINTENANCE else 'every ' + interval}"
                print(f"\n## {label}: batch median {statistics.median(s['batch_seconds']):.2f} s")
                _table("file-system calls per batch, on state files", [(f"partition {p}", v) for p, v in
                                                                       s["state_calls"].items()], CALL_KINDS)
                _table("  ... by who made them (both partitions)", list(s["state_calls_by_origin"].items()), CALL_KINDS)
                _table("S3 requests per batch under S3A, on state files", [(f"partition {p}", v) for p, v in
                                                                          s["state_requests"].items()], REQUEST_KINDS)
                _table("Spark's own log (offsets, commits, sources, metadata)", [("calls", s["log_calls"])], CALL_KINDS)
                _table("", [("S3 requests", s["log_requests"])], REQUEST_KINDS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "runs": runs}, f, indent=2)
    return runs


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        _worker_main(sys.argv[2:])
    else:
        main()
