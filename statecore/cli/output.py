"""What every ``statecore`` subcommand shares: the command group, ``--json`` output, exit
codes a script can test, progress bars on stderr, and bad input turned into one clear line.

Exit codes: :data:`OK` (0), :data:`FOUND_PROBLEMS` (1: the command ran and found the state
unsound, e.g. ``verify``, or could not read a file of it), :data:`USAGE` (2: bad arguments,
click's own), :data:`BAD_INPUT` (3: the path, operator, partition or version given is not what
the command needs; one line on stderr says what, and nothing was written). A subcommand that
meets a damaged file (StateCorruptionError), a file refused unread (UnsafeFileError: a FIFO, a
device, a directory, an oversize file) or a failing system call (OSError: a symlink loop, a
dangling link) it did not handle itself exits 1 with that one line too: the group turns them
into :class:`Unsound`, so no subcommand prints a traceback for them.
"""
import contextlib
import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from statecore.errors import StateCorruptionError, UnsafeFileError

__all__ = ["main", "OK", "FOUND_PROBLEMS", "USAGE", "BAD_INPUT", "BadInput", "Unsound", "bad_input", "emit",
           "progress", "print_table"]

OK, FOUND_PROBLEMS, USAGE, BAD_INPUT = 0, 1, 2, 3


class BadInput(click.ClickException):
    """The input is not what the command needs (exit code :data:`BAD_INPUT`); nothing was written."""

    exit_code = BAD_INPUT


class Unsound(click.ClickException):
    """The state the command must read is damaged (exit code :data:`FOUND_PROBLEMS`); one line
    names the file and what is wrong (``statecore verify`` lists everything)."""

    exit_code = FOUND_PROBLEMS


@contextlib.contextmanager
def bad_input(*errors):
    """Turn ``errors`` (exception classes) raised in the block into :class:`BadInput`, their
    message as the one line (a ``KeyError``'s without its quotes)."""
    try:
        yield
    except errors as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise BadInput(str(message)) from None


class _CommandGroup(click.Group):
    """The group of subcommands: damage, a refused file or an OS error that a subcommand did
    not turn into an exit code itself becomes :class:`Unsound` (one line, exit code 1)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (StateCorruptionError, UnsafeFileError, OSError) as e:
            raise Unsound(str(e)) from None


@click.group(cls=_CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="statecore")
def main():
    """Inspect, verify, dump, repartition, rewrite and import statecore checkpoints."""


def emit(as_json, data, human):
    """Print ``data`` as JSON (``as_json``) or call ``human(data)`` to print it for people."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        human(data)


def print_table(title, columns, rows):
    """A table on stdout: ``columns`` are names, ``rows`` sequences of printable values."""
    table = Table(title=title, title_justify="left")
    for name in columns:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    console = Console(file=sys.stdout, soft_wrap=True)
    if not console.is_terminal:  # a pipe or a file: no reason to fold columns at 80
        console = Console(file=sys.stdout, soft_wrap=True, width=200)
    console.print(table)


def progress(description, total=None, disable=False):
    """A progress bar on stderr (hidden when stderr is not a terminal or ``disable``): use as
    ``with progress("reading", total=n) as advance: advance(k)``."""
    return _Progress(description, total, disable)


class _Progress:
    def __init__(self, description, total, disable):
        console = Console(file=sys.stderr)
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), console=console, transient=True,
                             disable=disable or not console.is_terminal)
        self._task = self._bar.add_task(description, total=total)

    def __enter__(self):
        self._bar.__enter__()
        return lambda n=1: self._bar.advance(self._task, n)

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)
