"""A small authenticated RPC over TCP: what the driver's coordinators and the executors say
to each other (Spark's RpcEnv, reduced to what the StateStoreCoordinator and the
EpochCoordinator need).

An :class:`RpcEnv` listens on one TCP port and hosts named :class:`RpcEndpoint` objects. An
:class:`RpcEndpointRef` (``address``, ``name``, ``authkey``: exactly what pickles and
travels inside tasks) sends to one of them: :meth:`~RpcEndpointRef.send` is one-way,
:meth:`~RpcEndpointRef.ask` waits for the reply. A process without an RpcEnv (an executor,
a Python worker) gets refs from :func:`endpoint_ref`. Messages are :class:`Message` Structs
or plain values, encoded with msgspec's MessagePack.

Modules: ``wire`` (frames, envelopes, values), ``handshake``, ``client`` (refs and their
connections), ``endpoint`` (endpoints and their dispatch), ``server`` (RpcEnv). The rules
(ordering, flow control, memory bounds, security, the wire format) are in ``docs/rpc.md``.
"""
from statecore.errors import (CALL_ERRORS, EndpointAlreadyRegisteredError, EndpointNotFoundError, RpcConnectionError, RpcError,
                              RpcProtocolError, RpcTimeoutError)
from statecore.rpc.client import RpcEndpointRef, close_connections, endpoint_ref
from statecore.rpc.endpoint import RpcEndpoint
from statecore.rpc.server import RpcEnv
from statecore.rpc.wire import (DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_UNTYPED_MESSAGE_BYTES, DEFAULT_REPLY_STALL_S,
                                MAX_DEPTH, Message, check_value, decode_value, encode_value)

__all__ = ["RpcEnv", "RpcEndpoint", "RpcEndpointRef", "Message", "endpoint_ref", "close_connections", "RpcError",
           "CALL_ERRORS", "RpcTimeoutError", "RpcConnectionError", "RpcProtocolError", "EndpointNotFoundError",
           "EndpointAlreadyRegisteredError", "check_value", "encode_value", "decode_value", "MAX_DEPTH",
           "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_MAX_UNTYPED_MESSAGE_BYTES", "DEFAULT_REPLY_STALL_S"]
