"""Versioned stores and their provider: Spark's StateStore contract on statecore's files.

``provider.get_store(v)`` returns a :class:`StateStore` holding version ``v``; its updates
go to a private layer, invisible to everyone else until :meth:`StateStore.commit` writes
``<v+1>.delta`` (temporary name, fsync, rename) and merges the layer into the provider's
in-memory state (see :mod:`statecore.layers`): no version is ever copied. Loading a
version that is not in memory maps the newest good snapshot at or below it and replays the
deltas after it. ``do_maintenance`` writes snapshots and deletes files no longer needed,
by Spark's rules (spec 4.7); writing a snapshot never holds the provider lock for longer
than a pointer swap.

Lineage. Every version has a random 8-byte commit id; each delta header records its own id
and its parent's (the 16-byte lineage field), and each snapshot its version's id. A load
follows that chain, so files left by an abandoned run (a batch re-executed from an earlier
version) are never read for the new one: committing ``v+1`` again first deletes every file
of a later version and ``<v+1>.snapshot``, and a snapshot whose id differs from its
version's delta is skipped as stale.

Where we differ from Spark's HDFS provider: deltas hold the net change of a version (each
key once), not every call; nothing is written before commit (so abort has nothing to
cancel); a damaged snapshot found while loading is skipped for an older one when that
rebuilds the same version (Spark fails); re-committing a version can never pick up a stale
snapshot.

Thread-safety: a store is used by one task thread. A provider may be shared: its lock
guards its in-memory state; loads and file writes run outside it.
"""
import abc
import importlib
import json
import logging
import os
import threading
import weakref

import numpy as np

from statecore import files as files_module
from statecore._delta import BLOCK_PUTS, DeltaReader, DeltaWriter
from statecore._snapshot import SnapshotReader, SnapshotWriter
from statecore.conf import StateStoreConf
from statecore.errors import (IllegalStateError, SchemaMismatchError, StateCorruptionError,
                              VersionNotFoundError)
from statecore.ids import StateStoreId
from statecore.layers import FrozenView, Layer, State, no_values
from statecore.metrics import FILE_PROVIDER_CUSTOM_METRICS, StateStoreMetrics
from statecore.rowsource import iter_batches, iter_items
from statecore.schema import RowSchema, key_value_schemas

__all__ = ["ReadStateStore", "StateStore", "StateStoreProvider", "FileStateStoreProvider",
           "create_and_init_provider"]

log = logging.getLogger(__name__)

ROOT_COMMIT_ID = bytes(8)  # version 0: the empty state
# Besides Spark's rule (more than min_deltas_for_snapshot deltas), a snapshot is due once the
# head (every change since the last snapshot, held in hash tables) outgrows this share of the
# state: it keeps resident memory near the raw rows whatever the maintenance period.
HEAD_SNAPSHOT_RATIO = 0.5
HEAD_SNAPSHOT_MIN_ROWS = 1 << 16
# Temporary files older than this are a killed writer's leftovers; maintenance deletes them.
TEMPORARY_FILE_MAX_AGE_S = 3600.0
SCHEMA_FILE = "_statecore.schema.json"  # three dot-parts: ignored by version listing
DELTA_HEADER_BYTES = 72
_LINEAGE_OFFSET = 48  # of the lineage field in a delta header (statecore._delta)
_SNAPSHOT_LINEAGE_OFFSET = 116  # and in a snapshot header (statecore._snapshot)


class ReadStateStore(abc.ABC):
    """A read-only view of one version. Implementations guarantee that what a store reads
    never changes under it; callers must not assume any iteration order."""

    @property
    @abc.abstractmethod
    def id(self):
        """The StateStoreId."""

    @property
    @abc.abstractmethod
    def version(self):
        """The version this store was opened at (before any update)."""

    @abc.abstractmethod
    def get(self, key):
        """The value tuple of ``key``, or None."""

    @abc.abstractmethod
    def get_batch(self, keys):
        """``(values, found)`` for a batch of keys."""

    @abc.abstractmethod
    def iterator(self):
        """Yield ``(key_tuple, value_tuple)`` for every key, once each."""

    def get_range(self, start=None, end=None):
        """Every pair; like Spark's, the bounds are not enforced (a superset of the range)."""
        return self.iterator()

    @abc.abstractmethod
    def abort(self):
        """Release what the store holds; harmless to call twice."""

    @property
    @abc.abstractmethod
    def metrics(self):
        """A StateStoreMetrics."""


class StateStore(ReadStateStore):
    """A writable store: updates are private until :meth:`commit`. ``put`` copies its rows
    (callers reuse buffers). Updates may be interleaved with an open iterator."""

    @abc.abstractmethod
    def put(self, key, value):
        """Insert or overwrite."""

    @abc.abstractmethod
    def remove(self, key):
        """Remove ``key`` if present."""

    @abc.abstractmethod
    def put_batch(self, keys, values):
        """Insert or overwrite a batch."""

    @abc.abstractmethod
    def remove_batch(self, keys):
        """Remove a batch of keys."""

    @abc.abstractmethod
    def commit(self):
        """Make version ``version + 1`` durable and return it."""

    @property
    @abc.abstractmethod
    def has_committed(self):
        """True while the store is committed."""


class StateStoreProvider(abc.ABC):
    """Builds stores of one StateStoreId. Created by name from ``conf.provider_class`` with
    no arguments, then :meth:`init`; ``do_maintenance`` is called from the maintenance thread,
    never from a task."""

    @abc.abstractmethod
    def init(self, store_id, key_schema, value_schema, key_index_ordinal, conf):
        """Set the provider up for ``store_id``."""

    @property
    @abc.abstractmethod
    def state_store_id(self):
        """The StateStoreId given to init."""

    @abc.abstractmethod
    def get_store(self, version):
        """A StateStore holding ``version``."""

    def get_read_store(self, version):
        """A ReadStateStore holding ``version`` (default: a store that is never committed)."""
        return self.get_store(version)

    def do_maintenance(self):
        """Background work: snapshots and cleanup. Default: nothing."""

    @abc.abstractmethod
    def close(self):
        """Release everything; called when the provider is unloaded."""

    @property
    def supported_custom_metrics(self):
        return ()


def create_and_init_provider(store_id, key_schema, value_schema, conf, key_index_ordinal=None):
    """The provider class named by ``conf.provider_class``, created and initialised."""
    module_name, _, class_name = conf.provider_class.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load the state store provider class {conf.provider_class!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, StateStoreProvider)):
        raise TypeError(f"The given State Store Provider {conf.provider_class} does not extend "
                        f"statecore.StateStoreProvider.")
    provider = cls()
    provider.init(store_id, key_schema, value_schema, key_index_ordinal, conf)
    return provider


# -- the file provider's stores ---------------------------------------------------------------
class _View:
    """One version of a provider's State, pinned while the store that reads it is open."""

    def __init__(self, provider, state, version):
        self.provider = provider
        self.state = state
        self.version = version
        provider._pin(state, version)
        self._finalizer = weakref.finalize(self, provider._unpin, state, version)

    def release(self):
        self._finalizer()

    def lookup(self, key_rows, extra_layers=()):
        with self.provider._lock:
            return self.state.lookup(self.version, key_rows, extra_layers)

    def get_row(self, key, extra_layers=()):
        with self.provider._lock:
            return self.state.get_row(self.version, key, extra_layers)

    def iter_rows(self, extra_layers=()):
        """Row chunks of the version; the state must not be merged into meanwhile."""
        with self.provider._lock:
            merges = self.state.merges
        for chunk in self.state.iter_rows(self.version, extra_layers):
            if self.state.merges != merges:
                raise IllegalStateError(
                    f"version {self.version} of {self.provider} was committed on while being iterated; "
                    "iterate again")
            yield chunk


class _FileReadStore(ReadStateStore):
    _kind = "FileReadStateStore"

    def __init__(self, provider, view):
        self._provider = provider
        self._view = view
        self._key_schema = provider._key_schema
        self._value_schema = provider._value_schema

    def __repr__(self):
        sid = self._provider.state_store_id
        return f"{self._kind}[id=(op={sid.operator_id},part={sid.partition_id}),dir={self._provider._dir}]"

    @property
    def id(self):
        return self._provider.state_store_id

    @property
    def version(self):
        return self._view.version

    def _layers(self):
        return ()

    def get(self, key):
        value = self._view.get_row(self._key_schema.encode(key), self._layers())
        return None if value is None else self._value_schema.decode(value)

    def get_rows(self, key_rows, values_out, found_out):
        values, found = self._view.lookup(np.ascontiguousarray(key_rows), self._layers())
        values_out[...] = values
        found_out[...] = found

    def get_batch(self, keys):
        key_rows = self._key_schema.rows(keys)
        values, found = self._view.lookup(key_rows, self._layers())
        return self._value_schema.from_rows(values).copy(), found

    def _iteration_layers(self):
        return ()

    def iterator(self):
        return iter_items(_ChunkCursor(self._view.iter_rows(self._iteration_layers())), self._key_schema,
                          self._value_schema)

    def iter_batches(self, rows_per_batch=65536):
        """Yield ``(keys, values)`` structured arrays covering every key once."""
        return iter_batches(_ChunkCursor(self._view.iter_rows(self._iteration_layers())),
                            self._key_schema, self._value_schema, rows_per_batch)

    def abort(self):
        self._view.release()

    def _num_keys(self):
        with self._provider._lock:
            return self._view.state.count(self._view.version)

    @property
    def metrics(self):
        return self._provider._metrics(self._num_keys())


class _ChunkCursor:
    """Adapts a generator of row chunks to the ``next_rows`` cursor protocol."""

    def __init__(self, chunks):
        self._chunks = chunks
        self._pending = None

    def next_rows(self, max_rows):
        if self._pending is None or not len(self._pending):
            self._pending = next(self._chunks, None)
            if self._pending is None:
                return None
        out, self._pending = self._pending[:max_rows], self._pending[max_rows:]
        return out

    def close(self):
        self._chunks.close()


_UPDATING, _COMMITTED, _ABORTED = "UPDATING", "COMMITTED", "ABORTED"


class _FileStore(_FileReadStore, StateStore):
    _kind = "FileStateStore"

    def __init__(self, provider, view):
        super().__init__(provider, view)
        self._update = Layer(self._key_schema, self._value_schema)
        self._state = _UPDATING

    def _layers(self):
        return (self._update,)

    def _iteration_layers(self):
        # Iteration sees the updates as they were when it began: puts made while iterating
        # (eviction loops) then cannot hide a key that is still to be visited.
        return (self._update.copy(),)

    def _check_updating(self, verb):
        if self._state != _UPDATING:
            raise IllegalStateError(f"Cannot {verb} after already committed or aborted")

    def put(self, key, value):
        if value is None:
            raise ValueError("Cannot put a null value")
        self._check_updating("put")
        self._update.put_row(self._key_schema.encode(key), self._value_schema.encode(value))

    def remove(self, key):
        self._check_updating("remove")
        self._update.delete_row(self._key_schema.encode(key))

    def put_batch(self, keys, values):
        if values is None and self._value_schema.width:
            raise ValueError("Cannot put a null value")
        self._check_updating("put")
        key_rows = self._key_schema.rows(keys)
        value_rows = self._value_schema.rows(values) if values is not None else no_values(key_rows.shape[0])
        if value_rows.shape[0] != key_rows.shape[0]:
            raise ValueError(f"{key_rows.shape[0]} keys but {value_rows.shape[0]} values")
        self._update.put_rows(key_rows, value_rows)

    def remove_batch(self, keys):
        self._check_updating("remove")
        self._update.delete_rows(self._key_schema.rows(keys))

    def commit(self):
        self._check_updating("commit")
        new_version, self._committed_num_keys = self._provider._commit(self._view, self._update)
        self._state = _COMMITTED
        return new_version

    def abort(self):
        self._state = _ABORTED
        self._update = Layer(self._key_schema, self._value_schema)
        self._view.release()

    @property
    def has_committed(self):
        return self._state == _COMMITTED

    def _num_keys(self):
        if self._state == _COMMITTED:
            return self._committed_num_keys
        base = super()._num_keys()
        put_keys, _ = self._update.puts.export_rows()
        del_keys, _ = self._update.dels.export_rows()
        _, put_found = self._view.lookup(put_keys)
        _, del_found = self._view.lookup(del_keys)
        return base + int((~put_found).sum()) - int(del_found.sum())

    @property
    def metrics(self):
        return self._provider._metrics(self._num_keys(), update_bytes=self._update.sizeof())


# -- the provider ----------------------------------------------------------------------------
class FileStateStoreProvider(StateStoreProvider):
    """The default provider: deltas and snapshots on any fsspec filesystem (see the module
    docstring)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._maintaining = threading.Lock()  # one maintenance pass at a time per provider
        self._committing = threading.Lock()  # commits of one provider run one at a time
        self._latest = None
        self._pins = {}
        self._recommits = []  # versions committed again (re-executed batches), in order
        self._version_ids = {}  # version -> commit id, of the lineage this provider committed last
        self._maintenance_hint = None  # called when a snapshot is due before the next period
        self._hits = self._misses = 0
        self._schema_written = False
        self._closed = False

    # -- StateStoreProvider ------------------------------------------------------------------
    def init(self, store_id, key_schema, value_schema, key_index_ordinal=None, conf=None):
        if not isinstance(store_id, StateStoreId):
            raise TypeError(f"store_id must be a StateStoreId, got {type(store_id).__name__}")
        self._store_id = store_id
        self._key_schema, self._value_schema = key_value_schemas(key_schema, value_schema)
        self._key_index_ordinal = key_index_ordinal
        self._conf = conf or StateStoreConf()
        self._dir = store_id.store_checkpoint_location()
        self._files = files_module.open_store_files(self._dir, self._conf.storage_options,
                                                    self._conf.local_cache_dir)
        self._files.mkdirs()
        self._check_schema_file()

    def __repr__(self):
        sid = self._store_id
        return f"FileStateStoreProvider[id = (op={sid.operator_id},part={sid.partition_id}),dir = {self._dir}]"

    @property
    def state_store_id(self):
        return self._store_id

    @property
    def supported_custom_metrics(self):
        return FILE_PROVIDER_CUSTOM_METRICS

    def get_store(self, version):
        return _FileStore(self, self._view_of(version))

    def get_read_store(self, version):
        return _FileReadStore(self, self._view_of(version))

    def close(self):
        with self._lock:
            self._closed = True
            self._latest = None

    # -- versions --------------------------------------------------------------------------
    def _view_of(self, version):
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if version < 0:
            raise ValueError(f"Version cannot be less than 0, got {version}")
        on_disk = self._version_id_on_disk(version) if version > 0 else ROOT_COMMIT_ID
        with self._lock:
            if self._closed:
                raise IllegalStateError(f"{self} is closed")
            latest = self._latest
            if latest is not None and latest.holds(version):
                if latest.commit_ids[version] == on_disk:
                    self._hits += 1
                    return _View(self, latest, version)
                # Another process committed this version again (a re-executed batch): what
                # this one holds is the abandoned run's. Forget it and load the files' version.
                log.warning("version %d of %s in memory is not the one on disk (re-committed "
                            "elsewhere); loading it from files", version, self)
                self._latest = None
            if version > 0:  # version 0 is the empty state: nothing to load (as in Spark)
                self._misses += 1
        log.info("version %d of %s is not in memory; loading it from files", version, self)
        state = self._load(version)
        with self._lock:
            keep = self._conf.max_versions_to_retain_in_memory > 0 and (
                self._latest is None or version >= self._latest.version)
            if keep:
                self._latest = state
                self._record_version_id(version, state.commit_ids[version])
            return _View(self, state, version)

    def _pin(self, state, version):
        with self._lock:
            key = (id(state), version)
            self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, state, version):
        with self._lock:
            key = (id(state), version)
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def _pinned_versions(self, state):
        return [v for (sid, v) in self._pins if sid == id(state)]

    def _retain(self, state):
        """Keep the newest ``max_versions_to_retain_in_memory`` versions, and pinned ones."""
        k = self._conf.max_versions_to_retain_in_memory
        keep_from = state.version - max(k - 1, 0)
        pinned = self._pinned_versions(state)
        if pinned:
            keep_from = min(keep_from, min(pinned))
        state.retain(keep_from)

    # -- commit ----------------------------------------------------------------------------
    def _commit(self, view, update):
        with self._committing:
            return self._commit_serialized(view, update)

    def _commit_serialized(self, view, update):
        version = view.version
        new_version = version + 1
        commit_id = os.urandom(8)
        parent_id = view.state.commit_ids[version]
        self._write_schema_file()
        if self._drop_later_lineage(new_version):
            with self._lock:
                self._recommits.append(new_version)
        put_keys, put_values = update.puts.export_rows()
        del_keys, _ = update.dels.export_rows()

        def write(f):
            writer = DeltaWriter(f, self._key_schema, self._value_schema, new_version,
                                 lineage=commit_id + parent_id, compression=self._conf.compression)
            writer.remove_rows(del_keys)
            writer.put_rows(put_keys, put_values)
            writer.finish()

        # The delta is encoded and made durable on a second thread while the merge runs here
        # (lz4, checksums, fsync and the table loops all release the GIL). The new version is
        # invisible until the file is in place; if writing fails, the merge is undone.
        failure = []

        def write_delta():
            try:
                self._files.write_atomic(f"{new_version}.delta", write)
            except BaseException as e:  # re-raised on the committing thread
                failure.append(e)

        writer_thread = threading.Thread(target=write_delta, name="statecore-delta-writer")
        writer_thread.start()
        try:
            with self._lock:
                previous = self._latest
                if (previous is not None and previous.version == version
                        and previous.commit_ids[version] == parent_id):
                    state = previous
                else:
                    # Re-execution from an older version (or a state loaded privately): the
                    # new lineage continues from the store's own version, frozen underneath.
                    view.state.frozen = True
                    state = State(self._key_schema, self._value_schema, FrozenView(view.state, version),
                                  version, parent_id, view.state.count(version))
                state.merge(put_keys, put_values, del_keys, commit_id, pending=True)
        except BaseException:
            writer_thread.join()
            with self._lock:
                self._latest = None  # a half-applied merge: reload from files next time
            raise
        writer_thread.join()
        with self._lock:
            if failure:
                if state is previous:
                    state.rollback()
                raise failure[0]
            state.pending = None
            num_keys = state.num_keys[new_version]
            self._record_version_id(new_version, commit_id)
            head_due = self._head_outgrown(state)
            if self._conf.max_versions_to_retain_in_memory > 0:
                self._latest = state
                self._retain(state)
            else:
                self._latest = None
        log.info("Committed version %d for %s", new_version, self)
        if head_due and self._maintenance_hint is not None:
            self._maintenance_hint()
        return new_version, num_keys

    def _record_version_id(self, version, commit_id):
        # REQUIRES: self._lock held
        for v in [v for v in self._version_ids if v >= version or v < version - 256]:
            del self._version_ids[v]
        self._version_ids[version] = commit_id

    def _drop_later_lineage(self, new_version):
        """Before re-committing ``new_version``: delete files an abandoned run left at later
        versions, and its snapshot of ``new_version`` (its delta is overwritten). True if
        this is such a re-commit."""
        deltas, snapshots = self._files.list_versions()
        stale = [name for v, name in deltas.items() if v > new_version]
        stale += [name for v, name in snapshots.items() if v >= new_version]
        if stale:
            log.warning("re-committing version %d of %s: deleting files of the abandoned run: %s",
                        new_version, self, sorted(stale))
            self._files.delete(stale)
        return bool(stale) or new_version in deltas

    # -- loading ---------------------------------------------------------------------------
    def _version_id_on_disk(self, version):
        """The commit id of ``version`` as its files record it (its delta's header, else its
        snapshot's), or None if neither is there: one small read."""
        try:
            return self._delta_lineage(f"{version}.delta")[0]
        except (FileNotFoundError, StateCorruptionError):
            pass  # a damaged header: a load from files decides (an older snapshot may rebuild it)
        try:
            header = self._files.read_range(f"{version}.snapshot", 0, _SNAPSHOT_LINEAGE_OFFSET + 8)
        except FileNotFoundError:
            return None
        return header[_SNAPSHOT_LINEAGE_OFFSET:_SNAPSHOT_LINEAGE_OFFSET + 8]

    def _delta_lineage(self, name):
        """``(own_id, parent_id)`` from a delta's header (checked by a full read later)."""
        header = self._files.read_range(name, 0, DELTA_HEADER_BYTES)
        lineage = header[_LINEAGE_OFFSET:_LINEAGE_OFFSET + 16]
        if len(lineage) != 16:
            raise StateCorruptionError(self._files.path(name), len(header), "delta header is truncated")
        return lineage[:8], lineage[8:]

    def _load(self, version):
        """Version ``version`` from files: the newest good snapshot at or below it whose
        deltas after it are all there, then those deltas replayed (spec 4.6.1)."""
        if version == 0:
            return State(self._key_schema, self._value_schema, None, 0, ROOT_COMMIT_ID, 0)
        listing = self._files.list_versions()
        for attempt in range(3):
            try:
                return self._load_listed(version, *listing)
            except (FileNotFoundError, VersionNotFoundError) as e:
                # Another instance's cleanup may have deleted files we listed (a newer
                # snapshot covers them now): list again and retry, unless nothing changed.
                relisted = self._files.list_versions()
                if relisted == listing or attempt == 2:
                    if isinstance(e, FileNotFoundError):
                        raise VersionNotFoundError(f"a file of version {version} of {self} vanished "
                                                   f"while loading: {e}") from e
                    raise
                log.info("files of %s changed while loading version %d; listing again", self, version)
                listing = relisted

    def _load_listed(self, version, deltas, snapshots):
        empty = State(self._key_schema, self._value_schema, None, 0, ROOT_COMMIT_ID, 0)
        missing_error = damage = None
        for s in [*sorted((s for s in snapshots if s <= version), reverse=True), 0]:
            missing = [u for u in range(s + 1, version + 1) if u not in deltas]
            if missing:
                if missing_error is None:
                    path = self._files.path(f"{missing[0]}.delta")
                    missing_error = VersionNotFoundError(
                        f"Error reading delta file {path} of {self}: {path} does not exist")
                continue
            if s == 0:
                return self._replay(empty, version)
            try:
                state = self._open_snapshot_state(s, deltas)
            except StateCorruptionError as e:
                log.warning("skipping damaged snapshot %s.snapshot of %s: %s", s, self, e)
                damage = damage or e
                continue
            if state is not None:
                return self._replay(state, version)
        raise damage or missing_error

    def _snapshot_matches_delta(self, s, deltas):
        """Whether ``<s>.snapshot`` belongs to the same commit as ``<s>.delta`` (if that still
        exists; a snapshot outliving its delta is trusted)."""
        if s not in deltas:
            return True
        header = self._files.read_range(f"{s}.snapshot", 0, _SNAPSHOT_LINEAGE_OFFSET + 8)
        own_id = header[_SNAPSHOT_LINEAGE_OFFSET:_SNAPSHOT_LINEAGE_OFFSET + 8]
        return own_id == self._delta_lineage(f"{s}.delta")[0]

    def _open_snapshot_state(self, s, deltas):
        name = f"{s}.snapshot"
        reader = SnapshotReader(self._files.local_path_for_mapping(name), self._key_schema, self._value_schema)
        own_id = bytes(reader.lineage)[:8]
        if s in deltas:
            delta_id, _ = self._delta_lineage(f"{s}.delta")
            if delta_id != own_id:
                log.warning("skipping stale snapshot %s of %s (left by an abandoned run)",
                            self._files.path(name), self)
                reader.close()
                return None
        return State(self._key_schema, self._value_schema, reader, s, own_id, reader.row_count)

    def _replay(self, state, version):
        for u in range(state.version + 1, version + 1):
            name = f"{u}.delta"
            path = self._files.path(name)
            try:
                data = self._files.read_bytes(name)
            except FileNotFoundError:
                raise VersionNotFoundError(f"Error reading delta file {path} of {self}: {path} does not exist") from None
            reader = DeltaReader(data, self._key_schema, self._value_schema, path=path)
            own_id, parent_id = bytes(reader.lineage[:8]), bytes(reader.lineage[8:])
            if parent_id != state.commit_ids[state.version]:
                raise StateCorruptionError(path, _LINEAGE_OFFSET,
                                           f"delta of version {u} does not follow version {u - 1} "
                                           "(a file of another run)")
            blocks = list(reader)  # verified to the trailer before any change is applied
            for kind, keys, values in blocks:
                state.replay(kind == BLOCK_PUTS, keys, values)
            state.advance(u, own_id)
        return state

    # -- schema file -----------------------------------------------------------------------
    def _schema_record(self):
        return {"format": "statecore-state-schema-1", "key": self._key_schema.describe(),
                "value": self._value_schema.describe()}

    def _check_schema_file(self):
        stored = read_store_schemas(self._files)
        if stored is None:
            return
        stored_key, stored_value = stored
        for part, stored, given in (("key", stored_key, self._key_schema),
                                    ("value", stored_value, self._value_schema)):
            if stored != given:
                raise SchemaMismatchError(
                    f"the {part} schema {given.describe()} differs from the one the store at "
                    f"{self._dir} was written with: {stored.describe()}")
        self._schema_written = True

    def _write_schema_file(self):
        if self._schema_written:
            return
        payload = json.dumps(self._schema_record(), indent=1).encode()
        try:
            self._files.write_atomic(SCHEMA_FILE, lambda f: f.write(payload), overwrite=False)
        except FileExistsError:
            self._check_schema_file()
        self._schema_written = True

    # -- maintenance -----------------------------------------------------------------------
    def set_maintenance_hint(self, hint):
        """``hint()`` is called (from a committing task) when a snapshot is due early; the
        registry passes a function that wakes its maintenance thread."""
        self._maintenance_hint = hint

    def _head_outgrown(self, state):
        # REQUIRES: self._lock held
        head_rows = len(state.head)
        if head_rows <= HEAD_SNAPSHOT_MIN_ROWS:
            return False
        return state.base is None or head_rows > HEAD_SNAPSHOT_RATIO * state.count(state.version)

    def do_maintenance(self):
        """Write a snapshot once more than ``min_deltas_for_snapshot`` deltas piled up since
        the last one (of the newest version, if this provider holds it), then delete the
        files no version from ``newest - min_versions_to_retain`` on needs."""
        if not self._maintaining.acquire(blocking=False):
            return  # a pass is already running (the thread, or a call from a test)
        try:
            self._snapshot_if_due()
            self._cleanup()
        finally:
            self._maintaining.release()

    def _snapshot_if_due(self):
        deltas, snapshots = self._files.list_versions()
        if not deltas and not snapshots:
            return
        last = max([*deltas, *snapshots])
        with self._lock:
            state = self._latest
            if state is None or state.version != last or state.pending is not None:
                return  # not the newest version, or its commit is still in flight
            base = max((s for s in snapshots if s <= last), default=0)
            deltas_due = sum(1 for v in deltas if base < v <= last) > self._conf.min_deltas_for_snapshot
            if not (deltas_due or (last > base and self._head_outgrown(state))):
                return
            # Freeze the state at `last`: commits go on in a new state over it, while the
            # frozen one is written out without the lock.
            state.frozen = True
            frozen_view = FrozenView(state, last)
            successor = State(self._key_schema, self._value_schema, frozen_view, last,
                              state.commit_ids[last], state.count(last))
            successor.undo = dict(state.undo)
            successor.commit_ids = dict(state.commit_ids)
            successor.num_keys = dict(state.num_keys)
            self._latest = successor
            commit_id = state.commit_ids[last]
            recommits_seen = len(self._recommits)
        name = f"{last}.snapshot"
        row_count = frozen_view.num_keys

        def write(f):
            writer = SnapshotWriter(f, self._key_schema, self._value_schema, row_count, last,
                                    lineage=commit_id + bytes(8))
            for chunk in state.snapshot_rows(last):
                writer.write_rows(chunk)
            writer.finish()

        swap = _SnapshotSwap(self, state, last, commit_id, recommits_seen)
        try:
            # On local disks the new file is mapped and swapped in as soon as it is written,
            # while it is fsynced: the frozen state is let go that much sooner.
            self._files.write_atomic(name, write, on_flushed=swap.map_and_swap)
            if not swap.tried:
                swap.map_and_swap(self._files.local_path_for_mapping(name))
        except FileNotFoundError:
            # a batch re-executed meanwhile deleted it as the abandoned run's: nothing to swap
            log.warning("snapshot %s of %s was deleted by a re-commit before it was mapped", name, self)
            return
        if swap.stale or swap.is_stale():  # again: a re-commit may have come before the rename
            log.warning("snapshot %s of %s belongs to a run that was re-executed; deleting it", name, self)
            self._files.delete([name])
        else:
            log.info("wrote snapshot %s for %s", self._files.path(name), self)

    def _cleanup(self):
        leftovers = self._files.temporary_files(TEMPORARY_FILE_MAX_AGE_S)
        if leftovers:
            log.info("Deleting temporary files a killed writer left in %s: %s", self, leftovers)
            self._files.delete(leftovers)
        deltas, snapshots = self._files.list_versions()
        if not deltas and not snapshots:
            return
        last = max([*deltas, *snapshots])
        earliest = last - self._conf.min_versions_to_retain
        first_needed = 0  # every version from `earliest` on loads from here (0: the empty state)
        if earliest > 0:
            base = max((s for s in snapshots if s <= earliest), default=None)
            if base is not None and not self._snapshot_matches_delta(base, deltas):
                # another run's snapshot (a batch was re-executed while it was written): it is
                # no base for anything, and nothing older may be deleted on its account
                log.warning("deleting stale snapshot %s of %s", snapshots[base], self)
                self._files.delete([snapshots[base]])
                return
            first_needed = min([*deltas, *snapshots]) if base is None else base
            doomed = [name for v, name in deltas.items() if v < first_needed]
            doomed += [name for v, name in snapshots.items() if v < first_needed]
            if doomed:
                deleted = self._files.delete(doomed)
                log.info("Deleted files older than %d for %s: %s", first_needed, self, sorted(deleted))
        self._delete_intermediate_snapshots(first_needed, deltas, snapshots)

    def _delete_intermediate_snapshots(self, first_needed, deltas, snapshots):
        """Thin the snapshots after the retention window's base to Spark's cadence: keep one
        at least ``min_deltas_for_snapshot`` versions after the previous one kept (the bases
        of later windows, so old deltas keep being deleted) and the newest (the one a restart
        loads); delete the others once every delta after the base is there, so each retained
        version still loads (from a kept snapshot and deltas). The head-size rule may write a
        snapshot every batch; keeping each would cost a copy of the state per batch on disk."""
        if any(u not in deltas for u in range(first_needed + 1, max(snapshots, default=0) + 1)):
            return
        spacing = max(1, self._conf.min_deltas_for_snapshot)
        later = sorted(v for v in snapshots if v > first_needed)
        kept, doomed = first_needed, []
        for v in later[:-1]:  # the newest is always kept
            if v - kept >= spacing:
                kept = v
            else:
                doomed.append(v)
        if doomed:
            self._files.delete([snapshots[v] for v in doomed])
            log.info("Deleted snapshots %s of %s: those versions load from an older snapshot (or the empty "
                     "state) and the deltas", doomed, self)

    # -- metrics ---------------------------------------------------------------------------
    def _memory_bytes(self):
        with self._lock:
            state = self._latest
            layers = {}  # a state built over a frozen one shares its undo layers: count each once
            while state is not None:
                for layer in (state.head, *state.undo.values()):
                    layers[id(layer)] = layer
                state = state.base.state if isinstance(state.base, FrozenView) else None
            return sum(layer.sizeof() for layer in layers.values())

    def _metrics(self, num_keys, update_bytes=0):
        return StateStoreMetrics(
            num_keys=num_keys,
            memory_used_bytes=self._memory_bytes() + update_bytes,
            custom_metrics={
                "stateOnCurrentVersionSizeBytes": num_keys * (self._key_schema.width + self._value_schema.width),
                "loadedMapCacheHitCount": self._hits,
                "loadedMapCacheMissCount": self._misses,
            })


def read_store_schemas(files):
    """``(key_schema, value_schema)`` a store directory recorded with its first commit, or
    None if it has none yet; StateCorruptionError if the schema file is unreadable."""
    try:
        raw = files.read_bytes(SCHEMA_FILE)
    except FileNotFoundError:
        return None
    try:
        recorded = json.loads(raw)
        return RowSchema.from_description(recorded["key"]), RowSchema.from_description(recorded["value"])
    except (ValueError, KeyError, TypeError) as e:
        raise StateCorruptionError(files.path(SCHEMA_FILE), None, f"unreadable schema file: {e}") from None

class _SnapshotSwap:
    """Maps a snapshot just written of a frozen state at ``version`` and swaps it in as the
    base of the state built over that frozen one, unless a re-execution made it stale."""

    def __init__(self, provider, frozen_state, version, commit_id, recommits_seen):
        self.provider = provider
        self.frozen_state = frozen_state
        self.version = version
        self.commit_id = commit_id
        self.recommits_seen = recommits_seen
        self.tried = False
        self.stale = False

    def map_and_swap(self, path):
        self.tried = True
        p = self.provider
        reader = SnapshotReader(path, p._key_schema, p._value_schema)
        try:
            # Check every block (and fault its pages in) here, on the maintenance thread,
            # not in the first batches that look keys up in the new base.
            reader.verify(index=False)
        except BaseException:
            reader.close()
            raise
        swapped = False
        with p._lock:
            self.stale = self.is_stale()
            node = None if self.stale else p._latest
            # Same data, now mapped: the base of the state built over the frozen one at
            # exactly `version` (a re-executed run may sit on it at another version: that
            # one keeps its frozen base).
            while node is not None and not swapped:
                base = node.base
                if isinstance(base, FrozenView) and base.state is self.frozen_state and base.version == self.version:
                    node.base = reader
                    swapped = True
                node = base.state if isinstance(base, FrozenView) else None
        if not swapped:
            reader.close()

    def is_stale(self):
        """Whether a batch re-executed at or below the version made this file another run's."""
        p = self.provider
        with p._lock:
            return (any(v <= self.version for v in p._recommits[self.recommits_seen:])
                    or p._version_ids.get(self.version, self.commit_id) != self.commit_id)
