"""Late attempts never delete a recorded version (docs/lineage.md, "What a late commit may
delete"): a task attempt that opens version v after v+1.. were committed and recorded (a
speculative copy that starts just after the original committed, a retry delayed past its
batch) and then commits is not taken for a re-execution.

The driver's batch records are written here as StatefulOperator writes them
(statecore.operator_files), under ``<root>/<operator>/_commits/<batch>``."""
import os

import numpy as np
import pytest

from statecore import CommitConflictError, StateStoreConf, StateStoreId, create_and_init_provider
from statecore import operator_files
from statecore.checkpoint import CheckpointFiles
from statecore.schema import key_value_schemas
from tests.store_support import commit_batch, contents, open_provider, store_dir

KEY = np.dtype([("k", "<i8")])
VALUE = np.dtype([("v", "<i8")])
KEY_SCHEMA, VALUE_SCHEMA = key_value_schemas(KEY, VALUE)


def provider(root):
    return open_provider(root, KEY, VALUE)


def open_provider_named(root, store_name):
    return create_and_init_provider(StateStoreId(str(root), 0, 0, store_name), KEY, VALUE, StateStoreConf())


def files_of(root):
    return sorted(n for n in os.listdir(store_dir(root)) if n[0].isdigit())


def record(root, batch_id, commit_id, base_id, store_name="default", other_store=None):
    """Write the record of ``batch_id`` for partition 0 of a one-partition operator 0."""
    ids = [commit_id] if store_name == "default" else ["ab" * 8]
    others = {} if other_store is None else {other_store: [commit_id]}
    log = operator_files.commit_log(operator_files.operator_dir(str(root), 0))
    log.write(batch_id, operator_files.commit_record(batch_id, 1, store_name, "run", ids, [base_id],
                                                    store_commit_ids=others))


def run_batches(root, first, last, recorded=True):
    """Commit versions ``first + 1 .. last + 1`` (batches first..last) on the default lineage,
    each putting key b = b, recording each batch; returns {version: (commit id, contents)}."""
    p = provider(root)
    out = {}
    for b in range(first, last + 1):
        s = p.get_store(b)
        s.put(b, (b,))
        assert s.commit() == b + 1
        out[b + 1] = (s.commit_id, contents(p.get_read_store(b + 1, s.commit_id)))
        if recorded:
            record(root, b, s.commit_id, s.base_commit_id)
        s.abort()
    return out


def assert_read_back(root, versions):
    p = provider(root)
    for v, (cid, expected) in versions.items():
        store = p.get_read_store(v, commit_id=cid)
        assert contents(store) == expected, f"recorded version {v} ({cid}) reads back otherwise"
        store.abort()


@pytest.mark.parametrize("named", [False, True], ids=["default-lineage", "named-attempt"])
def test_a_late_speculative_copy_keeps_the_original_attempt_the_driver_recorded(tmp_path, named):
    """A speculative copy of batch 3 opens version 3 just after the original committed
    version 4 (the original's file is in its listing), and commits after the driver recorded
    the original: the original's delta of 4 stays, and reads back as recorded. Opened at the
    named attempt, the copy lands beside it (the same batch's result); opened on the default
    lineage, where a re-execution supersedes the other attempts of its version, it is refused,
    since the one it would delete is recorded."""
    committed = run_batches(tmp_path, 0, 2)
    p = provider(tmp_path)
    original = p.get_store(3)
    original.put(3, (3,))
    original.commit()
    committed[4] = (original.commit_id, contents(p.get_read_store(4, original.commit_id)))
    base = committed[3][0]
    late = provider(tmp_path).get_store(3, commit_id=base if named else None)  # opens after the commit
    record(tmp_path, 3, original.commit_id, base)
    late.put(3, (33,))
    if named:
        assert late.commit() == 4  # the same batch's result: nothing above 4 to refuse or delete
    else:
        with pytest.raises(CommitConflictError, match="after batch 3 was committed and recorded"):
            late.commit()
    assert f"4_{original.commit_id}.delta" in files_of(tmp_path)
    assert_read_back(tmp_path, committed)


@pytest.mark.parametrize("named", [False, True], ids=["default-lineage", "named-attempt"])
@pytest.mark.parametrize("later", [1, 3])
def test_a_retry_delayed_past_later_recorded_batches_deletes_nothing(tmp_path, named, later):
    """A retry of batch 3 opens version 3 after batches 3..3+later were committed and
    recorded, then commits version 4: it is refused (CommitConflictError naming a recorded
    batch) before anything is written, and every recorded version reads back exactly."""
    committed = run_batches(tmp_path, 0, 3 + later)
    before = files_of(tmp_path)
    late = provider(tmp_path).get_store(3, commit_id=committed[3][0] if named else None)
    late.put(3, (-3,))
    with pytest.raises(CommitConflictError, match=r"after batch [0-9]+ was committed and recorded"):
        late.commit()
    assert files_of(tmp_path) == before  # nothing written, nothing deleted
    assert_read_back(tmp_path, committed)


def test_a_record_of_another_store_of_the_operator_protects_its_files(tmp_path):
    """The operator's second store (``store_commit_ids`` of the records): a late attempt of
    it is refused too."""
    p = open_provider_named(tmp_path, "extra")
    ids = {}
    for b in range(4):
        s = p.get_store(b)
        s.put(b, (b,))
        s.commit()
        ids[b + 1] = s.commit_id
        record(tmp_path, b, s.commit_id, s.base_commit_id, store_name="default", other_store="extra")
    late = open_provider_named(tmp_path, "extra").get_store(1)
    late.put(1, (-1,))
    with pytest.raises(CommitConflictError, match="batch"):
        late.commit()
    q = open_provider_named(tmp_path, "extra")
    assert contents(q.get_read_store(4, ids[4])) == {b: (b,) for b in range(4)}


def test_a_re_execution_after_its_later_records_were_dropped_supersedes_the_abandoned_run(tmp_path):
    """The operator re-executes batch 3 (it deleted the records of batches 3 and later
    first): the commit of version 4 deletes the abandoned run's versions 5 and 6 and becomes
    the default lineage; the records of batches 0..2 still read back."""
    committed = run_batches(tmp_path, 0, 5)
    log = operator_files.commit_log(operator_files.operator_dir(str(tmp_path), 0))
    log.delete([3, 4, 5])
    assert commit_batch(provider(tmp_path), 3, [(3, (30,))]) == 4
    assert not any(n.startswith(("5_", "6_")) for n in files_of(tmp_path))
    assert contents(provider(tmp_path).get_read_store(4)) == {0: (0,), 1: (1,), 2: (2,), 3: (30,)}
    assert_read_back(tmp_path, {v: committed[v] for v in (1, 2, 3)})


def test_a_re_execution_without_records_supersedes_the_abandoned_run(tmp_path):
    """A bare engine user (no driver, no records) re-executing from version 3: the abandoned
    run above 4 is deleted, as before."""
    run_batches(tmp_path, 0, 5, recorded=False)
    assert commit_batch(provider(tmp_path), 3, [(3, (30,))]) == 4
    assert not any(n.startswith(("5_", "6_")) for n in files_of(tmp_path))
    assert contents(provider(tmp_path).get_read_store(4))[3] == (30,)


def test_the_record_a_repartition_left_in_operator_json_protects_its_files(tmp_path):
    """After ``statecore repartition`` at batch 3, the record of batch 3 is the one
    ``_operator.json`` holds (``_commits/3`` may not be written yet): a late attempt that
    opened version 2 and would delete version 4 is refused."""
    committed = run_batches(tmp_path, 0, 3, recorded=False)
    moved = operator_files.commit_record(3, 1, "default", "repartition-x", [committed[4][0]], ["00" * 8])
    files = CheckpointFiles(operator_files.operator_dir(str(tmp_path), 0))
    files.write_json(operator_files.OPERATOR_METADATA_FILE, {
        "format": operator_files.METADATA_FORMAT, "operator_id": 0, "num_partitions": 1,
        "key_schema": KEY_SCHEMA.describe(), "value_schema": VALUE_SCHEMA.describe(),
        operator_files.REPARTITION_KEY: {"batch_id": 3, "from_partitions": 2, "record": moved}})
    before = files_of(tmp_path)
    late = provider(tmp_path).get_store(2)
    late.put(2, (-2,))
    with pytest.raises(CommitConflictError, match="after batch 3 was committed and recorded"):
        late.commit()
    assert files_of(tmp_path) == before
    assert_read_back(tmp_path, {4: committed[4]})
