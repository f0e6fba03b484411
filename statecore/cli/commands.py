"""Imports every subcommand module, so that each registers itself on the group."""
