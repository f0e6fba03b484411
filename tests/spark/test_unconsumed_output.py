"""A ``foreachBatch`` function that does not consume the operator's output (Spark 4.1's
SPARK-52008: on a stateful plan of Spark's own, ``show()``, ``limit()`` or ``take()`` left stores
uncommitted): ``StatefulOperator.process`` runs the batch's job whole and materializes the output
before it returns, so what the function does with the output afterwards cannot leave half a
version. Each case runs a streaming query of three batches, with a failure or a re-run where it
has one, and checks the state (read_state) against ``groupBy().agg()`` over the input and each
batch's output against a clean run's.

Each test runs under both kinds of session (``any_spark``: classic, then a Spark Connect client
of the suite's local server) against one clean run on the classic session, and reports from
the batch function through files, not the test's memory: under Spark Connect that function runs
in the server's Python process."""
import os
import re
import sys
import time

import pytest
from pyspark import cloudpickle

from statecore import operator_files

from pyspark_glue.spark_internals import is_connect

from tests.glue_support import (INPUT_DDL, events, make_operator, spark_group_by, start_query, state_dict,
                                 write_parquet)
from tests.state_files import version_names

pytestmark = pytest.mark.slow  # scheduled first: tests/conftest.py

# The batch functions below close over this module's helpers; under Spark Connect they are
# unpickled in the server's Python worker, which cannot import a test module by the name pytest
# gave it: the module travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCHES = 3
DEADLINE_S = 120  # generous: the machine may be shared with other Spark jobs


def touch(path):
    open(path, "a").close()


def wait_for_file(path, query):
    """Wait until ``path`` exists; AssertionError if the query ends first or the deadline passes."""
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(path):
        assert query.isActive, f"the query ended before {path} appeared: {query.exception()}"
        assert time.monotonic() < deadline, f"{path} did not appear within {DEADLINE_S} s"
        time.sleep(0.05)


class BlockingAggregate:
    """A RunningAggregate whose task of the last partition, while the file ``armed`` exists,
    creates ``started`` and waits for ``released`` before touching its batch: a batch's job held
    running, the other partitions committed, until the test has stopped the query. Defined
    here: the operator ships it to the workers by value."""

    def __init__(self, directory, held_partition):
        from pyspark_glue import RunningAggregate

        from tests.glue_support import KEY

        self.inner = RunningAggregate(KEY, "amount")
        self.held_partition = held_partition
        self.armed, self.started, self.released = (os.path.join(directory, n) for n in ("armed", "started", "released"))

    def open(self, context):
        self.task = self.inner.open(context)
        self.partition = context.partition_id

    def __call__(self, store, batch):
        if self.partition == self.held_partition and os.path.exists(self.armed):
            touch(self.started)
            deadline = time.monotonic() + DEADLINE_S
            while not os.path.exists(self.released) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.task.process(batch)

    def finish(self, store):
        return self.task.finish()


def run_query(spark, source, checkpoint, handle, while_running=None):
    """One run of a streaming query over the files in ``source`` (one per batch) with ``handle``
    as its foreachBatch, until the files present are processed (or, with ``while_running``,
    until ``while_running(query)`` returns); stopped at the end. Returns its exception or None."""
    from pyspark.errors import StreamingQueryException

    query = start_query(spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(source)
                        .writeStream.foreachBatch(handle).option("checkpointLocation", checkpoint))
    try:
        if while_running is None:
            query.processAllAvailable()
        else:
            while_running(query)
        return None
    except StreamingQueryException as e:
        return e
    finally:
        query.stop()


def rows(df):
    return sorted(tuple(bytes(v) if isinstance(v, bytearray) else v for v in r) for r in df.collect())


def outputs(spark, op):
    """Each batch's output as the operator materialized it, read from its files."""
    return [rows(spark.read.parquet(op.output_dir(b))) for b in range(BATCHES)]


def sink_rows(spark, sink):
    return [rows(spark.read.parquet(f"{sink}/batch={b}")) for b in range(BATCHES)]


def operator(root, fn=None):
    return make_operator(root, fn=fn, output_batches_to_retain=BATCHES)


def writing_to(sink, op, fail_once_marker=None):
    """A batch function that writes the operator's output to ``sink``; with ``fail_once_marker``,
    batch 1's first attempt raises after ``process`` returned, as a failing write would."""
    def handle(df, batch_id):
        out = op.process(df, batch_id)
        if batch_id == 1 and fail_once_marker is not None and not os.path.exists(fail_once_marker):
            touch(fail_once_marker)
            raise RuntimeError("the user's sink refused batch 1")
        out.write.mode("overwrite").parquet(f"{sink}/batch={batch_id}")
    return handle


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    source = str(tmp_path_factory.mktemp("unconsumed-input"))
    for b in range(BATCHES):
        write_parquet(source, f"events-{b}.parquet", events(70 + b, 300))
    return source


@pytest.fixture(scope="module")
def clean(spark, inputs, tmp_path_factory):
    """The clean run, whose batch function writes the whole output: each batch's materialized
    output and sink rows, and the state expected after every batch (Spark's groupBy().agg())."""
    base = tmp_path_factory.mktemp("clean-run")
    op = operator(str(base / "state"))
    assert run_query(spark, inputs, str(base / "checkpoint"), writing_to(str(base / "sink"), op)) is None
    op.close()
    expected = spark_group_by([spark.read.schema(INPUT_DDL).parquet(os.path.join(inputs, f"events-{b}.parquet"))
                               for b in range(BATCHES)])
    return {"outputs": outputs(spark, op), "sink": sink_rows(spark, str(base / "sink")), "state": expected}


def check_against_clean(spark, op, clean):
    from pyspark_glue import read_state

    assert state_dict(read_state(spark, op.checkpoint_location, 0)) == clean["state"]
    assert outputs(spark, op) == clean["outputs"]


CONSUMERS = {
    "show": lambda out: out.show(),
    "limit_10_collect": lambda out: out.limit(10).collect(),
    "take_1": lambda out: out.take(1),
    "first": lambda out: out.first(),
}


@pytest.mark.parametrize("consume", sorted(CONSUMERS))
def test_a_batch_function_that_reads_part_of_the_output_leaves_whole_versions(any_spark, inputs, clean,
                                                                             tmp_path, consume):
    """The batch function calls ``process`` and then only ``show()``, ``limit(10).collect()``,
    ``take(1)`` or ``first()`` on its output: every batch commits whole, the state equals
    groupBy().agg() and the outputs the clean run's; a restart that re-runs the last batch (Spark
    had not committed it) with the same function leaves the same state and outputs."""
    checkpoint, reports = str(tmp_path / "checkpoint"), tmp_path / "reports"
    reports.mkdir()
    op = operator(str(tmp_path / "state"))
    partial = CONSUMERS[consume]

    def handle(df, batch_id):
        partial(op.process(df, batch_id))
        touch(os.path.join(str(reports), f"{batch_id}-{len(os.listdir(str(reports)))}"))

    assert run_query(any_spark, inputs, checkpoint, handle) is None
    op.close()
    assert sorted(n.split("-")[0] for n in os.listdir(reports)) == ["0", "1", "2"]
    check_against_clean(any_spark, op, clean)

    for name in (str(BATCHES - 1), f".{BATCHES - 1}.crc"):  # Spark's commit of the last batch is lost
        os.remove(os.path.join(checkpoint, "commits", name))
    op = operator(op.checkpoint_location)
    assert run_query(any_spark, inputs, checkpoint, handle) is None
    op.close()
    assert sorted(n.split("-")[0] for n in os.listdir(reports)) == ["0", "1", "2", "2"]  # the last batch re-ran
    check_against_clean(any_spark, op, clean)


def test_a_write_failing_after_process_returned_fails_the_query_and_its_re_run_is_the_clean_run(
        any_spark, inputs, clean, tmp_path):
    """The user's write of batch 1 raises after ``process`` committed the batch: the query fails
    with the user's error; restarted on the same checkpoint, Spark re-runs batch 1 (the operator
    re-executes it from the version before) and goes on: the state, the outputs and the sink equal
    the clean run's."""
    checkpoint, sink, marker = str(tmp_path / "checkpoint"), str(tmp_path / "sink"), str(tmp_path / "failed-once")
    op = operator(str(tmp_path / "state"))
    error = run_query(any_spark, inputs, checkpoint, writing_to(sink, op, marker))
    op.close()
    assert error is not None and "the user's sink refused batch 1" in str(error)
    assert os.path.exists(marker) and not os.path.exists(f"{sink}/batch=1")

    op = operator(op.checkpoint_location)
    assert run_query(any_spark, inputs, checkpoint, writing_to(sink, op, marker)) is None
    op.close()
    check_against_clean(any_spark, op, clean)
    assert sink_rows(any_spark, sink) == clean["sink"]


def test_a_query_stopped_while_a_batch_runs_re_runs_it_on_restart(any_spark, inputs, clean, tmp_path):
    """The query is stopped while batch 1's job runs: its last partition's task is held until
    the stop (the ``started`` file proves the interleaving) after other partitions committed
    version 2, half a version. The job is interrupted, batch 1 raises in the batch function (on
    a classic session; under Connect the server may end the function's process first), and
    neither Spark nor the operator records it; the restarted query re-runs batch 1 and goes on,
    and the state and the outputs equal the clean run's."""
    checkpoint, sink, hold = str(tmp_path / "checkpoint"), str(tmp_path / "sink"), tmp_path / "hold"
    hold.mkdir()
    partitions = 4  # make_operator's
    fn = BlockingAggregate(str(hold), held_partition=partitions - 1)
    root = str(tmp_path / "state")
    errors = str(tmp_path / "errors")
    os.mkdir(errors)

    def holding_batch_1(op):
        """The batch function: arms the hold for batch 1 until released, reports errors in files."""
        write = writing_to(sink, op)

        def handle(df, batch_id):
            if batch_id == 1 and not os.path.exists(fn.released):
                touch(fn.armed)
            try:
                write(df, batch_id)
            except Exception as e:
                with open(os.path.join(errors, str(batch_id)), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
                raise
        return handle

    committed_before_stop = []

    def stop_while_batch_1_runs(query):
        wait_for_file(fn.started, query)
        committed_before_stop.extend(p for p in range(partitions)
                                     if "2.delta" in version_names(os.path.join(root, "0", str(p))))
        query.stop()

    op = operator(root, fn)
    try:
        assert run_query(any_spark, inputs, checkpoint, holding_batch_1(op), stop_while_batch_1_runs) is None
    finally:
        touch(fn.released)  # before disarming: a task still held goes on at once
        if os.path.exists(fn.armed):
            os.remove(fn.armed)
    op.close()
    reported = os.listdir(errors)
    if is_connect(any_spark):
        # The Connect server ends the query's Python worker at the stop: the batch function
        # may be gone before any error reaches it.
        assert reported in ([], ["1"])
    else:  # batch 1 was running, and failed with its job interrupted
        assert reported == ["1"]
        with open(os.path.join(errors, "1")) as f:
            assert re.search(r"InterruptedException|cancelled", f.read()), "the stop did not interrupt batch 1's job"
    assert committed_before_stop and partitions - 1 not in committed_before_stop  # half of version 2
    assert not os.path.exists(os.path.join(checkpoint, "commits", "1"))
    assert operator_files.commit_log(op.operator_dir).epochs() == [0]  # no batch record of batch 1

    op = operator(op.checkpoint_location, fn)
    assert run_query(any_spark, inputs, checkpoint, holding_batch_1(op)) is None
    op.close()
    assert os.listdir(errors) == reported  # the re-run raised nothing
    check_against_clean(any_spark, op, clean)
    assert sink_rows(any_spark, sink) == clean["sink"]
