"""A provider's background work: spilling the head, writing snapshots, building the key
filter of the snapshot under the state, and deleting files no version needs.

Snapshots and cleanup follow the default lineage (:mod:`statecore.lineage`) and decide only
on checked bytes: headers read through the provider's checked parser, and a snapshot that
lets older files go is verified whole first. Damage found here is logged and nothing is
deleted on its account; files that vanish meanwhile (another instance's cleanup) end the pass quietly.
Rules and locks: ``docs/provider-rules.md``.
"""
import contextlib
import logging
import time

from statecore._delta import DeltaReader
from statecore._keyfilter import KeyFilter
from statecore._snapshot import SnapshotReader
from statecore._versions import (Spill, bottom_snapshot, changed_since_bottom, is_view_of, snapshot_version,
                                 spilled_base, stands_on_frozen)
from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError, VersionNotFoundError
from statecore.lineage import check_names_agree, file_name, image_lineage
from statecore.snapshot_files import check_snapshot, open_snapshot, write_snapshot_file
from statecore.spill import KEY_FILTER_MAX_ROWS, spill_file_maker, spill_head, spill_rows

__all__ = ["run_maintenance", "spill_if_outgrown", "MaintenanceRecord", "TEMPORARY_FILE_MAX_AGE_S"]

log = logging.getLogger(__name__)

# Temporary files older than this are a killed writer's leftovers; maintenance deletes them.
TEMPORARY_FILE_MAX_AGE_S = 3600.0
# How long a pass waits for a commit in flight to be published before it spills or freezes
# the state (commits back to back leave little time between them).
PUBLISH_WAIT_S = 1.0
# After a spill failed (a full or failing local disk), spills the head's size asks for wait
# this long before they are tried again: each try after a failure writes the whole state
# (the State stands on a frozen one), and a commit or a hint would otherwise try at once.
SPILL_RETRY_S = 10.0

# Visible for tests. The rows a snapshot or a compaction is written from, read by this name:
# Spill is a compiled type whose methods cannot be replaced, and tests wrap this to commit or
# stop a thread between the chunks.
rewritten_rows = Spill.rows


class MaintenanceRecord:
    """What maintenance remembers of one provider between passes."""

    def __init__(self):
        self.spill_failed_at = None  # time.monotonic() of the last failed spill (SPILL_RETRY_S)
        self.snapshot_on_files = 0  # the newest snapshot seen on the files of the default lineage
        self.verified_files = set()  # names checked whole before deleting on their account


def run_maintenance(provider):
    """One pass: a spill and a snapshot if due, the key filter of the snapshot under the
    state, then cleanup."""
    try:
        _snapshot_if_due(provider)
        _filter_bottom(provider)
        _cleanup(provider)
    except (FileNotFoundError, VersionNotFoundError) as e:
        log.info("files of %s changed during maintenance (another instance's cleanup?); "
                 "skipping this pass: %s", provider, e)
    except (StateCorruptionError, UnsafeFileError) as e:
        log.error("maintenance of %s found a damaged file and deleted nothing on its account: %s", provider, e)


def _default_chain_down(provider, listing, stop_below):
    """``[(u, id, delta, snapshot)]`` of the default lineage from the newest version down to
    the first snapshot at or below ``stop_below`` (or version 0, or a missing delta)."""
    chain = provider.chain(listing)
    top, commit_id = chain.default_top()
    steps = []
    for step in chain.walk(top, commit_id):
        steps.append(step)
        u, _, _, snapshot = step
        if u <= stop_below and snapshot is not None:
            break
    return steps


def _snapshot_if_due(p):
    """Spill the head if it outgrew its share of the state; then write a snapshot of the
    newest version if more than ``min_deltas_for_snapshot`` versions follow the newest
    snapshot on the files of the default lineage (or none follows the store's last schema
    change: ``docs/evolution.md``), or else compact its levels if the changes
    since the State's bottom image (a snapshot, or a whole spill) passed half the state:
    every row written again as one whole spill, local as any spill (no file of the
    checkpoint, nothing made durable: the deltas are). Both are written from a spill, so
    that nothing frozen is held in memory while a whole version is written (``docs/provider-
    rules.md``, "Spilling the head"). The state decides first; the files are listed once,
    after the spill, to check that its version is of the default lineage, has no snapshot
    yet, and is due by the files too (another worker of the store may have written one)."""
    spill_if_outgrown(p)
    min_deltas = p.conf.min_deltas_for_snapshot
    changed_at = p.schemas_changed_at  # a snapshot at or above it: later loads convert nothing

    def schema_due(since, version):
        return since < changed_at <= version

    def changes_outgrown(base, head_rows, num_keys):
        return p.held.changes_outgrown(head_rows + changed_since_bottom(base), num_keys)

    def due(state):
        since = max(snapshot_version(state.base), p.maintenance_record.snapshot_on_files)
        return state.version > 0 and (state.version - since > min_deltas or schema_due(since, state.version)
                                      or changes_outgrown(state.base, len(state.head), state.count(state.version)))

    spill = _spill_newest(p, due)
    if spill is None:
        return
    steps = _default_chain_down(p, p.files.list_versions(), spill.version)
    on_files = next((u for u, _, _, snapshot in steps if u <= spill.version and snapshot is not None), 0)
    p.maintenance_record.snapshot_on_files = max(p.maintenance_record.snapshot_on_files, on_files)
    of_default_lineage = any(step[:2] == (spill.version, spill.commit_id) for step in steps)
    if of_default_lineage and spill.version > on_files and (spill.version - on_files > min_deltas
                                                            or schema_due(on_files, spill.version)):
        _write_snapshot(p, spill, file_name(spill.version, spill.commit_id, "snapshot"))
    elif changes_outgrown(spill, 0, spill.num_keys):
        _compact(p, spill)


def _compact(p, spill):
    """Write ``spill``'s version whole as a new spill, over nothing, and stand it where
    ``spill`` stood: its levels are let go (lookups probe one image where they walked
    several, and later spills take it in or stack over it as over a snapshot)."""
    with _rewriting(p, spill) as rows:
        whole = spill_rows(spill_file_maker(p.files, spill.version), p.key_schema, p.value_schema, spill.version,
                           spill.commit_id, rows, spill.num_keys, _publisher(p, spill.version, spill.commit_id))
        if not p.held.replace_base(lambda b: b is spill, whole):
            whole.puts.close()
    log.debug("compacted version %d of %s: %r", spill.version, p, whole)


@contextlib.contextmanager
def _rewriting(p, spill):
    """While ``spill``'s version is written whole (a snapshot, or a compaction) it is the
    held versions' ``snapshot_source``: spills made meanwhile stand over it, never taking it in.
    Yields its rows, chunk by chunk; between chunks, a head that outgrew its share is spilled
    at once, over ``spill`` (which the version written replaces when done)."""
    def rows_spilling_meanwhile():
        for chunk in rewritten_rows(spill):
            yield chunk
            spill_if_outgrown(p)

    with p.held.lock:
        p.held.snapshot_source = spill
    try:
        yield rows_spilling_meanwhile()
    finally:
        with p.held.lock:
            p.held.snapshot_source = None


def _publisher(p, version, commit_id):
    """``publish(path)`` for a whole spill of ``version``: the provider shares its image with
    the machine's other processes (``FileStateStoreProvider.publish_image``)."""
    return lambda path: p.publish_image(version, commit_id, path)


def _filter_bottom(p):
    """Build the key filter of the snapshot under the newest state, if it has none and at most
    KEY_FILTER_MAX_ROWS rows. The scan reads the mapped rows without the provider's lock (the
    reader keeps its mapping for each call); a snapshot closed meanwhile (swapped for a newer
    one) is left without one."""
    with p.held.lock:
        state = p.held.newest
        reader = bottom_snapshot(state.base) if state is not None else None
    if reader is None or reader.key_filter is not None or reader.row_count > KEY_FILTER_MAX_ROWS:
        return
    try:
        reader.build_key_filter()
    except ValueError:
        if not reader.closed:
            raise


def _spill(p, state, written):
    """Write frozen ``state`` out as a Spill of its version (its head, and the newer levels of
    its base's spills, but not ``written``, the spill a snapshot is being written from) and
    make it the base of the State built over the frozen one."""
    version = state.version
    new_file = spill_file_maker(p.files, version)
    commit_id, num_keys = state.commit_ids[version], state.count(version)
    publish = _publisher(p, version, commit_id)
    if stands_on_frozen(state.base):  # no mapped base to tell changes from: every row
        spill = spill_rows(new_file, p.key_schema, p.value_schema, version, commit_id,
                           state.iter_rows(version), num_keys, publish)
    else:
        spill = spill_head(new_file, state.head, state.base, version, commit_id, num_keys, written, publish)
    p.held.replace_base(lambda b: is_view_of(b, state, version), spill)
    log.debug("spilled version %d of %s: %r", version, p, spill)
    return spill


def _write_snapshot(p, spill, name):
    """Write ``spill``'s version as snapshot ``name``; once durable and checked, it replaces
    the spill as the base of the State built over it, with the key filter its writer filled
    (up to KEY_FILTER_MAX_ROWS rows: no scan of it later)."""
    mapped = []
    key_filter = (KeyFilter(p.key_schema.width, spill.num_keys)
                  if 0 < spill.num_keys <= KEY_FILTER_MAX_ROWS else None)

    def map_and_verify(reader):
        # Check every block (and fault its pages in) here, on the maintenance thread, not in
        # the first batches that look keys up in the new base; swapped in once durable.
        mapped.append(reader)
        reader.verify(index=False)

    with _rewriting(p, spill) as rows:
        try:
            # An image on the local filesystem is mapped before its rename, while it is made
            # durable; a packed one (or one elsewhere) is opened once it is in place.
            write_snapshot_file(p.files, name, p.key_schema, p.value_schema, spill.num_keys, spill.version,
                                image_lineage(spill.commit_id), rows, p.conf.compression, keep_image=True,
                                key_filter=key_filter, on_flushed=lambda path: map_and_verify(
                                    SnapshotReader(path, p.key_schema, p.value_schema)))
            if not mapped:
                map_and_verify(open_snapshot(p.files, name, p.key_schema, p.value_schema))
            if key_filter is not None:
                mapped[-1].set_key_filter(key_filter)
        except BaseException:
            for reader in mapped:
                reader.close()
            raise
        if not p.held.replace_base(lambda b: b is spill, mapped[-1]):
            mapped[-1].close()
    log.info("wrote snapshot %s for %s", p.files.path(name), p)


def spill_if_outgrown(p, ratio=None, after_failure_wait=False):
    """Spill the newest State if its head outgrew its share (``ratio`` of the state, by
    default the provider's SPILL_RATIO), or if it stands on a frozen State (left by an
    iteration during a commit, or a spill that failed: every row is spilled, and the frozen
    heads are let go). Called by maintenance, between the chunks of a snapshot it writes, and
    by a commit whose head outgrew the hard limit (maintenance fell behind). With
    ``after_failure_wait`` (a commit, or a commit's hint to the registry's thread), does
    nothing within SPILL_RETRY_S of a failed spill: the head stays over its share meanwhile,
    and a maintenance pass tries again."""
    failed_at = p.maintenance_record.spill_failed_at
    if after_failure_wait and failed_at is not None and time.monotonic() - failed_at < SPILL_RETRY_S:
        return
    try:
        _spill_newest(p, lambda state: stands_on_frozen(state.base) or p.held.spill_due(state, ratio))
    except Exception:
        p.maintenance_record.spill_failed_at = time.monotonic()
        raise
    p.maintenance_record.spill_failed_at = None


def _spill_newest(p, wanted):
    """The Spill the newest State stands on once spilled, if ``wanted(state)``: its base
    already when that is a spill of the State's version (its head empty, no commit since);
    else None. One spill at a time, and never taking in the spill a snapshot is being written
    from."""
    held = p.held
    with held.spilling:
        with held.lock:
            state = held.newest_published(wanted, PUBLISH_WAIT_S)
            if state is None:
                return None
            spilled = spilled_base(state.base)
            if spilled is not None and not len(state.head) and spilled.version == state.version:
                return spilled
            held.freeze_newest()
            written = held.snapshot_source
        return _spill(p, state, written)


def _cleanup(p):
    leftovers = p.files.temporary_files(TEMPORARY_FILE_MAX_AGE_S)
    if leftovers:
        log.info("Deleting temporary files a killed writer left in %s: %s", p, leftovers)
        p.files.delete(leftovers)
    listing = p.files.list_versions()
    p.maintenance_record.verified_files &= listing.names  # forget files that are gone
    top = listing.top
    if top == 0:
        return
    earliest = top - p.conf.min_versions_to_retain
    steps = _default_chain_down(p, listing, max(earliest, 0))
    first_needed = 0  # every version from `earliest` on loads from here (0: the empty state)
    last_u, _, last_delta, last_snapshot = steps[-1]
    if earliest > 0:
        if last_u > earliest or last_snapshot is None and last_u != 0:
            return  # the lineage below the window is incomplete: nothing may go on its account
        first_needed = last_u
        if last_snapshot is not None and not _verified(p, last_snapshot):
            return
        doomed = [f.name for f in listing if f.version < first_needed]
        if doomed:
            deleted = p.files.delete(doomed)
            log.info("Deleted files older than %d for %s: %s", first_needed, p, sorted(deleted))
    _thin_snapshots(p, first_needed, steps)


def _verified(p, f):
    """Whether version file ``f`` would load: its header names the version and attempt its
    name does, and every checksum holds (checked once per file). Files
    are deleted only on the strength of what will load instead. Damage is logged and keeps
    everything."""
    if f.name in p.maintenance_record.verified_files:
        return True
    path = p.files.path(f.name)
    try:
        if f.kind == "snapshot":
            header = check_snapshot(p.files, f.name, deep=True)
            widths = (header.key_schema.width, header.value_schema.width)
        else:
            with p.files.open_read(f.name) as source:
                header = DeltaReader(source, None, None, path=path)
                for _ in header:
                    pass
            widths = (header.key_width, header.value_width)
        check_names_agree(f, path, header.store_version, header.commit_id)  # as a load would
        # and of schemas the store's history converts to the provider's, as a load would
        p.schema_plans((header.key_fingerprint, header.value_fingerprint), widths, f.version, path)
    except (StateCorruptionError, UnsafeFileError, SchemaMismatchError) as e:  # UnsafeFileError: a FIFO, ...
        log.error("%s of %s is damaged; keeping the files that can stand in for it: %s", f.name, p, e)
        return False
    p.maintenance_record.verified_files.add(f.name)
    return True


def _thin_snapshots(p, first_needed, steps):
    """Thin the default lineage's snapshots after the retention window's base to Spark's
    cadence: keep one at least ``min_deltas_for_snapshot`` versions after the previous one
    kept (the bases of later windows, so old deltas keep being deleted) and the newest (the
    one a restart loads); delete the others once every delta after the base is there, so
    each retained version still loads. Snapshots closer together than that (other workers
    of the store, re-executions, a conf changed between runs) would otherwise each keep a
    copy of the state on disk."""
    above = [s for s in steps if s[0] > first_needed]
    if any(delta is None for _, _, delta, _ in above):
        return
    snapshots = sorted((u, snapshot) for u, _, _, snapshot in above if snapshot is not None)
    spacing = max(1, p.conf.min_deltas_for_snapshot)
    kept, doomed, last_doomed = first_needed, [], 0
    for u, snapshot in snapshots[:-1]:  # the newest is always kept
        if u - kept >= spacing:
            kept = u
        else:
            doomed.append(snapshot.name)
            last_doomed = u
    # The versions a doomed snapshot served will load from an older one and the deltas in
    # between: every delta up to the next kept snapshot is checked whole first.
    needed_up_to = min((u for u, _ in snapshots if u > last_doomed), default=0)
    deltas = [delta for u, _, delta, _ in above if u <= needed_up_to]
    if doomed and all(_verified(p, d) for d in deltas):
        p.files.delete(doomed)
        log.info("Deleted snapshots %s of %s: those versions load from an older snapshot (or the empty "
                 "state) and the deltas", doomed, p)

