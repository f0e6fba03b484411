"""Sessions with a custom rule, as a statecore StatefulProcessor in a streaming query.

A user's session ends after ``GAP`` of inactivity (an event-time timer) or at once when the
user checks out (a row with ``page == "checkout"``); each closed session is emitted once:
``(user, start, end, clicks, checked_out)``. Every handler works on whole arrays: the rows of
all users of a micro-batch are sorted once, and sessions are cut and merged with numpy.

    python examples/custom_sessions.py [--dir DIR] [--users 200] [--batches 6]

It writes JSON files (one per micro-batch), runs them through a streaming query on local
Spark (``foreachBatch`` + ``StatefulOperator``), flushes the end of the run with an empty
batch and an advanced watermark, and checks the sessions against the same rule computed in
plain Python over all the events.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np
import pyarrow as pa

GAP_US = 30_000_000  # 30 s of inactivity ends a session
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def processor_class():
    from pyspark_glue import StatefulProcessor

    class CheckoutSessions(StatefulProcessor):
        key_columns = ["user"]
        key_schema = np.dtype([("user", "<i8")])
        output_schema = "user long, start timestamp, end timestamp, clicks long, checked_out boolean"
        time_mode = "event_time"
        event_time = "ts"
        delay = "10 seconds"

        def init(self, state):
            self.current = state.value("open", [("start", "<i8"), ("last", "<i8"), ("clicks", "<i8")])

        def handle_input(self, groups, timers):
            ts = groups.column("ts")
            checkout = groups.column("page") == "checkout"
            # each user's rows in event-time order
            order = np.lexsort((ts, groups.group))
            g, ts, checkout = groups.group[order], ts[order], checkout[order]
            # the open session each user had, and its timer, which this input replaces
            held, has = self.current.get(groups.keys)
            timers.delete(groups.keys[has], held["last"][has] + GAP_US)
            # a row starts a new segment if it is a user's first, follows a checkout, or
            # comes GAP after the previous row
            first = np.r_[True, g[1:] != g[:-1]]
            cut = first.copy()
            cut[1:] |= checkout[:-1] | (ts[1:] - ts[:-1] > GAP_US)
            seg = np.flatnonzero(cut)
            seg_user = g[seg]
            seg_last = np.maximum.reduceat(ts, seg)
            seg_clicks = np.diff(np.append(seg, len(ts)))
            seg_start = ts[seg]
            seg_closed = checkout[np.append(seg[1:], len(ts)) - 1]
            # the user's first segment continues the held session if it came within GAP
            opening = first[seg]
            joins = opening & has[seg_user] & (seg_start - held["last"][seg_user] <= GAP_US)
            seg_start = np.where(joins, held["start"][seg_user], seg_start)
            seg_clicks = seg_clicks + np.where(joins, held["clicks"][seg_user], 0)
            # a held session not continued ends where it was
            ended = has & ~np.isin(np.arange(len(groups)), seg_user[joins])
            # segments followed by another of the same user are closed too
            last_of_user = np.r_[seg_user[1:] != seg_user[:-1], True]
            emit = seg_closed | ~last_of_user
            out = [self._rows(groups.keys[ended], held["start"][ended], held["last"][ended],
                              held["clicks"][ended], np.zeros(int(ended.sum()), bool)),
                   self._rows(groups.keys[seg_user[emit]], seg_start[emit], seg_last[emit], seg_clicks[emit],
                              seg_closed[emit])]
            still_open = last_of_user & ~seg_closed
            keys = groups.keys[seg_user[still_open]]
            values = np.zeros(len(keys), dtype=self.current.dtype)
            values["start"], values["last"] = seg_start[still_open], seg_last[still_open]
            values["clicks"] = seg_clicks[still_open]
            self.current.put(keys, values)
            timers.register(keys, values["last"] + GAP_US)
            closed_users = groups.keys[np.setdiff1d(np.arange(len(groups)), seg_user[still_open])]
            self.current.clear(closed_users)
            return pa.concat_tables([pa.Table.from_batches([b]) for b in out])

        def handle_expired_timers(self, keys, times, timers):
            held, has = self.current.get(keys)
            self.current.clear(keys[has])
            return self._rows(keys[has], held["start"][has], held["last"][has], held["clicks"][has],
                              np.zeros(int(has.sum()), bool))

        @staticmethod
        def _rows(keys, start, last, clicks, checked_out):
            return pa.RecordBatch.from_pydict({
                "user": pa.array(keys["user"], pa.int64()), "start": pa.array(start, pa.timestamp("us", "UTC")),
                "end": pa.array(last, pa.timestamp("us", "UTC")), "clicks": pa.array(clicks, pa.int64()),
                "checked_out": pa.array(checked_out, pa.bool_())})

    return CheckoutSessions


def make_events(users, batches, seed=0):
    """Per batch, events ``(user, seconds after T0, page)``: each batch covers the next minute,
    in order per user (so the plain-Python rule below needs no watermark)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(batches):
        n = users * 3
        user = rng.integers(0, users, n)
        seconds = 60 * b + np.sort(rng.uniform(0, 60, n))
        page = np.where(rng.random(n) < 0.05, "checkout", "view")
        out.append([(int(u), round(float(s), 3), str(p)) for u, s, p in zip(user, seconds, page)])
    return out


def expected_sessions(events):
    """The rule in plain Python, over every event of every batch."""
    by_user = {}
    for batch in events:
        for user, seconds, page in batch:
            by_user.setdefault(user, []).append((round(seconds * 1_000_000), page))
    sessions = []
    for user, rows in by_user.items():
        rows.sort()
        start = last = None
        clicks = 0
        for t, page in rows:
            if start is not None and t - last > GAP_US:
                sessions.append((user, start, last, clicks, False))
                start = None
            if start is None:
                start, clicks = t, 0
            last, clicks = t, clicks + 1
            if page == "checkout":
                sessions.append((user, start, last, clicks, True))
                start = None
        if start is not None:
            sessions.append((user, start, last, clicks, False))
    return sorted(sessions)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="working directory (default: a temporary one)")
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--batches", type=int, default=6)
    args = p.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = args.dir or tempfile.mkdtemp(prefix="statecore-sessions-")
    events = make_events(args.users, args.batches)
    source = os.path.join(root, "events")
    os.makedirs(source, exist_ok=True)
    for i, batch in enumerate(events):
        path = os.path.join(source, f"part-{i:04d}.json")
        with open(path, "w") as f:
            for user, seconds, page in batch:
                ts = (T0 + datetime.timedelta(seconds=seconds)).isoformat()
                f.write(json.dumps({"user": user, "ts": ts, "page": page}) + "\n")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))

    from pyspark.sql import SparkSession

    from pyspark_glue import StatefulOperator

    spark = (SparkSession.builder.master("local[2]").appName("statecore-custom-sessions")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    op = StatefulOperator(os.path.join(root, "state"), 0, 2, fn=processor_class()())
    got = []

    def process(df, batch_id):
        got.extend(tuple(r) for r in op.process(df, batch_id).collect())

    query = (spark.readStream.schema("user long, ts timestamp, page string").option("maxFilesPerTrigger", 1)
             .json(source).writeStream.foreachBatch(process)
             .option("checkpointLocation", os.path.join(root, "checkpoint")).trigger(availableNow=True).start())
    query.awaitTermination()
    # the end of a bounded run: an empty batch whose watermark closes every session
    empty = spark.createDataFrame([], "user long, ts timestamp, page string")
    got.extend(tuple(r) for r in op.process(empty, len(events), advance_watermark_to=T0 + datetime.timedelta(
        days=1)).collect())
    op.close()
    spark.stop()

    def micros(t):  # Spark hands back timestamps as naive local times
        return round((t.timestamp() - T0.timestamp()) * 1_000_000)

    sessions = sorted((u, micros(s), micros(e), c, k) for u, s, e, c, k in got)
    expected = expected_sessions(events)
    print(f"{len(sessions)} sessions from {sum(len(b) for b in events)} events "
          f"({sum(1 for s in sessions if s[4])} ended by a checkout)")
    if sessions != expected:
        print(f"MISMATCH: {len(set(sessions) ^ set(expected))} sessions differ from the plain-Python rule")
        return 1
    print("the sessions match the rule computed in plain Python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
