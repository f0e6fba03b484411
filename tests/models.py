"""The reference model: a provider that keeps every version as a plain dict, in memory.

It implements the same contract as FileStateStoreProvider with the simplest possible
code, so the conformance suite (test_store_contract.py) checks both against each other's
behaviour. Versions live in a process-wide dict keyed by store directory, so a second
provider on the same directory sees what the first committed, as with files.
"""
import numpy as np

from statecore import (IllegalStateError, StateStore, StateStoreMetrics,
                       StateStoreProvider, VersionNotFoundError)
from statecore.schema import key_value_schemas

_VERSIONS = {}  # directory -> {version: {key_bytes: value_bytes}}


class _ModelStore(StateStore):
    def __init__(self, provider, version, data, writable):
        self._provider, self._version, self._data, self._writable = provider, version, data, writable
        self._state = "UPDATING"

    id = property(lambda self: self._provider.state_store_id)
    version = property(lambda self: self._version)
    has_committed = property(lambda self: self._state == "COMMITTED")

    def get(self, key):
        v = self._data.get(self._provider.key_schema.encode(key))
        return None if v is None else self._provider.value_schema.decode(v)

    def get_batch(self, keys):
        ks, vs = self._provider.key_schema, self._provider.value_schema
        rows = ks.rows(keys)
        found = np.array([r.tobytes() in self._data for r in rows], dtype=bool)
        values = np.zeros(len(rows), dtype=vs.dtype)
        for i, r in enumerate(rows):
            if found[i] and vs.width:
                values[i] = np.frombuffer(self._data[r.tobytes()], dtype=vs.dtype)[0]
        return values, found

    def iterator(self):
        ks, vs = self._provider.key_schema, self._provider.value_schema
        for k, v in list(self._data.items()):
            yield ks.decode(k), vs.decode(v)

    def _check(self, verb):
        if self._state != "UPDATING":
            raise IllegalStateError(f"Cannot {verb} after already committed or aborted")

    def put(self, key, value):
        if value is None:
            raise ValueError("Cannot put a null value")
        self._check("put")
        self._data[self._provider.key_schema.encode(key)] = self._provider.value_schema.encode(value)

    def remove(self, key):
        self._check("remove")
        self._data.pop(self._provider.key_schema.encode(key), None)

    def put_batch(self, keys, values):
        self._check("put")
        krows = self._provider.key_schema.rows(keys)
        vrows = (self._provider.value_schema.rows(values) if values is not None
                 else np.empty((len(krows), 0), np.uint8))
        for k, v in zip(krows, vrows):
            self._data[k.tobytes()] = v.tobytes()

    def remove_batch(self, keys):
        self._check("remove")
        for k in self._provider.key_schema.rows(keys):
            self._data.pop(k.tobytes(), None)

    def commit(self):
        self._check("commit")
        versions = _VERSIONS.setdefault(self._provider.directory, {})
        for v in [v for v in versions if v > self._version + 1]:
            del versions[v]
        versions[self._version + 1] = dict(self._data)
        self._state = "COMMITTED"
        return self._version + 1

    def abort(self):
        self._state = "ABORTED"

    @property
    def metrics(self):
        return StateStoreMetrics(len(self._data), 0, {})


class DictStateStoreProvider(StateStoreProvider):
    def init(self, store_id, key_schema, value_schema, key_index_ordinal, conf):
        self._id = store_id
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.directory = store_id.store_checkpoint_location()

    state_store_id = property(lambda self: self._id)

    def _data(self, version):
        if version < 0:
            raise ValueError(f"Version cannot be less than 0, got {version}")
        if version == 0:
            return {}
        versions = _VERSIONS.get(self.directory, {})
        if version not in versions:
            raise VersionNotFoundError(f"version {version} of {self.directory} does not exist")
        return dict(versions[version])

    def get_store(self, version):
        return _ModelStore(self, version, self._data(version), True)

    def get_read_store(self, version):
        return _ModelStore(self, version, self._data(version), False)

    def close(self):
        pass


from statecore import FileStateStoreProvider  # noqa: E402


class FailingMaintenanceProvider(FileStateStoreProvider):
    """A file provider whose maintenance always raises (registry tests)."""

    def do_maintenance(self):
        raise RuntimeError("injected maintenance failure")
