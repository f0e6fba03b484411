"""The metadata files beside a checkpoint's stores (``_operator.json``, batch records): their
checksums, their bounds, and what ``statecore inspect`` and ``statecore verify`` make of them.

The checkpoint is written at engine level as a StatefulProcessor leaves it: an operator whose
partitions hold its default store and the processor's timer stores (``__timers``,
``__timers.heads``, ``__timers.entries``), its ``_operator.json`` and batch records naming
every store's attempt. Hostile metadata (a directory, a link to /dev/zero, a FIFO, deep
nesting, huge partition counts) must give a one-line reason, never a traceback or a hang;
commands that could hang on the old code run in a subprocess with a deadline. A processor's
checkpoint written on Spark: tests/spark/test_metadata_files_spark.py.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from click.testing import CliRunner

import statecore.errors
from statecore import StateStoreConf, StateStoreId, checkpoint, create_and_init_provider
from statecore.checkpoint import CheckpointFiles, EpochLog
from statecore.cli import main
from statecore.lineage import ROOT_COMMIT_ID
from statecore.operator_files import (COMMITS_DIR, METADATA_FORMAT, OPERATOR_METADATA_FILE, check_metadata,
                                      commit_log, commit_record, read_commit_record, read_metadata)
from statecore.provider import SCHEMA_FILE
from statecore.schema import as_schema
from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)
KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("n", "<i8")])
TIMER_KEY = np.dtype([("k", "<i8"), ("__timer", "<i8")])
# The processor's stores besides the default one (pyspark_glue/state_vars.py: Timers).
TIMER_STORES = {"__timers": (TIMER_KEY, np.dtype([("x", "u1")])), "__timers.heads": (KEY, VALUE),
                "__timers.entries": (TIMER_KEY, VALUE)}
PARTITIONS = 2
BATCHES = 2
# Before the checksums there was no such error: a stand-in that nothing raises, so that each
# test fails on the old code for what it checks rather than at import.
DamagedMetadataError = getattr(statecore.errors, "DamagedMetadataError", None) or type(
    "DamagedMetadataErrorMissing", (Exception,), {})
HANG_DEADLINE_S = 60  # a command still running then is hung (the old code lists 10**7 directories)


def metadata():
    return {"format": METADATA_FORMAT, "operator_id": 0, "num_partitions": PARTITIONS, "key_columns": ["k"],
            "key_column_types": ["bigint"], "store_name": "default", "key_schema": as_schema(KEY).describe(),
            "value_schema": as_schema(VALUE).describe()}


def write_processor_checkpoint(root):
    """Operator 0 as a StatefulProcessor with timers leaves it after ``BATCHES`` batches."""
    stores = {"default": (KEY, VALUE), **TIMER_STORES}
    ids = {name: [[ROOT_COMMIT_ID.hex()] * PARTITIONS] for name in stores}  # [batch][partition]
    for name, (key, value) in stores.items():
        for p in range(PARTITIONS):
            provider = create_and_init_provider(StateStoreId(str(root), 0, p, name), key, value, StateStoreConf())
            for v in range(1, BATCHES + 1):
                store = provider.get_store(v - 1)
                keys = np.zeros(3, key)
                keys["k"] = np.arange(3) + 10 * v + p
                store.put_batch(keys, np.zeros(3, value))
                store.commit()
                if p == 0:
                    ids[name].append([None] * PARTITIONS)
                ids[name][v][p] = store.commit_id
            provider.close()
    operator = f"{root}/0"
    check_metadata(operator, metadata())
    records = commit_log(operator)
    for b in range(BATCHES):
        records.write(b, commit_record(b, PARTITIONS, "default", uuid.UUID(int=b), ids["default"][b + 1],
                                       ids["default"][b],
                                       store_commit_ids={n: ids[n][b + 1] for n in TIMER_STORES}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "state"
    write_processor_checkpoint(root)
    return root


@pytest.fixture
def root(pristine, tmp_path):
    copy = tmp_path / "state"
    shutil.copytree(pristine, copy)
    return copy


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def verify_problems(root):
    result = run("verify", root, "--json")
    data = json.loads(result.output)
    assert result.exit_code == (0 if data["sound"] else 1)
    return [(p["path"], p["offset"], p["what"]) for p in data["problems"]]


def change_inside_a_string(path, text):
    """Change one byte of ``path``: the first letter of the first string value ``text``, to
    another letter: the file stays valid JSON of the same shape."""
    with open(path, "rb") as f:
        raw = f.read()
    offset = raw.index(f'"{text}"'.encode()) + 1
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"z" if raw[offset:offset + 1] != b"z" else b"y")
    return offset


# -- item 12: verify and inspect see every store ---------------------------------------------

def test_an_untouched_processor_checkpoint_with_timer_stores_verifies_sound_and_inspect_lists_them(root):
    """The old scan skipped store directories starting with "_": the timer stores were hidden,
    and every batch record naming their attempts was reported as naming missing files."""
    assert verify_problems(root) == []
    data = json.loads(run("inspect", root, "--json").output)
    listed = {(s["partition_id"], s["store_name"]): s["newest_version"] for s in data["stores"]}
    assert listed == {(p, name): BATCHES for p in range(PARTITIONS) for name in ["default", *TIMER_STORES]}
    assert data["operators"][0]["store_names"] == sorted(["default", *TIMER_STORES])


def test_verify_finds_a_flipped_byte_in_a_timer_store(root):
    path = root / "0" / "1" / "__timers.heads"
    name = sorted(n for n in os.listdir(path) if n.endswith(".delta"))[0]
    with open(path / name, "r+b") as f:
        f.seek(60)
        byte = f.read(1)[0]
        f.seek(60)
        f.write(bytes([byte ^ 0x10]))
    assert any(p[0] == str(path / name) for p in verify_problems(root))


# -- item 13: metadata bytes checked ---------------------------------------------------------

def test_a_letter_changed_in_operator_json_is_caught_by_verify_and_by_the_next_read(root):
    """A one-byte change that leaves valid JSON of the same shape (a key column renamed)."""
    path = root / "0" / OPERATOR_METADATA_FILE
    change_inside_a_string(path, "k")
    problems = verify_problems(root)
    assert [(p[0], "checksum" in p[2]) for p in problems] == [(str(path), True)]
    with pytest.raises(DamagedMetadataError) as e:
        read_metadata(str(root / "0"))
    assert e.value.path == str(path) and "checksum" in e.value.reason
    with pytest.raises(DamagedMetadataError):  # what the operator's next batch calls first
        check_metadata(str(root / "0"), metadata())


def test_a_letter_changed_in_a_batch_record_run_id_is_caught_by_verify_and_by_the_reader(root):
    path = root / "0" / COMMITS_DIR / "1"
    with open(path) as f:
        run_id = json.load(f)["run_id"]
    change_inside_a_string(path, run_id)
    assert [p[0] for p in verify_problems(root)] == [str(path)]
    with pytest.raises(DamagedMetadataError) as e:
        read_commit_record(commit_log(str(root / "0")), 1)
    assert e.value.path == str(path)


def test_a_letter_changed_in_a_leftover_repartition_journal_is_caught_by_verify(root):
    """A journal an interrupted repartition left (the next run reads it to undo that run)."""
    from statecore.repartition import JOURNAL_DIR

    CheckpointFiles(str(root / "0" / JOURNAL_DIR)).write_json("00ff00ff00ff00ff.json", {
        "format": "statecore-repartition-journal-1", "batch_id": 1, "to_partitions": 3, "stores": ["default"]})
    assert verify_problems(root) == []
    path = root / "0" / JOURNAL_DIR / "00ff00ff00ff00ff.json"
    change_inside_a_string(path, "default")
    assert [p[0] for p in verify_problems(root)] == [str(path)]


@pytest.mark.parametrize("indent", [None, 1])
def test_every_single_byte_change_of_a_metadata_file_is_caught(tmp_path, indent):
    """Each byte of a written file replaced by each value that differs from it in one bit, and by
    JSON's other whitespace: the reader never returns a value for a changed file."""
    files = CheckpointFiles(str(tmp_path))
    value = dict(metadata(), repartition={"batch_id": 3, "record": {"ids": ["00ff" * 4] * 2}})
    files.write_json("m.json", value, indent=indent)
    raw = (tmp_path / "m.json").read_bytes()
    assert checkpoint.parse_json(raw, "m.json") == value
    missed = []
    for offset in range(len(raw)):
        for replacement in {raw[offset] ^ (1 << bit) for bit in range(8)} | set(b" \t\r\n") - {raw[offset]}:
            changed = raw[:offset] + bytes([replacement]) + raw[offset + 1:]
            try:
                checkpoint.parse_json(changed, "m.json")
            except DamagedMetadataError:
                continue
            missed.append((offset, replacement))
    assert missed == []


def test_files_written_before_checksums_still_read(tmp_path):
    """A record as an earlier statecore wrote it: sorted keys, no checksum member, no newline."""
    record = commit_record(0, 1, "default", "r", ["00" * 8], [ROOT_COMMIT_ID.hex()])
    (tmp_path / "0").write_text(json.dumps(record, sort_keys=True))
    assert read_commit_record(EpochLog(str(tmp_path)), 0)["commit_ids"] == ("00" * 8,)


def test_a_metadata_file_is_a_non_empty_object(tmp_path):
    files = CheckpointFiles(str(tmp_path))
    for value in ([1, 2], {}, {"checksum": "x"}):
        with pytest.raises(TypeError):
            files.write_json("m.json", value)
    assert not (tmp_path / "m.json").exists()


# -- item 6: hostile metadata ----------------------------------------------------------------

def test_json_nested_deeper_than_the_formats_allow_is_refused_naming_the_file(tmp_path):
    """A hand-made _operator.json of nested lists: the old reader let json's RecursionError out."""
    limit = getattr(checkpoint, "MAX_JSON_DEPTH", 32)
    files = CheckpointFiles(str(tmp_path))
    (tmp_path / "m.json").write_text("[" * limit + "]" * limit)
    assert files.read_json("m.json") == json.loads("[" * limit + "]" * limit)
    for depth in (limit + 1, 100_000):
        (tmp_path / "m.json").write_text("[" * depth + "]" * depth)
        with pytest.raises(DamagedMetadataError) as e:
            files.read_json("m.json", "operator metadata")
        assert e.value.path == str(tmp_path / "m.json") and f"deeper than {limit}" in e.value.reason


def test_json_values_python_does_not_convert_are_damage_naming_the_file(tmp_path):
    """A count of 5,000 digits (Python refuses to convert it) and a bare null."""
    (tmp_path / "m.json").write_text('{"num_partitions": ' + "9" * 5000 + "}")
    with pytest.raises(DamagedMetadataError) as e:
        CheckpointFiles(str(tmp_path)).read_json("m.json")
    assert e.value.path == str(tmp_path / "m.json")
    (tmp_path / "m.json").write_text("null")
    assert CheckpointFiles(str(tmp_path)).read_json("m.json") is None


def test_partition_counts_are_bounded():
    assert checkpoint.checked_partition_count(checkpoint.MAX_PARTITIONS, "x") == checkpoint.MAX_PARTITIONS
    for count in (0, checkpoint.MAX_PARTITIONS + 1, 10**12, True, 2.0, "2"):
        with pytest.raises(ValueError, match=f"x: num_partitions .* from 1 to {checkpoint.MAX_PARTITIONS}"):
            checkpoint.checked_partition_count(count, "x")


def hostile(root, shape):
    """Put a hostile ``_operator.json`` of ``shape`` in place of operator 0's."""
    path = root / "0" / OPERATOR_METADATA_FILE
    path.unlink()
    if shape == "directory":
        path.mkdir()
    elif shape == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif shape == "fifo":
        os.mkfifo(path)
    elif shape == "deep nesting":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        CheckpointFiles(str(root / "0")).write_json(OPERATOR_METADATA_FILE, dict(metadata(), num_partitions=shape))
    return path


@pytest.mark.parametrize("shape", ["directory", "link to /dev/zero", "fifo", "deep nesting", 10**5 + 1])
def test_hostile_operator_json_is_one_problem_for_verify_and_shown_by_inspect(root, shape):
    """No traceback: verify names the file (exit 1), inspect shows the reason and lists the
    stores it found on disk."""
    path = hostile(root, shape)
    problems = verify_problems(root)
    assert [p[0] for p in problems] == [str(path)]
    assert len(problems[0][2].splitlines()) == 1
    result = run("inspect", root, "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["operators"][0]["partitions"] == list(range(PARTITIONS))
    assert str(path) in data["operators"][0]["metadata"]["error"]
    assert len(data["stores"]) == PARTITIONS * (1 + len(TIMER_STORES))


@pytest.mark.parametrize("count", [10**7, 10**12])
def test_huge_num_partitions_is_answered_promptly_by_every_command(root, tmp_path, count):
    """The old scan and reads sized loops by the count (10**7 directory listings or stores
    opened; 10**12 never ends): each command answers well within the deadline, without a
    traceback. inspect shows the reason, verify reports it, repartition refuses naming it,
    dump reads the partitions on disk."""
    hostile(root, count)
    env = dict(os.environ, PYTHONPATH=ROOT)
    reason = f"num_partitions {count} is not a number of partitions"
    for args, code, where in ((["inspect"], 0, "stdout"), (["verify"], 1, "stdout"),
                              (["repartition", "--operator", "0", "--to", "3"], 3, "stderr"),
                              (["dump", "--format", "csv", "--out", str(tmp_path / "o.csv")], 0, "stderr")):
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "statecore", args[0], str(root), *args[1:]],
                                  capture_output=True, text=True, env=env, timeout=HANG_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"statecore {args[0]} still ran after {HANG_DEADLINE_S} s with num_partitions {count}")
        assert "Traceback" not in done.stderr
        assert done.returncode == code, done.stderr
        assert reason in getattr(done, where)
        assert time.monotonic() - started < HANG_DEADLINE_S


@pytest.mark.parametrize("count", [0, 10**12])
def test_readers_refuse_a_count_out_of_bounds_naming_the_file(root, count):
    path = hostile(root, count)
    with pytest.raises(ValueError, match=f"{path}: num_partitions {count} is not a number of partitions"):
        read_metadata(str(root / "0"))
    with pytest.raises(ValueError, match="num_partitions"):
        check_metadata(str(root / "0"), metadata())


@pytest.mark.parametrize("where", [SCHEMA_FILE, "delta"])
def test_a_fifo_in_place_of_a_store_file_is_a_problem_not_a_hang(root, where):
    store = root / "0" / "1"
    name = SCHEMA_FILE if where == SCHEMA_FILE else sorted(n for n in os.listdir(store) if n.endswith(".delta"))[-1]
    (store / name).unlink()
    os.mkfifo(store / name)
    assert str(store / name) in [p[0] for p in verify_problems(root)]
    result = run("inspect", root, "--json")
    assert result.exit_code == 0
    errors = [e for s in json.loads(result.output)["stores"] if s["location"] == str(store) for e in s["errors"]]
    assert any("FIFO" in e for e in errors)


@pytest.mark.parametrize("shape", ["directory", "link to /dev/zero", "fifo", "deep nesting"])
def test_dump_and_repartition_name_a_hostile_operator_json_without_a_traceback(root, tmp_path, shape):
    """The other commands read the same metadata through the same reader: repartition refuses
    with one line naming the file; dump logs what it ignored and reads the partitions on disk."""
    path = hostile(root, shape)
    out = tmp_path / "o.csv"
    for args in (["repartition", root, "--operator", 0, "--to", 3], ["dump", root, "--format", "csv", "--out", out]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        if args[0] == "repartition":
            # damage, as verify reports it: exit 1, one line naming the file
            assert result.exit_code == 1 and len(result.output.splitlines()) == 1 and str(path) in result.output
        else:
            assert result.exit_code == 0 and out.exists()


def test_a_batch_record_s_late_rows_are_a_count_or_unknown(tmp_path):
    """``late_rows``: what a Spark Connect client reads of a batch's late rows. A record from
    before it was kept reads as None (unknown); anything but a count >= 0 is refused by name."""
    log = EpochLog(str(tmp_path))
    old = commit_record(0, 1, "default", "r", ["00" * 8], [ROOT_COMMIT_ID.hex()])
    del old["late_rows"]
    (tmp_path / "0").write_text(json.dumps(old, sort_keys=True))
    assert read_commit_record(log, 0)["late_rows"] is None
    log.write(1, commit_record(1, 1, "default", "r", ["00" * 8], ["00" * 8], late_rows=12))
    assert read_commit_record(log, 1)["late_rows"] == 12
    for bad in (-1, True, 1.5, "3"):
        log.write(2, dict(commit_record(2, 1, "default", "r", ["00" * 8], ["00" * 8]), late_rows=bad))
        with pytest.raises(ValueError, match="late_rows"):
            read_commit_record(log, 2)


def test_known_records_list_once_and_serve_what_the_driver_wrote(tmp_path, monkeypatch):
    """A query's driver holding the operator lock knows the batch records: the directory is
    listed at the first batch only, the previous batch's record is the one it wrote (equal to
    a read of the file), deletes are remembered, and a delete that leaves a record behind
    makes it list again."""
    from statecore.operator_files import KnownRecords, commit_log, commit_record, read_commit_record

    log = commit_log(str(tmp_path / "0"))
    listings, reads = [], []
    epochs, read = log.epochs, log.read
    monkeypatch.setattr(log, "epochs", lambda: listings.append(1) or epochs())
    monkeypatch.setattr(log, "read", lambda b: reads.append(b) or read(b))
    known = KnownRecords(log)
    ids = ["ab" * 8, "cd" * 8]
    for b in range(4):
        assert known.epochs() == list(range(b))
        previous = known.record(b - 1, None) if b else None
        if b:
            assert previous == read_commit_record(log, b - 1) and previous["commit_ids"] == tuple(ids)
        known.write(b, commit_record(b, 2, "default", "run", ids, ids, batch_timestamp_ms=b))
        known.delete([x for x in range(b) if x < b - 2])
    assert len(listings) == 1 and len(reads) == 3, "one listing; the three reads are the checks above"
    assert known.epochs() == [1, 2, 3] == log.epochs()
    monkeypatch.setattr(log.files, "delete", lambda names: [])  # a record that could not be deleted
    known.delete([1])
    assert known.epochs() == [1, 2, 3], "listed again"
