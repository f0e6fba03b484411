"""What the store tests share: opening a provider on a directory, committing a batch of
per-row or batch updates and keeping a model of each version, reading a store back as a dict,
handing every provider a FaultInjectingFiles, the stores of a partition committed together
(Partition), a maintenance pass that writes a snapshot, a maintenance thread racing the test,
and waiting for a condition another thread brings about (or for a call, with a deadline).

Then the numbered store: one int key, an (n, x) value, version v's changes drawn from a seed
of v (:func:`batch`), so that a test commits versions with :func:`commit_numbered` and checks
each against its model with :func:`assert_reads` (every read path, exactly); and the store
directory's version files by version and kind, whatever commit id their names carry."""
import contextlib
import dataclasses
import os
import re
import threading
import time
from unittest import mock

import numpy as np

import statecore.files
from statecore import StateCorruptionError, StateStoreConf, StateStoreId, create_and_init_provider
from statecore.faults import FaultInjectingFiles
from tests.state_files import is_url, list_names, version_path

WAIT_S = 20.0  # how long a test waits for another thread to reach the point it forces


def open_provider(root, key, value, partition=0, **conf):
    """A provider of ``StateStoreId(root, 0, partition)`` with ``StateStoreConf(**conf)``."""
    return create_and_init_provider(StateStoreId(str(root), 0, partition), key, value, StateStoreConf(**conf))


class Partition:
    """The stores of one partition (``schemas``: ``{store name: (key, value)}``), opened at a
    version and committed together, as a task does; providers are opened on first use."""

    def __init__(self, root, schemas):
        self.root, self.schemas, self.version = str(root), dict(schemas), 0
        self.providers = {}
        self._started = {}  # store name -> the attempt it was started empty at (this version)

    def start_empty(self, name, key, value):
        """Add store ``name``, started empty at the current version, as the operator starts a
        store new to it (:func:`statecore.snapshot_at.start_empty`)."""
        from statecore.files import open_store_files
        from statecore.schema import key_value_schemas
        from statecore.snapshot_at import start_empty

        files = open_store_files(StateStoreId(self.root, 0, 0, store_name=name).store_checkpoint_location())
        self._started[name] = start_empty(files, self.version, *key_value_schemas(key, value),
                                          StateStoreConf().compression)
        self.schemas[name] = (key, value)

    def open(self):
        for name, (key, value) in self.schemas.items():
            if name not in self.providers:
                self.providers[name] = create_and_init_provider(StateStoreId(self.root, 0, 0, store_name=name),
                                                                key, value, StateStoreConf())
        started, self._started = self._started, {}
        return {name: p.get_store(self.version, started.get(name)) for name, p in self.providers.items()}

    def commit(self, stores):
        for store in stores.values():
            store.commit()
        self.version += 1

    def reload(self):
        """Close every provider: the next :meth:`open` loads the stores from their files."""
        for p in self.providers.values():
            p.close()
        self.providers = {}


def snapshot_now(provider):
    """A maintenance pass in which the newest version is due for a snapshot on files (as if
    ``min_deltas_for_snapshot`` versions had passed since the last one)."""
    with mock.patch.object(provider, "_conf", dataclasses.replace(provider.conf, min_deltas_for_snapshot=0)):
        provider.do_maintenance()


def store_dir(root, partition=0):
    return os.path.join(str(root), "0", str(partition))


def commit_batch(provider, version, puts=(), removes=()):
    """Open ``version``, put ``(key, value)`` pairs and remove keys, commit; the store is
    then aborted, as a task-completion hook does (harmless after a commit)."""
    store = provider.get_store(version)
    for k, v in puts:
        store.put(k, v)
    for k in removes:
        store.remove(k)
    new_version = store.commit()
    store.abort()
    return new_version


def write_batch(store, key, value, puts, removes):
    """One ``put_batch`` of ``puts`` ({k: value tuple}) and one ``remove_batch`` of ``removes``
    (a list of k), for a one-field ``key`` dtype and the ``value`` dtype."""
    keys = np.zeros(len(puts), key)
    keys[key.names[0]] = list(puts)
    values = np.zeros(len(puts), value)
    for i, name in enumerate(value.names):
        values[name] = [v[i] for v in puts.values()]
    store.put_batch(keys, values)
    gone = np.zeros(len(removes), key)
    gone[key.names[0]] = removes
    store.remove_batch(gone)


def applied(before, puts, removes):
    """The contents ``before`` ({k: value}) after ``puts`` and ``removes``."""
    after = dict(before)
    after.update(puts)
    for k in removes:
        after.pop(k, None)
    return after


def commit_changes(provider, model, changes, key, value):
    """Commit the version after the newest one in ``model`` ({version: contents}) with
    :func:`write_batch` of ``changes(version)`` (``(puts, removes)``), and add it to the model;
    returns the committed store."""
    v = max(model)
    store = provider.get_store(v)
    puts, removes = changes(v + 1)
    write_batch(store, key, value, puts, removes)
    assert store.commit() == v + 1
    model[v + 1] = applied(model[v], puts, removes)
    return store


def contents(store):
    """The store's iterator as a dict (a one-field key by its value); every key must come once."""
    out = {}
    for k, v in store.iterator():
        key = k[0] if len(k) == 1 else k
        assert key not in out, f"key {key} iterated twice"
        out[key] = tuple(v)
    return out


def inject_faulty_files(monkeypatch, files_class=FaultInjectingFiles):
    """Every provider opened from now on gets a ``files_class`` (a FaultInjectingFiles);
    returns the list they are appended to, newest last."""
    made = []

    def open_store_files(location, storage_options=None, local_cache_dir=None):
        made.append(files_class(location, storage_options, local_cache_dir))
        return made[-1]

    monkeypatch.setattr(statecore.files, "open_store_files", open_store_files)
    return made


@contextlib.contextmanager
def maintaining(provider):
    """A thread running ``provider.do_maintenance()`` over and over for the ``with`` block;
    yields the list of what it raised (it stops at the first exception)."""
    stop = threading.Event()
    errors = []

    def maintain():
        while not stop.is_set():
            try:
                provider.do_maintenance()
            except Exception as e:  # reported through the list
                errors.append(e)
                return

    thread = threading.Thread(target=maintain)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join()


def wait_until(condition, what, deadline_s=30.0):
    """Poll ``condition`` (letting the GIL go between polls) until it holds; AssertionError
    naming ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.001)


def call_with_deadline(fn, deadline_s=WAIT_S):
    """``("raised", exception)`` or ``("returned", value)`` of ``fn()`` run on a thread; fails the
    test if it has not finished within ``deadline_s`` (a read blocked on a FIFO)."""
    outcome = []

    def body():
        try:
            outcome.append(("returned", fn()))
        except BaseException as e:
            outcome.append(("raised", e))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert outcome, f"the call did not finish within {deadline_s} s"
    return outcome[0]


# -- the numbered store ----------------------------------------------------------------------
KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8")])
KEY_SPACE = 40
ALL_KEYS = np.zeros(KEY_SPACE + 2, KEY)  # every key a batch may write, and one on each side
ALL_KEYS["k"] = np.arange(-1, KEY_SPACE + 1)


def open_numbered(root, **conf):
    """A provider of the numbered store under ``root`` (partition 0), with ``StateStoreConf(**conf)``."""
    return open_provider(root, KEY, VALUE, **conf)


def batch(v, salt=0):
    """The changes of version ``v``: ``(puts {k: (n, x)}, removes [k])``, disjoint keys."""
    rng = np.random.default_rng(1000 * v + salt)
    ks = [int(k) for k in rng.permutation(KEY_SPACE)]
    puts = {k: (v, salt + i / 8) for i, k in enumerate(ks[:9])}
    return puts, ks[9:12]


def write(store, puts, removes):
    """:func:`write_batch` of the numbered store's ``puts`` and ``removes``."""
    write_batch(store, KEY, VALUE, puts, removes)


def commit_numbered(provider, model, salt=0):
    """Commit the next version from the newest one in ``model`` ({version: contents})."""
    return commit_changes(provider, model, lambda v: batch(v, salt), KEY, VALUE)


def commit_upto(provider, model, top, salt=0):
    while max(model) < top:
        commit_numbered(provider, model, salt)


def committed(root, top, **conf):
    """A provider made with ``conf`` that committed versions 1..``top``, and their model."""
    p = open_numbered(root, **conf)
    model = {0: {}}
    commit_upto(p, model, top)
    return p, model


def assert_reads(provider, version, expected, commit_id=None):
    """Version ``version`` (of attempt ``commit_id``, or the default lineage's) reads exactly
    ``expected`` by iteration, batch lookup and get."""
    store = provider.get_read_store(version, commit_id=commit_id)
    try:
        assert contents(store) == expected, f"version {version} differs"
        values, found = store.get_batch(ALL_KEYS)
        assert found.tolist() == [int(k) in expected for k in ALL_KEYS["k"]], f"version {version}: lookups"
        assert [tuple(v) for v in values[found].tolist()] == [expected[int(k)] for k in ALL_KEYS["k"][found]]
        for k in list(expected)[:3] + [-1]:
            got = store.get(k)
            assert (None if got is None else tuple(got)) == expected.get(k)
    finally:
        store.abort()


def load_outcome(provider, version, expected, commit_id=None):
    """"correct" if the version reads exactly ``expected``, else the StateCorruptionError's
    path (anything else raises)."""
    try:
        assert_reads(provider, version, expected, commit_id)
        return "correct"
    except StateCorruptionError as e:
        return e.path


# -- version files by version and kind -------------------------------------------------------
# The tests' own reading of the names (not the store's parser): ``<v>_<id>.delta``, or ``<v>.delta``
# of the previous layout.
VERSION_FILE = re.compile(r"^([0-9]+)(?:_([0-9a-f]{16}))?\.(delta|snapshot)$")
DELTA_LINEAGE_OFFSET = 48  # own id at 48..56, parent id at 56..64 (docs/formats.md, Delta)


def version_files(root):
    """``{(version, kind): [name, ...]}`` of the regular files of the store directory."""
    out = {}
    d = store_dir(root)
    for name in sorted(list_names(d)):
        m = VERSION_FILE.match(name)
        if m and (is_url(d) or os.path.isfile(os.path.join(d, name))):  # list_names lists only files of a URL
            out.setdefault((int(m.group(1)), m.group(3)), []).append(name)
    return out


def the_file(root, version, kind):
    """The path of the one ``kind`` file of ``version`` in the store directory."""
    return version_path(store_dir(root), version, kind)


def has_file(root, version, kind):
    return bool(version_files(root).get((version, kind)))


def snapshot_versions(root):
    return sorted(v for v, kind in version_files(root) if kind == "snapshot")


def attempt_id(path):
    """The 16-hex commit id a file name carries (None in the previous layout)."""
    return VERSION_FILE.match(os.path.basename(path)).group(2)
