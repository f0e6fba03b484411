"""Batch lookups through spilled levels (``Spill.lookup``, compiled in statecore/_versions.pyx)
against the mapped snapshot alone and a Python dict, in the same run.

    python -m bench.bench_levels --rows 1000000 --batch-rows 100000 --repeat 7 [--json PATH]

A provider holds ``--rows`` keys in a snapshot; each level over it is one spill of
``--batch-rows`` changes (nine puts of random keys to one remove), never taken in by the
next, so that the stack is as deep as asked. Each row of a table looks up one batch of
``--batch-rows`` random keys (found or not as the state has them): the snapshot alone (no
level: the floor), then 1, 3 and 6 levels, each by the compiled walk and level by level
(one batch lookup per level of the keys no newer level decided, in numpy: how Spill.lookup
worked before the walk and its key filters), and a dict of the same keys (``dict.get`` per
key, the Python anchor). ``relative`` is the snapshot's time over the row's.
"""
import dataclasses
import shutil
import tempfile
from unittest import mock

import numpy as np

import statecore.spill
from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore import StateStoreConf, StateStoreId, create_and_init_provider, held_versions
from statecore.spill import Spill

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("count", "<i8"), ("sum", "<f8")])
LEVELS = (1, 3, 6)


def stacked(root, rows, batch_rows, n_levels, rng):
    """A provider whose newest State stands on ``n_levels`` spills over a snapshot."""
    p = create_and_init_provider(StateStoreId(root, 0, 0), KEY, VALUE, StateStoreConf(min_deltas_for_snapshot=10**6))
    keys = np.zeros(rows, KEY)
    keys["k"] = np.arange(rows)
    s = p.get_store(0)
    s.put_batch(keys, np.zeros(rows, VALUE))
    s.commit()
    with mock.patch.object(p, "_conf", dataclasses.replace(p._conf, min_deltas_for_snapshot=0)):
        p.do_maintenance()  # the snapshot of version 1
    with mock.patch.object(statecore.spill, "TAKE_IN_RATIO", 0), \
            mock.patch.multiple(held_versions, SPILL_MIN_ROWS=-1, SPILL_RATIO=0):
        for v in range(1, n_levels + 1):
            changed = rng.choice(2 * rows, batch_rows, replace=False)
            puts, removes = changed[: batch_rows * 9 // 10], changed[batch_rows * 9 // 10:]
            s = p.get_store(v)
            k = np.zeros(puts.size, KEY)
            k["k"] = puts
            s.put_batch(k, np.ones(puts.size, VALUE))
            r = np.zeros(removes.size, KEY)
            r["k"] = removes
            s.remove_batch(r)
            s.commit()
            p.do_maintenance()
    base = p.held.newest.base
    depth, node = 0, base
    while isinstance(node, Spill):
        depth, node = depth + 1, node.lower
    assert depth == n_levels, (depth, n_levels)
    return p, base


def level_by_level(spill, key_rows):
    """``(values, found)`` as Spill.lookup had them before the compiled walk: each level's
    puts, then its removes, for the keys no newer level decided, then the snapshot."""
    n = key_rows.shape[0]
    values = np.zeros((n, spill.puts.value_width), dtype=np.uint8)
    found = np.zeros(n, dtype=np.uint8)
    spill.puts.get_rows(key_rows, values, found)
    found = found.view(np.bool_)
    rest = np.flatnonzero(~found)
    if spill.lower is None or rest.size == 0:
        return values, found
    rest_keys = np.ascontiguousarray(key_rows[rest])
    if spill.dels is not None and spill.dels.row_count:
        hidden = np.zeros(rest.size, dtype=np.uint8)
        spill.dels.get_rows(rest_keys, np.empty((rest.size, 0), np.uint8), hidden)
        keep = ~hidden.view(np.bool_)
        rest, rest_keys = rest[keep], np.ascontiguousarray(rest_keys[keep])
    if isinstance(spill.lower, Spill):
        lower_values, lower_found = level_by_level(spill.lower, rest_keys)
    else:
        lower_values = np.zeros((rest.size, spill.puts.value_width), dtype=np.uint8)
        lower_found = np.zeros(rest.size, dtype=np.uint8)
        spill.lower.get_rows(rest_keys, lower_values, lower_found)
    values[rest] = lower_values
    found[rest] = lower_found.view(np.bool_)
    return values, found


def main():
    p = arg_parser(__doc__.splitlines()[0], rows=1_000_000, repeat=7)
    p.add_argument("--batch-rows", type=int, default=100_000)
    args = p.parse_args()
    header = print_header(f"lookups through spilled levels; {args.rows:,} keys, batches of {args.batch_rows:,}")
    rng = np.random.default_rng(args.seed)
    probe = np.zeros(args.batch_rows, KEY)
    probe["k"] = rng.choice(2 * args.rows, args.batch_rows, replace=False)
    probe_rows = np.ascontiguousarray(probe.view(np.uint8).reshape(args.batch_rows, -1))
    scratch = tempfile.mkdtemp(prefix="statecore-bench-")
    t = Table(f"lookup of {args.batch_rows:,} keys", args.batch_rows, unit="keys")
    try:
        providers = {n: stacked(f"{scratch}/{n}", args.rows, args.batch_rows, n, rng) for n in LEVELS}
        snapshot = providers[LEVELS[0]][1].lower
        values = np.empty((args.batch_rows, snapshot.value_width), np.uint8)
        found = np.empty(args.batch_rows, np.uint8)
        alone = measure(lambda: snapshot.get_rows(probe_rows, values, found), args.repeat)
        t.add("the snapshot alone (no level)", alone)
        for n in LEVELS:
            base = providers[n][1]
            levels = f"{n} level{'s' if n > 1 else ''}"
            t.add(f"{levels}: the compiled walk", measure(lambda: base.lookup(probe_rows), args.repeat))
            t.add(f"{levels}: level by level (before)", measure(lambda: level_by_level(base, probe_rows), args.repeat))
            new, old = base.lookup(probe_rows), level_by_level(base, probe_rows)
            assert (new[1] == old[1]).all() and (new[0] == old[0]).all(), "the two walks disagree"
        d = dict.fromkeys(range(args.rows), (0, 0.0))
        keys = probe["k"].tolist()
        t.add("dict.get per key (Python)", measure(lambda: [d.get(k) for k in keys], args.repeat))
        t.print()
        if args.json:
            write_json(args.json, header, [t])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
