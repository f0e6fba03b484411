"""Tests of statecore._snapshot: the snapshot format, SnapshotWriter and SnapshotReader.

The format is pinned twice: by a pure-Python reference encoder written from the format
description (byte-for-byte equality with the writer) and by golden bytes of one tiny file.
Corruption is fuzzed in subprocesses, so that a crash fails the test instead of the run.
"""
import io
import json
import os
import signal
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import xxhash

from statecore._hash import hash_rows
from statecore._rowtable import RowSource, RowTable
from statecore._snapshot import (
    DEFAULT_BLOCK_SIZE,
    FOOTER_MAGIC,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    SNAPSHOT_HEADER_SIZE,
    SnapshotHeader,
    SnapshotReader,
    SnapshotWriter,
    _guarded_mappings,
    read_snapshot_header,
    write_snapshot,
)
from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError
from statecore.schema import RowSchema
from tests.paths import REPO_ROOT
from tests.state_files import put_in_place
from tests.store_support import call_with_deadline

REPO = REPO_ROOT

LAYOUTS = {
    "int64->int64,float64": ([("k", "<i8")], [("a", "<i8"), ("b", "<f8")]),
    "multi-field key": ([("user", "S5"), ("flag", "?"), ("n", "<i4"), ("small", "u1")],
                        [("x", "<f4"), ("tag", "S3")]),
    "set": ([("k", "<u8")], []),
    "1-byte key": ([("k", "u1")], [("v", "<i2")]),
}

HEADER = struct.Struct("<8sIIIIQQQQQIIIQQQQQ16sI")
HEADER_FIELDS = ("magic", "format_version", "header_size", "key_width", "value_width", "key_fingerprint",
                 "value_fingerprint", "store_version", "row_count", "n_slots", "hash_id", "reserved",
                 "block_size", "n_blocks", "rows_offset", "slots_offset", "checksums_offset", "file_size",
                 "lineage", "schema_json_len")
FOOTER = struct.Struct("<8sQQQI20x")


def xxh64(data):
    return xxhash.xxh64_intdigest(bytes(data))


# -- data -------------------------------------------------------------------------------------
def random_column(rng, dt, n):
    if dt.kind == "S":
        letters = rng.integers(ord("a"), ord("z") + 1, size=(n, dt.itemsize), dtype=np.uint8)
        lengths = rng.integers(0, dt.itemsize + 1, size=n)
        letters[np.arange(dt.itemsize)[None, :] >= lengths[:, None]] = 0  # NUL-padded, as numpy pads
        return letters.reshape(-1).view(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=n).astype(np.bool_)
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dt)


def random_records(rng, schema, n):
    out = np.zeros(n, dtype=schema.dtype)
    for name, dt in schema.fields:
        out[name] = random_column(rng, dt, n)
    return out


def unique_key_rows(rng, schema, n):
    """Up to ``n`` distinct key rows (n, width) in random order (fewer if the key space is small)."""
    rows = np.unique(schema.rows(random_records(rng, schema, 2 * n + 600)), axis=0)
    return rows[rng.permutation(len(rows))][:n]


def make_rows(rng, key_schema, value_schema, n, n_misses=200):
    """``(rows, miss_keys)``: n rows (keys distinct) and keys that are not among them."""
    keys = unique_key_rows(rng, key_schema, n + n_misses)
    hits, misses = keys[:n], keys[n:]
    values = value_schema.rows(random_records(rng, value_schema, len(hits)))
    return np.ascontiguousarray(np.concatenate([hits, values], axis=1)), misses


def schemas(layout):
    key_dtype, value_dtype = LAYOUTS[layout]
    return RowSchema(np.dtype(key_dtype)), RowSchema(np.dtype(value_dtype))


def write_file(path, key_schema, value_schema, rows, store_version=7, lineage=bytes(16),
               block_size=DEFAULT_BLOCK_SIZE, chunks=None):
    with open(path, "wb") as f:
        writer = SnapshotWriter(f, key_schema, value_schema, len(rows), store_version, lineage, block_size)
        for chunk in (chunks or [rows]):
            writer.write_rows(chunk)
        return writer.finish()


def split_randomly(rng, rows):
    """Read-only chunks of random sizes (some empty) covering ``rows``."""
    cuts = np.sort(rng.integers(0, len(rows) + 1, size=min(len(rows), 6)))
    chunks = np.split(rows, cuts)
    for chunk in chunks:
        chunk.setflags(write=False)
    return chunks


# -- a pure-Python encoder, written from the format description -------------------------------
def reference_snapshot(key_schema, value_schema, rows, store_version, lineage, block_size):
    kw, vw = key_schema.width, value_schema.width
    rows = [bytes(r) for r in rows]
    n_slots = 16
    while len(rows) * 4 > n_slots * 3:
        n_slots *= 2
    mask = n_slots - 1
    slots = [(0, 0)] * n_slots
    max_disp = 0
    for i, row in enumerate(rows):
        tag = xxh64(row[:kw]) & 0xFFFFFFFF
        carried, pos, dist = (tag, i + 1), tag & mask, 0
        while True:
            if slots[pos][1] == 0:
                slots[pos] = carried
                max_disp = max(max_disp, dist)
                break
            resident_dist = (pos - (slots[pos][0] & mask)) & mask
            if resident_dist < dist:
                slots[pos], carried = carried, slots[pos]
                max_disp = max(max_disp, dist)
                dist = resident_dist
            pos, dist = (pos + 1) & mask, dist + 1
    rows_bytes = b"".join(rows)
    slots_offset = -(-(4096 + len(rows_bytes)) // 64) * 64
    data = (rows_bytes + bytes(slots_offset - 4096 - len(rows_bytes))
            + b"".join(struct.pack("<II", t, r) for t, r in slots))
    checksums_offset = 4096 + len(data)
    table = b"".join(struct.pack("<Q", xxh64(data[i:i + block_size]))
                     for i in range(0, len(data), block_size))
    file_size = checksums_offset + len(table) + 64
    schema_json = json.dumps({"key": key_schema.describe(), "value": value_schema.describe()},
                             separators=(",", ":")).encode()
    header = HEADER.pack(b"SCSNAP\0\x01", 1, 4096, kw, vw, key_schema.fingerprint, value_schema.fingerprint,
                         store_version, len(rows), n_slots, 1, 0, block_size, len(table) // 8, 4096,
                         slots_offset, checksums_offset, file_size, lineage, len(schema_json)) + schema_json
    header = header.ljust(4088, b"\0")
    header += struct.pack("<Q", xxh64(header))
    footer = struct.pack("<8sQQQI", b"SCSNEND\x01", xxh64(table), file_size, xxh64(header[:4088]), max_disp)
    footer = footer.ljust(56, b"\0")
    footer += struct.pack("<Q", xxh64(footer))
    return header + data + table + footer


# -- round trips --------------------------------------------------------------------------------
def check_against_model(reader, rows, misses, key_schema, value_schema):
    kw = key_schema.width
    model = {bytes(r[:kw]): bytes(r[kw:]) for r in rows}
    assert len(reader) == len(model) == reader.row_count
    # Raw batch lookups: hits then misses, in a shuffled order, from a read-only array.
    keys = np.concatenate([rows[:, :kw], misses]) if len(rows) else misses
    order = np.random.default_rng(1).permutation(len(keys))
    keys = np.ascontiguousarray(keys[order])
    keys.setflags(write=False)
    values = np.full((len(keys), value_schema.width), 0xAB, dtype=np.uint8)
    found = np.zeros(len(keys), dtype=np.uint8)
    reader.get_rows(keys, values, found)
    # The model, vectorized: keys[i] is hit order[i] if order[i] < len(rows), else a miss.
    expected_values = np.concatenate([rows[:, kw:], np.zeros((len(misses), value_schema.width), np.uint8)])
    assert np.array_equal(found, (order < len(rows)).astype(np.uint8))
    assert np.array_equal(values, expected_values[order])
    # Structured batches.
    batch = key_schema.from_rows(keys)
    got_values, got_found = reader.get_batch(batch)
    assert got_found.dtype == np.bool_ and (got_found == found.astype(bool)).all()
    assert got_values.tobytes() == values.tobytes()
    # One at a time, through every entry point, on a sample.
    for key in keys[:300]:
        expected = model.get(key.tobytes())
        assert reader.get_row(key.tobytes()) == expected
        decoded = reader.get(key.tobytes())
        assert decoded == (None if expected is None else value_schema.decode(expected))
        assert (key.tobytes() in reader) == (expected is not None)
    # Iteration visits every row once, in file order.
    cursor = reader.cursor()
    chunks = []
    while (chunk := cursor.next_rows(977)) is not None:
        chunks.append(chunk)
    got = np.concatenate(chunks) if chunks else np.empty((0, rows.shape[1]), np.uint8)
    assert np.array_equal(got, rows)
    items = list(reader.items())
    assert len(items) == len(rows)
    for i in range(0, len(rows), max(1, len(rows) // 2000)):  # decoding every row twice is slow
        key, value = bytes(rows[i, :kw]), bytes(rows[i, kw:])
        assert items[i] == (key_schema.decode(key), value_schema.decode(value))
    batches = list(reader.iter_batches(4096))
    n = sum(len(k) for k, _ in batches)
    assert n == len(rows)
    if batches:
        assert np.concatenate([k for k, _ in batches]).tobytes() == rows[:, :kw].tobytes()
        assert np.concatenate([v for _, v in batches]).tobytes() == rows[:, kw:].tobytes()
        assert batches[0][0].dtype == key_schema.dtype and batches[0][1].dtype == value_schema.dtype


SIZES = [0, 1, 12, 49152, 100_000]  # 12 and 49152 fill 16 and 65536 slots to exactly 3/4


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_matches_dict_model(tmp_path, layout, n):
    rng = np.random.default_rng([n, len(layout)])
    key_schema, value_schema = schemas(layout)
    rows, misses = make_rows(rng, key_schema, value_schema, n)
    n = len(rows)  # a 1-byte key has 256 keys at most
    block_size = 64 if n < 100 else 4096 if n < 60_000 else DEFAULT_BLOCK_SIZE
    path = tmp_path / "s.snapshot"
    info = write_file(path, key_schema, value_schema, rows, block_size=block_size,
                      chunks=split_randomly(rng, rows))
    assert info["row_count"] == n and info["file_size"] == os.path.getsize(path)
    assert info["n_slots"] * 3 >= n * 4 and (info["n_slots"] == 16 or info["n_slots"] * 3 < n * 8)
    with SnapshotReader(path, key_schema, value_schema) as reader:
        assert reader.store_version == 7 and reader.lineage == bytes(16)
        check_against_model(reader, rows, misses, key_schema, value_schema)
        reader.verify()
        # With its key filter, asked first by every lookup: the same answers.
        assert reader.key_filter is None
        reader.build_key_filter(chunk_rows=1000)
        assert reader.key_filter is not None and reader.key_filter.capacity == n
        check_against_model(reader, rows, misses, key_schema, value_schema)


def test_the_key_filter_rules_out_most_absent_keys(tmp_path):
    """Built from the rows, it holds every key and lets at most a few absent ones through:
    most misses never touch the mapped slots."""
    rng = np.random.default_rng(8)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, misses = make_rows(rng, key_schema, value_schema, 20_000, n_misses=20_000)
    path = tmp_path / "f.snapshot"
    write_file(path, key_schema, value_schema, rows)
    with SnapshotReader(path, key_schema, value_schema) as reader:
        reader.build_key_filter()
        keys = reader.key_filter
        reader.build_key_filter()  # once: kept
        assert reader.key_filter is keys
        assert keys.may_hold_rows(np.ascontiguousarray(rows[:, :8])).all()
        assert keys.may_hold_rows(misses).mean() < 0.03
        assert keys.nbytes <= 20_000 * 10 // 8 + 64
    absent = next(bytes(k) for k in misses if not keys.may_hold_rows(k[None, :])[0])
    with pytest.raises(ValueError, match="closed"):  # closed is closed, whatever the filter says
        reader.get_row(absent)


def test_a_batch_lookup_asks_the_key_filter_only_while_it_pays(tmp_path):
    """The filter is asked about the first keys of each window of a batch, and about the rest
    only if it ruled out at least one in eight of those. Made visible with a filter that lacks
    some present keys (a broken filter, for the test): where it was asked about them they
    read as absent, where it was not they are found."""
    from statecore._keyfilter import KeyFilter

    rng = np.random.default_rng(21)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, misses = make_rows(rng, key_schema, value_schema, 20_000, n_misses=20_000)
    path = tmp_path / "f.snapshot"
    write_file(path, key_schema, value_schema, rows)
    keys = np.ascontiguousarray(rows[:, :8])
    lacking = rng.random(len(rows)) < 0.05  # present keys the filter is not given
    broken = KeyFilter(8, len(rows))
    broken.add_rows(np.ascontiguousarray(keys[~lacking]))
    ruled_out = ~broken.may_hold_rows(keys)
    assert ruled_out[lacking].sum() > 900 and not ruled_out[~lacking].any()
    window, sample = 4096, 256
    with SnapshotReader(path, key_schema, value_schema) as reader:
        reader.set_key_filter(broken)
        values = np.empty((len(rows), 16), np.uint8)
        found = np.empty(len(rows), np.uint8)
        # Every key present, a few in twenty ruled out: the filter does not pay past each sample.
        reader.get_rows(keys, values, found)
        asked = (np.arange(len(rows)) % window) < sample
        assert found.view(bool).tolist() == (~(ruled_out & asked)).tolist()
        assert (values[found.view(bool)] == rows[found.view(bool), 8:]).all()
        # Half the keys absent: it pays, and is asked about every key.
        mixed = np.empty((2 * len(rows), 8), np.uint8)
        mixed[0::2], mixed[1::2] = keys, misses
        values = np.empty((len(mixed), 16), np.uint8)
        found = np.empty(len(mixed), np.uint8)
        reader.get_rows(mixed, values, found)
        assert found[0::2].view(bool).tolist() == (~ruled_out).tolist()
        assert not found[1::2].any()
        # Asked about no key beyond the ones the filter rules out: the same as no filter.
        reader.get_rows(keys, values[: len(rows)], found[: len(rows)], filtered=False)
        assert found[: len(rows)].all()


def test_a_key_filter_is_set_once_and_for_its_key_width(small_snapshot):
    """A writer's filter (a spill's images get theirs so) is taken as it is; another width,
    or a second filter, is refused."""
    from statecore._keyfilter import KeyFilter

    path, rows, misses, key_schema, value_schema = small_snapshot
    with SnapshotReader(path) as reader:
        with pytest.raises(ValueError, match="16-byte keys for a snapshot of 8-byte keys"):
            reader.set_key_filter(KeyFilter(16, 10))
        keys = KeyFilter(8, len(rows))
        keys.add_rows(np.ascontiguousarray(rows))
        reader.set_key_filter(keys)
        assert reader.key_filter is keys
        with pytest.raises(ValueError, match="has a key filter already"):
            reader.set_key_filter(KeyFilter(8, 10))
        reader.build_key_filter()  # has one: kept
        assert reader.key_filter is keys
        check_against_model(reader, rows, misses, key_schema, value_schema)


def test_a_damaged_block_leaves_no_key_filter(small_snapshot):
    """The filter is built from rows checked against their blocks' checksums: a damaged
    block stops the build (naming the block) and the reader keeps probing without one."""
    path, rows, _, _, _ = small_snapshot
    offset = HEADER_SIZE + 321 * rows.shape[1] + 3  # inside a key
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with SnapshotReader(path) as reader:
        block_start = HEADER_SIZE + block_of(reader, offset) * reader.block_size
        with pytest.raises(StateCorruptionError) as info:
            reader.build_key_filter()
        assert info.value.offset == block_start
        assert reader.key_filter is None
        assert reader.get_row(rows[5, :8].tobytes()) == rows[5, 8:].tobytes()
        with pytest.raises(StateCorruptionError):
            reader.get_row(rows[321, :8].tobytes())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_schemas_come_from_the_file_when_not_given(tmp_path, layout):
    rng = np.random.default_rng(5)
    key_schema, value_schema = schemas(layout)
    rows, misses = make_rows(rng, key_schema, value_schema, 150)
    write_file(tmp_path / "s", key_schema, value_schema, rows)
    with SnapshotReader(tmp_path / "s") as reader:
        assert reader.key_schema == key_schema and reader.value_schema == value_schema
        check_against_model(reader, rows, misses, key_schema, value_schema)


def test_write_snapshot_streams_a_rowtable(tmp_path):
    rng = np.random.default_rng(11)
    key_schema, value_schema = schemas("int64->int64,float64")
    table = RowTable(key_schema, value_schema)
    keys = random_records(rng, key_schema, 150_000)
    table.put_batch(keys, random_records(rng, value_schema, 150_000))
    table.remove_batch(keys[:20_000])  # holes in the arena
    path = tmp_path / "t.snapshot"
    lineage = uuid.UUID(int=42)
    with open(path, "wb") as f:
        info = write_snapshot(f, table, 12, lineage=lineage)
    assert info["row_count"] == len(table)
    with SnapshotReader(path, key_schema, value_schema, expected_lineage=lineage.bytes) as reader:
        assert reader.store_version == 12 and reader.lineage == lineage.bytes
        probe = np.concatenate([keys[:1000], keys[-5000:]])
        values, found = reader.get_batch(probe)
        expected_values, expected_found = table.get_batch(probe)
        assert (found == expected_found).all() and found[:1000].sum() == 0
        assert values.tobytes() == expected_values.tobytes()
        assert dict(reader.items()) == dict(table.items())


def test_a_file_backed_slot_index_writes_the_same_bytes(tmp_path, monkeypatch):
    """Past a size the writer's slot index and key hashes live in an unlinked temporary
    file's mapping (a state larger than memory can be written): the same bytes come out."""
    import statecore._snapshot_writer as writer_module

    rng = np.random.default_rng(17)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, misses = make_rows(rng, key_schema, value_schema, 50_000)
    heap = write_file(tmp_path / "heap.snapshot", key_schema, value_schema, rows)
    monkeypatch.setattr(writer_module, "FILE_BACKED_SCRATCH_BYTES", 0)
    assert writer_module._scratch_array((4, 2), np.dtype("<u4")).base is not None  # mapped, not owned
    mapped = write_file(tmp_path / "mapped.snapshot", key_schema, value_schema, rows)
    assert heap == mapped
    assert (tmp_path / "heap.snapshot").read_bytes() == (tmp_path / "mapped.snapshot").read_bytes()
    with SnapshotReader(tmp_path / "mapped.snapshot", key_schema, value_schema) as reader:
        check_against_model(reader, rows, misses, key_schema, value_schema)
        reader.verify()


def test_the_slot_index_is_built_by_rowtables_rule(tmp_path):
    """Same keys, same order, same number of slots: a RowTable's index and a snapshot's slots
    come out alike (both follow _probe.pxd), down to the farthest displacement."""
    rng = np.random.default_rng(13)
    key_schema, value_schema = schemas("int64->int64,float64")
    for n in (12, 1000, 49_152):  # 49_152: exactly 3/4 of 65_536 slots
        table = RowTable(key_schema, value_schema, capacity=n)
        table.put_batch(random_records(rng, key_schema, n), random_records(rng, value_schema, n))
        with open(tmp_path / "t.snapshot", "wb") as f:
            info = write_snapshot(f, table, 1)
        stats = table.probe_stats()
        assert (info["n_slots"], info["max_displacement"]) == (stats["slots"], stats["max"]), n


def test_writer_output_equals_the_reference_encoder(tmp_path):
    rng = np.random.default_rng(3)
    for layout, n, block_size in [("1-byte key", 192, 64), ("multi-field key", 700, 128),
                                  ("set", 12, 64), ("int64->int64,float64", 0, 4096),
                                  ("int64->int64,float64", 3000, 65536)]:
        key_schema, value_schema = schemas(layout)
        rows, _ = make_rows(rng, key_schema, value_schema, n)
        lineage = bytes(range(16))
        path = tmp_path / f"{n}.snapshot"
        info = write_file(path, key_schema, value_schema, rows, store_version=2**40 + 3, lineage=lineage,
                          block_size=block_size, chunks=split_randomly(rng, rows))
        expected = reference_snapshot(key_schema, value_schema, rows, 2**40 + 3, lineage, block_size)
        assert path.read_bytes() == expected, layout
        assert info["max_displacement"] == FOOTER.unpack_from(expected, len(expected) - 64)[4]


# Pins format version 1: the first 64 header bytes and the whole file of a tiny snapshot.
GOLDEN_HEADER_64 = ("5343534e4150000101000000001000000800000004000000d4fa5a5e9c6c53c9"
                    "2ff296b31dc6cf60030000000000000003000000000000001000000000000000")
GOLDEN_FILE_XXH64 = 0x60DB274C442AA65B
GOLDEN_FILE_SIZE = 4096 + 64 + 128 + 8 + 64  # header, 3 rows padded to 64, 16 slots, 1 checksum, footer


def tiny_snapshot(path):
    key_schema = RowSchema(np.dtype([("id", "<i8")]))
    value_schema = RowSchema(np.dtype([("count", "<i4")]))
    rows = np.concatenate([np.array([1, 2, 3], "<i8").view(np.uint8).reshape(3, 8),
                           np.array([10, 20, 30], "<i4").view(np.uint8).reshape(3, 4)], axis=1)
    write_file(path, key_schema, value_schema, np.ascontiguousarray(rows), store_version=3,
               lineage=b"lineage-0123456!", block_size=4096)
    return key_schema, value_schema


def test_golden_bytes_of_a_tiny_snapshot(tmp_path):
    tiny_snapshot(tmp_path / "tiny")
    data = (tmp_path / "tiny").read_bytes()
    assert data[:64].hex() == GOLDEN_HEADER_64
    assert len(data) == GOLDEN_FILE_SIZE
    assert xxh64(data) == GOLDEN_FILE_XXH64
    assert data[:8] == MAGIC and data[-64:-56] == FOOTER_MAGIC and FORMAT_VERSION == 1
    header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(data)))
    assert header["lineage"] == b"lineage-0123456!"
    assert json.loads(data[136:136 + header["schema_json_len"]]) == {"key": [["id", "<i8"]],
                                                                     "value": [["count", "<i4"]]}


# -- opening: headers before trust --------------------------------------------------------------
@pytest.fixture
def small_snapshot(tmp_path):
    """A 500-row snapshot with 512-byte blocks: (path, rows, misses, key_schema, value_schema)."""
    rng = np.random.default_rng(17)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, misses = make_rows(rng, key_schema, value_schema, 500)
    path = tmp_path / "small.snapshot"
    write_file(path, key_schema, value_schema, rows, lineage=b"L" * 16, block_size=512)
    return path, rows, misses, key_schema, value_schema


def rewrite_header(path, fix_checksum=True, **fields):
    data = bytearray(Path(path).read_bytes())
    values = dict(zip(HEADER_FIELDS, HEADER.unpack_from(data)))
    values.update(fields)
    HEADER.pack_into(data, 0, *(values[f] for f in HEADER_FIELDS))
    if fix_checksum:
        struct.pack_into("<Q", data, 4088, xxh64(data[:4088]))
    Path(path).write_bytes(bytes(data))
    return values


def open_error(path, **kwargs):
    with pytest.raises(StateCorruptionError) as info:
        SnapshotReader(path, **kwargs)
    assert info.value.path == str(path)
    return info.value


def test_schema_mismatch_names_the_schema(small_snapshot):
    path, _, _, key_schema, value_schema = small_snapshot
    with pytest.raises(SchemaMismatchError, match="key schema"):
        SnapshotReader(path, np.dtype([("k", "<i4")]), value_schema)
    with pytest.raises(SchemaMismatchError, match="value schema"):
        SnapshotReader(path, key_schema, np.dtype([("a", "<i8"), ("c", "<f8")]))
    with SnapshotReader(path, key_schema.dtype, value_schema.dtype):
        pass


def test_lineage_must_match_when_expected(small_snapshot):
    path = small_snapshot[0]
    error = open_error(path, expected_lineage=b"M" * 16)
    assert "another lineage" in error.reason and error.offset == 116
    with SnapshotReader(path, expected_lineage=b"L" * 16) as reader:
        assert reader.lineage == b"L" * 16
    with pytest.raises(ValueError):
        SnapshotReader(path, expected_lineage=b"short")


@pytest.mark.parametrize("length", [0, 1, 100, 4095, 4159, 4160, -1, -8, -64, -65, -600])
def test_truncated_files_are_corrupt(small_snapshot, length):
    path = small_snapshot[0]
    data = path.read_bytes()
    path.write_bytes(data[:length] if length >= 0 else data[:len(data) + length])
    open_error(path)


def test_an_appended_byte_is_corrupt(small_snapshot):
    path = small_snapshot[0]
    path.write_bytes(path.read_bytes() + b"\0")
    open_error(path)


def test_wrong_magic(small_snapshot):
    path = small_snapshot[0]
    data = bytearray(path.read_bytes())
    data[0:8] = b"PAR1\0\0\0\0"
    path.write_bytes(bytes(data))
    error = open_error(path)
    assert error.offset == 0 and "magic" in error.reason


@pytest.mark.parametrize("fix_checksum", [True, False])
def test_unknown_format_version_is_named(small_snapshot, fix_checksum):
    path = small_snapshot[0]
    rewrite_header(path, fix_checksum=fix_checksum, format_version=3)
    error = open_error(path)
    assert error.offset == 8 and "format version 3" in error.reason


def test_header_checksum(small_snapshot):
    path = small_snapshot[0]
    rewrite_header(path, fix_checksum=False, store_version=8)
    error = open_error(path)
    assert error.offset == 4088 and "checksum" in error.reason


@pytest.mark.parametrize("change", [
    {"file_size": +4096}, {"row_count": +1}, {"row_count": +1_000_000}, {"row_count": 2**40},
    {"n_slots": +1}, {"n_slots": 2**62}, {"n_slots": -1008}, {"slots_offset": +64},
    {"checksums_offset": +8}, {"checksums_offset": 2**63}, {"n_blocks": +1}, {"n_blocks": -1},
    {"block_size": +1}, {"block_size": 2**31}, {"block_size": -448}, {"rows_offset": +64},
    {"key_width": +1}, {"value_width": -8}, {"key_width": -8}, {"hash_id": +1}, {"reserved": 7},
    {"header_size": +1}, {"schema_json_len": +1}, {"schema_json_len": 5000},
    {"key_fingerprint": +1}, {"value_fingerprint": +1},
])
def test_inconsistent_headers_with_valid_checksums(small_snapshot, change):
    """Sizes larger than the file, sections out of order, unknown ids: an error, never a crash."""
    path = small_snapshot[0]
    (field, delta), = change.items()
    original = dict(zip(HEADER_FIELDS, HEADER.unpack_from(path.read_bytes())))[field]
    value = delta if abs(delta) >= 2**30 or field == "reserved" else original + delta
    rewrite_header(path, **{field: value})
    open_error(path)


@pytest.mark.parametrize("field,value", [("max_displacement", 1024), ("max_displacement", 2**32 - 1),
                                         ("file_size", 1), ("header_checksum", 5)])
def test_inconsistent_footers_with_valid_checksums(small_snapshot, field, value):
    path = small_snapshot[0]
    data = bytearray(path.read_bytes())
    at = len(data) - 64
    fields = dict(zip(["magic", "table_checksum", "file_size", "header_checksum", "max_displacement"],
                      FOOTER.unpack_from(data, at)))
    fields[field] = value
    FOOTER.pack_into(data, at, *fields.values())
    struct.pack_into("<Q", data, at + 56, xxh64(data[at:at + 56]))
    path.write_bytes(bytes(data))
    error = open_error(path)
    assert at <= error.offset < len(data)


def test_a_header_from_another_snapshot_is_refused(tmp_path, small_snapshot):
    path, rows, _, key_schema, value_schema = small_snapshot
    write_file(tmp_path / "other", key_schema, value_schema, rows, store_version=8, block_size=512)
    spliced = (tmp_path / "other").read_bytes()[:4096] + path.read_bytes()[4096:]
    (tmp_path / "spliced").write_bytes(spliced)
    error = open_error(tmp_path / "spliced")
    assert "another header" in error.reason


# -- the header alone ----------------------------------------------------------------------------
def test_read_snapshot_header_decodes_the_checked_header(tmp_path):
    key_schema, value_schema = tiny_snapshot(tmp_path / "tiny")
    data = (tmp_path / "tiny").read_bytes()
    assert HEADER_SIZE == 4096 and SNAPSHOT_HEADER_SIZE == 4160  # an image needs its page; packed, 64 more
    for source in [data[:HEADER_SIZE], data[:SNAPSHOT_HEADER_SIZE], data, bytearray(data), memoryview(data)]:
        h = read_snapshot_header(source, path="3.snapshot")
        assert isinstance(h, SnapshotHeader)
        assert (h.store_version, h.lineage, h.commit_id) == (3, b"lineage-0123456!", b"lineage-")
        assert (h.row_count, h.key_width, h.value_width, h.file_size) == (3, 8, 4, GOLDEN_FILE_SIZE)
        assert (h.key_fingerprint, h.value_fingerprint) == (key_schema.fingerprint, value_schema.fingerprint)
        assert (h.key_schema, h.value_schema) == (key_schema, value_schema)
    with pytest.raises(AttributeError):
        h.store_version = 6
    with SnapshotReader(tmp_path / "tiny") as reader:
        assert (reader.store_version, reader.commit_id, reader.lineage) == (3, b"lineage-", b"lineage-0123456!")
        assert reader.header.store_version == 3 and reader.header.file_size == reader.file_size


def test_the_readers_attributes_are_its_headers(tmp_path):
    """As for DeltaReader: the header's fields are the reader's attributes too; the reads a
    RowTable has are RowSource's, on both."""
    tiny_snapshot(tmp_path / "tiny")
    with SnapshotReader(tmp_path / "tiny") as reader:
        for name in ("store_version", "lineage", "commit_id", "row_count", "key_width", "value_width",
                     "key_fingerprint", "value_fingerprint", "file_size", "n_slots", "n_blocks",
                     "block_size", "checksum"):
            assert getattr(reader, name) == getattr(reader.header, name), name
        assert isinstance(reader, RowSource)
        assert isinstance(RowTable(reader.key_schema, reader.value_schema), RowSource)
        with pytest.raises(AttributeError):
            reader.store_version = 4
        with pytest.raises(AttributeError, match="'SnapshotReader' object has no attribute 'compression'"):
            reader.compression


def test_a_renamed_copy_keeps_its_version(tmp_path):
    """A copy of 3.snapshot named 6.snapshot says 3: what the store compares with the name."""
    tiny_snapshot(tmp_path / "3.snapshot")
    (tmp_path / "6.snapshot").write_bytes((tmp_path / "3.snapshot").read_bytes())
    with open(tmp_path / "6.snapshot", "rb") as f:
        assert read_snapshot_header(f.read(SNAPSHOT_HEADER_SIZE)).store_version == 3
    with SnapshotReader(tmp_path / "6.snapshot") as reader:
        assert reader.store_version == 3


def test_read_snapshot_header_refuses_what_the_reader_refuses(small_snapshot):
    """One parser: a short or damaged header gives the same error from read_snapshot_header
    as from SnapshotReader, and no header byte can change without an error."""
    path = small_snapshot[0]
    pristine = path.read_bytes()
    for cut in [0, 1, 136, 4095]:
        with pytest.raises(StateCorruptionError, match="truncated") as e:
            read_snapshot_header(pristine[:cut], path="s")
        assert (e.value.path, e.value.offset) == ("s", cut)
    rng = np.random.default_rng(34)
    cases = []
    for change in [{"format_version": 3}, {"header_size": 4095}, {"row_count": 600}, {"n_slots": 1 << 40},
                   {"block_size": 100}, {"slots_offset": 0}, {"file_size": 1}, {"hash_id": 2},
                   {"reserved": 1}, {"key_width": 0}, {"schema_json_len": 1}]:
        path.write_bytes(pristine)
        rewrite_header(path, **change)
        cases.append(path.read_bytes())
    for at in range(HEADER_SIZE):  # one flipped bit in every header byte
        flipped = bytearray(pristine)
        flipped[at] ^= 1 << int(rng.integers(0, 8))
        cases.append(bytes(flipped))
    for i, case in enumerate(cases):
        with pytest.raises(StateCorruptionError) as from_header:
            read_snapshot_header(case, path=str(path))
        if i < 11 or i % 64 == 0:  # the reader on a sample (each case is a file)
            path.write_bytes(case)
            from_reader = open_error(path)
            assert (from_header.value.offset, from_header.value.reason) == (from_reader.offset, from_reader.reason)


@pytest.mark.parametrize("what", ["fifo", "dev_zero", "directory"])
def test_snapshot_reader_refuses_a_fifo_device_or_directory_without_waiting(tmp_path, what):
    """Someone left a FIFO (or a link to /dev/zero, or a directory) where a snapshot should be:
    the reader refuses it, naming the file, before it maps or waits on anything."""
    path = str(tmp_path / f"3_{'ab' * 8}.snapshot")
    put_in_place(path, what)
    try:
        kind, value = call_with_deadline(lambda: SnapshotReader(path))
    finally:
        if what == "fifo":  # release a reader blocked in open() on the old code
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert kind == "raised" and isinstance(value, UnsafeFileError), (kind, value)
    assert value.path == path and "not a regular file" in str(value)


# -- lazy verification --------------------------------------------------------------------------
def test_opening_reads_no_data_block(tmp_path):
    rng = np.random.default_rng(2)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, _ = make_rows(rng, key_schema, value_schema, 100_000, n_misses=0)
    write_file(tmp_path / "s", key_schema, value_schema, rows)
    with SnapshotReader(tmp_path / "s") as reader:
        assert reader.n_blocks > 50 and reader.verified_blocks() == 0
        assert reader.get_row(rows[0, :8].tobytes()) == rows[0, 8:].tobytes()
        assert 1 <= reader.verified_blocks() <= 3
        reader.verify()
        assert reader.verified_blocks() == reader.n_blocks


def block_of(reader, offset):
    return (offset - HEADER_SIZE) // reader.block_size


def test_a_flipped_row_byte_is_found_by_the_lookup_that_reads_it(small_snapshot):
    path, rows, _, key_schema, _ = small_snapshot
    row = 321
    offset = HEADER_SIZE + row * rows.shape[1] + 12  # inside the value
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with SnapshotReader(path) as reader:  # no verify()
        block_start = HEADER_SIZE + block_of(reader, offset) * reader.block_size
        far = 5  # a row in another block
        assert block_of(reader, HEADER_SIZE + far * 24) != block_of(reader, offset)
        assert reader.get_row(rows[far, :8].tobytes()) == rows[far, 8:].tobytes()
        with pytest.raises(StateCorruptionError) as info:
            reader.get_row(rows[row, :8].tobytes())
        assert info.value.offset == block_start and "checksum" in info.value.reason
        assert str(path) in str(info.value) and f"at byte {block_start}" in str(info.value)
        with pytest.raises(StateCorruptionError):
            reader.get_batch(key_schema.from_rows(np.ascontiguousarray(rows[row - 1:row + 1, :8])))
        with pytest.raises(StateCorruptionError):
            list(reader.items())
        with pytest.raises(StateCorruptionError):
            reader.verify()
        with pytest.raises(StateCorruptionError):
            reader.verify(index=False)


def test_verifying_the_blocks_alone_checks_every_block(small_snapshot):
    path = small_snapshot[0]
    with SnapshotReader(path) as reader:
        assert reader.verified_blocks() == 0
        reader.verify(index=False)
        assert reader.verified_blocks() == reader.n_blocks


def test_a_damaged_checksum_table_is_found_on_first_use(small_snapshot):
    path, rows, _, _, _ = small_snapshot
    data = bytearray(path.read_bytes())
    header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(data)))
    data[header["checksums_offset"] + 3] ^= 1
    path.write_bytes(bytes(data))
    with SnapshotReader(path) as reader:
        with pytest.raises(StateCorruptionError, match="checksum table") as info:
            reader.get_row(rows[0, :8].tobytes())
        assert info.value.offset == header["checksums_offset"]


def test_a_flipped_slot_byte_is_found(small_snapshot):
    path, rows, _, _, _ = small_snapshot
    data = bytearray(path.read_bytes())
    header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(data)))
    # Corrupt the slot of row 0 (its row number field), found from the unmodified index.
    tag = xxh64(rows[0, :8].tobytes()) & 0xFFFFFFFF
    pos = tag & (header["n_slots"] - 1)
    while struct.unpack_from("<II", data, header["slots_offset"] + 8 * pos)[1] != 1:
        pos = (pos + 1) & (header["n_slots"] - 1)
    data[header["slots_offset"] + 8 * pos + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with SnapshotReader(path) as reader:
        with pytest.raises(StateCorruptionError):
            reader.get_row(rows[0, :8].tobytes())


# -- writer errors ------------------------------------------------------------------------------
def test_writer_refuses_duplicates_and_wrong_counts():
    key_schema, value_schema = schemas("int64->int64,float64")
    rng = np.random.default_rng(4)
    rows, _ = make_rows(rng, key_schema, value_schema, 100, n_misses=0)

    writer = SnapshotWriter(io.BytesIO(), key_schema, value_schema, 100, 1)
    dup = rows.copy()
    dup[70, :8] = dup[10, :8]
    with pytest.raises(ValueError, match="duplicate key: row 70 has the key of row 10"):
        writer.write_rows(dup)
    with pytest.raises(ValueError, match="failed"):
        writer.write_rows(rows)

    writer = SnapshotWriter(io.BytesIO(), key_schema, value_schema, 101, 1)
    writer.write_rows(rows)
    with pytest.raises(ValueError, match="duplicate key: row 100 has the key of row 42"):
        writer.write_rows(rows[42:43])

    writer = SnapshotWriter(io.BytesIO(), key_schema, value_schema, 100, 1)
    writer.write_rows(rows[:60])
    with pytest.raises(ValueError, match="announced with 100 rows, but 60"):
        writer.finish()
    with pytest.raises(ValueError, match="announced with 100 rows"):
        writer.write_rows(rows[:41])
    with pytest.raises(ValueError, match=r"\(m, 24\)"):
        writer.write_rows(rows[:, :16])
    with pytest.raises(TypeError, match="uint8"):
        writer.write_rows(rows.view(np.uint16))
    writer.write_rows(rows[60:])
    info = writer.finish()
    with pytest.raises(ValueError, match="finished"):
        writer.finish()
    assert info["row_count"] == 100


@pytest.mark.parametrize("kwargs", [{"row_count": -1}, {"row_count": 2**32}, {"store_version": -1},
                                    {"lineage": b"x" * 15}, {"block_size": 100}, {"block_size": 32},
                                    {"block_size": 2**31}])
def test_writer_arguments_out_of_range(kwargs):
    key_schema, value_schema = schemas("set")
    args = {"row_count": 1, "store_version": 0, **kwargs}
    with pytest.raises(ValueError):
        SnapshotWriter(io.BytesIO(), key_schema, value_schema, **args)


def test_lineages_are_checked_as_deltas_check_them():
    key_schema, value_schema = schemas("set")
    with pytest.raises(TypeError, match="lineage must be 16 bytes or a uuid.UUID"):
        SnapshotWriter(io.BytesIO(), key_schema, value_schema, 1, 0, lineage=7)
    with pytest.raises(ValueError, match="lineage must be 16 bytes, got 15"):
        SnapshotWriter(io.BytesIO(), key_schema, value_schema, 1, 0, lineage=b"x" * 15)
    writer = SnapshotWriter(io.BytesIO(), key_schema, value_schema, 0, 0, lineage=np.arange(16, dtype=np.uint8))
    assert writer.finish()["row_count"] == 0


def test_the_module_exports_every_name_of_the_format():
    import statecore._snapshot as snapshot
    for name in snapshot.__all__ + ["MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MIN_SLOTS", "SLOTS_ALIGN", "MAX_ROWS"]:
        assert hasattr(snapshot, name), name
    assert (snapshot.MIN_SLOTS, snapshot.SLOTS_ALIGN, snapshot.MAX_ROWS) == (16, 64, 2**32 - 2)


def test_writer_needs_only_write_and_survives_partial_writes(tmp_path):
    class WriteOnly:  # no seek, no tell; takes at most 1000 bytes per call, as raw files may
        def __init__(self):
            self.parts = []

        def write(self, data):
            data = bytes(memoryview(data)[:1000])
            self.parts.append(data)
            return len(data)

    rng = np.random.default_rng(9)
    key_schema, value_schema = schemas("multi-field key")
    rows, _ = make_rows(rng, key_schema, value_schema, 3000, n_misses=0)
    sink = WriteOnly()
    writer = SnapshotWriter(sink, key_schema, value_schema, len(rows), 4, block_size=1024)
    for chunk in split_randomly(rng, rows):
        writer.write_rows(chunk)
    writer.finish()
    expected = reference_snapshot(key_schema, value_schema, rows, 4, bytes(16), 1024)
    assert b"".join(sink.parts) == expected


# -- keys with equal 64-bit hashes ------------------------------------------------------------
# XXH64 of a 16-byte input (seed 0) is two invertible lane steps and an invertible finish
# (tests/engine/test_hash.py pins our XXH64 to the xxhash package), so for any first lanes a, a' and
# second lane b there is exactly one b' with xxh64(a + b) == xxh64(a' + b'): real collisions
# of full 64-bit key hashes, found in microseconds instead of a 2**32 birthday search. Any
# user-chosen 16-byte key (two int64 columns, an S16 string) can be collided this way.
_M64 = (1 << 64) - 1
_P1, _P2, _P4, _P5 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
WIDE_KEY = RowSchema(np.dtype([("a", "<u8"), ("b", "<u8")]))
WIDE_VALUE = RowSchema(np.dtype([("v", "<i8")]))


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M64


def _lane(x):  # XXH64's round(0, x): invertible
    return _rotl(x * _P2 & _M64, 31) * _P1 & _M64


def _unlane(y):
    return _rotl(y * pow(_P1, -1, 1 << 64) & _M64, 33) * pow(_P2, -1, 1 << 64) & _M64


def _after_first_lane(a):
    return (_rotl((_P5 + 16) ^ _lane(a), 27) * _P1 + _P4) & _M64


def colliding_key(a, b, a2):
    """The 16-byte key (a2, b2) whose XXH64 equals that of (a, b)."""
    return a2, _unlane(_after_first_lane(a) ^ _lane(b) ^ _after_first_lane(a2))


def wide_keys(pairs):
    return np.array(pairs, dtype="<u8").view(np.uint8).reshape(-1, 16)


def test_colliding_keys_really_collide():
    rng = np.random.default_rng(30)
    a, b, a2 = (int(x) for x in rng.integers(0, 2**63, 3))
    keys = wide_keys([(a, b), colliding_key(a, b, a2)])
    assert keys[0].tobytes() != keys[1].tobytes()
    assert xxh64(keys[0]) == xxh64(keys[1])  # the xxhash package
    assert len(set(hash_rows(keys).tolist())) == 1  # statecore's key hash


def colliding_rows(rng, n_plain, groups):
    """Rows of WIDE_KEY -> WIDE_VALUE: ``n_plain`` random keys, then for each size in
    ``groups`` that many distinct keys sharing one 64-bit hash; plus miss keys, some of
    which share a hash with present keys. Row order is shuffled."""
    keys = [tuple(int(x) for x in k) for k in rng.integers(0, 2**63, (n_plain, 2))]
    misses = [tuple(int(x) for x in k) for k in rng.integers(0, 2**63, (50, 2))]
    for size in groups:
        a, b = (int(x) for x in rng.integers(0, 2**63, 2))
        group = [(a, b)] + [colliding_key(a, b, int(a2)) for a2 in rng.integers(0, 2**63, size)]
        keys += group[:size]
        misses.append(group[size])  # same hash as the group, not in the file
    keys = wide_keys(keys)[rng.permutation(len(keys))]
    assert len(np.unique(keys, axis=0)) == len(keys)
    values = rng.integers(0, 2**62, (len(keys), 1)).astype("<i8").view(np.uint8)
    return np.ascontiguousarray(np.concatenate([keys, values], axis=1)), wide_keys(misses)


@pytest.mark.parametrize("chunk_rows", [None, 1, 7, 300])
def test_keys_with_equal_64_bit_hashes_are_written_and_found(tmp_path, chunk_rows):
    """Distinct keys with equal full hashes, in one write_rows call and across calls: the
    writer takes them (it used to refuse them as duplicates), places them as the format
    says (the reference encoder compares no keys), and lookups, mark_rows and verify() tell
    them apart by their bytes."""
    rng = np.random.default_rng([31, chunk_rows or 0])
    rows, misses = colliding_rows(rng, 1000, [2, 2, 3, 5, 2])
    hashes = hash_rows(np.ascontiguousarray(rows[:, :16]))
    assert len(hashes) - len(np.unique(hashes)) == 1 + 1 + 2 + 4 + 1
    chunks = None if chunk_rows is None else [rows[i:i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    path = tmp_path / "s"
    info = write_file(path, WIDE_KEY, WIDE_VALUE, rows, block_size=1024, chunks=chunks)
    # pairs within each group: 1 + 1 + 3 + 10 + 1
    assert info["hash_collisions"] == 16
    assert path.read_bytes() == reference_snapshot(WIDE_KEY, WIDE_VALUE, rows, 7, bytes(16), 1024)
    with SnapshotReader(path) as reader:
        reader.verify()
        check_against_model(reader, rows, misses, WIDE_KEY, WIDE_VALUE)
        mask = np.zeros(len(rows), np.uint8)
        reader.mark_rows(np.ascontiguousarray(rows[::2, :16]), mask)
        assert mask.tolist() == [1 - i % 2 for i in range(len(rows))]


def test_a_duplicate_wide_key_is_refused_in_one_call_and_found_by_verify_across_calls(tmp_path):
    """Within one write_rows call the writer compares the bytes of keys with equal hashes. A
    16-byte key written again in a later call cannot be told from a collision (earlier rows
    are not kept), so the writer takes it; verify() finds the key in two rows."""
    rng = np.random.default_rng(32)
    rows, _ = colliding_rows(rng, 200, [2])
    dup = rows.copy()
    dup[150, :16] = dup[20, :16]
    with pytest.raises(ValueError, match="duplicate key: row 150 has the key of row 20"):
        SnapshotWriter(io.BytesIO(), WIDE_KEY, WIDE_VALUE, len(dup), 1).write_rows(dup)
    path = tmp_path / "dup"
    info = write_file(path, WIDE_KEY, WIDE_VALUE, dup, chunks=[dup[:100], dup[100:]])
    assert info["hash_collisions"] == 2  # the pair made above, and the duplicate
    with SnapshotReader(path) as reader:
        reader.verify(index=False)
        with pytest.raises(StateCorruptionError, match="two rows have the same key"):
            reader.verify()


def test_verify_checks_that_each_rows_key_finds_it(tmp_path):
    """A slot index whose tags or order are wrong (sealed with valid checksums, as only a
    broken writer makes it) fails verify(); before, verify() checked row numbers only."""
    rng = np.random.default_rng(33)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, _ = make_rows(rng, key_schema, value_schema, 40, n_misses=0)
    good = reference_snapshot(key_schema, value_schema, rows, 7, bytes(16), 4096)
    header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(good)))
    slots_at, n_slots = header["slots_offset"], header["n_slots"]
    slots = np.frombuffer(good, "<u4", n_slots * 2, slots_at).reshape(-1, 2).copy()
    used = np.flatnonzero(slots[:, 1])

    def sealed(new_slots):
        data = bytearray(good)
        data[slots_at:slots_at + n_slots * 8] = new_slots.tobytes()
        table_at = header["checksums_offset"]
        for b in range(header["n_blocks"]):
            lo = 4096 + b * 4096
            struct.pack_into("<Q", data, table_at + b * 8, xxh64(data[lo:min(lo + 4096, table_at)]))
        footer_at = len(data) - 64
        struct.pack_into("<Q", data, footer_at + 8, xxh64(data[table_at:footer_at]))
        struct.pack_into("<Q", data, footer_at + 56, xxh64(data[footer_at:footer_at + 56]))
        return bytes(data)

    wrong_tag = slots.copy()
    wrong_tag[used[3], 0] ^= 1 << 31  # same home slot, another tag
    swapped = slots.copy()
    swapped[[used[0], used[1]], 1] = swapped[[used[1], used[0]], 1]  # rows in the wrong slots
    # An entry at its home slot moved one on, past an empty slot: no lookup reaches it.
    home = (slots[:, 0] & (n_slots - 1)) == np.arange(n_slots)
    p = next(int(p) for p in used if home[p] and p + 1 < n_slots and slots[p + 1, 1] == 0)
    unreachable = slots.copy()
    unreachable[p + 1], unreachable[p] = slots[p], 0
    assert FOOTER.unpack_from(good, len(good) - 64)[4] >= 1  # so the displacement check passes
    for new_slots, match in [(wrong_tag, "tag is not the hash"), (swapped, "tag is not the hash"),
                             (unreachable, "does not reach")]:
        (tmp_path / "s").write_bytes(sealed(new_slots))
        with SnapshotReader(tmp_path / "s") as reader:
            reader.verify(index=False)
            with pytest.raises(StateCorruptionError, match=match):
                reader.verify()
    (tmp_path / "s").write_bytes(sealed(slots))
    with SnapshotReader(tmp_path / "s") as reader:
        reader.verify()


# -- lifetime -----------------------------------------------------------------------------------
def test_close_and_use_after_close(small_snapshot):
    path, rows, _, key_schema, _ = small_snapshot
    reader = SnapshotReader(path)
    key = rows[7, :8].tobytes()
    value = reader.get_row(key)
    values, found = reader.get_batch(key_schema.from_rows(np.ascontiguousarray(rows[:10, :8])))
    batches = list(reader.iter_batches(100))
    cursor = reader.cursor()
    first = cursor.next_rows(5)
    reader.close()
    reader.close()  # harmless
    assert reader.closed
    # Copies survive the mapping.
    assert value == rows[7, 8:].tobytes() and found.all() and first.tobytes() == rows[:5].tobytes()
    assert np.concatenate([k for k, _ in batches]).tobytes() == rows[:, :8].tobytes()
    for call in (lambda: reader.get_row(key), lambda: reader.get(1), lambda: 1 in reader,
                 lambda: reader.get_batch(key_schema.from_rows(np.ascontiguousarray(rows[:2, :8]))),
                 lambda: cursor.next_rows(5), reader.cursor, lambda: list(reader.items()), reader.verify):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert len(reader) == 500
    with pytest.raises(ValueError):
        with reader:
            pass


def test_readers_of_one_file_share_nothing_but_the_file(small_snapshot):
    path, rows, _, _, _ = small_snapshot
    with SnapshotReader(path) as a, SnapshotReader(path) as b:
        assert a.get_row(rows[3, :8].tobytes()) == b.get_row(rows[3, :8].tobytes())
        assert a.verified_blocks() == b.verified_blocks() > 0


def test_get_rows_checks_shapes(small_snapshot):
    path = small_snapshot[0]
    with SnapshotReader(path) as reader:
        with pytest.raises(ValueError):
            reader.get_rows(np.zeros((3, 7), np.uint8), np.zeros((3, 16), np.uint8), np.zeros(3, np.uint8))
        with pytest.raises(ValueError):
            reader.get_rows(np.zeros((3, 8), np.uint8), np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8))
        with pytest.raises(ValueError):
            reader.get_row(b"1234567")
        reader.get_rows(np.zeros((0, 8), np.uint8), np.zeros((0, 16), np.uint8), np.zeros(0, np.uint8))


@pytest.mark.parametrize("n", [0, 1, 12, 100_000])
def test_mark_rows_marks_the_file_order_index_of_each_found_key(tmp_path, n):
    rng = np.random.default_rng([n, 3])
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, misses = make_rows(rng, key_schema, value_schema, n)
    path = tmp_path / "s.snapshot"
    write_file(path, key_schema, value_schema, rows, chunks=split_randomly(rng, rows))
    kw = key_schema.width
    with SnapshotReader(path, key_schema, value_schema) as reader:
        chosen = rng.permutation(n)[: n // 3 + 1]  # rows are written in file order
        probe = np.concatenate([rows[chosen, :kw], misses[:50, :kw]])
        probe = np.ascontiguousarray(probe[rng.permutation(probe.shape[0])])
        mask = np.zeros(n, np.uint8)
        reader.mark_rows(probe, mask)
        expected = np.zeros(n, np.uint8)
        expected[chosen] = 1
        assert (mask == expected).all()
        with pytest.raises(ValueError, match="one per row"):
            reader.mark_rows(probe, np.zeros(n + 1, np.uint8))
        # the cursor leaves the marked rows out (runs at both ends and in between included)
        if n:
            mask[0] = mask[-1] = 1
        cursor, chunks = reader.cursor(), []
        while (chunk := cursor.next_rows(5, skip=mask)) is not None:
            chunks.append(chunk)
        assert np.concatenate(chunks).tobytes() == rows[mask == 0].tobytes() if n else not chunks
        with pytest.raises(ValueError, match="one per row"):
            reader.cursor().next_rows(5, skip=np.zeros(n + 1, np.uint8))
        with pytest.raises(ValueError):
            reader.mark_rows(np.zeros((2, kw + 1), np.uint8), mask)


# -- corruption fuzz, in subprocesses -----------------------------------------------------------
DRIVER = r'''
import json, sys
import numpy as np
from statecore._snapshot import SnapshotReader
from statecore.errors import StateCorruptionError

pristine_path, rows_path, misses_path, cases_path, case_path = sys.argv[1:]
pristine = open(pristine_path, "rb").read()
rows = np.load(rows_path)
misses = np.load(misses_path)
kw = misses.shape[1]
vw = rows.shape[1] - kw
keys = np.ascontiguousarray(rows[:, :kw])

def check(case):
    with SnapshotReader(case_path) as reader:
        if case["verify"]:
            reader.verify()
        values = np.zeros((len(keys), vw), np.uint8)
        found = np.zeros(len(keys), np.uint8)
        reader.get_rows(keys, values, found)
        if not (found.all() and np.array_equal(values, rows[:, kw:])):
            return "wrong: lookups"
        found = np.ones(len(misses), np.uint8)
        reader.get_rows(misses, np.zeros((len(misses), vw), np.uint8), found)
        if found.any():
            return "wrong: a missing key was found"
        for i in range(0, len(keys), 37):
            if reader.get_row(keys[i].tobytes()) != rows[i, kw:].tobytes():
                return "wrong: get_row"
        cursor = reader.cursor()
        chunks = []
        while (chunk := cursor.next_rows(100)) is not None:
            chunks.append(chunk)
        if not np.array_equal(np.concatenate(chunks), rows):
            return "wrong: iteration"
        if len(reader) != len(rows):
            return "wrong: len"
    return "ok"

for case in json.load(open(cases_path)):
    data = bytearray(pristine)
    if case["kind"] == "flip":
        data[case["offset"]] ^= case["mask"]
    else:
        data = data[:case["length"]]
    with open(case_path, "wb") as f:
        f.write(data)
    try:
        result = check(case)
    except StateCorruptionError as e:
        result = "error"
    except Exception as e:
        result = f"other: {type(e).__name__}: {e}"
    print(json.dumps({**case, "result": result}), flush=True)
'''


def fuzz_cases(rng, size, header, n_cases):
    """Single-byte flips spread over every region, then truncations."""
    json_end = 136 + header["schema_json_len"]
    regions = [(0, 136), (136, json_end), (json_end, 4088), (4088, 4096),
               (4096, header["slots_offset"]), (header["slots_offset"], header["checksums_offset"]),
               (header["checksums_offset"], size - 64), (size - 64, size)]
    cases = []
    for i in range(n_cases):
        lo, hi = regions[i % len(regions)]
        cases.append({"kind": "flip", "offset": int(rng.integers(lo, hi)),
                      "mask": int(rng.integers(1, 256)), "verify": bool(i % 3 == 0)})
    for length in rng.integers(0, size, size=n_cases // 8):
        cases.append({"kind": "truncate", "length": int(length), "verify": False})
    return cases


@pytest.mark.parametrize("layout,block_size,seed", [("int64->int64,float64", 512, 1),
                                                    ("multi-field key", 256, 2),
                                                    ("set", 64, 3),
                                                    ("int64->int64,float64", 4096, 4)])
def test_corruption_fuzz_in_subprocess(tmp_path, layout, block_size, seed):
    rng = np.random.default_rng(seed)
    key_schema, value_schema = schemas(layout)
    rows, misses = make_rows(rng, key_schema, value_schema, 400)
    path = tmp_path / "pristine"
    write_file(path, key_schema, value_schema, rows, block_size=block_size)
    size = path.stat().st_size
    header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(path.read_bytes())))
    cases = fuzz_cases(rng, size, header, 160)
    np.save(tmp_path / "rows.npy", rows)
    np.save(tmp_path / "misses.npy", misses)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, tmp_path / "driver.py", path, tmp_path / "rows.npy", tmp_path / "misses.npy",
            tmp_path / "cases.json", tmp_path / "case"]
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=120)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    if proc.returncode != 0:
        last = results[-1] if results else None
        pytest.fail(f"driver exited with {proc.returncode} (negative: killed by a signal) after "
                    f"{len(results)} of {len(cases)} cases; last finished: {last}\n{proc.stderr[-3000:]}")
    assert len(results) == len(cases)
    bad = [r for r in results if r["result"] not in ("ok", "error")]
    assert not bad, bad[:5]
    # Every byte is under a checksum: verify() finds every flip, and a truncation never opens.
    missed = [r for r in results if (r["verify"] or r["kind"] == "truncate") and r["result"] != "error"]
    assert not missed, missed[:5]
    assert sum(r["result"] == "error" for r in results) > len(results) // 2


# -- a file truncated while mapped ------------------------------------------------------------
TRUNCATION_CHILD = r'''
import faulthandler, json, mmap, os, sys, threading
import numpy as np
from statecore._snapshot import SnapshotReader, SnapshotWriter, _guarded_mappings
from statecore.errors import StateCorruptionError

path, scenario, cut_at, handler = sys.argv[1:]
if handler == "faulthandler":
    faulthandler.enable()  # as pytest does: the guard is installed over it and passes other faults on
KEY, VALUE = np.dtype([("k", "<i8")]), np.dtype([("v", "<i8")])
n = 200_000  # 8 MB of rows and slots: many pages past any cut
keys = np.zeros(n, KEY)
keys["k"] = np.arange(n) * 7919
rows = np.concatenate([keys.view(np.uint8).reshape(n, 8),
                       np.arange(n, dtype="<i8").view(np.uint8).reshape(n, 8)], axis=1)
with open(path, "wb") as f:
    w = SnapshotWriter(f, KEY, VALUE, n, 3, block_size=4096)
    w.write_rows(rows)
    w.finish()
size = os.path.getsize(path)
cut = {"zero": 0, "header": 100, "middle": size // 2 + 17, "last page": size - 16}[cut_at]
reader = SnapshotReader(path)
assert reader.get((7919 * 5,)) == (5,) and _guarded_mappings() == 1
out = {}

def outcome(call):
    try:
        call()
        return "returned"
    except StateCorruptionError as e:
        return "truncated" if "truncated while mapped" in e.reason and e.path == path else repr(e)
    except Exception as e:
        return repr(e)

if scenario == "calls":
    cursor = reader.cursor()
    os.truncate(path, cut)
    probe = np.ascontiguousarray(rows[::1000, :8])
    calls = {
        "get_row": lambda: reader.get_row(rows[123, :8].tobytes()),
        "get": lambda: reader.get((7919 * 9,)),
        "contains": lambda: (7919 * 9,) in reader,
        "get_batch": lambda: reader.get_batch(keys),
        "get_rows": lambda: reader.get_rows(probe, np.zeros((len(probe), 8), np.uint8),
                                            np.zeros(len(probe), np.uint8)),
        "mark_rows": lambda: reader.mark_rows(probe, np.zeros(n, np.uint8)),
        "next_rows": lambda: cursor.next_rows(n),
        "items": lambda: list(reader.items()),
        "iter_batches": lambda: list(reader.iter_batches()),
        "verify": reader.verify,
        "verify blocks": lambda: reader.verify(index=False),
        "cursor": reader.cursor,
    }
    out = {name: outcome(call) for name, call in calls.items()}
elif scenario == "threads":
    results = [[] for _ in range(3)]
    started = threading.Barrier(4)

    def lookups(mine):
        started.wait()
        while True:
            try:
                values, found = reader.get_batch(keys)
            except StateCorruptionError as e:
                mine.append("truncated" if "truncated while mapped" in e.reason else repr(e))
                return
            mine.append("ok" if found.all() and (values["v"] == np.arange(n)).all() else "wrong")

    threads = [threading.Thread(target=lookups, args=(r,)) for r in results]
    for t in threads:
        t.start()
    started.wait()
    os.truncate(path, cut)
    for t in threads:
        t.join()
    out = {f"thread {i}": sorted(set(r[:-1])) + [r[-1]] for i, r in enumerate(results)}
elif scenario == "many":
    # The guard's table holds 4096 mappings; more readers still open and work, unguarded.
    readers = [SnapshotReader(path) for _ in range(4200)]
    out["guarded"] = _guarded_mappings()
    out["lookups"] = sum(r.get((7919 * i,)) == (i,) for i, r in enumerate(readers))
    for r in readers:
        r.close()
elif scenario == "foreign":
    # A SIGBUS outside every snapshot mapping is not the guard's: it goes to the handler
    # installed before (faulthandler's, or the default action) and the process dies.
    with open(path + ".other", "wb") as f:
        f.write(b"x" * (1 << 16))
    with open(path + ".other", "rb") as f:
        other = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(path + ".other", 0)
    print("touching", flush=True)
    other[1 << 15]
    out["foreign"] = "survived"
reader.close()
out["guarded after close"] = _guarded_mappings()
print(json.dumps(out), flush=True)
'''


def run_child(tmp_path, *args):
    (tmp_path / "child.py").write_text(TRUNCATION_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "s.snapshot"), *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the SIGBUS guard is Linux only")
@pytest.mark.parametrize("handler", ["default", "faulthandler"])
@pytest.mark.parametrize("cut", ["zero", "header", "middle", "last page"])
def test_a_file_truncated_while_mapped_is_an_error_not_a_crash(tmp_path, cut, handler):
    """Every reader call on a mapped snapshot whose file was truncated raises
    StateCorruptionError; the process does not die of SIGBUS (it did before the guard). A
    cut inside the last page reads as zeros without a fault and is caught as well."""
    proc = run_child(tmp_path, "calls", cut, handler)
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out.pop("guarded after close") == 0
    assert out == {name: "truncated" for name in out} and len(out) == 12


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the SIGBUS guard is Linux only")
def test_threads_reading_a_file_truncated_under_them_get_errors_never_wrong_values(tmp_path):
    proc = run_child(tmp_path, "threads", "middle", "faulthandler")
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out.pop("guarded after close") == 0
    for thread, outcomes in out.items():  # correct results until the cut, then the error
        assert outcomes[-1] == "truncated" and set(outcomes[:-1]) <= {"ok"}, (thread, outcomes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the SIGBUS guard is Linux only")
def test_readers_beyond_the_guards_table_still_work(tmp_path):
    proc = run_child(tmp_path, "many", "middle", "default")
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert json.loads(proc.stdout.splitlines()[-1]) == {"guarded": 4096, "lookups": 4200,
                                                        "guarded after close": 0}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the SIGBUS guard is Linux only")
@pytest.mark.parametrize("handler", ["default", "faulthandler"])
def test_other_sigbus_faults_still_kill_the_process(tmp_path, handler):
    proc = run_child(tmp_path, "foreign", "middle", handler)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.strip() == "touching"
    assert ("Fatal Python error: Bus error" in proc.stderr) == (handler == "faulthandler")


def test_closing_a_reader_unguards_its_mapping(small_snapshot):
    path = small_snapshot[0]
    before = _guarded_mappings()
    readers = [SnapshotReader(path) for _ in range(50)]
    guarded = _guarded_mappings()
    for r in readers:
        r.close()
    assert _guarded_mappings() == before
    if sys.platform.startswith("linux"):
        assert guarded == before + 50


# -- threads --------------------------------------------------------------------------------------
def test_threads_share_a_reader_and_close_does_not_pull_the_mapping_away(tmp_path):
    import threading

    rng = np.random.default_rng(21)
    key_schema, value_schema = schemas("int64->int64,float64")
    rows, _ = make_rows(rng, key_schema, value_schema, 60_000, n_misses=0)
    write_file(tmp_path / "s", key_schema, value_schema, rows, block_size=4096)
    keys = key_schema.from_rows(np.ascontiguousarray(rows[:, :8]))
    expected = rows[:, 8:].tobytes()
    reader = SnapshotReader(tmp_path / "s")
    outcomes = []

    def lookups():  # every block is checked by whichever thread gets there first
        try:
            while True:
                values, found = reader.get_batch(keys)
                outcomes.append(bool(found.all()) and values.tobytes() == expected)
        except ValueError as e:  # closed under us: only between calls, never inside one
            outcomes.append("closed" in str(e))

    threads = [threading.Thread(target=lookups) for _ in range(3)]
    for t in threads:
        t.start()
    while len(outcomes) < 6:
        threading.Event().wait(0.001)
    reader.close()
    for t in threads:
        t.join(timeout=30)
    assert outcomes and all(outcomes)
    assert sum(1 for o in outcomes if o is True) >= 6


def test_a_reader_without_schemas_finds_float_keys_as_the_store_normalizes_them(tmp_path):
    """-0.0 finds the key written as 0.0 and any NaN the NaN key, also through a reader
    built from the file's own schemas."""
    from statecore import RowTable, SnapshotReader, write_snapshot

    t = RowTable(np.dtype([("x", "<f8")]), np.dtype([("c", "<i8")]))
    t.put((0.0,), (1,))
    t.put((float("nan"),), (2,))
    path = str(tmp_path / "1.snapshot")
    with open(path, "wb") as f:
        write_snapshot(f, t, 1)
    for reader in (SnapshotReader(path), SnapshotReader(path, np.dtype([("x", "<f8")]))):
        assert reader.get(-0.0) == (1,)
        assert reader.get(-float("nan")) == (2,)
        reader.close()
