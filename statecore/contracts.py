"""The state store contract, as Spark's StateStore API has it: what a store and a provider
must do, whatever keeps the state. :mod:`statecore.provider` holds the default implementation.
"""
import abc
import importlib

__all__ = ["ReadStateStore", "StateStore", "StateStoreProvider", "create_and_init_provider"]


class ReadStateStore(abc.ABC):
    """A read-only view of one version. Implementations guarantee that what a store reads
    never changes under it; callers must not assume any iteration order."""

    @property
    @abc.abstractmethod
    def id(self):
        """The StateStoreId."""

    @property
    @abc.abstractmethod
    def version(self):
        """The version this store was opened at (before any update)."""

    @abc.abstractmethod
    def get(self, key):
        """The value tuple of ``key``, or None."""

    @abc.abstractmethod
    def get_batch(self, keys):
        """``(values, found)`` for a batch of keys."""

    @abc.abstractmethod
    def iterator(self):
        """Yield ``(key_tuple, value_tuple)`` for every key, once each."""

    def get_range(self, start=None, end=None):
        """Every pair; like Spark's, the bounds are not enforced (a superset of the range)."""
        return self.iterator()

    @abc.abstractmethod
    def abort(self):
        """Release what the store holds; harmless to call twice."""

    @property
    @abc.abstractmethod
    def metrics(self):
        """A StateStoreMetrics."""


class StateStore(ReadStateStore):
    """A writable store: updates are private until :meth:`commit`. ``put`` copies its rows
    (callers reuse buffers). Updates may be interleaved with an open iterator."""

    @abc.abstractmethod
    def put(self, key, value):
        """Insert or overwrite."""

    @abc.abstractmethod
    def remove(self, key):
        """Remove ``key`` if present."""

    @abc.abstractmethod
    def put_batch(self, keys, values):
        """Insert or overwrite a batch."""

    @abc.abstractmethod
    def remove_batch(self, keys):
        """Remove a batch of keys."""

    @abc.abstractmethod
    def commit(self):
        """Make version ``version + 1`` durable and return it. Raised means not committed:
        the version is not visible, now or after a restart."""

    @property
    def commit_id(self):
        """The id (16 hex digits) of the version this store committed, once committed; None
        before, and for providers without attempt ids. A driver records it as the batch's
        winner and passes it to ``get_store`` of the next batch."""
        return None

    @property
    @abc.abstractmethod
    def has_committed(self):
        """True while the store is committed."""


class StateStoreProvider(abc.ABC):
    """Builds stores of one StateStoreId. Created by name from ``conf.provider_class`` with
    no arguments, then :meth:`init`; ``do_maintenance`` is called from the maintenance thread,
    never from a task."""

    @abc.abstractmethod
    def init(self, store_id, key_schema, value_schema, key_index_ordinal, conf):
        """Set the provider up for ``store_id``."""

    @property
    @abc.abstractmethod
    def state_store_id(self):
        """The StateStoreId given to init."""

    @abc.abstractmethod
    def get_store(self, version, commit_id=None):
        """A StateStore holding ``version``; ``commit_id`` names which committed attempt of
        it (a driver that records each batch's winner passes it), None for the default."""

    def get_read_store(self, version, commit_id=None):
        """A ReadStateStore holding ``version`` (default: a store that is never committed)."""
        return self.get_store(version, commit_id)

    def do_maintenance(self):
        """Background work: snapshots and cleanup. Default: nothing."""

    @abc.abstractmethod
    def close(self):
        """Release everything; called when the provider is unloaded."""

    @property
    def supported_custom_metrics(self):
        return ()


def create_and_init_provider(store_id, key_schema, value_schema, conf, key_index_ordinal=None):
    """The provider class named by ``conf.provider_class``, created and initialised."""
    module_name, _, class_name = conf.provider_class.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load the state store provider class {conf.provider_class!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, StateStoreProvider)):
        raise TypeError(f"The given State Store Provider {conf.provider_class} does not extend "
                        f"statecore.StateStoreProvider.")
    provider = cls()
    provider.init(store_id, key_schema, value_schema, key_index_ordinal, conf)
    return provider
