"""statecore.arrow_rows.parquet_writer: the output and dump files' writer."""
import io

import pyarrow as pa
import pyarrow.parquet as pq


def test_parquet_writer_keeps_dictionaries_for_text_only_and_round_trips():
    """Numbers are written plain (a dictionary tried on mostly distinct values costs about
    half the write); string and binary columns keep their dictionaries; the rows read back
    exactly."""
    from statecore.arrow_rows import parquet_writer

    schema = pa.schema([("key", pa.int64()), ("count", pa.int32()), ("region", pa.binary()), ("name", pa.string()),
                        ("amount", pa.float64())])
    table = pa.table({"key": list(range(1000)), "count": [i % 3 for i in range(1000)],
                      "region": [b"eu", b"us"] * 500, "name": ["a", "b", "c", "d"] * 250,
                      "amount": [i / 7 for i in range(1000)]}, schema=schema)
    out = io.BytesIO()
    with parquet_writer(out, schema) as writer:
        writer.write_table(table)
    out.seek(0)
    f = pq.ParquetFile(out)
    encodings = {schema.field(i).name: f.metadata.row_group(0).column(i).encodings for i in range(len(schema))}
    assert [name for name, e in encodings.items() if "RLE_DICTIONARY" in e] == ["region", "name"]
    assert f.read().equals(table)
