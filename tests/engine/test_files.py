"""StoreFiles: the version files' naming rules and listings, atomic and pending writes under injected
faults, durable directories, refused locations, reads, deletes, mapping and cache copies."""
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest

import statecore.files
from statecore.faults import FaultInjectingFiles
from statecore.files import PendingFile, StoreFiles, open_store_files
from statecore.lineage import Listing, VersionFile, parse_name
from tests.paths import REPO_ROOT
from tests.store_support import inject_faulty_files, open_numbered

LOGGER = "statecore.files"


@pytest.fixture
def memory_root():
    """A memory:// directory of this test only, removed afterwards (the memory fs is global)."""
    root = f"memory://statecore-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory", "s3"])
def location(request, tmp_path, memory_root):
    """A store directory on each filesystem the tests cover (s3: a bucket of the local S3
    server, reached through the environment)."""
    if request.param == "s3":
        return request.getfixturevalue("s3_env") + "/0/3"
    return str(tmp_path / "0" / "3") if request.param == "local" else memory_root + "/0/3"


def put_raw(files, name, data=b"x"):
    """Create a file behind StoreFiles' back, as another process (or a crash) would leave it."""
    files.fs.makedirs(files.path(name).rsplit("/", 1)[0], exist_ok=True)
    files.fs.pipe_file(files.path(name), data)


def raw_names(files):
    """Every entry of the directory, temporary files included (none for a prefix of an object
    store that holds no object)."""
    files.fs.invalidate_cache()
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in files.fs.ls(files.location, detail=False))
    except FileNotFoundError:
        return []


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
ID_A, ID_B, ID_C = "0123456789abcdef", "fedcba9876543210", "00000000000000ff"


def listed(listing):
    """A Listing as sorted (version, commit id hex or None, kind, name) tuples."""
    return sorted((f.version, f.commit_id.hex() if f.commit_id is not None else None, f.kind, f.name)
                  for f in listing)


def by_name(f):
    return f.name


def test_listing_follows_the_naming_rules(location, caplog):
    files = StoreFiles(location)
    files.mkdirs()
    versions = [f"1_{ID_A}.delta", f"1_{ID_B}.delta", "2.delta", f"3_{ID_C}.snapshot", "3.snapshot",
                f"10_{ID_A}.delta", "7.delta", f"{2**63 - 1}.delta"]
    # names that look like <x>.delta or <x>.snapshot but are no version: logged, ignored
    logged = ["abc.delta", "-1.delta", "+8.delta", "1e3.delta", f"5_{ID_A.upper()}.delta",
              f"5_{ID_A[:15]}.delta", f"5_{ID_A}0.delta", f"5-{ID_A}.delta", "\u0663.delta",
              "\uff15.snapshot", f"{2**63}.delta", f"_{ID_A}.delta", "5_.delta",
              "05.delta", "5.DELTA", f"3_{ID_C}.Snapshot", f"03_{ID_C}.snapshot"]  # no writer makes these
    # other names: ignored quietly
    quiet = [f".5_{ID_A}.delta.{'0f' * 16}.tmp", "5.delta.tmp", "6", "7.txt", f"5_{ID_A}.delta.bak",
             "_statecore.schema.json", "8.deltas"]
    for name in versions + logged + quiet:
        put_raw(files, name)
    put_raw(files, "_metadata/schema")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        listing = files.list_versions()
    assert isinstance(listing, Listing)
    a, b, c = bytes.fromhex(ID_A), bytes.fromhex(ID_B), bytes.fromhex(ID_C)
    assert sorted(listing.of("delta", 1), key=by_name) == [VersionFile(1, a, "delta", f"1_{ID_A}.delta"),
                                                            VersionFile(1, b, "delta", f"1_{ID_B}.delta")]
    assert list(listing.of("delta", 2)) == [VersionFile(2, None, "delta", "2.delta")]
    assert sorted(listing.of("snapshot", 3), key=by_name) == [
        VersionFile(3, None, "snapshot", "3.snapshot"), VersionFile(3, c, "snapshot", f"3_{ID_C}.snapshot")]
    assert list(listing.of("delta", 7)) == [VersionFile(7, None, "delta", "7.delta")]
    assert list(listing.of("delta", 3)) == [] and list(listing.of("snapshot", 1)) == []
    assert listing.versions("delta") == [1, 2, 7, 10, 2**63 - 1]
    assert listing.versions("snapshot") == [3]
    assert listing.versions() == [1, 2, 3, 7, 10, 2**63 - 1]
    assert listing.top == 2**63 - 1
    assert listing.names == frozenset(versions)
    assert sorted(f.name for f in listing) == sorted(versions)
    assert sorted(f.name for f in listing.newer_than(7)) == [f"10_{ID_A}.delta", f"{2**63 - 1}.delta"]
    warned = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert all(m.startswith("Could not identify file ") for m in warned), warned
    assert sorted(warned) == sorted(f"Could not identify file {files.path(n)} in store directory "
                                    f"{files.path(n).rsplit('/', 1)[0]}; ignoring it" for n in logged)


@pytest.mark.parametrize("name,expected", [
    (f"5_{ID_A}.delta", (5, bytes.fromhex(ID_A), "delta")),
    ("12.delta", (12, None, "delta")),
    ("0.snapshot", (0, None, "snapshot")),
    (f"{2**63 - 1}_{ID_B}.snapshot", (2**63 - 1, bytes.fromhex(ID_B), "snapshot")),
    (f"{2**63}.delta", None), (f"5_{ID_A.upper()}.delta", None), (f"5_{ID_A}", None), ("5.tmp", None),
    ("\u0665.delta", None), (" 5.delta", None), ("5.delta ", None), (f"5_{ID_A}.delta.tmp", None),
    (f".5_{ID_A}.delta", None), ("5.changelog", None),
    # what no writer makes (Java's Long.toString has no leading zero; kinds are lower case): a foreign file
    ("05.delta", None), ("5.DELTA", None), ("0012.Delta", None), (f"5_{ID_A}.SNAPSHOT", None), ("00.delta", None),
])
def test_parse_name(name, expected):
    parsed = parse_name(name)
    if expected is None:
        assert parsed is None
    else:
        assert parsed == VersionFile(*expected, name)


def test_two_attempts_of_a_version_and_an_old_name_of_it_are_all_listed(tmp_path, caplog):
    """Attempts never hide one another: a listing keeps every file of a version (which one
    a load follows is the lineage's business, read from the checked headers)."""
    files = StoreFiles(str(tmp_path))
    for name in ["7.delta", f"7_{ID_A}.delta", f"7_{ID_B}.delta", "8.snapshot"]:
        put_raw(files, name)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        listing = files.list_versions()
    assert sorted(f.name for f in listing.of("delta", 7)) == ["7.delta", f"7_{ID_A}.delta", f"7_{ID_B}.delta"]
    assert [f.name for f in listing.of("snapshot", 8)] == ["8.snapshot"]
    assert listing.top == 8 and not caplog.records
    # a listing equals another of the same names, whatever their order
    assert listing == files.list_versions() and listing != Listing()


def test_missing_directory_has_no_files(location):
    listing = StoreFiles(location).list_versions()
    assert list(listing) == [] and listing == Listing() and listing.names == frozenset()
    assert listing.top == 0 and listing.versions() == [] and list(listing.of("delta", 1)) == []


def test_directories_named_like_versions_are_ignored(location, caplog):
    files = StoreFiles(location)
    files.mkdirs()
    for name in ["4.delta", f"5_{ID_A}.delta", f"6_{ID_B}.snapshot", "7.snapshot"]:
        put_raw(files, name + "/inside")  # a directory of that name (with a file: fsspec's memory fs
        #                                   keeps no empty directories)
    put_raw(files, f"3_{ID_C}.delta")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        listing = files.list_versions()
        stale = files.temporary_files(older_than_s=-1)
    assert listed(listing) == [(3, ID_C, "delta", f"3_{ID_C}.delta")]
    assert stale == []
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
    made = inject_faulty_files(monkeypatch)
    files = statecore.files.open_store_files(str(tmp_path))
    files.arm("rename")
    with pytest.raises(OSError, match="injected fault at rename"):
        files.write_atomic("1.delta", writer(b"x"))
    assert made == [files] and os.listdir(tmp_path) == []


# -- pending writes (a commit's delta) ----------------------------------------------------------

def temporaries(files):
    return [n for n in raw_names(files) if n.endswith(".tmp")]


def test_write_pending_is_invisible_until_published(location):
    files = StoreFiles(location)
    files.mkdirs()
    name = f"5_{ID_A}.delta"
    pending = files.write_pending(name, writer(b"whole delta"))
    assert isinstance(pending, PendingFile)
    assert not files.exists(name) and list(files.list_versions()) == []
    if files.is_object_store:  # held locally until published: nothing of it in the store
        assert raw_names(files) == []
    else:
        [tmp] = temporaries(files)
        assert tmp.startswith(f".{name}.") and files.read_bytes(tmp) == b"whole delta"  # whole, under its own name
    assert pending.publish() == len(b"whole delta")
    assert files.read_bytes(name) == b"whole delta" and raw_names(files) == [name]
    assert [f.name for f in files.list_versions()] == [name]
    pending.discard()  # harmless after publish
    assert raw_names(files) == [name]


def test_write_pending_discard_leaves_nothing(location):
    files = StoreFiles(location)
    files.write_atomic(f"5_{ID_B}.delta", writer(b"another attempt"))
    pending = files.write_pending(f"5_{ID_A}.delta", writer(b"never published"))
    assert len(temporaries(files)) == (0 if files.is_object_store else 1)
    pending.discard()
    pending.discard()  # twice: harmless
    assert raw_names(files) == [f"5_{ID_B}.delta"]
    assert files.read_bytes(f"5_{ID_B}.delta") == b"another attempt"


def test_write_pending_then_publish_over_an_existing_file(location):
    """publish() replaces a file of that name (a re-written name of the old layout), and with
    overwrite=False refuses to, deleting its temporary file."""
    files = StoreFiles(location)
    files.write_atomic("3.delta", writer(b"old"))
    files.write_pending("3.delta", writer(b"new")).publish()
    assert files.read_bytes("3.delta") == b"new"
    refused = files.write_pending("3.delta", writer(b"newer"))
    with pytest.raises(FileExistsError):
        refused.publish(overwrite=False)
    assert files.read_bytes("3.delta") == b"new" and raw_names(files) == ["3.delta"]


@pytest.mark.parametrize("step,after_bytes", [("write", 0), ("write", 3), ("flush", 0), ("fsync", 0)])
def test_write_pending_failing_while_written_leaves_nothing(location, step, after_bytes):
    files = FaultInjectingFiles(location)
    files.mkdirs()
    files.arm(step, "*.delta", after_bytes=after_bytes)
    with pytest.raises(OSError, match=f"^injected fault at {step} of 5_{ID_A}.delta$"):
        files.write_pending(f"5_{ID_A}.delta", writer(b"never visible"))
    assert files.raised == {step: 1}
    assert raw_names(files) == [] and list(files.list_versions()) == []
    # nothing stays armed: the next attempt is written and published
    files.write_pending(f"5_{ID_A}.delta", writer(b"visible")).publish()
    assert raw_names(files) == [f"5_{ID_A}.delta"]


def test_write_pending_failing_rename_leaves_nothing(location):
    files = FaultInjectingFiles(location)
    files.mkdirs()
    pending = files.write_pending(f"5_{ID_A}.delta", writer(b"durable, not visible"))
    files.arm("rename")
    with pytest.raises(OSError, match="injected fault at rename"):
        pending.publish()
    assert raw_names(files) == []
    pending.discard()  # after a failed publish: nothing left to delete, no error
    assert raw_names(files) == []


def test_write_pending_callback_error_leaves_nothing(location):
    files = StoreFiles(location)
    files.mkdirs()

    def broken(f):
        f.write(b"half")
        raise KeyError("boom in the encoder")

    with pytest.raises(KeyError, match="boom in the encoder"):
        files.write_pending(f"5_{ID_A}.delta", broken)
    assert raw_names(files) == []


@pytest.fixture
def synced(monkeypatch):
    """(st_dev, st_ino) of every descriptor fsynced during the test."""
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(statecore.files.os, "fsync", recording_fsync)
    return synced


def test_write_pending_fsyncs_the_temporary_file_before_it_returns(tmp_path, synced):
    """The pending file is durable before the merge's outcome is known: its bytes were
    fsynced under the temporary name; publishing then fsyncs the directory."""
    files = StoreFiles(str(tmp_path))
    pending = files.write_pending(f"5_{ID_A}.delta", writer(b"payload"))
    tmp = os.stat(pending.tmp)
    assert synced == [(tmp.st_dev, tmp.st_ino)]  # the file, nothing else yet
    pending.publish()
    directory = os.stat(tmp_path)
    assert synced[1:] == [(directory.st_dev, directory.st_ino)]
    assert os.stat(files.path(f"5_{ID_A}.delta")).st_ino == tmp.st_ino  # renamed, not copied


# -- durability of directories ---------------------------------------------------------------------

def test_new_directories_are_fsynced_into_their_parents(tmp_path, synced_dirs):
    files = StoreFiles(str(tmp_path / "ckpt" / "0" / "3"))
    files.mkdirs()
    # each new directory's parent, synced once the new directory is in it, top down
    assert synced_dirs == [(str(tmp_path), ["ckpt"]), (str(tmp_path / "ckpt"), ["0"]),
                           (str(tmp_path / "ckpt" / "0"), ["3"])]
    synced_dirs.clear()
    files.mkdirs()  # existing: nothing to sync
    assert synced_dirs == []


def test_a_write_into_a_new_directory_syncs_its_parent_and_itself(tmp_path, synced_dirs):
    files = StoreFiles(str(tmp_path / "ckpt" / "0" / "3"))
    files.mkdirs()
    synced_dirs.clear()
    files.write_atomic("_metadata/schema", writer(b"{}"))
    store = str(tmp_path / "ckpt" / "0" / "3")
    assert synced_dirs == [(store, ["_metadata"]), (store + "/_metadata", ["schema"])]


def test_new_directories_are_fsynced_by_descriptor(tmp_path, synced):
    """The same through os.fsync: the descriptors synced are the new directories' parents."""
    (tmp_path / "ckpt").mkdir()
    StoreFiles(str(tmp_path / "ckpt" / "0" / "3")).mkdirs()
    ident = [(os.stat(p).st_dev, os.stat(p).st_ino) for p in (tmp_path / "ckpt", tmp_path / "ckpt" / "0")]
    assert synced == ident  # not tmp_path: "ckpt" was there already


# -- locations that fsspec would misread -------------------------------------------------------------

@pytest.mark.parametrize("location", ["memory://ckpt::x/0/3", "s3://bucket/a::b/0/3", "/tmp/a::b/0/3",
                                      "file:///tmp/a::b", "rel::dir", "simplecache::s3://bucket/x"])
def test_locations_with_a_double_colon_are_refused(location):
    with pytest.raises(ValueError, match="may not contain '::'"):
        StoreFiles(location)
    with pytest.raises(ValueError, match="may not contain '::'"):
        open_store_files(location)


def test_a_provider_on_a_location_with_a_double_colon_creates_nothing(tmp_path):
    from statecore import StateStoreConf, StateStoreId, create_and_init_provider
    import numpy as np

    root = tmp_path / "ckpt::other"
    with pytest.raises(ValueError, match="may not contain '::'"):
        create_and_init_provider(StateStoreId(str(root), 0, 0), np.dtype([("k", "<i8")]),
                                 np.dtype([("v", "<i8")]), StateStoreConf())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("root", ["{tmp}/a::b", "file://{tmp}/a::b", "memory://x::y"])
def test_root_with_double_colon_is_refused(tmp_path, root):
    with pytest.raises(ValueError, match="::"):
        open_numbered(root.format(tmp=tmp_path))


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
    # An object store's DELETE succeeds whether or not the object was there (no HEAD first).
    assert deleted == ["1.delta", "3.delta"] + (["4.delta"] if files.is_object_store else [])
    assert raw_names(files) == ["2.delta"]
    assert any("Could not delete file" in r.getMessage() and files.path("2.delta") in r.getMessage()
               for r in caplog.records)
    assert files.delete([]) == [] and files.delete(["2.delta"]) == ["2.delta"]


def test_old_temporary_files_are_found_young_ones_and_others_are_not(location, monkeypatch):
    files = StoreFiles(location)
    files.write_atomic(f"1_{ID_A}.delta", writer(b"x"))
    leftovers = [f".2_{ID_B}.delta." + "ab" * 16 + ".tmp",  # a pending delta whose commit was killed
                 ".2.delta." + "cd" * 16 + ".tmp"]  # one of the old layout
    for name in leftovers:
        put_raw(files, name)
    put_raw(files, ".notes.txt")  # hidden, but not a name write_atomic makes
    put_raw(files, f".3_{ID_A}.delta." + "ef" * 16 + ".tmp/inside")  # a directory: never a leftover
    assert files.temporary_files(older_than_s=3600) == []  # just written: maybe a live writer
    later = time.time() + 7200
    monkeypatch.setattr(statecore.files.time, "time", lambda: later)
    assert files.temporary_files(older_than_s=3600) == sorted(leftovers)
    assert files.delete(leftovers) == leftovers
    assert raw_names(files) == sorted([".notes.txt", f".3_{ID_A}.delta." + "ef" * 16 + ".tmp", f"1_{ID_A}.delta"])


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

    # Names of the old layout (<v>.snapshot) are re-written when a version is re-committed by
    # an older engine: the copy must follow the source, not the name.
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


def test_remote_mapping_without_a_cache_dir_copies_to_the_default_one(memory_root):
    """An executor given no local_cache_dir maps a remote image snapshot from a copy in the
    private per-user cache directory, where the images of packed snapshots go (it was refused)."""
    from statecore.localcache import default_cache_dir

    files = StoreFiles(memory_root)
    files.write_atomic("1.snapshot", writer(b"s"))
    path = files.local_path_for_mapping("1.snapshot")
    assert os.path.dirname(path) == default_cache_dir() and content(path) == b"s"


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


# -- reads refuse what is not a regular file, and sizes past the format's bound ------------

def _fifo_in(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def test_a_fifo_where_a_file_should_be_is_refused_at_once_by_every_read(tmp_path):
    """A user (or an attacker) leaves a FIFO named like a delta: a plain open() would block
    until something writes to it; every read refuses it instead, without waiting."""
    from statecore.errors import UnsafeFileError
    files = StoreFiles(str(tmp_path))
    _fifo_in(tmp_path, "1.delta")
    for read in (lambda: files.read_bytes("1.delta"), lambda: files.read_range("1.delta", 0, 8),
                 lambda: files.open_read("1.delta"), lambda: files.local_path_for_mapping("1.delta")):
        with pytest.raises(UnsafeFileError, match="FIFO"):
            read()


def test_a_link_to_a_device_and_a_directory_are_refused(tmp_path):
    from statecore.errors import UnsafeFileError
    files = StoreFiles(str(tmp_path))
    os.symlink("/dev/zero", tmp_path / "2.delta")
    (tmp_path / "3.delta").mkdir()
    with pytest.raises(UnsafeFileError, match="character device"):
        files.read_bytes("2.delta", max_bytes=1 << 20)
    with pytest.raises(UnsafeFileError, match="directory"):
        files.read_bytes("3.delta")


def test_a_sparse_file_larger_than_the_bound_is_refused_before_reading(tmp_path):
    """A sparse 8 GiB file costs nothing on disk; reading it whole would exhaust memory."""
    from statecore.errors import UnsafeFileError
    path = tmp_path / "meta.json"
    with open(path, "wb") as f:
        f.truncate(8 << 30)
    files = StoreFiles(str(tmp_path))
    with pytest.raises(UnsafeFileError, match="more than the 1024"):
        files.read_bytes("meta.json", max_bytes=1024)
    with pytest.raises(UnsafeFileError, match="more than the 1024"):
        files.open_read("meta.json", max_bytes=1024)
    path.write_bytes(b"x" * 1024)
    assert files.read_bytes("meta.json", max_bytes=1024) == b"x" * 1024


def test_memory_filesystem_reads_are_bounded_too(memory_root):
    from statecore.errors import UnsafeFileError
    files = StoreFiles(memory_root)
    files.write_atomic("big.json", lambda f: f.write(b"y" * 100))
    with pytest.raises(UnsafeFileError, match="more than the 10"):
        files.read_bytes("big.json", max_bytes=10)
    assert files.read_bytes("big.json", max_bytes=100) == b"y" * 100


def test_a_generous_bound_costs_the_file_not_the_bound(tmp_path):
    """A reader whose format allows gigabytes (import-spark's state files) reading a file of a
    few bytes: memory for the file's size, not for the bound (a child limited to 1 GiB of
    address space more than it starts with reads it under a 2 GiB bound)."""
    (tmp_path / "1.delta").write_bytes(b"z" * 100)
    checkout = str(REPO_ROOT)
    code = (f"import resource, sys; sys.path.insert(0, {checkout!r})\n"
            "from statecore.files import StoreFiles\n"
            "files = StoreFiles(sys.argv[1])\n"
            "with open('/proc/self/status') as f:\n"
            "    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmSize:'))\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
            "print(len(files.read_bytes('1.delta', max_bytes=2 << 30)))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "100", done.stderr[-2000:]


# -- object stores: one upload under the final name --------------------------------------------

def test_a_version_file_on_s3_is_one_put_never_a_copy_or_a_delete(s3_server, s3_env):
    """A commit's delta on S3 is uploaded under its own name when published: one PUT, no
    temporary object copied and deleted (S3 has no rename), nothing in the bucket before."""
    files = StoreFiles(s3_env + "/0/3")
    name = f"5_{ID_A}.delta"
    s3_server.counter.reset()
    pending = files.write_pending(name, writer(b"a whole delta"))
    assert s3_server.counter.snapshot() == {}  # nothing reaches the store before publish
    pending.publish()
    assert s3_server.counter.snapshot() == {"PUT": 1}
    assert files.read_bytes(name) == b"a whole delta" and raw_names(files) == [name]


def test_two_writers_of_a_no_overwrite_file_on_s3_the_first_wins(s3_env, monkeypatch):
    """Two processes take the operator lock (a file written with overwrite=False) at once on
    S3: both checks find no file, then both upload; the second upload is refused by the store
    (a conditional PUT, If-None-Match: *), not a silent overwrite of the first."""
    first, second = StoreFiles(s3_env + "/op"), StoreFiles(s3_env + "/op")
    first.write_atomic("_lock", writer(b"first"), overwrite=False)
    # Every existence check of the second ran before the first's upload landed.
    monkeypatch.setattr(second.fs, "exists", lambda *args, **kwargs: False)
    with pytest.raises(FileExistsError) as e:
        second.write_atomic("_lock", writer(b"second"), overwrite=False)
    monkeypatch.undo()
    assert e.value.filename == second.path("_lock")
    assert first.read_bytes("_lock") == b"first"


def test_a_large_upload_failing_on_s3_leaves_no_object_and_no_open_upload(s3_server, s3_env):
    """A snapshot larger than the upload's part size goes multipart; its upload failing
    after parts were sent (a lost connection) leaves neither an object nor an incomplete
    upload: the parts are invisible and aborted."""
    options = {"default_block_size": 5 * 2**20}  # S3's smallest part
    files = FaultInjectingFiles(s3_env + "/0/3", storage_options=options)
    files.mkdirs()
    data = os.urandom(11 * 2**20)
    pending = files.write_pending(f"7_{ID_A}.snapshot", writer(data))
    bucket = s3_env[len("s3://"):]
    sent = []
    real_put = files._put_object

    def failing_mid_upload(name, fill, exclusive):
        def fill_then_fail(f):
            fill(f)
            f.flush()  # the parts go out
            sent.append(s3_server.counter.snapshot())
            raise OSError("connection lost")
        return real_put(name, fill_then_fail, exclusive)

    files._put_object = failing_mid_upload
    s3_server.counter.reset()
    with pytest.raises(OSError, match="connection lost"):
        pending.publish()
    [counts] = sent
    assert counts.get("POST") == 1 and counts.get("PUT", 0) >= 1  # a multipart upload started, parts sent
    assert raw_names(files) == []
    assert files.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
