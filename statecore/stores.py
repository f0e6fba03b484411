"""The stores a :class:`~statecore.provider.FileStateStoreProvider` hands out: the contract's
reads and updates over one pinned version of the provider's in-memory state.

A :class:`View` pins a version while its store is open. :class:`FileReadStore` reads it
(under the provider's lock; iteration without it, see :meth:`View.iter_rows`);
:class:`FileStore` adds a private layer of updates, invisible to everyone else until
``commit()`` hands it to the provider, which writes and merges it. Lifecycle errors use
Spark's wording. The stores are subclasses of the compiled
:class:`~statecore._rowcalls.RowCalls`: their per-row ``get``, ``put`` and ``remove`` are
its methods (a call goes straight into C), and its ``status`` is the store's lifecycle (one
field, checked by ``check_updating``, the one check the per-row and batch writes make).
"""
import weakref

import numpy as np

from statecore._rowcalls import RowCalls
from statecore._versions import Layer, State, no_values
from statecore.contracts import ReadStateStore, StateStore
from statecore.rowsource import iter_batches, iter_items

__all__ = ["View", "FileReadStore", "FileStore"]

# Visible for tests. The call an iteration makes for its rows, by this name: State is a compiled
# type whose methods cannot be replaced, and tests wrap this to stop an iteration half way.
iter_state_rows = State.iter_rows


class View:
    """One version of a provider's State, pinned while the store that reads it is open, with
    the directory listing taken when it opened (what a commit from it may supersede).
    ``named``: a store's view opened at an attempt its caller named, not the default lineage.
    ``listed``: False for a view opened from memory without a listing (its ``listing`` is
    what the provider knew of the files then)."""

    named = False
    listed = True

    def __init__(self, provider, state, version, listing):
        self.provider = provider
        self.state = state
        self.version = version
        self.commit_id = state.commit_ids[version]
        self.listing = listing
        provider.held.pin(state, version)
        self._finalizer = weakref.finalize(self, provider.held.unpin, state, version)

    def release(self):
        self._finalizer()

    def lookup(self, key_rows, extra_layers=()):
        with self.provider.held.lock:
            return self.state.lookup(self.version, key_rows, extra_layers)

    def iter_rows(self, extra_layers=()):
        """Row chunks of the version. Rows are copied out without the provider lock: while
        the iteration is registered, no commit merges into this state (it freezes it and
        goes on in a new one), so nothing it reads changes."""
        lock = self.provider.held.lock
        with lock:
            self.state.iteration_opened()
            chunks = iter_state_rows(self.state, self.version, extra_layers)  # flattened here, under the lock
        try:
            yield from chunks
        finally:
            with lock:
                self.state.iteration_closed()


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


class FileReadStore(RowCalls, ReadStateStore):
    """A read store over ``view``; ``get`` is RowCalls'. ``update``: a FileStore's layer."""

    _kind = "FileReadStateStore"

    def __init__(self, provider, view, update=None):
        self._provider = provider
        self._view = view
        self._key_schema = provider.key_schema
        self._value_schema = provider.value_schema
        RowCalls.__init__(self, view, provider.held.lock, self._key_schema, self._value_schema, update)

    def __repr__(self):
        sid = self._provider.state_store_id
        return f"{self._kind}[id=(op={sid.operator_id},part={sid.partition_id}),dir={self._provider.directory}]"

    @property
    def id(self):
        return self._provider.state_store_id

    @property
    def version(self):
        return self._view.version

    @property
    def base_commit_id(self):
        """The id (16 hex digits) of the version this store opened."""
        return self._view.commit_id.hex()

    def _layers(self):
        return ()

    def get_batch(self, keys):
        key_rows = self._key_schema.rows(keys)
        values, found = self._view.lookup(key_rows, self._layers())
        self._batch_read(key_rows, values, found)
        return self._value_schema.from_rows(values).copy(), found

    def _batch_read(self, key_rows, values, found):
        """What a store may keep of a batch read (``values`` is its own; ``found`` the caller's)."""

    def _iteration_layers(self):
        return ()

    def iterator(self):
        return iter_items(_ChunkCursor(self._view.iter_rows(self._iteration_layers())), self._key_schema,
                          self._value_schema)

    def iter_batches(self, rows_per_batch=65536):
        """Yield ``(keys, values)`` structured arrays covering every key once."""
        return iter_batches(_ChunkCursor(self._view.iter_rows(self._iteration_layers())),
                            self._key_schema, self._value_schema, rows_per_batch)

    def abort(self):
        self._view.release()

    def _num_keys(self):
        with self._provider.held.lock:
            return self._view.state.count(self._view.version)

    @property
    def metrics(self):
        return self._provider.metrics_of(self._num_keys())


class _ChunkCursor:
    """Adapts a generator of row chunks to the ``next_rows`` cursor protocol."""

    def __init__(self, chunks):
        self._chunks = chunks
        self._pending = None

    def next_rows(self, max_rows):
        if self._pending is None or not len(self._pending):
            self._pending = next(self._chunks, None)
            if self._pending is None:
                return None
        out, self._pending = self._pending[:max_rows], self._pending[max_rows:]
        return out

    def close(self):
        self._chunks.close()


class FileStore(FileReadStore, StateStore):
    """A store that writes ``put``/``remove`` (RowCalls') and the batch writes into its
    update layer while ``updating``; ``commit`` hands the layer to the provider."""

    _kind = "FileStateStore"

    def __init__(self, provider, view):
        self._update = Layer(provider.key_schema, provider.value_schema)
        super().__init__(provider, view, self._update)
        self._commit_id = None
        self._opened = None  # (version, commit id) opened, once the view moved to the commit's
        self._read_before_writes = None  # OpenedValues of the one get_batch made before any write

    def _layers(self):
        return (self._update,)

    def _iteration_layers(self):
        # Iteration sees the updates as they were when it began: puts made while iterating
        # (eviction loops) then cannot hide a key that is still to be visited.
        return (self._update.copy(),)

    def _batch_read(self, key_rows, values, found):
        """The values a batch read finds before this store wrote anything are the opened
        version's, which the commit needs of the keys it puts: kept (the last such read
        only) for a commit that puts exactly those keys, in that order."""
        if self.updating and not len(self._update):
            self._read_before_writes = OpenedValues(key_rows.copy(), values, found.copy())

    def put_batch(self, keys, values):
        if values is None and self._value_schema.width:
            raise ValueError("Cannot put a null value")
        self.check_updating("put")
        key_rows = self._key_schema.rows(keys)
        value_rows = self._value_schema.rows(values) if values is not None else no_values(key_rows.shape[0])
        if value_rows.shape[0] != key_rows.shape[0]:
            raise ValueError(f"{key_rows.shape[0]} keys but {value_rows.shape[0]} values")
        self._update.put_rows(key_rows, value_rows)

    def remove_batch(self, keys):
        self.check_updating("remove")
        self._update.delete_rows(self._key_schema.rows(keys))

    def commit(self):
        self.check_updating("commit")
        opened_values, self._read_before_writes = self._read_before_writes, None
        new_version, self._committed_num_keys, commit_id, committed = self._provider.commit_update(
            self._view, self._update, opened_values)
        # The update layer may be the provider's head now: no per-row call may write to it
        # again. Reads after the commit see the version it made, from the provider's State:
        # the update layer, merged there, is let go (no longer a copy held beside the head).
        # ``version`` and ``base_commit_id`` still name the version the store opened.
        self._end_updates(True, committed)
        self._commit_id = commit_id
        if committed is not None:
            self._opened = (self._view.version, self._view.commit_id)
            self._view.release()
            self._view = committed
            self._update = Layer(self._key_schema, self._value_schema)
        return new_version

    @property
    def commit_id(self):
        return None if self._commit_id is None else self._commit_id.hex()

    @property
    def version(self):
        return self._opened[0] if self._opened else self._view.version

    @property
    def base_commit_id(self):
        return (self._opened[1] if self._opened else self._view.commit_id).hex()

    def abort(self):
        self._end_updates(False)
        self._read_before_writes = None
        self._update = Layer(self._key_schema, self._value_schema)
        self._view.release()

    def _num_keys(self):
        if self.has_committed:
            return self._committed_num_keys
        base = super()._num_keys()
        put_keys, _ = self._update.puts.export_rows()
        del_keys, _ = self._update.dels.export_rows()
        _, put_found = self._view.lookup(put_keys)
        _, del_found = self._view.lookup(del_keys)
        return base + int((~put_found).sum()) - int(del_found.sum())

    @property
    def metrics(self):
        return self._provider.metrics_of(self._num_keys(), update_bytes=self._update.sizeof())
