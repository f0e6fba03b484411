"""The harness (pyspark_glue.testing.Harness): a processor run over hand-given batches without
Spark, with a clock set by hand. The README's processor example, its processing-time TTL
ending exactly at its boundary; timers firing exactly at their time; several partitions; a
failing batch run again; a restart; the clocks; bad input. (That a harness run and a real
StatefulOperator run agree is tests/spark/test_harness_vs_operator.py, with Spark.)"""
import datetime

import numpy as np
import pytest

from statecore import StateStoreId
from statecore.files import open_store_files
from pyspark_glue.clocks import ManualClock, WallClock
from pyspark_glue.testing import Harness
from tests.processor_support import Sessions, clicks, readme_blocks, readme_module, sorted_rows

MINUTE_MS = 60_000


@pytest.fixture
def readme_example(tmp_path):
    with readme_module(tmp_path) as module:
        yield module


def test_the_readme_processor_example_passes_its_own_harness_test(readme_example):
    _, test = readme_blocks()
    exec(compile(test, "README.md", "exec"), dict(readme_example.__dict__))


def test_a_processing_time_ttl_ends_exactly_at_its_boundary_under_a_set_clock(readme_example):
    """An item put at t lives while the clock is below t + 1 hour and is gone at t + 1 hour;
    put again at t + 40 min, it lives until t + 100 min (a write restarts its TTL)."""
    with Harness(readme_example.Carts(), clock=ManualClock(10_000)) as h:
        h.run([{"user": 1, "item": 7, "qty": 2}, {"user": 1, "item": 8, "qty": 1}])  # at 10 s
        h.run([{"user": 1, "item": 8, "qty": 5}], processing_time=10_000 + 40 * MINUTE_MS)
        h.run(processing_time=10_000 + 60 * MINUTE_MS - 1)
        _, items, qty = h.map("cart", [1])
        assert sorted(zip(items["item"].tolist(), qty["qty"].tolist())) == [(7, 2), (8, 5)]
        h.run(processing_time=10_000 + 60 * MINUTE_MS)
        _, items, qty = h.map("cart", [1])
        assert list(zip(items["item"].tolist(), qty["qty"].tolist())) == [(8, 5)]
        keys, values = h.rows("cart")
        assert keys["item"].tolist() == [8], "the ended entry left the store, not only the reads"
        h.run(processing_time=10_000 + 100 * MINUTE_MS - 1)
        assert len(h.map("cart", [1])[0]) == 1
        h.run(processing_time=10_000 + 100 * MINUTE_MS)
        assert len(h.map("cart", [1])[0]) == 0


def test_a_processing_time_timer_fires_in_the_first_batch_at_or_after_its_time(readme_example):
    """The reminder is due 30 min after the last change: not in a batch 1 ms before, then
    exactly once; a change moves it."""
    with Harness(readme_example.Carts()) as h:
        h.run([{"user": 1, "item": 7, "qty": 2}, {"user": 2, "item": 3, "qty": 1}], processing_time=0)
        which, times = h.timers([1, 2])
        assert which.tolist() == [0, 1] and times.tolist() == [30 * MINUTE_MS * 1000] * 2
        h.run([{"user": 2, "item": 4, "qty": 1}], processing_time=10 * MINUTE_MS)  # user 2's moves to 40 min
        assert h.run(processing_time=30 * MINUTE_MS - 1).num_rows == 0
        assert h.run(processing_time=30 * MINUTE_MS).to_pylist() == [{"user": 1, "items": 1}]
        assert h.timers([1])[1].tolist() == []
        assert h.run(processing_time=39 * MINUTE_MS).num_rows == 0
        assert h.run(processing_time=41 * MINUTE_MS).to_pylist() == [{"user": 2, "items": 2}]
        assert h.last_progress["batch_timestamp_ms"] == 41 * MINUTE_MS


@pytest.mark.parametrize("seed", [0, 1])
def test_two_partitions_give_the_output_and_state_of_one(seed):
    """Rows routed by Spark's hash to two partitions: every batch's output, the late rows and
    the state read back are those of one partition."""
    rng = np.random.default_rng(seed)
    batches = [clicks(rng, b) for b in range(12)]
    users = list(range(12))
    with Harness(Sessions()) as one, Harness(Sessions(), num_partitions=2) as two:
        fired = 0
        for b, rows in enumerate(batches + [None] * 3):
            flush = 200_000 if b >= 12 else None  # the end of a bounded run: the watermark moved on
            out1, out2 = one.run(rows, advance_watermark_to=flush), two.run(rows, advance_watermark_to=flush)
            assert sorted_rows(out1) == sorted_rows(out2), f"batch {b}"
            assert one.last_progress["late_rows"] == two.last_progress["late_rows"]
            fired += out1.num_rows
            v1, f1 = one.value("count", users)
            v2, f2 = two.value("count", users)
            assert f1.tolist() == f2.tolist() and v1[f1].tolist() == v2[f2].tolist()
            w1, p1 = one.list("pages", users)
            w2, p2 = two.list("pages", users)
            assert w1.tolist() == w2.tolist() and p1.tolist() == p2.tolist()
        assert fired > 5, "sessions must end for the test to mean anything"
        assert len(two.rows("count")[0]) == 0, "every session ended by the flush"


def test_a_failing_batch_leaves_nothing_and_runs_again():
    """fn raises in the second partition of a batch, after the first partition's ran: no
    store of the batch is committed (the first partition's neither), and the same batch run
    again gives what a run without the failure gives."""
    class Flaky(Sessions):
        fail_in = None

        def open(self, context):
            self.partition = context.partition_id  # before the task's copy is made
            return super().open(context)

        def handle_input(self, groups, timers):
            super().handle_input(groups, timers)
            if self.partition == Flaky.fail_in:
                raise RuntimeError("boom")

    rng = np.random.default_rng(3)
    batches = [clicks(rng, b) for b in range(4)]
    with Harness(Flaky(), num_partitions=2) as h, Harness(Sessions(), num_partitions=2) as clean:
        for rows in batches[:2]:
            h.run(rows)
            clean.run(rows)
        before = sorted(h.rows("count")[0].tolist())
        Flaky.fail_in = 1
        with pytest.raises(RuntimeError, match="boom"):
            h.run(batches[2])
        assert h.batch_id == 2
        for partition in (0, 1):
            for store in ("count", "pages", "__timers", "default"):
                location = StateStoreId(h.checkpoint_location, 0, partition, store_name=store)
                versions = open_store_files(location.store_checkpoint_location()).list_versions().versions()
                assert 3 not in set(versions), f"partition {partition}'s {store} committed the failed batch"
        assert sorted(h.rows("count")[0].tolist()) == before
        Flaky.fail_in = None
        for rows in batches[2:]:
            assert sorted_rows(h.run(rows)) == sorted_rows(clean.run(rows))
        assert sorted(h.rows("count")[0].tolist()) == sorted(clean.rows("count")[0].tolist())


def test_a_restart_reads_the_state_back_from_its_files(tmp_path):
    rng = np.random.default_rng(5)
    batches = [clicks(rng, b) for b in range(6)]
    with Harness(Sessions(), checkpoint_location=str(tmp_path)) as h, Harness(Sessions()) as steady:
        for b, rows in enumerate(batches):
            if b == 3:
                h.restart()
                assert not h._providers
            assert sorted_rows(h.run(rows)) == sorted_rows(steady.run(rows))
        assert (tmp_path / "0" / "1" / "count").is_dir() is False  # one partition: 0 only
        assert (tmp_path / "0" / "0" / "count").is_dir()


def test_initial_state_goes_to_handle_initial_state_in_the_first_batch_only():
    class Seeded(Sessions):
        def handle_initial_state(self, groups, timers):
            values = np.zeros(len(groups), self.count.dtype)
            values["n"] = groups.column("n", np.int64)[groups.starts]
            values["last"] = 0
            self.count.put(groups.keys, values)

    initial = [{"user": 1, "n": 100}, {"user": 2, "n": 200}]
    rng = np.random.default_rng(7)
    with Harness(Seeded(), initial_state=initial) as h:
        h.run(clicks(rng, 0, n=5, users=1))  # user 0 only
        values, found = h.value("count", [0, 1, 2])
        assert found.tolist() == [True, True, True]
        assert values["n"].tolist() == [5, 100, 200]
        h.run(clicks(rng, 1, n=5, users=1))
        assert h.value("count", [1])[0]["n"].tolist() == [100]


def test_a_task_copy_of_the_processor_keeps_nothing_between_batches():
    """What a handler sets on ``self`` is gone in the next batch, as on Spark (each task
    gets its own copy of the processor)."""
    class Remembers(Sessions):
        def handle_input(self, groups, timers):
            assert not hasattr(self, "seen"), "a task saw what an earlier task set on its processor"
            self.seen = True
            super().handle_input(groups, timers)

    rng = np.random.default_rng(9)
    processor = Remembers()
    with Harness(processor) as h:
        h.run(clicks(rng, 0))
        h.run(clicks(rng, 1))
    assert not hasattr(processor, "seen")


def test_the_manual_clock_moves_only_forward_and_by_whole_milliseconds():
    clock = ManualClock(1_000)
    clock.advance("2 seconds")
    clock.advance(5)
    assert clock.now_ms() == 3_005
    with pytest.raises(ValueError, match="does not go back"):
        clock.set(3_004)
    with pytest.raises(ValueError, match="whole milliseconds"):
        clock.advance("10 microseconds")
    with pytest.raises(TypeError, match="int milliseconds"):
        ManualClock(-1)
    assert WallClock().now_ms() > 1_700_000_000_000


def test_bad_input_is_refused_naming_what_is_wrong():
    with pytest.raises(TypeError, match="hold dicts"):
        Harness(Sessions()).run([(1, 2, 3)])
    with pytest.raises(ValueError, match="first batch needs rows"):
        Harness(Sessions()).run()
    with Harness(Sessions()) as h:
        with pytest.raises(RuntimeError, match="no batch has run yet"):
            h.value("count", [1])
        h.run(clicks(np.random.default_rng(0), 0))
        with pytest.raises(KeyError, match="no ListState named 'count'.*'count': 'ValueState'"):
            h.list("count", [1])
        with pytest.raises(TypeError, match="key dtype"):
            h.value("count", np.zeros(1, dtype=[("user", "<i4")]))
        with pytest.raises(ValueError, match="distinct"):
            h.list("pages", [1, 1])
        with pytest.raises(KeyError, match="no store 'nope'"):
            h.rows("nope")
    with pytest.raises(ValueError, match="fixed-width"):
        class ByName(Sessions):
            key_columns = ["name"]
            key_schema = np.dtype([("name", "S8")])
        Harness(ByName(), num_partitions=2).run([{"name": "a", "ts": datetime.datetime(2026, 1, 1), "page": 1}])


@pytest.mark.parametrize("text", ["a array<int>", "a int NOT NULL", "a int COMMENT 'x'", "s struct<x: int>",
                                  "a varchar(3)", ""])
def test_a_ddl_beyond_simple_columns_is_left_to_sparks_parser(text):
    from pyspark_glue.arrow import parse_simple_ddl

    assert parse_simple_ddl(text) is None


def test_a_processor_upgraded_with_a_new_variable_goes_on_in_the_harness(tmp_path):
    """restart(fn=...) with a processor that declares one more variable: the new variable's
    store starts empty at the batch's version (as in the operator), the old state goes on,
    and the task knows which stores are new (``context.new_stores``)."""
    class Upgraded(Sessions):
        def init(self, state):
            super().init(state)
            self.first_seen = state.value("first_seen", [("batch", "<i8")])

        def open(self, context):
            Upgraded.new_stores = set(context.new_stores)
            return super().open(context)

        def handle_input(self, groups, timers):
            super().handle_input(groups, timers)
            _, found = self.first_seen.get(groups.keys)
            seen = np.full(int((~found).sum()), 7, dtype=[("batch", "<i8")])
            self.first_seen.put(groups.keys[~found], seen)

    rng = np.random.default_rng(11)
    with Harness(Sessions(), checkpoint_location=str(tmp_path)) as h:
        h.run(clicks(rng, 0, users=3))
        before = h.value("count", [0, 1, 2])
        h.restart(fn=Upgraded())
        h.run(clicks(rng, 1, n=0, users=3))
        assert Upgraded.new_stores == {"first_seen"}
        after = h.value("count", [0, 1, 2])
        assert after[1].tolist() == before[1].tolist() and after[0].tolist() == before[0].tolist()
        h.run(clicks(rng, 2, n=6, users=3))
        assert Upgraded.new_stores == set()
        values, found = h.value("first_seen", [0, 1, 2])
        assert found.any() and set(values["batch"][found].tolist()) == {7}
