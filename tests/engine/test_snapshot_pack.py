"""Packed snapshots (format version 2): PackWriter and unpack_snapshot round trips over several
schemas and sizes (block boundaries included), a flipped byte in every region named by path
and offset before any of its bytes is used, snapshot_files on both layouts and on a remote
filesystem, the image cache (reused, remade when damaged, dropped with its snapshot), and a
provider switching compression over one checkpoint."""
import gc
import io
import os
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore._snapshot import (
    HEADER_SIZE, PACK_FOOTER_SIZE, PACK_HEADER_SIZE, SNAPSHOT_HEADER_SIZE, PackWriter, SnapshotReader, SnapshotWriter,
    read_snapshot_header, unpack_snapshot, write_snapshot,
)
from statecore import _snapshot_pack as snapshot_pack
from statecore._rowtable import RowTable
from statecore.errors import SchemaMismatchError, StateCorruptionError
from statecore.files import StoreFiles
from statecore.snapshot_files import check_snapshot, open_snapshot, read_header, write_snapshot_file
from tests.store_support import commit_changes

LAYOUTS = {
    "int64->count,sum": ([("k", "<i8")], [("n", "<i8"), ("s", "<i8")]),
    "bytes key and value": ([("user", "S7"), ("n", "<i4")], [("blob", "S33"), ("x", "<f8")]),
    "set": ([("k", "<u8")], []),
}
BLOCK = 4096  # the smallest packed block: many blocks from few rows


def table_of(layout, n, seed=0):
    key, value = (np.dtype(f) for f in LAYOUTS[layout])
    rng = np.random.default_rng(seed)
    keys = np.zeros(n, key)
    raw = rng.permutation(10 * n + 10)[:n]
    for f in key.names:
        keys[f] = (raw % 250) if key[f].kind in "iu" and key[f].itemsize < 8 else raw
        if key[f].kind == "S":
            keys[f] = np.char.encode(np.char.mod("u%d", raw), "ascii")
    t = RowTable(key, value)
    values = np.zeros(n, value)
    for f in value.names:
        values[f] = rng.integers(0, 99, n) if value[f].kind != "S" else b"payload-%d" % seed
    if n:
        t.put_batch(keys, values)
    return t


def image_and_packed(table, block_size=BLOCK):
    image = io.BytesIO()
    write_snapshot(image, table, 5, lineage=b"L" * 16)
    out, copy = io.BytesIO(), io.BytesIO()
    packer = PackWriter(out, block_size, image=copy)
    write_snapshot(packer, table, 5, lineage=b"L" * 16)
    assert packer.finish() == len(out.getvalue())
    assert copy.getvalue() == image.getvalue()  # the image handed on, byte for byte
    return image.getvalue(), out.getvalue()


def unpacked(packed, path="p.snapshot"):
    out = io.BytesIO()
    unpack_snapshot(io.BytesIO(packed), out, path)
    return out.getvalue()


# Row counts whose image ends on a packed block boundary, just before one and just after one
# (within a row, or the 8 bytes the image's sizes step by), at least three blocks in.
def boundary_counts(layout):
    key, value = (np.dtype(f) for f in LAYOUTS[layout])
    hits = {}
    for n in range(1, 5000):
        size = SnapshotWriter(io.BytesIO(), key, value, n, 1).file_size
        over = (size - HEADER_SIZE) % BLOCK
        if (size - HEADER_SIZE) // BLOCK < 3:
            continue
        side = "on" if over == 0 else "after" if over <= 64 else "before" if over >= BLOCK - 64 else None
        if side is not None:
            hits.setdefault(side, n)
    return [hits[k] for k in sorted(hits)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_the_image_byte_for_byte(layout):
    counts = [0, 1, 1000] + boundary_counts(layout)
    assert len(counts) >= 5, counts  # at least two of on / just before / just after a boundary
    for n in counts:
        table = table_of(layout, n, seed=n)
        image, packed = image_and_packed(table)
        assert unpacked(packed) == image, n
        h = read_snapshot_header(packed[:SNAPSHOT_HEADER_SIZE], "p")
        assert h.packed is not None and h.format_version == 2 and h.row_count == n
        assert h.file_size == len(image) and h.packed.image_size == len(image)
        assert h.packed.n_blocks == -(-(len(image) - HEADER_SIZE) // BLOCK)
        assert unpack_snapshot(io.BytesIO(packed), None, "p").row_count == n  # checking alone


def test_packed_rows_are_smaller_and_raw_blocks_stay_raw():
    rng = np.random.default_rng(3)
    table = table_of("int64->count,sum", 20000)
    image, packed = image_and_packed(table, 65536)
    assert len(packed) < 0.7 * len(image)
    # Random bytes do not shrink: blocks stored as they are, and the container costs only
    # its header, table and footer.
    key, value = np.dtype([("k", "<u8")]), np.dtype([("r", "S56")])
    t = RowTable(key, value)
    keys = np.zeros(5000, key)
    keys["k"] = np.arange(5000) * 7919 + 13
    t.put_batch(keys, np.frombuffer(rng.bytes(5000 * 56), value))
    image, packed = image_and_packed(t, 65536)
    assert unpacked(packed) == image
    assert len(packed) <= len(image) + PACK_HEADER_SIZE + PACK_FOOTER_SIZE + 16 * 8


def test_packwriter_refuses_a_short_image_and_bytes_past_its_end():
    table = table_of("set", 10)
    image, _ = image_and_packed(table)
    packer = PackWriter(io.BytesIO(), BLOCK)
    packer.write(image[:-1])
    with pytest.raises(ValueError, match="were written"):
        packer.finish()
    with pytest.raises(ValueError, match="more were given"):
        packer.write(b"xx")
    with pytest.raises(ValueError, match="power of two"):
        PackWriter(io.BytesIO(), 1000)


def test_the_packed_bytes_do_not_depend_on_how_many_blocks_are_in_flight(monkeypatch):
    """Blocks packed on the writer's thread one by one (PACK_AHEAD 0) or many in flight on
    its packing thread: the same file, byte for byte, and the same image handed on."""
    table = table_of("bytes key and value", 6000, seed=4)
    files = []
    for ahead in (0, 1, 16):
        monkeypatch.setattr(snapshot_pack, "PACK_AHEAD", ahead)
        files.append(image_and_packed(table)[1])
    assert files[0] == files[1] == files[2] and len(files[0]) > 20 * BLOCK


def pack_threads():
    return [t for t in threading.enumerate() if t.name.startswith("statecore-pack")]


def no_pack_thread_left():
    """Wait (deadline 30 s) for every packing thread to end; whether they did."""
    gc.collect()
    deadline = time.monotonic() + 30
    while pack_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not pack_threads()


class FailingFile:
    """A file object whose write fails once ``limit`` bytes went in (a full disk)."""

    def __init__(self, limit):
        self.limit, self.taken = limit, 0

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if self.taken + n > self.limit:
            raise OSError(28, "No space left on device")
        self.taken += n
        return n


def test_a_failing_file_or_packing_error_reaches_the_writer_and_leaves_no_thread(monkeypatch):
    """A write that fails half-way through the image (a full disk), or lz4 failing on the
    packing thread: the error reaches the caller of write() as it was raised, and the packing
    thread ends once the abandoned writer is dropped."""
    assert no_pack_thread_left()
    table = table_of("int64->count,sum", 5000)
    image, _ = image_and_packed(table)
    packer = PackWriter(FailingFile(len(image) // 3), BLOCK)
    with pytest.raises(OSError, match="No space left"):
        packer.write(image)
    del packer
    assert no_pack_thread_left()

    def lz4_fails(block, image, head):
        raise MemoryError("lz4 could not allocate")

    monkeypatch.setattr(snapshot_pack, "_packed_block", lz4_fails)
    packer = PackWriter(io.BytesIO(), BLOCK)
    with pytest.raises(MemoryError, match="lz4 could not allocate"):
        packer.write(image)
    del packer
    assert no_pack_thread_left()


def test_a_failing_image_file_stops_the_packing_thread_before_the_error_is_raised():
    """The image handed on fails half-way (a full local disk): the error reaches write(), and
    by then the packing thread is gone and neither file is written again (the caller removes
    both next); the writer refuses more bytes."""
    table = table_of("int64->count,sum", 5000)
    image, _ = image_and_packed(table)
    out, copy = FailingFile(10 * len(image)), FailingFile(len(image) // 3)
    packer = PackWriter(out, BLOCK, image=copy)
    with pytest.raises(OSError, match="No space left"):
        packer.write(image)
    assert pack_threads() == []  # at once, not once the writer is dropped: nothing writes after
    with pytest.raises(ValueError, match="abandoned"):
        packer.write(b"x")
    with pytest.raises(ValueError, match="abandoned"):
        packer.finish()


def unpack_threads():
    return [t for t in threading.enumerate() if t.name.startswith("statecore-unpack")]


@pytest.mark.parametrize("ahead", [0, 1, 16])
def test_unpacking_writes_in_order_and_a_failing_image_file_stops_its_thread(monkeypatch, ahead):
    """The unpacker writes the image from a thread of its own, ``ahead`` blocks behind: the
    image is the same byte for byte. A destination that fails half-way (a full local disk):
    the error reaches the caller, and by then the thread is gone."""
    monkeypatch.setattr(snapshot_pack, "UNPACK_AHEAD", ahead)
    image, packed = image_and_packed(table_of("bytes key and value", 6000, seed=9))
    assert unpacked(packed) == image and len(image) > 20 * BLOCK
    assert unpack_threads() == []
    with pytest.raises(OSError, match="No space left"):
        unpack_snapshot(io.BytesIO(packed), FailingFile(len(image) // 2), "p.snapshot")
    assert unpack_threads() == []


def test_a_snapshot_that_fails_while_its_image_is_kept_leaves_neither_file(tmp_path):
    """A duplicate key in the last chunk makes the snapshot writer fail with blocks in flight:
    no snapshot, no image and no temporary file is left, and no packing thread."""
    files = StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
    table = table_of("int64->count,sum", 100_000)  # 3 MB of rows: a dozen blocks of the default size
    keys, values = table.export_rows()
    rows = np.concatenate([keys, values], axis=1)
    last = rows[-100:].copy()
    last[50, :8] = last[10, :8]
    with pytest.raises(ValueError, match="duplicate key"):
        write_snapshot_file(files, f"5_{'ab' * 8}.snapshot", table.key_schema, table.value_schema, len(rows), 5,
                            b"C" * 16, [rows[:-100], last], "lz4", keep_image=True)
    assert pack_threads() == []
    assert os.listdir(files.location) == []
    assert os.listdir(files.local_cache_dir) == []


def test_snapshot_reader_refuses_a_packed_file_by_name(tmp_path):
    _, packed = image_and_packed(table_of("set", 10))
    path = tmp_path / "1.snapshot"
    path.write_bytes(packed)
    with pytest.raises(StateCorruptionError, match="packed snapshot") as e:
        SnapshotReader(path)
    assert (e.value.path, e.value.offset) == (str(path), 8)


# -- damage ----------------------------------------------------------------------------------
def regions(packed):
    """{region: (first, end)} of a packed snapshot."""
    h = read_snapshot_header(packed[:SNAPSHOT_HEADER_SIZE], "p")
    table = len(packed) - PACK_FOOTER_SIZE - 16 * h.packed.n_blocks
    return {"container header": (0, PACK_HEADER_SIZE), "image header page": (PACK_HEADER_SIZE, SNAPSHOT_HEADER_SIZE),
            "blocks": (SNAPSHOT_HEADER_SIZE, table), "block table": (table, len(packed) - PACK_FOOTER_SIZE),
            "footer": (len(packed) - PACK_FOOTER_SIZE, len(packed))}


def test_a_flipped_byte_anywhere_is_named_before_its_block_is_used():
    """Every byte of a packed snapshot of several blocks, flipped: unpacking (and checking
    alone) raises StateCorruptionError naming the path and an offset in the damaged region;
    nothing is written before the header, table and footer are checked, and no byte of a
    damaged block is written."""
    table = table_of("bytes key and value", 300)
    image, packed = image_and_packed(table)
    spans = regions(packed)
    h = read_snapshot_header(packed[:SNAPSHOT_HEADER_SIZE], "p")
    assert h.packed.n_blocks >= 4
    starts = [SNAPSHOT_HEADER_SIZE]  # where each stored block starts, from a clean unpack's errors
    for region, (first, end) in spans.items():
        for at in range(first, end):
            case = bytearray(packed)
            case[at] ^= 0xFF
            for dest in (io.BytesIO(), None):
                with pytest.raises(StateCorruptionError) as e:
                    unpack_snapshot(io.BytesIO(bytes(case)), dest, "dir/6_x.snapshot")
                where = (region, at, e.value)
                assert e.value.path == "dir/6_x.snapshot", where
                assert first <= e.value.offset < end, where
                if dest is None:
                    continue
                written = dest.getvalue()
                if region != "blocks":
                    assert written == b"", where
                    continue
                assert e.value.offset <= at and "packed block" in e.value.reason, where
                if e.value.offset not in starts:
                    starts.append(e.value.offset)
                damaged = sorted(starts).index(e.value.offset)
                # The header page and the blocks before the damaged one, exactly.
                assert written == image[:HEADER_SIZE + damaged * BLOCK], where
    assert len(starts) == h.packed.n_blocks


def test_truncated_or_extended_files_are_named():
    _, packed = image_and_packed(table_of("set", 300))
    for size in (0, 12, 100, SNAPSHOT_HEADER_SIZE - 1, SNAPSHOT_HEADER_SIZE, len(packed) - 1, len(packed) - 65):
        with pytest.raises(StateCorruptionError) as e:
            unpack_snapshot(io.BytesIO(packed[:size]), None, "t")
        assert e.value.path == "t"
    with pytest.raises(StateCorruptionError, match="footer"):
        unpack_snapshot(io.BytesIO(packed + b"\0"), None, "t")


# -- snapshot files: both layouts, the image cache ------------------------------------------------
@pytest.fixture(params=["local", "memory"])
def files(request, tmp_path):
    if request.param == "local":
        yield StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
        return
    root = f"memory://statecore-pack-{uuid.uuid4().hex}"
    yield StoreFiles(root + "/0/0", local_cache_dir=str(tmp_path / "cache"))
    fsspec.filesystem("memory").rm(root, recursive=True)


def write_file(files, name, table, compression):
    keys, values = table.export_rows()
    return write_snapshot_file(files, name, table.key_schema, table.value_schema, len(table), 4, b"C" * 16,
                               [np.concatenate([keys, values], axis=1)], compression)


@pytest.mark.parametrize("compression", ["lz4", "none"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_snapshot_files_round_trip(files, layout, compression):
    for n in (0, 1, 700):
        table = table_of(layout, n, seed=n)
        name = f"{n + 1}_{'ab' * 8}.snapshot"
        write_file(files, name, table, compression)
        assert read_header(files, name).format_version == (2 if compression == "lz4" else 1)
        with open_snapshot(files, name, table.key_schema, table.value_schema) as reader:
            assert len(reader) == n
            keys = [k for k, _ in table.iter_batches(1000)]
            if n:
                k = np.concatenate(keys)
                got = reader.get_batch(k)
                want = table.get_batch(k)
                assert (got[0] == want[0]).all() and (got[1] == want[1]).all()
        assert check_snapshot(files, name, table.key_schema, table.value_schema).row_count == n
        assert check_snapshot(files, name, deep=True).row_count == n
        with pytest.raises(SchemaMismatchError, match="value schema"):
            check_snapshot(files, name, table.key_schema, np.dtype([("other", "<i2")]))


def cached_images(files):
    return sorted(n for n in os.listdir(files.local_cache_dir) if n.endswith(".image"))


def test_the_image_is_made_once_reused_and_dropped_with_its_snapshot(tmp_path):
    files = StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
    table = table_of("int64->count,sum", 2000)
    name = f"4_{'cd' * 8}.snapshot"
    write_file(files, name, table, "lz4")
    first = open_snapshot(files, name)
    images = cached_images(files)
    assert len(images) == 1
    made = os.stat(os.path.join(files.local_cache_dir, images[0])).st_ino
    second = open_snapshot(files, name)
    assert cached_images(files) == images
    assert os.stat(os.path.join(files.local_cache_dir, images[0])).st_ino == made  # reused, not made again
    # A damaged image (a torn cache, not the snapshot) is made again from the snapshot.
    path = os.path.join(files.local_cache_dir, images[0])
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with open_snapshot(files, name) as third:
        assert third.get_batch(next(iter(table.iter_batches(50)))[0])[1].all()
    assert files.delete([name]) == [name]
    assert cached_images(files) == []
    for r in (first, second):  # mappings outlive the files
        assert len(r) == 2000
        r.close()


def test_an_image_kept_while_writing_is_opened_without_unpacking(tmp_path, monkeypatch):
    import statecore.snapshot_files as snapshot_files

    files = StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
    table = table_of("int64->count,sum", 3000)
    name = f"5_{'ef' * 8}.snapshot"
    keys, values = table.export_rows()
    write_snapshot_file(files, name, table.key_schema, table.value_schema, len(table), 5, b"C" * 16,
                        [np.concatenate([keys, values], axis=1)], "lz4", keep_image=True)
    assert len(cached_images(files)) == 1
    assert [n for n in os.listdir(files.local_cache_dir) if n.endswith(".tmp")] == []
    unpacked = []
    monkeypatch.setattr(snapshot_files, "unpack_snapshot", lambda *a: unpacked.append(a))
    with open_snapshot(files, name) as reader:
        assert dict(reader.items()) == dict(table.items())
        reader.verify()
    assert unpacked == []


def test_images_unused_for_a_day_are_swept_by_the_next_process(tmp_path, monkeypatch):
    """What a dead process left in the cache (images of snapshots deleted since, temporary
    files) goes once unused for a day; an image in use is touched when reused and stays."""
    import statecore.localcache as localcache

    files = StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
    table = table_of("int64->count,sum", 500)
    live, gone = f"6_{'aa' * 8}.snapshot", f"7_{'bb' * 8}.snapshot"
    for name in (live, gone):
        write_file(files, name, table, "lz4")
        open_snapshot(files, name).close()
    os.unlink(os.path.join(files.location, gone))  # deleted by a process that died: its image stays
    leftover = os.path.join(files.local_cache_dir, ".x.tmp")
    open(leftover, "wb").close()
    day_ago = time.time() - localcache.UNUSED_FOR_S - 60
    for n in os.listdir(files.local_cache_dir):
        os.utime(os.path.join(files.local_cache_dir, n), (day_ago, day_ago))
    assert len(cached_images(files)) == 2
    monkeypatch.setattr(localcache, "_SWEPT", set())  # a new process
    fresh = StoreFiles(files.location, local_cache_dir=files.local_cache_dir)
    with open_snapshot(fresh, live) as reader:  # swept first, then made again
        assert len(reader) == 500
    assert len(cached_images(fresh)) == 1 and not os.path.exists(leftover)
    image = os.path.join(files.local_cache_dir, cached_images(fresh)[0])
    os.utime(image, (day_ago, day_ago))
    monkeypatch.setattr(localcache, "_SWEPT", {files.local_cache_dir})
    with open_snapshot(fresh, live):  # reused: touched
        assert os.path.getmtime(image) > day_ago + 3600


def test_a_damaged_packed_snapshot_is_named_and_leaves_no_image(tmp_path):
    files = StoreFiles(str(tmp_path / "store"), local_cache_dir=str(tmp_path / "cache"))
    table = table_of("int64->count,sum", 2000)
    name = f"4_{'cd' * 8}.snapshot"
    write_file(files, name, table, "lz4")
    path = files.path(name)
    with open(path, "r+b") as f:
        f.seek(SNAPSHOT_HEADER_SIZE + 10)
        byte = f.read(1)
        f.seek(SNAPSHOT_HEADER_SIZE + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    for call in (lambda: open_snapshot(files, name), lambda: check_snapshot(files, name),
                 lambda: check_snapshot(files, name, deep=True)):
        with pytest.raises(StateCorruptionError, match="packed block 0 checksum") as e:
            call()
        assert (e.value.path, e.value.offset) == (path, SNAPSHOT_HEADER_SIZE)
    assert cached_images(files) == []
    assert not [n for n in os.listdir(files.local_cache_dir) if n.endswith(".tmp")]


# -- the provider -------------------------------------------------------------------------------
KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("blob", "S6")])


def batch(v):
    rng = np.random.default_rng(v)
    ks = [int(k) for k in rng.permutation(300)]
    return {k: (v, b"v%d" % i) for i, k in enumerate(ks[:60])}, ks[60:70]


def provider(root, compression, **conf):
    return create_and_init_provider(StateStoreId(str(root), 0, 0), KEY, VALUE, StateStoreConf(
        compression=compression, min_deltas_for_snapshot=2, min_versions_to_retain=50,
        local_cache_dir=str(root / "cache"), **conf))


def read_all(p, v):
    store = p.get_read_store(v)
    try:
        return {int(k[0]): tuple(x) for k, x in store.iterator()}
    finally:
        store.abort()


@pytest.mark.parametrize("first, then", [("none", "lz4"), ("lz4", "none")])
def test_a_checkpoint_written_with_one_compression_reads_and_grows_with_the_other(tmp_path, first, then):
    model = {0: {}}
    p = provider(tmp_path, first)
    for _ in range(6):
        commit_changes(p, model, batch, KEY, VALUE)
        p.do_maintenance()
    p.close()
    store_dir = tmp_path / "0" / "0"
    versions = {n.split("_")[0]: (store_dir / n).read_bytes()[8] for n in os.listdir(store_dir)
                if n.endswith(".snapshot")}
    assert versions and set(versions.values()) == {2 if first == "lz4" else 1}, versions
    q = provider(tmp_path, then)
    for v in range(1, 7):
        assert read_all(q, v) == {k: tuple(x) for k, x in model[v].items()}, v
    for _ in range(6):
        commit_changes(q, model, batch, KEY, VALUE)
        q.do_maintenance()
    q.close()
    formats = {(store_dir / n).read_bytes()[8] for n in os.listdir(store_dir) if n.endswith(".snapshot")}
    assert formats == {1, 2}, formats  # the checkpoint mixes both
    for compression in ("lz4", "none"):
        r = provider(tmp_path, compression)
        for v in range(1, 13):
            assert read_all(r, v) == {k: tuple(x) for k, x in model[v].items()}, (compression, v)
        r.close()
