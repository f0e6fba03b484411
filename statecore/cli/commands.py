"""Imports every subcommand module, so that each registers itself on the group."""
from statecore.cli import dump, inspect, verify  # noqa: F401
