"""Continuous execution with statecore state: long-running partition tasks, epochs committed
in order by the driver's :class:`~statecore.epoch.EpochCoordinator`, exactly-once restart.

Spark's continuous mode runs one long-lived task per source partition and cuts the stream
into *epochs* instead of micro-batches: the driver advances an epoch counter on a timer, and
each task, when it sees the counter pass its epoch, commits what it did in that epoch. This
module gives PySpark users that mode with a statecore store per partition
(:func:`start_continuous`); the user's page is ``docs/continuous.md``.

Epochs, store versions and offsets (the numbering everything below relies on)
    - Epochs are numbered from 1. A new query starts epoch 1 with every store at version 0
      (empty) and every reader at its source's ``initial_offset``.
    - The driver calls ``increment_and_get_epoch`` every ``epoch_interval_ms``; the answer
      ``e + 1`` *ends* epoch ``e``. A task notices it at its next poll of
      ``get_current_epoch`` (every ``poll_interval_ms`` at most, between batches, or while
      its source is idle): every row it read before that poll belongs to epoch ``e``.
    - Closing epoch ``e`` in partition ``p``: the epoch's output is written to the sink
      (replacing any file of ``(e, p)``), the store commits version ``e``, and the task sends
      ``report_partition_offset(p, e, offset)`` (the reader's position after the last row of
      epoch ``e``) and ``commit_partition_epoch(p, e, message)``; the message carries the
      store's new ``commit_id``, and the task's next store opens version ``e`` at it. If
      the counter moved by more than one, the epochs in between are closed empty, so every
      partition commits every epoch.
    - On the driver, the coordinator calls ``query.add_offset(e, offsets)`` once every
      partition reported (written as ``<checkpoint>/offsets/<e>``), then, in epoch order,
      ``writer.commit(e, messages)`` (the sink's ``_commits/<e>``) and ``query.commit(e)``
      (``<checkpoint>/commits/<e>``, with ``commit_ids``: each partition's commit id of
      version ``e``, from the messages). An epoch is committed once its commits-log entry
      exists.
    - Restart: ``c`` = the newest epoch of the commits log (0 if none). Every store loads
      version ``c`` at the commit id ``commits/<c>`` recorded for its partition (several
      attempts of a version may be on disk, and the default lineage, the attempt renamed
      last, need not be the committed one: ``docs/lineage.md``; an entry without ids, from
      before they were recorded, loads the default lineage), every reader seeks to the
      offsets of ``offsets/<c>``, the run starts at epoch ``c + 1``; what uncommitted epochs
      left behind (offsets-log entries, sink files and sink commits of epochs after ``c``)
      is deleted, and store versions after ``c`` are committed again (statecore stores
      support re-committing a version; the new commits delete the abandoned ones).

State is per reader partition
    There is no shuffle (Spark's continuous mode has none either): partition ``p``'s task
    reads partition ``p`` of the source and keeps the store ``<checkpoint>/state/0/<p>``. So
    the source must route every key to one partition; :class:`GeneratorSource` does, and
    :class:`FileSource` leaves it to whoever writes the files.

The source interface (:class:`ContinuousSource`, :class:`PartitionReader`)
    A source is a picklable object (it travels to the tasks) with ``num_partitions``,
    ``initial_offset(p)`` and ``reader(p, offset)``; a reader returns Arrow record batches
    (``next_batch()``, None when nothing is available now) and its position (``offset()``).
    Offsets are small JSON values (None, bool, int, float, str, lists and dicts of them):
    they travel over RPC and are stored in the offsets log. A source must be *replayable*:
    a reader opened at an offset it reported returns exactly the rows that followed it.

Failures
    A task that raises fails the Spark job; the query then stops with that error, or, with
    ``max_restarts``, restarts from its checkpoint (a new run: new run id, new coordinator).
    Before a restart or at ``stop()`` the driver sends ``stop_continuous_execution_writes``,
    then unregisters the coordinator: the tasks' next poll fails, and they end, aborting
    their open store. A restart waits for the old run's tasks to be gone, so two tasks never
    write the same partition's files. The coordinator's backlog limits (``epoch_backlog_
    queue_size``) stop the query with Spark's messages, without restart, as does a failure
    to write the logs or the sink commit. Spark cannot retry a task of a continuous job
    (partition ``p`` would restart alone at an old epoch): a second attempt fails at once.

Threads (driver): the caller's; the query thread (runs the Spark job, restarts, tears
down); per run an epoch-timer thread; the RpcEnv's threads, which run the coordinator's
callbacks. Public methods of :class:`ContinuousQuery` may be called from any thread.
"""
import collections
import dataclasses
import json
import logging
import threading
import time
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statecore import registry
from statecore.conf import StateStoreConf
from statecore.epoch import EpochCoordinatorRef
from statecore.errors import SchemaMismatchError
from statecore.files import open_store_files
from statecore.ids import StateStoreId, StateStoreProviderId
from statecore.lineage import ROOT_COMMIT_ID
from statecore.rpc import RpcError
from statecore.schema import key_value_schemas

from pyspark_glue import executor
from pyspark_glue.logs import EpochLog, checked_commit_ids
from pyspark_glue.operator import conform_output
from pyspark_glue.rdd import ship_function_module

__all__ = ["ContinuousSource", "PartitionReader", "GeneratorSource", "FileSource", "EpochSink", "EpochLog",
           "ContinuousQuery", "ContinuousQueryException", "ContinuousTaskRetryError", "start_continuous",
           "task_slots", "STATE_DIR",
           "OPERATOR_ID"]

log = logging.getLogger(__name__)

STATE_DIR = "state"  # <checkpoint>/state/<OPERATOR_ID>/<partition>: the stores
OPERATOR_ID = 0
OFFSETS_DIR = "offsets"
COMMITS_DIR = "commits"
METADATA_FILE = "metadata"
_FORMAT = "statecore-continuous-1"


# -- sources -----------------------------------------------------------------------------------

class PartitionReader:
    """Reads one partition of a source, from the offset it was opened at (the interface)."""

    def next_batch(self):
        """The next ``pyarrow.RecordBatch`` (at least one row), or None if no row is
        available now (the task polls the epoch and asks again a few ms later). Must not block
        for long: epochs are closed between calls."""
        raise NotImplementedError

    def offset(self):
        """The position after the last row returned (a JSON value): opening a reader of the
        same partition at it must return exactly the rows that follow."""
        raise NotImplementedError

    def close(self):
        """Release what the reader holds (called once, also after a failure)."""


class ContinuousSource:
    """A replayable, partitioned source (the interface; see the module docstring).

    Attributes
    ----------
    num_partitions : int
        One long-running task per partition; fixed for the life of a checkpoint.
    """

    num_partitions = 0

    def initial_offset(self, partition):
        """Where a new query starts reading ``partition`` (a JSON value)."""
        raise NotImplementedError

    def reader(self, partition, offset):
        """A :class:`PartitionReader` of ``partition`` positioned at ``offset``."""
        raise NotImplementedError

    def describe(self):
        """A JSON description, recorded in the checkpoint's metadata (for humans)."""
        return {"class": type(self).__name__, "num_partitions": self.num_partitions}


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
    return value


class GeneratorSource(ContinuousSource):
    """Rows as a pure function of ``(partition, offset)``: replayable by construction.

    The offset of a partition is the number of its rows read so far (an int). ``rows(p,
    start, stop)`` returns rows ``start..stop-1`` of partition ``p`` as one record batch
    (numpy, no per-row Python); it must be deterministic and route each key to one
    partition. The default (:meth:`default_rows`) gives columns ``partition`` (int32),
    ``offset`` (int64), ``key`` (int64, ``key % num_partitions == partition``, about
    ``keys_per_partition`` distinct keys per partition) and ``value`` (int64 in 0..99).

    Parameters
    ----------
    num_partitions : int
    rows : callable ``(partition, start, stop) -> pyarrow.RecordBatch``, optional
        Picklable (it travels to the tasks).
    rows_per_second : int, optional
        Per partition: a reader makes rows available at this rate from when it opens
        (None: as fast as they are consumed).
    max_offset : int, optional
        Rows per partition in all (None: endless); a reader is then idle for ever.
    batch_rows : int, default 4096
        Most rows per batch.
    keys_per_partition : int, default 1000
        For the default rows.
    """

    def __init__(self, num_partitions, rows=None, *, rows_per_second=None, max_offset=None, batch_rows=4096,
                 keys_per_partition=1000):
        self.num_partitions = _check_positive_int("num_partitions", num_partitions)
        if rows is not None and not callable(rows):
            raise TypeError(f"rows must be callable (partition, start, stop) -> RecordBatch, got {type(rows).__name__}")
        self._rows = rows
        self.rows_per_second = _check_positive_int("rows_per_second", rows_per_second, allow_none=True)
        if max_offset is not None and (not isinstance(max_offset, int) or max_offset < 0):
            raise ValueError(f"max_offset must be an int >= 0 or None, got {max_offset!r}")
        self.max_offset = max_offset
        self.batch_rows = _check_positive_int("batch_rows", batch_rows)
        self.keys_per_partition = _check_positive_int("keys_per_partition", keys_per_partition)

    def default_rows(self, partition, start, stop):
        offsets = np.arange(start, stop, dtype=np.int64)
        # A multiplicative hash spreads consecutive offsets over the partition's keys.
        local = (offsets * 2654435761 + partition * 7919) % self.keys_per_partition
        return pa.RecordBatch.from_arrays(
            [pa.array(np.full(len(offsets), partition, dtype=np.int32)), pa.array(offsets),
             pa.array(local * self.num_partitions + partition), pa.array((offsets * 31 + partition) % 100)],
            names=["partition", "offset", "key", "value"])

    def rows(self, partition, start, stop):
        """Rows ``start..stop-1`` of ``partition`` (what a reader returns, and what tests
        compare with)."""
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} is not in 0..{self.num_partitions - 1}")
        batch = (self._rows or self.default_rows)(partition, start, stop)
        if not isinstance(batch, pa.RecordBatch) or batch.num_rows != stop - start:
            raise ValueError(f"rows({partition}, {start}, {stop}) must return a RecordBatch of {stop - start} rows, "
                             f"got {batch!r:.200}")
        return batch

    def initial_offset(self, partition):
        return 0

    def reader(self, partition, offset):
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"a GeneratorSource offset is an int >= 0, got {offset!r} for partition {partition}")
        return _GeneratorReader(self, partition, offset)

    def describe(self):
        return {**super().describe(), "rows_per_second": self.rows_per_second, "max_offset": self.max_offset,
                "batch_rows": self.batch_rows}


class _GeneratorReader(PartitionReader):
    def __init__(self, source, partition, offset):
        self.source, self.partition = source, partition
        self.start_offset = self.position = offset
        self.started = time.monotonic()

    def next_batch(self):
        source = self.source
        end = self.position + source.batch_rows
        if source.rows_per_second is not None:
            elapsed = time.monotonic() - self.started
            end = min(end, self.start_offset + int(elapsed * source.rows_per_second))
        if source.max_offset is not None:
            end = min(end, source.max_offset)
        if end <= self.position:
            return None
        batch = source.rows(self.partition, self.position, end)
        self.position = end
        return batch

    def offset(self):
        return self.position


class FileSource(ContinuousSource):
    """A folder of append-only files: partition ``p`` reads the parquet files of
    ``<path>/<p>/`` in the order of their names, each once, as they appear.

    Files must appear whole (written under a name starting with ``.`` or ``_``, which is
    ignored, then renamed) and never change; a file must sort after every file already
    there (zero-padded sequence numbers or timestamps), since a reader never goes back to a
    name before its position. The offset is ``[name, rows]``: every file sorting before
    ``name`` and the first ``rows`` rows of ``name`` were read (initially ``["", 0]``).
    Whoever writes the files decides the partition of each row: put each key in one
    partition's folder.

    Parameters
    ----------
    path : str
        A local path or fsspec URL the executors can read.
    num_partitions : int
    batch_rows : int, default 65536
        Most rows per batch.
    columns : list of str, optional
        Read only these columns.
    storage_options : dict, optional
    discovery_interval_ms : float, default 100
        How often, at most, an idle reader lists its folder for new files (0: at every call
        that finds nothing to read).
    """

    def __init__(self, path, num_partitions, *, batch_rows=65536, columns=None, storage_options=None,
                 discovery_interval_ms=100):
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        self.path = path.rstrip("/")
        self.num_partitions = _check_positive_int("num_partitions", num_partitions)
        self.batch_rows = _check_positive_int("batch_rows", batch_rows)
        self.columns = None if columns is None else list(columns)
        self.storage_options = dict(storage_options or {})
        if not isinstance(discovery_interval_ms, (int, float)) or not discovery_interval_ms >= 0:
            raise ValueError(f"discovery_interval_ms must be a number >= 0, got {discovery_interval_ms!r}")
        self.discovery_interval_s = discovery_interval_ms / 1e3

    def partition_path(self, partition):
        return f"{self.path}/{partition}"

    def initial_offset(self, partition):
        return ["", 0]

    def reader(self, partition, offset):
        if (not isinstance(offset, (list, tuple)) or len(offset) != 2 or not isinstance(offset[0], str)
                or not isinstance(offset[1], int) or offset[1] < 0):
            raise ValueError(f"a FileSource offset is [file name, rows read], got {offset!r} for partition {partition}")
        return _FileReader(self, partition, offset[0], offset[1])

    def describe(self):
        return {**super().describe(), "path": self.path}


class _FileReader(PartitionReader):
    def __init__(self, source, partition, name, rows):
        self.source = source
        self.fs, self.root = fsspec.core.url_to_fs(source.partition_path(partition), **source.storage_options)
        self.name, self.rows = name, rows  # the position: see FileSource
        self._batches = None  # batches of the open file (self.name), after the rows already read
        self._file = None
        self._exhausted = False  # self.name was read to its end
        self._listed_at = -float("inf")
        self._names = []

    def _list(self):
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            entries = []
        names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")
        self._names = sorted(n for n in names if not n.startswith((".", "_")))
        self._listed_at = time.monotonic()

    def _next_name(self):
        """The file to read next (the current one if unfinished), or None; lists the folder
        only when the last listing offers nothing and is older than the discovery interval."""
        for attempt in (0, 1):
            for n in self._names:
                if n > self.name or (n == self.name and not self._exhausted):
                    return n
            if attempt or time.monotonic() - self._listed_at < self.source.discovery_interval_s:
                return None
            self._list()
        return None

    def _open(self, name):
        skip = self.rows if name == self.name else 0
        self.name, self.rows, self._exhausted = name, skip, False
        self._file = self.fs.open(f"{self.root}/{name}", "rb")
        parquet = pq.ParquetFile(self._file)
        self._batches = _skip_rows(parquet.iter_batches(batch_size=self.source.batch_rows,
                                                        columns=self.source.columns), skip)

    def _close_file(self):
        self._batches = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def next_batch(self):
        while True:
            if self._batches is None:
                name = self._next_name()
                if name is None:
                    return None
                self._open(name)
            batch = next(self._batches, None)
            if batch is None:
                self._close_file()
                self._exhausted = True
                continue
            if batch.num_rows:
                self.rows += batch.num_rows
                return batch

    def offset(self):
        return [self.name, self.rows]

    def close(self):
        self._close_file()


def _skip_rows(batches, n):
    """The batches after dropping their first ``n`` rows."""
    for batch in batches:
        if n >= batch.num_rows:
            n -= batch.num_rows
            continue
        yield batch.slice(n) if n else batch
        n = 0


# -- the sink ------------------------------------------------------------------------------------

class EpochSink:
    """Output files keyed by epoch: ``<path>/epoch=<e>/part-<p>.parquet`` (one per partition
    with output in epoch ``e``), and ``<path>/_commits/<e>`` once epoch ``e`` is committed
    (JSON: the epoch's files and row counts). Writing ``(e, p)`` again replaces its file (or
    deletes it when the new output is empty), so re-running an epoch after a restart leaves
    exactly one output per epoch: readers take the committed epochs only
    (:meth:`committed_files`, :meth:`read`), which are never rewritten."""

    COMMITS = "_commits"

    def __init__(self, path, storage_options=None):
        if not isinstance(path, str) or not path:
            raise ValueError(f"sink path must be a non-empty str, got {path!r}")
        self.path = path.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.files = open_store_files(self.path, self.storage_options)
        self.commits = EpochLog(f"{self.path}/{self.COMMITS}", self.storage_options)

    @staticmethod
    def file_name(epoch, partition):
        return f"epoch={epoch}/part-{partition:05d}.parquet"

    def write(self, epoch, partition, batches, schema):
        """Write (or replace) the output of ``(epoch, partition)``: the task side. Returns the
        partition's commit message (``file``: the name or None, ``rows``)."""
        name = self.file_name(epoch, partition)
        rows = sum(b.num_rows for b in batches)
        if not rows:
            self.files.delete([name])  # a stale file of an abandoned run of this epoch
            return {"file": None, "rows": 0}

        def write(f):
            with pq.ParquetWriter(f, schema) as writer:
                for batch in batches:
                    if batch.num_rows:
                        writer.write_batch(batch)

        self.files.write_atomic(name, write)
        return {"file": name, "rows": rows}

    def commit(self, epoch, messages):
        """Record epoch ``epoch`` as committed with its partitions' messages: the driver side."""
        files = [m["file"] for m in messages if isinstance(m, dict) and m.get("file")]
        rows = sum(m.get("rows", 0) for m in messages if isinstance(m, dict))
        self.commits.write(epoch, {"epoch": epoch, "files": files, "rows": rows})

    def committed_epochs(self):
        return self.commits.epochs()

    def committed_files(self):
        """``{epoch: [file path, ...]}`` of the committed epochs."""
        return {e: [self.files.path(name) for name in self.commits.read(e)["files"]] for e in self.committed_epochs()}

    def discard_after(self, epoch):
        """Delete the commits, then the files, of every epoch after ``epoch`` (at a restart
        from ``epoch``)."""
        self.commits.delete_after(epoch)
        fs, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        fs.invalidate_cache(root)
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("epoch=") and name[6:].isdigit() and int(name[6:]) > epoch:
                fs.rm(entry, recursive=True)

    def read(self, columns=None):
        """The committed output as one ``pyarrow.Table`` with an ``epoch`` column (int64)
        appended, ordered by epoch then partition; None if no committed epoch has rows."""
        tables = []
        for epoch, paths in self.committed_files().items():
            for path in sorted(paths):
                with fsspec.open(path, "rb", **self.storage_options) as f:
                    table = pq.read_table(f, columns=columns)
                tables.append(table.append_column("epoch", pa.array(np.full(table.num_rows, epoch, np.int64))))
        return pa.concat_tables(tables) if tables else None


# -- the tasks ---------------------------------------------------------------------------------------

class ContinuousTaskRetryError(RuntimeError):
    """A continuous task was retried by Spark (not supported: see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class _TaskSpec:
    """What every task of one run needs; pickled into the job."""

    source: object
    fn: object
    state_root: str
    store_name: str
    key_dtype: np.dtype
    value_dtype: np.dtype
    conf: StateStoreConf
    arrow_schema: object  # pyarrow.Schema of the output, or None
    sink_path: str  # or None
    sink_storage_options: dict
    run_id: uuid.UUID
    coordinator_id: str
    address: tuple  # the driver's RpcEnv: the EpochCoordinator and the StateStoreCoordinator
    authkey: bytes
    start_epoch: int
    start_offsets: list
    start_commit_ids: tuple  # per partition, the attempt of version start_epoch - 1 to open; or None
    poll_interval_s: float


def _unload_other_runs(provider_id):
    """Earlier runs' instances of this store in this worker hold versions of an abandoned
    lineage in memory: drop them (this run loads from files)."""
    for other in registry.loaded_provider_ids():
        if other != provider_id and other.store_id == provider_id.store_id:
            registry.unload(other)


class _PartitionTask:
    """The body of partition ``p``'s long-running task (see the module docstring)."""

    def __init__(self, spec, partition_id):
        self.spec, self.partition_id = spec, partition_id
        self.epochs = EpochCoordinatorRef.connect(spec.address, spec.coordinator_id, spec.authkey)
        executor.ensure_worker_registry(spec.address, spec.authkey)
        self.provider_id = StateStoreProviderId(
            StateStoreId(spec.state_root, OPERATOR_ID, partition_id, spec.store_name), spec.run_id)
        _unload_other_runs(self.provider_id)
        self.sink = None if spec.sink_path is None else EpochSink(spec.sink_path, spec.sink_storage_options)
        self.rows_in = self.epochs_closed = 0

    def _open(self, version, commit_id):
        store, _ = executor.open_store(self.provider_id, self.spec.key_dtype, self.spec.value_dtype, version,
                                       self.spec.conf, commit_id=commit_id)
        return store

    def run(self):
        spec, p, fn = self.spec, self.partition_id, self.spec.fn
        reader = spec.source.reader(p, spec.start_offsets[p])
        epoch = spec.start_epoch
        store = None
        try:
            store = self._open(epoch - 1, None if spec.start_commit_ids is None else spec.start_commit_ids[p])
            outputs, rows, fn_s = [], 0, 0.0
            next_poll = 0.0
            while True:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + spec.poll_interval_s
                    try:
                        current = self.epochs.get_current_epoch()
                    except RpcError as e:  # unregistered at stop/restart, or the driver is gone
                        return {"partition": p, "ended": f"epoch coordinator gone: {e}", "epoch": epoch,
                                "rows_in": self.rows_in, "epochs_closed": self.epochs_closed}
                    while epoch < current:
                        self._close_epoch(store, epoch, reader.offset(), outputs, rows, fn_s)
                        epoch += 1
                        store = self._open(epoch - 1, store.commit_id)  # the attempt just committed
                        outputs, rows, fn_s = [], 0, 0.0
                batch = reader.next_batch()
                if batch is None:
                    time.sleep(max(0.0, next_poll - time.monotonic()))
                    continue
                started = time.perf_counter()
                rows += batch.num_rows
                out = fn(store, batch)
                if out is not None:
                    outputs += conform_output(out, spec.arrow_schema, "fn")
                fn_s += time.perf_counter() - started
        finally:
            reader.close()
            if store is not None and not store.has_committed:
                store.abort()

    def _close_epoch(self, store, epoch, offset, outputs, rows, fn_s):
        spec, p = self.spec, self.partition_id
        started = time.perf_counter()
        finish = getattr(spec.fn, "finish", None)
        if callable(finish):
            out = finish(store)
            if out is not None:
                outputs = outputs + conform_output(out, spec.arrow_schema, "fn.finish")
        if self.sink is not None:
            message = self.sink.write(epoch, p, outputs, spec.arrow_schema)
        elif outputs:
            raise ValueError("fn returned rows, but the query has no output_schema")
        else:
            message = {"file": None, "rows": 0}
        version = store.commit()
        if version != epoch:
            raise RuntimeError(f"partition {p}: the store committed version {version} at the end of epoch {epoch}")
        message.update(rows_in=rows, fn_s=fn_s, close_s=time.perf_counter() - started, commit_id=store.commit_id)
        self.epochs.report_partition_offset(p, epoch, offset)
        self.epochs.commit_partition_epoch(p, epoch, message)
        self.rows_in += rows
        self.epochs_closed += 1


def _task_function(spec):
    def run(partition_id, iterator):
        from pyspark import TaskContext

        for _ in iterator:  # one element; read to the end so that PySpark can reuse the worker
            pass
        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx is not None else 0
        if attempt:
            raise ContinuousTaskRetryError(
                f"continuous execution does not support task retry: partition {partition_id} attempt {attempt} "
                f"would restart at epoch {spec.start_epoch} while the other partitions go on (the query fails "
                f"instead; restart it, or set max_restarts)")
        yield _PartitionTask(spec, partition_id).run()
    return run


# -- the driver ------------------------------------------------------------------------------------

class ContinuousQueryException(Exception):
    """Why a continuous query terminated (Spark's ``StreamingQueryException``); the cause is
    ``__cause__``."""


def task_slots(sc):
    """``(slots, cores, task_cpus)``: how many tasks ``sc``'s cluster runs at once (cores of
    the registered executors, the driver's in local mode, divided by ``spark.task.cpus``)."""
    cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    try:
        executors = sc._jsc.sc().statusStore().executorList(True)
        per_executor = [executors.apply(i).totalCores() for i in range(executors.size())]
    except Exception as e:  # py4j internals moved: fall back to Spark's own figure
        log.debug("executor cores unavailable (%s); using defaultParallelism", e)
        per_executor = [sc.defaultParallelism]
    return sum(c // cpus for c in per_executor), sum(per_executor), cpus


class _Run:
    """One run of the query: its run id, coordinator, job group and epoch timer."""

    def __init__(self, run_id, start_epoch, start_offsets, start_commit_ids):
        self.run_id = run_id
        self.coordinator_id = f"{run_id}--{uuid.uuid4()}"
        self.group = f"statecore-continuous-{run_id}"
        self.start_epoch = start_epoch
        self.start_offsets = start_offsets
        self.start_commit_ids = start_commit_ids
        self.epochs = None  # EpochCoordinatorRef
        self.current_epoch = start_epoch
        self.ended_at = {}  # epoch -> monotonic time the driver ended it
        self.offsets = {}  # epoch -> offsets (logged, not yet committed)
        self.messages = {}  # epoch -> the partitions' commit messages (sink committed, query not yet)
        self.timer = None
        self.timer_stop = threading.Event()
        self.halted = False
        self.lock = threading.Lock()


class _Callbacks:
    """The coordinator's ``writer`` and ``query`` for one run (called on its endpoint thread).
    A callback that fails stops the query with its error: the coordinator would otherwise
    wait for ever on an epoch it could not commit."""

    def __init__(self, query, run):
        self.query, self.run = query, run

    def commit(self, epoch, messages):  # writer.commit
        self._guard(self.query._sink_commit, self.run, epoch, messages)

    def add_offset(self, epoch, offsets):
        self._guard(self.query._add_offset, self.run, epoch, offsets)

    def stop_in_new_thread(self, error):
        self.query._fail_in_new_thread(error)

    def _guard(self, method, *args):
        try:
            method(*args)
        except Exception as e:
            self.query._fail_in_new_thread(e)
            raise


class _QueryCallbacks(_Callbacks):
    def commit(self, epoch):  # query.commit
        self._guard(self.query._query_commit, self.run, epoch)


class ContinuousQuery:
    """A continuous query (use :func:`start_continuous`, whose parameters it takes).

    Attributes
    ----------
    id : str
        The query's id, kept in its checkpoint across runs.
    checkpoint_location, state_root, sink_path : str
        ``state_root`` is ``<checkpoint>/state``: read the state with
        ``read_state(spark, q.state_root, 0, version=q.last_committed_epoch,
        commit_ids=q.committed_commit_ids)``.
    sink : EpochSink or None
    """

    def __init__(self, spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema=None,
                 sink_path=None, epoch_interval_ms=1000, conf=None, max_restarts=0, *, store_name="default",
                 poll_interval_ms=5, epoch_backlog_queue_size=10000, logs_to_retain=100, name=None):
        from pyspark.sql.types import StructType

        if not isinstance(source, ContinuousSource) and not all(
                hasattr(source, a) for a in ("num_partitions", "initial_offset", "reader")):
            raise TypeError(f"source must implement ContinuousSource (num_partitions, initial_offset, reader), got "
                            f"{type(source).__name__}")
        self.num_partitions = _check_positive_int("source.num_partitions", source.num_partitions)
        if not callable(fn):
            raise TypeError(f"fn must be callable (store, pyarrow.RecordBatch) -> RecordBatch | None, got "
                            f"{type(fn).__name__}")
        if not isinstance(checkpoint_location, str) or not checkpoint_location:
            raise ValueError(f"checkpoint_location must be a non-empty str, got {checkpoint_location!r}")
        self.epoch_interval_s = _check_positive_int("epoch_interval_ms", epoch_interval_ms) / 1e3
        self.poll_interval_s = _check_positive_int("poll_interval_ms", poll_interval_ms) / 1e3
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.epoch_backlog_queue_size = _check_positive_int("epoch_backlog_queue_size", epoch_backlog_queue_size)
        self.logs_to_retain = _check_positive_int("logs_to_retain", logs_to_retain)
        if conf is None:
            conf = StateStoreConf()
        elif not isinstance(conf, StateStoreConf):
            conf = StateStoreConf.from_spark_conf(conf)
        self.conf = conf
        self.key_schema, self.value_schema = key_value_schemas(key_schema, value_schema)
        if isinstance(output_schema, str):
            output_schema = StructType.fromDDL(output_schema)
        if output_schema is not None and not isinstance(output_schema, StructType):
            raise TypeError(f"output_schema must be a StructType, a DDL string or None, got "
                            f"{type(output_schema).__name__}")
        self.output_schema = output_schema
        if output_schema is None:
            self._arrow_schema = None
        else:
            from pyspark.sql.pandas.types import to_arrow_schema
            self._arrow_schema = to_arrow_schema(output_schema, timezone="UTC")
        self.spark, self.source, self.fn, self.store_name = spark, source, fn, store_name
        self.checkpoint_location = checkpoint_location.rstrip("/")
        self.state_root = f"{self.checkpoint_location}/{STATE_DIR}"
        if sink_path is None and output_schema is not None:
            sink_path = f"{self.checkpoint_location}/output"
        self.sink_path = sink_path
        self.sink = None if sink_path is None else EpochSink(sink_path, conf.storage_options)
        self.offsets_log = EpochLog(f"{self.checkpoint_location}/{OFFSETS_DIR}", conf.storage_options)
        self.commits_log = EpochLog(f"{self.checkpoint_location}/{COMMITS_DIR}", conf.storage_options)
        self.name = name or self.checkpoint_location
        self.id = None
        self._lock = threading.RLock()  # re-entrant: wait_for's predicate reads properties under it
        self._changed = threading.Condition(self._lock)
        self._run = None
        self._thread = None
        self._stopping = False
        self._failure = None  # a terminal error (backlog, callback): no restart
        self._exception = None
        self._terminated = threading.Event()
        self._restarts = 0
        self._last_committed = None
        self._committed_offsets = None
        self._committed_ids = None
        self._epochs = collections.deque(maxlen=10000)  # per committed epoch: latency, rows

    # -- starting ----------------------------------------------------------------------------------

    def _check_slots(self):
        slots, cores, cpus = task_slots(self.spark.sparkContext)
        if slots < self.num_partitions:
            raise ValueError(
                f"continuous query {self.name}: the source has {self.num_partitions} partitions, and continuous "
                f"execution runs one long-running task per partition, all at once; this cluster runs only {slots} "
                f"task(s) at once ({cores} cores, spark.task.cpus={cpus}). Use a source with at most {slots} "
                f"partitions, or give the application more cores")

    def _check_metadata(self):
        files = open_store_files(self.checkpoint_location, self.conf.storage_options)
        ours = {"format": _FORMAT, "id": str(uuid.uuid4()), "num_partitions": self.num_partitions,
                "store_name": self.store_name, "key_schema": self.key_schema.describe(),
                "value_schema": self.value_schema.describe(), "source": self.source.describe()}
        payload = json.dumps(ours, indent=1, default=str).encode()
        try:
            files.write_atomic(METADATA_FILE, lambda f: f.write(payload), overwrite=False)
            recorded = ours
        except FileExistsError:
            where = files.path(METADATA_FILE)
            try:
                recorded = json.loads(files.read_bytes(METADATA_FILE))
            except ValueError as e:
                raise ValueError(f"unreadable continuous query metadata {where}: {e}") from None
            if recorded.get("format") != _FORMAT:
                raise ValueError(f"{where} is not the metadata of a statecore continuous query "
                                 f"(format {recorded.get('format')!r})")
            if recorded.get("num_partitions") != self.num_partitions:
                raise ValueError(f"the checkpoint {self.checkpoint_location} was written with a source of "
                                 f"{recorded.get('num_partitions')} partitions, this one has {self.num_partitions}: "
                                 f"the partitions are fixed for the life of a checkpoint (each keeps its own state "
                                 f"and offsets) ({where})")
            if recorded.get("store_name") != self.store_name:
                raise ValueError(f"the checkpoint {self.checkpoint_location} uses store name "
                                 f"{recorded.get('store_name')!r}, not {self.store_name!r} ({where})")
            for part in ("key_schema", "value_schema"):
                if [list(f) for f in recorded.get(part, [])] != [list(f) for f in ours[part]]:
                    raise SchemaMismatchError(f"the {part.replace('_', ' ')} {ours[part]} differs from the one the "
                                              f"checkpoint was written with: {recorded.get(part)} ({where})")
        self.id = recorded["id"]

    def start(self):
        """Check the cluster and the checkpoint, then start the query thread. Raises at once
        (nothing started) if there are too few task slots or the checkpoint does not match."""
        from pyspark import InheritableThread

        if self._thread is not None:
            raise RuntimeError(f"continuous query {self.name} was already started")
        self._check_slots()
        self._check_metadata()
        committed = self.commits_log.latest() or 0
        self._last_committed = committed
        self._committed_offsets = (self.offsets_log.read(committed)["offsets"] if committed else
                                   [self.source.initial_offset(p) for p in range(self.num_partitions)])
        self._committed_ids = self._recorded_ids(committed)
        # fn, the source and what the source holds (a rows function, say) may come from a
        # module the workers cannot import (a test, a notebook helper): ship those by value.
        for value in (self.fn, self.source, *vars(self.source).values()):
            ship_function_module(value)
        from pyspark_glue import driver
        self._env = driver.rpc_env_for(self.spark)
        self._thread = InheritableThread(target=self._main, name=f"statecore-continuous-{self.id}", daemon=True)
        self._thread.start()
        return self

    # -- the query thread ----------------------------------------------------------------------------

    def _main(self):
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                run = self._begin_run()
                with self._lock:
                    self._run = run  # from now on stop() and failures halt it
                    go = not self._stopping and self._failure is None
                error = self._execute(run) if go else None
                self._halt(run)
                self._wait_for_tasks(run)
                self._deactivate(run)
                with self._lock:
                    stopping, failure = self._stopping, self._failure
                if failure is not None:
                    raise failure
                if stopping:
                    return
                if error is None:
                    error = RuntimeError("every partition task ended while the query was running (see the "
                                         "executor logs: the epoch coordinator was unreachable)")
                if self._restarts >= self.max_restarts:
                    raise error
                self._restarts += 1
                log.warning("continuous query %s: run %s failed (%s: %s); restart %d of %d from the checkpoint",
                            self.name, run.run_id, type(error).__name__, str(error)[:500], self._restarts,
                            self.max_restarts)
        except BaseException as e:
            self._exception = ContinuousQueryException(
                f"continuous query {self.name} (id {self.id}) terminated with exception: {type(e).__name__}: {e}")
            self._exception.__cause__ = e
            log.error("%s", self._exception)
        finally:
            with self._changed:
                self._terminated.set()
                self._changed.notify_all()

    def _recorded_ids(self, epoch):
        """Per partition, the commit id of version ``epoch`` that ``commits/<epoch>`` recorded
        (version 0: the empty state's); None if the entry has none (written before ids were)."""
        if epoch == 0:
            return (ROOT_COMMIT_ID.hex(),) * self.num_partitions
        ids = self.commits_log.read(epoch).get("commit_ids")
        if ids is None:
            return None
        return checked_commit_ids(ids, self.num_partitions, self.commits_log.path(epoch))

    def _begin_run(self):
        """Read the checkpoint, clear what uncommitted epochs left, start a coordinator."""
        self._check_slots()  # executors may have gone since the last run
        committed = self.commits_log.latest() or 0
        if committed:
            offsets = self.offsets_log.read(committed)["offsets"]
            if len(offsets) != self.num_partitions:
                raise ValueError(f"offsets log entry {self.offsets_log.files.path(str(committed))} has "
                                 f"{len(offsets)} offsets for {self.num_partitions} partitions")
        else:
            offsets = [self.source.initial_offset(p) for p in range(self.num_partitions)]
        commit_ids = self._recorded_ids(committed)
        self.offsets_log.delete_after(committed)
        self.offsets_log.delete_before(committed - self.logs_to_retain + 1)
        self.commits_log.delete_before(committed - self.logs_to_retain + 1)
        if self.sink is not None:
            self.sink.discard_after(committed)
        run = _Run(uuid.uuid4(), committed + 1, offsets, commit_ids)
        with self._lock:
            self._last_committed, self._committed_offsets, self._committed_ids = committed, offsets, commit_ids
        run.epochs = EpochCoordinatorRef.create(_Callbacks(self, run), _QueryCallbacks(self, run),
                                                run.coordinator_id, run.start_epoch, self._env,
                                                self.epoch_backlog_queue_size)
        run.epochs.set_reader_partitions(self.num_partitions)
        run.epochs.set_writer_partitions(self.num_partitions)
        log.info("continuous query %s: run %s starts at epoch %d", self.name, run.run_id, run.start_epoch)
        return run

    def _execute(self, run):
        """Run the job of long-running tasks; returns its error, or None if the tasks ended."""
        spec = _TaskSpec(
            source=self.source, fn=self.fn, state_root=self.state_root, store_name=self.store_name,
            key_dtype=self.key_schema.dtype, value_dtype=self.value_schema.dtype, conf=self.conf,
            arrow_schema=self._arrow_schema, sink_path=self.sink_path, sink_storage_options=self.conf.storage_options,
            run_id=run.run_id, coordinator_id=run.coordinator_id, address=tuple(self._env.address),
            authkey=self._env.authkey, start_epoch=run.start_epoch, start_offsets=run.start_offsets,
            start_commit_ids=run.start_commit_ids, poll_interval_s=self.poll_interval_s)
        sc = self.spark.sparkContext
        sc.setJobGroup(run.group, f"statecore continuous query {self.name} run {run.run_id}", interruptOnCancel=True)
        run.timer = threading.Thread(target=self._advance_epochs, args=(run,), daemon=True,
                                     name=f"statecore-epoch-timer-{run.run_id}")
        run.timer.start()
        try:
            statuses = (sc.parallelize(range(self.num_partitions), self.num_partitions)
                        .mapPartitionsWithIndex(_task_function(spec)).collect())
        except Exception as e:
            with self._lock:
                if self._stopping or self._failure is not None:
                    return None  # the job was cancelled on purpose
            return e
        log.info("continuous query %s: run %s tasks ended: %s", self.name, run.run_id, statuses)
        return None

    def _advance_epochs(self, run):
        """Spark's epoch update thread: ``increment_and_get_epoch`` at a fixed rate."""
        next_at = time.monotonic() + self.epoch_interval_s
        while not run.timer_stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.epoch_interval_s
            ending = run.current_epoch
            run.ended_at[ending] = time.monotonic()
            try:
                run.current_epoch = run.epochs.increment_and_get_epoch()
            except RpcError as e:
                if not run.timer_stop.is_set():
                    log.warning("continuous query %s: cannot advance the epoch: %s", self.name, e)
                return
            now = time.monotonic()
            if now > next_at:  # fell behind (a long pause): skip the missed ticks, as Spark's trigger does
                next_at = now + self.epoch_interval_s

    def _halt(self, run):
        """Stop writes, the timer and the coordinator of ``run`` (idempotent): every task's
        next poll then fails, and the task ends."""
        with run.lock:
            if run.halted:
                return
            run.halted = True
        try:
            run.epochs.stop_continuous_execution_writes()
        except RpcError as e:
            log.warning("continuous query %s: stop_continuous_execution_writes failed: %s", self.name, e)
        run.timer_stop.set()
        if run.timer is not None and run.timer is not threading.current_thread():
            run.timer.join()
        try:
            run.epochs.stop()
        except RpcError as e:
            log.debug("stopping the epoch coordinator: %s", e)

    def _wait_for_tasks(self, run, timeout_s=60.0):
        """Wait until no task of ``run`` is running (a failed job's other tasks are killed, but
        Python may still be running them): a new run must never share a partition's files
        with a task of the old one. Cancels the job group if the tasks do not end."""
        sc = self.spark.sparkContext
        tracker = sc.statusTracker()
        deadline = time.monotonic() + timeout_s
        cancelled = False
        while True:
            active = 0
            for job_id in tracker.getJobIdsForGroup(run.group):
                job = tracker.getJobInfo(job_id)
                for stage_id in (job.stageIds if job is not None else ()):
                    stage = tracker.getStageInfo(stage_id)
                    active += stage.numActiveTasks if stage is not None else 0
            if not active:
                return
            now = time.monotonic()
            if not cancelled and now > deadline - timeout_s / 2:
                log.warning("continuous query %s: %d task(s) of run %s still running: cancelling them",
                            self.name, active, run.run_id)
                sc.cancelJobGroup(run.group)
                cancelled = True
            if now > deadline:
                raise RuntimeError(f"{active} task(s) of run {run.run_id} of continuous query {self.name} are still "
                                   f"running {timeout_s:g} s after the run ended")
            time.sleep(0.05)

    def _deactivate(self, run):
        from pyspark_glue import driver
        try:
            driver.deactivate(self.spark, run.run_id)
        except Exception as e:
            log.warning("could not deactivate the state stores of run %s: %s", run.run_id, e)

    def _fail_in_new_thread(self, error):
        """Stop the query with ``error`` (no restart), from a new thread: called on the
        coordinator's thread, which the halt's asks need."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            run = self._run
        if run is not None:
            threading.Thread(target=self._halt, args=(run,), daemon=True,
                             name="statecore-continuous-stop").start()

    # -- the coordinator's callbacks (its endpoint thread) -----------------------------------------

    def _add_offset(self, run, epoch, offsets):
        self.offsets_log.write(epoch, {"epoch": epoch, "offsets": offsets, "run_id": str(run.run_id),
                                       "timestamp_ms": int(time.time() * 1e3)})
        run.offsets[epoch] = offsets

    def _sink_commit(self, run, epoch, messages):
        if self.sink is not None:
            self.sink.commit(epoch, messages)
        run.messages[epoch] = messages

    def _query_commit(self, run, epoch):
        offsets = run.offsets.pop(epoch, None)
        if offsets is None:  # ContinuousExecution.commit asserts the same
            raise RuntimeError(f"epoch {epoch} is committed, but no offsets were logged for it")
        messages = run.messages.pop(epoch, [])
        commit_ids = [m.get("commit_id") for m in messages]
        self.commits_log.write(epoch, {"epoch": epoch, "run_id": str(run.run_id), "commit_ids": commit_ids,
                                       "timestamp_ms": int(time.time() * 1e3)})
        now = time.monotonic()
        ended = run.ended_at.pop(epoch, None)
        old = epoch - self.logs_to_retain
        if old >= 1:
            self.offsets_log.delete([old])
            self.commits_log.delete([old])
        entry = {"epoch": epoch, "run_id": str(run.run_id), "committed_at": now, "ended_at": ended,
                 "latency_s": None if ended is None else now - ended, "offsets": offsets,
                 "rows_in": [m.get("rows_in", 0) for m in messages], "rows_out": [m.get("rows", 0) for m in messages]}
        with self._changed:
            self._last_committed, self._committed_offsets = epoch, offsets
            self._committed_ids = tuple(commit_ids)
            self._epochs.append(entry)
            self._changed.notify_all()

    # -- the handle ---------------------------------------------------------------------------------

    @property
    def is_active(self):
        return self._thread is not None and not self._terminated.is_set()

    @property
    def last_committed_epoch(self):
        """The newest committed epoch (0: none yet); also the state's version."""
        with self._lock:
            return self._last_committed

    @property
    def committed_offsets(self):
        """The offsets of the last committed epoch, per partition."""
        with self._lock:
            return self._committed_offsets

    @property
    def committed_commit_ids(self):
        """Per partition, the commit id of the last committed epoch's store version (what a
        restart opens, and what ``read_state(..., commit_ids=...)`` takes); None for a
        checkpoint whose commits log has no ids."""
        with self._lock:
            return self._committed_ids

    @property
    def progress(self):
        """A snapshot: ids, epochs, offsets, restarts, and the recent committed epochs
        (``recent_epochs``: epoch, run id, latency_s from the driver ending it to its commit,
        offsets, rows_in and rows_out per partition), newest last."""
        with self._lock:
            run = self._run
            epochs = list(self._epochs)
            return {
                "id": self.id, "name": self.name, "run_id": None if run is None else str(run.run_id),
                "current_epoch": None if run is None else run.current_epoch,
                "last_committed_epoch": self._last_committed, "committed_offsets": self._committed_offsets,
                "committed_commit_ids": self._committed_ids,
                "restarts": self._restarts, "active": self.is_active, "recent_epochs": epochs,
            }

    def exception(self):
        """The :class:`ContinuousQueryException` the query terminated with, or None."""
        return self._exception

    def await_termination(self, timeout=None):
        """Wait for the query to terminate; raise its exception if it failed. With a timeout:
        True if it terminated in time, else False (Spark's ``awaitTermination``)."""
        done = self._terminated.wait(timeout)
        if done and self._exception is not None:
            raise self._exception
        return done if timeout is not None else None

    def wait_for(self, predicate, timeout):
        """Wait until ``predicate(self)`` is true, checked now and after every committed
        epoch; True if it became true, False at the timeout or if the query terminated first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if predicate(self):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._terminated.is_set():
                    return predicate(self)
                self._changed.wait(remaining)

    def stop(self, timeout=60.0):
        """Stop the query: ``stop_continuous_execution_writes`` first (nothing commits after
        it), then the timer and the coordinator; the tasks end at their next poll. Returns
        once the query thread ended (cancelling the job if the tasks do not end within
        ``timeout``). Idempotent; does not raise the query's exception."""
        with self._lock:
            self._stopping = True
            run = self._run
        if run is not None:
            self._halt(run)
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive() and run is not None:
            log.warning("continuous query %s: tasks did not end within %g s: cancelling the job", self.name, timeout)
            self.spark.sparkContext.cancelJobGroup(run.group)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"continuous query {self.name} did not stop within {2 * timeout:g} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        return f"ContinuousQuery({self.name!r}, last committed epoch {self._last_committed})"


def start_continuous(spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema=None,
                     sink_path=None, epoch_interval_ms=1000, conf=None, max_restarts=0, **options):
    """Start a continuous query: one long-running Spark task per partition of ``source``,
    each running ``fn(store, batch)`` over its partition with the store of that partition;
    epochs end every ``epoch_interval_ms`` and commit in order (see the module docstring).

    Parameters
    ----------
    spark : SparkSession
    source : ContinuousSource
        :class:`GeneratorSource`, :class:`FileSource`, or your own.
    fn : callable ``(StateStore, pyarrow.RecordBatch) -> RecordBatch | None``
        As in :class:`~pyspark_glue.StatefulOperator`; ``fn.finish(store)``, if present, runs
        at the end of every epoch (:class:`~pyspark_glue.RunningAggregate` then emits each key
        updated in the epoch once).
    checkpoint_location : str
        Holds ``metadata``, ``offsets/``, ``commits/``, ``state/`` (and ``output/`` by
        default); must be reachable from the executors.
    key_schema, value_schema : numpy structured dtypes of the store
    output_schema : StructType or DDL string, optional
        The batches ``fn`` returns; None: no output.
    sink_path : str, optional
        Where the output goes (an :class:`EpochSink`); default ``<checkpoint>/output``.
    epoch_interval_ms : int, default 1000
    conf : StateStoreConf or dict, optional
        Default ``StateStoreConf()``; a dict goes through ``StateStoreConf.from_spark_conf``.
    max_restarts : int, default 0
        How many times a failed run is restarted from the checkpoint before the query stops
        with the error.
    **options
        ``store_name``, ``poll_interval_ms`` (5: how often a task asks for the epoch, at
        most), ``epoch_backlog_queue_size`` (10000), ``logs_to_retain`` (100: entries kept
        in the offsets and commits logs), ``name``.

    Returns
    -------
    ContinuousQuery
        With ``stop()``, ``await_termination(timeout)``, ``exception()``,
        ``last_committed_epoch``, ``committed_offsets``, ``progress``, ``wait_for``.

    Raises
    ------
    ValueError
        The cluster cannot run one task per partition at once, or the checkpoint was written
        with another number of partitions.
    SchemaMismatchError
        The checkpoint was written with other key or value schemas.
    """
    return ContinuousQuery(spark, source, fn, checkpoint_location, key_schema, value_schema, output_schema,
                           sink_path, epoch_interval_ms, conf, max_restarts, **options).start()
