"""StatefulOperator under both kinds of session (the ``any_spark`` fixture: classic, then a Spark
Connect client of the suite's local server): a streaming query with a restart, a batch run again,
empty input, a processor's initial state, compared with the state Spark's ``groupBy`` or the classic run gives.
Under Connect the ``foreachBatch`` function runs in the server's Python worker, so what a test
reads of a batch comes from the checkpoint (the operator's batch records, the stores' files),
not from the client's copy of the operator."""
import json
import os

import pyarrow as pa
import pytest

from pyspark_glue import StatefulOperator
from tests.spark.test_event_time import _CountWithInitialState
from tests.glue_support import (INPUT_DDL, events, expected_state, make_operator, store_rows, stream_files,
                                write_parquet)

pytestmark = pytest.mark.slow  # scheduled first: tests/conftest.py

PARTITIONS = 4


def state_at(op, batch_id):
    """{(user, region bytes): (count, sum)} of every partition's store after ``batch_id``, at the
    attempts the batch record names, read from the files."""
    commit_ids = op.commit_record(batch_id)["commit_ids"]
    state = {}
    for p in range(op.num_partitions):
        state.update(store_rows(op.checkpoint_location, p, batch_id + 1, commit_id=commit_ids[p]))
    return state


def run_query(spark, source, checkpoint, op, sink, seen):
    """One start of a streaming query over ``source`` (one file per batch) running ``op``, the
    output of batch b written to ``sink/batch=b``, a file per batch in ``seen`` naming the
    batch's session id (None for a classic session) and process; stopped once the files present
    are processed."""
    def handle(df, batch_id):
        out = op.process(df, batch_id)
        out.write.mode("overwrite").parquet(os.path.join(sink, f"batch={batch_id}"))
        session_id = getattr(df.sparkSession, "session_id", None)
        with open(os.path.join(seen, f"{batch_id}.json"), "w") as f:
            json.dump({"session_id": session_id, "pid": os.getpid()}, f)

    stream_files(spark, INPUT_DDL, source, handle, checkpoint)


def read_seen(seen, batch_id):
    with open(os.path.join(seen, f"{batch_id}.json")) as f:
        return json.load(f)


def test_a_query_stopped_and_restarted_keeps_the_state_spark_would(any_spark, tmp_path):
    """The user's streaming job, stopped after two batches and restarted for a third: the state
    equals the events' sums, each run's batches share one run id (a new one at the restart), and
    the sink's newest row of each key is its state."""
    source, sink, seen = str(tmp_path / "in"), str(tmp_path / "sink"), str(tmp_path / "seen")
    checkpoint = str(tmp_path / "checkpoint")
    os.makedirs(seen)
    tables = [events(seed, 300) for seed in range(3)]
    op = make_operator(str(tmp_path / "state"), num_partitions=PARTITIONS)
    for i in range(2):
        write_parquet(source, f"events-{i}.parquet", tables[i])
    run_query(any_spark, source, checkpoint, op, sink, seen)
    write_parquet(source, "events-2.parquet", tables[2])
    run_query(any_spark, source, checkpoint, op, sink, seen)

    runs = [op.commit_record(b)["run_id"] for b in range(3)]
    assert runs[0] == runs[1] != runs[2]
    assert state_at(op, 1) == expected_state(tables[:2])
    assert state_at(op, 2) == expected_state(tables)
    sunk = any_spark.read.parquet(sink).toPandas().sort_values("batch")
    newest = sunk.groupby(["user", "region"]).last()
    assert {(u, bytes(r)): (int(row["count"]), int(row["sum"])) for (u, r), row in newest.iterrows()} == \
        expected_state(tables)


def test_under_connect_a_query_run_is_one_session_id_and_one_worker(connect_spark, tmp_path):
    """What names a query run in a Connect foreachBatch worker (pyspark_glue.query_runs): every
    batch of one start of the query sees the same session id in ``df.sparkSession`` and runs in
    the same worker process; a restart of the query brings a new session id and a new worker."""
    source, sink, seen = str(tmp_path / "in"), str(tmp_path / "sink"), str(tmp_path / "seen")
    checkpoint = str(tmp_path / "checkpoint")
    os.makedirs(seen)
    op = make_operator(str(tmp_path / "state"), num_partitions=2)
    for i in range(2):
        write_parquet(source, f"events-{i}.parquet", events(20 + i, 50))
    run_query(connect_spark, source, checkpoint, op, sink, seen)
    write_parquet(source, "events-2.parquet", events(22, 50))
    run_query(connect_spark, source, checkpoint, op, sink, seen)

    batches = [read_seen(seen, b) for b in range(3)]
    assert batches[0]["session_id"] is not None
    assert batches[0] == batches[1]
    assert batches[2]["session_id"] != batches[0]["session_id"] and batches[2]["pid"] != batches[0]["pid"]
    assert os.getpid() not in {b["pid"] for b in batches}
    assert {op.commit_record(b)["query_id"] for b in range(3)} == {None}  # Connect names no query


def test_a_batch_run_again_and_an_empty_batch_keep_the_state(any_spark, tmp_path):
    """The client calling ``process`` itself: a batch run again after a failure gives the same
    output and state; an empty batch (Spark runs no task for it) still commits every partition;
    a new operator (a restart) re-running the last batch gets a new run id and the same state."""
    tables = [events(40 + i, 200) for i in range(3)]
    dfs = [any_spark.createDataFrame(t.to_pandas(), INPUT_DDL) for t in tables]
    state_root = str(tmp_path / "state")
    op = make_operator(state_root, num_partitions=PARTITIONS)
    op.process(dfs[0], 0)
    first = sorted(op.process(dfs[1], 1).collect())
    again = sorted(op.process(dfs[1], 1).collect())
    assert op.last_progress["re_execution"] and again == first
    assert state_at(op, 1) == expected_state(tables[:2])

    assert op.process(any_spark.createDataFrame([], INPUT_DDL), 2).count() == 0
    assert sorted(p["partition_id"] for p in op.last_progress["partitions"]) == list(range(PARTITIONS))
    assert state_at(op, 2) == expected_state(tables[:2])
    op.process(dfs[2], 3)
    op.close()

    restarted = make_operator(state_root, num_partitions=PARTITIONS)
    restarted.process(dfs[2], 3)
    assert restarted.commit_record(3)["run_id"] != op.commit_record(2)["run_id"]
    assert state_at(restarted, 3) == expected_state(tables)
    restarted.close()


def test_a_processor_s_initial_state_given_as_a_function_reaches_the_batch_function(any_spark, tmp_path):
    """``initial_state`` as a function of the session (what travels to a Connect worker, where a
    DataFrame cannot): batch 0 hands its rows to ``handle_initial_state`` before the input, as
    Spark's ``transformWithState(initialState=...)``; the counts go on from them."""
    source, sink, initial = str(tmp_path / "in"), str(tmp_path / "sink"), str(tmp_path / "initial")
    write_parquet(initial, "initial.parquet", pa.table({"id": pa.array([1, 2, 2, 9], pa.int64()),
                                                         "n": pa.array([10, 20, 5, 1], pa.int64())}))
    batches = [[1, 1, 3], [2, 9, 9, 4]]
    for b, ids in enumerate(batches):
        write_parquet(source, f"ids-{b}.parquet", pa.table({"id": pa.array(ids, pa.int64())}))
    op = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=_CountWithInitialState.make(),
                          initial_state=lambda spark: spark.read.parquet(initial))

    def handle(df, batch_id):
        op.process(df, batch_id).write.mode("overwrite").parquet(os.path.join(sink, f"batch={batch_id}"))

    stream_files(any_spark, "id long", source, handle, str(tmp_path / "checkpoint"))
    out = any_spark.read.parquet(sink).collect()
    got = sorted((r["batch"], r["id"], r["n"]) for r in out)
    assert got == [(0, 1, 12), (0, 3, 1), (1, 2, 26), (1, 4, 1), (1, 9, 3)]


def test_a_dataframe_initial_state_is_refused_when_the_batch_function_is_pickled(connect_spark, tmp_path):
    """Under Connect the client pickles the ``foreachBatch`` function, and the operator in it: an
    ``initial_state`` DataFrame cannot go along, and the error says what to give instead."""
    initial = connect_spark.createDataFrame([(1, 10)], "id long, n long")
    op = StatefulOperator(str(tmp_path / "state"), 0, 2, fn=_CountWithInitialState.make(), initial_state=initial)

    def handle(df, batch_id):
        op.process(df, batch_id)

    with pytest.raises(Exception) as refused:  # PySpark's serialization error, caused by the operator's
        connect_spark.readStream.schema("id long").parquet(str(tmp_path)).writeStream.foreachBatch(handle)
    chain, error = [], refused.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    ours = [e for e in chain if isinstance(e, TypeError) and "initial_state is a DataFrame" in str(e)]
    assert ours and "initial_state=lambda spark: spark.read.parquet(path)" in str(ours[0]), chain
    assert not os.path.exists(tmp_path / "state")


def test_under_connect_a_new_spark_checkpoint_over_the_state_is_refused_until_offset(connect_spark, tmp_path):
    """A user's Connect query over state its old checkpoint left (Spark's batch ids start at 0
    again): no batch function can learn its query there, yet batch 0 must not re-execute the
    recorded batches. The new query fails with the refusal and nothing under the state changes;
    with ``batch_id_offset`` it continues from the state."""
    from pyspark.errors import StreamingQueryException

    from tests.state_files import tree

    state, sink, seen = str(tmp_path / "state"), str(tmp_path / "sink"), str(tmp_path / "seen")
    os.makedirs(seen)
    tables = [events(60 + seed, 200) for seed in range(3)]
    for i in range(2):
        write_parquet(tmp_path / "old-in", f"events-{i}.parquet", tables[i])
    run_query(connect_spark, str(tmp_path / "old-in"), str(tmp_path / "old-checkpoint"),
              make_operator(state, num_partitions=2), sink, seen)
    # The old query's worker ended with its query and left its operator lock (a dead holder,
    # which the next run takes over and, failing, releases): the lock is not state.
    before = {path: stat for path, stat in tree(state).items() if not path.endswith("_lock")}

    write_parquet(tmp_path / "new-in", "events-2.parquet", tables[2])
    with pytest.raises(StreamingQueryException, match=r"holds batches up to 1 .*batch_id_offset=2"):
        run_query(connect_spark, str(tmp_path / "new-in"), str(tmp_path / "new-checkpoint"),
                  make_operator(state, num_partitions=2), sink, seen)
    assert {path: stat for path, stat in tree(state).items() if not path.endswith("_lock")} == before

    op = make_operator(state, num_partitions=2, batch_id_offset=2)
    run_query(connect_spark, str(tmp_path / "new-in"), str(tmp_path / "newer-checkpoint"), op, sink, seen)
    assert state_at(op, 2) == expected_state(tables)
