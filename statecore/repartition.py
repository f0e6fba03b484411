"""Repartitioning a StatefulOperator's state from N to M partitions, without Spark.

Every key of every store of the operator moves to the partition the operator routes it to
with M partitions (``pmod(hash(key columns), M)``, :mod:`statecore.spark_hash`), at the
version of the newest batch record, under new commit ids. The protocol (why a kill at any
point leaves the checkpoint at the old partitioning, and what is deleted when) is in
``docs/operating.md``, "repartition":

1. :func:`plan_repartition` checks everything and writes nothing;
2. :func:`prepare` finishes or clears what an earlier run left, then writes the journal
   (``<operator>/_repartition/<token>.json``: the new ids, so that leftovers of an
   interrupted run can be found by name);
3. :func:`read_sources` + :func:`write_targets` (or :func:`build_partition` per new
   partition, the Spark job's task) write ``<version>_<new id>.snapshot`` into each new
   partition's store directories, each verified whole after it is durable;
4. :func:`switch` rewrites ``_operator.json`` atomically with M partitions and the new
   batch record: the commit point;
5. :func:`finish` rewrites the batch record file, drops the older records and deletes the
   old partitioning's files (the new snapshots that replace them were verified in step 3).

:func:`repartition` runs all five locally. Each run holds the operator's lock
(:mod:`statecore.operator_lock`) from its plan to its end: :func:`planned` takes it, and
finishes first what an interrupted run left switched (:func:`finish_pending`).
:mod:`statecore.rewrite` runs the same protocol to the same number of partitions, its
transform applied as the rows are read; its switch also records the new schemas, which
:func:`finish` adds to each store directory's schema history (``docs/rewrite.md``).
"""
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import re

import numpy as np

from statecore import files as files_module
from statecore import operator_files, operator_lock
from statecore._rowtable import RowTable
from statecore._versions import join_rows
from statecore.checkpoint import MAX_PARTITIONS, CheckpointFiles
from statecore.conf import StateStoreConf
from statecore.contracts import create_and_init_provider
from statecore.errors import StateCorruptionError, UnsafeFileError
from statecore.expiry import DEFAULT_BUCKET_SHIFT, ExpiryIndex
from statecore.ids import StateStoreId
from statecore.lineage import ROOT_COMMIT_ID, file_name
from statecore.schema_file import (MAX_SCHEMA_FILE_BYTES, SCHEMA_FILE, SchemaEntry, read_store_schemas,
                                   record_schemas)
from statecore.schema import RowSchema, key_value_schemas
from statecore.snapshot_at import write_snapshot_at
from statecore.spark_hash import HASHABLE_TYPES, spark_partition

__all__ = ["RepartitionError", "RepartitionPlan", "StorePlan", "plan_repartition", "prepare", "read_sources",
           "write_targets", "build_partition", "switch", "switch_entry", "finish", "pending_switch", "finish_pending",
           "repartition", "planned", "summary", "REWRITE_KEY", "JOURNAL_DIR", "MAX_PARTITIONS"]

log = logging.getLogger(__name__)

JOURNAL_DIR = "_repartition"  # <checkpoint>/<operator>/_repartition/<token>.json
JOURNAL_FORMAT = "statecore-repartition-1"
REWRITE_KEY = operator_files.REWRITE_KEY  # re-exported: the repartition block's entry of a rewrite
ROWS_PER_READ = 1 << 20
WRITERS = min(os.cpu_count() or 1, 4)  # new snapshots written at once
READERS = min(os.cpu_count() or 1, 4)  # old partitions read at once
# The most partitions an operator may have, old or new: every partition is a directory per store
# and a commit id in every batch record, and each new one a random id made before anything is
# written. A count from --to, _operator.json or a journal is checked against it before it sizes
# anything (a journal naming 10**12 partitions would otherwise be walked for ever).
_COMMIT_ID = re.compile(r"[0-9a-f]{16}")  # as a journal records the new ids


class RepartitionError(ValueError):
    """The checkpoint, operator or partition count cannot be repartitioned; nothing was written."""


@dataclasses.dataclass
class StorePlan:
    """One store of the operator: its schemas, the attempt of the version each old partition
    holds, the new ids (one per new partition), and the key fields rows are routed by."""

    name: str
    key_dtype: np.dtype  # dtypes, not RowSchemas: the plan is pickled into the Spark job
    value_dtype: np.dtype
    old_ids: tuple
    new_ids: tuple
    schema_bytes: bytes  # the old partitions' _statecore.schema.json, copied to new directories
    # "keyed": rows routed by the key columns their keys hold; "index_heads" and
    # "index_entries": the two stores of an ExpiryIndex over the default store's keys, rebuilt
    # in each new partition from the entries routed by their keys (``partner``: the other one)
    role: str = "keyed"
    partner: str = None
    # A rewrite's default store, its schemas changed by the transform: the new snapshots are
    # written without the schema file, whose history records the new schemas after the switch.
    rewritten: bool = False

    @property
    def key_schema(self):
        return _schemas_of(self.key_dtype, self.value_dtype)[0]

    @property
    def value_schema(self):
        return _schemas_of(self.key_dtype, self.value_dtype)[1]


@functools.lru_cache(maxsize=64)
def _schemas_of(key_dtype, value_dtype):
    """A plan's schemas, built once per pair of dtypes (they are asked for on every batch)."""
    return key_value_schemas(key_dtype, value_dtype)


@dataclasses.dataclass
class RepartitionPlan:
    """Everything a repartition needs, found by :func:`plan_repartition` (picklable: the
    Spark job ships it to its tasks)."""

    checkpoint: str
    operator_id: int
    conf: StateStoreConf
    metadata: dict
    record: dict  # the newest batch record (old partitioning)
    batch_id: int
    version: int
    from_partitions: int
    to_partitions: int
    key_columns: list
    key_types: list
    stores: list  # StorePlan, the default store first
    token: str
    command: str = "repartition"  # or "rewrite" (statecore.rewrite): what the switch records
    finished: dict = None  # the repartition block of an interrupted run :func:`planned` finished first

    @property
    def operator_dir(self):
        return operator_files.operator_dir(self.checkpoint, self.operator_id)

    def store_location(self, partition, store_name):
        return StateStoreId(self.checkpoint, self.operator_id, partition, store_name).store_checkpoint_location()


def _files(location, conf):
    return files_module.open_store_files(location, conf.storage_options, conf.local_cache_dir)


def plan_repartition(checkpoint, operator_id, num_partitions, conf=None):
    """Check that operator ``operator_id`` of ``checkpoint`` can go to ``num_partitions`` and
    return the plan; RepartitionError naming what is wrong otherwise, StateCorruptionError or
    UnsafeFileError naming a damaged or refused file (a FIFO, a device). Writes nothing.
    ``num_partitions`` None keeps the operator's count (a rewrite in place)."""
    conf = conf or StateStoreConf()
    if num_partitions is not None and not _is_partition_count(num_partitions):
        raise RepartitionError(f"the number of partitions must be an int from 1 to {MAX_PARTITIONS} (MAX_PARTITIONS), "
                               f"got {num_partitions!r}")
    if not isinstance(operator_id, int) or isinstance(operator_id, bool) or operator_id < 0:
        raise RepartitionError(f"operator id must be an int >= 0, got {operator_id!r}")
    root = CheckpointFiles(checkpoint, conf.storage_options)
    if not root.entries():
        raise RepartitionError(f"{checkpoint} is not a checkpoint: it is missing or empty")
    location = operator_files.operator_dir(checkpoint, operator_id)
    where = CheckpointFiles(location, conf.storage_options).path(operator_files.OPERATOR_METADATA_FILE)
    try:
        metadata = operator_files.read_metadata(location, conf.storage_options)
    except (StateCorruptionError, UnsafeFileError):
        raise  # damage, not bad input
    except ValueError as e:
        raise RepartitionError(str(e)) from None
    if metadata is None:
        raise RepartitionError(f"operator {operator_id} of {checkpoint} has no {where}: only a StatefulOperator's "
                               f"state can be repartitioned")
    old = metadata.get("num_partitions")
    key_columns, key_types = metadata.get("key_columns"), metadata.get("key_column_types")
    if not _is_partition_count(old) or not key_columns or len(key_columns) != len(key_types or ()):
        raise RepartitionError(f"{where} is not a StatefulOperator's metadata (num_partitions from 1 to "
                               f"{MAX_PARTITIONS}, key columns)")
    num_partitions = old if num_partitions is None else num_partitions
    bad = [f"{c} ({t})" for c, t in zip(key_columns, key_types) if t not in HASHABLE_TYPES]
    if bad:
        raise RepartitionError(f"key column(s) {bad} of operator {operator_id}: repartition routes keys of the "
                               f"Spark types {', '.join(HASHABLE_TYPES)} only")
    records = operator_files.commit_log(location, conf.storage_options)
    batch_id = records.latest()
    if batch_id is None:
        raise RepartitionError(f"operator {operator_id} of {checkpoint} has no batch record under "
                               f"{records.location}: run a batch first (or start the checkpoint afresh with the "
                               f"new number of partitions)")
    try:
        record = operator_files.read_commit_record(records, batch_id, metadata)
    except (StateCorruptionError, UnsafeFileError):
        raise  # damage, not bad input
    except ValueError as e:
        raise RepartitionError(str(e)) from None
    if record["num_partitions"] != old:
        raise RepartitionError(f"the record of batch {batch_id} has {record['num_partitions']} partitions, "
                               f"{where} {old}")
    token = os.urandom(8).hex()
    names = [metadata.get("store_name", "default"), *sorted(record["store_commit_ids"])]
    stores = []
    for name in names:
        old_ids = record["commit_ids"] if name == names[0] else record["store_commit_ids"][name]
        stores.append(_store_plan(checkpoint, operator_id, name, old, old_ids, num_partitions, key_columns, conf,
                                  stores[0].key_dtype if stores else None))
    _pair_indexes(stores, operator_id)
    return RepartitionPlan(checkpoint, operator_id, conf, metadata, record, batch_id, batch_id + 1, old,
                           num_partitions, list(key_columns), list(key_types), stores, token)


def _is_partition_count(n):
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_PARTITIONS


def _pair_indexes(stores, operator_id):
    """Each expiry index's entries store with its heads store (named alike, ``entries`` ->
    ``heads``); RepartitionError for an index store without its pair."""
    by_name = {s.name: s for s in stores}
    for store in stores:
        if store.role != "index_entries":
            continue
        i = store.name.rfind("entries")
        heads = by_name.get(store.name[:i] + "heads" + store.name[i + len("entries"):]) if i >= 0 else None
        if heads is None or heads.role != "index_heads":
            raise RepartitionError(f"store {store.name!r} of operator {operator_id} is an expiry index's entries "
                                   f"without its heads store: it cannot be rebuilt in the new partitions")
        store.partner, heads.partner = heads.name, store.name
    lone = [s.name for s in stores if s.role == "index_heads" and s.partner is None]
    if lone:
        raise RepartitionError(f"store(s) {lone} of operator {operator_id} are not keyed by the operator's key "
                               f"columns and are no expiry index's heads: their rows cannot be routed")


def _store_plan(checkpoint, operator_id, name, old, old_ids, new, key_columns, conf, default_key=None):
    schemas = None
    for p in range(old):
        files = _files(StateStoreId(checkpoint, operator_id, p, name).store_checkpoint_location(), conf)
        schemas = read_store_schemas(files)  # StateCorruptionError: damage, as in any later step
        if schemas is not None:
            schema_bytes = files.read_bytes(SCHEMA_FILE, max_bytes=MAX_SCHEMA_FILE_BYTES)
            break
    if schemas is None:
        raise RepartitionError(f"store {name!r} of operator {operator_id} has no {SCHEMA_FILE} in any partition")
    key, value = schemas
    role = "keyed"
    if not set(key_columns) <= set(key.names):
        index = ExpiryIndex.schemas(default_key) if default_key is not None else {}
        role = next((f"index_{part}" for part, (k, v) in index.items() if (k, v) == (key.dtype, value.dtype)), None)
        if role is None:
            raise RepartitionError(
                f"store {name!r} of operator {operator_id} is keyed by {list(key.names)}, which do not hold the "
                f"operator's key columns {list(key_columns)}, and is no expiry index over the operator's keys: "
                f"its rows cannot be routed to the new partitions; this operator cannot be repartitioned")
    return StorePlan(name, key.dtype, value.dtype, tuple(old_ids), tuple(os.urandom(8).hex() for _ in range(new)),
                     schema_bytes, role)


# -- 2. the journal ------------------------------------------------------------------------------

def prepare(plan):
    """Finish the roll-forward of a repartition that switched but was interrupted, delete what
    interrupted runs left (found by their journals, and the temporary file of a journal whose
    write was killed: this run holds the operator's lock, so no live run is writing one), then
    write this run's journal."""
    journals = CheckpointFiles(f"{plan.operator_dir}/{JOURNAL_DIR}", plan.conf.storage_options)
    leftovers = journals.temporary_files()
    if leftovers:
        log.info("deleting what a killed journal write left in %s: %s", journals.location, leftovers)
        journals.delete(leftovers)
    moved = operator_files.repartitioned(plan.metadata)
    current = moved.get("journal") if moved else None
    for name, is_dir in journals.entries():
        if is_dir or not name.endswith(".json") or name.startswith("."):
            continue
        try:
            journal = _checked_journal(journals.read_json(name, "repartition journal"), journals.path(name))
        except (ValueError, OSError) as e:  # damage (read_json bounds size and nesting), or unreadable
            log.warning("skipping unreadable repartition journal %s: %s", journals.path(name), e)
            continue
        if name == f"{current}.json":
            finish(plan, previous=moved)  # the switch happened; its roll-forward did not end
        else:
            _discard(plan, journal)
            journals.delete([name])
    journals.write_json(f"{plan.token}.json", {
        "format": JOURNAL_FORMAT, "batch_id": plan.batch_id, "version": plan.version,
        "from_partitions": plan.from_partitions, "to_partitions": plan.to_partitions,
        "stores": {s.name: list(s.new_ids) for s in plan.stores}}, indent=1)


def _checked_journal(journal, where):
    """``journal`` if it is one :func:`prepare` writes, its counts within what a checkpoint
    allows; ValueError naming ``where`` otherwise (the caller skips it, deleting nothing)."""
    stores = journal.get("stores") if isinstance(journal, dict) else None
    if (not isinstance(stores, dict) or not _is_partition_count(journal.get("to_partitions"))
            or not isinstance(journal.get("version"), int) or isinstance(journal.get("version"), bool)
            or not all(isinstance(ids, list) and len(ids) <= MAX_PARTITIONS
                       and all(isinstance(i, str) and _COMMIT_ID.fullmatch(i) for i in ids)
                       for ids in stores.values())):
        raise ValueError(f"{where} is not a repartition journal (to_partitions from 1 to {MAX_PARTITIONS}, a "
                         f"version, 16-hex-digit ids per store)")
    return journal


def _discard(plan, journal):
    """Delete the snapshots an interrupted run wrote (named by its journal), and its new
    partition directories outside the current partitioning (nothing refers to them)."""
    known = {s.name for s in plan.stores}  # a journal names this operator's stores; no other path is touched
    for name, ids in journal["stores"].items():
        if name not in known:
            continue
        for q, commit_id in enumerate(ids):
            if q >= plan.from_partitions:
                continue
            files = _files(plan.store_location(q, name), plan.conf)
            files.delete([file_name(journal["version"], bytes.fromhex(commit_id), "snapshot")])
    top = journal.get("to_partitions", 0)
    CheckpointFiles(plan.operator_dir, plan.conf.storage_options).delete_trees(
        str(q) for q in range(plan.from_partitions, top))


# -- 3. the new partitions -------------------------------------------------------------------------

def _rows_of(keys, values, order=None):
    """``(n, key width + value width)`` uint8 rows of a batch the store handed out (structured
    arrays in their schemas' canonical layout), in ``order`` if given: one pass."""
    n = len(keys)
    return join_rows(keys.view(np.uint8).reshape(n, keys.dtype.itemsize),
                     values.view(np.uint8).reshape(n, values.dtype.itemsize) if values.dtype.itemsize
                     else np.empty((n, 0), dtype=np.uint8), order)


def read_sources(plan, targets=None, on_source=None, transform=None):
    """Read every old partition of every store at the plan's version and route its rows:
    ``{(store name, new partition): [row arrays]}`` for the new partitions in ``targets``
    (default: all). Old partitions are read one per core at a time (decoding, hashing and
    routing release the GIL); their rows are gathered in partition order, and ``on_source()``
    is called after each old store is read, on this thread, in that order. ``transform(store,
    partition, keys, values)`` (a rewrite's) returns each batch of the keyed stores as it is
    to be written: structured arrays in their schemas' canonical layout; it may be called from
    any reading thread (the rewrite's makes one call at a time)."""
    targets = range(plan.to_partitions) if targets is None else sorted(targets)
    wanted = np.zeros(plan.to_partitions, dtype=bool)
    wanted[list(targets)] = True
    out = {(s.name, q): [] for s in plan.stores for q in targets}
    keyed = [(store, p) for store in plan.stores if store.role == "keyed" for p in range(plan.from_partitions)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=READERS) as pool:
        for (store, _), routed in zip(keyed, pool.map(lambda source: _read_partition(plan, *source, wanted,
                                                                                     transform), keyed)):
            for q, rows in routed:
                out[(store.name, q)].append(rows)
            if on_source is not None:
                on_source()
    for entries in (s for s in plan.stores if s.role == "index_entries"):
        _route_index(plan, entries, next(s for s in plan.stores if s.name == entries.partner), targets, out)
        if on_source is not None:
            for _ in range(2 * plan.from_partitions):  # both stores of the index
                on_source()
    return out


def _read_partition(plan, store, p, wanted, transform):
    """The rows of old partition ``p``'s ``store`` routed: ``[(new partition, rows)]`` for
    the new partitions ``wanted`` marks, in the order read."""
    routed = []
    for keys, values in _version_rows(plan, store, p):
        if transform is not None:
            keys, values = transform(store, p, keys, values)
        dest = spark_partition([keys[c] for c in plan.key_columns], plan.key_types, plan.to_partitions)
        keep = wanted[dest]
        if not keep.all():
            keys, values, dest = keys[keep], values[keep], dest[keep]
        if not len(dest):
            continue
        if dest.min() == dest.max():  # one partition (a rewrite in place): no sort
            routed.append((int(dest[0]), _rows_of(keys, values)))
            continue
        # a stable sort of small ints is a radix sort in numpy: linear, no comparisons
        order = np.argsort(dest.astype(np.uint16 if plan.to_partitions <= 1 << 16 else np.int64), kind="stable")
        rows = _rows_of(keys, values, order)
        bounds = np.searchsorted(dest[order], np.arange(plan.to_partitions + 1))
        routed.extend((q, rows[bounds[q]:bounds[q + 1]]) for q in np.flatnonzero(np.diff(bounds)).tolist())
    return routed


def _route_index(plan, entries, heads, targets, out):
    """An expiry index moved: every entry of the old partitions' entries stores goes to the
    new partition of its key, where the index is rebuilt (same bucket shift) and its two
    stores' rows put in ``out``."""
    key_dtype = plan.stores[0].key_dtype
    routed = {q: [] for q in targets}
    for p in range(plan.from_partitions):
        for _, chunks in _version_rows(plan, entries, p):
            times, keys = ExpiryIndex.entries_of_chunks(key_dtype, chunks)
            dest = spark_partition([keys[c] for c in plan.key_columns], plan.key_types, plan.to_partitions)
            for q in targets:
                mine = dest == q
                if mine.any():
                    routed[q].append((times[mine], keys[mine]))
    shift = _bucket_shift(plan, heads)
    for q in targets:
        built = {s.name: _TableStore(s.key_dtype, s.value_dtype) for s in (heads, entries)}
        index = ExpiryIndex(built[heads.name], built[entries.name], key_dtype, bucket_shift=shift)
        if routed[q]:
            index.add(np.concatenate([t for t, _ in routed[q]]), np.concatenate([k for _, k in routed[q]]))
        for name, table in built.items():
            rows = table.rows()
            if len(rows):
                out[(name, q)].append(rows)


def _old_provider(plan, store, p):
    """A provider of old partition ``p``'s ``store``, opened from the files."""
    return create_and_init_provider(StateStoreId(plan.checkpoint, plan.operator_id, p, store.name),
                                    store.key_schema, store.value_schema, plan.conf)


def _version_rows(plan, store, p):
    """The rows of old partition ``p``'s ``store`` at the plan's version, in batches."""
    provider = _old_provider(plan, store, p)
    try:
        yield from provider.version_rows(plan.version, store.old_ids[p], ROWS_PER_READ)
    finally:
        provider.close()


def _bucket_shift(plan, heads):
    """The bucket shift the old partitions' indexes were built with (all alike)."""
    shifts = set()
    for p in range(plan.from_partitions):
        provider = _old_provider(plan, heads, p)
        try:
            reader = provider.get_read_store(plan.version, heads.old_ids[p])
            try:
                shifts.add(ExpiryIndex.recorded_shift(reader))
            finally:
                reader.abort()
        finally:
            provider.close()
    shifts.discard(None)
    if len(shifts) > 1:
        raise RepartitionError(f"the expiry indexes in store {heads.name!r} were built with different bucket "
                               f"shifts {sorted(shifts)}")
    return shifts.pop() if shifts else DEFAULT_BUCKET_SHIFT


class _TableStore:
    """The batch calls an ExpiryIndex makes, over an in-memory table: a new partition's index
    is built here, then written as its stores' snapshots."""

    def __init__(self, key_dtype, value_dtype):
        self.key_schema, self.value_schema = key_value_schemas(key_dtype, value_dtype)
        self.table = RowTable(self.key_schema, self.value_schema)

    def get_batch(self, keys):
        return self.table.get_batch(keys)

    def put_batch(self, keys, values):
        self.table.put_rows(self.key_schema.rows(keys), self.value_schema.rows(values))

    def remove_batch(self, keys):
        self.table.remove_rows(self.key_schema.rows(keys))

    def rows(self):
        return join_rows(*self.table.export_rows())


def write_targets(plan, routed, on_target=None):
    """Write the snapshot of each new partition and store in ``routed`` (from
    :func:`read_sources`), one per core at a time (the writer and its packing release the
    GIL); returns ``{(store, partition): rows}``. ``on_target()`` after each, on this thread."""
    def write(target):
        (name, q), chunks = target
        store = next(s for s in plan.stores if s.name == name)
        rows = _write_snapshot(plan, store, q, chunks)
        chunks.clear()  # the rows are on disk: let them go
        return (name, q), rows

    written = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=WRITERS) as pool:
        for target, rows in pool.map(write, sorted(routed.items())):
            written[target] = rows
            if on_target is not None:
                on_target()
    return written


def build_partition(plan, partition):
    """New partition ``partition`` whole (every store): what one task of the Spark job does.
    Returns ``{store name: rows}``."""
    written = write_targets(plan, read_sources(plan, [partition]))
    return {name: rows for (name, _), rows in written.items()}


def _write_snapshot(plan, store, q, chunks):
    # Checked whole before anything relies on it: the old files go on the strength of it.
    return write_snapshot_at(_files(plan.store_location(q, store.name), plan.conf), plan.version,
                             bytes.fromhex(store.new_ids[q]), store.key_schema, store.value_schema, chunks,
                             sum(len(c) for c in chunks), plan.conf.compression, schema_bytes=store.schema_bytes,
                             schema_file=not store.rewritten)


# -- 4. the switch, 5. the roll-forward --------------------------------------------------------------

def new_record(plan):
    """The record of the plan's batch at the new partitioning."""
    default, *others = plan.stores
    record = operator_files.commit_record(
        plan.batch_id, plan.to_partitions, default.name, f"{plan.command}-{plan.token}", default.new_ids,
        [ROOT_COMMIT_ID.hex()] * plan.to_partitions, store_commit_ids={s.name: s.new_ids for s in others},
        watermarks=plan.record.get("watermarks"), batch_timestamp_ms=plan.record.get("batch_timestamp_ms"),
        late_rows=plan.record.get("late_rows"), writer=plan.command)
    record["repartitioned_from"] = plan.from_partitions
    return record


def switch(plan):
    """The commit point: ``_operator.json`` rewritten atomically with the new number of
    partitions and the batch record at the new partitioning (a rewrite's: the new schemas too,
    and the ``rewrite`` entry :func:`finish` records them in every store directory from)."""
    metadata = dict(plan.metadata)
    metadata["num_partitions"] = plan.to_partitions
    moved = switch_entry(plan)
    if REWRITE_KEY in moved:
        metadata["key_schema"], metadata["value_schema"] = (moved[REWRITE_KEY]["key_schema"],
                                                            moved[REWRITE_KEY]["value_schema"])
    metadata[operator_files.REPARTITION_KEY] = moved
    CheckpointFiles(plan.operator_dir, plan.conf.storage_options).write_json(
        operator_files.OPERATOR_METADATA_FILE, metadata, indent=1)
    return metadata


def finish(plan, previous=None):
    """After the switch: the record file of the batch rewritten, older records deleted, the
    old partitioning's files deleted, the journal last. Idempotent (``previous``: the
    metadata's repartition block of a run being finished by a later one)."""
    moved = previous or switch_entry(plan)
    _roll_forward(plan.checkpoint, plan.operator_id, plan.conf, moved)


def switch_entry(plan):
    """The metadata's repartition block :func:`switch` writes for ``plan``."""
    moved = {"batch_id": plan.batch_id, "record": new_record(plan), "journal": plan.token,
             "from_partitions": plan.from_partitions, "version": plan.version}
    default = plan.stores[0]
    if default.rewritten:
        moved[REWRITE_KEY] = {"key_schema": default.key_schema.describe(),
                              "value_schema": default.value_schema.describe()}
    return moved


def pending_switch(checkpoint, operator_id, conf):
    """The repartition block of a switched run (a repartition's or a rewrite's) whose
    roll-forward was interrupted (its journal is still there), or None."""
    location = operator_files.operator_dir(checkpoint, operator_id)
    moved = operator_files.repartitioned(operator_files.read_metadata(location, conf.storage_options))
    journal = moved.get("journal") if moved else None
    if not isinstance(journal, str) or not _COMMIT_ID.fullmatch(journal):
        return None
    journals = CheckpointFiles(f"{location}/{JOURNAL_DIR}", conf.storage_options)
    if not any(name == f"{journal}.json" for name, is_dir in journals.entries() if not is_dir):
        return None
    return moved


def finish_pending(checkpoint, operator_id, conf):
    """Finish the roll-forward of the :func:`pending_switch`, if there is one; returns its
    repartition block, or None."""
    moved = pending_switch(checkpoint, operator_id, conf)
    if moved is not None:
        _roll_forward(checkpoint, operator_id, conf, moved)
    return moved


def _record_rewritten_schemas(checkpoint, operator_id, conf, moved):
    """A rewrite's new schemas made the newest entry of every partition's default store's
    schema history (after the switch: the new snapshots carry their own schemas)."""
    rewrite = moved.get(REWRITE_KEY)
    if not isinstance(rewrite, dict):
        return
    key, value = key_value_schemas(RowSchema.from_description(rewrite["key_schema"]).dtype,
                                   RowSchema.from_description(rewrite["value_schema"]).dtype)
    record = moved["record"]
    entry = SchemaEntry(key, value, from_version=moved["version"], rewritten=True)
    for q in range(record["num_partitions"]):
        location = StateStoreId(checkpoint, operator_id, q, record["store_name"]).store_checkpoint_location()
        record_schemas(_files(location, conf), entry, location)


def _roll_forward(checkpoint, operator_id, conf, moved):
    """:func:`finish` of the run whose repartition block is ``moved``."""
    operator_dir = operator_files.operator_dir(checkpoint, operator_id)
    _record_rewritten_schemas(checkpoint, operator_id, conf, moved)
    record = dict(moved["record"])
    partitions, version = record["num_partitions"], moved["version"]
    records = operator_files.commit_log(operator_dir, conf.storage_options)
    records.write(moved["batch_id"], record)
    records.delete_before(moved["batch_id"])
    keep = {record["store_name"]: record["commit_ids"], **record["store_commit_ids"]}
    for q in range(partitions):
        for name, ids in keep.items():
            files = _files(StateStoreId(checkpoint, operator_id, q, name).store_checkpoint_location(), conf)
            own = file_name(version, bytes.fromhex(ids[q]), "snapshot")
            # Versions after the switch's are the new partitioning's own (batches that ran
            # before an interrupted roll-forward was finished): kept.
            files.delete([f.name for f in files.list_versions() if f.version <= version and f.name != own])
    CheckpointFiles(operator_dir, conf.storage_options).delete_trees(
        name for name, is_dir in CheckpointFiles(operator_dir, conf.storage_options).entries()
        if is_dir and name.isascii() and name.isdigit() and int(name) >= partitions)
    journals = CheckpointFiles(f"{operator_dir}/{JOURNAL_DIR}", conf.storage_options)
    journals.delete([f"{moved['journal']}.json"])


@contextlib.contextmanager
def planned(checkpoint, operator_id, num_partitions, conf=None, command="repartition"):
    """The plan, made and used under the operator's lock (``docs/operating.md``, "The operator
    lock"): checked once before the lock is taken, so that bad input writes nothing, not even
    the lock, and made again once it is held, after an interrupted run's roll-forward is
    finished (:func:`finish_pending`, recorded in the plan's ``finished``), so that what an
    earlier run changed is seen. OperatorLockedError if another command or a running query
    holds the lock. ``command`` names the lock's holder."""
    conf = conf or StateStoreConf()
    plan_repartition(checkpoint, operator_id, num_partitions, conf)
    with operator_lock.held(checkpoint, operator_id, command, conf.storage_options):
        finished = finish_pending(checkpoint, operator_id, conf)  # its schemas are then the ones to plan with
        plan = plan_repartition(checkpoint, operator_id, num_partitions, conf)
        plan.finished = finished
        yield plan


def repartition(checkpoint, operator_id, num_partitions, conf=None, on_source=None, on_target=None):
    """Repartition operator ``operator_id`` of ``checkpoint`` to ``num_partitions``, locally
    (every step of the module docstring, under the operator's lock). Returns a summary dict."""
    with planned(checkpoint, operator_id, num_partitions, conf) as plan:
        prepare(plan)
        written = write_targets(plan, read_sources(plan, on_source=on_source), on_target)
        switch(plan)
        finish(plan)
    return summary(plan, written)


def summary(plan, written):
    """What a repartition did, as the CLI prints it."""
    return {"checkpoint": plan.checkpoint, "operator_id": plan.operator_id, "batch_id": plan.batch_id,
            "version": plan.version, "from_partitions": plan.from_partitions, "to_partitions": plan.to_partitions,
            "stores": {s.name: {"rows": sum(n for (name, _), n in written.items() if name == s.name),
                                "commit_ids": list(s.new_ids)} for s in plan.stores}}

