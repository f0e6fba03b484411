"""A continuous query's checkpoint beside its stores: ``metadata`` (fixed for the checkpoint's
life), the offsets log ``offsets/<e>`` and the commits log ``commits/<e>``. The driver writes
them as epochs commit and reads them at every (re)start. Layout and rules:
``docs/continuous.md`` ("Checkpoint layout") and ``docs/lineage.md``.
"""
import time
import uuid

from statecore.errors import SchemaMismatchError
from statecore.lineage import ROOT_COMMIT_ID
from statecore.checkpoint import CheckpointFiles, EpochLog, checked_commit_ids


__all__ = ["QueryLogs", "EpochLog", "STATE_DIR", "OPERATOR_ID", "OFFSETS_DIR", "COMMITS_DIR", "METADATA_FILE"]

STATE_DIR = "state"  # <checkpoint>/state/<OPERATOR_ID>/<partition>: the stores
OPERATOR_ID = 0
OFFSETS_DIR = "offsets"
COMMITS_DIR = "commits"
METADATA_FILE = "metadata"
FORMAT = "statecore-continuous-1"


class QueryLogs:
    """The metadata, offsets log and commits log of the checkpoint at ``location``."""

    def __init__(self, location, storage_options=None):
        self.location = location
        self.files = CheckpointFiles(location, storage_options)
        self.offsets = EpochLog(f"{location}/{OFFSETS_DIR}", storage_options)
        self.commits = EpochLog(f"{location}/{COMMITS_DIR}", storage_options)

    def check_metadata(self, num_partitions, store_name, key_schema, value_schema, source):
        """Record the query's metadata on first use, or check it against what was recorded
        (ValueError; SchemaMismatchError for the schemas). Returns the query's id."""
        ours = {"format": FORMAT, "id": str(uuid.uuid4()), "num_partitions": num_partitions,
                "store_name": store_name, "key_schema": key_schema.describe(),
                "value_schema": value_schema.describe(), "source": source.describe()}
        recorded = self.files.record_once(METADATA_FILE, ours, "continuous query metadata")
        if recorded is ours:
            return ours["id"]
        where = self.files.path(METADATA_FILE)
        if recorded.get("format") != FORMAT:
            raise ValueError(f"{where} is not the metadata of a statecore continuous query "
                             f"(format {recorded.get('format')!r})")
        if recorded.get("num_partitions") != num_partitions:
            raise ValueError(f"the checkpoint {self.location} was written with a source of "
                             f"{recorded.get('num_partitions')} partitions, this one has {num_partitions}: "
                             f"the partitions are fixed for the life of a checkpoint (each keeps its own state "
                             f"and offsets) ({where})")
        if recorded.get("store_name") != store_name:
            raise ValueError(f"the checkpoint {self.location} uses store name {recorded.get('store_name')!r}, "
                             f"not {store_name!r} ({where})")
        for part in ("key_schema", "value_schema"):
            if [list(f) for f in recorded.get(part, [])] != [list(f) for f in ours[part]]:
                raise SchemaMismatchError(f"the {part.replace('_', ' ')} {ours[part]} differs from the one the "
                                          f"checkpoint was written with: {recorded.get(part)} ({where})")
        return recorded["id"]

    def committed(self, source, num_partitions):
        """``(epoch, offsets, commit_ids)`` of the newest committed epoch (0, the source's initial
        offsets and the empty state's ids when none is): where a run starts."""
        epoch = self.commits.latest() or 0
        if not epoch:
            initial = [source.initial_offset(p) for p in range(num_partitions)]
            return 0, initial, (ROOT_COMMIT_ID.hex(),) * num_partitions
        offsets = self.offsets.read(epoch)["offsets"]
        if len(offsets) != num_partitions:
            raise ValueError(f"offsets log entry {self.offsets.path(epoch)} has {len(offsets)} offsets for "
                             f"{num_partitions} partitions")
        ids = self.commits.read(epoch).get("commit_ids")
        if ids is not None:  # None: written before ids were recorded (the default lineage)
            ids = checked_commit_ids(ids, num_partitions, self.commits.path(epoch))
        return epoch, offsets, ids

    def discard_after(self, epoch, to_retain):
        """At a restart from ``epoch``: drop the offsets of uncommitted epochs, and entries
        older than the newest ``to_retain``."""
        self.offsets.delete_after(epoch)
        self.offsets.delete_before(epoch - to_retain + 1)
        self.commits.delete_before(epoch - to_retain + 1)

    def write_offsets(self, epoch, offsets, run_id):
        self.offsets.write(epoch, {"epoch": epoch, "offsets": offsets, "run_id": str(run_id),
                                   "timestamp_ms": int(time.time() * 1e3)})

    def write_commit(self, epoch, run_id, commit_ids, to_retain):
        """Commit ``epoch`` (its partitions' commit ids, in partition order), then drop the
        entries that fell out of the newest ``to_retain``."""
        self.commits.write(epoch, {"epoch": epoch, "run_id": str(run_id), "commit_ids": list(commit_ids),
                                   "timestamp_ms": int(time.time() * 1e3)})
        old = epoch - to_retain
        if old >= 1:
            self.offsets.delete([old])
            self.commits.delete([old])
