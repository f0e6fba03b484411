"""EpochCoordinator (docs/spark-state-store.md, The epoch coordinator): the endpoint as a plain
object, then over RPC with concurrent senders in threads and in other processes."""
import json
import logging
import os
import pickle
import random
import re
import subprocess
import sys
import threading

import pytest

import statecore
from statecore import IllegalStateError, rpc
from statecore.epoch import (COMMIT_QUEUE_EXCEEDED, EPOCH_QUEUE_EXCEEDED, OFFSET_QUEUE_EXCEEDED,
                             CommitPartitionEpoch, EpochCoordinator, EpochCoordinatorRef, GetCurrentEpoch,
                             IncrementAndGetEpoch, ReportPartitionOffset, SetReaderPartitions, SetWriterPartitions,
                             StopContinuousExecutionWrites)

DEADLINE_S = 30
SUBPROCESS_TIMEOUT_S = 60


class Events:
    """The callbacks of a writer and a query, in the order they were made (thread-safe)."""

    def __init__(self):
        self.log = []
        self.changed = threading.Condition()

    def add(self, *event):
        with self.changed:
            self.log.append(event)
            self.changed.notify_all()

    def of(self, kind):
        with self.changed:
            return [e[1:] for e in self.log if e[0] == kind]

    def committed(self):
        return [epoch for (epoch,) in self.of("query.commit")]

    def wait_for(self, predicate):
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=DEADLINE_S), self.log


class Writer:
    def __init__(self, events):
        self.events = events

    def commit(self, epoch, messages):
        self.events.add("writer.commit", epoch, messages)


class Query:
    def __init__(self, events):
        self.events = events

    def add_offset(self, epoch, offsets):
        self.events.add("query.add_offset", epoch, offsets)

    def commit(self, epoch):
        self.events.add("query.commit", epoch)

    def stop_in_new_thread(self, error):
        assert type(error) is IllegalStateError
        self.events.add("query.stop", str(error))


def make(readers=2, writers=2, start_epoch=1, limit=10000):
    """A coordinator told its partition counts, and the record of its callbacks."""
    events = Events()
    coordinator = EpochCoordinator(Writer(events), Query(events), start_epoch, limit)
    assert coordinator.receive_and_reply(SetReaderPartitions(readers)) is None
    assert coordinator.receive_and_reply(SetWriterPartitions(writers)) is None
    return coordinator, events


def commit(coordinator, partition, epoch, message=None):
    coordinator.receive(CommitPartitionEpoch(partition, epoch, f"c{epoch}.{partition}" if message is None
                                             else message))


def offset(coordinator, partition, epoch, value=None):
    coordinator.receive(ReportPartitionOffset(partition, epoch, f"o{epoch}.{partition}" if value is None
                                              else value))


def complete(coordinator, epoch):
    for p in range(coordinator.num_reader_partitions):
        offset(coordinator, p, epoch)
    for p in range(coordinator.num_writer_partitions):
        commit(coordinator, p, epoch)


# The endpoint, called directly.

def test_epoch_counter():
    coordinator, _ = make(start_epoch=7)
    assert coordinator.receive_and_reply(GetCurrentEpoch()) == 7
    assert coordinator.receive_and_reply(IncrementAndGetEpoch()) == 8
    assert coordinator.receive_and_reply(IncrementAndGetEpoch()) == 9
    assert coordinator.receive_and_reply(GetCurrentEpoch()) == 9
    assert coordinator.last_committed_epoch == 6


def test_a_complete_epoch_commits_writer_first_with_messages_by_partition():
    coordinator, events = make(readers=3, writers=2)
    for p in (2, 0, 1):
        offset(coordinator, p, 1)
    commit(coordinator, 1, 1)
    assert events.log == [("query.add_offset", 1, ["o1.0", "o1.1", "o1.2"])]
    commit(coordinator, 0, 1)
    assert events.log[1:] == [("writer.commit", 1, ["c1.0", "c1.1"]), ("query.commit", 1)]
    assert coordinator.last_committed_epoch == 1


def test_commits_before_offsets_complete_the_epoch_too():
    coordinator, events = make()
    commit(coordinator, 0, 1)
    commit(coordinator, 1, 1)
    offset(coordinator, 0, 1)
    assert events.committed() == []
    offset(coordinator, 1, 1)
    assert events.committed() == [1]


def test_nothing_commits_before_the_partition_counts_are_set():
    events = Events()
    coordinator = EpochCoordinator(Writer(events), Query(events), 1)
    offset(coordinator, 0, 1)
    commit(coordinator, 0, 1)
    assert events.log == []  # counts are 0: an epoch is complete only once they are set


@pytest.mark.parametrize("order", [[1, 3, 4, 2], [1, 3, 5, 4, 2], [4, 3, 2, 1], [2, 1]], ids=str)
def test_epochs_commit_in_order_whatever_order_they_complete_in(order):
    coordinator, events = make()
    for epoch in order:
        complete(coordinator, epoch)
    assert events.committed() == sorted(order)
    assert [epoch for epoch, _ in events.of("writer.commit")] == sorted(order)
    assert coordinator.epochs_waiting_to_be_committed == set()
    # Each writer commit right before its query commit.
    kinds = [e[0] for e in events.log if e[0] != "query.add_offset"]
    assert kinds == ["writer.commit", "query.commit"] * len(order)


def test_late_offset_for_an_epoch_after_all_of_the_next():
    coordinator, events = make()
    offset(coordinator, 0, 1)
    commit(coordinator, 0, 1)
    commit(coordinator, 1, 1)
    complete(coordinator, 2)
    assert events.committed() == [] and coordinator.epochs_waiting_to_be_committed == {2}
    offset(coordinator, 1, 1)
    assert events.committed() == [1, 2]
    assert [epoch for epoch, _ in events.of("query.add_offset")] == [2, 1]


def test_first_commit_wins_and_a_repeat_is_ignored_entirely():
    coordinator, events = make(readers=1, writers=2, limit=0)
    commit(coordinator, 0, 1, "first")
    stops = len(events.of("query.stop"))
    assert stops == 1  # one entry > limit 0
    commit(coordinator, 0, 1, "second")
    assert len(events.of("query.stop")) == stops  # no queue check either
    commit(coordinator, 1, 1)
    offset(coordinator, 0, 1)
    assert events.of("writer.commit") == [(1, ["first", "c1.1"])]


def test_last_offset_wins():
    coordinator, events = make()
    offset(coordinator, 0, 1, "early")
    offset(coordinator, 0, 1, "late")
    assert coordinator.num_partition_offsets == 1
    offset(coordinator, 1, 1)
    assert events.of("query.add_offset") == [(1, ["late", "o1.1"])]


def test_repeated_offset_of_a_complete_waiting_epoch_adds_it_again():
    # Kept from Spark: only epochs already committed are guarded (see the fix below).
    coordinator, events = make()
    complete(coordinator, 2)
    offset(coordinator, 0, 2, "again")
    assert events.of("query.add_offset") == [(2, ["o2.0", "o2.1"]), (2, ["again", "o2.1"])]
    complete(coordinator, 1)
    assert events.committed() == [1, 2]


def test_repeated_offset_of_a_committed_epoch_is_ignored(caplog):
    # Spark would add the offsets again and park epoch 1 in the waiting set for ever.
    coordinator, events = make()
    complete(coordinator, 1)
    with caplog.at_level(logging.DEBUG, logger="statecore.epoch"):
        offset(coordinator, 0, 1, "again")
    assert any("already committed" in m for m in caplog.messages)
    assert coordinator.epochs_waiting_to_be_committed == set()
    assert [epoch for epoch, _ in events.of("query.add_offset")] == [1]
    complete(coordinator, 2)
    complete(coordinator, 3)
    offset(coordinator, 1, 1)  # cleaned up by now: not stored again either
    assert events.committed() == [1, 2, 3]
    assert coordinator.epochs_waiting_to_be_committed == set()
    assert coordinator.num_partition_offsets == 2  # epoch 3's only


def test_offsets_before_the_start_epoch_are_ignored():
    coordinator, events = make(start_epoch=5)
    complete(coordinator, 4)
    assert events.of("query.add_offset") == [] and events.committed() == []
    complete(coordinator, 5)
    assert events.committed() == [5]


def test_cleanup_keeps_only_the_last_committed_epoch():
    coordinator, _ = make(readers=2, writers=3)
    for epoch in (1, 2, 3):
        complete(coordinator, epoch)
    offset(coordinator, 0, 5)
    commit(coordinator, 0, 5)
    assert coordinator.num_partition_offsets == 2 + 1 and coordinator.num_partition_commits == 3 + 1
    complete(coordinator, 4)
    assert coordinator.num_partition_offsets == 2 + 1 and coordinator.num_partition_commits == 3 + 1


def test_stopped_writes_drop_one_way_messages():
    coordinator, events = make()
    offset(coordinator, 0, 1)
    assert coordinator.receive_and_reply(StopContinuousExecutionWrites()) is None
    offset(coordinator, 1, 1)
    complete(coordinator, 1)
    assert events.log == [] and coordinator.num_partition_commits == 0 and coordinator.num_partition_offsets == 1
    assert coordinator.receive_and_reply(IncrementAndGetEpoch()) == 2  # asks still answer


LIMIT = 3


def stops(events):
    return [text for (text,) in events.of("query.stop")]


def test_offset_backlog_allows_exactly_the_limit():
    coordinator, events = make(readers=2, writers=1, limit=LIMIT)
    for epoch in range(1, LIMIT + 1):
        offset(coordinator, 0, epoch)  # never complete: readers=2
    assert stops(events) == []
    offset(coordinator, 0, LIMIT + 1)
    assert stops(events) == [OFFSET_QUEUE_EXCEEDED]
    offset(coordinator, 0, LIMIT + 1)  # a repeat adds nothing, but is checked again
    assert stops(events) == [OFFSET_QUEUE_EXCEEDED] * 2


def test_commit_backlog_allows_exactly_the_limit():
    coordinator, events = make(readers=1, writers=2, limit=LIMIT)
    for epoch in range(1, LIMIT + 1):
        commit(coordinator, 0, epoch)
    assert stops(events) == []
    commit(coordinator, 0, LIMIT + 1)
    assert stops(events) == [COMMIT_QUEUE_EXCEEDED]


def test_epoch_backlog_allows_exactly_the_limit():
    # Every waiting epoch holds its offsets, so the offset queue fills alongside; a writer
    # count of 0 keeps the commit queue empty.
    coordinator, events = make(readers=1, writers=0, limit=LIMIT)
    for epoch in range(2, LIMIT + 2):  # epoch 1 missing: all wait
        offset(coordinator, 0, epoch)
    assert len(coordinator.epochs_waiting_to_be_committed) == LIMIT and stops(events) == []
    offset(coordinator, 0, LIMIT + 2)
    assert stops(events) == [OFFSET_QUEUE_EXCEEDED, EPOCH_QUEUE_EXCEEDED]
    offset(coordinator, 0, 1)
    assert events.committed() == list(range(1, LIMIT + 3))  # the coordinator kept working


def test_backlog_messages_are_sparks():
    assert OFFSET_QUEUE_EXCEEDED == "Size of the partition offset queue has exceeded its maximum"
    assert COMMIT_QUEUE_EXCEEDED == "Size of the partition commit queue has exceeded its maximum"
    assert EPOCH_QUEUE_EXCEEDED == "Size of the epoch queue has exceeded its maximum"


def test_unknown_malformed_and_misdirected_messages_are_errors():
    coordinator, events = make()
    with pytest.raises(ValueError, match="not a one-way EpochCoordinator message: GetCurrentEpoch"):
        coordinator.receive(GetCurrentEpoch())
    with pytest.raises(ValueError, match="not an EpochCoordinator ask: CommitPartitionEpoch"):
        coordinator.receive_and_reply(CommitPartitionEpoch(0, 1, None))
    with pytest.raises(ValueError, match=r"not a one-way EpochCoordinator message: \('ReportPartitionOffset', 0, 1\)"):
        coordinator.receive(("ReportPartitionOffset", 0, 1))
    with pytest.raises(TypeError, match="epoch must be an int"):
        offset(coordinator, 0, "1")
    with pytest.raises(TypeError, match="number of reader partitions must be an int"):
        coordinator.receive_and_reply(SetReaderPartitions(2.0))
    assert events.log == [] and coordinator.num_partition_offsets == 0


def test_messages_decode_exactly_as_declared():
    """What the RPC layer decodes for the endpoint: its union, ints as ints (no bool, no
    float), the right number of fields; commit messages and offsets as plain values."""
    union = EpochCoordinator.message_type
    for message in (CommitPartitionEpoch(0, 1, {"file": "f", "rows": [1, 2]}), ReportPartitionOffset(3, 4, ["a", 5]),
                    GetCurrentEpoch(), SetReaderPartitions(2)):
        assert rpc.decode_value(rpc.encode_value(message), union) == message
    bad = {
        "of at least length 4, got 3": ("ReportPartitionOffset", 0, 1),
        "Expected `int`, got `bool` - at `$[2]`": ("CommitPartitionEpoch", 0, True, None),
        "Expected `int`, got `float` - at `$[1]`": ("SetReaderPartitions", 2.0),
        "Invalid value 'Nope'": ("Nope",),
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


def create(env, coordinator_id="run--1", start_epoch=1, limit=10000):
    events = Events()
    ref = EpochCoordinatorRef.create(Writer(events), Query(events), coordinator_id, start_epoch, env, limit)
    return ref, events


def test_every_message_over_rpc(env):
    ref, events = create(env, start_epoch=3)
    task = EpochCoordinatorRef.connect(env.address, "run--1", env.authkey)
    assert task.address == ref.address == env.address and task.authkey == env.authkey
    assert task.get_current_epoch() == 3
    assert ref.increment_and_get_epoch() == 4
    ref.set_reader_partitions(1)
    ref.set_writer_partitions(1)
    task.report_partition_offset(0, 3, {"topic": "t", "offset": 17})
    task.commit_partition_epoch(0, 3, b"\x00written")
    assert task.get_current_epoch() == 4  # flushes the task's sends
    assert events.log == [("query.add_offset", 3, [{"topic": "t", "offset": 17}]),
                          ("writer.commit", 3, [b"\x00written"]), ("query.commit", 3)]
    ref.stop_continuous_execution_writes()
    task.report_partition_offset(0, 4, 1)
    task.commit_partition_epoch(0, 4, None)
    task.get_current_epoch()
    assert events.committed() == [3] and len(events.log) == 3
    ref.stop()
    with pytest.raises(rpc.RpcError):
        task.get_current_epoch()
    again, _ = create(env)  # the name is free again
    assert again.get_current_epoch() == 1


def test_a_message_it_does_not_take_drops_only_its_connection(env, caplog):
    ref, events = create(env)
    ref.set_reader_partitions(1)
    ref.set_writer_partitions(1)
    raw = rpc.endpoint_ref(env.address, "EpochCoordinator-run--1", env.authkey)  # plain values, its own connection
    with caplog.at_level(logging.WARNING, logger="statecore.rpc"):
        with pytest.raises(rpc.RpcProtocolError, match="is not one EpochCoordinator takes"):
            raw.ask(("ReportPartitionOffset", 0, 1))  # one field short
    assert any("is not one EpochCoordinator takes" in m and "of at least length 4, got 3" in m for m in caplog.messages)
    assert raw.ask(("GetCurrentEpoch",)) == 1  # a new connection; plain values that are its messages do
    ref.report_partition_offset(0, 1, 0)
    ref.commit_partition_epoch(0, 1, None)
    assert ref.get_current_epoch() == 1 and events.committed() == [1]



def test_a_writer_committing_a_quarter_million_nested_values_is_dropped_before_decoding(env, caplog):
    """A commit message of 256 Ki empty lists (a plain value inside a typed message) is over
    the endpoint's bound for plain values: its connection is dropped before it is decoded (an
    ask is told why), so the epoch does not commit when its offset comes; a good commit does."""
    ref, events = create(env)
    ref.set_reader_partitions(1)
    ref.set_writer_partitions(1)
    bad = rpc.endpoint_ref(env.address, "EpochCoordinator-run--1", env.authkey)
    with caplog.at_level(logging.WARNING, logger="statecore.rpc"):
        with pytest.raises(rpc.RpcProtocolError, match="exceeds the 65536 bytes EpochCoordinator takes"):
            bad.ask(CommitPartitionEpoch(0, 1, [[]] * (1 << 18)))
    assert any("dropped" in m and "exceeds the 65536 bytes EpochCoordinator takes" in m for m in caplog.messages)
    ref.report_partition_offset(0, 1, 0)
    assert ref.get_current_epoch() == 1 and events.committed() == []
    ref.commit_partition_epoch(0, 1, None)
    assert ref.get_current_epoch() == 1 and events.committed() == [1]

def test_ref_pickles_and_refuses_bad_arguments(env):
    ref, events = create(env)
    ref.set_reader_partitions(1)
    ref.set_writer_partitions(1)
    task = pickle.loads(pickle.dumps(ref))
    task.report_partition_offset(0, 1, 0)
    task.commit_partition_epoch(0, 1, None)
    task.get_current_epoch()
    assert events.committed() == [1]
    with pytest.raises(TypeError, match="epoch must be an int"):
        task.commit_partition_epoch(0, 1.0, None)
    with pytest.raises(TypeError, match="cannot send a value of type set"):  # before anything is sent
        task.commit_partition_epoch(0, 2, {"files": {"a"}})
    with pytest.raises(TypeError, match="cannot send a value of type object"):
        task.report_partition_offset(0, 2, [object()])
    assert task.get_current_epoch() == 1 and events.committed() == [1]


def send_partition(ref, partition, epochs, seed):
    """One task's sends for its partition, as reader and writer, in a shuffled epoch order; then a flush."""
    order = list(epochs)
    random.Random(seed).shuffle(order)
    for epoch in order:
        ref.report_partition_offset(partition, epoch, [partition, epoch])
        ref.commit_partition_epoch(partition, epoch, {"partition": partition, "epoch": epoch})
    ref.get_current_epoch()


def check_committed_in_order(events, partitions, epochs):
    assert events.committed() == list(epochs)
    assert events.of("writer.commit") == [(e, [{"partition": p, "epoch": e} for p in range(partitions)])
                                          for e in epochs]
    assert sorted(events.of("query.add_offset")) == [(e, [[p, e] for p in range(partitions)]) for e in epochs]
    kinds = [e[0] for e in events.log if e[0] != "query.add_offset"]
    assert kinds == ["writer.commit", "query.commit"] * len(epochs)


def test_concurrent_senders_commit_in_order(env):
    partitions, epochs = 8, range(1, 41)
    ref, events = create(env)
    ref.set_reader_partitions(partitions)
    ref.set_writer_partitions(partitions)
    errors = []

    def task(partition):
        try:
            send_partition(EpochCoordinatorRef.connect(env.address, "run--1", env.authkey), partition, epochs,
                           seed=partition)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=task, args=(p,)) for p in range(partitions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert errors == [] and not any(t.is_alive() for t in threads)
    check_committed_in_order(events, partitions, epochs)


TASK_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_epoch import send_partition
from statecore.epoch import EpochCoordinatorRef

args = json.load(sys.stdin)
ref = EpochCoordinatorRef.connect(tuple(args["address"]), args["id"], bytes.fromhex(args["authkey"]))
send_partition(ref, args["partition"], range(1, args["epochs"] + 1), seed=args["partition"])
print("done")
"""


def test_senders_in_other_processes(env):
    partitions, epochs = 3, 20
    ref, events = create(env)
    ref.set_reader_partitions(partitions)
    ref.set_writer_partitions(partitions)
    script = TASK_SCRIPT.format(tests=os.path.dirname(__file__))
    child_env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(statecore.__file__)))
    children = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=child_env) for _ in range(partitions)]
    for p, child in enumerate(children):
        args = {"address": list(env.address), "id": "run--1", "authkey": env.authkey.hex(), "partition": p,
                "epochs": epochs}
        out, err = child.communicate(json.dumps(args), timeout=SUBPROCESS_TIMEOUT_S)
        assert child.returncode == 0 and out.strip() == "done", err
    check_committed_in_order(events, partitions, range(1, epochs + 1))
