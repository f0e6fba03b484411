"""A StatefulOperator whose checkpoint is in a bucket of the local S3 server, its storage options
given in its conf (nothing in the environment): the output ``process`` returns, and
``output(batch_id)``, are read back from the bucket by Python tasks
(``pyspark_glue/output_files.py``), since Spark has no filesystem for ``s3://``; under a classic
session and a Spark Connect client alike (``any_spark``)."""
import s3fs

from statecore.conf import StateStoreConf
from tests.glue_support import INPUT_DDL, events, expected_state, make_operator


def as_state(rows):
    return {(r["user"], bytes(r["region"])): (r["count"], r["sum"]) for r in rows}


def test_an_operator_with_its_checkpoint_in_a_bucket_returns_each_batchs_output(any_spark, s3_bucket):
    url, options = s3_bucket
    tables = [events(70 + i, 300) for i in range(2)]
    op = make_operator(f"{url}/state", num_partitions=2, conf=StateStoreConf(storage_options=options))
    try:
        op.process(any_spark.createDataFrame(tables[0].to_pandas(), INPUT_DDL), 0)
        out = op.process(any_spark.createDataFrame(tables[1].to_pandas(), INPUT_DDL), 1)
        first, second = out.collect(), out.collect()  # two actions, the same rows
        earlier = op.output(0).collect()
    finally:
        op.close()
    after_both, after_first = expected_state(tables), expected_state(tables[:1])
    updated = set(expected_state(tables[1:]))
    assert len(first) == len(updated) and as_state(first) == {k: after_both[k] for k in updated}
    assert sorted(map(tuple, second)) == sorted(map(tuple, first))
    assert len(earlier) == len(after_first) and as_state(earlier) == after_first
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/state/0/_output/1")) == \
        ["part-00000.parquet", "part-00001.parquet"]
