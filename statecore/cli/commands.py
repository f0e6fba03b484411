"""Imports every subcommand module, so that each registers itself on the group."""
from statecore.cli import import_spark  # noqa: F401
from statecore.cli import repartition  # noqa: F401
