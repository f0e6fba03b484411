"""StateStoreConf: a state store's options, their defaults and checks, and Spark's keys for them.

Spark builds its ``StateStoreConf`` from the session's SQL conf (docs/spark-state-store.md, Configuration); here
:meth:`StateStoreConf.from_spark_conf` reads the same ``spark.sql.streaming.*`` keys, in
Spark's syntax (``"10ms"``, ``"1m"``), plus statecore's own ``spark.statecore.*`` keys for
the fsspec storage options and the local cache directory.

A ``StateStoreConf`` is immutable, hashable and picklable, so it travels to tasks and
keys caches; it is safe to share between threads.
"""
import dataclasses
import math
import re
from collections.abc import Mapping

from statecore.schema_evolution import SchemaChanges

__all__ = ["StateStoreConf", "DEFAULT_PROVIDER_CLASS"]

DEFAULT_PROVIDER_CLASS = "statecore.FileStateStoreProvider"

# Spark's own provider classes, as spark.sql.streaming.stateStore.providerClass names them.
_SPARK_HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
_SPARK_ROCKSDB_PROVIDER = (
    "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")

_COMPRESSIONS = ("lz4", "none")

_KEY_MIN_DELTAS = "spark.sql.streaming.stateStore.minDeltasForSnapshot"
_KEY_MIN_RETAIN = "spark.sql.streaming.minBatchesToRetain"
_KEY_MAX_IN_MEMORY = "spark.sql.streaming.maxBatchesToRetainInMemory"
_KEY_INTERVAL = "spark.sql.streaming.stateStore.maintenanceInterval"
_KEY_PROVIDER = "spark.sql.streaming.stateStore.providerClass"
_KEY_CODEC = "spark.sql.streaming.stateStore.compression.codec"
_KEY_CACHE_DIR = "spark.statecore.localCacheDir"
_PREFIX_STORAGE = "spark.statecore.storageOptions."

# Spark's time suffixes (JavaUtils.timeStringAs), in seconds; a bare number takes the
# key's default unit, which for maintenanceInterval is milliseconds.
_TIME_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
                 "d": 86400.0}
_TIME = re.compile(r"(-?[0-9]+)([a-z]+)?")
_INT = re.compile(r"[+-]?[0-9]+")
_INT_MAX = 2**31 - 1  # Spark's intConf is a Java int


@dataclasses.dataclass(frozen=True)
class StateStoreConf:
    """The options of a state store provider.

    Parameters
    ----------
    min_deltas_for_snapshot : int, default 10
        Maintenance writes a snapshot once **more than** this many deltas were committed
        since the last snapshot (Spark's rule). ``>= 0``; 0 snapshots after every delta.
    min_versions_to_retain : int, default 100
        Maintenance keeps the files needed to rebuild the last this-many versions.
        ``>= 1``, as Spark requires of ``minBatchesToRetain``.
    max_versions_to_retain_in_memory : int, default 2
        How many loaded versions a provider caches ("2 covers success and direct failure,
        1 covers success only, 0 disables"). ``>= 0``.
    maintenance_interval_s : float, default 60.0
        Seconds between maintenance runs; ``> 0``.
    provider_class : str, default "statecore.FileStateStoreProvider"
        The provider, as ``"module.Class"`` (or ``"module:Class"``).
    compression : {"lz4", "none"}, default "lz4"
        The compression of deltas and snapshots (Spark's
        ``spark.sql.streaming.stateStore.compression.codec``): "lz4" writes deltas in lz4
        blocks and snapshots packed (format version 2, unpacked once into the local cache to
        be mapped); "none" writes both uncompressed (snapshots mapped in place). Files of
        either setting read under the other.
    storage_options : dict, optional
        fsspec options of the checkpoint filesystem (credentials, endpoints, ...). Copied;
        left out of the hash (equal confs still hash equal), so values need not be
        hashable; ``repr`` shows their names only.
    local_cache_dir : str, optional
        Where snapshots of a remote filesystem are copied, and packed snapshots unpacked,
        to be memory-mapped. Without it, both go to a private per-user directory under the
        temporary directory (``statecore-<uid>``).
    schema_changes : dict, optional
        ``{store name: SchemaChanges}``: the renames and defaults a query declares for a
        store whose schemas changed (``docs/evolution.md``); a store not named evolves by the
        rules alone. Left out of the hash.

    Raises
    ------
    ValueError
        For a value out of range or of the wrong type (a float or bool where an int is
        expected, ...); the message names the field and the value.
    """

    min_deltas_for_snapshot: int = 10
    min_versions_to_retain: int = 100
    max_versions_to_retain_in_memory: int = 2
    maintenance_interval_s: float = 60.0
    provider_class: str = DEFAULT_PROVIDER_CLASS
    compression: str = "lz4"
    storage_options: dict | None = dataclasses.field(default=None, hash=False)
    local_cache_dir: str | None = None
    schema_changes: dict | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self):
        for field, low in (("min_deltas_for_snapshot", 0), ("min_versions_to_retain", 1),
                           ("max_versions_to_retain_in_memory", 0)):
            value = getattr(self, field)
            # bool is an int subclass, but True as a count is a mistake.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{field} must be >= {low}, got {value}")
        interval = self.maintenance_interval_s
        if not isinstance(interval, (int, float)) or isinstance(interval, bool):
            raise ValueError(
                f"maintenance_interval_s must be a number of seconds, got {interval!r}")
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"maintenance_interval_s must be > 0 and finite, got {interval}")
        object.__setattr__(self, "maintenance_interval_s", float(interval))
        if not isinstance(self.provider_class, str) or not self.provider_class:
            raise ValueError(
                f"provider_class must be a non-empty class name, got {self.provider_class!r}")
        if self.compression not in _COMPRESSIONS:
            raise ValueError(
                f"compression must be one of {_COMPRESSIONS}, got {self.compression!r}")
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(
                    f"storage_options must be a dict, got {type(self.storage_options).__name__}")
            bad = [k for k in self.storage_options if not isinstance(k, str)]
            if bad:
                raise ValueError(f"storage_options keys must be strings, got {bad[0]!r}")
            # A private copy: the caller's dict may change later, this conf may not.
            object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.local_cache_dir is not None and (
                not isinstance(self.local_cache_dir, str) or not self.local_cache_dir):
            raise ValueError(
                f"local_cache_dir must be a non-empty path, got {self.local_cache_dir!r}")

        if self.schema_changes is not None:
            if not isinstance(self.schema_changes, Mapping):
                raise ValueError(f"schema_changes must be a dict of store name -> SchemaChanges, got "
                                 f"{type(self.schema_changes).__name__}")
            object.__setattr__(self, "schema_changes",
                               {str(name): SchemaChanges.of(c) for name, c in self.schema_changes.items()})

    def schema_changes_of(self, store_name):
        """The :class:`~statecore.schema_evolution.SchemaChanges` declared for ``store_name``, or None."""
        return None if self.schema_changes is None else self.schema_changes.get(store_name)

    def __repr__(self):
        # storage_options often hold credentials: show their names, never their values.
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "storage_options" and value is not None:
                parts.append(f"storage_options={{{', '.join(f'{k!r}: ...' for k in value)}}}")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    @classmethod
    def from_spark_conf(cls, conf):
        """A conf from Spark configuration keys (docs/spark-state-store.md, Configuration).

        Reads ``spark.sql.streaming.stateStore.minDeltasForSnapshot``,
        ``spark.sql.streaming.minBatchesToRetain``,
        ``spark.sql.streaming.maxBatchesToRetainInMemory``,
        ``spark.sql.streaming.stateStore.maintenanceInterval`` (a Spark time string:
        ``"500ms"``, ``"5s"``, ``"1m"``, ``"2min"``, ``"1h"``, ``"1d"``, ``"250us"``; a bare
        number is milliseconds), ``spark.sql.streaming.stateStore.providerClass``
        (Spark's HDFS provider maps to ours), ``spark.sql.streaming.stateStore.compression.codec``
        and statecore's ``spark.statecore.localCacheDir`` and
        ``spark.statecore.storageOptions.<name>`` (values stay strings, except ``"true"``
        and ``"false"``, which become booleans: fsspec filesystems take flags such as
        ``anon`` as booleans, and the string ``"false"`` is truthy). Other keys are
        ignored; missing keys take the defaults.

        Parameters
        ----------
        conf : Mapping[str, str] or iterable of (str, str)
            For example a dict, or ``SparkConf.getAll()``.

        Returns
        -------
        StateStoreConf

        Raises
        ------
        ValueError
            ``"Invalid value for '<key>', must be ..."`` for a value that does not parse or
            is out of range; for the RocksDB provider, which statecore does not have; for
            a codec other than lz4 (or statecore's "none").
        """
        items = conf.items() if isinstance(conf, Mapping) else conf
        kwargs = {}
        storage_options = {}
        for key, raw in items:
            if not isinstance(key, str):
                continue
            if key.startswith(_PREFIX_STORAGE) and len(key) > len(_PREFIX_STORAGE):
                storage_options[key[len(_PREFIX_STORAGE):]] = _option_value(raw)
                continue
            if key == _KEY_MIN_DELTAS:
                kwargs["min_deltas_for_snapshot"] = _parse_int(key, raw, 0, "a non-negative integer")
            elif key == _KEY_MIN_RETAIN:
                kwargs["min_versions_to_retain"] = _parse_int(key, raw, 1, "a positive integer")
            elif key == _KEY_MAX_IN_MEMORY:
                kwargs["max_versions_to_retain_in_memory"] = _parse_int(
                    key, raw, 0, "a non-negative integer")
            elif key == _KEY_INTERVAL:
                kwargs["maintenance_interval_s"] = _parse_interval_s(key, raw)
            elif key == _KEY_PROVIDER:
                kwargs["provider_class"] = _provider_class(key, raw)
            elif key == _KEY_CODEC:
                kwargs["compression"] = _codec(key, raw)
            elif key == _KEY_CACHE_DIR:
                if not str(raw).strip():
                    raise ValueError(f"Invalid value for '{key}', must be a directory path")
                kwargs["local_cache_dir"] = str(raw)
        if storage_options:
            kwargs["storage_options"] = storage_options
        return cls(**kwargs)


def _invalid(key, what, raw):
    return ValueError(f"Invalid value for '{key}', must be {what} (got {raw!r})")


def _option_value(raw):
    """A storage option from a Spark conf string: "true"/"false" as booleans, else as given."""
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    return raw


def _parse_int(key, raw, low, what):
    """A Java-int conf value (Spark's intConf: trimmed, optional sign, 32 bits) >= ``low``."""
    text = str(raw).strip()
    if not _INT.fullmatch(text):
        raise _invalid(key, what, raw)
    value = int(text)
    if not low <= value <= _INT_MAX:
        raise _invalid(key, what, raw)
    return value


def _parse_interval_s(key, raw):
    """A Spark time string in seconds; a bare number is milliseconds (the key's unit).

    Spark's grammar (JavaUtils.timeStringAs): trimmed, lower-cased, an integer and an
    optional suffix among us, ms, s, m, min, h, d. Unlike Spark's millisecond long, the
    result is exact ("250us" is 0.00025 s, not 0).
    """
    what = "a positive time such as '500ms', '10s', '1m', '1h' (a bare number is milliseconds)"
    m = _TIME.fullmatch(str(raw).strip().lower())
    if m is None or (m.group(2) is not None and m.group(2) not in _TIME_UNITS_S):
        raise _invalid(key, what, raw)
    seconds = int(m.group(1)) * _TIME_UNITS_S[m.group(2) or "ms"]
    if not seconds > 0 or not math.isfinite(seconds):
        raise _invalid(key, what, raw)
    return seconds


def _provider_class(key, raw):
    name = str(raw).strip()
    if name == _SPARK_HDFS_PROVIDER:
        # Spark's default names the file-based provider; statecore's is its counterpart.
        return DEFAULT_PROVIDER_CLASS
    if name == _SPARK_ROCKSDB_PROVIDER or name.rsplit(".", 1)[-1] == "RocksDBStateStoreProvider":
        raise ValueError(
            f"Invalid value for '{key}': statecore has no RocksDB provider ({name}); "
            f"use {DEFAULT_PROVIDER_CLASS} (Spark's {_SPARK_HDFS_PROVIDER} maps to it)")
    if not name:
        raise _invalid(key, "a provider class name", raw)
    return name


def _codec(key, raw):
    name = str(raw).strip().lower()
    if name in _COMPRESSIONS:
        return name
    # Spark also takes a codec's class name; lz4's means lz4 here too.
    if name == "org.apache.spark.io.lz4compressioncodec":
        return "lz4"
    raise ValueError(
        f"Invalid value for '{key}', must be one of {', '.join(_COMPRESSIONS)} (got {raw!r}): "
        f"statecore's delta files support lz4 or no compression, not Spark's "
        f"lzf, snappy or zstd")
