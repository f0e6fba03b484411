# cython: language_level=3
"""RowCalls: the per-row ``get``, ``put`` and ``remove`` of a FileReadStore / FileStore,
compiled, so that a call is one C function: the key (and value) encoded by the schemas'
RowCodecs into buffers on the C stack, one key hash, the probes, the value decoded.

It reads what ``State.get_row`` reads, in the same order: the store's update layer (its
puts, then its deletions), then, under the provider's lock (a ProviderLock, taken from C:
``statecore/_lock.pyx``), the pinned version's layers (undo layers of newer versions, the
head) and the base (a SnapshotReader, a Spill, or a frozen State seen at a version, walked
the same way). The update layer is the store's own (a
store is used by one thread), so a key the store itself put or removed is answered without
the lock. Puts and removes change the update layer exactly as ``Layer.put_row`` and
``Layer.delete_row`` do. A found value is copied out of the table while the lock is held
and decoded after, from the copy: decoding allocates, and nothing that allocation may run
(a finalizer) can then change what is being read.

The walk of the pinned version's own State (the tables of its non-empty layers, newest
first, and the base) is kept between calls: it is taken, under the lock, on the first
lookup and again whenever ``State.changes`` moved, which every change to what the walk
holds counts before it is made (layers.py), also under the lock. The tables kept are the
layers' own objects, so rows merged into the head later are seen; they are probed under
the lock, as before. A frozen State under the base is walked afresh on each call
(``_state_find``), and a Spill base follows its levels on each call (``spill_find``).
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from statecore._hash cimport key_hash, slot_tag
from statecore._levels cimport spill_find
from statecore._lock cimport ProviderLock, lock_enter, lock_exit
from statecore._rowcodec cimport RowCodec
from statecore._rowtable cimport RowTable, table_may_hold
from statecore._snapshot_reader cimport SnapshotReader

from statecore.errors import IllegalStateError
from statecore.spill import Spill

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


cdef inline int _table_find(RowTable t, const uint8_t* key, uint32_t tag, uint8_t* value_out) noexcept:
    """1 if ``t`` holds the key, else 0; its value is copied to ``value_out`` unless NULL."""
    cdef uint64_t pos
    cdef uint32_t row
    if not table_may_hold(t, tag):  # empty, or the filter rules the key out
        return 0
    row = t.table_find(key, tag, &pos)
    if row == 0:
        return 0
    if value_out != NULL:
        memcpy(value_out, t.rows + <uint64_t>(row - 1) * t.row_width + t.key_width, t.value_width)
    return 1


cdef int _layer_find(layer, const uint8_t* key, uint32_t tag, uint8_t* value_out) except -2:
    """1 (value copied out) if ``layer`` puts the key, 0 if it deletes it, -1 if it does not
    decide it."""
    puts = layer._puts
    if puts is None:
        if layer._pending is None:
            return -1  # nothing in it
        puts = layer.puts  # an undo layer kept as arrays: its tables are built once
    if _table_find(<RowTable>puts, key, tag, value_out if (<RowTable>puts).value_width else NULL):
        return 1
    if _table_find(<RowTable>layer._dels, key, tag, NULL):
        return 0
    return -1


cdef int _state_find(state, int64_t version, head, const uint8_t* key, uint64_t h,
                     uint8_t* value_out) except -1:
    """``State.get_row(version, key)`` for a key of hash ``h``: 1 (value copied out) or 0.
    REQUIRES: the provider's lock held, or ``state`` frozen."""
    cdef int r
    cdef int64_t newest = state.version, u
    cdef uint32_t tag = slot_tag(h)
    if newest != version:  # State.layers_for: the undo layers of versions + 1 .. newest first
        undo = state.undo
        for u in range(version + 1, newest + 1):
            r = _layer_find(undo[u], key, tag, value_out)
            if r >= 0:
                return r
    r = _layer_find(head, key, tag, value_out)
    if r >= 0:
        return r
    return _base_find(state.base, key, h, value_out)


cdef int _base_find(base, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
    """The lookup in a State's base: 1 (value copied out) or 0. REQUIRES: as _state_find."""
    if base is None:
        return 0
    if type(base) is SnapshotReader:
        return (<SnapshotReader>base).find_into(key, h, value_out)
    if type(base) is Spill:
        return spill_find(base, key, h, value_out)
    inner = base.state  # a FrozenView: a frozen State at a version
    return _state_find(inner, base.version, inner.head, key, h, value_out)


cdef int _walk_layer(layer, list walk) except -1:
    """Append the tables of ``layer`` to ``walk`` if it holds anything (an undo layer kept
    as arrays is turned into tables here, once, as ``_layer_find`` would)."""
    if layer._puts is None and layer._pending is None:
        return 0  # nothing in it
    puts = layer.puts
    dels = layer.dels
    if (<RowTable>puts).count or (<RowTable>dels).count:
        walk.append(puts)
        walk.append(dels)
    return 0


@cython.final
cdef class RowCalls:
    """The per-row calls of one store over one pinned ``view``; ``update`` is the store's
    update Layer, or None for a read store. The store binds ``get`` (and ``put``, ``remove``)
    on itself, so that ``store.get(key)`` calls straight into C."""

    def __cinit__(self, view, ProviderLock lock not None, key_schema, value_schema, update=None):
        self.key_codec = key_schema.codec
        self.value_codec = value_schema.codec
        self.key_width = key_schema.width
        self.value_width = value_schema.width
        cdef const uint64_t[::1] changes
        self.state = view.state
        self.version = view.version
        self.lock = lock
        self.changes = self.state.changes
        changes = self.changes
        if changes.shape[0] != 1:
            raise ValueError(f"State.changes must hold one count, got {changes.shape[0]}")
        self.changes_at = &changes[0]
        self.set_update(update)

    def set_update(self, update):
        """Read (and write) ``update`` from now on (a store that aborts starts a new one)."""
        if update is None:
            self.puts = self.dels = None
            self.updating = False
        else:
            self.puts = update.puts
            self.dels = update.dels
            self.updating = True

    def close_updates(self):
        """The store committed or aborted: puts and removes are refused from now on."""
        self.updating = False

    cdef int _take_walk(self) except -1:
        """Keep the walk of the pinned version (see the module docstring). REQUIRES: the
        provider's lock held."""
        cdef int64_t u
        cdef uint64_t at = self.changes_at[0]
        state = self.state
        undo = state.undo
        walk = []
        for u in range(self.version + 1, <int64_t>state.version + 1):  # State.layers_for
            _walk_layer(undo[u], walk)
        _walk_layer(state.head, walk)
        self.walk = walk
        self.base = state.base
        self.walked_at = at
        return 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int _find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        cdef uint32_t tag = slot_tag(h)
        cdef Py_ssize_t i, n
        cdef RowTable puts
        cdef list walk
        if self.puts is not None:
            if _table_find(self.puts, key, tag, value_out if self.value_width else NULL):
                return 1
            if _table_find(self.dels, key, tag, NULL):
                return 0
        lock_enter(self.lock)
        try:
            if self.walk is None or self.walked_at != self.changes_at[0]:
                self._take_walk()
            walk = self.walk
            n = len(walk)
            for i in range(0, n, 2):
                puts = <RowTable>walk[i]
                if _table_find(puts, key, tag, value_out if puts.value_width else NULL):
                    return 1
                if _table_find(<RowTable>walk[i + 1], key, tag, NULL):
                    return 0
            return _base_find(self.base, key, h, value_out)
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
        if not self.updating:
            raise IllegalStateError("Cannot put after already committed or aborted")
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
        if not self.updating:
            raise IllegalStateError("Cannot remove after already committed or aborted")
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
