"""Running the same input files as micro-batches through one of Spark's own stateful queries
and through a statecore operator, for the event-time tests.

Files are JSON lines, one per micro-batch (``maxFilesPerTrigger=1``), their modification
times in order. Each phase adds files and runs both queries with ``availableNow`` from their
checkpoints (a stop and restart between phases). Spark's query may run a batch without data at
the end of a phase (its watermark moved); statecore's ``foreachBatch`` query runs none, so
the harness gives statecore's query an empty file for each such batch of Spark's, so that
both queries run the same batches with the same ids (an empty batch is how a user flushes a
bounded run: ``docs/event-time.md``, "Flushing")."""
import json
import os

SCHEMA = "id long, ts timestamp, payload string"


def write_batch_files(directory, batches, first_index=0):
    """One JSON-lines file per batch of ``(id, ts seconds, payload)`` rows; mtimes in order."""
    os.makedirs(directory, exist_ok=True)
    for i, rows in enumerate(batches, start=first_index):
        path = os.path.join(directory, f"batch-{i:04d}.json")
        with open(path, "w") as f:
            for row_id, seconds, payload in rows:
                f.write(json.dumps({"id": row_id, "ts": _iso(seconds), "payload": payload}) + "\n")
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


def _source(spark, directory):
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(directory)


def run_spark_phase(spark, directory, checkpoint, transform, seen):
    """Spark's own query over the files not yet read; appends ``(batch_id, rows, late_rows)``
    per batch to ``seen`` (rows as tuples), data or not."""
    def collect(df, batch_id):
        seen.append([batch_id, [tuple(r) for r in df.collect()], None])

    query = (transform(_source(spark, directory)).writeStream.foreachBatch(collect)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    late = {p["batchId"]: sum(op.get("numRowsDroppedByWatermark", 0) for op in p.get("stateOperators", []))
            for p in query.recentProgress}
    inputs = {p["batchId"]: p["numInputRows"] for p in query.recentProgress}
    for entry in seen:
        if entry[2] is None:
            entry[2] = late.get(entry[0], 0)
            entry.append(inputs.get(entry[0]))
    return query


def run_statecore_phase(spark, directory, checkpoint, operator, seen):
    """statecore's query over the files not yet read; appends ``(batch_id, rows, late_rows)``
    per batch to ``seen``."""
    def process(df, batch_id):
        out = operator.process(df, batch_id)
        seen.append([batch_id, [tuple(r) for r in out.collect()], operator.last_progress.get("late_rows", 0)])

    query = (_source(spark, directory).writeStream.foreachBatch(process)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    if query.exception() is not None:
        raise query.exception()


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
