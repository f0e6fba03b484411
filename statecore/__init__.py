"""statecore: a fast, crash-safe, versioned key-value state store for stateful stream processing.

The compiled core (``_hash``, ``_rowtable``, ``_snapshot``, ``_delta``) holds rows, indexes
and file images; this package re-exports its public classes.
"""
from statecore.errors import (
    AuthenticationError,
    CommitConflictError,
    IllegalStateError,
    SchemaMismatchError,
    StateCorruptionError,
    StateStoreError,
    VersionNotFoundError,
)
from statecore.schema import RowSchema
from statecore.schema_evolution import SchemaChanges, SchemaEvolutionError
from statecore._rowtable import RowCursor, RowTable
from statecore._snapshot import SnapshotReader, SnapshotWriter, write_snapshot
from statecore._delta import DeltaReader, DeltaWriter, apply_delta, encode_delta, read_delta
from statecore.conf import StateStoreConf
from statecore.ids import StateStoreId, StateStoreProviderId
from statecore.metrics import StateStoreCustomMetric, StateStoreMetrics
from statecore.contracts import ReadStateStore, StateStore, StateStoreProvider, create_and_init_provider
from statecore.provider import FileStateStoreProvider

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CommitConflictError",
    "FileStateStoreProvider",
    "ReadStateStore",
    "StateStore",
    "StateStoreConf",
    "StateStoreCustomMetric",
    "StateStoreId",
    "StateStoreMetrics",
    "StateStoreProvider",
    "StateStoreProviderId",
    "create_and_init_provider",
    "DeltaReader",
    "DeltaWriter",
    "SnapshotReader",
    "SnapshotWriter",
    "apply_delta",
    "encode_delta",
    "read_delta",
    "write_snapshot",
    "IllegalStateError",
    "RowCursor",
    "RowSchema",
    "RowTable",
    "SchemaChanges",
    "SchemaEvolutionError",
    "SchemaMismatchError",
    "StateCorruptionError",
    "StateStoreError",
    "VersionNotFoundError",
]
