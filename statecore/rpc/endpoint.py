"""Endpoints: :class:`RpcEndpoint`, what an RpcEnv hosts, and the dispatcher that runs its
handlers one message at a time in arrival order (on a connection's reader when idle, else
on the endpoint's own thread). The rules are in ``docs/rpc.md`` ("Semantics").
"""
import collections
import logging
import threading
import traceback
from typing import Any

from statecore.rpc.wire import (_Ask, check_value, _DECODE_ERRORS, _decoder, DEFAULT_MAX_QUEUED_BYTES,
                                DEFAULT_MAX_QUEUED_MESSAGES, DEFAULT_MAX_UNTYPED_MESSAGE_BYTES, _error_frame, _frame,
                                _REFUSED, _REMOTE_NAMES, _Reply, _type_name, _undecodable, _where)

log = logging.getLogger(__name__)

class RpcEndpoint:
    """Base class of what an RpcEnv hosts. One message at a time, in each sender's order.

    ``message_type`` is what its messages are decoded as before they reach ``receive`` or
    ``receive_and_reply``: plain values (``Any``) unless a subclass declares the union of
    its :class:`Message` Structs. A message that does not decode as it drops its connection
    (see "Messages" in docs/rpc.md).

    ``max_message_bytes`` bounds one encoded message, checked before it is decoded (a larger
    one drops its connection too): ``None`` means the env's frame limit for a typed endpoint
    and ``DEFAULT_MAX_UNTYPED_MESSAGE_BYTES`` for an untyped one, whose decode time grows with
    its object count (one object per byte at worst) and holds the interpreter meanwhile."""

    message_type = Any
    max_message_bytes = None

    def receive(self, message):
        """A one-way message (``send``)."""
        log.warning("%s ignored a one-way message of type %s", type(self).__name__, type(message).__name__)

    def receive_and_reply(self, message):
        """An ``ask``: return the reply value; an exception goes back to the asker as RpcError."""
        raise NotImplementedError(f"{type(self).__name__} does not answer asks")

    def on_stop(self):
        """Called once the endpoint is stopped, after the messages queued before that."""


_INLINE_DRAIN = 16  # queued messages a reader handles after its own before leaving the rest to the thread


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
        message_type = getattr(endpoint, "message_type", Any)
        self.decoder = _decoder(message_type)
        self.max_message_bytes = _message_bound(endpoint, message_type)
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
        ``conn``'s share of the queue is at a bound. False once the endpoint is stopped. A
        message over the endpoint's bound drops ``conn`` before anything is queued."""
        if len(envelope.message) > self.max_message_bytes:
            self.refuse_oversize(conn, envelope.request_id if type(envelope) is _Ask else None, len(envelope.message))
            return True
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

    def refuse_oversize(self, conn, request_id, size):
        """Drop ``conn`` if a message of ``size`` encoded bytes is over the endpoint's bound
        (``request_id``: the ask's, None for a send); whether it was."""
        if size <= self.max_message_bytes:
            return False
        self._refuse(conn, request_id, f"a message of {size} bytes to {self.name!r} exceeds the "
                                       f"{self.max_message_bytes} bytes {type(self.endpoint).__name__} takes")
        return True

    def _refuse(self, conn, request_id, reason):
        """Drop ``conn`` for a message its endpoint does not take (logged with ``reason``). An
        ask (``request_id`` not None) is answered first with an RpcProtocolError, after the
        replies its reader holds."""
        refusal = None
        if request_id is not None:  # remote_type "": the RPC layer refused it; the asker drops its connection
            refusal = _error_frame(request_id, _REFUSED, "", f"{reason} (the server at {self.where} "
                                   f"dropped the connection)", limit=conn.peer_max_frame)
        if conn.pending and conn.reader_ident == threading.get_ident():
            conn.flush()
        conn.drop(reason, refusal)

    def _handle(self, conn, envelope):
        if conn.dropped:  # the server hung up on it: what it sent is not handled
            return
        asking = type(envelope) is _Ask
        try:
            message = self.decoder.decode(envelope.message)
        except _DECODE_ERRORS as e:
            self._refuse(conn, envelope.request_id if asking else None, str(_undecodable(
                e, f"a message to {self.name!r} is not one {type(self.endpoint).__name__} takes")))
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


def _message_bound(endpoint, message_type):
    """The largest encoded message ``endpoint`` takes (see RpcEndpoint.max_message_bytes)."""
    bound = getattr(endpoint, "max_message_bytes", None)
    if bound is None:
        return DEFAULT_MAX_UNTYPED_MESSAGE_BYTES if message_type is Any else _UNBOUNDED
    if type(bound) is not int or bound < 1:
        raise ValueError(f"max_message_bytes of {type(endpoint).__name__} must be an int >= 1 or None, got {bound!r}")
    return bound


_UNBOUNDED = float("inf")  # the env's frame limit bounds it already
