"""The processor example (examples/custom_sessions.py) run as a reader would run it, on local
Spark, checking what it says it checks. The engine's example:
tests/engine/test_examples_engine.py."""
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


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
