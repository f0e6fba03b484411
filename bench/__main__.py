"""Run the benchmarks: ``python -m bench [--quick] [--only a,b] [--out DIR]``.

Each micro benchmark runs in its own interpreter (``python -m bench.bench_<name> ... --json``),
its table printed as it goes and kept as ``<out>/<name>.txt`` and ``<out>/<name>.json``; the
end-to-end race (:mod:`bench.race`) writes ``<out>/race.json``. Plots of every JSON go to
``<out>/*.png`` (matplotlib, from the ``bench`` extra) and ``<out>/summary.json`` lists what
ran, with the machine header and commit. ``--quick`` runs everything small (about 25 minutes,
most of it starting the race's 17 Spark sessions and the event-time race's 12): a smoke test of
the harness, not figures to quote.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from bench import race
from bench._common import print_header

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")

# name -> (full arguments, --quick arguments); every benchmark compares against its baseline in the same run.
MICRO = {
    "rowtable": (["--rows", "1000000", "--repeat", "7"], ["--rows", "100000", "--repeat", "3"]),
    "delta": (["--rows", "1000000", "--repeat", "7"], ["--rows", "100000", "--repeat", "3"]),
    "snapshot": (["--rows", "1000000", "--repeat", "7"], ["--rows", "100000", "--repeat", "3", "--big-rows", "1000000"]),
    "store": (["--rows", "1000000", "--repeat", "5"],
              ["--rows", "100000", "--repeat", "2", "--big-rows", "1000000", "--batches", "10",
               "--batch-rows", "20000"]),
    "rpc": ([], ["--seconds", "0.5", "--procs", "1,2", "--threads", "1,4"]),
    "locality": ([], ["--batches", "3", "--warmup", "1", "--rows", "5000"]),
    "continuous": ([], ["--seconds", "2", "--warmup", "1"]),
    "event_time": ([], ["--quick"]),
    "processor": ([], ["--quick"]),
    "expiry": (["--rows", "10000000", "--repeat", "3"], ["--rows", "200000", "--repeat", "2"]),
    "verify": (["--keys", "10000000", "--repeat", "5"], ["--keys", "20000", "--repeat", "2"]),
    "repartition": (["--keys", "10000000", "--repeat", "3"], ["--keys", "100000", "--repeat", "1"]),
    "rewrite": (["--keys", "10000000", "--repeat", "3"], ["--keys", "100000", "--repeat", "1"]),
    "scale": (["--keys", "1000000,10000000", "--batches", "30"],
              ["--keys", "100000,1000000", "--batches", "5", "--batch-rows", "20000"]),
    "rowcalls": (["--rows", "200000", "--repeat", "7"], ["--rows", "20000", "--repeat", "2"]),
    "levels": (["--rows", "1000000", "--batch-rows", "100000", "--repeat", "7"],
               ["--rows", "50000", "--batch-rows", "5000", "--repeat", "2"]),
    "grouping": (["--rows", "500000", "--repeat", "7"], ["--rows", "50000", "--batch-rows", "5000", "--repeat", "2"]),
    "evolution": (["--rows", "1000000", "--repeat", "7"], ["--rows", "100000", "--repeat", "2"]),
    "packed": (["--sizes", "100000,1000000,10000000", "--repeat", "5"],
               ["--sizes", "100000", "--repeat", "2", "--checkpoint-keys", "20000", "--updates", "12600",
                "--batches", "3"]),
}
ALL = (*MICRO, "race")


def run_micro(name, quick, out):
    """One micro benchmark in a fresh interpreter; its output is echoed and kept."""
    full, small = MICRO[name]
    json_path = os.path.join(out, f"{name}.json")
    cmd = [sys.executable, "-m", f"bench.bench_{name}", *(small if quick else full), "--json", json_path]
    print(f"\n$ {' '.join(['python', *cmd[1:]])}", flush=True)
    started = time.perf_counter()
    with open(os.path.join(out, f"{name}.txt"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=os.path.dirname(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return {"name": name, "command": " ".join(["python", *cmd[1:]]), "exit_code": code,
            "seconds": time.perf_counter() - started, "json": json_path if code == 0 else None}


def run_race(quick, out, extra):
    json_path = os.path.join(out, "race.json")
    p = race.parser()
    args = race.quick_args(p) if quick else p.parse_args(extra)
    args.json = json_path
    started = time.perf_counter()
    race.run(args)
    return {"name": "race", "command": "python -m bench.race " + ("(--quick settings)" if quick else " ".join(extra)),
            "exit_code": 0, "seconds": time.perf_counter() - started, "json": json_path}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="everything small: checks the harness (about 25 min)")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=list(ALL),
                   help=f"which to run (default all: {','.join(ALL)})")
    p.add_argument("--out", default=DEFAULT_OUT, help="where results go (default %(default)s)")
    p.add_argument("--no-plots", action="store_true")
    args, race_args = p.parse_known_args(argv)
    unknown = [n for n in args.only if n not in ALL]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(ALL)}")
    if race_args and "race" not in args.only:
        p.error(f"unrecognized arguments: {' '.join(race_args)}")
    os.makedirs(args.out, exist_ok=True)
    header = print_header("statecore benchmarks" + (" (--quick)" if args.quick else ""))
    runs = []
    for name in args.only:
        runs.append(run_race(args.quick, args.out, race_args) if name == "race" else run_micro(name, args.quick, args.out))
    plots = []
    if not args.no_plots:
        from bench import plots as plotting
        for r in runs:
            if r["json"]:
                try:
                    plots += plotting.plot(r["name"], r["json"], args.out)
                except Exception as e:  # a plot is a convenience: never lose the run's results over it
                    print(f"could not plot {r['name']}: {type(e).__name__}: {e}", file=sys.stderr)
    summary = {"machine": header, "quick": args.quick, "runs": runs, "plots": plots}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    failed = [r["name"] for r in runs if r["exit_code"] != 0]
    print(f"\nresults in {args.out}: " + ", ".join(f"{r['name']} {r['seconds']:.0f} s" for r in runs)
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
