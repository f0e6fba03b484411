"""Continuous execution with statecore state: long-running partition tasks, epochs committed
in order by the driver's :class:`~statecore.epoch.EpochCoordinator`, exactly-once restart.
:func:`start_continuous` starts a query; the user's page and the design are in
``docs/continuous.md``.

- :mod:`~pyspark_glue.continuous.sources`: the source interface, ``GeneratorSource``, ``FileSource``;
- :mod:`~pyspark_glue.continuous.sink`: ``EpochSink``, the epoch-keyed output;
- :mod:`~pyspark_glue.continuous.log`: the checkpoint's metadata, offsets and commits logs;
- :mod:`~pyspark_glue.continuous.task`: the long-running task body;
- :mod:`~pyspark_glue.continuous.driver`: ``ContinuousQuery``, the query thread and the epoch timer.
"""
from pyspark_glue.continuous.driver import ContinuousQuery, ContinuousQueryException, start_continuous, task_slots
from pyspark_glue.continuous.log import COMMITS_DIR, METADATA_FILE, OFFSETS_DIR, OPERATOR_ID, STATE_DIR, EpochLog
from pyspark_glue.continuous.sink import EpochSink
from pyspark_glue.continuous.sources import ContinuousSource, FileSource, GeneratorSource, PartitionReader
from pyspark_glue.continuous.task import ContinuousTaskRetryError

__all__ = ["ContinuousSource", "PartitionReader", "GeneratorSource", "FileSource", "EpochSink", "EpochLog",
           "ContinuousQuery", "ContinuousQueryException", "ContinuousTaskRetryError", "start_continuous",
           "task_slots", "STATE_DIR", "OPERATOR_ID", "OFFSETS_DIR", "COMMITS_DIR", "METADATA_FILE"]
