"""The DataFrame / Structured Streaming level: :class:`StatefulOperator` for ``foreachBatch``.

This module owns the operator: its driver side (set-up, runs and re-executions, one Spark
job per micro-batch, the batch record) and its task body (route check, ``fn``, output,
commit). How a micro-batch runs and why, the exactly-once rules and the run ids are in
``docs/operator.md``; the batch records in ``docs/lineage.md``. Types and conversions live in
:mod:`pyspark_glue.arrow`, ready-made functions in :mod:`pyspark_glue.aggregates`, the
checkpoint files beside the stores in :mod:`statecore.operator_files`, finding the
streaming query's run in :mod:`pyspark_glue.query_runs`. (About 700 lines: one class,
whose public methods are the operator's API and whose driver-side steps all read its resolved
settings; the task body is :mod:`pyspark_glue.operator_task`.)
"""
import contextlib
import dataclasses
import logging
import threading
import time
import uuid

from statecore.conf import StateStoreConf
from statecore.lineage import ROOT_COMMIT_ID
from statecore.metrics import StateStoreMetrics
from statecore.spark_hash import FIXED_WIDTH_TYPES
from statecore import operator_files, operator_lock
from statecore.checkpoint import CheckpointFiles
from statecore.checkpoint_scan import NotACheckpointError, scan_checkpoint
from statecore.rpc import CALL_ERRORS
from statecore.files import open_store_files
from statecore.ids import StateStoreId
from statecore.schema_evolution import SchemaChanges, SchemaEvolutionError, plan_state
from statecore.schema_file import plan_change, read_schema_history

from pyspark_glue import query_runs, spark_internals
from pyspark_glue.clocks import WallClock, as_millis
from pyspark_glue.arrow import dtype_of_columns
from pyspark_glue.event_time import batch_watermarks
from pyspark_glue.local_workers import check_local_workers
from pyspark_glue.operator_fn import FROM_FN, FunctionSettings
from pyspark_glue.output_files import read_output_files
from pyspark_glue.operator_task import (FN_BATCH_ROWS, INITIAL_STATE_COLUMN, PARTITION_COLUMN, PartitionTask,
                                        StoreSpec, partition_function)
from pyspark_glue.task_status import TaskStatus
from pyspark_glue.rdd import StatefulOperatorStateInfo, ship_function_module

__all__ = ["StatefulOperator", "PARTITION_COLUMN"]

log = logging.getLogger(__name__)

_PROVIDER_CLASS_KEY = "spark.sql.streaming.stateStore.providerClass"
_SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
_ADAPTIVE = "spark.sql.adaptive.enabled"


# -- the driver -------------------------------------------------------------------------------

@contextlib.contextmanager
def _job_settings(spark, settings):
    """SQL settings of ``spark`` changed for one job and restored afterwards. Those already
    at their value are left alone: a streaming query's session runs with adaptive execution
    off and its shuffle partitions fixed by its checkpoint, often the operator's, and each
    change and restore is a py4j round trip before and after every batch's job."""
    conf = spark.conf
    before = {key: conf.get(key, None) for key in settings}
    changed = [key for key, value in settings.items() if before[key] != value]
    for key in changed:
        conf.set(key, settings[key])
    try:
        yield
    finally:
        for key in changed:
            if before[key] is None:
                conf.unset(key)
            else:
                conf.set(key, before[key])


class StatefulOperator:
    """A stateful operator for ``foreachBatch``: ``process(df, batch_id)`` runs ``fn(store,
    batch)`` over the rows of ``df`` hash-partitioned by ``key_columns``, each partition with
    its own store, and returns the output DataFrame (``docs/operator.md``). It pickles as its
    constructor's arguments, nothing of a run (``docs/operator.md``, "Pickling"): under Spark
    Connect the ``foreachBatch`` function holding it travels pickled.

    Parameters
    ----------
    checkpoint_location : str
        The state root (a path or fsspec URL, kept exactly as given in store ids): stores go
        to ``<checkpoint_location>/<operator_id>/<partition>[/<store_name>]``.
    operator_id : int
    num_partitions : int
        Fixed for the life of the checkpoint (recorded on first use).
    key_columns : sequence of str
        The columns rows are partitioned by; they must determine the state key (normally
        the key schema's fields).
    key_schema, value_schema : numpy structured dtypes
    fn : :class:`~pyspark_glue.OperatorFunction`, or a callable ``(StateStore, pyarrow.RecordBatch)
        -> pyarrow.RecordBatch | None``
        The contract (attributes, hooks, the per-task handler ``fn.open(context)`` returns) is
        in ``docs/operator.md``, "The function's contract"; a plain callable may have a
        ``finish(store) -> RecordBatch | None``, called once per partition after the last
        batch. Arguments left out here are taken from ``fn``'s attributes of the same name.
        Defined anywhere: a test module or notebook helper is shipped by value.
    output_schema : pyspark StructType, DDL string, or None
        The schema of the batches ``fn`` returns (cast to it exactly; the columns must be the
        same). None: ``fn`` returns nothing, and ``process`` returns an empty DataFrame.
    conf : StateStoreConf or dict, optional
        A dict goes through ``StateStoreConf.from_spark_conf``; default: the session's
        ``spark.sql.streaming.*`` and ``spark.statecore.*`` settings, read at the first
        ``process`` (a provider class of Spark's own, such as RocksDB for Spark's operators,
        is ignored there).
    store_name : str, default "default"
    coordinator : bool or StateStoreCoordinatorRef, default True
        True: the driver's coordinator (:func:`pyspark_glue.driver.coordinator_for`);
        False/None: none.
    query_run_id : uuid.UUID, optional
        The run id outside streaming queries (default: a uuid4 per instance).
    output_batches_to_retain : int, default 2
        How many batches' outputs (the latest ones) are kept on disk.
    fn_batch_rows : int or None, default ``FN_BATCH_ROWS`` (1,048,576)
        ``fn`` gets a partition's Arrow batches joined, consecutive ones, into batches of up
        to this many rows (and 128 MiB of buffers): a fn that reads and writes its keys per
        batch then does so about once per task. None: the batches as Spark sends them
        (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows each).
    batch_id_offset : int, default 0
        Added to every batch id ``process`` is given: the operator's batches (its records,
        outputs and ``last_progress``) are the shifted ids. For a new Spark checkpoint (whose
        batch ids start at 0 again) over state that already holds batches up to ``n``
        (written by ``statecore import-spark``, or by a query whose checkpoint is gone):
        ``batch_id_offset=n + 1`` continues from that state (``docs/operator.md``).
    initial_state : DataFrame or callable, optional
        For a fn with ``handle_initial_state`` (a StatefulProcessor): rows that batch 0 hands to
        it before its input, as Spark's ``transformWithState(initialState=...)``. A DataFrame,
        or a function of the batch's session returning one (``lambda spark:
        spark.read.parquet(path)``): under Spark Connect the ``foreachBatch`` function travels
        pickled to the server's Python process, and a DataFrame cannot, so the function is what
        works there (``docs/operator.md``, "Under Spark Connect").
    clock : object with ``now_ms()``, default :class:`~pyspark_glue.clocks.WallClock`
        Where each batch's processing time comes from (read once per batch on the driver, as
        the batch begins; a batch run again over its own record keeps the recorded time).
        A :class:`~pyspark_glue.clocks.ManualClock` makes processing-time timers and TTLs
        testable and replayable (``docs/processor.md``, "Clocks").

    Attributes
    ----------
    last_progress : dict or None
        Of the last ``process``: ``batch_id``, ``query_run_id``, ``committed_version``,
        ``rows_in``, ``rows_out``, ``state_keys``, ``memory_used_bytes``, ``custom_metrics``
        (summed over partitions), ``stores_already_loaded`` and
        ``stores_loaded_from_files`` (tasks whose store was already in their Python worker),
        ``re_execution``, ``seconds``, ``batch_timestamp_ms`` (its processing time),
        ``fn_counts`` (the counters ``fn`` kept in its PartitionContext's ``counts``, summed),
        and ``partitions`` (each partition's :class:`~pyspark_glue.task_status.TaskStatus` as a dict). After
        each batch, ``fn.observe(last_progress)`` is called.
    """

    def __init__(self, checkpoint_location, operator_id, num_partitions, key_columns=FROM_FN, key_schema=FROM_FN,
                 value_schema=FROM_FN, fn=None, output_schema=FROM_FN, conf=None, *, store_name="default",
                 coordinator=True, query_run_id=None, output_batches_to_retain=2, event_time=FROM_FN,
                 delay=FROM_FN, initial_state=None, fn_batch_rows=FN_BATCH_ROWS, batch_id_offset=0, clock=None,
                 schema_changes=FROM_FN):
        # what pickles: the arguments given (one left out, FROM_FN, is left out again when unpickled)
        self._arguments = {name: value for name, value in locals().items() if name != "self" and value is not FROM_FN}
        if not isinstance(checkpoint_location, str) or not checkpoint_location:
            raise ValueError(f"checkpoint_location must be a non-empty str, got {checkpoint_location!r}")
        if not isinstance(operator_id, int) or isinstance(operator_id, bool) or operator_id < 0:
            raise ValueError(f"operator_id must be an int >= 0, got {operator_id!r}")
        if not isinstance(num_partitions, int) or isinstance(num_partitions, bool) or num_partitions < 1:
            raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
        self._settings = settings = FunctionSettings(fn, key_columns, key_schema, value_schema, output_schema,
                                                     event_time, delay, initial_state is not None, schema_changes)
        if not isinstance(output_batches_to_retain, int) or output_batches_to_retain < 1:
            raise ValueError(f"output_batches_to_retain must be an int >= 1, got {output_batches_to_retain!r}")
        if fn_batch_rows is not None and (not isinstance(fn_batch_rows, int) or isinstance(fn_batch_rows, bool)
                                          or fn_batch_rows < 1):
            raise ValueError(f"fn_batch_rows must be an int >= 1 or None, got {fn_batch_rows!r}")
        self.fn_batch_rows = fn_batch_rows
        if not isinstance(batch_id_offset, int) or isinstance(batch_id_offset, bool) or batch_id_offset < 0:
            raise ValueError(f"batch_id_offset must be an int >= 0, got {batch_id_offset!r}")
        self.batch_id_offset = batch_id_offset
        self.clock = WallClock() if clock is None else clock
        if not callable(getattr(self.clock, "now_ms", None)):
            raise TypeError(f"clock must have a now_ms() method, got {type(clock).__name__}")
        if query_run_id is not None and not isinstance(query_run_id, uuid.UUID):
            raise TypeError(f"query_run_id must be a uuid.UUID, got {type(query_run_id).__name__}")
        self.checkpoint_location = checkpoint_location
        self.operator_id = operator_id
        self.num_partitions = num_partitions
        self.fn = fn
        # fn's module pickled by value if workers cannot import it: from construction on, so that
        # a foreachBatch function a Spark Connect client pickles carries it too
        ship_function_module(fn)
        self.contract = settings.contract  # what the operator reads of fn (pyspark_glue.operator_fn)
        self.key_columns = settings.key_columns
        self.event_time, self.delay_us = settings.event_time, settings.delay_us
        self.store_name = store_name
        if initial_state is not None and not (callable(initial_state) or _is_dataframe(initial_state)):
            raise TypeError(f"initial_state must be a DataFrame or a function of the session returning one, "
                            f"got {type(initial_state).__name__}")
        self.initial_state = initial_state
        self.output_batches_to_retain = output_batches_to_retain
        self.last_progress = None
        self._conf_arg = conf
        self._coordinator_arg = coordinator
        self._own_run_id = query_run_id or uuid.uuid4()
        self._lock = threading.Lock()
        self._resolved = False
        self._recorded = None  # the metadata in the checkpoint, once checked
        self._runs = {}  # run id -> [generation, last batch id processed]
        self._current_run = None
        self._listener = None  # (session, listener)
        self._closed = False
        self._operator_lock = None  # statecore.operator_lock.OperatorLock, from the first batch
        self._known_records = None  # operator_files.KnownRecords, while the lock is held
        self._outputs_from = None  # the oldest batch whose output may be on disk, while the lock is held

    # Pickling (under Spark Connect a foreachBatch function travels pickled, the operator in it,
    # to a Python process the server starts per query): an operator pickles the arguments its
    # constructor got, and an unpickled one is constructed again from them. Every attribute is
    # either made by the constructor from its arguments or belongs to a run; __getstate__ refuses
    # one in neither list, so that a new attribute gets classified.
    _FROM_ARGUMENTS = frozenset([
        "_arguments", "_settings", "checkpoint_location", "operator_id", "num_partitions", "fn", "contract",
        "key_columns", "event_time", "delay_us", "store_name", "initial_state", "output_batches_to_retain",
        "fn_batch_rows", "batch_id_offset", "clock", "_conf_arg", "_coordinator_arg", "_own_run_id"])
    _PER_RUN = frozenset([
        "conf", "coordinator", "last_progress", "_lock", "_resolved", "_recorded", "_runs", "_current_run",
        "_listener", "_closed", "_operator_lock", "_known_records", "_outputs_from"])

    def __getstate__(self):
        unclassified = sorted(set(vars(self)) - self._FROM_ARGUMENTS - self._PER_RUN)
        if unclassified:
            raise TypeError(f"StatefulOperator attribute(s) {unclassified} are neither made from the constructor's "
                            f"arguments nor per run: classify them (_FROM_ARGUMENTS, _PER_RUN) before pickling")
        if _is_dataframe(self.initial_state):
            raise TypeError("this StatefulOperator's initial_state is a DataFrame, which cannot be pickled (as Spark "
                            "Connect pickles a foreachBatch function to run it in the server's Python process): "
                            "give initial_state as a function of the session returning the DataFrame, such as "
                            "initial_state=lambda spark: spark.read.parquet(path)")
        return dict(self._arguments)

    def __setstate__(self, arguments):
        StatefulOperator.__init__(self, **arguments)

    # The schemas: given, fn's attributes, or resolved from the first input's columns.
    key_schema = property(lambda self: self._settings.key_schema)
    value_schema = property(lambda self: self._settings.value_schema)
    output_schema = property(lambda self: self._settings.output_schema)
    _arrow_schema = property(lambda self: self._settings.arrow_schema)
    _input_resolved = property(lambda self: self._settings.input_resolved)

    # -- paths ---------------------------------------------------------------------------------

    @property
    def operator_dir(self):
        return operator_files.operator_dir(self.checkpoint_location, self.operator_id)

    def output_dir(self, batch_id):
        """Where the output of ``batch_id`` is written (as given to fsspec)."""
        return operator_files.output_dir(self.operator_dir, batch_id)

    # -- set-up on the driver ---------------------------------------------------------------------

    def _resolve(self, spark):
        if self._resolved:
            return
        check_local_workers(spark)
        conf = self._conf_arg
        if conf is None:
            settings = spark_internals.session_settings(spark)
            # A session's provider class configures Spark's own stateful operators (RocksDB,
            # say); it is statecore's business only when it names a statecore provider.
            provider = settings.get(_PROVIDER_CLASS_KEY, "")
            if provider.startswith("org.apache.spark."):
                settings.pop(_PROVIDER_CLASS_KEY)
            conf = StateStoreConf.from_spark_conf(settings)
        elif not isinstance(conf, StateStoreConf):
            conf = StateStoreConf.from_spark_conf(conf)
        declared = self._settings.schema_changes(self.store_name)
        if declared:
            conf = dataclasses.replace(conf, schema_changes={**(conf.schema_changes or {}), **declared})
        self.conf = conf
        coordinator = self._coordinator_arg
        if coordinator is True:
            from pyspark_glue import driver
            coordinator = driver.coordinator_for(spark)
        self.coordinator = coordinator or None
        self._resolved = True

    def _resolve_input(self, df):
        """Checks of the input before any store changes (the key columns and the event-time
        column are there); a built-in given only column names takes its schemas from the first
        batch's (:meth:`FunctionSettings.resolve_input`)."""
        self._settings.resolve_input(df.schema)

    def _metadata(self, df):
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        metadata = {"format": operator_files.METADATA_FORMAT, "operator_id": self.operator_id,
                    "num_partitions": self.num_partitions, "key_columns": self.key_columns,
                    "key_column_types": [types[c] for c in self.key_columns], "store_name": self.store_name,
                    "key_schema": self.key_schema.describe(), "value_schema": self.value_schema.describe()}
        if self.event_time is not None:
            metadata["event_time"] = self.event_time
        return metadata

    def _check_metadata(self, df):
        """Check this batch against the recorded metadata; with none recorded yet, return
        ours, which :meth:`_record_metadata` records once the batch's job has succeeded (a
        failed first batch leaves no settings behind to refuse its corrected re-run)."""
        ours = self._metadata(df)  # also checks the key columns of every batch
        if self._recorded is None:
            recorded = operator_files.read_metadata(self.operator_dir, self.conf.storage_options)
            if recorded is None:
                return ours
            declared = self.conf.schema_changes_of(self.store_name) or SchemaChanges()
            operator_files.compare_metadata(ours, recorded, self.operator_dir, self.conf.storage_options,
                                            schemas=False, renames=declared.renames)
            self._recorded = recorded
            self._check_other_stores_change()
            if self._plan_schema_change(ours, recorded):
                return ours
        elif ours["key_column_types"] != self._recorded["key_column_types"]:
            operator_files.compare_metadata(ours, self._recorded, self.operator_dir, self.conf.storage_options)
        return None

    def _plan_schema_change(self, ours, recorded):
        """Whether this batch changes the state's schemas from the ``recorded`` ones: the change
        planned by the rules and the declared :class:`SchemaChanges` (SchemaEvolutionError,
        naming the operator, before any job runs: nothing written). Each store's provider plans
        it again and converts (``docs/evolution.md``); the metadata records it after the batch."""
        old = operator_files.schema_change(ours, recorded)
        if old is None:
            return False
        changes = self.conf.schema_changes_of(self.store_name) or SchemaChanges()
        where = f"operator {self.operator_id} at {self.operator_dir}"
        try:
            plan = plan_state(*old, self.key_schema, self.value_schema, renames=changes.renames,
                              defaults=changes.defaults)
        except SchemaEvolutionError as e:
            raise SchemaEvolutionError(e.kind, e.old, e.new, e.problems, also=e.also, where=where) from None
        problems = self.contract.schema_change_problems(plan)
        if problems:
            raise SchemaEvolutionError("value", plan.value.old.describe(), plan.value.new.describe(), problems,
                                       where=f"{where} ({type(self.contract).__name__})")
        log.info("operator %s: the state's schemas change with batch this run starts at: %s", self.operator_id,
                 "; ".join(plan.describe()))
        return True

    def _check_other_stores_change(self):
        """The stores ``fn.state_stores`` declares (a processor's state variables) whose schemas
        changed, each planned from partition 0's schema history before any job runs: a change
        the rules refuse is a SchemaEvolutionError naming the store, nothing written. Each
        task's provider plans it again (and converts); a store without a history yet is new."""
        for name, (key, value) in self._settings.extra_stores(self.store_name).items():
            location = StateStoreId(self.checkpoint_location, self.operator_id, 0, name).store_checkpoint_location()
            history = read_schema_history(open_store_files(location, self.conf.storage_options))
            if history is None:
                continue
            try:
                plan_change(history, key, value, self.conf.schema_changes_of(name))
            except SchemaEvolutionError as e:
                raise SchemaEvolutionError(e.kind, e.old, e.new, e.problems, also=e.also,
                                           where=f"operator {self.operator_id}, store {name!r} at {location}") \
                    from None

    def _record_metadata(self, ours):
        """Record ``ours`` (from :meth:`_check_metadata`) after the first successful batch, or
        check it against what another writer recorded meanwhile; after the first batch under
        changed schemas, replace what was recorded."""
        if ours is None:
            return
        if self._recorded is not None:  # what else was recorded (a repartition's switch) stays
            changed = {part: ours[part] for part in ("key_schema", "value_schema", "key_columns")}
            self._recorded = operator_files.replace_metadata(self.operator_dir, {**self._recorded, **changed},
                                                             self.conf.storage_options)
        else:
            self._recorded = operator_files.check_metadata(self.operator_dir, ours, self.conf.storage_options)

    def _drop_failed_first_batch(self):
        """After batch 0's job failed with nothing recorded (no ``_operator.json``, no batch
        record): delete the partition directories its tasks wrote (attempts of version 1 and
        the stores' schema files), so that a corrected re-run with other schemas starts from
        nothing. Only when every store there holds nothing but attempts of version 1: state
        kept before (a checkpoint from before operators recorded metadata) is never touched."""
        options = self.conf.storage_options
        try:
            found = scan_checkpoint(self.checkpoint_location, options).operators.get(self.operator_id)
        except (NotACheckpointError, OSError, ValueError) as e:
            log.debug("nothing of the failed batch 0 to delete under %s: %s", self.operator_dir, e)
            return
        if found is None or found.has_metadata or found.has_records:
            return
        stores = found.stores()
        if any(set(store.files(options).list_versions().versions()) - {1} for store in stores):
            log.warning("operator %s: batch 0 failed over stores holding other versions than 1; nothing deleted",
                        self.operator_id)
            return
        CheckpointFiles(self.operator_dir, options).delete_trees(str(p) for p in sorted(found.partitions))
        log.info("operator %s: batch 0 failed; deleted what its tasks wrote (%d stores)", self.operator_id,
                 len(stores))

    def _check_key_dtypes(self, schema):
        """ValueError naming the column, its Spark type and the field's dtype if a key column
        that is also a key field holds values of another kind than the field (a number in a
        bytes field, a string in a number field...), before anything runs. Widths are left to
        the task's safe casts (a value out of the field's range fails there)."""
        types = {f.name: f.dataType.simpleString() for f in schema.fields}
        fields = self.key_schema.dtype.fields
        for name in self.key_columns:
            if name not in fields or name not in types:
                continue
            given = fields[name][0]
            try:
                holds = dtype_of_columns(schema, [name], {name: max(given.itemsize, 1)})[name]
            except ValueError:
                continue  # a type a key column cannot be at all: fn.prepare or the task says so
            if _kind_class(holds) != _kind_class(given):
                raise ValueError(
                    f"operator {self.operator_id}: key column '{name}' is {types[name]} in the DataFrame, but the "
                    f"key schema's field '{name}' has dtype {given} (a {types[name]} column goes into a "
                    f"{_kind_class(holds)} field, e.g. {holds}); nothing was run or recorded")

    # -- runs ----------------------------------------------------------------------------------------

    def _run_for(self, run_id, session, batch_id):
        """The run id and generation of this batch (``run_id``, ``session``: its streaming
        query's, from :func:`query_runs.streaming_query`); notices new runs and re-executions."""
        with self._lock:
            previous = self._current_run
            self._current_run = run_id
            run = self._runs.setdefault(run_id, [0, None])
            re_execution = run[1] is not None and batch_id <= run[1]
            if re_execution:
                run[0] += 1
            run[1] = batch_id
            generation = run[0]
        if previous is not None and previous != run_id:
            self._run_ended(previous)
        if session is not None and self.coordinator is not None:
            self._listen_for_termination(session)
        return run_id, generation, re_execution

    def _listen_for_termination(self, session):
        with self._lock:
            if self._listener is not None:
                return
            listener = query_runs.termination_listener(self._run_ended)
            self._listener = (session, listener)
        try:
            session.streams.addListener(listener)
        except spark_internals.SPARK_CALL_ERRORS as e:
            log.warning("cannot watch for query termination (instances are deactivated at the next run or "
                        "at close()): %s", e)

    def _run_ended(self, run_id):
        with self._lock:
            known = self._runs.pop(run_id, None) is not None
            if self._current_run == run_id:
                self._current_run = None
        if known and self.coordinator is not None:
            try:
                self.coordinator.deactivate_instances(run_id)
                log.info("deactivated the state store instances of run %s", run_id)
            except CALL_ERRORS as e:
                log.warning("could not deactivate the state store instances of run %s: %s", run_id, e)

    def close(self):
        """Deactivate the current run's instances and stop listening for query termination.
        The operator may not be used afterwards."""
        with self._lock:
            runs = list(self._runs)
            listener, self._listener = self._listener, None
            self._closed = True
        for run_id in runs:
            self._run_ended(run_id)
        self._known_records = self._outputs_from = None
        if self._operator_lock is not None:
            self._operator_lock.release()
        if listener is not None:
            session, listener = listener
            try:
                session.streams.removeListener(listener)
            except Exception as e:
                log.debug("removing the termination listener: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- a micro-batch -------------------------------------------------------------------------------

    def process(self, df, batch_id, *, advance_watermark_to=None, read_output=True):
        """Run micro-batch ``batch_id`` of ``df`` through the operator (one Spark job) and
        return its output as a DataFrame read from the materialized files; with
        ``read_output=False``, return None and leave the files unread (listing them is a
        driver round trip per batch that a caller not using the output should not pay; read
        them later with :meth:`output`).

        With an event-time column, ``advance_watermark_to`` (a ``datetime`` or int
        milliseconds) raises the batch's eviction watermark to at least that: given an empty
        ``df`` at the end of a bounded run, it closes what the watermark would close once
        later data came (``docs/event-time.md``, "Flushing").

        Raises
        ------
        ValueError
            A bad ``batch_id``, a key column missing from ``df`` or of another kind than
            its key field, a checkpoint written with another number of partitions, other
            key columns or key column types, or a ``batch_id`` at or below the recorded
            batches of another query (``docs/operator.md``, "Batch ids and new Spark
            checkpoints"): nothing is deleted or run.
        SchemaMismatchError
            A checkpoint written with other key or value schemas.
        statecore.operator_lock.OperatorLockedError
            An offline command (``statecore repartition``, ``import-spark``) holds the
            operator's lock; nothing was run.
        pyspark.errors.PythonException
            ``fn`` (or a store) failed in a task; the failed partitions' stores are aborted.
        """
        if self._closed:
            raise RuntimeError("this StatefulOperator was closed")
        if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
            raise ValueError(f"batch_id must be an int >= 0, got {batch_id!r}")
        self._resolve(df.sparkSession)
        with self._holding_lock():
            return self._process(df, batch_id, advance_watermark_to, read_output)

    @contextlib.contextmanager
    def _holding_lock(self):
        """The operator's lock, held from this batch on until :meth:`close` or a failed batch
        (``docs/operating.md``, "The operator lock"): OperatorLockedError while an offline
        command holds it; when it had to be taken again, the metadata is read afresh (a command
        may have changed the operator since)."""
        if self._operator_lock is None:
            self._operator_lock = operator_lock.OperatorLock(
                self.checkpoint_location, self.operator_id, "query", operator_lock.QUERY, self.conf.storage_options)
        if not self._operator_lock.ensure():
            self._recorded = self._known_records = self._outputs_from = None
        try:
            with self._operator_lock.heartbeat():
                yield
        except BaseException:
            self._known_records = self._outputs_from = None
            self._operator_lock.release()
            raise

    def _process(self, df, batch_id, advance_watermark_to, read_output):
        begun = time.perf_counter()
        clock_ms = self.clock.now_ms()
        spark = df.sparkSession
        self._resolve(spark)
        self._resolve_input(df)
        first_metadata = self._check_metadata(df)
        self._check_key_dtypes(df.schema)
        batch_id += self.batch_id_offset
        moved = operator_files.repartitioned(self._recorded)
        if moved is not None and batch_id <= moved["batch_id"]:
            raise ValueError(f"operator {self.operator_id} was {operator_files.moved_how(moved, self._recorded)} "
                             f"after batch {moved['batch_id']}: batch {batch_id} cannot run again (its state was "
                             f"not kept)")
        query_id, query_run_id, query_session = query_runs.streaming_query(df, self._own_run_id)
        if self._known_records is None:
            self._known_records = operator_files.KnownRecords(self.commit_log())
        records = self._known_records
        recorded = records.epochs()
        self._refuse_starting_over(batch_id, recorded, query_id, query_run_id)
        batch_timestamp_ms = self._batch_timestamp_ms(batch_id, recorded, clock_ms)
        run_id, generation, re_execution = self._run_for(query_run_id, query_session, batch_id)
        records.delete([b for b in recorded if b >= batch_id])  # a re-execution replaces them
        previous = None if batch_id == 0 else records.record(batch_id - 1, self._metadata_known())
        state_info = StatefulOperatorStateInfo(self.checkpoint_location, run_id, self.operator_id, batch_id,
                                               self.num_partitions, self._base_commit_ids(batch_id, previous))
        output_dir = self.output_dir(batch_id) if self._arrow_schema is not None else None
        coordinator = self.coordinator
        watermarks = self._watermarks(batch_id, previous, advance_watermark_to)
        task = PartitionTask(
            state_info=state_info, store_name=self.store_name, key_dtype=self.key_schema.dtype,
            value_dtype=self.value_schema.dtype, extra_stores=self._extra_stores(batch_id, previous), conf=self.conf,
            fn=self.contract, arrow_schema=self._arrow_schema, output_dir=output_dir,
            coordinator_address=None if coordinator is None else tuple(coordinator.address),
            authkey=None if coordinator is None else coordinator.authkey, generation=generation,
            event_time=self.event_time, watermarks=watermarks, batch_timestamp_ms=batch_timestamp_ms,
            fn_batch_rows=self.fn_batch_rows)
        started = time.perf_counter()
        try:
            with spark_internals.described_job(spark, f"statecore operator {self.operator_id} batch {batch_id}"), \
                    _job_settings(spark, {_SHUFFLE_PARTITIONS: str(self.num_partitions), _ADAPTIVE: "false"}):
                routed, routing_keys = self._routed(self._with_initial_state(df, batch_id))
                task = dataclasses.replace(task, routing_keys=routing_keys)
                rows = routed.mapInArrow(partition_function(task), TaskStatus.spark_schema()).collect()
                if not rows:
                    # Spark knew the input empty (a limit(0), an empty local relation) and ran
                    # no task at all; every partition must still run (timers, TTL, a commit).
                    rows = _empty_partitions(spark, routed.schema, self.num_partitions) \
                        .mapInArrow(partition_function(task), TaskStatus.spark_schema()).collect()
        except BaseException:
            if first_metadata is not None and batch_id == 0 and not recorded:
                self._drop_failed_first_batch()
            raise
        seconds = time.perf_counter() - started
        statuses = sorted((TaskStatus.from_row(r) for r in rows), key=lambda s: s.partition_id)
        seen = [s.partition_id for s in statuses]
        if seen != list(range(self.num_partitions)):
            raise RuntimeError(f"operator {self.operator_id} batch {batch_id}: expected one task per partition "
                               f"0..{self.num_partitions - 1}, got partitions {seen}")
        self._record_metadata(first_metadata)
        self._record_batch(records, state_info, statuses, watermarks, query_id, batch_timestamp_ms)
        records.delete([b for b in recorded if b < batch_id - self.conf.min_versions_to_retain])
        self._record_progress(batch_id, run_id, statuses, re_execution, seconds, watermarks)
        self.last_progress["batch_timestamp_ms"] = batch_timestamp_ms
        self.contract.observe(self.last_progress)  # fn adapts to the batch (RunningAggregate's "auto")
        oldest_kept = batch_id - self.output_batches_to_retain + 1
        if oldest_kept > 0:
            operator_files.delete_outputs_before(self.operator_dir, oldest_kept, self.conf.storage_options,
                                                 known_from=self._outputs_from)
            self._outputs_from = oldest_kept
        out = self.output(batch_id, spark) if read_output else None
        self.last_progress["driver_s"] = {"before_job": started - begun, "job": seconds,
                                          "after_job": time.perf_counter() - started - seconds}
        return out

    def output(self, batch_id, spark=None):
        """The output of ``batch_id`` as a DataFrame read from its files (those of the latest
        ``output_batches_to_retain`` batches are kept); an empty DataFrame for an operator
        without output. ``spark``: the session to read with (default: the active one)."""
        from pyspark.sql import SparkSession
        if not self._input_resolved:
            raise RuntimeError("this StatefulOperator has processed no batch yet: its output schema (which may "
                               "follow the input's columns) is not known")
        spark = spark or SparkSession.active()
        if self._arrow_schema is None:
            from pyspark.sql.types import StructType
            return spark.createDataFrame([], StructType([]))
        return read_output_files(spark, self.output_dir(batch_id), self.conf.storage_options, self.output_schema)

    # -- the batch record ------------------------------------------------------------------------------

    def commit_log(self):
        """The operator's batch records (``docs/lineage.md``)."""
        conf = self.conf if self._resolved else self._conf_arg  # before the first process: the conf given
        if isinstance(conf, dict):
            conf = StateStoreConf.from_spark_conf(conf)
        return operator_files.commit_log(self.operator_dir, None if conf is None else conf.storage_options)

    def commit_record(self, batch_id):
        """The record of ``batch_id`` (a dict; ``commit_ids`` and ``base_commit_ids`` are
        tuples, one id per partition), or None if there is none."""
        return operator_files.read_commit_record(self.commit_log(), batch_id, self._metadata_known())

    def _metadata_known(self):
        """The operator's metadata: as checked, else (before the first process) as recorded."""
        if self._recorded is not None:
            return self._recorded
        return operator_files.read_metadata(self.operator_dir, self.commit_log().files.storage_options)

    def _base_commit_ids(self, batch_id, previous, store_name=None):
        """Per partition, the attempt of version ``batch_id`` the batch's tasks open for the
        default store (or ``store_name``): the winners in ``previous``, the record of
        ``batch_id - 1``; None (the default lineage) without one."""
        if batch_id == 0:
            return (ROOT_COMMIT_ID.hex(),) * self.num_partitions
        if previous is None:
            if store_name is None:
                log.info("operator %s: no record of batch %d under %s; batch %d opens the default lineage",
                         self.operator_id, batch_id - 1, self.commit_log().location, batch_id)
            return None
        return operator_files.store_ids(previous, self.store_name if store_name is None else store_name)

    def _extra_stores(self, batch_id, previous):
        """The :class:`StoreSpec` of each store ``fn.state_stores`` declares, at the attempts
        the previous batch recorded; one the previous record does not name starts empty."""
        specs = []
        for name, (key, value) in self._settings.extra_stores(self.store_name).items():
            commit_ids = self._base_commit_ids(batch_id, previous, name)
            # recorded before, without this store: it is new to the operator and starts empty
            starts_empty = previous is not None and commit_ids is None
            if starts_empty:
                log.info("operator %s: store %r is new in batch %d (the record of batch %d does not name it); its "
                         "tasks start it empty", self.operator_id, name, batch_id, batch_id - 1)
            specs.append(StoreSpec(name, key.dtype, value.dtype, commit_ids, starts_empty))
        return tuple(specs)

    def _watermarks(self, batch_id, previous, advance_to):
        """The batch's two watermarks (None without an event-time column): the previous
        batch's eviction watermark for late rows, and for eviction that one advanced by the
        previous batch's largest event time less the delay (``docs/event-time.md``)."""
        if self.event_time is None:
            if advance_to is not None:
                raise ValueError("advance_watermark_to needs an event-time column")
            return None
        marks = None if previous is None else previous.get("watermarks")
        if marks is None and batch_id > 0:
            log.info("operator %s: no watermark recorded for batch %d; batch %d starts from 0",
                     self.operator_id, batch_id - 1, batch_id)
        return batch_watermarks(marks, self.delay_us,
                                None if advance_to is None else as_millis(advance_to, "advance_watermark_to"))

    def _refuse_starting_over(self, batch_id, recorded, query_id, run_id):
        """A query whose batch ids start below the recorded ones (a new Spark checkpoint over
        state imported by ``statecore import-spark``, or that outlived its query's checkpoint)
        would re-execute them and delete the state's later versions: ValueError, before any
        record is deleted or anything runs.

        Batch ids at or below the newest record are a re-execution only within the query that
        wrote it: the same query id (a classic session's streaming query), or, where the record
        names no query (written outside a streaming query, or under Spark Connect, where a batch
        function cannot learn its query), the same run. The newest batch alone may also be run
        again by a run that cannot be told from its query (either names no query), if an
        operator wrote it: how Spark restarts a query whose last batch it had not committed. A
        record written before records named their query is taken as one that names none."""
        if not recorded or batch_id > recorded[-1]:
            return
        newest = self.commit_record(recorded[-1])
        if newest is None:
            return
        writer = newest.get("query_id")
        if query_id is not None and writer == query_id:
            return
        by_operator = newest["writer"] == operator_files.WRITER_OPERATOR  # checked_record's default: an operator
        if by_operator and writer is None and query_id is None and newest["run_id"] == str(run_id):
            return
        if by_operator and batch_id == recorded[-1] and (writer is None or query_id is None):
            # The newest batch run again by a run that cannot be told from the query's: how
            # Spark restarts a query whose last batch it had not committed (refusing it would
            # leave only an offset that counts the batch twice). A new Spark checkpoint over
            # state whose newest batch is 0 looks the same, and is let through.
            log.info("operator %s: batch %d re-executed by run %s over the record of %s (%s)", self.operator_id,
                     batch_id, run_id, f"query {writer}" if writer else f"run {newest['run_id']}",
                     self.commit_log().path(batch_id))
            return
        if writer:
            by = f"query {writer}"
        elif not by_operator:
            by = f"statecore {newest['writer']}"
        else:
            by = f"run {newest['run_id']} (outside a streaming query, or under Spark Connect)"
        this = query_id or f"run {run_id}, outside a streaming query or under Spark Connect"
        raise ValueError(
            f"operator {self.operator_id}: batch {batch_id} would re-execute the state under {self.operator_dir}, "
            f"which holds batches up to {recorded[-1]} written by {by}, not by this query ({this}); running it "
            f"would delete the later versions. A new Spark checkpoint starts its batch ids at 0 again: to continue "
            f"from this state, create the operator with batch_id_offset="
            f"{recorded[-1] + 1 - (batch_id - self.batch_id_offset)}; to start over on purpose, delete "
            f"{self.operator_dir} first (docs/operator.md, \"Starting over\"). Nothing was deleted or run")

    def _batch_timestamp_ms(self, batch_id, recorded, clock_ms):
        """The batch's processing time: the one its record holds when the batch is run again
        over its own record (as Spark replays a batch's timestamp from its offset log), else
        the clock's reading as the batch began."""
        if batch_id in recorded:
            record = self.commit_record(batch_id)
            if record is not None and record.get("batch_timestamp_ms") is not None:
                return record["batch_timestamp_ms"]
        if not isinstance(clock_ms, int) or isinstance(clock_ms, bool) or clock_ms < 0:
            raise TypeError(f"the clock's now_ms() must return int milliseconds >= 0, got {clock_ms!r}")
        return clock_ms

    def _record_batch(self, records, state_info, statuses, watermarks, query_id, batch_timestamp_ms):
        """Write the record of the batch whose job just succeeded: each partition's winner
        of each store, the batch's watermarks and largest event time, its processing time, the
        rows it dropped as late (what a Spark Connect client reads of the batch)."""
        batch_id = state_info.store_version
        if state_info.commit_ids is not None:
            opened = tuple(s.base_commit_id for s in statuses)
            if opened != state_info.commit_ids:
                raise RuntimeError(f"operator {self.operator_id} batch {batch_id}: the tasks opened version "
                                   f"{batch_id} at {opened}, not at the recorded {state_info.commit_ids}")
        names = statuses[0].store_commit_ids if statuses else {}
        store_commit_ids = {name: [s.store_commit_ids[name]["commit_id"] for s in statuses] for name in names}
        marks = None
        if watermarks is not None:
            maxima = [s.max_event_time_us for s in statuses if s.max_event_time_us is not None]
            marks = {"for_late_events_ms": watermarks.for_late_events, "for_eviction_ms": watermarks.for_eviction,
                     "max_event_time_us": max(maxima) if maxima else None}
        records.write(batch_id, operator_files.commit_record(
            batch_id, self.num_partitions, self.store_name, state_info.query_run_id,
            [s.commit_id for s in statuses], [s.base_commit_id for s in statuses],
            store_commit_ids=store_commit_ids, watermarks=marks, query_id=query_id,
            batch_timestamp_ms=batch_timestamp_ms, late_rows=sum(s.late_rows for s in statuses)))

    def _with_initial_state(self, df, batch_id):
        """Batch 0 carries the ``initial_state`` rows too, marked (other columns null)."""
        if self.initial_state is None or batch_id != 0:
            return df
        from pyspark.sql import functions as F

        initial = self.initial_state
        if not _is_dataframe(initial):
            initial = initial(df.sparkSession)
            if not _is_dataframe(initial):
                raise TypeError(f"the initial_state function returned a {type(initial).__name__}, not a DataFrame")
        missing = [c for c in self.key_columns if c not in initial.columns]
        if missing:
            raise ValueError(f"the initial state has no key column '{missing[0]}' (columns: {initial.columns})")
        return (df.withColumn(INITIAL_STATE_COLUMN, F.lit(False))
                .unionByName(initial.withColumn(INITIAL_STATE_COLUMN, F.lit(True)), allowMissingColumns=True))

    def _routed(self, df):
        """``(df, routing_keys)``: ``df`` (after ``fn.prepare``, if any) hash-partitioned by the
        key columns into the operator's partitions. The task checks that each row's key belongs
        to its partition: from the key columns themselves when all are of fixed-width types
        (``routing_keys``: the columns and their Spark types), else from a column Spark adds
        with the partition of each row (``routing_keys`` None)."""
        from pyspark.sql import functions as F

        df = self.contract.prepare(df, self.key_columns)
        missing = [c for c in self.key_columns if c not in df.columns]
        if missing:
            raise ValueError(f"fn.prepare returned a DataFrame without the key column '{missing[0]}' "
                             f"(columns: {df.columns})")
        routed = df.repartition(self.num_partitions, *self.key_columns)
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        key_types = tuple(types[c] for c in self.key_columns)
        if all(t in FIXED_WIDTH_TYPES for t in key_types):
            return routed, (tuple(self.key_columns), key_types)
        keys = ", ".join(f"`{c}`" for c in self.key_columns)
        return routed.withColumn(PARTITION_COLUMN, F.expr(f"pmod(hash({keys}), {self.num_partitions})")), None

    def _record_progress(self, batch_id, run_id, statuses, re_execution, seconds, watermarks):
        metrics = StateStoreMetrics.combine(
            StateStoreMetrics(s.num_keys, s.memory_used_bytes, s.custom_metrics) for s in statuses)
        loaded = sum(1 for s in statuses if s.already_loaded)
        self.last_progress = {
            "batch_id": batch_id, "query_run_id": str(run_id), "committed_version": batch_id + 1,
            "num_partitions": self.num_partitions,
            "rows_in": sum(s.rows_in for s in statuses), "rows_out": sum(s.rows_out for s in statuses),
            "state_keys": metrics.num_keys, "memory_used_bytes": metrics.memory_used_bytes,
            "custom_metrics": metrics.custom_metrics, "stores_already_loaded": loaded,
            "stores_loaded_from_files": len(statuses) - loaded, "re_execution": re_execution,
            "seconds": seconds, "partitions": [dataclasses.asdict(s) for s in statuses],
            "fn_counts": _summed_counts(s.fn_counts for s in statuses),
        }
        if watermarks is not None:
            maxima = [s.max_event_time_us for s in statuses if s.max_event_time_us is not None]
            self.last_progress.update({
                "watermark_for_late_events_ms": watermarks.for_late_events,
                "watermark_for_eviction_ms": watermarks.for_eviction,
                "max_event_time_ms": max(maxima) // 1000 if maxima else None,
                "late_rows": sum(s.late_rows for s in statuses)})


def _empty_partitions(spark, schema, num_partitions):
    """A DataFrame of ``schema`` with no rows in ``num_partitions`` partitions, each of which
    still runs a task: a ``range`` of one row per slice (public on classic and Connect sessions
    alike) filtered to none inside the task (an empty ``range(0, 0)`` ran no task under Spark
    Connect: tests/spark/test_connect_operator.py), every column a typed null."""
    from pyspark.sql import functions as F

    return spark.range(0, num_partitions, 1, num_partitions).where(F.col("id") < 0).select(
        *[F.lit(None).cast(field.dataType).alias(field.name) for field in schema.fields])


def _kind_class(dtype):
    """What values a numpy field holds, as a key column's check compares them."""
    return {"S": "bytes", "b": "boolean", "f": "floating-point", "i": "integer", "u": "integer"}.get(
        dtype.kind, str(dtype))


def _summed_counts(counts):
    """The partitions' ``fn_counts`` (dicts of ints), summed by name."""
    total = {}
    for partition in counts:
        for name, value in partition.items():
            total[name] = total.get(name, 0) + value
    return total


def _is_dataframe(obj):
    """Whether ``obj`` is a PySpark DataFrame, classic or Spark Connect (both derive from
    ``pyspark.sql.DataFrame``)."""
    from pyspark.sql import DataFrame

    return isinstance(obj, DataFrame)
