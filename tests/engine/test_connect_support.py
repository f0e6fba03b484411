"""The suite's Connect server support (pyspark_glue/connect_server.py) without a JVM: a stand-in
``spark-submit`` (a shell script in a fake SPARK_HOME) that logs what a real server logs, or
fails. The real server: tests/spark/test_connect.py."""
import os

import pytest

from pyspark_glue import connect_server as connect_support
from pyspark_glue.connect_server import start_connect_server

STARTED_LINE = "26/11/29 05:36:12 INFO SparkConnectServer: Spark Connect server started at: 127.0.0.1:45619"


@pytest.fixture
def fake_submit(tmp_path, monkeypatch):
    """Makes ``spark-submit`` the shell script given; returns the directory for the log."""
    home = tmp_path / "spark"
    (home / "bin").mkdir(parents=True)
    monkeypatch.setattr(connect_support, "spark_home", lambda: str(home))
    logs = tmp_path / "logs"
    logs.mkdir()

    def write(script):
        submit = home / "bin" / "spark-submit"
        submit.write_text("#!/bin/sh\n" + script)
        submit.chmod(0o755)
        return str(logs)

    return write


def test_the_port_comes_from_the_log_and_stop_ends_the_server_and_what_it_started(fake_submit):
    """The server binds port 0 and names its port in its log; stop() ends it and its worker."""
    logs = fake_submit('echo "$@" > arguments\nsleep 300 &\necho $! > worker.pid\n'
                       f'echo "{STARTED_LINE}"\nwait\n')
    server = start_connect_server({"spark.ui.enabled": "false"}, dict(os.environ), logs)
    with open(os.path.join(logs, "worker.pid")) as f:
        worker = int(f.read())
    try:
        assert (server.port, server.url) == (45619, "sc://127.0.0.1:45619")
        with open(os.path.join(logs, "arguments")) as f:
            arguments = f.read().split()
        assert arguments[:4] == ["--class", connect_support.CONNECT_SERVER_CLASS, "--master", "local[2]"]
        for setting in ("spark.ui.enabled=false", "spark.connect.grpc.binding.address=127.0.0.1",
                        "spark.connect.grpc.binding.port=0"):
            assert setting in arguments
        assert connect_support._alive(worker)
    finally:
        server.stop(timeout_s=30)
    assert server.process.returncode is not None and not connect_support._alive(worker)


def test_a_server_that_ends_before_listening_fails_with_its_log(fake_submit):
    logs = fake_submit('echo "java.net.BindException: Address already in use"\nexit 3\n')
    with pytest.raises(RuntimeError, match=r"ended \(exit code 3\)(.|\n)*Address already in use"):
        start_connect_server({}, dict(os.environ), logs)


def test_a_server_silent_past_the_deadline_is_stopped_and_fails(fake_submit):
    logs = fake_submit('echo $$ > server.pid\necho "starting"\nexec sleep 300\n')
    with pytest.raises(RuntimeError, match=r"did not start within 2 s(.|\n)*starting") as failed:
        start_connect_server({}, dict(os.environ), logs, timeout_s=2)
    assert "connect-server.log" in str(failed.value)
    with open(os.path.join(logs, "server.pid")) as f:
        assert not connect_support._alive(int(f.read()))
