"""Delta files: round trips over layouts and sources, order of interleaved puts and removes
against a dict model, golden bytes pinning format versions 1 and 2, header checks, and damage
(truncation at every offset, seeded byte-level fuzz in subprocesses, splicing), which must
always be StateCorruptionError and never wrong rows or a crash."""
import io
import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import xxhash

import statecore
from statecore import RowTable, SchemaMismatchError, StateCorruptionError
from statecore._delta import (
    BLOCK_HEADER_SIZE, BLOCK_PUTS, BLOCK_REMOVES, DEFAULT_BLOCK_BYTES, DELTA_HEADER_SIZE, FORMAT_VERSION,
    HEADER_SIZE, MAX_BLOCK_RAW_SIZE, TRAILER_MAGIC, TRAILER_SIZE, DeltaHeader, DeltaReader, DeltaWriter, apply_delta,
    encode_delta, read_delta, read_delta_header,
)
from statecore.errors import IllegalStateError
from statecore.schema import RowSchema

LAYOUTS = [
    ("int64->count,sum", [("k", "<i8")], [("count", "<i8"), ("sum", "<f8")]),
    ("name,flag,id->float32", [("name", "S5"), ("flag", "?"), ("id", "<i4")], [("x", "<f4")]),
    ("int64->set", [("k", "<i8")], []),
    ("uint8->uint16", [("b", "u1")], [("v", "<u2")]),
]
I8 = RowSchema([("k", "<i8")])
I8F8 = RowSchema([("count", "<i8"), ("sum", "<f8")])


def schemas(layout):
    _, key, value = layout
    return RowSchema(np.dtype(key)), RowSchema(np.dtype(value))


def rows(rng, n, width):
    return rng.integers(0, 256, (n, width), dtype=np.uint8)


def int_keys(values):
    return np.asarray(values, dtype="<i8").view(np.uint8).reshape(-1, 8)


def flatten(blocks):
    """The records of decoded blocks, in order: ``(kind, key bytes, value bytes or None)``."""
    out = []
    for kind, keys, values in blocks:
        for i in range(keys.shape[0]):
            out.append((kind, keys[i].tobytes(), None if values is None else values[i].tobytes()))
    return out


def table_contents(table):
    """``{key bytes: value bytes}`` of a RowTable."""
    out = {}
    cursor = table.cursor()
    while (chunk := cursor.next_rows(4096)) is not None:
        for row in chunk:
            raw = row.tobytes()
            out[raw[:table.key_width]] = raw[table.key_width:]
    return out


def multi_block_delta(seed=0, n=600, block_bytes=512, compression="lz4"):
    """A delta of several puts and removes blocks over int64 -> (int64, float64) rows."""
    rng = np.random.default_rng(seed)
    keys = int_keys(rng.integers(0, 200, n))
    values = rows(rng, n, 16)
    out = io.BytesIO()
    w = DeltaWriter(out, I8, I8F8, 3, lineage=b"L" * 16, compression=compression, block_bytes=block_bytes)
    w.put_rows(keys[: n // 2], values[: n // 2])
    w.remove_rows(keys[n // 4: n // 2])
    w.put_rows(keys[n // 2:], values[n // 2:])
    w.finish()
    return out.getvalue()


# -- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l[0])
@pytest.mark.parametrize("n", [0, 1, 1000])
@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_round_trip(layout, n, compression):
    ks, vs = schemas(layout)
    rng = np.random.default_rng(n)
    keys, values, gone = rows(rng, n, ks.width), rows(rng, n, vs.width), rows(rng, n // 3, ks.width)
    keys.flags.writeable = values.flags.writeable = gone.flags.writeable = False  # read-only input works
    data = encode_delta(ks, vs, 42, puts=(keys, values), removes=gone, compression=compression,
                        block_bytes=1024)
    reader = DeltaReader(data, ks, vs)
    assert (reader.store_version, reader.compression, reader.key_width, reader.value_width) == \
        (42, compression, ks.width, vs.width)
    assert reader.n_puts is None and not reader.finished
    blocks = list(reader)
    assert reader.finished and (reader.n_puts, reader.n_removes) == (n, n // 3)
    assert reader.n_blocks == len(blocks)
    if n == 1000:
        assert len(blocks) >= 4
    expected = [(BLOCK_PUTS, keys[i].tobytes(), values[i].tobytes()) for i in range(n)]
    expected += [(BLOCK_REMOVES, gone[i].tobytes(), None) for i in range(n // 3)]
    assert flatten(blocks) == expected
    for kind, k, v in blocks:  # the caller owns what it gets: new, writable, contiguous arrays
        assert k.dtype == np.uint8 and k.flags.c_contiguous and k.flags.writeable
        assert v is None or (v.shape == (k.shape[0], vs.width) and v.flags.c_contiguous)


def test_interleaved_puts_and_removes_replay_like_a_dict(rand):
    """Random put/remove calls of random sizes (0 to several blocks) over a small key space,
    onto a table holding a previous version: the table must equal a dict replaying the same
    calls, and the decoded record stream must equal the calls' records in order."""
    table = RowTable(I8, I8F8)
    model = {}
    base_keys = int_keys(rand.permutation(300)[:150])
    base_values = rows(rand, 150, 16)
    table.put_rows(base_keys, base_values)
    for i in range(150):
        model[base_keys[i].tobytes()] = base_values[i].tobytes()

    out = io.BytesIO()
    w = DeltaWriter(out, I8, I8F8, 9, block_bytes=256)  # 10 puts or 32 removes per block
    ops = []
    for _ in range(60):
        n = int(rand.choice([0, 1, 5, 31, 32, 33, 100]))
        keys = int_keys(rand.integers(0, 300, n))
        if rand.random() < 0.55:
            values = rows(rand, n, 16)
            w.put_rows(keys, values)
            ops += [(BLOCK_PUTS, keys[i].tobytes(), values[i].tobytes()) for i in range(n)]
        else:
            w.remove_rows(keys)
            ops += [(BLOCK_REMOVES, keys[i].tobytes(), None) for i in range(n)]
    summary = w.finish()
    for kind, key, value in ops:
        if kind == BLOCK_PUTS:
            model[key] = value
        else:
            model.pop(key, None)
    data = out.getvalue()
    assert summary["bytes_written"] == len(data)
    assert summary["n_puts"] == sum(op[0] == BLOCK_PUTS for op in ops)
    assert summary["n_removes"] == len(ops) - summary["n_puts"]
    blocks = read_delta(data, I8, I8F8)
    assert len(blocks) == summary["n_blocks"]
    assert flatten(blocks) == ops
    result = apply_delta(data, table)
    assert result["store_version"] == 9 and result["n_blocks"] == summary["n_blocks"]
    assert table_contents(table) == model


def test_small_calls_share_blocks():
    out = io.BytesIO()
    w = DeltaWriter(out, I8, I8F8, 1)
    for i in range(100):
        w.put_rows(int_keys([i]), np.full((1, 16), i, dtype=np.uint8))
    w.remove_rows(int_keys([1, 2]))
    w.put_rows(int_keys([3]), np.zeros((1, 16), dtype=np.uint8))
    assert w.finish()["n_blocks"] == 3


def test_whole_blocks_of_keys_go_straight_from_the_callers_array():
    """Removes (and puts of a set) bigger than a block skip the block buffer; a pending
    partial block must still come out first."""
    rng = np.random.default_rng(5)
    keys = int_keys(rng.integers(0, 1 << 40, 1000))
    out = io.BytesIO()
    w = DeltaWriter(out, I8, RowSchema(np.dtype([])), 1, block_bytes=800)  # 100 keys per block
    w.put_rows(keys[:30])
    w.put_rows(keys[30:700])
    w.remove_rows(keys[700:])
    w.put_rows(keys[:250], np.empty((250, 0), dtype=np.uint8))
    assert w.finish()["n_blocks"] == 7 + 3 + 3
    expected = [(BLOCK_PUTS, k.tobytes(), b"") for k in keys[:700]]
    expected += [(BLOCK_REMOVES, k.tobytes(), None) for k in keys[700:]]
    expected += [(BLOCK_PUTS, k.tobytes(), b"") for k in keys[:250]]
    assert flatten(read_delta(out.getvalue())) == expected


def test_one_record_per_block():
    keys, values = int_keys(range(5)), np.zeros((5, 16), np.uint8)
    data = encode_delta(I8, I8F8, 1, puts=(keys, values), removes=keys[:2], block_bytes=1)
    blocks = read_delta(data)
    assert [(k, b.shape[0]) for k, b, _ in blocks] == [(BLOCK_PUTS, 1)] * 5 + [(BLOCK_REMOVES, 1)] * 2


class FailingSink:
    def __init__(self, fail_after):
        self.calls, self.fail_after = 0, fail_after

    def write(self, data):
        self.calls += 1
        if self.calls > self.fail_after:
            raise OSError("disk full")
        return len(data)


def test_a_failed_write_stops_the_writer():
    w = DeltaWriter(FailingSink(fail_after=2), I8, I8F8, 1, block_bytes=160)  # header + 1 block header
    with pytest.raises(OSError, match="disk full"):
        w.put_rows(int_keys(range(30)), np.zeros((30, 16), np.uint8))
    with pytest.raises(IllegalStateError, match="failed"):
        w.remove_rows(int_keys([1]))
    with pytest.raises(IllegalStateError, match="failed"):
        w.finish()


def test_a_reader_stops_at_damage():
    data = bytearray(multi_block_delta())
    data[block_spans(bytes(data))[1][0] + 8] ^= 1
    reader = DeltaReader(bytes(data))
    next(reader)
    with pytest.raises(StateCorruptionError) as first:
        next(reader)
    with pytest.raises(StateCorruptionError) as again:  # never reads on from a lost position
        next(reader)
    assert again.value is first.value and reader.n_puts is None


class TrickleReader:
    """A file object whose read() returns at most 7 bytes, as raw streams may."""

    def __init__(self, data):
        self.buf = io.BytesIO(data)

    def read(self, n=-1):
        return self.buf.read(min(n, 7) if n >= 0 else 7)


class WriteOnlySink:
    """Only write(), no seek or tell; takes at most 5000 bytes per call, as raw files may."""

    def __init__(self):
        self.parts = []

    def write(self, data):
        chunk = bytes(data[:5000])
        self.parts.append(chunk)
        return len(chunk)


def test_sources_and_sinks(tmp_path):
    data = multi_block_delta()
    expected = flatten(read_delta(data))
    sink = WriteOnlySink()
    w = DeltaWriter(sink, I8, I8F8, 3, lineage=b"L" * 16, block_bytes=512)
    for kind, keys, values in read_delta(data):
        w.put_rows(keys, values) if kind == BLOCK_PUTS else w.remove_rows(keys)
    w.finish()
    assert b"".join(sink.parts) == data  # the encoding is deterministic
    path = tmp_path / "3.delta"
    path.write_bytes(data)
    with open(path, "rb") as f:
        assert flatten(read_delta(f)) == expected
    for source in [bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8),
                   io.BytesIO(data), TrickleReader(data)]:
        assert flatten(read_delta(source, I8, I8F8)) == expected


def test_fsspec_files_need_no_seek():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    rng = np.random.default_rng(1)
    keys, values = int_keys(rng.integers(0, 1 << 62, 5000)), rows(rng, 5000, 16)
    with fs.open("/delta-test/1.delta", "wb") as f:
        w = DeltaWriter(f, I8, I8F8, 1, block_bytes=4096)
        w.put_rows(keys, values)
        w.finish()
    with fs.open("/delta-test/1.delta", "rb") as f:
        blocks = read_delta(f, I8, I8F8)
    assert np.array_equal(np.concatenate([b[1] for b in blocks]), keys)
    fs.rm("/delta-test", recursive=True)


# -- the format ----------------------------------------------------------------------------

def tiny_delta(compression):
    """The golden delta: put 1->(10, 0.5), put 2->(20, 1.5), remove 1; version 7, of 1 key."""
    values = np.array([(10, 0.5), (20, 1.5)], dtype=I8F8.dtype).view(np.uint8).reshape(2, 16)
    return encode_delta(I8, I8F8, 7, puts=(int_keys([1, 2]), values), removes=int_keys([1]),
                        lineage=bytes(range(16)), compression=compression, num_keys=1)


# Pinned once from format version 1 (the same delta, with no key count): deltas written by
# earlier builds, which must still read.
GOLDEN_V1_NONE = bytes.fromhex(
    "534344454c5441010100000008000000100000000000000005023e6143c5809242bcdd79550d7f250700000000000000"
    "000102030405060708090a0b0c0d0e0f79e3d6ed81615e7001000000020000003000000030000000bc29eae4f1d3d032"
    "b7b5c68d757023af010000000000000002000000000000000a00000000000000000000000000e03f1400000000000000"
    "000000000000f83f020000000100000008000000080000009599a4a217cb299f6475631c21031d220100000000000000"
    "534344454e440001020000000000000002000000000000000100000000000000c074319f17d066eac3a26adcd1cd9372"
)
GOLDEN_V1_LZ4 = bytes.fromhex(
    "534344454c5441010100010008000000100000000000000005023e6143c5809242bcdd79550d7f250700000000000000"
    "000102030405060708090a0b0c0d0e0fae29b8b44713d63401000000020000003000000021000000fd36bbdd2c65625c"
    "41c425aaf6a5210022010001001202070023000a080002020032e03f1409009000000000000000f83f02000000010000"
    "0008000000090000006389b99e66777cd85a77e1d2ad104c3c800100000000000000534344454e440001020000000000"
    "0000020000000000000001000000000000009d97802322ee6669b941fd63e2ba24a9"
)
# Pinned once from format version 2. If a change breaks these, deltas already written no
# longer read: bump FORMAT_VERSION instead. The uncompressed file must also still encode
# byte for byte; lz4's output may change between lz4 releases, so that file is only read.
GOLDEN_NONE = bytes.fromhex(
    "534344454c5441010200000008000000100000000000000005023e6143c5809242bcdd79550d7f250700000000000000"
    "000102030405060708090a0b0c0d0e0f3f114bdcf9a85e7901000000020000003000000030000000bc29eae4f1d3d032"
    "b7b5c68d757023af010000000000000002000000000000000a00000000000000000000000000e03f1400000000000000"
    "000000000000f83f020000000100000008000000080000009599a4a217cb299f6475631c21031d220100000000000000"
    "534344454e4400020200000000000000020000000000000001000000000000000100000000000000bc45c075e5e330d3"
    "630043a0c8489371"
)
GOLDEN_LZ4 = bytes.fromhex(
    "534344454c5441010200010008000000100000000000000005023e6143c5809242bcdd79550d7f250700000000000000"
    "000102030405060708090a0b0c0d0e0fb4bf208d381ef7e801000000020000003000000021000000fd36bbdd2c65625c"
    "41c425aaf6a5210022010001001202070023000a080002020032e03f1409009000000000000000f83f02000000010000"
    "0008000000090000006389b99e66777cd85a77e1d2ad104c3c800100000000000000534344454e440002020000000000"
    "00000200000000000000010000000000000001000000000000002196b065f83046ca7064753e9b712f04"
)


def test_golden_header_bytes():
    data = tiny_delta("lz4")
    expected = (b"SCDELTA\x01" + bytes.fromhex("0200" "01" "00" "08000000" "10000000" "00000000")
                + I8.fingerprint.to_bytes(8, "little") + I8F8.fingerprint.to_bytes(8, "little")
                + (7).to_bytes(8, "little") + bytes(range(16)))
    assert data[:64] == expected
    assert data[64:72] == xxhash.xxh64_digest(expected)[::-1]  # u64 little-endian
    assert len(data) >= HEADER_SIZE + TRAILER_SIZE and data[-56:-48] == b"SCDEND\x00\x02"
    assert data[-24:-16] == (1).to_bytes(8, "little")  # the key count, before the two checksums


def test_golden_files():
    assert tiny_delta("none") == GOLDEN_NONE
    assert tiny_delta("lz4")[:64] == GOLDEN_LZ4[:64]
    for golden, version, num_keys in [(GOLDEN_NONE, 2, 1), (GOLDEN_LZ4, 2, 1),
                                      (GOLDEN_V1_NONE, 1, None), (GOLDEN_V1_LZ4, 1, None)]:
        reader = DeltaReader(golden, I8, I8F8, expected_lineage=bytes(range(16)))
        assert reader.format_version == version and reader.num_keys is None  # not read yet
        assert flatten(reader) == [
            (BLOCK_PUTS, int_keys([1]).tobytes(), np.array([(10, 0.5)], I8F8.dtype).tobytes()),
            (BLOCK_PUTS, int_keys([2]).tobytes(), np.array([(20, 1.5)], I8F8.dtype).tobytes()),
            (BLOCK_REMOVES, int_keys([1]).tobytes(), None),
        ]
        assert (reader.store_version, reader.n_puts, reader.n_removes, reader.n_blocks) == (7, 2, 1, 2)
        assert reader.num_keys == num_keys
        assert DeltaReader(golden).check(decode=False) == (2, 2, 1)


def test_the_key_count_is_recorded_when_given():
    keys = int_keys(range(10))
    values = np.zeros((10, 16), np.uint8)
    for num_keys in [None, 0, 10, (1 << 64) - 2]:
        reader = DeltaReader(encode_delta(I8, I8F8, 3, puts=(keys, values), num_keys=num_keys))
        reader.check()
        assert reader.num_keys == num_keys
    for bad in [-1, 1 << 64, (1 << 64) - 1, 2.0, True, "3"]:
        writer = DeltaWriter(io.BytesIO(), I8, I8F8, 3)
        with pytest.raises(ValueError, match="num_keys must be"):
            writer.finish(num_keys=bad)
        writer.finish(num_keys=1)  # refused before anything was written: the writer still works


def test_a_damaged_key_count_is_caught():
    data = bytearray(tiny_delta("none"))
    data[-24] ^= 1
    with pytest.raises(StateCorruptionError, match="trailer checksum mismatch") as e:
        read_delta(bytes(data))
    assert e.value.offset == len(data) - TRAILER_SIZE


def test_layout_constants():
    assert (HEADER_SIZE, BLOCK_HEADER_SIZE, TRAILER_SIZE, FORMAT_VERSION) == (72, 32, 56, 2)
    assert DEFAULT_BLOCK_BYTES <= MAX_BLOCK_RAW_SIZE


# -- header checks -------------------------------------------------------------------------

def reseal(data, offset, patch):
    """``data`` with ``patch`` at ``offset`` in the header and the header checksum redone."""
    head = bytearray(data[:64])
    head[offset:offset + len(patch)] = patch
    return bytes(head) + xxhash.xxh64_digest(bytes(head))[::-1] + data[72:]


def test_unknown_format_version_is_named():
    data = reseal(multi_block_delta(), 8, (3).to_bytes(2, "little"))
    with pytest.raises(StateCorruptionError, match="unknown delta format version 3; this build reads "
                                                   "versions 1, 2") as e:
        DeltaReader(data, path="ckpt/0/0/3.delta")
    assert (e.value.path, e.value.offset) == ("ckpt/0/0/3.delta", 8)
    assert "checksum does not match" not in str(e.value)
    damaged = bytearray(multi_block_delta())
    damaged[9] = 1  # a flip, not a new version: say so
    with pytest.raises(StateCorruptionError, match="checksum does not match"):
        DeltaReader(bytes(damaged))


def test_header_damage():
    data = multi_block_delta()
    with pytest.raises(StateCorruptionError, match="not a statecore delta") as e:
        DeltaReader(b"X" + data[1:])
    assert e.value.offset == 0
    flipped = bytearray(data)
    flipped[45] ^= 0x10  # inside store_version
    with pytest.raises(StateCorruptionError, match="header checksum mismatch") as e:
        DeltaReader(bytes(flipped))
    assert e.value.offset == 64
    with pytest.raises(StateCorruptionError, match="reserved"):
        DeltaReader(reseal(data, 20, b"\x01"))
    with pytest.raises(StateCorruptionError, match="compression"):
        DeltaReader(reseal(data, 10, b"\x07"))


def test_read_delta_header_decodes_the_checked_header():
    commit, parent = b"C" * 8, b"P" * 8
    data = encode_delta(I8, I8F8, 3, lineage=commit + parent, compression="none")
    for source in [data[:DELTA_HEADER_SIZE], data, bytearray(data), memoryview(data),
                   np.frombuffer(data, np.uint8)]:
        h = read_delta_header(source, path="3.delta")
        assert isinstance(h, DeltaHeader)
        assert (h.store_version, h.commit_id, h.parent_id, h.lineage) == (3, commit, parent, commit + parent)
        assert (h.key_width, h.value_width, h.compression) == (8, 16, "none")
        assert (h.key_fingerprint, h.value_fingerprint) == (I8.fingerprint, I8F8.fingerprint)
    with pytest.raises(AttributeError):
        h.store_version = 6
    reader = DeltaReader(data)
    assert (reader.header.store_version, reader.store_version, reader.commit_id, reader.parent_id) == \
        (3, 3, commit, parent)
    assert DELTA_HEADER_SIZE == HEADER_SIZE == 72


def test_the_readers_attributes_are_its_headers():
    data = encode_delta(I8, I8F8, 3, lineage=b"C" * 8 + b"P" * 8, compression="none")
    reader = DeltaReader(data)
    for name in ("store_version", "lineage", "compression", "key_width", "value_width", "key_fingerprint",
                 "value_fingerprint", "checksum", "commit_id", "parent_id"):
        assert getattr(reader, name) == getattr(reader.header, name), name
    with pytest.raises(AttributeError):
        reader.store_version = 4
    with pytest.raises(AttributeError, match="no attribute 'row_count'"):
        reader.row_count


def test_a_renamed_copy_keeps_its_version(tmp_path):
    """A copy of 3.delta named 6.delta says 3: what the store compares with the name."""
    (tmp_path / "3.delta").write_bytes(encode_delta(I8, I8F8, 3))
    (tmp_path / "6.delta").write_bytes((tmp_path / "3.delta").read_bytes())
    with open(tmp_path / "6.delta", "rb") as f:
        assert read_delta_header(f.read(DELTA_HEADER_SIZE)).store_version == 3
    assert DeltaReader((tmp_path / "6.delta").read_bytes()).store_version == 3


def test_read_delta_header_refuses_what_the_reader_refuses():
    """One parser: every short or damaged header gives the same error from read_delta_header
    as from DeltaReader, and no header byte can change without an error."""
    data = multi_block_delta()
    for cut in range(HEADER_SIZE):
        with pytest.raises(StateCorruptionError, match="truncated") as e:
            read_delta_header(data[:cut], path="d")
        assert (e.value.path, e.value.offset) == ("d", cut)
    cases = [reseal(data, 8, (3).to_bytes(2, "little")), reseal(data, 10, b"\x07"), reseal(data, 11, b"\x01"),
             reseal(data, 20, b"\x01"), reseal(data, 12, bytes(4)), reseal(data, 12, (5 << 20).to_bytes(4, "little"))]
    for at in range(HEADER_SIZE):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[at] ^= 1 << bit
            cases.append(bytes(flipped))
    for case in cases:
        with pytest.raises(StateCorruptionError) as from_header:
            read_delta_header(case, path="d")
        with pytest.raises(StateCorruptionError) as from_reader:
            DeltaReader(case, path="d")
        assert (from_header.value.offset, from_header.value.reason) == \
            (from_reader.value.offset, from_reader.value.reason)


@pytest.mark.parametrize("which", ["key", "value"])
def test_schema_mismatch_names_key_or_value(which):
    data = multi_block_delta()
    other_width = RowSchema([("a", "<i4")])
    same_width = RowSchema([("k", "<f8")]) if which == "key" else RowSchema([("c", "<i8"), ("s", "<f8")])
    for wrong in [other_width, same_width]:
        ks, vs = (wrong, I8F8) if which == "key" else (I8, wrong)
        with pytest.raises(SchemaMismatchError, match=f"^{which} schema mismatch"):
            DeltaReader(data, ks, vs)
        with pytest.raises(SchemaMismatchError, match=f"^{which} schema mismatch"):
            apply_delta(data, RowTable(ks, vs))


def test_lineage():
    run = uuid.UUID(int=0x1234)
    data = encode_delta(I8, I8F8, 1, lineage=run)
    assert DeltaReader(data, expected_lineage=run).lineage == run.bytes
    assert DeltaReader(data, expected_lineage=run.bytes).lineage == run.bytes
    with pytest.raises(StateCorruptionError, match="lineage mismatch") as e:
        DeltaReader(data, expected_lineage=uuid.UUID(int=0x1235), path="x.delta")
    assert (e.value.path, e.value.offset) == ("x.delta", 48)
    with pytest.raises(StateCorruptionError, match="lineage mismatch"):
        apply_delta(data, RowTable(I8, I8F8), expected_lineage=bytes(16))


def test_writer_refuses_bad_arguments():
    out = io.BytesIO()
    with pytest.raises(TypeError, match="key schema needs at least one field"):
        DeltaWriter(out, RowSchema(np.dtype([])), I8, 1)
    for kwargs, match in [({"store_version": -1}, "store_version"), ({"compression": "zstd"}, "compression"),
                          ({"block_bytes": 0}, "block_bytes"), ({"lineage": b"short"}, "16 bytes"),
                          ({"block_bytes": MAX_BLOCK_RAW_SIZE + 1}, "block_bytes")]:
        args = {"store_version": 1, **kwargs}
        with pytest.raises(ValueError, match=match):
            DeltaWriter(out, I8, I8F8, **args)
    w = DeltaWriter(out, I8, I8F8, 1)
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        w.put_rows(np.zeros((1, 4), np.uint8), np.zeros((1, 16), np.uint8))
    with pytest.raises(ValueError, match=r"\(n, 16\)"):
        w.put_rows(np.zeros((1, 8), np.uint8), np.zeros((1, 8), np.uint8))
    with pytest.raises(ValueError, match="2 keys but 1 value rows"):
        w.put_rows(np.zeros((2, 8), np.uint8), np.zeros((1, 16), np.uint8))
    with pytest.raises(ValueError, match="null value"):
        w.put_rows(np.zeros((1, 8), np.uint8))
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        w.remove_rows(np.zeros((1, 9), np.uint8))
    w.finish()
    with pytest.raises(IllegalStateError):
        w.put_rows(np.zeros((1, 8), np.uint8), np.zeros((1, 16), np.uint8))
    with pytest.raises(IllegalStateError):
        w.finish()


# -- damage --------------------------------------------------------------------------------

def test_truncation_at_every_offset():
    data = multi_block_delta(n=40, block_bytes=256)
    assert len(read_delta(data)) >= 4
    for cut in range(len(data)):
        with pytest.raises(StateCorruptionError, match="truncated") as e:
            read_delta(data[:cut], I8, I8F8, path="t.delta")
        assert e.value.path == "t.delta" and e.value.offset == cut, cut
    with pytest.raises(StateCorruptionError, match="truncated"):
        read_delta(TrickleReader(data[:-1]))
    for extra in [b"\0", TRAILER_MAGIC * 7]:
        with pytest.raises(StateCorruptionError, match="bytes follow the trailer") as e:
            read_delta(data + extra)
        assert e.value.offset == len(data)
        with pytest.raises(StateCorruptionError, match="bytes follow the trailer"):
            read_delta(io.BytesIO(data + extra))


class EndlessFile:
    """A file object that never ends: ``prefix``, then ``filler`` bytes forever. Counts the
    bytes it handed out."""

    def __init__(self, prefix=b"", filler=b"\0"):
        self.prefix, self.filler, self.handed_out = prefix, filler, 0

    def read(self, n=-1):
        if n < 0:
            raise AssertionError("read() of a whole endless file")
        out = self.prefix[self.handed_out:self.handed_out + n]
        out += (self.filler * (n // len(self.filler) + 1))[:n - len(out)]
        self.handed_out += n
        return out


def test_an_endless_file_fails_fast_and_reads_little(tmp_path):
    """A file object is read as far as the next check needs, never to its end: a delta that
    is a link to /dev/zero, or a stream that never ends, fails at the first check."""
    if os.path.exists("/dev/zero"):
        os.symlink("/dev/zero", tmp_path / "5.delta")
        with open(tmp_path / "5.delta", "rb") as f:
            with pytest.raises(StateCorruptionError, match="not a statecore delta") as e:
                read_delta(f, I8, I8F8)
            assert e.value.offset == 0 and f.tell() <= 8192  # one buffered read at most
    data = multi_block_delta()
    block_header = data[HEADER_SIZE:HEADER_SIZE + BLOCK_HEADER_SIZE]
    stored = int.from_bytes(block_header[12:16], "little")
    first_block = HEADER_SIZE + BLOCK_HEADER_SIZE
    for source, at, match, most in [
        (EndlessFile(), 0, "not a statecore delta", HEADER_SIZE),
        (EndlessFile(data[:HEADER_SIZE]), HEADER_SIZE, "block header checksum", first_block),
        # endless copies of a valid block header: read as its payload, which fails its checksum
        (EndlessFile(data[:HEADER_SIZE], filler=block_header), first_block, "payload checksum",
         first_block + stored),
        (EndlessFile(data, filler=b"x"), len(data), "bytes follow the trailer", len(data) + 1),
    ]:
        with pytest.raises(StateCorruptionError, match=match) as e:
            read_delta(source, I8, I8F8)
        assert e.value.offset == at and source.handed_out == most


def block_spans(data):
    """``[(start, end)]`` of each block (header and payload) of a valid delta."""
    spans, at = [], HEADER_SIZE
    while data[at:at + 8] != TRAILER_MAGIC:
        stored = int.from_bytes(data[at + 12:at + 16], "little")
        spans.append((at, at + BLOCK_HEADER_SIZE + stored))
        at += BLOCK_HEADER_SIZE + stored
    return spans


def test_dropped_reordered_or_foreign_blocks_are_caught():
    data = multi_block_delta(compression="none")  # equal-size blocks, so swaps stay aligned
    spans = block_spans(data)
    parts = [data[s:e] for s, e in spans]
    assert len(parts) >= 4 and len(parts[1]) == len(parts[2])
    body = lambda ps: data[:HEADER_SIZE] + b"".join(ps) + data[spans[-1][1]:]
    with pytest.raises(StateCorruptionError, match="blocks checksum") as e:
        read_delta(body([parts[0], parts[2], parts[1]] + parts[3:]))
    assert e.value.offset == spans[-1][1]
    with pytest.raises(StateCorruptionError, match="trailer counts"):
        read_delta(body(parts[:1] + parts[2:]))
    other = multi_block_delta(seed=1, compression="none")
    with pytest.raises(StateCorruptionError, match="blocks checksum"):  # a block from another delta
        read_delta(body(parts[:1] + [other[spans[1][0]:spans[1][1]]] + parts[2:]))
    with pytest.raises(StateCorruptionError, match="blocks checksum"):  # another version's header
        read_delta(reseal(data, 40, (4).to_bytes(8, "little")))


def test_block_damage_names_the_offset():
    data = multi_block_delta()
    (s0, e0), (s1, _) = block_spans(data)[:2]
    flipped = bytearray(data)
    flipped[s1 + 5] ^= 1  # n_records of block 1
    with pytest.raises(StateCorruptionError, match="block header checksum") as e:
        read_delta(bytes(flipped))
    assert e.value.offset == s1
    flipped = bytearray(data)
    flipped[e0 - 1] ^= 0x80  # the last payload byte of block 0
    with pytest.raises(StateCorruptionError, match="payload checksum") as e:
        read_delta(bytes(flipped))
    assert e.value.offset == s0 + BLOCK_HEADER_SIZE


def test_lengths_are_checked_before_anything_is_allocated():
    """Block headers whose checksum holds but whose lengths lie (a buggy writer) are refused
    before a byte of payload is read or a buffer allocated."""
    data = multi_block_delta()
    at = HEADER_SIZE

    def with_block_header(kind, n, raw, stored):
        head = (bytes([kind, 0, 0, 0]) + n.to_bytes(4, "little") + raw.to_bytes(4, "little")
                + stored.to_bytes(4, "little") + bytes(8))
        return data[:at] + head + xxhash.xxh64_digest(head)[::-1] + data[at + 32:]

    for kind, n, raw, stored, match in [
        (3, 1, 24, 10, "unknown block kind 3"),
        (1, 0, 0, 10, "cannot have"),
        (1, 2, 24, 10, "cannot have"),
        (2, 1 << 28, 1 << 31, 10, "cannot have"),  # over the cap
        (1, 200_000, 4_800_000, 10, "cannot have"),
        (1, 10, 240, 0xFFFFFFFF, "cannot store"),
        (1, 10, 240, 0, "cannot store"),
    ]:
        with pytest.raises(StateCorruptionError, match=match):
            read_delta(with_block_header(kind, n, raw, stored))


def test_apply_delta_leaves_the_table_unchanged_on_damage():
    rng = np.random.default_rng(3)
    base_keys = int_keys(rng.integers(0, 200, 300))
    table = RowTable(I8, I8F8)
    table.put_rows(base_keys, rows(rng, 300, 16))
    before = table_contents(table)
    data = multi_block_delta(n=600)
    spans = block_spans(data)
    last_payload = bytearray(data)
    last_payload[spans[-1][1] - 1] ^= 4
    bad_counts = bytearray(data)
    bad_counts[-40] ^= 1  # n_blocks in the trailer
    for damaged in [bytes(last_payload), bytes(bad_counts), data[:-1], data + b"\0"]:
        with pytest.raises(StateCorruptionError):
            apply_delta(damaged, table, path="3.delta")
        with pytest.raises(StateCorruptionError):
            apply_delta(io.BytesIO(damaged), table)
        assert table_contents(table) == before
    apply_delta(data, table)
    assert table_contents(table) != before


FUZZ_DRIVER = textwrap.dedent("""
    # Decode seeded mutations of one delta; print a JSON summary. A crash kills this process.
    import io, json, sys
    import numpy as np
    from statecore import StateCorruptionError
    from statecore._delta import read_delta
    from statecore.schema import RowSchema

    path, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ks, vs = RowSchema([("k", "<i8")]), RowSchema([("count", "<i8"), ("sum", "<f8")])
    data = open(path, "rb").read()

    def records(blocks):
        return [(kind, keys.tobytes(), None if values is None else values.tobytes())
                for kind, keys, values in blocks]

    expected = records(read_delta(data, ks, vs))
    out = {"corrupt": 0, "same": 0, "wrong": [], "other": []}
    for case in range(first, first + count):
        rng = np.random.default_rng(case)
        b = bytearray(data)
        how = case % 6
        if how == 0:    # flip 1 to 3 bits
            for _ in range(int(rng.integers(1, 4))):
                i = int(rng.integers(len(b)))
                b[i] ^= 1 << int(rng.integers(8))
        elif how == 1:  # overwrite a byte
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
        elif how == 2:  # truncate
            b = b[:int(rng.integers(len(b)))]
        elif how == 3:  # zero a run, as a torn page would
            i = int(rng.integers(len(b)))
            j = min(len(b), i + int(rng.integers(1, 512)))
            b[i:j] = bytes(j - i)
        elif how == 4:  # cut a range out
            i = int(rng.integers(len(b)))
            del b[i:i + int(rng.integers(1, 64))]
        else:           # insert random bytes
            i = int(rng.integers(len(b)))
            b[i:i] = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        source = bytes(b) if case % 2 else io.BytesIO(bytes(b))
        try:
            got = records(read_delta(source, ks, vs, path="fuzz.delta"))
        except StateCorruptionError as e:
            if e.path != "fuzz.delta" or e.offset is None or not 0 <= e.offset <= len(b):
                out["other"].append([case, "bad path/offset: " + str(e)])
            out["corrupt"] += 1
            continue
        except Exception as e:
            out["other"].append([case, type(e).__name__ + ": " + str(e)])
            continue
        if got == expected:
            out["same"] += 1
        else:
            out["wrong"].append(case)
    print(json.dumps(out))
""")


def test_corruption_fuzz_in_subprocesses(tmp_path):
    """Seeded flips, overwrites, truncations, zeroed runs, cuts and insertions over
    multi-block deltas (lz4 and uncompressed), decoded in child processes: each case is
    StateCorruptionError or exactly the original records; a child killed by a signal fails
    the test."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(statecore.__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    driver = tmp_path / "fuzz_driver.py"
    driver.write_text(FUZZ_DRIVER)
    batch = 1500
    jobs = []
    for i, compression in enumerate(["lz4", "none", "lz4", "none"]):
        data = multi_block_delta(n=1200, block_bytes=2048, compression=compression)
        assert len(block_spans(data)) >= 12
        delta_path = tmp_path / f"fuzz-{compression}.delta"
        delta_path.write_bytes(data)
        first = i * batch
        jobs.append((f"{compression} cases {first}..{first + batch - 1}", subprocess.Popen(
            [sys.executable, str(driver), str(delta_path), str(first), str(batch)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root, env=env, text=True)))
    totals = {"corrupt": 0, "same": 0}
    for cases, proc in jobs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode >= 0, f"fuzz driver killed by signal {-proc.returncode} on {cases}:\n{stderr}"
        assert proc.returncode == 0, f"fuzz driver failed on {cases}:\n{stderr}"
        out = json.loads(stdout)
        assert out["wrong"] == [], f"wrong records decoded without an error ({cases}): {out['wrong']}"
        assert out["other"] == [], f"errors other than StateCorruptionError ({cases}): {out['other'][:5]}"
        totals["corrupt"] += out["corrupt"]
        totals["same"] += out["same"]
    assert totals["corrupt"] + totals["same"] == batch * len(jobs)
    assert totals["corrupt"] > 0.95 * batch * len(jobs)


@pytest.mark.parametrize("decode", [True, False])
def test_check_reads_to_the_end_with_or_without_decompressing(decode):
    key, value = np.dtype([("k", "<i8")]), np.dtype([("v", "<i8")])
    keys = np.zeros(3000, key)
    keys["k"] = np.arange(3000)
    values = np.zeros(3000, value)
    rows_of = lambda a: a.view(np.uint8).reshape(len(a), -1)  # noqa: E731
    data = encode_delta(key, value, 4, puts=(rows_of(keys), rows_of(values)), removes=rows_of(keys[:10]),
                        block_bytes=4096)
    assert DeltaReader(data, key, value).check(decode=decode) == (DeltaReader(data).check()[0], 3000, 10)
    # header (its checksum), block header, payload, trailer: where each is reported
    cases = ((20, 64), (72 + 5, 72), (72 + 32 + 3, 72 + 32), (len(data) - 10, len(data) - TRAILER_SIZE))
    for offset, reported in cases:
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        with pytest.raises(StateCorruptionError) as e:
            DeltaReader(bytes(damaged)).check(decode=decode)
        assert e.value.offset == reported
    with pytest.raises(StateCorruptionError, match="bytes follow the trailer"):
        DeltaReader(data + b"x").check(decode=decode)
