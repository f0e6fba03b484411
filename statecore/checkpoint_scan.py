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
from statecore.operator_files import COMMITS_DIR, OPERATOR_METADATA_FILE, operator_dir
from statecore.provider import SCHEMA_FILE

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
    """The partition count ``_operator.json`` records, or 0 if it records none readable
    (verify reports an unreadable one; finding goes on from the directories)."""
    try:
        recorded = CheckpointFiles(operator_location, storage_options).read_json(OPERATOR_METADATA_FILE)
        count = recorded["num_partitions"]
        return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _scan_operator(root, operator_id, storage_options):
    location = operator_dir(root, operator_id)
    entries = CheckpointFiles(location, storage_options).entries()
    names = {name for name, _ in entries}
    has_metadata = OPERATOR_METADATA_FILE in names
    partition_ids = set(_numbered_dirs(entries))
    if has_metadata:
        partition_ids.update(range(_partition_count(location, storage_options)))
    partitions = {}
    for p in sorted(partition_ids):
        default = StateStoreId(root, operator_id, p)
        part_location = default.store_checkpoint_location()
        part_entries = CheckpointFiles(part_location, storage_options).entries()
        stores = {}
        if is_store_dir(part_entries):
            stores[default.store_name] = StoreRef(part_location, operator_id, p)
        for name, is_dir in part_entries:
            if not is_dir or name.startswith((".", "_")) or name == default.store_name:
                continue
            try:
                sid = StateStoreId(root, operator_id, p, name)
            except ValueError:
                continue  # a name no store can have (statecore.ids.check_store_name): not a store's directory
            sub = sid.store_checkpoint_location()
            if is_store_dir(CheckpointFiles(sub, storage_options).entries()):
                stores[name] = StoreRef(sub, operator_id, p, name)
        partitions[p] = stores
    return OperatorRef(operator_id, location, has_metadata, COMMITS_DIR in names, partitions)


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
