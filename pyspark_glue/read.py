"""Reading state back: :func:`read_state`, a DataFrame of every key and value of an
operator's stores at one version (what Spark's ``statestore`` data source does for its own
checkpoints, for statecore's).

This module owns finding what to read on the driver (partitions, schemas, versions, and the
attempts the batch records name) and the read-only tasks on the executors. The columns,
types and rules are in ``docs/operator.md`` ("Reading state back") and ``docs/lineage.md``.
"""
import logging

import numpy as np
import pyarrow as pa

from statecore.conf import StateStoreConf
from statecore.errors import StateCorruptionError, VersionNotFoundError
from statecore.files import open_store_files
from statecore.ids import StateStoreId
from statecore.store import SCHEMA_FILE, create_and_init_provider, read_store_schemas
from statecore import operator_files
from statecore.checkpoint import CheckpointFiles, checked_commit_ids

from pyspark_glue.arrow import arrow_type_of, spark_schema_of, to_record_batch

__all__ = ["read_state", "state_partitions", "PARTITION_ID_COLUMN", "BATCH_ID_COLUMN", "CHANGE_TYPE_COLUMN"]

log = logging.getLogger(__name__)

PARTITION_ID_COLUMN = "partition_id"
# The change feed's columns before the key and value fields (Spark's readChangeFeed names).
BATCH_ID_COLUMN, CHANGE_TYPE_COLUMN = "batch_id", "change_type"


def _partition_ids(checkpoint_root, operator_id, storage_options):
    """The partitions of an operator: those its metadata names, or without metadata its
    numbered directories (a directory beyond the metadata's count is a repartition's
    leftover or one in progress, not state)."""
    location = operator_files.operator_dir(checkpoint_root, operator_id)
    files = CheckpointFiles(location, storage_options)
    try:
        recorded = operator_files.read_metadata(location, storage_options)
        if recorded is not None:
            return list(range(int(recorded["num_partitions"])))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable %s: %s", files.path(operator_files.OPERATOR_METADATA_FILE), e)
    return sorted(int(name) for name, is_dir in files.entries() if is_dir and name.isascii() and name.isdigit())


def state_partitions(checkpoint_root, operator_id, store_name="default", conf=None):
    """What :func:`read_state` reads, found on the driver: ``(key_schema, value_schema,
    {partition_id: newest version})`` (RowSchemas; a partition that never committed has
    newest version 0).

    Raises
    ------
    FileNotFoundError
        No store of that operator (and store name) recorded a schema.
    StateCorruptionError
        A schema file is unreadable, or partitions disagree on the schemas.
    """
    conf = conf or StateStoreConf()
    found = {}
    schemas = {}
    for p in _partition_ids(checkpoint_root, operator_id, conf.storage_options):
        location = StateStoreId(checkpoint_root, operator_id, p, store_name).store_checkpoint_location()
        files = open_store_files(location, conf.storage_options, conf.local_cache_dir)
        found[p] = files.list_versions().top
        recorded = read_store_schemas(files)
        if recorded is None:
            continue
        schemas[p] = (*recorded, files.path(SCHEMA_FILE))
    if not schemas:
        raise FileNotFoundError(f"no state of operator {operator_id} (store {store_name!r}) under {checkpoint_root}: "
                                f"no store directory there has a {SCHEMA_FILE}")
    (key, value, first), *rest = schemas.values()
    for other_key, other_value, where in rest:
        if other_key != key or other_value != value:
            raise StateCorruptionError(where, None, f"schemas {other_key.describe()} / {other_value.describe()} "
                                                    f"differ from {key.describe()} / {value.describe()} of {first}")
    return key, value, found


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


def _read_changes(checkpoint_root, operator_id, store_name, partitions, key_dtype, value_dtype, start, end,
                  commit_ids, conf):
    """The change feed's task body: for each index in the ids it is given, the changes of that
    partition's versions ``start..end`` (``end`` at ``commit_ids[p]``, if given)."""
    def run(batches):
        value_types = [arrow_type_of(value_dtype[name]) for name in value_dtype.names]
        for batch in batches:
            for index in batch.column(0).to_pylist():
                p = partitions[index]
                provider = create_and_init_provider(StateStoreId(checkpoint_root, operator_id, p, store_name),
                                                    key_dtype, value_dtype, conf)
                try:
                    for version, is_put, keys, values in provider.changes(
                            start, end, None if commit_ids is None else commit_ids[p]):
                        n = len(keys)
                        if is_put:
                            fields = to_record_batch(keys, values).columns
                        else:
                            fields = to_record_batch(keys).columns + [pa.nulls(n, t) for t in value_types]
                        head = [pa.array(np.full(n, version - 1, dtype=np.int64)),
                                pa.repeat(pa.scalar("update" if is_put else "delete"), n)]
                        tail = [pa.array(np.full(n, p, dtype=np.int32))]
                        names = [BATCH_ID_COLUMN, CHANGE_TYPE_COLUMN, *key_dtype.names, *value_dtype.names,
                                 PARTITION_ID_COLUMN]
                        yield pa.RecordBatch.from_arrays(head + list(fields) + tail, names=names)
                finally:
                    provider.close()
    return run


def read_state(spark, checkpoint_root, operator_id, store_name="default", version=None, *, batch_id=None,
               commit_ids=None, conf=None, rows_per_batch=65536, change_feed=False, start_version=None,
               end_version=None):
    """The state of operator ``operator_id`` at ``version`` as a DataFrame: the key fields, the
    value fields, then ``partition_id`` (columns, types and which attempt of the version is
    read: ``docs/operator.md``, "Reading state back").

    With ``change_feed=True`` (Spark's ``readChangeFeed``), instead every change of the
    versions ``start_version`` to ``end_version`` (default: the version ``read_state`` would
    read): ``batch_id`` (the version less one), ``change_type`` (``"update"``: the key's new
    value; ``"delete"``: the key was removed, its value fields null), the key and value
    fields, ``partition_id``; one row per key changed in each version, read from the
    versions' deltas alone (``docs/operator.md``, "The change feed").

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
    change_feed : bool, default False
    start_version, end_version : int, optional
        The change feed's first and last version (>= 1; ``start_version`` required).

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
    if change_feed:
        if version is not None:
            raise ValueError("the change feed reads start_version..end_version: give those, not version or batch_id")
        if not isinstance(start_version, int) or isinstance(start_version, bool) or start_version < 1:
            raise ValueError(f"the change feed needs start_version, an int >= 1, got {start_version!r}")
        if end_version is not None:
            if not isinstance(end_version, int) or isinstance(end_version, bool) or end_version < start_version:
                raise ValueError(f"end_version must be an int >= start_version ({start_version}), got {end_version!r}")
            version = end_version
    elif start_version is not None or end_version is not None:
        raise ValueError("start_version and end_version are for the change feed (change_feed=True)")
    if commit_ids is not None and version is None:
        raise ValueError("commit_ids name attempts of one version: give the version too")
    key, value, latest = state_partitions(checkpoint_root, operator_id, store_name, conf)
    names = [*key.names, *value.names, PARTITION_ID_COLUMN]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"the state of operator {operator_id} cannot be flattened: field name(s) {duplicates} "
                         f"repeat across the key fields {key.names}, the value fields {value.names} and "
                         f"'{PARTITION_ID_COLUMN}'")
    partitions = sorted(latest)
    if commit_ids is None:
        version, commit_ids = _recorded(checkpoint_root, operator_id, store_name, version, conf)
    else:
        commit_ids = checked_commit_ids(commit_ids, len(commit_ids), "commit_ids")
    newest_common = min(latest.values())
    if version is None:
        version = newest_common
    elif version > newest_common:
        behind = sorted(p for p, v in latest.items() if v < version)
        raise VersionNotFoundError(
            f"version {version} of operator {operator_id} under {checkpoint_root} does not exist in partition(s) "
            f"{behind} (their newest: {sorted({latest[p] for p in behind})}); the newest version every "
            f"partition has is {newest_common}")
    if commit_ids is not None:
        missing = [p for p in partitions if p >= len(commit_ids)]
        if missing:
            raise ValueError(f"{len(commit_ids)} commit ids for operator {operator_id}, which has partition(s) "
                             f"{missing}")
        commit_ids = {p: commit_ids[p] for p in partitions}
    from pyspark.sql import types as T

    n = len(partitions)
    if change_feed:
        if version < start_version:
            raise VersionNotFoundError(f"the change feed of operator {operator_id} from version {start_version}: the "
                                       f"newest version is {version}")
        fields = spark_schema_of(key.dtype, value.dtype, extra=[(PARTITION_ID_COLUMN, T.IntegerType())]).fields
        schema = T.StructType([T.StructField(BATCH_ID_COLUMN, T.LongType(), True),
                               T.StructField(CHANGE_TYPE_COLUMN, T.StringType(), True), *fields])
        run = _read_changes(checkpoint_root, operator_id, store_name, partitions, key.dtype, value.dtype,
                            start_version, version, commit_ids, conf)
        return spark.range(0, n, 1, numPartitions=n).mapInArrow(run, schema)
    schema = spark_schema_of(key.dtype, value.dtype, extra=[(PARTITION_ID_COLUMN, T.IntegerType())])
    run = _read_partitions(checkpoint_root, operator_id, store_name, partitions, key.dtype, value.dtype, version,
                           commit_ids, conf, rows_per_batch)
    return spark.range(0, n, 1, numPartitions=n).mapInArrow(run, schema)


def _recorded(checkpoint_root, operator_id, store_name, version, conf):
    """``(version, commit_ids)`` the operator's batch records name for ``version`` (None:
    the newest record's), or ``(version, None)`` where there is no such record (a version
    0, a checkpoint without records, a record already deleted)."""
    location = operator_files.operator_dir(checkpoint_root, operator_id)
    records = operator_files.commit_log(location, conf.storage_options)
    try:
        metadata = operator_files.read_metadata(location, conf.storage_options)
    except ValueError:
        metadata = None  # _partition_ids logged it
    moved = operator_files.repartitioned(metadata)
    if moved is not None and version is not None and version < moved["version"]:
        raise ValueError(f"operator {operator_id} under {checkpoint_root} was repartitioned at version "
                         f"{moved['version']}: version {version} was not kept at the new partitioning")
    if version is None:
        newest = records.latest()
        if newest is None:
            return None, None
        batch = newest
    elif version == 0:
        return 0, None
    else:
        batch = version - 1
    record = operator_files.read_commit_record(records, batch, metadata)
    if record is None or record.get("store_name") != store_name:
        return version, None
    return batch + 1, record["commit_ids"]
