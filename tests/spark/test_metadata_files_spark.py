"""verify and inspect on a checkpoint a StatefulProcessor wrote on Spark (state variables with
TTL, event-time timers): sound, every timer store listed. The same checkpoint written at
engine level, and the metadata files' checks: tests/engine/test_metadata_files.py."""
import json

from tests.engine.test_metadata_files import TIMER_STORES, run, verify_problems


def test_a_stateful_processor_checkpoint_written_on_spark_verifies_sound(spark, tmp_path):
    """The issue's case: the sessions example's processor (state variables with TTL, event-time
    timers) run for two batches by a StatefulOperator; the old verify found 54 problems."""
    import datetime

    from examples.custom_sessions import T0, make_events, processor_class
    from pyspark_glue import StatefulOperator

    state = tmp_path / "state"
    op = StatefulOperator(str(state), 0, 2, fn=processor_class()())
    try:
        for b, batch in enumerate(make_events(20, 2)):
            rows = [(u, T0 + datetime.timedelta(seconds=s), page) for u, s, page in batch]
            op.process(spark.createDataFrame(rows, "user long, ts timestamp, page string"), b, read_output=False)
    finally:
        op.close()
    assert verify_problems(state) == []
    names = {s["store_name"] for s in json.loads(run("inspect", state, "--json").output)["stores"]}
    assert set(TIMER_STORES) <= names
