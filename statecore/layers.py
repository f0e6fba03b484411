"""The in-memory versions of one store: layers of changes over a mapped snapshot.

A version is never copied. The newest version a provider holds is a :class:`State`: a
*base* (a mapped :class:`~statecore.SnapshotReader`, another state frozen at a version, or
nothing) under a *head* layer holding every change since that base. Each commit merges its
updates into the head in place and keeps an *undo* layer (the previous value, or absence,
of every key it changed), so the versions just before the newest stay readable while they
are retained or pinned by an open store. A :class:`Layer` is a RowTable of puts and a
RowTable set of deletions; the first layer that holds a key decides its value.

Lookups go, for version ``v``: undo layers ``v+1 .. newest`` (oldest first: the undo of
``v+1`` holds the value at ``v``), the head, then the base. Everything is batch-shaped
(numpy row arrays in, row arrays out); nothing loops in Python per row.

Thread-safety: a State's owner (the provider) serializes merges and base swaps with its
lock; lookups read a consistent state as long as they hold the same lock or the state is
frozen. A frozen State never changes again.
"""
import numpy as np

from statecore._rowtable import RowTable
from statecore._snapshot import SnapshotReader

__all__ = ["Layer", "State", "FrozenView", "concat_rows"]

EMPTY = np.dtype([])


def concat_rows(table, width):
    """Every row of a RowTable as one ``(n, width)`` uint8 array (a copy)."""
    cursor = table.cursor()
    chunks = []
    while (chunk := cursor.next_rows(1 << 16)) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks) if chunks else np.empty((0, width), dtype=np.uint8)


class Layer:
    """Keys this layer decides: ``puts`` (key -> value) and ``dels`` (keys absent here)."""

    __slots__ = ("puts", "dels")

    def __init__(self, key_schema, value_schema):
        self.puts = RowTable(key_schema, value_schema)
        self.dels = RowTable(key_schema, EMPTY)

    def __len__(self):
        return len(self.puts) + len(self.dels)

    def sizeof(self):
        return self.puts.sizeof() + self.dels.sizeof()

    def copy(self):
        """An independent Layer with the same contents."""
        put_keys, put_values, del_keys = self.rows()
        other = Layer(self.puts.key_schema, self.puts.value_schema)
        other.puts.put_rows(put_keys, put_values)
        other.dels.put_rows(del_keys, np.empty((del_keys.shape[0], 0), dtype=np.uint8))
        return other

    def rows(self):
        """``(put_keys, put_values, deleted_keys)`` as contiguous uint8 row arrays."""
        kw = self.puts.key_width
        put_rows = concat_rows(self.puts, self.puts.row_width)
        return (np.ascontiguousarray(put_rows[:, :kw]), np.ascontiguousarray(put_rows[:, kw:]),
                concat_rows(self.dels, kw))

    def probe(self, key_rows, values_out):
        """Look ``key_rows`` up: values into ``values_out``; returns (put_found, decided)."""
        n = key_rows.shape[0]
        put_found = np.zeros(n, dtype=np.uint8)
        if len(self.puts):
            self.puts.get_rows(key_rows, values_out, put_found)
        put_found = put_found.view(np.bool_)
        decided = put_found.copy()
        if len(self.dels):
            del_found = np.zeros(n, dtype=np.uint8)
            self.dels.get_rows(key_rows, np.empty((n, 0), dtype=np.uint8), del_found)
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
        return self.state.num_keys[self.version]


class State:
    """The versions one provider holds in memory for one lineage (see the module docstring).

    ``commit_ids[v]`` identifies version v (8 bytes; all zeros for version 0); ``num_keys[v]``
    is its key count; both, and ``undo``, cover exactly the versions held.
    """

    def __init__(self, key_schema, value_schema, base, version, commit_id, num_keys):
        self.key_schema = key_schema
        self.value_schema = value_schema
        self.base = base
        self.head = Layer(key_schema, value_schema)
        self.version = version
        self.undo = {}
        self.commit_ids = {version: commit_id}
        self.num_keys = {version: num_keys}
        self.frozen = False
        self.merges = 0

    def holds(self, version):
        return version in self.commit_ids

    def oldest(self):
        return min(self.commit_ids)

    def layers_for(self, version):
        # REQUIRES: self.holds(version)
        return [self.undo[u] for u in range(version + 1, self.version + 1)] + [self.head]

    def sizeof(self):
        return self.head.sizeof() + sum(layer.sizeof() for layer in self.undo.values())

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, version, key_rows, extra_layers=()):
        """``(value_rows, found)`` of ``key_rows`` at ``version`` (under ``extra_layers``)."""
        n = key_rows.shape[0]
        vw = self.value_schema.width
        values = np.zeros((n, vw), dtype=np.uint8)
        found = np.zeros(n, dtype=np.bool_)
        pending = None  # None means every row is still pending (no copy needed)
        for layer in (*extra_layers, *self.layers_for(version)):
            if not len(layer):
                continue
            sub = key_rows if pending is None else np.ascontiguousarray(key_rows[pending])
            if sub.shape[0] == 0:
                break
            sub_values = np.zeros((sub.shape[0], vw), dtype=np.uint8)
            put_found, decided = layer.probe(sub, sub_values)
            idx = np.arange(n) if pending is None else pending
            values[idx[put_found]] = sub_values[put_found]
            found[idx[put_found]] = True
            pending = idx[~decided]
        if self.base is not None:
            sub = key_rows if pending is None else np.ascontiguousarray(key_rows[pending])
            if sub.shape[0]:
                base_values, base_found = base_lookup(self.base, sub)
                idx = np.arange(n) if pending is None else pending
                values[idx] = base_values
                found[idx] = base_found
        return values, found

    def base_found(self, key_rows):
        """Which keys the base holds (tombstones are only needed for those)."""
        if self.base is None or key_rows.shape[0] == 0:
            return np.zeros(key_rows.shape[0], dtype=np.bool_)
        return base_lookup(self.base, key_rows)[1]

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
    def replay(self, kind_is_put, keys, values):
        """Apply one block of a delta to the head (loading from files: no undo kept).
        REQUIRES: keys are unique within the block (deltas are written from a table)."""
        if keys.shape[0] == 0:
            return
        _, present = self.lookup(self.version, keys)
        v = self.version
        if kind_is_put:
            self.num_keys[v] += int((~present).sum())
            self.head.puts.put_rows(keys, values)
            if len(self.head.dels):
                self.head.dels.remove_rows(keys)
        else:
            self.num_keys[v] -= int(present.sum())
            if len(self.head.puts):
                self.head.puts.remove_rows(keys)
            in_base = self.base_found(keys)
            self._tombstone(keys[in_base])

    def advance(self, version, commit_id):
        """Make the head (just replayed) the given version."""
        n = self.num_keys.pop(self.version)
        self.commit_ids.pop(self.version)
        self.version = version
        self.commit_ids[version] = commit_id
        self.num_keys[version] = n

    def merge(self, update, commit_id):
        """Apply a store's update layer as version ``self.version + 1``, keeping its undo."""
        put_keys, put_values, del_keys = update.rows()
        keys = np.concatenate([put_keys, del_keys])
        prior_values, prior_found = self.lookup(self.version, keys)
        undo = Layer(self.key_schema, self.value_schema)
        if prior_found.any():
            undo.puts.put_rows(np.ascontiguousarray(keys[prior_found]),
                               np.ascontiguousarray(prior_values[prior_found]))
        if not prior_found.all():
            absent = np.ascontiguousarray(keys[~prior_found])
            undo.dels.put_rows(absent, np.empty((absent.shape[0], 0), dtype=np.uint8))
        n_put = put_keys.shape[0]
        new_keys = int((~prior_found[:n_put]).sum()) - int(prior_found[n_put:].sum())
        if n_put:
            self.head.puts.put_rows(put_keys, put_values)
            if len(self.head.dels):
                self.head.dels.remove_rows(put_keys)
        if del_keys.shape[0]:
            if len(self.head.puts):
                self.head.puts.remove_rows(del_keys)
            self._tombstone(del_keys[self.base_found(del_keys)])
        old = self.version
        self.version = old + 1
        self.undo[self.version] = undo
        self.commit_ids[self.version] = commit_id
        self.num_keys[self.version] = self.num_keys[old] + new_keys
        self.merges += 1

    def _tombstone(self, keys):
        if keys.shape[0]:
            self.head.dels.put_rows(np.ascontiguousarray(keys), np.empty((keys.shape[0], 0), dtype=np.uint8))

    def retain(self, keep_from):
        """Forget versions older than ``keep_from`` (and the undo layers only they need)."""
        for v in [v for v in self.commit_ids if v < keep_from]:
            del self.commit_ids[v]
            del self.num_keys[v]
        for u in [u for u in self.undo if u <= keep_from]:
            del self.undo[u]


def _decided_by(layers, key_rows):
    n = key_rows.shape[0]
    decided = np.zeros(n, dtype=np.bool_)
    for layer in layers:
        scratch = np.empty((n, layer.puts.value_width), dtype=np.uint8)
        decided |= layer.probe(key_rows, scratch)[1]
    return decided


def base_lookup(base, key_rows):
    """``(value_rows, found)`` from a base: a SnapshotReader or a FrozenView."""
    if isinstance(base, SnapshotReader):
        n = key_rows.shape[0]
        values = np.zeros((n, base.value_width), dtype=np.uint8)
        found = np.zeros(n, dtype=np.uint8)
        base.get_rows(key_rows, values, found)
        return values, found.view(np.bool_)
    return base.state.lookup(base.version, key_rows)


def base_rows(base, chunk_rows):
    if isinstance(base, SnapshotReader):
        cursor = base.cursor()
        while (chunk := cursor.next_rows(chunk_rows)) is not None:
            yield chunk
    else:
        yield from base.state.iter_rows(base.version, chunk_rows=chunk_rows)
