"""Reading state back: :func:`read_state`, a DataFrame of every key and value of an
operator's stores at one version (what Spark's ``statestore`` data source does for its own
checkpoints, for statecore's).

What to read (partitions, schemas, versions, and the attempts the batch records name) is
found on the driver by :func:`statecore.state_reads.plan_read`, which ``statecore dump``
shares; this module owns the read-only tasks on the executors. The columns,
types and rules are in ``docs/operator.md`` ("Reading state back") and ``docs/lineage.md``.
"""
import logging

import numpy as np
import pyarrow as pa

from statecore.conf import StateStoreConf
from statecore.ids import StateStoreId
from statecore.contracts import create_and_init_provider
from statecore.state_reads import PARTITION_ID_COLUMN, plan_changes, plan_read, state_partitions

from pyspark_glue.arrow import arrow_type_of, spark_schema_of, to_record_batch
from pyspark_glue.local_workers import check_local_workers

__all__ = ["read_state", "state_partitions", "PARTITION_ID_COLUMN", "BATCH_ID_COLUMN", "CHANGE_TYPE_COLUMN"]

log = logging.getLogger(__name__)

# The change feed's columns before the key and value fields (Spark's readChangeFeed names).
BATCH_ID_COLUMN, CHANGE_TYPE_COLUMN = "batch_id", "change_type"


def _partition_task(checkpoint_root, operator_id, store_name, partitions, key_dtype, value_dtype, conf, read):
    """A read-only task body: for each partition index it is given, the record batches
    ``read(provider, p)`` yields from a provider of partition ``p``'s store, opened from the
    files (no registry: no maintenance thread, nothing written)."""
    def run(batches):
        for batch in batches:
            for index in batch.column(0).to_pylist():
                p = partitions[index]
                provider = create_and_init_provider(StateStoreId(checkpoint_root, operator_id, p, store_name),
                                                    key_dtype, value_dtype, conf)
                try:
                    yield from read(provider, p)
                finally:
                    provider.close()
    return run


def _rows_of_version(version, commit_ids, rows_per_batch):
    """``read`` for :func:`_partition_task`: every row of ``version`` (at ``commit_ids[p]``)."""
    def read(provider, p):
        for keys, values in provider.version_rows(version, None if commit_ids is None else commit_ids[p],
                                                  rows_per_batch):
            yield to_record_batch(keys, values, **{PARTITION_ID_COLUMN: p})
    return read


def _changes_of_versions(key_dtype, value_dtype, start, end, commit_ids):
    """``read`` for :func:`_partition_task`: the changes of versions ``start..end`` (``end``
    at ``commit_ids[p]``), as the change feed's columns."""
    value_types = [arrow_type_of(value_dtype[name]) for name in value_dtype.names]
    names = [BATCH_ID_COLUMN, CHANGE_TYPE_COLUMN, *key_dtype.names, *value_dtype.names, PARTITION_ID_COLUMN]

    def read(provider, p):
        for version, is_put, keys, values in provider.changes(start, end,
                                                              None if commit_ids is None else commit_ids[p]):
            n = len(keys)
            if is_put:
                fields = to_record_batch(keys, values).columns
            else:
                fields = to_record_batch(keys).columns + [pa.nulls(n, t) for t in value_types]
            head = [pa.array(np.full(n, version - 1, dtype=np.int64)),
                    pa.repeat(pa.scalar("update" if is_put else "delete"), n)]
            tail = [pa.array(np.full(n, p, dtype=np.int32))]
            yield pa.RecordBatch.from_arrays(head + list(fields) + tail, names=names)
    return read


def _feed_bound(which, version, batch_id):
    """The change feed's ``which`` ("start" or "end") version, from ``<which>_version`` or
    ``<which>_batch_id`` (version = batch id + 1); None if neither is given."""
    if version is not None and batch_id is not None:
        raise ValueError(f"give {which}_version or {which}_batch_id, not both")
    for name, value, least in ((f"{which}_version", version, 1), (f"{which}_batch_id", batch_id, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return batch_id + 1 if batch_id is not None else version


def read_state(spark, checkpoint_root, operator_id, store_name="default", version=None, *, batch_id=None,
               commit_ids=None, conf=None, rows_per_batch=65536, change_feed=False, start_version=None,
               end_version=None, start_batch_id=None, end_batch_id=None):
    """The state of operator ``operator_id`` at ``version`` as a DataFrame: the key fields, the
    value fields, then ``partition_id`` (columns, types and which attempt of the version is
    read: ``docs/operator.md``, "Reading state back").

    With ``change_feed=True`` (Spark's ``readChangeFeed``), instead every change the batches
    ``start_batch_id`` to ``end_batch_id`` made (or, in versions, ``start_version`` to
    ``end_version``: batch ``b`` commits version ``b + 1``): ``batch_id`` (the batch that made
    the change, its version less one), ``change_type`` (``"update"``: the key's new value;
    ``"delete"``: the key was removed, its value fields null), the key and value fields,
    ``partition_id``; one row per key changed in each batch, read from the versions' deltas
    alone (``docs/operator.md``, "The change feed"). The end defaults to the version
    ``read_state`` would read; the start to the oldest batch whose change every partition
    still holds (not before a repartition).

    Parameters
    ----------
    spark : SparkSession
        Classic or Spark Connect: the read needs no SparkContext.
    checkpoint_root : str
        The state root the stores were written under (as given to the operator).
    operator_id : int
    store_name : str, default "default"
    version : int, optional
        Default: the version the operator's newest batch record committed; without
        records, the latest version every partition has (the newest complete batch: a
        batch that failed half-way has committed only some partitions).
    batch_id : int, optional
        Instead of ``version``: the state after batch ``batch_id`` (version ``batch_id + 1``).
    commit_ids : sequence of str, optional
        The attempt of ``version`` to read, per partition (16 hex digits each; index =
        partition id); ``version`` must be given. Default: the batch record's, if any.
    conf : StateStoreConf or dict, optional
        For the storage options of a remote checkpoint.
    rows_per_batch : int, default 65536
    change_feed : bool, default False
    start_batch_id, end_batch_id : int, optional
        The change feed's first and last batch (>= 0); or
    start_version, end_version : int, optional
        the same range in versions (>= 1): version = batch id + 1.

    Raises
    ------
    FileNotFoundError
        No state there.
    VersionNotFoundError
        ``version`` is newer than some partition's newest version (or its files are gone,
        found when the read runs).
    ValueError
        A field name repeats across key and value, or is ``partition_id``; a bad
        ``version``, ``batch_id`` or ``commit_ids``; an unreadable batch record; a change
        feed that starts before the operator's last repartition.
    """
    if conf is None:
        conf = StateStoreConf()
    elif not isinstance(conf, StateStoreConf):
        conf = StateStoreConf.from_spark_conf(conf)
    if not isinstance(operator_id, int) or operator_id < 0:
        raise ValueError(f"operator_id must be an int >= 0, got {operator_id!r}")
    for name, value in (("version", version), ("batch_id", batch_id)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if batch_id is not None:
        if version is not None:
            raise ValueError("give version or batch_id, not both")
        version = batch_id + 1
    if change_feed:
        if version is not None:
            raise ValueError("the change feed reads start_batch_id..end_batch_id (or start_version..end_version): "
                             "give those, not version or batch_id")
        start_version = _feed_bound("start", start_version, start_batch_id)
        version = _feed_bound("end", end_version, end_batch_id)
        if start_version is not None and version is not None and version < start_version:
            raise ValueError(f"the change feed's end (version {version}, batch {version - 1}) is before its start "
                             f"(version {start_version}, batch {start_version - 1})")
    elif any(v is not None for v in (start_version, end_version, start_batch_id, end_batch_id)):
        raise ValueError("start_version, end_version, start_batch_id and end_batch_id are for the change feed "
                         "(change_feed=True)")
    if commit_ids is not None and version is None:
        raise ValueError("commit_ids name attempts of one version: give the version too (of the change feed: its end)")
    if change_feed:
        plan, start_version = plan_changes(checkpoint_root, operator_id, store_name, start_version, version,
                                           commit_ids, conf)
    else:
        plan = plan_read(checkpoint_root, operator_id, store_name, version, commit_ids, conf)
    key, value, partitions, version, commit_ids = (plan.key_schema, plan.value_schema, plan.partitions,
                                                   plan.version, plan.commit_ids)
    from pyspark.sql import types as T

    n = len(partitions)
    if change_feed:
        fields = spark_schema_of(key.dtype, value.dtype, extra=[(PARTITION_ID_COLUMN, T.IntegerType())]).fields
        schema = T.StructType([T.StructField(BATCH_ID_COLUMN, T.LongType(), True),
                               T.StructField(CHANGE_TYPE_COLUMN, T.StringType(), True), *fields])
        read = _changes_of_versions(key.dtype, value.dtype, start_version, version, commit_ids)
    else:
        schema = spark_schema_of(key.dtype, value.dtype, extra=[(PARTITION_ID_COLUMN, T.IntegerType())])
        read = _rows_of_version(version, commit_ids, rows_per_batch)
    run = _partition_task(checkpoint_root, operator_id, store_name, partitions, key.dtype, value.dtype, conf, read)
    check_local_workers(spark)
    return spark.range(0, n, 1, numPartitions=n).mapInArrow(run, schema)
