"""Hardening of the file provider: one test per finding of the store review, each forcing its
interleaving (hooks on the provider's files and states that block on events, and assert
that the interleaving happened) or its damage, and each checking the outcome the store
promises: exact data, StateCorruptionError naming the damaged file, or a refusal that
leaves nothing behind.

The tests name version files by version and kind (``<v>_<id>.delta`` or, in the previous
layout, ``<v>.delta``) so the same test runs against both layouts. Tests that could hang
or exhaust memory on a broken store (a huge version, a delta that is /dev/zero) run in a
subprocess with a time and address-space limit.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import statecore
import statecore.errors
import statecore.maintenance
from tests.state_files import put_in_place
from tests.store_support import applied, commit_changes, contents, inject_faulty_files, store_dir, write_batch
from statecore import (SnapshotReader, StateCorruptionError, StateStoreConf, StateStoreId,
                       VersionNotFoundError, create_and_init_provider)
from statecore.files import StoreFiles
from statecore.layers import FrozenView, State
from statecore.spill import Spill

# The old code had no CommitConflictError: a stand-in that nothing raises.
CommitConflictError = getattr(statecore.errors, "CommitConflictError", None) or type(
    "CommitConflictErrorMissing", (Exception,), {})
NEW_LAYOUT = hasattr(statecore.errors, "CommitConflictError")  # names carry the commit id

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
KEY_SPACE = 40
SCHEMA_FILE = "_statecore.schema.json"
DELTA_LINEAGE_OFFSET = 48  # own id at 48..56, parent id at 56..64 (docs/formats.md, Delta)
WAIT_S = 20.0

_VERSION_FILE = re.compile(r"^([0-9]+)(?:_([0-9a-f]{16}))?\.(delta|snapshot)$")


# -- helpers ---------------------------------------------------------------------------------
def make(root, **conf):
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(**conf))


def version_files(root):
    """``{(version, kind): [name, ...]}`` of the store directory."""
    out = {}
    d = store_dir(root)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        m = _VERSION_FILE.match(name)
        if m and os.path.isfile(os.path.join(d, name)):
            out.setdefault((int(m.group(1)), m.group(3)), []).append(name)
    return out


def the_file(root, version, kind):
    names = version_files(root).get((version, kind), [])
    assert len(names) == 1, f"expected one {version}.{kind}, found {names}"
    return os.path.join(store_dir(root), names[0])


def has_file(root, version, kind):
    return bool(version_files(root).get((version, kind)))


def attempt_id(path):
    """The 16-hex commit id a file name carries (None in the previous layout)."""
    return _VERSION_FILE.match(os.path.basename(path)).group(2)


def same_attempt_name(name_of_attempt, version, kind):
    """The name of ``kind`` of ``version`` for the attempt that ``name_of_attempt`` names."""
    cid = _VERSION_FILE.match(name_of_attempt).group(2)
    return f"{version}_{cid}.{kind}" if cid else f"{version}.{kind}"


def tmp_files(root):
    d = store_dir(root)
    return [n for n in os.listdir(d) if n.endswith(".tmp")] if os.path.isdir(d) else []


def batch(v, salt=0):
    """The changes of version ``v``: ``(puts {k: (n, x)}, removes [k])``, disjoint keys."""
    rng = np.random.default_rng(1000 * v + salt)
    ks = [int(k) for k in rng.permutation(KEY_SPACE)]
    puts = {k: (v, salt + i / 8) for i, k in enumerate(ks[:9])}
    return puts, ks[9:12]


def write(store, puts, removes):
    write_batch(store, KEY, VALUE, puts, removes)


def commit_next(provider, model, salt=0):
    """Commit the next version from the newest one in ``model`` ({version: contents})."""
    return commit_changes(provider, model, lambda v: batch(v, salt), KEY, VALUE)


def commit_upto(provider, model, top, salt=0):
    while max(model) < top:
        commit_next(provider, model, salt)


def committed(root, top, **conf):
    """A provider made with ``conf`` that committed versions 1..``top``, and their model."""
    p = make(root, **conf)
    model = {0: {}}
    commit_upto(p, model, top)
    return p, model


ALL_KEYS = np.zeros(KEY_SPACE + 2, KEY)
ALL_KEYS["k"] = np.arange(-1, KEY_SPACE + 1)


def read_store(provider, version, commit_id=None):
    if commit_id is not None and NEW_LAYOUT:
        return provider.get_read_store(version, commit_id=commit_id)
    return provider.get_read_store(version)


def assert_reads(provider, version, expected, commit_id=None):
    """Version ``version`` reads exactly ``expected`` by iteration, batch lookup and get."""
    store = read_store(provider, version, commit_id)
    try:
        assert contents(store) == expected, f"version {version} differs"
        values, found = store.get_batch(ALL_KEYS)
        assert found.tolist() == [int(k) in expected for k in ALL_KEYS["k"]], f"version {version}: lookups"
        assert [tuple(v) for v in values[found].tolist()] == [expected[int(k)] for k in ALL_KEYS["k"][found]]
        for k in list(expected)[:3] + [-1]:
            got = store.get(k)
            assert (None if got is None else tuple(got)) == expected.get(k)
    finally:
        store.abort()


def load_outcome(provider, version, expected, commit_id=None):
    """"correct" if the version reads exactly ``expected``, else the StateCorruptionError's
    path (anything else raises)."""
    try:
        assert_reads(provider, version, expected, commit_id)
        return "correct"
    except StateCorruptionError as e:
        return e.path




def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def run_bounded(body, timeout_s=60, extra_address_space=1 << 30):
    """Run ``body`` (Python source) in a fresh interpreter that imports this checkout's
    statecore, with its address space capped at what it has after the imports plus
    ``extra_address_space``, killed after ``timeout_s``; returns its last stdout line as JSON."""
    prelude = f"""
        import json, os, resource, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(statecore.__file__))!r})
        import numpy as np
        import statecore
        from statecore import *
        KEY = np.dtype([("k", "<i8")])
        VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
        def vm_bytes():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        return int(line.split()[1]) * 1024
        _limit = vm_bytes() + {extra_address_space}
        resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))
        def make(root, **conf):
            return create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, StateStoreConf(**conf))
        def contents(store):
            return {{int(k[0]): list(v) for k, v in store.iterator()}}
    """
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(body)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the subprocess did not finish within {timeout_s} s")
    assert done.returncode == 0, f"subprocess exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- 1. reading while another store of the same provider commits -----------------------------


# -- 2. a flipped byte in a delta no load replays again --------------------------------------
def snapshot_versions(root):
    return sorted(v for v, kind in version_files(root) if kind == "snapshot")








# -- 4. commit() raises though the merge ran ------------------------------------------------


# -- 4b. a commit whose update becomes the head ----------------------------------------------
def loaded_over_a_snapshot(tmp_path, monkeypatch=None):
    """Versions 1..3 committed and snapshot 3 written; a new provider that loads 3 from it
    (its head empty), the model, and the files of the new provider if ``monkeypatch`` asks
    for fault-injecting ones."""
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=1)
    p.do_maintenance()
    assert has_file(tmp_path, 3, "snapshot")
    made = inject_faulty_files(monkeypatch) if monkeypatch is not None else None
    q = make(tmp_path)
    assert_reads(q, 3, model[3])
    assert q.describe()["latest"]["head_rows"] == 0, "loaded from the snapshot alone, the head should be empty"
    return q, model, (made[-1] if made else None)


def put_only(store, v):
    """Put-only changes of version ``v``: keys of the state and new ones; returns the puts."""
    puts = {k: (v, k / 4) for k in range(0, KEY_SPACE + 10, 3)}
    write(store, puts, [])
    return puts






# -- 4c. a commit of the keys its store read first ---------------------------------------------
def read_then_put(store, keys, v):
    """What a read-modify-write fn does: one get_batch of ``keys``, then a put of each."""
    old, found = store.get_batch(keys)
    new = np.zeros(len(keys), dtype=VALUE)
    new["n"] = np.where(found, old["n"], 0) + v
    new["x"] = keys["k"] / 4
    store.put_batch(keys, new)
    return {int(k): (int(n), float(x)) for k, n, x in zip(keys["k"], new["n"], new["x"])}


def count_base_lookups(monkeypatch):
    """A list that grows by the number of keys of each lookup of keys in a State's base."""
    import statecore.layers as layers

    seen, original = [], layers.base_lookup

    def counted(base, key_rows):
        if key_rows.shape[0]:
            seen.append(key_rows.shape[0])
        return original(base, key_rows)

    monkeypatch.setattr(layers, "base_lookup", counted)
    return seen


def keys_of(ks):
    return np.array([(k,) for k in ks], dtype=KEY)








# -- 5. the snapshot's fsync (or rename) fails ------------------------------------------------


# -- 7. a zombie's late commit ---------------------------------------------------------------


# -- 8. assorted damage and abuse ------------------------------------------------------------
@pytest.mark.parametrize("deltas", ["present", "cleaned_up"])
def test_copy_of_an_older_snapshot_is_never_served_as_a_newer_version(tmp_path, deltas):
    p = make(tmp_path, min_deltas_for_snapshot=2)
    model = {0: {}}
    for top in (3, 6):
        commit_upto(p, model, top)
        p.do_maintenance()
    commit_upto(p, model, 8)
    three, six = the_file(tmp_path, 3, "snapshot"), the_file(tmp_path, 6, "snapshot")
    # The copy takes the name version 6's attempt has (the id of version 6's delta).
    six_delta = os.path.basename(the_file(tmp_path, 6, "delta"))
    copy = os.path.join(store_dir(tmp_path), same_attempt_name(six_delta, 6, "snapshot"))
    os.unlink(six)
    shutil.copyfile(three, copy)
    if NEW_LAYOUT:  # and a copy renamed with 3's id too
        shutil.copyfile(three, os.path.join(store_dir(tmp_path), f"6_{attempt_id(three)}.snapshot"))
    if deltas == "cleaned_up":  # as if cleanup had deleted what the snapshot of 6 covered
        for u in range(1, 7):
            os.unlink(the_file(tmp_path, u, "delta"))
    for attempt in ("before maintenance", "after maintenance"):
        fresh = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=2)
        # before: every version with its files; after: the retained ones (8 - 2 = 6 on)
        for u in range(1 if attempt.startswith("before") and deltas == "present" else 6, 9):
            try:
                assert_reads(fresh, u, model[u])
            except StateCorruptionError as e:
                assert deltas == "cleaned_up", (
                    f"{attempt}: version {u} no longer loads though its deltas were there: {e}; "
                    f"files: {sorted(os.listdir(store_dir(tmp_path)))}")
        fresh.do_maintenance()


def test_huge_version_is_not_found_promptly_in_bounded_memory(tmp_path):
    p = make(tmp_path)
    commit_upto(p, {0: {}}, 3)
    result = run_bounded(f"""
        import resource
        p = make({str(tmp_path)!r})
        outcomes = []
        t0 = time.monotonic()
        for v in (2**63 - 1, 2**62, 10**12):
            for open_ in (p.get_store, p.get_read_store):
                try:
                    open_(v)
                    outcomes.append("opened")
                except VersionNotFoundError:
                    outcomes.append("not found")
                except BaseException as e:
                    outcomes.append(type(e).__name__)
        print(json.dumps({{"outcomes": outcomes, "seconds": time.monotonic() - t0,
                          "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
    """, timeout_s=60)
    assert result["outcomes"] == ["not found"] * 6, result
    assert result["seconds"] < 5, result




@pytest.mark.parametrize("field", ["own_id", "parent_id"])
# 4: a middle delta; 6: the newest; "snapshot's": the delta of version 6, whose snapshot is
# what versions 6.. load from (the deltas below it are cleaned up)
@pytest.mark.parametrize("damaged", [4, 6, "snapshot's"])
def test_damaged_commit_id_in_a_delta_header_names_the_file(tmp_path, damaged, field):
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=2)
    p = make(tmp_path, **conf)
    model = {0: {}}
    if damaged == "snapshot's":
        for top in (3, 6, 8):
            commit_upto(p, model, top)
            p.do_maintenance()
        assert snapshot_versions(tmp_path) == [6] and not has_file(tmp_path, 5, "delta"), "setup"
        damaged, first = 6, 6
    else:
        commit_upto(p, model, 6)
        first = 1
    path = the_file(tmp_path, damaged, "delta")
    flip(path, DELTA_LINEAGE_OFFSET + (0 if field == "own_id" else 8))
    for provider in (make(tmp_path, **conf), p):
        for u in range(first, max(model) + 1):
            outcome = load_outcome(provider, u, model[u])  # never VersionNotFoundError
            if u >= damaged and provider is not p and not has_file(tmp_path, damaged, "snapshot"):
                assert outcome == path, f"version {u}: {outcome}"  # from files, through it
            else:  # in memory, from the snapshot of 6, or resolved through the damaged delta
                assert outcome in ("correct", path), f"version {u}: {outcome}"
        provider.do_maintenance()
        assert os.path.exists(path)


@pytest.mark.parametrize("shape", ["lists", "dicts", "directory", "fifo", "dev_zero", "oversize"])
def test_unreadable_schema_file_is_corruption(tmp_path, shape):
    p = make(tmp_path)
    commit_upto(p, {0: {}}, 2)
    path = os.path.join(store_dir(tmp_path), SCHEMA_FILE)
    os.unlink(path)
    depth = 100_000
    if shape == "lists":
        with open(path, "w") as f:
            f.write('{"format": "statecore-state-schema-1", "key": ' + "[" * depth + "]" * depth + ', "value": 1}')
    elif shape == "dicts":
        with open(path, "w") as f:
            f.write('{"key": ' + '{"a": ' * depth + "1" + "}" * depth + "}")
    elif shape == "oversize":  # sparse: its size is refused before a byte is read
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    else:
        put_in_place(path, shape)
    kind, value = _call_with_deadline(lambda: make(tmp_path))
    assert kind == "raised" and isinstance(value, StateCorruptionError), (kind, value)
    assert value.path == path


@pytest.mark.parametrize("layout", ["with_id", "previous"])
def test_directory_with_a_version_file_name_is_ignored(tmp_path, layout):
    if layout == "previous" and not NEW_LAYOUT:
        pytest.skip("same as with_id in the previous layout")
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=1, min_versions_to_retain=2)
    name = f"5_{'ab' * 8}.delta" if NEW_LAYOUT and layout == "with_id" else "5.delta"
    os.mkdir(os.path.join(store_dir(tmp_path), name))
    fresh = make(tmp_path, min_deltas_for_snapshot=1, min_versions_to_retain=2)
    for provider in (p, fresh):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(5)
        with pytest.raises(VersionNotFoundError):
            read_store(provider, 5, commit_id="ab" * 8)
    assert_reads(fresh, 3, model[3])
    for _ in range(4):  # 4, 5, 6, 7, with maintenance (snapshots, cleanup) between
        commit_next(fresh, model)
        fresh.do_maintenance()
    for u in range(5, 8):
        assert_reads(make(tmp_path), u, model[u])


@pytest.mark.parametrize("what", ["dev_zero", "fifo"])
@pytest.mark.parametrize("which", ["newest_delta", "middle_delta", "snapshot"])
def test_version_file_linked_to_dev_zero_is_corruption_promptly(tmp_path, which, what):
    """A link to /dev/zero, or a FIFO someone left, where a version file should be: every load
    that needs it is corruption naming it, at once; the others and maintenance go on."""
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=2)
    p.do_maintenance()
    commit_upto(p, model, 6)
    version, kind = {"newest_delta": (6, "delta"), "middle_delta": (5, "delta"), "snapshot": (3, "snapshot")}[which]
    path = the_file(tmp_path, version, kind)
    put_in_place(path, what)
    result = run_bounded(f"""
        p = make({str(tmp_path)!r}, min_deltas_for_snapshot=2)
        out = {{}}
        t0 = time.monotonic()
        for v in range(1, 7):
            try:
                out[v] = ["data", contents(p.get_read_store(v))]
            except StateCorruptionError as e:
                out[v] = ["corrupt", e.path]
            except BaseException as e:
                out[v] = [type(e).__name__, str(e)]
        try:
            p.do_maintenance()
            maintenance = "ok"
        except BaseException as e:
            maintenance = f"{{type(e).__name__}}: {{e}}"
        print(json.dumps({{"loads": out, "maintenance": maintenance, "seconds": time.monotonic() - t0}}))
    """, timeout_s=60)
    assert result["seconds"] < 5, result
    assert result["maintenance"] == "ok", result
    for v in range(1, 7):
        kind_, what = result["loads"][str(v)]
        if kind_ == "data":
            assert {int(k): tuple(x) for k, x in what.items()} == model[v], f"version {v}: wrong data"
        else:
            assert [kind_, what] == ["corrupt", path], f"version {v}: {kind_} {what}"
    assert os.path.lexists(path) and not os.path.isfile(path), "maintenance deleted the damaged file"




# -- beyond the findings: interleavings of maintenance, iterations and commits ---------------




# -- 16. names no writer makes ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["05.delta", "5.DELTA", "5.Snapshot", "005.snapshot"])
def test_a_foreign_old_layout_name_is_not_taken_for_a_version(tmp_path, name):
    """A file someone copied in as "05.delta" or "5.DELTA" (no writer makes these: Spark writes the
    version with Java's Long.toString, statecore a lower-case kind) is not version 5: it must not
    become the default attempt and hide the store's newest version, nor be cleaned up as one."""
    p, model = committed(tmp_path, 4, min_deltas_for_snapshot=100)
    foreign = os.path.join(store_dir(tmp_path), name)
    shutil.copyfile(the_file(tmp_path, 4, "delta"), foreign)
    fresh = make(tmp_path, min_deltas_for_snapshot=100)
    assert_reads(fresh, 4, model[4])
    with pytest.raises(VersionNotFoundError):
        fresh.get_store(5)
    commit_next(fresh, model)  # version 5 is the store's own
    assert_reads(make(tmp_path), 5, model[5])
    assert os.path.exists(foreign)


# -- 5. what is not a regular file where a state file should be ------------------------------

def _call_with_deadline(fn, deadline_s=WAIT_S):
    """``("raised", exception)`` or ``("returned", value)`` of ``fn()`` run on a thread; fails the
    test if it has not finished within ``deadline_s`` (a read blocked on a FIFO)."""
    outcome = []

    def body():
        try:
            outcome.append(("returned", fn()))
        except BaseException as e:
            outcome.append(("raised", e))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert outcome, f"the call did not finish within {deadline_s} s"
    return outcome[0]




