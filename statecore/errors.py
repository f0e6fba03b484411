"""The one place statecore's exceptions are defined.

Every error a caller can act on derives from :class:`StateStoreError`. Where Python has a
fitting built-in, the error subclasses it too, so generic handlers (``except LookupError``)
still work.
"""

__all__ = [
    "StateStoreError",
    "IllegalStateError",
    "VersionNotFoundError",
    "StateCorruptionError",
    "SchemaMismatchError",
    "CommitConflictError",
    "AuthenticationError",
]


class StateStoreError(Exception):
    """Root of statecore's errors."""


class IllegalStateError(StateStoreError, RuntimeError):
    """Lifecycle misuse, worded as Spark words it ("Cannot put after already committed or aborted")."""


class VersionNotFoundError(StateStoreError, LookupError):
    """A version was asked for whose files are missing; the message names the missing file."""


class StateCorruptionError(StateStoreError):
    """A file is damaged: the message names the file, the byte offset and what was wrong.

    ``path`` and ``offset`` are kept as attributes so callers (and tests) need not parse text.
    """

    def __init__(self, path, offset, reason):
        self.path = str(path)
        self.offset = offset
        self.reason = reason
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"corrupt file '{self.path}'{where}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.offset, self.reason))


class SchemaMismatchError(StateStoreError, TypeError):
    """Rows or files do not match the schema a store was written with."""


class CommitConflictError(StateStoreError):
    """A commit was refused because newer versions were committed since its store opened:
    the committing attempt is stale (a zombie task). Nothing of it is visible."""


class AuthenticationError(StateStoreError, ConnectionError):
    """A peer failed the RPC handshake."""
