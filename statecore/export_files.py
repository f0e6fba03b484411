"""A store's rows written out as parquet, csv or JSON lines (``statecore dump``), batch by
batch, without Python per row: parquet and csv through pyarrow's writers, JSON lines built
column-wise with numpy's string functions.

Columns are the key fields, then the value fields, then (when given) ``partition_id``
(int32), named after the fields. Types: parquet keeps each field's exact type (unsigned ints
stay unsigned) and writes a fixed bytes field (``S<n>``) as binary; csv and JSON lines are
text, so a bytes field is written as its UTF-8 text (a value that is not UTF-8 is refused:
dump that state as parquet), a bool as ``true``/``false``, a float as the shortest text
that reads back to the same value (NaN and infinities as ``null`` in JSON, as Spark writes
them there; ``nan``/``inf`` in csv).

The caller owns the file (``statecore.cli.dump`` writes a temporary file and renames it).
"""
import json

import numpy as np

__all__ = ["FORMATS", "open_writer", "NotTextError"]

FORMATS = ("parquet", "csv", "jsonl")


class NotTextError(ValueError):
    """A bytes field holds a value that is not UTF-8 text, which csv and JSON lines cannot hold."""


def _empty(dtype):
    return np.zeros(0, dtype=dtype)


def _check_utf8(col, name):
    try:
        return np.strings.decode(col, "utf-8")
    except UnicodeDecodeError as e:
        raise NotTextError(f"field {name!r} holds bytes that are not UTF-8 text ({e.reason}): csv and jsonl are "
                           f"text formats; dump this state as parquet") from None


class _ArrowWriter:
    """Parquet or csv, through pyarrow's streaming writers."""

    def __init__(self, fmt, f, key_dtype, value_dtype, partition_column):
        import pyarrow as pa

        from statecore.arrow_rows import record_batch_of

        self._pa, self._record_batch_of, self._text = pa, record_batch_of, fmt == "csv"
        self._partition_column = partition_column
        schema = self._batch(_empty(key_dtype), _empty(value_dtype), 0).schema
        if fmt == "parquet":
            from statecore.arrow_rows import parquet_writer

            self._writer = parquet_writer(f, schema)
        else:
            import pyarrow.csv as pcsv

            self._writer = pcsv.CSVWriter(f, schema)

    def _batch(self, keys, values, partition_id):
        extra = {} if self._partition_column is None else {self._partition_column: partition_id}
        batch = self._record_batch_of(keys, values, **extra)
        if not self._text:
            return batch
        pa = self._pa
        columns = []
        for name, column in zip(batch.schema.names, batch.columns):
            if pa.types.is_binary(column.type):
                try:
                    column = column.cast(pa.string())
                except pa.ArrowInvalid as e:
                    raise NotTextError(f"field {name!r} holds bytes that are not UTF-8 text ({e}): csv is a text "
                                       f"format; dump this state as parquet") from None
            columns.append(column)
        return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)

    def write(self, keys, values, partition_id=None):
        self._writer.write_batch(self._batch(keys, values, partition_id))

    def close(self):
        self._writer.close()


class _JsonLinesWriter:
    """One JSON object per row, ``{"field": value, ...}``, built a column at a time."""

    def __init__(self, f, key_dtype, value_dtype, partition_column):
        self._f = f
        self._partition_column = partition_column
        self._names = [*key_dtype.names, *value_dtype.names]

    def _text(self, col, name):
        kind = col.dtype.kind
        if kind == "b":
            return np.where(col, "true", "false")
        if kind in "iu":
            return col.astype(str)
        if kind == "f":
            out = col.astype(str)
            out[~np.isfinite(col)] = "null"
            return out
        # Fixed bytes: UTF-8 text, quoted; escapes where JSON needs them.
        text = _check_utf8(col, name)
        matrix = np.ascontiguousarray(col).view(np.uint8).reshape(len(col), col.dtype.itemsize)
        nonzero = matrix != 0
        lengths = np.where(nonzero.any(axis=1), matrix.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
        inside = np.arange(matrix.shape[1])[None, :] < lengths[:, None]
        if ((matrix < 0x20) & inside).any():  # control characters: rare; json.dumps knows them all
            return np.array([json.dumps(s, ensure_ascii=False) for s in text.tolist()], dtype=str)
        text = np.strings.replace(np.strings.replace(text, "\\", "\\\\"), '"', '\\"')
        return np.strings.add(np.strings.add('"', text), '"')

    def write(self, keys, values, partition_id=None):
        n = len(keys)
        if n == 0:
            return
        line = None
        columns = [(name, keys[name]) for name in keys.dtype.names] + [(name, values[name])
                                                                        for name in values.dtype.names]
        if self._partition_column is not None:
            columns.append((self._partition_column, np.full(n, partition_id, dtype=np.int32)))
        for i, (name, col) in enumerate(columns):
            prefix = ("{" if i == 0 else ",") + json.dumps(name) + ":"
            part = np.strings.add(prefix, self._text(col, name))
            line = part if line is None else np.strings.add(line, part)
        line = np.strings.add(line, "}\n")
        self._f.write("".join(line.tolist()).encode("utf-8"))

    def close(self):
        pass


def open_writer(fmt, f, key_dtype, value_dtype, partition_column="partition_id"):
    """A writer of ``fmt`` (one of :data:`FORMATS`) into the binary file object ``f``, with
    ``write(keys, values, partition_id)`` (structured arrays of the two dtypes) and
    ``close()`` (which does not close ``f``). ``partition_column=None`` leaves that column
    out. parquet and csv need pyarrow (ImportError otherwise)."""
    if fmt == "jsonl":
        return _JsonLinesWriter(f, np.dtype(key_dtype), np.dtype(value_dtype), partition_column)
    if fmt in ("parquet", "csv"):
        return _ArrowWriter(fmt, f, np.dtype(key_dtype), np.dtype(value_dtype), partition_column)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
