"""``statecore repartition CHECKPOINT --operator N --to M``: a StatefulOperator's state moved
to another number of partitions, on this machine (:mod:`statecore.repartition`; for states
too big for one machine, ``pyspark_glue.repartition_state`` runs the same rewrite as a Spark
job). The protocol and what it refuses: ``docs/operating.md``, "repartition"."""
import contextlib

import click

from statecore import repartition as engine
from statecore.cli.output import BadInput, emit, main, print_table, progress
from statecore.conf import StateStoreConf
from statecore.operator_lock import OperatorLockedError

__all__ = ["repartition_command"]


@main.command("repartition")
@click.argument("checkpoint")
@click.option("--operator", "operator_id", type=int, required=True, help="the operator id")
@click.option("--to", "num_partitions", type=int, required=True, help="the new number of partitions (>= 1)")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def repartition_command(checkpoint, operator_id, num_partitions, as_json):
    """Move the state of operator OPERATOR under CHECKPOINT to TO partitions (stop the query
    first; it resumes with TO partitions and the same state). Refused while another command
    or a running query holds the operator's lock."""
    with contextlib.ExitStack() as locked:
        try:
            plan = locked.enter_context(engine.planned(checkpoint, operator_id, num_partitions, StateStoreConf()))
        except (engine.RepartitionError, OperatorLockedError, OSError) as e:  # OSError: no CHECKPOINT, a symlink loop
            raise BadInput(str(e)) from None
        engine.prepare(plan)
        with progress("reading old partitions", total=len(plan.stores) * plan.from_partitions) as advance:
            routed = engine.read_sources(plan, on_source=advance)
        with progress("writing new partitions", total=len(plan.stores) * plan.to_partitions) as advance:
            written = engine.write_targets(plan, routed, on_target=advance)
        engine.switch(plan)
        engine.finish(plan)
    emit(as_json, engine.summary(plan, written), _print)


def _print(result):
    click.echo(f"operator {result['operator_id']} of {result['checkpoint']}: {result['from_partitions']} -> "
               f"{result['to_partitions']} partitions at version {result['version']} (after batch "
               f"{result['batch_id']})")
    print_table("stores", ["store", "rows"], [(name, s["rows"]) for name, s in result["stores"].items()])
