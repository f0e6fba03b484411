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
    "DamagedMetadataError",
    "SchemaMismatchError",
    "CommitConflictError",
    "UnrecordedStateError",
    "UnsafeFileError",
    "AuthenticationError",
    "RpcError",
    "RpcTimeoutError",
    "RpcConnectionError",
    "RpcProtocolError",
    "EndpointNotFoundError",
    "EndpointAlreadyRegisteredError",
    "REMOTE_ERRORS",
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


class DamagedMetadataError(StateCorruptionError, ValueError):
    """A metadata JSON file of a checkpoint (``_operator.json``, a batch record, a journal, a
    log entry) is damaged: not UTF-8 JSON, nested deeper than its format allows, or its bytes
    do not match the checksum it carries. A ValueError too, as an unreadable metadata file
    always was."""


class SchemaMismatchError(StateStoreError, TypeError):
    """Rows or files do not match the schema a store was written with."""


class CommitConflictError(StateStoreError):
    """A commit was refused because newer versions were committed since its store opened:
    the committing attempt is stale (a zombie task). Nothing of it is visible."""


class UnrecordedStateError(StateStoreError, ValueError):
    """A store the operator would start empty (no batch record names it) already holds older
    versions: starting over them would hide state. Nothing was written."""


class UnsafeFileError(StateStoreError, ValueError):
    """A file of a checkpoint was refused before any byte of it was read: it is not a
    regular file (a FIFO, a device, a directory), or it is larger than its format allows.
    ``path`` and ``reason`` are kept as attributes."""

    def __init__(self, path, reason):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"refused to read '{self.path}': {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class AuthenticationError(StateStoreError, ConnectionError):
    """A peer failed the RPC handshake."""


# -- RPC (statecore.rpc re-exports these) -----------------------------------------------------

class RpcError(StateStoreError):
    """A message could not be delivered or answered. When the remote handler raised,
    ``remote_type`` names its exception type and ``remote_traceback`` holds its traceback."""

    remote_type = None
    remote_traceback = None


class RpcTimeoutError(RpcError, TimeoutError):
    """No reply within the ask's ``timeout_s``, or a send held back too long by flow control."""


class RpcConnectionError(RpcError, ConnectionError):
    """The server could not be reached, or the connection broke; the message names the address."""


class RpcProtocolError(RpcError):
    """Bytes that do not follow the wire format: a bad frame, or a message or reply that does
    not decode as the type its receiver takes."""


class EndpointNotFoundError(RpcError, LookupError):
    """No endpoint of that name is registered at the server (never was, or was stopped)."""


class EndpointAlreadyRegisteredError(RpcError, ValueError):
    """``RpcEnv.setup_endpoint``: the name is taken by an endpoint registered before."""


#: What a call to an endpoint can raise because the peer is unreachable or its handler
#: failed: every remote failure is an :class:`RpcError` (see below), every transport failure an
#: ``OSError`` (a refused or broken connection, :class:`AuthenticationError`). Callers that go
#: on without the peer catch exactly these; anything else is a bug and propagates.
CALL_ERRORS = (RpcError, OSError)

#: The errors that keep their type when they cross the wire: an error reply names the class
#: by its key here, and the asker raises that class (with ``remote_type`` and
#: ``remote_traceback`` set as for any remote error). Every other exception of a handler
#: arrives as a plain :class:`RpcError`. Only RpcError subclasses belong here, so that
#: ``except RpcError`` still catches every remote failure.
REMOTE_ERRORS = {
    "RpcProtocol": RpcProtocolError,
    "EndpointNotFound": EndpointNotFoundError,
    "EndpointAlreadyRegistered": EndpointAlreadyRegisteredError,
}
