"""``statecore inspect CHECKPOINT``: what a checkpoint holds, read from its files.

Per store: its versions (each attempt's delta and snapshot, with commit ids), files and
bytes, schemas, newest snapshot, and the key count at its newest version (the attempt the
operator's newest batch record names, else the default lineage's: what ``read_state``
reads). Per operator: its metadata (``_operator.json``) and batch records (``_commits/``).
Damaged files are shown as such, not verified: that is ``statecore verify``'s job.
"""
import click

from statecore import operator_files
from statecore.checkpoint_scan import NotACheckpointError, scan_checkpoint
from statecore.cli.output import bad_input, emit, main, print_table
from statecore.conf import StateStoreConf
from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError, VersionNotFoundError
from statecore.lineage import Chain
from statecore.provider import read_version_header
from statecore.schema_evolution import plan_state
from statecore.schema_file import SCHEMA_FILE, read_schema_history
from statecore.contracts import create_and_init_provider

__all__ = ["inspect_checkpoint"]

_READ_ERRORS = (StateCorruptionError, SchemaMismatchError, VersionNotFoundError, OSError, ValueError)


def _records(op):
    """``[record]`` of the operator's batch records, oldest first (``{"batch_id", "error"}`` for
    one that does not read)."""
    log = operator_files.commit_log(op.location)
    out = []
    for b in log.epochs():
        try:
            record = operator_files.read_commit_record(log, b)
        except ValueError as e:
            out.append({"batch_id": b, "error": str(e)})
            continue
        if record is not None:
            out.append({k: list(v) if isinstance(v, tuple) else v for k, v in record.items()})
    return out


def _newest_named(records, store_name, partition_id):
    """``(version, commit id bytes)`` the newest readable record names for that store, or None."""
    for record in reversed(records):
        if "error" in record:
            continue
        ids = record["commit_ids"] if record["store_name"] == store_name else \
            record.get("store_commit_ids", {}).get(store_name)
        if ids is not None and partition_id < len(ids):
            return record["version"], bytes.fromhex(ids[partition_id])
        return None
    return None


def _schema_changes(history):
    """Each entry of a store's schema history after the first: the version it starts at and
    its changes in plain words (docs/evolution.md)."""
    out = []
    for before, entry in zip(history.entries, history.entries[1:]):
        if entry.rewritten:
            changes = ["rewritten by `statecore rewrite`"]
        else:
            try:
                changes = plan_state(before.key, before.value, entry.key, entry.value, renames=dict(entry.renames),
                                     defaults=dict(entry.defaults)).describe()
            except SchemaMismatchError as e:  # a history written by hand: said, not raised
                changes = [f"not a change the rules allow: {e}"]
        out.append({"from_version": entry.from_version, "key_schema": entry.key.describe(),
                    "value_schema": entry.value.describe(), "changes": changes})
    return out


def _store(ref, records):
    files = ref.files()
    listing = files.list_versions()
    out = {"operator_id": ref.operator_id, "partition_id": ref.partition_id, "store_name": ref.store_name,
           "location": ref.location, "key_schema": None, "value_schema": None, "schema_history": [], "versions": [],
           "files": 0, "bytes": 0, "newest_version": None, "newest_commit_id": None, "newest_snapshot": None,
           "rows": None, "errors": []}
    try:
        history = read_schema_history(files)
    except (StateCorruptionError, UnsafeFileError) as e:
        history = None
        out["errors"].append(str(e))
    schemas = None if history is None else (history.newest.key, history.newest.value)
    if schemas is not None:
        out["key_schema"], out["value_schema"] = schemas[0].describe(), schemas[1].describe()
        out["schema_history"] = _schema_changes(history)
        out["files"] += 1
        out["bytes"] += files.size(SCHEMA_FILE)
    headers = {}

    def header(f):
        if f.name not in headers:
            headers[f.name] = read_version_header(files, f)
        return headers[f.name]

    attempts = {}
    for f in sorted(listing, key=lambda f: (f.version, f.kind, f.name)):
        size = files.size(f.name)
        out["files"] += 1
        out["bytes"] += size
        try:
            commit_id = f.commit_id if f.commit_id is not None else header(f)[0]
        except _READ_ERRORS as e:
            out["errors"].append(str(e))
            continue
        entry = attempts.setdefault((f.version, commit_id), {"version": f.version, "commit_id": commit_id.hex(),
                                                             "delta": None, "snapshot": None})
        entry[f.kind] = {"name": f.name, "bytes": size}
    out["versions"] = [attempts[k] for k in sorted(attempts)]
    snapshots = [a for a in out["versions"] if a["snapshot"] is not None]
    if snapshots:
        newest = snapshots[-1]
        out["newest_snapshot"] = {"version": newest["version"], "commit_id": newest["commit_id"],
                                  "name": newest["snapshot"]["name"]}
    named = _newest_named(records, ref.store_name, ref.partition_id) if ref.operator_id is not None else None
    try:
        if named is not None:
            version, commit_id = named
        else:
            version, commit_id = Chain(listing, header, files.mtime, files.path, ref.label()).default_top()
    except _READ_ERRORS as e:
        out["errors"].append(str(e))
        return out
    out["newest_version"], out["newest_commit_id"] = version, commit_id.hex()
    out["rows"] = _rows(ref, schemas, version, commit_id, out["errors"])
    return out


def _rows(ref, schemas, version, commit_id, errors):
    """The key count of that attempt, loaded read-only from the files (None if it does not load)."""
    if version == 0:
        return 0
    store_id = ref.store_id()
    if schemas is None or store_id is None:
        why = "no readable schema file" if schemas is None else "the store path does not end in <operator>/<partition>"
        errors.append(f"rows not counted: {why}")
        return None
    provider = create_and_init_provider(store_id, schemas[0].dtype, schemas[1].dtype, StateStoreConf())
    try:
        store = provider.get_read_store(version, commit_id)
        try:
            return store.metrics.num_keys
        finally:
            store.abort()
    except _READ_ERRORS as e:
        errors.append(f"version {version} does not load: {e}")
        return None
    finally:
        provider.close()


def _metadata(op):
    if not op.has_metadata:
        return None
    try:
        return operator_files.read_metadata(op.location)
    except ValueError as e:
        return {"error": str(e)}


def inspect_checkpoint(location):
    """What ``statecore inspect --json`` prints, as a dict."""
    checkpoint = scan_checkpoint(location)
    operators, stores = [], []
    if checkpoint.kind == "store":
        stores.append(_store(checkpoint.store, []))
    for op_id in sorted(checkpoint.operators):
        op = checkpoint.operators[op_id]
        records = _records(op)
        operators.append({"operator_id": op_id, "location": op.location, "partitions": sorted(op.partitions),
                          "store_names": sorted({n for s in op.partitions.values() for n in s}),
                          "metadata": _metadata(op), "batch_records": records})
        stores += [_store(ref, records) for ref in op.stores()]
    return {"checkpoint": checkpoint.location, "kind": checkpoint.kind, "operators": operators, "stores": stores}


def _versions_text(versions):
    if not versions:
        return "-"
    numbers = sorted({a["version"] for a in versions})
    text = f"{numbers[0]}..{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])
    extra = len(versions) - len(numbers)
    return text + (f" (+{extra} other attempts)" if extra else "")


def _print(data):
    kind = "a state root" if data["kind"] == "root" else "a store"
    click.echo(f"{data['checkpoint']}: {kind}, {len(data['stores'])} store(s)")
    for op in data["operators"]:
        meta = op["metadata"]
        click.echo(f"\noperator {op['operator_id']}: partitions {op['partitions']}, stores {op['store_names']}")
        if meta is None:
            click.echo("  no _operator.json")
        elif "error" in meta:
            click.echo(f"  _operator.json: {meta['error']}")
        else:
            click.echo(f"  _operator.json: {meta.get('num_partitions')} partitions, key columns "
                       f"{meta.get('key_columns')} {meta.get('key_column_types')}, store {meta.get('store_name')!r}"
                       + (f", event time {meta['event_time']!r}" if meta.get("event_time") else ""))
        if op["batch_records"]:
            print_table(f"batch records of operator {op['operator_id']}", ["batch", "version", "run", "commit ids"],
                        [(r["batch_id"], r.get("version", "-"), r.get("run_id", "-"),
                          r.get("error") or " ".join(r["commit_ids"])) for r in op["batch_records"]])
    schemas = {(str(s["key_schema"]), str(s["value_schema"])) for s in data["stores"]}
    for key, value in sorted(schemas):
        click.echo(f"schema: key {key}, value {value}")
    print_table("stores", ["operator", "partition", "store", "versions", "snapshots", "files", "bytes",
                           "newest (attempt)", "rows"],
                [("-" if s["operator_id"] is None else s["operator_id"],
                  "-" if s["partition_id"] is None else s["partition_id"], s["store_name"],
                  _versions_text(s["versions"]),
                  " ".join(str(a["version"]) for a in s["versions"] if a["snapshot"]) or "-",
                  s["files"], s["bytes"],
                  "-" if s["newest_version"] is None else f"{s['newest_version']} ({s['newest_commit_id']})",
                  "-" if s["rows"] is None else s["rows"]) for s in data["stores"]])
    changed = {(entry["from_version"], "; ".join(entry["changes"])) for s in data["stores"]
               for entry in s.get("schema_history", ())}
    for from_version, changes in sorted(changed):
        click.echo(f"schema changed from version {from_version}: {changes}")
    for s in data["stores"]:
        for error in s["errors"]:
            click.echo(f"{s['location']}: {error}")


@main.command("inspect")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def inspect_command(checkpoint, as_json):
    """What CHECKPOINT (a state root or a store directory) holds: operators, partitions,
    stores, versions and their commit ids, files, bytes, rows, schemas, metadata and batch
    records."""
    with bad_input(NotACheckpointError):
        data = inspect_checkpoint(checkpoint)
    emit(as_json, data, _print)
