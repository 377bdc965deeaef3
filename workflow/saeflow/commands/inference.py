"""Subcommands of the inference stage (being built; registers nothing yet)."""


def register(subparsers):
    pass
