"""Maintenance (statecore/maintenance.py): spills, snapshots and cleanup, on checked bytes only.
A flipped byte in a delta no load replays keeps the snapshots that stand in for it; a
snapshot whose write failed is never swapped in; a file another instance deletes between the
listing and the read stops nothing; a snapshot swapped in under an iteration while commits go
on changes no version; and commits, reads and maintenance on threads keep every version exact.
Interleavings are forced with hooks that block on events, and checked to have happened."""
import os
import threading
import time

import numpy as np
import pytest

import statecore.maintenance
import statecore.stores
from tests.state_files import flip
from tests.store_support import (DELTA_LINEAGE_OFFSET, WAIT_S, applied, assert_reads, attempt_id, batch,
                                 commit_numbered, commit_upto, committed, contents, has_file, inject_faulty_files,
                                 load_outcome, open_numbered, snapshot_versions, store_dir, the_file,
                                 version_files, write)
from statecore import SnapshotReader, VersionNotFoundError
from statecore.files import StoreFiles
from statecore._versions import FrozenView, State
from statecore.spill import Spill


def snapshot_bases(provider):
    """Every SnapshotReader the provider's in-memory states stand on."""
    out = []
    state = provider.held.newest
    while state is not None:
        if isinstance(state.base, SnapshotReader):
            out.append(state.base)
        state = state.base.state if isinstance(state.base, FrozenView) else None
    return out


# -- a flipped byte in a delta no load replays again -------------------------------------------
@pytest.mark.parametrize("field", ["own_id", "parent_id"])
# 6: the delta of the next cleanup's base; 5: below it (about to be cleaned up); 8: between
# that base and the snapshot maintenance writes next
@pytest.mark.parametrize("damaged", [5, 6, 8])
def test_flipped_lineage_byte_in_an_unreplayed_delta_keeps_good_snapshots(tmp_path, damaged, field):
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=3)
    p = open_numbered(tmp_path, **conf)
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
    fresh = open_numbered(tmp_path, **conf)
    for u in range(3, 10):
        outcome = load_outcome(fresh, u, model[u])
        assert outcome in ("correct", path), f"version {u}: {outcome}"

    for provider in (p, open_numbered(tmp_path, **conf)):  # the live one writes a snapshot of 9 first
        provider.do_maintenance()
        assert os.path.exists(good_snapshot), "maintenance deleted the good snapshot of 6"
        if damaged >= 6:
            assert os.path.exists(path), "maintenance deleted the damaged delta"
        snapshots = snapshot_versions(tmp_path)
        checker = open_numbered(tmp_path)
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
    checker = open_numbered(tmp_path)
    for u in range(6, 10):
        assert_reads(checker, u, model[u])


@pytest.mark.parametrize("where", ["block", "trailer"])
def test_flipped_byte_in_a_delta_a_thinned_snapshot_stands_in_for_keeps_it(tmp_path, where):
    """Snapshots of 3, 4 and 6 (a provider with min_deltas_for_snapshot=0), then a provider
    with a cadence of 2 thins the one of 4, whose versions would load from 3 and delta 4
    instead: with a flipped byte in delta 4 (which no load reads while the snapshot of 4
    is there), the snapshot of 4 must stay."""
    eager = open_numbered(tmp_path, min_deltas_for_snapshot=0)
    model = {0: {}}
    for top in (3, 4, 6):
        commit_upto(eager, model, top)
        eager.do_maintenance()
    assert snapshot_versions(tmp_path) == [3, 4, 6], "setup"
    snapshot = the_file(tmp_path, 4, "snapshot")
    path = the_file(tmp_path, 4, "delta")
    flip(path, 72 + 32 + 5 if where == "block" else os.path.getsize(path) - 10)
    for u in range(3, 7):
        assert_reads(open_numbered(tmp_path), u, model[u])  # nothing reads delta 4 yet
    thinning = open_numbered(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3)
    thinning.do_maintenance()
    assert os.path.exists(snapshot), "maintenance deleted the snapshot that stands in for a damaged delta"
    for u in range(3, 7):
        assert_reads(open_numbered(tmp_path), u, model[u])


# -- the snapshot's fsync (or rename) fails ----------------------------------------------------
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
        commit_numbered(p, model)
    for provider in (p, open_numbered(tmp_path)):
        for u in range(1, 7):
            assert_reads(provider, u, model[u])
    p.do_maintenance()  # disarmed now: the snapshot is written and swapped in
    assert has_file(tmp_path, 6, "snapshot")
    assert snapshot_bases(p), "the snapshot written was not swapped in"
    commit_numbered(p, model)
    for u in (6, 7):
        assert_reads(p, u, model[u])
        assert_reads(open_numbered(tmp_path), u, model[u])


# -- a file deleted under maintenance ----------------------------------------------------------
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
    open_numbered(tmp_path, min_deltas_for_snapshot=2, min_versions_to_retain=3).do_maintenance()
    assert gone, "maintenance never read the file it listed"
    monkeypatch.setattr(StoreFiles, "_step", original)
    p.do_maintenance()
    if deleted == "snapshot":
        for u in range(3, 7):
            assert_reads(open_numbered(tmp_path), u, model[u])
    else:  # 5 and 6 need the deleted delta; the default lineage of 3 and 4 runs through it
        for u in (3, 4):
            assert_reads(open_numbered(tmp_path), u, model[u], commit_id=ids[u])


# -- maintenance interleaved with iterations and commits ---------------------------------------
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
    for provider in (p, open_numbered(tmp_path)):
        for u in range(4, 8):
            assert_reads(provider, u, model[u])


def test_commits_reads_and_maintenance_on_threads(tmp_path):
    """One thread commits, one iterates and looks up recent versions, one runs maintenance,
    for a bounded time: every read is exactly its version (or a version cleanup already
    let go), nothing raises."""
    conf = dict(min_deltas_for_snapshot=2, min_versions_to_retain=4, max_versions_to_retain_in_memory=2)
    p = open_numbered(tmp_path, **conf)
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
    fresh = open_numbered(tmp_path)
    for u in range(max(0, top[0] - conf["min_versions_to_retain"]), top[0] + 1):
        assert_reads(fresh, u, model[u])
