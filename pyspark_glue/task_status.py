"""The status row each task of a :class:`~pyspark_glue.StatefulOperator` batch returns: one
dataclass, :class:`TaskStatus`, from which the Arrow schema the task writes, the Spark schema
``mapInArrow`` is given and the row itself all come (``docs/operator.md``, step 4)."""
import dataclasses

import pyarrow as pa

__all__ = ["TaskStatus"]

_COMMIT_IDS = pa.struct([("base_commit_id", pa.string()), ("commit_id", pa.string())])


def _field(arrow_type):
    return dataclasses.field(metadata={"arrow": arrow_type})


@dataclasses.dataclass(frozen=True)
class TaskStatus:
    """What one partition's task did in a batch (summed into ``last_progress``; the commit ids
    go into the batch record)."""

    partition_id: int = _field(pa.int32())
    rows_in: int = _field(pa.int64())
    batches_in: int = _field(pa.int32())  # the batches fn got (joined)
    rows_out: int = _field(pa.int64())
    num_keys: int = _field(pa.int64())  # of the default store
    memory_used_bytes: int = _field(pa.int64())
    already_loaded: bool = _field(pa.bool_())  # the default store was loaded in the worker
    worker: str = _field(pa.string())  # the executor id
    open_s: float = _field(pa.float64())
    fn_s: float = _field(pa.float64())
    write_s: float = _field(pa.float64())
    commit_s: float = _field(pa.float64())
    custom_metrics: dict = _field(pa.map_(pa.string(), pa.int64()))  # the default store's, by name
    commit_id: str = _field(pa.string())  # of the default store
    base_commit_id: str = _field(pa.string())
    # every other store of the partition: name -> {"base_commit_id": ..., "commit_id": ...}
    store_commit_ids: dict = _field(pa.map_(pa.string(), _COMMIT_IDS))
    max_event_time_us: int = _field(pa.int64())  # None without an event-time column or rows
    late_rows: int = _field(pa.int64())
    fn_counts: dict = _field(pa.map_(pa.string(), pa.int64()))  # PartitionContext.counts

    @classmethod
    def arrow_schema(cls):
        return pa.schema([(f.name, f.metadata["arrow"]) for f in dataclasses.fields(cls)])

    @classmethod
    def spark_schema(cls):
        """The StructType ``mapInArrow`` returns rows of."""
        from pyspark_glue.spark_internals import spark_schema_from_arrow

        return spark_schema_from_arrow(cls.arrow_schema())

    def to_record_batch(self):
        """This status as a one-row Arrow batch (maps as lists of pairs, as Arrow takes them)."""
        row = dataclasses.asdict(self)
        for name, value in row.items():
            if isinstance(value, dict):
                row[name] = list(value.items())
        return pa.RecordBatch.from_pylist([row], schema=self.arrow_schema())

    @classmethod
    def from_row(cls, row):
        """A status from a collected Spark ``Row`` (maps come back as dicts, structs as Rows)."""
        values = row.asDict(recursive=True)
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
