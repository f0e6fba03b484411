"""The paths a Spark Connect session cannot run refuse it at once, with an error that says they
need a classic session and what to use instead: continuous mode, and
``map_partitions_with_state_store`` / ``map_partitions_with_read_state_store`` (the RDD API,
which Connect lacks). Nothing is started or written."""
import os
import uuid

import numpy as np
import pytest

from pyspark_glue.session_kind import ClassicSessionRequired, is_connect

from tests.glue_support import KEY, VALUE

# The refusal's promise: what is missing, and the way on under Connect.
REFUSAL = (r"needs a classic SparkSession .* was given a Spark Connect \w+: Spark Connect has no SparkContext and "
           r"no RDD API\. Under Spark Connect, run the stateful step as a StatefulOperator in a streaming query's "
           r"foreachBatch .* read its state with read_state")


def test_connect_sessions_and_dataframes_are_told_from_classic_ones(spark, connect_spark):
    assert is_connect(connect_spark) and is_connect(connect_spark.range(3))
    assert not is_connect(spark) and not is_connect(spark.range(3)) and not is_connect(None)


def test_a_user_on_connect_starting_a_continuous_query_is_refused_at_once(connect_spark, tmp_path):
    """A managed-Spark user (Connect only) calls ``start_continuous`` with their session: a
    ClassicSessionRequired (a TypeError) naming continuous mode and the way on, before the
    checkpoint is touched or anything starts."""
    from pyspark_glue import RunningAggregate
    from pyspark_glue.continuous import ContinuousQuery, GeneratorSource, start_continuous

    checkpoint = str(tmp_path / "checkpoint")
    aggregate = RunningAggregate(np.dtype([("key", "<i8")]), "value")
    for start in (start_continuous, ContinuousQuery):
        with pytest.raises(ClassicSessionRequired, match="continuous mode .*" + REFUSAL):
            start(connect_spark, GeneratorSource(2, max_offset=10), aggregate, checkpoint, aggregate.key_schema,
                  aggregate.value_schema)
    assert not os.path.exists(checkpoint)


@pytest.mark.parametrize("name", ["map_partitions_with_state_store", "map_partitions_with_read_state_store"])
def test_a_user_on_connect_mapping_partitions_with_state_is_refused_at_once(connect_spark, tmp_path, name):
    """The RDD-level API given what a Connect user has in hand (a Connect DataFrame, or the
    session itself: ``df.rdd`` does not exist there): ClassicSessionRequired naming the
    function and the way on; no store is opened."""
    from pyspark_glue import rdd

    root = str(tmp_path / "state")
    state_info = rdd.StatefulOperatorStateInfo(root, uuid.uuid4(), 0, 0, 4)
    for given in (connect_spark.range(0, 8, 1, 4), connect_spark):
        with pytest.raises(ClassicSessionRequired, match=f"{name} " + REFUSAL):
            getattr(rdd, name)(given, lambda store, rows: iter(()), state_info, KEY, VALUE)
    assert not os.path.exists(root)
