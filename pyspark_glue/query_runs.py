"""Which streaming query run a ``foreachBatch`` call belongs to, and a listener for a query's
end: how :class:`~pyspark_glue.StatefulOperator` loads stores under the query's own run id
and deactivates a run's store instances when it terminates (``docs/operator.md``, "Query
runs and the coordinator").

A classic session learns the query and its run through PySpark internals
(:mod:`pyspark_glue.spark_internals`). Under Spark Connect the ``foreachBatch`` function gets
``(df, batch_id)`` and nothing of the query; what names a run there is the session id of
``df.sparkSession``: the server clones the query's session once per start of the query and
gives every batch of that start the same clone (``tests/spark/test_connect_operator.py``
checks it: one id across a run's batches, a new one at a restart).
"""
import logging
import re
import uuid

from pyspark_glue import spark_internals

__all__ = ["streaming_query", "streaming_query_run", "termination_listener"]

log = logging.getLogger(__name__)

_THREAD_RUN_ID = re.compile(r"runId = ([0-9a-fA-F-]{36})")


def streaming_query(df, own_run_id):
    """``(query_id, run_id, session)`` of the batch ``df``, for an operator whose own run id
    (outside a streaming query) is ``own_run_id``: the persistent id of its streaming query (a
    str; it survives restarts from the query's checkpoint) or None; the run id (a
    ``uuid.UUID``): the query's, else ``own_run_id``; the session that started the query (where
    a listener sees it terminate) or None.

    Under Spark Connect there is no query id and no session to listen on (the next run's first
    batch deactivates the old run's instances, and the worker process ends with its run); the
    run id is ``uuid5(own_run_id, session id of df's session)``: new at every start of the
    query (a new session clone, and a new worker that unpickled the operator afresh), the same
    for every batch of one start, and never shared by two operator instances of one session
    (a client calling ``process`` itself)."""
    spark = df.sparkSession
    if spark_internals.is_connect(spark):
        return None, uuid.uuid5(own_run_id, spark.session_id), None
    query_id = spark_internals.streaming_query_id(spark)
    run_id, session = streaming_query_run(df, query_id)
    return query_id, run_id or own_run_id, session


def streaming_query_run(df, query_id):
    """``(run_id, session)`` of the classic streaming query ``query_id`` whose ``foreachBatch``
    is running, or ``(None, None)`` outside one. ``session`` is the one that started the query
    (where a listener sees it terminate), if found."""
    from pyspark.sql import SparkSession

    spark = df.sparkSession
    if not query_id:
        return None, None
    # foreachBatch runs in a clone of the session that started the query; the original
    # session (usually the first one created) knows the query.
    candidates = [SparkSession.getActiveSession(), spark_internals.first_session(), spark]
    for session in candidates:
        if session is None:
            continue
        try:
            query = session.streams.get(query_id)
        except spark_internals.SPARK_CALL_ERRORS:  # a stopped session, a clone without the query
            continue
        if query is not None:
            return uuid.UUID(query.runId), session
    # Spark names the stream execution thread "... [id = <id>, runId = <runId>]", and the
    # JVM calls of foreachBatch run on that thread.
    match = _THREAD_RUN_ID.search(spark_internals.jvm_thread_name(spark))
    return (uuid.UUID(match.group(1)), None) if match else (None, None)


def _report_termination(on_terminated, run_id):
    """``on_terminated(uuid.UUID(run_id))``, an error logged: never raised into Spark's listener bus."""
    try:
        on_terminated(uuid.UUID(str(run_id)))
    except Exception as e:
        log.warning("handling the termination of query run %s failed: %s", run_id, e)


def termination_listener(on_terminated):
    """A ``StreamingQueryListener`` calling ``on_terminated(run_id)`` (a ``uuid.UUID``) when a
    query terminates; an error there is logged, never raised into Spark's listener bus.
    Registered with ``session.streams.addListener``, it reads no other event
    (:func:`pyspark_glue.spark_internals.termination_listener`)."""
    return spark_internals.termination_listener(lambda run_id: _report_termination(on_terminated, run_id))
