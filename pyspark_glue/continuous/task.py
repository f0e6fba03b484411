"""Continuous mode's tasks: the body of partition ``p``'s long-running task (read, ``fn``,
close each epoch: sink file, store commit, offset and commit messages to the driver's
``EpochCoordinator``), and the refusal of task retries. The epoch rules it follows are in
``docs/continuous.md`` ("Epochs, offsets, versions").
"""
import dataclasses
import time
import uuid

import numpy as np

from statecore.conf import StateStoreConf
from statecore.epoch import EpochCoordinatorRef
from statecore.ids import StateStoreId, StateStoreProviderId
from statecore.rpc import RpcError

from pyspark_glue import executor
from pyspark_glue.arrow import conform_output
from pyspark_glue.continuous.log import OPERATOR_ID
from pyspark_glue.continuous.sink import EpochSink
from pyspark_glue.operator_fn import PartitionContext, contract_of, open_task

__all__ = ["ContinuousTaskRetryError", "TaskSpec", "task_function"]


class ContinuousTaskRetryError(RuntimeError):
    """A continuous task was retried by Spark: not supported, since partition ``p`` would restart
    alone at an old epoch while the others go on."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What every task of one run needs; pickled into the job."""

    source: object
    fn: object
    state_root: str
    store_name: str
    key_dtype: np.dtype
    value_dtype: np.dtype
    conf: StateStoreConf
    arrow_schema: object  # pyarrow.Schema of the output, or None
    sink_path: str  # or None
    sink_storage_options: dict
    run_id: uuid.UUID
    coordinator_id: str
    address: tuple  # the driver's RpcEnv: the EpochCoordinator and the StateStoreCoordinator
    authkey: bytes
    start_epoch: int
    start_offsets: list
    start_commit_ids: tuple  # per partition, the attempt of version start_epoch - 1 to open; or None
    poll_interval_s: float


class _PartitionTask:
    """The body of partition ``p``'s long-running task."""

    def __init__(self, spec, partition_id):
        self.spec, self.partition_id = spec, partition_id
        self.contract = contract_of(spec.fn)  # each epoch gets its own handler (open_task)
        self.epochs = EpochCoordinatorRef.connect(spec.address, spec.coordinator_id, spec.authkey)
        executor.ensure_worker_registry(spec.address, spec.authkey)
        self.provider_id = StateStoreProviderId(
            StateStoreId(spec.state_root, OPERATOR_ID, partition_id, spec.store_name), spec.run_id)
        executor.unload_other_runs(self.provider_id)  # this run loads from files
        self.sink = None if spec.sink_path is None else EpochSink(spec.sink_path, spec.sink_storage_options)
        self.rows_in = self.epochs_closed = 0

    def _open(self, version, commit_id):
        """``(store, handler)``: the store at ``version`` and ``fn``'s handler of the epoch."""
        store, _ = executor.open_store(self.provider_id, self.spec.key_dtype, self.spec.value_dtype, version,
                                       self.spec.conf, commit_id=commit_id)
        context = PartitionContext(self.partition_id, version, {self.spec.store_name: store}, self.spec.store_name,
                                   None)
        return store, open_task(self.contract, context)

    def run(self):
        spec, p = self.spec, self.partition_id
        reader = spec.source.reader(p, spec.start_offsets[p])
        epoch = spec.start_epoch
        store = None
        try:
            store, handler = self._open(epoch - 1, None if spec.start_commit_ids is None else spec.start_commit_ids[p])
            outputs, rows, fn_s = [], 0, 0.0
            next_poll = 0.0
            while True:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + spec.poll_interval_s
                    try:
                        current = self.epochs.get_current_epoch()
                    except RpcError as e:  # unregistered at stop/restart, or the driver is gone
                        return {"partition": p, "ended": f"epoch coordinator gone: {e}", "epoch": epoch,
                                "rows_in": self.rows_in, "epochs_closed": self.epochs_closed}
                    while epoch < current:
                        self._close_epoch(store, handler, epoch, reader.offset(), outputs, rows, fn_s)
                        epoch += 1
                        store, handler = self._open(epoch - 1, store.commit_id)  # the attempt just committed
                        outputs, rows, fn_s = [], 0, 0.0
                batch = reader.next_batch()
                if batch is None:
                    time.sleep(max(0.0, next_poll - time.monotonic()))
                    continue
                started = time.perf_counter()
                rows += batch.num_rows
                out = handler.process(batch)
                if out is not None:
                    outputs += conform_output(out, spec.arrow_schema, "fn")
                fn_s += time.perf_counter() - started
        finally:
            reader.close()
            if store is not None and not store.has_committed:
                store.abort()

    def _close_epoch(self, store, handler, epoch, offset, outputs, rows, fn_s):
        spec, p = self.spec, self.partition_id
        started = time.perf_counter()
        out = handler.finish()
        if out is not None:
            outputs = outputs + conform_output(out, spec.arrow_schema, "fn.finish")
        if self.sink is not None:
            message = self.sink.write(epoch, p, outputs, spec.arrow_schema)
        elif outputs:
            raise ValueError("fn returned rows, but the query has no output_schema")
        else:
            message = {"file": None, "rows": 0}
        version = store.commit()
        if version != epoch:
            raise RuntimeError(f"partition {p}: the store committed version {version} at the end of epoch {epoch}")
        message.update(rows_in=rows, fn_s=fn_s, close_s=time.perf_counter() - started, commit_id=store.commit_id)
        self.epochs.report_partition_offset(p, epoch, offset)
        self.epochs.commit_partition_epoch(p, epoch, message)
        self.rows_in += rows
        self.epochs_closed += 1


def task_function(spec):
    """The function of the Spark job: one long-running task per partition."""

    def run(partition_id, iterator):
        from pyspark import TaskContext

        for _ in iterator:  # one element; read to the end so that PySpark can reuse the worker
            pass
        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx is not None else 0
        if attempt:
            raise ContinuousTaskRetryError(
                f"continuous execution does not support task retry: partition {partition_id} attempt {attempt} "
                f"would restart at epoch {spec.start_epoch} while the other partitions go on (the query fails "
                f"instead; restart it, or set max_restarts)")
        yield _PartitionTask(spec, partition_id).run()
    return run
