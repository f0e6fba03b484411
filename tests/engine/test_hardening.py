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
from statecore._versions import FrozenView, State
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


def snapshot_bases(provider):
    """Every SnapshotReader the provider's in-memory states stand on."""
    out = []
    state = provider.held.newest
    while state is not None:
        if isinstance(state.base, SnapshotReader):
            out.append(state.base)
        state = state.base.state if isinstance(state.base, FrozenView) else None
    return out


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
@pytest.mark.parametrize("reader", ["read_store", "store"])
@pytest.mark.parametrize("target", ["newest", "older"])
def test_iteration_returns_its_version_while_other_stores_commit(tmp_path, monkeypatch, target, reader):
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=2, max_versions_to_retain_in_memory=3)
    p.do_maintenance()  # version 3 on a mapped snapshot: the iteration crosses layers and base
    commit_upto(p, model, 4)
    v = 4 if target == "newest" else 3

    reached, go = threading.Event(), threading.Event()
    original = State.iter_rows
    iterating_thread = []

    def blocking_iter_rows(self, version, extra_layers=(), chunk_rows=1 << 16):
        hooked = threading.current_thread() in iterating_thread and not reached.is_set()
        for chunk in original(self, version, extra_layers, chunk_rows=3 if hooked else chunk_rows):
            yield chunk
            if hooked and not reached.is_set():
                reached.set()  # one chunk out, the rest still to copy
                assert go.wait(WAIT_S)

    monkeypatch.setattr(statecore.stores, "iter_state_rows", blocking_iter_rows)
    result, errors = {}, []
    opened = p.get_read_store(v) if reader == "read_store" else p.get_store(v)

    def iterate():
        try:
            result.update(contents(opened))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=iterate)
    iterating_thread.append(t)
    t.start()
    try:
        assert reached.wait(WAIT_S), "the iteration never reached its hook"
        for _ in range(3):  # versions 5, 6, 7 from other stores of the same provider
            commit_next(p, model)
        assert t.is_alive() and not go.is_set(), "the commits did not overlap the iteration"
    finally:
        go.set()
        t.join(WAIT_S)
    assert not t.is_alive()
    assert not errors, f"the iteration raised {errors[0]!r}"
    assert result == model[v], f"the iteration of version {v} did not return exactly version {v}'s rows"
    opened.abort()
    for u in (5, 6, 7):
        assert_reads(p, u, model[u])
    for u in range(1, 8):
        assert_reads(make(tmp_path), u, model[u])


# -- 2. a flipped byte in a delta no load replays again --------------------------------------
def snapshot_versions(root):
    return sorted(v for v, kind in version_files(root) if kind == "snapshot")


@pytest.mark.parametrize("field", ["own_id", "parent_id"])
# 6: the delta of the next cleanup's base; 5: below it (about to be cleaned up); 8: between
# that base and the snapshot maintenance writes next
@pytest.mark.parametrize("damaged", [5, 6, 8])
def test_flipped_lineage_byte_in_an_unreplayed_delta_keeps_good_snapshots(tmp_path, damaged, field):
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=3)
    p = make(tmp_path, **conf)
    model = {0: {}}
    for top in (3, 6):
        commit_upto(p, model, top)
        p.do_maintenance()
    commit_upto(p, model, 9)
    assert snapshot_versions(tmp_path) == [3, 6], "setup"
    ids = {u: attempt_id(the_file(tmp_path, u, "delta")) for u in range(3, 10)}
    good_snapshot = the_file(tmp_path, 6, "snapshot")  # the base of versions 6.. (9 - 3 = 6)
    path = the_file(tmp_path, damaged, "delta")
    with open(path, "rb") as f:
        pristine = f.read()
    flip(path, DELTA_LINEAGE_OFFSET + (0 if field == "own_id" else 8) + 3)

    # Before maintenance: a load through the damaged delta names it; the others read right.
    fresh = make(tmp_path, **conf)
    for u in range(3, 10):
        outcome = load_outcome(fresh, u, model[u])
        assert outcome in ("correct", path), f"version {u}: {outcome}"

    for provider in (p, make(tmp_path, **conf)):  # the live one writes a snapshot of 9 first
        provider.do_maintenance()
        assert os.path.exists(good_snapshot), "maintenance deleted the good snapshot of 6"
        if damaged >= 6:
            assert os.path.exists(path), "maintenance deleted the damaged delta"
        snapshots = snapshot_versions(tmp_path)
        checker = make(tmp_path)
        for u in range(6, 10):  # the retained versions
            # A version loads from its newest snapshot and the deltas after it; only if the
            # damaged delta is one of those does its load need it.
            base = max(s for s in snapshots if s <= u)
            needs = base < damaged <= u
            outcome = load_outcome(checker, u, model[u], commit_id=ids[u])
            assert outcome == (path if needs else "correct"), f"version {u} (by its id): {outcome}"
            outcome = load_outcome(checker, u, model[u])
            assert outcome in ("correct", path), f"version {u} (default lineage): {outcome}"

    if os.path.exists(path):
        with open(path, "wb") as f:
            f.write(pristine)
    checker = make(tmp_path)
    for u in range(6, 10):
        assert_reads(checker, u, model[u])


@pytest.mark.parametrize("where", ["block", "trailer"])
def test_flipped_byte_in_a_delta_a_thinned_snapshot_stands_in_for_keeps_it(tmp_path, where):
    """Snapshots of 3, 4 and 6 (a provider with min_deltas_for_snapshot=0), then a provider
    with a cadence of 2 thins the one of 4, whose versions would load from 3 and delta 4
    instead: with a flipped byte in delta 4 (which no load reads while the snapshot of 4
    is there), the snapshot of 4 must stay."""
    eager = make(tmp_path, min_deltas_for_snapshot=0)
    model = {0: {}}
    for top in (3, 4, 6):
        commit_upto(eager, model, top)
        eager.do_maintenance()
    assert snapshot_versions(tmp_path) == [3, 4, 6], "setup"
    snapshot = the_file(tmp_path, 4, "snapshot")
    path = the_file(tmp_path, 4, "delta")
    flip(path, 72 + 32 + 5 if where == "block" else os.path.getsize(path) - 10)
    for u in range(3, 7):
        assert_reads(make(tmp_path), u, model[u])  # nothing reads delta 4 yet
    thinning = make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    thinning.do_maintenance()
    assert os.path.exists(snapshot), "maintenance deleted the snapshot that stands in for a damaged delta"
    for u in range(3, 7):
        assert_reads(make(tmp_path), u, model[u])


def test_a_forked_child_commits_with_delta_writers_of_its_own(tmp_path):
    """Deltas are written by threads kept for the process; a child forked after the parent
    committed (as Spark forks its Python workers) has none of them running, and must make
    its own rather than queue a write nobody takes."""
    committed(tmp_path / "parent", 2)  # the parent's writers exist now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its commit returned
        code = 1
        try:
            committed(tmp_path / "child", 2)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the child's exit, not a synchronisation by delay
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child's commit hung: its delta write was queued to the parent's threads")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert has_file(tmp_path / "child", 2, "delta")


# -- 4. commit() raises though the merge ran ------------------------------------------------
@pytest.mark.parametrize("merge", ["raises_after_merging", "raises_after_part", "raises_before"])
def test_commit_that_raises_in_the_merge_leaves_no_version(tmp_path, monkeypatch, merge):
    p, model = committed(tmp_path, 3)
    v = 3
    original = State.merge
    saw = []

    writing = threading.Event()
    write_pending = p._files.write_pending

    def write_and_tell(name, write, *args):
        def told(f):
            writing.set()
            return write(f)
        return write_pending(name, told, *args)

    def failing_merge(self, put_keys, put_values, del_keys, commit_id, pending=False, del_prior=None, **more):
        # Let the delta write start first (on a delta writer thread): its temporary file is
        # there, and its trailer waits for the merge.
        assert writing.wait(WAIT_S), "the delta write did not start"
        saw.append(sorted(n for n in os.listdir(store_dir(tmp_path)) if n.startswith((f"{v + 1}", f".{v + 1}"))))
        if merge == "raises_after_merging":
            original(self, put_keys, put_values, del_keys, commit_id, pending, del_prior, **more)
        elif merge == "raises_after_part":
            half = put_keys.shape[0] // 2
            original(self, put_keys[:half], put_values[:half], del_keys[:0], commit_id, pending)
        raise RuntimeError("injected: the merge failed")

    monkeypatch.setattr(statecore.commit, "merge_update", failing_merge)
    monkeypatch.setattr(p._files, "write_pending", write_and_tell)
    store = p.get_store(v)
    write(store, *batch(v + 1))
    with pytest.raises(RuntimeError, match="injected"):
        store.commit()
    monkeypatch.setattr(statecore.commit, "merge_update", original)
    assert saw and saw[0], "the delta was not being written when the merge raised"

    assert not has_file(tmp_path, v + 1, "delta") and not has_file(tmp_path, v + 1, "snapshot"), \
        f"a file of version {v + 1} is visible after its commit raised: {version_files(tmp_path)}"
    assert not tmp_files(tmp_path)
    for provider in (p, make(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(v + 1)
        for u in range(v + 1):
            assert_reads(provider, u, model[u])
    commit_next(p, model)  # and the batch can be committed again
    for provider in (p, make(tmp_path)):
        assert_reads(provider, v + 1, model[v + 1])


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


def test_an_update_that_only_puts_becomes_the_empty_head(tmp_path):
    """The merge makes the store's update layer the head (no second insert); the per-row
    calls the store handed out before its commit can no longer write into it."""
    q, model, _ = loaded_over_a_snapshot(tmp_path)
    store = q.get_store(3)
    puts = put_only(store, 4)
    put = store.put  # bound before the commit: it must not reach the head afterwards
    layer = store._update
    store.commit()
    model[4] = applied(model[3], puts, [])
    state = q.held.newest
    assert state.head is layer and state.adopted_head == 4, "the update layer did not become the head"
    with pytest.raises(statecore.errors.IllegalStateError):
        put(np.array([(7,)], dtype=KEY)[0], np.array([(99, 9.0)], dtype=VALUE)[0])
    for u in (3, 4):
        assert_reads(q, u, model[u])  # 3 through the undo layer, over the adopted head
    commit_next(q, model)  # the next merge goes into the adopted head
    for provider in (q, make(tmp_path)):
        for u in (3, 4, 5):
            assert_reads(provider, u, model[u])


def test_a_failed_delta_write_after_the_update_became_the_head_leaves_both_as_they_were(tmp_path, monkeypatch):
    """The delta's fsync fails after the merge adopted the update layer: the rollback gives
    the State its empty head back without touching the layer (a rollback into it would
    write prior values into the store's own updates), and nothing of version 4 is visible."""
    q, model, files = loaded_over_a_snapshot(tmp_path, monkeypatch)
    store = q.get_store(3)
    puts = put_only(store, 4)
    layer = store._update
    before = layer.puts.export_rows()
    adopted = []
    original = State.merge

    def watched_merge(self, *args, **kwargs):
        original(self, *args, **kwargs)
        adopted.append(self.head is kwargs.get("update"))

    monkeypatch.setattr(statecore.commit, "merge_update", watched_merge)
    files.arm("fsync", "*.delta*")
    with pytest.raises(OSError, match="injected"):
        store.commit()
    assert adopted == [True], "the failed commit's merge did not adopt the update layer"
    assert files.raised["fsync"] == 1
    state = q.held.newest
    assert state is not None and state.version == 3 and len(state.head) == 0 and state.head is not layer
    after = layer.puts.export_rows()
    assert all(np.array_equal(a, b) for a, b in zip(before, after)) and len(layer.dels) == 0, \
        "the rollback changed the store's update layer"
    assert not has_file(tmp_path, 4, "delta")
    for provider in (q, make(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(4)
        assert_reads(provider, 3, model[3])
    again = q.get_store(3)
    assert put_only(again, 4) == puts
    again.commit()
    model[4] = applied(model[3], puts, [])
    for provider in (q, make(tmp_path)):
        assert_reads(provider, 4, model[4])


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
    import statecore._versions as versions

    seen, original = [], versions.base_lookup

    def counted(base, key_rows):
        if key_rows.shape[0]:
            seen.append(key_rows.shape[0])
        return original(base, key_rows)

    monkeypatch.setattr(versions, "base_lookup", counted)
    return seen


def keys_of(ks):
    return np.array([(k,) for k in ks], dtype=KEY)


@pytest.mark.parametrize("head", ["empty", "not_empty"])
def test_a_commit_of_the_keys_its_store_read_looks_none_of_them_up(tmp_path, monkeypatch, head):
    """The values a store's get_batch found before it wrote anything are the priors of the
    same keys' puts: the commit's merge looks none of them up, over an empty head (the update
    layer becomes it) or over a head with rows; the versions, their key counts and the undo
    that serves the older one are what lookups would have made."""
    q, model, _ = loaded_over_a_snapshot(tmp_path)
    if head == "not_empty":
        commit_next(q, model)
        assert q.describe()["latest"]["head_rows"], "the head should hold version 4's changes"
    v = max(model)
    store = q.get_store(v)
    keys = keys_of(range(1, KEY_SPACE + 8, 2))  # keys of the state and new ones, distinct
    seen = count_base_lookups(monkeypatch)
    puts = read_then_put(store, keys, v + 1)
    del seen[:]
    store.commit()
    assert seen == [], f"the commit looked up keys its store had read: {seen}"
    model[v + 1] = applied(model[v], puts, [])
    assert store.metrics.num_keys == len(model[v + 1])
    monkeypatch.undo()
    for provider in (q, make(tmp_path)):
        for u in (v, v + 1):
            assert_reads(provider, u, model[u])  # v in memory through the undo layer
    commit_next(q, model)
    assert_reads(q, v + 2, model[v + 2])


@pytest.mark.parametrize("case", ["subset", "more_puts", "reordered", "keys_changed", "read_after_a_write",
                                  "removed_and_put_again", "found_changed"])
def test_what_a_store_read_serves_only_a_commit_of_exactly_those_keys(tmp_path, monkeypatch, case):
    """A commit uses the values its store read only when its puts are exactly the keys read,
    in that order, read before any write; otherwise its merge looks the keys up. Either way
    the version and its key count are the model's (the caller's arrays changed after the
    read change nothing)."""
    q, model, _ = loaded_over_a_snapshot(tmp_path)
    store = q.get_store(3)
    keys = keys_of(range(1, KEY_SPACE + 8, 2))
    seen = count_base_lookups(monkeypatch)
    if case == "read_after_a_write":
        write(store, {0: (7, 0.5)}, [])
        puts = {0: (7, 0.5)}
    else:
        puts = {}
    old, found = store.get_batch(keys)
    vals = np.zeros(len(keys), dtype=VALUE)
    vals["n"], vals["x"] = 11, 0.25
    if case == "subset":
        put = keys[: len(keys) // 2]
    elif case == "reordered":
        put = keys[::-1].copy()
    elif case == "keys_changed":
        keys["k"] += 100  # the caller reuses its array: these keys were never read
        put = keys
    else:
        put = keys
    if case == "found_changed":
        found[:] = ~found  # the caller's copy; the store kept its own
    store.put_batch(put, vals[: len(put)])
    puts.update({int(k): (11, 0.25) for k in put["k"]})
    if case == "more_puts":
        write(store, {KEY_SPACE + 50: (1, 1.0)}, [])
        puts[KEY_SPACE + 50] = (1, 1.0)
    removes = []
    if case == "removed_and_put_again":
        first = keys[:1]
        store.remove_batch(first)
        store.put_batch(first, vals[:1])
    del seen[:]
    store.commit()
    if case != "removed_and_put_again":  # there, the keys may come out of the layer in the order read
        assert (seen == []) == (case == "found_changed"), f"{case}: base lookups at commit {seen}"
    model[4] = applied(model[3], puts, removes)
    assert store.metrics.num_keys == len(model[4])
    monkeypatch.undo()
    for provider in (q, make(tmp_path)):
        for u in (3, 4):
            assert_reads(provider, u, model[u])


def test_a_failed_delta_write_after_a_merge_of_read_keys_leaves_the_state_as_it_was(tmp_path, monkeypatch):
    """The delta's fsync fails after a merge that took its priors from the store's read:
    version 4 is not visible, version 3 reads as before (from memory and files), and the
    batch commits again."""
    q, model, files = loaded_over_a_snapshot(tmp_path, monkeypatch)
    commit_next(q, model)  # a head with rows: the merge writes into it, and must undo that
    store = q.get_store(4)
    keys = keys_of(range(0, KEY_SPACE + 6, 3))
    read_then_put(store, keys, 5)
    files.arm("fsync", "*.delta*")
    with pytest.raises(OSError, match="injected"):
        store.commit()
    assert files.raised["fsync"] == 1
    for provider in (q, make(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(5)
        assert_reads(provider, 4, model[4])
    again = q.get_store(4)
    puts = read_then_put(again, keys, 5)
    again.commit()
    model[5] = applied(model[4], puts, [])
    for provider in (q, make(tmp_path)):
        for u in (4, 5):
            assert_reads(provider, u, model[u])


# -- 5. the snapshot's fsync (or rename) fails ------------------------------------------------
@pytest.mark.parametrize("step", ["fsync", "rename"])
def test_failed_snapshot_write_is_not_swapped_in(tmp_path, monkeypatch, step):
    made = inject_faulty_files(monkeypatch)
    p, model = committed(tmp_path, 4, min_deltas_for_snapshot=2)
    files = made[-1]
    files.arm(step, "*.snapshot")
    try:
        p.do_maintenance()
    except OSError as e:
        assert "injected" in str(e)
    assert files.raised[step] == 1, "the snapshot write never reached the fault"
    assert not any(kind == "snapshot" for _, kind in version_files(tmp_path))
    # There was no snapshot before, and none was written: no state may stand on one.
    assert not snapshot_bases(p), f"the in-memory base is the unfinished snapshot {snapshot_bases(p)}"

    for _ in range(2):
        commit_next(p, model)
    for provider in (p, make(tmp_path)):
        for u in range(1, 7):
            assert_reads(provider, u, model[u])
    p.do_maintenance()  # disarmed now: the snapshot is written and swapped in
    assert has_file(tmp_path, 6, "snapshot")
    assert snapshot_bases(p), "the snapshot written was not swapped in"
    commit_next(p, model)
    for u in (6, 7):
        assert_reads(p, u, model[u])
        assert_reads(make(tmp_path), u, model[u])


# -- 7. a zombie's late commit ---------------------------------------------------------------
@pytest.mark.parametrize("live", ["same_provider", "other_provider", "during_the_commit"])
def test_zombie_commit_is_refused_and_removes_nothing(tmp_path, monkeypatch, live):
    zp, model = committed(tmp_path, 1)
    lp = zp if live == "same_provider" else make(tmp_path)
    zombie = zp.get_store(1)
    zombie_batch = batch(2, salt=7)
    write(zombie, *zombie_batch)

    if live != "during_the_commit":
        commit_upto(lp, model, 4)
        with pytest.raises(CommitConflictError):
            zombie.commit()
    else:
        # The zombie passes any check at the start of its commit, then stalls in writing its
        # delta while the live run commits 2, 3, 4; then it renames its file and finishes.
        reached, go = threading.Event(), threading.Event()
        original = StoreFiles._step

        def stalling_step(self, step, name):
            m = _VERSION_FILE.match(name)
            if (self is zp._files and step == "fsync" and m and int(m.group(1)) == 2
                    and m.group(3) == "delta" and not reached.is_set()):
                reached.set()
                assert go.wait(WAIT_S)
            return original(self, step, name)

        monkeypatch.setattr(StoreFiles, "_step", stalling_step)
        raised = []

        def commit_zombie():
            try:
                zombie.commit()
            except BaseException as e:
                raised.append(e)

        t = threading.Thread(target=commit_zombie)
        t.start()
        try:
            assert reached.wait(WAIT_S), "the zombie's commit never reached its delta's fsync"
            commit_upto(lp, model, 4)
            assert t.is_alive(), "the live commits did not overlap the zombie's commit"
        finally:
            go.set()
            t.join(WAIT_S)
        assert raised and isinstance(raised[0], CommitConflictError), f"the zombie's commit: {raised}"

    assert not zombie.has_committed
    for u in (2, 3, 4):
        assert len(version_files(tmp_path).get((u, "delta"), [])) == 1, version_files(tmp_path)
    assert not tmp_files(tmp_path)
    for provider in (lp, make(tmp_path)):
        for u in (2, 3, 4):
            assert_reads(provider, u, model[u])
    commit_next(lp, model)  # the live run goes on
    assert_reads(make(tmp_path), 5, model[5])


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


@pytest.mark.parametrize("deleted", ["snapshot", "delta"])
def test_maintenance_survives_a_file_deleted_between_listing_and_reading(tmp_path, monkeypatch, deleted):
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    p.do_maintenance()
    commit_upto(p, model, 6)
    # the next cleanup's base, or a delta whose header the next pass reads to follow the lineage
    target = os.path.basename(the_file(tmp_path, 3, "snapshot") if deleted == "snapshot"
                              else the_file(tmp_path, 5, "delta"))
    ids = {u: attempt_id(the_file(tmp_path, u, "delta")) for u in range(3, 7)}
    original = StoreFiles._step
    gone = []

    def deleting_step(self, step, name):
        if step == "read" and name == target and not gone:
            os.unlink(os.path.join(store_dir(tmp_path), name))  # another instance's cleanup
            gone.append(name)
        return original(self, step, name)

    monkeypatch.setattr(StoreFiles, "_step", deleting_step)
    # another instance's pass: it reads the headers the committing one remembers
    make(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3).do_maintenance()
    assert gone, "maintenance never read the file it listed"
    monkeypatch.setattr(StoreFiles, "_step", original)
    p.do_maintenance()
    if deleted == "snapshot":
        for u in range(3, 7):
            assert_reads(make(tmp_path), u, model[u])
    else:  # 5 and 6 need the deleted delta; the default lineage of 3 and 4 runs through it
        for u in (3, 4):
            assert_reads(make(tmp_path), u, model[u], commit_id=ids[u])


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


@pytest.mark.parametrize("root", ["{tmp}/a::b", "file://{tmp}/a::b", "memory://x::y"])
def test_root_with_double_colon_is_refused(tmp_path, root):
    with pytest.raises(ValueError, match="::"):
        create_and_init_provider(StateStoreId(root.format(tmp=tmp_path), 0, 0), KEY, VALUE, StateStoreConf())


# -- beyond the findings: interleavings of maintenance, iterations and commits ---------------
@pytest.mark.parametrize("phase", ["spill", "snapshot"])
def test_snapshot_swapped_in_while_a_version_is_iterated_and_commits_go_on(tmp_path, monkeypatch, phase):
    """Maintenance spills version 4 and writes its snapshot, blocked (before the spill, the
    frozen 4 being read; or half-way through the snapshot, over the spill) while versions 5
    and 6 are committed and version 6 is iterated (blocked half-way); the snapshot is swapped
    in under the iteration, 7 is committed, then the iteration finishes."""
    p, model = committed(tmp_path, 4, min_deltas_for_snapshot=2, max_versions_to_retain_in_memory=3)
    snap_reached, snap_go = threading.Event(), threading.Event()
    iter_reached, iter_go = threading.Event(), threading.Event()
    original_spill_rows, original_iter_rows = Spill.rows, State.iter_rows
    original_spill_head = statecore.maintenance.spill_head
    hooked_threads = {}

    def block_maintenance():
        if threading.current_thread() is hooked_threads.get("maintenance") and not snap_reached.is_set():
            snap_reached.set()
            assert snap_go.wait(WAIT_S)

    def blocking_spill_rows(self, chunk_rows=1 << 16):
        hooked = threading.current_thread() is hooked_threads.get("maintenance")
        for chunk in original_spill_rows(self, chunk_rows=3 if hooked else chunk_rows):
            yield chunk
            block_maintenance()

    def blocking_spill_head(*args):
        block_maintenance()
        return original_spill_head(*args)

    def blocking_iter_rows(self, version, extra_layers=(), chunk_rows=1 << 16):
        hooked = threading.current_thread() is hooked_threads.get("iteration") and not iter_reached.is_set()
        for chunk in original_iter_rows(self, version, extra_layers, chunk_rows=3 if hooked else chunk_rows):
            yield chunk
            if hooked and not iter_reached.is_set():
                iter_reached.set()
                assert iter_go.wait(WAIT_S)

    if phase == "spill":
        monkeypatch.setattr(statecore.maintenance, "spill_head", blocking_spill_head)
    else:
        monkeypatch.setattr(statecore.maintenance, "rewritten_rows", blocking_spill_rows)
    monkeypatch.setattr(statecore.stores, "iter_state_rows", blocking_iter_rows)
    errors, result = [], {}

    def run(fn):
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    maintenance = threading.Thread(target=run, args=(p.do_maintenance,))
    hooked_threads["maintenance"] = maintenance
    maintenance.start()
    iteration = None
    try:
        assert snap_reached.wait(WAIT_S), f"the {phase} never reached its hook"
        commit_upto(p, model, 6)
        reader = p.get_read_store(6)
        iteration = threading.Thread(target=run, args=(lambda: result.update(contents(reader)),))
        hooked_threads["iteration"] = iteration
        iteration.start()
        assert iter_reached.wait(WAIT_S), "the iteration never reached its hook"
        snap_go.set()
        maintenance.join(WAIT_S)
        assert not maintenance.is_alive()
        assert has_file(tmp_path, 4, "snapshot")
        assert snapshot_bases(p), "the snapshot was not swapped in under the newer versions"
        commit_upto(p, model, 7)
        assert iteration.is_alive(), "the iteration did not overlap the swap and the commit"
    finally:
        snap_go.set()
        iter_go.set()
        maintenance.join(WAIT_S)
        if iteration is not None:
            iteration.join(WAIT_S)
    assert not errors, errors
    assert result == model[6]
    for provider in (p, make(tmp_path)):
        for u in range(4, 8):
            assert_reads(provider, u, model[u])


def test_commits_reads_and_maintenance_on_threads(tmp_path):
    """One thread commits, one iterates and looks up recent versions, one runs maintenance,
    for a bounded time: every read is exactly its version (or a version cleanup already
    let go), nothing raises."""
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=4, max_versions_to_retain_in_memory=2)
    p = make(tmp_path, **conf)
    model = {0: {}}
    for v in range(1, 400):  # the models of every version a run can reach
        model[v] = applied(model[v - 1], *batch(v))
    top = [0]
    stop = threading.Event()
    errors, reads, passes = [], [0], [0]

    def committer():
        while not stop.is_set() and top[0] < 399:
            store = p.get_store(top[0])
            write(store, *batch(top[0] + 1))
            assert store.commit() == top[0] + 1
            top[0] += 1

    def reader():
        rng = np.random.default_rng(5)
        while not stop.is_set():
            now = top[0]
            v = max(0, now - int(rng.integers(0, 3)))
            try:
                assert_reads(p, v, model[v])
                reads[0] += 1
            except VersionNotFoundError:
                assert v < top[0] - conf["min_versions_to_retain"], f"version {v} (newest {top[0]}) not found"

    def maintainer():
        while not stop.is_set():
            p.do_maintenance()
            passes[0] += 1
            time.sleep(0.002)

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)
                stop.set()
        return run

    threads = [threading.Thread(target=guarded(f)) for f in (committer, reader, maintainer)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors[0]
    assert top[0] > 20 and reads[0] > 20 and passes[0] > 5, (top[0], reads[0], passes[0])
    fresh = make(tmp_path)
    for u in range(max(0, top[0] - conf["min_versions_to_retain"]), top[0] + 1):
        assert_reads(fresh, u, model[u])


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


@pytest.mark.parametrize("what", ["fifo", "dev_zero", "directory"])
def test_snapshot_reader_refuses_a_fifo_device_or_directory_without_waiting(tmp_path, what):
    """Someone left a FIFO (or a link to /dev/zero, or a directory) where a snapshot should be:
    the reader refuses it, naming the file, before it maps or waits on anything."""
    path = str(tmp_path / f"3_{'ab' * 8}.snapshot")
    put_in_place(path, what)
    try:
        kind, value = _call_with_deadline(lambda: SnapshotReader(path))
    finally:
        if what == "fifo":  # release a reader blocked in open() on the old code
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert kind == "raised" and isinstance(value, statecore.errors.UnsafeFileError), (kind, value)
    assert value.path == path and "not a regular file" in str(value)


def test_a_remote_directory_in_place_of_a_snapshot_is_refused_not_copied(tmp_path):
    """On a filesystem that is not local (here fsspec's memory one), a directory named like a
    snapshot that a caller asks to map: refused by the local cache (UnsafeFileError naming it),
    nothing copied."""
    location = f"memory://hardening-{os.getpid()}/{tmp_path.name}"
    files = StoreFiles(location, local_cache_dir=str(tmp_path / "cache"))
    name = f"3_{'ab' * 8}.snapshot"
    files.fs.pipe_file(f"{files._full(name)}/inside", b"x")
    try:
        with pytest.raises(statecore.errors.UnsafeFileError) as e:
            files.local_path_for_mapping(name)
        assert e.value.path == files.path(name) and "directory" in e.value.reason
        assert not [n for n in os.listdir(tmp_path / "cache") if not n.startswith(".")]
    finally:
        files.fs.rm(files._full(name), recursive=True)
