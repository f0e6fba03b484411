"""The aggregates of the event-time built-ins: ``{"name": ("count" | "sum" | "min" | "max",
column)}`` as Spark's ``agg(count(...), sum(...), ...)`` computes them, in numpy.

:class:`Aggregates` owns the state fields that carry them (one accumulator per output, and
for sum, min and max a count of the non-null values seen, so that an aggregate over only
nulls comes out null as in Spark), the aggregation of a batch's rows per group (one
``reduceat`` per output), the merge of two partial results, and the output columns.
"""
import numpy as np
import pyarrow as pa

from pyspark_glue.arrow import column, column_to_numpy, dtype_of_columns

__all__ = ["Aggregates", "FUNCTIONS"]

FUNCTIONS = ("count", "sum", "min", "max")
_NON_NULL = "__n_"  # prefix of the non-null count field of an output


def _null_fill(dtype, function):
    """What a null stands for in a reduction: nothing to a sum, never the min or max."""
    if function == "sum":
        return 0
    if dtype.kind == "f":
        return np.inf if function == "min" else -np.inf
    info = np.iinfo(dtype)
    return info.max if function == "min" else info.min


class Aggregates:
    """The parsed ``aggregates`` argument of a built-in, bound to its input's column dtypes.

    Parameters
    ----------
    aggregates : dict
        Output column name -> ``(function, column)``; ``("count", "*")`` counts rows.
    """

    def __init__(self, aggregates):
        if not isinstance(aggregates, dict) or not aggregates:
            raise ValueError(f"aggregates must be a non-empty dict of name -> (function, column), got {aggregates!r}")
        self.specs = []
        for name, spec in aggregates.items():
            if not isinstance(name, str) or not name or name.startswith(_NON_NULL):
                raise ValueError(f"aggregate name {name!r} must be a non-empty str")
            if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] in FUNCTIONS and isinstance(spec[1], str)):
                raise ValueError(f"aggregate {name!r}: {spec!r} is not (function, column) with function one of "
                                 f"{', '.join(FUNCTIONS)}")
            if spec[1] == "*" and spec[0] != "count":
                raise ValueError(f"aggregate {name!r}: only count takes '*'")
            self.specs.append((name, spec[0], spec[1]))
        self.columns = sorted({c for _, _, c in self.specs if c != "*"})
        self.input_dtypes = None

    def bind(self, spark_schema):
        """Take the input columns' types from the input's Spark schema (ValueError naming a
        column that is missing or that its function cannot take)."""
        types = {f.name: f.dataType for f in spark_schema.fields}
        dtypes = {}
        for name, function, col in self.specs:
            if col == "*":
                continue
            if col not in types:
                raise ValueError(f"aggregate {name!r}: column '{col}' is not in the DataFrame (columns: {list(types)})")
            simple = types[col].simpleString()
            if function != "count" and simple not in ("bigint", "int", "smallint", "tinyint", "double", "float",
                                                      "timestamp", "timestamp_ntz", "date"):
                raise ValueError(f"aggregate {name!r}: {function} of column '{col}' ({simple}) is not supported "
                                 f"(numbers, and for min and max timestamps and dates)")
            if function == "sum" and simple in ("timestamp", "timestamp_ntz", "date"):
                raise ValueError(f"aggregate {name!r}: sum of column '{col}' ({simple}) is not a number")
            if function != "count":
                dtypes[col] = dtype_of_columns(spark_schema, [col], what="aggregated")[col]
        self.input_dtypes = dtypes
        self.spark_types = types
        return self

    def _acc_dtype(self, function, col):
        if function == "count":
            return np.dtype("<i8")
        dt = self.input_dtypes[col]
        if function == "sum":
            return np.dtype("<f8") if dt.kind == "f" else np.dtype("<i8")
        return dt

    @property
    def state_fields(self):
        """The value fields that carry the aggregates in the state."""
        fields = []
        for name, function, col in self.specs:
            fields.append((name, self._acc_dtype(function, col)))
            if function != "count":
                fields.append((_NON_NULL + name, np.dtype("<i8")))
        return fields

    def output_fields(self):
        """``[(name, Spark type)]`` of the output columns, as Spark types them."""
        from pyspark.sql.types import DoubleType, LongType

        out = []
        for name, function, col in self.specs:
            if function == "count":
                out.append((name, LongType()))
            elif function == "sum":
                out.append((name, DoubleType() if self.input_dtypes[col].kind == "f" else LongType()))
            else:
                out.append((name, self.spark_types[col]))
        return out

    def inputs(self, batch, rows=None):
        """``{column: (values, non_null)}`` of the aggregated columns of an Arrow batch (rows
        ``rows`` of it, if given); nulls filled with a neutral value."""
        out = {}
        for col in self.columns:
            arr = column(batch, col)
            if rows is not None:
                arr = arr.take(pa.array(rows))
            non_null = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            dt = self.input_dtypes.get(col)
            values = None if dt is None else column_to_numpy(arr, dt, col, null_value=0)
            out[col] = (values, non_null)
        return out

    def aggregate(self, inputs, order, starts, out):
        """Fill ``out`` (a structured array of the state fields, one row per group) with the
        aggregates of the groups ``order[starts[g]:starts[g+1]]`` of the input rows."""
        n = len(order)
        sizes = np.diff(np.append(starts, n))
        for name, function, col in self.specs:
            if col == "*":
                out[name] = sizes
                continue
            values, non_null = inputs[col]
            counts = np.add.reduceat(non_null[order].astype(np.int64), starts) if len(starts) else sizes
            if function == "count":
                out[name] = counts
                continue
            out[_NON_NULL + name] = counts
            acc = out.dtype[name]
            filled = np.where(non_null, values, _null_fill(values.dtype, function)).astype(acc, copy=False)[order]
            reduce = {"sum": np.add, "min": np.minimum, "max": np.maximum}[function]
            out[name] = reduce.reduceat(filled, starts) if len(starts) else filled[:0]

    def combine(self, states, starts):
        """Partial results ``states`` (structured, of the state fields) combined per group, the
        groups being the runs ``states[starts[g]:starts[g+1]]``: one row per group."""
        out = np.zeros(len(starts), dtype=states.dtype)
        if not len(starts):
            return out
        for name, function, _col in self.specs:
            if function in ("count", "sum"):
                out[name] = np.add.reduceat(states[name], starts)
                if function == "count":
                    continue
            else:
                filled = np.where(states[_NON_NULL + name] > 0, states[name],
                                  _null_fill(states.dtype[name], function)).astype(states.dtype[name], copy=False)
                reduce = np.minimum if function == "min" else np.maximum
                out[name] = reduce.reduceat(filled, starts)
            out[_NON_NULL + name] = np.add.reduceat(states[_NON_NULL + name], starts)
        return out

    def merge(self, old, found, new):
        """``new`` combined into ``old`` where ``found`` (in place in ``new``)."""
        for name, function, _col in self.specs:
            if function == "count":
                new[name] = np.where(found, old[name], 0) + new[name]
                continue
            n_old = np.where(found, old[_NON_NULL + name], 0)
            n_new = new[_NON_NULL + name]
            if function == "sum":
                new[name] = np.where(found, old[name], 0) + new[name]
            else:
                reduce = np.minimum if function == "min" else np.maximum
                both = reduce(old[name], new[name])
                new[name] = np.where(n_old == 0, new[name], np.where(n_new == 0, old[name], both))
            new[_NON_NULL + name] = n_old + n_new

    def output_columns(self, values):
        """``{name: Arrow array}`` of the aggregates of state rows ``values``; null where no
        non-null value was aggregated."""
        out = {}
        for name, function, _col in self.specs:
            col = values[name]
            if function == "count":
                out[name] = pa.array(col)
            else:
                out[name] = pa.array(col, mask=values[_NON_NULL + name] == 0)
        return out
