"""Checking a whole checkpoint (``statecore verify``): every byte of every file, and that every
retained version loads.

Files are checked by the readers the store loads them with: a delta by
:meth:`statecore.DeltaReader.check` (header, every block header and payload checksum, the
trailer's counts and blocks checksum, the end of the file; ``deep`` also decompresses every
block, as a load does), a snapshot by :meth:`statecore.SnapshotReader.verify` (header,
footer, every data block: rows and slots; ``deep`` also looks every row's key up in the slot
index), the schema file by :func:`statecore.schema_file.read_schema_history` (every version
file's schemas must be an entry of it); every version file's header must name the version and
attempt its name does. ``_operator.json`` and the batch
records are read by the one metadata reader (:func:`statecore.checkpoint.parse_json`: bounded
size and nesting, the checksum their last member carries) and then checked for their shape
(:func:`statecore.operator_files.metadata_problems`, :func:`statecore.operator_files.checked_record`);
a file written before metadata carried checksums is reported as a problem only if its JSON
is damaged or of the wrong shape. The schema file carries no checksum: it is checked as UTF-8
JSON of the expected shape, and a damaged byte (never valid UTF-8 in ASCII JSON once flipped)
is found with its offset.

A sound snapshot and a sound delta of the same attempt must agree on the version's key
count (the delta's trailer records it; the snapshot holds that many rows).

Then the lineage (``docs/lineage.md``): each attempt ``(version, commit id)`` with a file must
load, following the parent ids in its deltas' headers down to a sound snapshot or to
version 0; and each attempt a batch record names must have a file. The repartition journals
an interrupted run left are checked as metadata files. Nothing is written.
"""
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import threading

from statecore import operator_files
from statecore._delta import DeltaReader
from statecore.checkpoint import CheckpointFiles, parse_json
from statecore.errors import SchemaMismatchError, StateCorruptionError, UnsafeFileError, VersionNotFoundError
from statecore.lineage import ROOT_COMMIT_ID, Chain, check_names_agree, file_name
from statecore.provider import read_version_header
from statecore.schema_file import MAX_SCHEMA_FILE_BYTES, SCHEMA_FILE, read_schema_history
from statecore.repartition import JOURNAL_DIR
from statecore.schema import RowSchema
from statecore.snapshot_files import check_snapshot

__all__ = ["Problem", "VerifyReport", "verify_checkpoint", "json_damage"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong: the file (or directory) it is in, the byte offset if known, and what."""

    path: str
    offset: int
    what: str

    def __str__(self):
        where = f" at byte {self.offset}" if self.offset is not None else ""
        return f"{self.path}{where}: {self.what}"


@dataclasses.dataclass
class VerifyReport:
    """What a verification found: ``problems`` (empty when all is sound), and how much it read."""

    problems: list = dataclasses.field(default_factory=list)
    lock: object = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)
    files: int = 0
    bytes: int = 0
    versions: int = 0  # attempts whose lineage was followed
    stores: int = 0

    @property
    def sound(self):
        return not self.problems

    def add(self, path, offset, what):
        with self.lock:
            self.problems.append(Problem(str(path), offset, what))

    def count(self, n_bytes):
        with self.lock:
            self.files += 1
            self.bytes += n_bytes


def json_damage(raw):
    """``(value, None)`` for UTF-8 JSON bytes, else ``(None, (byte offset, reason))``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, (e.start, f"not UTF-8 text ({e.reason})")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, (len(text[:e.pos].encode()), f"not JSON: {e.msg}")
    except RecursionError:
        return None, (None, "not JSON: nested too deeply")


def _no_progress(description, total=None):
    return contextlib.nullcontext(lambda n=1: None)


class _StoreCheck:
    """The files and lineage of one store directory."""

    def __init__(self, ref, report, deep, storage_options):
        self.ref, self.report, self.deep = ref, report, deep
        self.files = ref.files(storage_options)
        self.listing = self.files.list_versions()
        self.sizes = {f.name: self.files.size(f.name) for f in self.listing}
        self.history = None  # the store's SchemaHistory, once read
        self.schemas = self._schema_file()  # its newest (key, value) schemas
        self.attempts = {}  # (kind, version, commit id) -> VersionFile
        self.parents = {}  # delta name -> parent id, from its checked header
        self.sound = {}  # name -> whether the whole file checked out
        for f in sorted(self.listing, key=lambda f: f.name):
            try:
                commit_id, parent_id = read_version_header(self.files, f)
            except (StateCorruptionError, SchemaMismatchError, UnsafeFileError) as e:
                self._damaged(f, e)
                commit_id, parent_id = f.commit_id, None
                if commit_id is None:
                    continue  # a name of the previous layout: its header alone knows the attempt
            self.attempts[(f.kind, f.version, commit_id)] = f
            if parent_id is not None:
                self.parents[f.name] = parent_id
        self.loadable = {}  # (version, commit id) -> None or why it does not load
        # name -> the keys a sound file says its version holds: a snapshot's rows, a
        # delta's trailer (when its writer recorded the count)
        self.key_counts = {}

    def _damaged(self, f, e):
        self.sound[f.name] = False
        offset = getattr(e, "offset", None)
        what = e.reason if isinstance(e, (StateCorruptionError, UnsafeFileError)) else str(e)
        self.report.add(self.files.path(f.name), offset, what)

    def _schema_file(self):
        path = self.files.path(SCHEMA_FILE)
        try:
            raw = self.files.read_range(SCHEMA_FILE, 0, MAX_SCHEMA_FILE_BYTES + 1)
        except FileNotFoundError:
            if len(self.listing.names):
                self.report.add(path, None, f"missing: the store has version files but no {SCHEMA_FILE}")
            return None
        except (OSError, UnsafeFileError) as e:
            self.report.add(path, None, f"unreadable: {e}")
            return None
        self.report.files += 1
        self.report.bytes += len(raw)
        value, damage = json_damage(raw)
        if damage is not None:
            self.report.add(path, *damage)
            return None
        try:
            self.history = read_schema_history(self.files)
        except StateCorruptionError as e:
            self.report.add(path, e.offset, e.reason)
            return None
        return None if self.history is None else (self.history.newest.key, self.history.newest.value)

    def _check_file_schemas(self, f, path, fingerprints, widths):
        """SchemaMismatchError unless the store's schema history names the schemas a version
        file was written with (its header's fingerprints and widths), as a load needs."""
        if self.history is None:
            return
        i = self.history.entry_of(*fingerprints, f.version)
        entry = None if i is None else self.history.entries[i]
        if entry is None or (entry.key.width, entry.value.width) != tuple(widths):
            raise SchemaMismatchError(f"written with schemas the store's schema history does not name (key "
                                      f"fingerprint 0x{fingerprints[0]:016x}, value fingerprint "
                                      f"0x{fingerprints[1]:016x})")

    @property
    def total_bytes(self):
        return sum(self.sizes.values())

    def check_file(self, f):
        """Whether version file ``f`` checks out whole (memoized); a problem for each that does not."""
        if f.name in self.sound:
            return self.sound[f.name]
        path = self.files.path(f.name)
        try:
            if f.kind == "delta":
                with self.files.open_read(f.name) as source:
                    reader = DeltaReader(source, None, None, path=path)
                    self._check_file_schemas(f, path, (reader.key_fingerprint, reader.value_fingerprint),
                                             (reader.key_width, reader.value_width))
                    check_names_agree(f, path, reader.store_version, reader.commit_id)
                    reader.check(decode=self.deep)
                    count = reader.num_keys
            else:
                header = check_snapshot(self.files, f.name, deep=self.deep)
                self._check_file_schemas(f, path, (header.key_fingerprint, header.value_fingerprint),
                                         (header.key_schema.width, header.value_schema.width))
                check_names_agree(f, path, header.store_version, header.commit_id)
                count = header.row_count
        except (StateCorruptionError, SchemaMismatchError, UnsafeFileError) as e:
            self._damaged(f, e)
        except FileNotFoundError:
            self.sound[f.name] = False
            self.report.add(path, None, "vanished while it was being verified")
        else:
            self.sound[f.name] = True
            if count is not None:
                self.key_counts[f.name] = count
        self.report.count(self.sizes.get(f.name, 0))
        return self.sound[f.name]

    def report_count_mismatches(self):
        """A sound snapshot and a sound delta of the same attempt describe one version: the
        key count the delta's writer recorded must be the snapshot's row count (a writer
        that got either wrong is found here, where a load would trust the count)."""
        snapshots = sorted((v, c, f) for (kind, v, c), f in self.attempts.items() if kind == "snapshot")
        for version, commit_id, snapshot in snapshots:
            delta = self.attempts.get(("delta", version, commit_id))
            if delta is None:
                continue
            rows, recorded = self.key_counts.get(snapshot.name), self.key_counts.get(delta.name)
            if rows is not None and recorded is not None and rows != recorded:
                self.report.add(self.files.path(delta.name), None,
                                f"its trailer records {recorded} keys for version {version} (attempt "
                                f"{commit_id.hex()}), but the snapshot {self.files.path(snapshot.name)} of that "
                                f"attempt holds {rows} rows")

    def check_lineage(self, version, commit_id):
        """Why attempt ``(version, commit_id)`` does not load, or None if it does; checks the
        files on its way that were not checked yet (memoized per attempt)."""
        walked = []
        u, c = version, commit_id
        why = None
        while True:
            if (u, c) in self.loadable:
                why = self.loadable[(u, c)]
                break
            if u == 0:
                if c != ROOT_COMMIT_ID:
                    why = f"its version 1 does not start from version 0 (parent id {c.hex()})"
                break
            walked.append((u, c))
            snapshot = self.attempts.get(("snapshot", u, c))
            if snapshot is not None and self.check_file(snapshot):
                break
            delta = self.attempts.get(("delta", u, c))
            if delta is None:
                missing = self.files.path(file_name(u, c, "delta"))
                why = (f"version {u} (attempt {c.hex()}) on its lineage has no delta file {missing}"
                       + (" and its snapshot is damaged" if snapshot is not None else "")
                       + ("" if u == version else " (a missing version)"))
                break
            if not self.check_file(delta) or delta.name not in self.parents:
                why = f"the delta {self.files.path(delta.name)} of version {u} on its lineage is damaged"
                break
            u, c = u - 1, self.parents[delta.name]
        for step in walked:
            self.loadable[step] = why
        return why

    def report_lineage(self, version, commit_id):
        self.report.versions += 1
        why = self.check_lineage(version, commit_id)
        if why is not None:
            self.report.add(self.ref.location, None,
                            f"version {version} (attempt {commit_id.hex()}) of {self.ref.label()} cannot be "
                            f"loaded: {why}")

    def report_gaps(self):
        """The default lineage, followed down through every delta it has, must end at version
        0 or at a sound snapshot with nothing older left: a version missing in between cuts
        the versions below it off (and maintenance never leaves that)."""
        if not self.attempts:
            return
        try:
            top, c = self.default_chain().default_top()
        except (StateCorruptionError, SchemaMismatchError, UnsafeFileError, FileNotFoundError):
            return  # a damaged header or a file refused: reported with its file
        u = top
        while u > 0 and ("delta", u, c) in self.attempts and self.attempts[("delta", u, c)].name in self.parents:
            u, c = u - 1, self.parents[self.attempts[("delta", u, c)].name]
        older = sorted({f.version for f in self.listing if f.version < u})
        if u == 0 or (not older and ("delta", u, c) not in self.attempts):
            snapshot = self.attempts.get(("snapshot", u, c))
            if u == 0 or (snapshot is not None and self.check_file(snapshot)):
                return
        if ("delta", u, c) in self.attempts:
            return  # a damaged delta: reported with its file
        self.report.add(self.ref.location, None,
                        f"version {u} (attempt {c.hex()}) of the default lineage of {self.ref.label()} (newest "
                        f"version {top}) has no delta file {self.files.path(file_name(u, c, 'delta'))}: a missing "
                        f"version" + (f"; versions {older[0]}..{older[-1]} below it are cut off" if older else ""))

    def default_chain(self):
        return Chain(self.listing, lambda f: read_version_header(self.files, f), self.files.mtime,
                     self.files.path, self.ref.label())

    def all_attempts(self):
        return sorted({(v, c) for (_kind, v, c) in self.attempts})

    def has(self, version, commit_id):
        return any((kind, version, commit_id) in self.attempts for kind in ("delta", "snapshot"))

    def default_attempt(self, version):
        """The default lineage's attempt of ``version``; VersionNotFoundError if it has no file."""
        if version != 0 and not any(f.version == version for f in self.listing):
            present = self.listing.versions()
            raise VersionNotFoundError(
                f"version {version} does not exist in {self.ref.label()} ({self.ref.location}): it holds "
                + (f"versions {present[0]}..{present[-1]}" if present else "no version"))
        return self.default_chain().default_id(version)


def _read_json(files, name, what, report):
    """``(value, ok)`` of the metadata file ``name`` (:meth:`CheckpointFiles.read_json`'s checks),
    counted in ``report``; what is wrong with it reported there."""
    path = files.path(name)
    try:
        raw = files.read_bytes(name)
        report.count(len(raw))
        return parse_json(raw, path, what), True
    except StateCorruptionError as e:
        report.add(path, e.offset, e.reason)
    except UnsafeFileError as e:
        report.add(path, None, e.reason)
    except FileNotFoundError:
        report.add(path, None, "vanished while it was being verified")
    except OSError as e:
        report.add(path, None, f"unreadable: {e}")
    return None, False


def _check_metadata(op, report, storage_options):
    """The operator's ``_operator.json``: sound bytes, of the expected shape; returns it or None."""
    files = CheckpointFiles(op.location, storage_options)
    path = files.path(operator_files.OPERATOR_METADATA_FILE)
    value, ok = _read_json(files, operator_files.OPERATOR_METADATA_FILE, "operator metadata", report)
    if not ok:
        return None
    problems = operator_files.metadata_problems(value, op.operator_id)
    for what in problems:
        report.add(path, None, what)
    return None if problems else value


def _check_schemas_agree(op, metadata, checks, report):
    """Every store of the operator's store name holds the schemas its metadata records."""
    key = RowSchema.from_description(metadata["key_schema"])
    value = RowSchema.from_description(metadata["value_schema"])
    for check in checks:
        if check.ref.store_name == metadata.get("store_name", "default") and check.schemas is not None:
            if check.schemas != (key, value):
                report.add(check.files.path(SCHEMA_FILE), None,
                           f"schemas {check.schemas[0].describe()} / {check.schemas[1].describe()} differ from "
                           f"{key.describe()} / {value.describe()} of the operator's metadata")


def _check_records(op, checks, report, storage_options, batches=None):
    """Each batch record (those of ``batches``, or all) is a record, and names attempts that have
    files; returns ``{batch id: record}`` of the sound ones."""
    records = operator_files.commit_log(op.location, storage_options)
    by_store = {(c.ref.partition_id, c.ref.store_name): c for c in checks}
    sound = {}
    present = records.epochs()
    for b in present if batches is None else [b for b in batches if b in present]:
        path = records.path(b)
        value, ok = _read_json(records.files, str(b), "batch record", report)
        if not ok:
            continue
        try:
            record = operator_files.checked_record(value, b, path)
        except ValueError as e:
            what = str(e).removeprefix(path).lstrip(": ")
            report.add(path, None, f"it {what}" if what.startswith("is ") else what)
            continue
        named = [(record["store_name"], record["commit_ids"])] + list(record["store_commit_ids"].items())
        for store_name, ids in named:
            for p, commit_id in enumerate(ids):
                check = by_store.get((p, store_name))
                if check is None or not check.has(record["version"], bytes.fromhex(commit_id)):
                    where = check.ref.location if check is not None else f"{op.location}/{p}"
                    report.add(path, None, f"names version {record['version']} attempt {commit_id} of partition "
                                           f"{p} store {store_name!r}, which has no file of it in {where}")
        sound[b] = record
    return sound


def _check_journals(op, report, storage_options):
    """The bytes of each repartition journal an interrupted ``statecore repartition`` left (the
    next run reads it to undo that run): sound metadata JSON, an object."""
    journals = CheckpointFiles(f"{op.location}/{JOURNAL_DIR}", storage_options)
    for name, is_dir in journals.entries():
        if is_dir or name.startswith(".") or not name.endswith(".json"):
            continue
        value, ok = _read_json(journals, name, "repartition journal", report)
        if ok and not isinstance(value, dict):
            report.add(journals.path(name), None, "not a repartition journal (a JSON object)")


def verify_checkpoint(checkpoint, operator_id=None, version=None, deep=False, storage_options=None,
                      progress=_no_progress, threads=None):
    """Verify the :class:`statecore.checkpoint_scan.Checkpoint` ``checkpoint``.

    Parameters
    ----------
    operator_id : int, optional
        Only this operator (a state root).
    version : int, optional
        Only what loading ``version`` takes: in each store its attempt (the one the batch
        record of ``version - 1`` names, else the default lineage's) and the files of its
        lineage, plus that record. Default: every file and every attempt.
    deep : bool
        Also decompress every delta block and look every snapshot row's key up in the
        snapshot's index (what a load would trip on if a writer had written wrong bytes
        under right checksums).
    progress : callable
        ``progress(description, total)``: a context manager yielding ``advance(n_bytes)``
        (``statecore.cli.output.progress``).
    threads : int, optional
        Files checked at once (default: the CPUs, at most 4).

    Raises
    ------
    LookupError
        No such operator (a ``KeyError``), or ``version`` has no file in any store
        (:class:`VersionNotFoundError`; missing in only some stores is a problem).
    """
    report = VerifyReport()
    threads = threads if threads is not None else min(4, os.cpu_count() or 1)
    if checkpoint.kind == "store":
        groups = [(None, [checkpoint.store])]
    else:
        if operator_id is not None and operator_id not in checkpoint.operators:
            raise KeyError(f"operator {operator_id} does not exist in {checkpoint.location}: it has operator(s) "
                           f"{sorted(checkpoint.operators)}")
        chosen = [operator_id] if operator_id is not None else sorted(checkpoint.operators)
        groups = [(checkpoint.operators[op], checkpoint.operators[op].stores()) for op in chosen]
    plan = []
    for op, refs in groups:
        checks = [_StoreCheck(ref, report, deep, storage_options) for ref in refs]
        report.stores += len(checks)
        metadata = None
        if op is not None and op.has_metadata:
            metadata = _check_metadata(op, report, storage_options)
            if metadata is not None:
                _check_schemas_agree(op, metadata, checks, report)
        if op is not None and metadata is not None:
            counted = set(range(metadata["num_partitions"]))
            for p in sorted(set(op.partitions) - counted):
                if op.partitions[p]:
                    report.add(f"{op.location}/{p}", None, f"partition {p} has stores, but the operator's metadata "
                                                           f"counts {metadata['num_partitions']} partitions")
        batches = None if version is None else ([version - 1] if version > 0 else [])
        records = _check_records(op, checks, report, storage_options, batches) if op is not None else {}
        if op is not None and version is None:
            _check_journals(op, report, storage_options)
        plan.append((op, checks, records))
    if version is None:
        total = sum(c.total_bytes for _op, checks, _r in plan for c in checks)
        jobs = [(check, f) for _op, checks, _r in plan for check in checks
                for f in sorted(check.listing, key=lambda f: (f.version, f.kind, f.name))]
        first = len(report.problems)
        # The checksum loops release the GIL: files are checked side by side.
        with progress("verifying files", total) as advance, \
                concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            for done in pool.map(lambda job: (job[0].check_file(job[1]), job[0].sizes[job[1].name]), jobs):
                advance(done[1])
        for _op, checks, _r in plan:
            for check in checks:
                check.report_count_mismatches()
        report.problems[first:] = sorted(report.problems[first:], key=lambda p: (p.path, p.offset or 0))
        with progress("following lineages", sum(len(c.all_attempts()) for _o, cs, _r in plan for c in cs)) as advance:
            for _op, checks, _r in plan:
                for check in checks:
                    for v, c in check.all_attempts():
                        check.report_lineage(v, c)
                        advance(1)
                    check.report_gaps()
        return report
    absent = []
    with progress(f"verifying version {version}", sum(len(checks) for _o, checks, _r in plan)) as advance:
        for op, checks, records in plan:
            record = records.get(version - 1)
            for check in checks:
                named = None
                if record is not None:
                    ids = operator_files.store_ids(record, check.ref.store_name)
                    if ids is not None and check.ref.partition_id < len(ids):
                        named = bytes.fromhex(ids[check.ref.partition_id])
                try:
                    commit_id = named if named is not None else check.default_attempt(version)
                except VersionNotFoundError as e:
                    absent.append(e)
                    continue
                check.report_lineage(version, commit_id)
                advance(1)
    if absent and len(absent) == report.stores:
        raise absent[0]  # the version is nowhere: bad input, not damage
    for e in absent:
        report.add(checkpoint.location, None, str(e))
    return report
