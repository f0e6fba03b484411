"""Which streaming query run a ``foreachBatch`` call belongs to, and a listener for a query's
end: how :class:`~pyspark_glue.StatefulOperator` loads stores under the query's own run id
and deactivates a run's store instances when it terminates (``docs/operator.md``, "Query
runs and the coordinator").
"""
import logging
import re
import uuid

__all__ = ["streaming_query_run", "termination_listener"]

log = logging.getLogger(__name__)

_THREAD_RUN_ID = re.compile(r"runId = ([0-9a-fA-F-]{36})")


def streaming_query_run(df):
    """``(run_id, session)`` of the streaming query whose ``foreachBatch`` is running, or
    ``(None, None)`` outside one. ``session`` is the one that started the query (where a
    listener sees it terminate), if found."""
    from pyspark.sql import SparkSession

    spark = df.sparkSession
    query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    if not query_id:
        return None, None
    # foreachBatch runs in a clone of the session that started the query; the original
    # session (usually the first one created) knows the query.
    candidates = [SparkSession.getActiveSession(), getattr(SparkSession, "_instantiatedSession", None), spark]
    for session in candidates:
        if session is None:
            continue
        try:
            query = session.streams.get(query_id)
        except Exception:  # a stopped session, a clone without the query
            continue
        if query is not None:
            return uuid.UUID(query.runId), session
    # Spark names the stream execution thread "... [id = <id>, runId = <runId>]", and py4j
    # calls from foreachBatch run on that thread.
    try:
        name = spark.sparkContext._jvm.java.lang.Thread.currentThread().getName()
    except Exception:
        name = ""
    match = _THREAD_RUN_ID.search(name or "")
    return (uuid.UUID(match.group(1)), None) if match else (None, None)


def _report_termination(on_terminated, run_id):
    """``on_terminated(uuid.UUID(run_id))``, an error logged: never raised into Spark's listener bus."""
    try:
        on_terminated(uuid.UUID(str(run_id)))
    except Exception as e:
        log.warning("handling the termination of query run %s failed: %s", run_id, e)


class _TerminationCallback:
    """The Python side of Spark's ``PythonStreamingQueryListener`` interface that reads a
    terminated query's run id and nothing else. PySpark's own side first copies every event
    into Python objects: a progress event, one per micro-batch, costs dozens of py4j round
    trips on the driver's cores while the next batch runs, which a listener waiting for the
    end need not pay."""

    def __init__(self, on_terminated):
        self._on_terminated = on_terminated

    def onQueryStarted(self, jevent):
        pass

    def onQueryProgress(self, jevent):
        pass

    def onQueryIdle(self, jevent):
        pass

    def onQueryTerminated(self, jevent):
        try:
            run_id = jevent.runId().toString()
        except Exception as e:
            log.warning("could not read the run id of a terminated query: %s", e)
            return
        _report_termination(self._on_terminated, run_id)

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


def termination_listener(on_terminated):
    """A ``StreamingQueryListener`` calling ``on_terminated(run_id)`` (a ``uuid.UUID``) when a
    query terminates; an error there is logged, never raised into Spark's listener bus.
    Registered with ``session.streams.addListener``, it hands Spark a
    :class:`_TerminationCallback`: the other events cost one empty call each."""
    from pyspark import SparkContext
    from pyspark.sql.streaming import StreamingQueryListener

    class _OnTermination(StreamingQueryListener):  # the methods PySpark's class requires
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            pass

        def onQueryTerminated(self, event):
            _report_termination(on_terminated, event.runId)

        @property
        def _jlistener(self):  # what ``addListener`` and ``removeListener`` give the JVM
            if getattr(self, "_jlistenerobj", None) is None:
                self._jlistenerobj = SparkContext._jvm.org.apache.spark.sql.streaming \
                    .PythonStreamingQueryListenerWrapper(_TerminationCallback(on_terminated))
            return self._jlistenerobj

    return _OnTermination()
