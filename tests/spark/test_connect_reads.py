"""read_state (its rows and its change feed) and repartition_state through a Spark Connect
client, against the classic session's on the same checkpoint: a user on managed Spark (Connect
only) reads and moves the state a query wrote and gets what a classic session gets. Both
sessions live in this process; PySpark's side is switched per call (:func:`on_side`)."""
import shutil

from pyspark_glue.connect_server import CONNECT_MODE_VARIABLE
from tests.glue_support import events_df, make_operator
from tests.spark.test_glue_read import CountThenForget

BATCHES = 5


def on_side(session, monkeypatch):
    """``session``, with PySpark switched to its side (``SPARK_CONNECT_MODE_ENABLED`` set for a
    Connect session, unset for a classic one: ``pyspark_glue/connect_server.py``)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    if isinstance(session, ConnectSession):
        monkeypatch.setenv(CONNECT_MODE_VARIABLE, "1")
    else:
        monkeypatch.delenv(CONNECT_MODE_VARIABLE, raising=False)
    return session


def rows(df):
    """The rows of ``df`` as sorted tuples, binary columns as bytes (a classic session gives
    bytearray, a Connect client bytes)."""
    return sorted(tuple(bytes(v) if isinstance(v, bytearray) else v for v in r) for r in df.collect())


def write_query_state(spark, root, monkeypatch):
    """Operator 0 under ``root`` after a classic query's batches 0..4 on 3 partitions, keys
    updated and removed (batch 2 run twice: the record names the second attempt)."""
    on_side(spark, monkeypatch)
    op = make_operator(root, fn=CountThenForget(), num_partitions=3)
    for b in [0, 1, 2, 2, 3, 4]:
        op.process(events_df(spark, seed=b, n=60, users=12), b)
    op.close()


def test_read_state_and_its_change_feed_through_connect_equal_the_classic_reads(spark, connect_spark, tmp_path,
                                                                               monkeypatch):
    """A checkpoint a classic query wrote, read through a Connect client: every version and the
    change feed (whole, and a range of batch ids) give the classic session's rows, schema
    included."""
    from pyspark_glue import read_state

    root = str(tmp_path / "state")
    write_query_state(spark, root, monkeypatch)
    reads = {"newest": {}, **{f"version {v}": {"version": v} for v in range(1, BATCHES + 1)},
             "feed": {"change_feed": True}, "feed 1..3": {"change_feed": True, "start_batch_id": 1, "end_batch_id": 3}}
    got = {}
    for session in (spark, connect_spark):
        on_side(session, monkeypatch)
        for name, arguments in reads.items():
            df = read_state(session, root, 0, **arguments)
            got[session is connect_spark, name] = (df.schema.simpleString(), rows(df))
    for name in reads:
        assert got[True, name] == got[False, name], name
    feed = got[False, "feed"][1]
    assert {r[1] for r in feed} == {"update", "delete"} and len(got[False, "newest"][1]) > 0
    assert got[False, "newest"] == got[False, f"version {BATCHES}"]


def test_repartition_state_through_connect_leaves_the_classic_job_s_state(spark, connect_spark, tmp_path,
                                                                          monkeypatch):
    """The same checkpoint copied twice, one copy repartitioned from 3 to 5 partitions by the
    classic session, the other through a Connect client: the same summary (rows per store, the
    partitions) and the same state in the same partitions, equal to the state before."""
    from pyspark_glue import read_state, repartition_state

    root = str(tmp_path / "state")
    write_query_state(spark, root, monkeypatch)
    before = rows(read_state(on_side(spark, monkeypatch), root, 0).drop("partition_id"))
    copies = {"classic": str(tmp_path / "classic"), "connect": str(tmp_path / "connect")}
    for path in copies.values():
        shutil.copytree(root, path)
    summaries = {"classic": repartition_state(on_side(spark, monkeypatch), copies["classic"], 0, 5),
                 "connect": repartition_state(on_side(connect_spark, monkeypatch), copies["connect"], 0, 5)}
    for summary in summaries.values():
        assert summary["from_partitions"] == 3 and summary["to_partitions"] == 5
        for store in summary["stores"].values():
            store.pop("commit_ids")  # each run draws its own
        summary.pop("checkpoint")
    assert summaries["connect"] == summaries["classic"]
    on_side(spark, monkeypatch)
    after = {kind: rows(read_state(spark, path, 0)) for kind, path in copies.items()}
    assert after["connect"] == after["classic"]
    assert sorted(r[:-1] for r in after["connect"]) == before
    assert {r[-1] for r in after["connect"]} == set(range(5))
