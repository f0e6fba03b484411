"""StateStoreCoordinator (docs/spark-state-store.md, The registry and the coordinator): the
endpoint as a plain object, then over RPC, then with the executor registry."""
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import uuid

import msgspec
import numpy as np
import pytest

import statecore
from statecore import StateStoreConf, StateStoreId, StateStoreProviderId, registry, rpc
from statecore.coordinator import (DeactivateInstances, GetLocation, ProviderId, ReportActiveInstance,
                                   StateStoreCoordinator, StateStoreCoordinatorRef, StopCoordinator,
                                   VerifyIfInstanceActive, executor_location, provider_id_from_message,
                                   provider_id_to_message)

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("v", "<i8")])
CONF = StateStoreConf(maintenance_interval_s=3600)  # passes run only when a test asks
SUBPROCESS_TIMEOUT_S = 60


def pid(root="/ckpt", partition=0, run=None, store_name="default"):
    return StateStoreProviderId(StateStoreId(str(root), 0, partition, store_name), run or uuid.uuid4())


class FakeEnv:
    """Records the names the endpoint unregisters itself from."""

    def __init__(self):
        self.stopped = []

    def stop_endpoint(self, name):
        self.stopped.append(name)


@pytest.fixture
def coordinator():
    return StateStoreCoordinator(FakeEnv())


def plain(message):
    """A ProviderId as the plain list it travels as."""
    return [*msgspec.structs.astuple(message)[:4], str(message.query_run_id)]


def report(coordinator, provider_id, host, executor_id, to_check=()):
    reply = coordinator.receive_and_reply(ReportActiveInstance(
        provider_id_to_message(provider_id), host, executor_id, [provider_id_to_message(p) for p in to_check]))
    return [provider_id_from_message(p) for p in reply]


def location(coordinator, provider_id):
    return coordinator.receive_and_reply(GetLocation(provider_id_to_message(provider_id)))


def verify(coordinator, provider_id, executor_id):
    return coordinator.receive_and_reply(VerifyIfInstanceActive(provider_id_to_message(provider_id), executor_id))


# The endpoint, called directly.

def test_provider_id_round_trips_as_a_message():
    p = pid("s3://bucket/ckpt/state", partition=3, store_name="left-keyToNumValues")
    message = provider_id_to_message(p)
    assert message == ProviderId("s3://bucket/ckpt/state", 0, 3, "left-keyToNumValues", p.query_run_id)
    assert provider_id_from_message(message) == p
    wire = rpc.encode_value(GetLocation(message))  # [name, [root, operator, partition, store, run id]]
    assert msgspec.msgpack.decode(wire) == ["GetLocation", ["s3://bucket/ckpt/state", 0, 3, "left-keyToNumValues",
                                                           str(p.query_run_id)]]
    assert rpc.decode_value(wire, StateStoreCoordinator.message_type) == GetLocation(message)
    with pytest.raises(ValueError, match="operator_id"):
        provider_id_from_message(ProviderId("/ckpt", -1, 0, "default", p.query_run_id))
    with pytest.raises(TypeError, match="ProviderId"):
        provider_id_from_message(tuple(msgspec.structs.astuple(message)))
    with pytest.raises(TypeError, match="StateStoreProviderId"):
        provider_id_to_message(p.store_id)


def test_report_records_the_owner_and_a_later_report_overwrites_it(coordinator):
    a = pid()
    assert location(coordinator, a) is None
    assert report(coordinator, a, "host1", "1") == []
    assert location(coordinator, a) == "executor_host1_1"
    report(coordinator, a, "host2", "2")
    assert location(coordinator, a) == "executor_host2_2"


def test_report_replies_the_ids_registered_elsewhere(coordinator):
    mine, on_other_executor, on_other_host, unknown, reported = pid(), pid(), pid(), pid(), pid()
    report(coordinator, mine, "host1", "1")
    report(coordinator, on_other_executor, "host1", "2")
    report(coordinator, on_other_host, "host2", "1")  # same executor id, other host: another location
    to_check = [mine, on_other_executor, on_other_host, unknown]
    assert report(coordinator, reported, "host1", "1", to_check) == [on_other_executor, on_other_host]


def test_verify_compares_the_executor_id_only(coordinator):
    a = pid()
    assert verify(coordinator, a, "1") is False  # not registered
    report(coordinator, a, "host1", "1")
    assert verify(coordinator, a, "1") is True
    assert verify(coordinator, a, "2") is False
    report(coordinator, a, "host2", "1")
    assert verify(coordinator, a, "1") is True  # the host is not compared (Spark)


def test_deactivate_removes_the_instances_of_one_run(coordinator):
    run, other_run = uuid.uuid4(), uuid.uuid4()
    ids = [pid(partition=p, run=run) for p in range(3)]
    kept = pid(run=other_run)
    for p in ids + [kept]:
        report(coordinator, p, "host1", "1")
    assert coordinator.receive_and_reply(DeactivateInstances(run)) is True
    assert [location(coordinator, p) for p in ids] == [None, None, None]
    assert not any(verify(coordinator, p, "1") for p in ids)
    assert location(coordinator, kept) == "executor_host1_1"


def test_stop_unregisters_before_replying(coordinator, caplog):
    with caplog.at_level(logging.INFO, logger="statecore.coordinator"):
        assert coordinator.receive_and_reply(StopCoordinator()) is True
    assert coordinator.rpc_env.stopped == ["StateStoreCoordinator"]
    assert "StateStoreCoordinator stopped" in caplog.messages


def test_host_with_underscore_is_refused(coordinator):
    with pytest.raises(ValueError, match="contains '_'"):
        report(coordinator, pid(), "my_host", "1")
    assert coordinator.instances == {}
    # The executor id may contain '_': Spark splits on the first '_' after the prefix.
    report(coordinator, pid(), "host1", "exec_1")


def test_unknown_malformed_and_one_way_messages_are_errors(coordinator):
    with pytest.raises(ValueError, match=r"not a StateStoreCoordinator message: \('GetLocation',"):
        coordinator.receive_and_reply(("GetLocation", provider_id_to_message(pid())))
    class GetLocations(rpc.Message):  # another endpoint's message, say
        pass

    with pytest.raises(ValueError, match="not a StateStoreCoordinator message: GetLocations"):
        coordinator.receive_and_reply(GetLocations())
    with pytest.raises(ValueError, match="asks only; one-way message GetLocation refused"):
        coordinator.receive(GetLocation(provider_id_to_message(pid())))
    assert coordinator.instances == {}


def test_messages_decode_exactly_as_declared():
    """What the RPC layer decodes for the endpoint: the union of its messages and nothing
    else (over the wire, anything else drops the sender's connection: see below)."""
    union = StateStoreCoordinator.message_type
    p = provider_id_to_message(pid())
    for message in (ReportActiveInstance(p, "h", "1", [p, p]), VerifyIfInstanceActive(p, "1"), GetLocation(p),
                    DeactivateInstances(uuid.uuid4()), StopCoordinator()):
        assert rpc.decode_value(rpc.encode_value(message), union) == message
    bad = {
        "Invalid value 'GetLocations'": ("GetLocations", plain(p)),
        "of at most length 1, got 2": ("GetLocation", plain(p), "extra"),
        "Expected `array`, got `str`": ("GetLocation", "not a provider id"),
        "Expected `int`, got `bool`": ("GetLocation", ["/ckpt", True, 0, "default", str(uuid.uuid4())]),
        "Invalid UUID": ("DeactivateInstances", "not-a-uuid"),
        "Expected `array`, got `object`": {"GetLocation": None},
    }
    for reason, value in bad.items():
        with pytest.raises(rpc.RpcProtocolError, match=re.escape(reason)):
            rpc.decode_value(rpc.encode_value(value), union)


# Over RPC.

@pytest.fixture
def env():
    rpc_env = rpc.RpcEnv("127.0.0.1")
    yield rpc_env
    rpc_env.shutdown()


@pytest.mark.parametrize("active_at, named", [
    (("127.0.0.1", "7.2002"), False),  # another worker of executor 7 on this host: a sibling, kept
    (("127.0.0.1", "8.2002"), True),   # a worker of another executor
    (("10.0.0.9", "7.2002"), True),    # executor 7 of another host
    (("127.0.0.1", "7"), False),       # a reporter of executor 7 itself: the same executor
    (("127.0.0.1", "7.1001"), False),  # the reporting worker itself
    (None, False),                     # not registered: left alone
])
def test_report_names_only_stores_active_on_another_executor(coordinator, active_at, named):
    a, b = pid(partition=0), pid(partition=1)
    if active_at is not None:
        report(coordinator, a, *active_at)
    assert report(coordinator, b, "127.0.0.1", "7.1001", [a]) == ([a] if named else [])
    assert location(coordinator, a) == (None if active_at is None else executor_location(*active_at))


def test_every_message_over_rpc(env):
    driver = StateStoreCoordinatorRef.for_driver(env)
    executor = StateStoreCoordinatorRef.for_executor(env.address, env.authkey)
    assert executor.address == driver.address == env.address and executor.authkey == env.authkey
    run = uuid.uuid4()
    a, b = pid(partition=0, run=run), pid(partition=1, run=run)
    assert executor.report_active_instance(a, "127.0.0.1", "1") == []
    assert driver.report_active_instance(b, "127.0.0.1", "2", [a]) == [a]
    assert executor.verify_if_instance_active(a, "1") is True
    assert executor.verify_if_instance_active(a, "2") is False
    assert driver.get_location(a) == "executor_127.0.0.1_1"
    assert driver.deactivate_instances(run) is True
    assert driver.get_location(a) is None and driver.get_location(b) is None
    driver.stop()
    with pytest.raises(rpc.RpcError):
        executor.get_location(a)
    # The name is free again: a new, empty coordinator.
    fresh = StateStoreCoordinatorRef.for_driver(env)
    assert fresh.get_location(a) is None



class CountingCoordinator(StateStoreCoordinator):
    """The coordinator, noting how many ids each report it handles checks."""

    def __init__(self, rpc_env):
        super().__init__(rpc_env)
        self.checked = []

    def receive_and_reply(self, message):
        if isinstance(message, ReportActiveInstance):
            self.checked.append(len(message.provider_ids_to_check))
        return super().receive_and_reply(message)


def test_an_executor_holding_ten_thousand_stores_reports_them_in_bounded_messages(env):
    """An executor reports a load and checks 10000 ids (every other one active on another
    executor): the ref sends them in reports of at most REPORT_IDS_PER_MESSAGE, so no one
    message holds the coordinator for long, and the answer is the same as one report's."""
    from statecore.coordinator import ENDPOINT_NAME, REPORT_IDS_PER_MESSAGE
    coordinator = CountingCoordinator(env)
    env.setup_endpoint(ENDPOINT_NAME, coordinator)
    ref = StateStoreCoordinatorRef.for_driver(env)
    run = uuid.uuid4()
    ids = [pid(partition=i, run=run) for i in range(10000)]
    for p in ids[::2]:  # before any RPC: called directly
        report(coordinator, p, "10.0.0.9", "2")
    coordinator.checked.clear()
    assert ref.report_active_instance(pid(partition=10000, run=run), "127.0.0.1", "1", ids) == ids[::2]
    assert coordinator.checked == [REPORT_IDS_PER_MESSAGE, REPORT_IDS_PER_MESSAGE, 10000 - 2 * REPORT_IDS_PER_MESSAGE]
    assert ref.get_location(pid(partition=10000, run=run)) == "executor_127.0.0.1_1"
    assert ref.report_active_instance(ids[1], "127.0.0.1", "1") == [] and coordinator.checked[-1] == 0


def test_a_report_checking_more_ids_than_a_message_takes_is_refused_before_decoding(env, caplog):
    """A peer that is not the ref sends one report with REPORT_IDS_PER_MESSAGE + 1 ids: its
    connection is dropped on the array's length, and nothing of it is recorded."""
    from statecore.coordinator import REPORT_IDS_PER_MESSAGE
    driver = StateStoreCoordinatorRef.for_driver(env)
    raw = env.endpoint_ref(env.address, "StateStoreCoordinator", env.authkey)
    a = pid()
    oversize = ReportActiveInstance(provider_id_to_message(a), "127.0.0.1", "1",
                                    [provider_id_to_message(a)] * (REPORT_IDS_PER_MESSAGE + 1))
    with caplog.at_level(logging.WARNING, logger="statecore.rpc"):
        with pytest.raises(rpc.RpcProtocolError, match=f"Expected `array` of length <= {REPORT_IDS_PER_MESSAGE}"):
            raw.ask(oversize)
    assert any("dropped" in m and f"of length <= {REPORT_IDS_PER_MESSAGE}" in m for m in caplog.messages)
    assert driver.get_location(a) is None

def test_for_driver_twice_shares_one_coordinator(env):
    first = StateStoreCoordinatorRef.for_driver(env)
    second = StateStoreCoordinatorRef.for_driver(env)
    a = pid()
    first.report_active_instance(a, "127.0.0.1", "1")
    assert second.get_location(a) == "executor_127.0.0.1_1"


def test_ref_pickles(env):
    ref = pickle.loads(pickle.dumps(StateStoreCoordinatorRef.for_driver(env)))
    a = pid()
    ref.report_active_instance(a, "127.0.0.1", "1")
    assert StateStoreCoordinatorRef.for_driver(env).get_location(a) == "executor_127.0.0.1_1"


def test_ref_refuses_bad_arguments_before_sending(env):
    ref = StateStoreCoordinatorRef.for_driver(env)
    with pytest.raises(ValueError, match="contains '_'"):
        ref.report_active_instance(pid(), "my_host", "1")
    with pytest.raises(TypeError, match="must be str"):
        ref.report_active_instance(pid(), "127.0.0.1", 1)
    with pytest.raises(TypeError, match="uuid.UUID"):
        ref.deactivate_instances(str(uuid.uuid4()))


def test_remote_errors_name_the_remote_error(env, caplog):
    """Plain values from a raw ref: one that is a coordinator message is handled (and its
    error comes back); one that is not drops the connection, the asker told why."""
    driver = StateStoreCoordinatorRef.for_driver(env)
    raw = env.endpoint_ref(env.address, "StateStoreCoordinator", env.authkey)
    with caplog.at_level(logging.WARNING, logger="statecore.rpc"):
        with pytest.raises(rpc.RpcProtocolError, match="is not one StateStoreCoordinator takes: Invalid value 'Nope'"):
            raw.ask(("Nope",))
    assert any("dropped" in m and "Invalid value 'Nope'" in m for m in caplog.messages)
    a = pid()
    with pytest.raises(rpc.RpcError, match="contains '_'"):  # a fresh connection
        raw.ask(("ReportActiveInstance", plain(provider_id_to_message(a)), "my_host", "1",
                 []))
    assert raw.ask(("GetLocation", plain(provider_id_to_message(a)))) is None
    assert driver.get_location(a) is None  # the typed ref was never disturbed


EXECUTOR_SCRIPT = """
import json, sys, uuid
from statecore import StateStoreId, StateStoreProviderId
from statecore.coordinator import StateStoreCoordinatorRef

args = json.load(sys.stdin)
ref = StateStoreCoordinatorRef.for_executor(tuple(args["address"]), bytes.fromhex(args["authkey"]))
run = uuid.UUID(args["run"])
mine = StateStoreProviderId(StateStoreId(args["root"], 0, 1), run)
other = StateStoreProviderId(StateStoreId(args["root"], 0, 0), run)
reply = ref.report_active_instance(mine, "127.0.0.1", "2", [other])
print(json.dumps([p.store_id.partition_id for p in reply]))
"""


def run_script(script, args):
    """Run ``script`` in a fresh interpreter that imports this checkout; its stdout."""
    child_env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(statecore.__file__)))
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(args), capture_output=True, text=True,
                          env=child_env, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_for_executor_from_another_process(env):
    driver = StateStoreCoordinatorRef.for_driver(env)
    run = uuid.uuid4()
    other = StateStoreProviderId(StateStoreId("/ckpt", 0, 0), run)
    driver.report_active_instance(other, "127.0.0.1", "1")
    out = run_script(EXECUTOR_SCRIPT, {"address": list(env.address), "authkey": env.authkey.hex(),
                                       "run": str(run), "root": "/ckpt"})
    assert json.loads(out) == [0]
    assert driver.get_location(StateStoreProviderId(StateStoreId("/ckpt", 0, 1), run)) == "executor_127.0.0.1_2"


# With the executor registry (docs/spark-state-store.md, The registry and the coordinator).

@pytest.fixture(autouse=True)
def clean_registry():
    registry.stop()
    yield
    registry.stop()


def commit(provider_id, version, key=1):
    store = registry.get(provider_id, KEY, VALUE, version, CONF)
    store.put(key, (version,))
    return store.commit()


@pytest.fixture
def driver(env):
    """The driver's ref, with this process's registry reporting to it as executor "1"."""
    ref = StateStoreCoordinatorRef.for_driver(env)
    registry.set_coordinator(StateStoreCoordinatorRef.for_executor(env.address, env.authkey), "127.0.0.1", "1")
    return ref


def test_registry_reports_every_load(driver, tmp_path):
    a = pid(tmp_path)
    commit(a, 0)
    assert driver.get_location(a) == "executor_127.0.0.1_1"
    registry.run_maintenance_now()
    assert registry.is_loaded(a)  # still the active instance


def test_maintenance_unloads_a_deactivated_run(driver, tmp_path):
    stopped, running = pid(tmp_path / "q1"), pid(tmp_path / "q2")
    commit(stopped, 0)
    commit(running, 0)
    driver.deactivate_instances(stopped.query_run_id)
    assert registry.is_loaded(stopped)  # unloaded lazily, by the next pass
    registry.run_maintenance_now()
    assert not registry.is_loaded(stopped) and registry.is_loaded(running)


def test_maintenance_unloads_an_instance_another_executor_took_over(driver, tmp_path):
    a, b = pid(tmp_path, 0), pid(tmp_path, 1)
    commit(a, 0)
    commit(b, 0)
    driver.report_active_instance(a, "127.0.0.1", "2")
    registry.run_maintenance_now()
    assert not registry.is_loaded(a) and registry.is_loaded(b)
    assert driver.get_location(a) == "executor_127.0.0.1_2"


def test_get_unloads_at_once_what_the_report_reply_names(driver, tmp_path):
    a, b = pid(tmp_path, 0), pid(tmp_path, 1)
    commit(a, 0)
    driver.report_active_instance(a, "127.0.0.1", "2")
    commit(b, 0)  # its report checks a, which is now active on executor 2
    assert not registry.is_loaded(a) and registry.is_loaded(b)


def test_unreachable_coordinator_is_logged_and_stores_keep_working(driver, env, tmp_path, caplog):
    a = pid(tmp_path)
    assert commit(a, 0) == 1
    env.shutdown()
    with caplog.at_level(logging.WARNING, logger="statecore.registry"):
        assert commit(a, 1) == 2
        registry.run_maintenance_now()
    assert registry.is_loaded(a)
    assert registry.get_read_only(a, KEY, VALUE, 2, CONF).get(1) == (1,)
    assert any("could not report" in m for m in caplog.messages)
    assert any("could not verify" in m for m in caplog.messages)
