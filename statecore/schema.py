"""Row schemas: which numpy dtypes a store accepts, and one canonical row layout for each.

A row is the bytes of a packed little-endian numpy structured dtype, nothing more: no
header, no null bits. :class:`RowSchema` owns the conversions between what users hand in
(tuples, bare scalars, numpy records, bytes, structured arrays, mappings of columns) and
those bytes. It never casts silently: a wrong dtype is a ``TypeError`` naming the field.
Schemas are immutable and safe to share between threads.
"""
import json
import struct

import numpy as np

from statecore._hash import xxh64_digest

__all__ = ["RowSchema", "as_schema", "key_value_schemas"]

# numpy dtype char -> struct code, for the fixed-width kinds a row may hold (packed, "<").
_STRUCT_CODES = {
    np.dtype(np.bool_): "?",
    np.dtype(np.int8): "b", np.dtype(np.uint8): "B",
    np.dtype("<i2"): "h", np.dtype("<u2"): "H",
    np.dtype("<i4"): "i", np.dtype("<u4"): "I",
    np.dtype("<i8"): "q", np.dtype("<u8"): "Q",
    np.dtype("<f4"): "f", np.dtype("<f8"): "d",
}
_ALLOWED = "bool, int8..int64, uint8..uint64, float32, float64, or fixed bytes S<n>"

# Bumped if the way fingerprints are computed ever changes; part of the hashed text.
_FINGERPRINT_VERSION = "statecore-schema-1"


def _canonical_field(name, dt):
    """The little-endian form of one field's dtype, or TypeError naming the field."""
    if dt.subdtype is not None or dt.names is not None:
        raise TypeError(f"field '{name}' has dtype {dt}; a field must be a scalar of {_ALLOWED}")
    if dt.kind == "S":
        if dt.itemsize == 0:
            raise TypeError(f"field '{name}' has dtype {dt.str}; S<n> needs n >= 1")
        return np.dtype(f"S{dt.itemsize}")
    canon = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    if canon not in _STRUCT_CODES:
        raise TypeError(f"field '{name}' has dtype {dt.str} ({dt}); allowed: {_ALLOWED}")
    return canon


class RowSchema:
    """A validated schema and its canonical packed little-endian row layout.

    Parameters
    ----------
    dtype : numpy structured dtype (or anything ``numpy.dtype`` accepts for one)
        Fixed-width fields only. An empty dtype (no fields) is allowed, for value schemas
        of sets.

    Raises
    ------
    TypeError
        If the dtype is not structured, or a field has a kind rows cannot hold.
    """

    __slots__ = ("fields", "names", "dtype", "width", "fingerprint", "_struct", "_bytes_fields",
                 "_bool_fields", "_single_bytes", "_plain", "_pack_values", "_unpack_row")

    def __init__(self, dtype):
        dt = np.dtype(dtype)
        if dt.names is None:
            raise TypeError(f"a row schema must be a numpy structured dtype, got {dt}")
        fields = tuple((name, _canonical_field(name, dt.fields[name][0])) for name in dt.names)
        self.fields = fields
        self.names = tuple(name for name, _ in fields)
        self.dtype = np.dtype([(name, f) for name, f in fields])  # packed: no offsets given
        self.width = self.dtype.itemsize
        codes = "".join(f"{f.itemsize}s" if f.kind == "S" else _STRUCT_CODES[f] for _, f in fields)
        self._struct = struct.Struct("<" + codes)
        self._bytes_fields = tuple(i for i, (_, f) in enumerate(fields) if f.kind == "S")
        self._bool_fields = tuple(i for i, (_, f) in enumerate(fields) if f.kind == "b")
        self._single_bytes = len(fields) == 1 and fields[0][1].kind == "S"
        self._plain = not (self._bytes_fields or self._bool_fields)  # struct alone is strict enough
        self._pack_values = self._struct.pack
        self._unpack_row = self._struct.unpack
        self.fingerprint = xxh64_digest(self.describe_json().encode())

    # -- identity -------------------------------------------------------------------------
    def describe(self):
        """``[[name, dtype.str], ...]``: what files record and fingerprints hash."""
        return [[name, f.str] for name, f in self.fields]

    def describe_json(self):
        return json.dumps([_FINGERPRINT_VERSION, self.describe()], separators=(",", ":"))

    @classmethod
    def from_description(cls, description):
        """Inverse of :meth:`describe`."""
        return cls(np.dtype([(str(name), str(code)) for name, code in description]))

    def __eq__(self, other):
        return isinstance(other, RowSchema) and self.dtype == other.dtype and self.names == other.names

    def __hash__(self):
        return hash(self.fingerprint)

    def __repr__(self):
        return f"RowSchema({self.describe()})"

    # -- one row --------------------------------------------------------------------------
    def encode(self, obj):
        """Row bytes of a tuple, a bare scalar (one-field schema), a numpy record, or bytes.

        Bytes must be exactly ``width`` long, except for a one-field ``S<n>`` schema, where
        they are the field's value (at most n bytes, NUL-padded as numpy pads).
        """
        kind = type(obj)
        if self._plain and (kind is tuple or kind is int or kind is float):
            try:  # the per-row fast path: struct checks ints, floats and the field count
                return self._pack_values(*obj) if kind is tuple else self._pack_values(obj)
            except struct.error:
                raise self._explain(obj if kind is tuple else (obj,)) from None
        if kind is tuple:
            return self._pack(obj)
        if kind is int or kind is float:
            if len(self.fields) == 1:
                return self._pack((obj,))
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            raw = bytes(obj)
            if self._single_bytes:
                return self._pack((raw,))
            if len(raw) != self.width:
                raise ValueError(f"a row of {self.names} is {self.width} bytes, got {len(raw)} bytes")
            return raw
        elif isinstance(obj, (np.void, np.ndarray)) and obj.dtype.names is not None:
            self.check_dtype(obj.dtype)
            return self._pack(obj.item() if isinstance(obj, np.ndarray) else tuple(obj.item()))
        elif isinstance(obj, tuple):
            return self._pack(tuple(obj))
        elif isinstance(obj, list):
            return self._pack(tuple(obj))
        if len(self.fields) == 1 and obj is not None:
            return self._pack((obj,))
        raise TypeError(f"expected a tuple of {len(self.fields)} fields {self.names}, got {type(obj).__name__}")

    def _pack(self, values):
        if self._bool_fields or self._bytes_fields:
            self._check_strict_fields(values)
        try:
            return self._pack_values(*values)
        except struct.error:
            raise self._explain(values) from None

    def _check_strict_fields(self, values):
        """The checks struct leaves out: it turns any object into a bool, and truncates bytes."""
        if len(values) != len(self.fields):
            raise TypeError(f"expected {len(self.fields)} fields {self.names}, got {len(values)} values")
        for i in self._bool_fields:
            if not isinstance(values[i], (bool, np.bool_)):
                raise TypeError(f"field '{self.names[i]}' is bool, got {type(values[i]).__name__}")
        for i in self._bytes_fields:
            v = values[i]
            if not isinstance(v, (bytes, np.bytes_)):
                raise TypeError(f"field '{self.names[i]}' is {self.fields[i][1].str}, got {type(v).__name__}")
            if len(v) > self.fields[i][1].itemsize:
                raise ValueError(f"field '{self.names[i]}' holds at most {self.fields[i][1].itemsize} bytes, "
                                 f"got {len(v)}")

    def _explain(self, values):
        """The exception naming the field struct refused."""
        if len(values) != len(self.fields):
            return TypeError(f"expected {len(self.fields)} fields {self.names}, got {len(values)} values")
        for (name, f), v in zip(self.fields, values):
            try:
                struct.pack("<" + (f"{f.itemsize}s" if f.kind == "S" else _STRUCT_CODES[f]), v)
            except struct.error as e:
                kind = ValueError if isinstance(v, (int, float, np.integer, np.floating)) else TypeError
                return kind(f"field '{name}' ({f.str}) cannot hold {v!r}: {e}")
        return AssertionError("unreachable: struct refused the row but every field packed")

    def decode(self, row):
        """The tuple of field values of row bytes (``S<n>`` values without trailing NULs)."""
        values = self._unpack_row(row)
        if self._bytes_fields:
            values = list(values)
            for i in self._bytes_fields:
                values[i] = values[i].rstrip(b"\0")
            values = tuple(values)
        return values

    # -- many rows ------------------------------------------------------------------------
    def check_dtype(self, dtype):
        """TypeError naming the first field where ``dtype`` differs (byte order aside)."""
        names = dtype.names or ()
        if tuple(names) != self.names:
            missing = [n for n in self.names if n not in names]
            extra = [n for n in names if n not in self.names]
            if missing:
                raise TypeError(f"field '{missing[0]}' is missing; expected fields {self.names}")
            if extra:
                raise TypeError(f"field '{extra[0]}' is not in the schema; expected fields {self.names}")
            raise TypeError(f"fields are in order {tuple(names)}; expected {self.names}")
        for name, expected in self.fields:
            self._check_field(name, dtype.fields[name][0], expected)

    @staticmethod
    def _check_field(name, got, expected):
        canon = got.newbyteorder("<") if got.byteorder == ">" else got
        if canon != expected:
            raise TypeError(f"field '{name}' has dtype {got.str}; the schema has {expected.str}")

    def rows(self, batch):
        """A C-contiguous ``(n, width)`` uint8 array of the rows in ``batch``.

        ``batch`` is a 1-D structured array of this schema, a mapping of field name to 1-D
        array, or (one-field schema) a plain 1-D array of the field's dtype. Zero-copy when
        the batch already has the canonical layout; read-only input stays read-only.
        """
        arr = self._as_structured(batch)
        n = arr.shape[0]
        if self.width == 0:
            return np.empty((n, 0), dtype=np.uint8)
        if arr.dtype != self.dtype or not arr.flags.c_contiguous:
            packed = np.empty(n, dtype=self.dtype)
            for name in self.names:
                packed[name] = arr[name]
            arr = packed
        return arr.view(np.uint8).reshape(n, self.width)

    def _as_structured(self, batch):
        if isinstance(batch, np.ndarray):
            if batch.ndim != 1:
                raise ValueError(f"a batch must be 1-D, got shape {batch.shape}")
            if batch.dtype.names is not None:
                self.check_dtype(batch.dtype)
                return batch
            if len(self.fields) == 1:
                name, expected = self.fields[0]
                self._check_field(name, batch.dtype, expected)
                return _structured_from({name: batch}, self.dtype, batch.shape[0])
            raise TypeError(f"a batch for fields {self.names} must be a structured array or a mapping, "
                            f"got a plain {batch.dtype} array")
        if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
            keys = list(batch.keys())
            missing = [n for n in self.names if n not in keys]
            extra = [k for k in keys if k not in self.names]
            if missing:
                raise TypeError(f"field '{missing[0]}' is missing; expected fields {self.names}")
            if extra:
                raise TypeError(f"field '{extra[0]}' is not in the schema; expected fields {self.names}")
            lengths = set()
            for name, expected in self.fields:
                col = batch[name]
                if not isinstance(col, np.ndarray):
                    raise TypeError(f"field '{name}' must be a numpy array, got {type(col).__name__}")
                if col.ndim != 1:
                    raise ValueError(f"field '{name}' must be 1-D, got shape {col.shape}")
                self._check_field(name, col.dtype, expected)
                lengths.add(col.shape[0])
            if len(lengths) > 1:
                raise ValueError(f"columns have different lengths {sorted(lengths)}")
            n = lengths.pop() if lengths else 0
            return _structured_from(batch, self.dtype, n)
        raise TypeError(f"a batch must be a numpy structured array or a mapping of columns, "
                        f"got {type(batch).__name__}")

    def from_rows(self, rows):
        """A structured array viewing ``(n, width)`` uint8 rows (no copy)."""
        if self.width == 0:
            return np.zeros(rows.shape[0], dtype=self.dtype)
        return rows.reshape(-1).view(self.dtype)


def _structured_from(columns, dtype, n):
    out = np.empty(n, dtype=dtype)
    for name in dtype.names:
        out[name] = columns[name]
    return out


def key_value_schemas(key_schema, value_schema):
    """The (key, value) RowSchemas of a store; a key needs at least one field, a value may
    have none."""
    key, value = as_schema(key_schema), as_schema(value_schema)
    if key.width == 0:
        raise TypeError("a key schema needs at least one field")
    return key, value


def as_schema(schema):
    """A :class:`RowSchema` from a RowSchema or anything ``numpy.dtype`` accepts."""
    return schema if isinstance(schema, RowSchema) else RowSchema(schema)
