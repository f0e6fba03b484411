"""A query's steady state reads no listing (docs/provider-rules.md, "Opening the newest version
without a listing"): a store opened at the attempt its driver named, when that attempt is the
newest version the provider holds in memory, is served from memory, and its commit writes its
one file. On an object store a listing is a request (LIST) per batch and store.

What is given up, and what is not: a zombie in that state (a late attempt of a batch that
another process already carried further) is no longer refused; its commit adds an attempt no
recorded chain passes through, deletes nothing, and is gone at cleanup."""
import os

import numpy as np
import pytest

from statecore import StateStoreConf, StateStoreId, VersionNotFoundError, create_and_init_provider, held_versions
from statecore.lineage import ROOT_COMMIT_ID
from tests.store_support import contents, open_provider, store_dir

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("v", "<i8")])


def provider(root, **conf):
    return open_provider(root, KEY, VALUE, **conf)


def count_listings(monkeypatch, p):
    """A list that grows by one at each listing of ``p``'s store directory."""
    calls = []
    list_versions = p.files.list_versions

    def counted():
        calls.append(1)
        return list_versions()

    monkeypatch.setattr(p.files, "list_versions", counted)
    return calls


def commit_named(p, version, commit_id, key):
    """Open ``version`` at ``commit_id`` (as the driver names it), put ``key`` = ``key``,
    commit: the new attempt's id."""
    store = p.get_store(version, commit_id)
    store.put(key, (key,))
    assert store.commit() == version + 1
    return store.commit_id


def versions_on_disk(root):
    return sorted(n for n in os.listdir(store_dir(root)) if n[0].isdigit())


def test_a_querys_steady_state_batches_list_no_files(tmp_path, monkeypatch):
    """Batches after the first open the attempt the driver recorded, which this provider
    committed last: no listing at the open nor at the commit. The first open of a provider
    (recovery) lists; so does an open of an older version (a re-execution)."""
    p = provider(tmp_path)
    listings = count_listings(monkeypatch, p)
    commit_id = commit_named(p, 0, ROOT_COMMIT_ID, 0)
    assert listings, "the provider's first open lists the files"
    first = len(listings)
    for v in range(1, 6):
        commit_id = commit_named(p, v, commit_id, v)
        if v == 3:
            frozen = p.held.newest
            monkeypatch.setattr(held_versions, "SPILL_MIN_ROWS", -1)
            p.spill_if_outgrown(0.0)  # the head written out between batches: the same versions
            assert p.held.newest is not frozen, "the spill went on in a new State"
    assert len(listings) == first, f"{len(listings) - first} listings in 5 steady-state batches"
    assert not list(p.held.files_known), "nothing is known above the newest version: none kept, however many commits"
    assert contents(p.get_read_store(6, commit_id)) == {k: (k,) for k in range(6)}
    p.get_read_store(3)  # an older version, on the default lineage
    assert len(listings) > first


def test_a_new_provider_of_the_same_store_lists_once_then_not(tmp_path, monkeypatch):
    """A provider loaded in another process (a restart) lists at its first open: it cannot
    know what was committed before it; from then on its own commits are what it knows."""
    p = provider(tmp_path)
    ids = [ROOT_COMMIT_ID]
    for v in range(3):
        ids.append(commit_named(p, v, ids[-1], v))
    q = provider(tmp_path)
    listings = count_listings(monkeypatch, q)
    commit_id = commit_named(q, 3, ids[-1], 3)
    assert len(listings) == 3, "the load lists, and the commit of what it opened checks twice"
    commit_named(q, 4, commit_id, 4)
    assert len(listings) == 3


def test_a_zombie_at_the_newest_version_in_memory_adds_only_its_own_file(tmp_path):
    """A zombie task: process A committed versions 1..3 and holds 3; process B (the batch's
    retry elsewhere) went on from the recorded 3 to 4 and 5. A's late attempt of batch 3,
    opened at the recorded 3 from memory, commits a second attempt of version 4 without
    seeing B's: nothing of B's is deleted or changed, the default lineage and B's named
    versions read as before, and cleanup deletes the zombie's file once below its base."""
    a = provider(tmp_path, min_versions_to_retain=2, min_deltas_for_snapshot=2)
    ids = {0: ROOT_COMMIT_ID}
    for v in range(3):
        ids[v + 1] = commit_named(a, v, ids[v], v)
    b = provider(tmp_path, min_versions_to_retain=2, min_deltas_for_snapshot=2)
    for v in (3, 4):
        ids[v + 1] = commit_named(b, v, ids[v], v)
    before = versions_on_disk(tmp_path)
    expected = {k: (k,) for k in range(5)}

    zombie = commit_named(a, 3, ids[3], 99)

    after = versions_on_disk(tmp_path)
    assert set(before) < set(after) and len(after) == len(before) + 1, "one file added, none deleted"
    assert f"4_{zombie}.delta" in after
    fresh = provider(tmp_path)
    assert contents(fresh.get_read_store(5)) == expected, "the default lineage is B's"
    assert contents(fresh.get_read_store(4, ids[4])) == {k: (k,) for k in range(4)}
    # B carries on; maintenance's cleanup takes every file below its base, the zombie's too.
    for v in range(5, 9):
        ids[v + 1] = commit_named(b, v, ids[v], v)
        b.do_maintenance()
    assert not any(n.startswith(("4_", "5_")) for n in versions_on_disk(tmp_path))
    assert contents(provider(tmp_path).get_read_store(9)) == {k: (k,) for k in range(9)}


def test_files_a_re_execution_deleted_are_not_deleted_again(tmp_path, monkeypatch):
    """A re-execution from version 2 deletes the abandoned run's versions 4 and 5 (its other
    attempt of 3 stays: named, as a driver's retry is); the provider then knows they are gone:
    its next batches open from memory and delete nothing."""
    p = provider(tmp_path)
    ids = {0: ROOT_COMMIT_ID}
    for v in range(5):
        ids[v + 1] = commit_named(p, v, ids[v], v)
    q = provider(tmp_path)  # the re-execution's process: loads, sees 3..4 above
    commit_id = commit_named(q, 2, ids[2], 20)
    assert not any(n.startswith(("4_", "5_")) for n in versions_on_disk(tmp_path))
    deletes = []
    delete = q.files.delete
    monkeypatch.setattr(q.files, "delete", lambda names: deletes.append(list(names)) or delete(names))
    for v in range(3, 6):
        commit_id = commit_named(q, v, commit_id, v)
    assert deletes == []
    assert contents(provider(tmp_path).get_read_store(6)) == {k: (k,) for k in (0, 1, 20, 3, 4, 5)}


def test_a_steady_state_batch_on_s3_is_one_put_and_nothing_else(s3_server, s3_bucket, tmp_path):
    """On the local S3 server: a steady-state batch of a named query makes one request, the
    PUT of its delta: no LIST, HEAD or GET (without maintenance)."""
    url, options = s3_bucket
    conf = StateStoreConf(storage_options=options, local_cache_dir=str(tmp_path))
    p = create_and_init_provider(StateStoreId(f"{url}/state", 0, 0), KEY, VALUE, conf)
    commit_id = commit_named(p, 0, ROOT_COMMIT_ID, 0)
    counts = []
    for v in range(1, 4):
        s3_server.counter.reset()
        commit_id = commit_named(p, v, commit_id, v)
        counts.append(s3_server.counter.snapshot())
    assert counts == [{"PUT": 1}] * 3


def test_two_workers_taking_a_partitions_batches_in_turn_list_nothing_once_loaded(tmp_path, monkeypatch):
    """Spark's two Python workers of an executor take partition 0's tasks in turn: each
    worker's provider is a version or more behind when its turn comes, and reaches the
    version the driver names by the deltas the other wrote, read by name: after each
    worker's first open, no listing at all, and every version reads exactly."""
    workers = [provider(tmp_path), provider(tmp_path)]
    ids = [ROOT_COMMIT_ID]
    for v in range(2):  # each worker's first open lists (a load)
        ids.append(commit_named(workers[v % 2], v, ids[-1], v))
    listings = [count_listings(monkeypatch, w) for w in workers]
    order = [0, 1, 1, 0, 0, 0, 1, 0, 1]
    for v, w in enumerate(order, start=2):
        ids.append(commit_named(workers[w], v, ids[-1], v))
    assert [len(n) for n in listings] == [0, 0]
    expected = {k: (k,) for k in range(len(ids) - 1)}
    assert contents(workers[1].get_read_store(len(ids) - 1, ids[-1])) == expected
    assert contents(provider(tmp_path).get_read_store(len(ids) - 1)) == expected


def test_a_named_attempt_on_another_lineage_than_memory_is_loaded_from_a_listing(tmp_path, monkeypatch):
    """Worker A holds its own attempt of version 3; the driver recorded worker B's attempt of
    3 (a speculative copy won) and B went on to 4. A's open of B's 4 reads 4 by name, finds
    it stands on B's 3, not A's, and loads from a listing instead: B's state, exactly."""
    a, b = provider(tmp_path), provider(tmp_path)
    ids = [ROOT_COMMIT_ID]
    for v in range(2):
        ids.append(commit_named(a, v, ids[-1], v))
    commit_named(a, 2, ids[-1], 100)  # A's attempt of 3, not recorded
    ids.append(commit_named(b, 2, ids[-1], 2))  # B's, recorded
    ids.append(commit_named(b, 3, ids[-1], 3))
    listings = count_listings(monkeypatch, a)
    store = a.get_store(4, ids[-1])
    assert listings, "another lineage than the one held: listed"
    assert contents(store) == {k: (k,) for k in range(4)}


def test_a_worker_far_behind_or_missing_a_delta_lists(tmp_path, monkeypatch):
    """More versions behind than a snapshot's interval, the listing decides (a snapshot may
    be the shorter way); a delta of the chain gone (cleaned up) is not an error either."""
    a, b = provider(tmp_path, min_deltas_for_snapshot=3), provider(tmp_path, min_deltas_for_snapshot=3)
    ids = [ROOT_COMMIT_ID, commit_named(a, 0, ROOT_COMMIT_ID, 0)]
    for v in range(1, 6):
        ids.append(commit_named(b, v, ids[-1], v))
    listings = count_listings(monkeypatch, a)
    assert contents(a.get_read_store(6, ids[-1])) == {k: (k,) for k in range(6)}
    assert listings, "five versions behind, over min_deltas_for_snapshot: listed"
    c = provider(tmp_path)
    c.get_read_store(6, ids[-1])
    ids.append(commit_named(b, 6, ids[-1], 6))
    ids.append(commit_named(b, 7, ids[-1], 7))
    os.unlink(os.path.join(store_dir(tmp_path), f"7_{ids[7]}.delta"))  # c's way by name is gone
    b.get_read_store(8, ids[-1])  # b holds it in memory; c must find another way or fail clearly
    listings = count_listings(monkeypatch, c)
    with pytest.raises(VersionNotFoundError, match=f"7_{ids[7]}.delta"):  # no other way to 8
        c.get_read_store(8, ids[-1])
    assert listings, "a delta missing on the way by name: listed"
