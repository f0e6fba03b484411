"""A small authenticated RPC over TCP: what the driver's coordinators and the executors say
to each other (Spark's RpcEnv, reduced to what the StateStoreCoordinator and the
EpochCoordinator need).

An :class:`RpcEnv` listens on one TCP port and hosts named :class:`RpcEndpoint` objects. An
:class:`RpcEndpointRef` (``address``, ``name``, ``authkey``: exactly what pickles and
travels inside tasks) sends to one of them: :meth:`~RpcEndpointRef.send` is one-way,
:meth:`~RpcEndpointRef.ask` waits for the reply. A process without an RpcEnv (an executor,
a Python worker) gets refs from the module-level :func:`endpoint_ref`.

Semantics
    An endpoint handles one message at a time, in arrival order. A connection's reader
    thread runs the handler itself when the endpoint is idle (no thread hop: the common
    case); a message that finds the endpoint busy is queued for the endpoint's own
    dispatcher thread. The refs of one process to one endpoint share one connection (per
    :class:`RpcEnv`, or per process for module-level refs), so messages of one ref are
    handled in the order the ref sent them, and an ``ask`` is answered only after every
    earlier ``send`` of that ref was handled (the coordinators' tests use an ask as a
    flush); a slow handler holds up no other endpoint. Asks from any number of threads are
    matched to their replies by request id. Callers take turns at the socket: a thread that
    finds another one writing leaves its frame to that writer, and asking threads take turns
    reading replies for everyone, so no client thread is ever started and concurrent callers
    share system calls. Likewise the server answers asks that arrived together with one
    write, once the last of them was handled. The server never waits for a peer to read:
    replies are written without blocking, and what a socket does not take at once is left
    to the env's reply-writer thread, so a client that stops reading its replies holds up
    no handler and no other client (it is dropped, see below).

    Flow control: senders cannot run ahead of an endpoint without bound. A client
    connection's outbox (frames handed to the thread that is writing) holds about
    ``max_outbox_bytes`` (default 1 MiB, some 7000 coordinator messages: enough to batch
    writes, a few ms of the endpoint's work); a ``send`` that finds it full waits for room,
    and raises :class:`RpcTimeoutError` (naming the endpoint and the bound; that message
    was not sent) if none comes within ``io_timeout_s``. Asks never wait for room (one per
    asking thread at most), so an ask still follows every earlier send. On the server, at
    most ``max_queued_messages`` (default 1000) messages and ``max_queued_bytes`` (default
    4 MiB; the message that crosses it still gets in) *per connection* wait for a busy
    endpoint; past either, the connection's reader stops reading until both are down to
    half, the socket buffers fill and TCP holds the client back. Per connection rather
    than in total, so one flooding client cannot take the whole queue: any other client's
    ask waits behind at most that share of each connection. Likewise, while a handler runs
    on a connection's reader, that connection is not read. A client whose writes make no
    progress for ``io_timeout_s`` (the endpoint is stuck) drops the connection: the sends
    still waiting in it are lost, and the callers still waiting get
    :class:`RpcTimeoutError`. Handlers are meant to be quick, as in Spark.

    Server memory: a queued message is kept as the frame that came in, and decoded only by
    the thread that hands it to its endpoint (a value can decode to some tens of times its
    encoded size: a list of small dicts, say). So a connection holds at most
    ``max_queued_bytes`` plus one frame in each endpoint's queue, one frame its reader has
    in hand, its read buffer (up to twice a frame), and unsent replies: a client whose
    unread replies reach ``max_reply_backlog_bytes`` (default 16 MiB) when another reply
    comes, or that takes none of them for ``io_timeout_s``, is dropped and logged (and the
    messages it still had queued with it), so these stay under that bound plus 256 KiB and
    one frame. Decoded values exist only in running handlers, one per endpoint.

    ``send`` is at most once: a send written into a connection that the server has just
    closed is lost without an error. A connection the server has already hung up on is
    noticed before writing (a zero-timeout ``poll``), and a write that fails is retried
    once on a new connection (a frame whose write failed was never complete at the server,
    so it cannot be handled twice). ``ask`` retries the connect once the same way; a
    connection lost *after* an ask was written is an :class:`RpcConnectionError`, not
    retried, since the message may have been handled. So after a server restarts on the
    same address (same port, same authkey), refs carry on with their next message. After
    ``os.fork`` a child never uses its parent's connections: it opens its own.

    Stopping an endpoint (:meth:`RpcEnv.stop_endpoint`, also from inside its own handler)
    unregisters its name at once; messages already queued are still handled, then
    ``on_stop`` runs. Later asks to the name get an :class:`EndpointNotFoundError` naming
    it, later sends are dropped and logged.

Messages
    An endpoint declares what it takes in :attr:`RpcEndpoint.message_type`: a union of
    :class:`Message` Structs (the coordinators: one union per endpoint, defined with it), or
    ``Any``, plain values (the default, for user endpoints). Each message is decoded as that
    type by the thread that hands it to the endpoint; one that does not decode (malformed,
    an unknown message, a field of the wrong type) drops its connection, logged with
    msgspec's reason. An ask dropped so is answered first with an :class:`RpcProtocolError`
    when the connection's earlier replies are all written (otherwise its asker sees the
    connection lost); the client then uses a new connection. A reply is decoded as a plain
    value and, if the ask names a ``reply_type``, converted to it by msgspec (as strictly
    as decoding it as that type would); one that does not convert is an RpcProtocolError
    for that ask alone.

    A message or reply is a msgspec Struct (encoded as it is: its fields are the receiver's
    to check) or a plain value: None, bool, int (-2**63 to 2**64 - 1), float, str, bytes,
    and tuples, lists and dicts of them, dict keys being None, bool, int, float, str or bytes;
    Structs may sit inside plain containers. Containers nest at most :data:`MAX_DEPTH` deep.
    Only these exact types are sent: a subclass, a set, a bytearray, a datetime, ... is a
    :class:`TypeError` naming its type (excess depth a ValueError), raised before anything
    is sent (:func:`check_value` is that check). MessagePack has one array type, so a tuple
    arrives as a list. Decoding is msgspec's: strict about types (an int field takes no
    bool or float), and no extension type is accepted, with one exception msgspec makes
    itself: a MessagePack timestamp, which statecore never sends, decodes as a ``datetime``
    where a plain value goes. Nesting is bounded by msgspec (the interpreter's recursion
    limit), past :data:`MAX_DEPTH`.

Security
    Both sides prove knowledge of the shared ``authkey`` (HMAC-SHA256 over fresh random
    nonces in both directions, compared in constant time) before a single message is
    decoded. Traffic is neither encrypted nor integrity-protected after the handshake (as
    with ``multiprocessing.connection``): a trusted network is assumed. Nothing from the
    network is unpickled: msgspec decodes MessagePack into the declared Structs or plain
    data, nothing else. The authkey travels (pickled) with every ref, as Spark's tasks
    carry it.

Wire format
    Everything, the handshake included, goes in frames: ``length`` (u32, big-endian: the
    bytes that follow, at most the receiver's limit) then one MessagePack value, written
    and read by ``msgspec.msgpack`` as one of the Structs below. They are ``array_like``:
    a Struct is an array of its fields in order, after its tag if it has one. Handshake
    frames are at most 256 bytes, and the server allows ``handshake_timeout_s`` for all of
    it (``limit`` is the sender's frame-size limit; inside an HMAC it counts as 4 bytes,
    big-endian)::

        server -> client  _Hello     ["statecore-rpc/2", server_nonce (bin, 32 bytes)]
        client -> server  _Proof     ["statecore-rpc/2", client_nonce (bin, 32 bytes), limit,
                                      HMAC(key, b"statecore-rpc client" + server_nonce + client_nonce + limit)]
        server -> client  _Accepted  ["accepted", limit,
                                      HMAC(key, b"statecore-rpc server" + client_nonce + server_nonce + limit)]
                        | _Refused   ["refused"], then it closes

    Then each frame is one envelope, tagged by its kind::

        _Send   [1, endpoint, message]
        _Ask    [2, request_id, endpoint, message]
        _Reply  [3, request_id, value]
        _Error  [4, request_id, error, remote_type, text, traceback]

    Clients send only the first two, servers only the last two. An error reply's ``error``
    is the registered name of its exception type (``statecore.errors.REMOTE_ERRORS``: the
    asker raises that class) or ``""`` (a plain :class:`RpcError`); ``remote_type`` names
    the handler's exception type, ``""`` when the RPC layer itself refused the ask (an
    unknown endpoint name, say). A frame whose body has not fully arrived ``io_timeout_s``
    after its first byte drops the connection, as does an oversize frame or one whose
    envelope does not decode (the message inside is decoded when its endpoint takes it:
    see Messages).
"""
import collections
import hmac
import itertools
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import traceback
import weakref
from typing import Annotated, Any, Union

import msgspec

from statecore.errors import (REMOTE_ERRORS, AuthenticationError, EndpointAlreadyRegisteredError,
                              EndpointNotFoundError, RpcConnectionError, RpcError, RpcProtocolError, RpcTimeoutError)

__all__ = ["RpcEnv", "RpcEndpoint", "RpcEndpointRef", "Message", "endpoint_ref", "close_connections", "RpcError",
           "RpcTimeoutError", "RpcConnectionError", "RpcProtocolError", "EndpointNotFoundError",
           "EndpointAlreadyRegisteredError", "check_value", "encode_value", "decode_value", "MAX_DEPTH",
           "DEFAULT_MAX_FRAME_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 * 2**20
DEFAULT_IO_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTBOX_BYTES = 2**20
DEFAULT_MAX_QUEUED_MESSAGES = 1000
DEFAULT_MAX_QUEUED_BYTES = 4 * 2**20
DEFAULT_MAX_REPLY_BACKLOG_BYTES = 16 * 2**20
MAX_DEPTH = 64  # containers in a plain value nest at most this deep
_ACCEPT_PAUSE_S = (0.01, 1.0)  # the acceptor's pause after a failure: the first, and the longest
_ACCEPT_LOG_EVERY_S = 10.0  # at most one warning this often while accepting keeps failing
_MIN_FRAME_BYTES = 1024  # a limit below this could not carry an error reply
_MAX_U32 = 2**32 - 1

_PROTOCOL = "statecore-rpc/2"
_NONCE_BYTES = 32
_HANDSHAKE_FRAME_BYTES = 256
_CLIENT_LABEL = b"statecore-rpc client"
_SERVER_LABEL = b"statecore-rpc server"

_U32 = struct.Struct(">I")
_pack_u32 = _U32.pack
_unpack_u32 = _U32.unpack_from
_DONTWAIT = socket.MSG_DONTWAIT  # replies are written without waiting (see _ServerConnection)
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16)  # pieces per sendmsg

_request_ids = itertools.count(1)  # next() is atomic under the GIL: one sequence per process


class _NotSent(Exception):
    """Internal: the frame was not (completely) written, so it is safe to retry elsewhere."""


class _Backlogged(Exception):
    """Internal: the frame was not sent because the server did not take earlier ones (the
    outbox stayed full, or the writer stalled); not retried, since earlier frames are ahead
    of it (or lost)."""


# -- messages and values -----------------------------------------------------------------------

class Message(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=True):
    """Base of an endpoint's typed messages: each subclass is one message, sent as the array
    ``[class name, fields...]`` (no field more or less decodes); an endpoint takes the union
    of its own (``message_type``). Frozen: a message is a value."""


_Nonce = Annotated[bytes, msgspec.Meta(min_length=_NONCE_BYTES, max_length=_NONCE_BYTES)]
_Limit = Annotated[int, msgspec.Meta(ge=_MIN_FRAME_BYTES, le=_MAX_U32)]
_Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class _Hello(msgspec.Struct, array_like=True):
    protocol: str
    nonce: _Nonce


class _Proof(msgspec.Struct, array_like=True):
    protocol: str
    nonce: _Nonce
    limit: _Limit
    proof: _Mac


class _Accepted(msgspec.Struct, array_like=True, tag="accepted"):
    limit: _Limit
    proof: _Mac


class _Refused(msgspec.Struct, array_like=True, tag="refused"):
    pass


class _Send(msgspec.Struct, array_like=True, tag=1):
    endpoint: str
    message: msgspec.Raw  # left encoded until its endpoint takes it


class _Ask(msgspec.Struct, array_like=True, tag=2):
    request_id: int
    endpoint: str
    message: msgspec.Raw


class _Reply(msgspec.Struct, array_like=True, tag=3):
    request_id: int
    value: Any  # a plain value: the asking thread converts it to its reply_type


class _Error(msgspec.Struct, array_like=True, tag=4):
    request_id: int
    error: str
    remote_type: str
    text: str
    traceback: str


def _refuse_extension(code, data):
    raise msgspec.ValidationError(f"MessagePack extension type {code} is not accepted")


_encode = msgspec.msgpack.Encoder().encode  # msgspec's encoders and decoders are safe to share between threads
_server_envelopes = msgspec.msgpack.Decoder(Union[_Send, _Ask])
_client_envelopes = msgspec.msgpack.Decoder(Union[_Reply, _Error], ext_hook=_refuse_extension)
_decoders = {Any: msgspec.msgpack.Decoder(Any, ext_hook=_refuse_extension)}  # type -> its decoder, made once


def _decoder(message_type):
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type, ext_hook=_refuse_extension)
    return decoder


# What msgspec raises for bytes that do not decode (its ValidationError is a DecodeError).
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def _undecodable(error, what=None):
    """The RpcProtocolError for a decoding failure (one of _DECODE_ERRORS), with msgspec's reason."""
    reason = "nested too deeply to decode" if isinstance(error, RecursionError) else str(error)
    return RpcProtocolError(reason if what is None else f"{what}: {reason}")


def _decode(decoder, data):
    """``decoder.decode(data)``; RpcProtocolError if it does not decode. (Hot paths inline this.)"""
    try:
        return decoder.decode(data)
    except _DECODE_ERRORS as e:
        raise _undecodable(e) from None


_SCALARS = frozenset((type(None), bool, int, float, str, bytes))


def check_value(value, depth=0):
    """Raise TypeError (naming the type) unless ``value`` is a plain value, a Struct, or plain
    containers of them; ValueError if containers nest deeper than MAX_DEPTH (a cycle, say).
    See "Messages" in the module docstring."""
    t = type(value)
    if t is tuple or t is list:
        if depth >= MAX_DEPTH:
            raise ValueError(f"cannot send a value nested deeper than {MAX_DEPTH} containers")
        for item in value:
            if type(item) not in _SCALARS:
                check_value(item, depth + 1)
    elif t is dict:
        if depth >= MAX_DEPTH:
            raise ValueError(f"cannot send a value nested deeper than {MAX_DEPTH} containers")
        for key, item in value.items():
            if type(key) not in _SCALARS:
                raise TypeError(f"cannot send a dict key of type {_type_name(type(key))}: keys must be None, "
                                f"bool, int, float, str or bytes")
            if type(item) not in _SCALARS:
                check_value(item, depth + 1)
    elif t not in _SCALARS and not isinstance(value, msgspec.Struct):
        raise TypeError(f"cannot send a value of type {_type_name(t)}: supported are None, bool, int, float, str, "
                        f"bytes, tuple, list, dict and msgspec Structs")


def _type_name(t):
    """How messages name a type: ``set`` for a builtin, ``module.QualName`` otherwise."""
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _frame(envelope):
    """One complete frame (length, then the envelope), ready for a single write. ValueError
    for an int outside what MessagePack holds."""
    try:
        data = _encode(envelope)
        return _pack_u32(len(data)) + data
    except OverflowError as e:
        raise ValueError(f"cannot send an int outside [-2**63, 2**64 - 1]: {e}") from None
    except struct.error:
        raise ValueError(f"message of {len(data)} bytes is too large for one RPC frame") from None


def encode_value(value):
    """A plain value (or Struct) as MessagePack bytes, checked as a message is (check_value)."""
    check_value(value)
    try:
        return _encode(value)
    except OverflowError as e:
        raise ValueError(f"cannot send an int outside [-2**63, 2**64 - 1]: {e}") from None


def decode_value(data, message_type=Any):
    """The value in MessagePack ``data`` (any bytes-like object), decoded as ``message_type``
    as a message to an endpoint is; RpcProtocolError if it does not decode."""
    return _decode(_decoder(message_type), data)


def _check_name(name):
    if not isinstance(name, str) or not name:
        raise ValueError(f"an endpoint name must be a non-empty str, got {name!r}")
    return name


def _normalize_authkey(authkey):
    if isinstance(authkey, str):
        authkey = authkey.encode("utf-8")
    if not isinstance(authkey, (bytes, bytearray)):
        raise TypeError(f"authkey must be bytes or str, got {type(authkey).__name__}")
    if not authkey:
        raise ValueError("authkey must not be empty")
    return bytes(authkey)


def _normalize_address(address):
    host, port = address
    return (str(host), int(port))


def _where(address):
    return f"{address[0]}:{address[1]}"


# -- sockets -----------------------------------------------------------------------------------

def _tune(sock, io_timeout_s):
    """Blocking mode, no Nagle delay (one frame = one write), and writes that give up after
    ``io_timeout_s`` (a peer that stops reading cannot hold a writer for ever)."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seconds = int(io_timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", seconds, int((io_timeout_s - seconds) * 1e6)))


def _recv_exact(sock, n, deadline):
    """Exactly ``n`` bytes, all of them before ``deadline`` (handshakes only)."""
    data = b""
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} handshake bytes")
        data += chunk
    return data


def _send_before(sock, data, deadline):
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise socket.timeout("timed out")
    sock.settimeout(remaining)
    sock.sendall(data)


_HELLO = msgspec.msgpack.Decoder(_Hello)
_PROOF = msgspec.msgpack.Decoder(_Proof)
_ANSWER = msgspec.msgpack.Decoder(Union[_Accepted, _Refused])


def _send_handshake(sock, message, deadline):
    _send_before(sock, _frame(message), deadline)


def _recv_handshake(sock, decoder, deadline, peer):
    """The next handshake frame, decoded; RpcProtocolError ("unexpected greeting") for
    anything else, refused as soon as its length shows it (garbage, an HTTP request)."""
    size = _unpack_u32(_recv_exact(sock, 4, deadline))[0]
    if size > _HANDSHAKE_FRAME_BYTES:
        raise RpcProtocolError(f"not a statecore RPC {peer} (unexpected greeting)")
    try:
        message = _decode(decoder, _recv_exact(sock, size, deadline))
    except RpcProtocolError as e:
        raise RpcProtocolError(f"not a statecore RPC {peer} (unexpected greeting: {e})") from None
    if getattr(message, "protocol", _PROTOCOL) != _PROTOCOL:
        raise RpcProtocolError(f"not a statecore RPC {peer} (unexpected greeting: protocol {message.protocol!r}, "
                               f"this one speaks {_PROTOCOL!r})")
    return message


def _mac(authkey, label, first_nonce, second_nonce, limit):
    return hmac.digest(authkey, label + first_nonce + second_nonce + _pack_u32(limit), "sha256")


def _client_handshake(sock, authkey, max_frame_bytes, deadline):
    """Prove the authkey to the server and check its proof; returns the server's frame limit."""
    server_nonce = _recv_handshake(sock, _HELLO, deadline, "server").nonce
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    proof = _mac(authkey, _CLIENT_LABEL, server_nonce, client_nonce, max_frame_bytes)
    _send_handshake(sock, _Proof(_PROTOCOL, client_nonce, max_frame_bytes, proof), deadline)
    answer = _recv_handshake(sock, _ANSWER, deadline, "server")
    if type(answer) is _Refused:
        raise AuthenticationError("the server rejected our authkey")
    expected = _mac(authkey, _SERVER_LABEL, client_nonce, server_nonce, answer.limit)
    if not hmac.compare_digest(answer.proof, expected):
        raise AuthenticationError("the server failed to prove that it knows the authkey")
    return answer.limit


def _server_handshake(sock, authkey, max_frame_bytes, deadline):
    """Check the client's proof and prove ours; returns the client's frame limit."""
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    _send_handshake(sock, _Hello(_PROTOCOL, server_nonce), deadline)
    hello = _recv_handshake(sock, _PROOF, deadline, "client")
    expected = _mac(authkey, _CLIENT_LABEL, server_nonce, hello.nonce, hello.limit)
    if not hmac.compare_digest(hello.proof, expected):
        try:
            _send_handshake(sock, _Refused(), deadline)
        except OSError:
            pass
        raise AuthenticationError("the client failed to prove that it knows the authkey")
    proof = _mac(authkey, _SERVER_LABEL, hello.nonce, server_nonce, max_frame_bytes)
    _send_handshake(sock, _Accepted(max_frame_bytes, proof), deadline)
    sock.settimeout(None)
    return hello.limit


class _Stalled(Exception):
    """A frame began but did not complete within the io timeout."""


class _FrameReader:
    """Reads frames from a blocking socket. A frame cut short by a caller's deadline stays
    buffered for the next call; one not complete ``io_timeout_s`` after its first byte
    raises :class:`_Stalled`."""

    def __init__(self, sock, max_frame_bytes, io_timeout_s):
        self._sock = sock
        self._max = max_frame_bytes
        self._io_timeout = io_timeout_s
        self._buf = b""  # received bytes from _pos on are unread (bytes, or a bytearray while a frame spans reads)
        self._pos = 0
        self._started = None  # monotonic time of the first byte of the frame being read
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._recv_timeout = 0.0  # the socket's SO_RCVTIMEO (0: none)

    def _wait_at_most(self, seconds):
        """Make a blocking recv give up after about ``seconds`` (0: never). Changed only when
        off by more than 1% (or 2 ms), so asks with the usual timeout cost no extra call."""
        current = self._recv_timeout
        if seconds == 0.0:
            if current == 0.0:
                return
        elif current != 0.0 and seconds * 0.5 <= current <= seconds + max(0.002, seconds * 0.01):
            return
        seconds = max(seconds, 0.001) if seconds else 0.0  # a zero timeval would mean "no timeout"
        whole = int(seconds)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                              struct.pack("ll", whole, int((seconds - whole) * 1e6)))
        self._recv_timeout = seconds

    def has_frame(self):
        """Whether a whole frame is already buffered (read() would not wait)."""
        buf, pos = self._buf, self._pos
        have = len(buf) - pos
        return have >= 4 and have >= 4 + _unpack_u32(buf, pos)[0]

    def read(self, deadline=None):
        """The next frame's body, or None once ``deadline`` (monotonic; None: none) passed.
        EOFError at the end of the stream. Frames that came in one ``recv`` are sliced out
        of it one by one (one copy each); only a frame spread over several reads is gathered."""
        while True:
            buf, pos = self._buf, self._pos
            have = len(buf) - pos
            if have >= 4:
                size = _unpack_u32(buf, pos)[0]
                if size > self._max:
                    raise RpcProtocolError(f"frame of {size} bytes exceeds the limit of {self._max} bytes")
                end = pos + 4 + size
                if have >= 4 + size:
                    if end < len(buf):
                        self._pos, self._started = end, time.monotonic()
                    else:  # all read: let go of the buffer (it may be a large one)
                        self._buf, self._pos, self._started = b"", 0, None
                    return buf[pos + 4:end]
                need = 4 + size - have
            else:
                need = 4 - have
            if have:  # in the middle of a frame: it must complete within the io timeout
                if self._started is None:
                    self._started = time.monotonic()
                until, stalling = self._started + self._io_timeout, True
                if deadline is not None and deadline < until:
                    until, stalling = deadline, False
                remaining = until - time.monotonic()
                if remaining <= 0 or not self._poll.poll(int(remaining * 1000) + 1):
                    if time.monotonic() < until:
                        continue  # poll rounds down on some kernels; wait out the rest
                    if stalling:
                        raise _Stalled(f"frame incomplete {self._io_timeout:g} s after its first byte "
                                       f"({have} bytes received)")
                    return None
            elif deadline is not None:  # between frames, an asker waits in recv itself (one call, not two)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._wait_at_most(remaining)
            elif self._recv_timeout:
                self._wait_at_most(0.0)
            try:
                data = self._sock.recv(max(need, 65536))
            except BlockingIOError:  # SO_RCVTIMEO ran out: look at the deadline again
                continue
            if not data:
                raise EOFError("connection closed" + (f" in the middle of a frame ({have} bytes)" if have else ""))
            if not have:
                self._buf = data  # no copy
            else:
                rest = buf[pos:] if pos else buf
                if type(rest) is not bytearray:
                    rest = bytearray(rest)
                rest += data
                self._buf = rest
            self._pos = 0


# -- client side -------------------------------------------------------------------------------

class _Call:
    """An ask waiting while another thread reads the connection. ``waiter`` is held until
    the call is woken: its reply arrived, the connection broke, or it is its turn to read."""

    __slots__ = ("waiter", "done", "envelope")

    def __init__(self):
        self.waiter = threading.Lock()
        self.waiter.acquire()
        self.done = False
        self.envelope = None  # the _Reply or _Error


# The server closed its end (Linux reports it as POLLRDHUP; elsewhere only a full hang-up shows).
_HANGUP_EVENTS = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


class _ClientConnection:
    """One authenticated connection to one endpoint of a server, shared by every ref of a
    pool to it.

    Writes: one thread writes at a time (``_writing``); a frame that comes while another
    thread is writing is left in ``_outbox``, and the writer sends everything left there
    with its next ``sendall`` before it lets go, so concurrent callers share system calls
    and frames keep the order in which they were handed over. Reads: asking threads take
    turns as the reader (``_reading``): the reader hands each reply to its call and wakes
    that thread, and when its own reply arrives (or its deadline passes) it wakes another
    waiting call to take over. A lone asker is its own reader and never waits on a lock.
    ``_lock`` guards all of this. The socket is closed only when nobody writes or reads it
    (never under a running system call).

    Flow control: a send that finds ``max_outbox_bytes`` or more in the outbox waits
    (``_room``) until the writer takes the outbox, at most ``io_timeout_s``; so a server that
    falls behind slows its senders down instead of letting the outbox grow. Asks do not
    wait for room (each asking thread adds one frame at most, and its own timeout applies).
    A writer that finds senders waiting for room when it is done with a batch leaves the
    writing to one of them, so no caller writes for the others for ever.
    """

    def __init__(self, sock, address, peer_max_frame, max_frame_bytes, io_timeout_s,
                 max_outbox_bytes=DEFAULT_MAX_OUTBOX_BYTES):
        self.address = address
        self.peer_max_frame = peer_max_frame
        self._sock = sock
        self._reader = _FrameReader(sock, max_frame_bytes, io_timeout_s)
        self._hangup = select.poll()  # only used by the writer
        self._hangup.register(sock, _HANGUP_EVENTS)
        self._io_timeout = io_timeout_s
        self._max_outbox = max_outbox_bytes
        self._lock = threading.Lock()
        self._outbox = []  # frames waiting for the current writer
        self._outbox_bytes = 0
        self._room = threading.Condition(self._lock)  # senders waiting for the outbox to have room
        self._room_waiters = 0
        self._writing = False
        self._stalled = False  # the connection broke because the server read nothing for io_timeout_s
        self._calls = {}  # request id -> _Call, for asks waiting while another thread reads
        self._reading = False
        self._error = None  # why the connection is unusable, once it is
        self._closed = False

    @classmethod
    def open(cls, address, authkey, max_frame_bytes, io_timeout_s, connect_timeout_s, handshake_timeout_s,
             max_outbox_bytes=DEFAULT_MAX_OUTBOX_BYTES):
        where = _where(address)
        try:
            sock = socket.create_connection(address, timeout=connect_timeout_s)
        except OSError as e:
            raise RpcConnectionError(f"cannot connect to the RPC server at {where}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer_max = _client_handshake(sock, authkey, max_frame_bytes, time.monotonic() + handshake_timeout_s)
            _tune(sock, io_timeout_s)
        except AuthenticationError as e:
            sock.close()
            raise AuthenticationError(f"RPC handshake with {where} failed: {e}") from None
        except RpcProtocolError as e:
            sock.close()
            raise RpcConnectionError(f"RPC handshake with {where} failed: {e}") from None
        except (OSError, EOFError) as e:
            sock.close()
            raise RpcConnectionError(f"RPC handshake with {where} failed: {e or type(e).__name__}") from None
        return cls(sock, address, peer_max, max_frame_bytes, io_timeout_s, max_outbox_bytes)

    @property
    def usable(self):
        return self._error is None

    def send(self, frame, wait_for_room=True):
        """Write one frame, or hand it to the thread that is writing; with ``wait_for_room``
        (sends; not asks) first wait while the outbox is full. _NotSent if it was not
        written (safe to retry elsewhere); _Backlogged if the server did not take earlier
        frames in time."""
        waited_since = None
        with self._lock:
            while True:
                if self._error is not None:
                    if waited_since is not None and self._stalled:
                        raise _Backlogged(self._stall_message())
                    raise _NotSent(self._error)
                if not self._writing:
                    self._writing = True
                    if self._outbox:  # left by a writer that handed the writing over: those go first
                        self._outbox.append(frame)
                        data = self._take_outbox()
                    else:
                        data = frame
                    break
                if not wait_for_room or self._outbox_bytes < self._max_outbox:
                    self._outbox.append(frame)
                    self._outbox_bytes += len(frame)
                    return
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                elif now - waited_since >= self._io_timeout:
                    raise _Backlogged(
                        f"the connection's outbox still held {self._outbox_bytes} bytes of earlier messages "
                        f"(bound: {self._max_outbox} bytes) after {self._io_timeout:g} s: the server is not "
                        f"taking messages as fast as they are sent; this one was not sent")
                self._room_waiters += 1
                try:
                    self._room.wait(waited_since + self._io_timeout - now)
                finally:
                    self._room_waiters -= 1
        own = True
        try:
            if self._hangup.poll(0):  # the server hung up (it restarted, say): do not write into the void
                raise _NotSent("the server closed the connection")
            while True:
                self._sock.sendall(data)
                own = False
                with self._lock:
                    if not self._outbox or self._room_waiters:
                        self._writing = False
                        if self._outbox:  # a sender waiting for room takes over (it writes these first)
                            self._room.notify()
                        break
                    data = self._take_outbox()
            if self._error is not None:  # broken (closed, say) while we wrote: nobody else closes it
                self._close_if_idle()
        except _NotSent as e:
            self._fail(str(e.args[0]), writer=True)
            raise
        except OSError as e:
            stalled = isinstance(e, (BlockingIOError, socket.timeout))  # SO_SNDTIMEO ran out
            self._fail(f"write failed: {e}", writer=True, stalled=stalled)
            if own:  # our frame did not get out whole
                if stalled:  # not retried: frames ahead of it are lost
                    raise _Backlogged(self._stall_message()) from None
                raise _NotSent(e) from e  # the caller may retry it
            # frames handed to us are lost with the connection: their asks see it while waiting
        except BaseException:  # interrupted mid-write: the stream may hold half a frame
            self._fail("interrupted while writing", writer=True)
            raise

    def _take_outbox(self):
        """The outbox's frames as one buffer (lock held); senders waiting for room may go on."""
        data = b"".join(self._outbox)
        self._outbox.clear()
        self._outbox_bytes = 0
        if self._room_waiters:
            self._room.notify_all()
        return data

    def _stall_message(self):
        return (f"the server read nothing for {self._io_timeout:g} s (outbox bound: {self._max_outbox} bytes); "
                f"the connection was dropped and the messages still in it are lost")

    def ask(self, request_id, frame, deadline):
        """Send an ask and wait for its reply (a _Reply or an _Error), or None if ``deadline`` passed.
        _NotSent if it could not be written; RpcConnectionError if the connection broke after."""
        with self._lock:
            if self._error is not None:
                raise _NotSent(self._error)
            if self._reading:
                call = self._calls[request_id] = _Call()
            else:
                self._reading = True  # a lone asker: read for ourselves, no _Call needed
                call = None
        try:
            self.send(frame, wait_for_room=False)
        except (_NotSent, _Backlogged):
            self._finish(request_id, call, call is None)
            raise
        if call is None:
            return self._lead(request_id, None, deadline)
        return self._follow(request_id, call, deadline)

    def _follow(self, request_id, call, deadline):
        """Wait for a reply read by another thread, or for our turn to read."""
        lead = False
        try:
            while True:
                with self._lock:
                    if call.done:
                        return call.envelope
                    if self._error is not None:
                        raise self._lost()
                    if not self._reading:
                        self._reading = lead = True
                        break
                if deadline is None:
                    call.waiter.acquire()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    call.waiter.acquire(timeout=remaining)
        finally:
            if not lead:
                self._finish(request_id, call, False)
        return self._lead(request_id, call, deadline)

    def _lead(self, request_id, call, deadline):
        """As the reader: hand out replies until ours is in or ``deadline`` passes."""
        reader, calls, lock = self._reader, self._calls, self._lock
        try:
            if call is not None and call.done:  # the previous reader got ours before handing over
                return call.envelope
            while True:
                body = reader.read(deadline)
                if body is None:
                    return None
                try:
                    envelope = _client_envelopes.decode(body)
                except _DECODE_ERRORS as e:
                    raise _undecodable(e, "a frame does not decode as a reply") from None
                if type(envelope) is _Error and envelope.error == _REFUSED and not envelope.remote_type:
                    self._fail("the server dropped it")  # its last word (see _Dispatcher._handle): no more traffic
                rid = envelope.request_id
                if rid == request_id:
                    return envelope
                with lock:
                    target = calls.get(rid)
                    if target is None:
                        log.debug("dropped a late reply from %s (the ask had timed out)", _where(self.address))
                        continue
                    target.done, target.envelope = True, envelope
                    if target.waiter.locked():
                        target.waiter.release()
        except (OSError, EOFError, RpcProtocolError, _Stalled) as e:
            self._fail(str(e) or type(e).__name__)
            raise self._lost() from None
        finally:
            self._finish(request_id, call, True)

    def _finish(self, request_id, call, was_reading):
        """Leave: unregister the call; a reader hands the socket to a waiting call."""
        with self._lock:
            if call is not None:
                self._calls.pop(request_id, None)
            if was_reading:
                self._reading = False
                for other in self._calls.values():
                    if not other.done:
                        if other.waiter.locked():
                            other.waiter.release()
                        break
        if was_reading and self._error is not None:
            self._close_if_idle()

    def _lost(self):
        return RpcConnectionError(f"connection to {_where(self.address)} lost while waiting for a reply "
                                  f"({self._error}); the message may or may not have been handled")

    def _fail(self, reason, writer=False, stalled=False):
        """Mark the connection broken, wake every waiting call and sender, and stop all
        traffic (``writer``: called by the writing thread, which lets go of the socket;
        ``stalled``: the server read nothing for io_timeout_s)."""
        with self._lock:
            if self._error is None:
                self._error, self._stalled = reason, stalled
                log.debug("RPC connection to %s is unusable: %s", _where(self.address), reason)
            if writer:
                self._writing = False
            self._outbox.clear()
            self._outbox_bytes = 0
            self._room.notify_all()
            for call in self._calls.values():
                if call.waiter.locked():
                    call.waiter.release()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv, a writer blocked in send
        except OSError:
            pass
        self._close_if_idle()

    def _close_if_idle(self):
        with self._lock:
            if self._error is not None and not self._reading and not self._writing and not self._closed:
                self._closed = True
                self._sock.close()

    def close(self):
        self._fail("closed")


class _Slot:
    __slots__ = ("lock", "conn")

    def __init__(self):
        self.lock = threading.Lock()
        self.conn = None


class _ConnectionPool:
    """The client connections of one RpcEnv (or of the process): one per (address, authkey,
    endpoint name), so that a slow handler never holds up messages to another endpoint."""

    def __init__(self, max_frame_bytes=DEFAULT_MAX_FRAME_BYTES, io_timeout_s=DEFAULT_IO_TIMEOUT_S,
                 connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S, handshake_timeout_s=DEFAULT_HANDSHAKE_TIMEOUT_S,
                 owner=None, max_outbox_bytes=DEFAULT_MAX_OUTBOX_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self.max_outbox_bytes = max_outbox_bytes
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.owner = owner  # what shut it down, for the error message
        self._lock = threading.Lock()
        self._slots = {}
        self._closed = False
        _pools.add(self)

    def get(self, address, authkey, name, deadline):
        key = (address, authkey, name)
        slot = self._slots.get(key)
        if slot is not None:
            conn = slot.conn
            if conn is not None and conn.usable:
                return conn
        with self._lock:
            if self._closed:
                raise RpcError(f"{self.owner} was shut down; its refs cannot be used any more")
            slot = self._slots.setdefault(key, _Slot())
        with slot.lock:  # one connect per server at a time; other servers are not held up
            conn = slot.conn
            if conn is not None and conn.usable:
                return conn
            if conn is not None:
                conn.close()
            timeout = self.connect_timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise RpcTimeoutError(f"no connection to {_where(address)} before the ask's deadline")
            conn = _ClientConnection.open(address, authkey, self.max_frame_bytes, self.io_timeout_s, timeout,
                                          min(timeout, self.handshake_timeout_s), self.max_outbox_bytes)
            with self._lock:
                if self._closed:
                    conn.close()
                    raise RpcError(f"{self.owner} was shut down; its refs cannot be used any more")
                slot.conn = conn
            return conn

    def close(self):
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            if slot.conn is not None:
                slot.conn.close()

    def reset(self):
        """Close every connection; the pool stays usable and reconnects on demand."""
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            if slot.conn is not None:
                slot.conn.close()


_pools = weakref.WeakSet()  # every pool, for the fork handler
_default_pool = _ConnectionPool(owner="the process's connection pool")


def _forget_connections_after_fork():
    """In a forked child: every inherited connection is the parent's. Close our copy of each
    descriptor (never shut the connection down) and mark it dead, so that no ref writes
    into it, or into whatever reuses the descriptor number; refs reconnect on next use.
    Locks may be held by threads that do not exist here: everything is replaced, not taken."""
    for pool in list(_pools):
        slots, pool._slots, pool._lock = pool._slots, {}, threading.Lock()
        for slot in slots.values():
            conn = slot.conn
            if conn is not None:
                conn._error, conn._closed, conn._lock = "inherited across fork", True, threading.Lock()
                conn._room = threading.Condition(conn._lock)
                conn._sock.close()


os.register_at_fork(after_in_child=_forget_connections_after_fork)


def close_connections():
    """Close this process's shared client connections (those of module-level refs); refs
    reconnect on their next message."""
    _default_pool.reset()


class RpcEndpointRef:
    """A handle on a named endpoint of a server: ``address``, ``name`` and ``authkey``.

    Thread-safe; pickles as those three attributes only and connects lazily where it is
    unpickled (through the process's shared connections)."""

    def __init__(self, address, name, authkey, _pool=None):
        self.address = _normalize_address(address)
        self.name = _check_name(name)
        self.authkey = _normalize_authkey(authkey)
        self._pool = _pool
        self._conn = None  # the pool's connection, kept while it works (saves a look-up per message)

    def __reduce__(self):
        return (RpcEndpointRef, (self.address, self.name, self.authkey))

    def __repr__(self):
        return f"RpcEndpointRef({self.name!r} at {_where(self.address)})"  # never the authkey

    def __eq__(self, other):
        return (isinstance(other, RpcEndpointRef) and (self.address, self.name, self.authkey) ==
                (other.address, other.name, other.authkey))

    def __hash__(self):
        return hash((self.address, self.name))

    def send(self, message):
        """Deliver ``message`` to the endpoint's ``receive``; returns once it is written, or
        handed to the connection's writer. Waits while the connection's outbox is full (see
        "Flow control" in the module docstring); RpcTimeoutError if it stays full.

        ``message``: a Struct of the endpoint's ``message_type``, or a plain value (see
        "Messages" in the module docstring: TypeError for anything else, before sending).
        At most once: see the module docstring for the case where a send is lost."""
        check_value(message)
        frame = _frame(_Send(self.name, message))
        for attempt in (0, 1):
            conn = self._connection(frame, None, attempt)
            if conn is None:
                continue
            try:
                conn.send(frame)
                return
            except _NotSent as e:
                if attempt:
                    raise RpcConnectionError(f"cannot send to {self!r}: {e}") from None
            except _Backlogged as e:
                raise RpcTimeoutError(f"cannot send to {self!r}: {e}") from None

    def ask(self, message, timeout_s=30.0, reply_type=Any):
        """The endpoint's ``receive_and_reply(message)``, as ``reply_type`` (``Any``: plain
        values; RpcProtocolError if it is not one). RpcError if the handler
        raised (naming its exception; a class of ``statecore.errors.REMOTE_ERRORS`` keeps
        its type), RpcTimeoutError after ``timeout_s`` (None: wait for ever). ``message``
        as for :meth:`send`."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        check_value(message)
        request_id = next(_request_ids)
        frame = _frame(_Ask(request_id, self.name, message))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for attempt in (0, 1):
            conn = self._connection(frame, deadline, attempt)
            if conn is None:
                continue
            try:
                result = conn.ask(request_id, frame, deadline)
                break
            except _NotSent as e:  # not written: safe to try a new connection
                if attempt:
                    raise RpcConnectionError(f"cannot ask {self!r}: {e}") from None
            except _Backlogged as e:
                raise RpcTimeoutError(f"cannot ask {self!r}: {e}") from None
        if result is None:
            raise RpcTimeoutError(f"no reply from {self!r} within {timeout_s:g} s")
        if type(result) is _Error:
            raise _remote_error(self, result)
        if reply_type is Any:
            return result.value
        try:
            return msgspec.convert(result.value, reply_type)  # as strict as decoding it as that type
        except msgspec.ValidationError as e:
            raise RpcProtocolError(f"the reply of {self!r} does not decode as {reply_type!r}: {e}") from None

    def _connection(self, frame, deadline, attempt):
        """The pooled connection; None if the first attempt to connect failed (one retry)."""
        conn = self._conn
        if conn is None or conn._error is not None:
            pool = self._pool or _default_pool
            try:
                conn = self._conn = pool.get(self.address, self.authkey, self.name, deadline)
            except RpcConnectionError:
                if attempt:
                    raise
                return None
        if len(frame) - 4 > conn.peer_max_frame:
            raise ValueError(f"message of {len(frame) - 4} bytes exceeds the frame limit of {conn.peer_max_frame} "
                             f"bytes of the server at {_where(self.address)}")
        return conn


def _remote_error(ref, error):
    """The exception an error reply stands for: the registered class it names, else RpcError."""
    cls = REMOTE_ERRORS.get(error.error, RpcError)
    if error.remote_type:
        err = cls(f"{ref!r} raised {error.remote_type}: {error.text}")
        err.remote_type, err.remote_traceback = error.remote_type, error.traceback
    else:
        err = cls(error.text)
    return err


def endpoint_ref(address, name, authkey):
    """A ref to endpoint ``name`` of the server at ``address`` (a ``(host, port)`` pair), for a
    process that runs no RpcEnv; its connection is shared with the process's other refs."""
    return RpcEndpointRef(address, name, authkey)


# -- server side -------------------------------------------------------------------------------

class RpcEndpoint:
    """Base class of what an RpcEnv hosts. One message at a time, in each sender's order.

    ``message_type`` is what its messages are decoded as before they reach ``receive`` or
    ``receive_and_reply``: plain values (``Any``) unless a subclass declares the union of
    its :class:`Message` Structs. A message that does not decode as it drops its connection
    (see "Messages" in the module docstring)."""

    message_type = Any

    def receive(self, message):
        """A one-way message (``send``)."""
        log.warning("%s ignored a one-way message of type %s", type(self).__name__, type(message).__name__)

    def receive_and_reply(self, message):
        """An ``ask``: return the reply value; an exception goes back to the asker as RpcError."""
        raise NotImplementedError(f"{type(self).__name__} does not answer asks")

    def on_stop(self):
        """Called once the endpoint is stopped, after the messages queued before that."""


_PENDING_BYTES = 2**18  # a reader writes the replies it holds once they come to this much
_INLINE_DRAIN = 16  # queued messages a reader handles after its own before leaving the rest to the thread


class _ServerConnection:
    """A client's connection as the server sees it, and the replies not yet written to it.

    A reply must never wait for its peer: the thread that makes it runs a handler and holds
    the endpoint, so one peer that does not read would hold up every client of that
    endpoint. Replies are written with non-blocking sends; what the socket does not take
    stays in ``backlog``, and the env's :class:`_ReplyWriter` writes it as the peer reads.
    A peer is dropped (logged; its socket shut down, so its reader sees the end and closes
    it) when a reply comes while ``max_reply_backlog_bytes`` or more wait for it, when it
    takes none of its backlog for ``io_timeout_s``, or when one of its frames does not
    decode; its messages still queued are then not handled. Replies made by the
    connection's own reader are held until it has no further frame in hand (or holds
    ``_PENDING_BYTES``), then written together: frames that arrived together are answered
    with one write."""

    __slots__ = ("sock", "peer", "peer_max_frame", "env", "lock", "closed", "dropped", "broken", "reader_ident",
                 "pending", "pending_bytes", "backlog", "backlog_bytes", "progress_at")

    def __init__(self, sock, peer, peer_max_frame, env):
        self.sock, self.peer, self.peer_max_frame, self.env = sock, peer, peer_max_frame, env
        self.lock = threading.Lock()  # guards the socket's writing, the backlog and closing
        self.closed = False
        self.dropped = False  # the server hung up on it (see the class)
        self.broken = False  # a write failed (the peer is gone): replies are discarded
        self.reader_ident = threading.get_ident()
        self.pending = []  # the reader's own replies, not yet handed to send()
        self.pending_bytes = 0
        self.backlog = []  # what the socket did not take, oldest first
        self.backlog_bytes = 0
        self.progress_at = 0.0  # when the peer last took some of the backlog (monotonic)

    def reply(self, frame):
        """Send ``frame``, or hold it if the reader itself made it; False if the peer is gone."""
        if self.reader_ident == threading.get_ident():
            self.pending.append(frame)
            self.pending_bytes += len(frame)
            if len(self.pending) >= 64 or self.pending_bytes >= _PENDING_BYTES:
                self.flush()
            return True
        return self.send(frame)

    def flush(self):
        frames, self.pending, self.pending_bytes = self.pending, [], 0
        self.send(frames[0] if len(frames) == 1 else b"".join(frames))

    def send(self, data):
        """Write ``data`` (whole frames) without waiting; the rest goes to the backlog, for
        the env's reply writer. False if the peer is gone (or dropped now: see the class)."""
        with self.lock:
            if self.closed or self.dropped or self.broken:
                return False
            if self.backlog:
                bound = self.env.max_reply_backlog_bytes
                if self.backlog_bytes >= bound:
                    self._drop(f"it left {self.backlog_bytes} bytes of replies unread (bound: {bound} bytes)")
                    return False
                self.backlog.append(data)
                self.backlog_bytes += len(data)
                return True
            try:
                sent = self.sock.send(data, _DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._break(e)
                return False
            if sent == len(data):
                return True
            self.backlog.append(memoryview(data)[sent:])
            self.backlog_bytes = len(data) - sent
            self.progress_at = time.monotonic()
        self.env._writer.watch(self)
        return True

    def write_backlog(self, now):
        """(The reply writer) Write what the socket takes of the backlog, without copying it
        (one ``sendmsg`` of its pieces). ``(fd, deadline)`` to wait on while some is left,
        None once it is all written or the peer is dropped."""
        with self.lock:
            backlog = self.backlog
            if self.closed or self.dropped or self.broken or not backlog:
                return None
            try:
                sent = self.sock.sendmsg(backlog[:_IOV_MAX], (), _DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._break(e)
                return None
            if sent:
                self.progress_at = now
                self.backlog_bytes -= sent
                done = 0
                while done < len(backlog) and sent >= len(backlog[done]):
                    sent -= len(backlog[done])
                    done += 1
                del backlog[:done]
                if sent:
                    backlog[0] = memoryview(backlog[0])[sent:]
                if not backlog:
                    return None
            timeout = self.env.io_timeout_s
            if now - self.progress_at >= timeout:
                self._drop(f"it read none of its replies for {timeout:g} s ({self.backlog_bytes} bytes unsent)")
                return None
            return self.sock.fileno(), self.progress_at + timeout

    def drop(self, reason, last_frame=None):
        with self.lock:
            if not self.closed:
                self._drop(reason, last_frame)

    def _drop(self, reason, last_frame=None):
        """(Lock held) Hang up on the peer: no more replies, its queued messages are skipped.
        ``last_frame`` (an error reply) is written first (after the log record) if the socket
        takes it at once and no earlier reply still waits; else it is lost."""
        if not self.dropped:
            self.dropped = True
            log.warning("RPC server on %s dropped %s: %s", self.env._where, _where(self.peer), reason)
            if last_frame is not None and not (self.broken or self.backlog):
                try:
                    self.sock.send(last_frame, _DONTWAIT)
                except OSError:
                    pass
        self._hang_up()

    def _break(self, error):
        """(Lock held) A write failed: the stream may end in half a frame, so nothing more
        is written; its queued messages are still handled, as the peer sent them."""
        self.broken = True
        log.debug("RPC server on %s cannot reply to %s any more: %s", self.env._where, _where(self.peer), error)
        self._hang_up()

    def _hang_up(self):
        """(Lock held) Forget the backlog; the reader sees the end of the stream and closes it."""
        self.backlog, self.backlog_bytes = [], 0
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self):
        with self.lock:  # never while another thread writes to it
            if not self.closed:
                self.closed = True
                self.backlog, self.backlog_bytes = [], 0
                self.sock.close()


class _ReplyWriter:
    """The env's thread that writes the replies a connection's socket did not take at once
    (see _ServerConnection) as each peer reads them, and drops the peers that read none
    for ``io_timeout_s``. It waits only in ``poll``, so no peer can hold it up."""

    def __init__(self, name):
        self._lock = threading.Lock()
        self._handed = set()  # connections with a backlog, handed over since the last round
        self._stopped = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def watch(self, conn):
        with self._lock:
            self._handed.add(conn)
        self._wake()

    def _wake(self):
        try:
            self._wake_w.send(b"x")
        except OSError:  # the pipe is full (a wake-up is pending anyway), or it was closed
            pass

    def stop(self):
        with self._lock:
            self._stopped = True
        self._wake()
        _join(self.thread, "the reply writer")
        self._wake_r.close()
        self._wake_w.close()

    def _run(self):
        waiting = set()
        wake_fd = self._wake_r.fileno()
        while True:
            with self._lock:
                if self._stopped:
                    return
                waiting |= self._handed
                self._handed = set()
            poller = select.poll()
            poller.register(wake_fd, select.POLLIN)
            now, until = time.monotonic(), None
            for conn in list(waiting):
                try:
                    wait = conn.write_backlog(now)
                except Exception as e:  # a bug: drop that peer, keep writing to the others
                    log.exception("RPC reply writer failed on a connection")
                    conn.drop(f"its replies could not be written: {e!r}")
                    wait = None
                if wait is None:
                    waiting.discard(conn)
                else:
                    poller.register(wait[0], select.POLLOUT)
                    until = wait[1] if until is None else min(until, wait[1])
            timeout = None if until is None else max(0, int((until - time.monotonic()) * 1000) + 1)
            for fd, _events in poller.poll(timeout):
                if fd == wake_fd:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:
                        pass


class _Dispatcher:
    """An endpoint and what runs its handlers: one message at a time, in arrival order.

    A connection's reader hands its message straight to the handler when the endpoint is
    idle and nothing is queued (no thread hop: the common case), then handles up to
    ``_INLINE_DRAIN`` messages that were queued meanwhile. A message that finds the
    endpoint busy is queued, and the endpoint's own thread works through whatever a reader
    leaves. Since a reader only goes straight in when the queue is empty, messages are
    handled in the order they arrived, so in each connection's order.

    Messages are queued as they came in (envelopes whose message is still encoded: a
    ``msgspec.Raw`` view of the frame), and decoded as the endpoint's ``message_type`` only
    by the thread that handles them: a value can decode to many times its encoded size, and
    this way what the queue holds is what the bytes bound says, and one decoded message per
    endpoint exists at a time.

    At most ``max_queued`` messages, and ``max_queued_bytes`` bytes (the last message may
    pass it), of one connection are queued: a reader whose connection is at either bound
    waits (``room``) until both are down to half, reading nothing meanwhile, so its client
    is held back by TCP. The bounds are per connection, not in total, so a flooding client
    fills only its own share: another client's ask waits behind at most that share of each
    connection, never for ever. Waiting until half are handled (not just one) lets the
    reader come back for a batch, not for every message.
    """

    def __init__(self, name, endpoint, where, max_queued=DEFAULT_MAX_QUEUED_MESSAGES,
                 max_queued_bytes=DEFAULT_MAX_QUEUED_BYTES):
        self.name, self.endpoint, self.where = name, endpoint, where
        self.decoder = _decoder(getattr(endpoint, "message_type", Any))
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.room = threading.Condition(self.lock)  # readers waiting for their connection's share to drain
        self.room_waiters = 0
        self.queue = collections.deque()  # (connection, envelope, frame size)
        self.queued_from = {}  # connection -> [messages, bytes] of it in the queue
        self.max_queued, self.max_queued_bytes = max_queued, max_queued_bytes
        self.resume_at, self.resume_bytes = max_queued // 2, max_queued_bytes // 2
        self.queue_peak = 0  # the longest the queue has been (for tests and benchmarks)
        self.queue_bytes = 0  # bytes of the queued bodies, now and at most (for tests)
        self.queue_bytes_peak = 0
        self.busy = False  # a thread is handling a message
        self.stopped = False
        self.handler_ident = None  # the thread running a handler now
        self.thread = threading.Thread(target=self._run, name=f"statecore-rpc-endpoint-{name}", daemon=True)

    def _below_resume(self, conn):
        share = self.queued_from.get(conn)
        return share is None or (share[0] <= self.resume_at and share[1] <= self.resume_bytes)

    def deliver(self, conn, envelope, size):
        """Handle (or queue) one envelope of ``conn`` (a frame of ``size`` bytes). Waits while
        ``conn``'s share of the queue is at a bound. False once the endpoint is stopped."""
        with self.lock:
            while True:
                if self.stopped:
                    return False
                if conn.dropped:  # skipped like its queued messages
                    return True
                if not (self.busy or self.queue):
                    self.busy = True
                    break
                share = self.queued_from.get(conn)
                if share is None or (share[0] < self.max_queued and share[1] < self.max_queued_bytes):
                    if share is None:
                        self.queued_from[conn] = [1, size]
                    else:
                        share[0] += 1
                        share[1] += size
                    queue = self.queue
                    queue.append((conn, envelope, size))
                    self.queue_bytes += size
                    if len(queue) > self.queue_peak:
                        self.queue_peak = len(queue)
                    if self.queue_bytes > self.queue_bytes_peak:
                        self.queue_bytes_peak = self.queue_bytes
                    if not self.busy:
                        self.wakeup.notify()
                    return True
                if conn.pending:  # replies the reader holds go out before it waits
                    self.lock.release()
                    try:
                        conn.flush()
                    finally:
                        self.lock.acquire()
                    continue
                self.room_waiters += 1
                try:
                    self.room.wait_for(lambda: self._below_resume(conn) or self.stopped or conn.dropped)
                finally:
                    self.room_waiters -= 1
        item, drained = (conn, envelope), 0
        try:
            while True:
                self._handle(*item)
                with self.lock:
                    if not self.queue or drained == _INLINE_DRAIN:
                        self.busy = False
                        if self.queue or self.stopped:
                            self.wakeup.notify()
                        return True
                    item = self._pop()[:2]
                drained += 1
        except BaseException:
            with self.lock:
                self.busy = False
                self.wakeup.notify()
            raise

    def stop(self):
        """Refuse new messages (readers waiting for room give theirs up); the thread handles
        the queued ones, then calls ``on_stop``."""
        with self.lock:
            self.stopped = True
            self.wakeup.notify()
            self.room.notify_all()

    def _pop(self):
        """The oldest queued message (lock held); wakes the readers waiting for room if its
        connection's share just came down to the resume point."""
        item = self.queue.popleft()
        conn, size = item[0], item[2]
        share = self.queued_from[conn]
        was_above = share[0] > self.resume_at or share[1] > self.resume_bytes
        share[0] -= 1
        share[1] -= size
        self.queue_bytes -= size
        if not share[0]:
            del self.queued_from[conn]
        if was_above and self.room_waiters and share[0] <= self.resume_at and share[1] <= self.resume_bytes:
            self.room.notify_all()
        return item

    def in_handler(self):
        return self.handler_ident == threading.get_ident() or self.thread is threading.current_thread()

    def _run(self):
        with self.lock:
            while True:
                if self.queue and not self.busy:
                    item = self._pop()[:2]
                    self.busy = True
                    self.lock.release()
                    try:
                        self._handle(*item)
                    finally:
                        item = None
                        self.lock.acquire()
                        self.busy = False
                elif self.stopped and not self.busy:
                    break
                else:
                    self.wakeup.wait()
        on_stop = getattr(self.endpoint, "on_stop", None)
        if on_stop is not None:
            try:
                on_stop()
            except Exception:
                log.exception("on_stop of endpoint %r at %s failed", self.name, self.where)

    def _handle(self, conn, envelope):
        if conn.dropped:  # the server hung up on it: what it sent is not handled
            return
        asking = type(envelope) is _Ask
        try:
            message = self.decoder.decode(envelope.message)
        except _DECODE_ERRORS as e:
            reason = str(_undecodable(e, f"a message to {self.name!r} is not one {type(self.endpoint).__name__} takes"))
            refusal = None
            if asking:  # remote_type "": the RPC layer's own; with this name, the asker's connection is done
                refusal = _error_frame(envelope.request_id, _REFUSED, "", f"{reason} (the server at {self.where} "
                                       f"dropped the connection)", limit=conn.peer_max_frame)
            conn.drop(reason, refusal)
            return
        self.handler_ident = threading.get_ident()
        try:
            if not asking:
                try:
                    self.endpoint.receive(message)
                except Exception:
                    log.exception("endpoint %r at %s failed to handle a one-way message", self.name, self.where)
                return
            request_id = envelope.request_id
            try:
                reply = self.endpoint.receive_and_reply(message)
                check_value(reply)
                frame = _frame(_Reply(request_id, reply))
                if len(frame) - 4 > conn.peer_max_frame:
                    raise ValueError(f"reply of {len(frame) - 4} bytes exceeds the asker's frame limit of "
                                     f"{conn.peer_max_frame} bytes")
            except Exception as e:
                log.debug("endpoint %r at %s raised for an ask", self.name, self.where, exc_info=True)
                frame = _error_frame(request_id, _REMOTE_NAMES.get(type(e), ""), _type_name(type(e)), str(e),
                                     traceback.format_exc(), conn.peer_max_frame)
            if not conn.reply(frame):
                log.debug("could not reply to %s: the asker is gone", _where(conn.peer))
        finally:
            self.handler_ident = None


_REMOTE_NAMES = {cls: name for name, cls in REMOTE_ERRORS.items()}  # the errors that cross the wire by name
_REFUSED = _REMOTE_NAMES[RpcProtocolError]


def _error_frame(request_id, error, remote_type, text, remote_traceback="", limit=_MIN_FRAME_BYTES):
    """An error reply, shortened until it fits the asker's frame ``limit``."""
    frame = _frame(_Error(request_id, error, remote_type, text[:16384], remote_traceback[-32768:]))
    if len(frame) - 4 > limit:
        frame = _frame(_Error(request_id, error[:200], remote_type[:200], text[:500], ""))
    return frame


class _AcceptFailed(Exception):
    """Internal: a connection could not be accepted, or its reader thread not started."""


class RpcEnv:
    """A TCP server hosting named endpoints, and the client connections of the refs it makes.

    Threads: one accepts connections, one per connection reads it (and runs handlers when
    their endpoint is idle), one per endpoint works through messages that found it busy,
    and one writes the replies that peers did not take at once (see _ServerConnection).

    ``max_frame_bytes`` bounds a frame either way, ``io_timeout_s`` how long a started frame
    (or a blocked write, or a send waiting for room in a full outbox, or a peer taking none
    of its unsent replies) may take, ``handshake_timeout_s`` how long a new peer may take to
    authenticate; a peer breaking any of them is disconnected and logged, others go on. Flow
    control (see the module docstring): ``max_queued_messages`` and ``max_queued_bytes``
    bound the messages of one client connection queued for one of this env's endpoints,
    ``max_reply_backlog_bytes`` the replies waiting for one client to read them (past it,
    the client is dropped), ``max_outbox_bytes`` the bytes waiting to be written on one of
    this env's own client connections.
    ``shutdown()`` (or leaving a ``with`` block) stops everything and joins every thread.
    """

    def __init__(self, host="127.0.0.1", port=0, authkey=None, *, max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
                 io_timeout_s=DEFAULT_IO_TIMEOUT_S, handshake_timeout_s=DEFAULT_HANDSHAKE_TIMEOUT_S,
                 connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S, max_queued_messages=DEFAULT_MAX_QUEUED_MESSAGES,
                 max_outbox_bytes=DEFAULT_MAX_OUTBOX_BYTES, max_queued_bytes=DEFAULT_MAX_QUEUED_BYTES,
                 max_reply_backlog_bytes=DEFAULT_MAX_REPLY_BACKLOG_BYTES):
        if not _MIN_FRAME_BYTES <= max_frame_bytes <= _MAX_U32:
            raise ValueError(f"max_frame_bytes must be in [{_MIN_FRAME_BYTES}, {_MAX_U32}], got {max_frame_bytes}")
        for arg, value in (("io_timeout_s", io_timeout_s), ("handshake_timeout_s", handshake_timeout_s),
                           ("connect_timeout_s", connect_timeout_s)):
            if not value > 0:
                raise ValueError(f"{arg} must be > 0, got {value!r}")
        for arg, value in (("max_queued_messages", max_queued_messages), ("max_outbox_bytes", max_outbox_bytes),
                           ("max_queued_bytes", max_queued_bytes),
                           ("max_reply_backlog_bytes", max_reply_backlog_bytes)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        self.max_queued_messages = max_queued_messages
        self.max_queued_bytes = max_queued_bytes
        self.max_reply_backlog_bytes = max_reply_backlog_bytes
        self.authkey = secrets.token_bytes(32) if authkey is None else _normalize_authkey(authkey)
        self.max_frame_bytes = max_frame_bytes
        self.io_timeout_s = io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        advertised = host if host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.address = (advertised, self._listener.getsockname()[1])
        self._where = _where(self.address)
        self._pool = _ConnectionPool(max_frame_bytes, io_timeout_s, connect_timeout_s, handshake_timeout_s,
                                     owner=f"RpcEnv({self._where})", max_outbox_bytes=max_outbox_bytes)
        self._lock = threading.Lock()
        self._endpoints = {}  # name -> _Dispatcher
        self._connections = {}  # accepted socket -> its reader thread
        self._served = {}  # peer address -> its _ServerConnection, once authenticated
        self._stopped = False
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._writer = _ReplyWriter(f"statecore-rpc-replies-{self.address[1]}")
        self._writer.thread.start()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"statecore-rpc-accept-{self.address[1]}",
                                          daemon=True)
        self._acceptor.start()
        log.info("RpcEnv listening on %s", self._where)

    def __repr__(self):
        return f"RpcEnv({self._where})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # endpoints

    def setup_endpoint(self, name, endpoint):
        """Register ``endpoint`` under ``name`` and return a ref to it.
        :class:`EndpointAlreadyRegisteredError` (a ValueError) if the name is taken."""
        _check_name(name)
        with self._lock:
            if self._stopped:
                raise RpcError(f"{self!r} was shut down")
            if name in self._endpoints:
                raise EndpointAlreadyRegisteredError(f"an endpoint named {name!r} is already registered at "
                                                     f"{self._where}")
            dispatcher = _Dispatcher(name, endpoint, self._where, self.max_queued_messages, self.max_queued_bytes)
            self._endpoints[name] = dispatcher
            dispatcher.thread.start()
        return RpcEndpointRef(self.address, name, self.authkey, _pool=self._pool)

    def endpoint_ref(self, address, name, authkey=None):
        """A ref to endpoint ``name`` at ``address`` (this env's authkey unless given),
        using this env's connections."""
        return RpcEndpointRef(address, name, self.authkey if authkey is None else authkey, _pool=self._pool)

    def queue_length(self, name):
        """(messages queued for endpoint ``name`` now, the most ever queued at once): for
        tests and benchmarks. Messages handled straight by a reader are never queued."""
        with self._lock:
            dispatcher = self._endpoints[name]
        with dispatcher.lock:
            return len(dispatcher.queue), dispatcher.queue_peak

    def stop_endpoint(self, name):
        """Unregister ``name`` at once; the messages queued before are handled, then
        ``on_stop`` runs. Waits for that unless called from the endpoint's own handler.
        Unknown names are ignored."""
        with self._lock:
            dispatcher = self._endpoints.pop(name, None)
        if dispatcher is not None:
            dispatcher.stop()
            if not dispatcher.in_handler():
                _join(dispatcher.thread, f"endpoint {name!r} to finish its messages")

    def shutdown(self):
        """Stop accepting, close every connection, stop every endpoint (queued messages are
        still handled, then ``on_stop``), close this env's client connections; joins every
        thread it started (but the calling one, if a handler calls it)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            dispatchers = list(self._endpoints.values())
            self._endpoints.clear()
        self._wake_w.send(b"x")
        _join(self._acceptor, "the accept thread")
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            connections = list(self._connections.items())
        for sock, _thread in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end and closes it
            except OSError:
                pass
        for dispatcher in dispatchers:
            dispatcher.stop()  # also lets go of readers waiting for room in its queue
        for _sock, thread in connections:
            _join(thread, "a connection's reader")
        for dispatcher in dispatchers:
            if not dispatcher.in_handler():
                _join(dispatcher.thread, f"endpoint {dispatcher.name!r} to finish its messages")
        self._writer.stop()
        self._pool.close()
        log.info("RpcEnv on %s shut down", self._where)

    # serving

    def _accept_loop(self):
        """The acceptor. When a connection cannot be taken (out of descriptors, say) or its
        reader thread cannot start (a thread limit), it closes what it got and stops
        accepting for a pause (``_ACCEPT_PAUSE_S``: doubling while failures go on), then
        carries on; the first failure is logged, then at most one warning every
        ``_ACCEPT_LOG_EVERY_S``. Connections coming meanwhile wait in the listen backlog."""
        pause, unlogged, logged_at, resume_at = 0.0, 0, None, None
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(self._listener, selectors.EVENT_READ)
            while True:
                timeout = None
                if resume_at is not None:
                    timeout = resume_at - time.monotonic()
                    if timeout <= 0:
                        selector.register(self._listener, selectors.EVENT_READ)
                        resume_at = timeout = None
                for key, _events in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        accepted = self._accept_one()
                    except _AcceptFailed as e:
                        unlogged += 1
                        pause = min(max(2 * pause, _ACCEPT_PAUSE_S[0]), _ACCEPT_PAUSE_S[1])
                        now = time.monotonic()
                        if logged_at is None or now - logged_at >= _ACCEPT_LOG_EVERY_S:
                            log.warning("RPC server on %s %s; accepting again in %g s (%d such failures since the "
                                        "last message)", self._where, e, pause, unlogged)
                            logged_at, unlogged = now, 0
                        selector.unregister(self._listener)
                        resume_at = now + pause
                    else:
                        if accepted and pause:
                            log.info("RPC server on %s accepts connections again (%d failures not logged)",
                                     self._where, unlogged)
                            pause, unlogged = 0.0, 0

    def _accept_one(self):
        """Accept a connection and start its reader: True, or False if there was none after
        all; _AcceptFailed (the connection closed) if either step failed."""
        try:
            sock, peer = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return False
        except OSError as e:
            raise _AcceptFailed(f"could not accept a connection: {e}") from None
        thread = threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                                  name=f"statecore-rpc-conn-{self.address[1]}-{_where(peer)}")
        with self._lock:
            self._connections[sock] = thread
        try:
            thread.start()
        except RuntimeError as e:  # "can't start new thread"
            with self._lock:
                self._connections.pop(sock, None)
            sock.close()
            raise _AcceptFailed(f"could not start a thread for {_where(peer)} (closed the connection): {e}") from None
        return True

    def _serve(self, sock, peer):
        """A connection's reader: handshake, then each frame to its endpoint (see _Dispatcher)."""
        where = _where(peer)
        conn = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                peer_max = _server_handshake(sock, self.authkey, self.max_frame_bytes,
                                             time.monotonic() + self.handshake_timeout_s)
                _tune(sock, self.io_timeout_s)
            except AuthenticationError as e:
                log.warning("RPC server on %s refused %s: %s", self._where, where, e)
                return
            except socket.timeout:
                log.warning("RPC server on %s dropped %s: handshake not done within %g s", self._where, where,
                            self.handshake_timeout_s)
                return
            except (OSError, EOFError, RpcProtocolError) as e:
                if not self._stopped:
                    log.warning("RPC server on %s dropped %s during the handshake: %s", self._where, where, e)
                return
            conn = _ServerConnection(sock, peer, peer_max, self)
            with self._lock:
                self._served[peer] = conn
            reader = _FrameReader(sock, self.max_frame_bytes, self.io_timeout_s)
            endpoints = self._endpoints
            while not conn.dropped:
                if conn.pending and not reader.has_frame():
                    conn.flush()
                try:
                    body = reader.read()
                except EOFError as e:
                    if str(e) != "connection closed" and not conn.dropped:
                        log.warning("RPC server on %s: %s %s", self._where, where, e)
                    return
                try:
                    envelope = _server_envelopes.decode(body)
                except _DECODE_ERRORS as e:
                    raise _undecodable(e, "a frame does not decode as a send or an ask") from None
                name = envelope.endpoint
                dispatcher = endpoints.get(name)
                if dispatcher is None or not dispatcher.deliver(conn, envelope, len(body)):
                    if type(envelope) is _Send:
                        log.warning("RPC server on %s dropped a one-way message from %s to unknown endpoint %r",
                                    self._where, where, name)
                    else:
                        conn.reply(_error_frame(envelope.request_id, "EndpointNotFound", "",
                                                f"no endpoint named {name!r} at {self._where}", limit=peer_max))
        except (RpcProtocolError, _Stalled) as e:
            log.warning("RPC server on %s dropped %s: %s", self._where, where, e)
        except OSError as e:
            if not self._stopped and not (conn is not None and conn.dropped):
                log.info("RPC server on %s lost %s: %s", self._where, where, e)
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            with self._lock:
                self._connections.pop(sock, None)
                if conn is not None and self._served.get(peer) is conn:
                    del self._served[peer]


def _join(thread, what):
    """Join ``thread`` (not the current one), saying every 10 s what is still awaited."""
    if thread is threading.current_thread() or not thread.ident:
        return
    while True:
        thread.join(10.0)
        if not thread.is_alive():
            return
        log.warning("still waiting for %s (thread %s)", what, thread.name)
