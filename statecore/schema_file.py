"""A store directory's schema file: the key and value schemas its first commit records, checked
by every provider that opens the directory. Not a version file (listings ignore it)."""
import json

from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError
from statecore.schema import RowSchema

__all__ = ["SCHEMA_FILE", "MAX_SCHEMA_FILE_BYTES", "schema_file_bytes", "read_store_schemas", "check_schema_file",
           "write_schema_file"]

SCHEMA_FILE = "_statecore.schema.json"  # not a version file: ignored by listings
MAX_SCHEMA_FILE_BYTES = 1 << 20


def schema_file_bytes(key_schema, value_schema):
    """The bytes of a store's :data:`SCHEMA_FILE`: the schemas its first commit records."""
    record = {"format": "statecore-state-schema-1", "key": key_schema.describe(), "value": value_schema.describe()}
    return json.dumps(record, indent=1).encode()


def read_store_schemas(files):
    """``(key_schema, value_schema)`` a store directory recorded with its first commit, or
    None if it has none yet; StateCorruptionError if the schema file is unreadable."""
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
        return RowSchema.from_description(recorded["key"]), RowSchema.from_description(recorded["value"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise StateCorruptionError(path, None, f"unreadable schema file: {type(e).__name__}: {e}") from None


def check_schema_file(files, key_schema, value_schema, where):
    """Whether the store directory ``files`` (``where`` names it) records its schemas yet;
    SchemaMismatchError if they are not ``key_schema`` and ``value_schema``."""
    stored = read_store_schemas(files)
    if stored is None:
        return False
    for part, recorded, given in (("key", stored[0], key_schema), ("value", stored[1], value_schema)):
        if recorded != given:
            raise SchemaMismatchError(
                f"the {part} schema {given.describe()} differs from the one the store at "
                f"{where} was written with: {recorded.describe()}")
    return True


def write_schema_file(files, key_schema, value_schema, where):
    """Record the schemas in the store directory ``files`` unless another writer did first (then
    check them against its record, as :func:`check_schema_file`)."""
    payload = schema_file_bytes(key_schema, value_schema)
    try:
        files.write_atomic(SCHEMA_FILE, lambda f: f.write(payload), overwrite=False)
    except FileExistsError:
        check_schema_file(files, key_schema, value_schema, where)
