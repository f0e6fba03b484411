"""The suite's layers (tests/conftest.py): the folder a test is in decides its markers, and a
test in the wrong folder stops the collection with its name. Each case collects a small
tests/ tree made in a temporary directory, with this suite's conftest.py and paths.py, in a
pytest of its own."""
import os
import shutil
import subprocess
import sys

from tests.paths import TESTS_DIR

USES_SPARK = "def test_with_spark(spark):\n    pass\n"
NO_SPARK = "def test_without_spark():\n    pass\n"
OWN_SPARK = "import pytest\n\n\n@pytest.mark.spark\ndef test_own_spark():\n    pass\n"
USES_CONNECT = "def test_with_connect(connect_spark):\n    pass\n"
USAGE_ERROR = 4  # pytest's exit code for a usage error


def write_tests(root, files):
    """``files`` ({path under tests/: text}) beside copies of conftest.py and paths.py in root/tests."""
    tests = root / "tests"
    tests.mkdir(parents=True)
    for name in ("conftest.py", "paths.py"):
        shutil.copy(TESTS_DIR / name, tests / name)
    for path, text in files.items():
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text(text)
    return root


def collect(root, *args):
    """``pytest --collect-only`` of root/tests: its exit code, test ids and output."""
    env = dict(os.environ, PYTHONPATH=str(root))  # tests.paths is the copy: TESTS_DIR is root/tests
    plugins = ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:hypothesispytest"]  # a faster start
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--strict-markers", *plugins,
                           "tests", *args], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    return done.returncode, ids, done.stdout + done.stderr


def test_the_folder_decides_the_markers(tmp_path):
    files = {"engine/test_a.py": NO_SPARK, "spark/test_b.py": USES_SPARK, "spark/test_c.py": OWN_SPARK,
             "cluster/test_d.py": NO_SPARK, "bench/test_e.py": NO_SPARK + "\n\n" + OWN_SPARK,
             "bench/test_f.py": USES_CONNECT}
    root = write_tests(tmp_path, files)
    code, ids, out = collect(root, "-m", "not spark")
    assert code == 0, out
    assert ids == ["tests/bench/test_e.py::test_without_spark", "tests/engine/test_a.py::test_without_spark"]
    code, ids, out = collect(root, "-m", "spark and not cluster and not bench")
    assert code == 0 and ids == ["tests/spark/test_b.py::test_with_spark", "tests/spark/test_c.py::test_own_spark"]
    code, ids, out = collect(root, "-m", "spark and bench")  # a Spark Connect client starts Spark too
    assert code == 0 and ids == ["tests/bench/test_e.py::test_own_spark", "tests/bench/test_f.py::test_with_connect"]
    code, ids, out = collect(root, "-m", "cluster and spark")
    assert code == 0 and ids == ["tests/cluster/test_d.py::test_without_spark"], out
    code, ids, out = collect(root, "-m", "bench")
    assert code == 0 and ids == ["tests/bench/test_e.py::test_without_spark", "tests/bench/test_e.py::test_own_spark",
                                 "tests/bench/test_f.py::test_with_connect"]


def test_tests_in_the_wrong_folder_stop_the_collection_each_by_name(tmp_path):
    """A Spark test added to tests/engine by mistake, a test without Spark in tests/spark, a test
    file left at the top of tests/: one error naming the three, the well-placed tests unnamed."""
    files = {"engine/test_a.py": NO_SPARK, "engine/test_b.py": USES_SPARK + "\n\n" + USES_CONNECT,
             "spark/test_c.py": USES_SPARK + "\n\n" + NO_SPARK + "\n\n" + USES_CONNECT, "test_top.py": NO_SPARK}
    code, _, out = collect(write_tests(tmp_path, files))
    assert code == USAGE_ERROR, out
    problems = out.split("tests in the wrong layer", 1)[1].strip().splitlines()[1:]
    assert sorted(line.strip() for line in problems) == [
        "tests/engine/test_b.py::test_with_connect: it starts Spark (the spark or connect_spark fixture, or "
        "@pytest.mark.spark) but is in tests/engine: move it to tests/spark",
        "tests/engine/test_b.py::test_with_spark: it starts Spark (the spark or connect_spark fixture, or "
        "@pytest.mark.spark) but is in tests/engine: move it to tests/spark",
        "tests/spark/test_c.py::test_without_spark: it is in tests/spark but starts no Spark (no spark or "
        "connect_spark fixture, nor @pytest.mark.spark for a Spark of its own): move it to tests/engine",
        "tests/test_top.py::test_without_spark: its file is not in a layer folder of tests/ "
        "(engine, spark, cluster, bench)"]
