"""``statecore dump CHECKPOINT --operator N --format parquet|csv|jsonl --out PATH``: every key and
value of an operator's store at one version, written to one file.

What is read is what ``read_state`` reads (:func:`statecore.state_reads.plan_read`: the
version and attempts the batch records name), through each store's batch iterator; the
file is written by :mod:`statecore.export_files` under a temporary name beside ``--out`` and
renamed into place once whole, so a failed dump leaves nothing behind.
"""
import os
import uuid

import click

from statecore import operator_files
from statecore.checkpoint_scan import NotACheckpointError, scan_checkpoint
from statecore.cli.output import BadInput, Unsound, bad_input, emit, main, progress
from statecore.conf import StateStoreConf
from statecore.errors import StateCorruptionError, VersionNotFoundError
from statecore.export_files import FORMATS, NotTextError, open_writer
from statecore.ids import StateStoreId
from statecore.lineage import Chain
from statecore.provider import read_version_header
from statecore.schema_file import read_store_schemas
from statecore.state_reads import PARTITION_ID_COLUMN, plan_read
from statecore.contracts import create_and_init_provider


def _operator_reads(checkpoint, operator_id, partition, version, store_name):
    """``[(partition id, StateStoreId, version, commit id)]`` and the schemas, for a state root."""
    if operator_id is None:
        if len(checkpoint.operators) != 1:
            raise NotACheckpointError(f"{checkpoint.location} holds operators {sorted(checkpoint.operators)}: "
                                      f"give --operator")
        operator_id = next(iter(checkpoint.operators))
    if operator_id not in checkpoint.operators:
        raise NotACheckpointError(f"operator {operator_id} does not exist in {checkpoint.location}: it has "
                                  f"operator(s) {sorted(checkpoint.operators)}")
    try:
        plan = plan_read(checkpoint.location, operator_id, store_name, version)
    except FileNotFoundError as e:
        raise NotACheckpointError(str(e)) from None
    except ValueError:
        damage = _damaged_record(checkpoint.location, operator_id, version)
        if damage is not None:
            raise Unsound(f"{damage} (nothing was written; statecore verify lists every problem)") from None
        raise
    partitions = plan.partitions
    if partition is not None:
        if partition not in partitions:
            raise NotACheckpointError(f"partition {partition} of operator {operator_id} does not exist in "
                                      f"{checkpoint.location}: it has partitions {partitions}")
        partitions = [partition]
    reads = [(p, StateStoreId(checkpoint.location, operator_id, p, store_name), plan.version,
              None if plan.commit_ids is None else plan.commit_ids[p]) for p in partitions]
    return reads, plan.key_schema, plan.value_schema, PARTITION_ID_COLUMN


def _damaged_record(location, operator_id, version):
    """The ValueError of the batch record a read of ``version`` (None: the newest) follows, if
    that file is damaged (not JSON, not a batch record); None if it is sound or missing. A
    damaged record is damaged state (exit 1), not bad input."""
    records = operator_files.commit_log(operator_files.operator_dir(location, operator_id))
    batch = records.latest() if version is None else version - 1
    if batch is None or batch < 0:
        return None
    try:
        operator_files.checked_record(records.read(batch), batch, records.path(batch))
    except FileNotFoundError:
        return None
    except ValueError as e:
        return e
    return None


def _store_reads(checkpoint, operator_id, partition, version, store_name):
    """The same for a bare store: its default lineage, no partition column."""
    if operator_id is not None or partition is not None:
        raise NotACheckpointError(f"{checkpoint.location} is a single store: --operator and --partition do not apply")
    ref = checkpoint.store
    store_id = ref.store_id()
    if store_id is None:
        raise NotACheckpointError(f"{ref.location} is a store outside the <root>/<operator>/<partition> layout, "
                                  f"which a store cannot be opened from; give its state root instead")
    files = ref.files()
    schemas = read_store_schemas(files)
    if schemas is None:
        raise NotACheckpointError(f"{ref.location} has no schema file: it has never committed")
    listing = files.list_versions()
    chain = Chain(listing, lambda f: read_version_header(files, f), files.mtime, files.path, ref.label())
    if version is None:
        version = chain.default_top()[0]
    commit_id = chain.default_id(version)  # VersionNotFoundError above the newest version
    if version != 0 and not any(f.version == version for f in listing):
        raise VersionNotFoundError(f"version {version} does not exist in {ref.location}: it holds versions "
                                   f"{listing.versions()}")
    return [(None, store_id, version, commit_id)], schemas[0], schemas[1], None


def _write(reads, key, value, partition_column, fmt, f, rows_per_batch):
    """Every row of every read into ``f``; returns the row count."""
    writer = open_writer(fmt, f, key.dtype, value.dtype, partition_column)
    try:
        rows = _write_rows(reads, key, value, writer, rows_per_batch)
    except BaseException:
        try:
            writer.close()  # the temporary file is deleted; a writer left open fails when collected
        except Exception:
            pass
        raise
    writer.close()
    return rows


def _write_rows(reads, key, value, writer, rows_per_batch):
    rows = 0
    with progress("dumping partitions", len(reads)) as advance:
        for p, store_id, version, commit_id in reads:
            if version > 0:
                provider = create_and_init_provider(store_id, key.dtype, value.dtype, StateStoreConf())
                try:
                    for keys, values in provider.version_rows(version, commit_id, rows_per_batch):
                        writer.write(keys, values, p)
                        rows += len(keys)
                finally:
                    provider.close()
            advance(1)
    return rows


@main.command("dump")
@click.argument("checkpoint")
@click.option("--operator", "operator_id", type=click.IntRange(min=0),
              help="The operator (may be left out when the checkpoint has one).")
@click.option("--partition", type=click.IntRange(min=0), help="Only this partition (default: all).")
@click.option("--version", type=click.IntRange(min=0),
              help="The version (default: the one the newest batch record committed).")
@click.option("--store-name", default=StateStoreId.DEFAULT_STORE_NAME, show_default=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The file to write (replaced whole).")
@click.option("--rows-per-batch", default=65536, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def dump_command(checkpoint, operator_id, partition, version, store_name, fmt, out, rows_per_batch, as_json):
    """Write every key and value of an operator's store (at the version the batch records
    name) to OUT as parquet, csv or JSON lines: the key fields, the value fields, and
    partition_id."""
    if fmt != "jsonl":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise BadInput(f"--format {fmt} needs pyarrow, which is not installed (pip install pyarrow, or use "
                           f"--format jsonl)") from None
    out = os.path.abspath(out)
    directory = os.path.dirname(out)
    if not os.path.isdir(directory):
        raise BadInput(f"the directory of --out {out} does not exist")
    with bad_input(NotACheckpointError, OSError):  # OSError: a symlink loop or a dangling link as CHECKPOINT
        found = scan_checkpoint(checkpoint)
    with bad_input(NotACheckpointError, VersionNotFoundError, ValueError):
        plan = _store_reads if found.kind == "store" else _operator_reads
        reads, key, value, partition_column = plan(found, operator_id, partition, version, store_name)
    tmp = os.path.join(directory, f".{os.path.basename(out)}.{uuid.uuid4().hex}.tmp")
    try:
        f = open(tmp, "xb")
    except OSError as e:  # a name too long, a directory we may not write to
        raise BadInput(f"--out {out} cannot be written: {e.strerror}") from None
    try:
        with f:
            with bad_input(NotTextError, VersionNotFoundError):
                try:
                    rows = _write(reads, key, value, partition_column, fmt, f, rows_per_batch)
                except StateCorruptionError as e:
                    raise Unsound(f"{e} (nothing was written; statecore verify lists every problem)") from None
            f.flush()
            os.fsync(f.fileno())
        with bad_input(OSError):  # --out became a directory, or a file we may not replace
            os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    data = {"out": out, "format": fmt, "rows": rows, "version": reads[0][2] if reads else None,
            "partitions": [p for p, *_ in reads], "columns": [*key.names, *value.names]
            + ([partition_column] if partition_column else [])}
    emit(as_json, data, lambda d: click.echo(f"wrote {d['rows']} rows of version {d['version']} "
                                             f"({', '.join(d['columns'])}) to {d['out']}"))
