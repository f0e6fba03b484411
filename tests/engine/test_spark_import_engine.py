"""``statecore import-spark`` on Spark's files as they should not be, made by hand without
Spark (a FIFO, a device, huge or nested files, a commit beyond the files, an lz4 block over
its bound, schema and offsets entries Spark never writes): each refused with its error and
nothing written. The import of what Spark itself wrote: tests/spark/test_spark_import.py."""
import json
import os
import struct
import subprocess
import sys
import zlib

import pytest
import xxhash

from statecore.cli.output import BAD_INPUT

from tests.paths import REPO_ROOT
from tests.spark.test_spark_import import import_cli
from tests.state_files import put_in_place


def _unsafe_row(*longs):
    """An UnsafeRow of long fields, none null: the null bitset word, then a word per field."""
    return bytes(8) + b"".join(struct.pack("<q", v) for v in longs)


def _lz4_raw_stream(payload):
    """``payload`` as an lz4-java stream of one stored block and the end block."""
    checksum = xxhash.xxh32_intdigest(payload, 0x9747B28C) & 0x0FFFFFFF
    return (b"LZ4Block" + bytes([0x10]) + struct.pack("<iii", len(payload), len(payload), checksum) + payload
            + b"LZ4Block" + bytes([0x10]) + struct.pack("<iii", 0, 0, 0))


def _hadoop_crc(data, chunk=512):
    return b"crc\0" + struct.pack(">i", chunk) + b"".join(
        struct.pack(">I", zlib.crc32(data[i:i + chunk])) for i in range(0, len(data), chunk))


def _utf(text):
    raw = text.encode()
    return struct.pack(">H", len(raw)) + raw


def _struct(*names):
    return json.dumps({"type": "struct", "fields": [{"name": n, "type": "long", "nullable": True, "metadata": {}}
                                                    for n in names]})


def write_spark_checkpoint(root):
    """The files Spark 3.5+ leaves for a one-partition aggregation (long key k, count and sum)
    after batch 0: offsets, commits, the operator's metadata, the schema file, 1.delta and its
    .crc. Returns ``{name: path}`` of the files import-spark reads."""
    state = root / "state" / "0"
    for d in (root / "offsets", root / "commits", state / "_metadata", state / "0" / "_metadata"):
        d.mkdir(parents=True)
    (root / "metadata").write_text('{"id":"q"}')
    files = {"offsets": root / "offsets" / "0", "metadata": state / "_metadata" / "metadata",
             "schema": state / "0" / "_metadata" / "schema", "delta": state / "0" / "1.delta",
             "crc": state / "0" / ".1.delta.crc"}
    files["offsets"].write_text('v1\n{"batchWatermarkMs":0,"batchTimestampMs":0,"conf":{}}\n{}')
    (root / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}')
    files["metadata"].write_text('v1\n' + json.dumps({"operatorInfo": {"operatorId": 0, "operatorName": "agg"},
                                                      "stateStoreInfo": [{"storeName": "default",
                                                                          "numColsPrefixKey": 0,
                                                                          "numPartitions": 1}]}))
    files["schema"].write_bytes(_utf("v1") + _utf(_struct("k")) + _utf(_struct("count", "sum")))
    records = b"".join(struct.pack(">i", 16) + _unsafe_row(k) + struct.pack(">i", 24) + _unsafe_row(1, k * 10)
                       for k in range(5)) + struct.pack(">i", -1)
    delta = _lz4_raw_stream(records)
    files["delta"].write_bytes(delta)
    files["crc"].write_bytes(_hadoop_crc(delta))
    return {name: str(path) for name, path in files.items()}


def import_bounded(checkpoint, out, timeout_s=60, address_space=2 << 30):
    """``python -m statecore import-spark`` in a child limited to ``address_space`` bytes and
    killed after ``timeout_s``: a read of /dev/zero or of a sparse 8 GB file must neither
    exhaust one nor the other."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    root = str(REPO_ROOT)
    try:
        return subprocess.run([sys.executable, "-m", "statecore", "import-spark", str(checkpoint), str(out),
                               "--operator", "0"], cwd=root, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, PYTHONPATH=root), preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"import-spark did not finish within {timeout_s} s")


def test_a_hand_made_spark_checkpoint_imports(tmp_path):
    """The hand-made checkpoint the next tests damage is one import-spark takes."""
    write_spark_checkpoint(tmp_path / "ckpt")
    done = import_bounded(tmp_path / "ckpt", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "5 keys at version 1" in done.stdout


@pytest.mark.parametrize("which, what", [(which, what) for which in ("offsets", "metadata", "schema", "delta", "crc")
                                         for what in ("fifo", "dev_zero", "sparse_8g", "nested_json")
                                         if what != "nested_json" or which not in ("delta", "crc")])
def test_a_spark_file_that_is_a_fifo_a_device_huge_or_nested_is_refused(tmp_path, which, what):
    """Each file import-spark reads replaced by a FIFO, a link to /dev/zero, a sparse 8 GB file
    or JSON nested 100000 deep: exit 3 and one line naming the file, promptly and in bounded
    memory, nothing written (no MemoryError, no RecursionError, no hang)."""
    checkpoint = tmp_path / "ckpt"
    path = write_spark_checkpoint(checkpoint)[which]
    if what in ("fifo", "dev_zero"):
        put_in_place(path, what)
    elif what == "sparse_8g":
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    elif which == "schema":
        with open(path, "wb") as f:
            f.write(_utf("v1") + _utf("[" * 30000 + "]" * 30000) + _utf(_struct("count", "sum")))
    else:
        with open(path, "w") as f:
            f.write("v1\n" + "[" * 100000 + "]" * 100000 + "\n{}")
    out = tmp_path / "out"
    done = import_bounded(checkpoint, out)
    assert done.returncode == BAD_INPUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and path in lines[0], done.stderr
    assert not out.exists()


def test_a_commit_far_beyond_the_files_is_refused_promptly(tmp_path):
    """commits/ names batch 10**12 while the files stop at version 1: the missing version is
    named at once, not found by walking a trillion versions."""
    checkpoint = tmp_path / "ckpt"
    write_spark_checkpoint(checkpoint)
    (checkpoint / "commits" / str(10**12)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    done = import_bounded(checkpoint, tmp_path / "out", timeout_s=30)
    assert done.returncode == BAD_INPUT and f"{10**12 + 1}.delta is missing" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_an_lz4_block_claiming_more_than_the_bound_is_refused_before_it_is_decompressed():
    """A delta whose lz4 blocks claim more than MAX_SPARK_FILE_BYTES once decompressed (a sound
    block, then one of a few bytes on disk claiming 2 GiB): refused by the stated lengths,
    before the second is decompressed."""
    from statecore.spark_rows import MAX_SPARK_FILE_BYTES, SparkFileError, lz4_stream

    first = _lz4_raw_stream(b"x" * 64)[:-21]  # its stored block, without the end block
    body = b"\x1f\x00\x01\x00"
    stream = (first + b"LZ4Block" + bytes([0x20]) + struct.pack("<iii", len(body), 2**31 - 1, 0) + body
              + b"LZ4Block" + bytes([0x10]) + struct.pack("<iii", 0, 0, 0))
    with pytest.raises(SparkFileError, match=f"more than {MAX_SPARK_FILE_BYTES} bytes"):
        lz4_stream(stream, "state/0/0/1.delta")


def test_a_spark_checkpoint_path_that_is_a_symlink_loop_is_bad_input(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    result = import_cli(loop, tmp_path / "out", "--operator", 0)
    assert result.exit_code == BAD_INPUT and "cannot be listed" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key_json, message", [
    ('{"type": "struct", "fields": [1]}', "fields are not Spark's"),
    ('{"type": "struct", "fields": [{"type": "long"}]}', "fields are not Spark's"),
    ('{"type": "struct", "fields": {"k": "long"}}', "fields are not Spark's"),
    ('{"type": "struct", "fields": [{"name": "k", "type": "decimal(x,2)"}]}', "not a decimal type Spark writes"),
    ('{"type": "struct", "fields": [{"name": "k", "type": "decimal(' + "9" * 5000 + ',2)"}]}',
     "not a decimal type Spark writes"),
])
def test_a_state_schema_file_with_fields_spark_never_writes_is_bad_input(tmp_path, key_json, message):
    """A damaged schema file whose key fields are not Spark's JSON: exit 3 and one line, not a traceback."""
    checkpoint = tmp_path / "ckpt"
    path = write_spark_checkpoint(checkpoint)["schema"]
    with open(path, "wb") as f:
        f.write(_utf("v1") + _utf(key_json) + _utf(_struct("count", "sum")))
    result = import_cli(checkpoint, tmp_path / "out", "--operator", 0)
    assert result.exit_code == BAD_INPUT and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_an_offsets_entry_whose_conf_is_not_strings_is_bad_input(tmp_path):
    checkpoint = tmp_path / "ckpt"
    path = write_spark_checkpoint(checkpoint)["offsets"]
    with open(path, "w") as f:
        f.write('v1\n{"conf": {"spark.sql.streaming.stateStore.compression.codec": 4}}\n{}')
    result = import_cli(checkpoint, tmp_path / "out", "--operator", 0)
    assert result.exit_code == BAD_INPUT and "not a Spark offsets log entry" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_names_of_unicode_digits_beside_spark_files_are_ignored(tmp_path):
    """A stray "².delta", "³" directory or commits/"¹" (digits to str.isdigit, not to int): ignored
    like any other name Spark does not write, not a traceback."""
    checkpoint = tmp_path / "ckpt"
    write_spark_checkpoint(checkpoint)
    (checkpoint / "state" / "0" / "0" / "\u00b2.delta").write_bytes(b"x")
    (checkpoint / "state" / "0" / "\u00b3").mkdir()
    (checkpoint / "commits" / "\u00b9").write_text("v1")
    (checkpoint / "offsets" / "\u00b9").write_text("v1")
    result = import_cli(checkpoint, tmp_path / "out", "--operator", 0)
    assert result.exit_code == 0, result.output


def test_a_snapshot_of_a_billionth_version_is_refused_before_a_version_is_committed(tmp_path):
    """A consistent-looking checkpoint whose one snapshot is version 10**9 (commits/ naming its
    batch): the import would commit 10**9 - 1 empty versions first; refused at once, exit 3."""
    from statecore.spark_import import MAX_IMPORTED_VERSIONS

    checkpoint = tmp_path / "ckpt"
    files = write_spark_checkpoint(checkpoint)
    state = checkpoint / "state" / "0" / "0"
    os.rename(files["delta"], state / f"{10**9}.snapshot")
    os.rename(files["crc"], state / f".{10**9}.snapshot.crc")
    (checkpoint / "commits" / str(10**9 - 1)).write_text("v1")
    done = import_bounded(checkpoint, tmp_path / "out", timeout_s=30)
    assert done.returncode == BAD_INPUT and f"at most {MAX_IMPORTED_VERSIONS}" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
