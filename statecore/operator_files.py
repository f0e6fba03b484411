"""What a :class:`~pyspark_glue.StatefulOperator` keeps under ``<checkpoint>/<operator_id>/``
beside its stores: ``_operator.json`` (the metadata fixed for the checkpoint's life), the
batch records ``_commits/<batch_id>`` (which attempt of each partition a batch committed)
and the outputs ``_output/<batch_id>/``. The operator writes them and
:func:`~pyspark_glue.read_state` reads them, so both take the layout from here. The rules
are in ``docs/operator.md`` and ``docs/lineage.md``.
"""
from statecore.errors import SchemaMismatchError
from statecore.checkpoint import CheckpointFiles, EpochLog, checked_commit_ids, checked_partition_count, parse_json
from statecore.schema import RowSchema, as_schema


__all__ = ["OPERATOR_METADATA_FILE", "OUTPUT_DIR", "COMMITS_DIR", "METADATA_FORMAT", "RECORD_FORMAT",
           "operator_dir", "output_dir", "delete_outputs_before", "read_metadata", "metadata_problems",
           "check_metadata", "compare_metadata", "schema_change", "replace_metadata", "moved_how", "commit_log",
           "KnownRecords", "commit_record", "read_commit_record",
           "checked_record",
           "store_ids", "REPARTITION_KEY", "REWRITE_KEY", "repartitioned", "WRITER_OPERATOR", "WRITER_IMPORT_SPARK",
           "WRITER_REPARTITION", "WRITER_REWRITE", "WRITERS"]

OPERATOR_METADATA_FILE = "_operator.json"  # in <checkpoint>/<operator_id>/
OUTPUT_DIR = "_output"  # <checkpoint>/<operator_id>/_output/<batch_id>/part-<p>.parquet
COMMITS_DIR = "_commits"  # <checkpoint>/<operator_id>/_commits/<batch_id>: the batch record
METADATA_FORMAT = "statecore-operator-1"
# In _operator.json after `statecore repartition`: {"batch_id", "version", "from_partitions",
# "record" (the record of batch_id at the new partitioning), "journal"} (docs/operating.md).
REPARTITION_KEY = "repartition"
# In the repartition block of a rewrite (statecore.rewrite runs repartition's protocol):
# {"key_schema", "value_schema"} of its default store.
REWRITE_KEY = "rewrite"
RECORD_FORMAT = "statecore-operator-commit-1"


def operator_dir(checkpoint_location, operator_id):
    return f"{checkpoint_location.rstrip('/')}/{operator_id}"


def output_dir(operator_location, batch_id):
    """Where the output of ``batch_id`` is written (as given to fsspec)."""
    return f"{operator_location}/{OUTPUT_DIR}/{batch_id}"


def delete_outputs_before(operator_location, batch_id, storage_options=None, known_from=None):
    """Delete the outputs of the batches before ``batch_id`` (best effort). ``known_from``: the
    oldest batch whose output may be there, when the caller knows it (a query's driver that
    deleted the older ones itself): then the output directory is not listed."""
    files = CheckpointFiles(f"{operator_location}/{OUTPUT_DIR}", storage_options)
    if known_from is None:
        files.delete_trees(name for b, name in files.numbered().items() if b < batch_id)
    else:
        files.delete_trees(str(b) for b in range(known_from, batch_id))


def metadata_problems(value, operator_id=None):
    """What is wrong with ``value`` (parsed ``_operator.json``) as an operator's metadata, as
    short reasons (none if it is sound): its format, a number of partitions within
    :data:`statecore.checkpoint.MAX_PARTITIONS`, its schemas, the shape of its last repartition,
    and (if given) the operator id of its directory."""
    if not isinstance(value, dict) or value.get("format") != METADATA_FORMAT:
        return [f"not the metadata of a statecore operator (format {METADATA_FORMAT!r})"]
    problems = []
    try:
        checked_partition_count(value.get("num_partitions"), "its num_partitions")
    except ValueError as e:
        problems.append(str(e).removeprefix("its num_partitions: "))
    if operator_id is not None and value.get("operator_id") != operator_id:
        problems.append(f"it is the metadata of operator {value.get('operator_id')!r:.40}, in the directory of "
                        f"operator {operator_id}")
    for part in ("key_schema", "value_schema"):
        try:
            RowSchema.from_description(value.get(part))
        except (TypeError, ValueError, KeyError) as e:
            problems.append(f"{part} {value.get(part)!r:.100} is not a schema: {e}")
    moved = value.get(REPARTITION_KEY)
    if moved is not None and not (isinstance(moved, dict) and isinstance(moved.get("batch_id"), int)
                                  and not isinstance(moved["batch_id"], bool) and moved["batch_id"] >= 0
                                  and isinstance(moved.get("record"), dict)):
        problems.append(f"{REPARTITION_KEY} {moved!r:.100} is not a repartition (batch_id, record)")
    return problems


def _checked_metadata(value, files):
    problems = metadata_problems(value)
    if problems:
        raise ValueError(f"{files.path(OPERATOR_METADATA_FILE)}: {'; '.join(problems)}")
    return value


def read_metadata(operator_location, storage_options=None):
    """The operator's recorded metadata, or None if there is none; ValueError naming the file if
    it is unreadable, damaged (DamagedMetadataError) or not an operator's metadata
    (:func:`metadata_problems`)."""
    files = CheckpointFiles(operator_location, storage_options)
    try:
        return _checked_metadata(files.read_json(OPERATOR_METADATA_FILE, "operator metadata"), files)
    except FileNotFoundError:
        return None


def check_metadata(operator_location, ours, storage_options=None):
    """Record ``ours`` on first use, or check it against what was recorded (see
    :func:`compare_metadata`); returns the recorded metadata. Both are checked by
    :func:`metadata_problems` first (ValueError naming the file)."""
    files = CheckpointFiles(operator_location, storage_options)
    recorded = files.record_once(OPERATOR_METADATA_FILE, _checked_metadata(ours, files), "operator metadata")
    if recorded is not ours:
        compare_metadata(ours, _checked_metadata(recorded, files), operator_location, storage_options)
    return recorded


def compare_metadata(ours, recorded, operator_location, storage_options=None, schemas=True, renames=None):
    """ValueError if the number of partitions, the key columns (but for ``renames``, {old
    name: new name}: a renamed column of the same type routes rows as before), their types or
    the store name differ; SchemaMismatchError if the key or value schema does (unless not
    ``schemas``: a caller that evolves them, :func:`schema_change`)."""
    where = CheckpointFiles(operator_location, storage_options).path(OPERATOR_METADATA_FILE)
    op = f"operator {ours['operator_id']} at {operator_location}"
    if recorded.get("num_partitions") != ours["num_partitions"]:
        raise ValueError(
            f"{op} was created with num_partitions={recorded.get('num_partitions')}, but this operator has "
            f"num_partitions={ours['num_partitions']}: the number of partitions of a stateful operator is fixed "
            f"for the life of its checkpoint (keys are routed by hash modulo that number); use "
            f"{recorded.get('num_partitions')}, or start from a new checkpoint ({where})")
    renames = renames or {}
    if [renames.get(c, c) for c in recorded.get("key_columns") or ()] != ours["key_columns"]:
        raise ValueError(f"{op} partitions by key columns {recorded.get('key_columns')}, not {ours['key_columns']} "
                         f"({where})")
    if recorded.get("key_column_types") != ours["key_column_types"]:
        raise ValueError(
            f"operator {ours['operator_id']}: key columns {ours['key_columns']} have types "
            f"{ours['key_column_types']}, but the checkpoint was written with {recorded.get('key_column_types')}: "
            f"rows would be routed to other partitions; cast them back ({where})")
    if recorded.get("event_time") != ours.get("event_time"):
        raise ValueError(f"{op} keeps event time by column {recorded.get('event_time')!r}, not "
                         f"{ours.get('event_time')!r}: its state expires by that column's watermark ({where})")
    if recorded.get("store_name", "default") != ours["store_name"]:
        raise ValueError(f"{op} uses store name {recorded.get('store_name')!r}, not {ours['store_name']!r} ({where})")
    for part in ("key_schema", "value_schema") if schemas else ():
        if [list(f) for f in recorded.get(part, [])] != [list(f) for f in ours[part]]:
            raise SchemaMismatchError(f"the {part.replace('_', ' ')} {ours[part]} of operator {ours['operator_id']} "
                                      f"differs from the one its checkpoint was written with: {recorded.get(part)} "
                                      f"({where})")


def schema_change(ours, recorded):
    """The recorded ``(key, value)`` RowSchemas when ``ours`` asks for others, else None."""
    old = tuple(RowSchema.from_description(recorded.get(part, [])) for part in ("key_schema", "value_schema"))
    new = tuple(RowSchema.from_description(ours[part]) for part in ("key_schema", "value_schema"))
    return None if old == new else (as_schema(old[0], key=True), old[1])


def replace_metadata(operator_location, ours, storage_options=None):
    """Rewrite ``_operator.json`` atomically as ``ours`` (checked by :func:`metadata_problems`
    first): a query whose state schemas changed, after its first batch under them."""
    files = CheckpointFiles(operator_location, storage_options)
    files.write_json(OPERATOR_METADATA_FILE, _checked_metadata(ours, files), indent=1)
    return ours


def commit_log(operator_location, storage_options=None):
    """The batch records of the operator at ``operator_location`` (``<checkpoint>/<operator_id>``)."""
    return EpochLog(f"{operator_location}/{COMMITS_DIR}", storage_options)


class KnownRecords:
    """The batch records of :func:`commit_log` ``log`` as a query's driver knows them while it
    holds the operator lock, when no other process writes records (``docs/operating.md``,
    "The operator lock"): listed once, then kept by the driver's own writes and deletes, with
    the records it wrote, so that a steady-state batch lists and reads none (each a request on
    an object store). :meth:`forget` when the lock had to be taken again or a batch failed."""

    def __init__(self, log):
        self.log = log
        self._epochs = None  # the batch ids with a record, once listed
        self._written = {}  # batch id -> the record this driver wrote, as read_commit_record gives it

    def epochs(self):
        """The batch ids with a record, ascending."""
        if self._epochs is None:
            self._epochs = set(self.log.epochs())
        return sorted(self._epochs)

    def record(self, batch_id, metadata):
        """:func:`read_commit_record` of ``batch_id``, without a read for a record this driver wrote."""
        known = self._written.get(batch_id)
        if known is not None and repartitioned(metadata) is None:
            return dict(known)
        return read_commit_record(self.log, batch_id, metadata)

    def write(self, batch_id, record):
        """Write the record of ``batch_id``, and keep it as a read of the file would give it."""
        path = self.log.path(batch_id)
        raw = self.log.write(batch_id, record)
        self._written = {batch_id: checked_record(parse_json(raw, path, "batch record"), batch_id, path)}
        if self._epochs is not None:
            self._epochs.add(batch_id)

    def delete(self, batch_ids):
        """Delete the records of ``batch_ids`` (best effort: one left behind is listed again)."""
        batch_ids = list(batch_ids)
        if not batch_ids:
            return
        if len(self.log.files.delete([str(b) for b in batch_ids])) < len(batch_ids):
            self.forget()  # one was missing, or could not be deleted: list again
            return
        if self._epochs is not None:
            self._epochs.difference_update(batch_ids)
        for b in batch_ids:
            self._written.pop(b, None)

    def forget(self):
        """Know nothing: the next call lists and reads the files again."""
        self._epochs, self._written = None, {}


#: Who wrote a batch record (its ``writer``): a StatefulOperator's batch, or one of the
#: commands that write records of their own. Records written before the field read as an
#: operator's.
WRITER_OPERATOR, WRITER_IMPORT_SPARK, WRITER_REPARTITION, WRITER_REWRITE = (
    "operator", "import-spark", "repartition", "rewrite")
WRITERS = frozenset({WRITER_OPERATOR, WRITER_IMPORT_SPARK, WRITER_REPARTITION, WRITER_REWRITE})


def commit_record(batch_id, num_partitions, store_name, run_id, commit_ids, base_commit_ids, *,
                  store_commit_ids=None, watermarks=None, query_id=None, batch_timestamp_ms=None, late_rows=None,
                  writer=WRITER_OPERATOR):
    """The record of a batch whose job succeeded: each partition's winning attempt of
    version ``batch_id + 1`` and the attempt of ``batch_id`` it opened; the winners of the
    operator's other stores (``{name: [id per partition]}``); with event time, the batch's
    watermarks and largest event time (``{"for_late_events_ms", "for_eviction_ms",
    "max_event_time_us"}``); the persistent id of the streaming query that ran it (None
    outside one, and for records written by ``statecore import-spark`` or ``repartition``); the
    batch's processing time in milliseconds (None: not known, as for those commands' records);
    the input rows the batch dropped as late, summed over its partitions (None: not known);
    who wrote it (:data:`WRITER_OPERATOR` and the others)."""
    if writer not in WRITERS:
        raise ValueError(f"unknown batch record writer {writer!r}")
    return {"format": RECORD_FORMAT, "batch_id": batch_id, "version": batch_id + 1,
            "num_partitions": num_partitions, "store_name": store_name, "run_id": str(run_id),
            "commit_ids": list(commit_ids), "base_commit_ids": list(base_commit_ids),
            "store_commit_ids": {name: list(ids) for name, ids in (store_commit_ids or {}).items()},
            "watermarks": watermarks, "query_id": query_id, "batch_timestamp_ms": batch_timestamp_ms,
            "late_rows": late_rows, "writer": writer}


def store_ids(record, store_name):
    """The attempts (one id per partition) a checked batch record names for store
    ``store_name``: its ``commit_ids`` for the record's own store, its
    ``store_commit_ids[store_name]`` for any other; None if it names none of that store."""
    if record.get("store_name", "default") == store_name:
        return record["commit_ids"]
    return record["store_commit_ids"].get(store_name)


def repartitioned(metadata):
    """The metadata's last repartition (see :data:`REPARTITION_KEY`), or None."""
    moved = (metadata or {}).get(REPARTITION_KEY)
    return moved if isinstance(moved, dict) else None


def moved_how(moved, metadata):
    """What the switch ``moved`` (:func:`repartitioned`) did, in words for errors: "rewritten
    by `statecore rewrite`" or "repartitioned from N to M partitions"."""
    if REWRITE_KEY in moved:
        return "rewritten by `statecore rewrite`"
    return (f"repartitioned from {moved.get('from_partitions')} to {(metadata or {}).get('num_partitions')} "
            f"partitions")


def read_commit_record(records, batch_id, metadata=None):
    """The record of ``batch_id`` in ``records`` (:func:`commit_log`), checked, its
    ``commit_ids`` and ``base_commit_ids`` tuples; None if there is none. ValueError naming
    the file if it is not a batch record.

    With the operator's ``metadata``: after a repartition at batch ``r``, the record of ``r``
    is the one ``_operator.json`` holds (the switch; the file ``_commits/<r>`` is rewritten
    after it), and batches before ``r`` are refused (their attempts are of the old
    partitioning)."""
    moved = repartitioned(metadata)
    if moved is not None and batch_id <= moved.get("batch_id", -1):
        if batch_id < moved["batch_id"]:
            rewritten = isinstance(moved["record"], dict) and moved["record"].get("writer") == WRITER_REWRITE
            change = "rewritten by statecore rewrite" if rewritten else (
                f"repartitioned from {moved.get('from_partitions')} to {metadata.get('num_partitions')} partitions")
            raise ValueError(
                f"operator {metadata.get('operator_id')} was {change} after batch {moved['batch_id']}: the state of "
                f"batch {batch_id} was not kept ({records.path(batch_id)})")
        return checked_record(dict(moved["record"]), batch_id, f"{records.path(batch_id)} (as in _operator.json)")
    try:
        record = records.read(batch_id)
    except FileNotFoundError:
        return None
    return checked_record(record, batch_id, records.path(batch_id))


def checked_record(record, batch_id, where):
    """``record`` (parsed JSON) as :func:`read_commit_record` returns it, or ValueError naming
    ``where`` if it is not the record of ``batch_id``."""
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT
            or record.get("batch_id") != batch_id or not isinstance(record.get("num_partitions"), int)):
        raise ValueError(f"{where} is not the record of batch {batch_id} of a statecore operator")
    for ids in ("commit_ids", "base_commit_ids"):
        record[ids] = checked_commit_ids(record.get(ids), record["num_partitions"], where)
    others = record.get("store_commit_ids") or {}
    if not isinstance(others, dict):
        raise ValueError(f"{where}: store_commit_ids is not a mapping of store names")
    record["store_commit_ids"] = {name: checked_commit_ids(ids, record["num_partitions"], where)
                                  for name, ids in others.items()}
    marks = record.get("watermarks")
    if marks is not None and (not isinstance(marks, dict) or not all(
            isinstance(marks.get(k), int) for k in ("for_late_events_ms", "for_eviction_ms"))
            or not (marks.get("max_event_time_us") is None or isinstance(marks["max_event_time_us"], int))):
        raise ValueError(f"{where}: watermarks {marks!r} are not a batch's watermarks")
    record.setdefault("watermarks", None)
    stamp = record.setdefault("batch_timestamp_ms", None)
    if stamp is not None and (not isinstance(stamp, int) or isinstance(stamp, bool) or stamp < 0):
        raise ValueError(f"{where}: batch_timestamp_ms {stamp!r} is not a time in milliseconds")
    if record.setdefault("writer", WRITER_OPERATOR) not in WRITERS:
        raise ValueError(f"{where}: writer {record['writer']!r} is not one of statecore's")
    late = record.setdefault("late_rows", None)  # records from before it was kept: None
    if late is not None and (not isinstance(late, int) or isinstance(late, bool) or late < 0):
        raise ValueError(f"{where}: late_rows {late!r} is not a count of rows")
    return record
