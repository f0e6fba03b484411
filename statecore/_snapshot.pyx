# cython: language_level=3
"""Snapshot files: the full state of one store version, written once, then memory-mapped and
probed in place.

This module owns the bytes of a snapshot: :class:`SnapshotWriter` (and
:func:`write_snapshot`, which streams a RowTable into one) and :class:`SnapshotReader`.
Opening a snapshot reads and checks the header page and the footer only, whatever the number
of rows; lookups and iteration then run on the mapping, without copying it, and the kernel
brings pages in on demand and shares them between every process mapping the same file.

Format, version 1 (all integers little-endian; every byte is covered by a checksum)::

    offset            size  what
    0                 4096  header
    rows_offset       R     rows: row_count rows of key_width + value_width bytes (key, then
                            value), packed, in the order they were written
    rows_offset + R   < 64  zero padding, so that the slots start on a multiple of 64
    slots_offset      8*S   slots: n_slots slots (u32 tag, u32 row_index + 1); 0 = empty
    checksums_offset  8*B   checksums: u64 XXH64 (seed 0) of each data block
    file_size - 64    64    footer

  Header (4096 bytes)::

    0    8s  magic b"SCSNAP\\0\\x01"      72   u32 block_size (a power of two, default 65536)
    8    u32 format_version (1)          76   u64 n_blocks
    12   u32 header_size (4096)          84   u64 rows_offset (4096)
    16   u32 key_width                   92   u64 slots_offset (rows end rounded up to 64)
    20   u32 value_width                 100  u64 checksums_offset (slots end)
    24   u64 key_fingerprint             108  u64 file_size
    32   u64 value_fingerprint           116  16s lineage (the caller's id of a store lineage)
    40   u64 store_version               132  u32 schema_json_len
    48   u64 row_count                   136  schema JSON (UTF-8) {"key": key_schema.describe(),
    56   u64 n_slots (a power of two)              "value": value_schema.describe()}, zero padding
    64   u32 hash_id (HASH_ID_XXH64 = 1) 4088 u64 header_checksum: XXH64 of bytes [0, 4088)
    68   u32 reserved (0)

  Footer (64 bytes, at file_size - 64)::

    0    8s  magic b"SCSNEND\\x01"        32   u32 max_displacement
    8    u64 checksums_checksum: XXH64    36   20 zero bytes
             of the checksums section     56   u64 footer_checksum: XXH64 of footer bytes
    16   u64 file_size                             [0, 56)
    24   u64 header_checksum (copy: ties the footer to its header)

  The fingerprints are ``RowSchema.fingerprint``; the schema JSON lets a snapshot be read
  without being told its schemas. Slots are built as RowTable builds its index: linear
  probing with Robin Hood placement, home slot ``tag & (n_slots - 1)``, tag
  ``slot_tag(key_hash(key))``, at most 3/4 load and at least 16 slots; no lookup probes more
  than max_displacement + 1 slots. Distinct keys may share a tag, even their whole 64-bit
  hash (XXH64 is not collision-resistant): lookups compare the key bytes of every entry
  with their tag and probe on. The *data region* is [rows_offset, checksums_offset):
  rows, padding and slots, split into blocks of block_size bytes (the last one short), each
  with its checksum in the checksums section. Given row_count, the widths, n_slots and
  block_size, every offset is determined, and the reader requires exactly those values.

  max_displacement is in the footer, not the header, because the writer streams: the header
  is written before the first row, and the displacement is known only after the last key
  (file objects on remote file systems cannot seek back to patch it).

Verification is lazy. Opening checks the header and footer (checksums, and every offset and
size against the file's real size and against each other). Each data block is checked
against its checksum the first time a lookup or iteration touches it (the checksum table
itself is checked against the footer on first need), and a byte is never used before its
block matched: a damaged file raises :class:`~statecore.errors.StateCorruptionError` naming
the path and the byte offset, on open or on the lookup that touches the damage, never a
crash and never a wrong value. :meth:`SnapshotReader.verify` checks everything at once,
the index included (a lookup of each row's key must find that row).

Files are assumed immutable once written (they are written under a temporary name and
renamed into place). A file truncated while mapped is damage too. On Linux a process-wide
SIGBUS handler (installed when the first snapshot is mapped; every other SIGBUS goes on to
the handler installed before it) lets the faulting access read zeros and marks the reader
damaged, and every reader call checks that mark after its work, before it returns anything
or raises about what it read: the call raises StateCorruptionError ("the file was truncated
while mapped") and the process lives on. A file cut inside its last page reads as zeros
there without a fault; the same check catches it (the file's last 8 bytes must not change),
unless a call reads that lost tail while the kernel is zeroing it and reads the last 8
bytes before the kernel gets to them. A SIGBUS handler installed after the first snapshot
was mapped (``faulthandler.enable()`` then, for one) comes first, and the fault is fatal
again; so is a fault in a mapping beyond the first 4096 open at once.

:func:`read_snapshot_header` checks and decodes the header page alone; it is the only parser
of the header (SnapshotReader uses it, then checks the footer and the file's size).

I/O. The header and the footer are read with two ``pread`` calls; the mapping is
``MADV_RANDOM``, so a page fault reads one page and never the device's readahead window
(8 MiB on some cloud disks, which made a cold first lookup cost tens of milliseconds).
Whoever is about to checksum blocks announces exactly those with ``MADV_WILLNEED``: a
random lookup costs one read per block it touches first, and verify(), iteration and large
batches announce long ranges, so those read ahead.

Thread-safety: a SnapshotWriter is used by one thread. A SnapshotReader may be shared by
threads for every read (lookups, cursors, verify); batch calls release the GIL. The only
state reads change is the verified-block map, one byte per block set with relaxed atomic
stores: two threads may both check the same block, which is harmless. close() may be called
while another thread's call is running: that call keeps the mapping alive until it returns.
When one thread's fault maps zeros over the rest of a truncated mapping, other threads may
read those zeros without a fault of their own; the handler sets the damage mark before it
maps them, and every call reads the mark after its work, so those calls raise too.
"""
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from statecore._hash cimport HASH_ID_XXH64, key_hash, slot_tag, xxh64
from statecore._rowtable cimport rows_equal

import json
import operator
import os
import struct
import uuid

import numpy as np

from statecore.errors import SchemaMismatchError, StateCorruptionError
from statecore.rowsource import iter_batches, iter_items, lookup_batch, lookup_one
from statecore.schema import RowSchema, as_schema, key_value_schemas

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
    #define SNAP_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)
    #define SNAP_LOAD_FLAG(p) __atomic_load_n((p), __ATOMIC_RELAXED)
    #define SNAP_STORE_FLAG(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
    #define SNAP_LOAD_DAMAGE(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #else
    #define SNAP_PREFETCH(p) ((void)(p))
    #define SNAP_LOAD_FLAG(p) (*(volatile uint8_t*)(p))
    #define SNAP_STORE_FLAG(p, v) (*(volatile uint8_t*)(p) = (v))
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
    void SNAP_PREFETCH(const void* p) nogil
    uint8_t SNAP_LOAD_FLAG(uint8_t* p) nogil
    void SNAP_STORE_FLAG(uint8_t* p, uint8_t v) nogil
    uint64_t SNAP_LOAD_DAMAGE(uint64_t* p) nogil
    void snap_init_page_size() nogil
    void snap_willneed(const uint8_t* base, uint64_t start, uint64_t end) nogil
    const uint8_t* snap_map(int fd, size_t length) nogil
    void snap_unmap(const uint8_t* p, size_t length) nogil
    int snap_guard_add(const uint8_t* start, size_t length, uint64_t* damaged_at)
    void snap_guard_remove(int i)
    int snap_guard_count()

snap_init_page_size()

__all__ = ["SnapshotWriter", "SnapshotReader", "SnapshotCursor", "SnapshotHeader", "write_snapshot",
           "read_snapshot_header", "MAGIC", "FOOTER_MAGIC", "FORMAT_VERSION", "HEADER_SIZE",
           "SNAPSHOT_HEADER_SIZE", "FOOTER_SIZE", "DEFAULT_BLOCK_SIZE"]

MAGIC = b"SCSNAP\0\x01"
FOOTER_MAGIC = b"SCSNEND\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
SNAPSHOT_HEADER_SIZE = HEADER_SIZE   # what read_snapshot_header needs: read this many bytes
FOOTER_SIZE = 64
DEFAULT_BLOCK_SIZE = 65536
MIN_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 1 << 30
MIN_SLOTS = 16
SLOTS_ALIGN = 64
# Row numbers are stored + 1 in a u32 slot field (as in RowTable).
MAX_ROWS = 0xFFFFFFFE

# The fixed fields of the header, then of the footer (offsets in the module docstring).
_HEADER = struct.Struct("<8sIIIIQQQQQIIIQQQQQ16sI")
_FOOTER = struct.Struct("<8sQQQI20x")
_U64 = struct.Struct("<Q")
_HEADER_CHECKSUM_AT = HEADER_SIZE - 8
_FOOTER_CHECKSUM_AT = FOOTER_SIZE - 8
_MAX_SCHEMA_JSON = _HEADER_CHECKSUM_AT - _HEADER.size

assert _HEADER.size == 136 and _FOOTER.size == 56

cdef enum:
    SLOT_PREFETCH_AHEAD = 16   # lookups ahead whose home slot is prefetched
    ROW_PREFETCH_AHEAD = 8     # lookups ahead whose row is prefetched
    VERIFY_WINDOW_BYTES = 4 << 20   # verify() reads ahead this much
    WRITE_CHUNK_ROWS = 65536

cdef enum:
    WRITER_OPEN = 0
    WRITER_DONE = 1
    WRITER_FAILED = 2


cdef uint64_t _xxh64_of(const uint8_t[::1] data):
    """XXH64 (seed 0) of a bytes-like object."""
    return xxh64(&data[0] if data.shape[0] else NULL, <size_t>data.shape[0], 0)


cdef inline const uint8_t* _rows_ptr(const uint8_t[:, ::1] rows) noexcept:
    """First byte of a (n, width) row array, or NULL when it holds no bytes."""
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return NULL
    return &rows[0, 0]


def _layout(row_count, key_width, value_width, block_size):
    """Every size and offset of a snapshot, from what its header states up front."""
    row_width = key_width + value_width
    n_slots = MIN_SLOTS
    while row_count * 4 > n_slots * 3:
        n_slots *= 2
    rows_end = HEADER_SIZE + row_count * row_width
    slots_offset = -(-rows_end // SLOTS_ALIGN) * SLOTS_ALIGN
    checksums_offset = slots_offset + n_slots * 8
    n_blocks = -(-(checksums_offset - HEADER_SIZE) // block_size)
    return {
        "n_slots": n_slots, "rows_offset": HEADER_SIZE, "slots_offset": slots_offset,
        "checksums_offset": checksums_offset, "n_blocks": n_blocks,
        "file_size": checksums_offset + n_blocks * 8 + FOOTER_SIZE,
    }


def _schema_json(key_schema, value_schema):
    return json.dumps({"key": key_schema.describe(), "value": value_schema.describe()},
                      separators=(",", ":")).encode("utf-8")


def _lineage_bytes(lineage, what="lineage"):
    if isinstance(lineage, uuid.UUID):
        return lineage.bytes
    if isinstance(lineage, (bytes, bytearray, memoryview)) and len(lineage) == 16:
        return bytes(lineage)
    raise ValueError(f"{what} must be 16 bytes or a uuid.UUID, got {lineage!r}")


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


# -- the writer ---------------------------------------------------------------------------
@cython.final
cdef class SnapshotWriter:
    """Streams one snapshot to a binary file object, which needs only ``write()``.

    The header goes out at once (everything in it follows from ``row_count``), rows as they
    come, a block at a time; the slot index is built in memory while rows stream (each key
    is hashed as it arrives; no second pass, no copy of the rows) and written by
    :meth:`finish`, with the checksums and the footer. Memory: 8 bytes per slot, 4 bytes per
    row and one block. The file object is neither flushed nor closed: the caller owns it
    (write to a temporary name, then rename). After an error the writer refuses further
    calls and the bytes written so far must be discarded.

    Parameters
    ----------
    fileobj : binary file object
        Anything with ``write(bytes_like)``; a return value below the length given is taken
        as a partial write and the rest is written again.
    key_schema, value_schema : numpy structured dtype or RowSchema
        The value schema may have no fields (a set).
    row_count : int
        Exactly how many rows will be written (at most 2**32 - 2).
    store_version : int
        The store version this snapshot holds (>= 0).
    lineage : 16 bytes or uuid.UUID
        Ties the snapshot to one store lineage; readers may require it.
    block_size : int
        Bytes per checksummed block, a power of two in [64, 2**30].

    Raises
    ------
    ValueError
        On a row count, version, lineage or block size out of range.
    TypeError
        If the key schema has no field.
    """

    def __cinit__(self, fileobj, key_schema, value_schema, row_count, store_version,
                  lineage=bytes(16), block_size=DEFAULT_BLOCK_SIZE):
        if not callable(getattr(fileobj, "write", None)):
            raise TypeError(f"fileobj must have a write() method, got {type(fileobj).__name__}")
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.key_width = self.key_schema.width
        self.value_width = self.value_schema.width
        self.row_width = self.key_width + self.value_width
        row_count = operator.index(row_count)
        if not 0 <= row_count <= MAX_ROWS:
            raise ValueError(f"row_count must be in [0, {MAX_ROWS}], got {row_count}")
        store_version = operator.index(store_version)
        if not 0 <= store_version < (1 << 64):
            raise ValueError(f"store_version must be in [0, 2**64), got {store_version}")
        lineage = _lineage_bytes(lineage)
        block_size = operator.index(block_size)
        if not (_is_pow2(block_size) and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE):
            raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                             f"got {block_size}")
        schema_json = _schema_json(self.key_schema, self.value_schema)
        if len(schema_json) > _MAX_SCHEMA_JSON:
            raise ValueError(f"the schemas' description is {len(schema_json)} bytes; a snapshot header "
                             f"holds at most {_MAX_SCHEMA_JSON}")
        plan = _layout(row_count, self.key_width, self.value_width, block_size)
        self.fileobj = fileobj
        self.row_count = row_count
        self.store_version = store_version
        self.block_size = block_size
        self.n_slots = plan["n_slots"]
        self.n_blocks = plan["n_blocks"]
        self.rows_offset = plan["rows_offset"]
        self.slots_offset = plan["slots_offset"]
        self.checksums_offset = plan["checksums_offset"]
        self.file_size = plan["file_size"]

        # numpy owns the buffers (np.zeros of a large size is lazily zeroed by the kernel).
        self._slots_arr = np.zeros((self.n_slots, 2), dtype="<u4")
        self._key_hi_arr = np.empty(max(row_count, 1), dtype=np.uint32)
        self._block_arr = np.empty(block_size, dtype=np.uint8)
        self._checksums_arr = np.empty(self.n_blocks, dtype="<u8")
        cdef uint32_t[:, ::1] slots_view = self._slots_arr
        cdef uint32_t[::1] key_hi_view = self._key_hi_arr
        cdef uint8_t[::1] block_view = self._block_arr
        cdef uint64_t[::1] checksums_view = self._checksums_arr
        self.slots = <SnapSlot*>&slots_view[0, 0]
        self.key_hi = &key_hi_view[0]
        self.block_buf = &block_view[0]
        self.checksums = &checksums_view[0]

        header = bytearray(HEADER_SIZE)
        _HEADER.pack_into(header, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, self.key_width, self.value_width,
                          self.key_schema.fingerprint, self.value_schema.fingerprint, store_version,
                          row_count, self.n_slots, HASH_ID_XXH64, 0, block_size, self.n_blocks,
                          self.rows_offset, self.slots_offset, self.checksums_offset, self.file_size,
                          lineage, len(schema_json))
        header[_HEADER.size:_HEADER.size + len(schema_json)] = schema_json
        self.header_checksum = _xxh64_of(header[:_HEADER_CHECKSUM_AT])
        _U64.pack_into(header, _HEADER_CHECKSUM_AT, self.header_checksum)
        self.call_rows = NULL
        self.call_first = <uint64_t>-1
        self.state = WRITER_OPEN
        try:
            self._emit(header)
        except BaseException:
            self.state = WRITER_FAILED
            raise

    cdef object _check_open(self):
        if self.state == WRITER_DONE:
            raise ValueError("this SnapshotWriter has finished")
        if self.state == WRITER_FAILED:
            raise ValueError("this SnapshotWriter failed earlier; discard what it wrote")

    # -- the slot index -------------------------------------------------------------------
    cdef bint same_key(self, uint64_t r, uint64_t new) noexcept nogil:
        """Whether row ``r`` has the key of row ``new`` (of the current write_rows call),
        whose key has the same 64-bit hash.

        Its bytes decide when it is in the current write_rows call. Rows of earlier calls
        are not kept: on 4- and 8-byte keys XXH64 is one-to-one (every step of it on one
        4- or 8-byte input is invertible), so equal hashes are equal keys; on other widths
        the keys are taken as distinct, as the tables snapshots are written from guarantee,
        and SnapshotReader.verify() finds a key written twice.
        """
        cdef uint64_t rw = <uint64_t>self.row_width
        if r >= self.call_first:
            return rows_equal(self.call_rows + (r - self.call_first) * rw,
                              self.call_rows + (new - self.call_first) * rw, <size_t>self.key_width)
        return self.key_width == 4 or self.key_width == 8

    cdef int slots_add(self, uint32_t tag, uint32_t hi, uint32_t row, uint32_t* other) noexcept nogil:
        """Robin Hood insert of row ``row`` (index + 1, a row of the current write_rows
        call), or SNAP_DUPLICATE with ``other`` set.

        A key equal to ours can only sit before the first entry we displace (a lookup stops
        there), so duplicates are looked for up to that point only, among the entries with
        our full 64-bit hash (the tag and ``key_hi``); same_key decides for each of those.
        """
        # REQUIRES: a free slot exists (n_slots * 3/4 >= row_count, set up by __cinit__).
        cdef uint64_t mask = self.n_slots - 1
        cdef uint64_t pos = tag & mask
        cdef uint64_t dist = 0, resident_dist
        cdef SnapSlot* s
        cdef SnapSlot carried
        cdef bint searching = True
        carried.tag = tag
        carried.row = row
        while True:
            s = &self.slots[pos]
            if s.row == 0:
                s[0] = carried
                if dist > self.max_displacement:
                    self.max_displacement = <uint32_t>dist
                return SNAP_OK
            if searching and s.tag == tag and self.key_hi[s.row - 1] == hi:
                if self.same_key(s.row - 1, row - 1):
                    other[0] = s.row - 1
                    return SNAP_DUPLICATE
                self.hash_collisions += 1
            resident_dist = (pos - (s.tag & mask)) & mask
            if resident_dist < dist:
                searching = False
                carried, s[0] = s[0], carried
                if dist > self.max_displacement:
                    self.max_displacement = <uint32_t>dist
                dist = resident_dist
            pos = (pos + 1) & mask
            dist += 1

    # REQUIRES: rows_written + m <= row_count and rows is (m, row_width), both checked by
    # write_rows; tests/test_snapshot.py covers 0 rows, 1 row, the exact 3/4 load and
    # chunks of every size.
    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int index_rows(self, const uint8_t* rows, Py_ssize_t m, uint32_t* tags,
                        Py_ssize_t* bad, uint32_t* other) noexcept nogil:
        cdef Py_ssize_t i
        cdef uint64_t h, mask = self.n_slots - 1
        cdef size_t kw = self.key_width, rw = self.row_width
        cdef int rc
        for i in range(m):
            h = key_hash(rows + <size_t>i * rw, kw)
            tags[i] = slot_tag(h)
            self.key_hi[self.rows_written + <uint64_t>i] = <uint32_t>(h >> 32)
        for i in range(m):
            if i + SLOT_PREFETCH_AHEAD < m:
                SNAP_PREFETCH(&self.slots[tags[i + SLOT_PREFETCH_AHEAD] & mask])
            rc = self.slots_add(tags[i], self.key_hi[self.rows_written + <uint64_t>i],
                                <uint32_t>(self.rows_written + <uint64_t>i + 1), other)
            if rc < 0:
                bad[0] = i
                return rc
        return SNAP_OK

    # -- output ---------------------------------------------------------------------------
    cdef object _emit(self, object chunk):
        """Hand ``chunk`` to fileobj.write, again for what a partial write left over."""
        view = memoryview(chunk).cast("B")
        cdef Py_ssize_t n = len(view), done
        self.bytes_out += <uint64_t>n
        while n:
            done_obj = self.fileobj.write(view)
            if done_obj is None:  # file objects that do not report a count wrote it all
                return
            done = done_obj
            if done >= n:
                return
            if done <= 0:
                raise OSError(f"{type(self.fileobj).__name__}.write() wrote nothing")
            view = view[done:]
            n -= done

    cdef object _feed(self, object flat):
        """Append bytes of the data region: whole blocks are checksummed and written straight
        from ``flat`` (1-D uint8), the rest goes through the block buffer."""
        cdef const uint8_t[::1] src = flat
        cdef uint64_t n = src.shape[0], pos = 0, take, k, j, bs = self.block_size
        cdef const uint8_t* p
        if n == 0:
            return
        if self.block_fill:
            take = min(bs - self.block_fill, n)
            memcpy(self.block_buf + self.block_fill, &src[0], take)
            self.block_fill += take
            pos = take
            if self.block_fill == bs:
                self._flush_block()
        k = (n - pos) // bs
        if k:
            if self.blocks_done + k > self.n_blocks:
                raise AssertionError("snapshot writer fed more data than its header announced")
            p = &src[pos]
            with nogil:
                for j in range(k):
                    self.checksums[self.blocks_done + j] = xxh64(p + j * bs, bs, 0)
            self._emit(flat[pos:pos + k * bs])
            self.blocks_done += k
            pos += k * bs
        if pos < n:
            memcpy(self.block_buf, &src[pos], n - pos)
            self.block_fill = n - pos

    cdef object _flush_block(self):
        if self.blocks_done >= self.n_blocks:
            raise AssertionError("snapshot writer fed more data than its header announced")
        self.checksums[self.blocks_done] = xxh64(self.block_buf, self.block_fill, 0)
        self._emit(self._block_arr[:self.block_fill])
        self.blocks_done += 1
        self.block_fill = 0

    # -- the public interface -------------------------------------------------------------
    def write_rows(self, rows):
        """Append rows: a C-contiguous ``(m, row_width)`` uint8 array (or anything
        ``numpy.asarray`` turns into one), such as ``RowTable.cursor().next_rows(k)``.

        Raises
        ------
        ValueError
            On a wrong row width, more rows than announced, or a key written before. Keys
            with equal 64-bit XXH64 are compared by their bytes within one call; a key of an
            earlier call (those rows are not kept) is found again by its hash for 4- and
            8-byte keys, on which XXH64 is one-to-one, and not for other widths, whose rows
            the caller must keep unique (as RowTable does). Distinct keys are never refused.
        TypeError
            If ``rows`` is not uint8.
        """
        self._check_open()
        arr = np.asarray(rows)
        if arr.dtype != np.uint8:
            raise TypeError(f"rows must be a uint8 array, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[1] != self.row_width:
            raise ValueError(f"rows must be an (m, {self.row_width}) uint8 array ({self.key_width} key + "
                             f"{self.value_width} value bytes), got shape {arr.shape}")
        arr = np.ascontiguousarray(arr)
        cdef Py_ssize_t m = arr.shape[0], bad = 0
        cdef uint32_t other = 0
        cdef int rc
        if m == 0:
            return
        if self.rows_written + <uint64_t>m > self.row_count:
            raise ValueError(f"the snapshot was announced with {self.row_count} rows; "
                             f"{self.rows_written} were written and {m} more were given")
        cdef const uint8_t[:, ::1] view = arr
        cdef uint32_t[::1] tags = np.empty(m, dtype=np.uint32)
        self.call_rows = &view[0, 0]
        self.call_first = self.rows_written
        with nogil:
            rc = self.index_rows(&view[0, 0], m, &tags[0], &bad, &other)
        self.call_rows = NULL
        self.call_first = <uint64_t>-1
        if rc < 0:
            self.state = WRITER_FAILED
            first = self.rows_written + <uint64_t>bad
            raise ValueError(f"duplicate key: row {first} has the key of row {other} "
                             f"({arr[bad, :self.key_width].tobytes().hex()})")
        try:
            self._feed(arr.reshape(-1))
        except BaseException:
            self.state = WRITER_FAILED
            raise
        self.rows_written += <uint64_t>m

    def finish(self):
        """Write the slots, the checksums and the footer.

        Returns
        -------
        dict
            ``file_size``, ``n_slots``, ``max_displacement``, ``row_count``, ``n_blocks``,
            ``hash_collisions`` (pairs of keys with equal 64-bit hashes taken as distinct).

        Raises
        ------
        ValueError
            If fewer rows were written than announced (the writer stays open).
        """
        self._check_open()
        if self.rows_written != self.row_count:
            raise ValueError(f"the snapshot was announced with {self.row_count} rows, "
                             f"but {self.rows_written} were written")
        try:
            padding = self.slots_offset - (self.rows_offset + self.row_count * <uint64_t>self.row_width)
            self._feed(np.zeros(padding, dtype=np.uint8))
            self._feed(self._slots_arr.view(np.uint8).reshape(-1))
            if self.block_fill:
                self._flush_block()
            if self.blocks_done != self.n_blocks:
                raise AssertionError(f"snapshot writer made {self.blocks_done} blocks, not {self.n_blocks}")
            table = self._checksums_arr.view(np.uint8)
            self._emit(table)
            footer = bytearray(FOOTER_SIZE)
            _FOOTER.pack_into(footer, 0, FOOTER_MAGIC, _xxh64_of(table), self.file_size,
                              self.header_checksum, self.max_displacement)
            _U64.pack_into(footer, _FOOTER_CHECKSUM_AT, _xxh64_of(footer[:_FOOTER_CHECKSUM_AT]))
            self._emit(footer)
            if self.bytes_out != self.file_size:
                raise AssertionError(f"snapshot writer wrote {self.bytes_out} bytes, not {self.file_size}")
        except BaseException:
            self.state = WRITER_FAILED
            raise
        self.state = WRITER_DONE
        self._release()
        return {"file_size": self.file_size, "n_slots": self.n_slots,
                "max_displacement": self.max_displacement, "row_count": self.row_count,
                "n_blocks": self.n_blocks, "hash_collisions": self.hash_collisions}

    cdef object _release(self):
        self.slots = NULL
        self.key_hi = NULL
        self.block_buf = NULL
        self.checksums = NULL
        self._slots_arr = self._key_hi_arr = self._block_arr = self._checksums_arr = None


def write_snapshot(fileobj, table, store_version, lineage=bytes(16), block_size=DEFAULT_BLOCK_SIZE):
    """Stream a RowTable into ``fileobj`` as a snapshot; returns :meth:`SnapshotWriter.finish`'s
    dict. The rows are those live when the table's cursor opens (``len(table)`` of them)."""
    cursor = table.cursor()
    try:
        writer = SnapshotWriter(fileobj, table.key_schema, table.value_schema, len(table),
                                store_version, lineage, block_size)
        while True:
            chunk = cursor.next_rows(WRITE_CHUNK_ROWS)
            if chunk is None:
                break
            writer.write_rows(chunk)
        return writer.finish()
    finally:
        cursor.close()


# -- the header ---------------------------------------------------------------------------
@cython.final
cdef class SnapshotHeader:
    """The checked header of a snapshot (:func:`read_snapshot_header`); immutable.

    ``lineage`` is the 16 bytes the writer was given; the store writes its commit id first,
    which ``commit_id`` returns.
    """

    cdef readonly object store_version
    cdef readonly bytes lineage
    cdef readonly object row_count
    cdef readonly object key_width
    cdef readonly object value_width
    cdef readonly object key_fingerprint
    cdef readonly object value_fingerprint
    cdef readonly object key_schema       # RowSchema, from the schema description
    cdef readonly object value_schema
    cdef readonly object file_size
    cdef readonly object n_slots
    cdef readonly object block_size
    cdef readonly object n_blocks
    cdef readonly object rows_offset
    cdef readonly object slots_offset
    cdef readonly object checksums_offset
    cdef readonly object checksum         # the header checksum (the footer keeps a copy)

    @property
    def commit_id(self):
        """lineage[:8]."""
        return self.lineage[:8]

    def __repr__(self):
        return (f"SnapshotHeader(store_version={self.store_version}, lineage={self.lineage.hex()}, "
                f"row_count={self.row_count}, key_width={self.key_width}, "
                f"value_width={self.value_width}, file_size={self.file_size})")


def read_snapshot_header(data, path=None):
    """Check and decode the header page of a snapshot.

    Checks everything the header alone decides: magic, format version, header checksum,
    header size, hash id, reserved field, widths, and every size and offset against each
    other (a reader then checks them against the file and its footer).

    Parameters
    ----------
    data : bytes-like
        At least the first HEADER_SIZE bytes of the file; bytes after them are ignored.
    path : str, optional
        The name errors give.

    Returns
    -------
    SnapshotHeader

    Raises
    ------
    StateCorruptionError
        Fewer than HEADER_SIZE bytes ("truncated"), or any check failed.
    """
    name = os.fspath(path) if path is not None else "<snapshot bytes>"
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise StateCorruptionError(name, len(view), f"truncated: the header needs {HEADER_SIZE} bytes, "
                                                    f"the file ends after {len(view)}")
    header = bytes(view[:HEADER_SIZE])

    def corrupt(offset, reason):
        return StateCorruptionError(name, offset, reason)

    if header[:8] != MAGIC:
        raise corrupt(0, f"bad magic {header[:8]!r} (expected {MAGIC!r}): not a snapshot")
    (_, version, header_size, kw, vw, key_fp, value_fp, store_version, row_count, n_slots, hash_id,
     reserved, block_size, n_blocks, rows_offset, slots_offset, checksums_offset, file_size,
     lineage, json_len) = _HEADER.unpack_from(header)
    if version != FORMAT_VERSION:
        raise corrupt(8, f"unknown snapshot format version {version} "
                         f"(this reader knows version {FORMAT_VERSION})")
    stored = _U64.unpack_from(header, _HEADER_CHECKSUM_AT)[0]
    actual = _xxh64_of(header[:_HEADER_CHECKSUM_AT])
    if stored != actual:
        raise corrupt(_HEADER_CHECKSUM_AT, f"header checksum mismatch "
                                           f"(expected 0x{stored:016x}, got 0x{actual:016x})")
    # Sizes and offsets against each other (Python ints: no overflow).
    if header_size != HEADER_SIZE:
        raise corrupt(12, f"header size {header_size} (expected {HEADER_SIZE})")
    if hash_id != HASH_ID_XXH64:
        raise corrupt(64, f"unknown key hash id {hash_id} (this reader knows {HASH_ID_XXH64}, XXH64)")
    if reserved != 0:
        raise corrupt(68, f"reserved header field is {reserved}, not 0")
    if kw == 0:
        raise corrupt(16, "key width is 0")
    row_width = kw + vw
    if row_count > MAX_ROWS:
        raise corrupt(48, f"row count {row_count} is more than a snapshot holds ({MAX_ROWS})")
    if n_slots < MIN_SLOTS or not _is_pow2(n_slots):
        raise corrupt(56, f"slot count {n_slots} is not a power of two >= {MIN_SLOTS}")
    if n_slots * 3 < row_count * 4:
        raise corrupt(56, f"{n_slots} slots cannot hold {row_count} rows at 3/4 load")
    if not (_is_pow2(block_size) and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE):
        raise corrupt(72, f"block size {block_size} is not a power of two in "
                          f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    if rows_offset != HEADER_SIZE:
        raise corrupt(84, f"rows section at byte {rows_offset} (expected {HEADER_SIZE})")
    rows_end = rows_offset + row_count * row_width
    expected = -(-rows_end // SLOTS_ALIGN) * SLOTS_ALIGN
    if slots_offset != expected:
        raise corrupt(92, f"slots section at byte {slots_offset} (expected {expected}: "
                          f"{row_count} rows of {row_width} bytes end at byte {rows_end})")
    expected = slots_offset + n_slots * 8
    if checksums_offset != expected:
        raise corrupt(100, f"checksums section at byte {checksums_offset} (expected {expected})")
    expected = -(-(checksums_offset - rows_offset) // block_size)
    if n_blocks != expected:
        raise corrupt(76, f"{n_blocks} blocks (expected {expected} of {block_size} bytes)")
    expected = checksums_offset + n_blocks * 8 + FOOTER_SIZE
    if file_size != expected:
        raise corrupt(108, f"the sections end at byte {expected - FOOTER_SIZE}, but the footer "
                           f"is at byte {file_size - FOOTER_SIZE}")
    if json_len > _MAX_SCHEMA_JSON:
        raise corrupt(132, f"schema description of {json_len} bytes does not fit the header")
    try:
        described = json.loads(header[_HEADER.size:_HEADER.size + json_len].decode("utf-8"))
        key_schema = RowSchema.from_description(described["key"])
        value_schema = RowSchema.from_description(described["value"])
    except Exception as e:  # behind a valid checksum: only a broken writer gets here
        raise corrupt(_HEADER.size, f"unreadable schema description: {e!r}") from None
    if key_schema.width != kw or value_schema.width != vw:
        raise corrupt(_HEADER.size, f"the schema description gives rows of {key_schema.width} + "
                                    f"{value_schema.width} bytes, the header {kw} + {vw}")
    if key_schema.fingerprint != key_fp or value_schema.fingerprint != value_fp:
        raise corrupt(_HEADER.size, "the schema description does not match the header's fingerprints")
    cdef SnapshotHeader h = SnapshotHeader.__new__(SnapshotHeader)
    h.store_version = store_version
    h.lineage = lineage
    h.row_count = row_count
    h.key_width = kw
    h.value_width = vw
    h.key_fingerprint = key_fp
    h.value_fingerprint = value_fp
    h.key_schema = key_schema
    h.value_schema = value_schema
    h.file_size = file_size
    h.n_slots = n_slots
    h.block_size = block_size
    h.n_blocks = n_blocks
    h.rows_offset = rows_offset
    h.slots_offset = slots_offset
    h.checksums_offset = checksums_offset
    h.checksum = stored
    return h


# -- the reader: nogil core ---------------------------------------------------------------
cdef int snapshot_verify_block(const SnapLayout* s, uint64_t b, SnapError* err) noexcept nogil:
    """Check data block ``b`` (and, first, the checksum table) and mark it verified."""
    cdef uint64_t start, length, expected, got
    if not SNAP_LOAD_FLAG(s.table_ok):
        snap_willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
        got = xxh64(s.base + s.checksums_offset, s.n_blocks * 8, 0)
        if got != s.table_checksum:
            err.code = SNAP_BAD_TABLE
            err.offset = s.checksums_offset
            err.expected = s.table_checksum
            err.got = got
            return SNAP_BAD_TABLE
        SNAP_STORE_FLAG(s.table_ok, 1)
    start = s.rows_offset + (b << s.block_shift)
    length = s.checksums_offset - start
    if length > (<uint64_t>1 << s.block_shift):
        length = <uint64_t>1 << s.block_shift
    memcpy(&expected, s.base + s.checksums_offset + b * 8, 8)
    got = xxh64(s.base + start, length, 0)
    if got != expected:
        err.code = SNAP_BAD_BLOCK
        err.offset = start
        err.expected = expected
        err.got = got
        return SNAP_BAD_BLOCK
    SNAP_STORE_FLAG(&s.verified[b], 1)
    return SNAP_OK


cdef inline uint64_t snapshot_block_start(const SnapLayout* s, uint64_t b) noexcept nogil:
    """Where block ``b`` starts; the end of the data region for b >= n_blocks."""
    cdef uint64_t start
    if b >= s.n_blocks:
        return s.checksums_offset
    start = s.rows_offset + (b << s.block_shift)
    return start if start < s.checksums_offset else s.checksums_offset


cdef inline int snapshot_touch(const SnapLayout* s, uint64_t offset, uint64_t length,
                               SnapError* err) noexcept nogil:
    """Make sure every block holding bytes [offset, offset + length) was verified."""
    # REQUIRES: rows_offset <= offset, length >= 1, offset + length <= checksums_offset.
    cdef uint64_t b = (offset - s.rows_offset) >> s.block_shift
    cdef uint64_t last = (offset + length - 1 - s.rows_offset) >> s.block_shift
    cdef bint announced = False
    cdef int rc
    while b <= last:
        if not SNAP_LOAD_FLAG(&s.verified[b]):
            if not announced:  # one read for the blocks still to check (and the table)
                if not SNAP_LOAD_FLAG(s.table_ok):
                    snap_willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
                snap_willneed(s.base, snapshot_block_start(s, b), snapshot_block_start(s, last + 1))
                announced = True
            rc = snapshot_verify_block(s, b, err)
            if rc < 0:
                return rc
        b += 1
    return SNAP_OK


cdef inline int snapshot_find(const SnapLayout* s, const uint8_t* key, uint32_t tag,
                              uint64_t* row_out, SnapError* err) noexcept nogil:
    """Set ``row_out`` to the row index + 1 of ``key``, or 0; < 0 if damage was found."""
    cdef uint64_t mask = s.n_slots - 1
    cdef uint64_t pos = tag & mask
    cdef uint64_t dist = 0, offset, row_offset
    cdef SnapSlot slot
    cdef int rc
    row_out[0] = 0
    while dist <= s.max_displacement:
        offset = s.slots_offset + pos * 8
        rc = snapshot_touch(s, offset, 8, err)
        if rc < 0:
            return rc
        memcpy(&slot, s.base + offset, 8)
        if slot.row == 0:
            return SNAP_OK
        if ((pos - (slot.tag & mask)) & mask) < dist:
            return SNAP_OK  # a richer entry: ours would have displaced it (Robin Hood)
        if slot.tag == tag:
            if slot.row > s.row_count:  # cannot pass a checksum; checked all the same
                err.code = SNAP_BAD_SLOT
                err.offset = offset
                err.expected = s.row_count
                err.got = slot.row
                return SNAP_BAD_SLOT
            row_offset = s.rows_offset + <uint64_t>(slot.row - 1) * s.row_width
            rc = snapshot_touch(s, row_offset, s.row_width, err)
            if rc < 0:
                return rc
            if rows_equal(s.base + row_offset, key, s.key_width):
                row_out[0] = slot.row
                return SNAP_OK
        pos = (pos + 1) & mask
        dist += 1
    return SNAP_OK


cdef inline void snapshot_prefetch(const SnapLayout* s, const uint32_t* tags, Py_ssize_t i,
                                   Py_ssize_t n) noexcept nogil:
    """Software pipeline for batch lookups (as RowTable's): the home slot of lookup i+16, the
    row of lookup i+8. Unverified slot bytes only choose what to prefetch; a prefetch never
    faults and never changes a result."""
    cdef uint64_t mask = s.n_slots - 1, pos, dist
    cdef uint32_t tag
    cdef SnapSlot slot
    if i + SLOT_PREFETCH_AHEAD < n:
        SNAP_PREFETCH(s.base + s.slots_offset + (tags[i + SLOT_PREFETCH_AHEAD] & mask) * 8)
    if i + ROW_PREFETCH_AHEAD < n:
        tag = tags[i + ROW_PREFETCH_AHEAD]
        pos = tag & mask
        dist = 0
        while dist <= s.max_displacement:
            memcpy(&slot, s.base + s.slots_offset + pos * 8, 8)
            if slot.row == 0:
                return
            if slot.tag == tag:
                if slot.row <= s.row_count:
                    SNAP_PREFETCH(s.base + s.rows_offset + <uint64_t>(slot.row - 1) * s.row_width)
                return
            pos = (pos + 1) & mask
            dist += 1


cdef void snapshot_announce_all(const SnapLayout* s) noexcept nogil:
    """Start reading every block not checked yet, and the checksum table if it is not."""
    cdef uint64_t b = 0, first
    if not SNAP_LOAD_FLAG(s.table_ok):
        snap_willneed(s.base, s.checksums_offset, s.checksums_offset + s.n_blocks * 8)
    while b < s.n_blocks:
        while b < s.n_blocks and SNAP_LOAD_FLAG(&s.verified[b]):
            b += 1
        first = b
        while b < s.n_blocks and not SNAP_LOAD_FLAG(&s.verified[b]):
            b += 1
        if b > first:
            snap_willneed(s.base, snapshot_block_start(s, first), snapshot_block_start(s, b))


# REQUIRES: keys holds n rows of key_width bytes, values n rows of value_width bytes (or is
# NULL when value_width is 0), found and tags n entries: checked by SnapshotReader.get_rows;
# tests/test_snapshot.py covers 0 keys, 1 key, misses, and batches longer than the
# prefetch distance.
@cython.boundscheck(False)
@cython.wraparound(False)
cdef int snapshot_get_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* values,
                           uint8_t* found, uint32_t* tags, SnapError* err) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint64_t row
    cdef size_t kw = s.key_width, vw = s.value_width
    cdef int rc
    if <uint64_t>n >= s.n_blocks:
        # A batch this large touches most blocks: one read of everything beats a read per
        # block (the mapping has no readahead). Cheap when the pages are cached already.
        snapshot_announce_all(s)
    for i in range(n):
        tags[i] = slot_tag(key_hash(keys + <size_t>i * kw, kw))
    for i in range(n):
        snapshot_prefetch(s, tags, i, n)
        rc = snapshot_find(s, keys + <size_t>i * kw, tags[i], &row, err)
        if rc < 0:
            return rc
        found[i] = row != 0
        if vw:
            if row != 0:
                memcpy(values + <size_t>i * vw, s.base + s.rows_offset + (row - 1) * s.row_width + kw, vw)
            else:
                memset(values + <size_t>i * vw, 0, vw)
    return SNAP_OK


# REQUIRES: keys holds n rows of key_width bytes, tags n entries, mask row_count entries:
# checked by SnapshotReader.mark_rows; tests/test_snapshot.py covers hits, misses and
# batches longer than the prefetch distance.
@cython.boundscheck(False)
@cython.wraparound(False)
cdef int snapshot_mark_many(const SnapLayout* s, const uint8_t* keys, Py_ssize_t n, uint8_t* mask,
                            uint32_t* tags, SnapError* err) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint64_t row
    cdef size_t kw = s.key_width
    cdef int rc
    for i in range(n):
        tags[i] = slot_tag(key_hash(keys + <size_t>i * kw, kw))
    for i in range(n):
        snapshot_prefetch(s, tags, i, n)
        rc = snapshot_find(s, keys + <size_t>i * kw, tags[i], &row, err)
        if rc < 0:
            return rc
        if row != 0:
            mask[row - 1] = 1
    return SNAP_OK

cdef int snapshot_verify(const SnapLayout* s, uint8_t* seen, SnapError* err) noexcept nogil:
    """Every block, then the index: each slot names a row in range, within max_displacement
    of its home, no row twice, row_count rows in all, and a lookup of each row's key finds
    that row (so no key is in two rows). ``seen``: row_count bits, zeroed; NULL checks the
    blocks only."""
    cdef uint64_t b, pos, r, d, count = 0, mask = s.n_slots - 1, offset, found
    cdef uint64_t window = (<uint64_t>VERIFY_WINDOW_BYTES) >> s.block_shift
    cdef const uint8_t* key
    cdef uint32_t tag
    cdef SnapSlot slot, ahead
    cdef int rc
    if window == 0:
        window = 1
    for b in range(s.n_blocks):
        if b % window == 0:  # read this window and the next while hashing
            snap_willneed(s.base, snapshot_block_start(s, b), snapshot_block_start(s, b + 2 * window))
        if not SNAP_LOAD_FLAG(&s.verified[b]):
            rc = snapshot_verify_block(s, b, err)
            if rc < 0:
                return rc
    if seen == NULL:
        return SNAP_OK
    for pos in range(s.n_slots):
        if pos + ROW_PREFETCH_AHEAD < s.n_slots:  # the rows are read in slot order: at random
            memcpy(&ahead, s.base + s.slots_offset + (pos + ROW_PREFETCH_AHEAD) * 8, 8)
            if ahead.row != 0 and ahead.row <= s.row_count:
                SNAP_PREFETCH(s.base + s.rows_offset + <uint64_t>(ahead.row - 1) * s.row_width)
        offset = s.slots_offset + pos * 8
        memcpy(&slot, s.base + offset, 8)
        if slot.row == 0:
            continue
        err.offset = offset
        if slot.row > s.row_count:
            err.code = SNAP_BAD_SLOT
            err.expected = s.row_count
            err.got = slot.row
            return SNAP_BAD_SLOT
        d = (pos - (slot.tag & mask)) & mask
        if d > s.max_displacement:
            err.code = SNAP_BAD_INDEX
            err.what = "an entry lies farther from its home slot than max_displacement"
            err.expected = s.max_displacement
            err.got = d
            return SNAP_BAD_INDEX
        r = slot.row - 1
        if seen[r >> 3] & (1 << (r & 7)):
            err.code = SNAP_BAD_INDEX
            err.what = "two slots name the same row"
            err.expected = 1
            err.got = 2
            return SNAP_BAD_INDEX
        seen[r >> 3] |= <uint8_t>(1 << (r & 7))
        count += 1
        # A lookup of the row's key must end here: the tag is the key's, the entry is
        # reachable, and no entry before it holds the same key (entries with the same
        # hash but other keys are passed over, as lookups do).
        key = s.base + s.rows_offset + r * s.row_width
        tag = slot_tag(key_hash(key, s.key_width))
        if tag != slot.tag:
            err.code = SNAP_BAD_INDEX
            err.offset = offset
            err.what = "a slot's tag is not the hash of its row's key"
            err.expected = tag
            err.got = slot.tag
            return SNAP_BAD_INDEX
        rc = snapshot_find(s, key, tag, &found, err)
        if rc < 0:
            return rc
        if found != slot.row:
            err.code = SNAP_BAD_INDEX
            err.offset = offset
            if found:
                err.what = "two rows have the same key: a lookup of this row's key finds another row"
                err.expected = slot.row - 1
                err.got = found - 1
            else:
                err.what = "a lookup of a row's key does not reach the row's slot (rows found)"
                err.expected = 1
                err.got = 0
            return SNAP_BAD_INDEX
    if count != s.row_count:
        err.code = SNAP_BAD_INDEX
        err.offset = s.slots_offset
        err.what = "the slots do not name every row"
        err.expected = s.row_count
        err.got = count
        return SNAP_BAD_INDEX
    return SNAP_OK


# -- the mapping --------------------------------------------------------------------------
@cython.final
cdef class _Mapping:
    """A whole file mapped read-only and guarded against SIGBUS (see snap_guard_add).
    Unmapped when the last reference goes: the reader's, or the one a running call holds."""

    def __cinit__(self, int fd, size_t length):
        self.guard = -1
        self.damaged_at = 0
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


# -- the reader ---------------------------------------------------------------------------
@cython.final
cdef class SnapshotReader:
    """A snapshot file, memory-mapped read-only; lookups and iteration in place.

    Opening reads and checks the header and the footer only (O(1) whatever the size); data
    blocks are checked on first touch (see the module docstring). Everything returned is a
    copy (bytes, tuples, arrays), so nothing outlives the mapping. The API mirrors RowTable.

    Parameters
    ----------
    path : str or os.PathLike
        A local file (remote files are copied to a local cache first, by the caller).
    key_schema, value_schema : numpy structured dtype or RowSchema, optional
        The schemas the caller expects; by default, those recorded in the file.
    expected_lineage : 16 bytes or uuid.UUID, optional
        The lineage the snapshot must belong to.

    Raises
    ------
    StateCorruptionError
        If the file is damaged (or belongs to another lineage); names the path and offset.
    SchemaMismatchError
        If a schema given differs from the file's; the message names which one.
    OSError
        If the file cannot be opened.
    """

    def __cinit__(self, path, key_schema=None, value_schema=None, expected_lineage=None):
        self.path = os.fspath(path)
        self._closed = True
        if expected_lineage is not None:
            expected_lineage = _lineage_bytes(expected_lineage, "expected_lineage")
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE + FOOTER_SIZE:
                raise self._corrupt(size, f"the file is {size} bytes; a snapshot has at least "
                                          f"{HEADER_SIZE + FOOTER_SIZE}")
            # Header and footer by pread: two small reads, whatever the device's readahead.
            header = os.pread(fd, HEADER_SIZE, 0)
            footer = os.pread(fd, FOOTER_SIZE, size - FOOTER_SIZE)
            if len(header) != HEADER_SIZE or len(footer) != FOOTER_SIZE:
                raise self._corrupt(size, "the file shrank while it was opened")
            self._check(header, footer, size, key_schema, value_schema, expected_lineage)
            self._mapping = _Mapping(fd, size)
            self._mapping.canary_at = size - 8
            self._mapping.canary = self._footer_checksum
        finally:
            os.close(fd)
        self._closed = False

    def __dealloc__(self):
        free(self.verified)
        self.verified = NULL

    cdef object _corrupt(self, offset, reason):
        return StateCorruptionError(self.path, offset, reason)

    cdef object _check(self, bytes header, bytes footer, size, key_schema, value_schema,
                       expected_lineage):
        """Check the header (read_snapshot_header), then it and the footer against the file,
        then set up the reader's fields."""
        cdef SnapshotHeader h = read_snapshot_header(header, self.path)
        if h.file_size != size:
            raise self._corrupt(108, f"the header says the file is {h.file_size} bytes, "
                                     f"but it is {size} bytes")
        footer_at = size - FOOTER_SIZE
        if footer[:8] != FOOTER_MAGIC:
            raise self._corrupt(footer_at, f"bad footer magic {footer[:8]!r} "
                                           f"(expected {FOOTER_MAGIC!r})")
        footer_checksum = _U64.unpack_from(footer, _FOOTER_CHECKSUM_AT)[0]
        actual = _xxh64_of(footer[:_FOOTER_CHECKSUM_AT])
        if footer_checksum != actual:
            raise self._corrupt(footer_at + _FOOTER_CHECKSUM_AT, f"footer checksum mismatch "
                                f"(expected 0x{footer_checksum:016x}, got 0x{actual:016x})")
        _, table_checksum, footer_file_size, footer_header_checksum, max_displacement = \
            _FOOTER.unpack_from(footer)
        if footer_file_size != size:
            raise self._corrupt(footer_at + 16, f"the footer says the file is {footer_file_size} "
                                                f"bytes, but it is {size} bytes")
        if footer_header_checksum != h.checksum:
            raise self._corrupt(footer_at + 24, "the footer belongs to another header")
        if max_displacement >= h.n_slots:
            raise self._corrupt(footer_at + 32, f"max displacement {max_displacement} is not below the "
                                                f"{h.n_slots} slots")

        if key_schema is not None:
            key_schema = as_schema(key_schema, key=True)
            if key_schema.fingerprint != h.key_fingerprint:
                raise SchemaMismatchError(f"key schema mismatch in snapshot '{self.path}': the file has "
                                          f"{h.key_schema.describe()}, expected {key_schema.describe()}")
        if value_schema is not None:
            value_schema = as_schema(value_schema)
            if value_schema.fingerprint != h.value_fingerprint:
                raise SchemaMismatchError(f"value schema mismatch in snapshot '{self.path}': the file has "
                                          f"{h.value_schema.describe()}, "
                                          f"expected {value_schema.describe()}")
        if expected_lineage is not None and expected_lineage != h.lineage:
            raise self._corrupt(116, f"snapshot belongs to another lineage "
                                     f"(expected {expected_lineage.hex()}, found {h.lineage.hex()})")

        self.verified = <uint8_t*>calloc(h.n_blocks, 1)
        if self.verified == NULL:
            raise MemoryError(f"cannot allocate the verified-block map of {h.n_blocks} blocks")
        self.header = h
        self.key_schema = key_schema if key_schema is not None else as_schema(h.key_schema, key=True)
        self.value_schema = value_schema if value_schema is not None else h.value_schema
        self.lineage = h.lineage
        self.store_version = h.store_version
        self.row_count = h.row_count
        self.file_size = size
        self.n_slots = h.n_slots
        self.n_blocks = h.n_blocks
        self.block_size = h.block_size
        self.max_displacement = max_displacement
        self.key_width = h.key_width
        self.value_width = h.value_width
        self.row_width = h.key_width + h.value_width
        self._footer_checksum = footer_checksum
        self.table_ok = 0
        self.layout.base = NULL
        self.layout.verified = self.verified
        self.layout.table_ok = &self.table_ok
        self.layout.row_count = h.row_count
        self.layout.n_slots = h.n_slots
        self.layout.rows_offset = h.rows_offset
        self.layout.slots_offset = h.slots_offset
        self.layout.checksums_offset = h.checksums_offset
        self.layout.n_blocks = h.n_blocks
        self.layout.table_checksum = table_checksum
        self.layout.key_width = h.key_width
        self.layout.value_width = h.value_width
        self.layout.row_width = self.row_width
        self.layout.max_displacement = max_displacement
        self.layout.block_shift = h.block_size.bit_length() - 1

    cdef _Mapping _acquire(self):
        """The mapping, held by the caller for the length of its call (see close()). The
        caller checks ``mapping.sound()`` after its work, before it returns anything read
        from the mapping or raises about it."""
        if self._closed:
            raise ValueError(f"I/O operation on a closed SnapshotReader ('{self.path}')")
        return self._mapping

    cdef object _raise_truncated(self, _Mapping mapping):
        """The error for a mapping that is not sound."""
        cdef uint64_t at = mapping.damage()
        raise StateCorruptionError(self.path, at - 1 if at else mapping.canary_at,
                                   "the file was truncated while mapped")

    cdef object _raise_for(self, const SnapError* err):
        cdef uint64_t block
        if err.code == SNAP_BAD_TABLE:
            reason = (f"checksum table does not match the footer (expected 0x{err.expected:016x}, "
                      f"got 0x{err.got:016x})")
        elif err.code == SNAP_BAD_BLOCK:
            block = (err.offset - self.layout.rows_offset) >> self.layout.block_shift
            reason = (f"data block {block} checksum mismatch (expected 0x{err.expected:016x}, "
                      f"got 0x{err.got:016x})")
        elif err.code == SNAP_BAD_SLOT:
            reason = f"a slot names row {err.got} of {err.expected}"
        elif err.code == SNAP_BAD_INDEX:
            reason = f"{err.what.decode()} (expected {err.expected}, found {err.got})"
        else:
            raise AssertionError(f"unknown snapshot code {err.code}")
        raise StateCorruptionError(self.path, err.offset, reason)

    # -- raw rows -------------------------------------------------------------------------
    def get_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[:, ::1] values not None,
                 uint8_t[::1] found not None):
        """Look up ``keys`` (n, key_width) into ``values`` (n, value_width; zeros where not
        found) and ``found`` (n,). Raises StateCorruptionError if a touched block is damaged
        or the file was truncated; ``values`` and ``found`` then hold nothing to use."""
        cdef _Mapping mapping = self._acquire()
        cdef Py_ssize_t n = keys.shape[0]
        if keys.shape[1] != self.key_width or values.shape[1] != self.value_width:
            raise ValueError(f"rows must be (n, {self.key_width}) keys and (n, {self.value_width}) values, "
                             f"got {keys.shape[1]} and {values.shape[1]} bytes")
        if values.shape[0] != n or found.shape[0] != n:
            raise ValueError(f"{n} keys but {values.shape[0]} value rows and {found.shape[0]} found flags")
        if n == 0:
            return
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        cdef uint8_t* value_ptr = <uint8_t*>_rows_ptr(values)
        cdef SnapLayout lay = self.layout
        cdef SnapError err
        cdef int rc
        lay.base = mapping.base
        with nogil:
            rc = snapshot_get_many(&lay, &keys[0, 0], n, value_ptr, &found[0], &tags[0], &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def mark_rows(self, const uint8_t[:, ::1] keys not None, uint8_t[::1] mask not None):
        """Set ``mask[i] = 1`` for the file-order row index ``i`` of every key found: which
        rows a set of changed keys overrides, found by probing the changed keys rather than
        by probing every row of the snapshot elsewhere (writing a newer snapshot). After a
        StateCorruptionError, ``mask`` holds nothing to use."""
        cdef _Mapping mapping = self._acquire()
        cdef Py_ssize_t n = keys.shape[0]
        if keys.shape[1] != self.key_width:
            raise ValueError(f"keys must be (n, {self.key_width}) rows, got {keys.shape[1]} bytes")
        if <uint64_t>mask.shape[0] != self.row_count:
            raise ValueError(f"the mask needs {self.row_count} entries (one per row), got {mask.shape[0]}")
        if n == 0 or self.row_count == 0:
            return
        cdef uint32_t[::1] tags = np.empty(n, dtype=np.uint32)
        cdef SnapLayout lay = self.layout
        cdef SnapError err
        cdef int rc
        lay.base = mapping.base
        with nogil:
            rc = snapshot_mark_many(&lay, &keys[0, 0], n, &mask[0], &tags[0], &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def get_row(self, const uint8_t[::1] key not None):
        """Value bytes of key bytes, or None."""
        cdef _Mapping mapping = self._acquire()
        if key.shape[0] != self.key_width:
            raise ValueError(f"a key row is {self.key_width} bytes, got {key.shape[0]}")
        cdef SnapLayout lay = self.layout
        cdef SnapError err
        cdef uint64_t row
        lay.base = mapping.base
        cdef int rc = snapshot_find(&lay, &key[0], slot_tag(key_hash(&key[0], <size_t>self.key_width)),
                                    &row, &err)
        value = None
        if rc == SNAP_OK and row != 0:
            value = PyBytes_FromStringAndSize(
                <const char*>lay.base + lay.rows_offset + (row - 1) * lay.row_width + lay.key_width,
                self.value_width)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)
        return value

    # -- the schema-level API -------------------------------------------------------------
    def get(self, key):
        """The value tuple of ``key`` (tuple, scalar, record or bytes), or None."""
        return lookup_one(self.get_row, self.key_schema, self.value_schema, key)

    def __contains__(self, key):
        return self.get_row(self.key_schema.encode(key)) is not None

    def __len__(self):
        return self.row_count

    def get_batch(self, keys):
        """``(values, found)`` for a batch of keys; see :func:`statecore.rowsource.lookup_batch`."""
        return lookup_batch(self.get_rows, self.key_schema, self.value_schema, keys)

    def cursor(self):
        """A :class:`SnapshotCursor` over every row, in file order."""
        cdef _Mapping mapping = self._acquire()
        if not mapping.sound():
            self._raise_truncated(mapping)
        return SnapshotCursor(self)

    def items(self):
        """Yield ``(key_tuple, value_tuple)`` for every row, in file order."""
        return iter_items(self.cursor(), self.key_schema, self.value_schema)

    def iter_batches(self, Py_ssize_t rows_per_batch=65536):
        """Yield ``(keys, values)`` structured-array copies covering every row exactly once."""
        return iter_batches(self.cursor(), self.key_schema, self.value_schema, rows_per_batch)

    # -- checks ---------------------------------------------------------------------------
    def verify(self, bint index=True):
        """Check every checksum (they cover the rows and the slots) and, unless ``index`` is
        false, the slot index: consistent with the header, and a lookup of each row's key
        finds that row (so no key is in two rows; one random row read per row). Raises
        StateCorruptionError. ``index=False`` is what lookups would check lazily, done at
        once (a snapshot just written, made ready before it is used)."""
        cdef _Mapping mapping = self._acquire()
        seen_arr = np.zeros(self.row_count // 8 + 1, dtype=np.uint8)
        cdef uint8_t[::1] seen = seen_arr
        cdef SnapLayout lay = self.layout
        cdef SnapError err
        cdef int rc
        lay.base = mapping.base
        with nogil:
            rc = snapshot_verify(&lay, &seen[0] if index else NULL, &err)
        if not mapping.sound():
            self._raise_truncated(mapping)
        if rc < 0:
            self._raise_for(&err)

    def verified_blocks(self):
        """How many data blocks were checked so far. Visible for tests (lazy verification)."""
        cdef uint64_t b, total = 0
        for b in range(self.n_blocks):
            total += SNAP_LOAD_FLAG(&self.verified[b])
        return total

    # -- lifetime -------------------------------------------------------------------------
    @property
    def commit_id(self):
        """The header's lineage[:8] (the store's id of the version this snapshot holds)."""
        return self.lineage[:8]

    @property
    def closed(self):
        return self._closed

    def close(self):
        """Release the mapping; later calls raise ValueError. Calling it twice is harmless.

        A call running in another thread holds the mapping until it returns: the last
        reference to the mapping unmaps it."""
        if self._closed:
            return
        self._closed = True
        self._mapping = None

    def __enter__(self):
        self._acquire()
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"{self.row_count} rows"
        return f"SnapshotReader('{self.path}', version {self.store_version}, {state})"


# REQUIRES: src holds m rows of w bytes, skip m entries, dst room for the unskipped rows:
# checked by SnapshotCursor.next_rows (tests/test_snapshot.py covers skips at the ends).
@cython.boundscheck(False)
@cython.wraparound(False)
cdef void copy_unskipped(const uint8_t* src, const uint8_t* skip, uint64_t m, uint64_t w,
                         uint8_t* dst) noexcept nogil:
    cdef uint64_t i, run_start = 0, out = 0
    # copy maximal runs of kept rows with one memcpy each
    for i in range(m + 1):
        if i == m or skip[i]:
            if i > run_start:
                memcpy(dst + out * w, src + run_start * w, (i - run_start) * w)
                out += i - run_start
            run_start = i + 1

@cython.final
cdef class SnapshotCursor:
    """Walks a snapshot's rows in file order, in chunks; each chunk is a copy."""

    def __cinit__(self, SnapshotReader reader not None):
        self.reader = reader
        self.pos = 0
        self.end = reader.row_count

    def next_rows(self, Py_ssize_t max_rows, skip=None):
        """A copy of the next rows (up to ``max_rows`` of them) as an (m, row_width) uint8
        array, or None when done. With ``skip`` (a uint8 array, one entry per row of the
        file), rows whose entry is nonzero are left out of the copy, so a chunk may hold
        fewer rows, or none. Raises StateCorruptionError if a block they lie in is damaged."""
        if max_rows <= 0:
            raise ValueError(f"max_rows must be > 0, got {max_rows}")
        cdef SnapshotReader r = self.reader
        cdef _Mapping mapping = r._acquire()
        cdef const uint8_t[::1] skip_view
        if skip is not None:
            skip_view = skip
            if <uint64_t>skip_view.shape[0] != r.row_count:
                raise ValueError(f"skip needs {r.row_count} entries (one per row), got {skip_view.shape[0]}")
        if self.pos >= self.end:
            return None
        cdef uint64_t m = min(<uint64_t>max_rows, self.end - self.pos)
        cdef SnapLayout lay = r.layout
        cdef SnapError err
        cdef int rc
        lay.base = mapping.base
        cdef uint64_t start = lay.rows_offset + self.pos * lay.row_width
        cdef uint64_t length = m * lay.row_width
        cdef uint64_t kept = m
        if skip is not None:
            kept = m - <uint64_t>np.count_nonzero(skip[self.pos:self.pos + m])
        out = np.empty((kept, lay.row_width), dtype=np.uint8)
        cdef uint8_t* dst = <uint8_t*>_rows_ptr(out)
        with nogil:
            rc = snapshot_touch(&lay, start, length, &err)
            if rc == SNAP_OK:
                if kept == m:
                    if m:
                        memcpy(dst, lay.base + start, length)
                else:
                    copy_unskipped(lay.base + start, &skip_view[self.pos], m, lay.row_width, dst)
        if not mapping.sound():
            r._raise_truncated(mapping)
        if rc < 0:
            r._raise_for(&err)
        self.pos += m
        return out
