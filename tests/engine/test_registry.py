"""The executor registry: loading, maintenance thread, unloading, coordinator hooks."""
import os
import time
import uuid

import numpy as np
import pytest

from tests.state_files import version_names
from statecore import StateStoreConf, StateStoreId, StateStoreProviderId, registry
from statecore.errors import IllegalStateError

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("v", "<i8")])
DEADLINE_S = 30


@pytest.fixture(autouse=True)
def clean_registry():
    registry.stop()
    yield
    registry.stop()


def pid(root, partition=0, run=None):
    return StateStoreProviderId(StateStoreId(str(root), 0, partition), run or uuid.uuid4())


def commit(provider_id, version, conf, key=1):
    store = registry.get(provider_id, KEY, VALUE, version, conf)
    store.put(key, (version,))
    return store.commit()


def test_negative_version_loads_nothing(tmp_path):
    p = pid(tmp_path)
    with pytest.raises(ValueError, match="less than 0"):
        registry.get(p, KEY, VALUE, -1)
    assert not registry.is_loaded(p)


def test_get_loads_once_and_starts_maintenance(tmp_path):
    conf = StateStoreConf(maintenance_interval_s=3600)
    p = pid(tmp_path)
    assert not registry.is_maintenance_running()
    assert commit(p, 0, conf) == 1
    assert registry.is_loaded(p) and registry.is_maintenance_running()
    assert registry.get_read_only(p, KEY, VALUE, 1, conf).get(1) == (0,)
    assert registry.loaded_provider_ids() == [p]
    registry.unload(p)
    assert not registry.is_loaded(p)
    registry.stop()
    assert not registry.is_maintenance_running()


def test_maintenance_thread_snapshots_and_cleans_up(tmp_path):
    conf = StateStoreConf(maintenance_interval_s=0.01, min_deltas_for_snapshot=2, min_versions_to_retain=1)
    p = pid(tmp_path)
    for v in range(6):
        commit(p, v, conf, key=v)
    start = registry.maintenance_passes()
    assert registry.wait_for_maintenance_passes(start + 2, DEADLINE_S)
    names = os.listdir(os.path.join(tmp_path, "0", "0"))
    assert any(n.endswith(".snapshot") for n in names)  # passes ran while batches committed
    assert registry.is_loaded(p)  # no coordinator: maintenance unloads nothing
    fresh = StateStoreProviderId(p.store_id, uuid.uuid4())
    assert dict(registry.get_read_only(fresh, KEY, VALUE, 6, conf).iterator()) == {(k,): (k,) for k in range(6)}


def test_failing_maintenance_unloads_only_that_provider(tmp_path):
    good = pid(tmp_path / "good")
    bad = pid(tmp_path / "bad")
    conf = StateStoreConf(maintenance_interval_s=3600)
    commit(good, 0, conf)
    commit(bad, 0, StateStoreConf(maintenance_interval_s=3600, provider_class="models.FailingMaintenanceProvider"))
    registry.run_maintenance_now()
    assert registry.is_loaded(good) and not registry.is_loaded(bad)
    assert registry.is_maintenance_running()


class FakeCoordinator:
    """Stands in for StateStoreCoordinatorRef: records calls, answers as told."""

    def __init__(self):
        self.reports, self.unload_on_report, self.active, self.fail = [], [], {}, False
        self.locations = {}

    def report_active_instance(self, provider_id, host, executor_id, provider_ids_to_check=()):
        if self.fail:
            raise ConnectionError("coordinator is gone")
        self.reports.append((provider_id, host, executor_id, list(provider_ids_to_check)))
        return [p for p in provider_ids_to_check if p in self.unload_on_report]

    def verify_if_instance_active(self, provider_id, executor_id):
        if self.fail:
            raise ConnectionError("coordinator is gone")
        return self.active.get(provider_id, True)

    def get_location(self, provider_id):
        if self.fail:
            raise ConnectionError("coordinator is gone")
        return self.locations.get(provider_id)


def test_coordinator_report_unloads_what_it_names(tmp_path):
    coord = FakeCoordinator()
    registry.set_coordinator(coord, "127.0.0.1", "7")
    conf = StateStoreConf(maintenance_interval_s=3600)
    a, b = pid(tmp_path, 0), pid(tmp_path, 1)
    commit(a, 0, conf)
    coord.unload_on_report = [a]
    commit(b, 0, conf)
    assert coord.reports[-1][:3] == (b, "127.0.0.1", "7") and coord.reports[-1][3] == [a]
    assert not registry.is_loaded(a) and registry.is_loaded(b)


def test_maintenance_unloads_inactive_instances_after_their_maintenance(tmp_path):
    coord = FakeCoordinator()
    registry.set_coordinator(coord, "127.0.0.1", "7")
    conf = StateStoreConf(maintenance_interval_s=3600, min_deltas_for_snapshot=1)
    a, b = pid(tmp_path, 0), pid(tmp_path, 1)
    for v in range(3):
        commit(a, v, conf)
        commit(b, v, conf)
    coord.active[a] = False
    registry.run_maintenance_now()
    assert not registry.is_loaded(a) and registry.is_loaded(b)
    assert "3.snapshot" in version_names(os.path.join(tmp_path, "0", "0"))  # maintained, then unloaded


def test_unreachable_coordinator_is_not_fatal(tmp_path):
    coord = FakeCoordinator()
    coord.fail = True
    registry.set_coordinator(coord, "127.0.0.1", "7")
    conf = StateStoreConf(maintenance_interval_s=3600)
    a = pid(tmp_path)
    assert commit(a, 0, conf) == 1
    registry.run_maintenance_now()
    assert registry.is_loaded(a)


@pytest.mark.parametrize("location, kept", [
    ("executor_127.0.0.1_7.2002", True),   # another worker of executor 7 on this host: a sibling
    ("executor_127.0.0.1_8.2002", False),  # a worker of another executor
    ("executor_10.0.0.9_7.2002", False),   # executor 7 of another host
    ("executor_127.0.0.1_7", True),        # a reporter of executor 7 itself: the same executor
    ("executor_127.0.0.1_7.1001", False),  # this worker (the coordinator would not name it)
    (None, False),                         # the coordinator does not know
])
def test_a_store_another_worker_of_this_executor_took_over_is_kept(tmp_path, location, kept):
    """Workers of one executor take a store's tasks in turn: the copy here stays loaded (the
    next task here rolls it forward) and is left to the active worker's maintenance; a
    store taken over by another executor is unloaded, after its maintenance."""
    coord = FakeCoordinator()
    registry.set_coordinator(coord, "127.0.0.1", "7.1001")
    conf = StateStoreConf(maintenance_interval_s=3600, min_deltas_for_snapshot=1)
    a, b = pid(tmp_path, 0), pid(tmp_path, 1)
    for v in range(3):
        commit(a, v, conf)
    # the coordinator names a store on report only if it is active on another executor
    # (test_coordinator: test_report_names_only_stores_active_on_another_executor)
    coord.unload_on_report, coord.locations[a] = ([] if kept else [a]), location
    commit(b, 0, conf)
    assert registry.is_loaded(a) == kept
    if not kept:
        return
    coord.active[a] = False
    registry.run_maintenance_now()
    assert registry.is_loaded(a)
    assert not any(n.endswith(".snapshot") for n in version_names(os.path.join(tmp_path, "0", "0")))
    coord.active[a], coord.locations[a] = True, "executor_127.0.0.1_7.1001"  # active here again
    registry.run_maintenance_now()
    assert "3.snapshot" in version_names(os.path.join(tmp_path, "0", "0"))


def test_a_store_unloaded_between_its_lookup_and_its_open_is_loaded_again(tmp_path, monkeypatch):
    """The maintenance thread may judge a store inactive just before this process reports
    it, and unload it while the task opens it: the open loads it again, once."""
    conf = StateStoreConf(maintenance_interval_s=3600)
    a = pid(tmp_path)
    commit(a, 0, conf)
    original, calls = registry._provider_for, []

    def unloaded_meanwhile(*args):
        provider = original(*args)
        calls.append(provider)
        if len(calls) == 1:
            registry.unload(a)  # the maintenance thread, in the window
        return provider

    monkeypatch.setattr(registry, "_provider_for", unloaded_meanwhile)
    assert registry.get_read_only(a, KEY, VALUE, 1, conf).get(1) == (0,)
    assert len(calls) == 2 and calls[0] is not calls[1] and registry.is_loaded(a)
    calls.clear()
    calls.append(None)  # no unload now: a closed provider that is still registered is an error
    registry._providers[a].close()
    with pytest.raises(IllegalStateError, match="closed"):
        registry.get(a, KEY, VALUE, 1, conf)


def test_a_commit_asking_for_a_spill_wakes_the_thread_to_spill_only(tmp_path, monkeypatch):
    """Between passes (a one-hour period), a commit whose head outgrew its share wakes the
    maintenance thread, which spills that head and nothing else: no pass, no snapshot."""
    monkeypatch.setattr("statecore.held_versions.SPILL_MIN_ROWS", 8)
    monkeypatch.setattr("statecore.held_versions.SPILL_HARD_RATIO", float("inf"))  # only the thread spills
    conf = StateStoreConf(maintenance_interval_s=3600, min_deltas_for_snapshot=1)
    p = pid(tmp_path)
    store = registry.get(p, KEY, VALUE, 0, conf)
    keys = np.zeros(64, KEY)
    keys["k"] = np.arange(64)
    store.put_batch(keys, np.zeros(64, VALUE))
    passes = registry.maintenance_passes()
    assert store.commit() == 1
    provider = registry._providers[p]
    deadline = time.monotonic() + DEADLINE_S
    while provider.describe()["latest"]["base"]["kind"] != "spill":
        assert time.monotonic() < deadline, "the thread never spilled the head"
        time.sleep(0.01)
    assert registry.maintenance_passes() == passes
    assert not any(name.endswith(".snapshot") for name in version_names(str(tmp_path / "0" / "0")))
    assert registry.get_read_only(p, KEY, VALUE, 1, conf).get(5) == (0,)


def test_the_same_store_asked_for_with_other_schemas_is_opened_again_and_evolves(tmp_path):
    """A query changed and run again in this process under the same run id: the provider
    loaded with the old schemas is not handed out for the new ones (its rows are of another
    layout); a new one plans the change and reads the old state converted."""
    conf = StateStoreConf(maintenance_interval_s=3600)
    p = pid(tmp_path)
    assert commit(p, 0, conf, key=7) == 1
    wider = np.dtype([("v", "<i8"), ("seen", "<i4")])
    store = registry.get(p, KEY, wider, 1, conf)
    assert store.get(7) == (0, 0)
    store.put(8, (1, 1))
    assert store.commit() == 2
    assert registry.get_read_only(p, KEY, wider, 2, conf).get(8) == (1, 1)
