"""``statecore rewrite`` under a running aggregation (docs/rewrite.md): a StatefulOperator query
runs, stops, its state is rewritten (keys dropped, a value field renamed and made a float), and
the query continues with a fn declaring the new schemas. The engine's tests, kills and refusals:
tests/engine/test_rewrite.py."""
from tests import rewrite_support
from tests.engine.test_rewrite import cli


def test_a_query_continues_from_rewritten_state_with_new_schemas(spark, tmp_path):
    """The issue's case: after the rewrite, every later batch adds to the transformed state, so
    the state equals Spark's groupBy().agg() of the batches before under the transform's rule,
    plus the groupBy().agg() of the batches after."""
    from pyspark_glue import RunningAggregate, StatefulOperator, read_state
    from tests.glue_support import KEY, events_df, make_operator, spark_group_by

    root = str(tmp_path / "state")
    dfs = [events_df(spark, seed=70 + i, n=400, users=60) for i in range(6)]
    with make_operator(root, num_partitions=3) as op:
        for b in range(3):
            op.process(dfs[b], b)

    done = cli("rewrite", root, "--operator", "0", "--transform", "tests.rewrite_support:for_spark_query", "--json")
    assert done.exit_code == 0, done.output

    agg = RunningAggregate(KEY, "amount", count_field="events", sum_field="total", sum_dtype="<f8")
    assert agg.value_schema == rewrite_support.SPARK_VALUE
    with StatefulOperator(root, 0, 3, ["user", "region"], KEY, agg.value_schema, agg, agg.output_schema) as op:
        for b in range(3, 6):
            op.process(dfs[b], b)

    expected = {}
    for key, value in spark_group_by(dfs[:3]).items():
        row = rewrite_support.for_spark_query_rule(key, value)
        if row is not None:
            expected[key] = row[1]
    for key, (count, total) in spark_group_by(dfs[3:]).items():
        before = expected.get(key, (0, 0.0))
        expected[key] = (before[0] + count, before[1] + total)
    got = {(r["user"], bytes(r["region"])): (r["events"], r["total"]) for r in read_state(spark, root, 0).collect()}
    assert got == expected
