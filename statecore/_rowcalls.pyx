# cython: language_level=3
"""RowCalls: the per-row ``get``, ``put`` and ``remove`` of a FileReadStore / FileStore,
compiled, so that a call is one C function: the key (and value) encoded by the schemas'
RowCodecs into buffers on the C stack, one key hash, the probes, the value decoded.

It reads the store's update layer (its puts, then its deletions), then, under the
provider's lock (a ProviderLock, taken from C: ``statecore/_lock.pyx``), the pinned
version's flattened sources by the one rule (``Sources.find``, ``statecore/_versions.pyx``).
The update layer is the store's own (a store is used by one thread), so a key the store
itself put or removed is answered without the lock. Puts and removes change the update
layer exactly as ``Layer.put_row`` and ``Layer.delete_row`` do. A found value is copied out
of the table while the lock is held and decoded after, from the copy: decoding allocates,
and nothing that allocation may run (a finalizer) can then change what is being read.

The flattened sources are kept between calls: taken, under the lock, on the first lookup
and again whenever the provider's change counter (``State.changes``) moved, which every
change to what they hold counts before it is made (_versions.pyx), also under the lock. The
tables kept are the layers' own objects, so rows merged into the head later are seen; they
are probed under the lock, as before.
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from statecore._hash cimport key_hash, slot_tag
from statecore._lock cimport ProviderLock, lock_enter, lock_exit
from statecore._rowcodec cimport RowCodec
from statecore._rowtable cimport RowTable, table_may_hold
from statecore._versions cimport Sources, State, state_sources, table_find_value

from statecore.errors import IllegalStateError

cdef enum:
    # RowCalls.status: a read store, or a store's lifecycle.
    READING = 0
    UPDATING = 1
    COMMITTED = 2
    ABORTED = 3

cdef enum:
    # Rows up to this many bytes are encoded in a buffer on the C stack; wider ones on the heap.
    STACK_ROW = 256


cdef inline uint8_t* _scratch(uint8_t* stack, Py_ssize_t n, uint8_t** heap) except NULL:
    """Scratch bytes for one row of one call: ``stack`` when they fit, else ``*heap`` (the
    caller frees it). A call's own buffers keep a call made meanwhile (from a finalizer)
    from writing over them."""
    if n <= STACK_ROW:
        return stack
    heap[0] = <uint8_t*>PyMem_Malloc(n)
    if heap[0] == NULL:
        raise MemoryError(f"cannot allocate {n} bytes for a row")
    return heap[0]


cdef inline void _free(uint8_t* heap) noexcept:
    """Free a row's heap buffer of _scratch (NULL for a row that fit on the stack)."""
    if heap != NULL:
        PyMem_Free(heap)


cdef class RowCalls:
    """The per-row calls of one store over one pinned ``view`` (its ``state`` and
    ``version``), and the store's lifecycle: ``update`` is the store's update Layer (None
    for a read store), written by ``put``/``remove`` while the store is updating. The
    stores are subclasses (statecore/stores.py): ``store.get(key)`` calls straight
    into C. ``status``, one field, is the lifecycle: ``check_updating`` is the one check."""

    def __init__(self, view, ProviderLock lock not None, key_schema, value_schema, update=None):
        self.key_codec = key_schema.codec
        self.value_codec = value_schema.codec
        self.key_width = key_schema.width
        self.value_width = value_schema.width
        self.lock = lock
        self._follow(view)
        if update is None:
            self.puts = self.dels = None
            self.status = READING
        else:
            self.puts = update.puts
            self.dels = update.dels
            self.status = UPDATING

    cdef int _follow(self, view) except -1:
        """Read ``view`` from now on (its flattened sources taken on the next lookup)."""
        cdef const uint64_t[::1] changes
        self.state = view.state
        self.version = view.version
        self.changes = self.state.changes
        changes = self.changes
        if changes.shape[0] != 1:
            raise ValueError(f"State.changes must hold one count, got {changes.shape[0]}")
        self.changes_at = &changes[0]
        self.sources = None
        return 0

    @property
    def updating(self):
        """Whether puts and removes are taken (the store neither committed nor aborted)."""
        return self.status == UPDATING

    @property
    def has_committed(self):
        return self.status == COMMITTED

    def check_updating(self, verb):
        """IllegalStateError (Spark's wording) unless puts and removes are taken."""
        self._require_updating(verb)

    cdef int _require_updating(self, verb) except -1:
        """The one lifecycle check: of the per-row writes, and (through check_updating) the
        batch writes and commit."""
        if self.status != UPDATING:
            raise IllegalStateError(f"Cannot {verb} after already committed or aborted")
        return 0

    def _end_updates(self, committed, view=None):
        """The store committed (``committed``) or aborted: puts and removes are refused from
        now on. Reads follow ``view`` (the committed version) if given, without the update
        layer (merged there); an abort's reads drop the update layer too."""
        self.status = COMMITTED if committed else ABORTED
        if view is not None or not committed:
            self.puts = self.dels = None
        if view is not None:
            self._follow(view)

    cdef int _take_sources(self) except -1:
        """Keep the flattened sources of the pinned version (see the module docstring).
        REQUIRES: the provider's lock held."""
        cdef uint64_t at = self.changes_at[0]
        self.sources = state_sources(self.state, self.version)
        self.sources_at = at
        return 0

    cdef int _find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        cdef uint32_t tag
        if self.puts is not None:
            tag = slot_tag(h)
            if table_find_value(self.puts, key, tag, value_out if self.value_width else NULL):
                return 1
            if table_find_value(self.dels, key, tag, NULL):
                return 0
        lock_enter(self.lock)
        try:
            if self.sources is None or self.sources_at != self.changes_at[0]:
                self._take_sources()
            return self.sources.find(key, h, value_out)
        finally:
            lock_exit(self.lock)

    def get(self, key):
        """The value tuple of ``key`` (tuple, scalar, or what RowSchema.encode takes), or None."""
        cdef uint8_t key_stack[STACK_ROW]
        cdef uint8_t value_stack[STACK_ROW]
        cdef uint8_t* key_heap = NULL
        cdef uint8_t* value_heap = NULL
        cdef uint8_t* k
        cdef uint8_t* v
        try:
            k = _scratch(key_stack, self.key_width, &key_heap)
            v = _scratch(value_stack, self.value_width, &value_heap)
            self.key_codec.encode_into(key, k)
            if not self._find(k, key_hash(k, self.key_width), v):
                return None
            return self.value_codec.decode_from(v)
        finally:
            _free(key_heap)
            _free(value_heap)

    def put(self, key, value):
        """Insert or overwrite ``key`` with ``value`` in the update layer."""
        cdef uint8_t key_stack[STACK_ROW]
        cdef uint8_t value_stack[STACK_ROW]
        cdef uint8_t* key_heap = NULL
        cdef uint8_t* value_heap = NULL
        cdef uint8_t* k
        cdef uint8_t* v
        cdef uint32_t tag
        cdef int rc
        if value is None:
            raise ValueError("Cannot put a null value")
        self._require_updating("put")
        try:
            k = _scratch(key_stack, self.key_width, &key_heap)
            v = _scratch(value_stack, self.value_width, &value_heap)
            self.key_codec.encode_into(key, k)
            self.value_codec.encode_into(value, v)
            tag = slot_tag(key_hash(k, self.key_width))
            rc = self.puts.table_put(k, v if self.value_width else NULL, tag)
            if rc < 0:
                self.puts._check(rc)
            if table_may_hold(self.dels, tag):
                rc = self.dels.table_remove(k, tag)
                if rc < 0:
                    self.dels._check(rc)
        finally:
            _free(key_heap)
            _free(value_heap)

    def remove(self, key):
        """Remove ``key``: a deletion in the update layer, hiding it from the version below."""
        cdef uint8_t key_stack[STACK_ROW]
        cdef uint8_t* key_heap = NULL
        cdef uint8_t* k
        cdef uint32_t tag
        cdef int rc
        self._require_updating("remove")
        try:
            k = _scratch(key_stack, self.key_width, &key_heap)
            self.key_codec.encode_into(key, k)
            tag = slot_tag(key_hash(k, self.key_width))
            if table_may_hold(self.puts, tag):
                rc = self.puts.table_remove(k, tag)
                if rc < 0:
                    self.puts._check(rc)
            rc = self.dels.table_put(k, NULL, tag)
            if rc < 0:
                self.dels._check(rc)
        finally:
            _free(key_heap)
