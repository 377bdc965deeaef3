"""The `saeflow` command line. Each stage registers its subcommands from `saeflow.commands.<stage>`."""

import argparse
import importlib
import logging
import os
import sys

from saeflow import __version__
from saeflow.errors import SaeflowError

# One module per stage; each defines `register(subparsers)` and sets `func` on its parsers.
COMMAND_MODULES = ("store", "extract", "train", "inference", "interop", "workflow")

DESCRIPTION = """\
saeflow: reproducible, content-addressed sparse-autoencoder workflows on transformer activations.

Activations are stored as saev protocol 2.0 shard directories named by the sha256 of their metadata;
SAE runs follow the storage-and-run-manifest layout (runs/<run_id>/{checkpoint,links,inference}).
The whole pipeline runs with `snakemake --cores all`; these commands are its stages.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saeflow", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"saeflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug logging and full tracebacks")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"saeflow.commands.{name}").register(subparsers)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except SaeflowError as err:
        if args.verbose:
            raise
        print(f"saeflow {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"saeflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`saeflow plan ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
