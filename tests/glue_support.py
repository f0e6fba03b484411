"""What the glue tests share: the events of a running count and sum per (user, region), the
operator that keeps it, the state expected from the events, and reading a store's state
straight from its files. (tests/cluster/test_glue_cluster.py keeps its own copies: its driver runs
as a script from a venv that sees only the wheel.)"""
import functools
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statecore import StateStoreConf, StateStoreId, create_and_init_provider

KEY = np.dtype([("user", "<i8"), ("region", "S4")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<i8")])
REGIONS = np.array(["eu", "us", "apac", "latm"])
INPUT_DDL = "user long, region string, amount long"


def events(seed, n, users=40):
    """A deterministic table of n events: user, region (a string), amount."""
    rng = np.random.default_rng(seed)
    return pa.table({"user": pa.array(rng.integers(0, users, n), pa.int64()),
                     "region": pa.array(REGIONS[rng.integers(0, len(REGIONS), n)]),
                     "amount": pa.array(rng.integers(-5, 100, n), pa.int64())})


def events_df(spark, seed, n=300, users=30):
    """:func:`events` as a Spark DataFrame of :data:`INPUT_DDL`."""
    return spark.createDataFrame(events(seed, n, users).to_pandas(), INPUT_DDL)


def write_parquet(directory, name, table):
    """Write ``table`` to ``directory/name`` under a hidden name first: a file source must
    never see a partial file."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, os.path.join(directory, name))


def expected_state(tables):
    """{(user, region bytes): (count, sum)} over every event, in Python."""
    out = {}
    for t in tables:
        for user, region, amount in zip(*(t.column(c).to_pylist() for c in ("user", "region", "amount"))):
            count, total = out.get((user, region.encode()), (0, 0))
            out[(user, region.encode())] = (count + 1, total + amount)
    return out


def spark_group_by(dfs):
    """{(user, region bytes): (count, sum)} by Spark's groupBy().agg() over the union of ``dfs``."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    union = functools.reduce(DataFrame.unionByName, dfs)
    rows = union.groupBy("user", "region").agg(F.count(F.lit(1)).alias("count"), F.sum("amount").alias("sum"))
    return {(r["user"], r["region"].encode()): (r["count"], r["sum"]) for r in rows.collect()}


def state_dict(df):
    """{(user, region bytes): (count, sum)} of a DataFrame of the state or of the output."""
    return {(r["user"], bytes(r["region"])): (r["count"], r["sum"]) for r in df.collect()}


def start_query(writer, attempts=5):
    """``writer.start()``, started again (up to ``attempts`` in all) when a Spark Connect server
    timed out waiting for the query's ``foreachBatch`` Python worker to connect back: Spark
    waits a fixed 10 s for a new worker process (``PythonWorkerFactory``), which a loaded
    2-core machine running several JVMs can exceed, and nothing of the query ran then."""
    from pyspark.errors import PySparkException

    for attempt in range(1, attempts + 1):
        try:
            return writer.start()
        except PySparkException as e:
            if "failed to connect back" not in str(e) or attempt == attempts:
                raise
            print(f"the query's Python worker did not connect back in time (attempt {attempt}): starting it again")


def stream_files(spark, ddl, source, handle, checkpoint):
    """A streaming query over ``source``'s parquet files (one file a micro-batch) through
    ``foreachBatch(handle)``, run until it has processed the files present, then stopped; the
    stopped query (its ``runId``, its progress)."""
    query = start_query(spark.readStream.schema(ddl).option("maxFilesPerTrigger", 1).parquet(source)
                        .writeStream.foreachBatch(handle).option("checkpointLocation", checkpoint))
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    return query


def make_operator(state_root, fn=None, num_partitions=4, **kwargs):
    """A StatefulOperator keeping a RunningAggregate of ``amount`` per (user, region) (or
    running ``fn`` with that aggregate's schemas)."""
    from pyspark_glue import RunningAggregate, StatefulOperator

    agg = RunningAggregate(KEY, "amount")
    return StatefulOperator(state_root, 0, num_partitions, ["user", "region"], KEY, agg.value_schema,
                            agg if fn is None else fn, agg.output_schema, **kwargs)


def store_rows(state_root, partition, version, key=KEY, value=VALUE, commit_id=None, operator_id=0):
    """{key tuple: value tuple} of one partition's store at ``version`` (at ``commit_id``, or
    the default lineage), read by a fresh provider (nothing in memory)."""
    provider = create_and_init_provider(StateStoreId(str(state_root), operator_id, partition), key, value,
                                        StateStoreConf())
    try:
        store = provider.get_read_store(version, commit_id)
        try:
            return {tuple(k): tuple(v) for k, v in store.iterator()}
        finally:
            store.abort()
    finally:
        provider.close()
