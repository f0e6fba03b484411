"""Continuous mode's driver: :func:`start_continuous` and the :class:`ContinuousQuery` handle.

It owns the query thread (runs, restarts from the checkpoint, teardown), the epoch timer,
the callbacks through which the ``EpochCoordinator`` commits epochs in order (offsets log,
sink commit, commits log), and the cluster check. Threads: the caller's; the query thread;
per run an epoch-timer thread; the RpcEnv's threads, which run the coordinator's callbacks.
Public methods of :class:`ContinuousQuery` may be called from any thread. The design
(numbering, restart, failures) is in ``docs/continuous.md``.
"""
import collections
import logging
import threading
import time
import uuid

from statecore.conf import StateStoreConf
from statecore.epoch import EpochCoordinatorRef
from statecore.rpc import CALL_ERRORS, RpcError
from statecore.schema import key_value_schemas

from pyspark_glue import driver as glue_driver
from pyspark_glue import spark_internals
from pyspark_glue.arrow import output_schemas
from pyspark_glue.continuous.log import STATE_DIR, QueryLogs
from pyspark_glue.continuous.sink import EpochSink
from pyspark_glue.continuous.sources import ContinuousSource, positive_int
from pyspark_glue.continuous.task import TaskSpec, task_function
from pyspark_glue.operator_fn import contract_of
from pyspark_glue.rdd import ship_function_module
from pyspark_glue.session_kind import require_classic

__all__ = ["ContinuousQuery", "ContinuousQueryException", "start_continuous", "task_slots"]

log = logging.getLogger(__name__)


class ContinuousQueryException(Exception):
    """Why a continuous query terminated (Spark's ``StreamingQueryException``); the cause is
    ``__cause__``."""


def task_slots(sc):
    """``(slots, cores, task_cpus)``: how many tasks ``sc``'s cluster runs at once (cores of
    the registered executors, the driver's in local mode, divided by ``spark.task.cpus``)."""
    cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    per_executor = spark_internals.executor_cores(sc)
    if per_executor is None:  # not readable (logged): Spark's own figure
        per_executor = [sc.defaultParallelism]
    return sum(c // cpus for c in per_executor), sum(per_executor), cpus


class _Run:
    """One run of the query: its run id, coordinator, job group and epoch timer."""

    def __init__(self, run_id, start_epoch, start_offsets, start_commit_ids):
        self.run_id = run_id
        self.coordinator_id = f"{run_id}--{uuid.uuid4()}"
        self.group = f"statecore-continuous-{run_id}"
        self.start_epoch = start_epoch
        self.start_offsets = start_offsets
        self.start_commit_ids = start_commit_ids
        self.epochs = None  # EpochCoordinatorRef
        self.current_epoch = start_epoch
        self.ended_at = {}  # epoch -> monotonic time the driver ended it
        self.offsets = {}  # epoch -> offsets (logged, not yet committed)
        self.messages = {}  # epoch -> the partitions' commit messages (sink committed, query not yet)
        self.timer = None
        self.timer_stop = threading.Event()
        self.halted = False
        self.lock = threading.Lock()


class _Callbacks:
    """The coordinator's ``writer`` and ``query`` for one run (called on its endpoint thread).
    A callback that fails stops the query with its error: the coordinator would otherwise
    wait for ever on an epoch it could not commit."""

    def __init__(self, query, run):
        self.query, self.run = query, run

    def commit(self, epoch, messages):  # writer.commit
        self._guard(self.query._sink_commit, self.run, epoch, messages)

    def add_offset(self, epoch, offsets):
        self._guard(self.query._add_offset, self.run, epoch, offsets)

    def stop_in_new_thread(self, error):
        self.query._fail_in_new_thread(error)

    def _guard(self, method, *args):
        try:
            method(*args)
        except Exception as e:
            self.query._fail_in_new_thread(e)
            raise


class _QueryCallbacks(_Callbacks):
    def commit(self, epoch):  # query.commit
        self._guard(self.query._query_commit, self.run, epoch)


class ContinuousQuery:
    """A continuous query (use :func:`start_continuous`, whose parameters it takes).

    Attributes
    ----------
    id : str
        The query's id, kept in its checkpoint across runs.
    checkpoint_location, state_root, sink_path : str
        ``state_root`` is ``<checkpoint>/state``: read the state with
        ``read_state(spark, q.state_root, 0, version=q.last_committed_epoch,
        commit_ids=q.committed_commit_ids)``.
    sink : EpochSink or None
    """

    def __init__(self, spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema=None,
                 sink_path=None, epoch_interval_ms=1000, conf=None, max_restarts=0, *, store_name="default",
                 poll_interval_ms=5, epoch_backlog_queue_size=10000, logs_to_retain=100, name=None):
        require_classic(spark, "continuous mode (start_continuous)")
        if not isinstance(source, ContinuousSource) and not all(
                hasattr(source, a) for a in ("num_partitions", "initial_offset", "reader")):
            raise TypeError(f"source must implement ContinuousSource (num_partitions, initial_offset, reader), got "
                            f"{type(source).__name__}")
        self.num_partitions = positive_int("source.num_partitions", source.num_partitions)
        contract_of(fn)  # TypeError unless an OperatorFunction or a callable fn(store, batch)
        if not isinstance(checkpoint_location, str) or not checkpoint_location:
            raise ValueError(f"checkpoint_location must be a non-empty str, got {checkpoint_location!r}")
        self.epoch_interval_s = positive_int("epoch_interval_ms", epoch_interval_ms) / 1e3
        self.poll_interval_s = positive_int("poll_interval_ms", poll_interval_ms) / 1e3
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.epoch_backlog_queue_size = positive_int("epoch_backlog_queue_size", epoch_backlog_queue_size)
        self.logs_to_retain = positive_int("logs_to_retain", logs_to_retain)
        if conf is None:
            conf = StateStoreConf()
        elif not isinstance(conf, StateStoreConf):
            conf = StateStoreConf.from_spark_conf(conf)
        self.conf = conf
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        self.output_schema, self._arrow_schema = output_schemas(output_schema)
        self.spark, self.source, self.fn, self.store_name = spark, source, fn, store_name
        self.checkpoint_location = checkpoint_location.rstrip("/")
        self.state_root = f"{self.checkpoint_location}/{STATE_DIR}"
        if sink_path is None and output_schema is not None:
            sink_path = f"{self.checkpoint_location}/output"
        self.sink_path = sink_path
        self.sink = None if sink_path is None else EpochSink(sink_path, conf.storage_options)
        self.logs = QueryLogs(self.checkpoint_location, conf.storage_options)
        self.offsets_log, self.commits_log = self.logs.offsets, self.logs.commits
        self.name = name or self.checkpoint_location
        self.id = None
        self._lock = threading.RLock()  # re-entrant: wait_for's predicate reads properties under it
        self._changed = threading.Condition(self._lock)
        self._run = None
        self._thread = None
        self._stopping = False
        self._failure = None  # a terminal error (backlog, callback): no restart
        self._exception = None
        self._terminated = threading.Event()
        self._restarts = 0
        self._last_committed = None
        self._committed_offsets = None
        self._committed_ids = None
        self._epochs = collections.deque(maxlen=10000)  # per committed epoch: latency, rows

    # -- starting ----------------------------------------------------------------------------------

    def _check_slots(self):
        slots, cores, cpus = task_slots(spark_internals.spark_context(self.spark))
        if slots < self.num_partitions:
            raise ValueError(
                f"continuous query {self.name}: the source has {self.num_partitions} partitions, and continuous "
                f"execution runs one long-running task per partition, all at once; this cluster runs only {slots} "
                f"task(s) at once ({cores} cores, spark.task.cpus={cpus}). Use a source with at most {slots} "
                f"partitions, or give the application more cores")

    def start(self):
        """Check the cluster and the checkpoint, then start the query thread. Raises at once
        (nothing started) if there are too few task slots or the checkpoint does not match."""
        from pyspark import InheritableThread

        if self._thread is not None:
            raise RuntimeError(f"continuous query {self.name} was already started")
        self._check_slots()
        self.id = self.logs.check_metadata(self.num_partitions, self.store_name, self.key_schema, self.value_schema,
                                           self.source)
        self._last_committed, self._committed_offsets, self._committed_ids = self.logs.committed(
            self.source, self.num_partitions)
        # fn, the source and what the source holds (a rows function, say) may come from a
        # module the workers cannot import (a test, a notebook helper): ship those by value.
        for value in (self.fn, self.source, *vars(self.source).values()):
            ship_function_module(value)
        self._env = glue_driver.rpc_env_for(self.spark)
        self._thread = InheritableThread(target=self._main, name=f"statecore-continuous-{self.id}", daemon=True)
        self._thread.start()
        return self

    # -- the query thread ----------------------------------------------------------------------------

    def _main(self):
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                run = self._begin_run()
                with self._lock:
                    self._run = run  # from now on stop() and failures halt it
                    go = not self._stopping and self._failure is None
                error = self._execute(run) if go else None
                self._halt(run)
                self._wait_for_tasks(run)
                self._deactivate(run)
                with self._lock:
                    stopping, failure = self._stopping, self._failure
                if failure is not None:
                    raise failure
                if stopping:
                    return
                if error is None:
                    error = RuntimeError("every partition task ended while the query was running (see the "
                                         "executor logs: the epoch coordinator was unreachable)")
                if self._restarts >= self.max_restarts:
                    raise error
                self._restarts += 1
                log.warning("continuous query %s: run %s failed (%s: %s); restart %d of %d from the checkpoint",
                            self.name, run.run_id, type(error).__name__, str(error)[:500], self._restarts,
                            self.max_restarts)
        except BaseException as e:
            self._exception = ContinuousQueryException(
                f"continuous query {self.name} (id {self.id}) terminated with exception: {type(e).__name__}: {e}")
            self._exception.__cause__ = e
            log.error("%s", self._exception)
        finally:
            with self._changed:
                self._terminated.set()
                self._changed.notify_all()

    def _begin_run(self):
        """Read the checkpoint, clear what uncommitted epochs left, start a coordinator."""
        self._check_slots()  # executors may have gone since the last run
        committed, offsets, commit_ids = self.logs.committed(self.source, self.num_partitions)
        self.logs.discard_after(committed, self.logs_to_retain)
        if self.sink is not None:
            self.sink.discard_after(committed)
        run = _Run(uuid.uuid4(), committed + 1, offsets, commit_ids)
        with self._lock:
            self._last_committed, self._committed_offsets, self._committed_ids = committed, offsets, commit_ids
        run.epochs = EpochCoordinatorRef.create(_Callbacks(self, run), _QueryCallbacks(self, run),
                                                run.coordinator_id, run.start_epoch, self._env,
                                                self.epoch_backlog_queue_size)
        run.epochs.set_reader_partitions(self.num_partitions)
        run.epochs.set_writer_partitions(self.num_partitions)
        log.info("continuous query %s: run %s starts at epoch %d", self.name, run.run_id, run.start_epoch)
        return run

    def _execute(self, run):
        """Run the job of long-running tasks; returns its error, or None if the tasks ended."""
        spec = TaskSpec(
            source=self.source, fn=self.fn, state_root=self.state_root, store_name=self.store_name,
            key_dtype=self.key_schema.dtype, value_dtype=self.value_schema.dtype, conf=self.conf,
            arrow_schema=self._arrow_schema, sink_path=self.sink_path, sink_storage_options=self.conf.storage_options,
            run_id=run.run_id, coordinator_id=run.coordinator_id, address=tuple(self._env.address),
            authkey=self._env.authkey, start_epoch=run.start_epoch, start_offsets=run.start_offsets,
            start_commit_ids=run.start_commit_ids, poll_interval_s=self.poll_interval_s)
        sc = spark_internals.spark_context(self.spark)
        sc.setJobGroup(run.group, f"statecore continuous query {self.name} run {run.run_id}", interruptOnCancel=True)
        run.timer = threading.Thread(target=self._advance_epochs, args=(run,), daemon=True,
                                     name=f"statecore-epoch-timer-{run.run_id}")
        run.timer.start()
        try:
            statuses = (sc.parallelize(range(self.num_partitions), self.num_partitions)
                        .mapPartitionsWithIndex(task_function(spec)).collect())
        except Exception as e:
            with self._lock:
                if self._stopping or self._failure is not None:
                    return None  # the job was cancelled on purpose
            return e
        log.info("continuous query %s: run %s tasks ended: %s", self.name, run.run_id, statuses)
        return None

    def _advance_epochs(self, run):
        """Spark's epoch update thread: ``increment_and_get_epoch`` at a fixed rate."""
        next_at = time.monotonic() + self.epoch_interval_s
        while not run.timer_stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.epoch_interval_s
            ending = run.current_epoch
            run.ended_at[ending] = time.monotonic()
            try:
                run.current_epoch = run.epochs.increment_and_get_epoch()
            except RpcError as e:
                if not run.timer_stop.is_set():
                    log.warning("continuous query %s: cannot advance the epoch: %s", self.name, e)
                return
            now = time.monotonic()
            if now > next_at:  # fell behind (a long pause): skip the missed ticks, as Spark's trigger does
                next_at = now + self.epoch_interval_s

    def _halt(self, run):
        """Stop writes, the timer and the coordinator of ``run`` (idempotent): every task's
        next poll then fails, and the task ends."""
        with run.lock:
            if run.halted:
                return
            run.halted = True
        try:
            run.epochs.stop_continuous_execution_writes()
        except RpcError as e:
            log.warning("continuous query %s: stop_continuous_execution_writes failed: %s", self.name, e)
        run.timer_stop.set()
        if run.timer is not None and run.timer is not threading.current_thread():
            run.timer.join()
        try:
            run.epochs.stop()
        except RpcError as e:
            log.debug("stopping the epoch coordinator: %s", e)

    def _wait_for_tasks(self, run, timeout_s=60.0):
        """Wait until no task of ``run`` is running (a failed job's other tasks are killed, but
        Python may still be running them): a new run must never share a partition's files
        with a task of the old one. Cancels the job group if the tasks do not end."""
        sc = spark_internals.spark_context(self.spark)
        tracker = sc.statusTracker()
        deadline = time.monotonic() + timeout_s
        cancelled = False
        while True:
            active = 0
            for job_id in tracker.getJobIdsForGroup(run.group):
                job = tracker.getJobInfo(job_id)
                for stage_id in (job.stageIds if job is not None else ()):
                    stage = tracker.getStageInfo(stage_id)
                    active += stage.numActiveTasks if stage is not None else 0
            if not active:
                return
            now = time.monotonic()
            if not cancelled and now > deadline - timeout_s / 2:
                log.warning("continuous query %s: %d task(s) of run %s still running: cancelling them",
                            self.name, active, run.run_id)
                sc.cancelJobGroup(run.group)
                cancelled = True
            if now > deadline:
                raise RuntimeError(f"{active} task(s) of run {run.run_id} of continuous query {self.name} are still "
                                   f"running {timeout_s:g} s after the run ended")
            time.sleep(0.05)

    def _deactivate(self, run):
        try:
            glue_driver.deactivate(self.spark, run.run_id)
        except CALL_ERRORS as e:
            log.warning("could not deactivate the state stores of run %s: %s", run.run_id, e)

    def _fail_in_new_thread(self, error):
        """Stop the query with ``error`` (no restart), from a new thread: called on the
        coordinator's thread, which the halt's asks need."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            run = self._run
        if run is not None:
            threading.Thread(target=self._halt, args=(run,), daemon=True,
                             name="statecore-continuous-stop").start()

    # -- the coordinator's callbacks (its endpoint thread) -----------------------------------------

    def _add_offset(self, run, epoch, offsets):
        self.logs.write_offsets(epoch, offsets, run.run_id)
        run.offsets[epoch] = offsets

    def _sink_commit(self, run, epoch, messages):
        if self.sink is not None:
            self.sink.commit(epoch, messages)
        run.messages[epoch] = messages

    def _query_commit(self, run, epoch):
        offsets = run.offsets.pop(epoch, None)
        if offsets is None:  # ContinuousExecution.commit asserts the same
            raise RuntimeError(f"epoch {epoch} is committed, but no offsets were logged for it")
        messages = run.messages.pop(epoch, [])
        commit_ids = [m.get("commit_id") for m in messages]
        self.logs.write_commit(epoch, run.run_id, commit_ids, self.logs_to_retain)
        now = time.monotonic()
        ended = run.ended_at.pop(epoch, None)
        entry = {"epoch": epoch, "run_id": str(run.run_id), "committed_at": now, "ended_at": ended,
                 "latency_s": None if ended is None else now - ended, "offsets": offsets,
                 "rows_in": [m.get("rows_in", 0) for m in messages], "rows_out": [m.get("rows", 0) for m in messages]}
        with self._changed:
            self._last_committed, self._committed_offsets = epoch, offsets
            self._committed_ids = tuple(commit_ids)
            self._epochs.append(entry)
            self._changed.notify_all()

    # -- the handle ---------------------------------------------------------------------------------

    @property
    def is_active(self):
        return self._thread is not None and not self._terminated.is_set()

    @property
    def last_committed_epoch(self):
        """The newest committed epoch (0: none yet); also the state's version."""
        with self._lock:
            return self._last_committed

    @property
    def committed_offsets(self):
        """The offsets of the last committed epoch, per partition."""
        with self._lock:
            return self._committed_offsets

    @property
    def committed_commit_ids(self):
        """Per partition, the commit id of the last committed epoch's store version (what a
        restart opens, and what ``read_state(..., commit_ids=...)`` takes); None for a
        checkpoint whose commits log has no ids."""
        with self._lock:
            return self._committed_ids

    @property
    def progress(self):
        """A snapshot: ids, epochs, offsets, restarts, and the recent committed epochs
        (``recent_epochs``: epoch, run id, latency_s from the driver ending it to its commit,
        offsets, rows_in and rows_out per partition), newest last."""
        with self._lock:
            run = self._run
            epochs = list(self._epochs)
            return {
                "id": self.id, "name": self.name, "run_id": None if run is None else str(run.run_id),
                "current_epoch": None if run is None else run.current_epoch,
                "last_committed_epoch": self._last_committed, "committed_offsets": self._committed_offsets,
                "committed_commit_ids": self._committed_ids,
                "restarts": self._restarts, "active": self.is_active, "recent_epochs": epochs,
            }

    def exception(self):
        """The :class:`ContinuousQueryException` the query terminated with, or None."""
        return self._exception

    def await_termination(self, timeout=None):
        """Wait for the query to terminate; raise its exception if it failed. With a timeout:
        True if it terminated in time, else False (Spark's ``awaitTermination``)."""
        done = self._terminated.wait(timeout)
        if done and self._exception is not None:
            raise self._exception
        return done if timeout is not None else None

    def wait_for(self, predicate, timeout):
        """Wait until ``predicate(self)`` is true, checked now and after every committed
        epoch; True if it became true, False at the timeout or if the query terminated first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if predicate(self):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._terminated.is_set():
                    return predicate(self)
                self._changed.wait(remaining)

    def stop(self, timeout=60.0):
        """Stop the query: ``stop_continuous_execution_writes`` first (nothing commits after
        it), then the timer and the coordinator; the tasks end at their next poll. Returns
        once the query thread ended (cancelling the job if the tasks do not end within
        ``timeout``). Idempotent; does not raise the query's exception."""
        with self._lock:
            self._stopping = True
            run = self._run
        if run is not None:
            self._halt(run)
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive() and run is not None:
            log.warning("continuous query %s: tasks did not end within %g s: cancelling the job", self.name, timeout)
            spark_internals.spark_context(self.spark).cancelJobGroup(run.group)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"continuous query {self.name} did not stop within {2 * timeout:g} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        return f"ContinuousQuery({self.name!r}, last committed epoch {self._last_committed})"


def start_continuous(spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema=None,
                     sink_path=None, epoch_interval_ms=1000, conf=None, max_restarts=0, **options):
    """Start a continuous query: one long-running Spark task per partition of ``source``,
    each running ``fn(store, batch)`` over its partition with the store of that partition;
    epochs end every ``epoch_interval_ms`` and commit in order (``docs/continuous.md``).

    Parameters
    ----------
    spark : SparkSession
        A classic session (a Spark Connect one raises ``ClassicSessionRequired``:
        ``docs/continuous.md``, "Limits").
    source : ContinuousSource
        :class:`GeneratorSource`, :class:`FileSource`, or your own.
    fn : OperatorFunction or callable ``(StateStore, pyarrow.RecordBatch) -> RecordBatch | None``
        As in :class:`~pyspark_glue.StatefulOperator`: each epoch of a partition is a task of
        ``fn`` (``fn.open(context)``, its batches, ``finish``, with no watermarks), so
        :class:`~pyspark_glue.RunningAggregate` emits each key updated in the epoch once.
    checkpoint_location : str
        Holds ``metadata``, ``offsets/``, ``commits/``, ``state/`` (and ``output/`` by
        default); must be reachable from the executors.
    key_schema, value_schema : numpy structured dtypes of the store
    output_schema : StructType or DDL string, optional
        The batches ``fn`` returns; None: no output.
    sink_path : str, optional
        Where the output goes (an :class:`EpochSink`); default ``<checkpoint>/output``.
    epoch_interval_ms : int, default 1000
    conf : StateStoreConf or dict, optional
        Default ``StateStoreConf()``; a dict goes through ``StateStoreConf.from_spark_conf``.
    max_restarts : int, default 0
        How many times a failed run is restarted from the checkpoint before the query stops
        with the error.
    **options
        ``store_name``, ``poll_interval_ms`` (5: how often a task asks for the epoch, at
        most), ``epoch_backlog_queue_size`` (10000), ``logs_to_retain`` (100: entries kept
        in the offsets and commits logs), ``name``.

    Returns
    -------
    ContinuousQuery
        With ``stop()``, ``await_termination(timeout)``, ``exception()``,
        ``last_committed_epoch``, ``committed_offsets``, ``progress``, ``wait_for``.

    Raises
    ------
    pyspark_glue.session_kind.ClassicSessionRequired (a TypeError)
        ``spark`` is a Spark Connect session; nothing was started or written.
    ValueError
        The cluster cannot run one task per partition at once, or the checkpoint was written
        with another number of partitions.
    SchemaMismatchError
        The checkpoint was written with other key or value schemas.
    """
    return ContinuousQuery(spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema,
                           sink_path, epoch_interval_ms, conf, max_restarts, **options).start()
