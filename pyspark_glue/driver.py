"""The driver side of the glue: one StateStoreCoordinator per Spark application in this process.

Spark starts its ``StateStoreCoordinator`` inside the driver's RPC environment, one per
SparkSession's query manager. PySpark cannot add endpoints to the JVM's RpcEnv, so the
driver's Python process runs statecore's own :class:`~statecore.rpc.RpcEnv` with the
coordinator in it; tasks carry its ``address`` and ``authkey`` (see
:mod:`pyspark_glue.executor`). Under Spark Connect, the process is the Python worker the
server starts for a query's ``foreachBatch`` (on the driver's machine): the coordinator lives
there, for that query run.

- :func:`coordinator_for` starts it on first use for an application (later calls, from any
  session of that application, return a ref to the same coordinator) and gives back the
  :class:`~statecore.coordinator.StateStoreCoordinatorRef`. The application is named and
  configured through public settings only (``spark.app.id``, ``spark.driver.host``), read
  from a session's ``spark.conf`` (classic or Connect) or a SparkContext's ``getConf()``.
- :func:`deactivate` forgets a query run's instances, for when a query stops (Spark's
  ``StreamingQueryManager.notifyQueryTermination``): the executors' maintenance then unloads
  those stores, and a restarted query (a new run id) starts with no preferences.
- :func:`stop` shuts it down, and so does interpreter exit (under Connect, the end of the
  query's worker process). With a classic SparkContext it also shuts down by itself soon
  after the context stops (a watcher thread notices that the context is no longer the active
  one, :func:`pyspark_glue.spark_internals.context_is_active`).

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
APP_ID_CONF = "spark.app.id"
_WATCH_INTERVAL_S = 1.0

_lock = threading.Lock()
_services = {}  # spark.app.id -> CoordinatorService


def _setting(spark, key):
    """The Spark setting ``key`` of a session (``spark.conf``, classic or Connect) or of a
    SparkContext (``getConf()``), or None."""
    get_conf = getattr(spark, "getConf", None)
    if get_conf is not None:
        return get_conf().get(key) or None
    return spark.conf.get(key, None) or None


def _application_id(spark):
    app_id = _setting(spark, APP_ID_CONF)
    if not app_id:
        raise RuntimeError(f"the session has no {APP_ID_CONF}: no state store coordinator for it")
    return app_id


def _is_active(sc):
    """Whether a classic SparkContext still runs; True without one (Connect: the process's life)."""
    return sc is None or spark_internals.context_is_active(sc)


class CoordinatorService:
    """The RpcEnv and coordinator of one Spark application (use :func:`coordinator_for`);
    ``sc``: its classic SparkContext, watched, or None (Spark Connect)."""

    def __init__(self, spark, app_id, sc):
        host = (_setting(spark, HOST_CONF) or _setting(spark, "spark.driver.host") or os.environ.get("SPARK_LOCAL_IP")
                or "127.0.0.1")
        self.sc = sc
        self.env = RpcEnv(host=host)
        self.ref = StateStoreCoordinatorRef.for_driver(self.env)
        self._stopped = threading.Event()
        if sc is not None:
            self._watcher = threading.Thread(target=self._watch, name="statecore-coordinator-watch", daemon=True)
            self._watcher.start()
        log.info("StateStoreCoordinator for application %s listening on %s", app_id, self.env.address)

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
    """The :class:`StateStoreCoordinatorRef` of ``spark``'s application (a SparkSession,
    classic or Connect, or a SparkContext), starting the coordinator on first use. Its
    ``address`` and ``authkey`` are what tasks need (pass the ref as ``coordinator=`` to
    :func:`pyspark_glue.rdd.map_partitions_with_state_store`)."""
    sc = spark_internals.classic_context(spark)
    if not _is_active(sc):
        raise RuntimeError("the SparkContext is stopped: no state store coordinator for it")
    app_id = _application_id(spark)
    stale = []
    with _lock:
        for key, service in list(_services.items()):
            if not _is_active(service.sc):
                stale.append(_services.pop(key))
        service = _services.get(app_id)
        if service is None:
            service = _services[app_id] = CoordinatorService(spark, app_id, sc)
    for old in stale:
        old.stop()
    return service.ref


def active_coordinator(spark):
    """The coordinator ref of ``spark``'s application if one was started, else None."""
    app_id = _application_id(spark)
    with _lock:
        service = _services.get(app_id)
    return None if service is None else service.ref


def deactivate(spark, run_id):
    """Forget every store instance of the query run ``run_id`` (a ``uuid.UUID``), as when a
    query stops. A no-op if no coordinator was started for ``spark``'s application."""
    ref = active_coordinator(spark)
    if ref is not None:
        ref.deactivate_instances(run_id)


def stop(spark=None):
    """Stop the coordinator of ``spark``'s application (every coordinator if None)."""
    app_id = None if spark is None else _application_id(spark)
    with _lock:
        if spark is None:
            services = list(_services.values())
            _services.clear()
        else:
            service = _services.pop(app_id, None)
            services = [] if service is None else [service]
    for service in services:
        service.stop()


atexit.register(stop)


def rpc_env_for(spark):
    """The driver's :class:`~statecore.rpc.RpcEnv` of ``spark``'s application (started with its
    coordinator on first use), for other driver-side endpoints: the EpochCoordinators of
    continuous queries (:mod:`pyspark_glue.continuous`) live there, so tasks reach every
    driver endpoint at one address."""
    coordinator_for(spark)
    app_id = _application_id(spark)
    with _lock:
        service = _services.get(app_id)
    if service is None:
        raise RuntimeError("the SparkContext stopped: no driver RpcEnv for it")
    return service.env
