"""Every byte of every file of a small checkpoint, flipped.

A checkpoint of eight deltas (versions 3..10), three snapshots (3 and 6 packed, the default
compression; 7 an image, written with compression "none") and the schema file, few rows so
the files are small. For each byte of each file: flip it (xor 0xFF) and,
in a fresh process (tests/flip_worker.py: one process per chunk of flips, two at a time;
each flip starts from a fresh copy of the pristine directory and fresh providers), open
every version (3..10) and read all of it, run maintenance (a snapshot of 10 is due, so
maintenance writes one from what it loaded; cleanup then lets go of what only versions
before 6 need, and thins the snapshot of 7 away if the deltas standing in for it are
whole), read every retained version (6..10) again, then restore the byte and read them
once more. Outcomes:

- ``corrupt``: a load raised StateCorruptionError naming the damaged file, the others
  returned exact data;
- ``recovered``: every load returned exact data, and the store logged the damage (a
  damaged snapshot skipped for an older one plus the deltas, or maintenance finding a
  damaged file and keeping what stands in for it);
- ``unread``: exact data, nothing noticed: a byte nothing reads;
- ``failure``: anything else: wrong data, another exception or a crash (nonzero exit,
  signal), StateCorruptionError naming another file, a file maintenance deleted that it
  keeps in the pristine checkpoint, a version that loaded before maintenance and not after
  (damaged), or that no longer loads once the byte is restored.

The counts per file and outcome are printed (``-s`` shows them). By default (CI) the sweep
flips every byte of the deltas and of the schema file, and of each snapshot every byte of
its header fields and schema JSON, its header checksum, its checksums section and footer,
every 8th byte of its zero header padding and every 3rd of its data blocks (rows and
slots, all under block checksums); ``STATECORE_FULL_FLIPS=1`` flips every byte of every
file. Scratch directories go to /dev/shm where there is one.
"""
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.paths import TESTS_DIR
from tests.store_support import commit_changes
from statecore import StateStoreConf, StateStoreId, create_and_init_provider

pytestmark = pytest.mark.slow  # scheduled first: tests/conftest.py

WORKER = str(TESTS_DIR / "flip_worker.py")
KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
KEY_SPACE = 16
CONF = dict(min_deltas_for_snapshot=2, min_versions_to_retain=4, max_versions_to_retain_in_memory=2)
FULL = os.environ.get("STATECORE_FULL_FLIPS") == "1"
PADDING_STRIDE = 8  # over a snapshot's zero header padding, unless FULL
DATA_STRIDE = 3  # over a snapshot's data blocks (rows, slots), unless FULL
# Scratch directories in memory where there is /dev/shm: the sweep fsyncs thousands of
# small files (3x faster there); the store does the same work on any filesystem.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
WORKERS = 2
CHUNK = 600  # flips per worker process
SNAPSHOT_HEADER = 4096
SNAPSHOT_FOOTER = 64
SNAPSHOT_FIELDS = 136  # fixed header fields; the schema JSON follows (its length at 132)
PACK_HEADER = 64  # a packed snapshot's container header, before the image's header page
VERSIONS = range(3, 11)  # every version the checkpoint holds
RETAINED = range(6, 11)  # what a maintenance pass keeps (10 - min_versions_to_retain on)


def make(root):
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(**CONF))


def batch(v):
    rng = np.random.default_rng(v)
    ks = [int(k) for k in rng.permutation(KEY_SPACE)]
    return {k: (v, i / 4) for i, k in enumerate(ks[:5])}, ks[5:7]


def build_checkpoint(root):
    """Deltas 3..10, snapshots 3, 6 (packed) and 7 (an image), the schema file; returns the
    model. The snapshot of 7 is one version after 6 (written by a provider with
    min_deltas_for_snapshot=0 and compression "none"): the
    next maintenance pass, which snapshots 10, thins it away, once the deltas that stand in
    for it are checked whole."""
    p = make(root)
    model = {0: {}}
    for top in (3, 6, 7, 8, 10):
        while max(model) < top:
            commit_changes(p, model, batch, KEY, VALUE)
        if top == 7:
            eager = create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(
                **dict(CONF, min_deltas_for_snapshot=0, compression="none")))
            eager.get_read_store(7).abort()  # it holds 7: its maintenance writes the snapshot
            eager.do_maintenance()
            eager.close()
        elif top < 10:
            p.do_maintenance()
    p.close()
    return model


def offsets(path, size):
    """The offsets of ``path`` the sweep flips."""
    if FULL or not path.name.endswith(".snapshot"):
        return list(range(size))
    with open(path, "rb") as f:
        data = f.read()
    # A packed snapshot (format version 2): its container header, then the image's header
    # page, then blocks up to the block table (16 bytes a block) and the footer.
    packed = int.from_bytes(data[8:12], "little") == 2
    page = PACK_HEADER if packed else 0
    head = data[page:page + SNAPSHOT_HEADER]
    if packed:
        n_blocks = int.from_bytes(data[32:40], "little")
        data_end = size - SNAPSHOT_FOOTER - 16 * n_blocks  # table and footer follow
    else:
        data_end = int.from_bytes(head[100:108], "little")  # block checksums and footer follow
    fields_end = page + SNAPSHOT_FIELDS + int.from_bytes(head[132:136], "little")
    every = set(range(fields_end)) | set(range(page + SNAPSHOT_HEADER - 8, page + SNAPSHOT_HEADER))
    every |= set(range(data_end, size))
    strided = (set(range(fields_end, page + SNAPSHOT_HEADER - 8, PADDING_STRIDE))
               | set(range(page + SNAPSHOT_HEADER, data_end, DATA_STRIDE)))
    return sorted(every | strided)


@pytest.fixture(scope="module")
def checkpoint():
    root = Path(tempfile.mkdtemp(prefix="statecore-flips-", dir=SCRATCH))
    try:
        model = build_checkpoint(root / "pristine")
        pristine = root / "pristine" / "0" / "0"
        names = sorted(os.listdir(pristine))
        kinds = collections.Counter(n.rsplit(".", 1)[1] for n in names)
        assert kinds == {"delta": 8, "snapshot": 3, "json": 1}, names
        versions = {n.split("_")[0]: (pristine / n).read_bytes()[8] for n in names if n.endswith(".snapshot")}
        assert versions == {"3": 2, "6": 2, "7": 1}, versions  # format versions: packed, packed, image
        # What one maintenance pass keeps in the pristine directory: it adds a snapshot of
        # 10 and thins the one of 7.
        probe = root / "probe"
        shutil.copytree(pristine, probe / "0" / "0")
        p = make(probe)
        for v in VERSIONS:
            assert {int(k[0]): tuple(x) for k, x in p.get_read_store(v).iterator()} == model[v]
        p.do_maintenance()
        after = set(os.listdir(probe / "0" / "0"))
        assert [n.split("_")[0] for n in sorted(after - set(names))] == ["10"], "no snapshot of 10"
        gone = sorted(n.split("_")[0] + "." + n.rsplit(".", 1)[1] for n in set(names) - after)
        assert gone == ["3.delta", "3.snapshot", "4.delta", "5.delta", "7.snapshot"], gone
        yield root, pristine, model, sorted(set(names) & after)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def local_work_root():
    return tempfile.mkdtemp(prefix="statecore-flip-work-", dir=SCRATCH)


def run_chunk(spec, flips, new_work_root=local_work_root):
    """Run one worker over ``flips`` (its scratch root from ``new_work_root()``); a crash is
    recorded for the flip it was on, and a new worker goes on with the rest. Returns
    ``[(file, offset, outcome, detail)]``."""
    results = []
    while flips:
        fd, spec_path = tempfile.mkstemp(suffix=".json", prefix="statecore-flips-")
        work_root = new_work_root()
        with os.fdopen(fd, "w") as f:
            json.dump(dict(spec, flips=flips, work_root=work_root), f)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        try:
            done = subprocess.run([sys.executable, WORKER, spec_path], capture_output=True, text=True,
                                  timeout=900, env=env)
        finally:
            os.unlink(spec_path)
            shutil.rmtree(work_root, ignore_errors=True)
        started = None
        finished = 0
        for line in done.stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                started = tuple(record["start"])
            else:
                results.append((record["file"], record["offset"], record["outcome"], record["detail"]))
                finished += 1
                started = None
        if done.returncode == 0 and finished == len(flips):
            break
        # The worker died on `started` (or before its first flip).
        crashed = started or tuple(flips[finished])
        results.append((*crashed, "failure", f"the worker died (exit {done.returncode}): {done.stderr[-500:]}"))
        flips = flips[finished + 1:]
    return results


def sweep_spec(checkpoint, pristine):
    """The worker's spec for the checkpoint, its pristine directory at ``pristine``."""
    _, _, model, must_keep = checkpoint
    return {
        "pristine": str(pristine),
        "conf": CONF,
        "key_space": KEY_SPACE,
        "expected": {str(v): {str(k): list(x) for k, x in model[v].items()} for v in VERSIONS},
        "must_keep": must_keep,
        "retained": list(RETAINED),
    }


def run_sweep(spec, flips, chunk_size=CHUNK, new_work_root=local_work_root):
    """Every flip run by WORKERS workers at a time; ``[(file, offset, outcome, detail)]``."""
    chunks = [flips[i:i + chunk_size] for i in range(0, len(flips), chunk_size)]
    results, lock = [], threading.Lock()
    pending = list(reversed(chunks))

    def drain():
        while True:
            with lock:
                if not pending:
                    return
                chunk = pending.pop()
            got = run_chunk(spec, chunk, new_work_root)
            with lock:
                results.extend(got)

    threads = [threading.Thread(target=drain) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted((f, o) for f, o, _, _ in results) == sorted((f, o) for f, o in flips), "flips missing"
    return results


def test_every_flipped_byte_is_named_or_harmless(checkpoint):
    root, pristine, model, must_keep = checkpoint
    spec = sweep_spec(checkpoint, pristine)
    flips = []
    for name in sorted(os.listdir(pristine)):
        path = pristine / name
        flips += [[name, o] for o in offsets(path, path.stat().st_size)]
    results = run_sweep(spec, flips)

    assert sorted((f, o) for f, o, _, _ in results) == sorted((f, o) for f, o in flips), "flips missing"
    counts = collections.defaultdict(collections.Counter)
    for name, _, outcome, _ in results:
        kind = "schema" if name.endswith(".json") else f"{name.split('_')[0].split('.')[0]}.{name.rsplit('.', 1)[1]}"
        counts[kind][outcome] += 1
    sizes = {n: (pristine / n).stat().st_size for n in os.listdir(pristine)}
    print(f"\nbyte-flip sweep ({'every byte' if FULL else f'default: every {PADDING_STRIDE}th byte of snapshot header padding, every {DATA_STRIDE}rd of snapshot data blocks, every other byte'}"
          f"), {len(flips)} flips over {len(sizes)} files ({sum(sizes.values())} bytes):")
    outcomes = ("corrupt", "recovered", "unread", "failure")
    print(f"  {'file':<16}" + "".join(f"{o:>11}" for o in outcomes))
    for kind in sorted(counts, key=lambda k: (k == "schema", int(k.split(".")[0]) if k[0].isdigit() else 0, k)):
        print(f"  {kind:<16}" + "".join(f"{counts[kind][o]:>11}" for o in outcomes))
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    print(f"  {'total':<16}" + "".join(f"{total[o]:>11}" for o in outcomes))
    failures = [r for r in results if r[2] == "failure"]
    for name, offset, _, detail in failures[:30]:
        print(f"  FAILURE {name} @ {offset}: {detail}")
    assert not failures, f"{len(failures)} flips were not caught or harmless; first: {failures[:5]}"


S3_FLIPS_PER_FILE = 6  # seeded offsets of each file, beside its first byte and its last


def test_flipped_bytes_on_s3_are_named_or_harmless(checkpoint, s3_env):
    """The sweep on S3, representative flips (the whole sweep takes a request per file per
    flip to copy the pristine directory): the same checkpoint uploaded to a bucket of the
    local S3 server, and of each file its first and last byte and S3_FLIPS_PER_FILE seeded
    offsets, each flipped in a fresh copy there (the object written again whole), read
    through the store on S3 (snapshots mapped from the local cache), maintained, repaired.
    Every outcome as on disk: named, recovered or harmless, never a failure."""
    import fsspec

    _, pristine, _, _ = checkpoint
    fs, bucket = fsspec.core.url_to_fs(s3_env)
    names = sorted(os.listdir(pristine))
    for name in names:
        fs.put_file(str(pristine / name), f"{bucket}/pristine/0/0/{name}")
    rng = np.random.default_rng(36)
    flips = []
    for name in names:
        size = (pristine / name).stat().st_size
        picked = {0, size - 1} | {int(o) for o in rng.integers(0, size, S3_FLIPS_PER_FILE)}
        flips += [[name, o] for o in sorted(picked)]
    roots = iter(range(WORKERS * len(flips)))
    results = run_sweep(sweep_spec(checkpoint, f"{s3_env}/pristine/0/0"), flips, chunk_size=len(flips) // WORKERS + 1,
                        new_work_root=lambda: f"{s3_env}/work-{next(roots)}")
    failures = [r for r in results if r[2] == "failure"]
    assert not failures, f"{len(failures)} flips were not caught or harmless; first: {failures[:5]}"
    outcomes = collections.Counter(outcome for _, _, outcome, _ in results)
    assert outcomes["corrupt"] > 0 and set(outcomes) <= {"corrupt", "recovered", "unread"}, outcomes
