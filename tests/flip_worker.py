"""A worker of the byte-flip sweep (tests/engine/test_byte_flips.py): flips bytes of a checkpoint,
one at a time, and reports what the store made of each.

    python tests/flip_worker.py SPEC_JSON

SPEC_JSON names the pristine store directory (``<root>/0/0``), a scratch root of this
worker (local paths, or ``s3://`` URLs: the store then reaches its bucket as the environment
says, ``AWS_ENDPOINT_URL`` ...), the store's conf, the versions to read with their expected
contents (before maintenance: all of them; after it: the retained ones), the names of the
files a maintenance pass keeps in the pristine directory (none of them may go), and the
flips: ``[[file name, offset], ...]``. For each flip, from a fresh copy of the pristine
directory and fresh providers: flip the byte (xor 0xFF); open a provider and read every
version (iteration, batch lookups, single gets); run maintenance; read every version again;
then restore the byte and read every version once more, which must all be exact. One JSON
line per flip on stdout: ``{"file", "offset", "outcome", "detail"}`` with outcome

- ``corrupt``: some load (or opening the provider) raised StateCorruptionError naming the
  damaged file; every other load returned exact data;
- ``recovered``: every load returned exact data, and the store logged the damage (a
  damaged snapshot skipped for an older one plus deltas, or maintenance finding a damaged
  file and keeping what stands in for it);
- ``unread``: every load returned exact data and nothing noticed (a byte nothing reads);
- ``failure``: anything else (wrong data, another exception, StateCorruptionError naming
  another file, a file maintenance deleted, a version that no longer loads once repaired).

A crash (a signal, an abort) ends the process; the parent sees which flip was running from
the last line (``{"start": ...}`` is printed before each flip).
"""
import json
import logging
import os
import shutil
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from statecore import (StateCorruptionError, StateStoreConf, StateStoreId,  # noqa: E402
                       create_and_init_provider)
from tests.state_files import flip, is_url, list_names  # noqa: E402

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])


class Failure(Exception):
    pass


class _Recorder(logging.Handler):
    """Collects the log messages that mention the damaged file."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.needle = None
        self.hits = 0

    def emit(self, record):
        if self.needle is not None and self.needle in record.getMessage():
            self.hits += 1


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    pristine = spec["pristine"]
    work_root = spec["work_root"]
    work = os.path.join(work_root, "0", "0")
    conf = StateStoreConf(**spec["conf"])
    expected = {int(v): {int(k): tuple(x) for k, x in c.items()} for v, c in spec["expected"].items()}
    versions = sorted(expected)
    retained = sorted(spec["retained"])  # what must load after maintenance
    key_space = spec["key_space"]
    all_keys = np.zeros(key_space + 2, KEY)
    all_keys["k"] = np.arange(-1, key_space + 1)
    must_keep = set(spec["must_keep"])

    recorder = _Recorder()
    logging.getLogger("statecore").addHandler(recorder)
    logging.getLogger("statecore").setLevel(logging.DEBUG)
    logging.getLogger("statecore").propagate = False

    def make():
        return create_and_init_provider(StateStoreId(work_root, 0, 0), KEY, VALUE, conf)

    def read_version(p, v):
        store = p.get_read_store(v)
        try:
            got = {}
            for (k,), value in store.iterator():
                if int(k) in got:
                    raise Failure(f"version {v}: key {k} iterated twice")
                got[int(k)] = (int(value[0]), float(value[1]))
            values, found = store.get_batch(all_keys)
            if (found.tolist() != [int(k) in got for k in all_keys["k"]]
                    or [(int(n), float(x)) for n, x in values[found].tolist()]
                    != [got[int(k)] for k in all_keys["k"][found]]):
                raise Failure(f"version {v}: batch lookups disagree with the iteration")
            for k in list(got)[:3] + [-1]:
                one = store.get(k)
                if (None if one is None else (int(one[0]), float(one[1]))) != got.get(k):
                    raise Failure(f"version {v}: get({k}) disagrees with the iteration")
        finally:
            store.abort()
        if got != expected[v]:
            raise Failure(f"version {v}: wrong data ({len(got)} keys, expected {len(expected[v])})")

    def read_all(p, damaged_path, what, which):
        """Each version of ``which``: exact, or StateCorruptionError naming the damaged file.
        Returns the versions whose load named it. The newest is read last: maintenance then
        holds it."""
        named = set()
        for v in which:
            try:
                read_version(p, v)
            except StateCorruptionError as e:
                if damaged_path is None or e.path != damaged_path:
                    raise Failure(f"{what}: version {v}: StateCorruptionError naming another file: {e}")
                named.add(v)
        return named

    def one_flip(name, offset):
        path = os.path.join(work, name)
        fresh_copy(pristine, work)
        flip(path, offset)
        recorder.needle, recorder.hits = name, 0
        named = False
        try:
            p = make()
        except StateCorruptionError as e:
            if e.path != path:
                raise Failure(f"opening the provider: StateCorruptionError naming another file: {e}")
            p, named = None, True
        if p is not None:
            before = read_all(p, path, "before maintenance", versions)
            p.do_maintenance()
            p.close()
            missing = sorted(must_keep - set(list_names(work)))
            if missing:
                raise Failure(f"maintenance deleted {missing}")
            after = read_all(make(), path, "after maintenance", retained)
            if after - before:  # maintenance must not take away what loaded
                raise Failure(f"versions {sorted(after - before)} loaded before maintenance, not after")
            named = bool(before or after)
        if name in list_names(work):
            flip(path, offset)  # flipped back
        read_all(make(), None, "repaired", retained)
        if named:
            return "corrupt", ""
        return ("recovered" if recorder.hits else "unread"), ""

    for name, offset in spec["flips"]:
        print(json.dumps({"start": [name, offset]}), flush=True)
        try:
            outcome, detail = one_flip(name, offset)
        except Failure as e:
            outcome, detail = "failure", str(e)
        except BaseException as e:  # noqa: BLE001 - every other exception is a finding
            outcome, detail = "failure", "".join(traceback.format_exception_only(type(e), e)).strip()
        print(json.dumps({"file": name, "offset": offset, "outcome": outcome, "detail": detail}), flush=True)
    if not is_url(work_root):
        shutil.rmtree(work_root, ignore_errors=True)


def fresh_copy(pristine, work):
    """``work`` made a copy of the directory ``pristine`` (local paths, or URLs of one bucket:
    then the objects are copied by the store, each whole)."""
    if not is_url(work):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        return
    import fsspec

    fs, work_path = fsspec.core.url_to_fs(work)
    _, pristine_path = fsspec.core.url_to_fs(pristine)
    for name in list_names(work):
        fs.rm_file(f"{work_path}/{name}")
    for name in list_names(pristine):
        fs.copy(f"{pristine_path}/{name}", f"{work_path}/{name}")
    fs.invalidate_cache()


if __name__ == "__main__":
    main(sys.argv[1])
