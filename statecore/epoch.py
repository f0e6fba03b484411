"""The EpochCoordinator of continuous processing, and its typed client EpochCoordinatorRef
(docs/spark-state-store.md, The epoch coordinator).

The coordinator has three jobs: it keeps the epoch counter that reader tasks poll; it
collects the end offset each reader partition reports for an epoch and, once every reader
reported, hands them to the query (``query.add_offset``); and it collects each writer
partition's commit message for an epoch and, once the epoch has every offset and every
commit, commits it: ``writer.commit`` first, then ``query.commit`` (the other way round, a
driver restart in between would drop the sink's commit). Epochs commit strictly in
increasing order from ``start_epoch``, each once: a complete epoch whose predecessor is
not committed yet waits for it.

The messages are the :class:`~statecore.rpc.Message` Structs below, and the endpoint takes
exactly their union, :data:`EpochMessage` (anything else drops the sender's connection:
see :mod:`statecore.rpc`): the one-way :class:`CommitPartitionEpoch` and
:class:`ReportPartitionOffset`, dropped once writes are stopped; the asks
:class:`GetCurrentEpoch`, :class:`IncrementAndGetEpoch`, :class:`SetReaderPartitions`,
:class:`SetWriterPartitions`, :class:`StopContinuousExecutionWrites`, and statecore's own
:class:`StopEpochCoordinator`, which unregisters the endpoint (Spark's driver stops it
through its RpcEnv instead; a message lets any ref do it after its earlier sends). Commit
messages and offsets are whatever the tasks send, so they must be plain RPC values (None,
bool, int, float, str, bytes, and tuples, lists and dicts of them; a tuple arrives as a
list); the coordinator never looks inside them.

Thread-safety: the endpoint is driven by :mod:`statecore.rpc`, one message at a time, and
the callbacks run on that thread; it keeps no lock. An :class:`EpochCoordinatorRef` may be
shared by threads and pickled into tasks.
"""
import logging
from typing import Any, Union

from statecore import rpc
from statecore.errors import IllegalStateError

__all__ = ["EpochCoordinator", "EpochCoordinatorRef", "endpoint_name", "EpochMessage", "CommitPartitionEpoch",
           "ReportPartitionOffset", "GetCurrentEpoch", "IncrementAndGetEpoch", "SetReaderPartitions",
           "SetWriterPartitions", "StopContinuousExecutionWrites", "StopEpochCoordinator"]

log = logging.getLogger(__name__)

OFFSET_QUEUE_EXCEEDED = "Size of the partition offset queue has exceeded its maximum"
COMMIT_QUEUE_EXCEEDED = "Size of the partition commit queue has exceeded its maximum"
EPOCH_QUEUE_EXCEEDED = "Size of the epoch queue has exceeded its maximum"


# -- messages ----------------------------------------------------------------------------------

class CommitPartitionEpoch(rpc.Message):
    """One-way: writer partition ``partition_id``'s commit ``message`` for ``epoch``."""

    partition_id: int
    epoch: int
    message: Any


class ReportPartitionOffset(rpc.Message):
    """One-way: reader partition ``partition_id``'s end ``offset`` for ``epoch``."""

    partition_id: int
    epoch: int
    offset: Any


class GetCurrentEpoch(rpc.Message):
    """Ask: the current epoch (an int)."""


class IncrementAndGetEpoch(rpc.Message):
    """Ask: start the next epoch; its number (an int)."""


class SetReaderPartitions(rpc.Message):
    """Ask: the number of reader partitions (replies None)."""

    n: int


class SetWriterPartitions(rpc.Message):
    """Ask: the number of writer partitions (replies None)."""

    n: int


class StopContinuousExecutionWrites(rpc.Message):
    """Ask: drop every later commit and offset (replies None)."""


class StopEpochCoordinator(rpc.Message):
    """Ask: unregister the endpoint, after the messages before this one (replies True)."""


EpochMessage = Union[CommitPartitionEpoch, ReportPartitionOffset, GetCurrentEpoch, IncrementAndGetEpoch,
                     SetReaderPartitions, SetWriterPartitions, StopContinuousExecutionWrites, StopEpochCoordinator]
_ONE_WAY = (CommitPartitionEpoch, ReportPartitionOffset)


def endpoint_name(epoch_coordinator_id):
    return f"EpochCoordinator-{epoch_coordinator_id}"


def _check_int(what, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    return value


class EpochCoordinator(rpc.RpcEndpoint):
    """The endpoint; its state and messages are Spark's (docs/spark-state-store.md, The epoch
    coordinator), with one change.

    Parameters
    ----------
    writer
        The sink: ``writer.commit(epoch, messages)`` with the epoch's commit messages as a
        list ordered by partition id (Spark passes them in no particular order).
    query
        ``query.add_offset(epoch, offsets)`` with the epoch's offsets as a list ordered by
        partition id, ``query.commit(epoch)``, and ``query.stop_in_new_thread(error)``,
        called with an :class:`~statecore.IllegalStateError` carrying Spark's text when a
        backlog exceeds ``epoch_backlog_queue_size``.
    start_epoch : int
        The first epoch to commit (the query's current batch id).
    epoch_backlog_queue_size : int, default 10000
        Most (epoch, partition) offsets, (epoch, partition) commits and waiting epochs each
        kept before the query is told to stop (Spark's
        ``spark.sql.streaming.continuous.epochBacklogQueueSize``); exactly this many is allowed.
    rpc_env, name : optional
        The env and name it is registered under, for ``StopEpochCoordinator``
        (:meth:`EpochCoordinatorRef.create` passes them); without them that message only logs.

    Unlike Spark (the quirk that page ends with), an offset report for an epoch already committed
    (``<= last_committed_epoch``) is logged at debug level and ignored: Spark would call
    ``add_offset`` again and, for the last committed epoch, whose entries are still kept,
    park it in the waiting set, where it would stay for ever and count towards the epoch
    backlog. Such a report can only be a repeat (a committed epoch had every offset), so
    nothing is lost. The backlog check still runs after it, as after every offset report.
    """

    message_type = EpochMessage
    max_message_bytes = rpc.DEFAULT_MAX_UNTYPED_MESSAGE_BYTES  # commit messages and offsets are plain values

    def __init__(self, writer, query, start_epoch, epoch_backlog_queue_size=10000, *, rpc_env=None, name=None):
        super().__init__()
        self.writer = writer
        self.query = query
        self.epoch_backlog_queue_size = _check_int("epoch_backlog_queue_size", epoch_backlog_queue_size)
        self.current_driver_epoch = _check_int("start_epoch", start_epoch)
        self.last_committed_epoch = start_epoch - 1
        self.num_reader_partitions = 0
        self.num_writer_partitions = 0
        self.query_writes_stopped = False
        # Spark's maps keyed by (epoch, partition), kept as epoch -> {partition: value} so an
        # epoch's entries are found without a scan; the counts are the sizes Spark checks.
        self._commits = {}
        self._offsets = {}
        self.num_partition_commits = 0
        self.num_partition_offsets = 0
        self.epochs_waiting_to_be_committed = set()
        self._rpc_env = rpc_env  # where EpochCoordinatorRef.create registered it, as `name`
        self._name = name

    # One-way messages (CommitPartitionEpoch, ReportPartitionOffset).

    def receive(self, message):
        if not isinstance(message, _ONE_WAY):
            raise ValueError(f"not a one-way EpochCoordinator message: {_name(message)}")
        _check_int("partition_id", message.partition_id)
        _check_int("epoch", message.epoch)
        if self.query_writes_stopped:
            # Lame-duck tasks of a stopped run must not commit anything (Spark drops them).
            log.debug("Dropped %s: writes of this query are stopped", _name(message))
        elif type(message) is CommitPartitionEpoch:
            self._commit_partition_epoch(message.partition_id, message.epoch, message.message)
        else:
            self._report_partition_offset(message.partition_id, message.epoch, message.offset)

    def _commit_partition_epoch(self, partition_id, epoch, message):
        log.debug("Got commit from partition %d at epoch %d: %r", partition_id, epoch, message)
        commits = self._commits.setdefault(epoch, {})
        if partition_id in commits:
            return  # the first commit wins; a repeat is ignored entirely (Spark)
        commits[partition_id] = message
        self.num_partition_commits += 1
        self._resolve_commits_at_epoch(epoch)
        self._check_processing_queue_boundaries()

    def _report_partition_offset(self, partition_id, epoch, offset):
        if epoch <= self.last_committed_epoch:
            # Spark's quirk, fixed: see the class docstring.
            log.debug("Ignored offset of partition %d for epoch %d: epoch %d is already committed",
                      partition_id, epoch, self.last_committed_epoch)
        else:
            offsets = self._offsets.setdefault(epoch, {})
            if partition_id not in offsets:
                self.num_partition_offsets += 1
            offsets[partition_id] = offset  # the last report wins
            if len(offsets) == self.num_reader_partitions:
                log.debug("Epoch %d has offsets reported from all partitions: %r", epoch, offsets)
                self.query.add_offset(epoch, _by_partition(offsets))
                self._resolve_commits_at_epoch(epoch)
        self._check_processing_queue_boundaries()

    def _resolve_commits_at_epoch(self, epoch):
        commits = self._commits.get(epoch, {})
        offsets = self._offsets.get(epoch, {})
        if len(commits) != self.num_writer_partitions or len(offsets) != self.num_reader_partitions:
            return
        if self.last_committed_epoch != epoch - 1:
            log.debug("Epoch %d has received commits from all partitions and is waiting for epoch %d "
                      "to be committed first.", epoch, epoch - 1)
            self.epochs_waiting_to_be_committed.add(epoch)
            return
        self._commit_epoch(epoch, commits)
        while self.last_committed_epoch + 1 in self.epochs_waiting_to_be_committed:
            next_epoch = self.last_committed_epoch + 1
            self._commit_epoch(next_epoch, self._commits.get(next_epoch, {}))
            self.epochs_waiting_to_be_committed.remove(next_epoch)
        # Every partition is past the epochs before the last committed one: forget them. The
        # last committed epoch's own entries stay (Spark).
        for old in [e for e in self._commits if e < self.last_committed_epoch]:
            self.num_partition_commits -= len(self._commits.pop(old))
        for old in [e for e in self._offsets if e < self.last_committed_epoch]:
            self.num_partition_offsets -= len(self._offsets.pop(old))

    def _commit_epoch(self, epoch, commits):
        log.debug("Epoch %d has received commits from all partitions and is ready to be committed. "
                  "Committing epoch %d.", epoch, epoch)
        # The sink first, then the query's log: recorded the other way round, a restart in
        # between would drop the sink's commit (Spark).
        self.writer.commit(epoch, _by_partition(commits))
        self.query.commit(epoch)
        self.last_committed_epoch = epoch

    def _check_processing_queue_boundaries(self):
        # Strict comparisons, each checked on its own: exactly the limit is allowed (Spark).
        limit = self.epoch_backlog_queue_size
        if self.num_partition_offsets > limit:
            self.query.stop_in_new_thread(IllegalStateError(OFFSET_QUEUE_EXCEEDED))
        if self.num_partition_commits > limit:
            self.query.stop_in_new_thread(IllegalStateError(COMMIT_QUEUE_EXCEEDED))
        if len(self.epochs_waiting_to_be_committed) > limit:
            self.query.stop_in_new_thread(IllegalStateError(EPOCH_QUEUE_EXCEEDED))

    # Asks.

    def receive_and_reply(self, message):
        match message:
            case GetCurrentEpoch():
                return self.current_driver_epoch
            case IncrementAndGetEpoch():
                self.current_driver_epoch += 1
                return self.current_driver_epoch
            case SetReaderPartitions(n=n):
                self.num_reader_partitions = _check_int("number of reader partitions", n)
                return None
            case SetWriterPartitions(n=n):
                self.num_writer_partitions = _check_int("number of writer partitions", n)
                return None
            case StopContinuousExecutionWrites():
                # An ask, not a send: once it is answered, no message sent before it can still commit.
                self.query_writes_stopped = True
                return None
            case StopEpochCoordinator():
                return self._stop_epoch_coordinator()
        raise ValueError(f"not an EpochCoordinator ask: {_name(message)}")

    def _stop_epoch_coordinator(self):
        # statecore's own message (EpochCoordinatorRef.stop): every earlier message of the
        # caller's ref is handled before the name is unregistered.
        if self._rpc_env is not None:
            self._rpc_env.stop_endpoint(self._name)
        log.info("%s stopped", self._name or "EpochCoordinator")
        return True


def _name(message):
    """How an error names a message: its class name, or the repr of what is not one."""
    return type(message).__name__ if isinstance(message, rpc.Message) else repr(message)


def _by_partition(entries):
    """An epoch's values (partition -> value) as a list ordered by partition id."""
    return [entries[p] for p in sorted(entries)]


class EpochCoordinatorRef:
    """A typed client of an :class:`EpochCoordinator`; picklable, so it travels to tasks.

    ``commit_partition_epoch`` and ``report_partition_offset`` are one-way sends; the other
    methods are asks, answered after every earlier send of the same ref was handled (so
    :meth:`get_current_epoch` also flushes).
    """

    def __init__(self, endpoint_ref):
        self._ref = endpoint_ref

    @classmethod
    def create(cls, writer, query, epoch_coordinator_id, start_epoch, rpc_env, epoch_backlog_queue_size=10000):
        """Register a new coordinator as ``"EpochCoordinator-<epoch_coordinator_id>"`` in
        ``rpc_env`` and return a ref to it."""
        name = endpoint_name(epoch_coordinator_id)
        coordinator = EpochCoordinator(writer, query, start_epoch, epoch_backlog_queue_size,
                                       rpc_env=rpc_env, name=name)
        ref = rpc_env.setup_endpoint(name, coordinator)
        log.info("Registered %s starting at epoch %d", name, start_epoch)
        return cls(ref)

    @classmethod
    def connect(cls, address, epoch_coordinator_id, authkey):
        """A client-only ref to the coordinator ``epoch_coordinator_id`` of the driver at ``address``."""
        return cls(rpc.endpoint_ref(address, endpoint_name(epoch_coordinator_id), authkey))

    @property
    def address(self):
        return self._ref.address

    @property
    def authkey(self):
        return self._ref.authkey

    def commit_partition_epoch(self, partition_id, epoch, message):
        """Send writer partition ``partition_id``'s commit message for ``epoch`` (a plain RPC value)."""
        rpc.check_value(message)
        self._ref.send(CommitPartitionEpoch(_check_int("partition_id", partition_id), _check_int("epoch", epoch),
                                            message))

    def report_partition_offset(self, partition_id, epoch, offset):
        """Send reader partition ``partition_id``'s end offset for ``epoch`` (a plain RPC value)."""
        rpc.check_value(offset)
        self._ref.send(ReportPartitionOffset(_check_int("partition_id", partition_id), _check_int("epoch", epoch),
                                             offset))

    def get_current_epoch(self):
        return self._ref.ask(GetCurrentEpoch(), reply_type=int)

    def increment_and_get_epoch(self):
        return self._ref.ask(IncrementAndGetEpoch(), reply_type=int)

    def set_reader_partitions(self, n):
        self._ref.ask(SetReaderPartitions(_check_int("n", n)), reply_type=None)

    def set_writer_partitions(self, n):
        self._ref.ask(SetWriterPartitions(_check_int("n", n)), reply_type=None)

    def stop_continuous_execution_writes(self):
        """From now on the coordinator drops every commit and offset (those sent before this
        call through this ref are handled first)."""
        self._ref.ask(StopContinuousExecutionWrites(), reply_type=None)

    def stop(self):
        """Unregister the coordinator (after every earlier message of this ref was handled)."""
        self._ref.ask(StopEpochCoordinator(), reply_type=bool)

    def __repr__(self):
        return f"EpochCoordinatorRef({self._ref.name!r} at {self.address!r})"
