"""A writer process for the crash tests (tests/engine/test_store_crash.py), killed at random instants.

    python tests/crash_worker.py ROOT SEED START SIDE_FILE MODE [--die STEP:PATTERN:NTH[:BYTES]]

It opens the store at ``ROOT`` (operator 0, partition 0) and, from version ``START`` on,
forever: ``get_store(v)``, the batch :func:`batch` gives for ``(SEED, v + 1)``, ``commit()``,
then appends the committed version to ``SIDE_FILE`` (one line, written and fsync'ed after the
commit returned). ``MODE`` is ``plain`` (the loop calls ``do_maintenance`` itself every
``MAINTENANCE_EVERY`` versions) or ``registry`` (stores come from ``statecore.registry``,
whose maintenance thread runs every few milliseconds). It prints ``ready`` once the provider
is open, so that the parent can time its kill from there.

``--die STEP:PATTERN:NTH[:BYTES]`` makes the process SIGKILL itself at the NTH (1-based) time
the step STEP runs on a file matching PATTERN. The steps follow a commit's order: ``write``
(the delta is encoded on the commit's writer thread; after BYTES bytes of the file went
through, or when the callback returns if it writes fewer), ``flush``, ``fsync`` (the
temporary file is whole, not yet durable), ``merged`` (after the commit's merge into memory
returned, on the committing thread; PATTERN is ignored: the writer thread may still be
writing), ``rename`` (the delta is durable and merged, not yet renamed), ``published``
(renamed into place and the directory fsynced: before the commit deletes what it supersedes
and returns), ``delete`` (before a delete: a re-execution's supersede or cleanup), and
``recorded`` (after a commit returned, before the side file is written). Snapshots go
through ``write``, ``flush``, ``fsync``, ``rename`` and ``published`` too. That pins the crash
points a random kill only reaches by luck.

The batches are a pure function of ``(seed, version)``: the parent replays them into a dict
to know what every version must hold.
"""
import fnmatch
import os
import signal
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
KEY_SPACE = 4000
MIN_DELTAS_FOR_SNAPSHOT = 2
MIN_VERSIONS_TO_RETAIN = 3
MAINTENANCE_EVERY = 3
MAINTENANCE_INTERVAL_S = 0.003


def conf_kwargs():
    return dict(min_deltas_for_snapshot=MIN_DELTAS_FOR_SNAPSHOT,
                min_versions_to_retain=MIN_VERSIONS_TO_RETAIN)


def batch(seed, version):
    """The updates that turn version ``version - 1`` into ``version``, applied in this order:
    ``put_batch(put_keys, put_values)``, ``remove_batch(remove_keys)``, then each scalar put,
    then each scalar remove. Keys repeat within and across the parts, so the order matters."""
    rng = np.random.default_rng([seed, version])
    n_puts = int(rng.integers(1, 250))
    put_keys = np.zeros(n_puts, KEY)
    put_keys["k"] = rng.integers(0, KEY_SPACE, n_puts)
    put_values = np.zeros(n_puts, VALUE)
    put_values["count"] = version
    put_values["sum"] = rng.random(n_puts)
    n_removes = int(rng.integers(0, 120))
    remove_keys = np.zeros(n_removes, KEY)
    remove_keys["k"] = rng.integers(0, KEY_SPACE, n_removes)
    # scalar updates overlap the batch parts on purpose
    pool = np.concatenate([put_keys["k"][:5], remove_keys["k"][:5], rng.integers(0, KEY_SPACE, 5)])
    scalar_puts = [(int(k), (version, float(i))) for i, k in enumerate(rng.choice(pool, 6))]
    scalar_removes = [int(k) for k in rng.choice(pool, 3)]
    return put_keys, put_values, remove_keys, scalar_puts, scalar_removes


def apply_to_store(store, b):
    put_keys, put_values, remove_keys, scalar_puts, scalar_removes = b
    store.put_batch(put_keys, put_values)
    store.remove_batch(remove_keys)
    for k, v in scalar_puts:
        store.put(k, v)
    for k in scalar_removes:
        store.remove(k)


def apply_to_dict(d, b):
    """The same updates on a plain dict {key int: (count, sum)}."""
    put_keys, put_values, remove_keys, scalar_puts, scalar_removes = b
    for k, c, s in zip(put_keys["k"].tolist(), put_values["count"].tolist(), put_values["sum"].tolist()):
        d[k] = (c, s)
    for k in remove_keys["k"].tolist():
        d.pop(k, None)
    for k, v in scalar_puts:
        d[k] = v
    for k in scalar_removes:
        d.pop(k, None)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _install_die(spec):
    """Make the store's files SIGKILL this process at the given step (see the module doc)."""
    parts = spec.split(":")
    step, pattern, nth = parts[0], parts[1], int(parts[2])
    after_bytes = int(parts[3]) if len(parts) > 3 else 0
    if step == "recorded":
        return pattern, nth
    import threading

    import statecore.files as files_module

    seen = [0]
    lock = threading.Lock()  # the writer thread and the maintenance thread count too

    def hit(s, name):
        if s == step and (step == "merged" or fnmatch.fnmatchcase(name, pattern)):
            with lock:
                seen[0] += 1
                return seen[0] == nth
        return False

    if step == "merged":
        import statecore.commit as commit_module

        merge = commit_module.merge_update

        def dying_merge(self, *args, **kwargs):
            out = merge(self, *args, **kwargs)
            if hit("merged", None):
                _die()
            return out

        commit_module.merge_update = dying_merge
        return None

    armed = {}  # file name -> its dying writer, until it fired or the file was flushed

    class _DyingWriter:
        def __init__(self, f):
            self._f = f
            self._left = after_bytes

        def write(self, data):
            view = memoryview(data).cast("B")
            if len(view) >= self._left:
                self._f.write(view[:self._left])
                self._f.flush()
                _die()
            self._left -= len(view)
            return self._f.write(view)

        def __getattr__(self, attr):
            return getattr(self._f, attr)

    class DyingFiles(files_module.StoreFiles):
        def _step(self, s, name):
            if s == "flush" and armed.pop(name, None) is not None:
                _die()  # the callback wrote fewer than BYTES bytes: the write ends here
            if hit(s, name):
                _die()

        def _writer(self, f, name):
            if hit("write", name):
                writer = armed[name] = _DyingWriter(f)
                return writer
            return f

        def _publish(self, pending, overwrite):
            size = super()._publish(pending, overwrite)
            if hit("published", pending.name):
                _die()
            return size

    def open_store_files(location, storage_options=None, local_cache_dir=None):
        return DyingFiles(location, storage_options, local_cache_dir)

    files_module.open_store_files = open_store_files
    return None


def main(argv):
    root, seed, start, side_path, mode = argv[:5]
    seed, start = int(seed), int(start)
    die_recorded = None
    if len(argv) > 5:
        assert argv[5] == "--die", argv
        die_recorded = _install_die(argv[6])

    from statecore import StateStoreConf, StateStoreId, StateStoreProviderId, create_and_init_provider
    from statecore import registry

    store_id = StateStoreId(root, 0, 0)
    if mode == "plain":
        provider = create_and_init_provider(store_id, KEY, VALUE, StateStoreConf(**conf_kwargs()))

        def get_store(v):
            return provider.get_store(v)
    elif mode == "registry":
        conf = StateStoreConf(maintenance_interval_s=MAINTENANCE_INTERVAL_S, **conf_kwargs())
        provider_id = StateStoreProviderId(store_id, uuid.uuid4())

        def get_store(v):
            return registry.get(provider_id, KEY, VALUE, v, conf)
    else:
        raise SystemExit(f"unknown mode {mode!r}")

    fd = os.open(side_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    print("ready", flush=True)
    v = start
    commits = 0
    while True:
        store = get_store(v)
        apply_to_store(store, batch(seed, v + 1))
        new_version = store.commit()
        assert new_version == v + 1, (new_version, v)
        commits += 1
        if die_recorded is not None and commits == die_recorded[1]:
            _die()
        os.write(fd, f"{new_version}\n".encode())
        os.fsync(fd)
        v = new_version
        if mode == "plain" and v % MAINTENANCE_EVERY == 0:
            provider.do_maintenance()


if __name__ == "__main__":
    main(sys.argv[1:])
