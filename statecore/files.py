"""The files of one store directory, on any fsspec filesystem: the only way state files are touched.

:class:`StoreFiles` owns everything statecore does with the files of a store directory
(``<root>/<operator>/<partition>[/<store>]``): listing the version files, reading them whole
or in part, writing them atomically (a temporary file in the same directory, then a
rename; on an object store, one upload under the final name: docs/object-storage.md),
deleting them, and giving the snapshot reader a local path it can memory-map (on a
remote filesystem, a copy made by :mod:`statecore.localcache`; for a packed snapshot, the
image its caller unpacks into that cache). Which name holds which
version and attempt (``<v>_<16 hex id>.delta`` / ``.snapshot``) is :mod:`statecore.lineage`'s;
the formats of the files are the compiled modules' (``_delta``, ``_snapshot``). This module
moves bytes, never reads them.

The store obtains its files through :func:`open_store_files`, so tests replace that one
function (with :class:`statecore.faults.FaultInjectingFiles`) to fail any step of any file
operation.

Thread-safety: a ``StoreFiles`` may be shared by several threads (a task thread and the
maintenance thread). It keeps no mutable state after construction; the only shared thing
it writes is the local cache directory, where every file appears by an atomic rename.
(About 600 lines: one class, the one way to the files, kept whole so that no file is
touched around it.)
"""
import errno
import io
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from statecore.errors import UnsafeFileError
from statecore.lineage import Listing, parse_name
from statecore.localcache import LocalCache, default_cache_dir, default_cache_dir_if_exists

__all__ = ["StoreFiles", "PendingFile", "open_store_files", "open_regular_file", "file_kind", "OBJECT_STORE_PROTOCOLS"]

logger = logging.getLogger(__name__)

_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")  # write_atomic's temporary names

# Filesystems of object stores (s3fs's protocols): no rename (``mv`` is a copy and a delete),
# no directory to fsync, and an object that appears whole when its upload completes or not
# at all. Files there are written under their final names (docs/object-storage.md).
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a"})


class StoreFiles:
    """The files of one store directory on any fsspec filesystem.

    Parameters
    ----------
    location : str
        The directory: a plain path (made absolute), a ``file://`` URL, or any fsspec URL
        (``memory://x/y``, ``s3://bucket/ckpt/0/3``).
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoints, ...).
    local_cache_dir : str, optional
        Where copies of remote files and images of packed snapshots are kept for
        memory-mapping. Without it both go to :func:`statecore.localcache.default_cache_dir`.

    Attributes
    ----------
    location : str
        The location exactly as given, for messages.
    fs : fsspec.AbstractFileSystem
        The filesystem; plain paths and ``file://`` give the local one.
    is_local : bool
        True for the local filesystem, where files are written and read with ``os``
        calls directly (so that they can be fsync'ed and mapped in place).
    is_object_store : bool
        True for an object store (:data:`OBJECT_STORE_PROTOCOLS`), where a file is uploaded
        under its final name in one request, never renamed (docs/object-storage.md).

    Notes
    -----
    File names passed to the methods are relative to the directory and use ``/``
    (``"12_<16 hex id>.delta"``, ``"_commits/3"``).
    """

    def __init__(self, location, storage_options=None, local_cache_dir=None):
        if not isinstance(location, str) or not location:
            raise ValueError(f"location must be a non-empty string, got {location!r}")
        if "::" in location:
            # fsspec reads "a::b" as a chain of filesystems and drops the path after "::"
            # from every partition's directory: all partitions would share one.
            raise ValueError(f"a state location may not contain '::' (fsspec URL chaining): {location!r}")
        self.location = location
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(location, **self.storage_options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.is_object_store = not self.is_local and bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))
        # fsspec already strips "file://" and makes relative local paths absolute.
        self._root = root.rstrip("/") or "/"
        self.local_cache_dir = (os.path.abspath(local_cache_dir)
                                if local_cache_dir is not None else None)
        self._cache = (LocalCache(self.fs, self.storage_options, self.local_cache_dir)
                       if self.local_cache_dir is not None and not self.is_local else None)
        self._images = None  # the LocalCache of images, made on first need (see _image_cache)

    def __repr__(self):
        return f"{type(self).__name__}({self.location!r})"

    # -- names and paths ----------------------------------------------------------------

    def _full(self, name):
        """The filesystem path of ``name``, after checking it stays inside the directory."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"file name must be a non-empty string, got {name!r}")
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file name {name!r} must be relative to the store directory")
        return self._root.rstrip("/") + "/" + name

    def path(self, name):
        """The full path (local) or URL (other filesystems) of ``name``, for messages."""
        full = self._full(name)
        return full if self.is_local else self.fs.unstrip_protocol(full)

    def _dir_path(self):
        return self._root if self.is_local else self.fs.unstrip_protocol(self._root)

    # -- hooks ----------------------------------------------------------------------------

    # Visible for tests. Called before each step of a file operation ("flush", "fsync",
    # "rename", "delete", "read"); statecore.faults.FaultInjectingFiles raises from here.
    def _step(self, step, name):
        pass

    # Visible for tests. The file object handed to a write_atomic callback.
    def _writer(self, f, name):
        return f

    # -- directory --------------------------------------------------------------------------

    def mkdirs(self):
        """Create the directory and its parents; an existing directory is fine."""
        if self.is_local:
            _makedirs_durable(self._root)
        else:
            self.fs.makedirs(self._root, exist_ok=True)

    def _list_names(self):
        """(name, is_dir) of every entry in the directory; none if it does not exist."""
        if self.is_local:
            try:
                with os.scandir(self._root) as it:
                    return [(e.name, e.is_dir()) for e in it]
            except (FileNotFoundError, NotADirectoryError):
                return []
        # Listings may be cached by the filesystem object (s3fs, gcsfs): files written by
        # another process would stay invisible.
        self.fs.invalidate_cache(self._root)
        try:
            entries = self.fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return []
        return [(e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type") == "directory")
                for e in entries]

    def list_versions(self):
        """The version files in the directory, as a :class:`statecore.lineage.Listing`.

        Names are ``<v>_<16 hex digits>.delta`` / ``.snapshot`` (the version and the commit
        id of the attempt that wrote it), or ``<v>.delta`` / ``<v>.snapshot`` of the previous
        layout (:func:`statecore.lineage.parse_name`'s rule: no leading zero, a lower-case kind).
        Temporary files (leading dot),
        directories and other names are ignored (names that look like a version file but
        are not one are logged). A missing directory has no files.
        """
        found = []
        for name, is_dir in sorted(self._list_names()):
            if is_dir or name.startswith("."):
                continue
            parsed = parse_name(name)
            if parsed is None:
                if name.count(".") == 1 and name.rsplit(".", 1)[1].lower() in ("delta", "snapshot"):
                    logger.warning("Could not identify file %s in store directory %s; ignoring it",
                                   self.path(name), self._dir_path())
                continue
            found.append(parsed)
        return Listing(found)

    # -- reading ----------------------------------------------------------------------------

    def exists(self, name):
        """Whether the file ``name`` exists."""
        full = self._full(name)
        if self.is_local:
            return os.path.exists(full)
        self.fs.invalidate_cache(full)
        return self.fs.exists(full)

    def _reading(self, name):
        """The path of ``name``, after the "read" step every read takes first."""
        full = self._full(name)
        self._step("read", name)
        return full

    def read_bytes(self, name, max_bytes=None):
        """The whole content of ``name``; FileNotFoundError if it does not exist.
        UnsafeFileError, before any byte is read, if it is not a regular file or (with
        ``max_bytes``) is larger than that: every caller that reads a file whole passes the
        size its format allows. On an object store, one GET (of at most ``max_bytes`` + 1
        bytes): an object is always a regular file, and no HEAD is needed to say so."""
        full = self._reading(name)
        if self.is_local:
            with open_regular_file(full, max_bytes) as f:
                # One byte more than the size checked on open (read(n) allocates n bytes up front,
                # so not max_bytes + 1): a file that grew since is caught below.
                data = f.read() if max_bytes is None else f.read(os.fstat(f.fileno()).st_size + 1)
        else:
            if not self.is_object_store:
                self._checked_remote(full, max_bytes)
            # A range from byte 0, even for the whole file: s3fs asks an unranged read's size first
            try:
                data = self.fs.cat_file(full, start=0, end=None if max_bytes is None else max_bytes + 1)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "No such file", self.path(name)) from None
        if max_bytes is not None and len(data) > max_bytes:  # it grew since its size was checked
            raise UnsafeFileError(self.path(name), f"it holds more than the {max_bytes} bytes its format allows")
        return data

    def open_whole(self, name):
        """A binary file object over all of ``name``, for a file that is read whole at once
        (a delta): on an object store its bytes from one GET, held in memory; elsewhere
        :meth:`open_read`."""
        if self.is_object_store:
            return io.BytesIO(self.read_bytes(name))
        return self.open_read(name)

    def read_range(self, name, start, length):
        """``length`` bytes of ``name`` from byte ``start`` (both >= 0; fewer bytes if the file
        ends first); FileNotFoundError if it does not exist, UnsafeFileError if it is not a
        regular file. Reads only that range, so a header can be checked without fetching a
        whole remote file."""
        if start < 0 or length < 0:
            raise ValueError(f"start and length must be >= 0, got {start} and {length}")
        full = self._reading(name)
        if self.is_local:
            with open_regular_file(full) as f:
                f.seek(start)
                return f.read(length)
        self._checked_remote(full, None)  # still FileNotFoundError for a missing file
        if length == 0:
            return b""
        return self.fs.cat_file(full, start=start, end=start + length)

    def open_read(self, name, max_bytes=None):
        """A binary file object reading ``name`` (a context manager); FileNotFoundError if
        it does not exist, UnsafeFileError if it is not a regular file (or is larger than
        ``max_bytes``)."""
        full = self._reading(name)
        if self.is_local:
            return open_regular_file(full, max_bytes)
        self._checked_remote(full, max_bytes)
        return self.fs.open(full, "rb")

    def _checked_remote(self, full, max_bytes):
        """UnsafeFileError unless the remote ``full`` is a file of at most ``max_bytes``."""
        info = self.fs.info(full)
        if info.get("type") != "file":
            raise UnsafeFileError(self.fs.unstrip_protocol(full), f"it is a {info.get('type')}, not a file")
        size = info.get("size")
        if max_bytes is not None and size is not None and size > max_bytes:
            raise UnsafeFileError(self.fs.unstrip_protocol(full),
                                  f"it holds {size} bytes, more than the {max_bytes} its format allows")

    def local_path_for_mapping(self, name):
        """A local path holding the content of ``name``, that can be memory-mapped.

        On the local filesystem this is the file itself; on any other, a copy in
        ``local_cache_dir`` (else :func:`statecore.localcache.default_cache_dir`, as for
        images: :class:`statecore.localcache.LocalCache`), made once and reused while the
        source keeps its size and version. FileNotFoundError if the file does not exist.
        """
        full = self._reading(name)
        if self.is_local:
            open_regular_file(full).close()  # FileNotFoundError here, as on other filesystems
            return full
        cache = self._cache if self._cache is not None else self._image_cache(create=True)
        return cache.copy_of(full, self.path(name))

    def local_image_for_mapping(self, name, size, make):
        """A local path holding the ``size``-byte image that ``make(source, dest)`` writes from
        ``name`` (``source``: ``name`` open for reading, ``dest``: the new local file open for
        writing), that can be memory-mapped: made once per version of ``name`` in the cache
        directory (``local_cache_dir``, else :func:`statecore.localcache.default_cache_dir`),
        reused while ``name`` is unchanged, dropped when it is deleted. FileNotFoundError if
        ``name`` does not exist; what ``make`` raises (no image is kept then)."""
        full = self._reading(name)

        def write_image(tmp):
            with self.open_read(name) as source, open(tmp, "xb") as dest:
                make(source, dest)

        return self._image_cache(create=True).image_of(full, self.path(name), size, write_image)

    def new_image_file(self, name):
        """A new temporary file (open for binary writing) in the image cache's directory, for
        an image of ``name`` written while ``name`` is (see :meth:`adopt_image`)."""
        cache = self._image_cache(create=True)
        os.makedirs(cache.directory, mode=0o700, exist_ok=True)
        base = name.rsplit("/", 1)[-1]
        return open(os.path.join(cache.directory, f".{base}.{uuid.uuid4().hex}.image.tmp"), "xb")

    def adopt_image(self, name, path):
        """Make the local file ``path`` (an image of ``name``, written with it) the cached
        image of ``name`` as it now is: what :meth:`local_image_for_mapping` then returns."""
        full = self._reading(name)
        size = os.path.getsize(path)
        self._image_cache(create=True).image_of(full, self.path(name), size, lambda tmp: os.replace(path, tmp))

    def publish_image(self, name, path):
        """Make the local file ``path`` (from :meth:`new_image_file`) the image that other
        processes of this machine find for ``name`` (:meth:`published_image`), by a rename;
        its path there, for the caller to remove once superseded. FileNotFoundError if
        ``name`` does not exist."""
        return self._image_cache(create=True).adopt(self._full(name), path)

    def published_image(self, name):
        """The local path of the image published for ``name`` as it now is, or None."""
        cache = self._image_cache(create=False)
        return None if cache is None else cache.find_image(self._full(name))

    def drop_images(self, names):
        """Remove the local images (and copies) of ``names`` (best effort)."""
        cache = self._image_cache(create=False)
        if cache is not None:
            cache.drop([self._full(name) for name in names])

    def _image_cache(self, create):
        """The LocalCache of images; None if ``create`` is false and no cache directory is
        given or exists (then there are no images to drop)."""
        if self._images is None:
            if self.local_cache_dir is not None:
                directory = self.local_cache_dir
            elif create:
                directory = default_cache_dir()
            else:
                directory = default_cache_dir_if_exists()
                if directory is None:
                    return None
            self._images = LocalCache(self.fs, self.storage_options, directory)
        return self._images

    # -- writing ----------------------------------------------------------------------------

    def write_atomic(self, name, write, overwrite=True, on_flushed=None):
        """Write ``name`` so that it appears whole or not at all.

        ``write(fileobj)`` writes the content into a temporary file
        ``.<name>.<uuid4hex>.tmp`` in the same directory, which is then flushed, fsync'ed
        (local filesystem) and renamed to ``name`` (docs/spark-state-store.md, Files). On the local filesystem
        the directory is fsync'ed after the rename, so the new name survives a power
        loss. Until the rename, nothing but the temporary file is touched; on any error the
        temporary file is deleted (best effort) and the error re-raised. On an object store
        there is no rename: the content is uploaded under ``name`` in one request (or one
        multipart upload), conditionally with ``overwrite=False`` (:meth:`write_pending`).

        Parameters
        ----------
        name : str
            The final file name; missing parent directories are created (as Spark's
            ``createAtomic`` does).
        write : callable
            Called once with a binary file object open for writing.
        overwrite : bool, default True
            Replace an existing file of that name. With False an existing file is left
            alone and ``FileExistsError`` raised (the schema file uses this).
        on_flushed : callable, optional
            Local filesystem only: called with the temporary file's path once its bytes
            are written and flushed, before the fsync and the rename, so that a reader can
            map the new file while it is made durable (a mapping outlives the rename).

        Returns
        -------
        int
            The size of the file written, in bytes.

        Raises
        ------
        FileExistsError
            If ``overwrite`` is False and ``name`` exists (on an object store, also when it
            appeared during the write: the upload is an ``If-None-Match: *`` PUT).
        OSError
            From the filesystem; the previous file of that name, if any, is intact. (Only
            a failing fsync of the directory, after the rename, finds the new file in
            place; writing it again is safe.)
        """
        if not overwrite and self.exists(name):
            raise FileExistsError(errno.EEXIST, "File exists", self.path(name))
        pending = self.write_pending(name, write, on_flushed=on_flushed)
        return pending.publish(overwrite=overwrite)

    def _put_object(self, name, fill, exclusive):
        """Upload ``name`` under its final name: ``fill(f)`` writes its bytes into the
        object store's file. One PUT, or a multipart upload for a file larger than the
        filesystem's block size (its parts are invisible until it completes); ``exclusive``:
        a conditional create (``If-None-Match: *``), FileExistsError if ``name`` exists."""
        full = self._full(name)
        f = self.fs.open(full, "xb" if exclusive else "wb")
        try:
            fill(f)
        except BaseException:
            _quietly(_abandon_upload, f)
            raise
        try:
            f.close()
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "File exists", self.path(name)) from None
        except BaseException:
            _quietly(_abandon_upload, f)
            raise
        finally:
            self.fs.invalidate_cache(full)

    def write_pending(self, name, write, on_flushed=None):
        """Write the content of ``name`` durably under a temporary name, and return a
        :class:`PendingFile` whose ``publish()`` renames it into place and ``discard()``
        deletes it: a commit makes its file visible only once everything else succeeded.
        On any error the temporary file is deleted (best effort) and the error re-raised.
        ``on_flushed`` is as for :meth:`write_atomic`.

        On an object store the content goes to an unnamed local file instead (in
        ``local_cache_dir`` if given, else the system's temporary directory), uploaded under
        ``name`` by ``publish()``: nothing of it is in the store before (an uncommitted
        version is never visible, and a process that dies there leaves nothing behind)."""
        full = self._full(name)
        if self.is_object_store:
            return self._spool_pending(name, full, write)
        parent, base = full.rsplit("/", 1)
        tmp = f"{parent}/.{base}.{uuid.uuid4().hex}.tmp"
        if self.is_local:
            _makedirs_durable(parent)
            f = open(tmp, "xb")
        else:
            f = self.fs.open(tmp, "wb")
        try:
            try:
                write(self._writer(f, name))
                self._step("flush", name)
                f.flush()
                if on_flushed is not None and self.is_local:
                    on_flushed(tmp)
                self._step("fsync", name)
                if self.is_local:  # elsewhere close() makes it durable
                    os.fsync(f.fileno())
                size = f.tell()  # what was written: no round trip to ask the store afterwards
            except BaseException:
                _quietly(f.close)  # a failing close must not hide the first error
                raise
            f.close()
        except BaseException:
            _quietly(self._unlink_tmp, tmp)
            raise
        return PendingFile(self, name, full, tmp, size)

    def _spool_pending(self, name, full, write):
        """write_pending on an object store: the content in a local unnamed file."""
        if self.local_cache_dir is not None:
            os.makedirs(self.local_cache_dir, exist_ok=True)
        spool = tempfile.TemporaryFile(dir=self.local_cache_dir)
        try:
            write(self._writer(spool, name))
            self._step("flush", name)
            spool.flush()
            self._step("fsync", name)  # not needed: a crash before publish loses nothing committed
            size = spool.tell()
        except BaseException:
            _quietly(spool.close)
            raise
        return PendingFile(self, name, full, None, size, spool=spool)

    def _unlink_tmp(self, tmp):
        if self.is_local:
            os.unlink(tmp)
        else:
            self.fs.rm_file(tmp)

    def _publish(self, pending, overwrite):
        if pending.spool is not None:
            return self._publish_spooled(pending, overwrite)
        name, full, tmp = pending.name, pending.full, pending.tmp
        try:
            self._step("rename", name)
            if self.is_local:
                if overwrite:
                    os.replace(tmp, full)
                else:
                    self._rename_no_clobber_local(name, tmp, full)
            else:
                # Other remote filesystems (object stores are written by _put_object) may have
                # no rename that refuses to overwrite: the check is racy there.
                if not overwrite and self.fs.exists(full):
                    raise FileExistsError(errno.EEXIST, "File exists", self.path(name))
                self.fs.mv(tmp, full)
        except BaseException:
            _quietly(self._unlink_tmp, tmp)
            raise
        if self.is_local:
            _fsync_dir(os.path.dirname(full))
        else:
            self.fs.invalidate_cache(full)
        return pending.size

    def _publish_spooled(self, pending, overwrite):
        """publish() on an object store: upload the spooled content under its final name."""
        spool = pending.spool
        try:
            self._step("rename", pending.name)
            spool.seek(0)
            self._put_object(pending.name, lambda f: shutil.copyfileobj(spool, f, _UPLOAD_CHUNK), not overwrite)
        finally:
            _quietly(spool.close)
        return pending.size

    def _rename_no_clobber_local(self, name, tmp, full):
        # A hard link fails if the target exists, so no other writer can be overwritten
        # between a check and the rename; filesystems without links fall back to one.
        try:
            os.link(tmp, full)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "File exists", self.path(name)) from None
        except OSError:
            if os.path.lexists(full):
                raise FileExistsError(errno.EEXIST, "File exists", self.path(name)) from None
            os.replace(tmp, full)
            return
        _quietly(os.unlink, tmp)

    # -- deleting ---------------------------------------------------------------------------

    def delete(self, names):
        """Delete files, best effort: missing files and failures are skipped (failures
        logged); local cached copies of the deleted files go too. Returns the names deleted."""
        deleted, fulls = [], []
        for name in names:
            full = self._full(name)
            try:
                self._step("delete", name)
                if self.is_local:
                    os.unlink(full)
                else:
                    self.fs.rm_file(full)
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.warning("Could not delete file %s: %s", self.path(name), e)
                continue
            deleted.append(name)
            fulls.append(full)
        if fulls:
            for cache in {id(c): c for c in (self._cache, self._image_cache(create=False)) if c is not None}.values():
                cache.drop(fulls)
        return deleted

    def temporary_files(self, older_than_s):
        """Temporary files (``.<name>.<uuid>.tmp``) last modified more than ``older_than_s``
        seconds ago: what a writer killed in mid-write left behind (a live writer touches
        its file as it writes). Filesystems that report no modification time keep theirs."""
        now = time.time()
        stale = []
        for name, is_dir in self._list_names():
            if is_dir or not _TEMPORARY.fullmatch(name):
                continue
            mtime = self._mtime(name)
            if mtime is not None and now - mtime > older_than_s:
                stale.append(name)
        return sorted(stale)

    def size(self, name):
        """The size of ``name`` in bytes; FileNotFoundError if it does not exist."""
        full = self._full(name)
        if self.is_local:
            return os.stat(full).st_size
        self.fs.invalidate_cache(full)
        return self.fs.size(full)

    def mtime(self, name):
        """The modification time of ``name`` (seconds), or None if unknown or missing."""
        return self._mtime(name)

    def _mtime(self, name):
        full = self._full(name)
        try:
            if self.is_local:
                return os.stat(full).st_mtime
            info = self.fs.info(full)
        except FileNotFoundError:
            return None
        for key in ("mtime", "LastModified", "last_modified", "created"):
            value = info.get(key)
            if isinstance(value, (int, float)):
                return float(value)
            if hasattr(value, "timestamp"):
                return value.timestamp()
        return None


class PendingFile:
    """A file written and made durable under a temporary name, not yet visible under its own
    (on an object store: written to a local unnamed ``spool``, not yet uploaded)."""

    def __init__(self, files, name, full, tmp, size, spool=None):
        self.files, self.name, self.full, self.tmp, self.size = files, name, full, tmp, size
        self.spool = spool
        self.done = False

    def publish(self, overwrite=True):
        """Rename it into place (and fsync the directory), or upload it under its name on
        an object store; returns its size in bytes."""
        self.done = True
        return self.files._publish(self, overwrite)

    def discard(self):
        """Delete the temporary file (best effort); harmless after publish()."""
        if not self.done:
            self.done = True
            if self.spool is not None:
                _quietly(self.spool.close)
            else:
                _quietly(self.files._unlink_tmp, self.tmp)


def file_kind(mode):
    """What an ``st_mode`` that is not a regular file's stands for, in words."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular_file(path, max_bytes=None):
    """``path`` open for binary reading (a context manager) if it is a regular file of at
    most ``max_bytes`` (any size if None); UnsafeFileError otherwise, before any byte is
    read. The type is checked on the open descriptor, and the open does not wait: a FIFO put
    where a state file should be is refused at once, never read (a plain ``open`` would
    block until something writes to it), and a file swapped after a ``stat`` cannot slip
    through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, f"it is {file_kind(st.st_mode)}, not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFileError(path, f"it holds {st.st_size} bytes, more than the {max_bytes} its format allows")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_UPLOAD_CHUNK = 8 * 2**20  # bytes copied at a time from a spooled file into its upload


def _abandon_upload(f):
    """Drop an object store's file being written without completing its upload (an
    incomplete multipart upload is aborted); marked closed, so that it is never completed."""
    f.discard()
    f.closed = True


def _quietly(fn, *args):
    """Best-effort cleanup: never masks the error being handled."""
    try:
        fn(*args)
    except Exception:
        pass


def _makedirs_durable(path):
    """``os.makedirs``, each new directory fsynced into its parent: a directory created just
    before a commit must survive a power loss with the files renamed into it."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        _fsync_dir(os.path.dirname(d))


def _fsync_dir(path):
    """Make a rename in ``path`` durable; skipped where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # Windows, or a directory we may not open: nothing more we can do
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (and platforms) do not support fsync on a directory.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def open_store_files(location, storage_options=None, local_cache_dir=None):
    """The :class:`StoreFiles` of a store directory (arguments as its constructor's); the
    store gets its files only from here. Tests replace this function
    (``monkeypatch.setattr(statecore.files, "open_store_files", ...)``) to hand the store a
    :class:`statecore.faults.FaultInjectingFiles`."""
    return StoreFiles(location, storage_options, local_cache_dir)
