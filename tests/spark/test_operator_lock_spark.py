"""The operator lock (``statecore/operator_lock.py``) on Spark: ``import-spark`` under a held
lock, and a running query and an offline command excluding each other. The lock between
offline commands and its stale rules: tests/engine/test_operator_lock.py."""
import os

import pytest

from statecore import operator_files
from statecore import operator_lock
from statecore.cli.output import BAD_INPUT
from statecore.operator_lock import LOCK_FILE, OperatorLockedError

from tests.engine.test_operator_lock import cli, lock_path


def test_import_spark_under_a_held_lock_is_refused_and_writes_nothing(spark, tmp_path):
    """``statecore import-spark`` into an operator another command holds: exit code 3 naming the
    holder, nothing but the lock in the target; once released, the import runs."""
    from tests.spark.test_spark_import import batch_table, import_cli, run_aggregation

    checkpoint, _ = run_aggregation(spark, str(tmp_path / "spark"), [batch_table(0), batch_table(1)])
    target = tmp_path / "statecore"
    with operator_lock.held(str(target), 0, "repartition"):
        refused = import_cli(checkpoint, target, "--operator", 0)
        assert refused.exit_code == BAD_INPUT, refused.output
        assert "statecore repartition" in refused.output and f"pid {os.getpid()}" in refused.output, refused.output
        assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["0", "0/_lock"]
    done = import_cli(checkpoint, target, "--operator", 0)
    assert done.exit_code == 0, done.output
    assert "_operator.json" in os.listdir(target / "0") and LOCK_FILE not in os.listdir(target / "0")


def test_a_running_query_and_an_offline_command_exclude_each_other(spark, tmp_path):
    """A repartition while a StatefulOperator runs is refused (exit code 3 naming the query);
    a batch while a repartition holds the lock is refused naming it, and runs once it ends."""
    from pyspark_glue import read_state
    from tests.glue_support import events_df, make_operator, spark_group_by, state_dict

    root = str(tmp_path / "state")
    dfs = [events_df(spark, seed=70 + i, n=200) for i in range(3)]
    running = make_operator(root, num_partitions=3)
    running.process(dfs[0], 0, read_output=False)
    refused = cli("repartition", root, "--operator", "0", "--to", "2")
    assert refused.exit_code == BAD_INPUT, refused.output
    assert "running query" in refused.output and f"pid {os.getpid()}" in refused.output, refused.output
    assert operator_files.read_metadata(operator_files.operator_dir(root, 0))["num_partitions"] == 3
    running.close()

    with operator_lock.held(root, 0, "repartition"):
        restarted = make_operator(root, num_partitions=3)
        with pytest.raises(OperatorLockedError, match=rf"statecore repartition on host .*, pid {os.getpid()}, since"):
            restarted.process(dfs[1], 1, read_output=False)
        assert operator_files.commit_log(operator_files.operator_dir(root, 0)).epochs() == [0]
    with restarted:
        restarted.process(dfs[1], 1, read_output=False)
        restarted.process(dfs[2], 2, read_output=False)
    assert state_dict(read_state(spark, root, 0)) == spark_group_by(dfs)
    assert not os.path.exists(lock_path(root))
