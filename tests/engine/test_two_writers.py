"""Two processes commit the same version of the same store at once (a zombie task and its
retry), round after round.

Each round, both writers (tests/two_writers_worker.py) open the newest version on the
default lineage and stage their own batch of the next version (values tagged with the
writer: both put mostly the same keys), then the parent releases both commits together
(one line to each pipe), each after a random delay of up to a millisecond; now and then a
writer runs maintenance right after its commit, while the other may still be committing.
Afterwards, from a fresh provider:

- every version on the default lineage reads exactly as one writer's commit of it (the
  writer's batch on the version it opened), never a mix, and the default lineage is the
  one both writers opened in the next round;
- each writer's commit either raised or reads back exactly by naming its commit id.

The commits' intervals (CLOCK_MONOTONIC, comparable across processes) show that they
overlap; the test asserts that most rounds did.
"""
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import two_writers_worker as ww
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from tests.paths import TESTS_DIR

WORKER = str(TESTS_DIR / "two_writers_worker.py")
ROUNDS = int(os.environ.get("STATECORE_TWO_WRITER_ROUNDS", "200"))
JITTER_US = 1000
TIME_LIMIT_S = 300
ROOT_ID = "0" * 16


def contents(store):
    return {int(k[0]): (int(v[0]), int(v[1])) for k, v in store.iterator()}


def send(proc, line):
    """One line of commands to a worker."""
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def answer(proc):
    """The worker's next answer (a JSON line)."""
    line = proc.stdout.readline()
    assert line, f"a writer died (exit {proc.poll()}), or the test ran out of its {TIME_LIMIT_S} s"
    return json.loads(line)


@contextlib.contextmanager
def worker_processes(*worker_args):
    """One two_writers_worker process per argument list, talking over its stdin and stdout;
    killed if the test runs past TIME_LIMIT_S, and always reaped and closed after."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, bufsize=1, env=env) for args in worker_args]
    watchdog = threading.Timer(TIME_LIMIT_S, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        yield procs
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()


def applied(before, writer, version):
    puts, removes = ww.batch(writer, version)
    after = dict(before)
    after.update(puts)
    for k in removes:
        after.pop(k, None)
    return after


def test_two_writers_commit_the_same_version_at_once(tmp_path):
    root = str(tmp_path)
    expected = {(0, ROOT_ID): {}}  # (version, commit id) -> contents
    rounds = []
    started = time.monotonic()
    with worker_processes(*([root, str(w), str(100 + w)] for w in (0, 1))) as procs:
        for v in range(1, ROUNDS + 1):
            for proc in procs:
                send(proc, f"open {v - 1}")
            bases = [answer(proc)["base"] for proc in procs]
            assert bases[0] == bases[1], f"round {v}: the writers opened different attempts of {v - 1}: {bases}"
            assert (v - 1, bases[0]) in expected, f"round {v}: opened an attempt of {v - 1} no writer made"
            for w, proc in enumerate(procs):  # both lines go out before either answer is read
                send(proc, f"commit {JITTER_US} {int(v % 5 == 2 * w)}")
            results = [answer(proc) for proc in procs]
            for w, r in enumerate(results):
                if "error" not in r:
                    assert r["version"] == v
                    expected[(v, r["commit_id"])] = applied(expected[(v - 1, bases[w])], w, v)
            rounds.append((bases[0], results))
        for proc in procs:
            send(proc, "quit")
        for proc in procs:
            assert proc.wait(30) == 0
    elapsed = time.monotonic() - started

    p = create_and_init_provider(StateStoreId(root, 0, 0), ww.KEY, ww.VALUE, StateStoreConf(**ww.CONF))
    winners, both, raised = [0, 0], 0, []
    for v, (_, results) in enumerate(rounds, start=1):
        ok = [w for w, r in enumerate(results) if "error" not in r]
        both += len(ok) == 2
        raised += [(v, w, results[w]["error"]) for w in (0, 1) if w not in ok]
        # the default lineage: one writer's commit of v, exactly
        store = p.get_read_store(v)
        chosen = store.base_commit_id
        assert (v, chosen) in expected, f"version {v} on the default lineage is attempt {chosen}, which no " \
                                        f"writer's commit returned (results: {results})"
        assert contents(store) == expected[(v, chosen)], f"version {v} is not exactly one writer's data"
        store.abort()
        winners[[w for w in ok if results[w]["commit_id"] == chosen][0]] += 1
        if v < len(rounds):
            assert rounds[v][0] == chosen, f"the writers built {v + 1} on {rounds[v][0]}, the default is {chosen}"
        # each writer's own commit, by its id
        for w in ok:
            named = p.get_read_store(v, commit_id=results[w]["commit_id"])
            assert contents(named) == expected[(v, results[w]["commit_id"])], f"writer {w}'s version {v}"
            named.abort()
    # The default is documented as the attempt renamed into place last (statecore/lineage.py).
    renamed_last = sum(1 for v, (_, rs) in enumerate(rounds, start=1) if all("renamed" in r for r in rs)
                       and max(rs, key=lambda r: r["renamed"])["commit_id"] == p.get_read_store(v).base_commit_id)
    overlapping = sum(1 for _, rs in rounds
                      if all("t0" in r for r in rs) and rs[0]["t0"] < rs[1]["t1"] and rs[1]["t0"] < rs[0]["t1"])
    print(f"\n{len(rounds)} rounds in {elapsed:.1f} s: both commits succeeded in {both}, {len(raised)} raised, "
          f"commits overlapped in {overlapping}; default lineage: writer 0 in {winners[0]}, writer 1 in {winners[1]}; "
          f"the attempt renamed last in {renamed_last} of the {both} rounds with two")
    for v, w, error in raised[:5]:
        print(f"  round {v}, writer {w}: {error}")
    assert not any(not e.startswith("CommitConflictError") for _, _, e in raised), raised[:5]
    assert overlapping >= len(rounds) // 2, f"only {overlapping} of {len(rounds)} rounds' commits overlapped"


LATE_ROUNDS = int(os.environ.get("STATECORE_LATE_ATTEMPT_ROUNDS", "500"))
RECORDS_KEPT = 5  # batches whose records the driver model keeps (as StatefulOperator keeps min_versions_to_retain)
RETAINED = 12  # the workers' min_versions_to_retain: their cleanup deletes older versions


def test_late_openers_and_re_executions_never_change_a_recorded_version(tmp_path):
    """Two processes commit one store for a driver that records each batch's winner (as
    StatefulOperator does, with statecore.operator_files), round after round (seeded): one
    writer runs the driver's next batch, or re-executes a recent one (the driver first
    deletes the records of that batch and later ones); meanwhile the other, now and then, is
    a late attempt (a speculative copy or a delayed retry) that opened an older version,
    named or on the default lineage, and commits at the same moment. After every round,
    every recorded version reads back exactly as the commit the record names made it.
    STATECORE_LATE_ATTEMPT_ROUNDS raises the rounds."""
    import random

    from statecore import operator_files

    root = str(tmp_path)
    rng = random.Random(7)
    log = operator_files.commit_log(operator_files.operator_dir(root, 0))
    expected = {(0, ROOT_ID): {}}  # (version, commit id) -> contents of every commit that succeeded
    records = {}  # batch -> commit id of version batch + 1, as written to the log
    reader = create_and_init_provider(StateStoreId(root, 0, 0), ww.KEY, ww.VALUE,
                                      StateStoreConf(**dict(ww.CONF, min_versions_to_retain=RETAINED)))
    late_commits = late_refused = re_executions = 0
    with worker_processes(*([root, str(w), str(200 + w), str(RETAINED)] for w in (0, 1))) as procs:
        for rnd in range(LATE_ROUNDS):
            newest = max(records, default=-1)
            runner = rng.randrange(2)
            late = 1 - runner
            if newest >= 0 and rng.random() < 0.25:  # the driver re-executes a recent batch
                batch_id = rng.choice([b for b in records if b == 0 or b - 1 in records])
                log.delete([b for b in records if b >= batch_id])
                records = {b: i for b, i in records.items() if b < batch_id}
                re_executions += 1
            else:
                batch_id = newest + 1
            base = records.get(batch_id - 1, ROOT_ID)
            send(procs[runner], f"open {batch_id} {base}")
            late_open = None
            if rng.random() < 0.6 and batch_id > 0:  # a late attempt of an older batch
                v = rng.randint(max(0, batch_id - 4), batch_id)
                named = v - 1 in records or v == 0
                late_open = v
                send(procs[late], f"open {v} {records.get(v - 1, ROOT_ID)}" if named else f"open {v}")
            opened = answer(procs[runner])
            assert "error" not in opened, f"round {rnd}: the driver's batch {batch_id} cannot open: {opened}"
            late_base = answer(procs[late]) if late_open is not None else None
            if late_base is not None and "error" in late_base:
                late_open = None
            maintain = int(rng.random() < 0.3)
            send(procs[runner], f"commit 300 {maintain}")
            if late_open is not None:
                send(procs[late], f"commit 300 {int(rng.random() < 0.3)}")
            result = answer(procs[runner])
            assert "error" not in result, f"round {rnd}: the driver's batch {batch_id} did not commit: {result}"
            expected[(batch_id + 1, result["commit_id"])] = applied(expected[(batch_id, base)], runner, batch_id + 1)
            if late_open is not None:
                late_result = answer(procs[late])
                if "error" in late_result:
                    assert late_result["error"].startswith("CommitConflictError"), late_result
                    late_refused += 1
                else:
                    late_commits += 1
                    expected[(late_open + 1, late_result["commit_id"])] = applied(
                        expected[(late_open, late_base["base"])], late, late_open + 1)
            records[batch_id] = result["commit_id"]
            log.write(batch_id, operator_files.commit_record(batch_id, 1, "default", "stress", [result["commit_id"]],
                                                             [base]))
            for old in [b for b in records if b < batch_id - RECORDS_KEPT]:
                del records[old]
                log.delete([old])
            for b, commit_id in sorted(records.items()):
                store = reader.get_read_store(b + 1, commit_id)
                assert contents(store) == expected[(b + 1, commit_id)], \
                    f"round {rnd}: recorded batch {b} (version {b + 1}, {commit_id}) does not read back"
                store.abort()
        for proc in procs:
            send(proc, "quit")
        for proc in procs:
            assert proc.wait(30) == 0
    print(f"\n{LATE_ROUNDS} rounds: {re_executions} re-executions, {late_commits} late attempts committed, "
          f"{late_refused} refused")
    assert re_executions and late_commits and late_refused  # every kind of round happened
