"""The server side of statecore's RPC: :class:`RpcEnv` (the listener, its endpoints, its
threads) and the connections it serves, with the replies they have not yet taken. The
rules (flow control, server memory, stopping) are in ``docs/rpc.md``.
"""
import logging
import os
import secrets
import select
import selectors
import socket
import threading
import time

from statecore.errors import AuthenticationError, EndpointAlreadyRegisteredError, RpcError, RpcProtocolError
from statecore.rpc.wire import (_check_name, _DECODE_ERRORS, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_HANDSHAKE_TIMEOUT_S,
                                DEFAULT_IO_TIMEOUT_S, DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_OUTBOX_BYTES,
                                DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_MESSAGES, DEFAULT_MAX_REPLY_BACKLOG_BYTES,
                                DEFAULT_REPLY_STALL_S, _envelope_head, _error_frame, _FrameReader, _MAX_U32,
                                _MIN_FRAME_BYTES, _normalize_authkey, _Send, _server_envelopes, _Stalled, _tune,
                                _undecodable, _where)
from statecore.rpc.handshake import _server_handshake
from statecore.rpc.client import _ConnectionPool, RpcEndpointRef
from statecore.rpc.endpoint import _Dispatcher

log = logging.getLogger(__name__)

_ACCEPT_PAUSE_S = (0.01, 1.0)  # the acceptor's pause after a failure: the first, and the longest
_ACCEPT_LOG_EVERY_S = 10.0  # at most one warning this often while accepting keeps failing
_DONTWAIT = socket.MSG_DONTWAIT  # replies are written without waiting (see _ServerConnection)
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16)  # pieces per sendmsg

_PENDING_BYTES = 2**18  # a reader writes the replies it holds once they come to this much
_MIN_PROGRESS_BYTES = 2**18  # a peer with replies waiting takes at least this much every reply_stall_s


class _ServerConnection:
    """A client's connection as the server sees it, and the replies not yet written to it.

    A reply must never wait for its peer: the thread that makes it runs a handler and holds
    the endpoint, so one peer that does not read would hold up every client of that
    endpoint. Replies are written with non-blocking sends; what the socket does not take
    stays in ``backlog``, and the env's :class:`_ReplyWriter` writes it as the peer reads.
    A peer is dropped (logged; its socket shut down, so its reader sees the end and closes
    it) when a reply comes while ``max_reply_backlog_bytes`` or more wait for it, when it
    takes less than ``_MIN_PROGRESS_BYTES`` of its backlog in ``reply_stall_s`` (a socket
    whose peer reads nothing may still take a little now and then), or when one of its frames does not
    decode; its messages still queued are then not handled. Replies made by the
    connection's own reader are held until it has no further frame in hand (or holds
    ``_PENDING_BYTES``), then written together: frames that arrived together are answered
    with one write."""

    __slots__ = ("sock", "peer", "peer_max_frame", "env", "lock", "closed", "dropped", "broken", "reader_ident",
                 "pending", "pending_bytes", "backlog", "backlog_bytes", "progress_at", "taken")

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
        self.progress_at = 0.0  # when the backlog began, or the peer last took _MIN_PROGRESS_BYTES of it (monotonic)
        self.taken = 0  # bytes of the backlog the peer took since progress_at

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
            self.progress_at, self.taken = time.monotonic(), 0
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
                self.taken += sent
                if self.taken >= _MIN_PROGRESS_BYTES:
                    self.progress_at, self.taken = now, 0
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
            timeout = self.env.reply_stall_s
            if now - self.progress_at >= timeout:
                self._drop(f"it took {self.taken} bytes of its replies in {timeout:g} s, less than "
                           f"{_MIN_PROGRESS_BYTES} ({self.backlog_bytes} bytes unsent)")
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
    (see _ServerConnection) as each peer reads them, and drops the peers that read too little
    for ``reply_stall_s``. It waits only in ``poll``, so no peer can hold it up."""

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


class _AcceptFailed(Exception):
    """Internal: a connection could not be accepted, or its reader thread not started."""


class RpcEnv:
    """A TCP server hosting named endpoints, and the client connections of the refs it makes.

    Threads: one accepts connections, one per connection reads it (and runs handlers when
    their endpoint is idle), one per endpoint works through messages that found it busy,
    and one writes the replies that peers did not take at once (see _ServerConnection).

    ``max_frame_bytes`` bounds a frame either way, ``io_timeout_s`` how long a started frame
    (or a blocked write, or a send waiting for room in a full outbox) may take,
    ``reply_stall_s`` how long a peer may take less than 256 KiB of its unsent replies,
    ``handshake_timeout_s`` how long a new peer may take to authenticate; a peer breaking
    any of them is disconnected and logged, others go on. Flow
    control (see docs/rpc.md): ``max_queued_messages`` and ``max_queued_bytes``
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
                 max_reply_backlog_bytes=DEFAULT_MAX_REPLY_BACKLOG_BYTES, reply_stall_s=DEFAULT_REPLY_STALL_S):
        if not _MIN_FRAME_BYTES <= max_frame_bytes <= _MAX_U32:
            raise ValueError(f"max_frame_bytes must be in [{_MIN_FRAME_BYTES}, {_MAX_U32}], got {max_frame_bytes}")
        for arg, value in (("io_timeout_s", io_timeout_s), ("handshake_timeout_s", handshake_timeout_s),
                           ("connect_timeout_s", connect_timeout_s), ("reply_stall_s", reply_stall_s)):
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
        self.reply_stall_s = reply_stall_s
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

    def _vetter(self, conn):
        """The reader's ``vet`` for ``conn``: a large frame whose head names an endpoint that
        takes no message that big drops ``conn`` before the rest of it is read."""
        def vet(size, head):
            parsed = _envelope_head(head)
            if parsed is not None:
                request_id, name, offset = parsed
                dispatcher = self._endpoints.get(name)
                if dispatcher is not None and dispatcher.refuse_oversize(conn, request_id, size - offset):
                    raise EOFError("dropped before the rest of the frame was read")  # the reader stops, quietly
        return vet

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
            reader = _FrameReader(sock, self.max_frame_bytes, self.io_timeout_s, vet=self._vetter(conn))
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
