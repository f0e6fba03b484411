"""The small JSON logs the drivers keep in a checkpoint, one file per epoch or batch id.

:class:`EpochLog` holds continuous mode's offsets and commits logs and its sink's commits
(:mod:`pyspark_glue.continuous`), and :class:`~pyspark_glue.StatefulOperator`'s batch records
(:mod:`pyspark_glue.operator`). Each log lives in its own module's layout; this one only
writes, reads, lists and deletes the files, and checks the commit ids they record.
"""
import json

import fsspec

from statecore.files import open_store_files
from statecore.lineage import parse_commit_id

__all__ = ["EpochLog", "checked_commit_ids"]


def _json_bytes(value):
    return json.dumps(value, sort_keys=True).encode()


class EpochLog:
    """A directory of small JSON files named by epoch or batch id (``<location>/<n>``), each
    written atomically (temporary name, then rename). Listing ignores anything whose name
    is not all digits (temporaries)."""

    def __init__(self, location, storage_options=None):
        self.location = location
        self.files = open_store_files(location, storage_options)
        self._fs, self._root = fsspec.core.url_to_fs(location, **(storage_options or {}))

    def write(self, epoch, value):
        payload = _json_bytes(value)
        self.files.write_atomic(str(epoch), lambda f: f.write(payload))

    def read(self, epoch):
        """The entry of ``epoch``; FileNotFoundError if there is none, ValueError naming the
        file if it is not JSON."""
        raw = self.files.read_bytes(str(epoch))
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"unreadable log entry {self.files.path(str(epoch))}: {e}") from None

    def path(self, epoch):
        return self.files.path(str(epoch))

    def epochs(self):
        """The epochs with an entry, ascending."""
        self._fs.invalidate_cache(self._root)
        try:
            names = self._fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        found = (n.rstrip("/").rsplit("/", 1)[-1] for n in names)
        return sorted(int(n) for n in found if n.isascii() and n.isdigit())

    def latest(self):
        """The newest epoch with an entry, or None."""
        epochs = self.epochs()
        return epochs[-1] if epochs else None

    def delete(self, epochs):
        self.files.delete([str(e) for e in epochs])

    def delete_after(self, epoch):
        self.delete([e for e in self.epochs() if e > epoch])

    def delete_before(self, epoch):
        self.delete([e for e in self.epochs() if e < epoch])


def checked_commit_ids(ids, num_partitions, where):
    """``ids`` (a log entry's per-partition commit ids) as a tuple of 16-hex-digit strings,
    one per partition; ValueError naming ``where`` if it is anything else."""
    if not isinstance(ids, (list, tuple)) or len(ids) != num_partitions:
        raise ValueError(f"{where}: expected {num_partitions} commit ids (one per partition), got {ids!r:.200}")
    try:
        return tuple(parse_commit_id(i).hex() for i in ids)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
