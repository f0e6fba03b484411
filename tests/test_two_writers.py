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
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


import two_writers_worker as ww
from statecore import StateStoreConf, StateStoreId, create_and_init_provider

WORKER = str(Path(__file__).resolve().parent / "two_writers_worker.py")
ROUNDS = int(os.environ.get("STATECORE_TWO_WRITER_ROUNDS", "200"))
JITTER_US = 1000
TIME_LIMIT_S = 300
ROOT_ID = "0" * 16


def contents(store):
    return {int(k[0]): (int(v[0]), int(v[1])) for k, v in store.iterator()}


def applied(before, writer, version):
    puts, removes = ww.batch(writer, version)
    after = dict(before)
    after.update(puts)
    for k in removes:
        after.pop(k, None)
    return after


def test_two_writers_commit_the_same_version_at_once(tmp_path):
    root = str(tmp_path)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, root, str(w), str(100 + w)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1, env=env) for w in (0, 1)]
    watchdog = threading.Timer(TIME_LIMIT_S, lambda: [p.kill() for p in procs])
    watchdog.start()

    def send(proc, line):
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    def answer(proc):
        line = proc.stdout.readline()
        assert line, f"a writer died (exit {proc.poll()}), or the test ran out of its {TIME_LIMIT_S} s"
        return json.loads(line)

    expected = {(0, ROOT_ID): {}}  # (version, commit id) -> contents
    rounds = []
    started = time.monotonic()
    try:
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
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
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
