"""The ``statecore`` command's inspect, verify and dump, on checkpoints written with the store
API (two partitions, a second store name, deltas and snapshots): inspect's JSON against what
was written, verify against a flipped byte in every kind of file and a missing version, dump's
files (each format) against the state read through the store API, bad input (exit code 3,
nothing written), and one real ``python -m statecore`` run. A checkpoint written by a
StatefulOperator on Spark: tests/spark/test_cli_spark.py."""
import json
import os
import shutil
import subprocess
import sys
import threading
import traceback

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from statecore import StateStoreConf, StateStoreId, create_and_init_provider
from statecore.cli import main
from statecore.operator_files import COMMITS_DIR
from statecore.provider import SCHEMA_FILE
from tests.paths import REPO_ROOT
from tests.state_files import put_in_place, version_path

ROOT = str(REPO_ROOT)
KEY = np.dtype([("k", "<i8"), ("region", "S4")])
VALUE = np.dtype([("n", "<i8"), ("x", "<f8"), ("flag", "?")])
AUX_VALUE = np.dtype([("seen", "<u4")])
CONF = dict(min_deltas_for_snapshot=2, min_versions_to_retain=20)
PARTITIONS = 2
VERSIONS = 6  # each store commits versions 1..6; snapshots of 3 and 6 by maintenance
# Partition 0 writes packed snapshots (the default), partition 1 images: the checkpoint mixes both.
COMPRESSION = {0: "lz4", 1: "none"}


def changes(partition, version):
    """Deterministic puts and removes of one version (keys overlap across versions)."""
    rng = np.random.default_rng([partition, version])
    keys = np.zeros(40, KEY)
    keys["k"] = rng.choice(100, 40, replace=False)
    keys["region"] = np.array([b"eu", b"us", b"apac", b"a\"\\b"])[rng.integers(0, 4, 40)]
    values = np.zeros(40, VALUE)
    values["n"] = rng.integers(-10**12, 10**12, 40)
    values["x"] = rng.standard_normal(40) / 3
    values["flag"] = rng.integers(0, 2, 40).astype(bool)
    gone = np.zeros(5, KEY)
    gone["k"] = rng.choice(100, 5, replace=False)
    gone["region"] = b"eu"
    return keys, values, gone


def write_root(root):
    """The store checkpoint: ``{(partition, store): [(version, commit id hex)]}`` committed."""
    committed = {}
    for p in range(PARTITIONS):
        for name, value in (("default", VALUE), ("aux", AUX_VALUE)):
            provider = create_and_init_provider(StateStoreId(str(root), 0, p, name), KEY, value,
                                                StateStoreConf(**CONF, compression=COMPRESSION[p]))
            ids = []
            for v in range(1, VERSIONS + 1):
                store = provider.get_store(v - 1)
                keys, values, gone = changes(p, v)
                if name == "default":
                    store.put_batch(keys, values)
                    store.remove_batch(gone)
                else:
                    aux = np.zeros(len(keys), AUX_VALUE)
                    aux["seen"] = v
                    store.put_batch(keys, aux)
                store.commit()
                ids.append((v, store.commit_id))
                if v % 3 == 0:
                    provider.do_maintenance()  # a snapshot of v
            provider.close()
            committed[(p, name)] = ids
    return committed


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "state"
    return root, write_root(root)


@pytest.fixture
def root(pristine, tmp_path):
    """A fresh copy of the store checkpoint, and what was committed."""
    copy = tmp_path / "state"
    shutil.copytree(pristine[0], copy)
    return copy, pristine[1]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def store_state(root, p, version=None, name="default", value=VALUE, operator_id=0, key=KEY):
    """{key tuple: value tuple} through the store API (default lineage; newest version)."""
    provider = create_and_init_provider(StateStoreId(str(root), operator_id, p, name), key, value, StateStoreConf())
    try:
        if version is None:
            version = max(int(n.split("_")[0]) for n in os.listdir(provider.state_store_id.store_checkpoint_location())
                          if n[0].isdigit())
        store = provider.get_read_store(version)
        try:
            return {tuple(k): tuple(v) for keys, values in store.iter_batches(7)
                    for k, v in zip(keys.tolist(), values.tolist())}
        finally:
            store.abort()
    finally:
        provider.close()


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


# -- inspect ---------------------------------------------------------------------------------

def test_inspect_json_matches_what_was_written(root):
    root, committed = root
    result = run("inspect", root, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kind"] == "root" and data["operators"][0]["partitions"] == [0, 1]
    assert data["operators"][0]["store_names"] == ["aux", "default"]
    assert data["operators"][0]["metadata"] is None and data["operators"][0]["batch_records"] == []
    stores = {(s["partition_id"], s["store_name"]): s for s in data["stores"]}
    assert sorted(stores) == sorted(committed)
    for (p, name), ids in committed.items():
        s = stores[(p, name)]
        location = StateStoreId(str(root), 0, p, name).store_checkpoint_location()
        assert s["location"] == location
        assert [(a["version"], a["commit_id"]) for a in s["versions"]] == ids
        names = sorted(n for n in os.listdir(location) if os.path.isfile(os.path.join(location, n)))
        assert s["files"] == len(names)
        assert s["bytes"] == sum(os.path.getsize(os.path.join(location, n)) for n in names)
        for a in s["versions"]:
            assert a["delta"]["name"] == f"{a['version']}_{a['commit_id']}.delta"
            assert a["delta"]["bytes"] == os.path.getsize(os.path.join(location, a["delta"]["name"]))
        assert (s["newest_version"], s["newest_commit_id"]) == ids[-1]
        value = VALUE if name == "default" else AUX_VALUE
        assert s["rows"] == len(store_state(root, p, name=name, value=value))
        assert s["key_schema"] == [["k", "<i8"], ["region", "|S4"]]
        assert s["value_schema"] == [[n, value[n].str] for n in value.names]
        assert [a["version"] for a in s["versions"] if a["snapshot"]] == [3, 6]
        assert s["newest_snapshot"]["version"] == 6 and s["newest_snapshot"]["commit_id"] == ids[5][1]
    human = run("inspect", root)
    assert human.exit_code == 0 and "1..6" in human.output and ids[-1][1] in human.output


def test_inspect_a_bare_store(root):
    root, committed = root
    result = run("inspect", root / "0" / "1", "--json")
    data = json.loads(result.output)
    assert data["kind"] == "store" and data["operators"] == [] and len(data["stores"]) == 1
    assert [(a["version"], a["commit_id"]) for a in data["stores"][0]["versions"]] == committed[(1, "default")]
    assert data["stores"][0]["rows"] == len(store_state(root, 1))


# -- verify ----------------------------------------------------------------------------------

def problems_of(result):
    return json.loads(result.output)["problems"]


def test_verify_passes_a_sound_checkpoint(root):
    root, committed = root
    result = run("verify", root, "--json", "--deep")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["sound"] and data["problems"] == []
    assert data["stores"] == 4 and data["versions"] == sum(len(ids) for ids in committed.values())
    locations = [StateStoreId(str(root), 0, p, n).store_checkpoint_location() for p, n in committed]
    assert data["files"] == sum(os.path.isfile(os.path.join(d, n)) for d in locations for n in os.listdir(d))
    assert run("verify", root, "--version", 4).exit_code == 0
    assert "sound" in run("verify", root).output


# (what to flip: kind, version, offset; where verify reports it: the offset of the checksum
# or structure that covers the byte, None for "somewhere in the file"); negative offsets
# count from the end. Partition 1's default store; the snapshot of 6.
FLIPS = {  # (partition, kind, version, offset flipped, offset reported)
    "delta header": (1, "delta", 4, 20, 64),  # the header checksum
    "delta block header": (1, "delta", 4, 72 + 5, 72),  # the block
    "delta payload": (1, "delta", 4, 72 + 32 + 3, 72 + 32),  # the payload
    "delta trailer": (1, "delta", 4, -10, -56),  # the trailer (56 bytes in format version 2)
    "snapshot header": (1, "snapshot", 6, 50, 4088),  # the header checksum
    "snapshot schema json": (1, "snapshot", 6, 140, 4088),
    "snapshot rows": (1, "snapshot", 6, 4096 + 30, 4096),  # the data block
    "snapshot slots or checksums": (1, "snapshot", 6, -64 - 4, None),
    "snapshot footer": (1, "snapshot", 6, -20, -8),  # the footer checksum
    # A packed snapshot (one block): container header, image header page, block, table, footer.
    "packed container header": (0, "snapshot", 6, 20, 56),  # the container header checksum
    "packed image header": (0, "snapshot", 6, 64 + 50, 64 + 4088),  # the page's checksum
    "packed schema json": (0, "snapshot", 6, 64 + 140, 64 + 4088),
    "packed block": (0, "snapshot", 6, 4160 + 30, 4160),  # the block's start
    "packed block table": (0, "snapshot", 6, -64 - 4, -64 - 16),  # the table's start
    "packed footer": (0, "snapshot", 6, -20, -8),  # the footer checksum
}


@pytest.mark.parametrize("what", sorted(FLIPS))
def test_verify_names_the_file_and_offset_of_a_flipped_byte(root, what):
    root, _ = root
    partition, kind, version, offset, reported = FLIPS[what]
    path = version_path(str(root / "0" / str(partition)), version, kind)
    size = os.path.getsize(path)
    flip(path, offset % size)
    result = run("verify", root, "--json")
    assert result.exit_code == 1, result.output
    problems = problems_of(result)
    assert problems and problems[0]["path"] == path, problems
    if reported is None:
        assert 4096 <= problems[0]["offset"] < size
    else:
        assert problems[0]["offset"] == reported % size, problems[0]
    text = run("verify", root)
    assert text.exit_code == 1 and f"BAD {path} at byte {problems[0]['offset']}" in text.output


def test_verify_catches_a_flipped_byte_in_the_schema_file(root):
    root, _ = root
    path = str(root / "0" / "0" / "aux" / SCHEMA_FILE)
    flip(path, 11)
    result = run("verify", root, "--json")
    assert result.exit_code == 1
    assert [(p["path"], p["offset"]) for p in problems_of(result)] == [(path, 11)]
    assert "not UTF-8 text" in problems_of(result)[0]["what"]


def test_verify_reports_a_missing_version_in_a_chain(root):
    root, committed = root
    os.unlink(version_path(str(root / "0" / "0"), 5, "delta"))
    result = run("verify", root, "--json")
    assert result.exit_code == 1
    bad = problems_of(result)
    assert len(bad) == 1 and bad[0]["path"] == str(root / "0" / "0"), bad
    assert bad[0]["what"].startswith(f"version 5 (attempt {committed[(0, 'default')][4][1]}) of the default lineage")
    assert "a missing version; versions 1..4 below it are cut off" in bad[0]["what"]
    # Version 6 alone still loads from its snapshot; so does every version of partition 1.
    os.unlink(version_path(str(root / "0" / "0"), 6, "snapshot"))
    assert run("verify", root, "--version", 6).exit_code == 1
    assert run("verify", root / "0" / "1", "--version", 6).exit_code == 0


@pytest.mark.parametrize("partition", [0, 1], ids=["packed snapshot", "snapshot image"])
def test_verify_reports_a_delta_whose_key_count_its_snapshot_contradicts(root, partition):
    """Version 6 has a snapshot and a delta of the same attempt: a delta rewritten whole (every
    checksum sound) with a key count one off is reported, naming both files and both counts."""
    from statecore._delta import DeltaReader, encode_delta

    root, _ = root
    directory = str(root / "0" / str(partition))
    path = version_path(directory, 6, "delta")
    with open(path, "rb") as f:
        reader = DeltaReader(f.read())
        blocks = list(reader)
    assert reader.num_keys is not None
    puts = [(k, v) for kind, k, v in blocks if v is not None]
    removes = [k for kind, k, v in blocks if v is None]
    with open(path, "wb") as f:
        f.write(encode_delta(KEY, VALUE, 6,
                             puts=(np.concatenate([k for k, _ in puts]), np.concatenate([v for _, v in puts])),
                             removes=np.concatenate(removes) if removes else None, lineage=reader.lineage,
                             compression=COMPRESSION[partition], num_keys=reader.num_keys + 1))
    result = run("verify", root, "--json")
    assert result.exit_code == 1, result.output
    problems = problems_of(result)
    assert [p["path"] for p in problems] == [path], problems
    snapshot = version_path(directory, 6, "snapshot")
    assert (f"its trailer records {reader.num_keys + 1} keys for version 6" in problems[0]["what"]
            and f"the snapshot {snapshot} of that attempt holds {reader.num_keys} rows" in problems[0]["what"])


# -- dump ------------------------------------------------------------------------------------

def read_back(path, fmt):
    """{(k, region bytes, partition): (n, x, flag)} of a dump."""
    if fmt == "parquet":
        table = pq.read_table(path)
    elif fmt == "csv":
        table = pcsv.read_csv(path)
    else:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        return {(r["k"], r["region"].encode(), r["partition_id"]): (r["n"], r["x"], r["flag"]) for r in rows}
    cols = table.to_pydict()
    regions = [r if isinstance(r, bytes) else r.encode() for r in cols["region"]]
    return {(k, r, p): (n, x, f) for k, r, n, x, f, p in zip(cols["k"], regions, cols["n"], cols["x"], cols["flag"],
                                                            cols["partition_id"])}


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_dump_writes_the_state_read_through_the_store_api(root, tmp_path, fmt):
    root, _ = root
    tmp_path = tmp_path / "dumps"
    tmp_path.mkdir()
    out = tmp_path / f"out.{fmt}"
    result = run("dump", root, "--operator", 0, "--format", fmt, "--out", out, "--rows-per-batch", 9, "--json")
    assert result.exit_code == 0, result.output
    expected = {(*k, p): v for p in range(PARTITIONS) for k, v in store_state(root, p).items()}
    assert read_back(out, fmt) == expected
    assert json.loads(result.output)["rows"] == len(expected)
    older = tmp_path / f"older.{fmt}"
    assert run("dump", root, "--format", fmt, "--out", older, "--version", 2, "--partition", 1).exit_code == 0
    assert read_back(older, fmt) == {(*k, 1): v for k, v in store_state(root, 1, 2).items()}
    assert sorted(os.listdir(tmp_path)) == sorted([out.name, older.name])  # no temporary files left


def test_dump_of_another_store_name_and_column_names(root, tmp_path):
    root, _ = root
    out = tmp_path / "aux.parquet"
    assert run("dump", root, "--store-name", "aux", "--format", "parquet", "--out", out).exit_code == 0
    table = pq.read_table(out)
    assert table.column_names == ["k", "region", "seen", "partition_id"]
    assert str(table.schema.field("seen").type) == "uint32"
    assert len(table) == sum(len(store_state(root, p, name="aux", value=AUX_VALUE)) for p in range(PARTITIONS))


def test_dump_refuses_bytes_that_are_not_text_in_csv_and_writes_nothing(tmp_path):
    provider = create_and_init_provider(StateStoreId(str(tmp_path / "s"), 0, 0), KEY, VALUE, StateStoreConf())
    store = provider.get_store(0)
    keys = np.zeros(1, KEY)
    keys["region"] = b"\xff\xfe"
    store.put_batch(keys, np.zeros(1, VALUE))
    store.commit()
    provider.close()
    for fmt in ("csv", "jsonl"):
        result = CliRunner().invoke(main, ["dump", str(tmp_path / "s"), "--format", fmt, "--out",
                                           str(tmp_path / "o")])
        assert result.exit_code == 3 and "not UTF-8 text" in result.output and "parquet" in result.output
        assert sorted(os.listdir(tmp_path)) == ["s"]
    assert run("dump", tmp_path / "s", "--format", "parquet", "--out", tmp_path / "o").exit_code == 0
    assert pq.read_table(tmp_path / "o").column("region").to_pylist() == [b"\xff\xfe"]


# -- bad input -------------------------------------------------------------------------------

def bad(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    return lines[0]


def test_bad_input_is_one_line_exit_code_3_and_writes_nothing(root, tmp_path):
    root, _ = root
    out = tmp_path / "out" / "o.parquet"
    os.makedirs(out.parent)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    for command in (["inspect"], ["verify"], ["dump", "--format", "parquet", "--out", out]):
        for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "file"):
            assert "not a statecore checkpoint" in bad(command[0], path, *command[1:])
    assert "operator 0, not a checkpoint" in bad("inspect", root / "0")
    assert "operator 7 does not exist" in bad("verify", root, "--operator", 7)
    assert "version 9 does not exist" in bad("verify", root, "--version", 9)
    assert "operator 7 does not exist" in bad("dump", root, "--operator", 7, "--format", "csv", "--out", out)
    assert "partition 5 of operator 0 does not exist" in bad("dump", root, "--partition", 5, "--format", "csv",
                                                             "--out", out)
    assert "version 9 of operator 0" in bad("dump", root, "--version", 9, "--format", "csv", "--out", out)
    assert "store 'nope'" in bad("dump", root, "--store-name", "nope", "--format", "csv", "--out", out)
    assert "does not exist" in bad("dump", root, "--format", "csv", "--out", tmp_path / "no" / "o.csv")
    assert os.listdir(out.parent) == []


def test_dump_of_damaged_state_says_which_file_exits_1_and_writes_nothing(root, tmp_path):
    root, _ = root
    path = version_path(str(root / "0" / "1"), 5, "delta")
    flip(path, 100)
    out = tmp_path / "dumps" / "o.parquet"
    out.parent.mkdir()
    result = CliRunner().invoke(main, ["dump", str(root), "--format", "parquet", "--out", str(out), "--version", "5"])
    assert result.exit_code == 1 and result.output.startswith(f"Error: corrupt file '{path}' at byte ")
    assert os.listdir(out.parent) == []


def invoke_with_deadline(args, deadline_s=60):
    """The CliRunner result of ``args`` run on a thread; fails if it has not finished by then
    (a command blocked on a FIFO)."""
    done = []
    thread = threading.Thread(target=lambda: done.append(CliRunner().invoke(main, [str(a) for a in args])),
                              daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert done, f"statecore {args[0]} did not finish within {deadline_s} s"
    return done[0]


def one_line_error(result, code):
    """The one line of a failure with exit code ``code`` (never a traceback)."""
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        "".join(traceback.format_exception(result.exception))
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("what", ["fifo", "dev_zero", "loop"])
@pytest.mark.parametrize("target", ["delta", "snapshot", "schema"])
def test_a_fifo_or_device_in_place_of_a_state_file_is_one_line_and_exit_1(root, tmp_path, target, what):
    """Someone left a FIFO, a link to /dev/zero or a symlink loop where a delta,
    a snapshot or the schema file of a store should be: verify and dump say which file in one
    line and exit 1, promptly, writing nothing; inspect does not hang or print a traceback."""
    root, _ = root
    directory = str(root / "0" / "1")
    path = {"delta": lambda: version_path(directory, 5, "delta"), "snapshot": lambda: version_path(directory, 6,
            "snapshot"), "schema": lambda: os.path.join(directory, SCHEMA_FILE)}[target]()
    put_in_place(path, what)
    out = tmp_path / "dumps" / "o.csv"
    out.parent.mkdir()
    version = ["--version", 5] if target == "delta" else []
    assert path in one_line_error(invoke_with_deadline(["dump", root, "--format", "csv", "--out", out, *version]), 1)
    assert os.listdir(out.parent) == []
    verified = invoke_with_deadline(["verify", root])
    assert verified.exit_code == 1 and path in verified.output
    assert not isinstance(verified.exception, Exception) or isinstance(verified.exception, SystemExit)
    inspected = invoke_with_deadline(["inspect", root])
    assert inspected.exit_code in (0, 1) and (inspected.exit_code == 0 or path in inspected.output)
    assert not isinstance(inspected.exception, Exception) or isinstance(inspected.exception, SystemExit)


def test_dump_of_a_checkpoint_path_that_is_a_symlink_loop_or_an_out_that_cannot_be_created(root, tmp_path):
    """Bad input, exit 3 and one line: CHECKPOINT a symlink loop, --out a name too long to create."""
    root, _ = root
    out = tmp_path / "dumps" / "o.csv"
    out.parent.mkdir()
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert "Too many levels of symbolic links" in one_line_error(
        invoke_with_deadline(["dump", loop, "--format", "csv", "--out", out]), 3)
    assert "cannot be written" in one_line_error(
        invoke_with_deadline(["dump", root, "--format", "csv", "--out", out.parent / ("x" * 300 + ".csv")]), 3)
    assert os.listdir(out.parent) == []


def test_dump_of_a_damaged_schema_file_is_one_line_and_exit_1(root, tmp_path):
    root, _ = root
    path = root / "0" / "1" / SCHEMA_FILE
    path.write_text('{"key": [')
    out = tmp_path / "o.csv"
    line = one_line_error(invoke_with_deadline(["dump", root, "--format", "csv", "--out", out]), 1)
    assert str(path) in line and "unreadable schema file" in line and not out.exists()


def test_python_dash_m_statecore_runs_as_a_process(root):
    root, _ = root
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "statecore", "verify", str(root)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("version(s) followed)") and "sound" in done.stdout
    flip(version_path(str(root / "0" / "0"), 2, "delta"), 80)
    done = subprocess.run([sys.executable, "-m", "statecore", "verify", str(root)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 1 and "BAD " + version_path(str(root / "0" / "0"), 2, "delta") in done.stdout


# -- a StatefulOperator's checkpoint (those written on Spark: tests/spark/test_cli_spark.py) -----

@pytest.mark.parametrize("damage", ["not_json", "not_a_record", "fifo"])
def test_dump_of_an_operator_whose_batch_record_is_damaged_exits_1(tmp_path, damage):
    """The newest batch record (_commits/<b>) of a StatefulOperator's checkpoint is damaged:
    that is damaged state, exit 1 and one line naming the record, not bad input (3)."""
    from tests.engine.test_repartition import make_checkpoint

    root = tmp_path / "state"
    make_checkpoint(str(root), partitions=2, batches=2)
    record = root / "0" / COMMITS_DIR / "1"
    if damage == "not_json":
        record.write_text('{"format": ')
    elif damage == "not_a_record":
        record.write_text('{"format": "something else"}')
    else:
        record.unlink()
        os.mkfifo(record)
    out = tmp_path / "o.csv"
    line = one_line_error(invoke_with_deadline(["dump", root, "--operator", 0, "--format", "csv", "--out", out]), 1)
    assert str(record) in line and not out.exists()
