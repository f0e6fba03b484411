"""Whole versions read once, and the change feed: both from the files and the lineage alone
(nothing held in memory is built or changed), for readers that visit each row or change once."""
import numpy as np

from statecore import loading
from statecore._delta import BLOCK_PUTS
from statecore.errors import VersionNotFoundError
from statecore.lineage import ROOT_COMMIT_ID, file_name

__all__ = ["version_rows", "changes"]


def version_rows(p, version, commit_id=None, rows_per_batch=1 << 20):
    """``FileStateStoreProvider.version_rows`` of provider ``p``: ``(keys, values)`` batches
    of every row of ``version``. A version that is the delta of version 1 alone is read
    straight from it (checked to its trailer, then its puts: a delta holds each key once),
    without building it in memory; any other goes through a read-only store."""
    if not isinstance(rows_per_batch, int) or rows_per_batch <= 0:
        raise ValueError(f"rows_per_batch must be an int > 0, got {rows_per_batch!r}")
    listing = p.files.list_versions()
    target = p.resolve(version, commit_id, listing)
    chain = p.chain(listing)
    delta = chain.find("delta", 1, target) if version == 1 else None
    if delta is not None and chain.find("snapshot", 1, target) is None:
        _, blocks, _ = loading.read_checked_delta(p, delta, parent_id=ROOT_COMMIT_ID)
        for kind, keys, values in blocks:
            if kind == BLOCK_PUTS:
                for start in range(0, keys.shape[0], rows_per_batch):
                    stop = start + rows_per_batch
                    yield (p.key_schema.from_rows(np.ascontiguousarray(keys[start:stop])),
                           p.value_schema.from_rows(np.ascontiguousarray(values[start:stop])))
        return
    store = p.get_read_store(version, target)
    try:
        yield from store.iter_batches(rows_per_batch)
    finally:
        store.abort()


def changes(p, start_version, end_version, commit_id=None):
    """``FileStateStoreProvider.changes`` of provider ``p``: ``(version, is_put, keys, values)``
    of each version from ``start_version`` to ``end_version``, oldest first, each read from its
    delta alone and checked to its trailer before its rows are yielded."""
    for name, v in (("start_version", start_version), ("end_version", end_version)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if start_version > end_version:
        raise ValueError(f"start_version {start_version} is after end_version {end_version}")
    listing = p.files.list_versions()
    target = p.resolve(end_version, commit_id, listing)
    steps = []
    for u, cid, delta, _ in p.chain(listing).walk(end_version, target):
        if u < start_version:
            break
        if delta is None:
            path = p.files.path(file_name(u, cid, "delta"))
            raise VersionNotFoundError(
                f"the change of version {u} of {p} is not retained: {path} does not exist (deltas older "
                f"than the retained snapshots are deleted by maintenance)")
        steps.append((u, delta))
    for u, f in reversed(steps):
        _, blocks, _ = loading.read_checked_delta(p, f)
        for kind, keys, values in blocks:
            if kind == BLOCK_PUTS:
                yield u, True, p.key_schema.from_rows(keys), p.value_schema.from_rows(values)
            else:
                yield u, False, p.key_schema.from_rows(keys), None
