"""Repartitioning a StatefulOperator's state as a Spark job: :func:`repartition_state`.

The same rewrite as ``statecore repartition`` (:mod:`statecore.repartition`), for states too
big for one machine: the driver plans, clears what an interrupted run left and writes the
journal; one task per new partition reads the old partitions' rows of its keys and writes
that partition's snapshots (verified); the driver then switches ``_operator.json`` over and
deletes the old files. The protocol is in ``docs/operating.md``, "repartition".
"""
import pyarrow as pa

from statecore import repartition as engine
from statecore.conf import StateStoreConf

__all__ = ["repartition_state"]

_STATUS_DDL = "partition int, store string, rows long"
_STATUS_SCHEMA = pa.schema([("partition", pa.int32()), ("store", pa.string()), ("rows", pa.int64())])


def _build(plan):
    def run(batches):
        for batch in batches:
            for q in batch.column(0).to_pylist():
                written = engine.build_partition(plan, q)
                yield pa.RecordBatch.from_pydict({"partition": [q] * len(written), "store": list(written),
                                                  "rows": list(written.values())}, schema=_STATUS_SCHEMA)
    return run


def repartition_state(spark, checkpoint_location, operator_id, num_partitions, *, conf=None):
    """Move the state of operator ``operator_id`` under ``checkpoint_location`` to
    ``num_partitions`` partitions with one Spark task per new partition; returns what was
    done (as ``statecore repartition --json`` prints it). Stop the query first: it resumes
    with ``num_partitions`` partitions and the same state. ``spark`` may be a classic or a
    Spark Connect session; the planning and the switch run in this process, so it must reach
    the checkpoint as the executors do.

    Raises
    ------
    statecore.repartition.RepartitionError (a ValueError)
        Not a StatefulOperator's checkpoint, no batch record, ``num_partitions < 1``, or a
        store whose keys are not routed by the key columns; nothing was written.
    statecore.operator_lock.OperatorLockedError
        Another command or a running query holds the operator's lock; nothing was written.
    """
    if conf is None:
        conf = StateStoreConf()
    elif not isinstance(conf, StateStoreConf):
        conf = StateStoreConf.from_spark_conf(conf)
    with engine.planned(checkpoint_location, operator_id, num_partitions, conf, "repartition_state") as plan:
        engine.prepare(plan)
        n = plan.to_partitions
        rows = (spark.range(0, n, 1, numPartitions=n).selectExpr("cast(id as int) as id")
                .mapInArrow(_build(plan), _STATUS_DDL).collect())
        written = {(r["store"], r["partition"]): r["rows"] for r in rows}
        built = sorted({q for _, q in written})
        if built != list(range(n)):
            raise RuntimeError(f"repartition of operator {operator_id}: expected one task per new partition "
                               f"0..{n - 1}, got {built}; nothing was switched")
        engine.switch(plan)
        engine.finish(plan)
    return engine.summary(plan, written)
