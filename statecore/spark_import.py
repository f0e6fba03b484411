"""Moving a stateful operator's state off Spark's HDFSBackedStateStoreProvider: the state of
operator N in a Spark streaming checkpoint becomes a statecore checkpoint holding the same
versions, which a :class:`~pyspark_glue.StatefulOperator` with the same operator id and
number of partitions continues from (``statecore import-spark``; ``docs/operating.md``).

This module owns the checkpoint-level rules: which Spark checkpoints and operators it takes
(and the clear refusal of the others), which versions Spark retained, the schemas, and the
writing, through the store's public API, of every retained version into a staging
directory whose entries are moved into place at the end, so that bad input or a failure
leaves the target as it was; the writing holds the operator's lock
(:mod:`statecore.operator_lock`). The bytes of Spark's files are :mod:`statecore.spark_rows`'s.
"""
import contextlib
import json
import time
import uuid

import fsspec
import numpy as np

from statecore import operator_files, operator_lock
from statecore.conf import StateStoreConf
from statecore.errors import UnsafeFileError
from statecore.files import StoreFiles
from statecore.ids import StateStoreId
from statecore.lineage import ROOT_COMMIT_ID
from statecore.schema import key_value_schemas
from statecore.spark_rows import (MAX_SPARK_FILE_BYTES, SparkFileError, check_hadoop_crc, field_type, lz4_stream,
                                  max_crc_bytes, records, row_columns)
from statecore.contracts import create_and_init_provider

__all__ = ["SparkImportError", "SparkOperator", "find_spark_operator", "import_spark_state"]

_HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
_PROVIDER_KEY = "spark.sql.streaming.stateStore.providerClass"
_CODEC_KEY = "spark.sql.streaming.stateStore.compression.codec"
_ENCODING_KEY = "spark.sql.streaming.stateStore.encodingFormat"
_ROW_CHECKSUM_KEY = "spark.sql.streaming.stateStore.rowChecksum.enabled"
_ROCKSDB_MARKS = (".zip", ".changelog")
_STRING_ROUNDING = 8  # an automatic S<n> width is the longest value rounded up to this
# The most bytes of an offsets log entry, the operator's _metadata/metadata or a state schema
# file read: each is a few lines of JSON (a schema of thousands of columns is well under this).
MAX_SPARK_METADATA_BYTES = 16 << 20
# The most versions one partition's import commits: every version from 1 to the last batch's is
# a statecore commit (a file written and synced), the ones before the oldest retained snapshot
# empty, so a snapshot named 999999999.snapshot would otherwise start a billion commits.
MAX_IMPORTED_VERSIONS = 1_000_000


class SparkImportError(ValueError):
    """The Spark checkpoint, operator or target is not one this import takes; nothing was written."""


class SparkOperator:
    """What :func:`find_spark_operator` found of one operator's state in a Spark checkpoint.

    ``files[p]`` is ``{"delta": {version: path}, "snapshot": {version: path}}`` of partition
    ``p``; ``last_version`` is the version of the last committed batch (``batch + 1``);
    ``key_fields`` and ``value_fields`` are ``[(name, FieldType)]`` from the state schema."""

    def __init__(self, fs, location, operator_id, store_name, num_partitions, files, last_version, key_fields,
                 value_fields, notes, reader=None):
        self.fs, self.location, self.operator_id, self.store_name = fs, location, operator_id, store_name
        self.reader = reader  # the _SparkFiles the files are read through
        self.num_partitions, self.files, self.last_version = num_partitions, files, last_version
        self.key_fields, self.value_fields, self.notes = key_fields, value_fields, notes

    def first_versions(self):
        """Per partition, the oldest version from which every version up to ``last_version``
        loads (Spark's rule: from a snapshot, or from 0, and a delta for each version after
        it); it is 0 or a snapshot's version. SparkImportError naming a missing file."""
        out = []
        for p in range(self.num_partitions):
            deltas, snapshots = self.files[p]["delta"], self.files[p]["snapshot"]
            # Down from the last version while each has a file (so as many steps as files, whatever
            # the version numbers): the oldest snapshot on that run, or 0 if it reaches 0.
            first, missing = None, self.last_version
            while missing > 0 and (missing in deltas or missing in snapshots):
                first = missing if missing in snapshots else first
                missing -= 1
            first = 0 if missing == 0 else first
            if first is None:
                raise SparkImportError(
                    f"partition {p} of operator {self.operator_id} cannot load version {self.last_version} (the last "
                    f"committed batch's): {missing}.delta is missing and no later snapshot stands in for it")
            out.append(first)
        return out


def _numeric(name):
    """Whether ``name`` is ASCII digits (``str.isdigit`` alone takes "²", which ``int`` refuses)."""
    return name.isascii() and name.isdigit()


def _ls(fs, path):
    """``{name: is_dir}`` of a directory's entries (empty if it is missing)."""
    try:
        found = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:  # a symlink loop, a directory we may not list
        raise SparkImportError(f"{path} cannot be listed: {e}") from None
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type") == "directory" for e in found}


class _SparkFiles:
    """The files of a Spark checkpoint, read through :class:`statecore.files.StoreFiles`: each
    refused unread (SparkImportError naming it) if it is not a regular file or is larger than
    the bound its kind allows."""

    def __init__(self, location, root, storage_options):
        self.root = root
        self.files = StoreFiles(location, storage_options)

    def read(self, path, max_bytes):
        """The bytes of ``path`` (a path under the checkpoint); FileNotFoundError if missing."""
        try:
            return self.files.read_bytes(path[len(self.root.rstrip("/")) + 1:], max_bytes=max_bytes)
        except FileNotFoundError:
            raise
        except UnsafeFileError as e:
            raise SparkImportError(str(e)) from None
        except OSError as e:  # a symlink loop, a file we may not read
            raise SparkImportError(f"{path} cannot be read: {e}") from None


def _json(text, where, what):
    """``text`` parsed as JSON; SparkImportError naming ``where`` if it is not JSON or nests
    deeper than the interpreter's recursion limit allows."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise SparkImportError(f"{where} is not {what}: its JSON does not parse (or nests too deep)") from None


def _offsets_conf(reader, fs, root):
    """The SQL settings Spark recorded in its newest offsets log entry (``{}`` if none)."""
    numbered = [int(n) for n, is_dir in _ls(fs, f"{root}/offsets").items() if _numeric(n) and not is_dir]
    if not numbered:
        return {}
    path = f"{root}/offsets/{max(numbered)}"
    lines = reader.read(path, MAX_SPARK_METADATA_BYTES).decode("utf-8", "replace").splitlines()
    entry = _json(lines[1], path, "a Spark offsets log entry") if len(lines) > 1 else {}
    conf = entry.get("conf", {}) if isinstance(entry, dict) else None
    if not isinstance(conf, dict) or not all(isinstance(v, str) for v in conf.values()):
        raise SparkImportError(f"{path} is not a Spark offsets log entry (its conf is not a map of strings)")
    return conf


def _read_utf(data, pos, where):
    """A Java ``writeUTF`` string at ``pos``: ``(text, next position)``."""
    if pos + 2 > len(data):
        raise SparkImportError(f"{where} is truncated")
    size = int.from_bytes(data[pos:pos + 2], "big")
    if pos + 2 + size > len(data):
        raise SparkImportError(f"{where} is truncated")
    return data[pos + 2:pos + 2 + size].decode("utf-8", "surrogatepass"), pos + 2 + size


def _read_state_schema(data, where):
    """``(key JSON, value JSON)`` of a state schema file: ``v1`` (two UTF strings) or ``v2``
    (each schema as an int32 count of UTF chunks)."""
    version, pos = _read_utf(data, 0, where)
    texts = []
    for _ in range(2):
        if version == "v1":
            text, pos = _read_utf(data, pos, where)
        elif version == "v2":
            chunks = int.from_bytes(data[pos:pos + 4], "big", signed=True)
            pos += 4
            parts = []
            for _ in range(max(chunks, 0)):
                part, pos = _read_utf(data, pos, where)
                parts.append(part)
            text = "".join(parts)
        else:
            raise SparkImportError(f"{where} is a state schema file of format {version!r}; import-spark reads v1 "
                                   f"and v2 (Spark 3.x and 4.x aggregations, deduplications and joins)")
        texts.append(_json(text, where, "a state schema file"))
    return texts


def _schema_fields(schema_json, what):
    if not isinstance(schema_json, dict) or schema_json.get("type") != "struct":
        raise SparkImportError(f"the {what} schema is not a struct: {schema_json!r:.200}")
    fields = []
    listed = schema_json.get("fields", [])
    if not isinstance(listed, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                               and "type" in f for f in listed):
        raise SparkImportError(f"the {what} schema's fields are not Spark's (a name and a type each): {listed!r:.200}")
    for f in listed:
        try:
            fields.append((f["name"], field_type(f["name"], f["type"])))
        except SparkFileError as e:
            raise SparkImportError(f"the state's {what} {e}") from None
    return fields


def find_spark_operator(location, operator_id, store_name="default", storage_options=None):
    """The :class:`SparkOperator` of ``operator_id`` in the Spark checkpoint at ``location``;
    SparkImportError naming what is wrong for anything this import does not take."""
    fs, root = fsspec.core.url_to_fs(location, **dict(storage_options or {}))
    root = root.rstrip("/") or "/"
    reader = _SparkFiles(location, root, storage_options)
    top = _ls(fs, root)
    if not top:
        raise SparkImportError(f"{location} is not a Spark streaming checkpoint: it is missing or empty")
    if not ({"offsets", "commits", "metadata"} & set(top)) or not top.get("state"):
        raise SparkImportError(f"{location} is not a Spark streaming checkpoint with state: expected offsets/, "
                               f"commits/ and state/ (found {', '.join(sorted(top)) or 'nothing'})")
    operators = sorted(int(n) for n, d in _ls(fs, f"{root}/state").items() if d and _numeric(n))
    op_dir = f"{root}/state/{operator_id}"
    entries = _ls(fs, op_dir)
    partitions = sorted(int(n) for n, d in entries.items() if d and _numeric(n))
    if operator_id not in operators or not partitions:
        raise SparkImportError(f"operator {operator_id} has no state in {location} (operators with state: "
                               f"{', '.join(map(str, operators)) or 'none'})")
    conf = _offsets_conf(reader, fs, root)
    notes = []
    provider = conf.get(_PROVIDER_KEY, _HDFS_PROVIDER)
    rocksdb = sorted({n for p in partitions for n, d in _ls(fs, f"{op_dir}/{p}").items()
                      if n.endswith(_ROCKSDB_MARKS) or (d and n == "SSTs")})
    if rocksdb or "RocksDB" in provider:
        shown = ", ".join(n + ("/" if n == "SSTs" else "") for n in rocksdb[:4]) or provider
        raise SparkImportError(f"operator {operator_id} in {location} keeps its state in RocksDB ({shown}): "
                               f"import-spark reads HDFSBackedStateStoreProvider files (<v>.delta, <v>.snapshot) "
                               f"only")
    store_names = _operator_store_names(reader, fs, op_dir, partitions)
    if len(store_names) > 1 or any(n.startswith(("left-", "right-")) for n in store_names):
        raise SparkImportError(f"operator {operator_id} in {location} is a stream-stream join (state stores "
                               f"{', '.join(sorted(store_names))}): its state is lists of rows per key over several "
                               f"stores, which a statecore operator does not keep; import-spark reads operators "
                               f"with one store of fixed-width rows (aggregations)")
    if store_names and store_name not in store_names:
        raise SparkImportError(f"operator {operator_id} in {location} has no store named {store_name!r} (it has "
                               f"{', '.join(sorted(store_names))})")
    codec = conf.get(_CODEC_KEY, "lz4")
    if codec.lower() not in ("lz4", "org.apache.spark.io.lz4compressioncodec"):
        raise SparkImportError(f"the state of {location} is compressed with {codec!r}; import-spark reads lz4 (Spark's "
                               f"default)")
    if conf.get(_ENCODING_KEY, "unsaferow") != "unsaferow" or conf.get(_ROW_CHECKSUM_KEY, "false") != "false":
        raise SparkImportError(f"the state of {location} is written with {_ENCODING_KEY}={conf.get(_ENCODING_KEY)} "
                               f"and {_ROW_CHECKSUM_KEY}={conf.get(_ROW_CHECKSUM_KEY)}; import-spark reads plain "
                               f"UnsafeRows")
    num_partitions = len(partitions)
    if partitions != list(range(num_partitions)):
        raise SparkImportError(f"operator {operator_id} in {location} has partition directories {partitions}, not "
                               f"0..{num_partitions - 1}")
    sub = "" if store_name == "default" else f"/{store_name}"
    files = [_version_files(fs, f"{op_dir}/{p}{sub}") for p in range(num_partitions)]
    committed = sorted(int(n) for n, d in _ls(fs, f"{root}/commits").items() if _numeric(n) and not d)
    if not committed:
        raise SparkImportError(f"{location} has no committed batch (commits/ is empty): there is no state to import")
    last_version = committed[-1] + 1
    newer = sorted({v for f in files for kind in f.values() for v in kind if v > last_version})
    if newer:
        notes.append(f"versions {newer} were written by a batch that did not commit; left out, as Spark's restart "
                     f"would re-run that batch")
    schema_path = f"{op_dir}/0{sub}/_metadata/schema"
    try:
        key_json, value_json = _read_state_schema(reader.read(schema_path, MAX_SPARK_METADATA_BYTES), schema_path)
    except FileNotFoundError:
        raise SparkImportError(f"operator {operator_id} in {location} has no state schema file ({schema_path}); "
                               f"Spark writes one from 3.0 on") from None
    return SparkOperator(fs, location, operator_id, store_name, num_partitions, files, last_version,
                         _schema_fields(key_json, "key"), _schema_fields(value_json, "value"), notes, reader)


def _operator_store_names(reader, fs, op_dir, partitions):
    """The store names Spark recorded for the operator (``_metadata/metadata``, Spark 3.5+),
    else the named store directories in its first partition."""
    path = f"{op_dir}/_metadata/metadata"
    try:
        lines = reader.read(path, MAX_SPARK_METADATA_BYTES).decode("utf-8", "replace").split("\n", 1)
    except FileNotFoundError:
        lines = []
    try:
        if len(lines) == 2:
            return {s["storeName"] for s in _json(lines[1], path, "an operator's metadata").get("stateStoreInfo", [])}
    except (AttributeError, KeyError, TypeError):
        pass
    return {n for n, d in _ls(fs, f"{op_dir}/{partitions[0]}").items() if d and not n.startswith(("_", "."))} \
        or {"default"}


def _version_files(fs, directory):
    """``{"delta": {v: path}, "snapshot": {v: path}}`` of a store directory, named as Spark's
    provider finds them (``<v>.delta``, ``<v>.snapshot``; anything else ignored)."""
    out = {"delta": {}, "snapshot": {}}
    for name, is_dir in _ls(fs, directory).items():
        parts = name.split(".")
        if not is_dir and len(parts) == 2 and _numeric(parts[0]) and parts[1].lower() in out:
            out[parts[1].lower()][int(parts[0])] = f"{directory}/{name}"
    return out


# -- reading one file -----------------------------------------------------------------------------

def _read_spark_file(op, path, snapshot, key_fields, value_fields):
    """``(keys, values, removes)`` of one delta or snapshot: :class:`RowColumns` of every
    record's key and of the puts' values, and the removes mask, checksums checked."""
    data = op.reader.read(path, MAX_SPARK_FILE_BYTES)
    directory, name = path.rsplit("/", 1)
    try:
        crc = op.reader.read(f"{directory}/.{name}.crc", max_crc_bytes(len(data)))
    except FileNotFoundError:
        crc = None
    try:
        if crc is not None:
            check_hadoop_crc(data, crc, path)
        found = records(lz4_stream(data, path), path, snapshot=snapshot)
        keys = row_columns(found.buffer, found.key_starts, found.key_lengths, key_fields, path)
        puts = ~found.removes
        values = row_columns(found.buffer, found.value_starts[puts], found.value_lengths[puts], value_fields, path)
    except SparkFileError as e:
        raise SparkImportError(str(e)) from None
    return keys, values, found.removes


class _Columns:
    """The numpy columns of the statecore schemas, filled from Spark rows: the string widths
    (given, or the longest value rounded up) and what to do with null values."""

    def __init__(self, op, widths, value_names, nulls_as_zero):
        self.op, self.nulls_as_zero = op, nulls_as_zero
        self.key_names = [name for name, _ in op.key_fields]
        spark_value_names = [name for name, _ in op.value_fields]
        if value_names is not None:
            if len(value_names) != len(spark_value_names):
                raise SparkImportError(f"--value-names gives {len(value_names)} names for the {len(spark_value_names)} "
                                       f"value columns {spark_value_names}")
        self.value_names = list(value_names or spark_value_names)
        names = self.key_names + self.value_names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SparkImportError(f"the state's columns {names} name {twice} more than once; rename the value "
                                   f"columns with --value-names")
        variable = {name for name, kind in op.key_fields + op.value_fields if kind.variable}
        for name in widths:
            if name not in variable:
                raise SparkImportError(f"--string-width {name}=...: {name!r} is not a string column of the state "
                                       f"(string columns: {sorted(variable) or 'none'})")
        self.given = dict(widths)
        self.longest = {name: 0 for name in variable}
        self.widths = None

    def scan(self, keys, values):
        """Pass 1 over one file: null checks and the longest value of each string column."""
        for fields, cols, what in ((self.op.key_fields, keys, "key"), (self.op.value_fields, values, "value")):
            for name, kind in fields:
                nulls = int(cols.nulls[name].sum())
                if nulls and (what == "key" or not self.nulls_as_zero):
                    raise SparkImportError(
                        f"{what} column {name!r} holds {nulls} null value(s); statecore rows have no nulls"
                        + ("" if what == "key" else " (--nulls-as-zero imports them as 0)"))
                if kind.variable and len(cols.lengths[name]):
                    self.longest[name] = max(self.longest[name], int(cols.lengths[name].max()))

    def settle_widths(self):
        """The S<n> width of every string column, once every file is scanned."""
        self.widths = {}
        for name, longest in self.longest.items():
            kind = dict(self.op.key_fields + self.op.value_fields)[name]
            if name in self.given:
                if longest > self.given[name]:
                    raise SparkImportError(f"column {name!r} holds a value of {longest} bytes (its longest), longer "
                                           f"than --string-width {name}={self.given[name]}")
                self.widths[name] = self.given[name]
            elif kind.spark == "binary":
                raise SparkImportError(f"binary column {name!r} needs a width: --string-width {name}=N (its longest "
                                       f"value is {longest} bytes)")
            else:
                self.widths[name] = max(_STRING_ROUNDING, -(-longest // _STRING_ROUNDING) * _STRING_ROUNDING)
        self.key_dtype = self._dtype(self.op.key_fields, self.key_names)
        self.value_dtype = self._dtype(self.op.value_fields, self.value_names)

    def _dtype(self, fields, names):
        return np.dtype([(new, f"S{self.widths[name]}" if kind.variable else kind.dtype)
                         for (name, kind), new in zip(fields, names)])

    def array(self, cols, fields, names, dtype):
        out = np.zeros(cols.count, dtype)
        for (name, kind), new in zip(fields, names):
            column = cols.variable(name, self.widths[name]) if kind.variable else cols.values[name]
            out[new] = np.where(cols.nulls[name], np.zeros((), out.dtype[new]), column)
        return out


# -- the import -----------------------------------------------------------------------------------

def import_spark_state(spark_checkpoint, statecore_checkpoint, operator_id, *, store_name="default",
                       string_widths=None, value_names=None, nulls_as_zero=False, storage_options=None,
                       progress=None):
    """Import operator ``operator_id``'s state from the Spark checkpoint into
    ``<statecore_checkpoint>/<operator_id>`` and return a summary (a dict, as the command
    prints it). ``progress(n)`` is called as files are read. SparkImportError (nothing
    written) for bad input; see ``docs/operating.md``, "import-spark"."""
    begun = time.perf_counter()
    op = find_spark_operator(spark_checkpoint, operator_id, store_name, storage_options)
    fs, target = fsspec.core.url_to_fs(statecore_checkpoint, **dict(storage_options or {}))
    target = target.rstrip("/") or "/"
    _refuse_existing(fs, target, statecore_checkpoint, operator_id)
    firsts = op.first_versions()
    if op.last_version > MAX_IMPORTED_VERSIONS:
        raise SparkImportError(f"the last committed batch of {spark_checkpoint} is {op.last_version - 1}: import-spark "
                               f"commits every version from 1 to it, at most {MAX_IMPORTED_VERSIONS} "
                               f"(MAX_IMPORTED_VERSIONS)")
    columns = _Columns(op, dict(string_widths or {}), value_names, nulls_as_zero)
    plan = [_partition_plan(op, p, base) for p, base in enumerate(firsts)]
    for p, steps in enumerate(plan):  # pass 1: checks and string widths, nothing written
        for _version, kind, path in steps:
            keys, values, _removes = _read_spark_file(op, path, kind == "snapshot", op.key_fields, op.value_fields)
            columns.scan(keys, values)
            if progress:
                progress(1)
    columns.settle_widths()
    first = max(firsts)
    stage = f"{target}/.import-spark-{operator_id}-{uuid.uuid4().hex}"
    operator_path = f"{target}/{operator_id}"
    created = [path for path in (operator_path, target) if not fs.exists(path)]
    done = False
    locked = contextlib.ExitStack()
    try:
        locked.enter_context(operator_lock.held(statecore_checkpoint, operator_id, "import-spark", storage_options))
        _refuse_existing(fs, target, statecore_checkpoint, operator_id)  # again, now that no one else writes
        ids, rows = [], []
        for p, steps in enumerate(plan):  # pass 2: the versions, written under the staging root
            partition_ids, count = _write_partition(op, columns, stage, p, firsts[p], steps, progress)
            ids.append(partition_ids)
            rows.append(count)
        metadata = _metadata(op, columns)
        staged = operator_files.operator_dir(stage, operator_id)
        operator_files.check_metadata(staged, metadata, storage_options)
        records = operator_files.commit_log(staged, storage_options)
        run_id = str(uuid.uuid4())
        for version in range(max(first, 1), op.last_version + 1):
            records.write(version - 1, operator_files.commit_record(
                version - 1, op.num_partitions, store_name, run_id, [i[version] for i in ids],
                [i.get(version - 1, ROOT_COMMIT_ID.hex()) for i in ids], writer=operator_files.WRITER_IMPORT_SPARK))
        # Beside the lock, entry by entry; _operator.json last, so that until it lands the
        # directory is no StatefulOperator's checkpoint.
        for name in sorted(_ls(fs, staged), key=lambda n: (n == operator_files.OPERATOR_METADATA_FILE, n)):
            fs.mv(f"{staged}/{name}", f"{operator_path}/{name}", recursive=True)
        done = True
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(stage, recursive=True)
        locked.close()  # the lock released
        for path in created if not done else ():  # only what this call created, once empty
            with contextlib.suppress(OSError):
                if not _ls(fs, path):
                    fs.rmdir(path)
    return {"spark_checkpoint": spark_checkpoint, "statecore_checkpoint": statecore_checkpoint,
            "operator_id": operator_id, "store_name": store_name, "num_partitions": op.num_partitions,
            "versions": [first, op.last_version], "batches_recorded": [max(first, 1) - 1, op.last_version - 1],
            "key_columns": columns.key_names, "value_columns": columns.value_names,
            "key_schema": metadata["key_schema"], "value_schema": metadata["value_schema"],
            "spark_value_columns": [name for name, _ in op.value_fields],
            "string_widths": {name: {"width": w, "longest": columns.longest[name],
                                     "chosen": "given" if name in columns.given else "longest value, rounded up to "
                                                                                     f"a multiple of {_STRING_ROUNDING}"}
                              for name, w in columns.widths.items()},
            "rows": sum(rows), "rows_per_partition": rows,
            "files_read": sum(len(steps) for steps in plan), "notes": op.notes,
            "seconds": round(time.perf_counter() - begun, 3)}


def _refuse_existing(fs, target, statecore_checkpoint, operator_id):
    """SparkImportError unless ``<target>/<operator_id>`` is missing or holds nothing but the
    operator's lock."""
    found = [n for n in _ls(fs, f"{target}/{operator_id}") if not operator_lock.is_lock_file(n)]
    if found:
        raise SparkImportError(f"{statecore_checkpoint} already holds a statecore checkpoint for operator "
                               f"{operator_id} ({target}/{operator_id} is not empty); import into a new checkpoint")


def _partition_plan(op, p, base):
    """``[(version, kind, path)]``: the files partition ``p`` is imported from, oldest first
    (the base snapshot, if any, then one delta per version; a snapshot where a delta is missing)."""
    deltas, snapshots = op.files[p]["delta"], op.files[p]["snapshot"]
    steps = [(base, "snapshot", snapshots[base])] if base > 0 else []
    for v in range(base + 1, op.last_version + 1):
        steps.append((v, "delta", deltas[v]) if v in deltas else (v, "snapshot", snapshots[v]))
    return steps


def _write_partition(op, columns, stage, p, base, steps, progress):
    """Commit partition ``p``'s versions under ``stage``; returns ``({version: commit id},
    rows at the last version)``. A partition whose oldest retained version is a snapshot at
    ``base`` gets empty versions 1..base-1 first (statecore's versions start at 0); a
    snapshot of ``base`` lets statecore's own cleanup delete them at the end."""
    conf = StateStoreConf(min_deltas_for_snapshot=0 if base else StateStoreConf().min_deltas_for_snapshot,
                          min_versions_to_retain=max(1, op.last_version - base))  # every retained version stays
    provider = create_and_init_provider(StateStoreId(stage, op.operator_id, p, op.store_name),
                                        columns.key_dtype, columns.value_dtype, conf)
    ids = {0: ROOT_COMMIT_ID.hex()}
    try:
        for v in range(1, base):
            store = provider.get_store(v - 1)
            store.commit()
            ids[v] = store.commit_id
        count = 0
        for version, kind, path in steps:
            keys, values, removes = _read_spark_file(op, path, kind == "snapshot", op.key_fields, op.value_fields)
            key_rows = columns.array(keys, op.key_fields, columns.key_names, columns.key_dtype)
            value_rows = columns.array(values, op.value_fields, columns.value_names, columns.value_dtype)
            store = provider.get_store(version - 1)
            if kind == "snapshot":
                _replace_all(store, key_rows, value_rows)
            else:
                _apply_delta(store, key_rows, value_rows, removes)
            store.commit()
            ids[version] = store.commit_id
            count = store.metrics.num_keys
            if version == base:
                provider.do_maintenance()  # the snapshot of the base, which the cleanup below needs
            if progress:
                progress(1)
        provider.do_maintenance()
    finally:
        provider.close()
    return ids, count


def _apply_delta(store, keys, values, removes):
    """A Spark delta's records applied as Spark replays them: per key, the last record wins."""
    if not len(keys):
        return
    packed = np.ascontiguousarray(keys).view(f"S{keys.dtype.itemsize}")
    _, from_end = np.unique(packed[::-1], return_index=True)
    last = np.sort(len(keys) - 1 - from_end)
    put_index = np.cumsum(~removes) - 1  # record i's row among the values (puts only)
    puts, gone = last[~removes[last]], last[removes[last]]
    if len(gone):
        store.remove_batch(keys[gone])
    if len(puts):
        store.put_batch(keys[puts], values[put_index[puts]])


def _replace_all(store, keys, values):
    """The store's state made exactly ``keys``/``values`` (a snapshot)."""
    for old_keys, _old_values in store.iter_batches():
        _, found = _lookup(keys, old_keys)
        if (~found).any():
            store.remove_batch(old_keys[~found])
    if len(keys):
        store.put_batch(keys, values)


def _lookup(keys, probe):
    """``(index, found)`` of each row of ``probe`` among ``keys`` (equal bytes), by sorting."""
    width = keys.dtype.itemsize
    have = np.ascontiguousarray(keys).view(f"S{width}") if width else np.zeros(len(keys), "S1")
    want = np.ascontiguousarray(probe).view(f"S{width}") if width else np.zeros(len(probe), "S1")
    order = np.argsort(have, kind="stable")
    at = np.searchsorted(have[order], want)
    at = np.minimum(at, max(len(have) - 1, 0))
    found = (have[order][at] == want) if len(have) else np.zeros(len(want), np.bool_)
    return order[at] if len(have) else at, found


def _metadata(op, columns):
    """The operator's ``_operator.json`` record, as a StatefulOperator writes it."""
    key, value = key_value_schemas(columns.key_dtype, columns.value_dtype)
    kinds = dict(op.key_fields)
    return {"format": operator_files.METADATA_FORMAT, "operator_id": op.operator_id,
            "num_partitions": op.num_partitions, "key_columns": columns.key_names,
            "key_column_types": [kinds[name].spark for name in columns.key_names], "store_name": op.store_name,
            "key_schema": key.describe(), "value_schema": value.describe()}
