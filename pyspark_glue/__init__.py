"""PySpark glue: the only package that imports pyspark.

- RDD level (:mod:`pyspark_glue.rdd`): :class:`StatefulOperatorStateInfo` and
  :func:`map_partitions_with_state_store` (Spark's ``mapPartitionsWithStateStore``).
- DataFrame / Structured Streaming level (:mod:`pyspark_glue.operator`):
  :class:`StatefulOperator` for ``foreachBatch``; the contract of its ``fn``
  (:mod:`pyspark_glue.operator_fn`: :class:`OperatorFunction`, :class:`TaskHandler`); ready-made functions
  (:mod:`pyspark_glue.aggregates`: :class:`RunningAggregate`); the Arrow <-> numpy <-> Spark
  conversions user functions are written with (:mod:`pyspark_glue.arrow`:
  :func:`keys_from_arrow`, :func:`columns_from_arrow`, :func:`to_record_batch`).
- Reading state back (:mod:`pyspark_glue.read`): :func:`read_state`; repartitioning it as a
  Spark job (:mod:`pyspark_glue.repartition`): :func:`repartition_state`.
- Continuous mode (:mod:`pyspark_glue.continuous`): ``start_continuous``.
- Checkpoint files beside the stores are the engine's (:mod:`statecore.checkpoint`,
  :mod:`statecore.operator_files`): the ``statecore`` command reads them without Spark.
- Workers and the driver (:mod:`pyspark_glue.executor`, :mod:`pyspark_glue.driver`):
  executor identity, the worker registry's coordinator, the driver's coordinator.
- Processing time (:mod:`pyspark_glue.clocks`): :class:`WallClock`, :class:`ManualClock`.
- Testing an ``fn`` without Spark (:mod:`pyspark_glue.testing`): ``Harness``.
- The main job: ``python -m pyspark_glue.demo``.

Design notes: ``docs/operator.md``, ``docs/rdd.md``, ``docs/continuous.md``, ``docs/lineage.md``,
``docs/cluster.md``.
"""
from statecore.package_origin import check_package_origin

check_package_origin()  # before anything of statecore is imported by name

from pyspark_glue.rdd import (StatefulOperatorStateInfo, map_partitions_with_read_state_store,
                              map_partitions_with_state_store)
from pyspark_glue.operator_fn import OperatorFunction, PartitionContext, TaskHandler
from pyspark_glue.aggregates import RunningAggregate
from pyspark_glue.deduplicate import Deduplicate
from pyspark_glue.processor import Groups, StatefulProcessor
from pyspark_glue.sessions import SessionWindow
from pyspark_glue.windows import WindowedAggregate
from pyspark_glue.arrow import (column_to_numpy, columns_from_arrow, keys_from_arrow, spark_schema_of, spark_type_of,
                                to_record_batch)
from pyspark_glue.operator import StatefulOperator
from pyspark_glue.clocks import ManualClock, WallClock
from pyspark_glue.read import read_state
from pyspark_glue.repartition import repartition_state

__all__ = [
    "StatefulOperatorStateInfo",
    "map_partitions_with_state_store",
    "map_partitions_with_read_state_store",
    "StatefulOperator",
    "OperatorFunction",
    "TaskHandler",
    "PartitionContext",
    "ManualClock",
    "WallClock",
    "RunningAggregate",
    "Deduplicate",
    "WindowedAggregate",
    "SessionWindow",
    "StatefulProcessor",
    "Groups",
    "keys_from_arrow",
    "columns_from_arrow",
    "column_to_numpy",
    "to_record_batch",
    "spark_type_of",
    "spark_schema_of",
    "read_state",
    "repartition_state",
]
