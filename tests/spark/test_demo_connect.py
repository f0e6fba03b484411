"""The main job through Spark Connect: ``python -m pyspark_glue.demo --connect`` starts a local
Connect server from PySpark's jars, runs the job through it and prints the same check as the
classic run, its per-batch lines from the batch records."""
import os
import re
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT


@pytest.mark.spark
def test_the_demo_under_connect_prints_the_check_and_a_line_per_batch(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    done = subprocess.run([sys.executable, "-m", "pyspark_glue.demo", "--connect", "--rows", "3000", "--keys", "200",
                           "--batches", "3", "--partitions", "2", "--dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Spark Connect server" in done.stdout
    assert "state equals Spark's groupBy().agg() over the input: yes" in done.stdout
    lines = re.findall(r"^batch +(\d+): .*\| +1,000 rows in \| state version (\d+) committed", done.stdout, re.M)
    assert lines == [("0", "1"), ("1", "2"), ("2", "3")], done.stdout
