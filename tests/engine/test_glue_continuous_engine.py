"""Continuous execution (pyspark_glue.continuous) without Spark: the sources, the epoch-keyed
sink and the logs. The queries on real Spark are tests/spark/test_glue_continuous.py's."""
import numpy as np
import pyarrow as pa
import pytest

from pyspark_glue.continuous import EpochLog, EpochSink, FileSource, GeneratorSource
from tests.glue_support import write_parquet


def read_all(reader):
    batches = []
    while (batch := reader.next_batch()) is not None:
        batches.append(batch)
    return pa.Table.from_batches(batches) if batches else None


def test_generator_source_is_a_function_of_partition_and_offset():
    source = GeneratorSource(3, max_offset=1000, batch_rows=128, keys_per_partition=50)
    for p in range(3):
        reader = source.reader(p, source.initial_offset(p))
        everything = read_all(reader)
        assert reader.offset() == 1000 and reader.next_batch() is None  # idle at the end
        assert everything.column("offset").to_pylist() == list(range(1000))
        keys = everything.column("key").to_numpy()
        assert (keys % 3 == p).all() and len(np.unique(keys)) == 50  # every key in one partition
        tail = read_all(source.reader(p, 613))  # a reader seeks to any offset it reported
        assert tail.equals(everything.slice(613))
    assert max(b.num_rows for b in read_all(source.reader(0, 0)).to_batches()) <= 128
    with pytest.raises(ValueError, match="GeneratorSource offset is an int"):
        source.reader(0, ["", 0])
    with pytest.raises(ValueError, match="partition 3 is not in 0..2"):
        source.rows(3, 0, 10)


def test_file_source_reads_files_as_they_appear_and_seeks(tmp_path):
    source = FileSource(str(tmp_path), 2, batch_rows=4, discovery_interval_ms=0)
    write_parquet(tmp_path / "0", "0001.parquet", pa.table({"x": list(range(10))}))
    (tmp_path / "0" / ".0002.parquet.tmp").write_bytes(b"half-written")  # ignored: a hidden name
    reader = source.reader(0, source.initial_offset(0))
    assert read_all(reader).column("x").to_pylist() == list(range(10))
    assert reader.offset() == ["0001.parquet", 10]
    assert read_all(source.reader(1, source.initial_offset(1))) is None  # no folder yet: idle, not an error

    write_parquet(tmp_path / "0", "0002.parquet", pa.table({"x": list(range(10, 16))}))
    assert read_all(reader).column("x").to_pylist() == list(range(10, 16))  # the same reader finds the new file
    assert reader.offset() == ["0002.parquet", 6]
    reader.close()

    assert read_all(source.reader(0, ["0001.parquet", 7])).column("x").to_pylist() == list(range(7, 16))
    assert read_all(source.reader(0, ["0001.parquet", 10])).column("x").to_pylist() == list(range(10, 16))
    assert read_all(source.reader(0, ["0002.parquet", 6])) is None
    with pytest.raises(ValueError, match=r"FileSource offset is \[file name, rows read\]"):
        source.reader(0, 5)


def test_epoch_sink_rewrites_an_epoch_and_reads_committed_epochs_only(tmp_path):
    schema = pa.schema([("v", pa.int64())])
    sink = EpochSink(str(tmp_path / "sink"))

    def batch(values):
        return pa.RecordBatch.from_arrays([pa.array(values, pa.int64())], schema=schema)

    messages = [sink.write(1, 0, [batch([1, 2])], schema), sink.write(1, 1, [], schema)]
    assert messages == [{"file": "epoch=1/part-00000.parquet", "rows": 2}, {"file": None, "rows": 0}]
    sink.commit(1, messages)
    sink.write(2, 0, [batch([3])], schema)  # an epoch of a run that failed before committing it
    sink.write(2, 1, [batch([4])], schema)
    assert sink.committed_epochs() == [1]
    assert sink.read().to_pydict() == {"v": [1, 2], "epoch": [1, 1]}

    # The next run runs epoch 2 again: partition 0 now has other rows, partition 1 none.
    sink.discard_after(1)
    assert not (tmp_path / "sink" / "epoch=2").exists()
    sink.write(2, 1, [batch([9])], schema)
    second = [sink.write(2, 0, [batch([5]), batch([6])], schema), sink.write(2, 1, [], schema)]
    assert not (tmp_path / "sink" / "epoch=2" / "part-00001.parquet").exists()  # the stale file is gone
    sink.commit(2, second)
    assert sink.read().to_pydict() == {"v": [1, 2, 5, 6], "epoch": [1, 1, 2, 2]}
    assert sink.commits.read(2) == {"epoch": 2, "files": ["epoch=2/part-00000.parquet"], "rows": 2}


def test_epoch_log(tmp_path):
    log = EpochLog(str(tmp_path / "commits"))
    assert log.epochs() == [] and log.latest() is None
    for e in (1, 2, 3, 10):
        log.write(e, {"epoch": e, "offsets": [e, ["f", e]]})
    (tmp_path / "commits" / ".11.0123456789abcdef0123456789abcdef.tmp").write_bytes(b"{")  # a torn temporary
    assert log.epochs() == [1, 2, 3, 10] and log.latest() == 10
    assert log.read(3) == {"epoch": 3, "offsets": [3, ["f", 3]]}
    log.delete_after(2)
    log.delete_before(2)
    assert log.epochs() == [2]
    (tmp_path / "commits" / "7").write_bytes(b"not json")
    with pytest.raises(ValueError, match=r"commits/7.* at byte 0: the log entry is not JSON"):
        log.read(7)
    with pytest.raises(FileNotFoundError):
        log.read(8)
