"""A store's numpy rows as Arrow columns with the same ranges (``statecore dump``'s output):
every int, uint, float and bool field becomes the Arrow type of that exact dtype, and a
fixed bytes field (``S<n>``) a binary column whose values lose their trailing NULs, as
numpy reads them. Needs pyarrow (it comes with ``pyspark[sql]``); statecore imports this
module only where Arrow output is asked for.

The glue's conversions for Spark, which widen unsigned ints to the signed types Spark has,
are ``pyspark_glue/arrow.py``'s; both share :func:`fixed_to_binary`.
"""
import numpy as np
import pyarrow as pa

__all__ = ["fixed_to_binary", "native_array", "parquet_writer", "record_batch_of"]


def fixed_to_binary(col):
    """A binary Arrow array of an ``S<n>`` column, each value without its trailing NULs."""
    col = np.ascontiguousarray(col)
    m, n = col.shape[0], col.dtype.itemsize
    matrix = col.view(np.uint8).reshape(m, n)
    nonzero = matrix != 0
    lengths = np.where(nonzero.any(axis=1), n - np.argmax(nonzero[:, ::-1], axis=1), 0)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = matrix[np.arange(n)[None, :] < lengths[:, None]]  # row-major: the values, concatenated
    if offsets[-1] < 2**31:
        return pa.Array.from_buffers(pa.binary(), m, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                      pa.py_buffer(data)])
    large = pa.Array.from_buffers(pa.large_binary(), m, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return large.cast(pa.binary())  # raises if it cannot be one binary array


def native_array(col):
    """The Arrow array of one numpy field column, of the type with exactly its range."""
    if col.dtype.kind == "S":
        return fixed_to_binary(col)
    return pa.array(np.ascontiguousarray(col))


def record_batch_of(*arrays, **constant_int32_columns):
    """A ``pyarrow.RecordBatch`` of the fields of the structured ``arrays`` (equal lengths), in
    order, then one int32 column per keyword holding that constant (a partition id)."""
    n = len(arrays[0]) if arrays else 0
    columns, names = [], []
    for array in arrays:
        for name in array.dtype.names:
            columns.append(native_array(array[name]))
            names.append(name)
    for name, value in constant_int32_columns.items():
        columns.append(pa.array(np.full(n, value, dtype=np.int32)))
        names.append(name)
    return pa.RecordBatch.from_arrays(columns, names=names)


def parquet_writer(where, schema):
    """A ``pyarrow.parquet.ParquetWriter`` of ``schema`` to ``where`` that dictionary-encodes
    only the string and binary columns: the others (keys, counts, sums) are mostly distinct,
    and trying a dictionary first costs them about half the write."""
    import pyarrow.parquet as pq

    text = [field.name for field in schema
            if pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
            or pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)]
    return pq.ParquetWriter(where, schema, use_dictionary=text)
