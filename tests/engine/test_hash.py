"""Golden values for the key hash and checksum: files depend on them bit for bit."""
import numpy as np
import pytest
import xxhash

from statecore import _hash
from statecore._hash import hash_rows, xxh64_digest

# Published XXH64 values (seed 0 unless given), pinned independently of the xxhash package.
GOLDEN = [
    (b"", 0, 0xEF46DB3751D8E999),
    (b"a", 0, 0xD24EC4F1A98C6E5B),
    (b"statecore", 0, 0x482586A8DAEC3DD0),
    (bytes(range(40)), 0, 0xF5DA40F1B11741E9),
    (bytes(range(40)), 7, 0xFC9F7A1B24012CB5),
]


@pytest.mark.parametrize("data,seed,expected", GOLDEN, ids=lambda v: str(v)[:12])
def test_golden_values(data, seed, expected):
    assert xxh64_digest(data, seed) == expected


@pytest.mark.parametrize("length", [*range(0, 70), 127, 128, 129, 1000, 4096, 65537])
def test_matches_xxhash_package_at_every_tail_length(length):
    # Lengths 0..69 cover every branch: the 32-byte stripes, 8-, 4- and 1-byte tails.
    rng = np.random.default_rng(length)
    data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
    for seed in (0, 1, 2**63 + 11, 2**64 - 1):
        assert xxh64_digest(data, seed) == xxhash.xxh64_intdigest(data, seed=seed)


def test_hash_rows_equals_per_row_digest():
    rng = np.random.default_rng(1)
    for width in (1, 4, 8, 13, 16, 40):
        rows = rng.integers(0, 256, (257, width), dtype=np.uint8)
        expected = [xxhash.xxh64_intdigest(r.tobytes()) for r in rows]
        assert hash_rows(rows).tolist() == expected


def test_hash_rows_accepts_read_only_and_empty():
    rows = np.arange(64, dtype=np.uint8).reshape(8, 8)
    rows.flags.writeable = False
    assert hash_rows(rows).shape == (8,)
    assert hash_rows(np.empty((0, 8), dtype=np.uint8)).shape == (0,)


def test_hash_id_is_pinned():
    assert _hash.HASH_ID == 1
