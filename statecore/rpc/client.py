"""The client side of statecore's RPC: :class:`RpcEndpointRef`, the connections refs share
(one per endpoint address per RpcEnv, or per process), and how concurrent callers take
turns at the socket. The rules (ordering, flow control, retries) are in ``docs/rpc.md``.
"""
import itertools
import logging
import os
import select
import socket
import threading
import time
import weakref
from typing import Any

import msgspec

from statecore.errors import (AuthenticationError, REMOTE_ERRORS, RpcConnectionError, RpcError, RpcProtocolError,
                              RpcTimeoutError)
from statecore.rpc.wire import (_Ask, _check_name, check_value, _client_envelopes, _DECODE_ERRORS,
                                DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_IO_TIMEOUT_S,
                                DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_OUTBOX_BYTES, _Error, _frame, _FrameReader,
                                _normalize_address, _normalize_authkey, _REFUSED, _Send, _Stalled, _tune, _undecodable,
                                _where)
from statecore.rpc.handshake import _client_handshake

log = logging.getLogger(__name__)

_request_ids = itertools.count(1)  # next() is atomic under the GIL: one sequence per process

class _NotSent(Exception):
    """Internal: the frame was not (completely) written, so it is safe to retry elsewhere."""


class _Backlogged(Exception):
    """Internal: the frame was not sent because the server did not take earlier ones (the
    outbox stayed full, or the writer stalled); not retried, since earlier frames are ahead
    of it (or lost)."""


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
        "Flow control" in docs/rpc.md); RpcTimeoutError if it stays full.

        ``message``: a Struct of the endpoint's ``message_type``, or a plain value (see
        "Messages" in docs/rpc.md: TypeError for anything else, before sending).
        At most once: see docs/rpc.md for the case where a send is lost."""
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

