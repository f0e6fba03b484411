"""The commit protocol (statecore/commit.py), each case forcing its interleaving (hooks that
block on events, and assert that the interleaving happened) or its fault: a commit that
raises in its merge, or whose delta write fails after the merge, leaves no version and the
state as it was; the merge makes an update over an empty head the head, and takes the priors
of the keys its store read from that read; a zombie's late commit is refused and removes
nothing; a forked child writes its deltas with writer threads of its own."""
import os
import threading
import time

import numpy as np
import pytest

import statecore.commit
import statecore.errors
from tests.store_support import (KEY, KEY_SPACE, VALUE, VERSION_FILE, WAIT_S, applied, assert_reads, batch,
                                 commit_numbered, commit_upto, committed, has_file, inject_faulty_files,
                                 open_numbered, store_dir, version_files, write)
from statecore import CommitConflictError, VersionNotFoundError
from statecore.files import StoreFiles
from statecore._versions import State


def tmp_files(root):
    d = store_dir(root)
    return [n for n in os.listdir(d) if n.endswith(".tmp")] if os.path.isdir(d) else []


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


# -- a commit that raises though the merge ran -------------------------------------------------
@pytest.mark.parametrize("merge", ["raises_after_merging", "raises_after_part", "raises_before"])
def test_commit_that_raises_in_the_merge_leaves_no_version(tmp_path, monkeypatch, merge):
    p, model = committed(tmp_path, 3)
    v = 3
    original = State.merge
    saw = []

    writing = threading.Event()
    write_pending = p.files.write_pending

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
    monkeypatch.setattr(p.files, "write_pending", write_and_tell)
    store = p.get_store(v)
    write(store, *batch(v + 1))
    with pytest.raises(RuntimeError, match="injected"):
        store.commit()
    monkeypatch.setattr(statecore.commit, "merge_update", original)
    assert saw and saw[0], "the delta was not being written when the merge raised"

    assert not has_file(tmp_path, v + 1, "delta") and not has_file(tmp_path, v + 1, "snapshot"), \
        f"a file of version {v + 1} is visible after its commit raised: {version_files(tmp_path)}"
    assert not tmp_files(tmp_path)
    for provider in (p, open_numbered(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(v + 1)
        for u in range(v + 1):
            assert_reads(provider, u, model[u])
    commit_numbered(p, model)  # and the batch can be committed again
    for provider in (p, open_numbered(tmp_path)):
        assert_reads(provider, v + 1, model[v + 1])


# -- a commit whose update becomes the head ----------------------------------------------------
def loaded_over_a_snapshot(tmp_path, monkeypatch=None):
    """Versions 1..3 committed and snapshot 3 written; a new provider that loads 3 from it
    (its head empty), the model, and the files of the new provider if ``monkeypatch`` asks
    for fault-injecting ones."""
    p, model = committed(tmp_path, 3, min_deltas_for_snapshot=1)
    p.do_maintenance()
    assert has_file(tmp_path, 3, "snapshot")
    made = inject_faulty_files(monkeypatch) if monkeypatch is not None else None
    q = open_numbered(tmp_path)
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
    commit_numbered(q, model)  # the next merge goes into the adopted head
    for provider in (q, open_numbered(tmp_path)):
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
    for provider in (q, open_numbered(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(4)
        assert_reads(provider, 3, model[3])
    again = q.get_store(3)
    assert put_only(again, 4) == puts
    again.commit()
    model[4] = applied(model[3], puts, [])
    for provider in (q, open_numbered(tmp_path)):
        assert_reads(provider, 4, model[4])


# -- a commit of the keys its store read first -------------------------------------------------
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
        commit_numbered(q, model)
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
    for provider in (q, open_numbered(tmp_path)):
        for u in (v, v + 1):
            assert_reads(provider, u, model[u])  # v in memory through the undo layer
    commit_numbered(q, model)
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
    for provider in (q, open_numbered(tmp_path)):
        for u in (3, 4):
            assert_reads(provider, u, model[u])


def test_a_failed_delta_write_after_a_merge_of_read_keys_leaves_the_state_as_it_was(tmp_path, monkeypatch):
    """The delta's fsync fails after a merge that took its priors from the store's read:
    version 4 is not visible, version 3 reads as before (from memory and files), and the
    batch commits again."""
    q, model, files = loaded_over_a_snapshot(tmp_path, monkeypatch)
    commit_numbered(q, model)  # a head with rows: the merge writes into it, and must undo that
    store = q.get_store(4)
    keys = keys_of(range(0, KEY_SPACE + 6, 3))
    read_then_put(store, keys, 5)
    files.arm("fsync", "*.delta*")
    with pytest.raises(OSError, match="injected"):
        store.commit()
    assert files.raised["fsync"] == 1
    for provider in (q, open_numbered(tmp_path)):
        with pytest.raises(VersionNotFoundError):
            provider.get_store(5)
        assert_reads(provider, 4, model[4])
    again = q.get_store(4)
    puts = read_then_put(again, keys, 5)
    again.commit()
    model[5] = applied(model[4], puts, [])
    for provider in (q, open_numbered(tmp_path)):
        for u in (4, 5):
            assert_reads(provider, u, model[u])


# -- a zombie's late commit --------------------------------------------------------------------
@pytest.mark.parametrize("live", ["same_provider", "other_provider", "during_the_commit"])
def test_zombie_commit_is_refused_and_removes_nothing(tmp_path, monkeypatch, live):
    zp, model = committed(tmp_path, 1)
    lp = zp if live == "same_provider" else open_numbered(tmp_path)
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
            m = VERSION_FILE.match(name)
            if (self is zp.files and step == "fsync" and m and int(m.group(1)) == 2
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
    for provider in (lp, open_numbered(tmp_path)):
        for u in (2, 3, 4):
            assert_reads(provider, u, model[u])
    commit_numbered(lp, model)  # the live run goes on
    assert_reads(open_numbered(tmp_path), 5, model[5])
