"""A local Spark Connect server for the suite, started from PySpark's own jars.

``$SPARK_HOME/bin/spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
with SPARK_HOME the pyspark package's directory (pyspark ships the Connect server's jar). The
server binds to 127.0.0.1 on port 0, a free port its gRPC server picks, and names the port in
its log ("Spark Connect server started at: 127.0.0.1:<port>"), so no port is guessed and no
bind can race another process. Its log goes to a file; :meth:`ConnectServer.stop` ends it by
its pid, then the processes it started (its Python workers), each by pid.

A client session (:func:`client_session`) is made with Connect's own builder: PySpark's
generic ``SparkSession.builder.remote(...)`` refuses while a classic SparkContext runs in the
process. PySpark picks the classic or Connect side of ``pyspark.sql.functions`` (and of
``SparkSession.active()``) by one environment variable, ``SPARK_CONNECT_MODE_ENABLED``
(``pyspark.sql.utils.is_remote``): it must be set while Connect DataFrames are used and unset
while classic ones are, which ``tests/conftest.py``'s ``connect_spark`` fixture does per test.
"""
import os
import re
import signal
import subprocess
import time

CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
CONNECT_MODE_VARIABLE = "SPARK_CONNECT_MODE_ENABLED"
_STARTED = re.compile(r"Spark Connect server started at:? *(?:[\w.\-\[\]:]*?):(\d+)\s*$", re.MULTILINE)


def spark_home():
    """The pyspark package's directory: its ``bin/spark-submit`` and ``jars`` are a Spark."""
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def log_tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _children(pid):
    """The pids of ``pid``'s children, from /proc."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return found


def descendants(pid):
    """Every process under ``pid``, children first."""
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ConnectServer:
    """A running Spark Connect server: its ``port``, ``url`` (``sc://127.0.0.1:<port>``), ``log``."""

    def __init__(self, process, port, log):
        self.process, self.port, self.log = process, port, log
        self.url = f"sc://127.0.0.1:{port}"

    def stop(self, timeout_s=60):
        """SIGTERM to the server, then to the processes it started that are left (by pid);
        SIGKILL to whatever has not ended by the deadline."""
        started = descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        left = [pid for pid in started if _alive(pid)]
        for pid in left:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            if _alive(pid):
                _signal(pid, signal.SIGKILL)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_connect_server(conf, env, log_dir, timeout_s=300):
    """Start a Connect server on local[2] with the Spark settings ``conf`` (a dict), the
    environment ``env`` (its Python workers' PYSPARK_PYTHON, PYTHONPATH...), its log in
    ``log_dir``; return a :class:`ConnectServer` once its log says it listens. RuntimeError with
    the log's tail if it ends or says nothing within ``timeout_s``."""
    home = spark_home()
    log = os.path.join(log_dir, "connect-server.log")
    command = [os.path.join(home, "bin", "spark-submit"), "--class", CONNECT_SERVER_CLASS, "--master", "local[2]"]
    settings = {**conf, "spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": "0"}
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    env = {**env, "SPARK_HOME": home}
    env.pop(CONNECT_MODE_VARIABLE, None)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=log_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        with open(log, errors="replace") as f:
            found = _STARTED.search(f.read())
        if found:
            return ConnectServer(process, int(found.group(1)), log)
        ended = process.poll() is not None
        if ended or time.monotonic() > deadline:
            if not ended:
                ConnectServer(process, 0, log).stop()
            what = f"ended (exit code {process.returncode})" if ended else f"did not start within {timeout_s} s"
            raise RuntimeError(f"the Spark Connect server {what}; the end of its log {log}:\n{log_tail(log)}")
        try:
            process.wait(0.2)  # the poll's pace; returns at once if the server ends
        except subprocess.TimeoutExpired:
            pass


def client_session(url):
    """A Spark Connect client session of ``url`` (the same one on later calls)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    return ConnectSession.builder.remote(url).getOrCreate()
