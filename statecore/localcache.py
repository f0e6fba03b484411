"""Local files made from state files, so that snapshots on any filesystem can be memory-mapped.

A snapshot is probed in place through a memory map, which needs a local file holding its
image. :class:`LocalCache` keeps two kinds, both keyed by the source file and its version:
a *copy* of an image on a filesystem that is not local (in the ``local_cache_dir``), and the
*image* unpacked from a packed snapshot on any filesystem (in the ``local_cache_dir``, or
:func:`default_cache_dir`). Each is made once (to a temporary name, fsynced, then renamed),
reused while the source keeps its size and version, replaced when the source is re-written,
dropped when the source is deleted, and removed by a later process once nobody has used it
for a day (what a process that died left behind: :meth:`LocalCache.sweep_once`).

Thread-safety: threads and processes may share one cache directory: every copy appears by
an atomic rename, and within a process one thread at a time copies a given file.
"""
import errno
import hashlib
import json
import os
import stat
import tempfile
import threading
import time
import uuid

from fsspec.utils import tokenize

from statecore.errors import UnsafeFileError

__all__ = ["LocalCache", "default_cache_dir", "default_cache_dir_if_exists"]

# One copy at a time per cached file in this process (striped locks, a fixed number):
# threads mapping the same snapshot wait for the first copy instead of each downloading it.
_COPYING = tuple(threading.Lock() for _ in range(64))

# Keys of fsspec's info() that change when a file is re-written (which of them a
# filesystem gives varies: local and memory give mtime/created, S3 ETag and LastModified,
# GCS generation and crc32c, ...). They key the local cache together with the size.
_IDENTITY_KEYS = (
    "mtime", "created", "LastModified", "last_modified", "updated", "ETag", "etag",
    "VersionId", "version_id", "generation", "checksum", "md5Hash", "content_md5", "crc32c", "ino",
)


def _default_path():
    uid = os.getuid() if hasattr(os, "getuid") else None
    return os.path.join(tempfile.gettempdir(), f"statecore-{uid if uid is not None else 'cache'}"), uid


def default_cache_dir_if_exists():
    """:func:`default_cache_dir` if it was made already (by any process), else None."""
    path, _ = _default_path()
    if not os.path.isdir(path):
        return None
    try:
        return default_cache_dir()
    except OSError:  # not ours: no image of ours is there
        return None


def default_cache_dir():
    """The per-user cache directory used where no ``local_cache_dir`` is given:
    ``statecore-<uid>`` under :func:`tempfile.gettempdir`, private to its owner. OSError if it
    exists but belongs to someone else or others may write to it (images there are mapped)."""
    path, uid = _default_path()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid) or st.st_mode & 0o022:
        raise OSError(errno.EPERM, "the statecore cache directory is not a private directory of this user "
                                   "(give spark.statecore.localCacheDir instead)", path)
    return path


# A copy or image untouched this long is removed by the first cache use of a process.
UNUSED_FOR_S = 24 * 3600
_SWEPT = set()  # directories swept by this process
_SWEEP_LOCK = threading.Lock()


def _reusable(cached, size):
    """Whether ``cached`` is there whole (``size`` bytes); if so it is touched: in use, not
    swept."""
    try:
        if os.path.getsize(cached) != size:
            return False
        os.utime(cached)
    except OSError:
        return False
    return True


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

    def sweep_once(self):
        """Once per process and directory: remove what no one has used for
        :data:`UNUSED_FOR_S` (copies and images a dead process left, their sources deleted
        meanwhile, and abandoned temporary files). A process that has one mapped keeps its
        pages; one that wants it again makes it again. Best effort."""
        with _SWEEP_LOCK:
            if self.directory in _SWEPT:
                return
            _SWEPT.add(self.directory)
        horizon = time.time() - UNUSED_FOR_S
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        for e in entries:
            try:
                if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_mtime < horizon:
                    os.unlink(e.path)
            except OSError:
                pass

    def copy_of(self, full, shown):
        """A local path holding the content of the file at ``full`` (``shown``: its path for
        messages); FileNotFoundError if it does not exist. Older copies of it are removed (a
        process that has mapped one keeps its pages)."""
        os.makedirs(self.directory, exist_ok=True)
        self.sweep_once()
        base = full.rsplit("/", 1)[1]
        # Sources change under a name only when a version is committed again; copying
        # while that happens yields a copy of the wrong size, so look again.
        for _ in range(3):
            size, identity = self._identity(full, to_copy=True)
            cached = os.path.join(self.directory, f"{self._source_id(full)}-{identity[:16]}-{base}")
            with _COPYING[hash(cached) % len(_COPYING)]:
                if self._copy(full, cached, size):
                    return cached
        raise OSError(errno.EAGAIN, "file kept changing while it was copied", shown)

    def image_of(self, full, shown, size, make):
        """A local path holding the ``size``-byte image that ``make(tmp_path)`` writes from the
        file at ``full`` (``shown``: its path for messages): made once per version of the
        source, reused while the source is unchanged. FileNotFoundError if the source does
        not exist; what ``make`` raises (nothing is kept then). Older images of it are
        removed (a process that has mapped one keeps its pages)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.sweep_once()
        for _ in range(3):
            _, identity = self._identity(full)
            cached = self._image_path(full, identity)
            with _COPYING[hash(cached) % len(_COPYING)]:
                if _reusable(cached, size):
                    return cached
                tmp = self._tmp_name(cached)
                try:
                    make(tmp)
                    _fsync_file(tmp)  # an image torn by a power loss would read as corrupt
                    if self._identity(full)[1] != identity or os.path.getsize(tmp) != size:
                        _remove(tmp)  # the source was re-written meanwhile: look again
                        continue
                    os.replace(tmp, cached)
                except BaseException:
                    _remove(tmp)
                    raise
                self.drop([full], keep=cached)
                return cached
        raise OSError(errno.EAGAIN, "file kept changing while it was unpacked", shown)

    def adopt(self, full, path):
        """Make the local file ``path`` (in this cache's directory) the image of the file at
        ``full`` as it now is, by a rename (no copy; no fsync either: whoever maps it checks
        every block first); the cached path, which the caller removes when it is done with
        it (no listing of the directory here: a source that never changes has no older
        image). FileNotFoundError if the source does not exist."""
        _, identity = self._identity(full)
        cached = self._image_path(full, identity)
        os.replace(path, cached)
        return cached

    def find_image(self, full):
        """The cached image of the file at ``full`` as it now is (touched: in use), or None
        when there is none or the source does not exist."""
        try:
            _, identity = self._identity(full)
        except FileNotFoundError:
            return None
        cached = self._image_path(full, identity)
        try:
            os.utime(cached)
        except OSError:
            return None
        return cached

    def _image_path(self, full, identity):
        base = full.rsplit("/", 1)[1]
        return os.path.join(self.directory, f"{self._source_id(full)}-{identity[:16]}-{base}.image")

    def drop(self, fulls, keep=None):
        """Remove the copies and images of the files ``fulls`` other than ``keep`` (best effort)."""
        prefixes = tuple(self._source_id(full) + "-" for full in fulls)
        if not prefixes:
            return
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for n in names:
            p = os.path.join(self.directory, n)
            if n.startswith(prefixes) and p != keep:
                _remove(p)

    def _identity(self, full, to_copy=False):
        """``(size, digest)`` of the source's size and the version keys its filesystem reports;
        ``to_copy``: UnsafeFileError if it is not a file (a directory is never copied)."""
        self.fs.invalidate_cache(full)
        info = self.fs.info(full)
        if to_copy and info.get("type", "file") != "file":
            raise UnsafeFileError(self.fs.unstrip_protocol(full), f"it is a {info.get('type')}, not a file")
        size = info["size"]
        return size, _digest(json.dumps(
            [size] + [[k, str(info[k])] for k in _IDENTITY_KEYS if info.get(k) is not None]))

    def _tmp_name(self, cached):
        return os.path.join(self.directory, f".{os.path.basename(cached)}.{uuid.uuid4().hex}.tmp")

    def _copy(self, full, cached, size):
        """Make ``cached`` a whole copy of ``full`` (``size`` bytes), unless it is one already;
        False if the source did not have that size while it was copied."""
        if _reusable(cached, size):
            return True
        tmp = self._tmp_name(cached)
        try:
            self.fs.get_file(full, tmp)
            if os.path.getsize(tmp) != size:
                os.unlink(tmp)
                return False
            _fsync_file(tmp)  # a copy torn by a power loss would read as corrupt
            os.replace(tmp, cached)
        except BaseException:
            _remove(tmp)
            raise
        self.drop([full], keep=cached)
        return True

    def _source_id(self, full):
        """Names one source file across filesystems and endpoints (part of cache names)."""
        fs_type = f"{type(self.fs).__module__}.{type(self.fs).__qualname__}"
        return _digest(f"{fs_type}\0{self.fs.unstrip_protocol(full)}\0"
                       f"{tokenize(self.storage_options)}")[:24]


def _digest(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path):
    """Best-effort cleanup: never masks the error being handled."""
    try:
        os.unlink(path)
    except OSError:
        pass
