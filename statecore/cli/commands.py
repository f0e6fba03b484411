"""Imports every subcommand module, so that each registers itself on the group."""
from statecore.cli import import_spark  # noqa: E402,F401
