"""A user's job run by a venv's python without the venv activated (PYSPARK_PYTHON unset, so
Spark's local workers run the ``python3`` on PATH, which has no statecore): the operator's
first batch refuses at once, on the driver, naming what to set, instead of a task failing in
a worker with a traceback. The job is a script of its own, in a fresh process."""
import os
import stat
import subprocess
import sys
import textwrap

import pytest

JOB = textwrap.dedent("""
    import numpy as np
    from pyspark.sql import SparkSession
    from pyspark_glue import RunningAggregate, StatefulOperator
    from pyspark_glue.local_workers import WorkerPythonError

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    key = np.dtype([("k", "<i8")])
    agg = RunningAggregate(key, "v")
    op = StatefulOperator({state!r}, 0, 1, ["k"], key, agg.value_schema, agg, agg.output_schema)
    try:
        op.process(spark.createDataFrame([(1, 2)], "k long, v long"), 0)
    except WorkerPythonError as e:
        print("REFUSED:", e)
    spark.stop()
""")


@pytest.mark.spark
def test_a_job_whose_local_workers_would_run_another_python_is_refused_naming_pyspark_python(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # another interpreter: this one without its site-packages
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(python3.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "job.py"
    script.write_text(JOB.format(state=str(tmp_path / "state")))
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert refused, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"PYSPARK_PYTHON={sys.executable}" in refused[0] and "python3 on PATH" in refused[0]
    assert not (tmp_path / "state").exists()  # refused before anything was written
