"""Local copies of remote state files, so that snapshots on any filesystem can be memory-mapped.

A snapshot is probed in place through a memory map, which needs a local file. On a
filesystem that is not local, :class:`statecore.files.StoreFiles` maps a copy kept in the
``local_cache_dir`` by :class:`LocalCache`: copied once (to a temporary name, fsynced, then
renamed), reused while the source keeps its size and version, replaced when the source is
re-written, dropped when the source is deleted.

Thread-safety: threads and processes may share one cache directory: every copy appears by
an atomic rename, and within a process one thread at a time copies a given file.
"""
import errno
import hashlib
import json
import os
import threading
import uuid

from fsspec.utils import tokenize

__all__ = ["LocalCache"]

# One copy at a time per cached file in this process (striped locks, a fixed number):
# threads mapping the same snapshot wait for the first copy instead of each downloading it.
_COPYING = tuple(threading.Lock() for _ in range(64))

# Keys of fsspec's info() that change when a file is re-written (which of them a
# filesystem gives varies: local and memory give mtime/created, S3 ETag and LastModified,
# GCS generation and crc32c, ...). They key the local cache together with the size.
_IDENTITY_KEYS = (
    "mtime", "created", "LastModified", "last_modified", "updated", "ETag", "etag",
    "VersionId", "version_id", "generation", "checksum", "md5Hash", "content_md5", "crc32c",
)


class LocalCache:
    """The local copies of files of one fsspec filesystem, in one local directory.

    A copy is named ``<source id>-<version id>-<file name>``: the source id names the file
    across filesystems, endpoints and storage options, the version id its size and the
    version keys fsspec reports (mtime, ETag, ...), so a re-written file gets a new copy.
    """

    def __init__(self, fs, storage_options, directory):
        self.fs = fs
        self.storage_options = storage_options
        self.directory = directory

    def copy_of(self, full, shown):
        """A local path holding the content of the file at ``full`` (``shown``: its path for
        messages); FileNotFoundError if it does not exist. Older copies of it are removed (a
        process that has mapped one keeps its pages)."""
        os.makedirs(self.directory, exist_ok=True)
        base = full.rsplit("/", 1)[1]
        # Sources change under a name only when a version is committed again; copying
        # while that happens yields a copy of the wrong size, so look again.
        for _ in range(3):
            self.fs.invalidate_cache(full)
            info = self.fs.info(full)
            size = info["size"]
            identity = _digest(json.dumps(
                [size] + [[k, str(info[k])] for k in _IDENTITY_KEYS if info.get(k) is not None]))
            cached = os.path.join(self.directory, f"{self._source_id(full)}-{identity[:16]}-{base}")
            with _COPYING[hash(cached) % len(_COPYING)]:
                if self._copy(full, cached, size):
                    return cached
        raise OSError(errno.EAGAIN, "file kept changing while it was copied", shown)

    def drop(self, full, keep=None):
        """Remove the copies of ``full`` other than ``keep`` (best effort)."""
        prefix = self._source_id(full) + "-"
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for n in names:
            p = os.path.join(self.directory, n)
            if n.startswith(prefix) and p != keep:
                _remove(p)

    def _copy(self, full, cached, size):
        """Make ``cached`` a whole copy of ``full`` (``size`` bytes), unless it is one already;
        False if the source did not have that size while it was copied."""
        try:
            if os.path.getsize(cached) == size:
                return True
        except FileNotFoundError:
            pass
        tmp = os.path.join(self.directory, f".{os.path.basename(cached)}.{uuid.uuid4().hex}.tmp")
        try:
            self.fs.get_file(full, tmp)
            if os.path.getsize(tmp) != size:
                os.unlink(tmp)
                return False
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # a copy torn by a power loss would read as corrupt
            finally:
                os.close(fd)
            os.replace(tmp, cached)
        except BaseException:
            _remove(tmp)
            raise
        self.drop(full, keep=cached)
        return True

    def _source_id(self, full):
        """Names one source file across filesystems and endpoints (part of cache names)."""
        fs_type = f"{type(self.fs).__module__}.{type(self.fs).__qualname__}"
        return _digest(f"{fs_type}\0{self.fs.unstrip_protocol(full)}\0"
                       f"{tokenize(self.storage_options)}")[:24]


def _digest(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _remove(path):
    """Best-effort cleanup: never masks the error being handled."""
    try:
        os.unlink(path)
    except OSError:
        pass
