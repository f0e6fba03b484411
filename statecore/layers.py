"""The in-memory versions of one store: layers of changes over a mapped snapshot.

A version is never copied. The newest version a provider holds is a :class:`State`: a
*base* (a mapped :class:`~statecore.SnapshotReader`, a :class:`~statecore.spill.Spill` of
changes mapped over one, another state frozen at a version, or nothing) under a *head*
layer holding every change since that base. Each commit merges its updates into the head
in place and keeps an *undo* layer (the previous value, or absence, of every key it
changed), so the versions just before the newest stay readable while they are retained or
pinned by an open store. A :class:`Layer` is a RowTable of puts and a RowTable set of
deletions; the first layer that holds a key decides its value.

Lookups go, for version ``v``: undo layers ``v+1 .. newest`` (oldest first: the undo of
``v+1`` holds the value at ``v``), the head, then the base. Everything is batch-shaped
(numpy row arrays in, row arrays out); nothing loops in Python per row.

Thread-safety: a State's owner (the provider) serializes merges and base swaps with its
lock; lookups read a consistent state as long as they hold the same lock or the state is
frozen. A frozen State never changes again (but for its base: a swap maps the same rows).

What a lookup walks (the version, the undo layers, the base, and which layers hold
anything) changes only through State's methods and its ``base`` setter (and the provider's
set-up of a new State before anyone reads it), and each of them counts the change in
``State.changes`` before it changes anything: a compiled reader (RowCalls) keeps the walk
of its version and takes it again when that count moved.
"""
import threading

import numpy as np

from statecore._rowtable import RowTable
from statecore._snapshot import SnapshotReader

__all__ = ["Layer", "State", "FrozenView", "take_rows", "no_values"]

EMPTY = np.dtype([])
_MATERIALIZING = threading.Lock()


def take_rows(rows, index):
    """``rows[index]`` for an (n, w) uint8 row array, as one memcpy per row (a void view)."""
    w = rows.shape[1]
    if w == 0:
        index = np.asarray(index)
        return no_values(int(index.sum()) if index.dtype == np.bool_ else index.size)
    return rows.view(f"V{w}").ravel()[index].view(np.uint8).reshape(-1, w)


def put_rows_at(dst, index, src):
    """``dst[index] = src`` for (n, w) uint8 row arrays, one memcpy per row."""
    w = dst.shape[1]
    if w:
        dst.view(f"V{w}").ravel()[index] = src.view(f"V{w}").ravel()


def no_values(n):
    return np.empty((n, 0), dtype=np.uint8)


class Layer:
    """Keys this layer decides: ``puts`` (key -> value) and ``dels`` (keys absent here).

    An undo layer is kept as the arrays the merge already had (keys, prior values, prior
    presence) and turned into tables only if an older version is ever read: most never are.
    """

    __slots__ = ("key_schema", "value_schema", "_puts", "_dels", "_pending")

    def __init__(self, key_schema, value_schema):
        self.key_schema = key_schema
        self.value_schema = value_schema
        self._puts = self._dels = None
        self._pending = None

    @classmethod
    def from_changes(cls, key_schema, value_schema, keys, values, present):
        layer = cls(key_schema, value_schema)
        layer._pending = (keys, values, present)
        return layer

    def changes(self):
        """``(keys, values, present)`` of an undo layer: what each key was before its merge."""
        if self._pending is not None:
            return self._pending
        put_keys, put_values = self.puts.export_rows()
        del_keys, _ = self.dels.export_rows()
        present = np.concatenate([np.ones(put_keys.shape[0], bool), np.zeros(del_keys.shape[0], bool)])
        return (np.concatenate([put_keys, del_keys]),
                np.concatenate([put_values, np.zeros((del_keys.shape[0], put_values.shape[1]), np.uint8)]),
                present)

    def _materialize(self):
        # Readers of an old version may come from several threads: build the tables once, and
        # publish them only when they are complete.
        with _MATERIALIZING:
            if self._puts is not None:
                return
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

    @property
    def puts(self):
        if self._puts is None:
            self._materialize()
        return self._puts

    @property
    def dels(self):
        if self._puts is None:  # _puts is published last
            self._materialize()
        return self._dels

    def __len__(self):
        if self._pending is not None:
            return self._pending[0].shape[0]
        return (len(self._puts) if self._puts is not None else 0) + (len(self._dels) if self._dels is not None else 0)

    def sizeof(self):
        if self._pending is not None:
            return sum(a.nbytes for a in self._pending)
        return sum(t.sizeof() for t in (self._puts, self._dels) if t is not None)

    # The one place that keeps a key out of puts and dels at once.
    def put_rows(self, keys, values):
        """These keys now have these values (row arrays)."""
        self.puts.put_rows(keys, values)
        if len(self.dels):
            self.dels.remove_rows(keys)

    def delete_rows(self, keys, tombstone=True):
        """These keys are now absent. The tombstone hides them from whatever lies below the
        layer; where nothing does, it is left out."""
        if len(self.puts):
            self.puts.remove_rows(keys)
        if tombstone and keys.shape[0]:
            self.dels.put_rows(keys, no_values(keys.shape[0]))

    def put_row(self, key, value):
        """One key (bytes) now has this value (bytes)."""
        self.puts.put_row(key, value)
        if len(self.dels):
            self.dels.remove_row(key)

    def delete_row(self, key):
        """One key (bytes) is now absent, hidden from the layers below."""
        if len(self.puts):
            self.puts.remove_row(key)
        self.dels.put_row(key, b"")

    def copy(self):
        """An independent Layer with the same contents."""
        put_keys, put_values = self.puts.export_rows()
        del_keys, _ = self.dels.export_rows()
        other = Layer(self.key_schema, self.value_schema)
        other.puts.put_rows(put_keys, put_values)
        other.dels.put_rows(del_keys, no_values(del_keys.shape[0]))
        return other

    def probe(self, key_rows, values_out):
        """Look ``key_rows`` up: values into ``values_out`` (zeros where absent); returns
        ``(put_found, decided)`` bool arrays."""
        n = key_rows.shape[0]
        put_found = np.zeros(n, dtype=np.uint8)
        if len(self.puts):
            self.puts.get_rows(key_rows, values_out, put_found)
        put_found = put_found.view(np.bool_)
        decided = put_found.copy()
        if len(self.dels):
            del_found = np.zeros(n, dtype=np.uint8)
            self.dels.get_rows(key_rows, no_values(n), del_found)
            decided |= del_found.view(np.bool_)
        return put_found, decided


class FrozenView:
    """A frozen State seen at one of its versions: the base of a newer State."""

    __slots__ = ("state", "version")

    def __init__(self, state, version):
        self.state = state
        self.version = version

    @property
    def num_keys(self):
        return self.state.count(self.version)


class State:
    """The versions one provider holds in memory for one lineage (see the module docstring).

    ``commit_ids[v]`` identifies version v (8 bytes; all zeros for version 0); ``num_keys[v]``
    is its key count; both, and ``undo``, cover exactly the versions held.
    """

    def __init__(self, key_schema, value_schema, base, version, commit_id, num_keys):
        self.key_schema = key_schema
        self.value_schema = value_schema
        # One uint64: changes to what a lookup walks (see the module docstring); an array,
        # so that compiled readers compare it through a pointer.
        self.changes = np.zeros(1, dtype=np.uint64)
        self.base = base
        self.head = Layer(key_schema, value_schema)
        self.version = version
        self.undo = {}
        self.commit_ids = {version: commit_id}
        self.num_keys = {version: num_keys}
        self.frozen = False
        self.merges = 0
        self.pending = None  # a merged version whose delta is not durable yet
        self.iterating = 0  # open iterations: while any, nothing merges into this state
        self.spill_asked_at = None  # the version whose commit first asked for the head to be spilled
        self.adopted_head = None  # the version whose merge made its store's update layer the head

    @property
    def base(self):
        """A SnapshotReader, a Spill, a FrozenView, or None."""
        return self._base

    @base.setter
    def base(self, base):
        self._changed()
        self._base = base

    def _changed(self):
        """Count a change to what lookups walk. REQUIRES: the owner's lock held (or nobody
        reads this State yet); called before the change."""
        self.changes[0] += 1

    def holds(self, version):
        return version in self.commit_ids and version != self.pending

    def layers_for(self, version):
        # REQUIRES: self.holds(version)
        return [self.undo[u] for u in range(version + 1, self.version + 1)] + [self.head]

    # -- lookups --------------------------------------------------------------------------
    def get_row(self, version, key, extra_layers=()):
        """Value bytes of one key (bytes) at ``version``, or None: the per-row path, without
        the batch machinery."""
        for layer in (*extra_layers, *self.layers_for(version)):
            if not len(layer):
                continue
            value = layer.puts.get_row(key)
            if value is not None:
                return value
            if len(layer.dels) and layer.dels.get_row(key) is not None:
                return None
        base = self.base
        if base is None:
            return None
        if isinstance(base, FrozenView):
            return base.state.get_row(base.version, key)
        return base.get_row(key)  # a SnapshotReader or a Spill

    def lookup(self, version, key_rows, extra_layers=()):
        """``(value_rows, found)`` of ``key_rows`` at ``version`` (under ``extra_layers``)."""
        n = key_rows.shape[0]
        vw = self.value_schema.width
        values = np.zeros((n, vw), dtype=np.uint8)
        found = np.zeros(n, dtype=np.bool_)
        pending = None  # indices still undecided; None: all of them (no gather needed)
        for layer in (*extra_layers, *self.layers_for(version)):
            if not len(layer):
                continue
            if pending is None:
                put_found, decided = layer.probe(key_rows, values)  # nothing found yet: write in place
                found |= put_found
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
        if self.base is not None and (pending is None or pending.size):
            sub = key_rows if pending is None else take_rows(key_rows, pending)
            base_values, base_found = base_lookup(self.base, sub)
            if pending is None:
                return base_values, base_found
            put_rows_at(values, pending, base_values)
            found[pending] = base_found
        return values, found

    def iter_rows(self, version, extra_layers=(), chunk_rows=1 << 16):
        """Yield ``(n, row_width)`` uint8 chunks of every row at ``version`` (under
        ``extra_layers``), each key once: each layer's puts that no earlier layer decides,
        then the base's rows that no layer decides."""
        layers = [layer for layer in (*extra_layers, *self.layers_for(version)) if len(layer)]
        kw = self.key_schema.width
        for i, layer in enumerate(layers):
            cursor = layer.puts.cursor()
            while (chunk := cursor.next_rows(chunk_rows)) is not None:
                keep = ~_decided_by(layers[:i], np.ascontiguousarray(chunk[:, :kw]))
                if keep.any():
                    yield chunk[keep]
        if self.base is not None:
            for chunk in base_rows(self.base, chunk_rows):
                keep = ~_decided_by(layers, np.ascontiguousarray(chunk[:, :kw]))
                if keep.any():
                    yield chunk[keep]

    # -- changes --------------------------------------------------------------------------
    def count(self, version):
        """Keys at ``version``; counted from the head and the base when not known yet (after a
        load from files), which costs one base lookup per key changed since the base."""
        n = self.num_keys[version]
        if n is None:
            # REQUIRES: version == self.version (older versions get their count at merge time)
            put_keys, _ = self.head.puts.export_rows()
            del_keys, _ = self.head.dels.export_rows()
            if self.base is None:
                n = put_keys.shape[0]
            else:
                n = (base_count(self.base) + int((~base_lookup(self.base, put_keys)[1]).sum())
                     - int(base_lookup(self.base, del_keys)[1].sum()))
            self.num_keys[version] = n
        return n

    def replay(self, kind_is_put, keys, values):
        """Apply one block of a delta to the head (loading from files: no undo, no lookups;
        the key count becomes unknown until asked for). REQUIRES: not frozen."""
        self._check_not_frozen()
        if keys.shape[0] == 0:
            return
        self._changed()
        self.num_keys[self.version] = None
        if kind_is_put:
            self.head.put_rows(keys, values)
        else:
            self.head.delete_rows(keys, tombstone=self.base is not None)

    def advance(self, version, commit_id, num_keys=None):
        """Make the head (just replayed) the given version, of ``num_keys`` keys if known."""
        self._changed()
        n = self.num_keys.pop(self.version)
        self.commit_ids.pop(self.version)
        self.version = version
        self.commit_ids[version] = commit_id
        self.num_keys[version] = n if num_keys is None else num_keys

    def merge(self, put_keys, put_values, del_keys, commit_id, pending=False, del_prior=None, put_prior=None,
              update=None):
        """Apply a store's updates (its layer's rows) as version ``self.version + 1``, keeping
        their undo: the prior value or absence of every key they change. ``del_prior``: the
        values ``del_keys`` have now, if the caller looked them up (all of them present);
        ``put_prior``: ``(values, found)`` of ``put_keys`` now, likewise. Given both, the
        merge looks nothing up: no damaged base can stop it half way.

        ``update``: the store's update Layer those rows came from, which no one writes to
        again. Over an empty head, an update that only puts becomes the head itself (its
        table is already the head's contents: no second insert of every key)."""
        self._check_not_frozen()
        before = self.count(self.version)
        self._changed()
        # Every lookup that can fail (a damaged snapshot block) comes before the head changes,
        # or is undone: readers of this state's versions never see half a merge.
        if del_prior is None:
            prior_del, prior_del_found = self.lookup(self.version, del_keys)
        else:
            prior_del, prior_del_found = del_prior, np.ones(del_keys.shape[0], dtype=np.bool_)
        adopted = (update is not None and not len(self.head) and not len(update.dels)
                   and len(update.puts) == put_keys.shape[0])
        if adopted:
            prior_put, prior_put_found = self._base_prior(put_keys) if put_prior is None else put_prior
            self.head = update
        elif put_prior is None:
            prior_put, prior_put_found = self._put_and_get_prior(put_keys, put_values)
        else:
            prior_put, prior_put_found = put_prior
            self.head.put_rows(put_keys, put_values)
        if del_keys.shape[0]:
            self.head.delete_rows(del_keys, tombstone=self.base is not None)
        old = self.version
        self.version = old + 1
        self.undo[self.version] = Layer.from_changes(
            self.key_schema, self.value_schema, _cat(put_keys, del_keys), _cat(prior_put, prior_del),
            _cat(prior_put_found, prior_del_found))
        self.commit_ids[self.version] = commit_id
        self.num_keys[self.version] = (before + int((~prior_put_found).sum()) - int(prior_del_found.sum()))
        self.merges += 1
        self.adopted_head = self.version if adopted else None
        if pending:
            self.pending = self.version

    def rollback(self):
        """Undo the newest merge (its delta could not be written): the head returns to the
        previous version, exactly, from the undo layer (or, when the merge made the store's
        update layer the head, to the empty head it replaced, leaving that layer as it was)."""
        self._check_not_frozen()
        self._changed()
        undo = self.undo.pop(self.version)
        if self.adopted_head == self.version:
            self.head = Layer(self.key_schema, self.value_schema)
        else:
            keys, prior_values, prior_found = undo.changes()
            if prior_found.any():
                self.head.put_rows(take_rows(keys, prior_found), take_rows(prior_values, prior_found))
            if not prior_found.all():
                self.head.delete_rows(take_rows(keys, ~prior_found), tombstone=self.base is not None)
        self.adopted_head = None
        del self.commit_ids[self.version]
        del self.num_keys[self.version]
        self.version -= 1
        self.pending = None
        self.merges += 1

    def _base_prior(self, keys):
        """Each key's value and presence in the base alone (the head holds none of them)."""
        if self.base is None or keys.shape[0] == 0:
            return (np.zeros((keys.shape[0], self.value_schema.width), dtype=np.uint8),
                    np.zeros(keys.shape[0], dtype=np.bool_))
        return base_lookup(self.base, keys)

    def _put_and_get_prior(self, keys, values):
        """Write puts into the head; return each key's value and presence before the write.
        If the base lookup raises, the head is put back as it was before the raise."""
        n = keys.shape[0]
        prior = np.empty((n, self.value_schema.width), dtype=np.uint8)
        in_head = np.empty(n, dtype=np.uint8)
        self.head.puts.exchange_rows(keys, values, prior, in_head)  # one probe: old value out, new in
        found = in_head.view(np.bool_).copy()
        rest = np.flatnonzero(~found)
        if rest.size == 0:
            return prior, found
        rest_keys = all_rest_keys = take_rows(keys, rest)
        if len(self.head.dels):
            tombstoned = np.zeros(rest.size, dtype=np.uint8)
            self.head.dels.get_rows(rest_keys, no_values(rest.size), tombstoned)
            keep = ~tombstoned.view(np.bool_)
            rest, rest_keys = rest[keep], take_rows(rest_keys, keep)
        if self.base is not None and rest.size:
            try:
                base_values, base_found = base_lookup(self.base, rest_keys)
            except BaseException:
                self.head.puts.put_rows(take_rows(keys, found), take_rows(prior, found))
                self.head.puts.remove_rows(all_rest_keys)
                raise
            put_rows_at(prior, rest, base_values)
            found[rest] = base_found
        if len(self.head.dels):
            self.head.dels.remove_rows(all_rest_keys)
        return prior, found

    def _check_not_frozen(self):
        # Someone may be reading this state without a lock (a snapshot being written, a
        # newer state built over it): changing it now would be a bug, never a wrong value.
        if self.frozen:
            raise AssertionError("statecore bug: a change to a frozen in-memory state")

    def retain(self, keep_from):
        """Forget versions older than ``keep_from`` (and the undo layers only they need)."""
        self._changed()
        for v in [v for v in self.commit_ids if v < keep_from]:
            del self.commit_ids[v]
            del self.num_keys[v]
        for u in [u for u in self.undo if u <= keep_from]:
            del self.undo[u]


class OpenedValues:
    """What a store read of ``keys`` (rows) at the version it opened, before it wrote
    anything: ``values`` and ``found`` there, the priors a commit of puts of exactly those
    keys needs (the merge then looks none of them up)."""

    __slots__ = ("keys", "values", "found")

    def __init__(self, keys, values, found):
        self.keys, self.values, self.found = keys, values, found

    def priors_of(self, put_keys):
        """``(values, found)`` for ``put_keys`` if they are these keys in this order, else None."""
        if put_keys.shape != self.keys.shape or not np.array_equal(put_keys, self.keys):
            return None
        return self.values, self.found


def _decided_by(layers, key_rows):
    n = key_rows.shape[0]
    decided = np.zeros(n, dtype=np.bool_)
    for layer in layers:
        scratch = np.empty((n, layer.puts.value_width), dtype=np.uint8)
        decided |= layer.probe(key_rows, scratch)[1]
    return decided


def base_lookup(base, key_rows):
    """``(value_rows, found)`` from a base: a SnapshotReader, a Spill or a FrozenView."""
    if isinstance(base, SnapshotReader):
        n = key_rows.shape[0]
        values = np.zeros((n, base.value_width), dtype=np.uint8)
        found = np.zeros(n, dtype=np.uint8)
        base.get_rows(key_rows, values, found)
        return values, found.view(np.bool_)
    if isinstance(base, FrozenView):
        return base.state.lookup(base.version, key_rows)
    return base.lookup(key_rows)


def _cat(a, b):
    return a if b.shape[0] == 0 else np.concatenate([a, b])


def base_count(base):
    if isinstance(base, SnapshotReader):
        return base.row_count
    if isinstance(base, FrozenView):
        return base.state.count(base.version)
    return base.num_keys


def base_rows(base, chunk_rows):
    if isinstance(base, SnapshotReader):
        cursor = base.cursor()
        while (chunk := cursor.next_rows(chunk_rows)) is not None:
            yield chunk
    elif isinstance(base, FrozenView):
        yield from base.state.iter_rows(base.version, chunk_rows=chunk_rows)
    else:
        yield from base.rows(chunk_rows)
