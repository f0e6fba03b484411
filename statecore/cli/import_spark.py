"""``statecore import-spark``: a stateful operator's state moved off Spark's
HDFSBackedStateStoreProvider into a statecore checkpoint (:mod:`statecore.spark_import`
does the work; this module owns the arguments and the output). ``docs/operating.md``,
"import-spark", describes it."""
import click

from statecore.cli.output import BadInput, emit, main, progress
from statecore.operator_lock import OperatorLockedError
from statecore.spark_import import SparkImportError, import_spark_state

__all__ = ["import_spark"]


def _widths(values):
    """``{column: n}`` of the ``--string-width COL=N`` options."""
    out = {}
    for value in values:
        name, _, width = value.partition("=")
        if not name or not width.isdigit() or int(width) < 1:
            raise click.BadParameter(f"{value!r} is not COL=N with N >= 1", param_hint="--string-width")
        out[name] = int(width)
    return out


@main.command("import-spark")
@click.argument("spark_checkpoint")
@click.argument("statecore_checkpoint")
@click.option("--operator", "operator_id", type=click.IntRange(min=0), required=True,
              help="The stateful operator's id (the N of SPARK_CHECKPOINT/state/N).")
@click.option("--store-name", default="default", show_default=True, help="The operator's state store name.")
@click.option("--string-width", "string_widths", multiple=True, metavar="COL=N",
              help="The S<N> width of a string (or binary) column; default: its longest value, rounded up to 8.")
@click.option("--value-names", metavar="A,B,...",
              help="New names for the value columns, in order (e.g. count,sum for RunningAggregate).")
@click.option("--nulls-as-zero", is_flag=True, help="Import null values (not keys) as 0 instead of refusing them.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def import_spark(spark_checkpoint, statecore_checkpoint, operator_id, store_name, string_widths, value_names,
                 nulls_as_zero, as_json):
    """Import operator N's state from a Spark checkpoint (HDFSBackedStateStoreProvider) into
    STATECORE_CHECKPOINT/N: every version Spark retained, at the same version numbers, with
    the batch records a StatefulOperator continues from."""
    names = None if value_names is None else [n.strip() for n in value_names.split(",")]
    try:
        with progress("reading Spark's state files", disable=as_json) as advance:
            summary = import_spark_state(spark_checkpoint, statecore_checkpoint, operator_id,
                                         store_name=store_name, string_widths=_widths(string_widths),
                                         value_names=names, nulls_as_zero=nulls_as_zero, progress=advance)
    except (SparkImportError, OperatorLockedError) as e:
        raise BadInput(str(e)) from None
    emit(as_json, summary, _print_summary)


def _print_summary(s):
    first, last = s["versions"]
    click.echo(f"imported operator {s['operator_id']} ({s['num_partitions']} partitions, store {s['store_name']!r}) "
               f"from {s['spark_checkpoint']} into {s['statecore_checkpoint']}/{s['operator_id']}")
    click.echo(f"versions {first}..{last} (batch records {s['batches_recorded'][0]}..{s['batches_recorded'][1]}), "
               f"{s['rows']} keys at version {last}, {s['files_read']} Spark files read in {s['seconds']} s")
    click.echo(f"key {s['key_schema']}  value {s['value_schema']}")
    for name, w in s["string_widths"].items():
        click.echo(f"string column {name!r}: S{w['width']} ({w['chosen']}; longest value {w['longest']} bytes)")
    for note in s["notes"]:
        click.echo(f"note: {note}")
