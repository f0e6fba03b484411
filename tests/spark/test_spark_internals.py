"""pyspark_glue.spark_internals: each use of a PySpark internal on a real local session, and
what each does when PySpark no longer has what it reads (a stand-in object without the
attribute): a logged loss and a stated fallback, or a clear error."""
import logging
import threading
import types

import pytest
from py4j.protocol import Py4JError

from pyspark_glue import spark_internals
from pyspark_glue.rdd import _decode_frames

LOGGER = "pyspark_glue.spark_internals"


def warnings_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


class _Raises:
    """A stand-in whose every attribute read raises what a lost py4j gateway raises."""

    def __getattr__(self, name):
        raise Py4JError(f"the gateway is gone ({name})")


def test_spark_context_of_a_session_a_context_and_something_else(spark):
    sc = spark.sparkContext
    assert spark_internals.spark_context(spark) is sc
    assert spark_internals.spark_context(sc) is sc
    with pytest.raises(TypeError, match="expected a SparkSession or SparkContext, got SimpleNamespace"):
        spark_internals.spark_context(types.SimpleNamespace())  # a session without a SparkContext


def test_context_is_active_and_a_pyspark_without_the_active_context(spark, monkeypatch, caplog):
    assert spark_internals.context_is_active(spark.sparkContext)
    assert not spark_internals.context_is_active(types.SimpleNamespace(_jsc=object()))  # not the running one
    import pyspark

    monkeypatch.setattr(pyspark, "SparkContext", type("SparkContext", (), {}))  # no _active_spark_context
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert spark_internals.context_is_active(spark.sparkContext)  # kept running, said so
    assert warnings_logged(caplog) == [
        "cannot tell whether a SparkContext is still running (type object 'SparkContext' has no attribute "
        "'_active_spark_context'): its state store coordinator stays up until stopped"]


def test_session_settings_and_a_session_whose_settings_cannot_be_read(spark, caplog):
    spark.conf.set("spark.sql.streaming.stateStore.minDeltasForSnapshot", "7")
    try:
        settings = spark_internals.session_settings(spark)
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.minDeltasForSnapshot")
    assert settings["spark.sql.streaming.stateStore.minDeltasForSnapshot"] == "7"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert spark_internals.session_settings(types.SimpleNamespace(conf=object())) == {}
        assert spark_internals.session_settings(types.SimpleNamespace(conf=_Raises())) == {}
    assert warnings_logged(caplog) == [
        "cannot read the session's SQL settings (AttributeError: 'object' object has no attribute 'getAll'): its "
        "spark.sql.streaming.stateStore.* settings are not applied, statecore's defaults are",
        "cannot read the session's SQL settings (Py4JError: the gateway is gone (getAll)): its "
        "spark.sql.streaming.stateStore.* settings are not applied, statecore's defaults are"]


def test_query_id_thread_name_first_session_and_termination_in_a_real_query(spark, tmp_path):
    """A foreachBatch sees its query's id and its stream thread's name (with the run id), and
    the termination listener reports that run once the query ends."""
    source = tmp_path / "in"
    source.mkdir()
    (source / "part.txt").write_text("a\nb\n")
    assert spark_internals.streaming_query_id(spark) is None  # outside a query
    assert spark_internals.first_session() is spark
    seen = []
    ended, ended_event = [], threading.Event()

    def on_run_id(run_id):
        ended.append(run_id)
        ended_event.set()

    listener = spark_internals.termination_listener(on_run_id)
    spark.streams.addListener(listener)
    try:
        query = (spark.readStream.text(str(source)).writeStream
                 .foreachBatch(lambda df, _batch_id: seen.append((spark_internals.streaming_query_id(df.sparkSession),
                                                                 spark_internals.jvm_thread_name(df.sparkSession))))
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        assert ended_event.wait(60), "the termination listener was not called within 60 s"
    finally:
        spark.streams.removeListener(listener)
    assert seen and all(query_id == query.id for query_id, _ in seen)
    assert all(f"runId = {query.runId}" in name for _, name in seen), seen
    assert ended == [query.runId]


def test_executor_cores_of_local_two_and_of_a_context_without_the_status_store(spark, caplog):
    assert spark_internals.executor_cores(spark.sparkContext) == [2]  # local[2]: the driver's two cores
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert spark_internals.executor_cores(types.SimpleNamespace()) is None
        assert spark_internals.executor_cores(types.SimpleNamespace(_jsc=_Raises())) is None
    assert warnings_logged(caplog) == [
        "cannot read the executors' cores (AttributeError: 'types.SimpleNamespace' object has no attribute '_jsc'): "
        "using defaultParallelism",
        "cannot read the executors' cores (Py4JError: the gateway is gone (sc)): using defaultParallelism"]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "plain"])
def test_rdd_with_preferred_locations_keeps_every_row_and_the_pipelined_function(spark, pipelined):
    sc = spark.sparkContext
    rdd = sc.parallelize(list(range(10)), 2)  # a list: a plain RDD (a range is already pipelined)
    if pipelined:
        rdd = rdd.map(lambda x: x * 3)
    base, deserializer, parent_func = spark_internals.rdd_with_preferred_locations(rdd, [["nowhere_1"], []])
    assert (parent_func is not None) == pipelined
    per_partition = base.collect()  # one list of serialized frames per partition
    assert len(per_partition) == 2
    rows = []
    for p, frames in enumerate(per_partition):
        decoded = _decode_frames(frames, deserializer)
        rows += list(parent_func(p, decoded) if parent_func is not None else decoded)
    assert rows == [x * 3 if pipelined else x for x in range(10)]


def test_arrow_schemas_are_the_ones_spark_hands_python(spark):
    """``arrow_schema_of``/``spark_schema_from_arrow`` give the Arrow types Spark's own Arrow path
    (``toArrow``) uses, and back; a value that is not a schema fails loudly (no fallback)."""
    import datetime

    import pyarrow as pa
    from pyspark.sql.types import StructType

    ddl = "id long, name string, blob binary, at timestamp, day date, x double, n int, flag boolean"
    schema = StructType.fromDDL(ddl)
    row = (1, "a", b"\x00", datetime.datetime(2026, 1, 1), datetime.date(2026, 1, 1), 1.5, 2, True)
    assert spark_internals.arrow_schema_of(schema) == spark.createDataFrame([row], ddl).toArrow().schema
    assert spark_internals.spark_schema_from_arrow(spark_internals.arrow_schema_of(schema)) == schema
    with pytest.raises((TypeError, AttributeError)):
        spark_internals.arrow_schema_of(pa.schema([("id", pa.int64())]))
