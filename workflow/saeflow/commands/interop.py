"""Subcommands of the interop stage (being built; registers nothing yet)."""


def register(subparsers):
    pass
