"""The state variables and timers of a :class:`~pyspark_glue.StatefulProcessor`, over the
stores of its partition; every call takes and returns arrays (keys, values), none loops per key.

- :class:`ValueState`: one row per key.
- :class:`ListState`: an ordered list of rows per key (a :class:`~statecore.keyed_lists.KeyedLists`).
- :class:`MapState`: rows per (key, user key), listable per key.
- :class:`Timers`: times per key, fired when the processor's clock passes them.

A variable with a ``ttl`` expires each row ``ttl`` after it was last written, on the
processor's clock (event time: the batch's eviction watermark; processing time: the batch's
timestamp): an expired row reads as absent at once and leaves the stores at the end of the
batch, through an :class:`~statecore.expiry.ExpiryIndex` (work proportional to what expires).
:class:`StateHandle` declares the variables (the stores and schemas) on the driver and binds
them to the stores in each task (``docs/processor.md``).
"""
import numpy as np

from statecore.expiry import ExpiryIndex
from statecore.grouping import group_rows
from statecore.ids import check_store_name
from statecore.keyed_lists import SEQ_FIELD, KeyedLists, positions
from statecore.schema import as_schema

from pyspark_glue.event_time import parse_duration_us

__all__ = ["StateHandle", "ValueState", "ListState", "MapState", "Timers", "EXPIRES", "LISTING_BOUND"]

EXPIRES = "__expires"
_TIMER = "__timer"
_TIMERS = "__timers"
# A key's timer listing is looked over when a register makes it grow past a power of two from
# LISTING_BOUND on, and rewritten to its live timers if at least half of it is stale: a key whose
# timer moves every batch lists fewer than LISTING_BOUND entries, and a look (a read of the
# listing) costs O(1) per register amortized (docs/processor.md, "Listing timers").
LISTING_BOUND = 8


def _fields(dtype, what):
    """``dtype`` as a store's packed dtype; TypeError naming ``what`` and the field if a store
    cannot hold it."""
    try:
        dtype = as_schema(np.dtype(dtype)).dtype
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: {e}") from None
    if EXPIRES in (dtype.names or ()) or _TIMER in (dtype.names or ()):
        raise ValueError(f"{what}: field names {EXPIRES!r} and {_TIMER!r} are statecore's")
    return dtype


def _join(*dtypes):
    names = [n for d in dtypes for n in d.names]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"fields {dupes} appear twice (the grouping key's and a variable's must differ)")
    return np.dtype([f for d in dtypes for f in d.descr])


def _copy_fields(dst, src, names):
    for name in names:
        dst[name] = src[name]


def _strip(values, dtype):
    """The ``dtype`` fields of ``values``, a copy (a variable's fields without the expiry; a
    key out of a full key)."""
    out = np.empty(len(values), dtype=dtype)
    _copy_fields(out, values, dtype.names)
    return out


def _distinct(keys):
    """The distinct rows of ``keys``, in order of their first occurrence."""
    order, starts = group_rows(keys)
    return keys[order[starts]]


class _Variable:
    """What every variable shares: its name, the grouping key, its TTL and its stores."""

    def __init__(self, handle, name, ttl):
        if not isinstance(name, str) or not name or "." in name or name.startswith("__"):
            raise ValueError(f"a state variable's name must be a non-empty str without '.' or a leading '__', "
                             f"got {name!r}")
        self.handle, self.name = handle, name
        self.key_dtype = handle.key_dtype
        self.ttl_us = None if ttl is None else parse_duration_us(ttl, f"the ttl of state variable {name!r}",
                                                                 positive=True, months=False)

    def _ttl_stores(self, key_dtype):
        if self.ttl_us is None:
            return {}
        schemas = ExpiryIndex.schemas(key_dtype)
        return {f"{self.name}.ttl_heads": schemas["heads"], f"{self.name}.ttl_entries": schemas["entries"]}

    def _ttl_index(self, key_dtype):
        return ExpiryIndex(self.handle.store(f"{self.name}.ttl_heads"), self.handle.store(f"{self.name}.ttl_entries"),
                           key_dtype)

    def _stamp(self, rows):
        """Set the expiry of rows being written (with a TTL)."""
        if self.ttl_us is not None:
            rows[EXPIRES] = self.handle.now_us + self.ttl_us

    def _declare_rows(self, schema):
        """The variable's row dtype, and the stored one (with the expiry when it has a TTL)."""
        self.dtype = _fields(schema, f"state variable {self.name!r}")
        self.stored = _join(self.dtype, np.dtype([(EXPIRES, "<i8")])) if self.ttl_us is not None else self.dtype

    def _expire_rows(self, key_dtype, now_us):
        """Remove the rows of the variable's store whose TTL ended (entries of rows written
        again since are stale and ignored); returns the keys removed (with repeats)."""
        if self.ttl_us is None:
            return np.empty(0, dtype=key_dtype)
        times, keys = self._ttl_index(key_dtype).pop_until(now_us)
        if not len(keys):
            return keys
        store = self.handle.store(self.name)
        values, found = store.get_batch(keys)
        gone = keys[found & (values[EXPIRES] == times)]
        store.remove_batch(gone)
        return gone

    def _live(self, values, found):
        """``found`` less the rows whose TTL has passed."""
        if self.ttl_us is None:
            return found
        return found & (values[EXPIRES] > self.handle.now_us)


class ValueState(_Variable):
    """One row of ``schema`` per key."""

    def __init__(self, handle, name, schema, ttl=None):
        super().__init__(handle, name, ttl)
        self._declare_rows(schema)

    def stores(self):
        return {self.name: (self.key_dtype, self.stored), **self._ttl_stores(self.key_dtype)}

    def get(self, keys):
        """``(values, found)`` for each key."""
        values, found = self.handle.store(self.name).get_batch(keys)
        return _strip(values, self.dtype), self._live(values, found)

    def exists(self, keys):
        return self.get(keys)[1]

    def put(self, keys, values):
        rows = np.empty(len(keys), dtype=self.stored)
        _copy_fields(rows, values, self.dtype.names)
        self._stamp(rows)
        self.handle.store(self.name).put_batch(keys, rows)
        if self.ttl_us is not None:
            self._ttl_index(self.key_dtype).add(rows[EXPIRES], keys)

    def clear(self, keys):
        self.handle.store(self.name).remove_batch(keys)

    def expire(self, now_us):
        self._expire_rows(self.key_dtype, now_us)


class ListState(_Variable):
    """An ordered list of ``schema`` rows per key."""

    def __init__(self, handle, name, schema, ttl=None):
        super().__init__(handle, name, ttl)
        self._declare_rows(schema)

    def stores(self):
        schemas = KeyedLists.schemas(self.key_dtype, self.stored)
        return {self.name: schemas["heads"], f"{self.name}.entries": schemas["entries"],
                **self._ttl_stores(self.key_dtype)}

    def _lists(self):
        return KeyedLists(self.handle.store(self.name), self.handle.store(f"{self.name}.entries"), self.key_dtype,
                          self.stored)

    def get(self, keys):
        """``(which, items)``: the items of each of the (distinct) ``keys``, ``items[j]`` in the
        list of ``keys[which[j]]``, in order."""
        which, items = self._lists().read(keys)
        live = self._live(items, np.ones(len(items), dtype=bool))
        return which[live], _strip(items[live], self.dtype)

    def append(self, keys, items):
        """Append ``items[i]`` to the list of ``keys[i]``."""
        rows = np.empty(len(items), dtype=self.stored)
        _copy_fields(rows, items, self.dtype.names)
        self._stamp(rows)
        self._lists().append(keys, rows)
        self._index_expiry(keys)

    def put(self, keys, which, items):
        """Make the list of each (distinct) ``keys[k]`` exactly ``items[which == k]``."""
        rows = np.empty(len(items), dtype=self.stored)
        _copy_fields(rows, items, self.dtype.names)
        self._stamp(rows)
        self._lists().replace(keys, which, rows)
        self._index_expiry(keys[np.asarray(which, dtype=np.int64)])

    def _index_expiry(self, keys):
        """File the written keys under the expiry their new items got (older items keep theirs)."""
        if self.ttl_us is not None and len(keys):
            distinct = _distinct(keys)
            self._ttl_index(self.key_dtype).add(np.full(len(distinct), self.handle.now_us + self.ttl_us), distinct)

    def clear(self, keys):
        self._lists().clear(keys)

    def expire(self, now_us):
        if self.ttl_us is None:
            return
        _, due = self._ttl_index(self.key_dtype).pop_until(now_us)
        if not len(due):
            return
        keys = _distinct(due)
        lists = self._lists()
        counts = lists.counts(keys)
        which, items = lists.read(keys, counts)
        live = items[EXPIRES] > now_us
        if not live.all():
            lists.replace(keys, which[live], items[live], counts)


class MapState(_Variable):
    """Rows of ``schema`` per (key, user key), listable per key.

    Each key's *listing* (a :class:`~statecore.keyed_lists.KeyedLists` of user keys) is kept
    exact: every listed user key has an entry in the store, listed once, in the order the user
    keys were first put since they were last absent. ``put`` appends the absent ones;
    ``remove``, ``clear`` and the TTL's expiry drop what they remove from the listings of the
    keys they touch, in the same call."""

    def __init__(self, handle, name, user_key_schema, schema, ttl=None):
        super().__init__(handle, name, ttl)
        self.user_key_dtype = _fields(user_key_schema, f"the user key of state variable {name!r}")
        self._declare_rows(schema)
        self.full_key = _join(self.key_dtype, self.user_key_dtype)

    def stores(self):
        listed = KeyedLists.schemas(self.key_dtype, self.user_key_dtype)
        return {self.name: (self.full_key, self.stored), f"{self.name}.keys": listed["heads"],
                f"{self.name}.key_entries": listed["entries"], **self._ttl_stores(self.full_key)}

    def _lists(self):
        return KeyedLists(self.handle.store(f"{self.name}.keys"), self.handle.store(f"{self.name}.key_entries"),
                          self.key_dtype, self.user_key_dtype)

    def _full(self, keys, user_keys):
        full = np.empty(len(keys), dtype=self.full_key)
        _copy_fields(full, keys, self.key_dtype.names)
        _copy_fields(full, user_keys, self.user_key_dtype.names)
        return full

    def get(self, keys, user_keys):
        """``(values, found)`` for each (key, user key) pair."""
        values, found = self.handle.store(self.name).get_batch(self._full(keys, user_keys))
        return _strip(values, self.dtype), self._live(values, found)

    def put(self, keys, user_keys, values):
        """Write ``values[i]`` as the entry of (``keys[i]``, ``user_keys[i]``); a user key that
        was absent goes to the end of its key's listing. A pair given several times in one call
        is one entry, listed once, holding the last of its values (as a store's ``put_batch``)."""
        full = self._full(keys, user_keys)
        store = self.handle.store(self.name)
        _, present = store.get_batch(full)
        rows = np.empty(len(full), dtype=self.stored)
        _copy_fields(rows, values, self.dtype.names)
        self._stamp(rows)
        store.put_batch(full, rows)
        new = ~present
        if new.any():  # list each new user key once, even when it comes several times in the call
            order, starts = group_rows(full[new])
            first = np.flatnonzero(new)[order[starts]]
            self._lists().append(keys[first], user_keys[first])
        if self.ttl_us is not None:
            self._ttl_index(self.full_key).add(rows[EXPIRES], full)

    def remove(self, keys, user_keys):
        """Remove the entry of each (key, user key) pair and drop it from its key's listing
        (absent pairs, and pairs given several times, are removed once). Costs the listings
        of the distinct ``keys``: each is read once and rewritten without the removed ones."""
        self.handle.store(self.name).remove_batch(self._full(keys, user_keys))
        self._listing(_distinct(keys))

    def _listing(self, keys):
        """``(which, user_keys, values)``: the listed entries of each of the (distinct) ``keys``,
        expired ones included. A listed user key without an entry (just removed or expired) or
        listed a second time (state written by a version that listed remove-then-put twice) is
        dropped, the first listing kept, and the listing rewritten when it had any."""
        lists = self._lists()
        counts = lists.counts(keys)
        which, user_keys = lists.read(keys, counts)
        full = self._full(keys[which], user_keys)
        values, found = self.handle.store(self.name).get_batch(full)
        order, starts = group_rows(full)
        keep = np.zeros(len(full), dtype=bool)
        keep[order[starts]] = True
        keep &= found
        if not keep.all():
            lists.replace(keys, which[keep], user_keys[keep], counts)
        return which[keep], user_keys[keep], values[keep]

    def items(self, keys):
        """``(which, user_keys, values)`` of every live entry of each of the ``keys``, each entry
        once, a key's entries in the order of its listing. ValueError if a key comes twice (the
        listing it repairs is rewritten per key)."""
        order, starts = group_rows(keys)
        if len(starts) != len(keys):
            twice = np.setdiff1d(np.arange(len(keys)), order[starts])[0]
            raise ValueError(f"state variable {self.name!r}: items() takes distinct keys, but key "
                             f"{keys[twice].tolist()!r} (at {twice}) comes twice")
        which, user_keys, values = self._listing(keys)
        live = self._live(values, np.ones(len(values), dtype=bool))
        return which[live], user_keys[live], _strip(values[live], self.dtype)

    def clear(self, keys):
        """Remove every entry of each of the (distinct) ``keys``, and its listing."""
        lists = self._lists()
        counts = lists.counts(keys)
        which, user_keys = lists.read(keys, counts)
        self.handle.store(self.name).remove_batch(self._full(keys[which], user_keys))
        lists.clear(keys, counts)

    def expire(self, now_us):
        """Remove the entries whose TTL ended, and drop them from their keys' listings."""
        gone = self._expire_rows(self.full_key, now_us)
        if len(gone):
            self._listing(_distinct(_strip(gone, self.key_dtype)))


class Timers:
    """Timers per key: ``register``, ``delete``, ``list``; due timers are handed to the
    processor's ``handle_expired_timers`` once the processor's clock reaches them (at or past).

    Three structures: ``__timers`` (which timers exist), an :class:`ExpiryIndex` (timers by
    time, to pop the due ones) and a per-key listing (a :class:`KeyedLists`, for ``list``).
    The listing is kept from the first ``list`` of a partition on (until then no ``register``
    pays for it): that call fills it from a full read of ``__timers`` and marks it kept. It is
    lazy: ``register`` appends the timers that were absent, ``delete`` and firing leave it
    alone, and ``list`` (and a ``register`` that grows it past :data:`LISTING_BOUND` entries,
    or a power of two after that) keeps only what ``__timers`` still holds
    (``docs/processor.md``, "Listing timers")."""

    def __init__(self, handle):
        self.handle = handle
        self.key_dtype = handle.key_dtype
        self.full_key = _join(self.key_dtype, np.dtype([(_TIMER, "<i8")]))
        self.listed = np.dtype([(_TIMER, "<i8")])
        self._kept = None  # whether the partition keeps the listing: read once, at first need

    @property
    def processing_time_us(self):
        """The batch's processing time (Spark's ``getCurrentProcessingTimeInMs``, here in
        microseconds): the operator's clock when the batch began."""
        return self.handle.processing_time_us

    @property
    def watermark_us(self):
        """The batch's eviction watermark in microseconds (Spark's ``getCurrentWatermarkInMs``);
        None without event time."""
        return self.handle.watermark_us

    def stores(self):
        index = ExpiryIndex.schemas(self.key_dtype)
        listing = KeyedLists.schemas(self.key_dtype, self.listed)
        return {_TIMERS: (self.full_key, np.dtype([])), f"{_TIMERS}.heads": index["heads"],
                f"{_TIMERS}.entries": index["entries"], f"{_TIMERS}.keys": listing["heads"],
                f"{_TIMERS}.key_entries": listing["entries"]}

    def _full(self, keys, times):
        full = np.empty(len(keys), dtype=self.full_key)
        _copy_fields(full, keys, self.key_dtype.names)
        full[_TIMER] = times
        return full

    @staticmethod
    def _micros(times):
        times = np.asarray(times)
        if times.dtype.kind == "M":
            times = times.astype("datetime64[us]").astype(np.int64)
        if times.dtype.kind not in "iu":
            raise TypeError(f"timer times must be int64 microseconds or datetime64, got {times.dtype}")
        return times.astype(np.int64)

    def register(self, keys, times):
        """A timer at ``times[i]`` (microseconds, or datetime64) for ``keys[i]``; registering an
        existing timer again is a no-op."""
        times = self._micros(times)
        if len(times) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(times)} times")
        full = self._full(keys, times)
        store = self.handle.store(_TIMERS)
        _, present = store.get_batch(full)
        if present.all():
            return
        keys, times, full = keys[~present], times[~present], full[~present]
        if self._listing_kept():  # before __timers holds them: a compaction keeps only the timers already there
            self._list_new(keys, times)
        store.put_batch(full, None)
        self._index().add(times, keys)

    def _list_new(self, keys, times):
        """Append new timers to their keys' listings; a listing that grows past a power of two
        (from :data:`LISTING_BOUND` on) is compacted first when at least half of it is stale."""
        listing = self._listing()
        order, starts = group_rows(keys)
        distinct = keys[order[starts]]
        added = np.diff(np.append(starts, len(keys))).astype(np.int64)
        counts = listing.counts(distinct)
        grown = counts + added
        crossing = (grown >= LISTING_BOUND) & (counts < (1 << (np.frexp(grown)[1] - 1).astype(np.int64)))
        if crossing.any():
            counts[crossing] = self._relist(listing, distinct[crossing], counts[crossing], compacting=True)[2]
        listed = np.empty(len(keys), dtype=self.listed)
        listed[_TIMER] = times[order]
        listing.put_at(keys[order], np.repeat(counts, added) + positions(added), listed)
        listing.set_counts(distinct, counts + added)

    def delete(self, keys, times):
        """Delete the timers at ``times[i]`` of ``keys[i]`` (absent ones are ignored)."""
        self.handle.store(_TIMERS).remove_batch(self._full(keys, self._micros(times)))

    def exists(self, keys, times):
        return self.handle.store(_TIMERS).get_batch(self._full(keys, self._micros(times)))[1]

    def list(self, keys):
        """``(which, times)``: every registered timer of each of the (distinct) ``keys``,
        ``times[j]`` a timer of ``keys[which[j]]``; a key's times ascending (Spark's
        ``listTimers``). The listing of a key that held deleted or fired timers is rewritten;
        the partition's first call fills the listing of every key (a full read of the timers)."""
        if not self._listing_kept():
            self._keep_listing()
        listing = self._listing()
        return self._relist(listing, keys, listing.counts(keys))[:2]

    def _relist(self, listing, keys, counts, compacting=False):
        """``(which, times, new counts)``: the live timers of the (distinct) ``keys`` whose
        listings are ``counts`` long, by key then time. A listing that held more (timers
        deleted or fired since, or listed twice) is rewritten to exactly those; when
        ``compacting``, only one at least half of which was stale."""
        which, listed = listing.read(keys, counts)
        times = listed[_TIMER]
        _, live = self.handle.store(_TIMERS).get_batch(self._full(keys[which], times))
        order = np.lexsort((times, which))
        which, times, live = which[order], times[order], live[order]
        repeat = np.zeros(len(which), dtype=bool)
        repeat[1:] = (which[1:] == which[:-1]) & (times[1:] == times[:-1])
        keep = live & ~repeat
        which, times = which[keep], times[keep]
        kept = np.bincount(which, minlength=len(keys)).astype(np.int64)
        changed = 2 * kept <= counts if compacting else kept != counts
        if changed.any():
            rewritten = changed[which]
            position = np.cumsum(changed) - 1  # a changed key's index among the changed ones
            items = np.empty(int(rewritten.sum()), dtype=self.listed)
            items[_TIMER] = times[rewritten]
            listing.replace(keys[changed], position[which[rewritten]], items, counts[changed])
        return which, times, np.where(changed, kept, counts)

    def _marker(self):
        """The row of the listing's entries store that says the listing is kept: the zero key
        at position -1, which no list ever has."""
        marker = np.zeros(1, dtype=KeyedLists.schemas(self.key_dtype, self.listed)["entries"][0])
        marker[SEQ_FIELD] = -1
        return marker

    def _listing_kept(self):
        if self._kept is None:
            self._kept = bool(self.handle.store(f"{_TIMERS}.key_entries").get_batch(self._marker())[1][0])
        return self._kept

    def _keep_listing(self):
        """List every timer of ``__timers`` (a full read), and mark the listing kept: once per
        partition, at its first ``list`` (a checkpoint written before the listing existed
        comes here too, its listing's stores new and empty)."""
        listing = self._listing()
        for full, _ in self.handle.store(_TIMERS).iter_batches():
            keys = _strip(full, self.key_dtype)
            listed = np.empty(len(full), dtype=self.listed)
            listed[_TIMER] = full[_TIMER]
            listing.append(keys, listed)
        self.handle.store(f"{_TIMERS}.key_entries").put_batch(self._marker(), np.zeros(1, dtype=self.listed))
        self._kept = True

    def _listing(self):
        return KeyedLists(self.handle.store(f"{_TIMERS}.keys"), self.handle.store(f"{_TIMERS}.key_entries"),
                          self.key_dtype, self.listed)

    def _index(self):
        return ExpiryIndex(self.handle.store(f"{_TIMERS}.heads"), self.handle.store(f"{_TIMERS}.entries"),
                           self.key_dtype)

    def pop_due(self, now_us):
        """``(keys, times)`` of the registered timers at or before ``now_us``, each once, taken
        off the index. They stay registered (``exists`` says so) until the caller deletes them:
        the processor does after its handler, as Spark deletes a fired timer after its handler.
        Their listing entries stay until the key is listed or its listing compacted."""
        times, keys = self._index().pop_until(now_us)
        if not len(keys):
            return keys, times
        full = self._full(keys, times)
        _, live = self.handle.store(_TIMERS).get_batch(full)
        keys, times, full = keys[live], times[live], full[live]
        order, starts = group_rows(full)  # a timer registered, deleted and registered again is filed twice
        first = order[starts]
        return keys[first], times[first]


class StateHandle:
    """Declares a processor's variables (``value``, ``list``, ``map``) and binds them to the
    stores of the task's partition. On the driver it only records their stores and schemas."""

    def __init__(self, key_dtype, stores=None, now_us=None, *, processing_time_us=None, watermark_us=None):
        self.key_dtype = np.dtype(key_dtype)
        self._stores = stores
        self.now_us = now_us  # the processor's clock: what timers fire and TTLs end against
        self.processing_time_us, self.watermark_us = processing_time_us, watermark_us
        self.variables = {}
        self.timers = Timers(self)

    def store(self, name):
        if self._stores is None:
            raise RuntimeError("state variables are read and written in the handlers, not in init()")
        return self._stores[name]

    def _add(self, variable):
        """Declare ``variable``, on the driver: ValueError if its name cannot name a store
        directory (rather than in every task that opens its store)."""
        if variable.name in self.variables:
            raise ValueError(f"state variable {variable.name!r} is declared twice")
        check_store_name(variable.name, "state variable name")
        self.variables[variable.name] = variable
        return variable

    def value(self, name, schema, ttl=None):
        """A :class:`ValueState` named ``name``: one ``schema`` row per key."""
        return self._add(ValueState(self, name, schema, ttl))

    def list(self, name, schema, ttl=None):
        """A :class:`ListState`: an ordered list of ``schema`` rows per key."""
        return self._add(ListState(self, name, schema, ttl))

    def map(self, name, user_key_schema, schema, ttl=None):
        """A :class:`MapState`: ``schema`` rows per (key, user key)."""
        return self._add(MapState(self, name, user_key_schema, schema, ttl))

    def stores(self):
        """Every store the declared variables and the timers use: ``{name: (key, value)}``."""
        out = dict(self.timers.stores())
        for variable in self.variables.values():
            out.update(variable.stores())
        return out

    def expire(self):
        """Remove what every variable's TTL has ended (at the end of a batch)."""
        for variable in self.variables.values():
            variable.expire(self.now_us)
