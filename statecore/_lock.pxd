# cython: language_level=3
"""ProviderLock: a provider's re-entrant lock, taken from C per row (see _lock.pyx)."""
cimport cython
from cpython.pythread cimport PyThread_release_lock, PyThread_type_lock

cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil


@cython.final
cdef class ProviderLock:
    cdef unsigned long owner          # thread ident of the holder (meaningful while depth > 0)
    cdef Py_ssize_t depth             # re-entrant acquisitions by the holder; 0: free
    cdef PyThread_type_lock wait_lock # what waiters block on (see the module docstring)
    cdef readonly bint handoff        # wait_lock is held on the holder's behalf

    cdef int _wait(self, unsigned long me, double timeout) except -1


cdef inline bint lock_take(ProviderLock lock, unsigned long me) noexcept:
    """Take ``lock`` for thread ``me`` if it is free or already ``me``'s (one more depth):
    whether it did. REQUIRES: the GIL (the two fields change together under it)."""
    if lock.depth == 0:
        lock.owner = me
        lock.depth = 1
        return True
    if lock.owner == me:
        lock.depth += 1
        return True
    return False


cdef inline int lock_enter(ProviderLock lock) except -1:
    """Acquire ``lock`` for this thread, blocking (re-entrant). REQUIRES: the GIL."""
    cdef unsigned long me = PyThread_get_thread_ident()
    if not lock_take(lock, me):
        lock._wait(me, -1.0)
    return 0


cdef inline void lock_exit(ProviderLock lock) noexcept:
    """Release one acquisition of ``lock``. REQUIRES: the GIL; this thread holds ``lock``."""
    lock.depth -= 1
    if lock.depth == 0 and lock.handoff:
        lock.handoff = False
        PyThread_release_lock(lock.wait_lock)  # wakes one waiter
