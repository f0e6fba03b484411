"""What every benchmark shares: the machine header, timing, and the results table.

Each benchmark compares statecore with the obvious alternative in the same run; the first
row of a table is the baseline and ``relative`` is its time divided by the row's time.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np


def machine_header():
    """CPU, cores, OS, Python, numpy, Cython and statecore commit, as a dict."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import Cython
        cython_version = Cython.__version__
    except ImportError:
        cython_version = "not installed"
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=5).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if dirty:
            commit += "+dirty"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cython": cython_version,
        "statecore_commit": commit,
    }


def print_header(title):
    h = machine_header()
    print(f"# {title}")
    print(f"# {h['cpu']}, {h['cores']} cores; {h['os']}; Python {h['python']}; numpy {h['numpy']}; "
          f"Cython {h['cython']}; statecore {h['statecore_commit']}")
    return h


def measure(fn, repeat, setup=None):
    """Seconds per call of ``fn()`` over ``repeat`` runs (``setup()`` before each, untimed)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_alternated(fns, repeat, setup=None):
    """``measure`` of each of ``fns`` in turn, round by round (one call of each per round), so
    that a drift of the machine's load falls on all of them alike: a list of times per fn.
    ``setup()`` before each call, untimed."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return times


class Table:
    """Rows of (name, times) for one operation over ``n`` items; prints best/median/stdev."""

    def __init__(self, title, n, unit="rows"):
        self.title, self.n, self.unit, self.rows = title, n, unit, []

    def add(self, name, times):
        self.rows.append((name, times))

    def summary(self):
        base = statistics.median(self.rows[0][1])
        out = []
        for name, times in self.rows:
            med = statistics.median(times)
            out.append({
                "name": name, "best_ms": min(times) * 1e3, "median_ms": med * 1e3,
                "stdev_ms": statistics.stdev(times) * 1e3 if len(times) > 1 else 0.0,
                "m_per_s": self.n / med / 1e6 if med else float("inf"),
                "ns_per_item": med / self.n * 1e9 if self.n else 0.0,
                "relative": base / med if med else float("inf"),
            })
        return out

    def print(self):
        width = max(len(self.title), *(len(n) for n, _ in self.rows))
        print(f"\n{self.title:<{width}}  {'best ms':>9} {'median ms':>10} {'stdev':>7} "
              f"{'M' + self.unit + '/s':>10} {'ns/' + self.unit.rstrip('s'):>8} {'relative':>8}")
        for r in self.summary():
            print(f"{r['name']:<{width}}  {r['best_ms']:>9.2f} {r['median_ms']:>10.2f} {r['stdev_ms']:>7.2f} "
                  f"{_num(r['m_per_s']):>10} {_num(r['ns_per_item']):>8} {r['relative']:>7.1f}X")


def _num(x):
    """Two decimals for ordinary figures, three significant digits for tiny or huge ones."""
    return f"{x:.2f}" if 0.1 <= abs(x) < 1e5 else f"{x:.3g}"


def arg_parser(description, rows=1_000_000, repeat=7):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rows", type=int, default=rows, help="rows per operation (default %(default)s)")
    p.add_argument("--repeat", type=int, default=repeat, help="timed runs per row (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def write_json(path, header, tables, extra=None):
    payload = {"machine": header, "argv": sys.argv, "tables": {t.title: t.summary() for t in tables}}
    if extra:
        payload.update(extra)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
