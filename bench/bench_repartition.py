"""Repartition of a StatefulOperator's state from 4 to 7 partitions, on this machine, against
moving the same bytes.

The state is RunningAggregate's: an int64 key and two int64 values (count, sum), spread over
4 partitions as the operator routes them, each partition one committed version (a delta).

- anchor: read every partition's files, lz4-compress and decompress their bytes, and write
  as many bytes to new files (fsynced): the least a rewrite of the state costs;
- ``statecore.repartition.repartition``: the whole protocol (read at the recorded attempts,
  route with Spark's hash, write and verify the new snapshots, switch, delete the old files).

And the routing alone (what repartition and every operator task's check of its rows run):
``spark_partition`` (Spark's Murmur3 hash and pmod, compiled) against numpy's ``keys % n``,
a partitioning with no hash at all.

    python -m bench.bench_repartition --keys 10000000 --repeat 3 [--json PATH]

Each timed run starts from a fresh copy of the checkpoint (copied untimed).
"""
import os
import shutil
import tempfile

import lz4.block
import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider, operator_files
from statecore.lineage import ROOT_COMMIT_ID
from statecore.repartition import repartition
from statecore.spark_hash import spark_partition

KEY = np.dtype([("key", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<i8")])
FROM, TO = 4, 7


def make_checkpoint(root, keys, seed):
    """Operator 0 with ``keys`` distinct keys on FROM partitions, one batch, its metadata and record."""
    rng = np.random.default_rng(seed)
    k = np.zeros(keys, KEY)
    k["key"] = rng.permutation(np.arange(keys, dtype=np.int64) * 7919 - keys)
    v = np.zeros(keys, VALUE)
    v["count"] = rng.integers(1, 100, keys)
    v["sum"] = rng.integers(0, 1 << 40, keys)
    location = operator_files.operator_dir(root, 0)
    operator_files.check_metadata(location, {
        "format": operator_files.METADATA_FORMAT, "operator_id": 0, "num_partitions": FROM, "key_columns": ["key"],
        "key_column_types": ["bigint"], "store_name": "default", "key_schema": [["key", "<i8"]],
        "value_schema": [["count", "<i8"], ["sum", "<i8"]]})
    dest = spark_partition([k["key"]], ["bigint"], FROM)
    ids = []
    for p in range(FROM):
        provider = create_and_init_provider(StateStoreId(root, 0, p), KEY, VALUE, StateStoreConf())
        store = provider.get_store(0)
        store.put_batch(k[dest == p], v[dest == p])
        store.commit()
        ids.append(store.commit_id)
        provider.close()
    operator_files.commit_log(location).write(0, operator_files.commit_record(
        0, FROM, "default", "bench", ids, [ROOT_COMMIT_ID.hex()] * FROM))


def state_files(root):
    """Every version file of the operator's partitions."""
    out = []
    for p in range(FROM):
        d = os.path.join(root, "0", str(p))
        out += [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith((".delta", ".snapshot"))]
    return out


def move_bytes(files, out_dir):
    """The anchor: read each file, lz4 round trip, write the same volume to a new file, fsync."""
    os.makedirs(out_dir, exist_ok=True)
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        packed = lz4.block.compress(data, store_size=False)
        data = lz4.block.decompress(packed, uncompressed_size=len(data))
        with open(os.path.join(out_dir, f"{i}.bin"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def against_anchor(work, keys, seed, repeat, command, title, name, run):
    """A checkpoint of ``keys`` keys made under ``work``, then ``run(copy)`` (a command over a
    fresh copy of it: ``name`` in the table) timed beside the anchor (its files read, lz4 round
    trip, as many bytes written); the table printed with the ratio of the medians. Returns
    ``(table, bytes of the state's files, ratio)``."""
    source = os.path.join(work, "source")
    make_checkpoint(source, keys, seed)
    files = state_files(source)
    file_bytes = sum(os.path.getsize(f) for f in files)
    print(f"# {keys:,} keys of 24-byte rows = {keys * 24 / 1e6:.1f} MB raw, {file_bytes / 1e6:.1f} MB in "
          f"{len(files)} files")
    copy = os.path.join(work, "copy")
    anchor_out = os.path.join(work, "anchor")

    def fresh():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(anchor_out, ignore_errors=True)
        shutil.copytree(source, copy)
        os.sync()  # the copy's writeback done before the clock starts, not billed to the timed run

    table = Table(title, keys, unit="keys")
    table.add("anchor: read files + lz4 round trip + write as many bytes",
              measure(lambda: move_bytes(state_files(copy), anchor_out), repeat, fresh))
    table.add(name, measure(lambda: run(copy), repeat, fresh))
    table.print()
    anchor, ours = (np.median(t) for _, t in table.rows)
    print(f"\n{command} / anchor: {ours / anchor:.2f}x (target: within 2x)")
    return table, file_bytes, ours / anchor


def main():
    p = arg_parser(__doc__.splitlines()[0], rows=10_000_000, repeat=3)
    p.add_argument("--keys", type=int, default=None, help="keys in the state (default: --rows)")
    args = p.parse_args()
    keys = args.keys or args.rows
    header = print_header(f"statecore repartition {FROM} -> {TO} partitions")
    work = tempfile.mkdtemp(prefix="bench-repartition-")
    try:
        table, file_bytes, ratio = against_anchor(work, keys, args.seed, args.repeat, "repartition",
                                                  f"repartition {keys:,} keys {FROM} -> {TO}",
                                                  "statecore.repartition.repartition (local)",
                                                  lambda copy: repartition(copy, 0, TO))
        route = np.random.default_rng(args.seed).integers(-(1 << 62), 1 << 62, keys)
        routing = Table(f"route {keys:,} int64 keys to {TO} partitions", keys, unit="keys")
        routing.add("numpy keys % n (no hash)", measure(lambda: np.mod(route, TO), args.repeat * 3))
        routing.add("spark_partition (Spark's hash, pmod)",
                    measure(lambda: spark_partition([route], ["bigint"], TO), args.repeat * 3))
        routing.print()
        if args.json:
            write_json(args.json, header, [table, routing], {"keys": keys, "file_bytes": file_bytes,
                                                             "ratio_to_anchor": ratio})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
