"""The suite's local Spark Connect server (pyspark_glue/connect_server.py, the ``connect_spark``
fixture): a streaming query's ``foreachBatch`` function runs in a Python process the server
starts, with a Connect session; a classic session and a Connect client live in one pytest
process, PySpark's functions switched between them by ``SPARK_CONNECT_MODE_ENABLED``."""
import json
import os

import numpy as np

from pyspark_glue.connect_server import CONNECT_MODE_VARIABLE
from tests.glue_support import INPUT_DDL, events, start_query, write_parquet


def run_available(session, source, handle, checkpoint):
    """A streaming query of ``source``'s parquet files through ``foreachBatch(handle)``, run
    until it has processed what is there, then stopped."""
    query = start_query(session.readStream.schema(INPUT_DDL).parquet(str(source)).writeStream.foreachBatch(handle)
                        .option("checkpointLocation", str(checkpoint)))
    try:
        query.processAllAvailable()
    finally:
        query.stop()


def test_a_foreach_batch_query_runs_on_the_connect_server_with_a_connect_session(connect_spark, tmp_path):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    assert isinstance(connect_spark, ConnectSession)
    source, seen = tmp_path / "in", tmp_path / "seen"
    seen.mkdir()
    write_parquet(source, "events-0.parquet", events(0, 50))

    def handle(df, batch_id):  # runs in the server's Python worker: it reports through files
        session = type(df.sparkSession)
        report = {"session": f"{session.__module__}.{session.__name__}", "rows": df.count(), "pid": os.getpid()}
        with open(os.path.join(str(seen), f"{batch_id}.json"), "w") as f:
            json.dump(report, f)

    run_available(connect_spark, source, handle, tmp_path / "checkpoint")
    assert sorted(os.listdir(seen)) == ["0.json"]
    with open(seen / "0.json") as f:
        report = json.load(f)
    assert report["session"] == "pyspark.sql.connect.session.SparkSession"
    assert report["rows"] == 50 and report["pid"] != os.getpid()


def test_a_classic_session_and_a_connect_client_in_one_process(spark, connect_spark, monkeypatch):
    """Both sessions answer in one process; ``pyspark.sql.functions`` builds Columns for the side
    ``SPARK_CONNECT_MODE_ENABLED`` names, so a test of one side runs with it set or unset."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    def total(session):
        return session.range(5).select((F.col("id") + 1).alias("x")).agg(F.sum("x")).first()[0]

    assert total(connect_spark) == 15  # the fixture set the variable
    assert SparkSession.active() is connect_spark
    monkeypatch.delenv(CONNECT_MODE_VARIABLE)
    assert total(spark) == 15
    assert SparkSession.active() is spark
    assert connect_spark.range(3).count() == 3  # a Connect plan without functions needs no switch


def test_an_operator_in_a_foreach_batch_function_reaches_the_connect_worker_as_constructed(connect_spark, tmp_path):
    """The user's case under Connect: ``foreachBatch`` over a function closing over a
    StatefulOperator. The client pickles it, the server's Python worker unpickles it: there the
    operator is the one constructed (configuration, fn, schemas), with nothing of a run
    (tests/spark/test_connect_operator.py runs its ``process`` there)."""
    from pyspark_glue import RunningAggregate, StatefulOperator
    from pyspark_glue.clocks import ManualClock

    key = np.dtype([("user", "<i8"), ("region", "S4")])
    agg = RunningAggregate(key, "amount")
    op = StatefulOperator(str(tmp_path / "state"), 3, 2, ["user", "region"], key, agg.value_schema, agg,
                          agg.output_schema, batch_id_offset=5, clock=ManualClock(42))
    source, seen = tmp_path / "in", tmp_path / "seen"
    seen.mkdir()
    write_parquet(source, "events-0.parquet", events(1, 20))

    def handle(df, batch_id):
        report = {"checkpoint": op.checkpoint_location, "operator_id": op.operator_id, "offset": op.batch_id_offset,
                  "key_schema": op.key_schema.describe(), "key": op.key_schema.key, "fn": type(op.fn).__name__,
                  "clock_ms": op.clock.now_ms(), "last_progress": op.last_progress, "pid": os.getpid()}
        with open(os.path.join(str(seen), f"{batch_id}.json"), "w") as f:
            json.dump(report, f)

    run_available(connect_spark, source, handle, tmp_path / "checkpoint")
    with open(seen / "0.json") as f:
        report = json.load(f)
    assert report.pop("pid") != os.getpid()
    assert report == {"checkpoint": str(tmp_path / "state"), "operator_id": 3, "offset": 5,
                      "key_schema": [["user", "<i8"], ["region", "|S4"]], "key": True, "fn": "RunningAggregate",
                      "clock_ms": 42, "last_progress": None}
