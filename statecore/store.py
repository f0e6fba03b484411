"""The store's public names in one import: the contract (:mod:`statecore.contracts`) and the
default provider (:mod:`statecore.provider`)."""
from statecore.contracts import ReadStateStore, StateStore, StateStoreProvider, create_and_init_provider
from statecore.provider import SCHEMA_FILE, FileStateStoreProvider, read_store_schemas

__all__ = ["ReadStateStore", "StateStore", "StateStoreProvider", "FileStateStoreProvider",
           "create_and_init_provider", "read_store_schemas", "SCHEMA_FILE"]
