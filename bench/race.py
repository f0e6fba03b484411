"""The end-to-end race: one streaming aggregation, every state store a PySpark user could pick.

``python -m bench.race [--keys 100000,1000000] [--batches 10] [--rows 1000000] [--contenders ...]``
(``python -m bench`` runs it with the micro benchmarks; ``--quick`` shrinks everything.)

The query: a running count and sum of ``amount`` per ``key`` over micro-batches of ``--rows``
rows read from parquet files (one file per trigger), ``local[2]``, 2 state partitions,
update mode. Contenders, each in a fresh Python process with its own Spark session:

- ``hdfs``: Spark's ``groupBy().agg()`` on its default HDFS-backed state store provider;
- ``rocksdb``: the same on the RocksDB provider;
- ``rocksdb_changelog``: RocksDB with changelog checkpointing;
- ``pandas_state``: ``applyInPandasWithState`` (a Python function per key, Spark keeps the state);
- ``tws_pandas``: ``transformWithStateInPandas`` (a StatefulProcessor with a ValueState, on RocksDB);
- ``statecore``: :class:`pyspark_glue.StatefulOperator` with :class:`pyspark_glue.RunningAggregate`
  in ``foreachBatch``, as a user gets it (``pre_aggregate="auto"``: Spark aggregates each
  batch first until a batch shows most keys once); ``statecore_raw``: the same with
  ``pre_aggregate=False`` (the rows are shuffled as they are and grouped in numpy);
  ``statecore_pre``: with ``pre_aggregate=True`` (Spark aggregates every batch first);
- ``floor``: the same per-batch aggregation as a plain batch job with no state at all: what no
  Spark-based stateful query can beat;
- ``stream_floor`` (a diagnostic): that aggregation inside a streaming query's ``foreachBatch``,
  still without state: the floor plus what the streaming machinery costs per batch;
- ``hop_floor`` (a diagnostic): inside ``foreachBatch``, the batch routed by key into the
  state partitions and handed to Python by ``mapInArrow``, which only counts the rows: the
  least any Python operator that keeps its state by partition pays per batch (statecore's
  operator is this plus its state, its output and its commit);
- ``agg_hop_floor`` (a diagnostic): the batch aggregated per key in Spark (as
  ``stream_floor``) and its rows handed to Python by ``mapInArrow``, which only counts them:
  the floor of an operator that lets Spark aggregate first (statecore's pre-aggregation);
- ``statecore_connect``, ``stream_floor_connect``: ``statecore`` and ``stream_floor`` through
  a Spark Connect client of a local Connect server with the same settings
  (``pyspark_glue/connect_server.py``): the ``foreachBatch`` function runs in the Python
  process the server starts for the query. The ratio of each to its classic self in the
  same run is in the results (``statecore_connect_batch_over_statecore``).
- ``statecore_s3``, ``statecore_s3_10ms``, ``statecore_s3_50ms``: ``statecore`` with its state
  on a local S3 server (moto, ``bench/s3_server.py``, in the contender's process, reached by
  the Python workers through the endpoint in their environment), each request delayed by
  that much: the round trips of a remote object store. The ratio to ``statecore`` of the same
  run is in the results (``statecore_s3_50ms_batch_over_statecore``), and the requests of
  each kind per batch, counted at the server, in the contender's figures (``s3_requests``).
  The server's own CPU is on the machine's two cores too; a real store's is not.

Spark's queries write their updated rows to the ``noop`` sink; statecore's operator writes its
updated rows as parquet files (its materialized output), which is more work, not less (the
files are not read back: ``process(..., read_output=False)``, as a caller not using them would).

``--unix-socket`` starts every contender's Python workers on a Unix domain socket (Spark's
default is TCP on the loopback; docs/cluster.md, "Settings that matter").

``--runs N`` runs every contender N times, in turn, each round in another order, and
shows each contender's median run (with every run's s/batch): runs of the same code move
by a third at K = 100k on a 2-core machine, more than most changes.

``--small``: 50 batches of 10,000 rows over 100,000 keys for ``stream_floor``, ``hdfs`` and
``statecore``: per-batch latency (median and p95 over batches 21..50: every contender's
batches are still getting faster, JIT and all, over the first 20) when a batch's fixed
costs dominate.

Per contender: the time of each batch (``triggerExecution`` of the streaming progress; the
job's wall time for the floor), rows/s as the median over batches 3..N, the state commit time
per batch (summed over partitions, as Spark's ``commitTimeMs``), the bytes of state files in the
checkpoint, the peak resident memory of the JVM and of the Python workers (sampled from
/proc every 0.2 s), and the CPU seconds the JVM, the Python workers and the driver's Python
used over the batches (the steadier figure when wall times move between runs). The
Python-per-key contenders are far slower, so they run ``--slow-rows`` rows per batch for
``--slow-batches`` batches and are compared in rows/s.

Restart (``--restart-keys``): a query with a state of N keys is stopped, a new process starts it
again from its checkpoint with one more batch, and the time from ``start()`` to that batch's
end is taken, minus the same for a query with an empty checkpoint over the same batch (the
start-up any query pays). The 1M-key state is the race's own at K = 1M; a 10M-key state is
built by 10 batches of 1M new keys each.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench import RACE_DATA_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUT_DDL = "key long, amount long"
SPARK_CONTENDERS = ("hdfs", "rocksdb", "rocksdb_changelog", "pandas_state", "tws_pandas")
CONTENDERS = ("floor", "stream_floor", "hop_floor", "agg_hop_floor", "hdfs", "rocksdb", "rocksdb_changelog",
              "pandas_state", "tws_pandas", "statecore", "statecore_raw", "statecore_pre",
              "stream_floor_connect", "statecore_connect", "statecore_s3", "statecore_s3_10ms", "statecore_s3_50ms")
# keep no state: what the others are held against
FLOORS = ("floor", "stream_floor", "hop_floor", "agg_hop_floor", "stream_floor_connect")
# statecore's contenders: RunningAggregate's pre_aggregate for each
STATECORE_PRE_AGGREGATE = {"statecore": "auto", "statecore_raw": False, "statecore_pre": True}
# ``<contender>_connect``: the same query through a Spark Connect client of a local Connect
# server with the same settings
CONNECT_SUFFIX = "_connect"
# ``statecore_s3[_<N>ms]``: statecore's state on a local S3 server, N ms a request
S3_CONTENDER = re.compile(r"statecore_s3(?:_(\d+)ms)?")
SLOW = ("pandas_state", "tws_pandas")
RESTART_CONTENDERS = ("hdfs", "rocksdb", "rocksdb_changelog", "statecore")
_PROVIDERS = {
    "hdfs": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
    "rocksdb": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}
_CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"


# -- input -------------------------------------------------------------------------------------------

def write_batches(directory, batches, rows, keys, seed=0, distinct=False):
    """``batches`` parquet files of ``rows`` rows (``key`` uniform in [0, keys), ``amount`` 1..100),
    or with ``distinct``, keys ``i*rows .. (i+1)*rows`` shuffled in batch ``i``. Row groups of a
    quarter batch so that Spark reads each file with both cores. Reused when already there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    names = [f"batch-{i:05d}.parquet" for i in range(batches)]
    marker = os.path.join(directory, "_complete")
    if os.path.exists(marker):
        return [os.path.join(directory, n) for n in names]
    rng = np.random.default_rng(seed)
    for i, name in enumerate(names):
        if distinct:
            key = rng.permutation(rows).astype(np.int64) + i * rows
        else:
            key = rng.integers(0, keys, rows, dtype=np.int64)
        table = pa.table({"key": key, "amount": rng.integers(1, 101, rows, dtype=np.int64)})
        tmp = os.path.join(directory, f".{name}.tmp")
        pq.write_table(table, tmp, row_group_size=max(1, rows // 4))
        os.replace(tmp, os.path.join(directory, name))
    open(marker, "w").close()
    return [os.path.join(directory, n) for n in names]


def link_inputs(files, directory, prefix=""):
    """A source folder holding ``files`` (hard links; copies across filesystems), each
    named ``prefix`` + its own name."""
    os.makedirs(directory, exist_ok=True)
    for f in files:
        target = os.path.join(directory, prefix + os.path.basename(f))
        if not os.path.exists(target):
            try:
                os.link(f, target)
            except OSError:
                shutil.copy(f, target)


def tree_bytes(path, skip=()):
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in skip]
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in filenames)
    return total


# -- memory of the Spark processes ---------------------------------------------------------------------

class MemorySampler:
    """Peak RSS of this process's JVM descendant and of the Python workers under it, and the
    CPU seconds each kind used (the JVM, the workers, this driver process): on a 2-core
    machine whose timings move by a third between runs, the CPU a contender spends is the
    steadier figure of what it costs."""

    def __init__(self, interval=0.2):
        self.interval, self.jvm_peak, self.workers_peak = interval, 0, 0
        self._cpu = {}  # pid -> (kind, CPU ticks when last seen): a worker's CPU outlives it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self):
        self._start_ticks = _cpu_ticks(os.getpid())
        self._sample()
        self._baseline = {pid: ticks for pid, (_, ticks) in self._cpu.items()}  # spent before the start
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def cpu_s(self, kind):
        """CPU seconds of ``kind`` ("jvm", "workers" or "driver") since the sampler started."""
        if kind == "driver":
            ticks = _cpu_ticks(os.getpid()) - self._start_ticks
        else:
            ticks = sum(t - self._baseline.get(pid, 0) for pid, (k, t) in self._cpu.items() if k == kind)
        return ticks / os.sysconf("SC_CLK_TCK")

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self):
        jvm, workers = 0, 0
        for pid, comm, rss in _descendants(os.getpid()):
            kind = "jvm" if comm == "java" else "workers" if comm.startswith("python") else None
            if kind is None:
                continue
            if kind == "jvm":
                jvm += rss
            else:
                workers += rss
            ticks = _cpu_ticks(pid)
            if ticks is not None:
                self._cpu[pid] = (kind, ticks)
        self.jvm_peak = max(self.jvm_peak, jvm)
        self.workers_peak = max(self.workers_peak, workers)


def _cpu_ticks(pid):
    """User + system CPU of process ``pid`` in clock ticks (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


def _descendants(root):
    """(pid, comm, rss bytes) of every process under ``root``, found through the
    ``/proc/<pid>/task/<tid>/children`` lists (a handful of reads, not all of /proc)."""
    page = os.sysconf("SC_PAGE_SIZE")
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                try:
                    with open(f"/proc/{child}/comm") as f:
                        comm = f.read().strip()
                    with open(f"/proc/{child}/statm") as f:
                        rss = int(f.read().split()[1]) * page
                except (OSError, IndexError, ValueError):
                    continue
                out.append((child, comm, rss))
                todo.append(child)
    return out


# -- Spark ---------------------------------------------------------------------------------------------

def spark_settings(name, contender, driver_memory, image_cache=None, unix_socket=False):
    """The Spark settings of ``contender``'s local[2] session (see :func:`start_spark`)."""
    conf = {"spark.app.name": f"statecore-race-{name}",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.memory": driver_memory,
            "spark.sql.shuffle.partitions": "2",
            "spark.sql.streaming.noDataMicroBatches.enabled": "false",
            "spark.python.unix.domain.socket.enabled": str(unix_socket).lower()}
    contender = contender.removesuffix(CONNECT_SUFFIX)
    if contender in ("floor", "stream_floor", "agg_hop_floor"):  # the same two partitions as the streaming plans
        conf["spark.sql.adaptive.enabled"] = "false"
    if contender in ("rocksdb", "rocksdb_changelog", "tws_pandas"):
        conf["spark.sql.streaming.stateStore.providerClass"] = _PROVIDERS["rocksdb"]
    elif contender in ("hdfs", "pandas_state"):
        conf["spark.sql.streaming.stateStore.providerClass"] = _PROVIDERS["hdfs"]
    if contender == "rocksdb_changelog":
        conf[_CHANGELOG] = "true"
    if image_cache is not None:
        conf["spark.statecore.localCacheDir"] = image_cache
    return conf


def start_spark(name, contender, driver_memory, image_cache=None, unix_socket=False, work=None):
    """``(session, stop)``: the contender's local[2] session and what ends it. ``image_cache``:
    statecore's local image cache (``spark.statecore.localCacheDir``), inside the contender's
    work directory: a restart in that directory (another process) finds the images its first
    run left, as a restart on the same machine would, and they go with the directory.
    ``unix_socket``: Python workers on a Unix domain socket (docs/cluster.md, "Settings that
    matter"), else Spark's default, TCP on the loopback; only contenders with Python workers are
    affected. A ``*_connect`` contender gets a Spark Connect client of a local Connect server
    with the same settings (``pyspark_glue/connect_server.py``, its log in ``work``)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    conf = spark_settings(name, contender, driver_memory, image_cache, unix_socket)
    if contender.endswith(CONNECT_SUFFIX):
        from pyspark_glue import connect_server

        server = connect_server.start_connect_server(conf, dict(os.environ), work or tempfile.mkdtemp())
        os.environ[connect_server.CONNECT_MODE_VARIABLE] = "1"  # PySpark's functions build Connect columns
        spark = connect_server.client_session(server.url)

        def stop():
            spark.stop()
            server.stop()

        return spark, stop
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master("local[2]")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, spark.stop


def _count_sum_pandas(key, pdfs, state):
    """applyInPandasWithState: the running count and sum of one key."""
    import pandas as pd

    count, total = state.get if state.exists else (0, 0)
    for pdf in pdfs:
        count += len(pdf)
        total += int(pdf["amount"].sum())
    state.update((count, total))
    yield pd.DataFrame({"key": [key[0]], "count": [count], "sum": [total]})


def _tws_processor():
    from pyspark.sql.streaming import StatefulProcessor

    class CountSum(StatefulProcessor):
        """transformWithStateInPandas: the running count and sum of one key in a ValueState."""

        def init(self, handle):
            self.state = handle.getValueState("agg", "count long, sum long")

        def handleInputRows(self, key, rows, timerValues):
            import pandas as pd

            count, total = self.state.get() if self.state.exists() else (0, 0)
            for pdf in rows:
                count += len(pdf)
                total += int(pdf["amount"].sum())
            self.state.update((count, total))
            yield pd.DataFrame({"key": [key[0]], "count": [count], "sum": [total]})

        def close(self):
            pass

    return CountSum()


def _count_rows(batches):
    """hop_floor's Python side: the rows of its partition, counted."""
    import pyarrow as pa

    yield pa.RecordBatch.from_pydict({"rows": [sum(b.num_rows for b in batches)]})


def _statecore_operator(state_root, pre_aggregate="auto"):
    from pyspark_glue import RunningAggregate, StatefulOperator

    key = np.dtype([("key", "<i8")])
    aggregate = RunningAggregate(key, "amount", pre_aggregate=pre_aggregate)
    return StatefulOperator(state_root, 0, 2, ["key"], key, aggregate.value_schema, aggregate,
                            aggregate.output_schema)


def operator_writer(events, operator):
    """The stream ``events`` into a statecore ``operator`` by ``foreachBatch``, keeping each
    batch's progress in ``operator.history`` (what :func:`run_streaming` reads)."""
    operator.history = []

    def process(df, batch_id):
        operator.process(df, batch_id, read_output=False)  # like the noop sink of the others
        operator.history.append(operator.last_progress)

    return events.writeStream.foreachBatch(process)


def remote_operator_writer(events, operator):
    """:func:`operator_writer` under Spark Connect: the function runs in the server's Python
    process, so the operator's progress stays there (the query's own progress is read)."""
    def process(df, batch_id):
        operator.process(df, batch_id, read_output=False)

    return events.writeStream.foreachBatch(process)


def start_query(spark, contender, source, checkpoint, state_root):
    """The streaming query of ``contender`` over ``source`` (every file present, one per trigger)."""
    from pyspark.sql import functions as F

    remote = contender.endswith(CONNECT_SUFFIX)
    contender = contender.removesuffix(CONNECT_SUFFIX)
    events = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
    operator = None
    if contender in ("hdfs", "rocksdb", "rocksdb_changelog"):
        out = events.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))
    elif contender == "pandas_state":
        from pyspark.sql.streaming.state import GroupStateTimeout
        out = events.groupBy("key").applyInPandasWithState(
            _count_sum_pandas, "key long, count long, sum long", "count long, sum long", "Update",
            GroupStateTimeout.NoTimeout)
    elif contender == "tws_pandas":
        out = events.groupBy("key").transformWithStateInPandas(
            _tws_processor(), "key long, count long, sum long", "Update", "None")
    if contender == "stream_floor":
        def aggregate(df, batch_id):
            (df.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))
             .write.format("noop").mode("overwrite").save())

        writer = events.writeStream.foreachBatch(aggregate)
    elif contender == "hop_floor":
        def hop(df, batch_id):
            df.repartition(2, "key").mapInArrow(_count_rows, "rows long").collect()

        writer = events.writeStream.foreachBatch(hop)
    elif contender == "agg_hop_floor":
        def aggregate_and_hop(df, batch_id):
            (df.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))
             .mapInArrow(_count_rows, "rows long").collect())

        writer = events.writeStream.foreachBatch(aggregate_and_hop)
    elif contender in STATECORE_PRE_AGGREGATE or S3_CONTENDER.fullmatch(contender):
        operator = _statecore_operator(state_root, pre_aggregate=STATECORE_PRE_AGGREGATE.get(contender, "auto"))
        if remote:
            writer, operator = remote_operator_writer(events, operator), None
        else:
            writer = operator_writer(events, operator)
    else:
        writer = out.writeStream.outputMode("update").format("noop")
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    return query, operator


def _progress(query):
    """The query's progress as dicts, each with its ``numInputRows`` (a Connect client's JSON
    holds only the sources' counts)."""
    out = []
    for p in query.recentProgress:
        p = json.loads(p.json) if hasattr(p, "json") else dict(p)
        p.setdefault("numInputRows", sum(s.get("numInputRows", 0) for s in p.get("sources", [])))
        out.append(p)
    return out


def run_streaming(args, start_query=start_query):
    """One contender's batches (worker process); returns the result dict. ``start_query``:
    :func:`start_query` or another with its signature (the event-time race's)."""
    checkpoint = os.path.join(args.work, "checkpoint")
    state_root = os.path.join(args.work, "statecore")
    s3 = S3_CONTENDER.fullmatch(args.contender)
    s3_server = None
    if s3:  # started before Spark: its Python workers inherit the endpoint from this process
        from bench.s3_server import S3Server

        s3_server = S3Server().start()
        os.environ.update(s3_server.environment())
        state_root = f"s3://{s3_server.new_bucket()}/statecore"
        s3_server.counter.latency_s = int(s3.group(1) or 0) / 1000
        s3_server.counter.reset()
    spark, stop_spark = start_spark(args.name, args.contender, args.driver_memory,
                                    os.path.join(args.work, "image-cache"),
                                    unix_socket=getattr(args, "unix_socket", False), work=args.work)
    with MemorySampler() as memory:
        t0 = time.perf_counter()
        query, operator = start_query(spark, args.contender, args.source, checkpoint, state_root)
        query.awaitTermination()
        wall = time.perf_counter() - t0
        progress = _progress(query)
        exc = query.exception()
        if exc is not None:
            raise RuntimeError(f"{args.contender} failed: {exc}")
    batches = []
    for p in progress:
        if not p.get("numInputRows"):
            continue
        ops = p.get("stateOperators") or []
        batches.append({"rows": p["numInputRows"], "seconds": p["durationMs"]["triggerExecution"] / 1e3,
                        "add_batch_s": p["durationMs"].get("addBatch", 0) / 1e3,
                        "duration_ms": dict(p["durationMs"]),
                        "commit_s": sum(o.get("commitTimeMs", 0) for o in ops) / 1e3,
                        "late_rows": sum(o.get("numRowsDroppedByWatermark", 0) for o in ops),
                        "state_keys": sum(o.get("numRowsTotal", 0) for o in ops),
                        "state_memory_bytes": sum(o.get("memoryUsedBytes", 0) for o in ops)})
    if operator is not None:  # the operator's own figures: commit time summed over partitions, as Spark's
        operator.close()
        for batch, p in zip(batches, [p for p in operator.history if p["rows_in"]]):
            batch.update(commit_s=sum(t["commit_s"] for t in p["partitions"]), state_keys=p["state_keys"],
                         state_memory_bytes=p["memory_used_bytes"], late_rows=p.get("late_rows", 0),
                         task_s={k: max(t[k] for t in p["partitions"]) for k in ("open_s", "fn_s", "write_s")},
                         driver_s=p.get("driver_s"),
                         partitions=[{k: t[k] for k in ("worker", "already_loaded", "open_s", "fn_s", "commit_s")}
                                     for t in p["partitions"]])
    result = {"wall_s": wall, "batches": batches, "jvm_peak_bytes": memory.jvm_peak,
              "python_workers_peak_bytes": memory.workers_peak, "cpu_s": _cpu_of(memory),
              # measured here, before any later run (a restart) adds to the same checkpoint
              "state_bytes": _s3_bytes(state_root) if s3 else tree_bytes(state_root, skip=("_output",))
              if args.contender.startswith("statecore") else tree_bytes(os.path.join(checkpoint, "state")),
              "checkpoint_bytes": tree_bytes(checkpoint)}
    stop_spark()
    if s3_server is not None:
        result["s3_requests"] = s3_server.counter.snapshot()
        s3_server.stop()
    return result


def _s3_bytes(url):
    """The bytes of the state files under ``url`` on the local S3 server (its output files left out)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return sum(size for path, size in fs.du(url, total=False).items() if "/_output/" not in path)


def run_floor(args, schema=INPUT_DDL, query=None):
    """The plain batch job over each file (worker process): ``query(df)`` of each file read
    with ``schema`` to the noop sink (default: the race's count and sum per key)."""
    from pyspark.sql import functions as F

    if query is None:
        def query(df):
            return df.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))

    spark, stop_spark = start_spark(args.name, "floor", args.driver_memory)
    files = sorted(f for f in os.listdir(args.source) if f.endswith(".parquet"))
    batches = []
    with MemorySampler() as memory:
        for name in files:
            t0 = time.perf_counter()
            out = query(spark.read.schema(schema).parquet(os.path.join(args.source, name)))
            out.write.format("noop").mode("overwrite").save()
            seconds = time.perf_counter() - t0
            batches.append({"rows": None, "seconds": seconds, "commit_s": 0.0})
    stop_spark()
    return {"batches": batches, "jvm_peak_bytes": memory.jvm_peak, "python_workers_peak_bytes": memory.workers_peak,
            "cpu_s": _cpu_of(memory)}


def _cpu_of(memory):
    return {kind: memory.cpu_s(kind) for kind in ("jvm", "workers", "driver")}


def _worker_main(argv):
    p = argparse.ArgumentParser()
    for a in ("name", "contender", "source", "work", "driver_memory", "out"):
        p.add_argument(f"--{a.replace('_', '-')}", required=True)
    p.add_argument("--unix-socket", action="store_true")
    args = p.parse_args(argv)
    result = run_floor(args) if args.contender == "floor" else run_streaming(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    end_jvm()


def end_jvm(grace_s=20):
    """Make sure this process's JVM is gone before the next contender starts: after
    ``spark.stop()`` a JVM was seen to linger (RocksDB with changelog checkpointing, at 35%
    CPU), which would skew the next run and hold the parent's pipes open."""
    import signal

    jvms = [pid for pid, comm, _ in _descendants(os.getpid()) if comm == "java"]
    deadline = time.monotonic() + grace_s
    while jvms and time.monotonic() < deadline:
        jvms = [pid for pid in jvms if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.2)
    for pid in jvms:
        print(f"the JVM (pid {pid}) was still running {grace_s} s after spark.stop(): killing it", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)


def worker_options(args):
    """The race's own options a contender's process gets (flags of ``_worker``)."""
    return ["--unix-socket"] if getattr(args, "unix_socket", False) else []


_ERROR_LINE = re.compile(r"^\s*(Caused by: )?[\w.$]*(Error|Exception)\b")


def failure_summary(log_text, errors=5, last=15):
    """What a failed contender's log says: the first ``errors`` distinct lines naming an
    error or exception (a failed query's log ends with its plan, after the cause), then its
    ``last`` lines."""
    lines = log_text.strip().splitlines()
    named = list(dict.fromkeys(line.strip() for line in lines if _ERROR_LINE.search(line)))[:errors]
    if not named:
        return "\n".join(lines[-last:])
    return "\n".join(["errors in the log:", *named, "its last lines:", *lines[-last:]])


def run_in_process(name, contender, source, work, driver_memory, timeout, reuse=False, module="bench.race",
                   extra_args=()):
    """Run one contender in a fresh interpreter (its own JVM); returns its result dict
    (with ``reuse``, the result an earlier run left in ``work``, if any). ``module``'s
    ``_worker`` command runs it, given ``extra_args`` after the common ones."""
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, f"{name}.json")
    if reuse and os.path.exists(out):
        with open(out) as f:
            return dict(json.load(f), process_s=None)
    cmd = [sys.executable, "-m", module, "_worker", "--name", name, "--contender", contender,
           "--source", source, "--work", work, "--driver-memory", driver_memory, "--out", out, *extra_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t0 = time.perf_counter()
    log_path = os.path.join(work, f"{name}.log")
    with open(log_path, "w") as log:  # a file, not a pipe: a lingering child cannot block us
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        with open(log_path) as log:
            summary = failure_summary(log.read())
        raise RuntimeError(f"{name} exited with {done.returncode} (log: {log_path}):\n{summary}")
    with open(out) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - t0
    return result


# -- the race -------------------------------------------------------------------------------------------

def summarize(result, rows, first_measured):
    """rows/s as the median over the measured batches, and the other per-contender figures."""
    batches = result["batches"]
    measured = batches[first_measured:] or batches[-1:]
    seconds = statistics.median(b["seconds"] for b in measured)
    return {"batch_s": seconds, "batch_p95_s": float(np.percentile([b["seconds"] for b in measured], 95)),
            "rows_per_s": rows / seconds, "batches": batches,
            "commit_s": statistics.median(b.get("commit_s", 0.0) for b in measured),
            "batch_seconds": [b["seconds"] for b in batches],
            "jvm_peak_mib": result["jvm_peak_bytes"] / 2**20,
            "python_workers_peak_mib": result["python_workers_peak_bytes"] / 2**20,
            "cpu_s": result.get("cpu_s", {})}


def run_contender(args, keys, contender, files, slow_files, root, suffix=""):
    """One run of ``contender`` at K = ``keys`` in its own process: its summary."""
    slow = contender in SLOW
    n_rows = args.slow_rows if slow else args.rows
    work = os.path.join(root, f"{contender}-k{keys}{suffix}")
    done = os.path.join(work, f"{contender}-k{keys}.json")
    print(f"  K={keys:,} {contender} ...", flush=True)
    if args.resume and os.path.exists(done):  # finished in an earlier, interrupted run
        with open(done) as f:
            raw = dict(json.load(f), process_s=None)
    else:
        shutil.rmtree(work, ignore_errors=True)
        source = os.path.join(work, "input")
        link_inputs(slow_files if slow else files, source)
        raw = run_in_process(f"{contender}-k{keys}", contender, source, work, args.driver_memory, args.timeout,
                             extra_args=worker_options(args))
    s = summarize(raw, n_rows, 1 if slow else min(args.warmup, len(raw["batches"]) - 1))
    s["rows_per_batch"] = n_rows
    if contender not in FLOORS:  # statecore's state lives beside the query's checkpoint
        if "state_bytes" not in raw:  # a result from before the worker measured them: measure now
            ours = contender.startswith("statecore")
            raw["state_bytes"] = (tree_bytes(os.path.join(work, "statecore"), skip=("_output",)) if ours
                                  else tree_bytes(os.path.join(work, "checkpoint", "state")))
            raw["checkpoint_bytes"] = tree_bytes(os.path.join(work, "checkpoint"))
        s["state_bytes"] = raw["state_bytes"]
        s["checkpoint_bytes"] = raw["checkpoint_bytes"] + raw["state_bytes"] * contender.startswith("statecore")
    s["process_s"] = raw["process_s"]
    if "s3_requests" in raw:  # every request of the run, per batch
        s["s3_requests_per_batch"] = {k: n / len(raw["batches"]) for k, n in raw["s3_requests"].items()}
    print(f"    {s['batch_s']:.2f} s/batch, {s['rows_per_s']:,.0f} rows/s, commit {s['commit_s'] * 1e3:.0f} ms, "
          f"JVM {s['jvm_peak_mib']:.0f} MiB, workers {s['python_workers_peak_mib']:.0f} MiB "
          f"(batches: {' '.join(f'{x:.2f}' for x in s['batch_seconds'])})", flush=True)
    if suffix:  # an earlier round: its figures are kept, its files are not
        shutil.rmtree(work, ignore_errors=True)
    return s


def race(args, root, header):
    results = {"machine": header, "argv": sys.argv, "settings": vars(args), "race": {}, "restart": {}}
    for keys in args.keys:
        data = os.path.join(args.data, f"uniform-k{keys}-r{args.rows}-b{args.batches}")
        files = write_batches(data, args.batches, args.rows, keys, seed=args.seed)
        slow_data = os.path.join(args.data, f"uniform-k{keys}-r{args.slow_rows}-b{args.slow_batches}")
        slow_files = write_batches(slow_data, args.slow_batches, args.slow_rows, keys, seed=args.seed + 1)
        runs = {contender: [] for contender in args.contenders}
        for r in range(args.runs):
            # Each round in another order: a contender's place in the sequence (the page cache,
            # what the run before it left running) may move its figures.
            shift = r % len(args.contenders)
            for contender in args.contenders[shift:] + args.contenders[:shift]:
                # the last round's directories keep the plain names: the restarts reuse them
                suffix = "" if r == args.runs - 1 else f"-run{r}"
                runs[contender].append(run_contender(args, keys, contender, files, slow_files, root, suffix))
        table = {}
        for contender, summaries in runs.items():
            s = sorted(summaries, key=lambda x: x["batch_s"])[(len(summaries) - 1) // 2]  # the median run
            if len(summaries) > 1:
                s = dict(s, run_batch_s=[x["batch_s"] for x in summaries])
                print(f"  K={keys:,} {contender}: {len(summaries)} runs, s/batch "
                      f"{' '.join(f'{x:.2f}' for x in s['run_batch_s'])} -> median {s['batch_s']:.2f}", flush=True)
            table[contender] = s
        results["race"][str(keys)] = table
    return results


def restart(args, root, results):
    """Restart-to-first-batch, minus an empty query's, per contender and state size."""
    extra = write_batches(os.path.join(args.data, f"extra-r{args.rows}"), 1, args.rows, max(args.keys),
                          seed=args.seed + 7)
    sizes = []
    if max(args.keys) in args.restart_keys:
        sizes.append((max(args.keys), None))  # the race's own state
    for n in args.restart_keys:
        if n not in args.keys:
            batches = max(1, n // args.rows)
            sizes.append((n, write_batches(os.path.join(args.data, f"distinct-r{args.rows}-b{batches}"), batches,
                                           args.rows, None, seed=args.seed + 3, distinct=True)))
    for contender in sorted(set(args.restart_contenders) | set(args.big_restart_contenders), key=CONTENDERS.index):
        base_work = os.path.join(root, f"{contender}-empty")
        if not args.resume:
            shutil.rmtree(base_work, ignore_errors=True)
        link_inputs(extra, os.path.join(base_work, "input"), prefix="extra-")
        empty = run_in_process(f"{contender}-empty", contender, os.path.join(base_work, "input"), base_work,
                               args.driver_memory, args.timeout, reuse=args.resume, extra_args=worker_options(args))
        empty_s = empty["wall_s"]
        for n, build in sizes:
            if contender not in (args.restart_contenders if build is None else args.big_restart_contenders):
                continue
            if build is None:
                work = os.path.join(root, f"{contender}-k{n}")
                if not os.path.isdir(os.path.join(work, "checkpoint")):
                    continue
            else:
                work = os.path.join(root, f"{contender}-state{n}")
                if not (args.resume and os.path.exists(os.path.join(work, f"{contender}-build{n}.json"))):
                    shutil.rmtree(work, ignore_errors=True)
                    link_inputs(build, os.path.join(work, "input"))
                    print(f"  building a {n:,}-key state for {contender} ...", flush=True)
                    run_in_process(f"{contender}-build{n}", contender, os.path.join(work, "input"), work,
                                   args.driver_memory, args.timeout, extra_args=worker_options(args))
            link_inputs(extra, os.path.join(work, "input"), prefix="extra-")
            again = run_in_process(f"{contender}-restart{n}", contender, os.path.join(work, "input"), work,
                                   args.driver_memory, args.timeout, reuse=args.resume, extra_args=worker_options(args))
            for what, run in (("empty query", empty), ("restart", again)):
                if [b["rows"] for b in run["batches"]] != [args.rows]:
                    raise RuntimeError(f"{contender} {what} with {n} keys ran batches {run['batches']}, "
                                       f"not one batch of {args.rows} rows")
            entry = {"restart_s": again["wall_s"], "empty_start_s": empty_s,
                     "restart_cost_s": again["wall_s"] - empty_s,
                     "first_batch_s": again["batches"][0]["seconds"],
                     "empty_first_batch_s": empty["batches"][0]["seconds"]}
            if "task_s" in again["batches"][0]:  # statecore measures its stores' load in the tasks
                entry["state_load_s"] = again["batches"][0]["task_s"]["open_s"]
            results["restart"].setdefault(str(n), {})[contender] = entry
            print(f"  restart {contender} with {n:,} keys: {again['wall_s']:.1f} s to the first batch, "
                  f"empty query {empty_s:.1f} s -> {entry['restart_cost_s']:.1f} s", flush=True)


def add_ratios(results):
    """Pairwise ratios from the same run: what the issue's targets compare."""
    ratios = {}
    for keys, table in results["race"].items():
        r = {}
        for ours in STATECORE_PRE_AGGREGATE:
            sc = table.get(ours)
            if not sc:
                continue
            tag = "" if ours == "statecore" else ours.removeprefix("statecore_") + "_"
            for floor in FLOORS:
                if floor in table:
                    r[f"{ours}_batch_over_{floor}"] = sc["batch_s"] / table[floor]["batch_s"]
                    if "batch_p95_s" in sc and "batch_p95_s" in table[floor]:
                        r[f"{ours}_p95_over_{floor}"] = sc["batch_p95_s"] / table[floor]["batch_p95_s"]
            for other in CONTENDERS:
                if other in table and other not in (*STATECORE_PRE_AGGREGATE, *FLOORS) \
                        and not other.endswith(CONNECT_SUFFIX) and not S3_CONTENDER.fullmatch(other):
                    r[f"{tag}speedup_vs_{other}"] = sc["rows_per_s"] / table[other]["rows_per_s"]
                    if "state_bytes" in table[other]:
                        r[f"{tag}state_bytes_vs_{other}"] = sc["state_bytes"] / max(1, table[other]["state_bytes"])
        for remote in table:  # Spark Connect against the classic session, the same query in the same run
            classic = remote.removesuffix(CONNECT_SUFFIX)
            if remote != classic and classic in table:
                r[f"{remote}_batch_over_{classic}"] = table[remote]["batch_s"] / table[classic]["batch_s"]
            if S3_CONTENDER.fullmatch(remote) and "statecore" in table:  # the state on S3 against the local disk
                r[f"{remote}_batch_over_statecore"] = table[remote]["batch_s"] / table["statecore"]["batch_s"]
        if r:
            ratios[keys] = r
    for n, table in results["restart"].items():
        sc = table.get("statecore")
        if sc:
            # statecore's wall-clock difference is within the run-to-run spread of two JVM starts
            # (it came out negative); its cost is at least the stores' load its tasks measured
            cost = max(sc["restart_cost_s"], sc.get("state_load_s", 0.0), 1e-3)
            ratios[f"restart_{n}"] = {f"restart_speedup_vs_{o}": table[o]["restart_cost_s"] / cost
                                      for o in table if o != "statecore"}
    results["ratios"] = ratios
    return results


def print_tables(results):
    for keys, table in results["race"].items():
        print(f"\nK = {int(keys):,} keys  {'contender':<18} {'rows/batch':>10} {'s/batch':>8} {'p95 s':>6} {'rows/s':>11} "
              f"{'commit ms':>9} {'state MiB':>9} {'JVM MiB':>8} {'workers MiB':>11} {'CPU s: JVM':>10} {'workers':>7} "
              f"{'driver':>6}")
        for name, s in table.items():
            state = f"{s['state_bytes'] / 2**20:.1f}" if "state_bytes" in s else "-"
            p95 = f"{s['batch_p95_s']:.2f}" if "batch_p95_s" in s else "-"
            cpu = s.get("cpu_s") or {}
            cpu_cols = " ".join(f"{cpu[k]:>{w}.1f}" if k in cpu else f"{'-':>{w}}"
                                for k, w in (("jvm", 10), ("workers", 7), ("driver", 6)))
            print(f"{'':<15}{name:<18} {s['rows_per_batch']:>10,} {s['batch_s']:>8.2f} {p95:>6} {s['rows_per_s']:>11,.0f} "
                  f"{s['commit_s'] * 1e3:>9.0f} {state:>9} {s['jvm_peak_mib']:>8.0f} {s['python_workers_peak_mib']:>11.0f} "
                  f"{cpu_cols}")
    for n, table in results["restart"].items():
        print(f"\nrestart with {int(n):,} keys: " + ", ".join(
            f"{c} {e['restart_cost_s']:.1f} s ({e['restart_s']:.1f} - {e['empty_start_s']:.1f})" for c, e in table.items()))
    for what, r in results.get("ratios", {}).items():
        print(f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--keys", type=ints, default=[100_000, 1_000_000], help="key spaces K (default 100000,1000000)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per micro-batch (default %(default)s)")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--runs", type=int, default=1,
                   help="runs of every contender, in turn and each round in another order; a table shows each "
                        "contender's median run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="first batches left out of the medians (default %(default)s)")
    p.add_argument("--slow-rows", type=int, default=100_000, help="rows per batch of the per-key Python contenders")
    p.add_argument("--slow-batches", type=int, default=2)
    p.add_argument("--contenders", type=lambda s: s.split(","), default=list(CONTENDERS))
    p.add_argument("--restart-keys", type=ints, default=[1_000_000, 10_000_000],
                   help="state sizes to restart with ('' for none)")
    p.add_argument("--restart-contenders", type=lambda s: s.split(","), default=list(RESTART_CONTENDERS),
                   help="restarted with the race's own state (default %(default)s)")
    p.add_argument("--big-restart-contenders", type=lambda s: [x for x in s.split(",") if x],
                   default=["hdfs", "rocksdb", "statecore"],
                   help="restarted with the bigger --restart-keys states, built first (default %(default)s)")
    p.add_argument("--driver-memory", default="12g")
    p.add_argument("--data", default=RACE_DATA_DIR,
                   help="where input files are generated once and reused")
    p.add_argument("--work", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contender process")
    p.add_argument("--resume", action="store_true",
                   help="with --work: reuse the race results an interrupted run left there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unix-socket", action="store_true",
                   help="Python workers on a Unix domain socket (spark.python.unix.domain.socket.enabled) instead "
                        "of Spark's default, TCP on the loopback (docs/cluster.md)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="every contender and path, small (a smoke test)")
    p.add_argument("--small", action="store_true",
                   help="small batches: by default 50 batches of 10,000 rows over 100,000 keys, stream_floor, "
                        "hdfs and statecore, no restarts (per-batch latency: the median and p95 columns)")
    return p


# The defaults of ``--small`` (per-batch latency when the fixed costs of a batch dominate);
# options given with it still apply.
SMALL = dict(keys=[100_000], rows=10_000, batches=50, warmup=20, restart_keys=[],
             contenders=["stream_floor", "hdfs", "statecore"])


def quick_args(p):
    """The settings of ``--quick``: every contender and path, small."""
    return p.parse_args(["--keys", "10000", "--rows", "50000", "--batches", "4", "--slow-rows", "5000",
                         "--slow-batches", "2", "--restart-keys", "10000", "--driver-memory", "2g"])


def run(args):
    """The race (and restarts) with ``args`` from :func:`parser`; returns the results dict."""
    from bench._common import print_header

    header = print_header("end-to-end race: a running count and sum per key, local[2], 2 state partitions")

    def body(root):
        results = race(args, root, header)
        if args.restart_keys:
            restart(args, root, results)
        add_ratios(results)
        print_tables(results)
        return results

    return in_work_dir(args, "statecore-race-", body)


def in_work_dir(args, prefix, body):
    """``body(root)`` with ``root`` the ``--work`` directory (or a temporary one, removed
    after); its results dict is written to ``--json`` if given, and returned."""
    root = args.work or tempfile.mkdtemp(prefix=prefix)
    try:
        results = body(root)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return results
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)


def parse_main_args(p, argv, quick_args, keep=("json",)):
    """The arguments of a race's ``main``: ``--quick`` replaces them by ``quick_args(p)``,
    keeping those named in ``keep``."""
    args = p.parse_args(argv)
    if args.quick:
        kept = {name: getattr(args, name) for name in keep}
        args = quick_args(p)
        for name, value in kept.items():
            setattr(args, name, value)
    elif getattr(args, "small", False):
        p.set_defaults(**SMALL)
        args = p.parse_args(argv)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        return _worker_main(argv[1:])
    run(parse_main_args(parser(), argv, quick_args))


if __name__ == "__main__":
    main()
