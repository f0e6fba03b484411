"""Stateful partitions (pyspark_glue.rdd) on real Spark: versions, recomputation, workers that
stop reading, recovery in new workers, locations through the driver's coordinator, the
partition count. The pieces without Spark: tests/engine/test_glue_rdd_engine.py.

The tests share the session-scoped ``spark`` fixture (local[2]): both task slots are
executor "driver", each served by its own Python worker process. The functions handed to
Spark are defined in this module, which the workers cannot import (pytest put its folder on
the driver's sys.path only): that they work at all checks that their module travels by value.
"""
import os
import uuid

import numpy as np
import pytest

from statecore import StateStoreConf
from statecore.coordinator import StateStoreCoordinatorRef
from statecore.rpc import RpcEnv

from pyspark_glue import driver, executor
from pyspark_glue import rdd as glue
from pyspark_glue.rdd import (StatefulOperatorStateInfo, map_partitions_with_read_state_store,
                              map_partitions_with_state_store)
from tests.state_files import short_name, version_names


KEY = np.dtype([("k", "<i8")])


VALUE = np.dtype([("count", "<i8")])


PARTS = 4


CONF = StateStoreConf(maintenance_interval_s=3600)  # no maintenance thread work during tests


# -- functions run in the workers (pickled by value: this module is not importable there) ---------

def bump_counts(store, rows):
    """Count each key's rows into the store, commit, and yield (key, new count, worker pid)."""
    batch = {}
    for row in rows:
        k = int(row)
        batch[k] = batch.get(k, 0) + 1
    out = []
    for k, n in sorted(batch.items()):
        old = store.get(k)
        new = (old[0] if old else 0) + n
        store.put(k, (new,))
        out.append((k, new, os.getpid()))
    store.commit()
    return iter(out)


def bump_counts_no_commit(store, rows):
    """Gets only: what the counts would become, never committed."""
    for row in rows:
        old = store.get(int(row))
        yield int(row), (old[0] if old else 0) + 1


def dump_state(store, rows):
    for key, value in store.iterator():
        yield key[0], value[0]


def worker_pid(store, rows):
    yield os.getpid(), executor.executor_identity(), executor.worker_executor_id()


# -- helpers ---------------------------------------------------------------------------------------

def info(root, run, version, num_partitions=PARTS):
    return StatefulOperatorStateInfo(str(root), run, 0, version, num_partitions)


def keys_rdd(sc, keys):
    """Keys hash-partitioned into PARTS partitions (a key's rows all go to its store), read
    through a pipelined Python map: the common shape of a micro-batch's input."""
    return sc.parallelize([(k, None) for k in keys], 2).partitionBy(PARTS).keys()


def batch_rdd(sc, root, run, version, keys, fn=bump_counts, coordinator=None, **kwargs):
    """``fn`` over :func:`keys_rdd` of ``keys`` with each partition's store at ``version``
    (map_partitions_with_state_store, this module's schemas and CONF)."""
    return map_partitions_with_state_store(keys_rdd(sc, keys), fn, info(root, run, version), KEY, VALUE, CONF,
                                           coordinator, **kwargs)


def state_at(sc, root, run, version):
    rdd = map_partitions_with_read_state_store(sc.parallelize([], PARTS), dump_state, info(root, run, version), KEY,
                                               VALUE, CONF)
    return dict(rdd.collect())


def files_of(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def expected_counts(*batches):
    counts = {}
    for batch in batches:
        for k in batch:
            counts[k] = counts.get(k, 0) + 1
    return counts


BATCHES = [list(range(0, 40)) + [3, 3, 17], list(range(20, 60)) + [3], list(range(50, 70)) * 2]


def test_versions_advance_and_earlier_ones_stay_unchanged(spark, tmp_path):
    sc = spark.sparkContext
    run = uuid.uuid4()
    assert state_at(sc, tmp_path, run, 0) == {}
    states = []
    for version, batch in enumerate(BATCHES):
        out = batch_rdd(sc, tmp_path, run, version, batch).collect()
        want = expected_counts(*BATCHES[:version + 1])
        assert sorted((k, n) for k, n, _ in out) == sorted((k, want[k]) for k in set(batch))
        states.append(want)
    for version, want in enumerate(states, start=1):  # every version readable, as it was
        assert state_at(sc, tmp_path, run, version) == want
    assert state_at(sc, tmp_path, run, 0) == {}
    for p in range(PARTS):
        assert {"1.delta", "2.delta", "3.delta"} <= set(version_names(tmp_path / "0" / str(p)))


def test_recomputing_a_partition_gives_the_same_result(spark, tmp_path):
    sc = spark.sparkContext
    run = uuid.uuid4()
    batch_rdd(sc, tmp_path, run, 0, BATCHES[0]).collect()
    rdd = batch_rdd(sc, tmp_path, run, 1, BATCHES[1])
    first = sorted((k, n) for k, n, _ in rdd.collect())
    assert sorted((k, n) for k, n, _ in rdd.collect()) == first  # a second action re-runs every task
    assert rdd.map(lambda t: t[:2]).take(1)[0] in first  # a partial one, too
    assert state_at(sc, tmp_path, run, 2) == expected_counts(*BATCHES[:2])  # version 2 committed again, same
    assert state_at(sc, tmp_path, run, 1) == expected_counts(BATCHES[0])


def test_workers_survive_tasks_that_ignore_or_stop_reading_their_rows(spark, tmp_path):
    """PySpark reuses a worker only if its task read all its input; the output wrapper reads
    the rest, so the stores loaded in a worker stay there."""
    sc = spark.sparkContext
    run = uuid.uuid4()
    pids = set()
    for version in range(3):
        rdd = map_partitions_with_read_state_store(keys_rdd(sc, range(100)), worker_pid, info(tmp_path, run, 0),
                                                   KEY, VALUE, CONF)
        pids |= {pid for pid, _, _ in (rdd.collect() if version % 2 == 0 else rdd.take(1))}
    assert len(pids) <= 2  # local[2]: the two workers of the pool, never a replacement


def test_gets_only_tasks_abort_and_write_nothing(spark, tmp_path):
    sc = spark.sparkContext
    run = uuid.uuid4()
    batch_rdd(sc, tmp_path, run, 0, BATCHES[0]).collect()
    before = files_of(tmp_path)
    out = batch_rdd(sc, tmp_path, run, 1, [3, 17, 99], bump_counts_no_commit).collect()
    assert sorted(out) == [(3, 4), (17, 3), (99, 1)]
    assert files_of(tmp_path) == before
    assert not any(short_name(os.path.basename(name)) == "2.delta" for name in before)
    assert state_at(sc, tmp_path, run, 1) == expected_counts(BATCHES[0])
    # Version 1 is still the one to build on.
    out = batch_rdd(sc, tmp_path, run, 1, [3]).collect()
    assert [(k, n) for k, n, _ in out] == [(3, 4)]


def test_recovery_in_new_worker_processes_loads_from_files(spark, tmp_path):
    """A new session, for statecore, is new Python workers: the registry lives in them, not in
    the JVM. PySpark keys its worker pools by the tasks' environment variables, so a job
    built with another value in ``sc.environment`` runs in a brand-new daemon and workers
    with empty registries; same checkpoint, same run id (as Spark's "recovering from files")."""
    sc = spark.sparkContext
    run = uuid.uuid4()
    old_pids = set()
    for version, batch in enumerate(BATCHES[:2]):
        out = batch_rdd(sc, tmp_path, run, version, batch).collect()
        old_pids |= {pid for _, _, pid in out}
    sc.environment["STATECORE_TEST_FRESH_WORKERS"] = uuid.uuid4().hex
    try:
        loads = glue.load_count_accumulator(sc)
        out = batch_rdd(sc, tmp_path, run, 2, BATCHES[2], load_accumulator=loads).collect()
        new_pids = {pid for _, _, pid in out}
        recovered = state_at(sc, tmp_path, run, 3)  # also fresh workers: built while the variable is set
    finally:
        del sc.environment["STATECORE_TEST_FRESH_WORKERS"]
    assert new_pids and not new_pids & old_pids
    assert loads.value == (0, PARTS)  # every store came from files
    want = expected_counts(*BATCHES)
    assert sorted((k, n) for k, n, _ in out) == sorted((k, want[k]) for k in set(BATCHES[2]))
    assert recovered == want


def test_locations_reach_the_coordinator_and_become_preferences(spark, tmp_path):
    sc = spark.sparkContext
    coordinator = driver.coordinator_for(spark)
    assert driver.coordinator_for(sc).address == coordinator.address  # one per SparkContext
    run = uuid.uuid4()
    plain = batch_rdd(sc, tmp_path, run, 0, BATCHES[0], coordinator=coordinator)
    jsc = sc._jsc.sc()
    assert [str(jsc.getPreferredLocs(plain._jrdd.rdd(), p)) for p in range(PARTS)] == ["List()"] * PARTS
    pids = {pid for _, _, pid in plain.collect()}
    locations = [coordinator.get_location(info(tmp_path, run, 0).provider_id(p)) for p in range(PARTS)]
    assert {loc.rsplit(".", 1)[0] for loc in locations} == {"executor_127.0.0.1_driver"}
    assert {int(loc.rsplit(".", 1)[1]) for loc in locations} <= pids

    # The next batches' tasks prefer where their stores are: a pipelined parent, a text file, a DataFrame.
    loads = glue.load_count_accumulator(sc)
    piloted = batch_rdd(sc, tmp_path, run, 1, BATCHES[1], coordinator=coordinator, load_accumulator=loads)
    assert [str(jsc.getPreferredLocs(piloted._jrdd.rdd(), p)) for p in range(PARTS)] == [
        "List(executor_127.0.0.1_driver)"] * PARTS
    want = expected_counts(*BATCHES[:2])
    assert sorted((k, n) for k, n, _ in piloted.collect()) == sorted((k, want[k]) for k in set(BATCHES[1]))
    assert sum(loads.value) == PARTS
    text = tmp_path / "keys.txt"  # new keys, once each: whichever partition a line lands in is right
    text.write_text("".join(f"{k}\n" for k in range(1000, 1040)))
    lines = sc.textFile(str(text), PARTS).coalesce(PARTS)
    assert lines.getNumPartitions() == PARTS
    out = map_partitions_with_state_store(lines, bump_counts, info(tmp_path, run, 2), KEY, VALUE, CONF,
                                          coordinator).collect()
    assert sorted((k, n) for k, n, _ in out) == [(k, 1) for k in range(1000, 1040)]
    rows = spark.range(2000, 2040, numPartitions=PARTS).rdd.map(lambda row: row.id)  # DataFrame rows
    out = map_partitions_with_state_store(rows, bump_counts, info(tmp_path, run, 3), KEY, VALUE, CONF,
                                          coordinator).collect()
    assert sorted((k, n) for k, n, _ in out) == [(k, 1) for k in range(2000, 2040)]

    # Stopping the query forgets its instances: no preferences any more.
    driver.deactivate(spark, run)
    assert all(coordinator.get_location(info(tmp_path, run, 0).provider_id(p)) is None for p in range(PARTS))
    again = batch_rdd(sc, tmp_path, run, 4, [], worker_pid, coordinator=coordinator)
    assert [str(jsc.getPreferredLocs(again._jrdd.rdd(), p)) for p in range(PARTS)] == ["List()"] * PARTS
    identities = again.collect()
    assert {ident for _, ident, _ in identities} == {("127.0.0.1", "driver")}
    assert all(wid == f"driver.{pid}" for pid, _, wid in identities)


def test_a_coordinator_that_went_away_is_not_fatal(spark, tmp_path):
    sc = spark.sparkContext
    env = RpcEnv()
    coordinator = StateStoreCoordinatorRef.for_driver(env)
    run = uuid.uuid4()
    batch_rdd(sc, tmp_path, run, 0, BATCHES[0], coordinator=coordinator).collect()
    assert coordinator.get_location(info(tmp_path, run, 0).provider_id(0)) is not None
    env.shutdown()
    # Neither the driver nor the workers can reach it now.
    out = batch_rdd(sc, tmp_path, run, 1, BATCHES[1], coordinator=coordinator).collect()
    want = expected_counts(*BATCHES[:2])
    assert sorted((k, n) for k, n, _ in out) == sorted((k, want[k]) for k in set(BATCHES[1]))


def test_the_partition_count_is_checked(spark, tmp_path):
    with pytest.raises(ValueError, match="partitions"):
        map_partitions_with_state_store(spark.sparkContext.parallelize([1], 2), bump_counts,
                                        info(tmp_path, uuid.uuid4(), 0), KEY, VALUE)
