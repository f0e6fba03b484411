# cython: language_level=3
"""ProviderLock: the re-entrant lock a provider guards its in-memory versions with, made so
that a compiled per-row call can take and drop it per call for a few C statements.

``threading.RLock`` would do, but taken from C it costs a call through Python's protocol,
argument parsing, a semaphore and a clock read per acquire: more than the lookup it guards.
Here the holder and its depth are two fields read and written only with the GIL held, so
the GIL makes each acquire and release atomic, and no OS lock is touched while nobody waits.

Waiting. A thread that finds the lock held by another takes ``wait_lock`` (an OS lock) on
the holder's behalf, if nobody did yet (``handoff``), and blocks on it without the GIL; the
holder's last release releases ``wait_lock``, which wakes one waiter. The woken waiter, with
the GIL again, takes the lock if it is free (keeping ``wait_lock`` as its own handoff), or,
if a third thread took it in between, leaves ``wait_lock`` held on that thread's behalf and
waits again. So ``wait_lock`` is held exactly while ``handoff`` is set or a woken waiter has
not yet got the GIL back, and a holder's last release always wakes a waiter. PyThread locks
may be released by any thread, which the handoff relies on. A blocked wait is interrupted by
signals (KeyboardInterrupt), as RLock's is. Not fair (neither is RLock's).

It needs the GIL: on a build without one it refuses to import.
"""
cimport cython
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport (
    NOWAIT_LOCK, PY_LOCK_ACQUIRED, PY_LOCK_INTR, PyLockStatus, PyThread_acquire_lock, PyThread_allocate_lock,
    PyThread_free_lock, PyThread_type_lock,
)

import functools
import os
import sys
import time

cdef extern from "pythread.h":
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds,
                                             int intr_flag) nogil

if not getattr(sys, "_is_gil_enabled", lambda: True)():
    raise ImportError("statecore._lock relies on the GIL, which this interpreter runs without")

# Whether the functions marked ``requires_lock`` check that their caller holds the lock (a
# debugging aid: set STATECORE_DEBUG_LOCKS=1 before statecore is imported).
LOCK_CHECKS = os.environ.get("STATECORE_DEBUG_LOCKS", "") not in ("", "0")

# The longest single blocking wait, in microseconds (a longer timeout waits again).
cdef long long MAX_WAIT_US = 1_000_000_000


@cython.final
@cython.auto_pickle(False)
cdef class ProviderLock:
    """A re-entrant lock: ``acquire``/``release`` and ``with`` as ``threading.RLock``, and the
    lock of a ``threading.Condition`` (``_is_owned``, ``_release_save``, ``_acquire_restore``,
    as RLock has them); compiled callers use ``lock_enter``/``lock_exit`` of ``_lock.pxd``."""

    def __cinit__(self):
        self.wait_lock = PyThread_allocate_lock()
        if self.wait_lock == NULL:
            raise MemoryError("cannot allocate the OS lock of a ProviderLock")

    def __dealloc__(self):
        if self.wait_lock != NULL:
            PyThread_free_lock(self.wait_lock)
            self.wait_lock = NULL

    cdef int _wait(self, unsigned long me, double timeout) except -1:
        """Wait for the lock held by another thread: 1 once this thread holds it, 0 if
        ``timeout`` seconds (negative: no limit) passed first. REQUIRES: the GIL."""
        cdef PyLockStatus got
        cdef long long wait_us
        cdef double deadline = time.monotonic() + timeout if timeout >= 0 else -1.0
        cdef double left
        while True:
            # Read afresh on each turn: signal handlers run below, and any Python code may
            # have let other threads run.
            if lock_take(self, me):
                return 1
            if not self.handoff and PyThread_acquire_lock(self.wait_lock, NOWAIT_LOCK):
                self.handoff = True  # the holder's last release frees it, and wakes a waiter
            # else: held for the holder already, or by a woken waiter that will hand it on
            wait_us = -1
            if deadline >= 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return 0
                wait_us = min(<long long>(left * 1e6) + 1, MAX_WAIT_US)
            with nogil:
                got = PyThread_acquire_lock_timed(self.wait_lock, wait_us, 1)
            if got == PY_LOCK_ACQUIRED:
                # wait_lock is ours; handoff is clear (whoever set it released it to us)
                self.handoff = True
                if lock_take(self, me):
                    return 1
                # another thread took the lock before this one got the GIL back: wait_lock
                # stays held on its behalf
            elif got == PY_LOCK_INTR:
                PyErr_CheckSignals()  # raises what a signal handler raised
            # else: timed out for now: the deadline decides above

    def acquire(self, bint blocking=True, double timeout=-1):
        """Acquire, re-entrantly: True, or False if not blocking (or after ``timeout``
        seconds) while another thread holds it."""
        if not blocking and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if timeout < 0 and timeout != -1:
            raise ValueError(f"timeout must be -1 (no limit) or a non-negative number of seconds, got {timeout}")
        cdef unsigned long me = PyThread_get_thread_ident()
        if lock_take(self, me):
            return True
        if not blocking:
            return False
        return self._wait(me, timeout) == 1

    def release(self):
        """Release one acquisition; RuntimeError if this thread does not hold the lock."""
        if self.depth == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        lock_exit(self)

    def owned(self):
        """Whether this thread holds the lock."""
        return self.depth > 0 and self.owner == PyThread_get_thread_ident()

    def require_held(self, what):
        """Raise AssertionError naming ``what`` unless this thread holds the lock: the check
        of a "REQUIRES: the provider's lock held", made where ``LOCK_CHECKS`` is true."""
        if not (self.depth > 0 and self.owner == PyThread_get_thread_ident()):
            raise AssertionError(f"statecore bug: {what} needs the provider's lock, which this thread does not hold")

    # -- what threading.Condition uses when its lock has it (as with RLock) ----------------
    def _is_owned(self):
        return self.owned()

    def _release_save(self):
        """Release every acquisition of the holder (a Condition's wait): its depth, to
        restore. RuntimeError if this thread does not hold the lock."""
        if self.depth == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        cdef Py_ssize_t depth = self.depth
        self.depth = 1
        lock_exit(self)
        return depth

    def _acquire_restore(self, Py_ssize_t depth):
        """Acquire again, blocking, with the depth ``_release_save`` gave."""
        lock_enter(self)
        self.depth = depth

    def __enter__(self):
        lock_enter(self)
        return True

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        if self.depth == 0:
            return "<ProviderLock unlocked>"
        return f"<ProviderLock held by thread {self.owner}, depth {self.depth}>"


def requires_lock(fn):
    """Mark ``fn`` (a method of an object with a ``lock``, such as a provider's
    ``statecore.held_versions.HeldVersions``, or a function taking one first) as "REQUIRES:
    its lock held": with LOCK_CHECKS, each call checks it (``ProviderLock.require_held``);
    without, ``fn`` is returned as it is, at no cost."""
    if not LOCK_CHECKS:
        return fn

    @functools.wraps(fn)
    def checked(owner, *args, **kwargs):
        owner.lock.require_held(fn.__qualname__)
        return fn(owner, *args, **kwargs)
    return checked
