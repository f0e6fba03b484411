"""pyspark_glue.spark_internals without a Spark session: what each use of a PySpark internal
does when PySpark no longer has what it reads (a stand-in object without the attribute, as a
Spark Connect session or a lost py4j gateway): a logged loss and a stated fallback, or a clear
error. The same functions on a real session: tests/spark/test_spark_internals.py."""
import logging
import types

import pytest
from py4j.protocol import Py4JError

from pyspark_glue import spark_internals

LOGGER = "pyspark_glue.spark_internals"


def warnings_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_query_id_and_thread_name_of_a_session_without_a_context(caplog):
    session = types.SimpleNamespace()  # as a Spark Connect session: no sparkContext
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert spark_internals.streaming_query_id(session) is None
        assert spark_internals.jvm_thread_name(session) == ""
    assert warnings_logged(caplog) == [
        "cannot read the streaming query id of this batch (AttributeError: 'types.SimpleNamespace' object has no "
        "attribute 'sparkContext'): taken as outside a query",
        "cannot read the JVM thread name (AttributeError: 'types.SimpleNamespace' object has no attribute "
        "'sparkContext'): the query run of this batch is not known"]



def test_first_session_of_a_pyspark_without_it(monkeypatch):
    import pyspark.sql

    monkeypatch.setattr(pyspark.sql, "SparkSession", type("SparkSession", (), {}))
    assert spark_internals.first_session() is None



def test_a_terminated_event_whose_run_id_cannot_be_read_is_logged(caplog):
    class Event:  # the JVM's QueryTerminatedEvent, with the gateway gone
        def runId(self):
            raise Py4JError("the gateway is gone")

    called = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        spark_internals._TerminationCallback(called.append).onQueryTerminated(Event())
    assert called == []
    assert warnings_logged(caplog) == [
        "could not read the run id of a terminated query (its state store instances stay active until the next "
        "run or close()): the gateway is gone"]



def test_rdd_with_preferred_locations_of_an_rdd_without_its_jvm_side_raises():
    standin = types.SimpleNamespace(context=None)  # no _jrdd_deserializer, no _jrdd
    with pytest.raises(AttributeError, match="_jrdd_deserializer"):
        spark_internals.rdd_with_preferred_locations(standin, [[]])
