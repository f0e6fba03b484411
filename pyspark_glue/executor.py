"""The worker side of the glue: who this Python worker is, its registry's coordinator, and
opening stores with a count of how often a store was already loaded.

Runs inside PySpark's Python workers (and in the driver for local tests); it imports no
pyspark, so any task body (RDD ``mapPartitions``, ``mapInArrow``, ...) may call it. How an
executor is identified, why a worker reports ``"<spark executor id>.<pid>"``, and what
worker reuse means for loaded stores: docs/cluster.md, "Executor identity and the
coordinator".

Thread-safety: every function may be called from any thread of a worker.
"""
import logging
import os
import re
import threading
import time
from urllib.parse import parse_qs, urlparse

from statecore import registry
from statecore.rpc import CALL_ERRORS
from statecore.coordinator import StateStoreCoordinatorRef, executor_location, executor_of, parse_executor_location

__all__ = ["executor_identity", "worker_executor_id", "spark_location", "ensure_worker_registry",
           "open_store", "unload_other_runs", "load_counts", "reset_load_counts", "COORDINATOR_RETRY_S"]

log = logging.getLogger(__name__)

_EXECUTOR_BACKEND = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
_MAX_ANCESTRY = 12
COORDINATOR_RETRY_S = 30.0  # after a failed call, the coordinator is left alone this long

_lock = threading.Lock()
_identity = None  # (pid, host, spark executor id): recomputed after a fork
_coordinator = None  # (pid, address, authkey, wrapped ref)
_reuse_warned = False
_counts = {"pid": None, "already_loaded": 0, "loaded_from_files": 0}


# -- identity ----------------------------------------------------------------------------------

def _proc_parent(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm) state": ppid


def _proc_cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]


def _option(args, name):
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _from_ancestry():
    """(executor id, hostname) of the executor JVM among this process's ancestors, or
    (None, None): the driver (local mode), or no /proc."""
    try:
        pid = os.getppid()
        for _ in range(_MAX_ANCESTRY):
            if pid <= 1:
                break
            args = _proc_cmdline(pid)
            if _EXECUTOR_BACKEND in args:
                return _option(args, "--executor-id"), _option(args, "--hostname")
            if any(a == "org.apache.spark.deploy.SparkSubmit" for a in args):
                break  # the driver JVM: local mode
            pid = _proc_parent(pid)
    except (OSError, ValueError, IndexError):
        pass
    return None, None


def _from_log_url():
    url = os.environ.get("SPARK_LOG_URL_STDERR") or os.environ.get("SPARK_LOG_URL_STDOUT")
    if not url:
        return None
    ids = parse_qs(urlparse(url).query).get("executorId")
    if ids and ids[0]:
        return ids[0]
    match = re.search(r"executorId=([^&/]+)", url)
    return match.group(1) if match else None


def _compute_identity():
    executor_id = _from_log_url() or os.environ.get("SPARK_EXECUTOR_ID") or None
    ancestor_id, hostname = _from_ancestry()
    executor_id = executor_id or ancestor_id or "driver"
    host = (hostname or os.environ.get("SPARK_EXECUTOR_POD_IP") or os.environ.get("SPARK_LOCAL_IP")
            or "127.0.0.1")
    return host, executor_id


def executor_identity():
    """``(host, spark_executor_id)`` of the executor this process works for (where each comes
    from: docs/cluster.md); ``"driver"`` in local mode. Cached per process."""
    global _identity
    pid = os.getpid()
    with _lock:
        if _identity is not None and _identity[0] == pid:
            return _identity[1], _identity[2]
    host, executor_id = _compute_identity()
    with _lock:
        _identity = (pid, host, executor_id)
    return host, executor_id


def worker_executor_id():
    """The executor id this worker reports to the coordinator: ``"<spark executor id>.<pid>"``."""
    return f"{executor_identity()[1]}.{os.getpid()}"


def spark_location(location):
    """Spark's preferred-location string of a coordinator location: strips the ``.<pid>`` of
    ``"executor_<host>_<spark executor id>.<pid>"``. None (the coordinator knows nothing) and
    locations without a pid part are returned as they are."""
    if location is None:
        return None
    host, worker = parse_executor_location(location)
    return executor_location(host, executor_of(worker))


# -- the registry's coordinator ----------------------------------------------------------------

class _TolerantCoordinatorRef:
    """What the registry reports to: a coordinator ref that never fails a task.

    A call that fails (the driver went away, the endpoint was stopped, a timeout) is logged
    and answered with the neutral reply (report: nothing to unload; verify: still active,
    so nothing is unloaded on a guess); for :data:`COORDINATOR_RETRY_S` afterwards the
    coordinator is not called at all, so that a dead address costs no connect per task."""

    def __init__(self, ref):
        self.ref = ref
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def address(self):
        return self.ref.address

    @property
    def authkey(self):
        return self.ref.authkey

    def _call(self, what, neutral, method, *args):
        with self._lock:
            if time.monotonic() < self._down_until:
                return neutral
        try:
            return method(*args)
        except CALL_ERRORS as e:
            with self._lock:
                self._down_until = time.monotonic() + COORDINATOR_RETRY_S
            log.warning("state store coordinator at %s unreachable (%s: %s) during %s; not calling it for %g s",
                        self.ref.address, type(e).__name__, e, what, COORDINATOR_RETRY_S)
            return neutral

    def report_active_instance(self, provider_id, host, executor_id, provider_ids_to_check=()):
        return self._call("report_active_instance", [], self.ref.report_active_instance, provider_id, host,
                          executor_id, provider_ids_to_check)

    def verify_if_instance_active(self, provider_id, executor_id):
        return self._call("verify_if_instance_active", True, self.ref.verify_if_instance_active, provider_id,
                          executor_id)

    def get_location(self, provider_id):
        return self._call("get_location", None, self.ref.get_location, provider_id)


def _warn_if_no_reuse():
    global _reuse_warned
    if _reuse_warned or os.environ.get("SPARK_REUSE_WORKER") == "1":
        return
    _reuse_warned = True
    if "SPARK_REUSE_WORKER" in os.environ or os.environ.get("PYTHON_WORKER_FACTORY_SECRET") is not None:
        log.warning("Python worker reuse is off (spark.python.worker.reuse=false): every task starts a new "
                    "worker, so state stores are loaded from files by every task")


def ensure_worker_registry(coordinator_address, authkey):
    """Point this process's :mod:`statecore.registry` at the coordinator at
    ``coordinator_address`` (a ``(host, port)`` pair) with ``authkey``, reporting as
    (:func:`executor_identity` host, :func:`worker_executor_id`). Call it at the start of
    every task: cheap and idempotent (one ref per address per process, re-set if
    :func:`statecore.registry.stop` forgot it). ``coordinator_address=None``: no coordinator.

    Returns the ref the registry reports to (``report_active_instance``,
    ``verify_if_instance_active``, ``get_location``, ``address``, ``authkey``), or None.
    Never raises because of the coordinator, and neither does that ref: an unreachable one
    is logged and answered neutrally (see :class:`_TolerantCoordinatorRef`). Logs a warning
    once per process if Python worker reuse is off."""
    global _coordinator
    _warn_if_no_reuse()
    if coordinator_address is None:
        with _lock:
            had = _coordinator is not None and _coordinator[0] == os.getpid()
            _coordinator = None
        if had:
            registry.set_coordinator(None, None, None)
        return None
    address = tuple(coordinator_address)
    pid = os.getpid()
    with _lock:
        current = _coordinator
    if current is not None and current[:3] == (pid, address, authkey):
        ref = current[3]
    else:
        ref = _TolerantCoordinatorRef(StateStoreCoordinatorRef.for_executor(address, authkey))
        with _lock:
            _coordinator = (pid, address, authkey, ref)
    host, _ = executor_identity()
    registry.set_coordinator(ref, host, worker_executor_id())
    return ref


# -- opening stores ----------------------------------------------------------------------------

def _count(already_loaded):
    pid = os.getpid()
    with _lock:
        if _counts["pid"] != pid:  # a forked child starts its own counts
            _counts.update(pid=pid, already_loaded=0, loaded_from_files=0)
        _counts["already_loaded" if already_loaded else "loaded_from_files"] += 1


def open_store(provider_id, key_schema, value_schema, version, conf=None, read_only=False,
               key_index_ordinal=None, commit_id=None):
    """``(store, already_loaded)``: the store of ``provider_id`` at ``version`` from this
    process's registry (:func:`statecore.registry.get`, or ``get_read_only``), and whether
    its provider was loaded here before this call (else it was opened from files). Counted
    in :func:`load_counts`. ``commit_id``: the attempt of ``version`` the driver recorded
    (None: the default lineage)."""
    already_loaded = registry.is_loaded(provider_id)
    get = registry.get_read_only if read_only else registry.get
    store = get(provider_id, key_schema, value_schema, version, conf, key_index_ordinal, commit_id=commit_id)
    _count(already_loaded)
    return store, already_loaded


def unload_other_runs(provider_id):
    """Unload this worker's instances of the same store loaded by other runs: they hold
    versions of a lineage the new run may have abandoned. Returns the ids unloaded."""
    others = [other for other in registry.loaded_provider_ids()
              if other != provider_id and other.store_id == provider_id.store_id]
    for other in others:
        registry.unload(other)
    return others


def load_counts():
    """This process's counts of :func:`open_store` calls: ``{"already_loaded": n,
    "loaded_from_files": m}``."""
    pid = os.getpid()
    with _lock:
        if _counts["pid"] != pid:
            return {"already_loaded": 0, "loaded_from_files": 0}
        return {"already_loaded": _counts["already_loaded"], "loaded_from_files": _counts["loaded_from_files"]}


def reset_load_counts():
    with _lock:
        _counts.update(pid=os.getpid(), already_loaded=0, loaded_from_files=0)
