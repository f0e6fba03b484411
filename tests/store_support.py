"""What the store tests share: opening a provider on a directory, committing a batch of
per-row updates, reading a store back as a dict."""
import os

from statecore import StateStoreConf, StateStoreId, create_and_init_provider


def open_provider(root, key, value, partition=0, **conf):
    """A provider of ``StateStoreId(root, 0, partition)`` with ``StateStoreConf(**conf)``."""
    return create_and_init_provider(StateStoreId(str(root), 0, partition), key, value, StateStoreConf(**conf))


def store_dir(root, partition=0):
    return os.path.join(str(root), "0", str(partition))


def commit_batch(provider, version, puts=(), removes=()):
    """Open ``version``, put ``(key, value)`` pairs and remove keys, commit; the store is
    then aborted, as a task-completion hook does (harmless after a commit)."""
    store = provider.get_store(version)
    for k, v in puts:
        store.put(k, v)
    for k in removes:
        store.remove(k)
    new_version = store.commit()
    store.abort()
    return new_version


def contents(store):
    """The store's iterator as a dict (a one-field key by its value); every key must come once."""
    out = {}
    for k, v in store.iterator():
        key = k[0] if len(k) == 1 else k
        assert key not in out, f"key {key} iterated twice"
        out[key] = tuple(v)
    return out
