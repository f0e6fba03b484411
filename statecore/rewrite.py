"""Rewriting a StatefulOperator's state through a transform of the user's, without Spark
(``statecore rewrite``, issue 37): the way out for every schema change the rules of
:mod:`statecore.schema_evolution` refuse, and for filtering or fixing state offline.

A rewrite is a repartition to the same number of partitions with the transform in the
middle, and runs :mod:`statecore.repartition`'s protocol (plan, journal, new snapshots under
new ids, the atomic switch of ``_operator.json``, the roll-forward): a kill at any step leaves
the old state or the new one whole, and the next run finishes or undoes it. Every batch of
the default store is read at the newest batch record's version, given to the transform, and
its rows routed to the partition Spark routes their key to; every check (what the transform
returns, unique keys) is made before anything is written. The contract and the protocol:
``docs/rewrite.md``.
"""
import dataclasses
import importlib
import threading

import numpy as np

from statecore import operator_files
from statecore import repartition as protocol
from statecore._grouping import group_key_rows
from statecore.conf import StateStoreConf
from statecore.errors import SchemaMismatchError
from statecore.schema import key_value_schemas
from statecore.schema_evolution import plan_state

__all__ = ["RewriteError", "load_transform", "rewrite"]


class RewriteError(protocol.RepartitionError):
    """The transform or what it returned cannot be written; nothing was written."""


def load_transform(spec):
    """The function ``spec`` (``"module:function"``) names, imported as Python imports it;
    RewriteError saying what is wrong if it does not import or is not callable."""
    module_name, sep, attribute = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attribute:
        raise RewriteError(f"the transform must be given as module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error it raises on import is its own
        raise RewriteError(f"the transform's module {module_name!r} does not import: {type(e).__name__}: {e}") \
            from None
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise RewriteError(f"the transform {spec!r}: module {module_name!r} has no {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewriteError(f"the transform {spec!r} is a {type(fn).__name__}, not a function")
    return fn


class _Transformer:
    """The user's function called on every batch of the operator's default store, and what it
    returns checked: two 1-D structured arrays of equal length, the same dtypes for every batch
    (the new schemas, taken from the first), the operator's key columns kept as they were (they
    route the key). Other stores' batches pass unchanged. Counts each partition's rows in.
    Partitions are read on several threads; ``fn`` is called once at a time all the same."""

    def __init__(self, fn, name, plan):
        self.fn, self.name, self.plan = fn, name, plan
        self.default = plan.stores[0]
        self.rows_in = [0] * plan.from_partitions
        self.key_schema = self.value_schema = None
        # Whether some batch came back with other keys than it went in with; while none did,
        # every partition's keys are the store's own, unique, and need no check.
        self.keys_changed = False
        self._one_call = threading.Lock()

    def __call__(self, store, partition, keys, values):
        if store.name != self.default.name:
            return keys, values
        with self._one_call:  # partitions are read on several threads; the user's fn sees one call at a time
            return self._call(partition, keys, values)

    def _call(self, partition, keys, values):
        self.rows_in[partition] += len(keys)
        where = f"on a batch of partition {partition}"
        try:
            out = self.fn(keys, values)
        except Exception as e:  # the user's code: its error, named, and nothing written
            raise RewriteError(f"the transform {self.name} raised {type(e).__name__}: {e} ({where}); nothing was "
                               f"written") from None
        if not (isinstance(out, tuple) and len(out) == 2
                and all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.names is not None for a in out)):
            raise RewriteError(f"the transform {self.name} must return (keys, values), two 1-D numpy structured "
                               f"arrays; it returned {_shape_of(out)} ({where})")
        new_keys, new_values = out
        if len(new_keys) != len(new_values):
            raise RewriteError(f"the transform {self.name} returned {len(new_keys)} keys and {len(new_values)} "
                               f"values ({where}): a row is a key and its value")
        schemas = self._schemas_of(new_keys.dtype, new_values.dtype, where)
        if self.key_schema is None:
            self._learn(*schemas)
        elif schemas != (self.key_schema, self.value_schema):
            raise RewriteError(
                f"the transform {self.name} returned keys {_fields(new_keys.dtype)}, values "
                f"{_fields(new_values.dtype)} ({where}), but key {self.key_schema.describe()}, value "
                f"{self.value_schema.describe()} for the first batch: every batch must have the same schemas")
        key_rows = self.key_schema.rows(new_keys)
        if not self.keys_changed:
            self.keys_changed = (self.key_schema != self.default.key_schema or len(new_keys) != len(keys)
                                 or not np.array_equal(key_rows, self.default.key_schema.rows(keys)))
        return self.key_schema.from_rows(key_rows), self.value_schema.from_rows(self.value_schema.rows(new_values))

    def _schemas_of(self, key_dtype, value_dtype, where):
        """The store schemas of what the transform returned; RewriteError if a store cannot hold it."""
        try:
            return key_value_schemas(key_dtype, value_dtype)
        except (TypeError, ValueError) as e:
            raise RewriteError(f"the transform {self.name} returned rows a store cannot hold ({where}): {e}") \
                from None

    def _learn(self, key_schema, value_schema):
        """The new schemas, from the first batch the transform returned, checked."""
        self.key_schema, self.value_schema = key_schema, value_schema
        old_key = self.default.key_schema.dtype
        moved = [c for c in self.plan.key_columns if c not in self.key_schema.names
                 or not _same_route(old_key[c], self.key_schema.dtype[c])]
        if moved:
            raise RewriteError(f"the transform {self.name} changes or drops key column(s) {moved} of the key "
                               f"{_fields(old_key)}: they are the operator's key columns, which route each key to "
                               f"its partition, and stay as they are")
        if self.key_schema != self.default.key_schema and len(self.plan.stores) > 1:
            raise RewriteError(f"the transform {self.name} changes the key schema, and operator "
                               f"{self.plan.operator_id} has other stores keyed by the old keys "
                               f"{[s.name for s in self.plan.stores[1:]]}: only the key's value may change here")


def _same_route(old, new):
    """Whether a key column of dtype ``old`` routes alike as ``new``: the same dtype, or a wider
    ``S<n>`` (Spark hashes a string without the padding, and its type stays string)."""
    return old == new or (old.kind == new.kind == "S" and new.itemsize >= old.itemsize)


def _shape_of(out):
    if isinstance(out, tuple):
        return "(" + ", ".join(f"{type(a).__name__} {getattr(a, 'dtype', '')}" for a in out) + ")"
    return type(out).__name__


def _fields(dtype):
    return [[name, dtype[name].str] for name in dtype.names]


def _transformed(plan, fn, name, on_source=None):
    """Read and transform the state of ``plan`` (nothing written): ``(routed, transformer)``,
    every check made. The new schemas are in the plan's default store from then on."""
    transformer = _Transformer(fn, name, plan)
    routed = protocol.read_sources(plan, on_source=on_source, transform=transformer)
    default = plan.stores[0]
    if transformer.key_schema is None:  # no row at all: the transform tells its schemas on an empty batch
        transformer(default, 0, np.zeros(0, default.key_dtype), np.zeros(0, default.value_dtype))
    for q in range(plan.to_partitions if transformer.keys_changed else 0):
        _check_unique(routed[(default.name, q)], transformer, q)
    plan.stores[0] = dataclasses.replace(
        default, key_dtype=transformer.key_schema.dtype, value_dtype=transformer.value_schema.dtype,
        rewritten=(transformer.key_schema, transformer.value_schema) != (default.key_schema, default.value_schema))
    return routed, transformer


def _check_unique(chunks, transformer, partition):
    """RewriteError naming a key the transform returned twice for ``partition``."""
    if not chunks:
        return
    width = transformer.key_schema.width
    keys = np.ascontiguousarray(np.concatenate([c[:, :width] for c in chunks]))
    order, starts = group_key_rows(keys)
    if len(starts) == len(keys):
        return
    sizes = np.diff(np.append(starts, len(keys)))
    group = int(np.flatnonzero(sizes > 1)[0])
    key = transformer.key_schema.decode(keys[order[starts[group]]].tobytes())
    raise RewriteError(f"the transform {transformer.name} returned key {key} {int(sizes[group])} times in partition "
                       f"{partition} ({len(keys) - len(starts)} duplicated rows there): keys must be unique")


def schema_change(old_key, old_value, new_key, new_value):
    """The change of schemas in words: "unchanged", the rules' description of it where they
    allow it, else "rewritten" (a change only a rewrite makes)."""
    if (old_key, old_value) == (new_key, new_value):
        return ["unchanged"]
    try:
        return plan_state(old_key, old_value, new_key, new_value).describe() or ["rewritten"]
    except SchemaMismatchError:
        return ["rewritten"]


def rewrite(checkpoint, operator_id, transform, conf=None, dry_run=False, on_source=None, on_target=None):
    """Rewrite the state of operator ``operator_id`` of ``checkpoint`` through ``transform``
    (a callable, or ``"module:function"``), locally, under the operator's lock; returns a
    summary dict. ``dry_run``: read and transform every batch, check it, write nothing (no
    lock either). A run that finds an interrupted rewrite's switch made finishes that one and
    stops (its summary's ``finished``), so that no transform is applied twice.
    RewriteError (a ValueError) naming what is wrong; nothing written then."""
    conf = conf or StateStoreConf()
    name = transform if isinstance(transform, str) else getattr(transform, "__qualname__", repr(transform))
    fn = load_transform(transform) if isinstance(transform, str) else transform
    if not callable(fn):
        raise RewriteError(f"the transform {name} is not callable")
    if dry_run:
        plan = protocol.plan_repartition(checkpoint, operator_id, None, conf)
        pending = protocol.pending_switch(checkpoint, operator_id, conf)
        if pending is not None:
            writer = pending["record"].get("writer")
            raise RewriteError(f"operator {operator_id} of {checkpoint} has a switched {writer} whose clean-up was "
                               f"interrupted: run statecore rewrite without --dry-run to finish it first")
        old = plan.stores[0]
        routed, transformer = _transformed(plan, fn, name, on_source)
        return summary(plan, old, transformer, {key: sum(len(c) for c in chunks) for key, chunks in routed.items()},
                       dry_run=True)
    with protocol.planned(checkpoint, operator_id, None, conf, command="rewrite") as plan:
        plan.command = operator_files.WRITER_REWRITE
        if plan.finished is not None and plan.finished["record"].get("writer") == operator_files.WRITER_REWRITE:
            return {"checkpoint": checkpoint, "operator_id": operator_id, "finished": plan.finished["journal"],
                    "batch_id": plan.finished["batch_id"], "version": plan.finished["version"]}
        old = plan.stores[0]
        routed, transformer = _transformed(plan, fn, name, on_source)
        protocol.prepare(plan)
        written = protocol.write_targets(plan, routed, on_target)
        protocol.switch(plan)
        protocol.finish(plan)
    return summary(plan, old, transformer, written, dry_run=False)


def summary(plan, old, transformer, written, dry_run):
    """What a rewrite did (or would do): per partition the default store's rows in and out,
    the schemas before and after and their change in words."""
    default = plan.stores[0]
    out = [written.get((default.name, q), 0) for q in range(plan.to_partitions)]
    return {
        "checkpoint": plan.checkpoint, "operator_id": plan.operator_id, "batch_id": plan.batch_id,
        "version": plan.version, "dry_run": dry_run, "store": default.name,
        "partitions": [{"partition": q, "rows_in": transformer.rows_in[q], "rows_out": out[q],
                        "dropped": transformer.rows_in[q] - out[q]} for q in range(plan.to_partitions)],
        "rows_in": sum(transformer.rows_in), "rows_out": sum(out),
        "schemas": {"before": {"key": old.key_schema.describe(), "value": old.value_schema.describe()},
                    "after": {"key": default.key_schema.describe(), "value": default.value_schema.describe()},
                    "change": schema_change(old.key_schema, old.value_schema, default.key_schema,
                                            default.value_schema)},
        "commit_ids": None if dry_run else {s.name: list(s.new_ids) for s in plan.stores}}
