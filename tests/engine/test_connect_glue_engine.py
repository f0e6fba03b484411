"""The glue's Spark Connect paths without a server: a stand-in Connect session (PySpark's own
Connect SparkSession class, its settings given) for the driver's coordinator, the query run
of a batch and the job description. Real Connect sessions: tests/spark/test_connect_operator.py."""
import types
import uuid

import pytest

from pyspark_glue import driver, query_runs, spark_internals


class _Conf:
    def __init__(self, settings):
        self.settings = settings

    def get(self, key, default=None):
        return self.settings.get(key, default)


def connect_session(settings, session_id="9123cb35-1429-4168-a9f4-3e86059ec49f"):
    """A Connect SparkSession that answers ``conf.get`` from ``settings`` and has ``session_id``,
    made without a server (none of its other methods may be called)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    class StandIn(ConnectSession):
        conf = property(lambda self: _Conf(settings))
        session_id = property(lambda self: session_id)

    return object.__new__(StandIn)


def test_a_connect_session_gets_one_coordinator_per_application_without_a_spark_context():
    """A user's foreachBatch worker under Connect: the coordinator is named by spark.app.id and
    bound to spark.driver.host, both read through spark.conf; two sessions of one application
    share it; it has no SparkContext to watch, and stops when stopped."""
    first = connect_session({"spark.app.id": "app-connect-1", "spark.driver.host": "127.0.0.1"})
    second = connect_session({"spark.app.id": "app-connect-1"}, session_id="7d8b98f9-04df-4b82-989f-955e6fff988c")
    assert spark_internals.is_connect(first) and spark_internals.classic_context(first) is None
    ref = driver.coordinator_for(first)
    try:
        assert driver.coordinator_for(second) is ref and driver.active_coordinator(second) is ref
        assert ref.address[0] == "127.0.0.1"
        assert driver.rpc_env_for(first).address == ref.address
        driver.deactivate(second, uuid.uuid4())  # answered by the coordinator: no error
    finally:
        driver.stop(first)
    assert driver.active_coordinator(second) is None


def test_a_connect_session_without_an_application_id_is_refused():
    with pytest.raises(RuntimeError, match="spark.app.id"):
        driver.coordinator_for(connect_session({}))


def test_under_connect_the_run_is_the_batch_session_and_the_operator():
    """Two batches of one query start (one cloned session) share a run; a restart (a new clone)
    and another operator in the same session get their own; no query id, no session to listen on."""
    own, other = uuid.uuid4(), uuid.uuid4()
    batch = types.SimpleNamespace(sparkSession=connect_session({}))
    again = types.SimpleNamespace(sparkSession=connect_session({}))
    restart = types.SimpleNamespace(sparkSession=connect_session({}, "7d8b98f9-04df-4b82-989f-955e6fff988c"))
    query_id, run, session = query_runs.streaming_query(batch, own)
    assert query_id is None and session is None
    assert query_runs.streaming_query(again, own)[1] == run
    assert query_runs.streaming_query(restart, own)[1] != run
    assert query_runs.streaming_query(batch, other)[1] != run


def test_under_connect_the_job_description_is_left_alone():
    with spark_internals.described_job(connect_session({}), "statecore operator 0 batch 0"):
        pass  # a classic-only call (sparkContext) would raise here
