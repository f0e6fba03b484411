"""Finding what a checkpoint holds, without Spark: its operators, their partitions, the stores
of each partition, and each store's version files.

Two layouts are recognized. A *state root*, as a :class:`~pyspark_glue.StatefulOperator`
writes it: ``<root>/<operator>/<partition>/`` holds the default store's files and
``<root>/<operator>/<partition>/<store name>/`` each other store's
(:meth:`statecore.ids.StateStoreId.store_checkpoint_location`), beside the operator's
``_operator.json`` and ``_commits/`` (:mod:`statecore.operator_files`). And a *bare store*:
one directory of version files and its schema file. A directory is a store when it holds
the schema file or a version file (:func:`statecore.lineage.parse_name`).

This module only lists directories; the files' bytes are read by the checked readers.
"""
import dataclasses

from statecore.checkpoint import CheckpointFiles
from statecore.files import open_store_files
from statecore.ids import StateStoreId
from statecore.lineage import parse_name
from statecore import operator_files
from statecore.operator_files import COMMITS_DIR, OPERATOR_METADATA_FILE, operator_dir
from statecore.schema_file import SCHEMA_FILE

__all__ = ["NotACheckpointError", "StoreRef", "OperatorRef", "Checkpoint", "scan_checkpoint", "is_store_dir"]


class NotACheckpointError(ValueError):
    """The path holds neither a state root nor a store."""


@dataclasses.dataclass(frozen=True)
class StoreRef:
    """One store directory. ``operator_id`` and ``partition_id`` are None for a bare store."""

    location: str
    operator_id: int = None
    partition_id: int = None
    store_name: str = StateStoreId.DEFAULT_STORE_NAME

    def files(self, storage_options=None):
        """Its :class:`statecore.files.StoreFiles`."""
        return open_store_files(self.location, storage_options)

    def store_id(self):
        """The :class:`statecore.StateStoreId` whose directory this is, so that a provider can
        open it; None for a bare store whose path does not end in ``<operator>/<partition>``
        (or ``<operator>/<partition>/<store name>``)."""
        if self.operator_id is not None:
            return StateStoreId(self.location.rsplit("/", 3 if self.store_name != "default" else 2)[0],
                                self.operator_id, self.partition_id, self.store_name)
        parts = self.location.rstrip("/").split("/")
        for tail, name in ((2, StateStoreId.DEFAULT_STORE_NAME), (3, parts[-1])):
            numbers = parts[-tail:][:2]
            if len(parts) > tail and all(n.isascii() and n.isdigit() for n in numbers):
                sid = StateStoreId("/".join(parts[:-tail]) or "/", int(numbers[0]), int(numbers[1]), name)
                if sid.store_checkpoint_location() == self.location.rstrip("/"):
                    return sid
        return None

    def label(self):
        """How messages name it: ``operator 0 partition 3 store 'default'``, or its location."""
        if self.operator_id is None:
            return self.location
        return f"operator {self.operator_id} partition {self.partition_id} store {self.store_name!r}"


@dataclasses.dataclass
class OperatorRef:
    """One operator of a state root: ``partitions`` maps each partition id (its directories,
    and those its metadata counts) to ``{store name: StoreRef}`` (empty if it never committed)."""

    operator_id: int
    location: str
    has_metadata: bool
    has_records: bool
    partitions: dict

    def stores(self):
        return [s for p in sorted(self.partitions) for _, s in sorted(self.partitions[p].items())]


@dataclasses.dataclass
class Checkpoint:
    """What :func:`scan_checkpoint` found: ``kind`` is ``"root"`` (``operators`` by id) or
    ``"store"`` (``store`` is the one bare store; ``operators`` is empty)."""

    location: str
    kind: str
    operators: dict
    store: StoreRef = None

    def stores(self):
        if self.kind == "store":
            return [self.store]
        return [s for op in sorted(self.operators) for s in self.operators[op].stores()]


def is_store_dir(entries):
    """Whether a directory with these ``(name, is_dir)`` entries is a store directory."""
    return any(not is_dir and (name == SCHEMA_FILE or parse_name(name) is not None) for name, is_dir in entries)


def _numbered_dirs(entries):
    return sorted(int(name) for name, is_dir in entries if is_dir and name.isascii() and name.isdigit())


def _partition_count(operator_location, storage_options):
    """The partition count ``_operator.json`` records, or 0 if it records none readable (verify
    reports an unreadable or damaged one; finding goes on from the directories). The count is
    bounded by :data:`statecore.checkpoint.MAX_PARTITIONS` when the metadata is read."""
    try:
        return operator_files.read_metadata(operator_location, storage_options)["num_partitions"]
    except (OSError, ValueError, TypeError):
        return 0


def _partition_stores(root, operator_id, partition_id, storage_options):
    """``{store name: StoreRef}`` of one partition directory: the default store in it, and each
    sub-directory that is a store (the StatefulProcessor's timer stores are named
    ``__timers``...); temporaries (``.`` names) and names no store can have are left out."""
    default = StateStoreId(root, operator_id, partition_id)
    location = default.store_checkpoint_location()
    entries = CheckpointFiles(location, storage_options).entries()
    stores = {}
    if is_store_dir(entries):
        stores[default.store_name] = StoreRef(location, operator_id, partition_id)
    for name, is_dir in entries:
        if not is_dir or name.startswith(".") or name == default.store_name:
            continue
        try:
            sid = StateStoreId(root, operator_id, partition_id, name)
        except ValueError:
            continue  # a name no store can have (statecore.ids.check_store_name): not a store's directory
        sub = sid.store_checkpoint_location()
        if is_store_dir(CheckpointFiles(sub, storage_options).entries()):
            stores[name] = StoreRef(sub, operator_id, partition_id, name)
    return stores


def _scan_operator(root, operator_id, storage_options):
    location = operator_dir(root, operator_id)
    entries = CheckpointFiles(location, storage_options).entries()
    names = {name for name, _ in entries}
    has_metadata = OPERATOR_METADATA_FILE in names
    on_disk = _numbered_dirs(entries)
    partitions = {p: {} for p in range(_partition_count(location, storage_options) if has_metadata else 0)}
    for p in on_disk:  # only directories are listed: a partition the metadata counts and no directory has is empty
        partitions[p] = _partition_stores(root, operator_id, p, storage_options)
    return OperatorRef(operator_id, location, has_metadata, COMMITS_DIR in names, dict(sorted(partitions.items())))


def scan_checkpoint(location, storage_options=None):
    """The :class:`Checkpoint` at ``location`` (a path or fsspec URL).

    Raises
    ------
    NotACheckpointError
        Nothing there, or neither a store nor a state root with at least one operator
        (an operator's own directory is named as such, with the root to give instead).
    """
    root = location.rstrip("/") or "/"
    entries = CheckpointFiles(root, storage_options).entries()
    if not entries:
        raise NotACheckpointError(f"{location} is not a statecore checkpoint: it is empty, missing, or not a "
                                  f"directory")
    if is_store_dir(entries):
        return Checkpoint(root, "store", {}, StoreRef(root))
    if any(name == OPERATOR_METADATA_FILE for name, _ in entries):
        parent, _, name = root.rpartition("/")
        raise NotACheckpointError(f"{location} is the directory of operator {name}, not a checkpoint: give its "
                                  f"state root {parent or '/'} (and --operator {name} where the command takes it)")
    numbered = _numbered_dirs(entries)
    if numbered and is_store_dir(CheckpointFiles(f"{root}/{numbered[0]}", storage_options).entries()):
        parent, _, name = root.rpartition("/")
        raise NotACheckpointError(f"{location} is the directory of operator {name}, not a checkpoint: give its "
                                  f"state root {parent or '/'} (and --operator {name} where the command takes it)")
    operators = {}
    for op in numbered:
        found = _scan_operator(root, op, storage_options)
        if found.has_metadata or found.has_records or any(found.partitions.values()):
            operators[op] = found
    if not operators:
        raise NotACheckpointError(
            f"{location} is not a statecore checkpoint: it holds no store ({SCHEMA_FILE} or version files such as "
            f"1_<commit id>.delta) and no operator directories <operator>/<partition>/ with stores")
    return Checkpoint(root, "root", operators)
