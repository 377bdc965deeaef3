"""Subcommands of the `saeflow` CLI, one module per stage."""
