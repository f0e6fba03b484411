"""Delta encode, decode and replay, against raw lz4 on the same bytes.

State-like rows: random (not sequential) int64 keys, values ``(count int64, sum float64)``
with small counts and sums that are multiples of 0.25, as an aggregation keeps them.

    python -m bench.bench_delta --rows 1000000 --repeat 7 [--json PATH]

Encode and decode tables count bytes (MB/s of raw rows); the replay table counts rows.
The first row of each table is the baseline of its ``relative`` column.
"""
import io

import lz4.block
import numpy as np

from bench._common import Table, arg_parser, measure, print_header, write_json
from statecore._delta import DEFAULT_BLOCK_BYTES, DeltaReader, DeltaWriter, apply_delta
from statecore._rowtable import RowTable
from statecore.schema import RowSchema

KEY_SCHEMA = RowSchema([("key", "<i8")])
VALUE_SCHEMA = RowSchema([("count", "<i8"), ("sum", "<f8")])
BLOCK_SIZES = [64 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20]


def state_rows(n, seed):
    """``(keys, values)`` uint8 row arrays of n state-like rows."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    values = np.empty(n, dtype=VALUE_SCHEMA.dtype)
    values["count"] = rng.integers(1, 100, n)
    values["sum"] = rng.integers(1, 10_000, n) * 0.25
    return keys.view(np.uint8).reshape(n, 8), values.view(np.uint8).reshape(n, 16)


class NullSink:
    """A file that drops what it is given: the codec's cost without the file's."""

    def write(self, data):
        return len(data)


def encode(keys, values, compression="lz4", block_bytes=DEFAULT_BLOCK_BYTES, sink=None):
    out = io.BytesIO() if sink is None else sink
    writer = DeltaWriter(out, KEY_SCHEMA, VALUE_SCHEMA, 1, compression=compression, block_bytes=block_bytes)
    writer.put_rows(keys, values)
    writer.finish()
    return out.getvalue() if sink is None else None


def chunked_lz4(data, block_bytes):
    view = memoryview(data)
    return [lz4.block.compress(view[i:i + block_bytes], store_size=False)
            for i in range(0, len(view), block_bytes)]


def main():
    args = arg_parser(__doc__.splitlines()[0]).parse_args()
    header = print_header("statecore delta codec")
    n, repeat = args.rows, args.repeat
    keys, values = state_rows(n, args.seed)
    columns = np.concatenate([keys.reshape(-1), values.reshape(-1)])  # the delta's block layout
    interleaved = np.concatenate([keys, values], axis=1).reshape(-1)  # row after row
    nbytes = columns.nbytes
    print(f"# {n:,} puts of 24-byte rows = {nbytes / 1e6:.1f} MB raw; "
          f"default block {DEFAULT_BLOCK_BYTES >> 10} KiB")

    # -- encode -----------------------------------------------------------------------
    enc = Table(f"encode {n:,} puts", nbytes, unit="B")
    enc.add("lz4.block.compress(keys+values), one call",
            measure(lambda: lz4.block.compress(columns, store_size=False), repeat))
    enc.add(f"lz4.block.compress(keys+values), {DEFAULT_BLOCK_BYTES >> 10} KiB chunks",
            measure(lambda: chunked_lz4(columns, DEFAULT_BLOCK_BYTES), repeat))
    enc.add("lz4.block.compress(interleaved rows), one call",
            measure(lambda: lz4.block.compress(interleaved, store_size=False), repeat))
    scratch = np.empty_like(columns)
    enc.add("memcpy of the bytes (np.copyto)", measure(lambda: np.copyto(scratch, columns), repeat))
    enc.add("DeltaWriter lz4 -> BytesIO", measure(lambda: encode(keys, values), repeat))
    enc.add("DeltaWriter lz4 -> null sink", measure(lambda: encode(keys, values, sink=NullSink()), repeat))
    enc.add("DeltaWriter none -> BytesIO", measure(lambda: encode(keys, values, "none"), repeat))
    enc.print()

    raw_lz4 = lz4.block.compress(columns, store_size=False)
    rows_lz4 = lz4.block.compress(interleaved, store_size=False)
    delta = encode(keys, values)
    plain = encode(keys, values, "none")
    sizes = {
        "raw_bytes": nbytes,
        "lz4_keys_values_bytes": len(raw_lz4),
        "lz4_interleaved_bytes": len(rows_lz4),
        "delta_lz4_bytes": len(delta),
        "delta_none_bytes": len(plain),
    }
    print(f"\ncompression ratio (raw / stored): delta lz4 {nbytes / len(delta):.3f}, "
          f"lz4 keys+values one call {nbytes / len(raw_lz4):.3f}, "
          f"lz4 interleaved rows {nbytes / len(rows_lz4):.3f}; "
          f"delta none is {len(plain) - nbytes} bytes over raw")

    # -- decode -----------------------------------------------------------------------
    dec = Table(f"decode {n:,} puts", nbytes, unit="B")
    dec.add("lz4.block.decompress(one call)",
            measure(lambda: lz4.block.decompress(raw_lz4, uncompressed_size=nbytes), repeat))
    chunks = chunked_lz4(columns, DEFAULT_BLOCK_BYTES)
    dec.add(f"lz4.block.decompress({DEFAULT_BLOCK_BYTES >> 10} KiB chunks)",
            measure(lambda: [lz4.block.decompress(c, uncompressed_size=DEFAULT_BLOCK_BYTES) for c in chunks],
                    repeat))
    dec.add("DeltaReader lz4, from bytes", measure(lambda: list(DeltaReader(delta, KEY_SCHEMA, VALUE_SCHEMA)),
                                                   repeat))
    dec.add("DeltaReader lz4, from BytesIO",
            measure(lambda: list(DeltaReader(io.BytesIO(delta), KEY_SCHEMA, VALUE_SCHEMA)), repeat))
    dec.add("DeltaReader none, from bytes", measure(lambda: list(DeltaReader(plain, KEY_SCHEMA, VALUE_SCHEMA)),
                                                    repeat))
    dec.print()

    # -- replay -----------------------------------------------------------------------
    tables = {}

    def fresh():
        tables["t"] = RowTable(KEY_SCHEMA, VALUE_SCHEMA)

    app = Table(f"replay {n:,} puts onto an empty RowTable", n)
    app.add("RowTable.put_rows(keys, values)", measure(lambda: tables["t"].put_rows(keys, values), repeat, fresh))
    app.add("apply_delta(delta bytes, table)", measure(lambda: apply_delta(delta, tables["t"]), repeat, fresh))
    app.print()

    # -- block size -------------------------------------------------------------------
    blk = Table(f"block size: encode {n:,} puts", nbytes, unit="B")
    blk_dec = Table(f"block size: decode {n:,} puts", nbytes, unit="B")
    ratios = {}
    for size in BLOCK_SIZES:
        name = f"DeltaWriter lz4, {size >> 10} KiB blocks"
        blk.add(name, measure(lambda: encode(keys, values, block_bytes=size), repeat))
        data = encode(keys, values, block_bytes=size)
        ratios[size] = nbytes / len(data)
        blk_dec.add(name.replace("Writer", "Reader"),
                    measure(lambda: list(DeltaReader(data, KEY_SCHEMA, VALUE_SCHEMA)), repeat))
    blk.print()
    blk_dec.print()
    print("ratio by block size: " + ", ".join(f"{s >> 10} KiB {r:.3f}" for s, r in ratios.items()))

    summary = enc.summary()
    print(f"\nDeltaWriter lz4 encodes at {summary[4]['m_per_s']:.0f} MB/s into BytesIO "
          f"({summary[4]['relative']:.0%} of one-call lz4 on the same bytes), "
          f"{summary[5]['m_per_s']:.0f} MB/s into a null sink ({summary[5]['relative']:.0%})")

    if args.json:
        write_json(args.json, header, [enc, dec, app, blk, blk_dec],
                   {"sizes": sizes, "block_bytes": DEFAULT_BLOCK_BYTES,
                    "ratio_by_block_size": {str(k): v for k, v in ratios.items()}})


if __name__ == "__main__":
    main()
