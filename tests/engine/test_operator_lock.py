"""The operator lock (``statecore/operator_lock.py``): two ``statecore repartition`` runs at
once (one is refused, the state is intact), a killed holder recovered by the next run, two
successors taking over a stale lock at once, the stale rules one by one. ``import-spark``
under a held lock, and a running query and an offline command excluding each other:
tests/spark/test_operator_lock_spark.py."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from statecore import operator_files
from statecore import operator_lock
from statecore import repartition as engine
from statecore.cli import main
from statecore.cli.output import BAD_INPUT
from statecore.files import StoreFiles
from statecore.operator_lock import LOCK_FILE, OperatorLock, OperatorLockedError

from tests.engine.test_repartition import check_routed, make_checkpoint, read_at_record
from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)
DEADLINE_S = 120

# A child process running ``statecore <args>`` that, the first time it renames a new snapshot
# into place (step 3 of repartition, under the lock), either SIGKILLs itself ("kill") or
# creates <sync>/inside-<tag> and waits for <sync>/go ("pause").
CHILD = r'''
import fnmatch, os, signal, sys, time
import statecore.checkpoint, statecore.files, statecore.operator_lock
mode, sync, tag = sys.argv[1], sys.argv[2], sys.argv[3]
hooked = [False]

class Hooked(statecore.files.StoreFiles):
    def _step(self, step, name):
        if hooked[0] or step != "rename" or not fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], "*.snapshot"):
            return
        hooked[0] = True
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        open(os.path.join(sync, "inside-" + tag), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(sync, "go")):
            if time.monotonic() > deadline:
                sys.exit("no go within 120 s")
            time.sleep(0.01)

def opener(location, storage_options=None, local_cache_dir=None):
    return Hooked(location, storage_options, local_cache_dir)

statecore.files.open_store_files = opener
statecore.checkpoint.open_store_files = opener
statecore.operator_lock.open_store_files = opener
from statecore.cli import run
sys.exit(run(sys.argv[4:]))
'''


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def child(mode, sync, tag, *args):
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(sync), tag, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def lock_path(root):
    return os.path.join(operator_files.operator_dir(root, 0), LOCK_FILE)


def write_lock(root, **fields):
    """A lock file as a holder elsewhere left it (``fields`` override the defaults)."""
    now = time.time()
    record = {"format": operator_lock.LOCK_FORMAT, "kind": "offline", "command": "repartition",
              "host": "another-host", "pid": 4242, "pid_start": None, "token": "ab" * 16, "started": now - 20,
              "renewed": now - 10, "expires": now + 600, "lease_s": 600.0, **fields}
    os.makedirs(os.path.dirname(lock_path(root)), exist_ok=True)
    with open(lock_path(root), "w") as f:
        json.dump(record, f)
    return record


def held_token(root):
    with open(lock_path(root)) as f:
        return json.load(f)["token"]


# -- processes racing --------------------------------------------------------------------------------

def test_two_repartition_runs_at_once_one_is_refused_and_the_state_is_intact(tmp_path):
    """Two ``statecore repartition`` runs at once (the issue's data loss): the second starts
    while the first is inside, writing its new partitions; it is refused with exit code 3
    naming the first, writes nothing, and the first's result reads back exactly."""
    root, sync = str(tmp_path / "state"), tmp_path / "sync"
    sync.mkdir()
    expected = make_checkpoint(root, partitions=4, batches=3, seed=5)
    first = child("pause", sync, "first", "repartition", root, "--operator", "0", "--to", "7")
    started = [first]
    try:
        wait_for(lambda: (sync / "inside-first").exists() or first.poll() is not None, "the first run to be inside")
        assert (sync / "inside-first").exists(), first.communicate()
        second = child("pause", sync, "second", "repartition", root, "--operator", "0", "--to", "5")
        started.append(second)
        wait_for(lambda: (sync / "inside-second").exists() or second.poll() is not None, "the second run")
        second_inside, first_still_inside = (sync / "inside-second").exists(), first.poll() is None
        (sync / "go").touch()
        out, err = second.communicate(timeout=DEADLINE_S)
        assert not second_inside, "both runs were inside the rewrite at once"
        assert first_still_inside  # the interleaving: the second ran while the first was paused inside
        assert second.returncode == BAD_INPUT, out + err
        assert "statecore repartition" in err and f"pid {first.pid}" in err and "_lock" in err, err
        assert first.wait(timeout=DEADLINE_S) == 0, first.communicate()
    finally:
        (sync / "go").touch()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    check_routed(read_at_record(root, 7), expected)
    assert sorted(int(n) for n in os.listdir(os.path.join(root, "0")) if n.isdigit()) == list(range(7))
    assert os.listdir(os.path.join(root, "0", engine.JOURNAL_DIR)) == []
    assert not os.path.exists(lock_path(root))


def test_a_killed_holder_is_recovered_by_the_next_run(tmp_path):
    """A repartition killed with SIGKILL while it holds the lock leaves it naming its pid; the
    next run finds that pid gone on this host, takes the lock over and succeeds."""
    root, sync = str(tmp_path / "state"), tmp_path / "sync"
    sync.mkdir()
    expected = make_checkpoint(root, partitions=4, batches=3, seed=6)
    killed = child("kill", sync, "killed", "repartition", root, "--operator", "0", "--to", "7")
    killed.communicate(timeout=DEADLINE_S)
    assert killed.returncode == -9
    with open(lock_path(root)) as f:
        left = json.load(f)
    assert (left["pid"], left["host"], left["command"]) == (killed.pid, socket.gethostname(), "repartition")
    check_routed(read_at_record(root, 4), expected)

    result = cli("repartition", root, "--operator", "0", "--to", "5", "--json")
    assert result.exit_code == 0, result.output
    check_routed(read_at_record(root, 5), expected)
    assert sorted(os.listdir(os.path.join(root, "0"))) == ["0", "1", "2", "3", "4", "_commits", "_operator.json",
                                                           "_repartition"]


# -- taking over a stale lock --------------------------------------------------------------------------

class _PausingFiles(StoreFiles):
    """StoreFiles calling ``hook(step, name)`` before each step (installed by the tests below)."""

    hook = staticmethod(lambda step, name: None)

    def _step(self, step, name):
        type(self).hook(step, name)


def _race(monkeypatch, root, hook):
    """Two successors acquiring at once, each in its thread: ``{name: lock or error}``."""
    monkeypatch.setattr(operator_lock, "open_store_files", lambda loc, opts=None, cache=None: _PausingFiles(loc, opts))
    monkeypatch.setattr(_PausingFiles, "hook", staticmethod(hook))
    outcome = {}

    def run(name):
        try:
            outcome[name] = OperatorLock(root, 0, f"repartition ({name})").acquire()
        except OperatorLockedError as e:
            outcome[name] = e

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    return outcome


def _one_winner(root, outcome):
    won = [name for name, got in outcome.items() if isinstance(got, OperatorLock)]
    assert len(won) == 1, outcome
    winner, loser = outcome[won[0]], outcome[({"a", "b"} - set(won)).pop()]
    assert held_token(root) == winner.token
    assert "_lock" in str(loser) and ("taking over" in str(loser) or "repartition (" in str(loser)), loser
    assert sorted(os.listdir(os.path.dirname(lock_path(root)))) == [LOCK_FILE]  # no claim left behind
    winner.release()
    assert not os.path.exists(lock_path(root))


def test_two_successors_taking_over_a_stale_lock_at_once_exactly_one_wins(tmp_path, monkeypatch):
    """Two runs start after a holder on another host let its lease expire; both found it stale
    and are about to claim it (a barrier as their claims are written forces it): exactly one
    wins."""
    root = str(tmp_path / "state")
    write_lock(root, expires=time.time() - 1)
    barrier = threading.Barrier(2)
    passed = []

    def hook(step, name):
        if step == "flush" and name.startswith(operator_lock.TAKEOVER_PREFIX):
            passed.append(threading.current_thread().name)
            barrier.wait(DEADLINE_S)

    outcome = _race(monkeypatch, root, hook)
    assert sorted(passed) == ["a", "b"] and not barrier.broken
    _one_winner(root, outcome)


def test_a_late_successor_does_not_delete_the_lock_the_first_took_over(tmp_path, monkeypatch):
    """The race a delete-then-create take-over loses: b read the stale lock, then a took it
    over whole before b went on; b must neither delete a's lock nor think it holds it."""
    root = str(tmp_path / "state")
    write_lock(root, expires=time.time() - 1)
    b_read, a_done = threading.Event(), threading.Event()

    def hook(step, name):
        me = threading.current_thread().name
        if me == "a" and step == "read" and name == LOCK_FILE and not a_done.is_set():
            assert b_read.wait(DEADLINE_S)  # a starts once b holds its stale view
        if me == "b" and name.startswith(operator_lock.TAKEOVER_PREFIX) and step == "flush":
            b_read.set()
            assert a_done.wait(DEADLINE_S)  # b writes its claim only after a has finished

    original = OperatorLock.acquire

    def acquire(self):
        try:
            return original(self)
        finally:
            if threading.current_thread().name == "a":
                a_done.set()

    monkeypatch.setattr(OperatorLock, "acquire", acquire)
    outcome = _race(monkeypatch, root, hook)
    assert b_read.is_set() and a_done.is_set()
    assert isinstance(outcome["a"], OperatorLock), outcome
    _one_winner(root, outcome)


# -- the stale rules ---------------------------------------------------------------------------------

def test_a_live_holder_elsewhere_is_refused_by_name_and_its_lease_decides(tmp_path):
    """A holder on another host within its lease: refused, the message names the command, host,
    pid and start time; once its lease expired, the lock is taken over."""
    root = str(tmp_path / "state")
    record = write_lock(root)
    with pytest.raises(OperatorLockedError) as refused:
        OperatorLock(root, 0, "import-spark").acquire()
    message = str(refused.value)
    assert "statecore repartition on host another-host, pid 4242, since" in message and lock_path(root) in message
    assert held_token(root) == record["token"]
    write_lock(root, expires=time.time() - 1)
    lock = OperatorLock(root, 0, "import-spark").acquire()
    assert held_token(root) == lock.token
    lock.release()


def test_a_reused_pid_on_this_host_is_a_dead_holder(tmp_path):
    """A lock naming this host and a pid that now belongs to another process (its start time
    differs from the one recorded) is stale; the same pid with its own start time is alive."""
    root = str(tmp_path / "state")
    pid = os.getpid()
    start = operator_lock._process_start(pid)
    if start is None:
        pytest.fail("this test needs /proc/<pid>/stat")
    write_lock(root, host=socket.gethostname(), pid=pid, pid_start=start)
    with pytest.raises(OperatorLockedError, match=f"pid {pid}"):
        OperatorLock(root, 0, "repartition").acquire()
    write_lock(root, host=socket.gethostname(), pid=pid, pid_start=start - 1)
    lock = OperatorLock(root, 0, "repartition").acquire()
    assert held_token(root) == lock.token
    lock.release()


def test_a_holder_that_lost_its_lock_neither_renews_nor_deletes_the_successors(tmp_path):
    """A holder whose lease ran out (a paused process) and whose lock was taken over: its
    renew says so and its release leaves the successor's lock alone."""
    root = str(tmp_path / "state")
    paused = OperatorLock(root, 0, "repartition", lease_s=0).acquire()
    successor = OperatorLock(root, 0, "repartition").acquire()
    assert not paused.renew()
    paused.release()
    assert held_token(root) == successor.token
    successor.release()
    assert not os.path.exists(lock_path(root))


def test_a_damaged_lock_file_is_refused_until_it_is_older_than_the_lease(tmp_path):
    """A lock file that is not a lock record (a torn copy, an editor's leftover) is nobody's:
    refused while fresh, taken over once it was not written for a lease."""
    root = str(tmp_path / "state")
    write_lock(root)
    for damaged in ("{not json", "[" * 5000 + "]" * 5000):  # torn, or nested past any parser's stack
        with open(lock_path(root), "w") as f:
            f.write(damaged)
        with pytest.raises(OperatorLockedError, match="not a lock record"):
            OperatorLock(root, 0, "repartition").acquire()
    old = time.time() - 2 * operator_lock.LEASE_S
    os.utime(lock_path(root), (old, old))
    lock = OperatorLock(root, 0, "repartition").acquire()
    assert held_token(root) == lock.token
    lock.release()


def test_inspect_and_verify_see_no_store_in_a_held_lock(tmp_path):
    """``statecore inspect`` and ``verify`` of a checkpoint whose operator is locked (a
    repartition running): the lock is neither a store nor a problem."""
    root = str(tmp_path / "state")
    make_checkpoint(root, partitions=3, batches=2, seed=7)
    with operator_lock.held(root, 0, "repartition"):
        verified = cli("verify", root)
        inspected = cli("inspect", root, "--json")
    assert verified.exit_code == 0 and "sound" in verified.output, verified.output
    found = json.loads(inspected.output)
    assert inspected.exit_code == 0 and "_lock" not in inspected.output, inspected.output
    assert [op["operator_id"] for op in found["operators"]] == [0]
