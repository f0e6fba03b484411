"""Lists of rows per key over two stores: the prefix scan of statecore (Spark's ``prefixScan``).

A hash store finds a key, not the keys that share a prefix. :class:`KeyedLists` keeps, for
each *owner* key, a dense list of *items*: a ``heads`` store maps the owner to its length
and an ``entries`` store maps ``(owner fields..., seq)`` to the item, ``seq`` running from 0.
Reading an owner's list is then one lookup for its length and one batch lookup of its
entries: work proportional to what is read, whatever the size of the state. Every call takes
and returns arrays (owners with repeats, items in order); nothing loops per row in Python.
The stores are the caller's: it opens them in the same batch and commits them together
(``docs/event-time.md``).
"""
import numpy as np

from statecore.schema import RowSchema

__all__ = ["KeyedLists", "SEQ_FIELD", "COUNT_FIELD", "positions"]

SEQ_FIELD = "__seq"
COUNT_FIELD = "count"
_INT64 = np.dtype("<i8")


def positions(counts):
    """For lists of these lengths, each entry's position in its list (0, 1, ... per list)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


class KeyedLists:
    """Dense lists of ``item_dtype`` rows per ``owner_dtype`` key, on a ``heads`` store and an
    ``entries`` store whose schemas :meth:`schemas` gives."""

    def __init__(self, heads, entries, owner_dtype, item_dtype):
        self.heads, self.entries = heads, entries
        self.owner_dtype = np.dtype(owner_dtype)
        self.item_dtype = np.dtype(item_dtype)
        self._entry_key = self.schemas(self.owner_dtype, self.item_dtype)["entries"][0]
        self._head_value = np.dtype([(COUNT_FIELD, _INT64)])
        self._owner_schema = RowSchema(self.owner_dtype, key=True)

    @staticmethod
    def schemas(owner_dtype, item_dtype):
        """``{"heads": (key, value), "entries": (key, value)}``: the dtypes of the two stores."""
        owner_dtype = np.dtype(owner_dtype)
        if SEQ_FIELD in owner_dtype.names:
            raise ValueError(f"an owner key may not have a field named {SEQ_FIELD!r}")
        entry_key = np.dtype(owner_dtype.descr + [(SEQ_FIELD, _INT64)])
        return {"heads": (owner_dtype, np.dtype([(COUNT_FIELD, _INT64)])),
                "entries": (entry_key, np.dtype(item_dtype))}

    def counts(self, owners):
        """The length of each owner's list (0 for an owner with none)."""
        values, found = self.heads.get_batch(owners)
        return np.where(found, values[COUNT_FIELD], 0).astype(np.int64)

    def _entry_keys(self, owners, seqs):
        keys = np.empty(len(seqs), dtype=self._entry_key)
        for name in self.owner_dtype.names:
            keys[name] = owners[name]
        keys[SEQ_FIELD] = seqs
        return keys

    def append(self, owners, items):
        """Append ``items[i]`` to the list of ``owners[i]``; items of one owner keep their order.
        Returns the distinct owners whose lists were empty before (they became non-empty)."""
        if len(owners) != len(items):
            raise ValueError(f"{len(owners)} owners but {len(items)} items")
        if not len(owners):
            return owners[:0]
        distinct, inverse, added = self._group(owners)
        before = self.counts(distinct)
        order = np.argsort(inverse, kind="stable")
        group_of_sorted = inverse[order]
        seqs = np.empty(len(owners), dtype=np.int64)
        seqs[order] = before[group_of_sorted] + positions(added)
        self.entries.put_batch(self._entry_keys(owners, seqs), items)
        self.set_counts(distinct, before + added)
        return distinct[before == 0]

    def _group(self, owners):
        """The distinct owners (as the store tells keys apart: float fields normalized), the
        group of each owner, and each group's size."""
        rows = self._owner_schema.rows(owners)
        packed = np.ascontiguousarray(rows).view(f"V{rows.shape[1]}").ravel()
        _, first, inverse, added = np.unique(packed, return_index=True, return_inverse=True, return_counts=True)
        return owners[first], inverse.ravel(), added

    def entries_at(self, owners, seqs):
        """The item at position ``seqs[i]`` of the list of ``owners[i]`` (each must exist)."""
        items, found = self.entries.get_batch(self._entry_keys(owners, np.asarray(seqs, dtype=np.int64)))
        if not found.all():
            self._missing(owners, seqs, found)
        return items

    def _missing(self, owners, seqs, found):
        missing = int(np.flatnonzero(~found)[0])
        raise RuntimeError(f"list of owner {owners[missing]!r} is missing entry {int(seqs[missing])}: the heads "
                           f"and entries stores disagree (were they committed from different batches?)")

    def put_at(self, owners, seqs, items):
        """Write ``items[i]`` at position ``seqs[i]`` of the list of ``owners[i]`` (overwriting
        what is there); with :meth:`set_counts`, for a caller that keeps its lists dense itself."""
        if len(owners):
            self.entries.put_batch(self._entry_keys(owners, np.asarray(seqs, dtype=np.int64)), items)

    def set_counts(self, owners, counts):
        """Make each (distinct) owner's list length ``counts[i]`` (0 removes the owner); entries
        are not touched."""
        counts = np.asarray(counts, dtype=np.int64)
        keep = counts > 0
        if keep.any():
            values = np.empty(int(keep.sum()), dtype=self._head_value)
            values[COUNT_FIELD] = counts[keep]
            self.heads.put_batch(owners[keep], values)
        if not keep.all():
            self.heads.remove_batch(owners[~keep])

    def read(self, owners, counts=None):
        """Every item of each of the (distinct) ``owners``: ``(which, items)``, where
        ``items[j]`` is in the list of ``owners[which[j]]``, lists in order."""
        if counts is None:
            counts = self.counts(owners)
        which = np.repeat(np.arange(len(owners), dtype=np.int64), counts)
        seqs = positions(counts)
        items, found = self.entries.get_batch(self._entry_keys(owners[which], seqs))
        if not found.all():
            self._missing(owners[which], seqs, found)
        return which, items

    def clear(self, owners, counts=None):
        """Empty the lists of the (distinct) ``owners``."""
        if counts is None:
            counts = self.counts(owners)
        which = np.repeat(np.arange(len(owners), dtype=np.int64), counts)
        if len(which):
            self.entries.remove_batch(self._entry_keys(owners[which], positions(counts)))
        present = counts > 0
        if present.any():
            self.heads.remove_batch(owners[present])

    def replace(self, owners, which, items, counts=None):
        """Make the list of each (distinct) ``owners[k]`` exactly ``items[which == k]``, in
        order (an empty list removes the owner). Entries past a list's new length are removed."""
        if counts is None:
            counts = self.counts(owners)
        which = np.asarray(which, dtype=np.int64)
        new_counts = np.bincount(which, minlength=len(owners)).astype(np.int64)
        order = np.argsort(which, kind="stable")
        if len(order):
            self.entries.put_batch(self._entry_keys(owners[which[order]], positions(new_counts)), items[order])
        surplus = np.maximum(counts - new_counts, 0)
        if surplus.any():
            gone = np.repeat(np.arange(len(owners), dtype=np.int64), surplus)
            seqs = np.repeat(new_counts, surplus) + positions(surplus)
            self.entries.remove_batch(self._entry_keys(owners[gone], seqs))
        changed = new_counts != counts
        if changed.any():
            self.set_counts(owners[changed], new_counts[changed])
