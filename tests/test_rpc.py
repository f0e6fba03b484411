"""statecore.rpc: the value codec, ordering, errors, authentication, hostile peers, restarts
and a clean shutdown. Every server listens on 127.0.0.1; waits are on conditions with deadlines."""
import enum
import errno
import hmac
import logging
import math
import os
import pickle
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections import namedtuple

import numpy as np
import pytest

import statecore
from statecore import _rpccodec, rpc
from statecore.errors import AuthenticationError, StateStoreError
from statecore.rpc import (RpcConnectionError, RpcEndpoint, RpcEnv, RpcError, RpcProtocolError, RpcTimeoutError,
                           decode_value, encode_value)

DEADLINE_S = 30
MAGIC = b"SCRPC\x00\x00\x01"
SEND, ASK, REPLY, ERROR = 1, 2, 3, 4
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(statecore.__file__)))


# -- helpers -----------------------------------------------------------------------------------

class LogWatcher(logging.Handler):
    """Collects statecore.rpc's records and lets a test wait for one."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
        self.changed = threading.Condition()

    def emit(self, record):
        with self.changed:
            self.records.append(record)
            self.changed.notify_all()

    def wait_for(self, *fragments, level=logging.WARNING):
        def match():
            return next((r for r in self.records if r.levelno >= level
                         and all(f in r.getMessage() for f in fragments)), None)
        with self.changed:
            record = self.changed.wait_for(match, DEADLINE_S)
        assert record is not None, f"no log record with {fragments}: {[r.getMessage() for r in self.records]}"
        return record


@pytest.fixture
def logs():
    logger = logging.getLogger("statecore.rpc")
    watcher, level = LogWatcher(), logger.level
    logger.addHandler(watcher)
    logger.setLevel(logging.INFO)
    yield watcher
    logger.removeHandler(watcher)
    logger.setLevel(level)


def rpc_threads():
    """RPC threads started since the test began (another test's session-wide env, such as
    the Spark tests' driver coordinator, may be running all along)."""
    return [t for t in threading.enumerate() if t.name.startswith("statecore-rpc") and t not in _AT_START]


_AT_START = set()


@pytest.fixture(autouse=True)
def _threads_at_start():
    _AT_START.clear()
    _AT_START.update(threading.enumerate())
    yield


@pytest.fixture
def make_env():
    """RpcEnv factory; every env is shut down afterwards, and no RPC thread may be left."""
    envs = []

    def make(**kwargs):
        env = RpcEnv(**kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.shutdown()
    rpc.close_connections()
    assert rpc_threads() == []


class Recorder(RpcEndpoint):
    """Records one-way ("add", sender, seq) messages; answers asks about them."""

    def __init__(self):
        self.seen = {}
        self.total = 0
        self.stopped = threading.Event()

    def receive(self, message):
        if message[0] == "raise":
            raise ValueError(message[1])
        _, sender, seq = message
        self.seen.setdefault(sender, []).append(seq)
        self.total += 1

    def receive_and_reply(self, message):
        op = message[0]
        if op == "echo":
            return message[1]
        if op == "seen":
            return self.seen.get(message[1], [])
        if op == "total":
            return self.total
        if op == "raise":
            raise KeyError(message[1])
        if op == "custom":
            raise CustomError("custom failure")
        if op == "unencodable":
            return {1, 2}
        if op == "big":
            return b"x" * message[1]
        raise AssertionError(f"unexpected {message!r}")

    def on_stop(self):
        self.stopped.set()


class CustomError(Exception):
    pass


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"connection closed after {len(data)} of {n} bytes"
        data += chunk
    return data


def raw_connect(env):
    return socket.create_connection(env.address, timeout=DEADLINE_S)


def raw_handshake(sock, authkey, limit=1 << 20):
    """The documented handshake, written out here independently of the module."""
    hello = recv_exact(sock, 40)
    assert hello[:8] == MAGIC
    server_nonce, client_nonce, own_limit = hello[8:], os.urandom(32), struct.pack(">I", limit)
    proof = hmac.digest(authkey, b"statecore-rpc client" + server_nonce + client_nonce + own_limit, "sha256")
    sock.sendall(MAGIC + client_nonce + own_limit + proof)
    assert recv_exact(sock, 1) == b"\x01"
    answer = recv_exact(sock, 36)
    expected = hmac.digest(authkey, b"statecore-rpc server" + client_nonce + server_nonce + answer[:4], "sha256")
    assert hmac.compare_digest(answer[4:], expected)
    return struct.unpack(">I", answer[:4])[0]


def raw_frame(kind, request_id, name, payload):
    body = struct.pack(">BQH", kind, request_id, len(name)) + name + payload
    return struct.pack(">I", len(body)) + body


def assert_closed_by_server(sock):
    """Reads until the server closes the connection (within the deadline)."""
    sock.settimeout(DEADLINE_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass


def assert_still_open(sock):
    sock.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            sock.recv(1)
    finally:
        sock.setblocking(True)


def same(a, b):
    """Equal, with the same types all the way down (tuples stay tuples), NaN equal to NaN,
    dicts in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):  # in order, pair by pair (NaN keys included: the codec keeps the order)
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    return a == b


def nested(depth):
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


VALUES = [
    None, True, False, 0, 1, -1, 2**63 - 1, -2**63, 0.0, -0.0, 1.5, -1e308, float("inf"), float("-inf"),
    float("nan"), "", "ascii", "héllo wörld ✓ 🎉 \x00 \U0010ffff", b"", b"\x00\xff" * 3, b"y" * (1 << 20),
    (), (1,), ("a", (None, ("b",))), [], [1, "a", b"b", None], [[[]]], {}, {"a": 1},
    {None: (), True: [1], 7: {}, 2.5: "f", "s": None, b"k": (1, [2, {"x": b"y"}])},
    (0, [1, (2, [3, {"k": (4,)}])]), nested(64),
]


# -- the value codec -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_codec_round_trips_every_type_exactly(value):
    assert same(decode_value(encode_value(value)), value)


def test_int_outside_64_bits_is_a_clear_error():
    for value in (2**63, -2**63 - 1, 10**30, [1, (2, 2**64)]):
        with pytest.raises(ValueError, match="signed 64-bit"):
            encode_value(value)


def test_unsupported_types_raise_type_error_naming_the_type():
    Point = namedtuple("Point", "x y")

    class Color(enum.IntEnum):
        RED = 1

    cases = [(object(), "object"), ({1, 2}, "set"), (frozenset(), "frozenset"), (bytearray(b"x"), "bytearray"),
             (Point(1, 2), "Point"), (Color.RED, "Color"), (1j, "complex"), (np.int64(3), "numpy.int64"),
             ([1, (2, object())], "object"), ({(1, 2): 3}, "dict key of type tuple"), ({"k": {7}}, "set")]
    for value, name in cases:
        with pytest.raises(TypeError, match=name):
            encode_value(value)


def test_depth_is_bounded_both_ways():
    encode_value(nested(64))
    with pytest.raises(ValueError, match="deeper than 64"):
        encode_value(nested(65))
    deep = b"l\x00\x00\x00\x01" * 64 + b"l\x00\x00\x00\x00"  # 65 lists, made by hand
    with pytest.raises(RpcProtocolError, match="deeper than 64"):
        decode_value(deep)
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="deeper than 64"):
        encode_value(cyclic)


def test_decoding_is_strict():
    good = encode_value({"k": [1, 2.5, "s", b"b", (None, True)]})
    for cut in range(len(good)):
        with pytest.raises(RpcProtocolError, match="truncated"):
            decode_value(good[:cut])
    bad = {
        "trailing": good + b"N",
        "unknown value tag 0x5a": b"Z",
        "utf-8": b"s\x00\x00\x00\x02\xff\xfe",
        "keys must be scalars": b"d\x00\x00\x00\x01l\x00\x00\x00\x00N",
        "duplicate dict key": b"d\x00\x00\x00\x02" + (b"i" + struct.pack(">q", 1) + b"N") * 2,
        "truncated": b"l\xff\xff\xff\xff",  # a huge count is refused before allocating anything
    }
    for what, data in bad.items():
        with pytest.raises(RpcProtocolError, match=what):
            decode_value(data)


# -- the compiled codec against a reference written from the docstring -----------------------------
# statecore.rpc's codec is compiled (statecore/_rpccodec.pyx). These functions are the
# documented format in plain Python, written from the module docstring alone and kept slow
# and obvious: the compiled codec must produce exactly their bytes and accept exactly what
# they accept.

REF_MAX_DEPTH = 64
REF_KEY_TYPES = (type(None), bool, int, float, str, bytes)


def ref_u32(n):
    return n.to_bytes(4, "big")


def ref_encode(value, depth=0):
    t = type(value)
    if value is None:
        return b"N"
    if t is bool:
        return b"T" if value else b"F"
    if t is int:
        if not -2**63 <= value < 2**63:
            raise ValueError("outside the signed 64-bit range")
        return b"i" + value.to_bytes(8, "big", signed=True)
    if t is float:
        return b"f" + struct.pack(">d", value)
    if t is str:
        data = value.encode("utf-8")
        return b"s" + ref_u32(len(data)) + data
    if t is bytes:
        return b"b" + ref_u32(len(value)) + value
    if t in (tuple, list, dict):
        if depth >= REF_MAX_DEPTH:
            raise ValueError(f"nested deeper than {REF_MAX_DEPTH}")
        if t is dict:
            if any(type(k) not in REF_KEY_TYPES for k in value):
                raise TypeError("dict key")
            body = b"".join(ref_encode(k, depth + 1) + ref_encode(v, depth + 1) for k, v in value.items())
        else:
            body = b"".join(ref_encode(item, depth + 1) for item in value)
        return {tuple: b"t", list: b"l", dict: b"d"}[t] + ref_u32(len(value)) + body
    raise TypeError(f"type {t.__name__}")


class RefMalformed(Exception):
    pass


def ref_decode(data):
    """The value in ``data``; RefMalformed for anything the docstring calls malformed."""
    def take(pos, n):
        if pos + n > len(data):
            raise RefMalformed("truncated")
        return data[pos:pos + n], pos + n

    def value(pos, depth):
        tag, pos = take(pos, 1)
        if tag in (b"N", b"F", b"T"):
            return {b"N": None, b"F": False, b"T": True}[tag], pos
        if tag in (b"i", b"f"):
            raw, pos = take(pos, 8)
            return (int.from_bytes(raw, "big", signed=True) if tag == b"i" else struct.unpack(">d", raw)[0]), pos
        if tag in (b"s", b"b"):
            raw, pos = take(pos, 4)
            raw, pos = take(pos, int.from_bytes(raw, "big"))
            if tag == b"b":
                return raw, pos
            try:
                return raw.decode("utf-8"), pos
            except UnicodeDecodeError:
                raise RefMalformed("utf-8") from None
        if tag in (b"t", b"l", b"d"):
            if depth >= REF_MAX_DEPTH:
                raise RefMalformed("depth")
            raw, pos = take(pos, 4)
            items = []
            for _ in range(int.from_bytes(raw, "big")):
                if tag == b"d":
                    if data[pos:pos + 1] not in (b"N", b"F", b"T", b"i", b"f", b"s", b"b"):
                        raise RefMalformed("key")
                    key, pos = value(pos, depth + 1)
                    item, pos = value(pos, depth + 1)
                    items.append((key, item))
                else:
                    item, pos = value(pos, depth + 1)
                    items.append(item)
            if tag == b"d":
                d = dict(items)
                if len(d) != len(items):
                    raise RefMalformed("duplicate key")
                return d, pos
            return (tuple(items) if tag == b"t" else items), pos
        raise RefMalformed("tag")

    result, end = value(0, 0)
    if end != len(data):
        raise RefMalformed("trailing bytes")
    return result


def ref_frame(kind, request_id, name, value):
    body = bytes([kind]) + request_id.to_bytes(8, "big") + len(name).to_bytes(2, "big") + name + ref_encode(value)
    return ref_u32(len(body)) + body


def ref_envelope(body):
    if len(body) < 11 or body[0] not in (1, 2, 3, 4):
        raise RefMalformed("envelope")
    end = 11 + int.from_bytes(body[9:11], "big")
    if end > len(body):
        raise RefMalformed("name")
    try:
        name = body[11:end].decode("utf-8")
    except UnicodeDecodeError:
        raise RefMalformed("name") from None
    return body[0], int.from_bytes(body[1:9], "big"), name, ref_decode(body[end:])


NAN_PAYLOAD = struct.unpack(">d", b"\x7f\xf8\x00\x00\x00\x00\x00\x2a")[0]
NEGATIVE_NAN = struct.unpack(">d", b"\xff\xf8\x00\x00\x00\x00\x00\x00")[0]
SPECIAL_FLOATS = [0.0, -0.0, 5e-324, -1.5, 1e308, float("inf"), float("-inf"), float("nan"), NAN_PAYLOAD,
                  NEGATIVE_NAN]
SPECIAL_INTS = [0, 1, -1, 2**31, -2**31 - 1, 2**32, 2**63 - 1, -2**63, 255, 256, -256]
CODE_POINTS = [(0x20, 0x7F), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000), (0, 0x20)]


def random_scalar(rng):
    kind = int(rng.integers(9))
    if kind == 0:
        return [None, True, False][int(rng.integers(3))]
    if kind == 1:
        return int(rng.integers(-2**63, 2**63, dtype=np.int64))
    if kind == 2:
        return SPECIAL_INTS[int(rng.integers(len(SPECIAL_INTS)))]
    if kind == 3:
        return float(rng.normal() * 10.0 ** int(rng.integers(-300, 300)))
    if kind == 4:
        return SPECIAL_FLOATS[int(rng.integers(len(SPECIAL_FLOATS)))]
    if kind in (5, 6):  # ASCII, or any code point but surrogates (the compiled codec has a path for each)
        n = int(rng.integers(0, 2000 if rng.random() < 0.03 else 12))
        lo, hi = CODE_POINTS[0] if kind == 5 else CODE_POINTS[int(rng.integers(len(CODE_POINTS)))]
        return "".join(chr(c) for c in rng.integers(lo, hi, size=n))
    n = int(rng.integers(0, 3000 if rng.random() < 0.03 else 12))
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def random_value(rng, depth=0):
    """A random value of every supported type; now and then a long string or bytes (beyond
    the encoder's stack buffer), a container of more than 256 items (beyond the decoder's
    preallocation) or a chain reaching the depth limit."""
    r = rng.random()
    if depth >= REF_MAX_DEPTH or r < 0.4 + depth * 0.15:
        return random_scalar(rng)
    if depth == 0 and r > 0.99:
        chain = random_scalar(rng)
        for _ in range(int(rng.integers(1, REF_MAX_DEPTH + 1))):
            chain = [(chain,), [chain], {"k": chain}][int(rng.integers(3))]
            if type(chain) is tuple and len(chain) == 1 and rng.random() < 0.5:
                chain = chain[0]
        return chain
    kind = int(rng.integers(3))
    if rng.random() < 0.02:  # a large container, of scalars
        n, item = int(rng.integers(257, 600)), random_scalar
    else:
        n, item = int(rng.integers(0, 6)), lambda rng: random_value(rng, depth + 1)
    if kind == 0:
        return tuple(item(rng) for _ in range(n))
    if kind == 1:
        return [item(rng) for _ in range(n)]
    return {random_scalar(rng): item(rng) for _ in range(n)}


def test_the_codec_is_compiled():
    import importlib.machinery
    assert rpc.encode_value is _rpccodec.encode_value and rpc.decode_value is _rpccodec.decode_value
    assert _rpccodec.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), _rpccodec.__file__
    assert rpc.MAX_DEPTH == REF_MAX_DEPTH


def test_reference_agrees_with_the_documented_examples():
    assert ref_encode(("echo", -5)) == b"t\x00\x00\x00\x02s\x00\x00\x00\x04echoi" + struct.pack(">q", -5)
    for value in VALUES:
        assert same(ref_decode(ref_encode(value)), value)


def test_compiled_codec_matches_the_reference_on_random_values(rand):
    sizes = []
    for i in range(1500):
        value = random_value(rand)
        expected = ref_encode(value)
        data = encode_value(value)
        assert data == expected, (rand, i, value)
        sizes.append(len(data))
        assert same(decode_value(expected), value), (rand, i, value)
        assert same(ref_decode(data), value), (rand, i, value)
        kind, request_id = int(rand.integers(1, 5)), int(rand.integers(0, 2**64, dtype=np.uint64))
        name = "é✓ndpoint"[:int(rand.integers(0, 9))].encode()
        frame = _rpccodec.encode_frame(kind, request_id, name, value)
        assert frame == ref_frame(kind, request_id, name, value), (rand, i, value)
        got = _rpccodec.decode_envelope(frame[4:])
        assert got[:3] == (kind, request_id, name.decode()) and same(got[3], value), (rand, i, value)
    assert max(sizes) > 4096 and min(sizes) == 1  # the heap path of the encoder ran, and the one-byte values


def test_compiled_decoder_accepts_exactly_what_the_reference_accepts(rand):
    """In process, on mutated encodings (the subprocess fuzz below is the crash guard)."""
    for i in range(400):
        data = bytearray(encode_value(random_value(rand)))
        for case in mutations(rand, data, 6):
            try:
                expected = ("ok", ref_decode(case))
            except RefMalformed:
                expected = ("error", None)
            try:
                got = ("ok", decode_value(case))
            except RpcProtocolError:
                got = ("error", None)
            assert got[0] == expected[0] and same(got[1], expected[1]), (rand, i, case)


def test_exact_error_messages():
    """The compiled codec words every failure as the pure-Python codec before it did."""
    q = struct.Struct(">q").pack
    values = {
        b"": "truncated value (0 bytes)",
        b"Z": "unknown value tag 0x5a at byte 0",
        b"l\x00\x00\x00\x02NZ": "unknown value tag 0x5a at byte 6",
        b"NN": "1 trailing bytes after the value",
        b"s\x00\x00\x00\x02\xff\xfe": "invalid utf-8 in a string: invalid start byte",
        b"s\x00\x00\x00\x03\xed\xa0\x80": "invalid utf-8 in a string: invalid continuation byte",  # a surrogate
        b"d\x00\x00\x00\x01l\x00\x00\x00\x00N": "dict key with tag 0x6c at byte 5: keys must be scalars",
        b"d\x00\x00\x00\x02" + (b"i" + q(1) + b"N") * 2: "duplicate dict key 1",
        b"d\x00\x00\x00\x02TNi" + q(1) + b"N": "duplicate dict key 1",  # True == 1
        b"d\x00\x00\x00\x02s\x00\x00\x00\x01kNs\x00\x00\x00\x01kZ": "unknown value tag 0x5a at byte 18",
        b"l\xff\xff\xff\xff": "truncated value (5 bytes)",
        b"l\x00\x00\x00\x01" * 65 + b"N": "value nested deeper than 64 containers",
        b"i" + bytes(7): "truncated value (8 bytes)",
        b"f\x00": "truncated value (2 bytes)",
        b"t\x00\x00\x00\x03NN": "truncated value (7 bytes)",
        b"d\x00\x00\x00\x01s\x00\x00\x00\x01k": "truncated value (11 bytes)",
    }
    for data, message in values.items():
        with pytest.raises(RpcProtocolError) as info:
            decode_value(data)
        assert str(info.value) == message, data
        assert info.value.__suppress_context__ or info.value.__context__ is None

    def envelope(kind, request_id, name, payload=b"", name_length=None):
        return struct.pack(">BQH", kind, request_id, len(name) if name_length is None else name_length) + name + payload

    bodies = {
        b"abc": "frame of 3 bytes is shorter than an envelope",
        envelope(9, 0, b"", b"N"): "unknown message kind 9",
        envelope(0, 0, b""): "unknown message kind 0",
        envelope(1, 0, b"ab", name_length=5): "truncated endpoint name",
        envelope(1, 0, b"\xff\xfe", b"N"): "endpoint name is not utf-8",
        envelope(1, 0, b"rec", b"Z"): "unknown value tag 0x5a at byte 14",
        envelope(1, 0, b"rec", b"s\x00\x00\x00\x09abc"): "truncated value (8 bytes)",
        envelope(3, 7, b""): "truncated value (0 bytes)",
    }
    for body, message in bodies.items():
        with pytest.raises(RpcProtocolError) as info:
            _rpccodec.decode_envelope(body)
        assert str(info.value) == message, body
    assert _rpccodec.decode_envelope(envelope(2, 2**64 - 1, b"rec", b"N")) == (2, 2**64 - 1, "rec", None)
    with pytest.raises(ValueError, match="at most 65535 bytes"):
        _rpccodec.encode_frame(1, 0, b"x" * 65536, None)


def test_lone_surrogates_refuse_to_encode_as_str_encode_does():
    for value in ("\ud800", ["ok", "a\udfffb"], {"\udc00": 1}):
        with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
            encode_value(value)


def test_decoders_take_any_contiguous_bytes_like_object():
    data = encode_value({"k": [1, "v", b"b"]})
    body = _rpccodec.encode_frame(3, 9, b"", "x")[4:]
    for wrap in (bytes, bytearray, memoryview, lambda d: np.frombuffer(d, np.uint8)):
        assert decode_value(wrap(data)) == {"k": [1, "v", b"b"]}
        assert _rpccodec.decode_envelope(wrap(body)) == (3, 9, "", "x")
    for bad in (5, "N", None):
        with pytest.raises(TypeError):
            decode_value(bad)
    with pytest.raises(RpcProtocolError, match="trailing"):
        decode_value(memoryview(data + b"N"))


def test_hostile_counts_reserve_no_memory():
    """Each of 64 nested lists claims as many items as there are bytes left: the decoder
    must not reserve room for them before they arrive (the old codec did not either)."""
    import tracemalloc
    size = 1 << 20
    headers = b"".join(b"l" + struct.pack(">I", size - 5 * (level + 1)) for level in range(64))
    data = headers + bytes(size - len(headers))  # and then zero bytes: an unknown tag
    tracemalloc.start()
    try:
        with pytest.raises(RpcProtocolError, match="unknown value tag 0x00"):
            decode_value(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, peak


# -- decoder fuzz, in a subprocess (a crash fails the test instead of the run) -----------------------

FUZZ_DRIVER = r'''
import json, sys
from statecore._rpccodec import decode_envelope, encode_frame
from statecore.rpc import RpcProtocolError, decode_value, encode_value

with open(sys.argv[1]) as f:
    cases = json.load(f)
for i, (what, hex_data) in enumerate(cases):
    data = bytes.fromhex(hex_data)
    try:
        if what == "value":
            again = encode_value(decode_value(data))
        else:
            kind, request_id, name, value = decode_envelope(data)
            again = encode_frame(kind, request_id, name.encode(), value)[4:]
        result = "ok" if again == data else "ok, but it encodes differently"
    except RpcProtocolError:
        result = "error"
    except BaseException as e:
        result = f"other: {type(e).__name__}: {e}"
    print(json.dumps([i, result]), flush=True)
'''


def mutations(rng, data, n):
    """``n`` damaged copies of ``data``: truncations, bit flips, byte changes, insertions,
    deletions and random junk."""
    out = []
    for _ in range(n):
        case = bytearray(data)
        kind = int(rng.integers(7))
        at = int(rng.integers(0, len(case) + 1))
        if kind == 0:
            case = case[:at]
        elif kind == 1 and case:
            case[min(at, len(case) - 1)] ^= 1 << int(rng.integers(8))
        elif kind == 2 and case:
            case[min(at, len(case) - 1)] = int(rng.integers(256))
        elif kind == 3:
            case[at:at] = rng.integers(0, 256, size=int(rng.integers(1, 4)), dtype=np.uint8).tobytes()
        elif kind == 4:
            del case[at:at + int(rng.integers(1, 4))]
        elif kind == 5:  # a length or count byte made huge
            case[at:at + 1] = b"\xff"
        else:
            case = bytearray(rng.integers(0, 256, size=int(rng.integers(0, 24)), dtype=np.uint8).tobytes())
            if case and rng.random() < 0.7:
                case[0] = b"NFTifsbtld"[int(rng.integers(10))]
        out.append(bytes(case))
    return out


def deep_cases():
    """Nesting at, just past and far past the limit, in every container, with honest and
    hostile counts."""
    cases = []
    for depth in (63, 64, 65, 1000, 100_000):
        cases.append(b"l\x00\x00\x00\x01" * depth + b"N")
        cases.append(b"t\x00\x00\x00\x01" * depth + b"l\x00\x00\x00\x00")
        cases.append(b"d\x00\x00\x00\x01N" * depth + b"N")
        cases.append(b"l\xff\xff\xff\xff" * depth)
        cases.append(b"d\x00\x00\x00\x01" * depth + b"N")  # a dict as a key
    return cases


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_decoder_fuzz_in_subprocess(tmp_path, seed):
    import json
    rng = np.random.default_rng(seed)
    cases = [("value", data) for data in deep_cases()]
    for _ in range(600):
        value = random_value(rng)
        cases += [("value", data) for data in mutations(rng, encode_value(value), 12)]
        kind, request_id = int(rng.integers(0, 6)), int(rng.integers(0, 2**64, dtype=np.uint64))
        body = _rpccodec.encode_frame(max(1, min(kind, 4)), request_id, "né"[:int(rng.integers(3))].encode(), value)[4:]
        cases += [("envelope", data) for data in mutations(rng, body, 6)]
    (tmp_path / "cases.json").write_text(json.dumps([(what, data.hex()) for what, data in cases]))
    (tmp_path / "driver.py").write_text(FUZZ_DRIVER)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cases.json")],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    if proc.returncode != 0:
        last = results[-1][0] if results else None
        pytest.fail(f"driver exited with {proc.returncode} (negative: killed by a signal) after {len(results)} of "
                    f"{len(cases)} cases (next: {cases[len(results)] if len(results) < len(cases) else None}, "
                    f"last finished: {last})\n{proc.stderr[-3000:]}")
    assert [i for i, _ in results] == list(range(len(cases)))
    bad = [(cases[i], result) for i, result in results if result not in ("ok", "error")]
    assert not bad, bad[:5]  # every failure is an RpcProtocolError; what decodes encodes back to its bytes
    # and the compiled decoder accepts exactly what the reference accepts
    for (what, data), (_, result) in zip(cases, results):
        try:
            (ref_decode if what == "value" else ref_envelope)(data)
            expected = "ok"
        except RefMalformed:
            expected = "error"
        assert result == expected, (what, data)
    assert 0.05 < sum(result == "ok" for _, result in results) / len(results) < 0.95


# -- messages over the wire ----------------------------------------------------------------------

def test_every_value_round_trips_over_the_wire(make_env):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    for value in VALUES[:-1] + [nested(63)]:  # the ("echo", ...) tuple is one more level
        assert same(ref.ask(("echo", value)), value)
    assert same(ref.ask(("echo", VALUES[:-1])), VALUES[:-1])
    with pytest.raises(ValueError, match="deeper than 64"):
        ref.ask(("echo", nested(64)))
    with pytest.raises(ValueError, match="signed 64-bit"):
        ref.ask(("echo", 2**63))


def test_unsupported_type_fails_at_the_caller_before_anything_is_sent(make_env):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    with pytest.raises(TypeError, match="object"):
        ref.send(("add", "a", object()))
    with pytest.raises(TypeError, match="set"):
        ref.ask(("echo", {1}))
    assert ref.ask(("total",)) == 0
    nowhere = rpc.endpoint_ref(("127.0.0.1", free_port()), "rec", b"key")  # no connect is even tried
    with pytest.raises(TypeError, match="object"):
        nowhere.send(object())


def test_the_documented_wire_format(make_env):
    """A client written from the module docstring alone: handshake, ask, reply, error."""
    env = make_env()
    env.setup_endpoint("rec", Recorder())
    with raw_connect(env) as sock:
        assert raw_handshake(sock, env.authkey) == rpc.DEFAULT_MAX_FRAME_BYTES
        sock.sendall(raw_frame(ASK, 77, b"rec", b"t\x00\x00\x00\x02s\x00\x00\x00\x04echoi" + struct.pack(">q", -5)))
        size = struct.unpack(">I", recv_exact(sock, 4))[0]
        body = recv_exact(sock, size)
        assert struct.unpack_from(">BQH", body) == (REPLY, 77, 0)
        assert decode_value(body[11:]) == -5
        sock.sendall(raw_frame(ASK, 78, b"gone", encode_value(None)))
        body = recv_exact(sock, struct.unpack(">I", recv_exact(sock, 4))[0])
        assert struct.unpack_from(">BQH", body) == (ERROR, 78, 0)
        remote_type, text, _tb = decode_value(body[11:])
        assert remote_type == "" and "no endpoint named 'gone'" in text


def test_ask_after_sends_sees_them_all_in_order_many_threads(make_env):
    env = make_env()
    env.setup_endpoint("rec", Recorder())
    n_threads, n_sends = 8, 300
    failures = []

    def sender(i):
        try:
            ref = rpc.endpoint_ref(env.address, "rec", env.authkey)  # each thread its own ref
            for seq in range(n_sends):
                ref.send(("add", f"t{i}", seq))
                if seq % 100 == 99:  # an ask is a flush: everything sent before it was handled
                    assert ref.ask(("seen", f"t{i}")) == list(range(seq + 1))
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not failures, failures
    check = env.endpoint_ref(env.address, "rec")
    assert check.ask(("total",)) == n_threads * n_sends


CHILD = """
import pickle, sys
from statecore import rpc
address, key = (sys.argv[1], int(sys.argv[2])), bytes.fromhex(sys.argv[3])
sender, n = sys.argv[4], int(sys.argv[5])
ref = rpc.endpoint_ref(address, "rec", key) if sys.argv[6] == "-" else pickle.loads(bytes.fromhex(sys.argv[6]))
for seq in range(n):
    ref.send(("add", sender, seq))
seen = ref.ask(("seen", sender))
assert seen == list(range(n)), seen[:20]
print("ok", len(seen))
"""


def test_sends_from_other_processes_are_handled_in_order(make_env):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    n = 500
    children = []
    for i in range(3):
        pickled = "-" if i == 0 else pickle.dumps(ref).hex()  # two children get a pickled ref, as tasks do
        children.append(subprocess.Popen(
            [sys.executable, "-c", CHILD, env.address[0], str(env.address[1]), env.authkey.hex(), f"p{i}", str(n),
             pickled], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": REPO_ROOT}))
    for child in children:
        out, err = child.communicate(timeout=DEADLINE_S)
        assert child.returncode == 0, err
        assert out.split() == ["ok", str(n)]
    assert ref.ask(("total",)) == 3 * n
    for i in range(3):
        assert ref.ask(("seen", f"p{i}")) == list(range(n))


def test_concurrent_asks_on_one_ref_get_their_own_replies(make_env):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    shared = rpc.endpoint_ref(env.address, "rec", env.authkey)
    failures = []

    def asker(i):
        try:
            for j in range(200):
                payload = (i, j, os.urandom(j % 7))
                assert (ref if j % 2 else shared).ask(("echo", payload)) == payload
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=asker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not failures, failures


# -- errors --------------------------------------------------------------------------------------

def test_handler_exception_comes_back_as_rpc_error_and_the_endpoint_goes_on(make_env, logs):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    with pytest.raises(RpcError, match="KeyError: 'missing thing'") as info:
        ref.ask(("raise", "missing thing"))
    assert isinstance(info.value, StateStoreError)
    assert info.value.remote_type == "KeyError" and "receive_and_reply" in info.value.remote_traceback
    with pytest.raises(RpcError, match=r"CustomError: custom failure") as info:
        ref.ask(("custom",))
    assert info.value.remote_type.endswith("test_rpc.CustomError")
    with pytest.raises(RpcError, match="TypeError: cannot encode a value of type set"):
        ref.ask(("unencodable",))
    ref.send(("raise", "one-way failure"))
    assert ref.ask(("echo", "still here")) == "still here"
    record = logs.wait_for("failed to handle a one-way message", level=logging.ERROR)
    assert "one-way failure" in str(record.exc_info[1])
    ref.send(("add", "a", 1))
    assert ref.ask(("seen", "a")) == [1]
    restored = pickle.loads(pickle.dumps(info.value))
    assert str(restored) == str(info.value) and restored.remote_type == info.value.remote_type


class Blocker(RpcEndpoint):
    def __init__(self):
        self.release = threading.Event()

    def receive_and_reply(self, message):
        if message == "block":
            assert self.release.wait(DEADLINE_S)
            return "late"
        return message


def test_ask_timeout_then_the_late_reply_is_not_mistaken_for_another(make_env):
    env = make_env()
    blocker = Blocker()
    ref = env.setup_endpoint("blocker", blocker)
    with pytest.raises(RpcTimeoutError, match="within 0.2 s") as info:
        ref.ask("block", timeout_s=0.2)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RpcError)
    blocker.release.set()
    assert ref.ask("next") == "next"  # not "late": replies are matched by request id
    with pytest.raises(ValueError, match="timeout_s"):
        ref.ask("x", timeout_s=0)
    assert ref.ask("no deadline", timeout_s=None) == "no deadline"


class Gate(RpcEndpoint):
    """Answers "wait" asks only once ``release`` is set; says when the first one arrived."""

    def __init__(self):
        self.arrived, self.release = threading.Event(), threading.Event()

    def receive_and_reply(self, message):
        self.arrived.set()
        assert self.release.wait(DEADLINE_S)
        return message


def test_a_waiting_ask_takes_over_reading_when_the_reader_gives_up(make_env):
    """Two threads share a connection; the one reading it times out while the other still
    waits: the reading passes to the other, which gets its reply."""
    env = make_env()
    gate = Gate()
    env.setup_endpoint("gate", gate)
    ref = rpc.endpoint_ref(env.address, "gate", env.authkey)
    outcome = {}

    def impatient():
        try:
            ref.ask("first", timeout_s=0.3)
        except RpcTimeoutError as e:
            outcome["first"] = e

    thread = threading.Thread(target=impatient)
    thread.start()
    assert gate.arrived.wait(DEADLINE_S)  # the impatient ask is out and being read for
    second = threading.Thread(target=lambda: outcome.setdefault("second", ref.ask("second", timeout_s=DEADLINE_S)))
    second.start()
    thread.join(DEADLINE_S)
    assert isinstance(outcome.get("first"), RpcTimeoutError)
    gate.release.set()
    second.join(DEADLINE_S)
    assert outcome.get("second") == "second"


def test_a_blocked_handler_holds_up_no_other_endpoint(make_env):
    env = make_env()
    gate = Gate()
    env.setup_endpoint("gate", gate)
    env.setup_endpoint("rec", Recorder())
    blocked = threading.Thread(target=lambda: rpc.endpoint_ref(env.address, "gate", env.authkey).ask("wait"))
    blocked.start()
    try:
        assert gate.arrived.wait(DEADLINE_S)
        other = rpc.endpoint_ref(env.address, "rec", env.authkey)  # same process, same server
        other.send(("add", "a", 1))
        assert other.ask(("seen", "a")) == [1]
    finally:
        gate.release.set()
        blocked.join(DEADLINE_S)


class Journal(Gate):
    """A Gate that also journals one-way messages and its stop."""

    def __init__(self):
        super().__init__()
        self.journal = []

    def receive(self, message):
        self.journal.append(message)

    def on_stop(self):
        self.journal.append("stopped")


def wait_until(predicate, deadline_s=DEADLINE_S):
    """Polls ``predicate`` (state with no event to wait on) until true, within the deadline."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def test_messages_queued_before_stop_are_handled_then_on_stop(make_env):
    env = make_env()
    journal = Journal()
    env.setup_endpoint("journal", journal)
    blocked = threading.Thread(target=lambda: rpc.endpoint_ref(env.address, "journal", env.authkey).ask("wait"))
    blocked.start()
    assert journal.arrived.wait(DEADLINE_S)  # the endpoint is busy: what comes now is queued
    sender = make_env().endpoint_ref(env.address, "journal", env.authkey)  # another connection
    for i in range(5):
        sender.send(i)
    wait_until(lambda: len(env._endpoints["journal"].queue) == 5)  # white box: all five are queued
    stopper = threading.Thread(target=env.stop_endpoint, args=("journal",))
    stopper.start()
    wait_until(lambda: "journal" not in env._endpoints)
    with pytest.raises(RpcError, match="no endpoint named 'journal'"):
        sender.ask("too late")
    journal.release.set()
    stopper.join(DEADLINE_S)
    blocked.join(DEADLINE_S)
    assert not stopper.is_alive() and journal.journal == [0, 1, 2, 3, 4, "stopped"]


def test_unknown_endpoint_name(make_env, logs):
    env = make_env()
    env.setup_endpoint("rec", Recorder())
    missing = env.endpoint_ref(env.address, "missing")
    with pytest.raises(RpcError, match=f"no endpoint named 'missing' at 127.0.0.1:{env.address[1]}"):
        missing.ask(("echo", 1))
    missing.send(("add", "a", 1))
    logs.wait_for("unknown endpoint 'missing'")


def test_setup_endpoint_twice_and_reuse_after_stop(make_env):
    env = make_env()
    first = Recorder()
    env.setup_endpoint("rec", first)
    with pytest.raises(ValueError, match="already registered"):
        env.setup_endpoint("rec", Recorder())
    env.stop_endpoint("rec")
    assert first.stopped.is_set()  # stop_endpoint from outside waits for on_stop
    ref = env.setup_endpoint("rec", Recorder())
    assert ref.ask(("total",)) == 0
    env.stop_endpoint("never registered")


class SelfStopping(Recorder):
    def __init__(self, env):
        super().__init__()
        self.env = env

    def receive_and_reply(self, message):
        if message == "stop":
            self.env.stop_endpoint("selfstop")
            return "stopping"
        return super().receive_and_reply(message)


def test_stop_endpoint_from_inside_its_own_handler(make_env, logs):
    env = make_env()
    endpoint = SelfStopping(env)
    ref = env.setup_endpoint("selfstop", endpoint)
    for seq in range(50):
        ref.send(("add", "a", seq))
    assert ref.ask("stop") == "stopping"
    assert endpoint.stopped.wait(DEADLINE_S)
    assert endpoint.seen["a"] == list(range(50))
    with pytest.raises(RpcError, match="no endpoint named 'selfstop'"):
        ref.ask(("total",))
    ref.send(("add", "a", 50))
    logs.wait_for("unknown endpoint 'selfstop'")
    assert endpoint.total == 50
    for t in rpc_threads():
        if t.name == "statecore-rpc-endpoint-selfstop":
            t.join(DEADLINE_S)
            assert not t.is_alive()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_names_the_address():
    port = free_port()
    ref = rpc.endpoint_ref(("127.0.0.1", port), "rec", b"key")
    with pytest.raises(RpcConnectionError, match=f"127.0.0.1:{port}") as info:
        ref.ask(("echo", 1))
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(RpcConnectionError, match=f"127.0.0.1:{port}"):
        ref.send(("add", "a", 1))


def test_authkey_forms():
    with RpcEnv(authkey="sécret") as env:
        assert env.authkey == "sécret".encode()
    with RpcEnv() as a, RpcEnv() as b:
        assert len(a.authkey) == 32 and isinstance(a.authkey, bytes) and a.authkey != b.authkey
    with pytest.raises(ValueError, match="empty"):
        RpcEnv(authkey=b"")
    with pytest.raises(TypeError, match="bytes or str"):
        RpcEnv(authkey=42)
    assert rpc_threads() == []



# -- flow control --------------------------------------------------------------------------------

PAD = b"x" * 1000  # 1 kB messages: a few thousand fill the loopback socket buffers (~4 MB)


def flood(ref, sender, n, sent, errors):
    """Sends ("add", sender, seq, PAD) for seq in range(n); records progress and the error that stopped it."""
    try:
        for seq in range(n):
            ref.send(("add", sender, seq, PAD))
            sent[sender] = seq + 1
    except BaseException as e:  # reported by the test
        errors[sender] = e


def block_endpoint(env, gate):
    """An ask that keeps ``gate`` busy (handled on its own connection's reader) until released."""
    thread = threading.Thread(target=lambda: rpc.endpoint_ref(env.address, gate.name, env.authkey).ask("wait"))
    thread.start()
    assert gate.arrived.wait(DEADLINE_S)
    return thread


def start_flood(ref, n, threads=2):
    sent, errors = {}, {}
    senders = [threading.Thread(target=flood, args=(ref, f"t{i}", n, sent, errors)) for i in range(threads)]
    for t in senders:
        t.start()
    return senders, sent, errors


def busy_journal(make_env, **client_options):
    """A server whose "journal" endpoint is blocked (at most 20 messages queued per
    connection) and a client with a 16 KiB outbox: ``(server, journal, blocked, client, ref)``."""
    server = make_env(max_queued_messages=20)
    journal = Journal()
    journal.name = "journal"
    server.setup_endpoint("journal", journal)
    blocked = block_endpoint(server, journal)
    client = make_env(max_outbox_bytes=16384, **client_options)
    return server, journal, blocked, client, client.endpoint_ref(server.address, "journal", server.authkey)


def test_a_flood_to_a_busy_endpoint_is_held_back_at_both_ends(make_env):
    """The endpoint is stuck: the server queues at most max_queued_messages of the flooding
    connection and stops reading it, TCP fills, the client's outbox fills and its senders
    wait. Another client's ask still gets in. Once released, everything is handled in order."""
    server, journal, blocked, client, ref = busy_journal(make_env)
    n = 10000
    senders, sent, errors = start_flood(ref, n)
    other = threading.Thread(target=lambda: errors.setdefault(
        "other", make_env().endpoint_ref(server.address, "journal", server.authkey).ask("other")))
    try:
        # white box: the server's reader waits for room, and so does a sender, the outbox full
        dispatcher = server._endpoints["journal"]
        wait_until(lambda: dispatcher.room_waiters == 1 and ref._conn is not None and ref._conn._room_waiters >= 1
                   and ref._conn._outbox_bytes >= 16384)
        assert server.queue_length("journal") == (20, 20)  # stopped at the bound, not one more
        assert ref._conn._outbox_bytes < 16384 + 2 * len(PAD)
        assert all(t.is_alive() for t in senders) and sum(sent.values()) < 2 * n and not errors
        other.start()  # another client is not held back by the flooding one's share
        wait_until(lambda: server.queue_length("journal")[0] == 21)
    finally:
        journal.release.set()
    for t in [*senders, other, blocked]:
        t.join(DEADLINE_S)
        assert not t.is_alive()
    assert errors == {"other": "other"}
    assert ref.ask("flush") == "flush"
    for sender in ("t0", "t1"):
        assert [m[2] for m in journal.journal if m[1] == sender] == list(range(n))
    assert server.queue_length("journal")[1] <= 21


def test_a_send_held_back_too_long_raises_naming_the_endpoint_and_the_bound(make_env):
    server, journal, blocked, client, ref = busy_journal(make_env, io_timeout_s=0.3)
    senders, _sent, errors = start_flood(ref, 10**6)  # until refused
    try:
        for t in senders:
            t.join(DEADLINE_S)
            assert not t.is_alive()
    finally:
        journal.release.set()
    blocked.join(DEADLINE_S)
    assert sorted(errors) == ["t0", "t1"]
    for e in errors.values():
        assert isinstance(e, RpcTimeoutError), repr(e)
        text = str(e)  # the outbox stayed full, or the writer stalled (whichever saw it first)
        assert re.match(r"cannot send to RpcEndpointRef\('journal' at 127\.0\.0\.1:\d+\): ", text), text
        assert "bound: 16384 bytes" in text and " 0.3 s" in text, text
    assert ref.ask("after") == "after"  # the endpoint caught up; the ref goes on


def test_a_send_waiting_for_room_notices_its_env_shutting_down(make_env):
    server, journal, blocked, client, ref = busy_journal(make_env)
    senders, _sent, errors = start_flood(ref, 10**6)
    try:
        wait_until(lambda: ref._conn is not None and ref._conn._room_waiters >= 1)
        client.shutdown()
        for t in senders:
            t.join(DEADLINE_S)
            assert not t.is_alive()
    finally:
        journal.release.set()
    blocked.join(DEADLINE_S)
    assert sorted(errors) == ["t0", "t1"]
    assert all(isinstance(e, RpcError) and "was shut down" in str(e) for e in errors.values()), errors


FLOOD_CHILD = """
import sys, threading
from statecore import rpc
address, key, tag, n = (sys.argv[1], int(sys.argv[2])), bytes.fromhex(sys.argv[3]), sys.argv[4], int(sys.argv[5])
with rpc.RpcEnv(max_outbox_bytes=4096) as env:  # a small outbox: the threads take turns waiting for room
    ref = env.endpoint_ref(address, "rec", key)
    failures = []
    def flood(sender):
        try:
            for seq in range(n):
                ref.send(("add", sender, seq))
            seen = ref.ask(("seen", sender))
            assert seen == list(range(n)), seen[:20]
        except BaseException as e:
            failures.append(repr(e))
    threads = [threading.Thread(target=flood, args=(f"{tag}-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print("ok" if not failures else failures)
"""


def test_a_flood_from_processes_and_threads_completes_in_order(make_env):
    server = make_env(max_queued_messages=50)
    ref = server.setup_endpoint("rec", Recorder())
    n, procs = 5000, 3
    children = [subprocess.Popen(
        [sys.executable, "-c", FLOOD_CHILD, server.address[0], str(server.address[1]), server.authkey.hex(),
         f"p{p}", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT}) for p in range(procs)]
    for child in children:
        out, err = child.communicate(timeout=DEADLINE_S * 2)
        assert child.returncode == 0, err
        assert out.split() == ["ok"], out
    assert ref.ask(("total",)) == procs * 4 * n
    assert server.queue_length("rec")[1] <= procs * 50  # one connection per child process


def test_flow_control_arguments_are_checked():
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="max_queued_messages must be an int >= 1"):
            RpcEnv(max_queued_messages=bad)
        with pytest.raises(ValueError, match="max_outbox_bytes must be an int >= 1"):
            RpcEnv(max_outbox_bytes=bad)
        with pytest.raises(ValueError, match="max_queued_bytes must be an int >= 1"):
            RpcEnv(max_queued_bytes=bad)
        with pytest.raises(ValueError, match="max_reply_backlog_bytes must be an int >= 1"):
            RpcEnv(max_reply_backlog_bytes=bad)
    assert rpc_threads() == []

# -- authentication and hostile peers ------------------------------------------------------------

def test_wrong_authkey_is_refused_and_logged_while_good_clients_go_on(make_env, logs):
    env = make_env(authkey=b"the right key")
    env.setup_endpoint("rec", Recorder())
    bad = rpc.endpoint_ref(env.address, "rec", b"a wrong key")
    with pytest.raises(AuthenticationError, match="rejected our authkey"):
        bad.ask(("echo", 1))
    with pytest.raises(AuthenticationError):
        bad.send(("add", "x", 1))
    logs.wait_for("refused", "failed to prove that it knows the authkey")
    good = rpc.endpoint_ref(env.address, "rec", "the right key")
    assert good.ask(("echo", 1)) == 1
    assert good.ask(("seen", "x")) == []


def test_client_refuses_a_server_that_does_not_know_the_key():
    """Mutual authentication: a fake server that accepts anything cannot prove the key."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()

        def fake_server():
            conn, _ = listener.accept()
            with conn:
                conn.sendall(MAGIC + os.urandom(32))
                recv_exact(conn, 76)
                conn.sendall(b"\x01" + struct.pack(">I", 1 << 20) + os.urandom(32))
                conn.recv(1)  # until the client hangs up

        thread = threading.Thread(target=fake_server, name="test-fake-server")
        thread.start()
        try:
            with pytest.raises(AuthenticationError, match="failed to prove"):
                rpc.endpoint_ref(address, "rec", b"key").ask(("echo", 1))
        finally:
            thread.join(DEADLINE_S)
    assert not thread.is_alive()


def test_garbage_is_dropped_and_logged(make_env, logs):
    env = make_env()
    good = env.setup_endpoint("rec", Recorder())
    with raw_connect(env) as sock:  # before the handshake
        recv_exact(sock, 40)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert_closed_by_server(sock)
    logs.wait_for("unexpected greeting")
    garbage = {
        "unknown value tag": raw_frame(SEND, 0, b"rec", b"\xfe"),
        "trailing bytes": raw_frame(SEND, 0, b"rec", b"NN"),
        "truncated value": raw_frame(ASK, 1, b"rec", b"s\x00\x00\x00\x09abc"),
        "unknown message kind": raw_frame(9, 0, b"rec", b"N"),
        "unexpected message kind 3": raw_frame(REPLY, 1, b"", b"N"),
        "shorter than an envelope": struct.pack(">I", 3) + b"abc",
        "deeper than 64": raw_frame(SEND, 0, b"rec", b"l\x00\x00\x00\x01" * 65 + b"N"),
    }
    for what, frame in garbage.items():  # after a good handshake
        with raw_connect(env) as sock:
            raw_handshake(sock, env.authkey)
            sock.sendall(frame)
            assert_closed_by_server(sock)
        logs.wait_for("dropped", what)
        assert good.ask(("echo", what)) == what
    assert good.ask(("total",)) == 0


def test_oversize_frames(make_env, logs):
    env = make_env(max_frame_bytes=4096)
    ref = env.setup_endpoint("rec", Recorder())
    with raw_connect(env) as sock:
        assert raw_handshake(sock, env.authkey) == 4096
        sock.sendall(struct.pack(">I", 4097))  # the header alone is enough to refuse it
        assert_closed_by_server(sock)
    logs.wait_for("frame of 4097 bytes exceeds the limit of 4096 bytes")
    assert len(ref.ask(("echo", b"x" * 4000))) == 4000
    with pytest.raises(ValueError, match="exceeds the frame limit of 4096"):  # refused before sending
        ref.ask(("echo", b"x" * 4096))
    with pytest.raises(ValueError, match="exceeds the frame limit"):
        ref.send(("add", "a", b"x" * 5000))
    # a reply larger than the asker's limit becomes an error reply
    small_client = make_env(max_frame_bytes=2048)
    with pytest.raises(RpcError, match="exceeds the asker's frame limit of 2048"):
        small_client.endpoint_ref(env.address, "rec", env.authkey).ask(("big", 3000))
    assert ref.ask(("total",)) == 0


def test_stalled_peers_block_no_one(make_env):
    # timeouts far beyond the test: the good client is served while the stallers hang on
    env = make_env(handshake_timeout_s=600, io_timeout_s=600)
    env.setup_endpoint("rec", Recorder())
    with raw_connect(env) as silent, raw_connect(env) as mid_frame:
        recv_exact(silent, 40)  # never answers the greeting
        raw_handshake(mid_frame, env.authkey)
        mid_frame.sendall(struct.pack(">I", 100) + b"\x02" * 10)  # a header and a tenth of the body
        good = rpc.endpoint_ref(env.address, "rec", env.authkey)
        for i in range(20):
            assert good.ask(("echo", i)) == i
        fresh = make_env().endpoint_ref(env.address, "rec", env.authkey)  # and a new connection
        assert fresh.ask(("echo", "new")) == "new"
        assert_still_open(silent)
        assert_still_open(mid_frame)


def test_stalled_peers_are_dropped_after_the_deadlines(make_env, logs):
    env = make_env(handshake_timeout_s=0.2, io_timeout_s=0.2)
    env.setup_endpoint("rec", Recorder())
    good = rpc.endpoint_ref(env.address, "rec", env.authkey)
    with raw_connect(env) as silent, raw_connect(env) as mid_frame:
        recv_exact(silent, 40)
        raw_handshake(mid_frame, env.authkey)
        mid_frame.sendall(struct.pack(">I", 100) + b"\x02" * 10)
        assert good.ask(("echo", 1)) == 1
        assert_closed_by_server(silent)
        assert_closed_by_server(mid_frame)
    logs.wait_for("handshake not done within 0.2 s")
    logs.wait_for("frame incomplete 0.2 s after its first byte")
    assert good.ask(("echo", 2)) == 2


# -- peers that do not read, resource exhaustion, large decodes ------------------------------------

class Tally(Gate):
    """A Gate (for "wait" asks) that keeps the first item of each one-way message (never the
    rest: decoded values are let go), counts the other asks, and answers ("big", n) with n
    bytes and anything else with itself."""

    def __init__(self, name="tally"):
        super().__init__()
        self.name, self.firsts, self.asks = name, [], 0

    def receive(self, message):
        self.firsts.append(message[0])

    def receive_and_reply(self, message):
        if message == "wait":
            return super().receive_and_reply(message)
        self.asks += 1
        if message[0] == "big":
            return b"x" * message[1]
        return message


def unread_asker(env, n, size, name=b"tally"):
    """A raw authenticated peer with a small receive buffer that sends ``n`` asks (request
    ids 1..n) for ``size``-byte replies and reads none of them."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(DEADLINE_S)
    sock.connect(env.address)
    raw_handshake(sock, env.authkey, limit=16 << 20)
    sock.sendall(b"".join(raw_frame(ASK, i, name, encode_value(("big", size))) for i in range(1, n + 1)))
    return sock


def served(env, sock):
    """White box: the server's side of the raw client connection ``sock`` (it is registered
    just after the server's last handshake message)."""
    peer = sock.getsockname()
    wait_until(lambda: peer in env._served)
    return env._served[peer]


def test_a_peer_that_never_reads_its_replies_holds_up_no_one(make_env):
    """A peer asks for 16 MiB of replies and reads none; its asks are queued (the endpoint is
    busy), so another thread than its reader answers them, as under load. Then 200 clients
    connect and hang up while a good client asks: its p99 stays under 100 ms, and the bad
    peer's replies wait in the server's backlog all along (its socket buffers are full)."""
    env = make_env()
    tally = Tally()
    env.setup_endpoint("tally", tally)
    blocked = block_endpoint(env, tally)
    try:
        bad = unread_asker(env, 16, 1 << 20)
        wait_until(lambda: env.queue_length("tally")[0] == 16)
    finally:
        tally.release.set()
    blocked.join(DEADLINE_S)
    with bad:
        wait_until(lambda: tally.asks == 16, deadline_s=10)  # all answered: nobody waited for the bad peer
        conn = served(env, bad)
        assert conn.backlog_bytes > 0 and not conn.dropped
        rng, churned = random.Random(7), []

        def churn():
            for i in range(200):
                with raw_connect(env) as sock:
                    if rng.random() < 0.5:
                        recv_exact(sock, 40)  # the greeting, then hang up in the handshake
                churned.append(i)

        good = rpc.endpoint_ref(env.address, "tally", env.authkey)
        assert good.ask(("echo", -1)) == ("echo", -1)  # connected before the clock starts
        churner = threading.Thread(target=churn)
        latencies, deadline = [], time.monotonic() + DEADLINE_S
        churner.start()
        try:
            while (churner.is_alive() or len(latencies) < 500) and len(latencies) < 20000:
                assert time.monotonic() < deadline
                t0 = time.perf_counter()
                assert good.ask(("echo", len(latencies)), timeout_s=5) == ("echo", len(latencies))
                latencies.append(time.perf_counter() - t0)
        finally:
            churner.join(DEADLINE_S)
        assert len(churned) == 200
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        print(f"\ngood client: {len(latencies)} asks while 200 connections came and went; "
              f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {latencies[-1] * 1e3:.2f} ms")
        assert p99 < 0.1, f"p99 {p99 * 1e3:.1f} ms"
        assert conn.backlog_bytes > 0 and not conn.dropped  # the bad peer stalled all along


def test_replies_a_slow_peer_reads_late_arrive_whole(make_env):
    """Replies left in the server's backlog (large ones, then many small ones in between
    reads) are written as the peer reads: all of them, whole."""
    env = make_env()
    env.setup_endpoint("tally", Tally())
    with unread_asker(env, 16, 1 << 20) as slow:
        conn = served(env, slow)
        wait_until(lambda: conn.backlog_bytes > 0)
        expected = {i: b"x" * (1 << 20) for i in range(1, 17)}
        for i in range(17, 317):
            slow.sendall(raw_frame(ASK, i, b"tally", encode_value(("echo", i))))
            expected[i] = ("echo", i)
        replies = {}
        for _ in range(len(expected)):
            (size,) = struct.unpack(">I", recv_exact(slow, 4))
            kind, request_id, name_length = struct.unpack(">BQH", recv_exact(slow, 11))
            assert (kind, name_length) == (REPLY, 0)
            replies[request_id] = decode_value(recv_exact(slow, size - 11))
        assert replies == expected
        wait_until(lambda: conn.backlog_bytes == 0 and not conn.backlog)
        assert not conn.dropped


def test_a_peer_that_never_reads_is_dropped_past_the_backlog_bound_or_the_io_timeout(make_env, logs):
    by_bytes = make_env(max_reply_backlog_bytes=2 << 20)
    by_time = make_env(io_timeout_s=0.5)  # the default bound (16 MiB) is not reached by 16 x 1 MiB
    for env in (by_bytes, by_time):
        env.setup_endpoint("tally", Tally())
    with unread_asker(by_bytes, 64, 1 << 20) as bad:  # far more than the socket buffers take
        record = logs.wait_for("dropped", "bytes of replies unread (bound: 2097152 bytes)")
        assert_closed_by_server(bad)
    unread = int(re.search(r"it left (\d+) bytes", record.getMessage()).group(1))
    assert 2 << 20 <= unread < (2 << 20) + (1 << 20) + 64  # the bound, plus at most the reply before it
    assert by_bytes.endpoint_ref(by_bytes.address, "tally").ask(("echo", 1)) == ("echo", 1)
    good = by_time.endpoint_ref(by_time.address, "tally")
    with unread_asker(by_time, 16, 1 << 20) as bad:
        assert good.ask(("echo", 2)) == ("echo", 2)
        logs.wait_for("dropped", "read none of its replies for 0.5 s")
        assert_closed_by_server(bad)
    assert good.ask(("echo", 3)) == ("echo", 3)


class FailingThreads:
    """Stands in for the threading module inside statecore.rpc: the first ``failures``
    connection threads fail to start, as under a process's thread limit."""

    def __init__(self, failures):
        self.failures, self.fired = failures, 0

    def __getattr__(self, name):
        return getattr(threading, name)

    def Thread(self, *args, **kwargs):  # noqa: N802 (threading's name)
        thread = threading.Thread(*args, **kwargs)
        if thread.name.startswith("statecore-rpc-conn") and self.failures:
            self.failures -= 1
            thread.start = self._refuse
        return thread

    def _refuse(self):
        self.fired += 1
        raise RuntimeError("can't start new thread")


def test_the_acceptor_survives_threads_that_fail_to_start(make_env, logs, monkeypatch):
    env = make_env()
    env.setup_endpoint("rec", Recorder())
    threads = FailingThreads(3)
    monkeypatch.setattr(rpc, "threading", threads)
    for _ in range(3):
        with raw_connect(env) as sock:
            sock.settimeout(5)
            assert sock.recv(40) == b""  # closed, no greeting: its thread did not start
    assert threads.fired == 3
    logs.wait_for("could not start a thread", "can't start new thread")
    assert rpc.endpoint_ref(env.address, "rec", env.authkey).ask(("echo", 1)) == 1
    assert make_env().endpoint_ref(env.address, "rec", env.authkey).ask(("echo", 2)) == 2


class ExhaustedListener:
    """Stands in for an env's listening socket: while ``exhausted``, accept fails as when a
    process is out of descriptors (EMFILE); the time of each such call is kept."""

    def __init__(self, real):
        self.real, self.exhausted, self.calls = real, True, []

    def accept(self):
        if self.exhausted:
            self.calls.append(time.monotonic())
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.real.accept()

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_out_of_descriptors_the_acceptor_backs_off_then_serves_again(make_env, logs, monkeypatch):
    env = make_env()
    env.setup_endpoint("rec", Recorder())
    listener = ExhaustedListener(env._listener)
    monkeypatch.setattr(env, "_listener", listener)
    outcome = {}
    asker = threading.Thread(target=lambda: outcome.setdefault(
        "echo", rpc.endpoint_ref(env.address, "rec", env.authkey).ask(("echo", 1))))
    asker.start()  # its connection waits in the listen backlog: accept is called, and fails
    try:
        wait_until(lambda: len(listener.calls) >= 6)
        calls = list(listener.calls)
    finally:
        listener.exhausted = False
    asker.join(DEADLINE_S)
    assert outcome == {"echo": 1}  # served once descriptors are back
    assert calls[5] - calls[0] >= 0.3, calls  # paused 10, 20, 40, 80 and 160 ms between them
    assert len([t for t in calls if t < calls[0] + 0.3]) <= 5
    warnings = [r for r in logs.records if "could not accept a connection" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # then at most one per 10 s


def dicts_payload(n):
    """A list of ``n`` one-entry dicts: 7 bytes each encoded, about 30 times that decoded."""
    return b"l" + struct.pack(">I", n) + b"d\x00\x00\x00\x01NN" * n


def test_the_queue_bound_counts_bytes_of_frames_left_undecoded(make_env):
    """A flood of 16 KiB frames that each decode to about 0.5 MB, to a busy endpoint: the
    connection's share stops at 64 KiB of frames (not at the 1000 messages), nothing queued
    is decoded, and the server's memory stays within a few frames and one decoded value."""
    import tracemalloc
    server = make_env(max_queued_bytes=64 << 10)
    tally = Tally()
    server.setup_endpoint("tally", tally)
    dispatcher = server._endpoints["tally"]
    n, payload = 100, dicts_payload(2340)
    flood = b"".join(raw_frame(SEND, 0, b"tally", b"t\x00\x00\x00\x02" + encode_value(seq) + payload)
                     for seq in range(n))
    frame_bytes = len(flood) // n
    blocked = block_endpoint(server, tally)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with raw_connect(server) as flooder:
            raw_handshake(flooder, server.authkey)
            sender = threading.Thread(target=flooder.sendall, args=(flood,))
            sender.start()
            try:
                wait_until(lambda: dispatcher.room_waiters == 1 or server.queue_length("tally")[0] == n)
                held = tracemalloc.get_traced_memory()[0] - base
                queued = server.queue_length("tally")[0]
            finally:
                tally.release.set()
            sender.join(DEADLINE_S)
            blocked.join(DEADLINE_S)
            wait_until(lambda: len(tally.firsts) == n)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    print(f"\n{n} frames of {frame_bytes} bytes: {queued} queued, {held / 2**20:.2f} MiB held while blocked, "
          f"{peak / 2**20:.2f} MiB at the peak")
    assert tally.firsts == list(range(n))
    assert queued == (64 << 10) // frame_bytes + 1  # stopped by the byte bound (the last one crosses it)
    assert dispatcher.queue_bytes_peak <= (64 << 10) + frame_bytes
    assert held < 1 << 20, held
    assert peak < 4 << 20, peak  # one decoded message (about 0.5 MB) at a time


def test_a_queued_frame_that_does_not_decode_drops_its_connection_and_what_came_after(make_env, logs):
    server = make_env()
    tally = Tally()
    server.setup_endpoint("tally", tally)
    blocked = block_endpoint(server, tally)
    try:
        with raw_connect(server) as sock:
            raw_handshake(sock, server.authkey)
            sock.sendall(raw_frame(SEND, 0, b"tally", encode_value((0,))) + raw_frame(SEND, 0, b"tally", b"\xfe")
                         + raw_frame(SEND, 0, b"tally", encode_value((2,))))
            wait_until(lambda: server.queue_length("tally")[0] == 3)  # queued undecoded
            tally.release.set()
            assert_closed_by_server(sock)
    finally:
        tally.release.set()
    blocked.join(DEADLINE_S)
    logs.wait_for("dropped", "unknown value tag 0xfe")
    assert server.endpoint_ref(server.address, "tally").ask(("echo", 1)) == ("echo", 1)
    assert tally.firsts == [0]


# -- restarts, shutdown, pickling ----------------------------------------------------------------

def test_ref_reconnects_after_the_server_restarts_on_the_same_port(make_env):
    key = b"restart key"
    first = make_env(authkey=key)
    first.setup_endpoint("rec", Recorder())
    port = first.address[1]
    ref = rpc.endpoint_ref(first.address, "rec", key)
    ref.send(("add", "a", 0))
    assert ref.ask(("seen", "a")) == [0]
    first.shutdown()
    with pytest.raises(RpcConnectionError, match=f"127.0.0.1:{port}"):
        ref.ask(("seen", "a"))
    second = make_env(port=port, authkey=key)
    second.setup_endpoint("rec", Recorder())
    ref.send(("add", "a", 1))
    assert ref.ask(("seen", "a")) == [1]
    second.shutdown()  # and straight away a third: the first message after it goes through
    third = make_env(port=port, authkey=key)
    third.setup_endpoint("rec", Recorder())
    assert ref.ask(("seen", "a")) == []
    ref.send(("add", "a", 2))
    assert ref.ask(("seen", "a")) == [2]


def test_shutdown_leaves_no_thread_and_no_socket(logs):
    before = set(threading.enumerate())
    env = RpcEnv()
    address = env.address
    endpoints = [Recorder(), Recorder()]
    own = env.setup_endpoint("a", endpoints[0])
    env.setup_endpoint("b", endpoints[1])
    outside = rpc.endpoint_ref(address, "b", env.authkey)
    assert own.ask(("echo", 1)) == 1 and outside.ask(("echo", 2)) == 2
    with raw_connect(env) as staller:
        recv_exact(staller, 40)
        assert len(rpc_threads()) >= 5  # acceptor, two endpoints, three connections
        env.shutdown()
        assert_closed_by_server(staller)
    assert rpc_threads() == [] and set(threading.enumerate()) <= before
    assert all(e.stopped.is_set() for e in endpoints)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=DEADLINE_S).close()
    with pytest.raises(RpcError, match="shut down"):
        own.ask(("echo", 1))
    with pytest.raises(RpcConnectionError, match=f"{address[0]}:{address[1]}"):
        outside.ask(("echo", 1))
    with pytest.raises(RpcError, match="shut down"):
        env.setup_endpoint("c", Recorder())
    env.shutdown()  # twice is fine
    rpc.close_connections()


def test_a_forked_child_gets_its_own_connection(make_env):
    """A ref inherited across fork must not write into the parent's connection (nor into
    whatever reuses its descriptor number in the child): the child reconnects."""
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    shared = rpc.endpoint_ref(env.address, "rec", env.authkey)
    assert ref.ask(("echo", "before")) == "before" and shared.ask(("echo", 0)) == 0
    parents = shared._conn._sock.getsockname()  # white box: the local end of the parent's connection
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: only os._exit, whatever happens
        code = 1
        try:
            with open(os.devnull, "wb") as reuses_a_descriptor:
                shared.send(("add", "child", 1))
                code = 0 if (shared.ask(("seen", "child")) == [1] and ref.ask(("echo", "child")) == "child"
                             and shared._conn._sock.getsockname() != parents
                             and reuses_a_descriptor.tell() == 0) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ref.ask(("echo", "after")) == "after" and shared.ask(("seen", "child")) == [1]


def test_pickled_ref_works_after_unpickling(make_env):
    env = make_env()
    ref = env.setup_endpoint("rec", Recorder())
    data = pickle.dumps(ref)
    restored = pickle.loads(data)
    assert restored == ref and hash(restored) == hash(ref)
    assert (restored.address, restored.name, restored.authkey) == (env.address, "rec", env.authkey)
    assert env.authkey.hex() not in repr(restored)
    restored.send(("add", "p", 1))
    assert restored.ask(("seen", "p")) == [1]
    assert ref.ask(("total",)) == 1
