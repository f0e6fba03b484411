"""One kind of per-row store call, repeated, to be counted in instructions under valgrind.

    valgrind --tool=cachegrind --cache-sim=no python -P -m bench.count_rowcalls KIND WHERE OP N

KIND is a schema of bench_rowcalls (``numeric``, ``bytes``); WHERE the version read
(``memory``: committed, in memory; ``snapshot``: reopened from a snapshot; ``filter``: the
same after maintenance built its key filter); OP ``hit`` or ``miss``; N the calls. The store
is built as bench_rowcalls builds it, over 20,000 keys. A wall-clock figure of per-row calls
moves with the machine far more than the few percent a change makes; an instruction count
does not: run it with N and with 0, or compare the compiled modules' own counts in
``cg_annotate`` (bench/HISTORY.md, "One read model, finished").
"""
import sys
import tempfile

from bench.bench_rowcalls import SCHEMAS, make_tuples, open_provider, put_all

ROWS = 20_000


def store_to_read(kind, where, scratch):
    key, value = SCHEMAS[kind]
    keys, values, hits, misses = make_tuples(kind, ROWS, 1)
    provider = open_provider(scratch + "/state", key, value)
    writer = provider.get_store(0)
    put_all(writer.put, keys, values)
    version = writer.commit()
    if where == "memory":
        return provider.get_store(version), hits, misses
    provider.do_maintenance()
    reopened = open_provider(scratch + "/state", key, value, tempfile.mkdtemp(dir=scratch))
    if where == "filter":
        reopened.get_read_store(version).abort()
        reopened.do_maintenance()  # the snapshot's key filter
    return reopened.get_store(version), hits, misses


def main(argv):
    kind, where, op, n = argv[0], argv[1], argv[2], int(argv[3])
    with tempfile.TemporaryDirectory() as scratch:
        store, hits, misses = store_to_read(kind, where, scratch)
        keys = hits if op == "hit" else misses
        keys = (keys * (n // len(keys) + 1))[:n]
        get = store.get
        for k in keys:
            get(k)
        store.abort()


if __name__ == "__main__":
    main(sys.argv[1:])
