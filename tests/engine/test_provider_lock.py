"""ProviderLock: re-entrant, refuses a release by a thread that does not hold it, and hands
the lock to a blocked waiter, including when a third thread takes it while that waiter is
woken but not yet running (the interleavings are forced: a long switch interval keeps the
GIL with the releasing thread, and ``handoff`` shows when a waiter is blocked)."""
import sys
import threading
import time

import pytest

from statecore._lock import ProviderLock
from tests.store_support import wait_until


@pytest.fixture
def long_switch_interval():
    """A thread keeps the GIL until it blocks: what it does between two blocking calls is
    not interleaved with another thread's Python code."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    yield
    sys.setswitchinterval(before)


def in_thread(fn):
    """Start ``fn`` in a thread; returns (thread, results list)."""
    results = []

    def run():
        try:
            results.append(fn())
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            results.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, results


def test_reentrant_and_released_only_by_its_holder():
    lock = ProviderLock()
    assert lock.acquire() and lock.acquire(blocking=False)
    with lock:
        assert "depth 3" in repr(lock)
    t, results = in_thread(lambda: (lock.acquire(blocking=False), lock.acquire(timeout=0.01)))
    t.join()
    assert results == [(False, False)]
    t, results = in_thread(lock.release)
    t.join()
    assert isinstance(results[0], RuntimeError) and "un-acquired" in str(results[0])
    lock.release()
    lock.release()
    assert repr(lock) == "<ProviderLock unlocked>"
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(blocking=False, timeout=1)
    with pytest.raises(ValueError, match="non-negative"):
        lock.acquire(timeout=-2)


def test_a_blocked_waiter_gets_the_lock_on_release():
    lock = ProviderLock()
    lock.acquire()
    t, results = in_thread(lambda: (lock.acquire(), lock.release()))
    wait_until(lambda: lock.handoff, "the waiter blocks")
    assert not results
    lock.release()
    t.join()
    assert results == [(True, None)]
    assert not lock.handoff and lock.acquire(blocking=False)
    lock.release()


def test_a_thread_that_barges_in_keeps_the_waiter_waiting(long_switch_interval):
    lock = ProviderLock()
    lock.acquire()
    order = []
    t, results = in_thread(lambda: (lock.acquire(), order.append("waiter"), lock.release()))
    wait_until(lambda: lock.handoff, "the waiter blocks")
    lock.release()  # wakes the waiter, which cannot run: this thread keeps the GIL
    assert lock.acquire(blocking=False)  # taken again before the waiter runs
    order.append("barger")
    # The waiter runs while this thread sleeps, finds the lock held, and waits again with
    # the OS lock held on this thread's behalf.
    wait_until(lambda: lock.handoff, "the waiter waits again")
    assert order == ["barger"] and not results
    lock.release()
    t.join()
    assert order == ["barger", "waiter"] and results == [(True, None, None)]
    assert repr(lock) == "<ProviderLock unlocked>" and not lock.handoff


def test_counts_are_not_lost_under_contention():
    lock = ProviderLock()
    counter = [0]
    n_threads, rounds = 4, 2000
    start = threading.Barrier(n_threads)

    def work():
        start.wait()
        for i in range(rounds):
            with lock:
                with lock:  # re-entrant
                    value = counter[0]
                    if i % 97 == 0:
                        time.sleep(0)  # lets the GIL go: other threads try the lock meanwhile
                    counter[0] = value + 1

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == n_threads * rounds
    assert repr(lock) == "<ProviderLock unlocked>" and not lock.handoff


def test_a_timed_wait_gives_up_and_leaves_the_lock_usable():
    lock = ProviderLock()
    lock.acquire()
    t, results = in_thread(lambda: lock.acquire(timeout=0.05))
    t.join()
    assert results == [False]
    lock.release()  # releases the OS lock the waiter left held on this thread's behalf
    assert not lock.handoff
    t, results = in_thread(lambda: (lock.acquire(timeout=5), lock.release()))
    t.join()
    assert results == [(True, None)]


def test_it_serves_a_condition_as_rlock_does():
    """threading.Condition over a ProviderLock: wait releases every acquisition (a waiter
    held it twice) and takes them back; notify needs the lock held."""
    lock = ProviderLock()
    cond = threading.Condition(lock)
    ready = []

    def waiter():
        with lock:
            with lock:
                assert cond.wait_for(lambda: ready, timeout=30)
                assert "depth 2" in repr(lock)
        return "woken"

    t, results = in_thread(waiter)
    wait_until(lambda: lock.acquire(blocking=False) and (lock.release() or True) and cond._waiters,
               "the waiter waits, the lock released")
    with pytest.raises(RuntimeError):
        cond.notify()  # not held
    with cond:
        ready.append(1)
        cond.notify_all()
    t.join()
    assert results == ["woken"] and repr(lock) == "<ProviderLock unlocked>"
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock._release_save()
