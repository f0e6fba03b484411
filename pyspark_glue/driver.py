"""The driver side of the glue: one StateStoreCoordinator per SparkContext.

Spark starts its ``StateStoreCoordinator`` inside the driver's RPC environment, one per
SparkSession's query manager. PySpark cannot add endpoints to the JVM's RpcEnv, so the
driver's Python process runs statecore's own :class:`~statecore.rpc.RpcEnv` with the
coordinator in it; tasks carry its ``address`` and ``authkey`` (see
:mod:`pyspark_glue.executor`).

- :func:`coordinator_for` starts it on first use for a SparkContext (later calls, from any
  session of that context, return a ref to the same coordinator) and gives back the
  :class:`~statecore.coordinator.StateStoreCoordinatorRef`.
- :func:`deactivate` forgets a query run's instances, for when a query stops (Spark's
  ``StreamingQueryManager.notifyQueryTermination``): the executors' maintenance then unloads
  those stores, and a restarted query (a new run id) starts with no preferences.
- :func:`stop` shuts it down. It also shuts down by itself soon after its SparkContext
  stops (a watcher thread notices that the context is no longer the active one), and at
  interpreter exit.

The RpcEnv binds to ``spark.driver.host`` (where executors already reach the driver), else
``SPARK_LOCAL_IP``, else 127.0.0.1; ``spark.statecore.coordinator.host`` overrides it.

Thread-safety: every function may be called from any thread.
"""
import atexit
import logging
import os
import threading

from statecore.coordinator import StateStoreCoordinatorRef
from statecore.rpc import RpcEnv

from pyspark_glue import spark_internals

__all__ = ["CoordinatorService", "coordinator_for", "active_coordinator", "rpc_env_for", "deactivate", "stop"]

log = logging.getLogger(__name__)

HOST_CONF = "spark.statecore.coordinator.host"
_WATCH_INTERVAL_S = 1.0

_lock = threading.Lock()
_services = {}  # id(SparkContext) -> CoordinatorService


def _context(spark):
    """The SparkContext of a SparkSession or SparkContext."""
    return spark_internals.spark_context(spark)


def _is_active(sc):
    return spark_internals.context_is_active(sc)


class CoordinatorService:
    """The RpcEnv and coordinator of one SparkContext (use :func:`coordinator_for`)."""

    def __init__(self, sc):
        conf = sc.getConf()
        host = conf.get(HOST_CONF) or conf.get("spark.driver.host") or os.environ.get("SPARK_LOCAL_IP") or "127.0.0.1"
        self.sc = sc
        self.env = RpcEnv(host=host)
        self.ref = StateStoreCoordinatorRef.for_driver(self.env)
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="statecore-coordinator-watch", daemon=True)
        self._watcher.start()
        log.info("StateStoreCoordinator for application %s listening on %s", sc.applicationId, self.env.address)

    def _watch(self):
        while not self._stopped.wait(_WATCH_INTERVAL_S):
            if not _is_active(self.sc):
                log.info("SparkContext stopped: stopping its StateStoreCoordinator")
                _drop(self)
                return

    def stop(self):
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.ref.stop()
        except Exception as e:  # the env may be half gone at interpreter exit
            log.debug("stopping the coordinator endpoint: %s", e)
        self.env.shutdown()


def _drop(service):
    with _lock:
        for key, value in list(_services.items()):
            if value is service:
                del _services[key]
    service.stop()


def coordinator_for(spark):
    """The :class:`StateStoreCoordinatorRef` of ``spark``'s context (a SparkSession or
    SparkContext), starting the coordinator on first use. Its ``address`` and ``authkey``
    are what tasks need (pass the ref as ``coordinator=`` to
    :func:`pyspark_glue.rdd.map_partitions_with_state_store`)."""
    sc = _context(spark)
    if not _is_active(sc):
        raise RuntimeError("the SparkContext is stopped: no state store coordinator for it")
    stale = []
    with _lock:
        for key, service in list(_services.items()):
            if not _is_active(service.sc):
                stale.append(_services.pop(key))
        service = _services.get(id(sc))
        if service is None:
            service = _services[id(sc)] = CoordinatorService(sc)
    for old in stale:
        old.stop()
    return service.ref


def active_coordinator(spark):
    """The coordinator ref of ``spark``'s context if one was started, else None."""
    with _lock:
        service = _services.get(id(_context(spark)))
    return None if service is None else service.ref


def deactivate(spark, run_id):
    """Forget every store instance of the query run ``run_id`` (a ``uuid.UUID``), as when a
    query stops. A no-op if no coordinator was started for ``spark``'s context."""
    ref = active_coordinator(spark)
    if ref is not None:
        ref.deactivate_instances(run_id)


def stop(spark=None):
    """Stop the coordinator of ``spark``'s context (every coordinator if None)."""
    with _lock:
        if spark is None:
            services = list(_services.values())
            _services.clear()
        else:
            service = _services.pop(id(_context(spark)), None)
            services = [] if service is None else [service]
    for service in services:
        service.stop()


atexit.register(stop)


def rpc_env_for(spark):
    """The driver's :class:`~statecore.rpc.RpcEnv` of ``spark``'s context (started with its
    coordinator on first use), for other driver-side endpoints: the EpochCoordinators of
    continuous queries (:mod:`pyspark_glue.continuous`) live there, so tasks reach every
    driver endpoint at one address."""
    coordinator_for(spark)
    with _lock:
        service = _services.get(id(_context(spark)))
    if service is None:
        raise RuntimeError("the SparkContext stopped: no driver RpcEnv for it")
    return service.env
