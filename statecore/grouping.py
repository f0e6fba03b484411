"""Grouping a batch's rows by key: what every ready-made ``fn`` aggregates a batch by before
it meets the store. The work is one compiled pass by hash (``statecore._grouping``); this
module turns a structured array into the key rows it groups.
"""
import numpy as np

from statecore._grouping import group_key_rows
from statecore.schema import as_schema

__all__ = ["group_rows"]


def group_rows(keys):
    """``(order, starts)`` grouping the equal rows of a structured array: group ``g`` is
    ``order[starts[g]:starts[g+1]]`` (the last one ends at ``len(keys)``), groups in order of
    their first row and each group's rows in input order, so ``order[starts]`` is each
    group's first row, ascending. Keys are equal when the store's key rows are: float fields
    normalized (``-0.0`` is ``0.0``, every NaN one key), the rest compared by bytes. One
    compiled pass by hash (``statecore._grouping``), no sort, no Python loop."""
    n = keys.shape[0]
    if keys.dtype.names is not None and len(keys.dtype.names) == 1 and keys.dtype[0].kind in "iub":
        packed = np.ascontiguousarray(keys[keys.dtype.names[0]])
    elif keys.dtype.names is not None and any(keys.dtype[f].kind == "f" for f in keys.dtype.names):
        return group_key_rows(as_schema(keys.dtype, key=True).rows(keys))
    else:
        packed = np.ascontiguousarray(keys)
    return group_key_rows(packed.view(np.uint8).reshape(n, packed.dtype.itemsize))
