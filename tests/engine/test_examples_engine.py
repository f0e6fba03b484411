"""The examples run as a reader would run them, and check what they say they check (the one
on Spark: tests/spark/test_examples.py)."""
import os
import subprocess
import sys

from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


def test_engine_tour_runs_and_agrees_with_itself(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "engine_tour.py"), "--keys", "20000",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "1.delta" in os.listdir(tmp_path) and "1.snapshot" in os.listdir(tmp_path)
