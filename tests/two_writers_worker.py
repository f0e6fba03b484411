"""One of the two writers of tests/engine/test_two_writers.py: commits versions of one store on
command, so that the parent can make two processes commit the same version at once.

    python tests/two_writers_worker.py ROOT WRITER SEED [MIN_VERSIONS_TO_RETAIN]

Reads commands on stdin, one per line, and answers each with one JSON line on stdout:

- ``open V [ID]``: ``get_store(V)`` (the default lineage, or attempt ID) and stage this
  writer's batch of version V+1 (:func:`batch`); answers ``{"base": <base commit id>}``, or
  ``{"error": ...}`` if the version cannot be opened.
- ``commit JITTER_US MAINTAIN``: sleep a random 0..JITTER_US microseconds, ``commit()``,
  then, if MAINTAIN is 1, run maintenance; answers ``{"version", "commit_id", "t0", "t1",
  "renamed"}`` (CLOCK_MONOTONIC, comparable across processes: around the commit, and just
  after its delta was renamed into place) or ``{"error": "<type>: <message>", "t0", "t1"}``.
- ``quit``.
"""
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import statecore.files  # noqa: E402
from statecore import StateStoreConf, StateStoreId, create_and_init_provider  # noqa: E402

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("writer", "<i8"), ("version", "<i8")])
KEY_SPACE = 24
CONF = dict(min_deltas_for_snapshot=4, min_versions_to_retain=100_000, max_versions_to_retain_in_memory=2)


def batch(writer, version):
    """The changes writer ``writer`` makes in version ``version``: ``(puts {k: (writer,
    version)}, removes [k])``. Both writers put mostly the same keys (a mix shows), and each
    removes a few of its own."""
    rng = np.random.default_rng(1_000_003 * version + writer)
    ks = [int(k) for k in rng.permutation(KEY_SPACE)]
    return {k: (writer, version) for k in ks[:8]}, ks[8:10]


def record_renames(renamed):
    """Note the time each version file is renamed into place (after the rename returned)."""
    original = statecore.files.StoreFiles._publish

    def publish(self, pending, overwrite):
        size = original(self, pending, overwrite)
        renamed[pending.name] = time.monotonic()
        return size

    statecore.files.StoreFiles._publish = publish


def main(root, writer, seed, retain=None):
    rand = random.Random(seed)
    renamed = {}
    record_renames(renamed)
    conf = dict(CONF, min_versions_to_retain=retain) if retain is not None else CONF
    p = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, StateStoreConf(**conf))
    store = None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "open":
            v = int(cmd[1])
            try:
                store = p.get_store(v, cmd[2] if len(cmd) > 2 else None)
            except Exception as e:  # noqa: BLE001 - reported to the parent (a late opener's version is gone)
                store = None
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
                continue
            puts, removes = batch(writer, v + 1)
            keys = np.zeros(len(puts), KEY)
            keys["k"] = list(puts)
            values = np.zeros(len(puts), VALUE)
            values["writer"] = writer
            values["version"] = v + 1
            store.put_batch(keys, values)
            gone = np.zeros(len(removes), KEY)
            gone["k"] = removes
            store.remove_batch(gone)
            answer = {"base": store.base_commit_id}
        elif cmd[0] == "commit":
            jitter_us, maintain = int(cmd[1]), cmd[2] == "1"
            time.sleep(rand.randint(0, jitter_us) / 1e6)
            t0 = time.monotonic()
            try:
                version = store.commit()
                answer = {"version": version, "commit_id": store.commit_id,
                          "renamed": renamed.get(f"{version}_{store.commit_id}.delta")}
            except Exception as e:  # noqa: BLE001 - reported to the parent
                answer = {"error": f"{type(e).__name__}: {e}"}
            answer.update(t0=t0, t1=time.monotonic())
            store = None
            if maintain:
                p.do_maintenance()
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
