"""One benchmark on two source trees, rounds alternated in one run: the before/after figures a
change that touches a hot path must give.

    python -m bench.compare --before /tmp/old-tree [--after .] [--rounds 3] bench_store --rows 1000000

Each round runs ``python -m bench.<name> ... --json`` once on each tree (in alternating order,
so drift in the machine's load falls on both), each in a fresh interpreter importing that
tree first. The ``before`` tree must be built in place (``python setup.py build_ext
--inplace``). Printed: per table row, the median over rounds of each tree's median time and
the ratio after/before (above 1: slower).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(tree, name, args, json_path):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    # -P: the tree on PYTHONPATH, not the current directory, is what gets imported
    subprocess.run([sys.executable, "-P", "-m", f"bench.{name}", *args, "--json", json_path],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    with open(json_path) as f:
        return json.load(f)["tables"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the source tree before the change (built in place)")
    p.add_argument("--after", default=".", help="the source tree after it (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("benchmark", help="a module of bench/, e.g. bench_store")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    opts = p.parse_args(argv)
    medians = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(opts.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                tree = opts.before if side == "before" else opts.after
                tables = run_once(tree, opts.benchmark, opts.args, os.path.join(scratch, f"{side}.json"))
                for title, rows in tables.items():
                    for row in rows:
                        medians[side].setdefault((title, row["name"]), []).append(row["median_ms"])
            print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)
    print(f"python -m bench.compare --before {opts.before} --after {opts.after} --rounds {opts.rounds} "
          f"{opts.benchmark} {' '.join(opts.args)}")
    print(f"{'table / row':<78} {'before ms':>10} {'after ms':>10} {'after/before':>12}")
    for key, before in medians["before"].items():
        after = medians["after"].get(key)
        if not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        print(f"{(key[0] + ' / ' + key[1])[:78]:<78} {b:>10.2f} {a:>10.2f} {a / b if b else float('nan'):>12.3f}")


if __name__ == "__main__":
    main()
