"""The contract between an operator and its ``fn`` (``docs/operator.md``, "The function's contract").

:class:`OperatorFunction` declares everything a :class:`~pyspark_glue.StatefulOperator` (and
:class:`~pyspark_glue.testing.Harness`, and continuous mode) reads of ``fn``: its attributes, with
defaults, and its hooks; ``open(context)`` returns a :class:`TaskHandler`, which holds one task's
state and gets the task's batches and its ``finish``, so nothing of a task lives on the shared
``fn``. :func:`contract_of` is the one way a runner reads ``fn``: an ``OperatorFunction`` as it
is, a plain callable ``fn(store, batch)`` with optional attributes wrapped in one.
:class:`FunctionSettings` is what a runner takes from its arguments and the contract: the key
columns, event time and delay, the schemas (resolved from the first batch's columns when ``fn``
resolves them), the stores.
"""
import numpy as np

from statecore.grouping import group_rows
from statecore.schema import key_value_schemas
from statecore.schema_evolution import SchemaChanges

from pyspark_glue.arrow import output_schemas, to_record_batch
from pyspark_glue.event_time import check_event_time_column, parse_duration_us

__all__ = ["OperatorFunction", "TaskHandler", "PartitionContext", "contract_of", "FunctionSettings", "FROM_FN"]

FROM_FN = object()  # a runner's argument left out: taken from fn's attribute of the same name


class PartitionContext:
    """What ``fn.open(context)`` is given: the partition, its stores, the batch's watermarks.

    Attributes
    ----------
    partition_id, batch_id : int
    store : StateStore
        The default store (the one a plain ``fn`` is called with).
    stores : dict
        Every store of the partition by name: the default one (under the operator's
        ``store_name``) and those ``fn.state_stores`` declares.
    watermarks : Watermarks or None
        The batch's two watermarks (None without an event-time column).
    batch_timestamp_ms : int
        The batch's processing time (the driver's clock when the batch began).
    late_rows : int
        Rows ``fn`` dropped as late; ``fn`` adds to it (it is summed into ``last_progress``).
    counts : dict
        Counters of ``fn``'s own (name -> int), summed over the partitions into
        ``last_progress["fn_counts"]`` (what an ``fn.observe`` may adapt to).
    new_stores : frozenset
        The names of the stores that start empty in this batch: every store in batch 0, and
        later a store the previous batch's record does not name (new to the operator), which
        ``fn`` may fill from the others once.
    """

    def __init__(self, partition_id, batch_id, stores, store_name, watermarks, batch_timestamp_ms=0,
                 new_stores=frozenset()):
        self.partition_id, self.batch_id = partition_id, batch_id
        self.stores = stores
        self.new_stores = frozenset(new_stores)
        self.store = stores[store_name]
        self.watermarks = watermarks
        self.batch_timestamp_ms = batch_timestamp_ms
        self.late_rows = 0
        self.counts = {}


class TaskHandler:
    """One task's side of an ``fn``: made by ``fn.open(context)`` in the task, given each of the
    partition's (joined) Arrow batches by :meth:`process`, then :meth:`finish` once. It holds
    whatever the task keeps between them; it ends with the task.

    Rows handed to :meth:`emit_latest` are emitted by the default :meth:`finish`, each key
    once with the last values given for it: a handler that emits the keys it updated emits
    each once per micro-batch however many batches its rows came in.
    """

    def __init__(self, fn, context):
        self.fn, self.context = fn, context
        self.store = context.store
        self._latest = []  # (keys, values, distinct) given to emit_latest, in order

    def process(self, batch):
        """One Arrow batch of the partition's rows; returns output (a RecordBatch or Table) or None."""
        raise NotImplementedError(f"{type(self).__name__} must define process(batch)")

    def emit_latest(self, keys, values, distinct=False):
        """Output these keys (a structured array) with these values at :meth:`finish`, each key
        once with the last values given for it in the task. ``distinct``: no key repeats in
        ``keys`` (it saves a grouping when this is the task's only call)."""
        self._latest.append((keys, values, distinct))

    def latest(self):
        """``(keys, values)`` given to :meth:`emit_latest`, each key once with its last values,
        or None if nothing was given."""
        parts, self._latest = self._latest, []
        if not parts:
            return None
        if len(parts) == 1 and parts[0][2]:
            return parts[0][:2]
        keys = np.concatenate([k for k, _, _ in parts])
        values = np.concatenate([v for _, v, _ in parts])
        order, starts = group_rows(keys)
        last = order[np.append(starts[1:], len(keys)) - 1]  # a group's rows keep their order
        return keys[last], values[last]

    def finish(self):
        """After the last batch (also for a partition without rows); returns output or None.
        Default: the rows given to :meth:`emit_latest`."""
        latest = self.latest()
        return None if latest is None else to_record_batch(*latest)


class OperatorFunction:
    """Base class of an operator's ``fn``: what the operator reads of it, with defaults.

    Attributes (class or instance; an operator argument of the same name wins)
    ----------
    key_columns : list of str or None
    key_schema, value_schema : structured dtypes or None
        None: :meth:`resolve_schemas` sets them from the first batch's columns.
    output_schema : StructType, DDL string or None
        The schema of what the handlers return; None: no output.
    event_time : str or None
        A timestamp column; with it, ``delay`` (the watermark delay) is needed.
    delay : str or timedelta or None
    state_stores : dict or None
        The partition's stores besides the default one: name -> (key schema, value schema).
    schema_changes : SchemaChanges, dict or None
        What the schema rules cannot infer when the state's schemas changed since the
        checkpoint was written (``docs/evolution.md``): renamed fields and added fields'
        defaults, as a :class:`statecore.SchemaChanges` for the operator's store or
        ``{store name: SchemaChanges}``. Kept after the change (ignored once in effect).
    takes_initial_state : bool
        Whether the operator's ``initial_state`` may be given (its rows reach the handlers
        marked, in the first batch: :class:`~pyspark_glue.StatefulProcessor`).

    Hooks: :meth:`prepare`, :meth:`resolve_schemas` and :meth:`observe` run on the driver,
    :meth:`open` in each task.
    """

    key_columns = None
    key_schema = None
    value_schema = None
    output_schema = None
    event_time = None
    delay = None
    state_stores = None
    schema_changes = None
    takes_initial_state = False

    def prepare(self, df, key_columns):
        """On the driver, every batch, before the operator's shuffle: the DataFrame the tasks
        get (Spark may aggregate it first). Default: ``df``."""
        return df

    def resolve_schemas(self, spark_schema):
        """On the driver, at the first batch, while ``key_schema`` or ``value_schema`` is None:
        set them (and ``output_schema`` if it follows the input) from the input's columns."""

    def observe(self, progress):
        """On the driver, after each batch: its ``last_progress`` (adapt the next batch to it)."""

    def schema_change_problems(self, plan):
        """On the driver, when the operator's state schemas change by ``plan`` (a
        :class:`statecore.schema_evolution.StatePlan` the rules allow): ``(field, rule)`` pairs
        for each change this fn cannot take (the operator refuses them before anything is
        written). Default: none."""
        return []

    def open(self, context):
        """In each task, before its rows: the :class:`TaskHandler` that gets them."""
        raise NotImplementedError(f"{type(self).__name__} must define open(context) returning a TaskHandler")


def _fn_attribute(name):
    """A property of :class:`CallableFunction`: the wrapped ``fn``'s attribute ``name``, read
    when asked (a built-in sets its schemas late), None if it has none."""
    return property(lambda self: getattr(self.fn, name, None), doc=f"``fn.{name}``, or None")


class CallableFunction(OperatorFunction):
    """A plain ``fn(store, batch)`` as the contract: its optional attributes (``key_schema``,
    ``prepare``, ``open``, ``finish``...) read from it when asked, so a callable written against
    the documented attributes runs unchanged (its ``open(context)`` is called, its result
    unused, and ``fn.finish(store)`` ends the task)."""

    def __init__(self, fn):
        self.fn = fn

    key_columns = _fn_attribute("key_columns")
    key_schema = _fn_attribute("key_schema")
    value_schema = _fn_attribute("value_schema")
    output_schema = _fn_attribute("output_schema")
    event_time = _fn_attribute("event_time")
    delay = _fn_attribute("delay")
    state_stores = _fn_attribute("state_stores")
    schema_changes = _fn_attribute("schema_changes")

    @property
    def takes_initial_state(self):
        return callable(getattr(self.fn, "handle_initial_state", None))

    def _hook(self, name):
        hook = getattr(self.fn, name, None)
        return hook if callable(hook) else None

    def prepare(self, df, key_columns):
        hook = self._hook("prepare")
        return df if hook is None else hook(df, key_columns)

    def resolve_schemas(self, spark_schema):
        hook = self._hook("resolve_schemas")
        if hook is not None:
            hook(spark_schema)

    def observe(self, progress):
        hook = self._hook("observe")
        if hook is not None:
            hook(progress)

    def open(self, context):
        hook = self._hook("open")
        if hook is not None:
            hook(context)
        return _CallableTask(self.fn, context)


class _CallableTask(TaskHandler):
    """A plain ``fn``'s task: ``fn(store, batch)`` per batch, ``fn.finish(store)`` if it has one."""

    def process(self, batch):
        return self.fn(self.store, batch)

    def finish(self):
        finish = getattr(self.fn, "finish", None)
        return finish(self.store) if callable(finish) else None


def contract_of(fn):
    """``fn`` as an :class:`OperatorFunction`: itself, or a plain callable wrapped
    (:class:`CallableFunction`). TypeError for anything else."""
    if isinstance(fn, OperatorFunction):
        return fn
    if not callable(fn):
        raise TypeError(f"fn must be an OperatorFunction or a callable fn(store, batch), got {type(fn).__name__}")
    return CallableFunction(fn)


def open_task(contract, context):
    """``contract.open(context)``, checked to be a :class:`TaskHandler`."""
    handler = contract.open(context)
    if not isinstance(handler, TaskHandler):
        raise TypeError(f"{type(contract).__name__}.open(context) must return a TaskHandler, got "
                        f"{type(handler).__name__}")
    return handler


def added_aggregate_problems(plan):
    """A built-in's refusal of added value fields (``schema_change_problems``): it keeps no rows
    once merged, so a new aggregate's value over them is unknown, and a default would be a
    wrong answer for every key already in the state (``docs/evolution.md``, "The built-ins")."""
    return [(f.name, "an aggregate added to a built-in: the rows already merged into the state are not kept, so "
                     "its value over them is unknown (a default would be wrong for every key already there); "
                     "remove or widen aggregates in place, or compute the new one with `statecore rewrite`")
            for f in plan.value.fields if f.added]


def _from_fn(contract, name, given):
    return getattr(contract, name) if given is FROM_FN else given


class FunctionSettings:
    """What a runner (the operator, the harness) takes from its arguments and ``fn``'s contract,
    checked once: an argument left out (``FROM_FN``) is ``fn``'s attribute of the same name.
    The schemas may wait for the first batch's columns (:meth:`resolve_input`).

    Attributes
    ----------
    contract : OperatorFunction
    key_columns : list of str
    event_time : str or None
    delay_us : int or None
    key_schema, value_schema : RowSchema or None (until resolved)
    output_schema, arrow_schema : the output's StructType and pyarrow schema (None: no output),
        known once :attr:`input_resolved`
    """

    def __init__(self, fn, key_columns=FROM_FN, key_schema=FROM_FN, value_schema=FROM_FN, output_schema=FROM_FN,
                 event_time=FROM_FN, delay=FROM_FN, with_initial_state=False, schema_changes=FROM_FN):
        self.contract = contract_of(fn)
        self._schema_changes = _from_fn(self.contract, "schema_changes", schema_changes)
        key_columns = _from_fn(self.contract, "key_columns", key_columns)
        if isinstance(key_columns, str):
            key_columns = [key_columns]
        self.key_columns = list(key_columns or ())
        if not self.key_columns or not all(isinstance(c, str) for c in self.key_columns):
            raise ValueError(f"key_columns must be a non-empty list of column names (pass them, or give fn an "
                             f"attribute of that name), got {key_columns!r}")
        self.event_time = _from_fn(self.contract, "event_time", event_time)
        if self.event_time is not None and not isinstance(self.event_time, str):
            raise TypeError(f"event_time must be a column name, got {type(self.event_time).__name__}")
        delay = _from_fn(self.contract, "delay", delay)
        if self.event_time is not None and delay is None:
            raise ValueError(f"an event-time column ('{self.event_time}') needs a watermark delay")
        self.delay_us = None if delay is None else parse_duration_us(delay, "the watermark delay")
        if with_initial_state and not self.contract.takes_initial_state:
            raise TypeError("an initial_state needs an fn with handle_initial_state (a StatefulProcessor)")
        self._schema_args = (key_schema, value_schema)
        self._output_schema_arg = output_schema
        self.key_schema = self.value_schema = None
        self.output_schema = self.arrow_schema = None
        self.input_resolved = False
        self._take_schemas()

    def _take_schemas(self):
        key, value = (_from_fn(self.contract, name, given)
                      for name, given in zip(("key_schema", "value_schema"), self._schema_args))
        if key is not None and value is not None:
            self.key_schema, self.value_schema = key_value_schemas(key, value)
        return key, value

    def resolve_input(self, spark_schema, what="the DataFrame"):
        """Check the input's columns (``spark_schema``, a StructType; ``what``: the input, in
        errors) before any store changes:
        the key columns and the event-time column (a timestamp) are there; the schemas not
        given come from ``fn.resolve_schemas`` (the first time); the output schema is fixed."""
        columns = [f.name for f in spark_schema.fields]
        missing = [c for c in self.key_columns if c not in columns]
        if missing:
            raise ValueError(f"key column '{missing[0]}' is not in {what} (columns: {columns})")
        if self.event_time is not None:
            check_event_time_column(spark_schema, self.event_time)
        if self.key_schema is None:
            self.contract.resolve_schemas(spark_schema)
            key, value = self._take_schemas()
            if self.key_schema is None:
                missing = "key_schema" if key is None else "value_schema"
                raise ValueError(f"no {missing}: pass it, or give fn an attribute of that name (or a "
                                 f"resolve_schemas that sets it from the input's columns)")
        if not self.input_resolved:
            self.output_schema, self.arrow_schema = output_schemas(
                _from_fn(self.contract, "output_schema", self._output_schema_arg))
            self.input_resolved = True

    def schema_changes(self, store_name):
        """``{store name: SchemaChanges}`` declared (the argument, else ``fn.schema_changes``),
        a bare SchemaChanges being the operator's own ``store_name``'s; TypeError for
        anything else."""
        declared = self._schema_changes
        if declared is None:
            return {}
        if isinstance(declared, SchemaChanges) or (isinstance(declared, dict)
                                                   and set(declared) <= {"renames", "defaults"} and declared):
            return {store_name: SchemaChanges.of(declared)}
        if not isinstance(declared, dict):
            raise TypeError(f"schema_changes must be a SchemaChanges or a dict of store name -> SchemaChanges, got "
                            f"{type(declared).__name__}")
        return {str(name): SchemaChanges.of(changes) for name, changes in declared.items()}

    def extra_stores(self, store_name):
        """``{name: (key RowSchema, value RowSchema)}`` of the stores ``fn.state_stores``
        declares, by name; ValueError if one is the operator's own ``store_name``."""
        declared = self.contract.state_stores or {}
        if store_name in declared:
            raise ValueError(f"fn.state_stores names the operator's own store {store_name!r}")
        return {name: key_value_schemas(key, value) for name, (key, value) in sorted(declared.items())}
