"""Arrow, numpy and Spark types: how a store's numpy rows become Arrow and Spark columns and
back, for user functions (numpy in, the store's batch calls, Arrow out: no per-row Python).

The type mapping, one rule in both directions, is in ``docs/operator.md`` ("Types").
"""
import re

import numpy as np
import pyarrow as pa

from statecore.arrow_rows import fixed_to_binary
from statecore.schema import as_schema

__all__ = ["arrow_type_of", "spark_type_of", "spark_schema_of", "numpy_to_arrow", "to_record_batch",
           "column_to_numpy", "column", "columns_from_arrow", "keys_from_arrow", "output_schemas", "dtype_of_columns",
           "conform_output"]

_ARROW_OF_KIND = {  # (kind, itemsize) -> the Arrow type Spark takes for it
    ("b", 1): pa.bool_(),
    ("i", 1): pa.int8(), ("i", 2): pa.int16(), ("i", 4): pa.int32(), ("i", 8): pa.int64(),
    ("u", 1): pa.int16(), ("u", 2): pa.int32(), ("u", 4): pa.int64(), ("u", 8): pa.decimal128(20, 0),
    ("f", 4): pa.float32(), ("f", 8): pa.float64(),
}
_ARROW_NATIVE = {  # (kind, itemsize) -> the Arrow type with exactly the numpy dtype's range
    ("b", 1): pa.bool_(),
    ("i", 1): pa.int8(), ("i", 2): pa.int16(), ("i", 4): pa.int32(), ("i", 8): pa.int64(),
    ("u", 1): pa.uint8(), ("u", 2): pa.uint16(), ("u", 4): pa.uint32(), ("u", 8): pa.uint64(),
    ("f", 4): pa.float32(), ("f", 8): pa.float64(),
}
_WIDENED = {1: np.int16, 2: np.int32, 4: np.int64}  # unsigned itemsize -> the signed dtype Spark gets


def arrow_type_of(dtype):
    """The Arrow type a numpy field of ``dtype`` becomes (``docs/operator.md``, "Types")."""
    dt = np.dtype(dtype)
    if dt.kind == "S":
        return pa.binary()
    try:
        return _ARROW_OF_KIND[(dt.kind, dt.itemsize)]
    except KeyError:
        raise TypeError(f"no Spark type for numpy dtype {dt}") from None


def spark_type_of(dtype):
    """The Spark SQL type a numpy field of ``dtype`` becomes (``docs/operator.md``, "Types")."""
    from pyspark.sql import types as T

    t = arrow_type_of(dtype)
    if pa.types.is_decimal(t):
        return T.DecimalType(t.precision, t.scale)
    return {
        pa.bool_(): T.BooleanType(), pa.int8(): T.ByteType(), pa.int16(): T.ShortType(),
        pa.int32(): T.IntegerType(), pa.int64(): T.LongType(), pa.float32(): T.FloatType(),
        pa.float64(): T.DoubleType(), pa.binary(): T.BinaryType(),
    }[t]


def spark_schema_of(*dtypes, extra=()):
    """A ``StructType`` of the fields of structured ``dtypes`` in order, then ``extra``
    (``(name, spark type)`` pairs). Every field is nullable, as Spark reads them back."""
    from pyspark.sql import types as T

    fields = []
    for dtype in dtypes:
        schema = as_schema(dtype)
        fields += [T.StructField(name, spark_type_of(f), True) for name, f in schema.fields]
    fields += [T.StructField(name, t, True) for name, t in extra]
    return T.StructType(fields)


def numpy_to_arrow(col):
    """The Arrow array of one numpy column, typed as :func:`arrow_type_of` says."""
    dt = col.dtype
    if dt.kind == "S":
        return fixed_to_binary(col)
    col = np.ascontiguousarray(col)
    if dt.kind == "u":
        if dt.itemsize == 8:
            return pa.array(col, type=pa.uint64()).cast(pa.decimal128(20, 0))
        return pa.array(col.astype(_WIDENED[dt.itemsize]))
    if (dt.kind, dt.itemsize) not in _ARROW_OF_KIND:
        raise TypeError(f"no Spark type for numpy dtype {dt}")
    return pa.array(col)


def to_record_batch(*arrays, names=None, **constant_columns):
    """A ``pyarrow.RecordBatch`` of the fields of the structured ``arrays`` (equal lengths), in
    order, then one column per keyword holding that constant (an int becomes int32, as a
    partition id). ``names`` renames the fields (one name per field, in order). Types as
    :func:`arrow_type_of`; ``S<n>`` values lose their trailing NULs."""
    columns, out_names = [], []
    lengths = {len(a) for a in arrays}
    if len(lengths) > 1:
        raise ValueError(f"arrays have different lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    for array in arrays:
        if array.dtype.names is None:
            raise TypeError(f"expected structured arrays, got dtype {array.dtype}")
        for name in array.dtype.names:
            columns.append(numpy_to_arrow(array[name]))
            out_names.append(name)
    for name, value in constant_columns.items():
        if isinstance(value, (bool, np.bool_)):
            columns.append(pa.array(np.full(n, value, dtype=np.bool_)))
        elif isinstance(value, (int, np.integer)):
            columns.append(pa.array(np.full(n, value, dtype=np.int32)))
        else:
            columns.append(pa.array([value] * n))
        out_names.append(name)
    if names is not None:
        names = list(names)
        if len(names) != len(out_names) - len(constant_columns):
            raise ValueError(f"{len(names)} names for {len(out_names) - len(constant_columns)} fields")
        out_names[:len(names)] = names
    return pa.RecordBatch.from_arrays(columns, names=out_names)


def _binary_to_fixed(arr, n, name):
    """The ``S<n>`` numpy column of a string/binary Arrow array without nulls (one scatter)."""
    t = arr.type
    m = len(arr)
    if pa.types.is_fixed_size_binary(t):
        width = t.byte_width
        if width > n:
            raise ValueError(f"column '{name}' holds {width}-byte values; the field is S{n}")
        data = arr.buffers()[1]
        raw = np.frombuffer(data, dtype=np.uint8, count=(arr.offset + m) * width)[arr.offset * width:]
        out = np.zeros((m, n), dtype=np.uint8)
        out[:, :width] = raw.reshape(m, width)
        return out.view(f"S{n}").reshape(m)
    if pa.types.is_string(t):
        arr, t = arr.cast(pa.binary()), pa.binary()
    elif pa.types.is_large_string(t):
        arr, t = arr.cast(pa.large_binary()), pa.large_binary()
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise TypeError(f"column '{name}' is {t}; an S{n} field takes string or binary columns")
    off_dtype = np.int64 if pa.types.is_large_binary(t) else np.int32
    buffers = arr.buffers()
    offsets = np.frombuffer(buffers[1], dtype=off_dtype, count=arr.offset + m + 1)[arr.offset:].astype(np.int64)
    lengths = np.diff(offsets)
    if m and lengths.max() > n:
        i = int(np.argmax(lengths))
        raise ValueError(f"column '{name}' holds a {int(lengths[i])}-byte value (row {i}); the field is S{n}")
    out = np.zeros((m, n), dtype=np.uint8)
    total = int(offsets[-1] - offsets[0]) if m else 0
    if total:
        data = np.frombuffer(buffers[2], dtype=np.uint8)
        src = np.arange(offsets[0], offsets[-1])
        rows = np.repeat(np.arange(m), lengths)
        out[rows, src - np.repeat(offsets[:-1], lengths)] = data[src]
    return out.view(f"S{n}").reshape(m)


def column_to_numpy(arr, dtype, name="?", null_value=None):
    """The numpy column of dtype ``dtype`` of one Arrow array (``name`` is for messages).

    Numeric and boolean columns cast with Arrow's safe cast (a value out of the dtype's range,
    or a fraction cast to an integer, is a ``ValueError``); string and binary columns fill
    ``S<n>``. Nulls are a ``ValueError`` unless ``null_value`` replaces them.
    """
    dt = np.dtype(dtype)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        if null_value is None:
            raise ValueError(f"column '{name}' has {arr.null_count} null value(s); state keys cannot be null")
        arr = arr.fill_null(null_value)
    if dt.kind == "S":
        return _binary_to_fixed(arr, dt.itemsize, name)
    target = _ARROW_NATIVE.get((dt.kind, dt.itemsize))
    if target is None:
        raise TypeError(f"field for column '{name}' has dtype {dt}, which no store holds")
    t = arr.type
    if pa.types.is_timestamp(t) or pa.types.is_date32(t):  # as Spark holds them: microseconds, days
        arr = arr.cast(pa.timestamp("us", t.tz)) if pa.types.is_timestamp(t) else arr
        arr = arr.cast(pa.int64() if pa.types.is_timestamp(arr.type) else pa.int32())
        t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_decimal(t)):
        raise TypeError(f"column '{name}' is {t}; a {dt} field takes numeric columns")
    if t != target:
        try:
            arr = arr.cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"column '{name}' ({t}) does not fit the field's dtype {dt}: {e}") from None
    out = arr.to_numpy(zero_copy_only=False)
    return out if out.dtype == dt else out.astype(dt)


def column(batch, name):
    """The column ``name`` of a record batch; KeyError naming the batch's columns if absent."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        raise KeyError(f"column '{name}' is not in the batch (columns: {batch.schema.names})")
    return batch.column(i)


def columns_from_arrow(batch, schema, columns=None):
    """A structured numpy array of ``schema`` (a structured dtype or RowSchema; the
    canonical packed layout, ready for the store's batch API) from a ``RecordBatch``.

    Field ``i`` comes from column ``columns[i]`` (default: the column named like the field).
    See :func:`column_to_numpy` for the casts; nulls are refused.
    """
    schema = as_schema(schema)
    names = schema.names if columns is None else tuple(columns)
    if len(names) != len(schema.names):
        raise ValueError(f"{len(names)} columns for the {len(schema.names)} fields {schema.names}")
    out = np.empty(batch.num_rows, dtype=schema.dtype)
    for field, name in zip(schema.names, names):
        out[field] = column_to_numpy(column(batch, name), schema.dtype[field], name)
    return out


keys_from_arrow = columns_from_arrow  # the name the key side reads best with


# Spark's simple type names -> the numpy dtype a store field holds them in.
_DTYPE_OF_SPARK = {"bigint": "<i8", "int": "<i4", "smallint": "<i2", "tinyint": "i1", "double": "<f8",
                   "float": "<f4", "boolean": "?", "timestamp": "<i8", "timestamp_ntz": "<i8", "date": "<i4"}


def dtype_of_columns(spark_schema, columns, widths=None, what="key"):
    """The packed structured dtype holding ``columns`` of a Spark schema, one field each (named
    like the column): numbers, booleans, timestamps (microseconds), dates (days); strings and
    binaries as ``S<n>`` with ``n`` from ``widths`` (ValueError naming the column without it)."""
    widths = dict(widths or {})
    fields = {f.name: f.dataType.simpleString() for f in spark_schema.fields}
    out = []
    for name in columns:
        if name not in fields:
            raise ValueError(f"{what} column '{name}' is not in the DataFrame (columns: {list(fields)})")
        t = fields[name]
        if t in ("string", "binary"):
            width = widths.get(name)
            if not isinstance(width, int) or width < 1:
                raise ValueError(f"{what} column '{name}' is a {t}: give its width in bytes (e.g. "
                                 f"key_widths={{'{name}': 16}}); longer values are refused, never cut")
            out.append((name, f"S{width}"))
        elif t in _DTYPE_OF_SPARK:
            out.append((name, _DTYPE_OF_SPARK[t]))
        else:
            raise ValueError(f"{what} column '{name}' has type {t}, which a state key cannot hold (numbers, "
                             f"booleans, timestamps, dates, strings and binaries can)")
    return as_schema(np.dtype(out)).dtype


_DDL_TYPES = {  # Spark's names of the simple types (as its DDL parser takes them) -> the type's class name
    "boolean": "BooleanType", "tinyint": "ByteType", "byte": "ByteType", "smallint": "ShortType",
    "short": "ShortType", "int": "IntegerType", "integer": "IntegerType", "bigint": "LongType", "long": "LongType",
    "float": "FloatType", "real": "FloatType", "double": "DoubleType", "string": "StringType",
    "binary": "BinaryType", "date": "DateType", "timestamp": "TimestampType", "timestamp_ltz": "TimestampType",
    "timestamp_ntz": "TimestampNTZType",
}
_DDL_FIELD = re.compile(r"\s*(`(?:[^`]|``)+`|[A-Za-z_][A-Za-z0-9_]*)\s*:?\s*([A-Za-z_0-9]+)"
                        r"(?:\s*\(\s*(\d+)\s*,\s*(\d+)\s*\))?\s*$")


def parse_simple_ddl(text):
    """A StructType from a DDL string of simple columns (``"user long, clicks long"``:
    names, the types of ``_DDL_TYPES`` and ``decimal(p, s)``), without Spark; None for
    anything else (nested types, ``NOT NULL``, comments), which Spark's own parser must read.
    What it reads, it reads as Spark does: every field nullable."""
    from pyspark.sql import types as T

    fields = []
    for part in re.split(r",(?![^(]*\))", text):  # commas outside a decimal's parentheses
        m = _DDL_FIELD.match(part)
        if m is None:
            return None
        name, type_name, precision, scale = m.groups()
        if name.startswith("`"):
            name = name[1:-1].replace("``", "`")
        type_name = type_name.lower()
        if type_name in ("decimal", "dec", "numeric") and precision is not None:
            data_type = T.DecimalType(int(precision), int(scale))
        elif type_name in _DDL_TYPES and precision is None:
            data_type = getattr(T, _DDL_TYPES[type_name])()
        else:
            return None
        fields.append(T.StructField(name, data_type, True))
    return T.StructType(fields) if fields else None


def output_schemas(schema):
    """``(StructType, pyarrow.Schema)`` of an output schema given as a StructType, a DDL
    string or None (``(None, None)``: no output). A DDL string of simple columns is read
    here (:func:`parse_simple_ddl`: no Spark needed); any other goes to Spark's parser."""
    from pyspark.sql.types import StructType

    from pyspark_glue.spark_internals import arrow_schema_of

    if schema is None:
        return None, None
    if isinstance(schema, str):
        schema = parse_simple_ddl(schema) or StructType.fromDDL(schema)
    if not isinstance(schema, StructType):
        raise TypeError(f"output_schema must be a StructType, a DDL string or None, got {type(schema).__name__}")
    return schema, arrow_schema_of(schema)


def joined_batches(batches, max_rows, max_bytes):
    """``batches`` (record batches of one schema) with consecutive ones joined into one of at
    most ``max_rows`` rows and ``max_bytes`` buffer bytes (a batch already past either limit
    passes alone): fewer, larger batches, in the same order with the same rows. ``max_rows``
    None: the batches as they come."""
    if max_rows is None:
        yield from batches
        return
    held, rows, nbytes = [], 0, 0
    for batch in batches:
        if held and (rows + batch.num_rows > max_rows or nbytes + batch.nbytes > max_bytes):
            yield _joined(held)
            held, rows, nbytes = [], 0, 0
        held.append(batch)
        rows += batch.num_rows
        nbytes += batch.nbytes
    if held:
        yield _joined(held)


def _joined(batches):
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).combine_chunks()
    return table.to_batches()[0] if table.num_rows else batches[0]


def conform_output(out, schema, where):
    """``out`` (a RecordBatch or Table that ``fn`` returned, or a list of them) as batches of
    exactly ``schema``, cast safely; ``where`` names the function in errors. Every runner of
    ``fn`` shares it."""
    if isinstance(out, list):
        return [b for part in out for b in conform_output(part, schema, where)]
    if isinstance(out, pa.Table):
        return _conform_batches(out.to_batches(), schema, where)
    if not isinstance(out, pa.RecordBatch):
        raise TypeError(f"{where} must return a pyarrow.RecordBatch or None, got {type(out).__name__}")
    return _conform_batches([out], schema, where)


def _conform_batches(batches, schema, where):
    if schema is None:
        raise ValueError(f"{where} returned rows, but the operator has no output_schema")
    out = []
    for batch in batches:
        if batch.schema.names != schema.names:
            if sorted(batch.schema.names) != sorted(schema.names):
                raise ValueError(f"{where} returned columns {batch.schema.names}; the output schema has "
                                 f"{schema.names}")
            batch = batch.select(schema.names)
        columns = []
        for col, field in zip(batch.columns, schema):
            if col.type != field.type:
                try:
                    col = col.cast(field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise ValueError(f"{where}: column '{field.name}' ({col.type}) does not cast to the "
                                     f"output type {field.type}: {e}") from None
            columns.append(col)
        out.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return out
