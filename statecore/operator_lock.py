"""The exclusive lock on one operator of a checkpoint: ``<checkpoint>/<operator>/_lock``.

Offline commands that change an operator's files (``repartition``, ``rewrite``,
``import-spark``) hold it for their whole run; a running :class:`~pyspark_glue.StatefulOperator` holds it from its
first batch until it is closed (kind ``"query"``), so each refuses while the other holds it.
The lock needs nothing but a create that refuses an existing name
(``StoreFiles.write_atomic(..., overwrite=False)``), so it works on any filesystem where that
create is atomic. The file is JSON naming its holder (command, host, pid and the pid's start
time, a random token) and a lease (``expires``) that the holder renews while it runs.

A lock whose holder is dead is taken over: on the holder's own host, when its pid is gone
(or is another process, told by the start time in ``/proc/<pid>/stat``); from anywhere, once
its lease expired. Taking over is race-free: a successor first creates a claim
``_lock.takeover-<token of the stale lock>`` without overwrite (one successor per stale lock
gets it), checks the lock still holds that token, then replaces it. The rules, and how to
clear a lock by hand, are in ``docs/operating.md``, "The operator lock".
"""
import contextlib
import datetime
import hashlib
import logging
import os
import socket
import threading
import time

from statecore.checkpoint import json_bytes, parse_json
from statecore.errors import StateStoreError
from statecore.files import open_store_files
from statecore.operator_files import operator_dir

__all__ = ["OperatorLock", "OperatorLockedError", "held", "is_lock_file", "LOCK_FILE", "LEASE_S", "OFFLINE", "QUERY"]

log = logging.getLogger(__name__)

LOCK_FILE = "_lock"  # <checkpoint>/<operator>/_lock
TAKEOVER_PREFIX = f"{LOCK_FILE}.takeover-"  # + the stale lock's token: the one successor's claim
LOCK_FORMAT = "statecore-operator-lock-1"
MAX_LOCK_BYTES = 64 << 10  # a lock file is a few hundred bytes
LEASE_S = 300.0  # renewed every third of it; a holder on another host is dead once it expired
OFFLINE, QUERY = "offline", "query"


class OperatorLockedError(StateStoreError, RuntimeError):
    """The operator's lock is held by a live holder (the message names it and how to clear a
    stale one); nothing was written."""


def is_lock_file(name):
    """Whether ``name`` (in an operator's directory) is the lock or a successor's claim on it."""
    return name == LOCK_FILE or name.startswith(TAKEOVER_PREFIX)


def _process_start(pid):
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat``), or
    None where there is no /proc; raises ProcessLookupError if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise ProcessLookupError(pid) from None
        return None
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # after "(comm) state": field 22, starttime


def _pid_alive(pid, start):
    """Whether ``pid`` (started at ``start``, if known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        now = _process_start(pid)
    except ProcessLookupError:
        return False
    return start is None or now is None or now == start


def _when(seconds):
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class OperatorLock:
    """One would-be holder of operator ``operator_id``'s lock under ``checkpoint``.

    ``command`` names the holder in messages (``"repartition"``); ``kind`` is :data:`OFFLINE`
    or :data:`QUERY`. :meth:`acquire` takes it or raises :class:`OperatorLockedError`;
    :meth:`renew` extends the lease; :meth:`release` deletes the file if it is still ours.
    """

    def __init__(self, checkpoint, operator_id, command, kind=OFFLINE, storage_options=None, lease_s=LEASE_S):
        if kind not in (OFFLINE, QUERY):
            raise ValueError(f"kind must be {OFFLINE!r} or {QUERY!r}, got {kind!r}")
        self.checkpoint, self.operator_id = checkpoint, operator_id
        self.command, self.kind, self.lease_s = command, kind, float(lease_s)
        self.files = open_store_files(operator_dir(checkpoint, operator_id), storage_options)
        self.token = None  # ours while we hold it
        self.expires = self._started = None

    @property
    def path(self):
        return self.files.path(LOCK_FILE)

    # -- the file -----------------------------------------------------------------------------

    def read(self):
        """The lock's record (with ``identity``: its token, or a digest of a file that is not a
        lock record), or None if there is no lock."""
        try:
            raw = self.files.read_bytes(LOCK_FILE, max_bytes=MAX_LOCK_BYTES)
        except FileNotFoundError:
            return None
        except ValueError as e:  # oversize or not a regular file: nobody's record
            return {"identity": "unreadable", "problem": str(e)}
        try:
            record = parse_json(raw, self.path, "operator lock")  # bounded nesting, checksum checked
            if not isinstance(record, dict) or not isinstance(record.get("token"), str):
                raise ValueError("not a lock record")
            float(record["expires"])
        except (ValueError, KeyError, TypeError) as e:
            return {"identity": hashlib.sha256(raw).hexdigest()[:32], "problem": f"not a lock record ({e})"}
        record["identity"] = record["token"]
        return record

    def _record(self, now):
        pid = os.getpid()
        try:
            start = _process_start(pid)
        except ProcessLookupError:
            start = None
        return {"format": LOCK_FORMAT, "kind": self.kind, "command": self.command, "host": socket.gethostname(),
                "pid": pid, "pid_start": start, "token": self.token, "started": self._started,
                "renewed": now, "expires": now + self.lease_s, "lease_s": self.lease_s}

    def _write(self, overwrite):
        now = time.time()
        record = self._record(now)
        payload = json_bytes(record, indent=1)
        self.files.write_atomic(LOCK_FILE, lambda f: f.write(payload), overwrite=overwrite)
        self.expires = record["expires"]

    # -- taking and giving back ---------------------------------------------------------------------

    def acquire(self):
        """Take the lock: create it, or take over a stale one. OperatorLockedError naming the
        holder if a live one holds it (or another successor is taking over the stale one)."""
        self.token, self._started = os.urandom(16).hex(), time.time()
        try:
            for _ in range(3):  # the holder may release between our create and our read
                try:
                    self._write(overwrite=False)
                    return self
                except FileExistsError:
                    pass
                held = self.read()
                if held is None:
                    continue
                reason = self.stale_reason(held)
                if reason is None:
                    raise OperatorLockedError(self.describe(held))
                self._take_over(held, reason)
                return self
            raise OperatorLockedError(f"{self.path}: the lock was taken and given back repeatedly while this "
                                      f"{self.command} tried to take it; try again")
        except BaseException:
            self.token = None
            raise

    def _take_over(self, held, reason):
        claim = f"{TAKEOVER_PREFIX}{held['identity']}"
        try:
            self.files.write_atomic(claim, lambda f: f.write(self.token.encode()), overwrite=False)
        except FileExistsError:
            raise OperatorLockedError(f"{self.path}: another run is taking over the stale lock of "
                                      f"{self._holder(held)} ({reason}); try again") from None
        try:
            now = self.read()
            if now is not None and now["identity"] != held["identity"]:
                raise OperatorLockedError(self.describe(now))  # a successor before us replaced it
            self.files.delete([LOCK_FILE])
            try:
                self._write(overwrite=False)
            except FileExistsError:  # a fresh acquirer created it after the delete
                raise OperatorLockedError(self.describe(self.read() or held)) from None
        finally:
            self.files.delete([claim])
        log.warning("took over the lock %s of %s: %s", self.path, self._holder(held), reason)

    def stale_reason(self, held, now=None):
        """Why the lock ``held`` may be taken over, or None if its holder may be alive."""
        now = time.time() if now is None else now
        if "problem" in held:
            mtime = self.files.mtime(LOCK_FILE)
            if mtime is not None and now - mtime > self.lease_s:
                return f"it is {held['problem']} and was last written {now - mtime:.0f} s ago"
            return None
        expires = float(held["expires"])
        if expires <= now:
            return f"its lease expired at {_when(expires)}"
        pid = held.get("pid")
        if held.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
            return None
        if not _pid_alive(pid, held.get("pid_start")):
            return f"its process {pid} on this host is gone"
        if held.get("kind") == QUERY and self.kind == QUERY and pid == os.getpid():
            return "an earlier StatefulOperator of this process held it (a query restarted in the same driver)"
        return None

    def renew(self):
        """Extend the lease if the lock is still ours; False (and the token forgotten) if not."""
        if self.token is None:
            return False
        held = self.read()
        if held is None or held["identity"] != self.token:
            log.error("lost the lock %s of this %s: it is now %s", self.path, self.command,
                      "gone" if held is None else f"held by {self._holder(held)}")
            self.token = None
            return False
        self._write(overwrite=True)
        return True

    def ensure(self):
        """Hold the lock at the start of a query's batch: True if it was held since the last
        call (one read; the lease is renewed when half of it is spent), False if it had to be
        taken again (something may have changed the operator meanwhile). OperatorLockedError
        if a live holder has it."""
        if self.token is not None:
            held = self.read()
            if held is not None and held["identity"] == self.token:
                if self.expires - time.time() < self.lease_s / 2:
                    self._write(overwrite=True)
                return True
        self.acquire()
        return False

    def release(self):
        """Delete the lock if it is still ours (best effort; a stale lock is taken over anyway)."""
        token, self.token = self.token, None
        if token is None:
            return
        try:
            held = self.read()
            if held is not None and held["identity"] == token:
                self.files.delete([LOCK_FILE])
        except OSError as e:
            log.warning("could not release the lock %s: %s", self.path, e)

    @contextlib.contextmanager
    def heartbeat(self):
        """Renew the lease every third of it while the block runs (a thread)."""
        stop = threading.Event()

        def beat():
            while not stop.wait(self.lease_s / 3):
                try:
                    if not self.renew():
                        return
                except OSError as e:
                    log.warning("could not renew the lock %s: %s", self.path, e)

        thread = threading.Thread(target=beat, name=f"statecore-lock-{self.operator_id}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    # -- messages ---------------------------------------------------------------------------------

    def _holder(self, held):
        if "problem" in held:
            return f"an unknown holder ({held['problem']})"
        what = "a running query (StatefulOperator)" if held.get("kind") == QUERY else \
            f"statecore {held.get('command')}"
        return (f"{what} on host {held.get('host')}, pid {held.get('pid')}, since "
                f"{_when(float(held.get('started') or held['renewed']))}")

    def describe(self, held):
        """The one line refusing this command because of ``held``."""
        if self.kind == QUERY:
            doing = f"batch of operator {self.operator_id} cannot run"
        else:
            doing = f"{self.command} of operator {self.operator_id} cannot run"
        wait = ("stop that query and close its StatefulOperator" if held.get("kind") == QUERY
                else "wait until it ends")
        expires = f" (its lease runs until {_when(float(held['expires']))})" if "expires" in held else ""
        return (f"{self.path} is held by {self._holder(held)}{expires}: this {doing}; {wait}. A lock whose "
                f"holder died is taken over by the next run (its pid gone on the same host, or its lease expired); "
                f"delete the file by hand only if you are sure its holder is dead")


@contextlib.contextmanager
def held(checkpoint, operator_id, command, storage_options=None, lease_s=LEASE_S):
    """Hold operator ``operator_id``'s lock (an offline ``command``) for the block, renewing
    its lease, and release it at the end whatever happens."""
    lock = OperatorLock(checkpoint, operator_id, command, OFFLINE, storage_options, lease_s).acquire()
    try:
        with lock.heartbeat():
            yield lock
    finally:
        lock.release()
