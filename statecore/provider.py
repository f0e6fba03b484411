"""The default provider: versioned stores over delta and snapshot files on any fsspec filesystem.

``provider.get_store(v)`` returns a store holding version ``v``; its updates go to a private
layer, invisible to everyone else until ``commit()`` writes ``<v+1>_<id>.delta`` and merges
the layer into the versions held in memory (:mod:`statecore.held_versions`, over
:mod:`statecore._versions`' States): no version is ever copied. This module keeps the provider's
lifecycle: opening a version (which attempt, from memory, rolled forward, or loaded), the
cache of version files' headers, maintenance entry points and metrics. The jobs it hands out:
the commit protocol (:mod:`statecore.commit`), loading and roll-forward
(:mod:`statecore.loading`), whole-version reads and the change feed
(:mod:`statecore.version_reads`), the schema file (:mod:`statecore.schema_file`), the store
objects (:mod:`statecore.stores`), snapshots and cleanup (:mod:`statecore.maintenance`). The
locks, what each guards, and the rules a commit follows against stale attempts are in
``docs/provider-rules.md``.
"""
import dataclasses
import logging
import os
import threading

from statecore import commit as commit_module, files as files_module, held_versions, loading, version_reads
from statecore.commit import DELTA_WRITERS
from statecore._delta import HEADER_SIZE as DELTA_HEADER_SIZE, read_delta_header
from statecore.conf import StateStoreConf
from statecore.contracts import StateStoreProvider
from statecore.errors import (IllegalStateError, SchemaMismatchError, StateCorruptionError, UnsafeFileError,
                              VersionNotFoundError)
from statecore.held_versions import HeldVersions
from statecore.ids import StateStoreId
from statecore.lineage import ROOT_COMMIT_ID, Chain, check_names_agree, file_name, parse_commit_id
from statecore.maintenance import MaintenanceRecord
from statecore.metrics import FILE_PROVIDER_CUSTOM_METRICS, StateStoreMetrics
from statecore.schema import key_value_schemas
from statecore.schema_file import (MAX_SCHEMA_FILE_BYTES, SCHEMA_FILE, SchemaEntry, SchemaHistory, plan_change,
                                   read_schema_history, read_store_schemas, record_schemas, schema_file_bytes)
from statecore.snapshot_files import read_header as read_snapshot_file_header
from statecore.stores import FileReadStore, FileStore, View

# Re-exported: the schema file's names (statecore.schema_file's) and DELTA_WRITERS (statecore.commit's).
# The spill and snapshot ratios moved to statecore.held_versions, which reads them: not re-exported,
# so that a patch of them here fails rather than changing nothing.
__all__ = ["FileStateStoreProvider", "read_store_schemas", "schema_file_bytes", "read_version_header", "SCHEMA_FILE",
           "MAX_SCHEMA_FILE_BYTES", "DELTA_WRITERS"]

log = logging.getLogger(__name__)

_HEADER_CACHE_ENTRIES = 4096
_NOT_YET = 1 << 62  # the from_version of a schema change not recorded yet: after every version


class FileStateStoreProvider(StateStoreProvider):
    """The default provider: deltas and snapshots on any fsspec filesystem (see the module
    docstring and ``docs/provider-rules.md``). ``held``: the versions it holds in memory
    (:class:`~statecore.held_versions.HeldVersions`), which its stores pin and read under
    ``held.lock``; ``files``, ``conf``, ``key_schema``, ``value_schema``: what it was opened
    with, for its stores, commits, loads and maintenance."""

    def __init__(self):
        self.held = HeldVersions()
        self.maintenance_record = MaintenanceRecord()  # what maintenance remembers between passes
        self._image_published = None  # the path of the whole image this provider published last
        self._maintaining = threading.Lock()  # one maintenance pass at a time per provider
        self._committing = threading.Lock()  # commits of one provider run one at a time
        self._headers_lock = threading.Lock()  # guards _headers
        self._headers = {}  # file name -> (commit_id, parent_id): names with ids never change
        self._maintenance_hint = None  # called when the head is due to be spilled
        self._hits = self._misses = self._rolled_forward = 0
        self._schema_written = False
        self._history = None  # the store's SchemaHistory as read, with this provider's change added
        self._plans = {}  # (entry of a file, this provider's entry) -> the StatePlans between
        self._closed = False

    # -- StateStoreProvider ------------------------------------------------------------------
    def init(self, store_id, key_schema, value_schema, key_index_ordinal=None, conf=None):
        if not isinstance(store_id, StateStoreId):
            raise TypeError(f"store_id must be a StateStoreId, got {type(store_id).__name__}")
        self._store_id = store_id
        self._key_schema, self._value_schema = key_value_schemas(key_schema, value_schema)
        self._key_index_ordinal = key_index_ordinal
        self._conf = conf or StateStoreConf()
        self.held.keep_in_memory = self._conf.max_versions_to_retain_in_memory
        self._dir = store_id.store_checkpoint_location()
        self._files = files_module.open_store_files(self._dir, self._conf.storage_options,
                                                    self._conf.local_cache_dir)
        self._files.mkdirs()
        self._history = read_schema_history(self._files)
        self._schema_written = self._plan_schema_change()

    def _plan_schema_change(self):
        """Whether the store records this provider's schemas as its newest (nothing to record
        at the first commit). When its newest differ, the change is planned now, before
        anything is written (SchemaEvolutionError if the rules refuse it), with the store's
        declared :class:`~statecore.schema_evolution.SchemaChanges` (``conf.schema_changes``),
        and added to the history held; the first commit records it (``docs/evolution.md``). A
        store without a schema file is held as a history of these schemas alone."""
        history = self._history
        if history is None:
            self._history = SchemaHistory([SchemaEntry(self._key_schema, self._value_schema, 0)])
            return False
        plan = plan_change(history, self._key_schema, self._value_schema,
                           self._conf.schema_changes_of(self._store_id.store_name))
        if plan is None:
            return True
        declared = plan.declared()
        log.info("the schemas of %s change: %s", self, "; ".join(plan.describe()))
        self._history = history.with_entry(SchemaEntry(
            self._key_schema, self._value_schema, _NOT_YET, tuple(sorted(declared.renames.items())),
            tuple(sorted(declared.defaults.items()))))
        return False

    def __repr__(self):
        sid = self._store_id
        return f"FileStateStoreProvider[id = (op={sid.operator_id},part={sid.partition_id}),dir = {self._dir}]"

    @property
    def state_store_id(self):
        return self._store_id

    @property
    def supported_custom_metrics(self):
        return FILE_PROVIDER_CUSTOM_METRICS

    @property
    def files(self):
        """The store directory's :class:`statecore.files.StoreFiles`."""
        return self._files

    @property
    def directory(self):
        return self._dir

    @property
    def conf(self):
        return self._conf

    @property
    def key_schema(self):
        return self._key_schema

    @property
    def value_schema(self):
        return self._value_schema

    def get_store(self, version, commit_id=None):
        view = self._view_of(version, commit_id)
        view.named = commit_id is not None
        return FileStore(self, view)

    def get_read_store(self, version, commit_id=None):
        return FileReadStore(self, self._view_of(version, commit_id))

    def close(self):
        with self.held.lock:
            self._closed = True
            self.held.newest = None
            published, self._image_published = self._image_published, None
        _remove_image(published)  # no longer this process's to keep: its mappings stay valid

    def do_maintenance(self):
        """Spills, snapshots and cleanup (:mod:`statecore.maintenance`), one pass at a time: a
        call while a pass runs (the registry's thread woken by a commit) waits for it and then
        runs its own, so that a pass asked for always sees the versions committed before."""
        from statecore.maintenance import run_maintenance
        with self._maintaining:
            run_maintenance(self)

    def spill_if_outgrown(self, ratio=None):
        """Spill the head if it outgrew ``ratio`` (SPILL_RATIO by default) of the state
        (``docs/provider-rules.md``, "Spilling the head"); what the registry's thread does
        when a commit wakes it. Not within SPILL_RETRY_S of a failed spill (maintenance
        passes try again on their period)."""
        from statecore.maintenance import spill_if_outgrown
        spill_if_outgrown(self, ratio, after_failure_wait=True)

    def spill_after_commit(self):
        """Spill the head on the committing thread: maintenance did not keep it under its
        hard limit. A failure is logged (the commit stands; maintenance tries again)."""
        try:
            self.spill_if_outgrown(held_versions.SPILL_HARD_RATIO)
        except Exception as e:  # the version is committed: a failed spill must not say otherwise
            log.warning("could not spill the head of %s after a commit (maintenance tries again): %s", self, e)

    def set_maintenance_hint(self, hint):
        """``hint()`` is called (from a committing task) when the head is due to be spilled;
        the registry passes a function that wakes its maintenance thread."""
        self._maintenance_hint = hint

    def hint_maintenance(self):
        """The head is due to be spilled: wake the registry's maintenance thread, if any."""
        if self._maintenance_hint is not None:
            self._maintenance_hint()

    # -- lineage over the files ----------------------------------------------------------------
    def chain(self, listing):
        """The :class:`statecore.lineage.Chain` of ``listing`` (headers read through the cache)."""
        return Chain(listing, self._header_of, self._mtime_of, self._files.path, self)

    def _mtime_of(self, f):
        return self._files.mtime(f.name)

    def _header_of(self, f):
        """``(commit_id, parent_id)`` of a version file from its checked header (the parent
        is None for a snapshot). The header must agree with the name: version and id."""
        with self._headers_lock:
            cached = self._headers.get(f.name)
        if cached is not None:
            return cached
        commit_id, parent_id = read_version_header(self._files, f)
        if f.commit_id is not None:  # the names of the previous layout can be re-written
            self.remember_header(f.name, commit_id, parent_id)
        return commit_id, parent_id

    def remember_header(self, name, commit_id, parent_id):
        """Cache the ids of the version file ``name`` (its name carries its commit id and
        is never re-written: the header cannot change)."""
        with self._headers_lock:
            if len(self._headers) >= _HEADER_CACHE_ENTRIES:
                self._headers.clear()
            self._headers[name] = (commit_id, parent_id)

    def resolve(self, version, commit_id, listing):
        """The commit id of the attempt of ``version`` to open (named, or the default
        lineage's); VersionNotFoundError if there is none."""
        chain = self.chain(listing)
        if commit_id is None:
            return chain.default_id(version)
        commit_id = parse_commit_id(commit_id)
        if version == 0:
            if commit_id != ROOT_COMMIT_ID:
                raise VersionNotFoundError(f"version 0 of {self} is the empty state: its id is {ROOT_COMMIT_ID.hex()}")
            return commit_id
        if chain.find("delta", version, commit_id) is None and chain.find("snapshot", version, commit_id) is None:
            name = self._files.path(file_name(version, commit_id, "delta"))
            raise VersionNotFoundError(f"Error reading delta file {name} of {self}: {name} does not exist")
        return commit_id

    # -- versions --------------------------------------------------------------------------
    def _view_of(self, version, commit_id=None):
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if version < 0:
            raise ValueError(f"Version cannot be less than 0, got {version}")
        if commit_id is not None:
            view = self._named_from_memory(version, parse_commit_id(commit_id))
            if view is not None:
                return view
        listing = self._files.list_versions()
        target = self.resolve(version, commit_id, listing)
        held = self.held
        with held.lock:
            if self._closed:
                raise IllegalStateError(f"{self} is closed")
            latest = held.newest
            if latest is not None and latest.holds(version):
                if latest.commit_ids[version] == target:
                    self._hits += 1
                    held.know_files(latest, listing)
                    return View(self, latest, version, listing)
                # Another attempt's version is the one asked for (a batch re-executed in
                # another process, or the driver named another winner): load that one.
                log.warning("version %d of %s in memory is attempt %s, not %s; loading it from files",
                            version, self, latest.commit_ids[version].hex(), target.hex())
            if version > 0:  # version 0 is the empty state: nothing to load (as in Spark)
                self._misses += 1
        view = self._roll_forward(latest, version, target, listing)
        if view is not None:
            return view
        log.info("version %d of %s is not in memory; loading it from files", version, self)
        state = loading.load(self, version, target, listing)
        with held.lock:
            # The loaded state becomes the one kept when it is newer, or when the one kept holds
            # another attempt of this version (its lineage was abandoned); a read of an older
            # version it no longer holds leaves it in place.
            keep = held.keep_in_memory > 0 and (
                held.newest is None or version >= held.newest.version
                or held.newest.commit_ids.get(version) is not None)
            if keep:
                held.newest = state
                held.know_files(state, listing)
            return View(self, state, version, listing)

    def _named_from_memory(self, version, commit_id):
        """A view of attempt ``commit_id`` of ``version`` without listing the files, or None.
        When it is the newest version this provider holds, from memory; when it is a few
        versions above it (another worker of the executor ran the batches between), rolled
        forward by the deltas read by name. Either way only while the files were known when
        the State held became the newest (a query's steady state: the driver names the
        attempts). The view is not ``listed``: its commit skips the stale-attempt listings
        (``docs/provider-rules.md``, "Opening the newest version without a listing")."""
        held = self.held
        with held.lock:
            if self._closed:
                raise IllegalStateError(f"{self} is closed")
            latest, known = held.newest, held.files_known
            if known is None or latest.pending is not None or latest.version > version:
                return None
            if latest.version == version:
                if latest.commit_ids[version] != commit_id:
                    return None
                self._hits += 1
                view = View(self, latest, version, known)
                view.listed = False
                return view
        if version - latest.version > max(self._conf.min_deltas_for_snapshot, 1):
            return None  # a load from a snapshot may read less: the listing tells
        deltas = loading.deltas_by_name(self, latest, version, commit_id)
        if deltas is None:
            return None
        with held.lock:
            self._misses += 1  # not in memory, as a listed roll-forward counts it
        view = self._roll_forward_with(latest, version, deltas, known)  # what it read is not above
        if view is not None:
            view.listed = False
        return view

    def _roll_forward(self, latest, version, commit_id, listing):
        """A view of ``version`` reached from ``latest``, the newest version in memory, by the
        deltas committed since (another process of the executor ran the batches in between;
        :func:`statecore.loading.roll_newest_forward`), or None when a load from files is the
        better way: no state in memory, another lineage, a snapshot newer than the version
        held, or the state changed while the deltas were read."""
        if latest is None or latest.pending is not None or latest.version >= version:
            return None
        deltas = loading.deltas_to_roll_forward(self, latest, version, commit_id, listing)
        if deltas is None:
            return None
        return self._roll_forward_with(latest, version, deltas, listing)

    def _roll_forward_with(self, latest, version, deltas, listing):
        """:meth:`_roll_forward` once the ``deltas`` are read; ``listing``: the files as known."""
        start = latest.version
        held = self.held
        with held.lock:
            if self._closed or held.newest is not latest or latest.version != start or latest.pending is not None:
                return None
            rolled = loading.roll_newest_forward(self, latest, deltas, version)
            if rolled is None:
                return None
            state, replayed = rolled
            self._rolled_forward += 1
            held.newest = state
            held.know_files(state, listing)
            held.retain(state)
            head_due = held.spill_due(state)
            view = View(self, state, version, listing)
        log.info("version %d of %s reached from version %d in memory by %d deltas (%s)",
                 version, self, start, len(deltas), "replayed" if replayed else "merged")
        if head_due:
            self.hint_maintenance()
        return view

    # -- commit ----------------------------------------------------------------------------
    def commit_update(self, view, update, opened_values=None):
        """Commit a store's ``update`` layer on ``view`` (:func:`statecore.commit.commit`), one
        commit of this provider at a time: ``(new_version, num_keys, commit_id, committed)``."""
        with self._committing:
            return commit_module.commit(self, view, update, opened_values)

    # -- whole images shared by the processes of a machine ----------------------------------
    def publish_image(self, version, commit_id, path):
        """Give the other processes of this machine the whole image of ``version`` (attempt
        ``commit_id``) that maintenance just wrote at ``path``, as the image of that version's
        delta (a worker of the same executor that opens the version then maps it instead of
        replaying deltas); the one this provider published before goes. Local files only;
        best effort (a failure leaves the image to be unlinked, and is logged)."""
        if not self._files.is_local:
            return
        name = file_name(version, commit_id, "delta")
        try:
            cached = self._files.publish_image(name, path)
        except OSError as e:  # the delta is gone (cleaned up), or the cache is not writable
            log.info("whole image of version %d of %s not published: %s", version, self, e)
            return
        with self.held.lock:
            older, self._image_published = self._image_published, cached
        if older != cached:
            _remove_image(older)


    # -- whole versions, read once -------------------------------------------------------------
    def version_rows(self, version, commit_id=None, rows_per_batch=1 << 20):
        """Yield ``(keys, values)`` batches of every row of ``version`` (at ``commit_id``, or
        the default lineage's), for a reader that visits each row once (a repartition, an
        export, read_state). A version that is the delta of version 1 alone is read straight
        from it (checked to its trailer, then its puts: a delta holds each key once), without
        building it in memory; any other goes through a read-only store (``get_read_store``:
        a snapshot is mapped, a damaged one skipped for an older one and its deltas)."""
        return version_reads.version_rows(self, version, commit_id, rows_per_batch)

    # -- change feed -----------------------------------------------------------------------
    def changes(self, start_version, end_version, commit_id=None):
        """Yield ``(version, is_put, keys, values)`` for each version from ``start_version``
        to ``end_version`` (both >= 1), oldest first: the net change of each version, read from
        its delta alone (a put is a key's new value; a removal, of a key the version before
        held, has ``values`` None). ``commit_id`` names the attempt of ``end_version`` (default:
        the default lineage's); the older versions are those its chain passes through. Every
        delta is checked to its trailer before its rows are yielded.

        Raises VersionNotFoundError if a version in the range has no delta on that chain
        (never committed, or its delta deleted by cleanup after a snapshot)."""
        return version_reads.changes(self, start_version, end_version, commit_id)

    # -- schemas ---------------------------------------------------------------------------
    def write_schema_file(self, version):
        """Record the store's schemas with this provider's first commit (of ``version``): the
        store's first, or the first under schemas that changed (``docs/evolution.md``)."""
        if not self._schema_written:
            entry = dataclasses.replace(self._history.newest, from_version=version)
            record_schemas(self._files, entry, self._dir)
            self._history = SchemaHistory(self._history.entries[:-1] + (entry,))
            self._plans = {}
            self._schema_written = True

    @property
    def schemas_changed_at(self):
        """The first version written under this provider's schemas, when they are the store's
        newest and replaced others; else 0. Maintenance snapshots a version at or above it at
        its next pass, so that the loads after it convert nothing (``docs/evolution.md``)."""
        history = self._history
        if not self._schema_written or len(history.entries) < 2:
            return 0
        newest = history.newest
        own = newest.key == self._key_schema and newest.value == self._value_schema
        return newest.from_version if own else 0

    def schema_plans(self, fingerprints, widths, version, path):
        """The :class:`~statecore.schema_evolution.StatePlan` s that convert the rows of a
        version file (of ``version``, at ``path``) whose header names its key and value schemas
        by ``fingerprints`` and row ``widths`` into this provider's schemas: none when it was
        written under this provider's entry of the store's schema history, else the history's
        plans from the entry it was written under (read again once when no entry names it:
        another writer may have added it). SchemaMismatchError if none does;
        SchemaEvolutionError if the rules refuse."""
        (key_fp, value_fp), (key_width, value_width) = fingerprints, widths
        history = self._history
        found = history.entry_of(key_fp, value_fp, version)
        if found is None:
            history = self._history_read_again()
            found = history.entry_of(key_fp, value_fp, version)
        if found is not None and (history.entries[found].key.width != key_width
                                  or history.entries[found].value.width != value_width):
            found = None
        if found is None:
            raise SchemaMismatchError(
                f"schema mismatch in '{path}': the file has key rows of {key_width} bytes (fingerprint "
                f"0x{key_fp:016x}) and value rows of {value_width} bytes (fingerprint 0x{value_fp:016x}); "
                f"neither the schemas asked for (key {self._key_schema.describe()}, value "
                f"{self._value_schema.describe()}) nor the store's schema history name them")
        own = history.latest_of(self._key_schema, self._value_schema)
        plans = self._plans.get((found, own))
        if plans is None:
            plans = self._plans[(found, own)] = history.plans(found, own)
        return plans

    def _history_read_again(self):
        """The store's schema history read again (this provider's unrecorded change added),
        held from now on."""
        history = read_schema_history(self._files)
        if history is None:
            return self._history
        if not self._schema_written and len(self._history.entries) > 1:
            history = history.with_entry(self._history.newest)
        self._history, self._plans = history, {}
        return history

    # -- metrics ---------------------------------------------------------------------------
    def describe(self):
        """What this provider holds in memory, as a dict (for tests and debugging, as LevelDB's
        DebugString): ``latest``, the newest State's ``State.describe()`` (None: none held),
        and its counters (loads from memory and from files, roll-forwards, changes to what
        lookups walk, heap bytes)."""
        with self.held.lock:
            return {**self.held.describe(), "closed": self._closed, "hits": self._hits, "misses": self._misses,
                    "rolled_forward": self._rolled_forward}

    def metrics_of(self, num_keys, update_bytes=0):
        """The StateStoreMetrics of a store of this provider reading ``num_keys`` keys, with
        ``update_bytes`` in its update layer."""
        return StateStoreMetrics(
            num_keys=num_keys,
            memory_used_bytes=self.held.memory_bytes() + update_bytes,
            custom_metrics={
                "stateOnCurrentVersionSizeBytes": num_keys * (self._key_schema.width + self._value_schema.width),
                "loadedMapCacheHitCount": self._hits,
                "loadedMapCacheMissCount": self._misses,
                "rolledForwardCount": self._rolled_forward,
            })


def read_version_header(files, f):
    """``(commit_id, parent_id)`` of version file ``f`` (a :class:`statecore.lineage.VersionFile`
    of the :class:`statecore.files.StoreFiles` ``files``) from its checked header; the parent is
    None for a snapshot. The header must name the version and id the file name does
    (StateCorruptionError otherwise)."""
    path = files.path(f.name)
    try:
        if f.kind == "delta":
            header = read_delta_header(files.read_range(f.name, 0, DELTA_HEADER_SIZE), path)
            parent_id = header.parent_id
        else:
            header = read_snapshot_file_header(files, f.name)
            parent_id = None
    except UnsafeFileError as e:  # a FIFO, a device, a directory in a version file's place: damage
        raise StateCorruptionError(path, None, e.reason) from None
    check_names_agree(f, path, header.store_version, header.commit_id)
    return header.commit_id, parent_id


def _remove_image(path):
    """Remove a published image (None: nothing); best effort: one already gone is fine."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
