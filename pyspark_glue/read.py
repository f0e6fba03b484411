"""Reading state back: :func:`read_state`, a DataFrame of every key and value of an
operator's stores at one version (what Spark's ``statestore`` data source does for its own
checkpoints, for statecore's).

What to read (partitions, schemas, versions, and the attempts the batch records name) is
found on the driver by :func:`statecore.state_reads.plan_read`, which ``statecore dump``
shares; this module owns the read-only tasks on the executors. The columns,
types and rules are in ``docs/operator.md`` ("Reading state back") and ``docs/lineage.md``.
"""
import logging

from statecore.conf import StateStoreConf
from statecore.ids import StateStoreId
from statecore.store import create_and_init_provider
from statecore.state_reads import PARTITION_ID_COLUMN, plan_read, state_partitions

from pyspark_glue.arrow import spark_schema_of, to_record_batch

__all__ = ["read_state", "state_partitions", "PARTITION_ID_COLUMN"]

log = logging.getLogger(__name__)


def _read_partitions(checkpoint_root, operator_id, store_name, partitions, key_dtype, value_dtype, version,
                     commit_ids, conf, rows_per_batch):
    """The task body: for each index in the ids it is given, the rows of that partition
    (at ``commit_ids[p]``, if given)."""
    def run(batches):
        for batch in batches:
            for index in batch.column(0).to_pylist():
                p = partitions[index]
                store_id = StateStoreId(checkpoint_root, operator_id, p, store_name)
                provider = create_and_init_provider(store_id, key_dtype, value_dtype, conf)
                try:
                    store = provider.get_read_store(version, None if commit_ids is None else commit_ids[p])
                    try:
                        for keys, values in store.iter_batches(rows_per_batch):
                            yield to_record_batch(keys, values, **{PARTITION_ID_COLUMN: p})
                    finally:
                        store.abort()
                finally:
                    provider.close()
    return run


def read_state(spark, checkpoint_root, operator_id, store_name="default", version=None, *, batch_id=None,
               commit_ids=None, conf=None, rows_per_batch=65536):
    """The state of operator ``operator_id`` at ``version`` as a DataFrame: the key fields, the
    value fields, then ``partition_id`` (columns, types and which attempt of the version is
    read: ``docs/operator.md``, "Reading state back").

    Parameters
    ----------
    spark : SparkSession
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

    Raises
    ------
    FileNotFoundError
        No state there.
    VersionNotFoundError
        ``version`` is newer than some partition's newest version (or its files are gone,
        found when the read runs).
    ValueError
        A field name repeats across key and value, or is ``partition_id``; a bad
        ``version``, ``batch_id`` or ``commit_ids``; an unreadable batch record.
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
    if commit_ids is not None and version is None:
        raise ValueError("commit_ids name attempts of one version: give the version too")
    plan = plan_read(checkpoint_root, operator_id, store_name, version, commit_ids, conf)
    key, value, partitions, version, commit_ids = (plan.key_schema, plan.value_schema, plan.partitions,
                                                   plan.version, plan.commit_ids)
    from pyspark.sql import types as T

    schema = spark_schema_of(key.dtype, value.dtype, extra=[(PARTITION_ID_COLUMN, T.IntegerType())])
    run = _read_partitions(checkpoint_root, operator_id, store_name, partitions, key.dtype, value.dtype, version,
                           commit_ids, conf, rows_per_batch)
    n = len(partitions)
    return spark.range(0, n, 1, numPartitions=n).mapInArrow(run, schema)

