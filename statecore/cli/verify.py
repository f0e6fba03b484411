"""``statecore verify CHECKPOINT``: every file's checksums and every retained version's lineage
(:func:`statecore.checkpoint_verify.verify_checkpoint`). Exit code 0 when all is sound, 1 when
something is not, with one line per problem: the file, the byte offset, what is wrong."""
import click

from statecore.checkpoint_scan import NotACheckpointError, scan_checkpoint
from statecore.checkpoint_verify import verify_checkpoint
from statecore.cli.output import FOUND_PROBLEMS, bad_input, emit, main, progress
from statecore.errors import VersionNotFoundError


def _print(data):
    for p in data["problems"]:
        where = f" at byte {p['offset']}" if p["offset"] is not None else ""
        click.echo(f"BAD {p['path']}{where}: {p['what']}")
    verdict = "sound" if data["sound"] else f"NOT sound: {len(data['problems'])} problem(s)"
    click.echo(f"{data['checkpoint']}: {verdict} ({data['stores']} store(s), {data['files']} file(s), "
               f"{data['bytes']} bytes, {data['versions']} version(s) followed)")


@main.command("verify")
@click.argument("checkpoint")
@click.option("--version", type=click.IntRange(min=0), help="Only what loading this version takes (default: all).")
@click.option("--operator", "operator_id", type=click.IntRange(min=0), help="Only this operator.")
@click.option("--deep", is_flag=True, help="Also decompress every delta block and look every snapshot row's key up in its index.")
@click.option("--threads", type=click.IntRange(min=1), help="Files checked at once (default: the CPUs, at most 4).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def verify_command(checkpoint, version, operator_id, deep, threads, as_json):
    """Check every file of CHECKPOINT (checksums, headers, JSON) and that every retained
    version loads; exit code 0 only when all is sound, 1 when something is not."""
    with bad_input(NotACheckpointError, KeyError, VersionNotFoundError):
        found = scan_checkpoint(checkpoint)
        if found.kind == "store" and operator_id is not None:
            raise NotACheckpointError(f"{checkpoint} is a single store, not a state root: --operator does not apply")
        report = verify_checkpoint(found, operator_id=operator_id, version=version, deep=deep, progress=progress,
                                   threads=threads)
    data = {"checkpoint": found.location, "sound": report.sound, "stores": report.stores, "files": report.files,
            "bytes": report.bytes, "versions": report.versions,
            "problems": [{"path": p.path, "offset": p.offset, "what": p.what} for p in report.problems]}
    emit(as_json, data, _print)
    if not report.sound:
        click.get_current_context().exit(FOUND_PROBLEMS)
