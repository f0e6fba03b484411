"""Identifiers of stores and provider instances (Spark's StateStoreId and StateStoreProviderId).

Both are frozen, hashable value types; they are the keys of the executor registry and of
the coordinator's table, and they travel to tasks, so they pickle.
"""
import dataclasses
import uuid
from typing import ClassVar

__all__ = ["StateStoreId", "StateStoreProviderId"]


@dataclasses.dataclass(frozen=True)
class StateStoreId:
    """One store: (checkpoint root, operator, partition, store name).

    ``checkpoint_root_location`` is kept exactly as the caller gave it (a path or a URL).
    """

    checkpoint_root_location: str
    operator_id: int
    partition_id: int
    store_name: str = "default"

    DEFAULT_STORE_NAME: ClassVar[str] = "default"

    def __post_init__(self):
        if not isinstance(self.operator_id, int) or self.operator_id < 0:
            raise ValueError(f"operator_id must be an int >= 0, got {self.operator_id!r}")
        if not isinstance(self.partition_id, int) or self.partition_id < 0:
            raise ValueError(f"partition_id must be an int >= 0, got {self.partition_id!r}")
        if not self.store_name or "/" in self.store_name:
            raise ValueError(f"store_name must be a non-empty name without '/', got {self.store_name!r}")

    def store_checkpoint_location(self):
        """``<root>/<operator>/<partition>``, plus ``/<store_name>`` unless it is the default
        (Spark leaves the default name out so that pre-2.3 checkpoints stay readable)."""
        base = f"{self.checkpoint_root_location.rstrip('/')}/{self.operator_id}/{self.partition_id}"
        return base if self.store_name == self.DEFAULT_STORE_NAME else f"{base}/{self.store_name}"

    def __str__(self):
        return (f"StateStoreId[ checkpointRootLocation={self.checkpoint_root_location}, "
                f"operatorId={self.operator_id}, partitionId={self.partition_id}, storeName={self.store_name} ]")


@dataclasses.dataclass(frozen=True)
class StateStoreProviderId:
    """A provider instance: a store plus the run of the query that uses it. A restarted query
    gets a new run id, hence new provider instances, even for the same directory."""

    store_id: StateStoreId
    query_run_id: uuid.UUID

    def __post_init__(self):
        if not isinstance(self.query_run_id, uuid.UUID):
            raise TypeError(f"query_run_id must be a uuid.UUID, got {type(self.query_run_id).__name__}")
