"""Identifiers of stores and provider instances (Spark's StateStoreId and StateStoreProviderId).

Both are frozen, hashable value types; they are the keys of the executor registry and of
the coordinator's table, and they travel to tasks, so they pickle.
"""
import dataclasses
import uuid
from typing import ClassVar

from statecore.lineage import parse_name

__all__ = ["StateStoreId", "StateStoreProviderId", "check_store_name"]

# A store directory's own files (schema_file.SCHEMA_FILE and whatever statecore adds beside it)
# start with this; a store of that name would be a directory among them.
_RESERVED_PREFIX = "_statecore"


def check_store_name(name, what="store_name"):
    """``name`` if it can be the name of a store: one directory of its own inside its partition's
    directory, among no file of the default store there. ValueError naming ``what`` and the name
    otherwise: not a str, empty, ``.`` or ``..``, holding ``/``, ``\\`` or NUL, starting with ``.``
    (hidden names, which listings skip), or a name the default store's files take (a version file's
    ``<version>[_<id>].<kind>``, or statecore's ``_statecore*``)."""
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a str, got {name!r}")
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{what} {name!r} is not a directory name of its own: a store name must be non-empty, "
                         f"not start with '.', and hold no '/', '\\' or NUL (stores with such names would share "
                         f"a directory)")
    if name.startswith(_RESERVED_PREFIX) or parse_name(name) is not None:
        raise ValueError(f"{what} {name!r} is the name of a store's own file: a store of that name would sit among "
                         f"the files of the partition's default store")
    return name


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
        if not isinstance(self.checkpoint_root_location, str) or not self.checkpoint_root_location:
            raise ValueError(f"checkpoint_root_location must be a non-empty path or URL, got "
                             f"{self.checkpoint_root_location!r}")
        for name in ("operator_id", "partition_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        check_store_name(self.store_name)

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
