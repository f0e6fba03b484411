"""Store locality on a 2-executor cluster: how often a micro-batch's task finds its store
already loaded in its Python worker, with and without the coordinator's preferred locations.

    python -m bench.bench_locality [--batches 10] [--partitions 4] [--rows 20000] [--keys 100000]
                                   [--modes prefer,no-prefer,no-coordinator] [--warmup 3] [--json PATH]

Starts ``local-cluster[2,1,1024]`` (two executor JVMs of one core each, so one Python worker
each; a local-cluster writes its executors' work directories under SPARK_HOME, so SPARK_HOME
is a scratch directory of symlinks to pyspark's files, keeping them out of the venv; and
SPARK_LOCAL_IP=127.0.0.1), then for each mode runs ``--batches``
micro-batches of a stateful RDD job through ``map_partitions_with_state_store`` over a fresh
checkpoint, the modes taking turns batch by batch (after ``--warmup`` throwaway batches of a
query of their own): each batch hash-partitions ``--rows`` random keys into ``--partitions``
and counts them into the stores (batch API, commit). Modes:

- ``prefer``: the driver's coordinator; tasks prefer the executor that last loaded their
  store (the makeRDD pilot);
- ``no-prefer``: the same coordinator (workers report, and unload the copies another
  executor took over), but no preferred locations: Spark places tasks as it likes;
- ``no-coordinator``: no coordinator at all; nothing is ever unloaded, so a worker keeps
  stale copies of every store it ever ran and "already loaded" overstates locality (the
  provider still replays the deltas it missed): shown for comparison only.

Per mode, over batches 2.. (batch 1 always loads from files):
- ``loaded``: share of tasks whose store provider was already loaded in their worker
  (``pyspark_glue.executor.open_store``; summed by a Spark accumulator);
- ``in memory``: share of tasks whose provider held the very version asked for (the
  provider's ``loadedMapCacheHitCount`` went up by one);
- ``same exec``: share of tasks that ran on the executor of the partition's previous batch;
- median seconds per batch.
The machine should be otherwise idle (``uptime`` load < 1): two executors, their Python
workers and the driver share its cores.
"""
import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

from bench._common import print_header, write_json
from statecore import StateStoreConf

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8")])
MASTER = "local-cluster[2,1,1024]"
MODES = ("prefer", "no-prefer", "no-coordinator")
# No maintenance passes during the run: with the modes taking turns in the same workers, a
# pass would check the no-coordinator mode's stores with the coordinator the previous task set.
CONF = StateStoreConf(maintenance_interval_s=3600)


def scratch_spark_home(root):
    """A SPARK_HOME of symlinks to the pip package's bin, sbin, jars and python, so that
    local-cluster's worker directories land under ``root``, not in the venv."""
    import pyspark

    package = os.path.dirname(os.path.abspath(pyspark.__file__))
    home = os.path.join(root, "spark-home")
    os.makedirs(home)
    for name in ("bin", "sbin", "jars", "python"):
        if os.path.exists(os.path.join(package, name)):
            os.symlink(os.path.join(package, name), os.path.join(home, name))
    return home


def start_session(root, executors=2, timeout_s=120):
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["SPARK_HOME"] = scratch_spark_home(root)
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join([project] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and os.path.abspath(p) != project])
    from pyspark.sql import SparkSession

    started = time.perf_counter()
    spark = (SparkSession.builder.master(MASTER).appName("statecore-bench-locality")
             .config("spark.executor.memory", "1g")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.local.dir", os.path.join(root, "local"))
             .config("spark.statecore.localCacheDir", os.path.join(root, "image-cache"))  # goes with root
             .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    jsc = spark.sparkContext._jsc.sc()
    deadline = time.monotonic() + timeout_s
    while jsc.getExecutorIds().size() < executors:
        if time.monotonic() > deadline:
            spark.stop()
            raise RuntimeError(f"only {jsc.getExecutorIds().size()} of {executors} executors registered "
                               f"after {timeout_s} s")
        time.sleep(0.2)
    return spark, time.perf_counter() - started


def count_keys(store, rows):
    """Count the batch's keys into the store (batch API) and commit; yield one record:
    (partition, worker id, loadedMapCacheHitCount, loadedMapCacheMissCount, rows)."""
    from pyspark import TaskContext

    from pyspark_glue import executor

    keys = np.fromiter(rows, dtype=np.int64)
    unique, counts = np.unique(keys, return_counts=True)
    k = np.zeros(len(unique), KEY)
    k["k"] = unique
    values, found = store.get_batch(k)
    new = np.zeros(len(unique), VALUE)
    new["count"] = np.where(found, values["count"], 0) + counts
    store.put_batch(k, new)
    store.commit()
    metrics = store.metrics.custom_metrics
    yield (TaskContext.get().partitionId(), executor.worker_executor_id(), metrics["loadedMapCacheHitCount"],
           metrics["loadedMapCacheMissCount"], len(keys))


@contextlib.contextmanager
def preferences_off(enabled):
    """Without preferences: the driver never looks locations up (the workers still report)."""
    from pyspark_glue import rdd

    if not enabled:
        yield
        return
    saved = rdd.preferred_locations
    rdd.preferred_locations = lambda state_info, coordinator: None
    try:
        yield
    finally:
        rdd.preferred_locations = saved


class Mode:
    """One mode's query: its checkpoint, run id, coordinator and what its batches saw."""

    def __init__(self, spark, mode, args, root):
        from pyspark_glue import driver

        self.spark, self.mode, self.args = spark, mode, args
        self.checkpoint = os.path.join(root, f"checkpoint-{mode}")
        self.run = uuid.uuid4()
        self.coordinator = None if mode == "no-coordinator" else driver.coordinator_for(spark)
        self.rng = np.random.default_rng(args.seed)
        self.records, self.seconds, self.loads = [], [], []

    def batch(self, batch):
        from pyspark_glue.rdd import StatefulOperatorStateInfo, load_count_accumulator, map_partitions_with_state_store

        sc, args = self.spark.sparkContext, self.args
        keys = [(int(k), None) for k in self.rng.integers(0, args.keys, args.rows)]
        data = sc.parallelize(keys, args.partitions).partitionBy(args.partitions).keys()
        info = StatefulOperatorStateInfo(self.checkpoint, self.run, 0, batch, args.partitions)
        acc = load_count_accumulator(sc)
        started = time.perf_counter()
        with preferences_off(self.mode == "no-prefer"):
            out = map_partitions_with_state_store(data, count_keys, info, KEY, VALUE, CONF, self.coordinator,
                                                  load_accumulator=acc).collect()
        self.seconds.append(time.perf_counter() - started)
        self.loads.append(acc.value)
        self.records.append(sorted(out))
        assert sum(r[4] for r in out) == args.rows

    def finish(self):
        if self.coordinator is not None:
            self.coordinator.deactivate_instances(self.run)
        return summarize(self.mode, self.records, self.seconds, self.loads)


def run_modes(spark, modes, args, root):
    """Batch ``i`` of every mode, then batch ``i + 1``: the modes share the JVMs' warm-up and
    whatever else the machine does meanwhile. A few warm-up batches (a throwaway query with
    preferences) come first."""
    warm = argparse.Namespace(**{**vars(args), "seed": args.seed + 1})
    warmup = Mode(spark, "prefer", warm, os.path.join(root, "warmup"))
    for batch in range(args.warmup):
        warmup.batch(batch)
    warmup.finish()
    runs = [Mode(spark, mode, args, root) for mode in modes]
    for batch in range(args.batches):
        for run in runs:
            run.batch(batch)
    return [run.finish() for run in runs]


def summarize(mode, records, seconds, loads):
    last = {}  # (worker, partition) -> (hits, misses) seen last
    executor_of = {}  # partition -> spark executor id of its previous batch
    tasks = loaded = in_memory = same_executor = 0
    workers = set()
    placement = []  # per batch, the spark executor id of each partition
    for batch, out in enumerate(records):
        placement.append("".join(worker.rsplit(".", 1)[0] for _, worker, _, _, _ in sorted(out)))
        for partition, worker, hits, misses, _rows in out:
            workers.add(worker)
            spark_executor = worker.rsplit(".", 1)[0]
            before = last.get((worker, partition))
            if batch > 0:
                tasks += 1
                in_memory += before is not None and hits == before[0] + 1 and misses == before[1]
                same_executor += executor_of.get(partition) == spark_executor
            last[(worker, partition)] = (hits, misses)
            executor_of[partition] = spark_executor
    for already, _files in loads[1:]:
        loaded += already
    return {
        "mode": mode, "batches": len(records), "tasks_after_first_batch": tasks,
        "loaded_share": loaded / tasks if tasks else 0.0,
        "in_memory_share": in_memory / tasks if tasks else 0.0,
        "same_executor_share": same_executor / tasks if tasks else 0.0,
        "median_batch_s": statistics.median(seconds), "first_batch_s": seconds[0],
        "python_workers": sorted(workers), "placement": placement, "batch_s": seconds,
        "loads_per_batch": [list(x) for x in loads],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--rows", type=int, default=20_000, help="keys per batch (default %(default)s)")
    p.add_argument("--keys", type=int, default=100_000, help="key space (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--warmup", type=int, default=3, help="throwaway batches first (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")

    header = print_header("store locality: map_partitions_with_state_store on " + MASTER)
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    root = tempfile.mkdtemp(prefix="statecore-bench-locality-")
    spark = None
    try:
        spark, startup_s = start_session(root)
        print(f"# session with 2 executors in {startup_s:.1f} s; {args.batches} batches x {args.rows} keys "
              f"into {args.partitions} partitions, spark.locality.wait "
              f"{spark.sparkContext.getConf().get('spark.locality.wait', '3s')}")
        results = run_modes(spark, modes, args, root)
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'mode':<16} {'tasks':>5} {'loaded':>7} {'in memory':>9} {'same exec':>9} {'median s':>9} "
          f"{'1st s':>6} {'workers':>7}")
    for r in results:
        print(f"{r['mode']:<16} {r['tasks_after_first_batch']:>5} {r['loaded_share']:>7.0%} "
              f"{r['in_memory_share']:>9.0%} {r['same_executor_share']:>9.0%} {r['median_batch_s']:>9.2f} "
              f"{r['first_batch_s']:>6.2f} {len(r['python_workers']):>7}")
    for r in results:
        print(f"# {r['mode']}: executor of each partition per batch: {' '.join(r['placement'])}")
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        write_json(args.json, header, [], {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
