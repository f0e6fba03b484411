"""The executor-side registry: one per process (Spark's ``object StateStore``).

It loads providers by :class:`~statecore.StateStoreProviderId` and keeps them loaded across
micro-batches, and runs the maintenance thread, started on the first :func:`get`, that
every ``maintenance_interval_s`` runs each provider's ``do_maintenance`` (spills, snapshots
and cleanup; a commit that asks for a spill wakes it in between to spill only) and then, if
a coordinator was set, unloads the providers the coordinator says are no longer active
here. A provider whose maintenance raises is logged and unloaded; the others go on (Spark
4.0). Without a coordinator nothing is ever unloaded by maintenance.

A provider whose active instance is in a sibling worker (another Python worker process of
the same executor, :func:`statecore.coordinator.same_executor`: the coordinator does not name
it when this process reports, and maintenance asks where it is) is kept, not unloaded: the
workers of an executor take its tasks in turn, and the next task here reaches the new
version from the one held by the deltas since. The sibling maintains it; this process
skips its maintenance until it is active here again.

Thread-safety: every function may be called from any thread. The registry lock is held
only to look up, add or remove providers; loading a version, committing and maintenance
run outside it.
"""
import logging
import threading
import time

from statecore.conf import StateStoreConf
from statecore.coordinator import parse_executor_location, same_executor
from statecore.errors import IllegalStateError
from statecore.schema import key_value_schemas
from statecore.contracts import create_and_init_provider

__all__ = ["get", "get_read_only", "unload", "is_loaded", "is_maintenance_running", "set_coordinator",
           "stop", "loaded_provider_ids", "run_maintenance_now", "run_spills_now", "wait_for_maintenance_passes"]

log = logging.getLogger(__name__)

_lock = threading.RLock()
_providers = {}  # StateStoreProviderId -> provider
_coordinator = None  # (ref, host, executor_id)
_maintenance = None  # the running _MaintenanceThread, if any
_passes = 0  # completed maintenance passes (visible for tests)
_passes_changed = threading.Condition(_lock)


class _MaintenanceThread(threading.Thread):
    """Runs a maintenance pass every ``interval_s`` until stopped (first pass after one
    period); woken in between by a commit, it spills the heads that outgrew their share."""

    def __init__(self, interval_s):
        super().__init__(name="state-store-maintenance-task", daemon=True)
        self.interval_s = interval_s
        self.stopping = threading.Event()
        self.wakeup = threading.Event()  # set by a provider whose head is due to be spilled

    def run(self):
        next_pass = time.monotonic() + self.interval_s
        while True:
            self.wakeup.wait(max(0.0, next_pass - time.monotonic()))
            self.wakeup.clear()
            if self.stopping.is_set():
                return
            try:
                if time.monotonic() >= next_pass:
                    next_pass = time.monotonic() + self.interval_s
                    run_maintenance_now()
                else:
                    run_spills_now()
            except Exception:  # never let the thread die: providers are handled one by one
                log.exception("State store maintenance pass failed")


def _request_maintenance():
    """Wake the maintenance thread now (a provider's head is due to be spilled)."""
    thread = _maintenance
    if thread is not None:
        thread.wakeup.set()


def _serves(provider, key_schema, value_schema):
    """Whether a loaded ``provider`` holds rows of these schemas (a provider class without
    schema attributes is taken to)."""
    have = (getattr(provider, "key_schema", None), getattr(provider, "value_schema", None))
    if None in have:
        return True
    if have[0].dtype == key_schema and have[1].dtype == value_schema:  # the usual case, without new RowSchemas
        return True
    return have == key_value_schemas(key_schema, value_schema)


def _provider_for(provider_id, key_schema, value_schema, version, conf, key_index_ordinal):
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"Version cannot be less than 0, got {version}")  # before anything loads
    conf = conf or StateStoreConf()
    with _lock:
        loaded = _providers.get(provider_id)
    if loaded is not None and not _serves(loaded, key_schema, value_schema):
        # the same store asked for with other schemas (a changed query in this process): its
        # provider is opened again, planning the change (docs/evolution.md)
        log.info("%s is asked for with other schemas: opening it again", loaded)
        unload(provider_id)
    with _lock:
        _start_maintenance_if_needed(conf)
        provider = _providers.get(provider_id)
        if provider is None:
            provider = create_and_init_provider(provider_id.store_id, key_schema, value_schema, conf,
                                                key_index_ordinal)
            if hasattr(provider, "set_maintenance_hint"):
                provider.set_maintenance_hint(_request_maintenance)
            _providers[provider_id] = provider
        others = [pid for pid in _providers if pid != provider_id]
        coordinator = _coordinator
    if coordinator is not None:
        ref, host, executor_id = coordinator
        try:
            to_unload = ref.report_active_instance(provider_id, host, executor_id, others)
        except Exception as e:  # an unreachable coordinator must not stop the task
            log.warning("could not report %s to the state store coordinator: %s", provider_id, e)
            to_unload = ()
        for pid in to_unload:  # active on another executor (never a sibling worker's)
            unload(pid)
    return provider


_HERE, _SIBLING, _ELSEWHERE = "here", "sibling", "elsewhere"


def _active_instance(coordinator, provider_id):
    """Where the coordinator says the active instance of ``provider_id`` is: in this process
    (_HERE), in another worker of this process's executor (_SIBLING: this copy is kept), or
    elsewhere (_ELSEWHERE, also when it cannot tell)."""
    ref, host, executor_id = coordinator
    try:
        location = ref.get_location(provider_id)
        if location is None:
            return _ELSEWHERE
        active_host, active_id = parse_executor_location(location)
    except Exception as e:  # unreachable, or a location of another form: as if elsewhere
        log.warning("could not locate %s with the state store coordinator: %s", provider_id, e)
        return _ELSEWHERE
    if not same_executor((active_host, active_id), host, executor_id):
        return _ELSEWHERE
    return _HERE if active_id == executor_id else _SIBLING


def get(provider_id, key_schema, value_schema, version, conf=None, key_index_ordinal=None, commit_id=None):
    """The writable store of ``version`` (the attempt ``commit_id``, if given) from the
    provider of ``provider_id``, loading the provider on first use."""
    return _open(provider_id, key_schema, value_schema, version, conf, key_index_ordinal, commit_id, False)


def get_read_only(provider_id, key_schema, value_schema, version, conf=None, key_index_ordinal=None,
                  commit_id=None):
    """Like :func:`get`, but a read-only store."""
    return _open(provider_id, key_schema, value_schema, version, conf, key_index_ordinal, commit_id, True)


def _open(provider_id, key_schema, value_schema, version, conf, key_index_ordinal, commit_id, read_only):
    """A store of the provider; once more from a new provider if the maintenance thread
    unloaded (closed) the one found between the lookup and the open (it judged the store
    inactive just before this process reported it)."""
    for attempt in range(2):
        provider = _provider_for(provider_id, key_schema, value_schema, version, conf, key_index_ordinal)
        get_store = provider.get_read_store if read_only else provider.get_store
        try:
            return get_store(version) if commit_id is None else get_store(version, commit_id)
        except IllegalStateError:
            with _lock:
                unloaded = _providers.get(provider_id) is not provider
            if not unloaded or attempt:
                raise
            log.info("%s was unloaded while it was opened; loading it again", provider_id)


def unload(provider_id):
    """Drop and close a provider; unknown ids are ignored."""
    with _lock:
        provider = _providers.pop(provider_id, None)
    if provider is not None:
        provider.close()
        log.info("Unloaded %s", provider)


def is_loaded(provider_id):
    with _lock:
        return provider_id in _providers


def loaded_provider_ids():
    with _lock:
        return list(_providers)


def is_maintenance_running():
    with _lock:
        return _maintenance is not None and _maintenance.is_alive()


def set_coordinator(ref, host, executor_id):
    """Report to ``ref`` (a StateStoreCoordinatorRef) as executor ``executor_id`` on ``host``;
    ``ref=None`` forgets the coordinator."""
    global _coordinator
    with _lock:
        _coordinator = None if ref is None else (ref, host, executor_id)


def _start_maintenance_if_needed(conf):
    global _maintenance
    # REQUIRES: _lock held
    if _maintenance is None or not _maintenance.is_alive():
        _maintenance = _MaintenanceThread(conf.maintenance_interval_s)
        _maintenance.start()
        log.info("State Store maintenance task started")


def run_spills_now():
    """Spill the head of every loaded provider that outgrew its share (what the thread does
    when a commit wakes it between passes): memory work and local files only, no listing and
    no coordinator call. A provider whose spill raises is logged and left to the next pass."""
    with _lock:
        providers = list(_providers.values())
    for provider in providers:
        spill = getattr(provider, "spill_if_outgrown", None)
        if spill is None:
            continue
        try:
            spill()
        except Exception:
            log.exception("Error spilling the head of %s", provider)


def run_maintenance_now():
    """One maintenance pass over every loaded provider (what the thread runs each period)."""
    global _passes
    with _lock:
        providers = list(_providers.items())
        coordinator = _coordinator
    for provider_id, provider in providers:
        where = _HERE if coordinator is None else _active_instance(coordinator, provider_id)
        if where == _SIBLING:
            continue  # kept for the next task here; the sibling maintains it
        try:
            provider.do_maintenance()
        except Exception:
            log.exception("Error managing %s, unloading state store provider", provider)
            unload(provider_id)
            continue
        if where != _HERE:  # asked again after the pass: a task here may have taken it meanwhile
            ref, _host, executor_id = coordinator
            try:
                active = ref.verify_if_instance_active(provider_id, executor_id)
            except Exception as e:
                log.warning("could not verify %s with the state store coordinator: %s", provider_id, e)
                continue
            if not active:
                unload(provider_id)
    with _lock:
        _passes += 1
        _passes_changed.notify_all()


def wait_for_maintenance_passes(n, timeout_s):
    """Wait until at least ``n`` passes have completed since the process started (or since
    :func:`stop`); returns whether they did within ``timeout_s``. Visible for tests."""
    with _lock:
        return _passes_changed.wait_for(lambda: _passes >= n, timeout=timeout_s)


def maintenance_passes():
    with _lock:
        return _passes


def stop():
    """Unload every provider, forget the coordinator, and stop (join) the maintenance thread."""
    global _maintenance, _coordinator, _passes
    with _lock:
        thread, _maintenance = _maintenance, None
        ids = list(_providers)
        _coordinator = None
    for provider_id in ids:
        unload(provider_id)
    if thread is not None:
        thread.stopping.set()
        thread.wakeup.set()
        thread.join()
    with _lock:
        _passes = 0
    log.info("StateStore stopped")
