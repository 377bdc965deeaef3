"""Subcommands of the workflow stage (being built; registers nothing yet)."""


def register(subparsers):
    pass
