"""Whether the glue was handed a Spark Connect session (or one of its DataFrames), and the
refusal of the paths that need a classic one.

Under Spark Connect the user's process holds a gRPC client, not a SparkContext: no RDD API, no
JVM to start long-running tasks from. Continuous mode and ``map_partitions_with_state_store``
are built on those, so they refuse a Connect session at once with :class:`ClassicSessionRequired`,
which names what to use instead (``docs/rdd.md``, "Under Spark Connect"; ``docs/continuous.md``, "Limits").

A Connect object is an instance of PySpark's Connect ``SparkSession`` or ``DataFrame``
(``pyspark.sql.connect.session``, ``pyspark.sql.connect.dataframe``; checked on PySpark 4.3.0).
Their modules are looked up among those already imported, never imported here: a process that
has not imported them holds no Connect object, and importing them needs the Connect client's
packages (grpcio ...), which a classic installation may lack.
"""
import sys

__all__ = ["ClassicSessionRequired", "is_connect", "require_classic"]

_CONNECT_CLASSES = (("pyspark.sql.connect.session", "SparkSession"), ("pyspark.sql.connect.dataframe", "DataFrame"))


class ClassicSessionRequired(TypeError):
    """A path that needs a classic SparkSession (a SparkContext in this process) was given a
    Spark Connect session or DataFrame."""


def is_connect(obj):
    """Whether ``obj`` is a Spark Connect session or DataFrame."""
    for module_name, class_name in _CONNECT_CLASSES:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(obj, getattr(module, class_name)):
            return True
    return False


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
