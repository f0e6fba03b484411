"""The benchmark harness: the race's figures and ratios, the plots, ``python -m bench`` end to
end on two micro benchmarks, and one contender of the race and of the event-time race on real
Spark."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from bench import bench_event_time, plots, race
from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


def run_bench(module, args, out, timeout=600):
    """Run ``python -m <module> <args> --json <out>`` from the project root; its JSON payload."""
    done = subprocess.run([sys.executable, "-m", module, *args, "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def fake_result(seconds, commit=0.0):
    return {"batches": [{"seconds": s, "commit_s": commit} for s in seconds], "jvm_peak_bytes": 2**30,
            "python_workers_peak_bytes": 2**29}


def test_summary_takes_the_median_of_the_measured_batches():
    s = race.summarize(fake_result([9.0, 5.0, 1.0, 3.0, 2.0], commit=0.25), rows=1_000_000, first_measured=2)
    assert s["batch_s"] == 2.0  # median of 1, 3, 2: the first two batches are warm-up
    assert s["rows_per_s"] == 500_000
    assert s["commit_s"] == 0.25 and s["jvm_peak_mib"] == 1024 and s["python_workers_peak_mib"] == 512
    assert s["batch_seconds"] == [9.0, 5.0, 1.0, 3.0, 2.0]


def test_ratios_compare_contenders_of_the_same_run():
    table = {
        "floor": {"batch_s": 1.0, "rows_per_s": 1e6},
        "hop_floor": {"batch_s": 1.0 / 1.1, "rows_per_s": 1.1e6},
        "hdfs": {"batch_s": 2.0, "rows_per_s": 5e5, "state_bytes": 400},
        "pandas_state": {"batch_s": 10.0, "rows_per_s": 1e4, "state_bytes": 900},
        "statecore": {"batch_s": 1.1, "rows_per_s": 1e6 / 1.1, "state_bytes": 300},
    }
    restart = {"hdfs": {"restart_cost_s": 20.0}, "statecore": {"restart_cost_s": 0.5}}
    out = race.add_ratios({"race": {"100": table}, "restart": {"1000": restart}})["ratios"]
    assert out["100"]["statecore_batch_over_floor"] == pytest.approx(1.1)
    assert out["100"]["statecore_batch_over_hop_floor"] == pytest.approx(1.21)
    assert "speedup_vs_hop_floor" not in out["100"] and "speedup_vs_floor" not in out["100"]
    assert out["100"]["speedup_vs_hdfs"] == pytest.approx(2 / 1.1)
    assert out["100"]["speedup_vs_pandas_state"] == pytest.approx(100 / 1.1)
    assert out["100"]["state_bytes_vs_hdfs"] == pytest.approx(0.75)
    assert out["restart_1000"] == {"restart_speedup_vs_hdfs": pytest.approx(40.0)}


def test_runs_rotate_the_order_and_keep_each_contender_s_median_run(tmp_path, monkeypatch):
    from bench import race

    calls = []
    times = {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]}

    def fake_run(args, keys, contender, files, slow_files, root, suffix=""):
        calls.append((contender, suffix))
        return {"batch_s": times[contender][sum(1 for c, _ in calls if c == contender) - 1], "run": len(calls)}

    monkeypatch.setattr(race, "run_contender", fake_run)
    monkeypatch.setattr(race, "write_batches", lambda *a, **k: [])
    args = race.parser().parse_args(["--keys", "10", "--contenders", "a,b", "--runs", "3", "--data", str(tmp_path)])
    table = race.race(args, str(tmp_path), {})["race"]["10"]
    assert [c for c, _ in calls] == ["a", "b", "b", "a", "a", "b"]
    assert [s for _, s in calls] == ["-run0", "-run0", "-run1", "-run1", "", ""]
    assert table["a"]["batch_s"] == 2.0 and table["a"]["run_batch_s"] == [3.0, 1.0, 2.0]
    assert table["b"]["batch_s"] == 5.0


def test_a_failed_contender_s_error_names_the_cause_before_its_plan():
    """A failed streaming query's log ends with its plan: the error raised names the
    exceptions logged before it, then the last lines."""
    log = "\n".join([
        "26/11/27 INFO starting", "org.apache.spark.SparkException: the Python worker crashed",
        "\tat org.apache.spark.util.SparkErrorUtils.tryWithSafeFinally(SparkErrorUtils.scala:86)",
        "Caused by: org.apache.spark.SomeInitializationException: initialization failed. Cause:",
        "ImportError: cannot import name 'descriptor' from 'google.protobuf'",
        "ImportError: cannot import name 'descriptor' from 'google.protobuf'",
        *[f"plan line {i}" for i in range(20)]])
    summary = race.failure_summary(log).splitlines()
    assert summary[:5] == ["errors in the log:", "org.apache.spark.SparkException: the Python worker crashed",
                           "Caused by: org.apache.spark.SomeInitializationException: initialization failed. Cause:",
                           "ImportError: cannot import name 'descriptor' from 'google.protobuf'", "its last lines:"]
    assert summary[5:] == [f"plan line {i}" for i in range(5, 20)]
    assert race.failure_summary("a\nb") == "a\nb"


def test_unix_socket_reaches_every_contender_process(tmp_path, monkeypatch):
    from bench import race

    started = []

    def fake_run_in_process(name, contender, source, work, driver_memory, timeout, reuse=False, extra_args=()):
        started.append(list(extra_args))
        return {"batches": [{"seconds": 1.0, "rows": 10}] * 3, "jvm_peak_bytes": 0,
                "python_workers_peak_bytes": 0, "process_s": 1.0}

    monkeypatch.setattr(race, "run_in_process", fake_run_in_process)
    for flags, expected in (([], []), (["--unix-socket"], ["--unix-socket"])):
        args = race.parser().parse_args(["--keys", "10", "--rows", "10", *flags])
        race.run_contender(args, 10, "hop_floor", [], [], str(tmp_path))
        assert started.pop() == expected


def test_input_batches_are_written_once(tmp_path):
    files = race.write_batches(str(tmp_path / "data"), 2, 1000, 50, seed=3)
    table = pq.read_table(files[1])
    assert table.num_rows == 1000 and table.column_names == ["key", "amount"]
    assert 0 <= min(table.column("key").to_pylist()) and max(table.column("key").to_pylist()) < 50
    assert pq.ParquetFile(files[0]).metadata.num_row_groups == 4  # both cores read every file
    before = os.path.getmtime(files[0])
    assert race.write_batches(str(tmp_path / "data"), 2, 1000, 50, seed=3) == files
    assert os.path.getmtime(files[0]) == before
    distinct = race.write_batches(str(tmp_path / "distinct"), 2, 100, None, distinct=True)
    keys = [k for f in distinct for k in pq.read_table(f).column("key").to_pylist()]
    assert sorted(keys) == list(range(200))


def test_plots_are_written(tmp_path):
    payload = {"machine": {"cpu": "test", "cores": 2},
               "race": {"100": {"floor": {"rows_per_s": 1e6, "batch_seconds": [2, 1, 1], "rows_per_batch": 10},
                                "statecore": {"rows_per_s": 9e5, "batch_seconds": [3, 1.1, 1.1],
                                              "rows_per_batch": 10}}},
               "restart": {"1000": {"hdfs": {"restart_cost_s": 5.0}, "statecore": {"restart_cost_s": 0.2}}}}
    path = tmp_path / "race.json"
    path.write_text(json.dumps(payload))
    made = plots.plot("race", str(path), str(tmp_path))
    assert sorted(os.path.basename(p) for p in made) == ["race_batches.png", "race_restart.png",
                                                          "race_rows_per_s.png"]
    for p in made:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_harness_runs_micro_benchmarks_and_writes_results(tmp_path):
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", "rowtable,delta", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["rowtable", "delta"]
    assert all(r["exit_code"] == 0 for r in summary["runs"])
    tables = json.loads((out / "rowtable.json").read_text())["tables"]
    assert any(t.startswith("put 100,000 new keys") for t in tables)
    assert (out / "rowtable.png").exists() and (out / "delta.png").exists()
    assert "RowTable.put_batch" in (out / "rowtable.txt").read_text()


def test_verify_benchmark_runs_its_quick_setting(tmp_path):
    """bench_verify on a tiny checkpoint: both rows timed, verify sound, the ratio recorded."""
    from bench.__main__ import MICRO

    result = run_bench("bench.bench_verify", MICRO["verify"][1], tmp_path / "verify.json", timeout=300)
    (rows,) = result["tables"].values()
    assert [r["name"] for r in rows] == ["read the files' bytes", "statecore verify", "statecore verify --deep"]
    assert result["keys"] == 20000 and result["files"] == 4 * 6 and result["verify_over_read"] > 0


@pytest.mark.spark
@pytest.mark.parametrize("contender", ["statecore", "statecore_connect"])
def test_race_contender_runs_in_its_own_process(tmp_path, contender):
    """The statecore contender end to end on tiny batches, on a classic session and through a
    Spark Connect server of its own: per-batch figures, the operator's commit time (classic:
    under Connect the operator runs in the server's worker), state files, and state that adds
    up."""
    files = race.write_batches(str(tmp_path / "data"), 3, 2000, 300, seed=5)
    work = str(tmp_path / "work")
    race.link_inputs(files, os.path.join(work, "input"))
    result = race.run_in_process("t", contender, os.path.join(work, "input"), work, "1g", timeout=600)
    assert len(result["batches"]) == 3
    assert all(b["rows"] == 2000 and b["seconds"] > 0 for b in result["batches"])
    assert all(b["commit_s"] > 0 for b in result["batches"]) == (contender == "statecore")
    assert result["jvm_peak_bytes"] > 0 and result["python_workers_peak_bytes"] > 0
    assert race.tree_bytes(os.path.join(work, "statecore"), skip=("_output",)) > 0
    from statecore import StateStoreConf, StateStoreId, create_and_init_provider
    import numpy as np
    key = np.dtype([("key", "<i8")])
    value = np.dtype([("count", "<i8"), ("sum", "<i8")])
    total_count = total_sum = 0
    for partition in range(2):
        provider = create_and_init_provider(StateStoreId(os.path.join(work, "statecore"), 0, partition), key, value,
                                            StateStoreConf())
        for _keys, values in provider.get_read_store(3).iter_batches():
            total_count += int(values["count"].sum())
            total_sum += int(values["sum"].sum())
        provider.close()
    amounts = sum(pq.read_table(f).column("amount").to_numpy().sum() for f in files)
    assert (total_count, total_sum) == (6000, int(amounts))


@pytest.mark.spark
def test_race_contender_with_its_state_on_s3_counts_the_requests(tmp_path):
    """``statecore_s3_10ms``: the state in a bucket of a local S3 server its process starts,
    every request delayed: batches run, the state is in the bucket, and the requests of each
    kind are counted (a delta and an output file a partition and batch at least)."""
    files = race.write_batches(str(tmp_path / "data"), 3, 2000, 300, seed=5)
    work = str(tmp_path / "work")
    race.link_inputs(files, os.path.join(work, "input"))
    result = race.run_in_process("t", "statecore_s3_10ms", os.path.join(work, "input"), work, "1g", timeout=600)
    assert len(result["batches"]) == 3 and all(b["rows"] == 2000 for b in result["batches"])
    assert result["state_bytes"] > 0
    assert not os.path.exists(os.path.join(work, "statecore")), "the state went to the local disk"
    assert result["s3_requests"]["PUT"] >= 3 * 2 * 2, result["s3_requests"]


@pytest.mark.spark
def test_hop_floor_contender_runs_in_its_own_process(tmp_path):
    """The hop_floor diagnostic runs its batches (each routed by key into Python, no state)."""
    files = race.write_batches(str(tmp_path / "data"), 2, 1500, 300, seed=6)
    work = str(tmp_path / "work")
    race.link_inputs(files, os.path.join(work, "input"))
    result = race.run_in_process("h", "hop_floor", os.path.join(work, "input"), work, "1g", timeout=600)
    assert [b["rows"] for b in result["batches"]] == [1500, 1500]
    assert all(b["seconds"] > 0 for b in result["batches"])


@pytest.mark.spark
def test_event_time_contender_runs_in_its_own_process(tmp_path):
    """The statecore contender of the event-time race end to end on tiny batches, on session
    windows: per-batch figures, the operator's commit time, state files, and every lagging row
    dropped as late from the third batch on (before that the watermark is still 0)."""
    files = bench_event_time.write_event_batches(str(tmp_path / "data"), 4, 2000, 300, slice_s=60,
                                                 late_fraction=0.05, seed=5)
    work = str(tmp_path / "work")
    race.link_inputs(files, os.path.join(work, "input"))
    result = race.run_in_process("t", "statecore", os.path.join(work, "input"), work, "1g", timeout=600,
                                 module=bench_event_time.MODULE,
                                 extra_args=bench_event_time.worker_args("session", 10, 30, 10))
    assert len(result["batches"]) == 4
    assert all(b["rows"] == 2000 and b["seconds"] > 0 and b["commit_s"] > 0 for b in result["batches"])
    assert result["jvm_peak_bytes"] > 0 and result["python_workers_peak_bytes"] > 0
    assert result["state_bytes"] > 0 and 0 < result["batches"][-1]["state_keys"] <= 300
    lagging = [int((pq.read_table(f).column("ts").cast("int64").to_numpy()
                    < bench_event_time.T0_US + i * 60_000_000).sum()) for i, f in enumerate(files)]
    assert all(n > 0 for n in lagging)
    assert [b["late_rows"] for b in result["batches"]] == [0, 0] + lagging[2:]


def test_repartition_benchmark_runs_small(tmp_path):
    payload = run_bench("bench.bench_repartition", ["--keys", "20000", "--repeat", "1"],
                        tmp_path / "repartition.json")
    assert payload["keys"] == 20000 and payload["ratio_to_anchor"] > 0
    tables = list(payload["tables"].values())
    assert [r["name"] for r in tables[0]][1].startswith("statecore.repartition")
    assert [r["name"] for r in tables[1]] == ["numpy keys % n (no hash)", "spark_partition (Spark's hash, pmod)"]


def test_rewrite_benchmark_runs_small(tmp_path):
    """bench_rewrite on a small state: the anchor and the rewrite both timed, their ratio kept."""
    payload = run_bench("bench.bench_rewrite", ["--keys", "20000", "--repeat", "1"], tmp_path / "rewrite.json")
    assert payload["keys"] == 20000 and payload["ratio_to_anchor"] > 0
    rows = [r["name"] for r in next(iter(payload["tables"].values()))]
    assert rows[0].startswith("anchor") and rows[1].startswith("statecore.rewrite")


def test_levels_benchmark_runs_small(tmp_path):
    """bench_levels on a small state: every row timed, the two walks agreed (it asserts so)."""
    payload = run_bench("bench.bench_levels", ["--rows", "20000", "--batch-rows", "2000", "--repeat", "1"],
                        tmp_path / "levels.json")
    rows = [r["name"] for r in next(iter(payload["tables"].values()))]
    assert rows[0] == "the snapshot alone (no level)" and "6 levels: the compiled walk" in rows
    assert rows[-1].startswith("dict.get")


def test_rowcalls_benchmark_runs_small(tmp_path):
    """bench_rowcalls on a small state: every reader agreed with the dict (it asserts so), the
    reopened ones over the snapshot file, not the image the writing provider published."""
    payload = run_bench("bench.bench_rowcalls", ["--rows", "5000", "--repeat", "1"], tmp_path / "rowcalls.json")
    tables = payload["tables"]
    assert len(tables) == 6  # put, hits and misses, for numeric and bytes rows
    misses = [r["name"] for r in tables["numeric: get 5,000 misses, random order"]]
    assert misses == ["dict: d.get(k)", "store.get(k), update layer (this store's puts)",
                      "store.get(k), empty base (committed, in memory)", "store.get(k), snapshot base (reopened)",
                      "store.get(k), snapshot base with its key filter"]


def test_grouping_benchmark_runs_small(tmp_path):
    """bench_grouping on small batches: the three groupings agreed (it asserts so), and the
    aggregate's task is timed phase by phase (its output by the task's parquet writer and
    pyarrow's default beside it), over Spark's batches and joined."""
    payload = run_bench("bench.bench_grouping", ["--rows", "20000", "--batch-rows", "2000", "--repeat", "2"],
                        tmp_path / "grouping.json")
    tables = list(payload["tables"].values())
    assert [r["name"] for r in tables[0]] == ["group_rows (hash)", "numpy argsort + boundaries", "dict of row lists"]
    assert [r["name"] for r in tables[2]] == ["batches", "finish", "output (parquet_writer)",
                                              "output (pyarrow's default ParquetWriter)", "commit", "maintenance"]
    assert len(tables) == 4 and [r["name"] for r in tables[3]] == [r["name"] for r in tables[2]]  # joined


def test_evolution_benchmark_runs_small(tmp_path):
    """bench_evolution on few rows: convert gave the anchor's bytes (it asserts so), for a value
    change and a re-key, each timed beside its numpy anchor; a first batch after a restart
    with and without a schema change, each leaving the state it should (it asserts so); an eager
    re-key to its new snapshot beside the repartition anchor and a snapshot of the same state
    with no schema change (its state checked too)."""
    payload = run_bench("bench.bench_evolution", ["--rows", "2000", "--repeat", "1"], tmp_path / "evolution.json")
    tables = payload["tables"]
    assert list(tables) == ["value schema: 2,000 rows", "key schema (a re-key): 2,000 rows",
                            "first batch after a restart: 2,000 keys, 200 upserts",
                            "an eager re-key: 2,000 keys, int32 -> int64, to its new snapshot"]
    for rows in list(tables.values())[:2]:
        assert [r["name"] for r in rows] == ["numpy field copies between structured arrays (anchor)",
                                             "convert(plan, rows), the plan made once", "plan(...) then convert"]
    assert len(tables["first batch after a restart: 2,000 keys, 200 upserts"]) == 4
    assert len(tables["an eager re-key: 2,000 keys, int32 -> int64, to its new snapshot"]) == 3


def test_workers_benchmark_runs_small(tmp_path):
    """bench_workers: the four ways of opening a store's next version end with the same
    state (it asserts so), each timed."""
    payload = run_bench("bench.bench_workers", ["--keys", "4000", "--batch-rows", "3000", "--batches", "4"],
                        tmp_path / "workers.json")
    tables = list(payload["tables"].values())
    assert [r["name"] for r in tables[0]] == ["one worker", "two workers, published images",
                                              "two workers, roll forward", "load from files"]


def test_scale_benchmark_runs_small(tmp_path):
    """bench_scale end to end on a tiny state: the built checkpoint opens cold, the store and
    the dict anchor end with the same keys, one row per batch, the page cache was dropped."""
    from bench import bench_scale
    payload = run_bench("bench.bench_scale", ["--keys", "20000", "--batches", "3", "--batch-rows", "2000",
                                              "--tmp", str(tmp_path)], tmp_path / "scale.json")
    new_keys = {int(k) for keys, _ in bench_scale.batches(0, 20000, 3, 2000) for k in keys if k % 2}
    run = payload["raw"]["20000"]["run"]
    assert run["num_keys"] == payload["raw"]["dict"]["num_keys"] == 20000 + len(new_keys)
    assert [b["version"] for b in run["batches"]] == [2, 3, 4]
    assert run["cached_after_evict"] in (0, None)
    row = payload["rows"][0]
    assert row["open_s"] > 0 and row["state_mib"] > row["raw_mib"] and row["probe_present_ns"] > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("statecore-scale-")]


def test_snapshot_benchmark_runs_small(tmp_path):
    """bench_snapshot on a small state: its batch lookups with a tenth of the keys absent
    found exactly the others, with and without the key filter (it asserts so), and the
    writer's scratch table has its two rows."""
    payload = run_bench("bench.bench_snapshot", ["--rows", "20000", "--repeat", "1", "--big-rows", "20000"],
                        tmp_path / "snapshot.json")
    tables = list(payload["tables"].values())
    rows = [r["name"] for r in tables[-2]]
    assert rows == ["dict.get per key (Python loop)", "snapshot get_batch, no key filter",
                    "snapshot get_batch, its key filter asked first"]
    assert [r["name"] for r in tables[-1]] == ["scratch on the heap (the default below an eighth of memory)",
                                               "scratch mapped from an unlinked file (every size)"]


@pytest.mark.spark
def test_spark_file_calls_counts_the_hdfs_store_s_calls_per_batch_and_partition(tmp_path):
    """Spark's HDFS state store with its checkpoint on the counting file system: every batch's
    task creates and renames a delta in each of the two partitions, and the S3A translation
    makes that one PUT, one COPY and one DELETE a batch and partition. Were the checkpoint not on
    ``count://`` (the counter off the path), nothing would be recorded and this fails."""
    from bench import spark_file_calls

    files = race.write_batches(str(tmp_path / "data"), 3, 2000, 300, seed=7)
    race.link_inputs(files, str(tmp_path / "input"))
    classes = spark_file_calls.compile_counting_fs(str(tmp_path / "classes"))
    summary = spark_file_calls.measure("hdfs", spark_file_calls.NO_MAINTENANCE, str(tmp_path / "input"),
                                       str(tmp_path / "work"), classes, "1g", timeout=600)
    assert sorted(summary["per_batch"]) == ["0", "1", "2"]
    for batch, partitions in summary["per_batch"].items():
        for partition in ("0", "1"):
            calls = partitions[partition]
            assert calls["create"] >= 1 and calls["rename"] >= 1 and calls["getFileStatus"] >= 1, (batch, calls)
    for partition in ("0", "1"):
        requests = summary["state_requests"][partition]
        assert (requests["PUT"], requests["COPY"], requests["DELETE"]) == (1, 1, 1), requests
        assert requests["HEAD"] > 0 and requests["LIST"] > 0
    assert summary["state_calls_by_origin"]["maintenance"]["listStatus"] == 0  # maintenance never ran
    assert summary["log_calls"]["create"] >= 2  # an offsets and a commits entry a batch, apart from the state


def test_spark_file_calls_puts_a_maintenance_call_in_the_batch_it_ran_during():
    """A maintenance thread's calls count in the batch whose task or query thread called last
    before them, also when the thread carries the stale batch id of the thread that started it
    (batch 0 here, as Spark's inherited local properties leave it), and a log purge thread's
    stale id moves nothing; a call before any batch counts in the first."""
    from bench import spark_file_calls

    text = "\n".join(["5\t-1\tstream execution thread\tx\tmkdirs\tmissing\t/c/offsets",
                      "10\t3\tExecutor task launch worker for task 0.0\tx\tcreate\tmissing\t/c/state/0/1/.4.delta.tmp",
                      "30\t-1\tstate-store-maintenance-low-priority-0\tx\tlistStatus\t12\t/c/state/0/1",
                      "33\t0\tasync-log-purge\tx\tlistStatus\t104\t/c/offsets",
                      "35\t0\tstate-store-maintenance-high-priority-0\tx\tlistStatus\t12\t/c/state/0/0",
                      "20\t4\tstream execution thread\tx\tgetFileStatus\tfile\t/c/offsets/4", ""])
    calls = spark_file_calls.parse_records(text)
    assert [(c.ms, c.batch) for c in calls] == [(5, 3), (10, 3), (20, 4), (30, 4), (33, 4), (35, 4)]
    counts = spark_file_calls.count_calls(calls, "/c")
    assert counts["state"][4][1]["listStatus"] == 1 and counts["state"][4][0]["listStatus"] == 1
    assert counts["state"][3][1]["create"] == 1 and 0 not in counts["state"]
    assert spark_file_calls.area_of("/c/state/0/0/_metadata/schema", "/c") == ("state", "op")  # the operator's
    assert spark_file_calls.area_of("/c/state/0/0/12.delta", "/c") == ("state", 0)
    assert spark_file_calls.area_of("/c/commits/12", "/c") == ("log", "commits")
    assert counts["log"][3]["mkdirs"] == 1 and counts["log"][4]["getFileStatus"] == 1


def test_spark_file_calls_translates_each_call_to_s3a_requests():
    """S3A's costs: a status probe of a file is a HEAD, of a missing key a HEAD and a LIST; a rename
    in one directory probes, copies and deletes; a listing of 2,500 entries is three LISTs."""
    from bench.spark_file_calls import Call, s3a_requests

    def cost(call, outcome, *paths):
        return {k: n for k, n in s3a_requests(Call(0, 0, "t", "x", call, outcome, paths)).items() if n}

    assert cost("getFileStatus", "file", "/c/a") == {"HEAD": 1}
    assert cost("exists", "missing", "/c/a") == {"HEAD": 1, "LIST": 1}
    assert cost("create", "missing", "/c/a") == {"LIST": 1, "PUT": 1}
    assert cost("rename", "file,missing", "/c/.a.tmp", "/c/a") == {"HEAD": 3, "LIST": 1, "COPY": 1, "DELETE": 1}
    assert cost("listStatus", "2500", "/c") == {"LIST": 3}
    assert cost("open", "file", "/c/a") == {"HEAD": 1, "GET": 1}
    with pytest.raises(ValueError, match="append"):
        cost("append", "file", "/c/a")
