"""The scale simulation's counting (bench.fs_counts): the fsspec calls it records are the
operations a provider really did, and its S3 request mapping follows the stated rules.
Engine layer only: a provider on a local directory, no Spark, no coordinator."""
import os

import numpy as np
import pytest

from bench.fs_counts import CallLog, counting_store_files, object_store_requests
from statecore import StateStoreConf, StateStoreId, create_and_init_provider

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("v", "<i8")])


@pytest.fixture
def counted(tmp_path, monkeypatch):
    log = CallLog()
    monkeypatch.setattr("statecore.files.open_store_files", counting_store_files(log, str(tmp_path / "cache")))
    conf = StateStoreConf(min_deltas_for_snapshot=2, min_versions_to_retain=2, maintenance_interval_s=1e6)
    provider = create_and_init_provider(StateStoreId(str(tmp_path / "state"), 0, 0), KEY, VALUE, conf)
    return log, provider, tmp_path / "state" / "0" / "0"


def commit(provider, version, key):
    store = provider.get_store(version)
    store.put(key, (version,))
    return store.commit()


def names(directory):
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def test_each_commit_is_counted_as_what_it_did_to_the_directory(counted):
    log, provider, directory = counted
    with log.phase("first"):
        commit(provider, 0, 1)
    for version in range(1, 4):
        before = names(directory)
        with log.phase(f"commit {version}"):
            commit(provider, version, version + 1)
        after = names(directory)
        assert len(after) == len(before) + 1  # one delta appeared
        calls = log.call_counts(f"commit {version}")
        # one file written under a temporary name and renamed into place; nothing deleted
        assert calls.get("open-wb") == 1 and calls.get("mv") == 1 and "rm_file" not in calls
        # the listings a commit takes: on opening its version, and twice when committing (stale checks)
        assert calls.get("ls") == 3
        requests = object_store_requests(log.of(f"commit {version}"))
        assert requests["PUT"] == 1 and requests["COPY"] == 1 and requests["DELETE"] == 1
        assert requests["LIST"] == 3
    written = [d["bytes"] for c, d in log.of("commit 3") if c == "open"]
    new = sorted(set(names(directory)) - set(before))
    assert written == [os.path.getsize(directory / new[0])]


def test_maintenance_is_counted_as_the_snapshots_and_deletes_it_made(counted):
    log, provider, directory = counted
    for version in range(6):
        commit(provider, version, version)
    provider.do_maintenance()  # the first snapshot: nothing older may go yet
    for version in range(6, 10):
        commit(provider, version, version)
    before = set(names(directory))
    with log.phase("maintenance"):
        provider.do_maintenance()
    after = set(names(directory))
    calls = log.call_counts("maintenance")
    snapshots = [n for n in after - before if n.endswith(".snapshot")]
    assert len(snapshots) == 1
    assert calls.get("open-wb") == 1 and calls.get("mv") == 1  # the snapshot, written as a commit's delta is
    assert calls.get("rm_file", 0) == len(before - after) > 0  # one DELETE per file cleanup removed
    requests = object_store_requests(log.of("maintenance"))
    assert requests["DELETE"] == len(before - after) + 1  # and the rename's


def test_a_load_reads_every_delta_since_the_snapshot(counted, tmp_path):
    log, provider, directory = counted
    for version in range(5):
        commit(provider, version, version)
    provider.close()
    conf = StateStoreConf(min_deltas_for_snapshot=2, min_versions_to_retain=2, maintenance_interval_s=1e6)
    with log.phase("load"):
        fresh = create_and_init_provider(StateStoreId(str(tmp_path / "state"), 0, 0), KEY, VALUE, conf)
        store = fresh.get_read_store(5)
    assert store.get((4,)) is not None
    store.abort()
    calls = log.call_counts("load")
    deltas = len([n for n in names(directory) if n.endswith(".delta")])
    assert calls.get("open-rb") == deltas == 5  # each delta read whole, no snapshot yet
    assert calls.get("cat_file", 0) >= 1  # the schema file, and the headers the walk reads


def test_request_mapping():
    calls = [("ls", {"entries": 2500}), ("info", {}), ("cat_file", {"bytes": 64}), ("open", {"mode": "rb", "bytes": 9}),
             ("open", {"mode": "wb", "bytes": 10}), ("open", {"mode": "wb", "bytes": 250}), ("mv", {"bytes": 10}),
             ("rm_file", {}), ("makedirs", {}), ("get_file", {"bytes": 5})]
    assert object_store_requests(calls, part_bytes=100) == {
        "LIST": 3, "HEAD": 3, "GET": 3, "PUT": 1 + (2 + 3), "COPY": 1, "DELETE": 2}
