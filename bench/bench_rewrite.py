"""``statecore rewrite`` of a StatefulOperator's state through a value-changing transform, on
this machine, against moving the same bytes.

The state and the anchor are bench_repartition's (an int64 key and two int64 values over 4
partitions, each one committed delta; the anchor reads every file, lz4-compresses and
decompresses its bytes and writes as many bytes to new files, fsynced):

- ``statecore.rewrite.rewrite``: the whole protocol (read at the recorded attempts, the
  transform on every batch, its checks, route, write and verify the new snapshots, switch,
  record, delete the old files), the transform adding 1 to every sum.

    python -m bench.bench_rewrite --keys 10000000 --repeat 3 [--json PATH]

Each timed run starts from a fresh copy of the checkpoint (copied untimed).
"""
import shutil
import tempfile

from bench._common import arg_parser, print_header, write_json
from bench.bench_repartition import against_anchor
from statecore.rewrite import rewrite


def add_one_to_sum(keys, values):
    """The benchmark's transform: every value changed, the schemas kept."""
    values = values.copy()
    values["sum"] += 1
    return keys, values


def main():
    p = arg_parser(__doc__.splitlines()[0], rows=10_000_000, repeat=3)
    p.add_argument("--keys", type=int, default=None, help="keys in the state (default: --rows)")
    args = p.parse_args()
    keys = args.keys or args.rows
    header = print_header("statecore rewrite, a value-changing transform")
    work = tempfile.mkdtemp(prefix="bench-rewrite-")
    try:
        table, file_bytes, ratio = against_anchor(
            work, keys, args.seed, args.repeat, "rewrite", f"rewrite {keys:,} keys",
            "statecore.rewrite.rewrite (local, sum + 1)", lambda copy: rewrite(copy, 0, add_one_to_sum))
        if args.json:
            write_json(args.json, header, [table], {"keys": keys, "file_bytes": file_bytes, "ratio_to_anchor": ratio})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
