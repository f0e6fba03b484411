"""A micro-batch's output files as a DataFrame: the ``part-<p>.parquet`` files the operator's
tasks write under ``<checkpoint>/<operator>/_output/<batch_id>/`` (``docs/operator.md``).

On a local disk Spark's own parquet reader reads them. Anywhere else (``s3://``, any fsspec URL)
Python tasks read them through :class:`statecore.checkpoint.CheckpointFiles`, with the storage
options that wrote them: Spark's readers may have no filesystem for the scheme at all (PySpark
ships none for ``s3://`` or ``s3a://``) and never see options given to statecore.
"""
import pyarrow.parquet as pq

from statecore.checkpoint import CheckpointFiles

from pyspark_glue.local_workers import check_local_workers

__all__ = ["read_output_files"]


def read_output_files(spark, location, storage_options, spark_schema):
    """The parquet files directly under ``location`` as a DataFrame of ``spark_schema``; names
    starting with ``.`` or ``_`` (a writer's temporary file) are left out, as Spark's reader does."""
    files = CheckpointFiles(location, storage_options)
    if files.is_local:
        return spark.read.schema(spark_schema).parquet(files.spark_url())
    names = [name for name, is_dir in files.entries()
             if not is_dir and name.endswith(".parquet") and not name.startswith((".", "_"))]
    if not names:
        return spark.createDataFrame([], spark_schema)

    def read(batches):
        task_files = CheckpointFiles(location, storage_options)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                with task_files.open_read(names[index]) as f:
                    yield from pq.ParquetFile(f).iter_batches()

    check_local_workers(spark)
    return spark.range(0, len(names), 1, numPartitions=len(names)).mapInArrow(read, spark_schema)
