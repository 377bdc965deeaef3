"""Subcommands of the train stage (being built; registers nothing yet)."""


def register(subparsers):
    pass
