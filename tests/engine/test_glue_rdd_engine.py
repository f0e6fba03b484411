"""Stateful partitions (pyspark_glue.rdd) without Spark: the state info, worker identity,
ending a partition's store (its generator run in this process as a worker would run it),
shipping a function's module, and the driver's coordinator. On real Spark:
tests/spark/test_glue_rdd.py, whose functions for the workers these tests run too."""
import os
import sys
import time
import uuid

import numpy as np
import pytest

from statecore import IllegalStateError, registry
from statecore.errors import VersionNotFoundError
from statecore.rpc import RpcError

from pyspark_glue import driver, executor
from pyspark_glue import rdd as glue
from pyspark_glue.rdd import StatefulOperatorStateInfo
from tests.spark.test_glue_rdd import CONF, KEY, VALUE, bump_counts, bump_counts_no_commit, dump_state, info
from tests.state_files import version_names


def test_state_info_is_a_frozen_value():
    run = uuid.uuid4()
    a = StatefulOperatorStateInfo("/ckpt", run, 2, 5, 4)
    assert a == StatefulOperatorStateInfo("/ckpt", run, 2, 5, 4) and hash(a) == hash(StatefulOperatorStateInfo(
        "/ckpt", run, 2, 5, 4))
    with pytest.raises(AttributeError):
        a.store_version = 6
    assert a.provider_id(3).store_id.store_checkpoint_location() == "/ckpt/2/3"
    assert a.provider_id(3).query_run_id == run
    with pytest.raises(TypeError, match="uuid"):
        StatefulOperatorStateInfo("/ckpt", str(run), 2, 5, 4)
    with pytest.raises(ValueError, match="store_version"):
        StatefulOperatorStateInfo("/ckpt", run, 2, -1, 4)
    with pytest.raises(ValueError, match="num_partitions"):
        StatefulOperatorStateInfo("/ckpt", run, 2, 0, 0)


def test_spark_location_strips_the_worker_pid():
    assert executor.spark_location("executor_127.0.0.1_1.4242") == "executor_127.0.0.1_1"
    assert executor.spark_location("executor_10.0.0.7_driver.17") == "executor_10.0.0.7_driver"
    assert executor.spark_location("executor_host-a_3") == "executor_host-a_3"
    assert executor.spark_location(None) is None
    with pytest.raises(ValueError):
        executor.spark_location("127.0.0.1")


def test_executor_identity_sources(monkeypatch):
    monkeypatch.setattr(executor, "_identity", None)
    monkeypatch.setenv("SPARK_LOG_URL_STDERR",
                       "http://127.0.0.1:18081/logPage/?appId=app-2026-0001&executorId=7&logType=stderr")
    monkeypatch.setenv("SPARK_LOCAL_IP", "10.1.2.3")
    assert executor.executor_identity() == ("10.1.2.3", "7")
    assert executor.worker_executor_id() == f"7.{os.getpid()}"
    monkeypatch.setattr(executor, "_identity", None)
    monkeypatch.delenv("SPARK_LOG_URL_STDERR")
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    # This process descends from no executor JVM: the local-mode answer.
    assert executor.executor_identity() == ("127.0.0.1", "driver")
    monkeypatch.setattr(executor, "_identity", None)


@pytest.fixture
def clean_registry():
    registry.stop()
    executor.ensure_worker_registry(None, None)
    yield
    registry.stop()


def _task(root, run, version, fn, rows, read_only=False):
    """One partition's generator, run in this process as a worker would run it."""
    return glue._run_partition(0, iter(rows), fn, info(root, run, version, 1), KEY, VALUE, CONF, None, None, read_only,
                               None)


def _capture_store(holder, fn):
    def wrapped(store, rows):
        holder.append(store)
        return fn(store, rows)
    return wrapped


@pytest.mark.usefixtures("clean_registry")
def test_store_is_aborted_when_the_output_ends_fails_or_is_dropped(tmp_path):
    run = uuid.uuid4()
    stores = []
    executor.reset_load_counts()
    # Exhausted without a commit: aborted, nothing written.
    assert list(_task(tmp_path, run, 0, _capture_store(stores, bump_counts_no_commit), [1, 2])) == [(1, 1), (2, 1)]
    with pytest.raises(IllegalStateError):
        stores[-1].put(1, (1,))
    assert "1.delta" not in version_names(tmp_path / "0" / "0")
    # fn raises half way: aborted, the error propagates.
    def failing(store, rows):
        store.put(1, (5,))
        yield 1
        raise RuntimeError("boom")
    out = _task(tmp_path, run, 0, _capture_store(stores, failing), [])
    assert next(out) == 1
    with pytest.raises(RuntimeError, match="boom"):
        next(out)
    with pytest.raises(IllegalStateError):
        stores[-1].put(1, (1,))
    # The consumer stops early (take(1)): closing the output aborts.
    out = _task(tmp_path, run, 0, _capture_store(stores, bump_counts_no_commit), [1, 2, 3])
    assert next(out) == (1, 1)
    out.close()
    with pytest.raises(IllegalStateError):
        stores[-1].put(1, (1,))
    # Committed: left alone; the read variant always aborts.
    assert [k for k, _, _ in _task(tmp_path, run, 0, _capture_store(stores, bump_counts), [4, 4])] == [4]
    assert stores[-1].has_committed
    assert list(_task(tmp_path, run, 1, dump_state, [], read_only=True)) == [(4, 2)]
    assert version_names(tmp_path / "0" / "0") == ["1.delta", "_statecore.schema.json"]
    assert executor.load_counts() == {"already_loaded": 4, "loaded_from_files": 1}  # one provider, 5 opens
    # fn must return something iterable.
    with pytest.raises(TypeError, match="iterator"):
        list(_task(tmp_path, run, 1, lambda store, rows: None, []))


def open_then_commit(store, rows):
    """Yields once its store is open; then puts each row's key with count 1, commits, and
    yields the new version's commit id (what a driver collects to name the winners)."""
    yield "opened"
    for row in rows:
        store.put(int(row), (1,))
    store.commit()
    yield store.commit_id


@pytest.mark.usefixtures("clean_registry")
def test_state_info_commit_ids_name_the_attempt_each_partition_opens(tmp_path):
    run = uuid.uuid4()
    first = _task(tmp_path, run, 0, open_then_commit, [1])
    second = _task(tmp_path, run, 0, open_then_commit, [2])
    assert next(first) == next(second) == "opened"  # two attempts of one batch, both open
    (first_id,), (second_id,) = list(first), list(second)  # both commit version 1
    assert version_names(tmp_path / "0" / "0").count("1.delta") == 2

    def state_at_attempt(commit_id):
        chosen = StatefulOperatorStateInfo(str(tmp_path), run, 0, 1, 1, commit_ids=[commit_id])
        return list(glue._run_partition(0, iter([]), dump_state, chosen, KEY, VALUE, CONF, None, None, True, None))

    assert state_at_attempt(first_id) == [(1, 1)] and state_at_attempt(second_id) == [(2, 1)]
    assert list(_task(tmp_path, run, 1, dump_state, [], read_only=True)) in ([(1, 1)], [(2, 1)])  # the default
    with pytest.raises(VersionNotFoundError):
        state_at_attempt("0123456789abcdef")
    with pytest.raises(ValueError, match="expected 1 commit ids"):
        StatefulOperatorStateInfo(str(tmp_path), run, 0, 1, 1, commit_ids=[first_id, second_id])
    with pytest.raises(ValueError, match="16 hex digits"):
        StatefulOperatorStateInfo(str(tmp_path), run, 0, 1, 1, commit_ids=["nope"])


@pytest.mark.usefixtures("clean_registry")
def test_a_later_task_aborts_stores_left_open_by_an_earlier_one(tmp_path, monkeypatch):
    run = uuid.uuid4()
    stores = []
    monkeypatch.setattr(glue, "_task_attempt_id", lambda: 1)
    left_open = _task(tmp_path, run, 0, _capture_store(stores, bump_counts_no_commit), [1, 2])
    next(left_open)  # started, never finished nor closed (as if a reference cycle kept it)
    stores[-1].put(9, (9,))  # still open
    monkeypatch.setattr(glue, "_task_attempt_id", lambda: 2)
    assert list(_task(tmp_path, run, 0, dump_state, [], read_only=True)) == []
    with pytest.raises(IllegalStateError):
        stores[0].put(9, (9,))
    left_open.close()


def test_functions_of_modules_the_workers_cannot_import_travel_by_value(tmp_path, monkeypatch):
    from pyspark import cloudpickle

    assert glue.ship_function_module(np.add) is None  # installed: by reference
    assert glue.ship_function_module(executor.open_store) is None  # on every worker
    (tmp_path / "cell_helpers_x1.py").write_text("def f(store, rows):\n    return iter(rows)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import cell_helpers_x1

    try:
        assert glue.ship_function_module(cell_helpers_x1.f) == "cell_helpers_x1"
        assert "cell_helpers_x1" in cloudpickle.list_registry_pickle_by_value()
    finally:
        cloudpickle.unregister_pickle_by_value(cell_helpers_x1)
        del sys.modules["cell_helpers_x1"]


class _FakeContext:
    """Enough of a SparkContext for pyspark_glue.driver (its activity is monkeypatched)."""

    applicationId = "app-fake"
    _jsc = object()

    def getConf(self):
        return {"spark.driver.host": "127.0.0.1", "spark.app.id": "app-fake"}


def test_the_driver_coordinator_lives_as_long_as_its_context(monkeypatch):
    active = {"yes"}
    monkeypatch.setattr(driver, "_is_active", lambda sc: "yes" in active)
    monkeypatch.setattr(driver, "_WATCH_INTERVAL_S", 0.05)
    sc = _FakeContext()
    ref = driver.coordinator_for(sc)
    try:
        assert driver.coordinator_for(sc) is ref and driver.active_coordinator(sc) is ref
        run = uuid.uuid4()
        pid = info("/ckpt", run, 0).provider_id(1)
        ref.report_active_instance(pid, "127.0.0.1", "3.77")
        assert executor.spark_location(ref.get_location(pid)) == "executor_127.0.0.1_3"
        driver.deactivate(sc, run)
        assert ref.get_location(pid) is None
        active.clear()  # the context stopped: the watcher stops the coordinator

        def service_gone():
            return driver.active_coordinator(sc) is None

        deadline = time.monotonic() + 10
        while not service_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service_gone()
        with pytest.raises(RpcError):
            ref.get_location(pid)
        with pytest.raises(RuntimeError, match="stopped"):
            driver.coordinator_for(sc)
    finally:
        driver.stop(sc)




class _Ref:
    """A coordinator ref whose calls raise ``error``."""
    address, authkey = ("127.0.0.1", 1), b"k"

    def __init__(self, error):
        self.error, self.calls = error, 0

    def get_location(self, provider_id):
        self.calls += 1
        raise self.error


def test_the_tolerant_ref_answers_neutrally_only_for_an_unreachable_coordinator(caplog):
    # The peer gone (a refused connection) or its handler failed (RpcError): logged, answered
    # neutrally, and not called again for a while. A bug on this side (a TypeError) propagates.
    for error in (ConnectionRefusedError("refused"), RpcError("the handler failed")):
        ref = _Ref(error)
        tolerant = executor._TolerantCoordinatorRef(ref)
        with caplog.at_level("WARNING", logger="pyspark_glue.executor"):
            assert tolerant.get_location("p") is None and tolerant.get_location("p") is None
        assert ref.calls == 1
        assert any("unreachable" in m and type(error).__name__ in m for m in caplog.messages)
    bug = _Ref(TypeError("a bug"))
    with pytest.raises(TypeError, match="a bug"):
        executor._TolerantCoordinatorRef(bug).get_location("p")
