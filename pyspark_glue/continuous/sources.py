"""Continuous mode's sources: the interface (:class:`ContinuousSource`,
:class:`PartitionReader`) and the two that come with it, :class:`GeneratorSource` and
:class:`FileSource`. The rules a source must keep (replayable, JSON offsets, keys in one
partition) are in ``docs/continuous.md`` ("Sources").
"""
import time

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ContinuousSource", "PartitionReader", "GeneratorSource", "FileSource", "positive_int"]


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
    """A replayable, partitioned source (the interface; ``docs/continuous.md``, "Sources").

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


def positive_int(name, value, allow_none=False):
    """``value`` if it is an int >= 1 (or None, with ``allow_none``); ValueError naming it otherwise."""
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
        self.num_partitions = positive_int("num_partitions", num_partitions)
        if rows is not None and not callable(rows):
            raise TypeError(f"rows must be callable (partition, start, stop) -> RecordBatch, got {type(rows).__name__}")
        self._rows = rows
        self.rows_per_second = positive_int("rows_per_second", rows_per_second, allow_none=True)
        if max_offset is not None and (not isinstance(max_offset, int) or max_offset < 0):
            raise ValueError(f"max_offset must be an int >= 0 or None, got {max_offset!r}")
        self.max_offset = max_offset
        self.batch_rows = positive_int("batch_rows", batch_rows)
        self.keys_per_partition = positive_int("keys_per_partition", keys_per_partition)

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
        self.num_partitions = positive_int("num_partitions", num_partitions)
        self.batch_rows = positive_int("batch_rows", batch_rows)
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

