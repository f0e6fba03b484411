"""The main job with its state on S3: ``python -m pyspark_glue.demo --checkpoint s3://bucket/state``
against the local S3 server (moto's, ``tests/conftest.py``), as an operator with a bucket runs it.

The demo runs in a process of its own (``main`` stops the Spark session it gets, which in this
process could be the run's shared one), with the server's endpoint and credentials in its
environment only (``s3_env``): nothing passes storage options. The state must be in the bucket,
every partition's versions there, and nothing under the demo's directory but Spark's own
checkpoint, the input and the sink; the state read back from the bucket here, without Spark
(``statecore dump``), must equal a count and sum per key over the input files, and so must the
newest row of each key in the sink, written from the operator's output (read from the bucket by
Python tasks: ``pyspark_glue/output_files.py``)."""
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from statecore.cli import main as statecore_cli
from tests.paths import REPO_ROOT

PARTITIONS = 2
BATCHES = 3


def aggregate_of_input(source):
    """{user_id: (count, sum)} over the demo's input files, with pyarrow."""
    table = pa.concat_tables([pq.read_table(os.path.join(source, n)) for n in sorted(os.listdir(source))])
    grouped = table.group_by("user_id").aggregate([("amount", "count"), ("amount", "sum")])
    return {u: (c, s) for u, c, s in zip(grouped["user_id"].to_pylist(), grouped["amount_count"].to_pylist(),
                                         grouped["amount_sum"].to_pylist())}


@pytest.mark.spark
def test_the_demo_keeps_its_state_in_the_bucket_and_reads_it_back_from_there(s3_env, tmp_path):
    import s3fs

    state_url, work = f"{s3_env}/state", tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    done = subprocess.run([sys.executable, "-m", "pyspark_glue.demo", "--rows", "20000", "--keys", "2000",
                           "--batches", str(BATCHES), "--partitions", str(PARTITIONS), "--dir", str(work),
                           "--checkpoint", state_url],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=900)
    # the first error lines too: the tail of a failed run can be the py4j traceback of reporting it
    first_errors = [line for line in done.stderr.splitlines() if "Error" in line or "Exception" in line][:20]
    assert done.returncode == 0, done.stdout[-3000:] + "\n".join(first_errors) + "\n...\n" + done.stderr[-3000:]
    assert "state equals Spark's groupBy().agg() over the input: yes" in done.stdout, done.stdout[-3000:]

    # Every partition committed every batch into the bucket ...
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    in_bucket = [p[len(state_url) - len("s3://"):] for p in fs.find(state_url)]
    for partition in range(PARTITIONS):
        versions = {int(m.group(1)) for p in in_bucket
                    for m in [re.fullmatch(rf"/0/{partition}/(\d+)_[0-9a-f]{{16}}\.delta", p)] if m}
        assert versions == set(range(1, BATCHES + 1)), (partition, in_bucket)
    # ... and none of statecore's files went to the local disk.
    local = [os.path.relpath(os.path.join(d, n), work) for d, _, names in os.walk(work) for n in names]
    assert not [p for p in local if not p.startswith(("checkpoint/", "input/", "sink/"))], local
    assert not [p for p in local if p.endswith((".delta", ".snapshot"))], local

    # The state read back from the bucket, without Spark, is the input's count and sum per key.
    out = tmp_path / "state.jsonl"
    dumped = CliRunner().invoke(statecore_cli, ["dump", state_url, "--operator", "0", "--format", "jsonl",
                                                "--out", str(out)], catch_exceptions=False)
    assert dumped.exit_code == 0, dumped.output
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    state = {r["user_id"]: (r["count"], r["sum"]) for r in rows}
    assert len(state) == len(rows)
    expected = aggregate_of_input(work / "input")
    assert len(expected) > 1000 and state == expected

    # The sink the demo wrote from the operator's output (read back from the bucket): the newest
    # row of every key is its state.
    sink = pq.read_table(work / "sink").to_pandas()
    sink["batch_id"] = sink["batch_id"].astype(int)
    assert set(sink["batch_id"]) == set(range(BATCHES))
    newest = sink.sort_values("batch_id").groupby("user_id").last()
    assert {u: (int(r["count"]), int(r["sum"])) for u, r in newest.iterrows()} == expected
