"""The handshake that opens every connection: both sides prove the shared authkey (HMAC over
fresh nonces) and learn each other's frame limit before any message is decoded. The frames
are in ``docs/rpc.md`` ("Wire format").
"""
import hmac
import secrets
from typing import Annotated, Union

import msgspec

from statecore.errors import AuthenticationError, RpcProtocolError
from statecore.rpc.wire import (_decode, _frame, _MAX_U32, _MIN_FRAME_BYTES, _pack_u32, _recv_exact, _send_before,
                                _unpack_u32)

_PROTOCOL = "statecore-rpc/2"
_NONCE_BYTES = 32
_HANDSHAKE_FRAME_BYTES = 256
_CLIENT_LABEL = b"statecore-rpc client"
_SERVER_LABEL = b"statecore-rpc server"

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

