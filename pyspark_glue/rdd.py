"""Stateful partitions: Spark's ``mapPartitionsWithStateStore`` for Python RDDs.

``map_partitions_with_state_store(rdd, fn, state_info, key_schema, value_schema)`` runs
``fn(store, rows)`` for every partition ``p`` of ``rdd`` with the store of
``(state_info.operator_id, p)`` at ``state_info.store_version``. This module owns the task
side (opening the store from the worker's registry, ending it, keeping the worker), the
preferred locations, and shipping ``fn``'s module to the workers. How each works and why:
``docs/rdd.md``.
"""
import dataclasses
import logging
import os
import sys
import sysconfig
import threading
import uuid
import weakref

from pyspark.accumulators import AccumulatorParam

from statecore.conf import StateStoreConf
from statecore.ids import StateStoreId, StateStoreProviderId
from statecore.checkpoint import checked_commit_ids
from statecore.rpc import CALL_ERRORS

from pyspark_glue import executor, spark_internals
from pyspark_glue.local_workers import check_local_workers
from pyspark_glue.session_kind import require_classic

__all__ = ["StatefulOperatorStateInfo", "map_partitions_with_state_store", "map_partitions_with_read_state_store",
           "preferred_locations", "load_count_accumulator", "ship_function_module"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StatefulOperatorStateInfo:
    """Where a stateful operator keeps its stores and which version a batch reads (Spark's
    ``StatefulOperatorStateInfo``). ``checkpoint_location`` is the state root (kept exactly
    as given); ``store_version`` is the version the batch's stores start from (the batch id
    in a streaming query); ``num_partitions`` is the operator's fixed number of partitions;
    ``commit_ids``, if given, names per partition the attempt of ``store_version`` to open
    (16 hex digits each: what the driver recorded as the previous batch's winners, Spark
    4's ``stateStoreCkptIds``); None opens the default lineage."""

    checkpoint_location: str
    query_run_id: uuid.UUID
    operator_id: int
    store_version: int
    num_partitions: int
    commit_ids: tuple = None

    def __post_init__(self):
        if not isinstance(self.checkpoint_location, str) or not self.checkpoint_location:
            raise ValueError(f"checkpoint_location must be a non-empty str, got {self.checkpoint_location!r}")
        if not isinstance(self.query_run_id, uuid.UUID):
            raise TypeError(f"query_run_id must be a uuid.UUID, got {type(self.query_run_id).__name__}")
        for name in ("operator_id", "store_version", "num_partitions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.num_partitions == 0:
            raise ValueError("num_partitions must be >= 1")
        if self.commit_ids is not None:
            object.__setattr__(self, "commit_ids",
                               checked_commit_ids(self.commit_ids, self.num_partitions, "commit_ids"))

    def commit_id(self, partition_id):
        """The attempt of ``store_version`` partition ``partition_id`` opens (None: the default
        lineage)."""
        return None if self.commit_ids is None else self.commit_ids[partition_id]

    def provider_id(self, partition_id, store_name=StateStoreId.DEFAULT_STORE_NAME):
        """The :class:`~statecore.StateStoreProviderId` of partition ``partition_id``."""
        return StateStoreProviderId(StateStoreId(self.checkpoint_location, self.operator_id, partition_id, store_name),
                                    self.query_run_id)

    def __str__(self):
        return (f"state info [ checkpoint = {self.checkpoint_location}, runId = {self.query_run_id}, "
                f"opId = {self.operator_id}, ver = {self.store_version}, numPartitions = {self.num_partitions}]")


# -- worker side -------------------------------------------------------------------------------

_open_lock = threading.Lock()
_open_stores = {}  # id(store) -> (task attempt id, weakref to store) of stores opened by tasks, not yet ended


def _task_attempt_id():
    from pyspark.taskcontext import TaskContext  # imported in workers only (pyspark is there)
    ctx = TaskContext.get()
    return None if ctx is None else ctx.taskAttemptId()


def _abort_leftovers(attempt):
    """Abort stores still open from other task attempts of this process (their outputs were
    never closed); a worker runs one task at a time, so they are abandoned."""
    with _open_lock:
        stale = [(key, ref) for key, (owner, ref) in _open_stores.items() if owner != attempt]
        for key, _ref in stale:
            del _open_stores[key]
    for _key, ref in stale:
        store = ref()
        if store is not None and not getattr(store, "has_committed", False):
            log.warning("aborting %s left open by an earlier task", getattr(store, "id", store))
            store.abort()


def _run_partition(partition_id, rows, fn, state_info, key_schema, value_schema, conf, coordinator_address,
                   authkey, read_only, load_accumulator, drain=None):
    """The partition's output: ``fn(store, rows)``, then the store's end (``docs/rdd.md``).

    ``drain``: the task's input iterator, read to its end once the output ends or is closed
    (not when ``fn`` raised): PySpark reuses a Python worker only if the task read all its
    input, and a worker that is not reused takes its loaded stores with it (a read ``fn``
    that ignores its rows would otherwise cost every store on every task)."""
    attempt = _task_attempt_id()
    _abort_leftovers(attempt)
    executor.ensure_worker_registry(coordinator_address, authkey)
    provider_id = state_info.provider_id(partition_id)
    store, already_loaded = executor.open_store(provider_id, key_schema, value_schema, state_info.store_version,
                                                conf, read_only=read_only,
                                                commit_id=state_info.commit_id(partition_id))
    if load_accumulator is not None:
        load_accumulator.add((1, 0) if already_loaded else (0, 1))
    key = id(store)
    with _open_lock:
        _open_stores[key] = (attempt, weakref.ref(store))
    try:
        output = fn(store, rows)
        if output is None:
            raise TypeError(f"fn must return an iterator (or iterable) of output rows, got None for partition "
                            f"{partition_id}")
        yield from output
    except GeneratorExit:  # the consumer stopped early (take): this task is over all the same
        _drain(drain)
        raise
    else:
        _drain(drain)
    finally:
        with _open_lock:
            _open_stores.pop(key, None)
        if read_only or not store.has_committed:
            store.abort()


def _drain(iterator):
    if iterator is not None:
        for _ in iterator:
            pass


def _decode_frames(frames, deserializer):
    """The rows of a partition's serialized frames (pickled batches, or pickled rows), as the
    parent RDD's ``deserializer`` would have read them."""
    from pyspark.serializers import BatchedSerializer

    if isinstance(deserializer, BatchedSerializer):
        loads = deserializer.serializer.loads
        for frame in frames:
            yield from loads(frame)
    else:
        loads = deserializer.loads
        for frame in frames:
            yield loads(frame)


def _partition_function(fn, state_info, key_schema, value_schema, conf, coordinator_address, authkey, read_only,
                        piloted, load_accumulator):
    """The function shipped to the workers: references only this module (importable there)
    and ``fn``. ``piloted``: None, or ``(deserializer, parent_func)`` when the partition is one
    list of the parent's serialized frames (the pilot route; ``parent_func`` is the parent's
    own pipelined Python function, or None)."""

    def run(partition_id, iterator):
        drain = None
        if piloted is None:
            rows = drain = iterator
        else:
            deserializer, parent_func = piloted
            elements = list(iterator)
            if len(elements) != 1:
                raise RuntimeError(f"partition {partition_id}: expected one list of frames, got {len(elements)} "
                                   f"elements")
            rows = _decode_frames(elements[0], deserializer)
            if parent_func is not None:
                rows = parent_func(partition_id, rows)
        return _run_partition(partition_id, rows, fn, state_info, key_schema, value_schema, conf,
                              coordinator_address, authkey, read_only, load_accumulator, drain)

    return run


# -- driver side -------------------------------------------------------------------------------

def preferred_locations(state_info, coordinator):
    """Per partition, the Spark location strings (``[]`` or ``["executor_<host>_<id>"]``)
    where its store was last loaded, according to ``coordinator``; None if it knows none or
    cannot be reached (logged)."""
    try:
        locations = [executor.spark_location(coordinator.get_location(state_info.provider_id(p)))
                     for p in range(state_info.num_partitions)]
    except CALL_ERRORS as e:
        log.warning("state store coordinator at %s unreachable (%s: %s): no preferred locations",
                    getattr(coordinator, "address", "?"), type(e).__name__, e)
        return None
    if all(loc is None for loc in locations):
        return None
    return [[] if loc is None else [loc] for loc in locations]


def load_count_accumulator(sc):
    """A Spark accumulator of ``(already_loaded, loaded_from_files)`` task counts, to pass as
    ``load_accumulator=``; ``.value`` on the driver after the job."""
    return sc.accumulator((0, 0), _PairParam())


class _PairParam(AccumulatorParam):  # module level: pickles by reference
    def zero(self, value):
        return (0, 0)

    def addInPlace(self, a, b):
        return (a[0] + b[0], a[1] + b[1])


_STATIC_PACKAGES = {"statecore", "pyspark_glue", "pyspark", "py4j", "numpy", "pyarrow", "pandas"}


def _library_dirs():
    dirs = set()
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(name)
        if path:
            dirs.add(os.path.realpath(path))
    try:
        import site
        dirs.update(os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()])
    except (AttributeError, TypeError):
        pass
    return dirs


def ship_function_module(fn):
    """Make ``fn`` picklable for workers that cannot import its module: register the
    module's top-level package with cloudpickle's ``register_pickle_by_value`` unless it is
    ``__main__`` (pickled by value anyway), installed (site-packages, standard library) or
    one of the packages every worker has. Returns the name registered, or None."""
    module_name = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", None)
    if module_name is None and hasattr(fn, "func"):  # functools.partial
        module_name = getattr(fn.func, "__module__", None)
    if not module_name or module_name == "__main__" or module_name not in sys.modules:
        return None  # cloudpickle pickles functions of unknown modules by value
    top = module_name.split(".", 1)[0]
    if top in _STATIC_PACKAGES or top in sys.builtin_module_names:
        return None
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return None  # a namespace package or a built-in: leave it to cloudpickle
    path = os.path.realpath(path)
    if any(path.startswith(d + os.sep) for d in _library_dirs()):
        return None
    from pyspark import cloudpickle

    if top not in cloudpickle.list_registry_pickle_by_value():
        cloudpickle.register_pickle_by_value(module)
        log.info("pickling module %s by value for the workers (it is not installed: %s)", top, path)
    return top


def _map(rdd, fn, state_info, key_schema, value_schema, conf, coordinator, read_only, load_accumulator):
    require_classic(rdd, "map_partitions_with_read_state_store" if read_only else "map_partitions_with_state_store")
    check_local_workers(rdd.context)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(state_info, StatefulOperatorStateInfo):
        raise TypeError(f"state_info must be a StatefulOperatorStateInfo, got {type(state_info).__name__}")
    num_partitions = rdd.getNumPartitions()
    if num_partitions != state_info.num_partitions:
        raise ValueError(f"the RDD has {num_partitions} partitions but {state_info} says "
                         f"{state_info.num_partitions}: the number of partitions of a stateful operator is fixed")
    conf = StateStoreConf() if conf is None else conf
    ship_function_module(fn)
    address = authkey = locations = None
    if coordinator is not None:
        address, authkey = tuple(coordinator.address), coordinator.authkey
        locations = preferred_locations(state_info, coordinator)
    if locations is None:
        data, piloted = rdd, None
    else:
        data, deserializer, parent_func = spark_internals.rdd_with_preferred_locations(rdd, locations)
        piloted = (deserializer, parent_func)
    run = _partition_function(fn, state_info, key_schema, value_schema, conf, address, authkey, read_only, piloted,
                              load_accumulator)
    return data.mapPartitionsWithIndex(run)


def map_partitions_with_state_store(rdd, fn, state_info, key_schema, value_schema, conf=None, coordinator=None, *,
                                    load_accumulator=None):
    """Spark's ``rdd.mapPartitionsWithStateStore``: an RDD whose partition ``p`` is
    ``fn(store, rows)``, ``store`` being the writable store of partition ``p`` at
    ``state_info.store_version`` (``docs/rdd.md``).

    Parameters
    ----------
    rdd : pyspark.RDD
        Its number of partitions must equal ``state_info.num_partitions``. A classic session's
        (a Spark Connect DataFrame or session raises ``ClassicSessionRequired``: ``docs/rdd.md``).
    fn : callable ``(StateStore, iterator of rows) -> iterable``
        Commits the store to write version ``store_version + 1``; otherwise it is aborted.
    state_info : StatefulOperatorStateInfo
    key_schema, value_schema : numpy structured dtypes
    conf : StateStoreConf, optional
        Default ``StateStoreConf()``.
    coordinator : StateStoreCoordinatorRef, optional
        The driver's coordinator (:func:`pyspark_glue.driver.coordinator_for`): workers report
        the stores they load to it, and tasks prefer the executor that has their store.
    load_accumulator : accumulator, optional
        From :func:`load_count_accumulator`: counts tasks whose store was already loaded in
        their worker versus loaded from files.
    """
    return _map(rdd, fn, state_info, key_schema, value_schema, conf, coordinator, False, load_accumulator)


def map_partitions_with_read_state_store(rdd, fn, state_info, key_schema, value_schema, conf=None, coordinator=None,
                                         *, load_accumulator=None):
    """Like :func:`map_partitions_with_state_store` with a read-only store, always aborted
    at the end of the task (Spark's ``mapPartitionsWithReadStateStore``)."""
    return _map(rdd, fn, state_info, key_schema, value_schema, conf, coordinator, True, load_accumulator)
