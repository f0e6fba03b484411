"""The main job: a Structured Streaming query on local Spark keeping its state in statecore.

``python -m pyspark_glue.demo [--rows N] [--keys K] [--batches B] [--partitions P] [--dir D] [--keep] [--connect]
[--checkpoint URL]``

A real Structured Streaming query on local Spark (``local[2]``) with local files, no server:

1. writes ``B`` parquet files of events (``user_id``, ``amount``) into ``<dir>/input``;
2. streams them with the file source, one file per micro-batch (``maxFilesPerTrigger=1``,
   ``Trigger.AvailableNow``), through ``foreachBatch`` and a :class:`StatefulOperator`
   running a count and sum per ``user_id`` (:class:`RunningAggregate`), state in
   ``<dir>/state``;
3. writes each batch's updated rows to a parquet sink, ``<dir>/sink/batch_id=<b>``
   (overwritten if a batch runs again, so the sink is exactly once too);
4. prints per batch the rows, the time, the state's keys, memory and size, and how many
   partitions found their store already loaded in their Python worker (local[2] runs two
   workers and a partition's task lands in either, so about half do);
5. at the end prints the throughput, a sample of the state read back with
   :func:`read_state`, and checks the state against Spark's own ``groupBy().agg()`` over
   the input (exit status 1 if they differ).

With ``--connect`` the same job runs through Spark Connect: a local Connect server started
from PySpark's own jars (:mod:`pyspark_glue.connect_server`, its log in ``<dir>``), this
process its client. The ``foreachBatch`` function then runs in the server's Python worker, so
the per-batch lines are printed after the query, from the operator's batch records and
Spark's query progress (input rows and time per batch).

With ``--checkpoint URL`` (``s3://bucket/prefix``, or any fsspec URL or path) statecore's state
goes there instead of ``<dir>/state``, and the final check reads it back from there. The
filesystem finds its options where it looks by itself (s3fs: the ``AWS_*`` variables and
``~/.aws``), in this process and in Spark's Python workers, which inherit the environment;
before Spark starts, :func:`check_state_location` refuses a URL whose filesystem package is
missing, whose bucket cannot be reached, or which already holds files. Spark's own streaming
checkpoint (offsets, commits) stays in ``<dir>/checkpoint``: Spark would write it to S3
through ``s3a://``, whose jar (hadoop-aws) PySpark does not ship.

``<dir>`` defaults to a temporary directory, deleted at the end unless ``--keep``; a
``--dir`` given is kept, and must be empty or absent.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

KEY = np.dtype([("user_id", "<i8")])
INPUT_DDL = "user_id long, amount long"


def write_input(directory, rows, keys, batches, seed=42):
    """``batches`` parquet files of ``rows`` events in total; returns their count of rows."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = np.full(batches, rows // batches)
    sizes[: rows % batches] += 1
    for i, n in enumerate(sizes):
        table = pa.table({"user_id": pa.array(rng.integers(0, keys, n) * 7919, pa.int64()),
                          "amount": pa.array(rng.integers(1, 101, n), pa.int64())})
        tmp = os.path.join(directory, f".events-{i:05d}.parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, os.path.join(directory, f"events-{i:05d}.parquet"))
    return int(sizes.sum())


def spark_settings(partitions):
    return {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": str(partitions), "spark.sql.execution.arrow.maxRecordsPerBatch": "50000",
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}


def _worker_environment():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # The Python workers import statecore and pyspark_glue as this process does.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in [os.path.abspath(p) for p in paths]:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


def start_spark(partitions):
    _worker_environment()
    from pyspark.sql import SparkSession

    from pyspark_glue import spark_internals

    builder = SparkSession.builder.master("local[2]").appName("statecore-demo")
    for key, value in spark_settings(partitions).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark_internals.spark_context(spark).setLogLevel("ERROR")
    return spark


def start_connect(partitions, directory):
    """``(client session, server)``: a local Connect server on local[2] and its client."""
    _worker_environment()
    from pyspark_glue import connect_server

    server = connect_server.start_connect_server(spark_settings(partitions), dict(os.environ), directory)
    os.environ[connect_server.CONNECT_MODE_VARIABLE] = "1"  # PySpark's functions build Connect columns
    try:
        return connect_server.client_session(server.url), server
    except BaseException:
        server.stop()
        raise


def check_state_location(url):
    """Why statecore's state cannot go to ``url``, or None: the package of its filesystem is not
    installed (s3fs for ``s3://``), its bucket or directory cannot be listed (no such bucket, an
    endpoint that does not answer, credentials refused), or it holds files already (the demo's
    Spark checkpoint is new on every run: it cannot go on with an older run's state)."""
    import fsspec

    from statecore.files import OBJECT_STORE_PROTOCOLS

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        return f"--checkpoint {url}: the package of its filesystem is not installed ({e})"
    except ValueError as e:  # a protocol fsspec does not know
        return f"--checkpoint {url}: {e}"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    bucket = root.split("/", 1)[0] if OBJECT_STORE_PROTOCOLS.intersection(protocols) else None
    try:
        if bucket is not None:
            try:
                fs.info(bucket)
            except FileNotFoundError:
                return f"--checkpoint {url}: bucket {bucket} does not exist (or is not visible with these credentials)"
        try:
            entries = fs.ls(root)
        except FileNotFoundError:
            entries = []  # a prefix or directory not made yet: statecore makes it
    except Exception as e:  # whatever the filesystem raises (botocore's errors ...), named in the message
        return f"--checkpoint {url} cannot be reached: {type(e).__name__}: {e}"
    if entries:
        return (f"--checkpoint {url} holds {len(entries)} entries already: give an empty or new location "
                f"(each run starts a new Spark checkpoint, which cannot go on with older state)")
    return None


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="events in total (default %(default)s)")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct user ids (default %(default)s)")
    parser.add_argument("--batches", type=int, default=10, help="input files = micro-batches (default %(default)s)")
    parser.add_argument("--partitions", type=int, default=4, help="state partitions (default %(default)s)")
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--connect", action="store_true",
                        help="run through a local Spark Connect server started from PySpark's jars")
    parser.add_argument("--checkpoint", metavar="URL",
                        help="statecore's state root, empty or new: a path or an fsspec URL such as s3://bucket/prefix "
                             "(default <dir>/state); s3fs takes its endpoint and credentials from the environment "
                             "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), here and in Spark's Python workers. Spark's "
                             "own checkpoint (offsets, commits) stays local, in <dir>/checkpoint: writing it to S3 "
                             "takes Spark's s3a:// filesystem, whose jar (hadoop-aws) PySpark does not ship")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.keys < 1 or args.batches < 1 or args.partitions < 1:
        parser.error("--rows, --keys, --batches and --partitions must be >= 1")
    if args.checkpoint is not None:
        problem = check_state_location(args.checkpoint)
        if problem:
            parser.error(problem)
    if args.dir:
        if os.path.exists(args.dir) and os.listdir(args.dir):
            parser.error(f"--dir {args.dir} is not empty")
        directory, remove = os.path.abspath(args.dir), False
    else:
        directory, remove = tempfile.mkdtemp(prefix="statecore-demo-"), not args.keep
    try:
        return run(args, directory)
    finally:
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"kept {directory}")


def run(args, directory):
    started = time.perf_counter()
    source, state_root = os.path.join(directory, "input"), args.checkpoint or os.path.join(directory, "state")
    sink, checkpoint = os.path.join(directory, "sink"), os.path.join(directory, "checkpoint")
    t0 = time.perf_counter()
    total = write_input(source, args.rows, args.keys, args.batches)
    print(f"wrote {args.batches} input files, {total:,} events over up to {args.keys:,} keys, "
          f"in {time.perf_counter() - t0:.1f} s ({source}); statecore's state in {state_root}")

    t0 = time.perf_counter()
    if args.connect:
        spark, server = start_connect(args.partitions, directory)
        print(f"Spark Connect server {spark.version} local[2] started in {time.perf_counter() - t0:.1f} s "
              f"({server.url}, its log {server.log})")
    else:
        spark, server = start_spark(args.partitions), None
        print(f"Spark {spark.version} local[2] started in {time.perf_counter() - t0:.1f} s")
    try:
        return stream(spark, args, source, state_root, sink, checkpoint, total, started)
    finally:
        if server is not None:
            server.stop()


def stream(spark, args, source, state_root, sink, checkpoint, total, started):
    from pyspark.sql import functions as F

    from pyspark_glue import RunningAggregate, StatefulOperator, read_state

    aggregate = RunningAggregate(KEY, "amount")
    operator = StatefulOperator(state_root, 0, args.partitions, ["user_id"], KEY, aggregate.value_schema,
                                aggregate, aggregate.output_schema)
    batches = []

    def handle(df, batch_id):
        t_start = time.perf_counter()
        out = operator.process(df, batch_id)
        t_processed = time.perf_counter()
        out.write.mode("overwrite").parquet(os.path.join(sink, f"batch_id={batch_id}"))
        t_end = time.perf_counter()
        p = operator.last_progress
        batches.append(t_end - t_start)
        custom = p["custom_metrics"]
        print(f"batch {batch_id:>3}: {t_end - t_start:5.2f} s "
              f"(operator {t_processed - t_start:4.2f}, sink {t_end - t_processed:4.2f}) | "
              f"{p['rows_out']:>8,} keys updated | state {p['state_keys']:>9,} keys, {mib(p['memory_used_bytes'])} "
              f"in memory ({mib(custom.get('stateOnCurrentVersionSizeBytes', 0))} of rows) | "
              f"stores already loaded {p['stores_already_loaded']}/{p['num_partitions']}", flush=True)

    t0 = time.perf_counter()
    query = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
             .writeStream.queryName("statecore_demo").foreachBatch(handle)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    streaming_s = time.perf_counter() - t0
    operator.close()
    rows = sum(p.numInputRows for p in query.recentProgress)
    if args.connect:  # handle ran in the server's worker: the batches from the records and progress
        batches = print_batches_from_records(operator, query.recentProgress)
    batch_s = sum(batches)
    print(f"\nstreamed {rows:,} rows in {len(batches)} batches: {streaming_s:.1f} s wall "
          f"({rows / streaming_s:,.0f} rows/s), {batch_s:.1f} s in foreachBatch ({rows / batch_s:,.0f} rows/s)")

    t0 = time.perf_counter()
    state = read_state(spark, state_root, 0)
    keys = state.count()
    print(f"state read back with read_state: {keys:,} keys in {args.partitions} partitions "
          f"({time.perf_counter() - t0:.1f} s); the 5 biggest:")
    for r in state.orderBy(F.desc("count"), "user_id").limit(5).collect():
        print(f"  user_id {r['user_id']:>12}  count {r['count']:>4}  sum {r['sum']:>7}  partition {r['partition_id']}")
    expected = (spark.read.schema(INPUT_DDL).parquet(source).groupBy("user_id")
                .agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum")))
    ours = state.select("user_id", "count", "sum")
    differences = ours.exceptAll(expected).count() + expected.exceptAll(ours).count()
    ok = differences == 0 and rows == total
    print(f"state equals Spark's groupBy().agg() over the input: {'yes' if ok else f'NO ({differences} rows differ)'}")
    spark.stop()
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def print_batches_from_records(operator, progress):
    """One line per batch from the operator's batch records and Spark's query progress (under
    Connect the ``foreachBatch`` function ran elsewhere); returns each batch's seconds."""
    seconds = []
    for p in sorted(progress, key=lambda p: p["batchId"]):
        record = operator.commit_record(p["batchId"])
        if record is None:
            continue
        seconds.append(p["batchDuration"] / 1000)
        print(f"batch {p['batchId']:>3}: {seconds[-1]:5.2f} s | {p.numInputRows:>8,} rows in | state version "
              f"{record['version']} committed by run {record['run_id'][:8]} in {len(record['commit_ids'])} "
              f"partitions", flush=True)
    return seconds


if __name__ == "__main__":
    sys.exit(main())
