"""read_state on real Spark (local[2]) over stores written with the engine directly: column
names and Spark types (S<n> as binary without trailing NULs, unsigned integers widened),
values, partition ids, a given version or batch, named commit ids, the default version, and
the errors."""
import decimal
import os

import numpy as np
import pytest

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.errors import VersionNotFoundError
from statecore.files import StoreFiles

KEY = np.dtype([("name", "S6"), ("id", "<u2")])
VALUE = np.dtype([("u8", "u1"), ("u32", "<u4"), ("u64", "<u8"), ("i8", "i1"), ("i16", "<i2"), ("i32", "<i4"),
                  ("f32", "<f4"), ("f64", "<f8"), ("flag", "?")])


def rows(partition, version, n=5):
    """Deterministic keys and values of one partition at one version (extremes included)."""
    keys = np.zeros(n, KEY)
    keys["name"] = [f"p{partition}k{i}".encode()[:6] for i in range(n)]
    keys["name"][0] = b""  # the empty name
    keys["id"] = np.arange(n) + [0, 65535 - n, 0, 0, 0][:n]
    values = np.zeros(n, VALUE)
    values["u8"] = 255 - np.arange(n)
    values["u32"] = 2**32 - 1 - version
    values["u64"] = 2**64 - 1 - np.arange(n, dtype=np.uint64) - np.uint64(version)
    values["i8"], values["i16"], values["i32"] = -128 + version, -(2**15), 2**31 - 1
    values["f32"], values["f64"] = 0.5 * version, -1.25 * version
    values["flag"] = np.arange(n) % 2 == 0
    return keys, values


def write_versions(root, newest):
    """Partition p of operator 3 gets versions 1..newest[p], version v holding rows(p, v)."""
    conf = StateStoreConf()
    for p, last in enumerate(newest):
        provider = create_and_init_provider(StateStoreId(root, 3, p), KEY, VALUE, conf)
        for v in range(last):
            store = provider.get_store(v)
            keys, values = rows(p, v + 1)
            store.put_batch(keys, values)
            store.commit()
        provider.close()


def expected(partitions, version):
    out = {}
    for p in partitions:
        keys, values = rows(p, version)
        for k, v in zip(keys.tolist(), values.tolist()):
            out[(k[0], k[1])] = (*v, p)
    return out


def as_dict(df):
    out = {}
    for r in df.collect():
        d = r.asDict()
        key = (bytes(d.pop("name")), d.pop("id"))
        out[key] = tuple(d.values())
    return out


def normalize(expected_rows):
    """Expected tuples as Spark returns them: uint64 as Decimal, float32 rounded as float32."""
    out = {}
    for key, v in expected_rows.items():
        v = list(v)
        v[2] = decimal.Decimal(int(v[2]))
        v[6] = float(np.float32(v[6]))
        out[key] = tuple(v)
    return out


def test_read_state_columns_types_and_values(spark, tmp_path):
    from pyspark_glue import read_state

    root = str(tmp_path / "state")
    write_versions(root, [2, 2])
    df = read_state(spark, root, 3)
    assert df.columns == ["name", "id", "u8", "u32", "u64", "i8", "i16", "i32", "f32", "f64", "flag",
                          "partition_id"]
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "binary", "int", "smallint", "bigint", "decimal(20,0)", "tinyint", "smallint", "int", "float", "double",
        "boolean", "int"]
    got = as_dict(df)
    assert got == normalize(expected([0, 1], 2))
    assert (b"", 0) in got  # S<n> comes back without trailing NULs: the empty name is b""
    assert got[(b"p0k1", 65531)][2] == decimal.Decimal(2**64 - 4)  # uint64 near its maximum, exact
    assert df.rdd.getNumPartitions() == 2  # one task per partition


def test_read_state_versions(spark, tmp_path):
    from pyspark_glue import read_state

    root = str(tmp_path / "state")
    write_versions(root, [3, 2])  # partition 0 is one version ahead (a batch that failed half-way)
    assert as_dict(read_state(spark, root, 3)) == normalize(expected([0, 1], 2))  # newest common version
    assert as_dict(read_state(spark, root, 3, version=1)) == normalize(expected([0, 1], 1))
    assert read_state(spark, root, 3, version=0).count() == 0
    with pytest.raises(VersionNotFoundError, match=r"version 3 .*partition\(s\) \[1\]"):
        read_state(spark, root, 3, version=3)
    # No batch records here (stores written directly): batch_id b is version b + 1, and
    # commit_ids name the attempts explicitly.
    assert as_dict(read_state(spark, root, 3, batch_id=0)) == normalize(expected([0, 1], 1))
    ids = [StoreFiles(os.path.join(root, "3", str(p))).list_versions().of("delta", 2)[0].commit_id.hex()
           for p in range(2)]
    assert as_dict(read_state(spark, root, 3, version=2, commit_ids=ids)) == normalize(expected([0, 1], 2))
    with pytest.raises(Exception, match="VersionNotFoundError"):  # found by the tasks
        read_state(spark, root, 3, version=2, commit_ids=["0123456789abcdef"] * 2).collect()
    with pytest.raises(ValueError, match="not both"):
        read_state(spark, root, 3, version=1, batch_id=0)
    with pytest.raises(ValueError, match="give the version too"):
        read_state(spark, root, 3, commit_ids=ids)
    three = str(tmp_path / "three")
    write_versions(three, [1, 1, 1])
    with pytest.raises(ValueError, match=r"2 commit ids .* partition\(s\) \[2\]"):
        read_state(spark, three, 3, version=1, commit_ids=ids)


def test_read_state_errors(spark, tmp_path):
    from pyspark_glue import read_state

    with pytest.raises(FileNotFoundError, match="no state of operator 3"):
        read_state(spark, str(tmp_path / "nothing"), 3)
    root = str(tmp_path / "dup")
    provider = create_and_init_provider(StateStoreId(root, 0, 0), np.dtype([("k", "<i8")]),
                                        np.dtype([("k", "<i8"), ("partition_id", "<i4")]), StateStoreConf())
    store = provider.get_store(0)
    store.put((1,), (2, 3))
    store.commit()
    provider.close()
    with pytest.raises(ValueError, match=r"\['k', 'partition_id'\] repeat"):
        read_state(spark, root, 0)


class CountThenForget:
    """An ``fn`` that changes keys every way a change feed must show: counts rows per key,
    removes a key once its count reaches 4, and also removes keys that were never there."""

    def __call__(self, store, batch):
        from pyspark_glue import columns_from_arrow

        from tests.glue_support import KEY, VALUE

        keys = columns_from_arrow(batch, KEY)
        distinct, counts = np.unique(keys, return_counts=True)
        old, found = store.get_batch(distinct)
        new = np.zeros(len(distinct), VALUE)
        new["count"] = np.where(found, old["count"], 0) + counts
        gone = new["count"] >= 4
        store.put_batch(distinct[~gone], new[~gone])
        store.remove_batch(distinct[gone])
        never = np.zeros(2, KEY)
        never["user"] = [10**9, 10**9 + 1]  # absent: no change to report
        store.remove_batch(never)
        return None


def test_change_feed_is_the_difference_of_consecutive_versions(spark, tmp_path):
    """Five batches of puts and removes (and removes of absent keys), batch 2 run twice (the
    feed follows the recorded attempt): the change feed of versions 1..5, and of 2..4 (batches
    1..3), equals the difference of read_state at each version and the one before; without a
    start it is the whole feed; a start after the newest version is a clear error."""
    from pyspark_glue import read_state

    from tests.glue_support import events_df, make_operator

    root = str(tmp_path / "state")
    op = make_operator(root, fn=CountThenForget(), num_partitions=3)
    for b in [0, 1, 2, 2, 3, 4]:
        op.process(events_df(spark, seed=b, n=60, users=12), b)
    op.close()

    def state_at(v):
        if v == 0:
            return {}
        return {(r["user"], bytes(r["region"])): (r["count"], r["sum"], r["partition_id"])
                for r in read_state(spark, root, 0, version=v).collect()}

    def diff(v):
        before, after = state_at(v - 1), state_at(v)
        out = {(v - 1, "update", k, val) for k, val in after.items() if before.get(k) != val}
        out |= {(v - 1, "delete", k, (None, None, before[k][2])) for k in before if k not in after}
        return out

    def feed(start=None, end=None, **batch_ids):
        df = read_state(spark, root, 0, change_feed=True, start_version=start, end_version=end, **batch_ids)
        assert df.columns == ["batch_id", "change_type", "user", "region", "count", "sum", "partition_id"]
        rows = [(r["batch_id"], r["change_type"], (r["user"], bytes(r["region"])),
                 (r["count"], r["sum"], r["partition_id"])) for r in df.collect()]
        assert len(rows) == len(set(rows)), "a key changed twice in one version"
        return set(rows)

    expected = set().union(*(diff(v) for v in range(1, 6)))
    assert any(t == "delete" for _, t, _, _ in expected) and any(t == "update" for _, t, _, _ in expected)
    assert feed(1) == expected
    assert feed(2, 4) == {row for row in expected if 1 <= row[0] <= 3}
    # The same range in batch ids (the batch_id column's): batches 1..3 are versions 2..4.
    assert feed(start_batch_id=1, end_batch_id=3) == feed(2, 4)
    assert feed() == expected  # no start: the oldest change every partition holds, here version 1
    with pytest.raises(ValueError, match="change_feed=True"):
        read_state(spark, root, 0, start_version=1)
    with pytest.raises(VersionNotFoundError, match=r"from version 6 \(batch 5\) ends before it starts: its end is "
                                                   r"version 5"):
        read_state(spark, root, 0, change_feed=True, start_version=6)


def test_read_state_and_the_change_feed_of_a_processor_store_skip_a_zombie_attempt(spark, tmp_path):
    """A StatefulProcessor-like extra store whose last batch ran twice in partition 0, the
    losing attempt writing last (the default lineage): read_state and its change feed read the
    attempt the batch record's store_commit_ids name, so the zombie's key -1 never shows."""
    from pyspark_glue import read_state

    from tests.engine.test_read_paths import PARTITIONS, write_operator

    root = str(tmp_path / "state")
    write_operator(root, zombie=True)
    state = sorted((r["partition_id"], r["k"], r["first"]) for r in read_state(spark, root, 0, "seen").collect())
    assert state == [(p, k, k) for p in range(PARTITIONS) for k in (0, 1)]
    changes = sorted((r["batch_id"], r["change_type"], r["k"], r["first"], r["partition_id"])
                     for r in read_state(spark, root, 0, "seen", change_feed=True).collect())
    assert changes == [(b, "update", b, b, p) for b in (0, 1) for p in range(PARTITIONS)]
