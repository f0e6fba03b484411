# cython: language_level=3
"""A file mapped read-only, for random access, and the SIGBUS guard that turns a file
truncated under its mapping into an error instead of a crash.

:class:`Mapping` maps a whole file (``MADV_RANDOM``: a page fault reads one page, never the
device's readahead window) and registers it with the guard; :func:`willneed` announces the
bytes a caller is about to read. A mapping whose file was cut is no longer ``sound()``:
every reader call checks that after its work, before it returns anything read from the
mapping or raises about it. The guard (Linux only) is described with its C code below and
in docs/formats.md ("Reading a snapshot").
"""
cimport cython
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy

import os

cdef extern from *:
    """
    #include <sys/mman.h>
    #include <unistd.h>

    /* Ask the kernel to start reading bytes [start, end) of a mapping now. The mapping is
       MADV_RANDOM (no readahead on faults: a snapshot on a device with a large readahead
       would otherwise read megabytes per random lookup), so whoever is about to checksum
       blocks announces exactly those; the hashing then waits for one I/O, not one per page.
       Linux reads at most max(readahead window, device I/O size) per MADV_WILLNEED call and
       silently drops the rest, so long ranges go in pieces no larger than the smallest
       common readahead window (128 KiB). */
    #define SNAP_WILLNEED_PIECE ((uintptr_t)128 << 10)
    static size_t snap_page_size = 4096;
    static void snap_init_page_size(void) {
        long p = sysconf(_SC_PAGESIZE);
        if (p > 0) snap_page_size = (size_t)p;
    }
    static void snap_willneed(const uint8_t* base, uint64_t start, uint64_t end) {
    #if defined(MADV_WILLNEED)
        uintptr_t lo = (uintptr_t)(base + start) & ~(uintptr_t)(snap_page_size - 1);
        uintptr_t hi = (uintptr_t)(base + end);
        while (hi > lo) {
            uintptr_t n = hi - lo < SNAP_WILLNEED_PIECE ? hi - lo : SNAP_WILLNEED_PIECE;
            (void)madvise((void*)lo, (size_t)n, MADV_WILLNEED);
            lo += n;
        }
    #else
        (void)base; (void)start; (void)end;
    #endif
    }

    #if defined(__GNUC__) || defined(__clang__)
    #define SNAP_LOAD_DAMAGE(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #else
    #define SNAP_LOAD_DAMAGE(p) (*(volatile uint64_t*)(p))
    #endif

    /* Map a whole file read-only and shared, for random access; NULL (errno set) on failure. */
    static const uint8_t* snap_map(int fd, size_t length) {
        void* p = mmap(NULL, length, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) return NULL;
    #if defined(MADV_RANDOM)
        (void)madvise(p, length, MADV_RANDOM);  /* see snap_willneed */
    #endif
        return (const uint8_t*)p;
    }
    static void snap_unmap(const uint8_t* p, size_t length) { (void)munmap((void*)p, length); }

    /* The SIGBUS guard. A snapshot truncated while mapped makes every access to its pages
       past the new end raise SIGBUS, which kills the process by default. The guard keeps a
       fixed table of the mapped snapshots; for a fault inside one, the handler records the
       file offset in that mapping's damage word (first fault wins), then maps anonymous
       zero pages over the rest of the mapping, from the faulting page on, and returns: the
       access is retried, reads zeros, and the interrupted loop finishes. Readers check the
       damage word after every call and raise instead of returning anything. (A page the
       kernel fails to read from the device faults the same way and is handled the same.)
       Any other SIGBUS goes to the handler installed before (faulthandler's, or the
       default action).

       Entries change only with the GIL held (it orders the changes; a lock of our own could
       be held by another thread at a fork and never released in the child). The handler
       takes no lock: it reads an entry between two reads of its sequence counter (odd while
       the entry changes, as a seqlock), and calls only mmap (a system call on Linux),
       sigaction and raise. A mapping is unregistered before it is unmapped, and a thread
       can fault in a mapping only while it holds a reference to it, so an entry that
       matches a fault address is stable. Linux only (elsewhere nothing is guarded). */
    #include <signal.h>
    #if defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && defined(SA_SIGINFO) \
        && defined(BUS_ADRERR) && defined(MAP_ANONYMOUS)
    #define SNAP_GUARD 1
    #include <errno.h>
    #include <string.h>
    #define SNAP_MAX_GUARDED 4096
    typedef struct {
        uint64_t seq;
        uintptr_t start;          /* 0: a free entry */
        uintptr_t end;
        uint64_t* damaged_at;     /* file offset of the first fault + 1; 0 while sound */
    } snap_guard_entry;
    static snap_guard_entry snap_guarded[SNAP_MAX_GUARDED];
    static int snap_guarded_high = 0;       /* entries in use all lie below this index */
    static struct sigaction snap_previous_bus;
    static int snap_guard_state = 0;        /* 0: not installed yet, 1: installed, -1: failed */

    static void snap_bus_chain(int sig, siginfo_t* info, void* context) {
        if (snap_previous_bus.sa_handler != SIG_DFL && snap_previous_bus.sa_handler != SIG_IGN) {
            if (snap_previous_bus.sa_flags & SA_SIGINFO)
                snap_previous_bus.sa_sigaction(sig, info, context);
            else
                snap_previous_bus.sa_handler(sig);
            return;
        }
        /* The default action: put it back, and raise (a fault would come again on return,
           a SIGBUS sent by kill() would not; raised here it stays pending until then). */
        (void)sigaction(sig, &snap_previous_bus, NULL);
        (void)raise(sig);
    }

    static void snap_bus_handler(int sig, siginfo_t* info, void* context) {
        int saved_errno = errno;
        if (info != NULL && info->si_code == BUS_ADRERR) {
            uintptr_t addr = (uintptr_t)info->si_addr;
            int high = __atomic_load_n(&snap_guarded_high, __ATOMIC_ACQUIRE);
            for (int i = 0; i < high; i++) {
                snap_guard_entry* e = &snap_guarded[i];
                uint64_t seq = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
                uintptr_t start = __atomic_load_n(&e->start, __ATOMIC_RELAXED);
                uintptr_t end = __atomic_load_n(&e->end, __ATOMIC_RELAXED);
                uint64_t* damaged_at = __atomic_load_n(&e->damaged_at, __ATOMIC_RELAXED);
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if ((seq & 1) || __atomic_load_n(&e->seq, __ATOMIC_RELAXED) != seq) continue;
                if (start == 0 || addr < start || addr >= end) continue;
                uintptr_t page = addr & ~(uintptr_t)(snap_page_size - 1);
                uint64_t sound = 0;
                /* The damage word before the zeros: whoever reads a zero finds it set. */
                (void)__atomic_compare_exchange_n(damaged_at, &sound, (uint64_t)(addr - start) + 1, 0,
                                                  __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
                if (mmap((void*)page, end - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                         -1, 0) != MAP_FAILED) {
                    errno = saved_errno;
                    return;
                }
                break;  /* no zero pages: the fault stays fatal */
            }
        }
        errno = saved_errno;
        snap_bus_chain(sig, info, context);
    }

    /* REQUIRES: the GIL. Installs the handler once; 1 if it is installed. */
    static int snap_guard_install(void) {
        struct sigaction action;
        if (snap_guard_state == 0) {
            snap_guard_state = -1;
            if (sigaction(SIGBUS, NULL, &snap_previous_bus) == 0) {
                memset(&action, 0, sizeof action);
                action.sa_sigaction = snap_bus_handler;
                action.sa_flags = SA_SIGINFO | SA_ONSTACK;
                sigemptyset(&action.sa_mask);
                if (sigaction(SIGBUS, &action, NULL) == 0) snap_guard_state = 1;
            }
        }
        return snap_guard_state == 1;
    }

    /* REQUIRES: the GIL. */
    static void snap_guard_set(snap_guard_entry* e, uintptr_t start, uintptr_t end, uint64_t* damaged_at) {
        uint64_t seq = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);
        __atomic_store_n(&e->seq, seq + 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        __atomic_store_n(&e->damaged_at, damaged_at, __ATOMIC_RELAXED);
        __atomic_store_n(&e->end, end, __ATOMIC_RELAXED);
        __atomic_store_n(&e->start, start, __ATOMIC_RELAXED);
        __atomic_store_n(&e->seq, seq + 2, __ATOMIC_RELEASE);
    }

    /* REQUIRES: the GIL. Guard [start, start + length): the entry's index, or -1 (no
       handler, or the table is full: the mapping works unguarded). */
    static int snap_guard_add(const uint8_t* start, size_t length, uint64_t* damaged_at) {
        int i;
        uintptr_t end = ((uintptr_t)start + length + snap_page_size - 1) & ~(uintptr_t)(snap_page_size - 1);
        if (!snap_guard_install()) return -1;
        for (i = 0; i < SNAP_MAX_GUARDED; i++) {
            if (snap_guarded[i].start == 0) {
                snap_guard_set(&snap_guarded[i], (uintptr_t)start, end, damaged_at);
                if (i >= snap_guarded_high) __atomic_store_n(&snap_guarded_high, i + 1, __ATOMIC_RELEASE);
                return i;
            }
        }
        return -1;
    }

    /* REQUIRES: the GIL. */
    static void snap_guard_remove(int i) {
        if (i >= 0) snap_guard_set(&snap_guarded[i], 0, 0, NULL);
    }

    /* REQUIRES: the GIL. */
    static int snap_guard_count(void) {
        int i, n = 0;
        for (i = 0; i < SNAP_MAX_GUARDED; i++) n += snap_guarded[i].start != 0;
        return n;
    }
    #else
    static int snap_guard_add(const uint8_t* start, size_t length, uint64_t* damaged_at) {
        (void)start; (void)length; (void)damaged_at;
        return -1;
    }
    static void snap_guard_remove(int i) { (void)i; }
    static int snap_guard_count(void) { return 0; }
    #endif
    """
    uint64_t SNAP_LOAD_DAMAGE(uint64_t* p) nogil
    void snap_init_page_size() nogil
    void snap_willneed(const uint8_t* base, uint64_t start, uint64_t end) nogil
    const uint8_t* snap_map(int fd, size_t length) nogil
    void snap_unmap(const uint8_t* p, size_t length) nogil
    int snap_guard_add(const uint8_t* start, size_t length, uint64_t* damaged_at)
    void snap_guard_remove(int i)
    int snap_guard_count()

snap_init_page_size()


cdef void willneed(const uint8_t* base, uint64_t start, uint64_t end) noexcept nogil:
    """Start reading bytes [start, end) of the mapping at ``base`` now (see snap_willneed)."""
    snap_willneed(base, start, end)


@cython.final
cdef class Mapping:
    """A whole file mapped read-only and guarded against SIGBUS (see snap_guard_add).
    Unmapped when the last reference goes: the reader's, or the one a running call holds."""

    def __cinit__(self, int fd, size_t length, uint64_t canary):
        self.guard = -1
        self.damaged_at = 0
        self.canary_at = length - 8
        self.canary = canary
        self.base = snap_map(fd, length)
        if self.base == NULL:
            raise OSError(errno, os.strerror(errno))
        self.length = length
        self.guard = snap_guard_add(self.base, length, &self.damaged_at)

    def __dealloc__(self):
        snap_guard_remove(self.guard)  # first: once unmapped, the addresses may be reused
        if self.base != NULL:
            snap_unmap(self.base, self.length)
            self.base = NULL

    cdef inline uint64_t damage(self) noexcept nogil:
        """File offset + 1 of the first access past the file's end (0: none so far)."""
        return SNAP_LOAD_DAMAGE(&self.damaged_at)

    cdef inline bint sound(self) noexcept nogil:
        """False once the file was seen truncated: the SIGBUS guard recorded a fault, or the
        file's last 8 bytes changed (a file cut inside its last page reads as zeros there
        without a fault). What was read from the mapping before this returned True was
        read before the file was cut."""
        cdef uint64_t last
        if self.damage():
            return False
        memcpy(&last, self.base + self.canary_at, 8)
        return last == self.canary and not self.damage()  # reading it may have faulted


def _guarded_mappings():
    """How many mappings the SIGBUS guard covers now. Visible for tests."""
    return snap_guard_count()

