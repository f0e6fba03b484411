"""The main job's ``--checkpoint URL`` refused before Spark starts: an operator who mistypes the
bucket, points the demo at a prefix of an older run, has no s3fs installed, or whose endpoint
does not answer gets one line naming what is wrong (exit status 2, argparse's), and no Spark
session is started nor anything written. And where the demo puts things up to the start of
Spark, with and without ``--checkpoint`` and ``--dir``. The run itself, on S3:
tests/spark/test_demo_on_s3.py."""
import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest

from pyspark_glue import demo
from tests.paths import REPO_ROOT

SMALL = ["--rows", "100", "--keys", "10", "--batches", "1", "--partitions", "1"]


class SparkStarted(Exception):
    """Raised where the demo would start Spark."""


@pytest.fixture
def no_spark(monkeypatch):
    """The demo's Spark start replaced by :class:`SparkStarted`: a refusal must come before it,
    and what the demo did up to it can be checked."""
    def stop(*_args, **_kwargs):
        raise SparkStarted()

    monkeypatch.setattr(demo, "start_spark", stop)
    monkeypatch.setattr(demo, "start_connect", stop)


def until_spark(argv, capsys):
    """``(working directory, state root)`` the demo printed for ``argv``, run up to Spark's start."""
    with pytest.raises(SparkStarted):
        demo.main([*SMALL, *argv])
    out = capsys.readouterr().out
    printed = re.search(r"\((\S+)/input\); statecore's state in (\S+)\n", out)
    assert printed, out
    return printed.group(1), printed.group(2)


def test_a_bucket_given_without_dir_gets_a_temporary_working_directory(s3_env, no_spark, capsys):
    directory, state_root = until_spark(["--checkpoint", f"{s3_env}/state"], capsys)
    assert state_root == f"{s3_env}/state"
    assert os.path.dirname(directory) == tempfile.gettempdir() and not os.path.exists(directory)


def test_a_dir_given_without_checkpoint_holds_the_input_and_the_state(tmp_path, no_spark, capsys):
    directory, state_root = until_spark(["--dir", str(tmp_path / "demo")], capsys)
    assert directory == str(tmp_path / "demo") and state_root == str(tmp_path / "demo" / "state")
    assert sorted(os.listdir(tmp_path / "demo" / "input")) == ["events-00000.parquet"]


def refusal(argv, capsys, tmp_path):
    """The message the demo exits with (status 2) for ``argv``; its working directory stays empty."""
    with pytest.raises(SystemExit) as exited:
        demo.main([*SMALL, "--dir", str(tmp_path / "demo"), *argv])
    assert exited.value.code == 2
    assert not (tmp_path / "demo").exists()
    return capsys.readouterr().err


def test_a_mistyped_bucket_is_named_before_spark_starts(s3_env, no_spark, capsys, tmp_path):
    missing = s3_env + "-mistyped"
    err = refusal(["--checkpoint", f"{missing}/state"], capsys, tmp_path)
    assert f"bucket {missing[len('s3://'):]} does not exist" in err, err


def test_a_prefix_holding_an_older_runs_state_is_refused_and_left_alone(s3_env, no_spark, capsys, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    older = f"{s3_env}/state/0/_operator.json"
    fs.pipe(older, b"{}")
    err = refusal(["--checkpoint", f"{s3_env}/state"], capsys, tmp_path)
    assert f"--checkpoint {s3_env}/state holds 1 entries already" in err, err
    assert fs.cat(older) == b"{}" and fs.find(s3_env) == [older[len("s3://"):]]


@pytest.fixture
def fresh_s3fs():
    """s3fs's instances made anew from the environment in this test, and none of its kept after
    it (s3fs keeps one per set of arguments, with the endpoint it read when made)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_endpoint_that_does_not_answer_is_named(s3_env, no_spark, fresh_s3fs, capsys, tmp_path, monkeypatch):
    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries would only make the test slower
        err = refusal(["--checkpoint", f"{s3_env}/state"], capsys, tmp_path)
    assert f"--checkpoint {s3_env}/state cannot be reached: " in err and "Could not connect" in err, err


def test_s3_without_s3fs_installed_is_named(tmp_path):
    """A driver installed without s3fs: the demo says which package is missing, in a process
    where importing s3fs fails (and where a Spark start would show as exit status 99)."""
    script = ("import sys; sys.modules['s3fs'] = None\n"
              "from pyspark_glue import demo\n"
              "demo.start_spark = demo.start_connect = lambda *a, **k: sys.exit(99)\n"
              "sys.exit(demo.main(sys.argv[1:]))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script, *SMALL, "--dir", str(tmp_path / "demo"),
                           "--checkpoint", "s3://some-bucket/state"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--checkpoint s3://some-bucket/state: the package of its filesystem is not installed" in done.stderr
    assert "s3fs" in done.stderr.splitlines()[-1], done.stderr
    assert not (tmp_path / "demo").exists()
