"""The commit protocol of a provider's stores: refuse a stale or late attempt before anything
is written, write the delta on a pooled writer thread while the update merges into the held
versions as a pending version, publish the delta, delete what a re-execution supersedes, and
undo the merge if anything failed (``docs/provider-rules.md``, "Commits")."""
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from statecore import held_versions
from statecore._delta import DeltaWriter
from statecore._lock import requires_lock
from statecore._versions import State, take_rows
from statecore.errors import CommitConflictError
from statecore.lineage import Listing, file_name
from statecore.stores import View

__all__ = ["commit", "DELTA_WRITERS"]

log = logging.getLogger(__name__)

# Deltas written at once in a process (commits of different stores); more queue.
DELTA_WRITERS = 4

# Visible for tests. The one call that merges a commit's update into the held versions (under
# the provider's lock), called by this name: State is a compiled type whose methods cannot be
# replaced, and tests wrap this to fail a merge or to stop a thread inside it.
merge_update = State.merge

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


def commit(p, view, update, opened_values=None):
    """Commit ``update`` (a store's layer) on ``view``'s version of provider ``p``:
    ``(new_version, num_keys, commit_id, committed)``, ``committed`` a View of the new version
    (None when no version is kept in memory), for the store's reads after. ``opened_values``: an
    OpenedValues the store read, the priors of its puts if they are its keys. The caller
    runs commits of one provider one at a time."""
    held = p.held
    version = view.version
    new_version = version + 1
    commit_id = os.urandom(8)
    parent_id = view.commit_id
    p.write_schema_file(new_version)
    _refuse_if_stale(p, view, new_version)
    doomed = _superseded(view, new_version)
    if doomed:  # a re-execution, or a late attempt: refused here before anything is written
        _refuse_if_recorded(p, view, new_version, doomed)
    put_keys, put_values = update.puts.export_rows()
    del_keys, del_prior = _removed_keys(view, update)
    put_prior = opened_values.priors_of(put_keys) if opened_values is not None else None
    name = file_name(new_version, commit_id, "delta")
    merged_count = Future()  # the new version's key count, once the merge knows it

    def write(f):
        writer = DeltaWriter(f, p.key_schema, p.value_schema, new_version,
                             lineage=commit_id + parent_id, compression=p.conf.compression)
        writer.remove_rows(del_keys)
        writer.put_rows(put_keys, put_values)
        writer.finish(num_keys=merged_count.result())

    # The delta is encoded and made durable under a temporary name on a second thread
    # while the merge runs here (lz4, checksums, fsync and the table loops release the
    # GIL); its trailer waits for the key count the merge finds. It is renamed into place
    # only once the merge succeeded: raised means not visible. Until then the merged
    # version is pending: no reader sees it.
    written = _delta_writers().submit(p.files.write_pending, name, write)
    try:
        with held.lock:
            state = held.state_to_merge_into(view.state, view.version, view.commit_id)
            merge_update(state, put_keys, put_values, del_keys, commit_id, pending=True, del_prior=del_prior,
                         put_prior=put_prior, update=update)
            count = state.num_keys[new_version]
    except BaseException:
        merged_count.set_result(None)  # lets the write end; its file is discarded
        if written.exception() is None:  # waits for the write
            written.result().discard()
        with held.lock:
            held.newest = None  # a half-applied merge: reload from files next time
            held.published.notify_all()
        raise
    merged_count.set_result(count)
    try:
        pending = written.result()  # waits; re-raises the write's error here
        try:
            pending.publish()
            p.remember_header(name, commit_id, parent_id)  # maintenance reads no header back
            _supersede(p, view, new_version, doomed)
        except BaseException:
            p.files.delete([name])
            pending.discard()
            raise
    except BaseException:
        with held.lock:
            _undo_merge(held, state)
        raise
    with held.lock:
        state.published()
        held.published.notify_all()
        num_keys = state.num_keys[new_version]
        head_due = held.spill_due(state)
        # Over the hard limit, and maintenance has had since an earlier commit to spill:
        head_over_limit = (head_due and state.spill_asked_at is not None
                           and held.spill_due(state, held_versions.SPILL_HARD_RATIO))
        if head_due:
            state.spill_asked(new_version)
        committed = None
        if held.keep_in_memory > 0:
            held.newest = state
            held.retain(state)
            gone = {f.name for f in doomed}
            held.know_files(state, Listing([f for f in view.listing if f.name not in gone]))  # its own: not above
            committed = View(p, state, new_version, view.listing)
        else:
            held.newest = None
    log.info("Committed version %d (%s) for %s", new_version, commit_id.hex(), p)
    if head_due:
        p.hint_maintenance()
    if head_over_limit and held.newest is state:
        p.spill_after_commit()
    return new_version, num_keys, commit_id, committed


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
def _undo_merge(held, state):
    """After a failed commit: the merge must leave no trace. REQUIRES: held.lock held."""
    if state is held.newest and not state.iterating:
        state.rollback()
    elif state is held.newest:
        held.newest = None  # iterated meanwhile: drop it, reload from files next time
    # else: a State built for this commit and never published: dropped with it
    held.published.notify_all()


def _refuse_if_stale(p, view, new_version):
    """A commit whose store opened before newer versions than ``new_version`` were
    committed is a stale attempt (a zombie task): it must not write or delete anything.
    Not checked for a view opened from memory without a listing (``view.listed`` false: a
    named attempt, the provider's newest): the commit then writes only its own file, and
    deletes only what the provider knew to be above (``docs/provider-rules.md``)."""
    if not view.listed:
        return
    listing = p.files.list_versions()
    unseen = sorted({f.version for f in listing.newer_than(new_version)
                     if f.kind == "delta" and f.name not in view.listing.names})
    if unseen:
        raise CommitConflictError(
            f"version {new_version} of {p} was not committed: versions {unseen} were committed "
            f"by other attempts since this store opened version {view.version} (a stale attempt)")
    chain = p.chain(listing)
    if view.version > 0 and all(chain.find(kind, view.version, view.commit_id) is None
                                for kind in ("delta", "snapshot")):
        raise CommitConflictError(
            f"version {new_version} of {p} was not committed: the attempt {view.commit_id.hex()} of "
            f"version {view.version} this store opened is gone from the files (a re-execution replaced "
            f"it): a commit on it would not load")


def _superseded(view, new_version):
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


def _refuse_if_recorded(p, view, new_version, doomed):
    """A commit that would delete a file a batch record names, or one on the chain down
    from a recorded attempt, is a late opener (a speculative copy or a retry that opened
    ``view.version`` after later batches were committed and recorded), not a
    re-execution: CommitConflictError naming the batch, before anything is deleted. Off
    the common path: only a commit with files to supersede reads the records."""
    doomed_names = {f.name for f in doomed}
    chain = p.chain(p.files.list_versions())
    for batch_id, version, commit_id in _recorded_attempts(p, new_version):
        for u, cid, delta, snapshot in chain.walk(version, commit_id):
            if u < new_version:
                break
            needed = [f.name for f in (delta, snapshot) if f is not None and f.name in doomed_names]
            if needed:
                raise CommitConflictError(
                    f"version {new_version} of {p} was not committed: this store opened version "
                    f"{view.version} after batch {batch_id} was committed and recorded (a late attempt), "
                    f"and its commit would delete {needed[0]}, which version {version} of that batch "
                    f"needs; nothing was written or deleted")
            if delta is None:
                break


def _recorded_attempts(p, new_version):
    """``(batch_id, version, commit id)`` of this store's attempts that the operator's batch
    records name at or above ``new_version`` (``<root>/<operator>/_commits/<batch>``, and the
    record ``_operator.json`` holds after a repartition); none without records."""
    from statecore import operator_files  # only on the re-execution path

    sid = p.state_store_id
    location = operator_files.operator_dir(sid.checkpoint_root_location, sid.operator_id)
    options = p.conf.storage_options
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


def _supersede(p, view, new_version, doomed):
    """After this commit's delta is in place: delete ``doomed`` (:func:`_superseded`),
    once more checked against what appeared since the store opened (a newer delta: this
    attempt is stale) and against the batch records. Raises if anything is refused or
    cannot be deleted (the caller deletes its own file)."""
    _refuse_if_stale(p, view, new_version)
    if not doomed:
        return
    _refuse_if_recorded(p, view, new_version, doomed)
    log.warning("version %d of %s committed again: deleting the files of the abandoned run: %s",
                new_version, p, [f.name for f in doomed])
    # Newest first, a version's delta before its snapshot, stopping at the first failure:
    # whatever is left of the abandoned run is a whole prefix of it, which still loads.
    for f in doomed:
        if not p.files.delete([f.name]) and p.files.exists(f.name):
            raise OSError(f"could not delete {p.files.path(f.name)} of the abandoned run of {p}: "
                          f"version {new_version} would not be the default lineage")
