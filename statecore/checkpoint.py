"""The files beside the stores in a checkpoint: :class:`CheckpointFiles`, the one helper for
every file the operator and continuous mode keep beside their stores (metadata, outputs, batch
records, offsets and commits logs, sink files), and :class:`EpochLog`, a directory of JSON
files named by epoch or batch id, on top of it.

Files are written, read and deleted through statecore's ``StoreFiles``
(:func:`statecore.files.open_store_files`): the same atomic writes (temporary name, fsync,
rename) and name checks as the stores' own files, and the one place tests inject file
faults. ``StoreFiles`` lists only a store's version files and deletes only files, so
listing a directory's entries and deleting whole sub-directories (a batch's output, an
epoch's sink files) is done here with fsspec, and nowhere else. The glue writes these files;
the ``statecore`` command reads them without Spark.
"""
import json
import logging

import fsspec
from fsspec.implementations.local import LocalFileSystem

from statecore.files import open_store_files
from statecore.lineage import parse_commit_id

__all__ = ["CheckpointFiles", "EpochLog", "checked_commit_ids"]

log = logging.getLogger(__name__)


class CheckpointFiles:
    """The files and sub-directories of one checkpoint directory, on any fsspec filesystem.
    Names are relative to the directory and use ``/``."""

    def __init__(self, location, storage_options=None, local_cache_dir=None):
        self.location = location
        self.storage_options = dict(storage_options or {})
        self._files = open_store_files(location, self.storage_options, local_cache_dir)
        self._fs, root = fsspec.core.url_to_fs(location, **self.storage_options)
        self._root = root.rstrip("/") or "/"

    def path(self, name):
        """The full path or URL of ``name``, for messages and for readers."""
        return self._files.path(name)

    def spark_url(self):
        """The directory as Spark's readers take it (``file://`` and the absolute path when local)."""
        if isinstance(self._fs, LocalFileSystem):
            return f"file://{self._root}"
        return self._fs.unstrip_protocol(self._root)

    # -- files --------------------------------------------------------------------------------

    def write_atomic(self, name, write, overwrite=True):
        """Write ``name`` whole or not at all: ``write(fileobj)`` fills a temporary file, which
        is then renamed. ``overwrite=False``: FileExistsError if ``name`` exists."""
        return self._files.write_atomic(name, write, overwrite=overwrite)

    def write_json(self, name, value, overwrite=True, indent=None):
        payload = json.dumps(value, sort_keys=True, indent=indent, default=str).encode()
        return self.write_atomic(name, lambda f: f.write(payload), overwrite=overwrite)

    def read_json(self, name, what="file"):
        """The JSON value of ``name``; FileNotFoundError if there is none, ValueError naming the
        file (as ``what``) if it is not JSON."""
        raw = self._files.read_bytes(name)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"unreadable {what} {self.path(name)}: {e}") from None

    def record_once(self, name, value, what="file"):
        """Write ``value`` as JSON to ``name`` unless the file exists; return what the file
        holds (``value``, or what an earlier writer recorded)."""
        try:
            self.write_json(name, value, overwrite=False, indent=1)
            return value
        except FileExistsError:
            return self.read_json(name, what)

    def open_read(self, name):
        return self._files.open_read(name)

    def delete(self, names):
        """Delete files, best effort (missing ones skipped, failures logged)."""
        return self._files.delete(names)

    # -- the directory ------------------------------------------------------------------------

    def entries(self):
        """``(name, is_dir)`` of every entry of the directory, sorted; none if it is missing.
        Listed afresh (a filesystem's listing cache would hide other processes' files)."""
        self._fs.invalidate_cache(self._root)
        try:
            found = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return []
        return sorted((e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type") == "directory") for e in found)

    def numbered(self, prefix=""):
        """``{n: name}`` of the entries named ``<prefix><n>`` (``n`` all ASCII digits);
        temporaries and other names are left out."""
        out = {}
        for name, _is_dir in self.entries():
            digits = name[len(prefix):]
            if name.startswith(prefix) and digits.isascii() and digits.isdigit():
                out[int(digits)] = name
        return out

    def delete_trees(self, names):
        """Delete entries and everything under them, best effort (failures logged)."""
        for name in names:
            full = f"{self._root}/{name}"
            try:
                self._fs.rm(full, recursive=True)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not delete %s: %s", self.path(name), e)
        self._fs.invalidate_cache(self._root)


class EpochLog:
    """A directory of small JSON files named by epoch or batch id (``<location>/<n>``), each
    written atomically. Continuous mode's offsets and commits logs, its sink's commits and
    the operator's batch records are EpochLogs."""

    def __init__(self, location, storage_options=None):
        self.location = location
        self.files = CheckpointFiles(location, storage_options)

    def write(self, epoch, value):
        self.files.write_json(str(epoch), value)

    def read(self, epoch):
        """The entry of ``epoch``; FileNotFoundError if there is none, ValueError naming the
        file if it is not JSON."""
        return self.files.read_json(str(epoch), "log entry")

    def path(self, epoch):
        return self.files.path(str(epoch))

    def epochs(self):
        """The epochs with an entry, ascending."""
        return sorted(self.files.numbered())

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
    """``ids`` (a record's per-partition commit ids) as a tuple of 16-hex-digit strings, one
    per partition; ValueError naming ``where`` if it is anything else."""
    if not isinstance(ids, (list, tuple)) or len(ids) != num_partitions:
        raise ValueError(f"{where}: expected {num_partitions} commit ids (one per partition), got {ids!r:.200}")
    try:
        return tuple(parse_commit_id(i).hex() for i in ids)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
