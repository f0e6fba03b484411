"""RPC on loopback: statecore.rpc against multiprocessing.connection (Listener/Client with an
authkey), in the same run, with clients in several processes.

    python -m bench.bench_rpc [--seconds 2] [--procs 1,2,4] [--threads 1,4] [--modes ask,send] [--json PATH]

For each (client processes x threads per process):
1. ask: every thread asks an echo endpoint as fast as it can for ``--seconds``; asks/s
   (aggregate) and the p50/p99 latency of one ask;
2. send: every thread sends one-way messages for ``--seconds``, then asks for the number
   the server counted from it (the ask is a flush); sends/s up to that answer, and a check
   that nothing was lost. Also, for statecore: ``flush s`` (from the end of sending to the
   last flush answer: the backlog the senders left), ``queue`` (the endpoint's longest
   queue, sampled every 5 ms) and ``RSS MiB`` (the server process's peak resident size).
The message is a coordinator-sized tuple (a provider id, a host, an executor id). The
server is this process: for statecore one endpoint, which handles one message at a time
as the coordinators' endpoints do; for multiprocessing.connection a thread per
connection, with no such serialization. statecore's threads of one process share one
connection (as refs do); each multiprocessing thread has its own (its connections are not
thread-safe). ``relative`` is statecore's rate over multiprocessing's for the same clients.
The machine should be otherwise idle: the clients and the server share its cores.

With ``--json``, each row also has ``name`` (system and clients) and ``median_ms``: the time
1000 operations took, all clients together (1e6 / ops_per_s), the figure ``bench.compare``
sets side by side, so that its after/before ratio is above 1 when the rate fell.
"""
import argparse
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Client, Listener

from bench._common import print_header, write_json
from statecore import rpc

MESSAGE = ("file:///tmp/checkpoint/state", 0, 17, "default", "3f9c1a52-5a1e-4c1b-9b0e-2d6f1c8e7a10",
           "10.0.0.17", "executor-3")
START_DELAY_S = 0.5  # time for every client to be ready before the common start


class Counter(rpc.RpcEndpoint):
    """Echoes asks; counts one-way messages per sender; ("count", sender) answers the count."""

    def __init__(self):
        self.counts = {}

    def receive(self, message):
        sender = message[1]
        self.counts[sender] = self.counts.get(sender, 0) + 1

    def receive_and_reply(self, message):
        if message[0] == "count":
            return self.counts.get(message[1], 0)
        return message


def _serve_mp(listener, counts, stop):
    """multiprocessing.connection server: a thread per accepted connection."""
    threads = []
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError, multiprocessing.AuthenticationError):
            if stop.is_set():
                break
            continue
        if stop.is_set():
            conn.close()
            break
        t = threading.Thread(target=_serve_mp_conn, args=(conn, counts), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def _serve_mp_conn(conn, counts):
    with conn:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            op = message[0]
            if op == "echo":
                conn.send(message)
            elif op == "add":
                counts[message[1]] = counts.get(message[1], 0) + 1
            elif op == "count":
                conn.send(counts.get(message[1], 0))


# -- client processes --------------------------------------------------------------------------

def _client_thread(system, mode, address, authkey, sender, start_at, stop_at, out):
    if system == "statecore":
        ref = rpc.endpoint_ref(address, "bench", authkey)
        ask, send = ref.ask, ref.send
        flush = lambda: ref.ask(("count", sender))  # noqa: E731
    else:
        conn = Client(address, authkey=authkey)

        def ask(message):
            conn.send(message)
            return conn.recv()

        send = conn.send

        def flush():
            conn.send(("count", sender))
            return conn.recv()
    if system == "statecore":
        ask(("echo", MESSAGE))  # connect before the clock starts (shared by the process's threads)
    latencies, n = [], 0
    clock = time.perf_counter
    while time.monotonic() < start_at:
        time.sleep(0.001)
    if mode == "ask":
        message = ("echo", MESSAGE)
        while True:
            t0 = clock()
            reply = ask(message)
            latencies.append(clock() - t0)
            n += 1
            if n & 63 == 0 and time.monotonic() >= stop_at:
                break
        assert reply[0] == "echo" and list(reply[1]) == list(MESSAGE)  # tuples may come back as lists
    else:
        message = ("add", sender, MESSAGE)
        while True:
            send(message)
            n += 1
            if n & 255 == 0 and time.monotonic() >= stop_at:
                break
        counted = flush()
        assert counted == n, f"{sender}: sent {n}, the server counted {counted}"
    end = time.monotonic()
    if system != "statecore":
        conn.close()
    out.append((n, end, latencies))


def _client_process(system, mode, address, authkey, threads, tag, start_at, seconds, results):
    out = []
    workers = [threading.Thread(target=_client_thread,
                                args=(system, mode, address, authkey, f"{tag}-{i}", start_at, start_at + seconds, out))
               for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    results.put(out)


# -- one measurement ---------------------------------------------------------------------------

def _reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM to the current size
            f.write("5")
    except OSError:
        pass


def _peak_rss_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _sample_queue(dispatcher, stop, peak):
    """The longest the endpoint's queue gets (white box, so it works on older statecore too)."""
    while not stop.wait(0.005):
        peak[0] = max(peak[0], len(dispatcher.queue))


def run(ctx, system, mode, procs, threads, seconds):
    """{ops_per_s, p50_us, p99_us, ops} of one (system, mode, procs, threads) run."""
    authkey = b"bench-" + bytes(26)
    _reset_peak_rss()
    if system == "statecore":
        env = rpc.RpcEnv(authkey=authkey)
        env.setup_endpoint("bench", Counter())
        address = env.address
        sampling, queue_peak = threading.Event(), [0]
        sampler = threading.Thread(target=_sample_queue, args=(env._endpoints["bench"], sampling, queue_peak))
        sampler.start()
    else:
        listener = Listener(("127.0.0.1", 0), backlog=128, authkey=authkey)  # the default backlog of 1 drops clients
        address, stop, counts = listener.address, threading.Event(), {}
        server = threading.Thread(target=_serve_mp, args=(listener, counts, stop), daemon=True)
        server.start()
    results = ctx.Queue()
    start_at = time.monotonic() + START_DELAY_S + 0.3 * procs
    children = [ctx.Process(target=_client_process,
                            args=(system, mode, address, authkey, threads, f"p{p}", start_at, seconds, results))
                for p in range(procs)]
    try:
        for c in children:
            c.start()
        outs = [results.get(timeout=START_DELAY_S + 0.3 * procs + seconds + 60) for _ in children]
        for c in children:
            c.join(60)
            assert c.exitcode == 0, f"client process failed ({c.exitcode})"
    except BaseException:
        for c in children:
            if c.is_alive():
                c.terminate()
                c.join()
        raise
    finally:
        if system == "statecore":
            sampling.set()
            sampler.join()
            env.shutdown()
        else:
            stop.set()
            socket.create_connection(address).close()  # wakes the accept; the clients have all hung up
            server.join()
            listener.close()
    rows = [row for out in outs for row in out]
    assert len(rows) == procs * threads, "a client thread failed (see its traceback above)"
    ops = sum(n for n, _, _ in rows)
    elapsed = max(end for _, end, _ in rows) - start_at
    latencies = sorted(x for _, _, lat in rows for x in lat)
    result = {"system": system, "mode": mode, "procs": procs, "threads": threads, "ops": ops,
              "ops_per_s": ops / elapsed, "elapsed_s": elapsed, "server_peak_rss_mib": _peak_rss_mib()}
    if mode == "send":
        result["flush_s"] = max(end for _, end, _ in rows) - (start_at + seconds)
    if system == "statecore":
        result["queue_peak"] = queue_peak[0]
    if latencies:
        result["p50_us"] = latencies[len(latencies) // 2] * 1e6
        result["p99_us"] = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6
        result["mean_us"] = statistics.fmean(latencies) * 1e6
    return result


class ResultTable:
    """Rows of one mode; ``relative`` is the row's rate over multiprocessing.connection's rate
    for the same clients."""

    def __init__(self, title):
        self.title, self.rows = title, []

    def add(self, row):
        self.rows.append(row)

    def summary(self):
        base = {(r["procs"], r["threads"]): r["ops_per_s"] for r in self.rows if r["system"] != "statecore"}
        out = []
        for r in self.rows:
            b = base.get((r["procs"], r["threads"]))
            name = "statecore.rpc" if r["system"] == "statecore" else "multiprocessing.connection"
            out.append({**r, "relative": r["ops_per_s"] / b if b else float("nan"),
                        "name": f"{name} {r['procs']} proc x {r['threads']} thr",
                        "median_ms": 1e6 / r["ops_per_s"]})
        return out

    def print(self):
        print(f"\n{self.title}", flush=True)
        print(f"{'clients':<16} {'system':<26} {'ops/s':>9} {'p50 us':>8} {'p99 us':>8} {'relative':>8} "
              f"{'flush s':>8} {'queue':>8} {'RSS MiB':>8}")
        for r in self.summary():
            clients = f"{r['procs']} proc x {r['threads']} thr"
            p50 = f"{r['p50_us']:.0f}" if "p50_us" in r else "-"
            p99 = f"{r['p99_us']:.0f}" if "p99_us" in r else "-"
            flush = f"{r['flush_s']:.2f}" if "flush_s" in r else "-"
            queue = f"{r['queue_peak']:,}" if "queue_peak" in r else "-"
            name = "statecore.rpc" if r["system"] == "statecore" else "multiprocessing.connection"
            print(f"{clients:<16} {name:<26} {r['ops_per_s']:>9,.0f} {p50:>8} {p99:>8} {r['relative']:>7.2f}X "
                  f"{flush:>8} {queue:>8} {r['server_peak_rss_mib']:>8.0f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="measured seconds per run (default %(default)s)")
    p.add_argument("--procs", default="1,2,4", help="client process counts (default %(default)s)")
    p.add_argument("--threads", default="1,4", help="threads per client process (default %(default)s)")
    p.add_argument("--modes", default="ask,send")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    procs = [int(x) for x in args.procs.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    header = print_header(f"RPC on loopback, {args.seconds:g} s per run; clients {args.procs} processes x "
                          f"{args.threads} threads")
    ctx = multiprocessing.get_context("spawn")
    tables = []
    for mode in args.modes.split(","):
        table = ResultTable(f"{mode}: {'echo asks (round trips)' if mode == 'ask' else 'one-way sends + final flush'}")
        for n_procs in procs:
            for n_threads in threads:
                for system in ("multiprocessing", "statecore"):
                    row = run(ctx, system, mode, n_procs, n_threads, args.seconds)
                    print(f"  {mode} {system} {n_procs}x{n_threads}: {row['ops_per_s']:,.0f}/s", file=sys.stderr,
                          flush=True)
                    table.add(row)
        table.print()
        tables.append(table)
    if args.json:
        write_json(args.json, header, tables)


if __name__ == "__main__":
    main()
