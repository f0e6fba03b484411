# cython: language_level=3
"""The read model: the in-memory versions of one store as typed objects, what one version is
made of, and the one rule that reads it (per row, in batches, and whole).

The in-memory versions. A version is never copied. The newest version a provider holds is a
:class:`State` (a version stack): a *base* (a mapped SnapshotReader, a :class:`Spill` of
changes mapped over one, a :class:`FrozenView` of another State frozen at a version, or
nothing) under a *head* :class:`Layer` holding every change since that base. Each commit
merges its updates into the head in place and keeps an *undo* layer (the previous value, or
absence, of every key it changed), so the versions just before the newest stay readable while
they are retained or pinned by an open store. A Layer is a RowTable of puts and a RowTable set
of deletions. Everything is batch-shaped (row arrays in, row arrays out); nothing loops in
Python per row.

The four are cdef classes declared in ``_versions.pxd`` with typed fields: the flattening
below reads them as C attributes, and tells the kinds of base apart by type. None of their
fields can be set from Python (read-only attributes, no ``__dict__``; a State's versions, undo
layers and pins are read-only mappings): a State changes only through its methods. A frozen
State (``freeze_into_successor``: a newer State goes on over it while it is read without the
lock) refuses every change in one check, ``_refuse_if_frozen``, but a base swap (the same rows,
mapped) and the bookkeeping of pins and open iterations.

Thread-safety: a State's owner (the provider) serializes merges and base swaps with its lock;
lookups read a consistent state as long as they hold the same lock or the state is frozen.
What a lookup walks (the version, the undo layers, the base, a spill's ``lower``, and which
layers hold anything) changes only through State's methods, its ``base`` setter and
``replace_in_chain``, and each of them counts the change in ``State.changes`` before it changes
anything. That counter is one per provider, shared by every State of it (a change to a frozen
State low in the chain moves it too): a compiled reader (RowCalls) keeps the flattened sources
of its version and flattens again when it moved.

A version's *sources* are flattened once into a :class:`Sources`, newest first:

- *tables*: the non-empty layers that decide keys at that version: the undo layers of the
  newer versions (oldest first: the undo of v+1 holds the value at v), the head, and, where
  the base is a FrozenView (a frozen State seen at a version), that State's own layers at
  that version, and so on down;
- *levels*: the Spills at the bottom of that chain that stand on something (each two mapped
  images: the rows it puts, the keys it removes);
- the *bottom image*: the mapped snapshot under them (a SnapshotReader, or a ConvertedImage:
  a snapshot of an older value schema whose values are converted as they are read), or a
  whole spill's image (every row of its version), or nothing.

Tables always come before images: a Spill never stands over a table. The rule is: **the
first source that decides a key wins** (a put gives its value; a removal, absence); a key no
source decides is absent. It is written here once, with three entry points:
``Sources.find`` (the stores' per-row calls, statecore/_rowcalls.pyx), ``Sources.lookup``
(batches: the tables narrowed to the keys still undecided, then the images in one nogil walk,
statecore/_image_walk.pyx) and ``Sources.rows`` (iteration: each source's rows that no newer
source decides). Whatever tells the kinds of base apart is in this module too, as the
functions at its end.

Rules: ``docs/provider-rules.md``, "The read model". (About 950 lines: the types and the
flattening that reads their fields are one module; split, each part would cimport the other.
The image walk, which reads images only, is a module of its own.)
"""
cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

import threading
from types import MappingProxyType

import numpy as np

from statecore._hash cimport slot_tag
from statecore._image_walk cimport images_lookup
from statecore._rowtable cimport RowTable
from statecore._converted_image cimport ConvertedImage
from statecore._hash cimport key_hash
from statecore._snapshot_reader cimport SnapshotReader

__all__ = ["Layer", "State", "Sources", "FrozenView", "Spill", "sources_of", "base_lookup", "base_sources",
           "take_rows", "join_rows", "put_rows_at", "no_values", "below_sources", "base_count", "bottom_snapshot",
           "snapshot_version", "filter_bytes", "spilled_base", "changed_since_bottom", "stands_on_frozen", "is_view_of",
           "frozen_below", "spill_chain", "replace_in_chain", "describe_base"]

CHUNK_ROWS = 1 << 16


def take_rows(rows, index):
    """``rows[index]`` for an (n, w) uint8 row array, as one memcpy per row (a void view)."""
    w = rows.shape[1]
    if w == 0:
        index = np.asarray(index)
        return no_values(int(index.sum()) if index.dtype == np.bool_ else index.size)
    items = rows.view(f"V{w}").ravel()
    index = np.asarray(index)
    taken = items[index] if index.dtype == np.bool_ else np.take(items, index)  # take: a tighter loop
    return taken.view(np.uint8).reshape(-1, w)


@cython.boundscheck(False)
@cython.wraparound(False)
def join_rows(key_rows, value_rows, index=None):
    """``(n, kw + vw)`` uint8 rows, each a key row followed by its value row, from two (m, kw)
    and (m, vw) uint8 row arrays: row i is row ``index[i]`` of both (an int64 index, each in
    ``[0, m)``), or row i with no index. One pass, without the GIL."""
    cdef const uint8_t[:, :] k = key_rows
    cdef const uint8_t[:, :] v = value_rows
    cdef Py_ssize_t m = k.shape[0], kw = k.shape[1], vw = v.shape[1], i, j
    if v.shape[0] != m:
        raise ValueError(f"{m} key rows and {v.shape[0]} value rows: a row is a key and its value")
    if (kw and k.strides[1] != 1) or (vw and v.strides[1] != 1):
        raise ValueError("row arrays must be contiguous within a row")
    cdef const int64_t[::1] at
    cdef Py_ssize_t n = m
    cdef bint gather = index is not None
    if gather:
        at = np.ascontiguousarray(index, dtype=np.int64)
        n = at.shape[0]
        for i in range(n):
            if not 0 <= at[i] < m:
                raise IndexError(f"row index {at[i]} is outside the {m} rows")
    out = np.empty((n, kw + vw), dtype=np.uint8)
    cdef uint8_t[:, ::1] o = out
    if n == 0 or kw + vw == 0:
        return out
    cdef Py_ssize_t ks = k.strides[0], vs = v.strides[0], w = kw + vw
    cdef const uint8_t* kp = &k[0, 0] if kw else NULL
    cdef const uint8_t* vp = &v[0, 0] if vw else NULL
    cdef uint8_t* op = &o[0, 0]
    with nogil:
        for i in range(n):
            j = at[i] if gather else i
            copy_field(op + i * w, kp + j * ks, kw)
            copy_field(op + i * w + kw, vp + j * vs, vw)
    return out


cdef inline void copy_field(uint8_t* dst, const uint8_t* src, Py_ssize_t n) noexcept nogil:
    """memcpy, inlined for the common widths of a key or value (a call per row otherwise)."""
    if n == 8:
        memcpy(dst, src, 8)
    elif n == 16:
        memcpy(dst, src, 16)
    elif n == 4:
        memcpy(dst, src, 4)
    elif n == 24:
        memcpy(dst, src, 24)
    elif n:
        memcpy(dst, src, n)


def put_rows_at(dst, index, src):
    """``dst[index] = src`` for (n, w) uint8 row arrays, one memcpy per row."""
    w = dst.shape[1]
    if w:
        dst.view(f"V{w}").ravel()[index] = src.view(f"V{w}").ravel()


def no_values(n):
    return np.empty((n, 0), dtype=np.uint8)


# -- the typed parts of a version ---------------------------------------------------------------
EMPTY = np.dtype([])
_MATERIALIZING = threading.Lock()


@cython.final
cdef class Layer:
    """Keys this layer decides: ``puts`` (key -> value) and ``dels`` (keys absent here).

    An undo layer is kept as the arrays the merge already had (keys, prior values, prior
    presence) and turned into tables only if an older version is ever read: most never are.
    """

    def __init__(self, key_schema, value_schema):
        self.key_schema = key_schema
        self.value_schema = value_schema

    @staticmethod
    def from_changes(key_schema, value_schema, keys, values, present):
        cdef Layer layer = Layer(key_schema, value_schema)
        layer._pending = (keys, values, present)
        return layer

    def changes(self):
        """``(keys, values, present)`` of an undo layer: what each key was before its merge."""
        if self._pending is not None:
            return self._pending
        put_keys, put_values = self.puts_table().export_rows()
        del_keys, _ = self.dels_table().export_rows()
        present = np.concatenate([np.ones(put_keys.shape[0], bool), np.zeros(del_keys.shape[0], bool)])
        return (np.concatenate([put_keys, del_keys]),
                np.concatenate([put_values, np.zeros((del_keys.shape[0], put_values.shape[1]), np.uint8)]),
                present)

    cdef int _materialize(self) except -1:
        # Readers of an old version may come from several threads: build the tables once, and
        # publish them only when they are complete.
        with _MATERIALIZING:
            if self._puts is not None:
                return 0
            puts = RowTable(self.key_schema, self.value_schema)
            dels = RowTable(self.key_schema, EMPTY)
            if self._pending is not None:
                keys, values, present = self._pending
                if present.any():
                    puts.put_rows(take_rows(keys, present), take_rows(values, present))
                if not present.all():
                    absent = take_rows(keys, ~present)
                    dels.put_rows(absent, no_values(absent.shape[0]))
            self._dels = dels
            self._puts = puts
            self._pending = None
        return 0

    cdef RowTable puts_table(self):
        if self._puts is None:
            self._materialize()
        return self._puts

    cdef RowTable dels_table(self):
        if self._puts is None:  # _puts is published last
            self._materialize()
        return self._dels

    @property
    def puts(self):
        return self.puts_table()

    @property
    def dels(self):
        return self.dels_table()

    cdef Py_ssize_t size(self) except -1:
        if self._pending is not None:
            return self._pending[0].shape[0]
        return (len(self._puts) if self._puts is not None else 0) + (len(self._dels) if self._dels is not None else 0)

    def __len__(self):
        return self.size()

    def sizeof(self):
        if self._pending is not None:
            return sum(a.nbytes for a in self._pending)
        return sum(t.sizeof() for t in (self._puts, self._dels) if t is not None)

    # The one place that keeps a key out of puts and dels at once.
    def put_rows(self, keys, values):
        """These keys now have these values (row arrays)."""
        self.puts_table().put_rows(keys, values)
        if len(self._dels):
            self._dels.remove_rows(keys)

    def delete_rows(self, keys, tombstone=True):
        """These keys are now absent. The tombstone hides them from whatever lies below the
        layer; where nothing does, it is left out."""
        if len(self.puts_table()):
            self._puts.remove_rows(keys)
        if tombstone and keys.shape[0]:
            self._dels.put_rows(keys, no_values(keys.shape[0]))

    def put_row(self, key, value):
        """One key (bytes) now has this value (bytes)."""
        self.puts_table().put_row(key, value)
        if len(self._dels):
            self._dels.remove_row(key)

    def delete_row(self, key):
        """One key (bytes) is now absent, hidden from the layers below."""
        if len(self.puts_table()):
            self._puts.remove_row(key)
        self._dels.put_row(key, b"")

    def copy(self):
        """An independent Layer with the same contents."""
        put_keys, put_values = self.puts_table().export_rows()
        del_keys, _ = self.dels_table().export_rows()
        cdef Layer other = Layer(self.key_schema, self.value_schema)
        other.puts_table().put_rows(put_keys, put_values)
        other.dels_table().put_rows(del_keys, no_values(del_keys.shape[0]))
        return other

    cpdef tuple probe(self, key_rows, values_out):
        """Look ``key_rows`` up: values into ``values_out`` (zeros where absent); returns
        ``(put_found, decided)`` bool arrays."""
        cdef RowTable puts = self.puts_table(), dels = self._dels
        n = key_rows.shape[0]
        put_found = np.zeros(n, dtype=np.uint8)
        if len(puts):
            puts.get_rows(key_rows, values_out, put_found)
        put_found = put_found.view(np.bool_)
        decided = put_found.copy()
        if len(dels):
            del_found = np.zeros(n, dtype=np.uint8)
            dels.get_rows(key_rows, no_values(n), del_found)
            decided |= del_found.view(np.bool_)
        return put_found, decided


@cython.final
cdef class Spill:
    """Version ``version`` (attempt ``commit_id``, ``num_keys`` keys) as ``puts`` and ``dels``
    (SnapshotReaders, each with the KeyFilter of its keys its writer filled, which lookups
    ask to skip the level) over ``lower`` (a SnapshotReader, a Spill over one, or None);
    ``dels`` is None when ``lower`` is. Written by statecore/spill.py. Only
    ``replace_in_chain`` changes it: ``lower``, for the same rows mapped."""

    def __init__(self, SnapshotReader puts not None, SnapshotReader dels, lower, int64_t version, bytes commit_id,
                 int64_t num_keys):
        if not (lower is None or _is_snapshot(lower) or type(lower) is Spill):
            raise TypeError(f"a Spill stands on a snapshot, a Spill or nothing, not {type(lower).__name__}")
        self.puts = puts
        self.dels = dels
        self.lower = lower
        self.version = version
        self.commit_id = commit_id
        self.num_keys = num_keys

    def __repr__(self):
        return (f"Spill(version={self.version}, keys={self.num_keys}, puts={self.puts.row_count}, "
                f"dels={self.dels.row_count if self.dels is not None else 0})")

    @property
    def own_changed(self):
        """Keys this level decides."""
        return self.puts.row_count + (self.dels.row_count if self.dels is not None else 0)

    @property
    def whole(self):
        """Whether this spill holds every row of its version (it stands on nothing): the
        bottom image of the levels above it, as a snapshot is."""
        return self.lower is None

    @property
    def changed(self):
        """Keys this spill and the levels below it decide over their bottom image (a snapshot,
        or a whole spill): the changes since it (a key changed in two levels counts twice);
        none for a whole spill itself."""
        return sum(level.own_changed for level in _over_images([], self).levels)

    @property
    def filter_bytes(self):
        """Heap bytes of the key filters of this level and the levels below it, the
        snapshot's included."""
        return filter_bytes(self)

    def lookup(self, key_rows):
        """``(value_rows, found)`` of ``key_rows`` at this spill's version."""
        return _over_images([], self).lookup(key_rows, self.puts.value_width)

    def rows(self, chunk_rows=CHUNK_ROWS):
        """Every row of the version, each key once (``Sources.rows``)."""
        return _over_images([], self).rows(chunk_rows)


@cython.final
cdef class FrozenView:
    """A frozen State seen at one of its versions: the base of a newer State."""

    def __init__(self, State state not None, int64_t version):
        if not state.frozen:
            raise ValueError("a FrozenView is of a frozen State")
        self.state = state
        self.version = version

    @property
    def num_keys(self):
        return self.state.count(self.version)

    def __repr__(self):
        return f"FrozenView(version={self.version})"


cdef inline bint _is_snapshot(base):
    """A mapped snapshot: a SnapshotReader, or a ConvertedImage (one of an older value schema)."""
    return type(base) is SnapshotReader or type(base) is ConvertedImage


cdef inline bint _is_base(base):
    return base is None or _is_snapshot(base) or type(base) is Spill or type(base) is FrozenView


@cython.final
cdef class State:
    """The versions one provider holds in memory for one lineage (see "The in-memory versions"
    in the module docstring).

    ``commit_ids[v]`` identifies version v (8 bytes; all zeros for version 0); ``num_keys[v]``
    is its key count; both, and ``undo``, cover exactly the versions held (read-only views:
    only the methods change them). ``changes``: the provider's change counter (one uint64
    array shared by its States; a new one if None). ``pins[v]``: how many open stores read
    version v (``pin``/``unpin``); ``retain`` keeps those versions. Every field is read-only
    from Python: a frozen State (``frozen``) refuses every change in ``_refuse_if_frozen``
    but a base swap (the same rows, mapped) and the bookkeeping of pins and iterations."""

    def __init__(self, key_schema, value_schema, base, int64_t version, commit_id, num_keys, changes=None):
        self.key_schema = key_schema
        self.value_schema = value_schema
        # One uint64: changes to what a lookup walks (see the module docstring); an array,
        # so that compiled readers compare it through a pointer.
        self.changes = np.zeros(1, dtype=np.uint64) if changes is None else changes
        self._counter = self.changes
        if self._counter.shape[0] != 1:
            raise ValueError(f"State.changes must hold one count, got {self._counter.shape[0]}")
        self._set_base(base)
        self.head = Layer(key_schema, value_schema)
        self.version = version
        self._undo = {}
        self._commit_ids = {version: commit_id}
        self._num_keys = {version: num_keys}
        self._pins = {}

    def __repr__(self):
        return f"State(version={self.version}, frozen={self.frozen}, head={self.head.size()})"

    @property
    def base(self):
        """A SnapshotReader, a Spill, a FrozenView, or None."""
        return self._base

    @base.setter
    def base(self, base):
        self._set_base(base)

    @property
    def undo(self):
        return MappingProxyType(self._undo)

    @property
    def commit_ids(self):
        return MappingProxyType(self._commit_ids)

    @property
    def num_keys(self):
        return MappingProxyType(self._num_keys)

    @property
    def pins(self):
        return MappingProxyType(self._pins)

    cdef int _set_base(self, base) except -1:
        if not _is_base(base):
            raise TypeError(f"a State stands on a snapshot, a Spill, a FrozenView or nothing, "
                            f"not {type(base).__name__}")
        self._count_base_change()
        self._base = base
        return 0

    cdef int _count_base_change(self) except -1:
        """Count a change to what lies under this State (its base, or a spill's ``lower``
        under it), the one change a frozen State may see. REQUIRES: the owner's lock held (or
        nobody reads this State yet); called before the change."""
        self._counter[0] += 1
        return 0

    cdef int _changed(self) except -1:
        """Count a change to this State's versions or layers. REQUIRES: as _count_base_change."""
        self._refuse_if_frozen()
        self._counter[0] += 1
        return 0

    cdef int _refuse_if_frozen(self) except -1:
        """The one place that refuses a change to a frozen State."""
        if self.frozen:
            # Someone may be reading this state without a lock (a snapshot being written, a
            # newer state built over it): changing it now would be a bug, never a wrong value.
            raise AssertionError("statecore bug: a change to a frozen in-memory state")
        return 0

    def holds(self, version):
        return version in self._commit_ids and version != self.pending

    def layers_for(self, int64_t version):
        """The layers that decide keys at ``version``, oldest undo first, the head last.
        REQUIRES: self.holds(version)."""
        return [self._undo[u] for u in range(version + 1, self.version + 1)] + [self.head]

    # -- bookkeeping a frozen State may see too ------------------------------------------------
    def pin(self, version):
        """An open store reads ``version``: ``retain`` keeps it. REQUIRES: the owner's lock held."""
        self._pins[version] = self._pins.get(version, 0) + 1

    def unpin(self, version):
        """A store that read ``version`` closed. REQUIRES: the owner's lock held."""
        left = self._pins.get(version, 0) - 1
        if left > 0:
            self._pins[version] = left
        else:
            self._pins.pop(version, None)

    def pinned(self):
        """The versions open stores read, oldest first."""
        return sorted(self._pins)

    def iteration_opened(self):
        """An iteration copies rows out of this State without the lock: while any is open,
        nothing merges into it. REQUIRES: the owner's lock held."""
        self.iterating += 1

    def iteration_closed(self):
        """REQUIRES: the owner's lock held."""
        if self.iterating <= 0:
            raise AssertionError("statecore bug: an iteration closed that was never opened")
        self.iterating -= 1

    def published(self):
        """The pending version's delta is durable: readers may open it. REQUIRES: the owner's lock held."""
        self.pending = None

    def spill_asked(self, version):
        """The commit of ``version`` asked for the head to be spilled; the first one asking is
        kept. REQUIRES: the owner's lock held."""
        self._refuse_if_frozen()
        if self.spill_asked_at is None:
            self.spill_asked_at = version

    # -- lookups --------------------------------------------------------------------------
    def sources(self, int64_t version):
        """The flattened sources of ``version`` (a :class:`Sources`)."""
        return state_sources(self, version)

    def lookup(self, int64_t version, key_rows, extra_layers=()):
        """``(value_rows, found)`` of ``key_rows`` at ``version`` (under ``extra_layers``)."""
        return state_sources(self, version).lookup(key_rows, self.value_schema.width, extra_layers)

    def iter_rows(self, int64_t version, extra_layers=(), chunk_rows=CHUNK_ROWS):
        """Yield ``(n, row_width)`` uint8 chunks of every row at ``version`` (under
        ``extra_layers``), each key once."""
        return state_sources(self, version).rows(chunk_rows, extra_layers)

    # -- changes --------------------------------------------------------------------------
    def count(self, int64_t version):
        """Keys at ``version``; counted from the head and the base when not known yet (after a
        load from files), which costs one base lookup per key changed since the base."""
        n = self._num_keys[version]
        if n is None:
            # REQUIRES: version == self.version (older versions get their count at merge time)
            put_keys, _ = self.head.puts_table().export_rows()
            del_keys, _ = self.head.dels_table().export_rows()
            if self._base is None:
                n = put_keys.shape[0]
            else:
                n = (base_count(self._base) + int((~base_lookup(self, put_keys)[1]).sum())
                     - int(base_lookup(self, del_keys)[1].sum()))
            self._num_keys[version] = n
        return n

    def replay(self, kind_is_put, keys, values):
        """Apply one block of a delta to the head (loading from files: no undo, no lookups;
        the key count becomes unknown until asked for)."""
        if keys.shape[0] == 0:
            self._refuse_if_frozen()
            return
        self._changed()
        self._num_keys[self.version] = None
        if kind_is_put:
            self.head.put_rows(keys, values)
        else:
            self.head.delete_rows(keys, tombstone=self._base is not None)

    def advance(self, int64_t version, commit_id, num_keys=None):
        """Make the head (just replayed) the given version, of ``num_keys`` keys if known."""
        self._changed()
        n = self._num_keys.pop(self.version)
        self._commit_ids.pop(self.version)
        self.version = version
        self._commit_ids[version] = commit_id
        self._num_keys[version] = n if num_keys is None else num_keys

    def merge(self, put_keys, put_values, del_keys, commit_id, pending=False, del_prior=None, put_prior=None,
              Layer update=None):
        """Apply a store's updates (its layer's rows) as version ``self.version + 1``, keeping
        their undo: the prior value or absence of every key they change. ``del_prior``: the
        values ``del_keys`` have now, if the caller looked them up (all of them present);
        ``put_prior``: ``(values, found)`` of ``put_keys`` now, likewise. Given both, the
        merge looks nothing up: no damaged base can stop it half way.

        ``update``: the store's update Layer those rows came from, which no one writes to
        again. Over an empty head, an update that only puts becomes the head itself (its
        table is already the head's contents: no second insert of every key)."""
        self._changed()
        before = self.count(self.version)
        # Every lookup that can fail (a damaged snapshot block) comes before the head changes,
        # or is undone: readers of this state's versions never see half a merge.
        if del_prior is None:
            prior_del, prior_del_found = self.lookup(self.version, del_keys)
        else:
            prior_del, prior_del_found = del_prior, np.ones(del_keys.shape[0], dtype=np.bool_)
        adopted = (update is not None and not self.head.size() and not len(update.dels_table())
                   and len(update.puts_table()) == put_keys.shape[0])
        if adopted:
            prior_put, prior_put_found = self._base_prior(put_keys) if put_prior is None else put_prior
            self.head = update
        elif put_prior is None:
            prior_put, prior_put_found = self._put_and_get_prior(put_keys, put_values)
        else:
            prior_put, prior_put_found = put_prior
            self.head.put_rows(put_keys, put_values)
        if del_keys.shape[0]:
            self.head.delete_rows(del_keys, tombstone=self._base is not None)
        self.version += 1
        self._undo[self.version] = Layer.from_changes(
            self.key_schema, self.value_schema, _cat(put_keys, del_keys), _cat(prior_put, prior_del),
            _cat(prior_put_found, prior_del_found))
        self._commit_ids[self.version] = commit_id
        self._num_keys[self.version] = (before + int((~prior_put_found).sum()) - int(prior_del_found.sum()))
        self.adopted_head = self.version if adopted else None
        if pending:
            self.pending = self.version

    def rollback(self):
        """Undo the newest merge (its delta could not be written): the head returns to the
        previous version, exactly, from the undo layer (or, when the merge made the store's
        update layer the head, to the empty head it replaced, leaving that layer as it was)."""
        self._changed()
        undo = self._undo.pop(self.version)
        if self.adopted_head == self.version:
            self.head = Layer(self.key_schema, self.value_schema)
        else:
            keys, prior_values, prior_found = undo.changes()
            if prior_found.any():
                self.head.put_rows(take_rows(keys, prior_found), take_rows(prior_values, prior_found))
            if not prior_found.all():
                self.head.delete_rows(take_rows(keys, ~prior_found), tombstone=self._base is not None)
        self.adopted_head = None
        del self._commit_ids[self.version]
        del self._num_keys[self.version]
        self.version -= 1
        self.pending = None

    def _base_prior(self, keys):
        """Each key's value and presence in the base alone (the head holds none of them)."""
        if self._base is None or keys.shape[0] == 0:
            return (np.zeros((keys.shape[0], self.value_schema.width), dtype=np.uint8),
                    np.zeros(keys.shape[0], dtype=np.bool_))
        return base_lookup(self, keys)

    def _put_and_get_prior(self, keys, values):
        """Write puts into the head; return each key's value and presence before the write.
        If the base lookup raises, the head is put back as it was before the raise."""
        cdef RowTable head_puts = self.head.puts_table(), head_dels = self.head.dels_table()
        n = keys.shape[0]
        prior = np.empty((n, self.value_schema.width), dtype=np.uint8)
        in_head = np.empty(n, dtype=np.uint8)
        head_puts.exchange_rows(keys, values, prior, in_head)  # one probe: old value out, new in
        found = in_head.view(np.bool_).copy()
        rest = np.flatnonzero(~found)
        if rest.size == 0:
            return prior, found
        rest_keys = all_rest_keys = take_rows(keys, rest)
        if len(head_dels):
            tombstoned = np.zeros(rest.size, dtype=np.uint8)
            head_dels.get_rows(rest_keys, no_values(rest.size), tombstoned)
            keep = ~tombstoned.view(np.bool_)
            rest, rest_keys = rest[keep], take_rows(rest_keys, keep)
        if self._base is not None and rest.size:
            try:
                base_values, base_found = base_lookup(self, rest_keys)
            except BaseException:
                head_puts.put_rows(take_rows(keys, found), take_rows(prior, found))
                head_puts.remove_rows(all_rest_keys)
                raise
            put_rows_at(prior, rest, base_values)
            found[rest] = base_found
        if len(head_dels):
            head_dels.remove_rows(all_rest_keys)
        return prior, found

    def retain(self, keep_from):
        """Forget versions older than ``keep_from`` (and the undo layers only they need), but
        for pinned ones (and what they need)."""
        if self._pins:
            keep_from = min(keep_from, min(self._pins))
        self._changed()
        for v in [v for v in self._commit_ids if v < keep_from]:
            del self._commit_ids[v]
            del self._num_keys[v]
        for u in [u for u in self._undo if u <= keep_from]:
            del self._undo[u]

    def freeze_into_successor(self, int64_t version, keep_versions):
        """Freeze this State and return a new one over it at ``version`` (a FrozenView of this
        one, sharing its change counter), where commits go on while the frozen one is read
        without the lock. ``keep_versions`` (``version`` is the newest here): the new State
        holds every version this one does, through the same undo layers. REQUIRES: the
        owner's lock held."""
        self.frozen = True
        cdef State successor = State(self.key_schema, self.value_schema, FrozenView(self, version), version,
                                     self._commit_ids[version], self.count(version), changes=self.changes)
        if keep_versions:
            successor._undo = dict(self._undo)
            successor._commit_ids = dict(self._commit_ids)
            successor._num_keys = dict(self._num_keys)
        return successor

    def describe(self):
        """What this State holds, as a dict (for tests and debugging; LevelDB's DebugString):
        its version, the versions held and pinned, whether it is frozen, pending or iterated,
        the rows of its head and undo layers, and its base (down any frozen States)."""
        return {
            "version": self.version,
            "versions": sorted(self._commit_ids),
            "pins": dict(sorted(self._pins.items())),
            "frozen": self.frozen,
            "pending": self.pending,
            "iterating": self.iterating,
            "head_rows": self.head.size(),
            "undo_layers": {u: len(layer) for u, layer in sorted(self._undo.items())},
            "base": describe_base(self._base),
            "snapshot_version": snapshot_version(self._base),
        }


def base_lookup(State state, key_rows):
    """``(value_rows, found)`` of ``key_rows`` in what ``state``'s head stands on: its base
    alone (the prior values a merge needs of keys the head does not hold). States call it by
    its module name, so that a test may count these lookups by replacing it."""
    return below_sources(state).lookup(key_rows, state.value_schema.width)


cdef _cat(a, b):
    return a if b.shape[0] == 0 else np.concatenate([a, b])


@cython.final
cdef class Sources:
    """The sources of one version, flattened, newest first (see the module docstring):
    ``layers`` (non-empty Layers), ``levels`` (Spills standing on something), ``bottom``
    (a SnapshotReader, or None). Built under the provider's lock; immutable after."""

    def __init__(self, layers, levels, bottom):
        self.layers = tuple(layers)
        self.levels = tuple(levels)
        self.bottom = bottom
        if type(bottom) is ConvertedImage:
            self.bottom_converted = bottom
        elif bottom is not None:
            self.bottom_image = <SnapshotReader?>bottom
        self.tables = []
        for layer in self.layers:  # an undo layer kept as arrays gets its tables here, once
            self.tables.append((<Layer?>layer).puts_table())
            self.tables.append((<Layer>layer).dels_table())
        self.images = []
        for level in self.levels:
            self.images.append((<Spill?>level).puts)
            self.images.append((<Spill>level).dels)

    def __repr__(self):
        return f"Sources(tables={len(self.layers)}, levels={len(self.levels)}, bottom={self.bottom is not None})"

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int find(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """The per-row rule: 1 (the value copied to ``value_out``) if the first source that
        decides the key puts it, 0 if it removes it or no source decides it. REQUIRES: the
        provider's lock held, or every State read frozen."""
        cdef uint32_t tag = slot_tag(h)
        cdef Py_ssize_t i, n = len(self.tables)
        cdef RowTable puts
        cdef list tables = self.tables
        for i in range(0, n, 2):
            puts = <RowTable>tables[i]
            if table_find_value(puts, key, tag, value_out if puts.value_width else NULL):
                return 1
            if table_find_value(<RowTable>tables[i + 1], key, tag, NULL):
                return 0
        return self.find_in_images(key, h, value_out)

    cdef int find_in_images(self, const uint8_t* key, uint64_t h, uint8_t* value_out) except -1:
        """``find`` below the tables: the levels' images, then the bottom image."""
        cdef Py_ssize_t i
        cdef list images = self.images
        for i in range(0, len(images), 2):
            if (<SnapshotReader>images[i]).find_into(key, h, value_out):
                return 1
            dels = images[i + 1]
            if dels is not None and (<SnapshotReader>dels).find_into(key, h, NULL):
                return 0
        if self.bottom_image is not None:
            return self.bottom_image.find_into(key, h, value_out)
        if self.bottom_converted is not None:
            return self.bottom_converted.find_into(key, h, value_out)
        return 0

    def lookup(self, key_rows, Py_ssize_t vw, extra_layers=()):
        """``(value_rows, found)`` of ``key_rows`` (values ``vw`` bytes wide) under
        ``extra_layers`` (a store's update layer, newer than every source): the batch rule.
        Each table is probed with the keys no newer one decided; the rest go through the
        images in one walk."""
        n = key_rows.shape[0]
        values = found = None  # made by the first table that holds anything
        pending = None  # indices still undecided; None: all of them (no gather needed)
        cdef Layer layer
        for layer in (*extra_layers, *self.layers):
            if not layer.size():
                continue
            if values is None:
                values = np.zeros((n, vw), dtype=np.uint8)
                put_found, decided = layer.probe(key_rows, values)  # nothing found yet: write in place
                found = put_found.copy()
                pending = np.flatnonzero(~decided)
                continue
            if pending.size == 0:
                break
            sub_values = np.empty((pending.size, vw), dtype=np.uint8)
            put_found, decided = layer.probe(take_rows(key_rows, pending), sub_values)
            hit = pending[put_found]
            put_rows_at(values, hit, take_rows(sub_values, put_found))
            found[hit] = True
            pending = pending[~decided]
        has_images = bool(self.levels) or self.bottom is not None
        if values is None:  # no table holds anything: the images decide every key
            if has_images:
                return self._image_lookup(key_rows, vw)
            return np.zeros((n, vw), dtype=np.uint8), np.zeros(n, dtype=np.bool_)
        if has_images and pending.size:
            image_values, image_found = self._image_lookup(take_rows(key_rows, pending), vw)
            put_rows_at(values, pending, image_values)
            found[pending] = image_found
        return values, found

    def _image_lookup(self, key_rows, Py_ssize_t vw):
        n = key_rows.shape[0]
        values = np.empty((n, vw), dtype=np.uint8)  # every row written: zeros where not found
        found = np.empty(n, dtype=np.uint8)
        if not self.levels:
            self.bottom.get_rows(key_rows, values, found)
        elif self.bottom_converted is None:
            images_lookup(self.images, self.bottom_image, key_rows, values, found)
        else:  # levels over a converted snapshot (until maintenance snapshots the change): the per-row rule
            self._each_in_images(key_rows, values, found)
        return values, found.view(np.bool_)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _each_in_images(self, const uint8_t[:, ::1] key_rows, uint8_t[:, ::1] values, uint8_t[::1] found):
        cdef Py_ssize_t i, n = key_rows.shape[0], kw = key_rows.shape[1], vw = values.shape[1]
        for i in range(n):
            found[i] = self.find_in_images(&key_rows[i, 0], key_hash(&key_rows[i, 0], <size_t>kw),
                                           &values[i, 0] if vw else NULL)
            if not found[i] and vw:
                values[i, :] = 0

    def rows(self, chunk_rows=CHUNK_ROWS, extra_layers=()):
        """Yield ``(n, row_width)`` uint8 chunks of every row, each key once: each table's
        puts that no newer table decides, then each level's puts that no newer level decides,
        then the bottom's rows that no level decides, the image rows less those any table
        decides. An image's rows a newer image overrides are found by probing the newer keys
        in it (a mask of its rows), never the other way round."""
        layers = [layer for layer in (*extra_layers, *self.layers) if (<Layer?>layer).size()]
        kw = None
        for i, layer in enumerate(layers):
            kw = layer.key_schema.width
            cursor = layer.puts.cursor()
            while (chunk := cursor.next_rows(chunk_rows)) is not None:
                keep = ~_decided_by(layers[:i], np.ascontiguousarray(chunk[:, :kw]))
                if keep.any():
                    yield chunk[keep]
        for chunk in self._image_rows(chunk_rows):
            if not layers:
                yield chunk
                continue
            keep = ~_decided_by(layers, np.ascontiguousarray(chunk[:, :kw]))
            if keep.any():
                yield chunk[keep]

    def _image_rows(self, chunk_rows):
        newer = []
        for level in self.levels:
            yield from unshadowed(level.puts, newer, chunk_rows)[1]
            newer += [image for image in (level.puts, level.dels) if image is not None]
        if self.bottom is not None and self.bottom.row_count:
            yield from unshadowed(self.bottom, newer, chunk_rows)[1]


def _decided_by(layers, key_rows):
    n = key_rows.shape[0]
    decided = np.zeros(n, dtype=np.bool_)
    cdef Layer layer
    for layer in layers:
        scratch = np.empty((n, layer.puts.value_width), dtype=np.uint8)
        decided |= layer.probe(key_rows, scratch)[1]
    return decided


def unshadowed(image, newer, chunk_rows):
    """``(count, chunks)`` of the rows of ``image`` (a SnapshotReader) whose keys none of the
    ``newer`` sources (RowTables or SnapshotReaders) holds: found by probing the newer keys
    in ``image`` (those its key filter, if any, may hold), a mask of its rows."""
    kw = image.key_width
    image_filter = image.key_filter
    mask = np.zeros(image.row_count, dtype=np.uint8)
    for source in newer:
        for chunk in cursor_chunks(source, chunk_rows):
            keys = image_filter.keys_it_may_hold(chunk) if image_filter is not None else chunk[:, :kw]
            image.mark_rows(np.ascontiguousarray(keys), mask)
    return image.row_count - int(np.count_nonzero(mask)), cursor_chunks(image, chunk_rows, skip=mask)


def cursor_chunks(source, chunk_rows, skip=None):
    """The non-empty row chunks of ``source``'s cursor (less the rows ``skip`` marks)."""
    cursor = source.cursor()
    kwargs = {} if skip is None else {"skip": skip}
    while (chunk := cursor.next_rows(chunk_rows, **kwargs)) is not None:
        if chunk.shape[0]:
            yield chunk


# -- flattening: the one place that tells the kinds of base apart ---------------------------------
cdef Sources state_sources(State state, int64_t version):
    """The :class:`Sources` of ``version`` of ``state`` (a State holding it): its layers at
    that version (the undo layers of the newer versions, oldest first, then the head), then,
    down every FrozenView base, the frozen State's at its version, then the images under the
    last base. REQUIRES: the provider's lock held (or every State read frozen)."""
    cdef list layers = []
    cdef Layer layer
    cdef int64_t u
    while True:
        for u in range(version + 1, state.version + 1):
            layer = state._undo[u]
            if layer.size():
                layers.append(layer)
        if state.head.size():
            layers.append(state.head)
        base = state._base
        if type(base) is not FrozenView:
            break
        state, version = (<FrozenView>base).state, (<FrozenView>base).version
    return _over_images(layers, base)


def sources_of(State state not None, int64_t version):
    """``state_sources`` for Python callers."""
    return state_sources(state, version)


def base_sources(base):
    """The :class:`Sources` of a base that is no FrozenView (a SnapshotReader, a Spill, or
    None): its images alone."""
    return _over_images([], base)


cdef Sources _over_images(list layers, base):
    cdef list levels = []
    while type(base) is Spill:
        levels.append(base)
        base = (<Spill>base).lower
    if levels and (<Spill>levels[-1]).lower is None:  # a whole spill: its puts are every row of its version
        base = (<Spill>levels.pop()).puts
    return Sources(layers, levels, base)


def spill_chain(base):
    """``(spills, below)``: the Spills from ``base`` down (newest first; a whole one last, if
    any), and what the last stands on (a SnapshotReader, or None)."""
    levels = []
    node = base
    while type(node) is Spill:
        levels.append(node)
        node = (<Spill>node).lower
    return levels, node


def base_count(base):
    """Keys in the version ``base`` holds (0: no base)."""
    if base is None:
        return 0
    if _is_snapshot(base):
        return base.row_count
    if type(base) is Spill:
        return (<Spill>base).num_keys
    return (<FrozenView?>base).num_keys


def bottom_snapshot(base):
    """The mapped snapshot at the bottom of ``base`` (a SnapshotReader, or a Spill over
    one), or None (nothing under the levels, or another kind of base)."""
    node = spill_chain(base)[1]
    return node if _is_snapshot(node) else None


def snapshot_version(base):
    """The version of the snapshot a State's base stands on, down any frozen States (0: none)."""
    while type(base) is FrozenView:
        base = (<FrozenView>base).state._base
    node = spill_chain(base)[1]
    return node.store_version if _is_snapshot(node) else 0


def filter_bytes(base):
    """Heap bytes of the key filters of ``base`` (a SnapshotReader, a Spill and the levels
    under it, or anything else: 0)."""
    if type(base) is Spill:
        return filter_bytes((<Spill>base).puts) + filter_bytes((<Spill>base).dels) + filter_bytes((<Spill>base).lower)
    if _is_snapshot(base):
        keys = base.key_filter
        return keys.nbytes if keys is not None else 0
    return 0


def spilled_base(base):
    """``base`` if it is a Spill, else None."""
    return base if type(base) is Spill else None


def changed_since_bottom(base):
    """Keys the spilled levels of ``base`` decide over their bottom image (0: no levels)."""
    return base.changed if type(base) is Spill else 0


def stands_on_frozen(base):
    """Whether ``base`` is a frozen State (a FrozenView)."""
    return type(base) is FrozenView


def is_view_of(base, state, version):
    """Whether ``base`` is ``state`` seen at ``version``."""
    return type(base) is FrozenView and (<FrozenView>base).state is state and (<FrozenView>base).version == version


def frozen_below(State state not None):
    """The frozen State ``state`` stands on (through a FrozenView), or None."""
    base = state._base
    return (<FrozenView>base).state if type(base) is FrozenView else None


def replace_in_chain(State state not None, is_old, new):
    """Make ``new`` the base of the State (``state`` first, then down the chain of frozen
    ones) whose base ``is_old``, or the ``lower`` of the level of its spills that stands on
    it: the same version, now mapped. Either change is counted in the States' change counter
    first. Whether one was found. REQUIRES: the provider's lock held."""
    cdef State node = state
    cdef Spill level
    if not (new is None or type(new) is SnapshotReader or type(new) is Spill):
        raise TypeError(f"a base is replaced by a SnapshotReader, a Spill or nothing, not {type(new).__name__}")
    while True:
        base = node._base
        if is_old(base):
            node._set_base(new)
            return True
        while type(base) is Spill:  # the levels of spills, newest first
            level = <Spill>base
            if is_old(level.lower):
                node._count_base_change()
                level.lower = new
                return True
            base = level.lower
        if type(node._base) is not FrozenView:
            return False
        node = (<FrozenView>node._base).state


def describe_base(base):
    """What ``base`` is, as a dict (for ``State.describe``)."""
    if base is None:
        return {"kind": "none"}
    if _is_snapshot(base):
        described = {"kind": "snapshot", "version": base.store_version, "rows": base.row_count,
                     "filter": base.key_filter is not None}
        if type(base) is ConvertedImage:  # read in the State's schemas, converted as it is read
            described["converted_from"] = (<ConvertedImage>base).image.value_schema.describe()
            if (<ConvertedImage>base).keys is not None:
                described["keys_converted_from"] = (<ConvertedImage>base).image.key_schema.describe()
        return described
    if type(base) is FrozenView:
        return {"kind": "frozen", "version": (<FrozenView>base).version,
                "state": (<FrozenView>base).state.describe()}
    levels, below = spill_chain(base)
    return {"kind": "spill", "version": base.version,
            "levels": [{"version": s.version, "puts": s.puts.row_count,
                        "dels": s.dels.row_count if s.dels is not None else 0, "whole": s.whole}
                       for s in levels],
            "below": describe_base(below)}


def below_sources(State state not None):
    """The :class:`Sources` of what ``state``'s head stands on: its base alone (a frozen
    State's at its version, down the chain, or the images). REQUIRES: as state_sources."""
    base = state._base
    if type(base) is FrozenView:
        return state_sources((<FrozenView>base).state, (<FrozenView>base).version)
    return _over_images([], base)
