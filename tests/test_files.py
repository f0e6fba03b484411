"""StoreFiles: Spark's listing rule, atomic writes under injected faults, reads, deletes, mapping."""
import logging
import os
import threading
import time
import uuid

import fsspec
import pytest

import statecore.files
from statecore.files import FaultInjectingFiles, StoreFiles, open_store_files

LOGGER = "statecore.files"


@pytest.fixture
def memory_root():
    """A memory:// directory of this test only, removed afterwards (the memory fs is global)."""
    root = f"memory://statecore-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path, memory_root):
    """A store directory on each filesystem the tests cover."""
    return str(tmp_path / "0" / "3") if request.param == "local" else memory_root + "/0/3"


def put_raw(files, name, data=b"x"):
    """Create a file behind StoreFiles' back, as another process (or a crash) would leave it."""
    files.fs.makedirs(files.path(name).rsplit("/", 1)[0], exist_ok=True)
    files.fs.pipe_file(files.path(name), data)


def raw_names(files):
    """Every entry of the directory, temporary files included."""
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in files.fs.ls(files.location, detail=False))


def content(path):
    with open(path, "rb") as f:
        return f.read()


def writer(data):
    return lambda f: f.write(data)


# -- locations -------------------------------------------------------------------------------

def test_plain_relative_and_file_url_locations_are_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for loc in [str(tmp_path / "a"), "rel/dir", f"file://{tmp_path}/b"]:
        files = StoreFiles(loc)
        assert files.is_local and files.location == loc
        assert os.path.isabs(files.path("1.delta"))
    assert StoreFiles("rel/dir").path("1.delta") == f"{tmp_path}/rel/dir/1.delta"
    assert StoreFiles(f"file://{tmp_path}/b").path("1.delta") == f"{tmp_path}/b/1.delta"


def test_memory_location_is_not_local_and_paths_are_urls(memory_root):
    files = StoreFiles(memory_root + "/0/3")
    assert not files.is_local and files.location == memory_root + "/0/3"
    assert files.path("7.snapshot").startswith("memory://")
    assert files.path("7.snapshot").endswith("/0/3/7.snapshot")


@pytest.mark.parametrize("bad", ["", "/abs", "../1.delta", "a/../1.delta", "a//b", "./1.delta"])
def test_names_must_stay_inside_the_directory(tmp_path, bad):
    with pytest.raises(ValueError, match="file name"):
        StoreFiles(str(tmp_path)).path(bad)


def test_open_store_files_is_the_factory(tmp_path):
    files = open_store_files(str(tmp_path), None, str(tmp_path / "cache"))
    assert type(files) is StoreFiles and files.local_cache_dir == str(tmp_path / "cache")


# -- listing ---------------------------------------------------------------------------------

def test_listing_follows_sparks_two_part_rule(location, caplog):
    files = StoreFiles(location)
    files.mkdirs()
    for name in ["1.delta", "2.DELTA", "3.delta", "3.snapshot", "4.Snapshot", "10.delta",
                 ".5.delta.0f1e.tmp", "5.delta.tmp", "6", "abc.delta", "7.txt", "-1.delta",
                 "+8.delta", "1e3.delta"]:
        put_raw(files, name)
    put_raw(files, "_metadata/schema")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        deltas, snapshots = files.list_versions()
    assert deltas == {1: "1.delta", 2: "2.DELTA", 3: "3.delta", 10: "10.delta"}
    assert list(deltas) == [1, 2, 3, 10]
    assert snapshots == {3: "3.snapshot", 4: "4.Snapshot"}
    warned = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warned) == 5 and all(m.startswith("Could not identify file ") for m in warned)
    for name in ["abc.delta", "7.txt", "-1.delta", "+8.delta", "1e3.delta"]:
        assert any(files.path(name) in m for m in warned), name


def test_same_version_under_two_names_keeps_the_canonical_one(tmp_path, caplog):
    files = StoreFiles(str(tmp_path))
    for name in ["007.delta", "7.delta", "08.snapshot"]:
        put_raw(files, name)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        deltas, snapshots = files.list_versions()
    assert deltas == {7: "7.delta"} and snapshots == {8: "08.snapshot"}
    assert any("007.delta" in r.getMessage() for r in caplog.records)


def test_missing_directory_has_no_files(location):
    assert StoreFiles(location).list_versions() == ({}, {})


def test_directories_named_like_versions_are_ignored(tmp_path, caplog):
    (tmp_path / "4.delta").mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert StoreFiles(str(tmp_path)).list_versions() == ({}, {})
    assert not caplog.records


# -- atomic writes ---------------------------------------------------------------------------

def test_write_atomic_writes_and_returns_the_size(location):
    files = StoreFiles(location)
    files.mkdirs()
    assert files.write_atomic("1.delta", writer(b"hello")) == 5
    assert files.read_bytes("1.delta") == b"hello"
    assert files.write_atomic("1.delta", writer(b"replaced!")) == 9
    assert files.read_bytes("1.delta") == b"replaced!"
    assert raw_names(files) == ["1.delta"]


def test_on_flushed_sees_the_whole_temporary_file_before_the_rename(location):
    files = StoreFiles(location)
    seen = []

    def on_flushed(path):
        assert not files.exists("5.snapshot")  # not renamed yet
        seen.append(content(path))

    files.write_atomic("5.snapshot", writer(b"whole content"), on_flushed=on_flushed)
    assert files.read_bytes("5.snapshot") == b"whole content"
    # local only: a remote temporary file has no local path to map
    assert seen == ([b"whole content"] if files.is_local else [])


def test_write_atomic_creates_missing_parents(location):
    files = StoreFiles(location)
    assert files.write_atomic("_metadata/schema", writer(b"{}")) == 2
    assert files.exists("_metadata/schema") and files.read_bytes("_metadata/schema") == b"{}"


def test_write_atomic_without_overwrite_refuses_an_existing_file(location):
    files = StoreFiles(location)
    assert files.write_atomic("_metadata/schema", writer(b"first"), overwrite=False) == 5
    with pytest.raises(FileExistsError) as e:
        files.write_atomic("_metadata/schema", writer(b"second"), overwrite=False)
    assert e.value.filename == files.path("_metadata/schema")
    assert files.read_bytes("_metadata/schema") == b"first"
    assert raw_names(files) == ["_metadata"]


def test_without_overwrite_a_file_appearing_during_the_write_wins(location):
    files = StoreFiles(location)
    files.mkdirs()

    def racing(f):
        f.write(b"mine")
        put_raw(files, "schema", b"theirs")  # another writer renames first

    with pytest.raises(FileExistsError):
        files.write_atomic("schema", racing, overwrite=False)
    assert files.read_bytes("schema") == b"theirs"
    assert raw_names(files) == ["schema"]


def test_a_failing_write_callback_leaves_the_old_file_and_no_temp(location):
    files = StoreFiles(location)
    files.write_atomic("2.delta", writer(b"committed"))

    def broken(f):
        f.write(b"half")
        raise KeyError("boom in the writer")

    with pytest.raises(KeyError, match="boom in the writer"):
        files.write_atomic("2.delta", broken)
    assert files.read_bytes("2.delta") == b"committed"
    assert raw_names(files) == ["2.delta"]


@pytest.mark.parametrize("step", ["write", "flush", "fsync", "rename"])
def test_a_fault_at_any_write_step_leaves_the_old_file_and_no_temp(location, step):
    files = FaultInjectingFiles(location)
    files.write_atomic("3.snapshot", writer(b"old"))
    files.arm(step, "*.snapshot")
    with pytest.raises(OSError, match=f"^injected fault at {step} of 3.snapshot$"):
        files.write_atomic("3.snapshot", writer(b"new and longer"))
    assert files.read_bytes("3.snapshot") == b"old"
    assert raw_names(files) == ["3.snapshot"]
    assert files.raised == {step: 1}
    # Disarmed after one fault: the next write goes through.
    assert files.write_atomic("3.snapshot", writer(b"new")) == 3
    assert files.read_bytes("3.snapshot") == b"new"
    assert files.calls["write"] == 3 and files.calls["rename"] == 2 + (step == "rename")


def test_a_write_fault_tears_the_write_at_after_bytes(location):
    files = FaultInjectingFiles(location)
    files.mkdirs()
    done = []

    def chunks(f):
        for chunk in (b"abc", b"defg", b"hi"):
            f.write(chunk)
            done.append(chunk)

    files.arm("write", after_bytes=5)
    with pytest.raises(OSError, match="injected fault at write of 4.delta"):
        files.write_atomic("4.delta", chunks)
    assert done == [b"abc"] and raw_names(files) == []
    # A callback that writes less than after_bytes fails when it returns.
    files.arm("write", after_bytes=100)
    with pytest.raises(OSError, match="injected fault at write"):
        files.write_atomic("4.delta", chunks)
    assert files.calls["flush"] == 0 and files.raised["write"] == 2
    assert not files.exists("4.delta") and raw_names(files) == []


def test_faults_match_by_glob_and_count(tmp_path):
    files = FaultInjectingFiles(str(tmp_path))
    files.arm("rename", "*.snapshot", times=2)
    files.write_atomic("1.delta", writer(b"d"))
    for _ in range(2):
        with pytest.raises(OSError):
            files.write_atomic("1.snapshot", writer(b"s"))
    files.write_atomic("1.snapshot", writer(b"s"))
    files.arm("read", "1.*", times=None)
    for _ in range(3):
        with pytest.raises(OSError, match="injected fault at read of 1.delta"):
            files.read_bytes("1.delta")
    files.disarm("read")
    assert files.read_bytes("1.delta") == b"d"
    assert files.calls["read"] == 4
    with pytest.raises(ValueError, match="unknown step"):
        files.arm("close")


def test_fault_injection_reaches_the_store_through_the_factory(tmp_path, monkeypatch):
    made = []

    def faulty(location, storage_options=None, local_cache_dir=None):
        made.append(FaultInjectingFiles(location, storage_options, local_cache_dir))
        made[-1].arm("rename")
        return made[-1]

    monkeypatch.setattr(statecore.files, "open_store_files", faulty)
    files = statecore.files.open_store_files(str(tmp_path))
    with pytest.raises(OSError, match="injected fault at rename"):
        files.write_atomic("1.delta", writer(b"x"))
    assert made == [files] and os.listdir(tmp_path) == []


# -- reads and deletes ------------------------------------------------------------------------

def test_reads(location):
    files = StoreFiles(location)
    files.write_atomic("5.delta", writer(bytes(range(100))))
    assert files.read_range("5.delta", 0, 72) == bytes(range(72))
    assert files.read_range("5.delta", 90, 72) == bytes(range(90, 100))
    assert files.read_range("5.delta", 10, 0) == b""
    with files.open_read("5.delta") as f:
        assert f.read() == bytes(range(100))
    assert files.exists("5.delta") and not files.exists("6.delta")
    with pytest.raises(ValueError):
        files.read_range("5.delta", -1, 2)


@pytest.mark.parametrize("read", [
    lambda files: files.read_bytes("9.delta"),
    lambda files: files.read_range("9.delta", 0, 72),
    lambda files: files.read_range("9.delta", 0, 0),
    lambda files: files.open_read("9.delta").close(),
    lambda files: files.local_path_for_mapping("9.delta"),
], ids=["read_bytes", "read_range", "read_range_empty", "open_read", "mapping"])
def test_reading_a_missing_file_is_file_not_found(location, tmp_path, read):
    files = StoreFiles(location, local_cache_dir=str(tmp_path / "cache"))
    files.mkdirs()
    with pytest.raises(FileNotFoundError):
        read(files)


def test_delete_is_best_effort(location, caplog):
    files = FaultInjectingFiles(location)
    for name in ["1.delta", "2.delta", "3.delta"]:
        files.write_atomic(name, writer(b"x"))
    files.arm("delete", "2.*")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        deleted = files.delete(["1.delta", "2.delta", "3.delta", "4.delta"])
    assert deleted == ["1.delta", "3.delta"]
    assert raw_names(files) == ["2.delta"]
    assert any("Could not delete file" in r.getMessage() and files.path("2.delta") in r.getMessage()
               for r in caplog.records)
    assert files.delete([]) == [] and files.delete(["2.delta"]) == ["2.delta"]


def test_old_temporary_files_are_found_young_ones_and_others_are_not(location, monkeypatch):
    files = StoreFiles(location)
    files.write_atomic("1.delta", writer(b"x"))
    leftover = ".2.delta." + "ab" * 16 + ".tmp"
    put_raw(files, leftover)
    put_raw(files, ".notes.txt")  # hidden, but not a name write_atomic makes
    assert files.temporary_files(older_than_s=3600) == []  # just written: maybe a live writer
    later = time.time() + 7200
    monkeypatch.setattr(statecore.files.time, "time", lambda: later)
    assert files.temporary_files(older_than_s=3600) == [leftover]
    assert files.delete([leftover]) == [leftover]
    assert raw_names(files) == [".notes.txt", "1.delta"]


# -- local paths for mapping --------------------------------------------------------------------

def test_local_files_are_mapped_in_place(tmp_path):
    files = StoreFiles(str(tmp_path), local_cache_dir=str(tmp_path / "cache"))
    files.write_atomic("3.snapshot", writer(b"snap"))
    assert files.local_path_for_mapping("3.snapshot") == files.path("3.snapshot")
    assert not (tmp_path / "cache").exists()


def test_remote_files_are_copied_to_the_cache_once(memory_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    files = StoreFiles(memory_root + "/0/3", local_cache_dir=str(cache))
    copies = []
    real_get_file = files.fs.get_file
    monkeypatch.setattr(files.fs, "get_file",
                        lambda rpath, lpath, **kw: copies.append(rpath) or real_get_file(rpath, lpath, **kw))
    files.write_atomic("3.snapshot", writer(b"version one"))
    first = files.local_path_for_mapping("3.snapshot")
    assert os.path.dirname(first) == str(cache) and first.endswith("3.snapshot")
    assert content(first) == b"version one"
    assert files.local_path_for_mapping("3.snapshot") == first and len(copies) == 1
    # Another StoreFiles on the same directory (a new provider) reuses the copy too.
    again = StoreFiles(memory_root + "/0/3", local_cache_dir=str(cache))
    assert again.local_path_for_mapping("3.snapshot") == first and len(copies) == 1

    files.write_atomic("3.snapshot", writer(b"version two, re-committed"))
    second = files.local_path_for_mapping("3.snapshot")
    assert second != first and len(copies) == 2
    assert content(second) == b"version two, re-committed"
    assert os.listdir(cache) == [os.path.basename(second)]  # the stale copy is gone

    files.write_atomic("4.snapshot", writer(b"other"))
    other = files.local_path_for_mapping("4.snapshot")
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(second), os.path.basename(other)])
    assert files.delete(["3.snapshot"]) == ["3.snapshot"]
    assert os.listdir(cache) == [os.path.basename(other)]


def test_same_name_in_another_directory_gets_its_own_copy(memory_root, tmp_path):
    cache = str(tmp_path / "cache")
    a = StoreFiles(memory_root + "/0/1", local_cache_dir=cache)
    b = StoreFiles(memory_root + "/0/2", local_cache_dir=cache)
    a.write_atomic("1.snapshot", writer(b"aaaa"))
    b.write_atomic("1.snapshot", writer(b"bbbb"))
    pa, pb = a.local_path_for_mapping("1.snapshot"), b.local_path_for_mapping("1.snapshot")
    assert pa != pb
    assert content(pa) == b"aaaa" and content(pb) == b"bbbb"


def test_remote_mapping_needs_a_cache_dir(memory_root):
    files = StoreFiles(memory_root)
    files.write_atomic("1.snapshot", writer(b"s"))
    with pytest.raises(ValueError, match="local_cache_dir"):
        files.local_path_for_mapping("1.snapshot")


def test_threads_mapping_one_file_agree(memory_root, tmp_path):
    files = StoreFiles(memory_root, local_cache_dir=str(tmp_path / "cache"))
    files.write_atomic("9.snapshot", writer(b"z" * 4096))
    paths, errors = [], []

    def run():
        try:
            paths.append(files.local_path_for_mapping("9.snapshot"))
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert content(paths[0]) == b"z" * 4096
    assert [n for n in os.listdir(tmp_path / "cache") if n.startswith(".")] == []
