"""The schema-level reads every row source shares (RowTable, SnapshotReader, and the
stores built on them), written once in terms of the two primitives a source provides:
``get_rows(key_rows, value_rows_out, found_out)`` and a cursor whose ``next_rows(k)``
returns an ``(m, row_width)`` uint8 copy, or None when done.
"""
import numpy as np

__all__ = ["lookup_one", "lookup_batch", "iter_items", "iter_batches"]

# Rows decoded per cursor call when yielding tuples one by one.
ITEM_CHUNK_ROWS = 1024


def lookup_one(get_row, key_schema, value_schema, key):
    """The value tuple of ``key`` (tuple, scalar, record or bytes) through ``get_row``, or None."""
    value = get_row(key_schema.encode(key))
    return None if value is None else value_schema.decode(value)


def lookup_batch(get_rows, key_schema, value_schema, keys):
    """``(values, found)``: a structured array of the value schema (zeros where a key is
    absent) and a bool array, for a batch of keys (structured array or mapping of columns)."""
    key_rows = key_schema.rows(keys)
    n = key_rows.shape[0]
    values = np.zeros(n, dtype=value_schema.dtype)
    found = np.empty(n, dtype=np.bool_)
    value_rows = (values.view(np.uint8).reshape(n, value_schema.width) if value_schema.width
                  else np.empty((n, 0), dtype=np.uint8))
    get_rows(key_rows, value_rows, found.view(np.uint8))
    return values, found


def iter_items(cursor, key_schema, value_schema):
    """Yield ``(key_tuple, value_tuple)`` for every row the cursor visits; closes it at the end."""
    kw, rw = key_schema.width, key_schema.width + value_schema.width
    decode_key, decode_value = key_schema.decode, value_schema.decode
    try:
        while (chunk := cursor.next_rows(ITEM_CHUNK_ROWS)) is not None:
            raw = chunk.tobytes()
            for start in range(0, len(raw), rw):
                yield decode_key(raw[start:start + kw]), decode_value(raw[start + kw:start + rw])
    finally:
        _close(cursor)


def iter_batches(cursor, key_schema, value_schema, rows_per_batch):
    """Yield ``(keys, values)`` structured-array copies of the rows the cursor visits."""
    if rows_per_batch <= 0:
        raise ValueError(f"rows_per_batch must be > 0, got {rows_per_batch}")
    kw = key_schema.width
    try:
        while (chunk := cursor.next_rows(rows_per_batch)) is not None:
            keys = np.ascontiguousarray(chunk[:, :kw])
            values = np.ascontiguousarray(chunk[:, kw:])
            yield key_schema.from_rows(keys), value_schema.from_rows(values)
    finally:
        _close(cursor)


def _close(cursor):
    close = getattr(cursor, "close", None)
    if close is not None:
        close()
