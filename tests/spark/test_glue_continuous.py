"""Continuous execution (pyspark_glue.continuous) on real Spark (local[2]): a running
aggregation over the generator with a forced failure, a manual restart, a stop and a resume,
and an automatic restart, each checked for exactly-once state and output; the refusal when
partitions exceed the cores; and the coordinator's backlog limit stopping the query with Spark's message. The
sources, the sink and the logs without Spark: tests/engine/test_glue_continuous_engine.py."""
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.lineage import parse_name

from pyspark_glue import read_state
from pyspark_glue.continuous import (COMMITS_DIR, OFFSETS_DIR, ContinuousQueryException, EpochLog, EpochSink,
                                     GeneratorSource)
from tests.glue_support import VALUE, store_rows

KEY = np.dtype([("key", "<i8")])
OUTPUT_DDL = "partition int, offset long, key long"
DEADLINE_S = 120  # generous: the machine may be shared with other Spark jobs


class EchoAggregate:
    """A running count and sum of ``value`` per key (the state), echoing each row's partition,
    offset and key as output, so the output of every epoch can be checked row by row.

    With ``marker``: fails once (the first time, in partition 1) as soon as some of
    partition 1's rows are committed (or at its last row), leaving ``marker`` behind."""

    def __init__(self, checkpoint, marker=None, last_offset=None):
        from pyspark_glue import RunningAggregate

        self.agg = RunningAggregate(KEY, "value", emit=False)
        self.checkpoint = checkpoint
        self.marker, self.last_offset = marker, last_offset

    def _rows_committed(self, partition):
        newest = EpochLog(os.path.join(self.checkpoint, COMMITS_DIR)).latest()
        if newest is None:
            return 0
        return EpochLog(os.path.join(self.checkpoint, OFFSETS_DIR)).read(newest)["offsets"][partition]

    def _fail_once(self, batch):
        if self.marker is None or batch.column("partition")[0].as_py() != 1 or os.path.exists(self.marker):
            return
        if self._rows_committed(1) > 0 or batch.column("offset")[-1].as_py() == self.last_offset - 1:
            open(self.marker, "w").close()
            raise RuntimeError("forced failure in partition 1")

    def open(self, context):  # each epoch: the aggregate's handler of the epoch's task
        self.task = self.agg.open(context)

    def __call__(self, store, batch):
        self._fail_once(batch)
        self.task.process(batch)
        return batch.select(["partition", "offset", "key"])


def start(spark, checkpoint, source, fn, **kwargs):
    from pyspark_glue.continuous import start_continuous

    kwargs.setdefault("epoch_interval_ms", 100)
    return start_continuous(spark, source, fn, checkpoint, KEY, VALUE, OUTPUT_DDL, logs_to_retain=100000, **kwargs)


def expected_state(source, offsets):
    """{key: (count, sum)} over rows 0..offsets[p]-1 of every partition, in numpy."""
    out = {}
    for p, end in enumerate(offsets):
        rows = source.rows(p, 0, end)
        keys, inverse = np.unique(rows.column("key").to_numpy(), return_inverse=True)
        counts = np.bincount(inverse, minlength=len(keys))
        sums = np.bincount(inverse, weights=rows.column("value").to_numpy(), minlength=len(keys))
        out.update({int(k): (int(c), int(s)) for k, c, s in zip(keys, counts, sums)})
    return out


def state_from_files(state_root, num_partitions, version, commit_ids=None):
    """The state at ``version``: each partition at ``commit_ids[p]`` (default: the default lineage)."""
    out = {}
    for p in range(num_partitions):
        rows = store_rows(state_root, p, version, KEY, VALUE, None if commit_ids is None else commit_ids[p])
        out.update({k[0]: v for k, v in rows.items()})
    return out


def recorded_ids(checkpoint, epoch):
    """The commit ids the commits log recorded for ``epoch`` (None for epoch 0: the empty state)."""
    return EpochLog(os.path.join(checkpoint, COMMITS_DIR)).read(epoch)["commit_ids"] if epoch else None


JUNK_KEY = 10**9


def plant_default_attempt(tmp_path, state_root, version, parent_id):
    """Another attempt of ``version`` in partition 0, with JUNK_KEY, that the driver never
    recorded: made on a copy of the files of the versions below (opened at the recorded
    ``parent_id``, so it chains onto the live lineage) and moved into the store directory.
    It is the newest file there (the newer files of the uncommitted epoch are removed, as a
    restart would), so the default lineage of ``version`` is now this attempt."""
    live = os.path.join(state_root, "0", "0")
    scratch_root = str(tmp_path / "zombie")
    scratch = os.path.join(scratch_root, "0", "0")
    os.makedirs(scratch)
    for name in os.listdir(live):
        f = parse_name(name)
        if f is not None and f.version > version:
            os.remove(os.path.join(live, name))
        elif (f is None or f.version < version) and not name.startswith("."):
            shutil.copy(os.path.join(live, name), scratch)
    provider = create_and_init_provider(StateStoreId(scratch_root, 0, 0), KEY, VALUE, StateStoreConf())
    store = provider.get_store(version - 1, parent_id)
    store.put((JUNK_KEY,), (1, 1))
    store.commit()
    provider.close()
    (name,) = [n for n in os.listdir(scratch) if getattr(parse_name(n), "version", None) == version]
    shutil.copy(os.path.join(scratch, name), os.path.join(live, f".{name}.tmp"))
    os.replace(os.path.join(live, f".{name}.tmp"), os.path.join(live, name))


def check_exactly_once(query, source):
    """The logs, the sink and the state agree with exactly the rows up to the committed offsets:
    commit epochs contiguous from 1, every committed epoch's output exactly the rows between
    its offsets and the previous epoch's, and the state the aggregate of those rows."""
    checkpoint = query.checkpoint_location
    committed = query.last_committed_epoch
    commits = EpochLog(os.path.join(checkpoint, COMMITS_DIR)).epochs()
    assert commits == list(range(1, committed + 1)), "the commit log must be contiguous from epoch 1"
    offsets_log = EpochLog(os.path.join(checkpoint, OFFSETS_DIR))
    offsets = {0: [source.initial_offset(p) for p in range(source.num_partitions)]}
    offsets.update({e: offsets_log.read(e)["offsets"] for e in commits})
    assert offsets[committed] == query.committed_offsets

    sink = EpochSink(query.sink_path)
    assert sink.committed_epochs() == commits
    table = sink.read()
    if table is None:  # nothing committed has rows
        table = pa.table({"epoch": pa.array([], pa.int64()), "partition": pa.array([], pa.int32()),
                          "offset": pa.array([], pa.int64())})
    epoch, partition, offset = (table.column(c).to_numpy() for c in ("epoch", "partition", "offset"))
    for e in commits:
        for p in range(source.num_partitions):
            mine = offset[(epoch == e) & (partition == p)]
            assert mine.tolist() == list(range(offsets[e - 1][p], offsets[e][p])), f"epoch {e} partition {p}"
    assert len(offset) == sum(offsets[committed])  # nothing else: no duplicate, no stray epoch
    assert query.committed_commit_ids == (tuple(recorded_ids(checkpoint, committed)) if committed
                                          else ("0" * 16,) * source.num_partitions)
    assert state_from_files(query.state_root, source.num_partitions, committed,
                            recorded_ids(checkpoint, committed)) == expected_state(source, offsets[committed])


def as_state(df):
    return {r["key"]: (r["count"], r["sum"]) for r in df.collect()}


def all_rows_committed(rows):
    return lambda q: q.committed_offsets == [rows, rows]


def test_failure_restart_stop_resume_is_exactly_once(spark, tmp_path):
    rows = 20000
    checkpoint, marker = str(tmp_path / "checkpoint"), str(tmp_path / "failed-once")
    source = GeneratorSource(2, rows_per_second=10000, max_offset=rows, batch_rows=500, keys_per_partition=300)

    failing = start(spark, checkpoint, source, EchoAggregate(checkpoint, marker, rows))
    try:
        with pytest.raises(ContinuousQueryException, match="forced failure in partition 1"):
            failing.await_termination(DEADLINE_S)
    finally:
        failing.stop()
    assert os.path.exists(marker) and not failing.is_active
    assert failing.exception() is not None and failing.progress["restarts"] == 0
    check_exactly_once(failing, source)
    first = failing.last_committed_epoch

    resumed = start(spark, checkpoint, source, EchoAggregate(checkpoint))  # a manual restart
    try:
        assert resumed.last_committed_epoch == first
        assert resumed.wait_for(lambda q: q.last_committed_epoch >= first + 3, DEADLINE_S), resumed.exception()
        assert resumed.progress["run_id"] != failing.progress["run_id"]
    finally:
        resumed.stop()
    assert resumed.exception() is None and not resumed.is_active
    assert resumed.last_committed_epoch >= first + 3
    check_exactly_once(resumed, source)

    # An attempt of the last committed epoch that the driver did not record becomes the
    # default lineage: a reader without the ids would see it; the restart must not.
    second = resumed.last_committed_epoch
    plant_default_attempt(tmp_path, resumed.state_root, second, recorded_ids(checkpoint, second - 1)[0])
    assert JUNK_KEY in state_from_files(resumed.state_root, 2, second)
    committed = expected_state(source, resumed.committed_offsets)
    assert state_from_files(resumed.state_root, 2, second, recorded_ids(checkpoint, second)) == committed
    assert as_state(read_state(spark, resumed.state_root, 0, version=second,
                               commit_ids=resumed.committed_commit_ids)) == committed

    final = start(spark, checkpoint, source, EchoAggregate(checkpoint))  # resumes after the stop
    try:
        assert final.wait_for(all_rows_committed(rows), DEADLINE_S), final.exception()
    finally:
        final.stop()
    assert final.exception() is None
    check_exactly_once(final, source)
    last = final.last_committed_epoch
    assert state_from_files(final.state_root, 2, last, recorded_ids(checkpoint, last)) == expected_state(
        source, [rows, rows])


def test_max_restarts_restarts_the_query_from_its_checkpoint(spark, tmp_path):
    rows = 10000
    checkpoint, marker = str(tmp_path / "checkpoint"), str(tmp_path / "failed-once")
    source = GeneratorSource(2, rows_per_second=10000, max_offset=rows, batch_rows=500, keys_per_partition=200)
    query = start(spark, checkpoint, source, EchoAggregate(checkpoint, marker, rows), max_restarts=1)
    try:
        assert query.wait_for(all_rows_committed(rows), DEADLINE_S), query.exception()
        assert os.path.exists(marker) and query.progress["restarts"] == 1 and query.is_active
    finally:
        query.stop()
    assert query.exception() is None
    check_exactly_once(query, source)


def test_refuses_more_partitions_than_task_slots(spark, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match=r"3 partitions.*only 2 task\(s\) at once \(2 cores, spark.task.cpus=1\)"):
        start(spark, checkpoint, GeneratorSource(3), EchoAggregate(checkpoint))
    assert not os.path.exists(checkpoint)  # refused before anything was written


def test_backlog_limit_stops_the_query_with_sparks_message(spark, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    # One (epoch, partition) entry allowed: two partitions reporting one epoch exceed it.
    query = start(spark, checkpoint, GeneratorSource(2, rows_per_second=1000), EchoAggregate(checkpoint),
                  epoch_backlog_queue_size=1)
    try:
        with pytest.raises(ContinuousQueryException,
                           match="Size of the partition (offset|commit) queue has exceeded its maximum"):
            query.await_termination(DEADLINE_S)
    finally:
        query.stop()
    assert not query.is_active
