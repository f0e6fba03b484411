"""Running the same input files as micro-batches through one of Spark's own stateful queries
and through a statecore operator, for the event-time tests (and the processor's,
tests/spark/test_processor_vs_spark.py, which reads parquet files: ``fmt``).

Files are JSON lines, one per micro-batch (``maxFilesPerTrigger=1``), their modification
times in order. Each phase adds files and runs both queries with ``availableNow`` from their
checkpoints (a stop and restart between phases). Spark's query may run a batch without data at
the end of a phase (its watermark moved); statecore's ``foreachBatch`` query runs none, so
the harness gives statecore's query an empty file for each such batch of Spark's, so that
both queries run the same batches with the same ids (an empty batch is how a user flushes a
bounded run: ``docs/event-time.md``, "Flushing")."""
import contextlib
import functools
import json
import os
import pickle
import tempfile

from tests.glue_support import start_query

SCHEMA = "id long, ts timestamp, payload string"


def write_batch_files(directory, batches, first_index=0):
    """One JSON-lines file per batch of rows (dicts, or ``(id, ts, payload)`` tuples), ``ts``
    in seconds after 2026-01-01; mtimes in order."""
    os.makedirs(directory, exist_ok=True)
    for i, rows in enumerate(batches, start=first_index):
        path = os.path.join(directory, f"batch-{i:04d}.json")
        with open(path, "w") as f:
            for row in rows:
                if not isinstance(row, dict):
                    row = dict(zip(("id", "ts", "payload"), row))
                f.write(json.dumps(dict(row, ts=_iso(row["ts"]))) + "\n")
        os.utime(path, (1_000_000 + 10 * i, 1_000_000 + 10 * i))


def write_empty_files(directory, after_index, count):
    """``count`` empty files read right after batch file ``after_index``."""
    for k in range(count):
        path = os.path.join(directory, f"batch-{after_index:04d}-empty-{k}.json")
        open(path, "w").close()
        os.utime(path, (1_000_000 + 10 * after_index + 1 + k,) * 2)


def _iso(seconds):
    whole, frac = divmod(round(seconds * 1_000_000), 1_000_000)
    import datetime
    t = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=whole,
                                                                                       microseconds=frac)
    return t.isoformat()


def _source(spark, directory, schema, fmt="json"):
    return spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).format(fmt).load(directory)


def _input_rows(query):
    """{batch id: rows read from the source} of a finished query run (the ``numInputRows``
    property: a Connect client's progress leaves the key out and sums its sources')."""
    return {p["batchId"]: p.numInputRows for p in query.recentProgress}


def _rows(df, columns):
    """The rows of ``df`` as tuples of ``columns`` (nested rows as tuples too), in that order."""
    return [tuple(tuple(r[c]) if hasattr(r[c], "asDict") else r[c] for c in columns) for r in df.collect()]


class BatchReports:
    """What a ``foreachBatch`` function saw, batch by batch, kept in files: under Spark Connect
    the function runs in the server's Python worker, where appending to a list of the test's
    would be lost; the same files serve a classic session. Made beside ``checkpoint``, one
    directory per run of a query."""

    def __init__(self, checkpoint):
        parent = os.path.dirname(checkpoint)
        os.makedirs(parent, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="batch-reports-", dir=parent)

    def writer(self):
        """``write(batch_id, entry)``, picklable, to call in the ``foreachBatch`` function."""
        return functools.partial(_write_report, self.directory)

    def read(self):
        """The entries written, in batch order."""
        names = sorted(os.listdir(self.directory))
        out = []
        for name in names:
            with open(os.path.join(self.directory, name), "rb") as f:
                out.append(pickle.load(f))
        return out


def _write_report(directory, batch_id, entry):
    path = os.path.join(directory, f"{batch_id:08d}.pickle")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(entry, f)
    os.replace(path + ".tmp", path)


def run_spark_phase(spark, directory, checkpoint, transform, seen, schema=SCHEMA, columns=None, fmt="json"):
    """Spark's own query over the files not yet read; appends ``(batch_id, rows, late_rows,
    input rows)`` per batch to ``seen`` (rows as tuples of ``columns``), data or not."""
    reports = BatchReports(checkpoint)
    report = reports.writer()

    def collect(df, batch_id):
        report(batch_id, [batch_id, _rows(df, columns or df.columns), None])

    writer = transform(_source(spark, directory, schema, fmt)).writeStream.foreachBatch(collect)
    writer = writer.outputMode(getattr(transform, "output_mode", "append"))
    query = start_query(writer.option("checkpointLocation", checkpoint).trigger(availableNow=True))
    query.awaitTermination()
    seen.extend(reports.read())
    late = {p["batchId"]: sum(op.get("numRowsDroppedByWatermark", 0) for op in p.get("stateOperators", []))
            for p in query.recentProgress}
    inputs = _input_rows(query)
    for entry in seen:
        if entry[2] is None:
            entry[2] = late.get(entry[0], 0)
            entry.append(inputs.get(entry[0]))
    return query


def run_statecore_phase(spark, directory, checkpoint, operator, seen, schema=SCHEMA, columns=None, fmt="json"):
    """statecore's query over the files not yet read; appends ``(batch_id, rows, late_rows,
    input rows)`` per batch to ``seen`` (the late rows from the operator's ``last_progress``
    where it ran: the client's process, or under Connect the server's worker; the batch
    records the client reads must hold the same counts)."""
    reports = BatchReports(checkpoint)
    report = reports.writer()

    def process(df, batch_id):
        out = operator.process(df, batch_id)
        report(batch_id, [batch_id, _rows(out, columns or out.columns), operator.last_progress.get("late_rows", 0)])

    query = start_query(_source(spark, directory, schema, fmt).writeStream.foreachBatch(process)
                        .option("checkpointLocation", checkpoint).trigger(availableNow=True))
    query.awaitTermination()
    if query.exception() is not None:
        raise query.exception()
    new = reports.read()
    # What the client reads of each batch under either kind of session: its batch record
    # (under Connect the operator that ran the batch lived in the server's worker).
    assert [operator.commit_record(e[0])["late_rows"] for e in new] == [e[2] for e in new]
    seen.extend(new)
    inputs = _input_rows(query)
    for entry in seen:
        if len(entry) == 3:
            entry.append(inputs.get(entry[0]))


def no_data_batches_at_end(seen, phase_start):
    """How many of Spark's batches since ``phase_start`` (an index in ``seen``) had no input,
    all at the end of the phase (none between data batches: the files were all there)."""
    flags = [entry[3] == 0 for entry in seen[phase_start:]]
    count = 0
    while flags and flags[-1]:
        flags.pop()
        count += 1
    assert not any(flags), f"Spark ran a batch without data between data batches: {seen[phase_start:]}"
    return count


def compare_with_spark(spark, tmp_path, batches, phases, spark_transform, make_operator, schema=SCHEMA,
                       columns=None):
    """Both queries over ``batches`` in ``phases`` (``[(first, end)]`` file ranges, a restart
    with a new operator between phases); returns ``(spark_seen, ours_seen)`` after checking
    they ran the same batches."""
    theirs_in, ours_in = str(tmp_path / "spark-in"), str(tmp_path / "ours-in")
    spark_seen, ours_seen = [], []
    # statecore's tasks get their rows in several small Arrow batches, as large inputs come
    arrow_batch = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(arrow_batch)
    spark.conf.set(arrow_batch, "16")
    try:
        _run_phases(spark, tmp_path, batches, phases, spark_transform, make_operator, schema, columns, theirs_in,
                    ours_in, spark_seen, ours_seen)
    finally:
        spark.conf.set(arrow_batch, before)
    assert [e[0] for e in ours_seen] == [e[0] for e in spark_seen], \
        f"batches: ours {[(e[0], e[3]) for e in ours_seen]}, Spark's {[(e[0], e[3]) for e in spark_seen]}"
    return spark_seen, ours_seen


def _run_phases(spark, tmp_path, batches, phases, spark_transform, make_operator, schema, columns, theirs_in,
                ours_in, spark_seen, ours_seen):
    for lo, hi in phases:
        write_batch_files(theirs_in, batches[lo:hi], first_index=lo)
        start = len(spark_seen)
        run_spark_phase(spark, theirs_in, str(tmp_path / "spark-ckpt"), spark_transform, spark_seen, schema, columns)
        write_batch_files(ours_in, batches[lo:hi], first_index=lo)
        write_empty_files(ours_in, hi - 1, no_data_batches_at_end(spark_seen, start))
        operator = make_operator()  # a restart: a new operator and a new run of the query
        try:
            run_statecore_phase(spark, ours_in, str(tmp_path / "ours-ckpt"), operator, ours_seen, schema, columns)
        finally:
            operator.close()


@contextlib.contextmanager
def session_settings(spark, settings):
    """``spark``'s SQL ``settings`` changed while the block runs, then restored (or unset)."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
