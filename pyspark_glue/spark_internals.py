"""Every use of a PySpark internal in the glue, one small function each.

An internal is anything PySpark does not promise to keep: ``SparkSession.sparkContext``
(absent under Spark Connect), the py4j gateway (``_jvm``, ``_jsc``), private attributes of
PySpark's classes, the JVM classes behind them. The rest of the glue calls these functions
and names none of those (``tests/test_import_boundaries.py`` checks). Each function says what
it returns, not how, so that another way of getting it (Spark Connect) changes this module
only; each docstring names the PySpark version it was checked on, and what a failure loses.

All were checked on PySpark 4.3.0 with py4j 0.10.9.9 (``pip show pyspark`` in the project's
venv); ``tests/test_spark_internals.py`` runs each on a local session, and its failure path
on a stand-in that lacks the attribute. A failure is caught only as the exceptions it can
really raise (``AttributeError`` when PySpark moved a name, py4j's ``Py4JError``, which covers
a Java exception and a lost gateway) and logged with what is lost; anything else propagates.
The rule, for users on other PySpark versions: docs/cluster.md, "PySpark versions".
"""
import contextlib
import logging
import sys

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException

__all__ = ["is_connect", "classic_context", "described_job", "spark_context", "context_is_active",
           "session_settings", "streaming_query_id", "first_session", "jvm_thread_name", "executor_cores",
           "termination_listener", "rdd_with_preferred_locations", "arrow_schema_of", "spark_schema_from_arrow",
           "worker_python", "SPARK_CALL_ERRORS"]

log = logging.getLogger(__name__)

_MOVED = (AttributeError, Py4JError)  # what a renamed internal or a gone gateway raises

#: What a call of PySpark's public API that reaches Spark can raise when Spark refuses or is
#: gone: PySpark's own errors (a captured Java exception, a Connect server's error) and py4j's
#: (a classic session's gateway lost). Callers that can go on without the answer catch these.
SPARK_CALL_ERRORS = (PySparkException, Py4JError)


_CONNECT_CLASSES = (("pyspark.sql.connect.session", "SparkSession"), ("pyspark.sql.connect.dataframe", "DataFrame"))


def is_connect(obj):
    """Whether ``obj`` is a Spark Connect session or DataFrame (``pyspark.sql.connect.session.
    SparkSession``, ``pyspark.sql.connect.dataframe.DataFrame``: no SparkContext, no py4j and none
    of this module's other internals). Checked on PySpark 4.3.0. The modules are looked up among
    those already imported, never imported here: a process that never imported them holds no
    Connect object, and importing them needs the Connect client's packages (grpcio ...)."""
    for module_name, class_name in _CONNECT_CLASSES:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(obj, getattr(module, class_name)):
            return True
    return False


def classic_context(spark):
    """The SparkContext of a classic SparkSession (or ``spark`` itself if it is a SparkContext),
    or None under Spark Connect: the one way the glue asks "is there a SparkContext here"."""
    return None if is_connect(spark) else spark_context(spark)


@contextlib.contextmanager
def described_job(spark, description):
    """Spark jobs started inside show ``description`` in Spark's UI (``sc.setJobDescription``,
    the previous one restored afterwards: a streaming query sets one per batch). Checked on
    PySpark 4.3.0. Under Spark Connect: nothing (a Connect client has no job description;
    the jobs keep the query's)."""
    sc = classic_context(spark)
    if sc is None:
        yield
        return
    before = sc.getLocalProperty("spark.job.description")
    sc.setJobDescription(description)
    try:
        yield
    finally:
        sc.setJobDescription(before)


def spark_context(spark):
    """The SparkContext of a SparkSession (``SparkSession.sparkContext``), or ``spark`` itself
    if it is one (it has the JVM handle ``_jsc``). Checked on PySpark 4.3.0. A TypeError
    for anything else (a Spark Connect session has no SparkContext): nothing to fall back on."""
    sc = getattr(spark, "sparkContext", spark)
    if not hasattr(sc, "_jsc"):
        raise TypeError(f"expected a SparkSession or SparkContext, got {type(spark).__name__}")
    return sc


def context_is_active(sc):
    """Whether ``sc`` is the running SparkContext: PySpark's ``SparkContext._active_spark_context``
    is it, and ``stop()`` has not cleared its ``_jsc``. Checked on PySpark 4.3.0. If PySpark
    lacks those attributes: logged, and True (the coordinator of ``sc`` is then stopped only
    by ``pyspark_glue.driver.stop`` or at exit, not when the context stops)."""
    from pyspark import SparkContext
    try:
        return SparkContext._active_spark_context is sc and sc._jsc is not None
    except AttributeError as e:
        log.warning("cannot tell whether a SparkContext is still running (%s): its state store coordinator "
                    "stays up until stopped", e)
        return True


def session_settings(spark):
    """The session's runtime SQL settings as a dict (``spark.conf.getAll``: a property in
    PySpark 4, a method in some versions; checked on 4.3.0). If they cannot be read: logged,
    and ``{}``: the session's ``spark.sql.streaming.stateStore.*`` settings are not applied,
    statecore's defaults are."""
    try:
        settings = spark.conf.getAll
        return dict(settings() if callable(settings) else settings)
    except _MOVED as e:
        log.warning("cannot read the session's SQL settings (%s: %s): its spark.sql.streaming.stateStore.* "
                    "settings are not applied, statecore's defaults are", type(e).__name__, e)
        return {}


def streaming_query_id(spark):
    """The id of the streaming query whose ``foreachBatch`` runs on this thread (the local
    property ``sql.streaming.queryId`` of ``spark``'s context), or None outside one. Checked
    on PySpark 4.3.0. If it cannot be read: logged, and None (the batch is then taken as
    outside a query: the operator's own run id, no query id in its records)."""
    try:
        return spark.sparkContext.getLocalProperty("sql.streaming.queryId") or None
    except _MOVED as e:
        log.warning("cannot read the streaming query id of this batch (%s: %s): taken as outside a query",
                    type(e).__name__, e)
        return None


def arrow_schema_of(schema):
    """The ``pyarrow.Schema`` Spark's Arrow paths (``mapInArrow``, ``toArrow``) use for the
    StructType ``schema``, timestamps in UTC (``pyspark.sql.pandas.types.to_arrow_schema``, a
    module PySpark's API reference leaves out). Checked on PySpark 4.3.0. No fallback: a
    schema is needed, so a failure propagates."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def spark_schema_from_arrow(schema):
    """The StructType of the ``pyarrow.Schema`` ``schema``, as Spark reads Arrow
    (``pyspark.sql.pandas.types.from_arrow_schema``). Checked on PySpark 4.3.0. No fallback:
    a failure propagates."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def worker_python(sc):
    """The interpreter the SparkContext ``sc`` starts its Python workers with, as given
    (``sc.pythonExec``: PYSPARK_PYTHON when the context was made, else ``python3``), or None
    if it cannot be read (logged: the workers' interpreter is then not checked). Checked on
    PySpark 4.3.0."""
    try:
        return str(sc.pythonExec)
    except _MOVED as e:
        log.warning("cannot read the Python workers' interpreter (%s: %s): not checked", type(e).__name__, e)
        return None


def first_session():
    """The first SparkSession this process created (``SparkSession._instantiatedSession``),
    or None. Checked on PySpark 4.3.0. Read with a default: if PySpark drops it, None (a
    query started there is then found only through the active session or the thread name)."""
    from pyspark.sql import SparkSession
    return getattr(SparkSession, "_instantiatedSession", None)


def jvm_thread_name(spark):
    """The name of the JVM thread that runs this thread's calls into the JVM (py4j pins a
    Python thread to one; ``foreachBatch`` runs on the stream execution thread, named
    ``... [id = <id>, runId = <runId>]``), or ``""``. Checked on PySpark 4.3.0. If it
    cannot be read: logged, and ``""`` (the batch's query run is then not known)."""
    try:
        return str(spark.sparkContext._jvm.java.lang.Thread.currentThread().getName())
    except _MOVED as e:
        log.warning("cannot read the JVM thread name (%s: %s): the query run of this batch is not known",
                    type(e).__name__, e)
        return ""


def executor_cores(sc):
    """The total cores of each registered executor (the driver's in local mode), read from
    the JVM's status store (``sc._jsc.sc().statusStore().executorList``), or None if they
    cannot be read (logged: the caller falls back to ``defaultParallelism``). Checked on
    PySpark 4.3.0."""
    try:
        executors = sc._jsc.sc().statusStore().executorList(True)
        return [int(executors.apply(i).totalCores()) for i in range(executors.size())]
    except _MOVED as e:
        log.warning("cannot read the executors' cores (%s: %s): using defaultParallelism", type(e).__name__, e)
        return None


class _TerminationCallback:
    """The Python side of Spark's ``PythonStreamingQueryListener`` interface (a py4j callback)
    that reads a terminated query's run id and nothing else: PySpark's own side first copies
    every event into Python objects, and a progress event, one per micro-batch, costs dozens
    of py4j round trips on the driver's cores while the next batch runs."""

    def __init__(self, on_run_id):
        self._on_run_id = on_run_id

    def onQueryStarted(self, jevent):
        pass

    def onQueryProgress(self, jevent):
        pass

    def onQueryIdle(self, jevent):
        pass

    def onQueryTerminated(self, jevent):
        try:
            run_id = jevent.runId().toString()
        except _MOVED as e:
            log.warning("could not read the run id of a terminated query (its state store instances stay "
                        "active until the next run or close()): %s", e)
            return
        self._on_run_id(str(run_id))

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


def termination_listener(on_run_id):
    """A ``StreamingQueryListener`` (for ``session.streams.addListener``) that calls
    ``on_run_id(run_id)`` (a string) when a query terminates and reads no other event: it
    hands the JVM a :class:`_TerminationCallback` wrapped in Spark's
    ``PythonStreamingQueryListenerWrapper`` through the listener's ``_jlistener``, which
    ``addListener`` and ``removeListener`` read. Checked on PySpark 4.3.0. If the wrapper
    cannot be made, ``addListener`` raises (the caller logs it)."""
    from pyspark import SparkContext
    from pyspark.sql.streaming import StreamingQueryListener

    class _OnTermination(StreamingQueryListener):  # the methods PySpark's class requires
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            pass

        def onQueryTerminated(self, event):
            on_run_id(str(event.runId))

        @property
        def _jlistener(self):
            if getattr(self, "_jlistenerobj", None) is None:
                self._jlistenerobj = SparkContext._jvm.org.apache.spark.sql.streaming \
                    .PythonStreamingQueryListenerWrapper(_TerminationCallback(on_run_id))
            return self._jlistenerobj

    return _OnTermination()


# -- an RDD whose partitions prefer executors ----------------------------------------------------

def _pilot_jrdd(sc, locations):
    """A JVM RDD of one marker string per partition, partition ``p`` preferring
    ``locations[p]``: ``SparkContext.makeRDD`` of ``(marker, locations)`` pairs, the one RDD
    constructor that takes per-partition preferences, called through py4j. Every py4j call
    is a round trip, so class handles are looked up once and partitions with the same
    locations share one Scala list: about two calls per partition."""
    jvm = sc._jvm
    converters = jvm.scala.jdk.javaapi.CollectionConverters
    array_list, tuple2 = jvm.java.util.ArrayList, jvm.scala.Tuple2
    scala_lists = {}
    pairs = array_list(len(locations))
    for p, locs in enumerate(locations):
        key = tuple(locs)
        scala_list = scala_lists.get(key)
        if scala_list is None:
            jlocs = array_list(len(key))
            for loc in key:
                jlocs.add(loc)
            scala_list = scala_lists[key] = converters.asScala(jlocs).toList()
        pairs.add(tuple2(f"p{p}", scala_list))
    class_tag = jvm.scala.reflect.ClassTag.apply(jvm.java.lang.Class.forName("java.lang.String"))
    return sc._jsc.sc().makeRDD(converters.asScala(pairs).toList(), class_tag).toJavaRDD()


def _is_pickle_frames(deserializer):
    from pyspark.serializers import BatchedSerializer, CPickleSerializer

    inner = deserializer.serializer if isinstance(deserializer, BatchedSerializer) else deserializer
    return isinstance(inner, CPickleSerializer)  # CloudPickleSerializer is one too


def rdd_with_preferred_locations(rdd, locations):
    """``(base, deserializer, parent_func)``: ``base`` has one element per partition of
    ``rdd``, the list of its serialized frames, partition ``p`` preferring the executors
    ``locations[p]``; ``deserializer`` reads the frames and ``parent_func`` (or None) is a
    pipelined Python function of ``rdd`` still to apply to them.

    All on the JVM, so that a task still runs one Python worker: a pilot RDD that carries the
    preferences (:func:`_pilot_jrdd`), ``pilot.zip(frames.glom()).values()``, pickled for
    Python by ``SerDeUtil.javaToPython``. ``frames`` is the JVM RDD under ``rdd``'s pipelined
    Python function, if it has one (that function then runs in our task, as PySpark would
    have pipelined it), else ``rdd``'s own. (Zipping Python RDDs, ``pilot.zip(rdd.glom())``,
    would run the pilot, the parent and ``fn`` in three Python workers per task, and which
    of them runs ``fn`` would change from task to task: the store would rarely be found
    loaded.) Reads PySpark's private RDD attributes (``_jrdd``, ``_prev_jrdd``, their
    deserializers, ``_is_pipelinable``, ``_reserialize``); checked on PySpark 4.3.0. A
    failure raises: without it the job cannot run where its stores are."""
    from pyspark.core.rdd import RDD, PipelinedRDD
    from pyspark.serializers import AutoBatchedSerializer, CPickleSerializer

    sc = rdd.context
    if (isinstance(rdd, PipelinedRDD) and rdd._is_pipelinable() and not rdd._is_barrier()
            and _is_pickle_frames(rdd._prev_jrdd_deserializer)):
        jrdd, deserializer, parent_func = rdd._prev_jrdd, rdd._prev_jrdd_deserializer, rdd.func
    else:
        if not _is_pickle_frames(rdd._jrdd_deserializer):
            rdd = rdd._reserialize(AutoBatchedSerializer(CPickleSerializer()))  # a text file, say
        jrdd, deserializer, parent_func = rdd._jrdd, rdd._jrdd_deserializer, None
    frames = _pilot_jrdd(sc, locations).zip(jrdd.glom()).values()
    base = RDD(sc._jvm.org.apache.spark.api.python.SerDeUtil.javaToPython(frames), sc,
               AutoBatchedSerializer(CPickleSerializer()))
    return base, deserializer, parent_func
