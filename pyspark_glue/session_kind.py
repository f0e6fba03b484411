"""Whether the glue was handed a Spark Connect session (or one of its DataFrames), and the
refusal of the paths that need a classic one.

Under Spark Connect the user's process holds a gRPC client, not a SparkContext: no RDD API, no
JVM to start long-running tasks from. Continuous mode and ``map_partitions_with_state_store``
are built on those, so they refuse a Connect session at once with :class:`ClassicSessionRequired`,
which names what to use instead (``docs/rdd.md``, "Under Spark Connect"; ``docs/continuous.md``, "Limits").

What counts as a Connect object is :func:`pyspark_glue.spark_internals.is_connect`'s rule.
"""
from pyspark_glue.spark_internals import is_connect

__all__ = ["ClassicSessionRequired", "is_connect", "require_classic"]


class ClassicSessionRequired(TypeError):
    """A path that needs a classic SparkSession (a SparkContext in this process) was given a
    Spark Connect session or DataFrame."""


def require_classic(obj, what):
    """Raise :class:`ClassicSessionRequired` if ``obj`` is a Spark Connect object: ``what``
    (the path, as the user called it) needs a classic session. The message says what works
    under Connect instead: a ``StatefulOperator`` in ``foreachBatch``, and ``read_state``."""
    if is_connect(obj):
        raise ClassicSessionRequired(
            f"{what} needs a classic SparkSession (a SparkContext in this process) and was given a Spark Connect "
            f"{type(obj).__name__}: Spark Connect has no SparkContext and no RDD API. Under Spark Connect, run the "
            f"stateful step as a StatefulOperator in a streaming query's foreachBatch (docs/operator.md) and read "
            f"its state with read_state")
