"""``statecore import-spark``: Spark's own streaming aggregation runs on its
HDFSBackedStateStoreProvider, its state is imported, every retained batch reads the same
rows as Spark's ``statestore`` source, a StatefulOperator continues the query from it, and
each bad input is refused with its error and nothing written. Spark's files made by hand,
without Spark: tests/engine/test_spark_import_engine.py."""
import json
import os
import shutil
import time

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from statecore.cli import main
from statecore.cli.output import BAD_INPUT

from glue_support import write_parquet

HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
INPUT_DDL = "i int, l long, s string, v long"
WORDS = np.array(["a", "bb", "ccc", "a fairly long key"])
PARTITIONS = 4


def batch_table(seed, n=60):
    rng = np.random.default_rng(seed)
    return pa.table({"i": pa.array(rng.integers(0, 6, n), pa.int32()), "l": pa.array(rng.integers(0, 3, n) << 40),
                     "s": pa.array(WORDS[rng.integers(0, len(WORDS), n)]), "v": pa.array(rng.integers(-9, 99, n))})


def spark_settings(spark, provider, **extra):
    """Set the query's SQL settings; returns the values they replace (None: unset)."""
    conf = {"spark.sql.streaming.stateStore.providerClass": provider, "spark.sql.shuffle.partitions": str(PARTITIONS),
            **extra}
    before = {key: spark.conf.get(key, None) for key in conf}
    for key, value in conf.items():
        spark.conf.set(key, value)
    return before


def restore(spark, before):
    for key, value in before.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)


def run_aggregation(spark, root, batches, provider=HDFS, aggregate=None, first_batch=0, until=None, **extra):
    """Spark's groupBy(i, l, s).agg(count, sum) over ``batches`` (one file each, one
    micro-batch each) with ``provider``; returns the checkpoint and the input directory.
    ``until(checkpoint)``: before stopping the query (its stores stay loaded, so Spark's
    maintenance thread keeps working on them), wait up to 60 s for it to be true."""
    from pyspark.sql import functions as F

    inputs, checkpoint = f"{root}/in", f"{root}/ckpt"
    os.makedirs(inputs, exist_ok=True)
    conf = spark_settings(spark, provider, **extra)
    try:
        source = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(inputs)
        agg = aggregate or [F.count(F.lit(1)).alias("n"), F.sum("v").alias("total")]
        query = (source.groupBy("i", "l", "s").agg(*agg).writeStream.outputMode("update").format("noop")
                 .option("checkpointLocation", checkpoint).start())
        try:
            for b, table in enumerate(batches):
                write_parquet(inputs, f"part-{first_batch + b:04d}.parquet", table)
                query.processAllAvailable()
            deadline = time.monotonic() + 60
            while until is not None and not until(checkpoint) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling a condition Spark's maintenance thread makes true
        finally:
            query.stop()
    finally:
        restore(spark, conf)
    return checkpoint, inputs


def import_cli(*args):
    return CliRunner().invoke(main, ["import-spark", *map(str, args)])


def statestore_rows(spark, checkpoint, batch_id):
    """{(i, l, s bytes): (count, sum)} that Spark's statestore source reads at ``batch_id``."""
    df = spark.read.format("statestore").option("batchId", batch_id).load(f"file://{checkpoint}")
    return {(r.key.i, r.key.l, r.key.s.encode()): (r.value["count"], r.value["sum"], r.partition_id)
            for r in df.collect()}


def statecore_rows(spark, root, batch_id):
    from pyspark_glue import read_state

    df = read_state(spark, root, 0, batch_id=batch_id)
    return {(r.i, r.l, bytes(r.s).rstrip(b"\0")): (r["count"], r["sum"], r.partition_id) for r in df.collect()}


@pytest.fixture(scope="module")
def aggregation(spark, tmp_path_factory):
    """A streaming aggregation on Spark's HDFS provider, snapshotting and cleaning up often,
    run until every partition has a snapshot and has deleted its first delta (so the import
    starts from snapshots), within 14 batches."""
    root = tmp_path_factory.mktemp("spark_agg")
    tables = []
    checkpoint = None
    def cleaned_up(checkpoint):
        state = f"{checkpoint}/state/0"
        return all(any(n.endswith(".snapshot") for n in os.listdir(f"{state}/{p}"))
                   and "1.delta" not in os.listdir(f"{state}/{p}") for p in range(PARTITIONS))

    for rounds in range(1, 8):  # two batches per round, until maintenance has run in every partition
        new = [batch_table(len(tables) + k) for k in range(2)]
        checkpoint, inputs = run_aggregation(  # from 6 batches on, the clean-up can have happened: wait for it
            spark, root, new, first_batch=len(tables), until=cleaned_up if rounds >= 3 else None,
            **{"spark.sql.streaming.stateStore.minDeltasForSnapshot": "1",
               "spark.sql.streaming.minBatchesToRetain": "3",
               "spark.sql.streaming.stateStore.maintenanceInterval": "100ms"})
        tables += new
        if cleaned_up(checkpoint):
            break
    return checkpoint, inputs, tables, rounds


def test_import_matches_spark_at_every_retained_batch_and_continues(spark, aggregation, tmp_path):
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F
    from pyspark_glue import RunningAggregate, StatefulOperator

    checkpoint, inputs, tables, rounds = aggregation
    state = f"{checkpoint}/state/0"
    assert all("1.delta" not in os.listdir(f"{state}/{p}") for p in range(PARTITIONS)), \
        f"Spark's maintenance did not clean up within {2 * rounds} batches"
    target = tmp_path / "statecore"
    result = import_cli(checkpoint, target, "--operator", 0, "--value-names", "count,sum", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    first, last = summary["versions"]
    assert last == len(tables) and first > 1
    assert summary["key_columns"] == ["i", "l", "s"]
    assert summary["key_schema"] == [["i", "<i4"], ["l", "<i8"], ["s", "|S24"]]  # longest 17, rounded up
    assert summary["string_widths"]["s"]["longest"] == len("a fairly long key")
    # Every batch Spark's own statestore source still reads (those its commit log keeps) reads
    # the same rows from the import.
    committed = sorted(int(n) for n in os.listdir(f"{checkpoint}/commits") if n.isdigit())
    assert committed and first - 1 <= committed[0] and committed[-1] == last - 1
    for batch_id in committed:
        expected = statestore_rows(spark, checkpoint, batch_id)
        assert expected and statecore_rows(spark, str(target), batch_id) == expected, batch_id
    # Versions Spark had deleted are not in the import either (the placeholders are cleaned up).
    for p in range(PARTITIONS):
        versions = {int(n.split("_")[0]) for n in os.listdir(target / "0" / str(p)) if n[0].isdigit()}
        assert min(versions) >= min(v for v in range(1, last + 1) if os.path.exists(f"{state}/{p}/{v}.snapshot")
                                    or os.path.exists(f"{state}/{p}/{v}.delta"))

    key = np.dtype([tuple(f) for f in summary["key_schema"]])
    aggregate = RunningAggregate(key, "v")
    more = [batch_table(100 + k) for k in range(2)]
    with StatefulOperator(str(target), 0, PARTITIONS, summary["key_columns"], key, aggregate.value_schema, aggregate,
                          aggregate.output_schema, coordinator=False) as operator:
        for k, table in enumerate(more):
            operator.process(spark.createDataFrame(table.to_pandas(), INPUT_DDL), last + k)
    everything = [spark.createDataFrame(t.to_pandas(), INPUT_DDL) for t in tables + more]
    union = everything[0]
    for df in everything[1:]:
        union = DataFrame.unionByName(union, df)
    want = {(r.i, r.l, r.s.encode()): (r.n, r.total) for r in union.groupBy("i", "l", "s").agg(
        F.count(F.lit(1)).alias("n"), F.sum("v").alias("total")).collect()}
    got = statecore_rows(spark, str(target), last + len(more) - 1)
    assert {k: v[:2] for k, v in got.items()} == want


def test_damaged_file_and_second_import_write_nothing(spark, aggregation, tmp_path):
    checkpoint, _inputs, _tables, _rounds = aggregation
    target = tmp_path / "statecore"
    assert import_cli(checkpoint, target, "--operator", 0).exit_code == 0
    before = sorted(str(p) for p in target.rglob("*"))
    again = import_cli(checkpoint, target, "--operator", 0)
    assert again.exit_code == BAD_INPUT and "already holds a statecore checkpoint for operator 0" in again.output
    assert sorted(str(p) for p in target.rglob("*")) == before

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    newest = max((f for f in (damaged / "state" / "0" / "1").iterdir() if f.name.endswith(".delta")),
                 key=lambda f: int(f.name.split(".")[0]))
    data = bytearray(newest.read_bytes())
    data[30] ^= 0x40
    newest.write_bytes(bytes(data))
    out = tmp_path / "out"
    result = import_cli(damaged, out, "--operator", 0)
    assert result.exit_code == BAD_INPUT and str(newest) in result.output and "damaged" in result.output
    assert not out.exists()


def test_widths_and_names(spark, aggregation, tmp_path):
    checkpoint, *_ = aggregation
    short = import_cli(checkpoint, tmp_path / "a", "--operator", 0, "--string-width", "s=8")
    assert short.exit_code == BAD_INPUT and "column 's' holds a value of 17 bytes" in short.output
    assert not (tmp_path / "a").exists()
    wrong = import_cli(checkpoint, tmp_path / "b", "--operator", 0, "--value-names", "count")
    assert wrong.exit_code == BAD_INPUT and "--value-names gives 1 names for the 2 value columns" in wrong.output
    wide = import_cli(checkpoint, tmp_path / "c", "--operator", 0, "--string-width", "s=40", "--json")
    assert wide.exit_code == 0, wide.output
    assert json.loads(wide.output)["key_schema"][2] == ["s", "|S40"]
    meta = json.loads((tmp_path / "c" / "0" / "_operator.json").read_text())
    assert meta["key_column_types"] == ["int", "bigint", "string"] and meta["num_partitions"] == PARTITIONS


def test_bad_inputs(spark, aggregation, tmp_path):
    from pyspark.sql import functions as F

    checkpoint, *_ = aggregation
    cases = []
    not_spark = tmp_path / "not_spark"
    not_spark.mkdir()
    (not_spark / "notes.txt").write_text("hello")
    cases.append(((not_spark, "--operator", 0), "is not a Spark streaming checkpoint with state"))
    cases.append(((checkpoint, "--operator", 7), "operator 7 has no state"))
    rocks, _ = run_aggregation(spark, tmp_path / "rocks", [batch_table(1)], provider=ROCKSDB)
    cases.append(((rocks, "--operator", 0), "keeps its state in RocksDB"))
    wide, _ = run_aggregation(spark, tmp_path / "wide", [batch_table(2)],
                              aggregate=[F.sum(F.col("v").cast("decimal(30,2)")).alias("total")])
    cases.append(((wide, "--operator", 0), "a decimal of more than 18 digits has no fixed width"))
    listy, _ = run_aggregation(spark, tmp_path / "listy", [batch_table(3)],
                               aggregate=[F.first(F.array("v")).alias("vs")])  # buffer: an array
    cases.append(((listy, "--operator", 0), "field 'first' is of type array: only fixed-width types"))
    binary, _ = run_aggregation(spark, tmp_path / "binary", [batch_table(4)],
                                aggregate=[F.collect_list("v").alias("vs")])  # buffer: serialized bytes
    cases.append(((binary, "--operator", 0), "binary column 'buf' needs a width: --string-width buf=N"))
    cases.append(((join_checkpoint(spark, tmp_path / "join"), "--operator", 0), "is a stream-stream join"))
    for args, message in cases:
        out = tmp_path / "out"
        result = import_cli(args[0], out, *args[1:])
        assert result.exit_code == BAD_INPUT and message in result.output, (args, result.output)
        assert not out.exists(), args


def join_checkpoint(spark, root):
    """A stream-stream inner join's checkpoint (one batch), on Spark's HDFS provider."""
    from pyspark.sql import functions as F

    conf = spark_settings(spark, HDFS)
    try:
        for side in ("left", "right"):
            write_parquet(f"{root}/{side}", "part-0.parquet", batch_table(5))
        left = spark.readStream.schema(INPUT_DDL).parquet(f"{root}/left").select("i", F.col("v").alias("a"))
        right = spark.readStream.schema(INPUT_DDL).parquet(f"{root}/right").select("i", F.col("v").alias("b"))
        query = (left.join(right, "i").writeStream.format("noop")
                 .option("checkpointLocation", f"{root}/ckpt").start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()
    finally:
        restore(spark, conf)
    return f"{root}/ckpt"
