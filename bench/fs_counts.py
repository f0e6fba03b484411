"""Counting what the store asks of its filesystem, and what that costs on an object store.

:func:`counting_store_files` installs, in place of :func:`statecore.files.open_store_files`
(the store's one hook for its files), a ``StoreFiles`` on a local directory whose fsspec
filesystem is wrapped by :class:`CountingFS` and which takes the remote path (``is_local``
False): every listing, read, write, rename and delete then goes through fsspec calls, as
it does on S3, and each call is recorded with its size. :func:`object_store_requests` maps
the recorded calls to the requests an S3-like store would be sent (the mapping and its
sources are in ``docs/scale.md``).
"""
import collections
import contextlib
import math
import os

from statecore import files as files_module
from statecore.localcache import LocalCache

__all__ = ["CountingFS", "CallLog", "counting_store_files", "object_store_requests", "REQUEST_KINDS",
           "LIST_PAGE_KEYS"]

# fsspec calls that reach the storage; the others (invalidate_cache, unstrip_protocol, ...) are local.
COUNTED_CALLS = ("ls", "info", "exists", "size", "cat_file", "open", "mv", "rm_file", "makedirs", "get_file")
REQUEST_KINDS = ("LIST", "HEAD", "GET", "PUT", "COPY", "DELETE")
LIST_PAGE_KEYS = 1000  # S3 ListObjectsV2 returns at most 1,000 keys per page
DEFAULT_PART_BYTES = 50 * 2**20  # a write larger than this goes multipart (s3fs' default block size)


class CallLog:
    """The recorded calls, ``(phase, call, detail)``; ``detail`` is the entries listed, the
    bytes moved, or the open mode. ``phase`` is whatever :meth:`phase` last set."""

    def __init__(self):
        self.calls = []
        self.current = "other"

    @contextlib.contextmanager
    def phase(self, name):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def record(self, call, **detail):
        self.calls.append((self.current, call, detail))

    def of(self, phase):
        return [(call, detail) for p, call, detail in self.calls if p == phase]

    def call_counts(self, phase):
        """``{call: n}`` of one phase (``open`` split into ``open-rb`` and ``open-wb``)."""
        counts = collections.Counter()
        for call, detail in self.of(phase):
            counts[f"open-{detail['mode']}" if call == "open" else call] += 1
        return dict(counts)


class _CountedFile:
    """A file object of :meth:`CountingFS.open` that adds up the bytes it moved."""

    def __init__(self, f, log, mode):
        self._f, self._log, self._mode, self._bytes = f, log, mode, 0
        self._closed = False

    def write(self, data):
        self._bytes += memoryview(data).nbytes
        return self._f.write(data)

    def read(self, *args):
        data = self._f.read(*args)
        self._bytes += len(data)
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer)
        self._bytes += n or 0
        return n

    def close(self):
        if not self._closed:
            self._closed = True
            self._log.record("open", mode=self._mode, bytes=self._bytes)
        return self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


class CountingFS:
    """An fsspec filesystem whose calls that reach the storage are recorded in a CallLog."""

    def __init__(self, fs, log):
        self._fs, self._log = fs, log

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name not in COUNTED_CALLS or not callable(attr):
            return attr
        log = self._log

        def counted(*args, **kwargs):
            result = attr(*args, **kwargs)
            if name == "open":
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "rb")
                return _CountedFile(result, log, mode)  # recorded when it closes, with its bytes
            if name == "ls":
                log.record(name, entries=len(result))
            elif name == "cat_file":
                log.record(name, bytes=len(result))
            elif name == "get_file":
                log.record(name, bytes=os.path.getsize(args[1]))
            elif name == "mv":
                log.record(name, bytes=os.path.getsize(args[1]))
            else:
                log.record(name)
            return result

        return counted


def counting_store_files(log, cache_dir):
    """A replacement for :func:`statecore.files.open_store_files`: the store's files on a local
    directory, reached through fsspec as a remote store's are, every call recorded in ``log``;
    snapshots are mapped from copies in ``cache_dir`` (as with ``local_cache_dir``)."""

    def open_store_files(location, storage_options=None, local_cache_dir=None):
        files = files_module.StoreFiles(location, storage_options)
        files.fs = CountingFS(files.fs, log)
        files.is_local = False
        files.local_cache_dir = cache_dir
        files._cache = LocalCache(files.fs, files.storage_options, cache_dir)
        return files

    return open_store_files


def object_store_requests(calls, part_bytes=DEFAULT_PART_BYTES):
    """``{kind: n}`` of the S3 requests a sequence of ``(call, detail)`` costs (kinds:
    :data:`REQUEST_KINDS`). The mapping, for s3fs on S3: a listing is one LIST per 1,000
    keys; info/exists/size one HEAD; a ranged read (cat_file) one GET; a whole read
    (open for reading, get_file) a HEAD for the size and a GET; a write one PUT, or a
    multipart upload past ``part_bytes`` (one request to start, one per part, one to
    complete); a rename (mv) a COPY and a DELETE, S3 having no rename; a delete one DELETE;
    makedirs none (a prefix needs no object)."""
    out = dict.fromkeys(REQUEST_KINDS, 0)
    for call, detail in calls:
        if call == "ls":
            out["LIST"] += max(1, math.ceil(detail["entries"] / LIST_PAGE_KEYS))
        elif call in ("info", "exists", "size"):
            out["HEAD"] += 1
        elif call == "cat_file":
            out["GET"] += 1
        elif call == "get_file" or (call == "open" and detail["mode"].startswith("r")):
            out["HEAD"] += 1
            out["GET"] += 1
        elif call == "open":
            size = detail["bytes"]
            out["PUT"] += 1 if size <= part_bytes else 2 + math.ceil(size / part_bytes)
        elif call == "mv":
            out["COPY"] += 1
            out["DELETE"] += 1
        elif call == "rm_file":
            out["DELETE"] += 1
    return out
