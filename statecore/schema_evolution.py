"""Schema evolution: whether a store's row schema may change into another, and its rows converted.

:func:`plan` compares the schema a store was written with (``old``) to the one a query now
asks for (``new``) and either returns an :class:`EvolutionPlan` (where each new field comes
from) or raises one :class:`SchemaEvolutionError` listing every field that breaks a rule.
:func:`convert` turns old rows into new rows by that plan (compiled into byte moves,
``_row_convert``). The rules and why (exact widenings only; a key keeps its identity) are in
docs/evolution.md. This module decides and converts; it reads and writes no file.
"""
import dataclasses

import numpy as np

from statecore._row_convert import RowConverter
from statecore.errors import SchemaMismatchError
from statecore.schema import RowSchema, as_schema

__all__ = ["EvolutionPlan", "FieldSource", "SchemaChanges", "SchemaEvolutionError", "StatePlan", "convert", "plan",
           "plan_state"]

# The widenings that keep every value exactly (docs/evolution.md, "The rules"): old -> new dtypes.
_SIGNED = [np.dtype(t) for t in ("i1", "<i2", "<i4", "<i8")]
_UNSIGNED = [np.dtype(t) for t in ("u1", "<u2", "<u4", "<u8")]
_F4, _F8 = np.dtype("<f4"), np.dtype("<f8")


def _exact_widenings():
    allowed = set()
    for chain in (_SIGNED, _UNSIGNED):
        allowed.update((a, b) for i, a in enumerate(chain) for b in chain[i + 1:])
    allowed.update((u, s) for u in _UNSIGNED for s in _SIGNED if s.itemsize > u.itemsize)
    allowed.add((_F4, _F8))
    allowed.update((t, _F8) for t in _SIGNED[:3] + _UNSIGNED[:3])  # at most 32 bits: a float64 holds them all
    return frozenset(allowed)


_WIDENINGS = _exact_widenings()

_REWRITE_HINT = ("Nothing was converted or written. To make this change, rewrite the state with a transform of "
                 "your own: `statecore rewrite` (docs/evolution.md).")


class SchemaEvolutionError(SchemaMismatchError):
    """A schema change the rules refuse. ``kind`` is "key" or "value"; ``problems`` holds
    ``(field, rule)`` pairs, one per field that breaks a rule, all of them; the message lists
    them and says how to proceed. A :class:`SchemaMismatchError`, so callers that catch that
    keep working."""

    def __init__(self, kind, old, new, problems, also=None, where=None):
        self.kind, self.old, self.new = kind, old, new
        self.problems = tuple((str(field), str(rule)) for field, rule in problems)
        self.also = also  # the value schema's error when the key's breaks the rules too (plan_state)
        self.where = where  # what changed its schemas (an operator), named first
        lines = self._lines() + (also._lines() if also is not None else []) + [_REWRITE_HINT]
        if where is not None:
            lines[0] = f"{where}: {lines[0]}"
        super().__init__("\n".join(lines))

    def _lines(self):
        count = f"{len(self.problems)} fields break" if len(self.problems) > 1 else "1 field breaks"
        lines = [f"the {self.kind} schema cannot change from {self.old} to {self.new}: {count} the rules:"]
        return lines + [f"  - {self.kind} field '{field}': {rule}" for field, rule in self.problems]

    def __reduce__(self):
        return (type(self), (self.kind, self.old, self.new, self.problems, self.also, self.where))


@dataclasses.dataclass(frozen=True)
class FieldSource:
    """Where one field of the new schema comes from: the old field ``source`` (None: added,
    filled with ``default``), its old dtype, and its new one."""

    name: str
    dtype: np.dtype
    source: str | None = None
    old_dtype: np.dtype | None = None
    default: object = None

    @property
    def added(self):
        return self.source is None

    @property
    def renamed(self):
        return self.source is not None and self.source != self.name

    @property
    def widened(self):
        return self.source is not None and self.old_dtype != self.dtype


@dataclasses.dataclass(frozen=True)
class EvolutionPlan:
    """How rows of ``old`` become rows of ``new`` (both key schemas when ``key``): one
    :class:`FieldSource` per new field, in the new order, and the old fields ``dropped``.
    ``changes_bytes``: whether a row's bytes change (renames alone change none); for a key
    that means every row is re-keyed (its bytes, and so its hash, change)."""

    old: RowSchema
    new: RowSchema
    key: bool
    fields: tuple
    dropped: tuple
    changes_bytes: bool

    @property
    def is_identity(self):
        return self.old == self.new

    @property
    def reordered(self):
        """Whether the fields carried over are in another order than in ``old``."""
        positions = [self.old.names.index(f.source) for f in self.fields if not f.added]
        return positions != sorted(positions)

    def describe(self):
        """The changes in plain words, one string each (none for the identity plan)."""
        kind = "key" if self.key else "value"
        out = []
        for f in self.fields:
            if f.added:
                out.append(f"{kind} field '{f.name}' added, default {f.default!r}")
                continue
            changes = []
            if f.renamed:
                changes.append(f"renamed to '{f.name}'")
            if f.widened:
                changes.append(f"widened {_type_name(f.old_dtype)} -> {_type_name(f.dtype)}")
            if changes:
                out.append(f"{kind} field '{f.source}' " + ", ".join(changes))
        out += [f"{kind} field '{name}' dropped" for name in self.dropped]
        if self.reordered:
            out.append(f"{kind} fields reordered: {', '.join(self.new.names)}")
        if self.key and self.changes_bytes:
            out.append("every key row is re-keyed (its bytes and hash change)")
        return out


def plan(old, new, *, renames=None, defaults=None, key=False):
    """The :class:`EvolutionPlan` from ``old`` to ``new`` (RowSchemas or dtypes), or a
    :class:`SchemaEvolutionError` listing every field that breaks a rule.

    ``renames``: {old name: new name}, the only way a field is renamed (for values, a field
    that disappears under one name and appears under another is a drop and an add).
    ``defaults``: {new name: value} for added value fields; an added field without one is
    zero (empty bytes, False). ``key``: the schemas are a store's key schemas, under the key
    rules (rename and exact integer or bytes widening only)."""
    old, new = as_schema(old, key=key), as_schema(new, key=key)
    renames, defaults = dict(renames or {}), dict(defaults or {})
    problems = _rename_problems(old, new, renames)
    renamed_from = {target: source for source, target in renames.items() if source in old.names}
    old_dtypes, fields = dict(old.fields), []
    for name, dtype in new.fields:
        source = renamed_from.get(name, name if name in old_dtypes and name not in renames else None)
        if source is None:
            field, problem = _added(name, dtype, defaults, key)
        else:
            field = FieldSource(name, dtype, source, old_dtypes[source])
            problem = _widening_problem(field.old_dtype, dtype, key)
            if name in defaults:
                problems.append((name, f"a default is given, but the field is not added: it comes from the old "
                                       f"field '{source}'"))
        fields.append(field)
        if problem:
            problems.append((name, problem))
    problems += [(name, "a default is given, but the new schema has no such field")
                 for name in defaults if name not in new.names]
    carried = {f.source for f in fields if not f.added}
    dropped = tuple(name for name in old.names if name not in carried)
    result = EvolutionPlan(old, new, bool(key), tuple(fields), dropped,
                           changes_bytes=[(f.source, f.dtype) for f in fields] != list(old.fields))
    if key:
        problems += _key_problems(result)
    if problems:
        raise SchemaEvolutionError("key" if key else "value", old.describe(), new.describe(), problems)
    return result


def convert(plan, rows):
    """``(n, plan.old.width)`` uint8 rows as ``(n, plan.new.width)`` rows of ``plan.new``:
    each field moved (widened where the plan widens it, NUL-padded where bytes widen), added
    fields set to their default, by the plan's :class:`~statecore._row_convert.RowConverter`.
    Rows whose bytes the plan keeps come back as they are; key rows come back normalized as
    ``RowSchema(key=True)`` rows are."""
    rows = _checked_rows(plan.old, rows)
    if plan.changes_bytes:
        rows = RowConverter(plan).convert_rows(rows)
    return plan.new.rows(plan.new.from_rows(rows))


@dataclasses.dataclass(frozen=True)
class SchemaChanges:
    """What a query declares about its state's schema change beyond the rules: ``renames``
    ({old field name: new name}, key or value) and ``defaults`` ({added value field: value};
    without one an added field is zero, empty bytes or False). Kept after the change: a
    declaration already in effect is ignored (:func:`plan_state`)."""

    renames: dict = dataclasses.field(default_factory=dict, hash=False)
    defaults: dict = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self):
        for what, mapping in (("renames", self.renames), ("defaults", self.defaults)):
            if not isinstance(mapping, dict):
                raise TypeError(f"{what} must be a dict, got {type(mapping).__name__}")
            bad = [k for k in mapping if not isinstance(k, str)]
            if bad:
                raise TypeError(f"{what} keys are field names (str), got {bad[0]!r}")
        bad = [v for v in self.renames.values() if not isinstance(v, str)]
        if bad:
            raise TypeError(f"renames maps field names to field names (str), got {bad[0]!r}")
        object.__setattr__(self, "renames", dict(self.renames))
        object.__setattr__(self, "defaults", dict(self.defaults))

    @classmethod
    def of(cls, changes):
        """A SchemaChanges from one, a ``{"renames": ..., "defaults": ...}`` dict, or None (none)."""
        if changes is None:
            return cls()
        if isinstance(changes, cls):
            return changes
        if isinstance(changes, dict) and set(changes) <= {"renames", "defaults"}:
            return cls(**changes)
        raise TypeError(f"schema changes must be a SchemaChanges or a dict with 'renames' and 'defaults', "
                        f"got {changes!r}")


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """How a store's rows, key and value, change from one pair of schemas to another: the
    two :class:`EvolutionPlan` s, applied together by :meth:`convert`."""

    key: EvolutionPlan
    value: EvolutionPlan

    @property
    def is_identity(self):
        return self.key.is_identity and self.value.is_identity

    @property
    def rekeys(self):
        """Whether every key row's bytes (and so its hash) change."""
        return self.key.changes_bytes

    def describe(self):
        return self.key.describe() + self.value.describe()

    def declared(self):
        """The :class:`SchemaChanges` this plan applied: its renames and added fields' defaults."""
        fields = self.key.fields + self.value.fields
        return SchemaChanges({f.source: f.name for f in fields if f.renamed},
                             {f.name: f.default for f in self.value.fields if f.added})

    def convert(self, keys, values):
        """``(keys, values)``, (n, width) uint8 rows of the old schemas, as rows of the new."""
        return convert(self.key, keys), convert(self.value, values)


def plan_state(old_key, old_value, new_key, new_value, *, renames=None, defaults=None):
    """The :class:`StatePlan` from a store's schemas ``(old_key, old_value)`` to ``(new_key,
    new_value)``, or one :class:`SchemaEvolutionError` listing every field of both that breaks
    a rule. ``renames`` ({old name: new name}) apply to whichever old schema holds the name;
    ``defaults`` to added value fields. A declaration already in effect (a rename whose new
    name the old schema has instead of its old one, a default for a field the old value has)
    is left out: a query keeps its declarations after the change they made."""
    old_key, old_value = as_schema(old_key, key=True), as_schema(old_value, key=False)
    renames, defaults = dict(renames or {}), dict(defaults or {})
    in_effect = {source for source, target in renames.items()
                 if source not in old_key.names + old_value.names and target in old_key.names + old_value.names}
    key_renames = {s: t for s, t in renames.items() if s in old_key.names}
    value_renames = {s: t for s, t in renames.items() if s not in old_key.names and s not in in_effect}
    defaults = {name: v for name, v in defaults.items() if name not in old_value.names}
    plans, errors = [], []
    for old, new, names, is_key in ((old_key, new_key, key_renames, True),
                                    (old_value, new_value, value_renames, False)):
        try:
            plans.append(plan(old, new, renames=names, defaults=None if is_key else defaults, key=is_key))
        except SchemaEvolutionError as e:
            errors.append(e)
    if len(errors) == 2:
        key_error, value_error = errors
        raise SchemaEvolutionError(key_error.kind, key_error.old, key_error.new, key_error.problems, also=value_error)
    if errors:
        raise errors[0]
    return StatePlan(*plans)


# -- the rules --------------------------------------------------------------------------------

def _rename_problems(old, new, renames):
    problems = []
    for source, target in renames.items():
        if source not in old.names:
            problems.append((source, f"renames maps it to '{target}', but the old schema has no field '{source}'"))
        elif target not in new.names:
            problems.append((source, f"renames maps it to '{target}', but the new schema has no field '{target}'"))
    targets = {}
    for source, target in renames.items():
        targets.setdefault(target, []).append(source)
    problems += [(target, f"renames maps several old fields to it: {', '.join(map(repr, sources))}")
                 for target, sources in targets.items() if len(sources) > 1]
    return problems


def _added(name, dtype, defaults, key):
    """The FieldSource of an added field and the problem with it, or None."""
    if key:
        return FieldSource(name, dtype), ("added: a key field added or dropped changes which rows are "
                                          "one key; to rename a key field, name it in renames")
    if name not in defaults:
        return FieldSource(name, dtype, default=np.zeros(1, dtype)[0].item()), None
    value = defaults[name]
    try:  # RowSchema's own per-value rules: the type a field takes, its range, a bytes field's width
        RowSchema(np.dtype([(name, dtype)])).encode((value,))
    except (TypeError, ValueError) as e:
        return FieldSource(name, dtype), f"its default {value!r} does not fit the field: {e}"
    return FieldSource(name, dtype, default=value), None


def _widening_problem(old, new, key):
    """None if a field of dtype ``old`` may become ``new``, else the rule it breaks."""
    if old == new:
        return None
    change = f"{_type_name(old)} -> {_type_name(new)}"
    if key and "f" in (old.kind, new.kind):
        return (f"{change}: a float key field stays as it is (its values are keys as Spark normalizes and groups "
                f"them; a widened key would not be the key the new query computes from the same input)")
    if "b" in (old.kind, new.kind):
        return f"{change}: a bool field stays a bool"
    if (old.kind == "S") != (new.kind == "S"):
        return f"{change}: a field does not change between bytes and numbers"
    if old.kind == "S":
        return None if new.itemsize > old.itemsize else f"{change} narrows: bytes fields only widen"
    if (old, new) in _WIDENINGS:
        return None
    if old.kind == "f" and new.kind in "iu":
        return f"{change}: a float does not become an int"
    if old.kind == "f":
        return f"{change} narrows: a float only widens, float32 -> float64"
    if new.kind == "f":
        return f"{change} is not exact: only float32 and ints of up to 32 bits widen to float64"
    if old.kind == "i" and new.kind == "u":
        return f"{change}: a signed int does not become unsigned"
    return (f"{change} narrows: ints widen only to more bits (int8 < int16 < int32 < int64, the same for uints, "
            f"uintN to intM with M > N)")


def _key_problems(plan):
    """What the key rules add: no field dropped, the fields in their order."""
    problems = [(name, "dropped: a key field added or dropped changes which rows are one key")
                for name in plan.dropped]
    if plan.reordered:
        carried = [f for f in plan.fields if not f.added]
        in_old_order = sorted(carried, key=lambda f: plan.old.names.index(f.source))
        problems += [(f.name, f"moved from position {in_old_order.index(f)} to {i}: a key keeps its fields' order "
                              f"(Spark compares key schemas field by field in order)")
                     for i, f in enumerate(carried) if in_old_order[i] is not f]
    return problems


def _type_name(dtype):
    return f"S{dtype.itemsize}" if dtype.kind == "S" else dtype.name


def _checked_rows(schema, rows):
    """``rows`` as a C-contiguous (n, width) uint8 array of ``schema``, or an error saying what is wrong."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2:
        raise TypeError(f"rows must be a 2-D uint8 array, got {type(rows).__name__} "
                        f"{getattr(rows, 'dtype', '')}{getattr(rows, 'shape', '')}")
    if rows.shape[1] != schema.width:
        raise ValueError(f"rows are {rows.shape[1]} bytes wide; rows of the old schema {schema.describe()} "
                         f"are {schema.width}")
    return np.ascontiguousarray(rows)
