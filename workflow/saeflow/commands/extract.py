"""Subcommands of the extract stage (being built; registers nothing yet)."""


def register(subparsers):
    pass
