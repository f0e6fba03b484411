"""The ``statecore`` command: a checkpoint's state operated from a shell, without Spark.

One module per subcommand (``inspect``, ``verify``, ``dump``, ``repartition``, ``rewrite``,
``import-spark``), each registering itself on :data:`main`; what they share (the ``--json``
switch, exit codes, progress bars, errors) is in :mod:`statecore.cli.output`. The commands
and their output are described in ``docs/operating.md``.
"""
from statecore.package_origin import check_package_origin

check_package_origin()

from statecore.cli.output import main  # noqa: E402

__all__ = ["main", "run"]

# The subcommands register themselves on ``main`` when imported.
from statecore.cli import dump, import_spark, inspect, repartition, rewrite, verify  # noqa: E402,F401


def run(argv=None):
    """The console script's entry point (``statecore``, ``python -m statecore``)."""
    return main.main(args=argv, prog_name="statecore")
