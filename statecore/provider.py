"""The default provider: versioned stores over delta and snapshot files on any fsspec filesystem.

``provider.get_store(v)`` returns a store holding version ``v``; its updates go to a private
layer, invisible to everyone else until ``commit()`` writes ``<v+1>_<id>.delta`` and merges
the layer into the provider's in-memory state (:mod:`statecore.layers`): no version is ever
copied. A version not in memory is loaded from the newest good snapshot on its lineage and
the deltas after it (:mod:`statecore.lineage`). The store objects are
:mod:`statecore.file_stores`'s, snapshots and cleanup :mod:`statecore.maintenance`'s. The
locks, what each guards, and the rules a commit follows against stale attempts are in
``docs/provider-rules.md``.
"""
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from statecore import files as files_module
from statecore._delta import BLOCK_PUTS, HEADER_SIZE as DELTA_HEADER_SIZE, DeltaReader, DeltaWriter, read_delta_header
from statecore._lock import ProviderLock, requires_lock
from statecore._snapshot import SnapshotReader
from statecore.conf import StateStoreConf
from statecore.contracts import StateStoreProvider
from statecore.errors import (CommitConflictError, IllegalStateError, SchemaMismatchError,
                              StateCorruptionError, UnsafeFileError, VersionNotFoundError)
from statecore.file_stores import FileReadStore, FileStore, View
from statecore.ids import StateStoreId
from statecore._versions import Spill, filter_bytes, frozen_below
from statecore.layers import State, take_rows
from statecore.lineage import ROOT_COMMIT_ID, Chain, check_names_agree, file_name, parse_commit_id
from statecore.metrics import FILE_PROVIDER_CUSTOM_METRICS, StateStoreMetrics
from statecore.schema import RowSchema, key_value_schemas
from statecore.snapshot_files import open_snapshot, read_header as read_snapshot_file_header

__all__ = ["FileStateStoreProvider", "read_store_schemas", "schema_file_bytes", "read_version_header", "SCHEMA_FILE"]

log = logging.getLogger(__name__)

# The head (the changes since the base, in hash tables) is spilled to a mapped image once it
# outgrows this share of the state: what the heap holds stays a fraction of the raw rows,
# whatever the maintenance period (statecore.spill).
SPILL_RATIO = 0.125
SPILL_MIN_ROWS = 1 << 10
# Past this share, and due since an earlier commit, maintenance fell behind (starved of CPU,
# or busy with a snapshot): the commit spills the head itself before it returns, so the
# bound holds whatever the timing.
SPILL_HARD_RATIO = 0.25
# Besides Spark's rule (more than min_deltas_for_snapshot deltas), a snapshot is due once the
# changes since the last one (spilled and in the head) outgrow this share of the state: each
# spill rewrites them, so they must not grow towards the state's size.
HEAD_SNAPSHOT_RATIO = 0.5
HEAD_SNAPSHOT_MIN_ROWS = 1 << 16
SCHEMA_FILE = "_statecore.schema.json"  # not a version file: ignored by listings
MAX_SCHEMA_FILE_BYTES = 1 << 20
_HEADER_CACHE_ENTRIES = 4096
# Deltas written at once in a process (commits of different stores); more queue.
DELTA_WRITERS = 4


_writers_lock = threading.Lock()
_writers = None  # (pid, ThreadPoolExecutor): the delta writers of this process


def _delta_writers():
    """The threads that write commits' deltas beside their merges: kept for the process (a
    thread started per commit waits for the GIL twice: measurable at a commit's scale),
    made again in a forked child, where the parent's threads do not run."""
    global _writers
    with _writers_lock:
        if _writers is None or _writers[0] != os.getpid():
            _writers = (os.getpid(), ThreadPoolExecutor(max_workers=DELTA_WRITERS,
                                                        thread_name_prefix="statecore-delta-writer"))
        return _writers[1]


class FileStateStoreProvider(StateStoreProvider):
    """The default provider: deltas and snapshots on any fsspec filesystem (see the module
    docstring and ``docs/provider-rules.md``). Its stores call back into it (``_lock``,
    ``_pin``/``_unpin``, ``_commit``, ``_metrics``)."""

    def __init__(self):
        self._lock = ProviderLock()  # guards _latest, every State's contents and pins (re-entrant)
        self._published = threading.Condition(self._lock)  # notified when no merge is pending
        self._spilling = threading.Lock()  # one spill at a time (maintenance, or a commit)
        self._snapshot_source = None  # the Spill a snapshot is being written from (guarded by _lock)
        self._spill_failed_at = None  # time.monotonic() of the last failed spill (maintenance.SPILL_RETRY_S)
        self._snapshot_on_files = 0  # the newest snapshot maintenance saw on the default lineage
        self._image_published = None  # the path of the whole image this provider published last
        self._maintaining = threading.Lock()  # one maintenance pass at a time per provider
        self._committing = threading.Lock()  # commits of one provider run one at a time
        self._headers_lock = threading.Lock()  # guards _headers
        self._latest = None
        # What lookups walk changed (layers.py): one counter shared by every State of this provider.
        self._changes = np.zeros(1, dtype=np.uint64)
        self._headers = {}  # file name -> (commit_id, parent_id): names with ids never change
        self._verified_files = set()  # names maintenance checked whole before deleting on their account
        self._maintenance_hint = None  # called when the head is due to be spilled
        self._hits = self._misses = self._rolled_forward = 0
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

    def get_store(self, version, commit_id=None):
        view = self._view_of(version, commit_id)
        view.named = commit_id is not None
        return FileStore(self, view)

    def get_read_store(self, version, commit_id=None):
        return FileReadStore(self, self._view_of(version, commit_id))

    def close(self):
        with self._lock:
            self._closed = True
            self._latest = None
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

    def _spill_now(self):
        """Spill the head on the committing thread: maintenance did not keep it under its
        hard limit. A failure is logged (the commit stands; maintenance tries again)."""
        try:
            self.spill_if_outgrown(SPILL_HARD_RATIO)
        except Exception as e:  # the version is committed: a failed spill must not say otherwise
            log.warning("could not spill the head of %s after a commit (maintenance tries again): %s", self, e)

    def set_maintenance_hint(self, hint):
        """``hint()`` is called (from a committing task) when the head is due to be spilled;
        the registry passes a function that wakes its maintenance thread."""
        self._maintenance_hint = hint

    # -- lineage over the files ----------------------------------------------------------------
    def _chain(self, listing):
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
            self._remember_header(f.name, commit_id, parent_id)
        return commit_id, parent_id

    def _remember_header(self, name, commit_id, parent_id):
        """Cache the ids of the version file ``name`` (its name carries its commit id and
        is never re-written: the header cannot change)."""
        with self._headers_lock:
            if len(self._headers) >= _HEADER_CACHE_ENTRIES:
                self._headers.clear()
            self._headers[name] = (commit_id, parent_id)

    def _resolve(self, version, commit_id, listing):
        """The commit id of the attempt of ``version`` to open (named, or the default
        lineage's); VersionNotFoundError if there is none."""
        chain = self._chain(listing)
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
        listing = self._files.list_versions()
        target = self._resolve(version, commit_id, listing)
        with self._lock:
            if self._closed:
                raise IllegalStateError(f"{self} is closed")
            latest = self._latest
            if latest is not None and latest.holds(version):
                if latest.commit_ids[version] == target:
                    self._hits += 1
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
        state = self._load(version, target, listing)
        with self._lock:
            # The loaded state becomes the one kept when it is newer, or when the one kept holds
            # another attempt of this version (its lineage was abandoned); a read of an older
            # version it no longer holds leaves it in place.
            keep = self._conf.max_versions_to_retain_in_memory > 0 and (
                self._latest is None or version >= self._latest.version
                or self._latest.commit_ids.get(version) is not None)
            if keep:
                self._latest = state
            return View(self, state, version, listing)

    def _roll_forward(self, latest, version, commit_id, listing):
        """A view of ``version`` reached from ``latest``, the newest version in memory, by the
        deltas committed since (another process of the executor ran the batches in between),
        or None when a load from files is the better way: no state in memory, another
        lineage, a snapshot newer than the version held (fewer deltas to replay from it),
        or the state changed while the deltas were read.

        Each delta is checked whole and must follow the one before. When nobody reads
        ``latest`` (no open store, iteration or maintenance) and every delta records its
        version's key count, the deltas are replayed into its head as a load replays them:
        no lookups, and the versions held before are dropped. Otherwise each is merged as a
        commit is (its undo kept), so the versions held before stay readable. A delta holds
        each key once, its removes and puts disjoint (only a commit's update layer writes one)."""
        if latest is None or latest.pending is not None or latest.version >= version:
            return None
        start, start_id = latest.version, latest.commit_ids[latest.version]
        steps = []  # (version, delta file) from `version` down to start + 1
        for u, cid, delta, snapshot in self._chain(listing).walk(version, commit_id):
            if u == start:
                if cid != start_id:
                    return None
                break
            if snapshot is not None or delta is None or self._has_published_image(delta):
                return None  # a load from that snapshot or image replays fewer deltas
            steps.append((u, delta))
        try:
            deltas = list(self._checked_deltas(steps, start_id))
        except FileNotFoundError:
            return None  # cleaned up meanwhile: the load lists again
        with self._lock:
            if (self._closed or self._latest is not latest or latest.version != start
                    or latest.pending is not None):
                return None
            replayed = self._unread(latest) and all(count is not None for *_, count in deltas)
            if replayed:
                state = latest
                try:
                    self._replay_deltas(state, deltas, drop_older=True)
                except BaseException:
                    self._latest = None  # replayed in part: load from files next time
                    raise
            else:
                state = self._state_to_merge_into(latest, start, start_id)
                try:
                    for _, own_id, blocks, _ in deltas:
                        self._merge_delta(state, own_id, blocks)
                except StateCorruptionError as e:  # a damaged block of the base, found by a lookup
                    log.warning("version %d of %s not reached from version %d in memory: %s; loading it from "
                                "files", version, self, start, e)
                    if state.version > start:  # merged whole up to there: a consistent state
                        self._latest = state
                    return None
            self._rolled_forward += 1
            self._latest = state
            self._retain(state)
            head_due = self._spill_due(state)
            view = View(self, state, version, listing)
        log.info("version %d of %s reached from version %d in memory by %d deltas (%s)",
                 version, self, start, len(steps), "replayed" if replayed else "merged")
        if head_due and self._maintenance_hint is not None:
            self._maintenance_hint()
        return view

    @requires_lock
    def _unread(self, state):
        """Whether nothing reads ``state`` but through this provider's lock: no open store
        pins a version of it, nothing iterates it, maintenance has not frozen it and no
        commit is pending on it. Then it may be changed in place. REQUIRES: self._lock held."""
        return not state.frozen and not state.iterating and state.pending is None and not state.pins

    @requires_lock
    def _merge_delta(self, state, commit_id, blocks):
        """Merge one checked delta's blocks as the next version of ``state``. REQUIRES:
        self._lock held. The prior values are looked up first: a lookup that raises leaves
        ``state`` as it was. Removes of keys absent here change nothing and are left out."""
        key_width, value_width = self._key_schema.width, self._value_schema.width
        put_keys = _rows_of([keys for kind, keys, _ in blocks if kind == BLOCK_PUTS], key_width)
        put_values = _rows_of([values for kind, _, values in blocks if kind == BLOCK_PUTS], value_width)
        del_keys = _rows_of([keys for kind, keys, _ in blocks if kind != BLOCK_PUTS], key_width)
        put_prior = state.lookup(state.version, put_keys)
        del_values, del_found = state.lookup(state.version, del_keys)
        if not del_found.all():
            del_keys, del_values = take_rows(del_keys, del_found), take_rows(del_values, del_found)
        state.merge(put_keys, put_values, del_keys, commit_id, put_prior=put_prior, del_prior=del_values)

    def _pin(self, state, version):
        with self._lock:
            state.pin(version)

    def _unpin(self, state, version):
        with self._lock:
            state.unpin(version)

    @requires_lock
    def _retain(self, state):
        """Keep the newest ``max_versions_to_retain_in_memory`` versions (and pinned ones:
        State.retain keeps them). REQUIRES: self._lock held."""
        k = self._conf.max_versions_to_retain_in_memory
        state.retain(state.version - max(k - 1, 0))

    # -- commit ----------------------------------------------------------------------------
    def _commit(self, view, update, opened_values=None):
        """``(new_version, num_keys, commit_id, committed)``: ``committed`` is a View of the
        new version (None when no version is kept in memory), for the store's reads after.
        ``opened_values``: an OpenedValues the store read, the priors of its puts if they are
        its keys."""
        with self._committing:
            return self._commit_serialized(view, update, opened_values)

    def _commit_serialized(self, view, update, opened_values=None):
        version = view.version
        new_version = version + 1
        commit_id = os.urandom(8)
        parent_id = view.commit_id
        self._write_schema_file()
        self._refuse_if_stale(view, new_version)
        doomed = self._superseded(view, new_version)
        if doomed:  # a re-execution, or a late attempt: refused here before anything is written
            self._refuse_if_recorded(view, new_version, doomed)
        put_keys, put_values = update.puts.export_rows()
        del_keys, del_prior = self._removed_keys(view, update)
        put_prior = opened_values.priors_of(put_keys) if opened_values is not None else None
        name = file_name(new_version, commit_id, "delta")
        merged_count = Future()  # the new version's key count, once the merge knows it

        def write(f):
            writer = DeltaWriter(f, self._key_schema, self._value_schema, new_version,
                                 lineage=commit_id + parent_id, compression=self._conf.compression)
            writer.remove_rows(del_keys)
            writer.put_rows(put_keys, put_values)
            writer.finish(num_keys=merged_count.result())

        # The delta is encoded and made durable under a temporary name on a second thread
        # while the merge runs here (lz4, checksums, fsync and the table loops release the
        # GIL); its trailer waits for the key count the merge finds. It is renamed into place
        # only once the merge succeeded: raised means not visible. Until then the merged
        # version is pending: no reader sees it.
        written = _delta_writers().submit(self._files.write_pending, name, write)
        try:
            with self._lock:
                state = self._state_to_merge_into(view.state, view.version, view.commit_id)
                state.merge(put_keys, put_values, del_keys, commit_id, pending=True, del_prior=del_prior,
                            put_prior=put_prior, update=update)
                count = state.num_keys[new_version]
        except BaseException:
            merged_count.set_result(None)  # lets the write end; its file is discarded
            if written.exception() is None:  # waits for the write
                written.result().discard()
            with self._lock:
                self._latest = None  # a half-applied merge: reload from files next time
                self._published.notify_all()
            raise
        merged_count.set_result(count)
        try:
            pending = written.result()  # waits; re-raises the write's error here
            try:
                pending.publish()
                self._remember_header(name, commit_id, parent_id)  # maintenance reads no header back
                self._supersede(view, new_version, doomed)
            except BaseException:
                self._files.delete([name])
                pending.discard()
                raise
        except BaseException:
            with self._lock:
                self._undo_merge(state)
            raise
        with self._lock:
            state.pending = None
            self._published.notify_all()
            num_keys = state.num_keys[new_version]
            head_due = self._spill_due(state)
            # Over the hard limit, and maintenance has had since an earlier commit to spill:
            head_over_limit = (head_due and state.spill_asked_at is not None
                               and self._spill_due(state, SPILL_HARD_RATIO))
            if head_due and state.spill_asked_at is None:
                state.spill_asked_at = new_version
            committed = None
            if self._conf.max_versions_to_retain_in_memory > 0:
                self._latest = state
                self._retain(state)
                committed = View(self, state, new_version, view.listing)
            else:
                self._latest = None
        log.info("Committed version %d (%s) for %s", new_version, commit_id.hex(), self)
        if head_due and self._maintenance_hint is not None:
            self._maintenance_hint()
        if head_over_limit and self._latest is state:
            self._spill_now()
        return new_version, num_keys, commit_id, committed

    @staticmethod
    def _removed_keys(view, update):
        """The keys the update removes that ``view``'s version holds, and their values there.
        As in Spark's stores, a delta records the removal of a key only if the key was there:
        a version's delta is then exactly its change (what the change feed reads)."""
        del_keys, _ = update.dels.export_rows()
        if not del_keys.shape[0]:
            return del_keys, None
        values, found = view.lookup(del_keys)
        if not found.all():
            del_keys, values = take_rows(del_keys, found), take_rows(values, found)
        return del_keys, values

    @requires_lock
    def _state_to_merge_into(self, source, version, commit_id):
        """The State a commit on ``version`` (attempt ``commit_id``) of ``source`` merges into.
        REQUIRES: self._lock held.

        The newest State when it holds that version and attempt as its newest (the same
        contents: ``source`` itself, or the State maintenance built over ``source`` when it
        froze it for a spill while the store was open) and nobody iterates it; otherwise
        ``source`` is frozen (iterations read it without the lock; a re-execution from an
        older version leaves it to its readers) and a new one is built over it."""
        previous = self._latest
        if (previous is not None and previous.version == version and not previous.frozen
                and not previous.iterating and previous.commit_ids.get(version) == commit_id):
            return previous
        # Same lineage, frozen only for its iterators: older versions stay readable.
        return source.freeze_into_successor(version, keep_versions=source is previous and previous.version == version)

    @requires_lock
    def _undo_merge(self, state):
        """After a failed commit: the merge must leave no trace. REQUIRES: self._lock held."""
        if state is self._latest and not state.iterating:
            state.rollback()
        elif state is self._latest:
            self._latest = None  # iterated meanwhile: drop it, reload from files next time
        # else: a State built for this commit and never published: dropped with it
        self._published.notify_all()

    def _refuse_if_stale(self, view, new_version):
        """A commit whose store opened before newer versions than ``new_version`` were
        committed is a stale attempt (a zombie task): it must not write or delete anything."""
        listing = self._files.list_versions()
        unseen = sorted({f.version for f in listing.newer_than(new_version)
                         if f.kind == "delta" and f.name not in view.listing.names})
        if unseen:
            raise CommitConflictError(
                f"version {new_version} of {self} was not committed: versions {unseen} were committed "
                f"by other attempts since this store opened version {view.version} (a stale attempt)")
        chain = self._chain(listing)
        if view.version > 0 and all(chain.find(kind, view.version, view.commit_id) is None
                                    for kind in ("delta", "snapshot")):
            raise CommitConflictError(
                f"version {new_version} of {self} was not committed: the attempt {view.commit_id.hex()} of "
                f"version {view.version} this store opened is gone from the files (a re-execution replaced "
                f"it): a commit on it would not load")

    def _superseded(self, view, new_version):
        """The files a commit of ``new_version`` from ``view`` deletes, newest version first
        (a version's delta before its snapshot): those that were there when the store opened
        of the versions above ``new_version`` (a re-execution from ``view.version`` abandons
        them), and, for a store opened on the default lineage, the other attempts of
        ``new_version`` too: with no driver naming attempts, the default lineage must not
        depend on which of two files' modification times is later (equal within a clock tick).
        A store opened at a named attempt leaves them: its driver names the attempt it keeps,
        and a speculative copy's commit must not delete the original's, not yet recorded."""
        above = new_version if view.named else view.version
        return sorted(view.listing.newer_than(above), key=lambda f: (f.version, f.kind == "delta"), reverse=True)

    def _refuse_if_recorded(self, view, new_version, doomed):
        """A commit that would delete a file a batch record names, or one on the chain down
        from a recorded attempt, is a late opener (a speculative copy or a retry that opened
        ``view.version`` after later batches were committed and recorded), not a
        re-execution: CommitConflictError naming the batch, before anything is deleted. Off
        the common path: only a commit with files to supersede reads the records."""
        doomed_names = {f.name for f in doomed}
        listing = self._files.list_versions()
        chain = self._chain(listing)
        for batch_id, version, commit_id in self._recorded_attempts(new_version):
            for u, cid, delta, snapshot in chain.walk(version, commit_id):
                if u < new_version:
                    break
                needed = [f.name for f in (delta, snapshot) if f is not None and f.name in doomed_names]
                if needed:
                    raise CommitConflictError(
                        f"version {new_version} of {self} was not committed: this store opened version "
                        f"{view.version} after batch {batch_id} was committed and recorded (a late attempt), "
                        f"and its commit would delete {needed[0]}, which version {version} of that batch "
                        f"needs; nothing was written or deleted")
                if delta is None:
                    break

    def _recorded_attempts(self, new_version):
        """``(batch_id, version, commit id)`` of this store's attempts that the operator's batch
        records name at or above ``new_version`` (``<root>/<operator>/_commits/<batch>``, and the
        record ``_operator.json`` holds after a repartition); none without records."""
        from statecore import operator_files  # only on the re-execution path

        sid = self._store_id
        location = operator_files.operator_dir(sid.checkpoint_root_location, sid.operator_id)
        options = self._conf.storage_options
        records = operator_files.commit_log(location, options)
        batches = [b for b in records.epochs() if b + 1 >= new_version]
        metadata = operator_files.read_metadata(location, options)
        moved = operator_files.repartitioned(metadata)
        if moved is not None and isinstance(moved.get("batch_id"), int) and moved["batch_id"] + 1 >= new_version:
            batches = sorted({b for b in batches if b >= moved["batch_id"]} | {moved["batch_id"]})
        found = []
        for batch_id in batches:
            record = operator_files.read_commit_record(records, batch_id, metadata)
            if record is None or sid.partition_id >= record["num_partitions"]:
                continue
            ids = operator_files.store_ids(record, sid.store_name)
            if ids is not None:
                found.append((batch_id, batch_id + 1, bytes.fromhex(ids[sid.partition_id])))
        return found

    def _supersede(self, view, new_version, doomed):
        """After this commit's delta is in place: delete ``doomed`` (:meth:`_superseded`),
        once more checked against what appeared since the store opened (a newer delta: this
        attempt is stale) and against the batch records. Raises if anything is refused or
        cannot be deleted (the caller deletes its own file)."""
        self._refuse_if_stale(view, new_version)
        if not doomed:
            return
        self._refuse_if_recorded(view, new_version, doomed)
        log.warning("version %d of %s committed again: deleting the files of the abandoned run: %s",
                    new_version, self, [f.name for f in doomed])
        # Newest first, a version's delta before its snapshot, stopping at the first failure:
        # whatever is left of the abandoned run is a whole prefix of it, which still loads.
        for f in doomed:
            if not self._files.delete([f.name]) and self._files.exists(f.name):
                raise OSError(f"could not delete {self._files.path(f.name)} of the abandoned run of {self}: "
                              f"version {new_version} would not be the default lineage")

    @requires_lock
    def _spill_due(self, state, ratio=None):
        """Whether the head holds more changed keys than ``ratio`` (SPILL_RATIO by default) of
        the state, and at least SPILL_MIN_ROWS: then it is spilled. REQUIRES: self._lock held."""
        head_rows = len(state.head)
        ratio = SPILL_RATIO if ratio is None else ratio
        return head_rows > SPILL_MIN_ROWS and head_rows > ratio * state.count(state.version)

    @staticmethod
    def _changes_outgrown(changed, num_keys):
        """Whether ``changed`` keys since the last snapshot (spilled, or in a head) outgrew
        their share of a version of ``num_keys`` keys (and HEAD_SNAPSHOT_MIN_ROWS): then a
        snapshot is due (a spill would otherwise grow towards the state's size)."""
        return changed > HEAD_SNAPSHOT_MIN_ROWS and changed > HEAD_SNAPSHOT_RATIO * num_keys

    # -- loading ---------------------------------------------------------------------------
    def _empty_state(self):
        return State(self._key_schema, self._value_schema, None, 0, ROOT_COMMIT_ID, 0, self._changes)

    def _load(self, version, commit_id, listing):
        """Version ``version`` (attempt ``commit_id``) from files, listing again if another
        instance's cleanup deleted files meanwhile."""
        if version == 0:
            return self._empty_state()
        for attempt in range(3):
            try:
                return self._load_listed(version, commit_id, listing)
            except (FileNotFoundError, VersionNotFoundError) as e:
                relisted = self._files.list_versions()
                if relisted == listing or attempt == 2:
                    if isinstance(e, FileNotFoundError):
                        raise VersionNotFoundError(f"a file of version {version} of {self} vanished "
                                                   f"while loading: {e}") from e
                    raise
                log.info("files of %s changed while loading version %d; listing again", self, version)
                listing = relisted

    def _load_listed(self, version, commit_id, listing):
        """Walk the lineage down from the version to the newest snapshot that opens (a damaged
        one is skipped for an older one plus deltas), then replay the deltas after it."""
        steps = []  # (version, delta file) from `version` down
        damage = None
        for u, cid, delta, snapshot in self._chain(listing).walk(version, commit_id):
            if u == 0:
                return self._replay(self._empty_state(), steps)
            published = self._published_state(u, cid, delta) if delta is not None else None
            if published is not None:
                return self._replay(published, steps)
            if snapshot is not None:
                try:
                    return self._replay(self._open_snapshot(snapshot, cid), steps)
                except StateCorruptionError as e:
                    if e.path != self._files.path(snapshot.name):
                        raise
                    log.warning("skipping damaged snapshot %s of %s: %s", snapshot.name, self, e)
                    damage = damage or e
            if delta is None:
                path = self._files.path(file_name(u, cid, "delta"))
                raise damage or VersionNotFoundError(
                    f"Error reading delta file {path} of {self}: {path} does not exist")
            steps.append((u, delta))
        raise AssertionError("unreachable: a walk ends at version 0 or a missing delta")

    # -- whole images shared by the processes of a machine ----------------------------------
    def _publish_image(self, version, commit_id, path):
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
        with self._lock:
            older, self._image_published = self._image_published, cached
        if older != cached:
            _remove_image(older)

    def _has_published_image(self, delta):
        return self._files.is_local and self._files.published_image(delta.name) is not None

    def _published_state(self, version, commit_id, delta):
        """A State of ``version`` (attempt ``commit_id``) over the whole image another process
        published for ``delta``, every checksum checked, or None (none published,
        or one that does not hold exactly that version: it is dropped)."""
        path = self._files.published_image(delta.name) if self._files.is_local else None
        if path is None:
            return None
        try:
            reader = SnapshotReader(path, self._key_schema, self._value_schema)
        except FileNotFoundError:
            return None  # dropped meanwhile
        except (OSError, StateCorruptionError, SchemaMismatchError) as e:
            log.warning("published image %s of %s not used: %s", path, self, e)
            self._files.drop_images([delta.name])
            return None
        try:
            if reader.store_version != version or reader.commit_id != commit_id:
                raise StateCorruptionError(path, None, f"it holds version {reader.store_version} "
                                                       f"({reader.commit_id.hex()}), not {version} ({commit_id.hex()})")
            reader.verify(index=False)  # every checksum: rows and slots
        except StateCorruptionError as e:
            reader.close()
            log.warning("published image %s of %s not used: %s", path, self, e)
            self._files.drop_images([delta.name])
            return None
        log.info("version %d of %s mapped from the image another process published", version, self)
        # A whole spill, as it was where it was written: the next spill takes it in (and is
        # whole, and published in turn) as it would take in this provider's own.
        whole = Spill(reader, None, None, version, commit_id, reader.row_count)
        return State(self._key_schema, self._value_schema, whole, version, commit_id, reader.row_count, self._changes)

    def _open_snapshot(self, f, commit_id):
        path = self._files.path(f.name)
        reader = open_snapshot(self._files, f.name, self._key_schema, self._value_schema)
        try:
            check_names_agree(f, path, reader.store_version, reader.commit_id)
            if reader.commit_id != commit_id:
                raise StateCorruptionError(path, None, f"the snapshot is of commit {reader.commit_id.hex()}, "
                                                       f"expected {commit_id.hex()}")
        except BaseException:
            reader.close()
            raise
        return State(self._key_schema, self._value_schema, reader, f.version, commit_id, reader.row_count,
                     self._changes)

    def _checked_delta(self, f, parent_id=None):
        """``(commit id, blocks, key count)`` of the delta file ``f``, read whole and verified
        to its trailer before any row is used (the key count of its version is None when the
        file does not record it); its header must agree with its name and, given
        ``parent_id``, follow that attempt of the version before."""
        path = self._files.path(f.name)
        with self._files.open_read(f.name) as source:
            reader = DeltaReader(source, self._key_schema, self._value_schema, path=path)
            check_names_agree(f, path, reader.store_version, reader.commit_id)
            if parent_id is not None and reader.parent_id != parent_id:
                raise StateCorruptionError(path, None, f"delta of version {f.version} does not follow the "
                                                       f"version {f.version - 1} it is read on (a file of another run)")
            blocks = list(reader)
            return reader.commit_id, blocks, reader.num_keys

    def _checked_deltas(self, steps, parent_id):
        """``(version, commit id, blocks, key count)`` of the delta files of ``steps``
        (``(version, file)``, newest first), oldest first: each read and checked whole,
        following the one before it (the first follows ``parent_id``)."""
        for u, f in reversed(steps):
            own_id, blocks, count = self._checked_delta(f, parent_id=parent_id)
            yield u, own_id, blocks, count
            parent_id = own_id

    def _replay(self, state, steps):
        self._replay_deltas(state, self._checked_deltas(steps, state.commit_ids[state.version]))
        return state

    @staticmethod
    def _replay_deltas(state, deltas, drop_older=False):
        """Replay ``deltas`` (as :meth:`_checked_deltas` yields them) into ``state``'s head,
        each becoming its newest version with the key count its file records (or an unknown
        one). ``drop_older``: first forget the versions ``state`` held before its newest,
        which the replay makes unreadable."""
        if drop_older:
            state.retain(state.version)
        for u, own_id, blocks, count in deltas:
            for kind, keys, values in blocks:
                state.replay(kind == BLOCK_PUTS, keys, values)
            state.advance(u, own_id, count)

    # -- whole versions, read once -------------------------------------------------------------
    def version_rows(self, version, commit_id=None, rows_per_batch=1 << 20):
        """Yield ``(keys, values)`` batches of every row of ``version`` (at ``commit_id``, or
        the default lineage's), for a reader that visits each row once (a repartition, an
        export, read_state). A version that is the delta of version 1 alone is read straight
        from it (checked to its trailer, then its puts: a delta holds each key once), without
        building it in memory; any other goes through a read-only store (``get_read_store``:
        a snapshot is mapped, a damaged one skipped for an older one and its deltas)."""
        if not isinstance(rows_per_batch, int) or rows_per_batch <= 0:
            raise ValueError(f"rows_per_batch must be an int > 0, got {rows_per_batch!r}")
        listing = self._files.list_versions()
        target = self._resolve(version, commit_id, listing)
        chain = self._chain(listing)
        delta = chain.find("delta", 1, target) if version == 1 else None
        if delta is not None and chain.find("snapshot", 1, target) is None:
            _, blocks, _ = self._checked_delta(delta, parent_id=ROOT_COMMIT_ID)
            for kind, keys, values in blocks:
                if kind == BLOCK_PUTS:
                    for start in range(0, keys.shape[0], rows_per_batch):
                        stop = start + rows_per_batch
                        yield (self._key_schema.from_rows(np.ascontiguousarray(keys[start:stop])),
                               self._value_schema.from_rows(np.ascontiguousarray(values[start:stop])))
            return
        store = self.get_read_store(version, target)
        try:
            yield from store.iter_batches(rows_per_batch)
        finally:
            store.abort()

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
        for name, v in (("start_version", start_version), ("end_version", end_version)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if start_version > end_version:
            raise ValueError(f"start_version {start_version} is after end_version {end_version}")
        listing = self._files.list_versions()
        target = self._resolve(end_version, commit_id, listing)
        steps = []
        for u, cid, delta, _ in self._chain(listing).walk(end_version, target):
            if u < start_version:
                break
            if delta is None:
                path = self._files.path(file_name(u, cid, "delta"))
                raise VersionNotFoundError(
                    f"the change of version {u} of {self} is not retained: {path} does not exist (deltas older "
                    f"than the retained snapshots are deleted by maintenance)")
            steps.append((u, delta))
        for u, f in reversed(steps):
            _, blocks, _ = self._checked_delta(f)
            for kind, keys, values in blocks:
                if kind == BLOCK_PUTS:
                    yield u, True, self._key_schema.from_rows(keys), self._value_schema.from_rows(values)
                else:
                    yield u, False, self._key_schema.from_rows(keys), None

    # -- schema file -----------------------------------------------------------------------
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
        payload = schema_file_bytes(self._key_schema, self._value_schema)
        try:
            self._files.write_atomic(SCHEMA_FILE, lambda f: f.write(payload), overwrite=False)
        except FileExistsError:
            self._check_schema_file()
        self._schema_written = True

    # -- metrics ---------------------------------------------------------------------------
    def describe(self):
        """What this provider holds in memory, as a dict (for tests and debugging, as LevelDB's
        DebugString): ``latest``, the newest State's ``State.describe()`` (None: none held),
        and its counters (loads from memory and from files, roll-forwards, changes to what
        lookups walk, heap bytes)."""
        with self._lock:
            latest = self._latest
            return {
                "latest": latest.describe() if latest is not None else None,
                "closed": self._closed,
                "hits": self._hits,
                "misses": self._misses,
                "rolled_forward": self._rolled_forward,
                "changes": int(self._changes[0]),
                "memory_bytes": self._memory_bytes(),
            }

    def _memory_bytes(self):
        with self._lock:
            state = self._latest
            layers = {}  # a state built over a frozen one shares its undo layers: count each once
            filters = 0  # the base's key filters (its images are mapped, not heap)
            while state is not None:
                for layer in (state.head, *state.undo.values()):
                    layers[id(layer)] = layer
                filters += filter_bytes(state.base)
                state = frozen_below(state)
            return filters + sum(layer.sizeof() for layer in layers.values())

    def _metrics(self, num_keys, update_bytes=0):
        return StateStoreMetrics(
            num_keys=num_keys,
            memory_used_bytes=self._memory_bytes() + update_bytes,
            custom_metrics={
                "stateOnCurrentVersionSizeBytes": num_keys * (self._key_schema.width + self._value_schema.width),
                "loadedMapCacheHitCount": self._hits,
                "loadedMapCacheMissCount": self._misses,
                "rolledForwardCount": self._rolled_forward,
            })


def _rows_of(parts, width):
    """One (n, width) uint8 array of the row arrays ``parts`` (empty when there are none)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty((0, width), dtype=np.uint8)
    return np.concatenate(parts)


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


def schema_file_bytes(key_schema, value_schema):
    """The bytes of a store's :data:`SCHEMA_FILE`: the schemas its first commit records."""
    record = {"format": "statecore-state-schema-1", "key": key_schema.describe(), "value": value_schema.describe()}
    return json.dumps(record, indent=1).encode()


def read_store_schemas(files):
    """``(key_schema, value_schema)`` a store directory recorded with its first commit, or
    None if it has none yet; StateCorruptionError if the schema file is unreadable."""
    path = files.path(SCHEMA_FILE)
    try:
        raw = files.read_bytes(SCHEMA_FILE, max_bytes=MAX_SCHEMA_FILE_BYTES)
    except FileNotFoundError:
        return None
    except UnsafeFileError as e:  # a FIFO, a device, a directory, or more than the bound: refused unread
        raise StateCorruptionError(path, None, f"unreadable schema file: {e.reason}") from None
    except OSError as e:  # a file we may not read
        raise StateCorruptionError(path, None, f"unreadable schema file: {e}") from None
    try:
        recorded = json.loads(raw)
        return RowSchema.from_description(recorded["key"]), RowSchema.from_description(recorded["value"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise StateCorruptionError(path, None, f"unreadable schema file: {type(e).__name__}: {e}") from None


def _remove_image(path):
    """Remove a published image (None: nothing); best effort: one already gone is fine."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
