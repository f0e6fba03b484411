"""Continuous mode's output: :class:`EpochSink`, parquet files keyed by epoch and partition,
committed by the driver once per epoch (layout: ``docs/continuous.md``, "Sink layout")."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statecore.arrow_rows import parquet_writer
from statecore.checkpoint import CheckpointFiles, EpochLog

__all__ = ["EpochSink"]

_EPOCH_PREFIX = "epoch="


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
        self.files = CheckpointFiles(self.path, self.storage_options)
        self.commits = EpochLog(f"{self.path}/{self.COMMITS}", self.storage_options)

    @staticmethod
    def file_name(epoch, partition):
        return f"{_EPOCH_PREFIX}{epoch}/part-{partition:05d}.parquet"

    def write(self, epoch, partition, batches, schema):
        """Write (or replace) the output of ``(epoch, partition)``: the task side. Returns the
        partition's commit message (``file``: the name or None, ``rows``)."""
        name = self.file_name(epoch, partition)
        rows = sum(b.num_rows for b in batches)
        if not rows:
            self.files.delete([name])  # a stale file of an abandoned run of this epoch
            return {"file": None, "rows": 0}

        def write(f):
            with parquet_writer(f, schema) as writer:
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

    def _committed_names(self):
        return {e: self.commits.read(e)["files"] for e in self.committed_epochs()}

    def committed_files(self):
        """``{epoch: [file path, ...]}`` of the committed epochs."""
        return {e: [self.files.path(name) for name in names] for e, names in self._committed_names().items()}

    def discard_after(self, epoch):
        """Delete the commits, then the files, of every epoch after ``epoch`` (at a restart
        from ``epoch``)."""
        self.commits.delete_after(epoch)
        self.files.delete_trees(name for e, name in self.files.numbered(_EPOCH_PREFIX).items() if e > epoch)

    def read(self, columns=None):
        """The committed output as one ``pyarrow.Table`` with an ``epoch`` column (int64)
        appended, ordered by epoch then partition; None if no committed epoch has rows."""
        tables = []
        for epoch, names in self._committed_names().items():
            for name in sorted(names):
                with self.files.open_read(name) as f:
                    table = pq.read_table(f, columns=columns)
                tables.append(table.append_column("epoch", pa.array(np.full(table.num_rows, epoch, np.int64))))
        return pa.concat_tables(tables) if tables else None
