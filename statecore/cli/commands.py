"""Imports every subcommand module, so that each registers itself on the group."""
from statecore.cli import dump, import_spark, inspect, repartition, verify  # noqa: F401
