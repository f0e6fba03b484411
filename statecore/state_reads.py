"""What a read of an operator's state takes, found from its files without Spark: the
partitions, the schemas, the version and the attempt of each partition to read.

:func:`~pyspark_glue.read_state` and ``statecore dump`` both read what :func:`plan_read`
returns, so the two always read the same thing. The rules (``docs/operator.md``, "Reading
state back"; ``docs/lineage.md``, "Reading state"): the partitions are those
``_operator.json`` counts (without it, the numbered directories under ``<root>/<operator>/``);
version ``v`` is read at the attempts the batch record of ``v - 1`` names for the store read
(``commit_ids`` for the operator's own, ``store_commit_ids[name]`` for any other; after a
repartition, no version before it), the default version is the one the newest record
committed, and without a record the default lineage is read at the newest version every
partition has. :func:`plan_changes` checks the change feed's range the same way, on the
driver, before any task reads a delta.
"""
import dataclasses
import logging

from statecore import operator_files
from statecore.checkpoint import CheckpointFiles, checked_commit_ids
from statecore.conf import StateStoreConf
from statecore.errors import StateCorruptionError, VersionNotFoundError
from statecore.files import open_store_files
from statecore.ids import StateStoreId
from statecore.schema_file import SCHEMA_FILE, read_store_schemas

__all__ = ["PARTITION_ID_COLUMN", "ReadPlan", "partition_ids", "state_partitions", "recorded_attempts", "plan_read",
           "plan_changes"]

log = logging.getLogger(__name__)

PARTITION_ID_COLUMN = "partition_id"


def partition_ids(checkpoint_root, operator_id, storage_options=None):
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
    """``(key_schema, value_schema, {partition_id: newest version})`` of an operator's store
    (RowSchemas; a partition that never committed has newest version 0).

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
    for p in partition_ids(checkpoint_root, operator_id, conf.storage_options):
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


def recorded_attempts(checkpoint_root, operator_id, store_name, version, storage_options=None):
    """``(version, commit_ids)`` the operator's batch records name for store ``store_name`` at
    ``version`` (None: the newest record's): the record's ``commit_ids`` for the operator's
    own store, its ``store_commit_ids[store_name]`` for any other (a StatefulProcessor's
    variables and timers, the event-time operators' expiry stores). ``(version, None)``, the
    default lineage, where there is no such record (a version 0, a checkpoint without
    records, a record already deleted) or the record names no attempts of that store (logged)."""
    location = operator_files.operator_dir(checkpoint_root, operator_id)
    records = operator_files.commit_log(location, storage_options)
    try:
        metadata = operator_files.read_metadata(location, storage_options)
    except ValueError:
        metadata = None  # partition_ids logged it
    moved = operator_files.repartitioned(metadata)
    if moved is not None and version is not None and version < moved["version"]:
        raise ValueError(f"operator {operator_id} under {checkpoint_root} was "
                         f"{operator_files.moved_how(moved, metadata)} at version {moved['version']}: version "
                         f"{version} was not kept")
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
    if record is None:
        return version, None
    ids = operator_files.store_ids(record, store_name)
    if ids is None:
        log.warning("the record of batch %d (%s) names no attempts of store %r (it names %s): reading that store's "
                    "default lineage", batch, records.path(batch), store_name,
                    sorted([str(record.get("store_name")), *record["store_commit_ids"]]))
        return version, None
    return batch + 1, ids


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """What to read: the schemas, the partitions (ascending), the version, and the attempt of
    each partition (``{partition: 16 hex digits}``; None: the default lineage)."""

    key_schema: object
    value_schema: object
    partitions: list
    version: int
    commit_ids: dict

    @property
    def column_names(self):
        return [*self.key_schema.names, *self.value_schema.names, PARTITION_ID_COLUMN]


def plan_read(checkpoint_root, operator_id, store_name="default", version=None, commit_ids=None, conf=None):
    """The :class:`ReadPlan` of operator ``operator_id``'s store ``store_name`` at ``version``
    (None: the default version), at ``commit_ids`` (per partition; None: the records').

    Raises
    ------
    FileNotFoundError
        No state there.
    VersionNotFoundError
        ``version`` is newer than some partition's newest version.
    ValueError
        A field name repeats across key and value, or is ``partition_id``; ``commit_ids``
        that are not one per partition; an unreadable batch record.
    """
    conf = conf or StateStoreConf()
    key, value, latest = state_partitions(checkpoint_root, operator_id, store_name, conf)
    names = [*key.names, *value.names, PARTITION_ID_COLUMN]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"the state of operator {operator_id} cannot be flattened: field name(s) {duplicates} "
                         f"repeat across the key fields {key.names}, the value fields {value.names} and "
                         f"'{PARTITION_ID_COLUMN}'")
    partitions = sorted(latest)
    if commit_ids is None:
        version, commit_ids = recorded_attempts(checkpoint_root, operator_id, store_name, version,
                                                conf.storage_options)
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
    return ReadPlan(key, value, partitions, version, commit_ids)


def plan_changes(checkpoint_root, operator_id, store_name="default", start_version=None, end_version=None,
                 commit_ids=None, conf=None):
    """``(plan, start_version)`` of the change feed of versions ``start_version`` to
    ``end_version``, checked on the driver: ``plan`` is :func:`plan_read`'s at ``end_version``
    (None: the default version). A start left out is the oldest version from which every
    partition still holds a delta of each version up to the end (deltas older than the
    retained snapshots are deleted by maintenance; one listing per partition), and never
    the version a repartition wrote (a snapshot, no delta).

    Raises
    ------
    ValueError
        The range starts at or before the version a repartition wrote (its changes were of
        the old partitioning; the message names the first batch the feed can start at); and
        what :func:`plan_read` raises.
    VersionNotFoundError
        The start is after the end; without a start, some partition holds no change of
        ``end_version`` (version 0, or only a snapshot of it); and what :func:`plan_read`
        raises.
    """
    conf = conf or StateStoreConf()
    location = operator_files.operator_dir(checkpoint_root, operator_id)
    try:
        metadata = operator_files.read_metadata(location, conf.storage_options)
    except ValueError:
        metadata = None  # partition_ids logs it
    moved = operator_files.repartitioned(metadata)
    first = 1 if moved is None else moved["version"] + 1
    if start_version is not None and start_version < first:
        raise ValueError(
            f"operator {operator_id} under {checkpoint_root} was {operator_files.moved_how(moved, metadata)} after "
            f"batch {moved['batch_id']}: its change feed can start at batch {moved['batch_id'] + 1} (start_version "
            f"{first}) at the earliest, not at batch {start_version - 1} (the changes before were not kept)")
    plan = plan_read(checkpoint_root, operator_id, store_name, end_version, commit_ids, conf)
    if start_version is not None:
        if start_version > plan.version:
            raise VersionNotFoundError(
                f"the change feed of operator {operator_id} under {checkpoint_root} from version {start_version} "
                f"(batch {start_version - 1}) ends before it starts: its end is version {plan.version}")
        return plan, start_version
    oldest = {p: _oldest_change(checkpoint_root, operator_id, store_name, p, plan.version, conf)
              for p in plan.partitions}
    start_version = max([first, *oldest.values()])
    if start_version > plan.version:
        raise VersionNotFoundError(
            f"operator {operator_id} under {checkpoint_root} (store {store_name!r}) holds no change of version "
            f"{plan.version}: partition(s) {sorted(p for p, v in oldest.items() if v > plan.version)} have no delta "
            f"of it (version 0, a version a repartition wrote as a snapshot, or a delta deleted)")
    return plan, start_version


def _oldest_change(checkpoint_root, operator_id, store_name, partition, end, conf):
    """The oldest version from which partition ``partition``'s directory holds a delta of
    every version up to ``end`` (``end + 1``: none, not even that version's), from one
    listing: no file is read (the tasks check, delta by delta, that the chain they follow
    passes through these)."""
    location = StateStoreId(checkpoint_root, operator_id, partition, store_name).store_checkpoint_location()
    files = open_store_files(location, conf.storage_options, conf.local_cache_dir)
    deltas = set(files.list_versions().versions("delta"))
    oldest = end + 1
    while oldest > 1 and oldest - 1 in deltas:
        oldest -= 1
    return oldest
