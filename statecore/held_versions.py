"""The versions a provider holds in memory: its lock, the newest State, the pins of open
stores, freezing a State to go on in a successor, replacing a State's base, and when the head
is due to be spilled. One object per provider; the provider, its commits, its stores and
maintenance use it through this public surface (``docs/provider-rules.md``, "The read model").
"""
import threading

import numpy as np

from statecore._lock import ProviderLock, requires_lock
from statecore._versions import filter_bytes, frozen_below, replace_in_chain
from statecore.lineage import Listing

__all__ = ["HeldVersions", "SPILL_RATIO", "SPILL_MIN_ROWS", "SPILL_HARD_RATIO", "HEAD_SNAPSHOT_RATIO",
           "HEAD_SNAPSHOT_MIN_ROWS"]

# The head (the changes since the base, in hash tables) is spilled to a mapped image once it
# outgrows this share of the state: what the heap holds stays a fraction of the raw rows,
# whatever the maintenance period (statecore.spill).
SPILL_RATIO = 0.125
SPILL_MIN_ROWS = 1 << 10
# Past this share, and due since an earlier commit, maintenance fell behind (starved of CPU,
# or busy with a snapshot): the commit spills the head itself before it returns, so the
# bound holds whatever the timing.
SPILL_HARD_RATIO = 0.25
# Besides Spark's rule (more than min_deltas_for_snapshot deltas), a snapshot is due once the
# changes since the last one (spilled and in the head) outgrow this share of the state: each
# spill rewrites them, so they must not grow towards the state's size.
HEAD_SNAPSHOT_RATIO = 0.5
HEAD_SNAPSHOT_MIN_ROWS = 1 << 16


class HeldVersions:
    """What one provider holds in memory. ``lock`` (re-entrant) guards ``newest``, every
    State's contents and pins, and ``snapshot_source``; ``published`` (a condition on it) is
    notified when no merge is pending; ``spilling`` lets one spill run at a time.
    ``keep_in_memory``: how many versions ``retain`` keeps (the conf's
    ``max_versions_to_retain_in_memory``). ``files_known``: the version files as the provider
    knew them while ``newest`` is the State they were noted with (:meth:`know_files`)."""

    def __init__(self):
        self.lock = ProviderLock()
        self.published = threading.Condition(self.lock)
        self.spilling = threading.Lock()
        self.newest = None  # the newest State, or None: none held
        self.snapshot_source = None  # the Spill a snapshot is being written from
        # What lookups walk changed (_versions.pyx): one counter shared by every State held.
        self.changes = np.zeros(1, dtype=np.uint64)
        self.keep_in_memory = 1
        self._known = None  # (State, Listing)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, state, version):
        """An open store reads ``version`` of ``state`` (kept by ``retain`` until unpinned)."""
        with self.lock:
            state.pin(version)

    def unpin(self, state, version):
        with self.lock:
            state.unpin(version)

    # -- the newest State ------------------------------------------------------------------
    @requires_lock
    def retain(self, state):
        """Keep the newest ``keep_in_memory`` versions of ``state`` (and pinned ones:
        State.retain keeps them). REQUIRES: self.lock held."""
        state.retain(state.version - max(self.keep_in_memory - 1, 0))

    @requires_lock
    def unread(self, state):
        """Whether nothing reads ``state`` but through this lock: no open store pins a version
        of it, nothing iterates it, maintenance has not frozen it and no commit is pending on
        it. Then it may be changed in place. REQUIRES: self.lock held."""
        return not state.frozen and not state.iterating and state.pending is None and not state.pins

    @requires_lock
    def state_to_merge_into(self, source, version, commit_id):
        """The State a commit on ``version`` (attempt ``commit_id``) of ``source`` merges into.
        REQUIRES: self.lock held.

        The newest State when it holds that version and attempt as its newest (the same
        contents: ``source`` itself, or the State maintenance built over ``source`` when it
        froze it for a spill while the store was open) and nobody iterates it; otherwise
        ``source`` is frozen (iterations read it without the lock; a re-execution from an
        older version leaves it to its readers) and a new one is built over it."""
        previous = self.newest
        if (previous is not None and previous.version == version and not previous.frozen
                and not previous.iterating and previous.commit_ids.get(version) == commit_id):
            return previous
        # Same lineage, frozen only for its iterators: older versions stay readable.
        return source.freeze_into_successor(version, keep_versions=source is previous and previous.version == version)

    @requires_lock
    def freeze_newest(self):
        """Freeze the newest State (a spill writes it out without the lock) and go on in a
        successor holding the same versions; the frozen one. REQUIRES: self.lock held."""
        state = self.newest
        self.newest = state.freeze_into_successor(state.version, keep_versions=True)
        if self._known is not None and self._known[0] is state:  # the same versions, the same files
            self._known = (self.newest, self._known[1])
        return state

    @requires_lock
    def know_files(self, state, listing):
        """``listing`` is the version files as known while ``state`` is ``newest`` (listed
        when it was loaded or rolled forward to, then that listing with the provider's own
        commits since). Only the files above ``state``'s version are kept: a store opened
        from memory opens that version or a later one, and its commit looks only above
        (what it would supersede), so what is kept stays as small as the files above the
        newest version, however long the query runs. REQUIRES: self.lock held."""
        self._known = (state, Listing([f for f in listing if f.version > state.version]))

    @property
    def files_known(self):
        """The Listing noted for ``newest``, or None (another State is newest, or none)."""
        known = self._known
        return known[1] if known is not None and known[0] is self.newest else None

    @requires_lock
    def newest_published(self, wanted, timeout):
        """The newest State if ``wanted(state)``, once no merge into it is pending (a commit in
        flight is waited for, up to ``timeout`` seconds, only if the state is wanted already),
        or None. REQUIRES: self.lock held (released while waiting)."""
        def ready():
            state = self.newest
            return state is not None and not state.frozen and wanted(state)

        if not ready():
            return None
        if self.newest.pending is not None:
            self.published.wait_for(lambda: self.newest is None or self.newest.pending is None, timeout=timeout)
            if not ready() or self.newest.pending is not None:
                return None
        return self.newest

    def replace_base(self, is_old, new):
        """Make ``new`` the base of the State (newest first, down the chain of frozen ones) whose
        base ``is_old``, or the lower of the level of its spills that stands on it: the same
        version, now mapped. Whether one was found."""
        with self.lock:
            return self.newest is not None and replace_in_chain(self.newest, is_old, new)

    # -- sizes -----------------------------------------------------------------------------
    @requires_lock
    def spill_due(self, state, ratio=None):
        """Whether the head holds more changed keys than ``ratio`` (SPILL_RATIO by default) of
        the state, and at least SPILL_MIN_ROWS: then it is spilled. REQUIRES: self.lock held."""
        head_rows = len(state.head)
        ratio = SPILL_RATIO if ratio is None else ratio
        return head_rows > SPILL_MIN_ROWS and head_rows > ratio * state.count(state.version)

    @staticmethod
    def changes_outgrown(changed, num_keys):
        """Whether ``changed`` keys since the last snapshot (spilled, or in a head) outgrew
        their share of a version of ``num_keys`` keys (and HEAD_SNAPSHOT_MIN_ROWS): then a
        snapshot is due (a spill would otherwise grow towards the state's size)."""
        return changed > HEAD_SNAPSHOT_MIN_ROWS and changed > HEAD_SNAPSHOT_RATIO * num_keys

    def memory_bytes(self):
        """Heap bytes of the layers held (each once: a State built over a frozen one shares its
        undo layers) and of the bases' key filters (their images are mapped, not heap)."""
        with self.lock:
            state = self.newest
            layers = {}
            filters = 0
            while state is not None:
                for layer in (state.head, *state.undo.values()):
                    layers[id(layer)] = layer
                filters += filter_bytes(state.base)
                state = frozen_below(state)
            return filters + sum(layer.sizeof() for layer in layers.values())

    def describe(self):
        """The newest State's ``State.describe()`` (None: none held), the count of changes to
        what lookups walk, and the heap bytes."""
        with self.lock:
            newest = self.newest
            return {
                "latest": newest.describe() if newest is not None else None,
                "changes": int(self.changes[0]),
                "memory_bytes": self.memory_bytes(),
            }
