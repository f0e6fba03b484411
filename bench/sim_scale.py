"""A simulation of statecore at scale: N state partitions over E executors.

    python -m bench.sim_scale [--partitions 10000] [--executors 100] [--cores 4] [--trigger-s 1]
        [--maintenance-s 60] [--min-deltas 10] [--retain 100] [--keys-per-store 100000]
        [--latency-ms 30] [--json PATH]

Nothing in the projection is a guess about the code: every per-store count is measured on
the real code, in this process, then scaled.
1. files: real ``FileStateStoreProvider``s, opened and committed by the operator task's own
   ``_open_stores`` (``pyspark_glue.operator_task``, no Spark) through the executor registry,
   on a local directory reached through fsspec as a remote store is (``bench.fs_counts``);
   every fsspec call is recorded per phase: a store opened while loaded, a store loaded from
   files, a commit, a maintenance pass; files per store directory at steady state.
2. asks: the real ``StateStoreCoordinator`` on an RPC server on 127.0.0.1, the same run
   counting the asks the task path and the maintenance thread make per store.
3. service: the coordinator's rate for the real messages (a verify, a report carrying the
   worker's other stores), asked from client processes; its CPU per ask in this process.
4. snapshot: the time maintenance takes to write (and map and verify) a snapshot of a store
   of ``--snapshot-keys`` keys on local disk.
Then the model: per trigger and per maintenance interval at ``--partitions``, the load on
each resource and the partition count at which each saturates. Assumptions (object-store
latency, request-rate baseline, S3's request mapping) are named in the output and in
``docs/scale.md``.
"""
import argparse
import json
import math
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from unittest import mock

import numpy as np

from bench._common import print_header
from bench.fs_counts import CallLog, counting_store_files, object_store_requests, REQUEST_KINDS, LIST_PAGE_KEYS
from statecore import StateStoreConf, StateStoreId, StateStoreProviderId, create_and_init_provider, registry, rpc
from statecore.coordinator import (ENDPOINT_NAME, ReportActiveInstance, StateStoreCoordinator,
                                   StateStoreCoordinatorRef, provider_id_to_message)

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
ROW_BYTES = KEY.itemsize + VALUE.itemsize
AUTHKEY = b"sim-scale-" + bytes(22)
S3_WRITES_PER_PREFIX_S = 3500  # AWS: at least 3,500 PUT/COPY/POST/DELETE per second per prefix
S3_READS_PER_PREFIX_S = 5500  # and 5,500 GET/HEAD
WRITE_KINDS = ("PUT", "COPY", "DELETE")
SOFT = "(soft) "
PHASES = ("open, loaded", "open, from files", "commit", "maintenance, stores kept", "maintenance, after reloads")


# -- 1 and 2: the real task path over counted files, against the real coordinator ----------------

class CountingCoordinator(StateStoreCoordinator):
    """The coordinator, counting the asks it handles per phase (set by the experiment, which
    asks synchronously, so every ask lands in the phase that made it)."""

    def __init__(self, rpc_env=None):
        super().__init__(rpc_env)
        self.phase = "other"
        self.asks = {}  # phase -> {message name: n}
        self.ids_checked = {}  # phase -> [len(provider_ids_to_check) of each report]

    def receive_and_reply(self, message):
        counts = self.asks.setdefault(self.phase, {})
        counts[type(message).__name__] = counts.get(type(message).__name__, 0) + 1
        if isinstance(message, ReportActiveInstance):
            self.ids_checked.setdefault(self.phase, []).append(len(message.provider_ids_to_check))
        return super().receive_and_reply(message)


class _Updates:
    """``fn`` of the simulated operator: upserts ``rows`` keys of a ``key_space`` per batch."""

    def __init__(self, rows, key_space, seed):
        self.rows, self.key_space = rows, key_space
        self.rng = np.random.default_rng(seed)

    def apply(self, store):
        keys = np.zeros(self.rows, KEY)
        keys["k"] = self.rng.choice(self.key_space, self.rows, replace=False)
        values = np.zeros(self.rows, VALUE)
        values["count"] = 1
        store.put_batch(keys, values)


def _task(root, run_id, batch, num_partitions, conf, address):
    from pyspark_glue.operator_task import PartitionTask
    from pyspark_glue.rdd import StatefulOperatorStateInfo

    info = StatefulOperatorStateInfo(root, run_id, 0, batch, num_partitions)
    return PartitionTask(state_info=info, store_name="default", key_dtype=KEY, value_dtype=VALUE, extra_stores=(),
                         conf=conf, fn=None, arrow_schema=None, output_dir=None, coordinator_address=address,
                         authkey=AUTHKEY, generation=0)


def measure_task_path(stores, batches, maintenance_every, conf, rows=50, key_space=2000, load_batches=None,
                      seed=0, workdir=None):
    """Run ``stores`` partitions of one worker through ``batches`` micro-batches with the
    operator task's ``_open_stores`` and commits, maintenance every ``maintenance_every``
    batches, then ``load_batches`` batches (default: one maintenance period) in which every
    store was unloaded before its task (a task on another worker, or a restart). Returns the
    CallLog, the coordinator's counts, per-phase event counts and the files per store."""
    from pyspark_glue import executor
    from pyspark_glue.operator_task import _open_stores

    load_batches = maintenance_every if load_batches is None else load_batches
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="sim-scale-")
    root, cache = os.path.join(workdir, "state"), os.path.join(workdir, "cache")
    log = CallLog()
    env = rpc.RpcEnv(authkey=AUTHKEY)
    coordinator = CountingCoordinator(env)
    env.setup_endpoint(ENDPOINT_NAME, coordinator)
    updates = _Updates(rows, key_space, seed)
    events = dict.fromkeys(PHASES, 0)
    files_max = {}
    # The maintenance thread never fires by itself: passes run here, at the simulated period.
    conf = StateStoreConf(min_deltas_for_snapshot=conf.min_deltas_for_snapshot,
                          min_versions_to_retain=conf.min_versions_to_retain, maintenance_interval_s=1e6)
    run_id = uuid.UUID(int=seed + 1)
    registry.stop()
    try:
        with mock.patch("statecore.files.open_store_files", counting_store_files(log, cache)):
            executor.ensure_worker_registry(env.address, AUTHKEY)

            def one_batch(batch, unload_first):
                task = _task(root, run_id, batch, stores, conf, env.address)
                for p in range(stores):
                    if unload_first:  # as on another executor: not loaded, no local copy of its snapshot
                        registry.unload(task.state_info.provider_id(p))
                        shutil.rmtree(cache, ignore_errors=True)
                    phase = "open, from files" if unload_first or batch == 0 else "open, loaded"
                    first = batch == 0
                    with log.phase("first open" if first else phase):
                        coordinator.phase = "first open" if first else phase
                        opened, _, _ = _open_stores(task, p)
                    store = opened["default"]
                    updates.apply(store)
                    with log.phase("first commit" if first else "commit"):
                        coordinator.phase = "commit"
                        store.commit()
                    if not first:
                        events[phase] += 1
                        events["commit"] += 1
                if batch % maintenance_every == 0 and batch > 0:
                    phase = "maintenance, after reloads" if unload_first else "maintenance, stores kept"
                    with log.phase(phase):
                        coordinator.phase = phase
                        registry.run_maintenance_now()
                    events[phase] += stores
                for p in range(stores):
                    d = os.path.join(root, "0", str(p))
                    kinds = {}
                    for name in os.listdir(d):
                        kind = ("temporary" if name.startswith(".") else "schema" if name.endswith(".json")
                                else name.rsplit(".", 1)[-1])
                        kinds[kind] = kinds.get(kind, 0) + 1
                    for kind, n in kinds.items():
                        files_max[kind] = max(files_max.get(kind, 0), n)
                return kinds

            for batch in range(batches):
                one_batch(batch, unload_first=False)
            for batch in range(batches, batches + load_batches):
                one_batch(batch, unload_first=True)
        files_end = {}
        for p in range(stores):
            for name in os.listdir(os.path.join(root, "0", str(p))):
                kind = ("temporary" if name.startswith(".") else "schema" if name.endswith(".json")
                        else name.rsplit(".", 1)[-1])
                files_end[kind] = files_end.get(kind, 0) + 1 / stores
        return {"log": log, "asks": coordinator.asks, "ids_checked": coordinator.ids_checked, "events": events,
                "files_per_store_end": files_end, "files_per_store_max": files_max}
    finally:
        registry.stop()
        env.shutdown()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def per_store_counts(result, part_bytes):
    """Per phase: fsspec calls and S3 requests per event (a store opened, a commit, a store's
    maintenance pass), and coordinator asks per event."""
    log, events = result["log"], result["events"]
    out = {}
    for phase in PHASES:
        n = events[phase]
        if not n:
            continue
        calls = log.of(phase)
        out[phase] = {
            "events": n,
            "fsspec_calls": {k: v / n for k, v in sorted(log.call_counts(phase).items())},
            "requests": {k: v / n for k, v in object_store_requests(calls, part_bytes).items()},
            "bytes_written": sum(d.get("bytes", 0) for c, d in calls if c == "open" and d["mode"].startswith("w")) / n,
            "bytes_read": sum(d.get("bytes", 0) for c, d in calls
                              if c in ("cat_file", "get_file") or (c == "open" and d["mode"].startswith("r"))) / n,
            "asks": {k: v / n for k, v in sorted(result["asks"].get(phase, {}).items())},
        }
    return out


# -- 3: the coordinator's service rate ----------------------------------------------------------

def _ask_client(address, kind, ids, run_int, n_instances, start_at, stop_at, threads, out):
    import threading

    def one(i):
        ref = StateStoreCoordinatorRef.for_executor(address, AUTHKEY)
        run = uuid.UUID(int=run_int)
        mine = [StateStoreProviderId(StateStoreId("s3://bucket/checkpoint/state", 0, (i * 7919 + j) % n_instances),
                                     run) for j in range(ids + 1)]
        n = 0
        ref.verify_if_instance_active(mine[0], "7.1234")  # connect before the clock starts
        while time.monotonic() < start_at:
            time.sleep(0.001)
        while time.monotonic() < stop_at:
            for _ in range(32):
                if kind == "verify":
                    ref.verify_if_instance_active(mine[0], "7.1234")
                elif kind == "location":
                    ref.get_location(mine[0])
                else:
                    ref.report_active_instance(mine[0], "10.0.0.7", "7.1234", mine[1:])
            n += 32
        results.append(n)

    results = []
    workers = [threading.Thread(target=one, args=(os.getpid() * 16 + t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(sum(results))


def measure_service(kind, ids, n_instances, procs=2, threads=4, seconds=2.0):
    """``{asks_per_s, server_cpu_us_per_ask}`` of the real coordinator holding ``n_instances``
    instances, asked ``kind`` ("verify", or "report" carrying ``ids`` other provider ids) by
    ``procs`` client processes x ``threads`` threads for ``seconds``."""
    env = rpc.RpcEnv(authkey=AUTHKEY)
    coordinator = StateStoreCoordinator(env)
    env.setup_endpoint(ENDPOINT_NAME, coordinator)
    run = uuid.UUID(int=1)
    for p in range(n_instances):  # a coordinator that knows every store of the query
        provider_id = StateStoreProviderId(StateStoreId("s3://bucket/checkpoint/state", 0, p), run)
        coordinator.instances[provider_id_to_message(provider_id)] = (
            f"10.0.{p % 100 // 256}.{p % 100}", f"{p % 100}.1")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 1.0 + 0.3 * procs
    children = [ctx.Process(target=_ask_client, args=(env.address, kind, ids, 1, n_instances, start_at,
                                                      start_at + seconds, threads, out)) for _ in range(procs)]
    try:
        for c in children:
            c.start()
        while time.monotonic() < start_at:
            time.sleep(0.001)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        done = [out.get(timeout=seconds + 60) for _ in children]
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        for c in children:
            c.join(30)
    finally:
        for c in children:
            if c.is_alive():
                c.terminate()
                c.join()
        env.shutdown()
    asks = sum(done)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"kind": kind, "ids": ids, "asks": asks, "asks_per_s": asks / (t1 - t0),
            "server_cpu_us_per_ask": cpu / asks * 1e6}


# -- 4: snapshot writes -------------------------------------------------------------------------

def measure_snapshot(keys, min_deltas, repeat=3):
    """Median seconds of a maintenance pass that writes (maps, verifies) a snapshot of a store
    of ``keys`` keys on local disk, and the snapshot's bytes."""
    times, sizes = [], []
    for r in range(repeat):
        d = tempfile.mkdtemp(prefix="sim-scale-snap-")
        try:
            conf = StateStoreConf(min_deltas_for_snapshot=min_deltas, maintenance_interval_s=1e6)
            provider = create_and_init_provider(StateStoreId(d, 0, 0), KEY, VALUE, conf)
            k = np.zeros(keys, KEY)
            k["k"] = np.arange(keys) * 7
            v = np.zeros(keys, VALUE)
            store = provider.get_store(0)
            store.put_batch(k, v)
            store.commit()
            rng = np.random.default_rng(r)
            for version in range(1, min_deltas + 2):  # small deltas until a snapshot is due
                store = provider.get_store(version)
                store.put_batch(k[rng.choice(keys, min(1000, keys), replace=False)], v[:min(1000, keys)])
                store.commit()
            t0 = time.perf_counter()
            provider.do_maintenance()
            times.append(time.perf_counter() - t0)
            snaps = [n for n in os.listdir(os.path.join(d, "0", "0")) if n.endswith(".snapshot")]
            assert snaps, "maintenance wrote no snapshot"
            sizes.append(os.path.getsize(os.path.join(d, "0", "0", snaps[0])))
            provider.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return {"keys": keys, "seconds": statistics.median(times), "bytes": statistics.median(sizes)}


# -- the model ----------------------------------------------------------------------------------

def _total(requests, kinds=REQUEST_KINDS):
    return sum(requests[k] for k in kinds)


def project(args, counts, service, snapshots, files_per_store):
    """The load at ``args.partitions`` on each resource, from the measured per-store figures."""
    n, e, c = args.partitions, args.executors, args.cores
    workers = e * c
    per_worker = n / workers  # stores per Python worker (each has its own registry)
    per_executor = n / e
    lat = args.latency_ms / 1e3
    hit = args.reuse  # share of tasks that find their store loaded in their worker
    loaded, loading, commit, kept, reloaded = (counts[p] for p in PHASES)
    maint = {"requests": {k: hit * kept["requests"][k] + (1 - hit) * reloaded["requests"][k] for k in REQUEST_KINDS},
             "asks": {k: hit * kept["asks"].get(k, 0) + (1 - hit) * reloaded["asks"].get(k, 0)
                      for k in ("VerifyIfInstanceActive",)},
             "snapshots": hit * kept["snapshots"] + (1 - hit) * reloaded["snapshots"]}
    opened_req = {k: hit * loaded["requests"][k] + (1 - hit) * loading["requests"][k] for k in REQUEST_KINDS}
    per_batch_req = {k: opened_req[k] + commit["requests"][k] for k in REQUEST_KINDS}
    asks_open = {k: hit * loaded["asks"].get(k, 0) + (1 - hit) * loading["asks"].get(k, 0)
                 for k in ("VerifyIfInstanceActive", "ReportActiveInstance")}
    rows = {}

    # coordinator
    t_verify = service["verify"]["server_cpu_us_per_ask"] / 1e6
    slope = (service["report_full"]["server_cpu_us_per_ask"] - service["report_0"]["server_cpu_us_per_ask"]) / max(
        1, service["report_full"]["ids"])
    def t_report(ids):
        return (service["report_0"]["server_cpu_us_per_ask"] + slope * ids) / 1e6
    ids_steady = per_worker - 1  # a report carries every other store loaded in the worker
    asks_per_trigger = n * (asks_open["VerifyIfInstanceActive"] + asks_open["ReportActiveInstance"])
    coord_s_per_trigger = n * (asks_open["VerifyIfInstanceActive"] * t_verify
                               + asks_open["ReportActiveInstance"] * t_report(ids_steady))
    maint_asks = n * maint["asks"].get("VerifyIfInstanceActive", 0)
    coord_busy = coord_s_per_trigger / args.trigger_s + maint_asks * t_verify / args.maintenance_s
    restart_drain_s = n * t_report(ids_steady / 2)  # each worker's list grows from 0 as it loads
    rows["coordinator"] = {
        "asks_per_trigger": asks_per_trigger, "asks_per_s": asks_per_trigger / args.trigger_s
        + maint_asks / args.maintenance_s, "ids_per_report": ids_steady,
        "cpu_s_per_trigger": coord_s_per_trigger, "utilization": coord_busy,
        "restart_asks": n, "restart_drain_s": restart_drain_s,
        "capacity_asks_per_s_verify": 1 / t_verify, "capacity_asks_per_s_report": 1 / t_report(ids_steady),
        "driver_locations_s_per_batch": n / service["location_serial"]["asks_per_s"],
    }

    # object store: requests per trigger, against S3's per-prefix baseline
    reqs_per_trigger = {k: n * per_batch_req[k] for k in REQUEST_KINDS}
    maint_reqs = {k: n * maint["requests"][k] for k in REQUEST_KINDS}
    writes_s = (_total(reqs_per_trigger, WRITE_KINDS) / args.trigger_s
                + _total(maint_reqs, WRITE_KINDS) / args.maintenance_s)
    reads_s = (_total(reqs_per_trigger, ("LIST", "HEAD", "GET")) / args.trigger_s
               + _total(maint_reqs, ("LIST", "HEAD", "GET")) / args.maintenance_s)
    restart_reqs = {k: n * loading["requests"][k] for k in REQUEST_KINDS}
    rows["object_store"] = {
        "requests_per_trigger": reqs_per_trigger, "requests_per_maintenance": maint_reqs,
        "writes_per_s": writes_s, "reads_per_s": reads_s,
        "write_prefixes_needed": writes_s / S3_WRITES_PER_PREFIX_S,
        "read_prefixes_needed": reads_s / S3_READS_PER_PREFIX_S,
        "restart_requests": restart_reqs,
        "restart_prefixes_needed_in_10s": _total(restart_reqs, ("LIST", "HEAD", "GET")) / 10 / S3_READS_PER_PREFIX_S,
    }

    # task round trips: a core runs its per_worker tasks one after another each trigger
    per_task_s = _total(per_batch_req) * lat
    batch_floor_s = per_worker * per_task_s
    rows["tasks"] = {"requests_per_task": _total(per_batch_req), "round_trip_s_per_task": per_task_s,
                     "batch_floor_s": batch_floor_s, "utilization": batch_floor_s / args.trigger_s,
                     "restart_load_s_per_worker": per_worker * _total(loading["requests"]) * lat}

    # maintenance: one thread per worker, over its stores, every maintenance interval
    snap = _snapshot_cost(snapshots, args.keys_per_store)
    snaps_per_pass = maint["snapshots"]  # snapshots written per store per pass (measured)
    pass_s = per_worker * (_total(maint["requests"]) * lat + snaps_per_pass * snap["seconds"]
                           + snaps_per_pass * snap["bytes"] / (args.bandwidth_mib_s * 2**20) * 2)
    rows["maintenance"] = {"stores_per_thread": per_worker, "threads_per_executor": c,
                           "requests_per_store_pass": _total(maint["requests"]),
                           "snapshot_s": snap["seconds"], "snapshot_bytes": snap["bytes"],
                           "pass_s": pass_s, "utilization": pass_s / args.maintenance_s,
                           "stores_per_executor": per_executor}

    # files and listings
    files_total = n * sum(files_per_store.values())
    rows["files"] = {"per_store": files_per_store, "total": files_total,
                     "list_pages_per_store": math.ceil(sum(files_per_store.values()) / LIST_PAGE_KEYS),
                     "list_pages_whole_checkpoint": math.ceil(files_total / LIST_PAGE_KEYS),
                     "list_whole_checkpoint_s_serial": math.ceil(files_total / LIST_PAGE_KEYS) * lat,
                     "store_lists_per_trigger": reqs_per_trigger["LIST"]}

    limits = {"coordinator CPU (one core)": rows["coordinator"]["utilization"],
              "task round trips vs trigger": rows["tasks"]["utilization"],
              "maintenance thread duty": rows["maintenance"]["utilization"],
              SOFT + "object-store writes vs one prefix's baseline": rows["object_store"]["write_prefixes_needed"],
              SOFT + "object-store reads vs one prefix's baseline": rows["object_store"]["read_prefixes_needed"]}
    rows["limits"] = {k: {"utilization": u, "saturates_at_partitions": n / u if u else float("inf")}
                      for k, u in sorted(limits.items(), key=lambda kv: -kv[1])}
    return rows


def _snapshot_cost(snapshots, keys):
    """A snapshot's write time and size at ``keys``, scaled linearly from the nearest measured size."""
    nearest = min(snapshots, key=lambda s: abs(math.log(s["keys"]) - math.log(keys)))
    f = keys / nearest["keys"]
    return {"seconds": nearest["seconds"] * f, "bytes": nearest["bytes"] * f}


# -- output -------------------------------------------------------------------------------------

def _fmt(x):
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def print_counts(counts):
    print("\nMeasured per store (real provider, registry, task path and coordinator; fsspec calls counted):")
    print(f"{'phase':<18} {'events':>6}  {'fsspec calls per event':<58} {'S3 requests per event':<44} asks per event")
    for phase, c in counts.items():
        calls = ", ".join(f"{k} {v:.3g}" for k, v in c["fsspec_calls"].items())
        reqs = ", ".join(f"{k} {v:.3g}" for k, v in c["requests"].items() if v)
        asks = ", ".join(f"{k.replace('InstanceActive', '').replace('ActiveInstance', '')} {v:.3g}"
                         for k, v in c["asks"].items()) or "-"
        print(f"{phase:<18} {c['events']:>6}  {calls:<58} {reqs:<44} {asks}")


def print_projection(args, rows, service, snapshots):
    n, e = args.partitions, args.executors
    print(f"\nProjection: {n:,} partitions over {e} executors x {args.cores} cores "
          f"({n / e:,.0f} stores per executor, {n / e / args.cores:,.0f} per worker); trigger {args.trigger_s:g} s, "
          f"maintenance every {args.maintenance_s:g} s, store reused by its worker in {args.reuse:.0%} of tasks; "
          f"object-store request {args.latency_ms:g} ms")
    co, ob, ta, ma, fi = (rows[k] for k in ("coordinator", "object_store", "tasks", "maintenance", "files"))
    table = [
        ("coordinator", "asks per trigger (steady)", co["asks_per_trigger"]),
        ("coordinator", "asks/s (steady, incl. maintenance verifies)", co["asks_per_s"]),
        ("coordinator", "ids carried per report", co["ids_per_report"]),
        ("coordinator", "capacity, verify asks/s (server CPU)", co["capacity_asks_per_s_verify"]),
        ("coordinator", "capacity, report asks/s (server CPU)", co["capacity_asks_per_s_report"]),
        ("coordinator", "busy share of one core (steady)", co["utilization"]),
        ("coordinator", "rdd path: driver's get_location per batch, s", co["driver_locations_s_per_batch"]),
        ("coordinator", "full restart: reports / drain s", f"{co['restart_asks']:,} / {co['restart_drain_s']:.2f}"),
        ("object store", "requests per trigger", _total(ob["requests_per_trigger"])),
        ("object store", "  of which LIST / HEAD / GET", " / ".join(
            _fmt(ob["requests_per_trigger"][k]) for k in ("LIST", "HEAD", "GET"))),
        ("object store", "  of which PUT / COPY / DELETE", " / ".join(
            _fmt(ob["requests_per_trigger"][k]) for k in WRITE_KINDS)),
        ("object store", "writes/s; prefixes' worth at 3,500/s", f"{ob['writes_per_s']:,.0f}; "
                                                                   f"{ob['write_prefixes_needed']:.1f}"),
        ("object store", "reads/s; prefixes' worth at 5,500/s", f"{ob['reads_per_s']:,.0f}; "
                                                                  f"{ob['read_prefixes_needed']:.1f}"),
        ("object store", "full restart: requests", _total(ob["restart_requests"])),
        ("tasks", "requests per task (open + commit)", ta["requests_per_task"]),
        ("tasks", "round trips per task, s", ta["round_trip_s_per_task"]),
        ("tasks", "per core per trigger (batch floor), s", ta["batch_floor_s"]),
        ("tasks", "full restart: load per worker, s", ta["restart_load_s_per_worker"]),
        ("maintenance", f"snapshot of {args.keys_per_store:,} keys, s / MB",
         f"{ma['snapshot_s']:.3f} / {ma['snapshot_bytes'] / 1e6:.1f}"),
        ("maintenance", "requests per store per pass", ma["requests_per_store_pass"]),
        ("maintenance", "one pass of one worker's thread, s", ma["pass_s"]),
        ("maintenance", "duty cycle of each thread", ma["utilization"]),
        ("files", "per store (steady state)", ", ".join(f"{k} {v:.1f}" for k, v in sorted(fi["per_store"].items()))),
        ("files", "whole checkpoint", fi["total"]),
        ("files", "LIST pages: one store / whole checkpoint", f"{fi['list_pages_per_store']} / "
                                                              f"{fi['list_pages_whole_checkpoint']:,}"),
        ("files", "whole-checkpoint listing, serial, s", fi["list_whole_checkpoint_s_serial"]),
    ]
    print(f"{'resource':<13} {'figure':<44} {'value':>22}")
    for resource_name, what, value in table:
        print(f"{resource_name:<13} {what:<44} {_fmt(value):>22}")
    print(f"\n{'limit (share of capacity at this scale; >1 = saturated)':<58} {'load':>8} {'saturates at':>14}")
    for name, lim in rows["limits"].items():
        print(f"{name:<58} {lim['utilization']:>8.3g} {lim['saturates_at_partitions']:>14,.0f}")
    first = next(k for k in rows["limits"] if not k.startswith(SOFT))
    print(f"first hard limit to saturate: {first} ({SOFT.strip()} rows: S3 adds capacity per prefix as the load "
          f"persists, answering 503 SlowDown until it has)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--partitions", type=int, default=10_000)
    p.add_argument("--executors", type=int, default=100)
    p.add_argument("--cores", type=int, default=4, help="cores (Python workers, each with its registry) per executor")
    p.add_argument("--trigger-s", type=float, default=1.0, help="micro-batch trigger interval")
    p.add_argument("--maintenance-s", type=float, default=StateStoreConf().maintenance_interval_s)
    p.add_argument("--min-deltas", type=int, default=StateStoreConf().min_deltas_for_snapshot)
    p.add_argument("--retain", type=int, default=StateStoreConf().min_versions_to_retain)
    p.add_argument("--keys-per-store", type=int, default=100_000)
    p.add_argument("--reuse", type=float, default=None,
                   help="share of tasks that find their store loaded (default: 1/workers, StatefulOperator's "
                        "random placement)")
    p.add_argument("--latency-ms", type=float, default=30.0, help="object-store request latency (assumption)")
    p.add_argument("--bandwidth-mib-s", type=float, default=100.0, help="per-worker object-store bandwidth")
    p.add_argument("--part-mib", type=float, default=50.0, help="multipart threshold of the writer (s3fs: 50)")
    p.add_argument("--sim-stores", type=int, default=4, help="stores in the measured worker")
    p.add_argument("--sim-batches", type=int, default=0,
                   help="measured batches (default: enough to fill the retention window twice)")
    p.add_argument("--snapshot-keys", default="100000,1000000")
    p.add_argument("--service-seconds", type=float, default=2.0)
    p.add_argument("--service-procs", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.reuse is None:
        args.reuse = 1 / (args.executors * args.cores)
    header = print_header(f"sim_scale: {args.partitions:,} partitions over {args.executors} executors")
    maintenance_every = max(1, round(args.maintenance_s / args.trigger_s))
    batches = args.sim_batches or 2 * (args.retain + args.min_deltas + maintenance_every) + 1
    conf = StateStoreConf(min_deltas_for_snapshot=args.min_deltas, min_versions_to_retain=args.retain)
    t0 = time.perf_counter()
    result = measure_task_path(args.sim_stores, batches, maintenance_every, conf)
    counts = per_store_counts(result, args.part_mib * 2**20)
    for phase in PHASES[3:]:
        written = sum(1 for ph, call, d in result["log"].calls
                      if ph == phase and call == "open" and d["mode"].startswith("w"))
        counts[phase]["snapshots"] = written / result["events"][phase]
    print(f"# measured {batches} + {maintenance_every} batches of {args.sim_stores} stores in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print_counts(counts)
    ids = [n for phase, lens in result["ids_checked"].items() if phase.startswith("open") for n in lens]
    print(f"other provider ids carried per report: mean {statistics.fmean(ids):.2f}, max {max(ids)} "
          f"({args.sim_stores} stores loaded in the worker)")
    print(f"files per store directory at the end (mean): "
          f"{', '.join(f'{k} {v:.1f}' for k, v in sorted(result['files_per_store_end'].items()))}; "
          f"most seen at once: {', '.join(f'{k} {v}' for k, v in sorted(result['files_per_store_max'].items()))}")
    per_worker = max(1, round(args.partitions / (args.executors * args.cores)))
    service = {"verify": measure_service("verify", 0, args.partitions, args.service_procs, 4, args.service_seconds),
               "report_0": measure_service("report", 0, args.partitions, args.service_procs, 4,
                                           args.service_seconds),
               "report_full": measure_service("report", per_worker - 1, args.partitions, args.service_procs, 4,
                                              args.service_seconds),
               # the driver asks where each partition's store is, one after another (rdd.preferred_locations)
               "location_serial": measure_service("location", 0, args.partitions, 1, 1, args.service_seconds)}
    print(f"\nCoordinator service ({args.service_procs} client processes x 4 threads, {args.partitions:,} "
          f"instances known; the clients share this machine's cores):")
    print(f"{'ask':<28} {'asks/s':>10} {'server CPU us/ask':>18}")
    for s in service.values():
        name = {"verify": "verify", "location": "get_location, 1 thread"}.get(
            s["kind"], f"report, {s['ids']} ids to check")
        print(f"{name:<28} {s['asks_per_s']:>10,.0f} {s['server_cpu_us_per_ask']:>18.1f}")
    snapshots = [measure_snapshot(int(k), args.min_deltas) for k in args.snapshot_keys.split(",")]
    print("\nSnapshot written by a maintenance pass (local disk; write + map + verify):")
    for s in snapshots:
        print(f"  {s['keys']:>10,} keys: {s['seconds'] * 1e3:8.1f} ms, {s['bytes'] / 1e6:.1f} MB")
    rows = project(args, counts, service, snapshots, result["files_per_store_end"])
    print_projection(args, rows, service, snapshots)
    if args.json:
        payload = {"machine": header, "argv": sys.argv, "args": vars(args), "counts": counts,
                   "files_per_store_end": result["files_per_store_end"],
                   "files_per_store_max": result["files_per_store_max"],
                   "service": service, "snapshots": snapshots, "projection": rows}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)


if __name__ == "__main__":
    main()
