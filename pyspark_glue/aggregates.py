"""Ready-made ``fn``s for :class:`~pyspark_glue.StatefulOperator` and continuous mode:
:class:`RunningAggregate` (a running count and sum per key), and :func:`group_rows`, the one
grouping they share (``statecore.grouping``'s, named here too).
"""
import numpy as np

from statecore.grouping import group_rows
from statecore.schema import RowSchema, as_schema

from pyspark_glue.arrow import column, column_to_numpy, columns_from_arrow, spark_schema_of
from pyspark_glue.operator_fn import OperatorFunction, TaskHandler, added_aggregate_problems

__all__ = ["RunningAggregate", "group_rows", "PARTIAL_COUNT", "PARTIAL_SUM"]

# Columns of the per-batch partial aggregate RunningAggregate.prepare hands to its tasks.
PARTIAL_COUNT, PARTIAL_SUM = "__statecore_count", "__statecore_sum"
# pre_aggregate="auto": Spark's aggregation before the shuffle is dropped after a batch of at
# least AUTO_MIN_ROWS rows with more than AUTO_OFF_ABOVE keys per row (most keys came once:
# the race at 1M keys, 1M rows a batch, has 0.63), and taken up again below AUTO_ON_BELOW
# (at 100k keys it has 0.1); between the two, it stays as it is.
AUTO_MIN_ROWS = 10_000
AUTO_OFF_ABOVE = 0.5
AUTO_ON_BELOW = 0.3


class RunningAggregate(OperatorFunction):
    """``fn`` for a running count and sum per key (Spark's ``groupBy(keys).agg(count, sum)``
    in update mode): one row per key updated in the micro-batch, with its new totals.

    In a :class:`~pyspark_glue.StatefulOperator`, :meth:`prepare` has Spark count and sum each micro-batch
    per key first, so a task merges one row per key: one ``get_batch`` and one ``put_batch``
    per Arrow batch. Given raw rows instead (other runners call it that way), a batch's keys
    are grouped by hash (:func:`group_rows`) and counted and summed with
    ``np.add.reduceat`` (exact for integer sums). The output is emitted when the task
    finishes, once per key per micro-batch (:meth:`TaskHandler.emit_latest`).

    Parameters
    ----------
    key_schema : structured dtype
        The state key; its fields are read from the columns of the same names (or
        ``key_columns``).
    value_column : str
        The column summed. Nulls count as rows and add nothing to the sum.
    sum_dtype : dtype, default int64
        The sum's dtype (the state's int64 sum wraps on overflow, as numpy's does; Spark's
        per-batch sum in :meth:`prepare` fails on overflow when ANSI mode is on).
    count_field, sum_field : str
        Names of the value fields (and output columns).
    emit : bool, default True
        Whether to output the updated rows (False: state only, no output).
    pre_aggregate : bool or "auto", default "auto"
        Whether :meth:`prepare` has Spark aggregate each batch first. It pays when a batch
        holds several rows per key and costs when most keys come once (Spark's hash
        aggregation of nearly every row is then dearer than shuffling the rows and grouping
        them in one compiled pass); bench/RESULTS.md has the figures. ``"auto"`` starts with
        it and, after each batch (:meth:`observe`), turns it off when the batch had more
        than AUTO_OFF_ABOVE keys per row (of at least AUTO_MIN_ROWS rows), and on again
        below AUTO_ON_BELOW.

    Attributes
    ----------
    value_schema : numpy dtype ``[(count_field, int64), (sum_field, sum_dtype)]``
    output_schema : StructType of the key fields, then count and sum (None if not emit)
    """

    def schema_change_problems(self, plan):
        return added_aggregate_problems(plan)

    def __init__(self, key_schema, value_column, *, key_columns=None, sum_dtype="<i8", count_field="count",
                 sum_field="sum", emit=True, pre_aggregate="auto"):
        self.key_dtype = as_schema(key_schema).dtype
        self.value_column = value_column
        self.key_columns = None if key_columns is None else tuple(key_columns)
        self.count_field, self.sum_field = count_field, sum_field
        self.value_schema = RowSchema([(count_field, "<i8"), (sum_field, np.dtype(sum_dtype))]).dtype
        self.sum_dtype = self.value_schema[sum_field]
        if self.sum_dtype.kind not in "iuf":
            raise TypeError(f"sum_dtype must be numeric, got {self.sum_dtype}")
        self.emit = emit
        if pre_aggregate not in (True, False, "auto"):
            raise ValueError(f"pre_aggregate must be True, False or 'auto', got {pre_aggregate!r}")
        self.pre_aggregate = pre_aggregate
        self.pre_aggregating = pre_aggregate is not False  # what prepare() does for the next batch

    @property
    def output_schema(self):
        return spark_schema_of(self.key_dtype, self.value_schema) if self.emit else None

    def open(self, context):
        """In each task: its :class:`_AggregateTask`."""
        return _AggregateTask(self, context)

    def observe(self, progress):
        """After each batch, on the driver: with ``pre_aggregate="auto"``, whether the next
        batch is aggregated by Spark first, from the keys per row this one had."""
        counts = progress.get("fn_counts") or {}
        rows, keys = counts.get("input_rows", 0), counts.get("keys", 0)
        if self.pre_aggregate != "auto" or rows < AUTO_MIN_ROWS:
            return
        if self.pre_aggregating and keys > AUTO_OFF_ABOVE * rows:
            self.pre_aggregating = False
        elif not self.pre_aggregating and keys < AUTO_ON_BELOW * rows:
            self.pre_aggregating = True

    def prepare(self, df, key_columns):
        """The micro-batch aggregated per key in Spark (count and sum), before the operator's
        shuffle: Spark aggregates each input partition first and merges after the shuffle, as
        its own streaming aggregation does, so only one row per key and batch reaches Python.
        The operator calls this on the driver; the tasks then see :data:`PARTIAL_COUNT` and
        :data:`PARTIAL_SUM` columns, each key once per partition."""
        if not self.pre_aggregating:
            return df
        from pyspark.sql import functions as F

        names = self.key_columns or self.key_dtype.names
        value = F.col(f"`{self.value_column}`")
        if self.sum_dtype.kind == "f":
            value = value.cast("double")
        return df.groupBy(*names).agg(F.count(F.lit(1)).alias(PARTIAL_COUNT),
                                      F.coalesce(F.sum(value), F.lit(0)).alias(PARTIAL_SUM))

class _AggregateTask(TaskHandler):
    """One task of a :class:`RunningAggregate`: each batch merged into the store, the keys it
    updated emitted once at the end, with their final totals; the rows and keys seen counted
    into the context (what ``observe`` decides from)."""

    def process(self, batch):
        agg = self.fn
        keys = columns_from_arrow(batch, agg.key_dtype, agg.key_columns)
        partial = batch.schema.get_field_index(PARTIAL_COUNT) >= 0
        if partial:  # from prepare(): the keys are distinct in the whole partition
            distinct = keys
            counts = column_to_numpy(column(batch, PARTIAL_COUNT), np.int64, PARTIAL_COUNT)
            sums = column_to_numpy(column(batch, PARTIAL_SUM), agg.sum_dtype, PARTIAL_SUM, null_value=0)
        else:
            amounts = column_to_numpy(column(batch, agg.value_column), agg.sum_dtype, agg.value_column,
                                      null_value=0)
            order, starts = group_rows(keys)
            distinct = keys[order[starts]]
            counts = np.diff(np.append(starts, len(keys)))
            sums = np.add.reduceat(amounts[order], starts) if len(starts) else amounts[:0]
        tally = self.context.counts
        tally["input_rows"] = tally.get("input_rows", 0) + int(counts.sum())
        tally["keys"] = tally.get("keys", 0) + len(distinct)
        if not len(distinct):
            return None
        old, found = self.store.get_batch(distinct)
        new = np.empty(len(distinct), dtype=agg.value_schema)
        new[agg.count_field] = np.where(found, old[agg.count_field], 0) + counts
        new[agg.sum_field] = np.where(found, old[agg.sum_field], 0) + sums
        self.store.put_batch(distinct, new)
        if agg.emit:
            self.emit_latest(distinct, new, distinct=True)
        return None
