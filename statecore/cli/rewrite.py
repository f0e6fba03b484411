"""``statecore rewrite CHECKPOINT --operator N --transform module:function``: a StatefulOperator's
state rewritten through a function of the user's, on this machine (:mod:`statecore.rewrite`).
The contract, the protocol and what it refuses: ``docs/rewrite.md``."""
import click

from statecore import rewrite as engine
from statecore.cli.output import bad_input, emit, main, print_table, progress
from statecore.conf import StateStoreConf
from statecore.operator_lock import OperatorLockedError
from statecore.repartition import RepartitionError, plan_repartition

__all__ = ["rewrite_command"]


@main.command("rewrite")
@click.argument("checkpoint")
@click.option("--operator", "operator_id", type=int, required=True, help="the operator id")
@click.option("--transform", "transform", required=True,
              help="module:function, called with (keys, values) per batch; returns (keys, values)")
@click.option("--dry-run", is_flag=True, help="run the transform and report what would change; write nothing")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def rewrite_command(checkpoint, operator_id, transform, dry_run, as_json):
    """Rewrite the state of operator OPERATOR under CHECKPOINT through TRANSFORM (stop the query
    first; it resumes from the new state, with a fn declaring the new schemas). Refused while
    another command or a running query holds the operator's lock."""
    conf = StateStoreConf()
    with bad_input(RepartitionError, OSError):  # OSError: no CHECKPOINT, a symlink loop
        plan = plan_repartition(checkpoint, operator_id, None, conf)
    steps = len(plan.stores) * plan.from_partitions * (1 if dry_run else 2)
    with bad_input(RepartitionError, OperatorLockedError), progress("rewriting", total=steps) as advance:
        result = engine.rewrite(checkpoint, operator_id, transform, conf, dry_run=dry_run, on_source=advance,
                                on_target=advance)
    emit(as_json, result, _print)


def _print(result):
    if "finished" in result:
        click.echo(f"operator {result['operator_id']} of {result['checkpoint']}: finished the interrupted rewrite "
                   f"at version {result['version']} (after batch {result['batch_id']}); the transform was not run "
                   f"again")
        return
    done = "would rewrite" if result["dry_run"] else "rewrote"
    click.echo(f"operator {result['operator_id']} of {result['checkpoint']}: {done} store {result['store']!r} at "
               f"version {result['version']} (after batch {result['batch_id']}): {result['rows_in']} rows in, "
               f"{result['rows_out']} out")
    click.echo("schemas: " + "; ".join(result["schemas"]["change"]))
    print_table("partitions", ["partition", "rows in", "rows out", "dropped"],
                [(p["partition"], p["rows_in"], p["rows_out"], p["dropped"]) for p in result["partitions"]])
