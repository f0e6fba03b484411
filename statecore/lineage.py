"""Version files and lineage: which file holds which attempt of which version, and which
attempt a load follows.

A commit of version ``v`` writes ``<v>_<commit id>.delta`` (16 hex digits: the version's
random 8-byte id), and a snapshot of it ``<v>_<commit id>.snapshot``; the delta's header
records its parent's id too. Several attempts of one batch (a retried or speculative task,
a zombie that comes back late) therefore leave several files that never overwrite one
another, and a version is loaded by following one chain of ids from the version down to
a snapshot or to version 0. Names of the previous layout (``<v>.delta``) are still read:
their id is taken from the file's checked header.

Which attempt of ``v`` is meant: the one the caller names (the driver records each batch's
winner), else the *default lineage*: the chain that ends at the newest version that has a
delta (among several attempts of it, the one whose delta was written last). The rules that
keep the default right are the committer's (``docs/provider-rules.md``).

This module only reasons over names and ids; headers are read through the callable the
provider passes in, which checks them.
"""
import functools
import re
from typing import NamedTuple

from statecore.errors import StateCorruptionError, VersionNotFoundError

__all__ = ["ROOT_COMMIT_ID", "VersionFile", "Listing", "file_name", "image_lineage", "parse_name",
           "parse_commit_id", "check_names_agree", "Chain"]

ROOT_COMMIT_ID = bytes(8)  # version 0: the empty state
KINDS = ("delta", "snapshot")
# Versions are ASCII digits as Java's Long.toString writes them (no leading zero, no sign); ids are
# 16 lowercase hex digits; the kind is lower case. Spark's reader would also take "05.delta" or
# "5.DELTA", but no writer makes them: such a name is a foreign file, never a version of the store.
_NAME = re.compile(r"(0|[1-9][0-9]*)(?:_([0-9a-f]{16}))?\.(delta|snapshot)")
MAX_VERSION = 2**63 - 1


def image_lineage(commit_id):
    """The 16 lineage bytes in the header of an image of a version written whole (a snapshot,
    a whole spill): its commit id, and no parent (an image stands on nothing before it)."""
    return commit_id + bytes(8)


class VersionFile(NamedTuple):
    version: int
    commit_id: bytes  # None for a name of the previous layout (the header knows it)
    kind: str  # "delta" or "snapshot"
    name: str


def file_name(version, commit_id, kind):
    """The name of the ``kind`` file of ``version``'s attempt ``commit_id``."""
    return f"{version}_{commit_id.hex()}.{kind}"


@functools.lru_cache(maxsize=1 << 14)
def parse_name(name):
    """The VersionFile a name stands for, or None if it is not a version file (cached: a
    store lists the same names at every open and commit)."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    version = int(m.group(1))
    if version > MAX_VERSION:
        return None
    commit_id = bytes.fromhex(m.group(2)) if m.group(2) else None
    return VersionFile(version, commit_id, m.group(3), name)


def parse_commit_id(commit_id):
    """A caller's commit id (16 hex digits, or 8 bytes) as bytes."""
    if isinstance(commit_id, (bytes, bytearray)) and len(commit_id) == 8:
        return bytes(commit_id)
    if isinstance(commit_id, str) and re.fullmatch(r"[0-9a-fA-F]{16}", commit_id):
        return bytes.fromhex(commit_id)
    raise ValueError(f"a commit id is 16 hex digits (or 8 bytes), got {commit_id!r}")


def check_names_agree(f, path, version, commit_id):
    """A version file's checked header must name the version (and id) its file name does: a
    copy of ``3_<id>.snapshot`` renamed to ``6_<id>.snapshot`` is damage, not version 6."""
    if version != f.version:
        raise StateCorruptionError(path, None, f"the file's header is of version {version}, its name says {f.version}")
    if f.commit_id is not None and commit_id != f.commit_id:
        raise StateCorruptionError(path, None, f"the file's header is of commit {commit_id.hex()}, its name "
                                               f"says {f.commit_id.hex()}")


class Listing:
    """The version files of a store directory at one moment: ``files[(kind, version)]`` is a
    list of VersionFile (several attempts of a version may coexist)."""

    def __init__(self, files=()):
        self.files = {}
        for f in files:
            self.files.setdefault((f.kind, f.version), []).append(f)
        self.names = frozenset(f.name for f in files)

    def __eq__(self, other):
        return isinstance(other, Listing) and self.names == other.names

    def __iter__(self):
        for group in self.files.values():
            yield from group

    def of(self, kind, version):
        return self.files.get((kind, version), ())

    def versions(self, kind=None):
        return sorted({v for (k, v) in self.files if kind is None or k == kind})

    @property
    def top(self):
        """The newest version with any file, or 0."""
        return max((v for (_, v) in self.files), default=0)

    def newer_than(self, version):
        return [f for f in self if f.version > version]


class Chain:
    """Resolves attempts and chains over one Listing.

    ``header(f)`` returns ``(commit_id, parent_id)`` of a VersionFile from its checked
    header (``parent_id`` is None for a snapshot); ``mtime(f)`` the file's modification
    time (or None), used only to order attempts of the newest version.
    """

    def __init__(self, listing, header, mtime, path, where):
        self.listing = listing
        self._header = header
        self._mtime = mtime
        self._path = path  # name -> full path, for messages
        self._where = where  # the store, for messages

    def commit_id(self, f):
        return f.commit_id if f.commit_id is not None else self._header(f)[0]

    def find(self, kind, version, commit_id):
        """The ``kind`` file of that attempt, or None."""
        for f in self.listing.of(kind, version):
            if self.commit_id(f) == commit_id:
                return f
        return None

    def parent_id(self, version, commit_id):
        """The parent id of that attempt, from its delta's header; None if it has no delta."""
        if version == 0:
            return None
        f = self.find("delta", version, commit_id)
        return None if f is None else self._header(f)[1]

    def default_top(self):
        """``(version, commit_id)`` where the default lineage ends: the newest version with a
        delta, and among its attempts the one whose file was written last (its modification
        time; ties: the larger name);
        ``(0, ROOT_COMMIT_ID)`` for an empty directory. A snapshot alone never makes an
        attempt the default (a late snapshot of an abandoned attempt is just a file)."""
        deltas = self.listing.versions("delta")
        kind = "delta" if deltas else "snapshot"
        versions = deltas or self.listing.versions("snapshot")
        if not versions:
            return 0, ROOT_COMMIT_ID
        top = versions[-1]
        attempts = {self.commit_id(f): f for f in self.listing.of(kind, top)}
        if len(attempts) == 1:
            return top, next(iter(attempts))
        ranked = sorted(attempts.items(), key=lambda kv: (self._mtime(kv[1]) or 0.0, kv[1].name))
        return top, ranked[-1][0]

    def default_id(self, version):
        """The id of ``version`` on the default lineage: its only attempt, or the one the
        chain from the newest version passes through; VersionNotFoundError if there is none
        (above the newest, or a file of the chain missing)."""
        if version == 0:
            return ROOT_COMMIT_ID
        top, commit_id = self.default_top()
        if version > top:
            raise VersionNotFoundError(
                f"version {version} of {self._where} does not exist: the newest version is {top}")
        attempts = {self.commit_id(f) for kind in KINDS for f in self.listing.of(kind, version)}
        if len(attempts) == 1:
            # The only attempt of the version: no need to read (or trust) the headers above it.
            return attempts.pop()
        for u in range(top, version, -1):
            parent = self.parent_id(u, commit_id)
            if parent is None:
                raise VersionNotFoundError(
                    f"version {version} of {self._where} cannot be found: the newest version's lineage "
                    f"has no delta file {self._path(file_name(u, commit_id, 'delta'))}")
            commit_id = parent
        return commit_id

    def walk(self, version, commit_id):
        """Yield ``(u, id_u, delta, snapshot)`` from ``version`` down along the chain, until
        version 0 (yielded with both None) or a version with no delta (the walk stops after
        yielding it; ``delta`` is None there)."""
        u = version
        while True:
            if u == 0:
                yield 0, ROOT_COMMIT_ID, None, None
                return
            delta = self.find("delta", u, commit_id)
            snapshot = self.find("snapshot", u, commit_id)
            yield u, commit_id, delta, snapshot
            if delta is None:
                return
            commit_id = self._header(delta)[1]
            u -= 1
