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

Every metadata JSON file goes through :meth:`CheckpointFiles.write_json` and
:meth:`CheckpointFiles.read_json`: the writer appends a checksum of the file's bytes as its
last member, the reader refuses a file larger than its kind allows, nested deeper than
:data:`MAX_JSON_DEPTH`, or whose bytes do not match its checksum (``docs/formats.md``,
"Metadata files").
"""
import json
import logging
import re

import fsspec
from fsspec.implementations.local import LocalFileSystem

from statecore._hash import xxh64_digest
from statecore.errors import DamagedMetadataError
from statecore.files import open_store_files
from statecore.lineage import parse_commit_id

__all__ = ["CheckpointFiles", "EpochLog", "checked_commit_ids", "checked_partition_count", "parse_json", "json_bytes",
           "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_PARTITIONS", "CHECKSUM_FIELD"]

log = logging.getLogger(__name__)

#: The most partitions an operator or a query may have: every count of partitions read from a
#: file or an argument is checked against it before it sizes a loop or a list.
MAX_PARTITIONS = 100_000
#: The largest metadata JSON file read: a batch record of MAX_PARTITIONS partitions holds two
#: lists of 16-hex-digit commit ids (about 22 bytes an id as written) and one more per other
#: store, so this leaves room for a dozen stores; an operator's metadata holds one such record
#: after a repartition.
MAX_JSON_BYTES = 32 << 20
#: The deepest nesting of lists and objects a metadata file may have (the formats need 4).
MAX_JSON_DEPTH = 32
#: The last member of every metadata JSON file statecore writes: the XXH64 (16 hex digits) of
#: the file's bytes before that member.
CHECKSUM_FIELD = "checksum"
# The member as the writer puts it, compact or indented, and the newline that ends the file.
_CHECKSUM_TAIL = re.compile(rb'(?:, "checksum": "([0-9a-f]{16})"\}|,\n *"checksum": "([0-9a-f]{16})"\n\})\n\Z')


def json_bytes(value, indent):
    """The bytes of ``value`` (a non-empty dict) as JSON, its checksum the last member."""
    if not isinstance(value, dict) or not value or CHECKSUM_FIELD in value:
        raise TypeError(f"a metadata file holds a non-empty JSON object without a {CHECKSUM_FIELD!r} member, "
                        f"got {type(value).__name__} {value!r:.100}")
    payload = json.dumps(value, sort_keys=True, indent=indent, default=str).encode()
    body = payload[:-1].rstrip()  # without the closing brace (and the newline before it)
    digest = f"{xxh64_digest(body):016x}".encode()
    if indent is None:
        return body + b', "checksum": "' + digest + b'"}\n'
    return body + b',\n' + b' ' * (indent if isinstance(indent, int) else len(indent)) \
        + b'"checksum": "' + digest + b'"\n}\n'


def _depth(value):
    """The nesting depth of a parsed JSON value (a scalar is 0), counted up to MAX_JSON_DEPTH + 1."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
            stack.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(raw, path, what="file"):
    """The JSON value of a metadata file's bytes ``raw`` (its checksum member checked and left
    out). DamagedMetadataError naming ``path``, the byte offset where known, and what is wrong,
    if the bytes are not UTF-8 JSON, nest deeper than :data:`MAX_JSON_DEPTH`, or do not match
    their checksum. A file without the checksum member and the newline after it, as statecore
    wrote them before, is read unchecked; one with either is checked."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedMetadataError(path, e.start, f"the {what} is not UTF-8 text ({e.reason})") from None
    too_deep = f"the {what} nests lists and objects deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedMetadataError(path, len(text[:e.pos].encode()), f"the {what} is not JSON: {e.msg}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DamagedMetadataError(path, None, f"the {what} is not JSON statecore reads: {e}") from None
    except RecursionError:
        raise DamagedMetadataError(path, None, too_deep) from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise DamagedMetadataError(path, None, too_deep)
    if not raw.endswith(b"\n") and not (isinstance(value, dict) and CHECKSUM_FIELD in value):
        return value  # written before files carried a checksum
    tail = _CHECKSUM_TAIL.search(raw)
    recorded = tail and (tail.group(1) or tail.group(2)).decode()
    if not tail or not isinstance(value, dict) or value.get(CHECKSUM_FIELD) != recorded:
        raise DamagedMetadataError(path, None, f"the {what} does not end with its {CHECKSUM_FIELD!r} member as "
                                               f"statecore writes it: the end of the file is damaged")
    actual = f"{xxh64_digest(raw[:tail.start()]):016x}"
    if actual != recorded:
        raise DamagedMetadataError(path, None, f"the {what}'s bytes do not match its checksum (recorded "
                                               f"{recorded}, computed {actual}): the file is damaged")
    del value[CHECKSUM_FIELD]
    return value


def checked_partition_count(count, where, what="num_partitions"):
    """``count`` if it is an int in ``[1, MAX_PARTITIONS]``; ValueError naming ``where`` otherwise."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PARTITIONS:
        raise ValueError(f"{where}: {what} {count!r:.40} is not a number of partitions from 1 to {MAX_PARTITIONS}")
    return count


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

    @property
    def is_local(self):
        """True on the local filesystem (plain paths and ``file://``)."""
        return isinstance(self._fs, LocalFileSystem)

    def spark_url(self):
        """The directory as Spark's readers take it (``file://`` and the absolute path when local)."""
        if self.is_local:
            return f"file://{self._root}"
        return self._fs.unstrip_protocol(self._root)

    # -- files --------------------------------------------------------------------------------

    def write_atomic(self, name, write, overwrite=True):
        """Write ``name`` whole or not at all: ``write(fileobj)`` fills a temporary file, which
        is then renamed. ``overwrite=False``: FileExistsError if ``name`` exists."""
        return self._files.write_atomic(name, write, overwrite=overwrite)

    def write_json(self, name, value, overwrite=True, indent=None):
        """Write ``value`` (a non-empty dict) atomically as JSON with its checksum member; the
        bytes written."""
        payload = json_bytes(value, indent)
        self.write_atomic(name, lambda f: f.write(payload), overwrite=overwrite)
        return payload

    def read_bytes(self, name, max_bytes=MAX_JSON_BYTES):
        """The bytes of ``name``, refused before reading (UnsafeFileError, a ValueError) unless
        it is a regular file of at most ``max_bytes``; FileNotFoundError if there is none."""
        return self._files.read_bytes(name, max_bytes=max_bytes)

    def read_json(self, name, what="file", max_bytes=MAX_JSON_BYTES):
        """The JSON value of ``name`` (checked by :func:`parse_json`); FileNotFoundError if there
        is none, UnsafeFileError if it is not a regular file of at most ``max_bytes``,
        DamagedMetadataError (both ValueErrors) naming the file (as ``what``) if it is damaged."""
        return parse_json(self.read_bytes(name, max_bytes), self.path(name), what)

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

    def temporary_files(self):
        """The temporary files (``.<name>.<uuid>.tmp``) of writes not renamed into place: what
        a writer killed in mid-write left, or one writing now. Only a caller that holds the
        lock every writer of the directory holds may take them for the first."""
        return self._files.temporary_files(0)

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
        """Write the entry of ``epoch``; the bytes written."""
        return self.files.write_json(str(epoch), value)

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
    checked_partition_count(num_partitions, where)
    if not isinstance(ids, (list, tuple)) or len(ids) != num_partitions:
        raise ValueError(f"{where}: expected {num_partitions} commit ids (one per partition), got {ids!r:.200}")
    try:
        return tuple(parse_commit_id(i).hex() for i in ids)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
