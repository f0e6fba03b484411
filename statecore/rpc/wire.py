"""The bytes of statecore's RPC: frames, envelopes, messages and plain values, and the socket
reader that cuts a stream into frames. The wire format and the rules for values are in
``docs/rpc.md``.
"""
import select
import socket
import struct
import time
from typing import Any, Union

import msgspec

from statecore.errors import REMOTE_ERRORS, RpcProtocolError

DEFAULT_MAX_FRAME_BYTES = 16 * 2**20
DEFAULT_IO_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTBOX_BYTES = 2**20
DEFAULT_MAX_QUEUED_MESSAGES = 1000
DEFAULT_MAX_QUEUED_BYTES = 4 * 2**20
DEFAULT_MAX_REPLY_BACKLOG_BYTES = 16 * 2**20
DEFAULT_REPLY_STALL_S = 3.0  # a peer with replies waiting that takes under 256 KiB of them this long is dropped
# An untyped (``Any``) endpoint's messages are at most this big unless it says otherwise: a plain value
# can decode to one object per byte, and its decode holds the interpreter (see docs/rpc.md, Messages).
DEFAULT_MAX_UNTYPED_MESSAGE_BYTES = 64 * 2**10
MAX_DEPTH = 64  # containers in a plain value nest at most this deep
_MIN_FRAME_BYTES = 1024  # a limit below this could not carry an error reply
_MAX_U32 = 2**32 - 1


_U32 = struct.Struct(">I")
_pack_u32 = _U32.pack
_unpack_u32 = _U32.unpack_from


# -- messages and values -----------------------------------------------------------------------

class Message(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=True):
    """Base of an endpoint's typed messages: each subclass is one message, sent as the array
    ``[class name, fields...]`` (no field more or less decodes); an endpoint takes the union
    of its own (``message_type``). Frozen: a message is a value."""


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
    See "Messages" in docs/rpc.md."""
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


class _Stalled(Exception):
    """A frame began but did not complete within the io timeout."""


_FILL_IN_PLACE_BYTES = 2**16  # a frame body at least this big that spans reads is received into its own buffer
_HEAD_BYTES = 256  # what of such a frame is received first, for the reader's ``vet`` (see _envelope_head)


def _envelope_head(head):
    """``(request_id, endpoint, offset)`` of a send (request_id None) or an ask whose encoded
    envelope begins with ``head``, ``offset`` being where its message begins; None if ``head``
    does not hold that much of one (a name longer than it, or not an envelope: its decoding
    says why later)."""
    try:
        if head[0] == 0x93 and head[1] == 1:  # [1, endpoint, message]
            request_id, pos = None, 2
        elif head[0] == 0x94 and head[1] == 2:  # [2, request_id, endpoint, message]
            first = head[2]
            if first <= 0x7F:
                request_id, pos = first, 3
            elif 0xCC <= first <= 0xCF:
                width = 1 << (first - 0xCC)
                request_id, pos = int.from_bytes(head[3:3 + width], "big"), 3 + width
            else:
                return None
        else:
            return None
        first = head[pos]
        if 0xA0 <= first <= 0xBF:
            length, pos = first & 0x1F, pos + 1
        elif first in (0xD9, 0xDA):
            width = 1 if first == 0xD9 else 2
            length, pos = int.from_bytes(head[pos + 1:pos + 1 + width], "big"), pos + 1 + width
        else:
            return None
        if pos + length > len(head):
            return None
        return request_id, bytes(head[pos:pos + length]).decode("utf-8"), pos + length
    except (IndexError, UnicodeDecodeError):
        return None


class _FrameReader:
    """Reads frames from a blocking socket. A frame cut short by a caller's deadline stays
    buffered for the next call; one not complete ``io_timeout_s`` after its first byte
    raises :class:`_Stalled`. A large frame that spans reads is received straight into a
    buffer of its size (``_body``, which is what ``read`` returns), in one ``MSG_WAITALL``
    call bounded by ``SO_RCVTIMEO``: gathered piece by piece it would be copied over and over
    as the buffer grows, and each piece would take the interpreter back. Its first
    ``_HEAD_BYTES`` come first, for ``vet(size, head)`` (the server's: it may drop the peer
    before the rest is read)."""

    def __init__(self, sock, max_frame_bytes, io_timeout_s, vet=None):
        self._sock = sock
        self._max = max_frame_bytes
        self._io_timeout = io_timeout_s
        self._buf = b""  # received bytes from _pos on are unread (bytes, or a bytearray while a frame spans reads)
        self._pos = 0
        self._started = None  # monotonic time of the first byte of the frame being read
        self._body = None  # the bytearray a large frame's body is received into, or None
        self._filled = 0  # bytes of _body received so far
        self._vet = vet
        self._vetted = True  # whether _body's head went to vet (or need not)
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
        of it one by one (one copy each); only a frame spread over several reads is gathered
        (a large one in its own bytearray, returned as it is)."""
        while True:
            body = self._body
            if body is not None:
                if self._filled == len(body):
                    self._body, self._started = None, None
                    return body
                if not self._vetted and self._filled >= _HEAD_BYTES:
                    self._vetted = True
                    self._vet(len(body), body[:_HEAD_BYTES])
                    continue
                have, need = 4 + self._filled, len(body) - self._filled
            else:
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
                    if size >= _FILL_IN_PLACE_BYTES:  # the rest goes straight into a buffer of its size
                        body = self._body = bytearray(size)
                        self._filled = have - 4
                        body[:self._filled] = memoryview(buf)[pos + 4:]
                        self._buf, self._pos = b"", 0
                        self._vetted = self._vet is None
                        continue
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
                if body is not None and remaining > 0:  # the rest of a large frame: one call, within the time left
                    self._wait_at_most(remaining)
                    until_byte = len(body) if self._vetted else _HEAD_BYTES
                    try:
                        with memoryview(body) as view:
                            got = self._sock.recv_into(view[self._filled:until_byte], 0, socket.MSG_WAITALL)
                    except BlockingIOError:  # SO_RCVTIMEO ran out with nothing received
                        continue
                    if not got:
                        raise EOFError(f"connection closed in the middle of a frame ({have} bytes)")
                    self._filled += got
                    continue
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


_REMOTE_NAMES = {cls: name for name, cls in REMOTE_ERRORS.items()}  # the errors that cross the wire by name
_REFUSED = _REMOTE_NAMES[RpcProtocolError]


def _error_frame(request_id, error, remote_type, text, remote_traceback="", limit=_MIN_FRAME_BYTES):
    """An error reply, shortened until it fits the asker's frame ``limit``."""
    frame = _frame(_Error(request_id, error, remote_type, text[:16384], remote_traceback[-32768:]))
    if len(frame) - 4 > limit:
        frame = _frame(_Error(request_id, error[:200], remote_type[:200], text[:500], ""))
    return frame
