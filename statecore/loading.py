"""Loading a version into memory: from the newest good snapshot on its lineage, or a whole image
another process of the machine published, and the deltas after it, each checked whole first;
and rolling the newest State held forward by the deltas committed since (another process ran
those batches). Reads files through the provider's ``files``, builds States that share its
held versions' change counter (:mod:`statecore.held_versions`)."""
import logging

import numpy as np

from statecore._converted_image import ConvertedImage
from statecore._delta import BLOCK_PUTS, DeltaReader
from statecore._row_convert import RowConverter
from statecore._lock import requires_lock
from statecore._snapshot import SnapshotReader
from statecore._versions import Spill, State, join_rows, take_rows
from statecore.errors import SchemaMismatchError, StateCorruptionError, VersionNotFoundError
from statecore.lineage import ROOT_COMMIT_ID, VersionFile, check_names_agree, file_name
from statecore.schema_evolution import convert
from statecore.snapshot_files import open_snapshot
from statecore.spill import spill_file_maker, spill_rows

__all__ = ["load", "deltas_to_roll_forward", "roll_newest_forward", "read_checked_delta", "checked_deltas"]

log = logging.getLogger(__name__)


def empty_state(p):
    """Version 0 of provider ``p``: the empty state."""
    return State(p.key_schema, p.value_schema, None, 0, ROOT_COMMIT_ID, 0, p.held.changes)


def load(p, version, commit_id, listing):
    """Version ``version`` (attempt ``commit_id``) of provider ``p`` from files, listing again
    if another instance's cleanup deleted files meanwhile."""
    if version == 0:
        return empty_state(p)
    for attempt in range(3):
        try:
            return _load_listed(p, version, commit_id, listing)
        except (FileNotFoundError, VersionNotFoundError) as e:
            relisted = p.files.list_versions()
            if relisted == listing or attempt == 2:
                if isinstance(e, FileNotFoundError):
                    raise VersionNotFoundError(f"a file of version {version} of {p} vanished "
                                               f"while loading: {e}") from e
                raise
            log.info("files of %s changed while loading version %d; listing again", p, version)
            listing = relisted


def _load_listed(p, version, commit_id, listing):
    """Walk the lineage down from the version to the newest snapshot that opens (a damaged
    one is skipped for an older one plus deltas), then replay the deltas after it."""
    steps = []  # (version, delta file) from `version` down
    damage = None
    for u, cid, delta, snapshot in p.chain(listing).walk(version, commit_id):
        if u == 0:
            return _replay(p, empty_state(p), steps)
        published = _published_state(p, u, cid, delta) if delta is not None else None
        if published is not None:
            return _replay(p, published, steps)
        if snapshot is not None:
            try:
                return _replay(p, _open_snapshot(p, snapshot, cid), steps)
            except StateCorruptionError as e:
                if e.path != p.files.path(snapshot.name):
                    raise
                log.warning("skipping damaged snapshot %s of %s: %s", snapshot.name, p, e)
                damage = damage or e
        if delta is None:
            path = p.files.path(file_name(u, cid, "delta"))
            raise damage or VersionNotFoundError(
                f"Error reading delta file {path} of {p}: {path} does not exist")
        steps.append((u, delta))
    raise AssertionError("unreachable: a walk ends at version 0 or a missing delta")


def has_published_image(p, delta):
    """Whether another process of the machine published the whole image of ``delta``'s version."""
    return p.files.is_local and p.files.published_image(delta.name) is not None


def _published_state(p, version, commit_id, delta):
    """A State of ``version`` (attempt ``commit_id``) over the whole image another process
    published for ``delta``, every checksum checked, or None (none published,
    or one that does not hold exactly that version: it is dropped)."""
    path = p.files.published_image(delta.name) if p.files.is_local else None
    if path is None:
        return None
    try:
        reader = SnapshotReader(path, p.key_schema, p.value_schema)
    except FileNotFoundError:
        return None  # dropped meanwhile
    except SchemaMismatchError as e:  # written under other schemas (docs/evolution.md): another's to keep
        log.info("published image %s of %s not used: %s", path, p, e)
        return None
    except (OSError, StateCorruptionError) as e:
        log.warning("published image %s of %s not used: %s", path, p, e)
        p.files.drop_images([delta.name])
        return None
    try:
        if reader.store_version != version or reader.commit_id != commit_id:
            raise StateCorruptionError(path, None, f"it holds version {reader.store_version} "
                                                   f"({reader.commit_id.hex()}), not {version} ({commit_id.hex()})")
        reader.verify(index=False)  # every checksum: rows and slots
    except StateCorruptionError as e:
        reader.close()
        log.warning("published image %s of %s not used: %s", path, p, e)
        p.files.drop_images([delta.name])
        return None
    log.info("version %d of %s mapped from the image another process published", version, p)
    # A whole spill, as it was where it was written: the next spill takes it in (and is
    # whole, and published in turn) as it would take in this provider's own.
    whole = Spill(reader, None, None, version, commit_id, reader.row_count)
    return State(p.key_schema, p.value_schema, whole, version, commit_id, reader.row_count, p.held.changes)


def _open_snapshot(p, f, commit_id):
    """A State over snapshot ``f``, in the provider's schemas. A snapshot written under older
    ones (it records its own) is read in place through a ConvertedImage when one plan leads
    from them (keeping the keys' bytes, or widening int and bytes key fields), else converted
    whole, once (``docs/evolution.md``)."""
    path = p.files.path(f.name)
    reader = open_snapshot(p.files, f.name)
    try:
        check_names_agree(f, path, reader.store_version, reader.commit_id)
        if reader.commit_id != commit_id:
            raise StateCorruptionError(path, None, f"the snapshot is of commit {reader.commit_id.hex()}, "
                                                   f"expected {commit_id.hex()}")
        schemas = (reader.key_schema, reader.value_schema)
        plans = p.schema_plans([s.fingerprint for s in schemas], [s.width for s in schemas], f.version, path)
    except BaseException:
        reader.close()
        raise
    if not plans:
        return State(p.key_schema, p.value_schema, reader, f.version, commit_id, reader.row_count, p.held.changes)
    keys = _key_converter(p, plans)
    if keys is not False:  # read in place, each row converted as it is read
        image = ConvertedImage(reader, RowConverter(plans[0].value), p.key_schema, p.value_schema, keys=keys)
        log.info("version %d of %s read from its snapshot of %s, each row converted as it is read", f.version, p,
                 f"key schema {reader.key_schema.describe()}, value schema {reader.value_schema.describe()}"
                 if keys is not None else f"value schema {reader.value_schema.describe()}")
        return State(p.key_schema, p.value_schema, image, f.version, commit_id, reader.row_count, p.held.changes)
    state = State(reader.key_schema, reader.value_schema, reader, f.version, commit_id, reader.row_count,
                  p.held.changes)
    return _converted_state(p, state, plans)


def _key_converter(p, plans):
    """How a snapshot that ``plans`` lead from can be read in place: None (its keys as they are),
    an invertible RowConverter of its keys (a re-key of int and bytes key fields, each new key
    narrowed back to probe the snapshot), or False (it cannot: two recorded changes, or a key
    of floats or bools, whose new rows would need normalizing)."""
    if len(plans) != 1:
        return False
    if not plans[0].rekeys:
        return None
    if p.key_schema.normalizes:
        return False
    keys = RowConverter(plans[0].key)
    return keys if keys.invertible else False


def _converted_state(p, state, plans):
    """A State of ``state``'s version in the provider's schemas: every row converted by
    ``plans`` (:meth:`FileStateStoreProvider.schema_plans`), a chunk at a time, into a whole
    spill (a local image of the version, as maintenance writes one), which the State stands on."""
    version = state.version
    commit_id, count = state.commit_ids[version], state.count(version)
    key_width = state.key_schema.width
    chunks = (join_rows(*_converted_rows(plans, chunk[:, :key_width], chunk[:, key_width:]))
              for chunk in state.iter_rows(version))
    whole = spill_rows(spill_file_maker(p.files, version), p.key_schema, p.value_schema, version, commit_id, chunks,
                       count)
    log.info("version %d of %s converted to its schemas from key %s, value %s (%d keys)", version, p,
             state.key_schema.describe(), state.value_schema.describe(), count)
    return State(p.key_schema, p.value_schema, whole, version, commit_id, count, p.held.changes)


def _converted_rows(plans, keys, values):
    for plan in plans:
        keys, values = plan.convert(keys, values)
    return keys, values


def _converted_blocks(plans, blocks):
    """A delta's ``(kind, keys, values)`` blocks converted by ``plans``."""
    out = []
    for kind, keys, values in blocks:
        if kind == BLOCK_PUTS:
            out.append((kind, *_converted_rows(plans, keys, values)))
        else:
            for plan in plans:
                keys = convert(plan.key, keys)
            out.append((kind, keys, values))
    return out


def read_checked_delta(p, f, parent_id=None):
    """``(commit id, blocks, key count)`` of the delta file ``f`` of provider ``p``, read whole
    and verified to its trailer before any row is used (the key count of its version is None
    when the file does not record it); its header must agree with its name and, given
    ``parent_id``, follow that attempt of the version before."""
    path = p.files.path(f.name)
    own_id, read_parent, blocks, count = _read_delta(p, f)
    if parent_id is not None and read_parent != parent_id:
        raise StateCorruptionError(path, None, f"delta of version {f.version} does not follow the "
                                               f"version {f.version - 1} it is read on (a file of another run)")
    return own_id, blocks, count


def _read_delta(p, f):
    """``(commit id, parent id, blocks, key count)`` of the delta file ``f``, read whole and
    checked; its header must agree with its name. Its rows come in the provider's schemas: a
    delta written under older ones (its header names them) is converted."""
    path = p.files.path(f.name)
    with p.files.open_whole(f.name) as source:
        reader = DeltaReader(source, None, None, path=path)
        h = reader.header
        plans = p.schema_plans((h.key_fingerprint, h.value_fingerprint), (h.key_width, h.value_width), f.version,
                               path)
        check_names_agree(f, path, reader.store_version, reader.commit_id)
        blocks = list(reader)
        if plans:
            blocks = _converted_blocks(plans, blocks)
        return reader.commit_id, reader.parent_id, blocks, reader.num_keys


def checked_deltas(p, steps, parent_id):
    """``(version, commit id, blocks, key count)`` of the delta files of ``steps``
    (``(version, file)``, newest first), oldest first: each read and checked whole,
    following the one before it (the first follows ``parent_id``)."""
    for u, f in reversed(steps):
        own_id, blocks, count = read_checked_delta(p, f, parent_id=parent_id)
        yield u, own_id, blocks, count
        parent_id = own_id


def _replay(p, state, steps):
    _replay_deltas(state, checked_deltas(p, steps, state.commit_ids[state.version]))
    return state


def _replay_deltas(state, deltas, drop_older=False):
    """Replay ``deltas`` (as :func:`checked_deltas` yields them) into ``state``'s head,
    each becoming its newest version with the key count its file records (or an unknown
    one). ``drop_older``: first forget the versions ``state`` held before its newest,
    which the replay makes unreadable."""
    if drop_older:
        state.retain(state.version)
    for u, own_id, blocks, count in deltas:
        for kind, keys, values in blocks:
            state.replay(kind == BLOCK_PUTS, keys, values)
        state.advance(u, own_id, count)


# -- rolling the newest State forward ------------------------------------------------------
def deltas_to_roll_forward(p, latest, version, commit_id, listing):
    """The checked deltas (as :func:`checked_deltas` yields them) that reach ``version``
    (attempt ``commit_id``) from ``latest``, the newest State held, or None when a load from
    files is the better way: another lineage, a snapshot or published image newer than the
    version held (fewer deltas to replay from it), or a delta cleaned up meanwhile. Each delta
    is checked whole and must follow the one before."""
    start, start_id = latest.version, latest.commit_ids[latest.version]
    steps = []  # (version, delta file) from `version` down to start + 1
    for u, cid, delta, snapshot in p.chain(listing).walk(version, commit_id):
        if u == start:
            if cid != start_id:
                return None
            break
        if snapshot is not None or delta is None or has_published_image(p, delta):
            return None  # a load from that snapshot or image replays fewer deltas
        steps.append((u, delta))
    try:
        return list(checked_deltas(p, steps, start_id))
    except FileNotFoundError:
        return None  # cleaned up meanwhile: the load lists again


def deltas_by_name(p, latest, version, commit_id):
    """The checked deltas (as :func:`checked_deltas` yields them) that reach attempt
    ``commit_id`` of ``version`` from ``latest``, the newest State held, found without a
    listing: each read whole under its name (``<u>_<id>.delta``), its header naming the
    attempt below. None when the chain does not reach ``latest``'s attempt, a file of it is
    missing, or a whole image of one is published on this machine (a listed open finds the
    better way); the caller bounds how many versions apart they may be."""
    start_id = latest.commit_ids[latest.version]
    found = []
    u, cid = version, commit_id
    while u > latest.version:
        f = VersionFile(u, cid, "delta", file_name(u, cid, "delta"))
        if has_published_image(p, f):
            return None
        try:
            own_id, parent_id, blocks, count = _read_delta(p, f)
        except (FileNotFoundError, StateCorruptionError) as e:  # a listed open decides (a snapshot?)
            log.info("version %d of %s not reached by name from version %d in memory: %s",
                     version, p, latest.version, e)
            return None
        found.append((u, own_id, blocks, count))
        u, cid = u - 1, parent_id
    return found[::-1] if cid == start_id else None


def roll_newest_forward(p, latest, deltas, version):
    """The State holding ``version`` once ``deltas`` (:func:`deltas_to_roll_forward`) are in
    ``latest``, the newest State held, and whether they were replayed (not merged); None when
    a damaged block of the base stops the merge (what merged whole stays the newest).
    REQUIRES: p.held.lock held, ``latest`` still the newest and not pending.

    When nobody reads ``latest`` (``HeldVersions.unread``) and every delta records its
    version's key count, the deltas are replayed into its head as a load replays them: no
    lookups, and the versions held before are dropped. Otherwise each is merged as a commit
    is (its undo kept), so the versions held before stay readable. A delta holds each key
    once, its removes and puts disjoint (only a commit's update layer writes one)."""
    held, start = p.held, latest.version
    if held.unread(latest) and all(count is not None for *_, count in deltas):
        try:
            _replay_deltas(latest, deltas, drop_older=True)
        except BaseException:
            held.newest = None  # replayed in part: load from files next time
            raise
        return latest, True
    state = held.state_to_merge_into(latest, start, latest.commit_ids[start])
    try:
        for _, own_id, blocks, _ in deltas:
            _merge_delta(held, state, own_id, blocks)
    except StateCorruptionError as e:  # a damaged block of the base, found by a lookup
        log.warning("version %d of %s not reached from version %d in memory: %s; loading it from "
                    "files", version, p, start, e)
        if state.version > start:  # merged whole up to there: a consistent state
            held.newest = state
        return None
    return state, False


@requires_lock
def _merge_delta(held, state, commit_id, blocks):
    """Merge one checked delta's blocks as the next version of ``state``. REQUIRES:
    held.lock held. The prior values are looked up first: a lookup that raises leaves
    ``state`` as it was. Removes of keys absent here change nothing and are left out."""
    key_width, value_width = state.key_schema.width, state.value_schema.width
    put_keys = _rows_of([keys for kind, keys, _ in blocks if kind == BLOCK_PUTS], key_width)
    put_values = _rows_of([values for kind, _, values in blocks if kind == BLOCK_PUTS], value_width)
    del_keys = _rows_of([keys for kind, keys, _ in blocks if kind != BLOCK_PUTS], key_width)
    put_prior = state.lookup(state.version, put_keys)
    del_values, del_found = state.lookup(state.version, del_keys)
    if not del_found.all():
        del_keys, del_values = take_rows(del_keys, del_found), take_rows(del_values, del_found)
    state.merge(put_keys, put_values, del_keys, commit_id, put_prior=put_prior, del_prior=del_values)


def _rows_of(parts, width):
    """One (n, width) uint8 array of the row arrays ``parts`` (empty when there are none)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty((0, width), dtype=np.uint8)
    return np.concatenate(parts)
