"""Fault injection for tests: StoreFiles that fail a chosen step of a file operation.

:class:`FaultInjectingFiles` overrides the two hooks :class:`statecore.files.StoreFiles`
calls around every file operation (``_step`` before each step, ``_writer`` for the file
a ``write_atomic`` callback writes to). Tests hand it to a store by replacing
:func:`statecore.files.open_store_files`; the engine never uses it.
"""
import collections
import fnmatch
import threading

from statecore.files import StoreFiles

__all__ = ["FaultInjectingFiles"]


class FaultInjectingFiles(StoreFiles):
    """StoreFiles that fail a chosen step of the operations on chosen files (for tests).

    Steps: ``"write"`` (inside the ``write_atomic`` callback), ``"flush"``, ``"fsync"``,
    ``"rename"`` (of ``write_atomic``), ``"delete"`` and ``"read"`` (``read_bytes``,
    ``read_range``, ``open_read``, ``local_path_for_mapping``). An armed step raises
    ``OSError("injected fault at <step> of <name>")``. ``calls`` counts how many times each
    step ran (``"write"``: once per ``write_atomic``); ``raised`` how many faults fired.

    Thread-safe: arming and counting take a lock.
    """

    STEPS = ("write", "flush", "fsync", "rename", "delete", "read")

    def __init__(self, location, storage_options=None, local_cache_dir=None):
        super().__init__(location, storage_options, local_cache_dir)
        self._lock = threading.Lock()
        self._faults = []  # [step, pattern, remaining or None, after_bytes]
        self._pending = threading.local()  # this thread's armed, not yet fired write fault
        self.calls = collections.Counter()
        self.raised = collections.Counter()

    def arm(self, step, pattern="*", times=1, after_bytes=0):
        """Make ``step`` fail for file names matching ``pattern``.

        Parameters
        ----------
        step : str
            One of :attr:`STEPS`.
        pattern : str, default "*"
            A glob (``fnmatch``) over the file name relative to the directory.
        times : int or None, default 1
            How many faults to raise before disarming; None: every time.
        after_bytes : int, default 0
            ``"write"`` only: the callback's writes go through until this many bytes are
            in the temporary file, then the write that crosses it stores the bytes up to
            it and raises (a torn write). If the callback writes less, the fault fires
            when it returns.
        """
        if step not in self.STEPS:
            raise ValueError(f"unknown step {step!r}; steps are {self.STEPS}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times}")
        with self._lock:
            self._faults.append([step, pattern, times, after_bytes])

    def disarm(self, step=None):
        """Remove the faults armed for ``step`` (all steps if None)."""
        with self._lock:
            self._faults = [f for f in self._faults if step is not None and f[0] != step]

    def _take(self, step, name):
        """Consume and return the first fault armed for (step, name), or None. REQUIRES: lock."""
        for fault in self._faults:
            if fault[0] == step and fnmatch.fnmatchcase(name, fault[1]):
                if fault[2] is not None:
                    fault[2] -= 1
                    if fault[2] == 0:
                        self._faults.remove(fault)
                return fault
        return None

    def _fire(self, step, name):
        with self._lock:
            self.raised[step] += 1
        raise OSError(f"injected fault at {step} of {name}")

    def _step(self, step, name):
        pending = getattr(self._pending, "writer", None)
        if step == "flush" and pending is not None and pending.name == name:
            # The callback returned without crossing after_bytes: the write fault fires now.
            self._pending.writer = None
            if not pending.fired:
                pending.fired = True
                self._fire("write", name)
        with self._lock:
            self.calls[step] += 1
            fault = self._take(step, name)
        if fault is not None:
            self._fire(step, name)

    def _writer(self, f, name):
        with self._lock:
            self.calls["write"] += 1
            fault = self._take("write", name)
        self._pending.writer = None
        if fault is None:
            return f
        writer = _FaultyWriter(f, self, name, fault[3])
        self._pending.writer = writer
        return writer


class _FaultyWriter:
    """A writable file that raises once ``after_bytes`` bytes went through (a torn write)."""

    def __init__(self, f, files, name, after_bytes):
        self._f = f
        self._files = files
        self.name = name
        self._left = after_bytes
        self.fired = False

    def write(self, data):
        view = memoryview(data).cast("B")
        if not self.fired and len(view) > self._left:
            if self._left:
                self._f.write(view[:self._left])
            self.fired = True
            self._files._fire("write", self.name)
        self._left -= len(view)
        return self._f.write(view)

    def __getattr__(self, attr):
        return getattr(self._f, attr)
