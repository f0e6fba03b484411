"""StateStoreConf: defaults, validation, Spark's keys and time strings, hashing and pickling."""
import pickle

import pytest

from statecore.conf import StateStoreConf

HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def test_defaults_are_sparks():
    c = StateStoreConf()
    assert (c.min_deltas_for_snapshot, c.min_versions_to_retain,
            c.max_versions_to_retain_in_memory, c.maintenance_interval_s) == (10, 100, 2, 60.0)
    assert c.provider_class == "statecore.FileStateStoreProvider"
    assert c.compression == "lz4" and c.storage_options is None and c.local_cache_dir is None
    assert StateStoreConf.from_spark_conf({}) == c


@pytest.mark.parametrize("field,value", [
    ("min_deltas_for_snapshot", -1),
    ("min_deltas_for_snapshot", 2.0),
    ("min_deltas_for_snapshot", True),
    ("min_versions_to_retain", 0),
    ("min_versions_to_retain", "100"),
    ("max_versions_to_retain_in_memory", -1),
    ("maintenance_interval_s", 0),
    ("maintenance_interval_s", -5.0),
    ("maintenance_interval_s", float("inf")),
    ("maintenance_interval_s", float("nan")),
    ("maintenance_interval_s", "60"),
    ("compression", "zstd"),
    ("compression", "LZ4"),
    ("provider_class", ""),
    ("local_cache_dir", ""),
    ("storage_options", [("anon", True)]),
])
def test_invalid_values_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        StateStoreConf(**{field: value})
    assert field in str(e.value) and (repr(value) in str(e.value) or str(value) in str(e.value)
                                      or type(value).__name__ in str(e.value))


def test_boundary_values_are_allowed():
    c = StateStoreConf(min_deltas_for_snapshot=0, min_versions_to_retain=1,
                       max_versions_to_retain_in_memory=0, maintenance_interval_s=1,
                       compression="none")
    assert c.maintenance_interval_s == 1.0 and isinstance(c.maintenance_interval_s, float)


def test_hashable_picklable_and_immutable():
    options = {"key": "id", "client_kwargs": {"region_name": "eu"}}  # unhashable values
    c = StateStoreConf(min_deltas_for_snapshot=3, storage_options=options, local_cache_dir="/c")
    same = StateStoreConf(min_deltas_for_snapshot=3, storage_options=dict(options),
                          local_cache_dir="/c")
    assert c == same and hash(c) == hash(same) and len({c, same}) == 1
    assert StateStoreConf(storage_options={"key": "other"}) != StateStoreConf()
    back = pickle.loads(pickle.dumps(c))
    assert back == c and hash(back) == hash(c)
    options["key"] = "changed"  # the conf keeps its own copy
    assert c.storage_options["key"] == "id"
    with pytest.raises(AttributeError):
        c.min_deltas_for_snapshot = 4


def test_repr_hides_storage_option_values():
    r = repr(StateStoreConf(storage_options={"secret": "hunter2"}))
    assert "'secret'" in r and "hunter2" not in r and "min_deltas_for_snapshot=10" in r


# -- from_spark_conf --------------------------------------------------------------------------

def test_from_spark_conf_reads_every_key():
    c = StateStoreConf.from_spark_conf({
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": "5",
        "spark.sql.streaming.minBatchesToRetain": " 20 ",
        "spark.sql.streaming.maxBatchesToRetainInMemory": "0",
        "spark.sql.streaming.stateStore.maintenanceInterval": "30s",
        "spark.sql.streaming.stateStore.providerClass": "my.pkg.Provider",
        "spark.sql.streaming.stateStore.compression.codec": "LZ4",
        "spark.statecore.localCacheDir": "/mnt/cache",
        "spark.statecore.storageOptions.endpoint_url": "http://minio:9000",
        "spark.statecore.storageOptions.anon": "False",
        "spark.sql.shuffle.partitions": "7",  # unknown keys are ignored
        "spark.statecore.somethingElse": "x",
    })
    assert c == StateStoreConf(min_deltas_for_snapshot=5, min_versions_to_retain=20,
                               max_versions_to_retain_in_memory=0, maintenance_interval_s=30.0,
                               provider_class="my.pkg.Provider", compression="lz4",
                               local_cache_dir="/mnt/cache",
                               storage_options={"endpoint_url": "http://minio:9000", "anon": False})


def test_from_spark_conf_takes_pairs_like_sparkconf_getall():
    pairs = [("spark.sql.streaming.minBatchesToRetain", "7"),
             ("spark.statecore.storageOptions.key", "abc")]
    c = StateStoreConf.from_spark_conf(pairs)
    assert c.min_versions_to_retain == 7 and c.storage_options == {"key": "abc"}
    assert StateStoreConf.from_spark_conf(iter(pairs)) == c


@pytest.mark.parametrize("text,seconds", [
    ("10ms", 0.01), ("500ms", 0.5), ("5s", 5.0), ("1m", 60.0), ("2min", 120.0),
    ("1h", 3600.0), ("1d", 86400.0), ("250us", 0.00025), ("60000", 60.0), ("1500", 1.5),
    (" 10S ", 10.0), ("3Min", 180.0),
])
def test_maintenance_interval_takes_spark_time_strings(text, seconds):
    c = StateStoreConf.from_spark_conf({"spark.sql.streaming.stateStore.maintenanceInterval": text})
    assert c.maintenance_interval_s == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "1.5s", "10 ms", "5sec", "0", "0s", "-1s", "1e3"])
def test_bad_maintenance_intervals_are_refused_in_sparks_words(text):
    key = "spark.sql.streaming.stateStore.maintenanceInterval"
    with pytest.raises(ValueError, match=f"^Invalid value for '{key}', must be a positive time"):
        StateStoreConf.from_spark_conf({key: text})


@pytest.mark.parametrize("key,text,what", [
    ("spark.sql.streaming.stateStore.minDeltasForSnapshot", "-1", "a non-negative integer"),
    ("spark.sql.streaming.stateStore.minDeltasForSnapshot", "ten", "a non-negative integer"),
    ("spark.sql.streaming.minBatchesToRetain", "0", "a positive integer"),
    ("spark.sql.streaming.minBatchesToRetain", "1.0", "a positive integer"),
    ("spark.sql.streaming.minBatchesToRetain", "2147483648", "a positive integer"),
    ("spark.sql.streaming.minBatchesToRetain", "1_000", "a positive integer"),
    ("spark.sql.streaming.maxBatchesToRetainInMemory", "", "a non-negative integer"),
])
def test_bad_numbers_are_refused_in_sparks_words(key, text, what):
    with pytest.raises(ValueError, match=f"^Invalid value for '{key}', must be {what}"):
        StateStoreConf.from_spark_conf({key: text})


def test_int_values_accept_a_sign_and_non_strings():
    c = StateStoreConf.from_spark_conf({"spark.sql.streaming.minBatchesToRetain": "+12",
                                        "spark.sql.streaming.stateStore.minDeltasForSnapshot": 4})
    assert c.min_versions_to_retain == 12 and c.min_deltas_for_snapshot == 4


def test_sparks_hdfs_provider_maps_to_ours():
    c = StateStoreConf.from_spark_conf({"spark.sql.streaming.stateStore.providerClass": HDFS})
    assert c.provider_class == "statecore.FileStateStoreProvider"


@pytest.mark.parametrize("name", [ROCKSDB, "com.example.RocksDBStateStoreProvider"])
def test_rocksdb_provider_is_refused(name):
    key = "spark.sql.streaming.stateStore.providerClass"
    with pytest.raises(ValueError, match=f"'{key}'.*no RocksDB provider"):
        StateStoreConf.from_spark_conf({key: name})


@pytest.mark.parametrize("codec,expected", [
    ("lz4", "lz4"), ("LZ4", "lz4"), ("org.apache.spark.io.LZ4CompressionCodec", "lz4"),
    ("none", "none"),
])
def test_codecs_we_support(codec, expected):
    c = StateStoreConf.from_spark_conf({"spark.sql.streaming.stateStore.compression.codec": codec})
    assert c.compression == expected


@pytest.mark.parametrize("codec", ["zstd", "snappy", "lzf", "org.apache.spark.io.ZStdCompressionCodec"])
def test_other_spark_codecs_are_refused(codec):
    key = "spark.sql.streaming.stateStore.compression.codec"
    with pytest.raises(ValueError, match=f"^Invalid value for '{key}', must be one of lz4, none"):
        StateStoreConf.from_spark_conf({key: codec})
