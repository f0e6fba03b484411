"""Row schemas: which numpy dtypes a store accepts, and one canonical row layout for each.

A row is the bytes of a packed little-endian numpy structured dtype, nothing more: no
header, no null bits. :class:`RowSchema` owns the conversions between what users hand in
(tuples, bare scalars, numpy records, bytes, structured arrays, mappings of columns) and
those bytes. It never casts silently: a wrong dtype is a ``TypeError`` naming the field.
A *key* schema (``key=True``, as :func:`key_value_schemas` makes it) also normalizes its
float fields the way Spark normalizes grouping keys (NormalizeFloatingNumbers): -0.0
becomes 0.0 and every NaN the one canonical NaN, so that keys Spark groups together are
one key here; and its bool fields, whose byte numpy lets hold any value (a view of other
bytes), to 0 or 1, so that every true key is one key. Schemas are immutable and safe to share between threads;
they pickle as their dtype and key flag.
"""
import functools
import json
import struct

import numpy as np

from statecore._float_keys import FLOAT_KEY_BITS, key_bits, needs_normalizing, normalize_bits
from statecore._hash import xxh64_digest
from statecore._rowcodec import RowCodec

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

# What a per-row value of each field kind may be (bool is refused where it is not the kind:
# it is an int to Python). Ints are taken for float fields, as Python's float() takes them.
_BOOL_TYPES = (bool, np.bool_)
_ROW_VALUE_TYPES = {"b": _BOOL_TYPES, "i": (int, np.integer), "u": (int, np.integer),
                    "f": (float, int, np.floating, np.integer), "S": (bytes,)}
_ROW_VALUE_NAMES = {"b": "a bool", "i": "an int", "u": "an int", "f": "a float or an int", "S": "bytes"}
# The types of values that int and float fields take (Python's and numpy's ints and floats,
# not bool): given only these, struct refuses exactly what the rules above refuse.
_NUMBER_TYPES = frozenset([int, float] + [np.dtype(c).type
                                           for c in np.typecodes["AllInteger"] + np.typecodes["Float"]])

# The struct code of each float dtype a key normalizes (the bits: statecore._float_keys).
_FLOAT_CODES = {np.dtype("<f4"): "<f", np.dtype("<f8"): "<d"}

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


def _key_float(name, dt, offset):
    """``(name, byte offset, byte end, unpack_from, bits dtype)`` of a float field a key
    normalizes."""
    return name, offset, offset + dt.itemsize, struct.Struct(_FLOAT_CODES[dt]).unpack_from, FLOAT_KEY_BITS[dt][0]


class RowSchema:
    """A validated schema and its canonical packed little-endian row layout.

    Parameters
    ----------
    dtype : numpy structured dtype (or anything ``numpy.dtype`` accepts for one)
        Fixed-width fields only. An empty dtype (no fields) is allowed, for value schemas
        of sets.
    key : bool, default False
        Whether rows of this schema are keys: then every row it makes (per row or per
        batch) has float fields normalized, -0.0 as 0.0 and any NaN as the canonical NaN.
        Equality, hash and fingerprint ignore it: they are about the row layout, which
        files record.

    Raises
    ------
    TypeError
        If the dtype is not structured, or a field has a kind rows cannot hold.
    """

    __slots__ = ("fields", "names", "dtype", "width", "fingerprint", "key", "_struct", "_bytes_fields",
                 "_bool_fields", "_key_floats", "_key_bools", "_normalizes", "_single_bytes", "_numeric",
                 "_value_types", "_max_bytes", "_pack_values", "_unpack_row", "_codec")

    def __init__(self, dtype, *, key=False):
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
        self._value_types = tuple(_ROW_VALUE_TYPES[f.kind] for _, f in fields)
        self._max_bytes = tuple(f.itemsize if f.kind == "S" else 0 for _, f in fields)
        self.key = bool(key)
        self._key_floats = tuple(_key_float(name, f, self.dtype.fields[name][1])
                                 for name, f in fields if f.kind == "f") if self.key else ()
        self._key_bools = tuple((name, self.dtype.fields[name][1])
                                for name, f in fields if f.kind == "b") if self.key else ()
        self._normalizes = bool(self._key_floats or self._key_bools)
        # Whether struct alone checks values of the _NUMBER_TYPES (no bool or bytes field).
        self._numeric = not (self._bytes_fields or self._bool_fields)
        self._pack_values = self._struct.pack
        self._unpack_row = self._struct.unpack
        self.fingerprint = xxh64_digest(self.describe_json().encode())
        self._codec = None

    @property
    def codec(self):
        """The compiled per-row conversions of this schema (a :class:`RowCodec`, built on first
        use): what stores' per-row calls encode and decode with; its rules are this class's."""
        if self._codec is None:
            self._codec = RowCodec(self)
        return self._codec

    @property
    def normalizes(self):
        """Whether rows of this (key) schema are normalized as they are made: a float field
        (-0.0, NaNs) or a bool field. Bytes of such rows are not simply moved between schemas."""
        return self._normalizes

    # -- identity -------------------------------------------------------------------------
    def describe(self):
        """``[[name, dtype.str], ...]``: what files record and fingerprints hash."""
        return [[name, f.str] for name, f in self.fields]

    def describe_json(self):
        return json.dumps([_FINGERPRINT_VERSION, self.describe()], separators=(",", ":"))

    @classmethod
    def from_description(cls, description):
        """Inverse of :meth:`describe`. Schemas are immutable, so one is built per distinct
        description and shared: a file header names the same few schemas again and again."""
        return _schema_of_description(cls, tuple((str(name), str(code)) for name, code in description))

    def __eq__(self, other):
        return isinstance(other, RowSchema) and self.dtype == other.dtype and self.names == other.names

    def __hash__(self):
        return hash(self.fingerprint)

    def __reduce__(self):
        """Pickles as what it is built from, its dtype and key flag (its compiled parts are
        made again): an operator and its ``fn`` travel pickled to Spark's Python workers."""
        return as_schema, (self.dtype, self.key)

    def __repr__(self):
        return f"RowSchema({self.describe()}{', key=True' if self.key else ''})"

    # -- one row --------------------------------------------------------------------------
    def encode(self, obj):
        """Row bytes of a tuple, a bare scalar (one-field schema), a numpy record, or bytes.

        Bytes must be exactly ``width`` long, except for a one-field ``S<n>`` schema, where
        they are the field's value (at most n bytes, NUL-padded as numpy pads). Values are
        checked per field: a bool only for bool fields, an int (Python or numpy) for int
        fields, a float or an int for float fields, bytes for ``S<n>``; anything else is a
        TypeError naming the field, a value out of the field's range a ValueError.
        """
        kind = type(obj)
        if self._numeric and (kind is int or kind is float):
            try:  # the per-row fast path: struct checks ints, floats and the field count
                row = self._pack_values(obj)
            except (struct.error, OverflowError):
                raise self._explain((obj,)) from None
        elif self._numeric and kind is tuple and _NUMBER_TYPES.issuperset(map(type, obj)):
            try:
                row = self._pack_values(*obj)
            except (struct.error, OverflowError):
                raise self._explain(obj) from None
        else:
            row = self._encode(obj, kind)
        return self._normalize_row(row) if self._normalizes else row

    def _encode(self, obj, kind):
        """Row bytes of ``obj``, key fields not yet normalized."""
        if kind is tuple or kind is list:
            return self._pack(tuple(obj))
        if kind is float or kind is int:
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
            if obj.dtype == self.dtype and obj.size == 1:
                return obj.tobytes()  # the bytes a batch would take, float payloads and all
            return self._pack(obj.item() if isinstance(obj, np.ndarray) else tuple(obj.item()))
        elif isinstance(obj, tuple):
            return self._pack(tuple(obj))
        if len(self.fields) == 1 and obj is not None:
            return self._pack((obj,))
        raise TypeError(f"expected a tuple of {len(self.fields)} fields {self.names}, got {type(obj).__name__}")

    def _pack(self, values):
        if not (self._numeric and _NUMBER_TYPES.issuperset(map(type, values))):
            refused = self._refusal(values)
            if refused is not None:
                raise refused
        try:
            return self._pack_values(*values)
        except (struct.error, OverflowError):
            raise self._explain(values) from None

    def _refusal(self, values):
        """The TypeError (or ValueError, for bytes too long) of the first value its field does
        not take, or None: the checks struct leaves out (it turns any object into a bool,
        bools and any number-like object into ints and floats, and truncates bytes)."""
        if len(values) != len(self.fields):
            return TypeError(f"expected {len(self.fields)} fields {self.names}, got {len(values)} values")
        for v, types, max_bytes, (name, f) in zip(values, self._value_types, self._max_bytes,
                                                  self.fields):
            if not isinstance(v, types) or ((v is True or v is False) and types is not _BOOL_TYPES):
                return TypeError(f"field '{name}' ({f.str}) of the schema {self.names} takes "
                                 f"{_ROW_VALUE_NAMES[f.kind]}, got {type(v).__name__} {v!r}")
            if max_bytes and len(v) > max_bytes:
                return ValueError(f"field '{name}' holds at most {max_bytes} bytes, got {len(v)}")
        return None

    def _explain(self, values):
        """The exception naming the field struct refused."""
        refused = self._refusal(values)
        if refused is not None:
            return refused
        for (name, f), v in zip(self.fields, values):
            try:
                struct.pack("<" + (f"{f.itemsize}s" if f.kind == "S" else _STRUCT_CODES[f]), v)
            except (struct.error, OverflowError) as e:
                return ValueError(f"field '{name}' ({f.str}) cannot hold {v!r}: {e}")
        return AssertionError("unreachable: struct refused the row but every field packed")

    def _normalize_row(self, row):
        """``row`` with its key fields normalized: floats as ``statecore._float_keys`` rules
        (-0.0 as 0.0, any NaN as the canonical NaN), bools any non-zero byte as 1."""
        for _, offset in self._key_bools:
            if row[offset] > 1:
                row = row[:offset] + b"\x01" + row[offset + 1:]
        for _, start, end, unpack_from, _ in self._key_floats:
            x = unpack_from(row, start)[0]
            if x == 0 or x != x:  # a cheap filter: only zeros and NaNs may need a rewrite
                bits = int.from_bytes(row[start:end], "little")
                canon = key_bits(bits, end - start)
                if canon != bits:
                    row = row[:start] + canon.to_bytes(end - start, "little") + row[end:]
        return row

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
        names = tuple(dtype.names or ())
        if names != self.names:
            self._check_names(names)
            raise TypeError(f"fields are in order {names}; expected {self.names}")
        for name, expected in self.fields:
            self._check_field(name, dtype.fields[name][0], expected)

    def _check_names(self, names):
        """TypeError naming the first field missing from ``names``, else the first not in the schema."""
        missing = [n for n in self.names if n not in names]
        extra = [n for n in names if n not in self.names]
        if missing:
            raise TypeError(f"field '{missing[0]}' is missing; expected fields {self.names}")
        if extra:
            raise TypeError(f"field '{extra[0]}' is not in the schema; expected fields {self.names}")

    @staticmethod
    def _check_field(name, got, expected):
        canon = got.newbyteorder("<") if got.byteorder == ">" else got
        if canon != expected:
            raise TypeError(f"field '{name}' has dtype {got.str}; the schema has {expected.str}")

    def rows(self, batch):
        """A C-contiguous ``(n, width)`` uint8 array of the rows in ``batch``.

        ``batch`` is a 1-D structured array of this schema, a mapping of field name to 1-D
        array, or (one-field schema) a plain 1-D array of the field's dtype. Zero-copy when
        the batch already has the canonical layout (and, for a key, no float field holds
        -0.0 or a NaN other than the canonical one, no bool byte is above 1); read-only input
        stays read-only. The
        caller's arrays are never written.
        """
        arr = self._as_structured(batch)
        n = arr.shape[0]
        if self.width == 0:
            return np.empty((n, 0), dtype=np.uint8)
        owned = arr is not batch
        if arr.dtype != self.dtype or not arr.flags.c_contiguous:
            packed = np.empty(n, dtype=self.dtype)
            for name in self.names:
                packed[name] = arr[name]
            arr, owned = packed, True
        if self._normalizes:
            arr = self._normalize_batch(arr, owned)
        return arr.view(np.uint8).reshape(n, self.width)

    def _normalize_batch(self, arr, owned):
        """``arr`` (canonical) with its key fields normalized: written in place when
        ``owned``, else in a copy, made only when some value needs it."""
        for name, _ in self._key_bools:
            raised = np.flatnonzero(np.ascontiguousarray(arr[name]).view(np.uint8) > 1)
            if raised.size:
                if not owned:
                    arr, owned = arr.copy(), True
                arr[name].view(np.uint8)[raised] = 1
        for name, _, _, _, bits_dtype in self._key_floats:
            if not needs_normalizing(arr[name].view(bits_dtype)):  # compiled, no copy
                continue
            if not owned:
                arr, owned = arr.copy(), True
            normalize_bits(arr[name].view(bits_dtype))
        return arr

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
            self._check_names(list(batch.keys()))
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


@functools.lru_cache(maxsize=256)
def _schema_of_description(cls, fields):
    return cls(np.dtype(list(fields)))


def _structured_from(columns, dtype, n):
    out = np.empty(n, dtype=dtype)
    for name in dtype.names:
        out[name] = columns[name]
    return out


def key_value_schemas(key_schema, value_schema):
    """The (key, value) RowSchemas of a store; a key needs at least one field, a value may
    have none. The key schema is the one place keys get normalized (``key=True``): every
    table, store and file writer takes its schemas from here."""
    key, value = as_schema(key_schema, key=True), as_schema(value_schema, key=False)
    if key.width == 0:
        raise TypeError("a key schema needs at least one field")
    return key, value


def as_schema(schema, key=None):
    """A :class:`RowSchema` from a RowSchema or anything ``numpy.dtype`` accepts; ``key``
    True or False asks for a key or value schema, None keeps a RowSchema's own."""
    if isinstance(schema, RowSchema):
        if key is None or schema.key == bool(key):
            return schema
        schema = schema.dtype
    return RowSchema(schema, key=bool(key))
