"""The examples run as a reader would run them, and check what they say they check."""
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


def test_engine_tour_runs_and_agrees_with_itself(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "engine_tour.py"), "--keys", "20000",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "1.delta" in os.listdir(tmp_path) and "1.snapshot" in os.listdir(tmp_path)


@pytest.mark.spark
def test_custom_sessions_match_the_rule_in_plain_python(tmp_path):
    """The processor example: a streaming query on local Spark, checked by the example itself."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_sessions.py"), "--dir",
                          str(tmp_path), "--users", "60", "--batches", "4"], capture_output=True, text=True,
                         timeout=300, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "the sessions match the rule computed in plain Python" in out.stdout
    assert "ended by a checkout" in out.stdout
