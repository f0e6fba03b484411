"""Grouping a batch's rows by key: ``statecore.grouping.group_rows`` (one compiled pass by
hash) against numpy's stable argsort with its group boundaries (what it replaced) and a
Python dict of row lists; then ``RunningAggregate`` over raw rows as the race's statecore
partition runs it, in one process: its Arrow batches, its finish (the output), the commit,
and the maintenance pass after it (spill, compaction or snapshot, cleanup).

    python -m bench.bench_grouping [--rows 500000] [--batch-rows 10000] [--repeat 7] [--json PATH]

Keys are int64 drawn with replacement from ``--rows`` keys (about 63% distinct, as in the
race at K = 1M), grouped once as one Arrow batch (``--batch-rows``) and once as a task's
whole output (``--rows``); the three groupings are checked to agree. The task runs twice:
over Spark's Arrow batches of ``--batch-rows`` rows as they come, and over them joined
into one batch, as the operator hands them to ``fn`` (``fn_batch_rows``).
"""
import io
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.arrow_rows import parquet_writer
from statecore.grouping import group_rows

KEY = np.dtype([("key", "<i8")])


def argsort_groups(keys):
    """The sort-based grouping: a stable argsort, then where the sorted keys change."""
    order = np.argsort(keys["key"], kind="stable")
    ordered = keys["key"][order]
    new_group = np.empty(len(keys), dtype=np.bool_)
    new_group[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_group[1:])
    return order, np.flatnonzero(new_group)


def dict_groups(keys):
    groups = {}
    for i, key in enumerate(keys["key"].tolist()):
        groups.setdefault(key, []).append(i)
    return groups


def grouping_table(n, repeat, rng):
    keys = np.zeros(n, KEY)
    keys["key"] = rng.integers(0, n, n)
    order, starts = group_rows(keys)
    sorted_order, sorted_starts = argsort_groups(keys)
    assert len(starts) == len(sorted_starts) == len(dict_groups(keys))
    assert sorted(keys["key"][order[starts]].tolist()) == keys["key"][sorted_order[sorted_starts]].tolist()
    table = Table(f"group {n:,} int64 keys ({len(starts):,} distinct)", n)
    table.add("group_rows (hash)", measure(lambda: group_rows(keys), repeat))
    table.add("numpy argsort + boundaries", measure(lambda: argsort_groups(keys), repeat))
    table.add("dict of row lists", measure(lambda: dict_groups(keys), max(1, repeat // 2)))
    return table


def aggregate_table(n, batch_rows, repeat, rng):
    """RunningAggregate over raw rows into a store of n keys: a task's Arrow batches, its
    finish (the output), the output's parquet (the task's writer, and pyarrow's default
    writer beside it; in memory, no fsync), the commit and a maintenance pass, each timed
    per task."""
    from pyspark_glue import PartitionContext, RunningAggregate

    aggregate = RunningAggregate(KEY, "amount", pre_aggregate=False)
    root = tempfile.mkdtemp(prefix="bench-grouping-")
    provider = create_and_init_provider(StateStoreId(root, 0, 0), KEY, aggregate.value_schema, StateStoreConf())
    try:
        everything = np.zeros(n, KEY)
        everything["key"] = np.arange(n)
        store = provider.get_store(0)
        store.put_batch(everything, np.zeros(n, aggregate.value_schema))
        store.commit()
        phases = {"batches": [], "finish": [], "output (parquet_writer)": [],
                  "output (pyarrow's default ParquetWriter)": [], "commit": [], "maintenance": []}
        for version in range(1, repeat + 1):
            keys, amounts = rng.integers(0, n, n), rng.integers(0, 100, n)
            batches = [pa.RecordBatch.from_pydict({"key": keys[i:i + batch_rows], "amount": amounts[i:i + batch_rows]})
                       for i in range(0, n, batch_rows)]
            store = provider.get_store(version)
            task = aggregate.open(PartitionContext(0, version, {"default": store}, "default", None))
            t0 = time.perf_counter()
            for batch in batches:
                task.process(batch)
            t1 = time.perf_counter()
            out = task.finish()
            phases["batches"].append(t1 - t0)
            phases["finish"].append(time.perf_counter() - t1)
            for name, writer_of in (("output (parquet_writer)", parquet_writer),
                                    ("output (pyarrow's default ParquetWriter)", pq.ParquetWriter)):
                w0 = time.perf_counter()
                with writer_of(io.BytesIO(), out.schema) as writer:
                    writer.write_batch(out)
                phases[name].append(time.perf_counter() - w0)
            t2 = time.perf_counter()
            store.commit()
            t3 = time.perf_counter()
            provider.do_maintenance()
            phases["maintenance"].append(time.perf_counter() - t3)
            phases["commit"].append(t3 - t2)
    finally:
        provider.close()
        shutil.rmtree(root, ignore_errors=True)
    table = Table(f"RunningAggregate, {n:,} raw rows a task in {batch_rows:,}-row batches over {n:,} keys", n)
    for name, times in phases.items():
        table.add(name, times)
    return table


def main(argv=None):
    p = arg_parser(__doc__.split("\n")[0], rows=500_000, repeat=7)
    p.add_argument("--batch-rows", type=int, default=10_000)
    args = p.parse_args(argv)
    header = print_header("grouping a batch's rows by key")
    rng = np.random.default_rng(args.seed)
    tables = [grouping_table(args.batch_rows, args.repeat * 10, rng), grouping_table(args.rows, args.repeat, rng),
              aggregate_table(args.rows, args.batch_rows, args.repeat, rng),
              aggregate_table(args.rows, args.rows, args.repeat, rng)]
    for table in tables:
        table.print()
    if args.json:
        write_json(args.json, header, tables)


if __name__ == "__main__":
    main()
