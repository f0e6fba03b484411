"""A store directory's schema file: the history of the key and value schemas its versions were
written with, checked by every provider that opens the directory. Not a version file
(listings ignore it).

The first commit records the store's schemas; the first commit under other schemas (a query
whose state evolved, ``docs/evolution.md``) adds an entry, the file replaced whole. Version
files name their schemas by fingerprint (a delta's header) or by description (a snapshot's),
and :meth:`SchemaHistory.plans` gives the conversions between any two entries. A file of the
first format (one schema, no history) reads as a history of one entry."""
import dataclasses
import json

from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError
from statecore.schema import RowSchema, as_schema
from statecore.schema_evolution import plan_state

__all__ = ["SCHEMA_FILE", "MAX_SCHEMA_FILE_BYTES", "SchemaEntry", "SchemaHistory", "plan_change", "schema_file_bytes",
           "read_store_schemas", "read_schema_history", "record_schemas"]

SCHEMA_FILE = "_statecore.schema.json"  # not a version file: ignored by listings
MAX_SCHEMA_FILE_BYTES = 1 << 20
FORMAT = "statecore-state-schema-2"
_FORMAT_ONE_SCHEMA = "statecore-state-schema-1"


@dataclasses.dataclass(frozen=True)
class SchemaEntry:
    """One entry of a store's schema history: the schemas versions from ``from_version`` on
    were written with, and what declared the change from the entry before (``renames`` and
    ``defaults`` as sorted pairs; ``rewritten``: the rows were rewritten by a transform of the
    user's, so no plan leads here from older entries)."""

    key: RowSchema
    value: RowSchema
    from_version: int
    renames: tuple = ()
    defaults: tuple = ()
    rewritten: bool = False

    def describe(self):
        out = {"key": self.key.describe(), "value": self.value.describe(), "from_version": self.from_version}
        if self.renames:
            out["renames"] = dict(self.renames)
        if self.defaults:
            out["defaults"] = {name: _json_value(v) for name, v in self.defaults}
        if self.rewritten:
            out["rewritten"] = True
        return out

    @classmethod
    def from_description(cls, d):
        from_version = d["from_version"]
        if not isinstance(from_version, int) or isinstance(from_version, bool) or from_version < 0:
            raise ValueError(f"from_version must be an int >= 0, got {from_version!r}")
        renames = d.get("renames", {})
        defaults = d.get("defaults", {})
        if not isinstance(renames, dict) or not isinstance(defaults, dict):
            raise ValueError("renames and defaults must be objects")
        return cls(as_schema(RowSchema.from_description(d["key"]), key=True), RowSchema.from_description(d["value"]),
                   from_version, tuple(sorted((str(a), str(b)) for a, b in renames.items())),
                   tuple(sorted((str(n), _from_json_value(v)) for n, v in defaults.items())),
                   bool(d.get("rewritten", False)))


def _json_value(v):
    return {"bytes_hex": v.hex()} if isinstance(v, bytes) else v


def _from_json_value(v):
    if isinstance(v, dict):
        return bytes.fromhex(v["bytes_hex"])
    return v


class SchemaHistory:
    """A store's schema entries, oldest first (at least one)."""

    def __init__(self, entries):
        self.entries = tuple(entries)
        if not self.entries:
            raise ValueError("a schema history has at least one entry")

    @property
    def newest(self):
        return self.entries[-1]

    def latest_of(self, key_schema, value_schema):
        """The index of the newest entry of exactly these schemas, or None."""
        for i in range(len(self.entries) - 1, -1, -1):
            e = self.entries[i]
            if e.key == key_schema and e.value == value_schema:
                return i
        return None

    def entry_of(self, key_fingerprint, value_fingerprint, version):
        """The index of the entry a file of ``version`` whose header names these fingerprints
        was written under: the newest of those schemas in effect at that version (an entry
        whose ``from_version`` is not above it), or None."""
        for i in range(len(self.entries) - 1, -1, -1):
            e = self.entries[i]
            if (e.from_version <= version and e.key.fingerprint == key_fingerprint
                    and e.value.fingerprint == value_fingerprint):
                return i
        return None

    def with_entry(self, entry):
        return SchemaHistory(self.entries + (entry,))

    def plans(self, i, j):
        """The :class:`~statecore.schema_evolution.StatePlan` s that turn rows written under
        entry ``i`` into rows of entry ``j``, applied in turn: none when they are the same
        entry; the plans of each change from ``i`` on to ``j`` (with the renames and defaults
        each declared) when ``j`` came later; else one plan from ``i``'s schemas to ``j``'s by
        the rules alone. SchemaEvolutionError if the rules refuse a step; SchemaMismatchError
        when a rewrite lies between (rows before it read only in their own schemas)."""
        if i == j:
            return []
        old, new = self.entries[i], self.entries[j]
        if j < i:
            return [plan_state(old.key, old.value, new.key, new.value)]
        steps = []
        for k in range(i + 1, j + 1):
            before, e = self.entries[k - 1], self.entries[k]
            if e.rewritten:
                raise SchemaMismatchError(
                    f"versions before {e.from_version} were written before `statecore rewrite` changed the "
                    f"schemas to key {e.key.describe()}, value {e.value.describe()}: they read only in their own "
                    f"schemas (key {old.key.describe()}, value {old.value.describe()})")
            if before.key == e.key and before.value == e.value:
                continue
            steps.append(plan_state(before.key, before.value, e.key, e.value, renames=dict(e.renames),
                                    defaults=dict(e.defaults)))
        return steps

    def describe(self):
        return {"format": FORMAT, "schemas": [e.describe() for e in self.entries]}


def plan_change(history, key_schema, value_schema, changes=None):
    """The :class:`~statecore.schema_evolution.StatePlan` from ``history``'s newest schemas to
    ``key_schema`` and ``value_schema`` (RowSchemas) with the declared ``changes``
    (a SchemaChanges, or None), or None when they are the newest already.
    SchemaEvolutionError if the rules refuse the change."""
    newest = history.newest
    if newest.key == key_schema and newest.value == value_schema:
        return None
    return plan_state(newest.key, newest.value, key_schema, value_schema,
                      renames=None if changes is None else changes.renames,
                      defaults=None if changes is None else changes.defaults)


def schema_file_bytes(key_schema, value_schema):
    """The bytes of a new store's :data:`SCHEMA_FILE`: a history of its first schemas."""
    return history_bytes(SchemaHistory([SchemaEntry(key_schema, value_schema, 1)]))


def history_bytes(history):
    return json.dumps(history.describe(), indent=1).encode()


def read_schema_history(files):
    """The :class:`SchemaHistory` of the store directory ``files``, or None if it has none yet;
    StateCorruptionError if the schema file is unreadable."""
    path = files.path(SCHEMA_FILE)
    try:
        raw = files.read_bytes(SCHEMA_FILE, max_bytes=MAX_SCHEMA_FILE_BYTES)
    except FileNotFoundError:
        return None
    except UnsafeFileError as e:  # a FIFO, a device, a directory, or more than the bound: refused unread
        raise StateCorruptionError(path, None, f"unreadable schema file: {e.reason}") from None
    except OSError as e:  # a file we may not read
        raise StateCorruptionError(path, None, f"unreadable schema file: {e}") from None
    try:
        recorded = json.loads(raw)
        if recorded.get("format") == FORMAT:
            return SchemaHistory(SchemaEntry.from_description(d) for d in recorded["schemas"])
        key, value = RowSchema.from_description(recorded["key"]), RowSchema.from_description(recorded["value"])
        return SchemaHistory([SchemaEntry(as_schema(key, key=True), value, 1)])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise StateCorruptionError(path, None, f"unreadable schema file: {type(e).__name__}: {e}") from None


def read_store_schemas(files):
    """``(key_schema, value_schema)`` a store directory's newest versions were written with
    (its history's newest entry), or None if it has none yet; StateCorruptionError if the
    schema file is unreadable."""
    history = read_schema_history(files)
    return None if history is None else (history.newest.key, history.newest.value)


def record_schemas(files, entry, where):
    """Make ``entry`` the newest of the store directory's history before a version written with
    its schemas is published: a new history if there is none, the file replaced whole with the
    entry added if its newest has other schemas (the change checked by the rules and the
    entry's declarations again: SchemaEvolutionError), nothing if it has these."""
    history = read_schema_history(files)
    if history is None:
        first = dataclasses.replace(entry, renames=(), defaults=())
        try:
            files.write_atomic(SCHEMA_FILE, lambda f: f.write(history_bytes(SchemaHistory([first]))),
                               overwrite=False)
            return
        except FileExistsError:
            history = read_schema_history(files)
    newest = history.newest
    if newest.key == entry.key and newest.value == entry.value:
        return
    if not entry.rewritten:
        plan_state(newest.key, newest.value, entry.key, entry.value, renames=dict(entry.renames),
                   defaults=dict(entry.defaults))
    payload = history_bytes(history.with_entry(entry))
    if len(payload) > MAX_SCHEMA_FILE_BYTES:
        raise SchemaMismatchError(f"the schema history at {where} would exceed {MAX_SCHEMA_FILE_BYTES} bytes")
    files.write_atomic(SCHEMA_FILE, lambda f: f.write(payload), overwrite=True)
