"""The `saeflow` command line. Each stage registers its subcommands from `saeflow.commands.<stage>`."""

import argparse
import importlib
import logging
import os
import sys

from saeflow import __version__, devices, numerics, preempt
from saeflow.errors import SaeflowError, one_line, say

# One module per stage; each defines `register(subparsers)` and sets `func` on its parsers.
COMMAND_MODULES = (
    "store", "extract", "train", "inference", "evaluate", "probe", "stability", "interop", "workflow", "migrate",
)
# The commands that compute with torch: inside a job given a GPU, they check that torch sees it first.
GPU_COMMANDS = ("extract", "train", "inference", "evaluate")
# The commands whose work loops save their resume point and stop on Slurm's warning signal or SIGTERM.
PREEMPTIBLE_COMMANDS = ("extract", "train")

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
    _add_global_options(parser, default=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"saeflow.commands.{name}").register(subparsers)
    for sub in subparsers.choices.values():  # `saeflow validate DIR --debug` works as well as `saeflow --debug ...`
        _add_global_options(sub, default=argparse.SUPPRESS)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="show debug logging")
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show the full traceback when a command fails"
    )


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command == "train" and not args.verbose:
        # Before torch loads: c10d's C++ warnings (a store call to a rank that died, each with ~25 lines of C++
        # frames) stay quiet; saeflow names the dead rank in one line (saeflow.training.ranks.distributed).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        numerics.apply()  # before torch runs a kernel: which CPU kernels it may choose (saeflow.numerics)
        if args.command in GPU_COMMANDS:
            devices.check_requested_gpu()  # a job given a GPU that torch cannot see fails now, not hours later
        if args.command in PREEMPTIBLE_COMMANDS:
            with preempt.handling():  # USR1/TERM: save the resume point, then stop (saeflow.preempt)
                return args.func(args) or 0
        return args.func(args) or 0
    except SaeflowError as err:  # the specific messages: what and where, raised where the fault was found
        if args.debug:
            raise
        return error(args.command, one_line(err))
    except KeyboardInterrupt as err:  # Ctrl-C; a stage that kept work says what and how to resume (extract)
        say(f"saeflow {args.command}: interrupted" + (f": {err}" if str(err) else ""))
        return 130
    except BrokenPipeError:  # the reader went away (`saeflow plan ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except Exception as err:  # noqa: BLE001 -- the last resort: never a traceback unless asked for (--debug)
        if args.debug:
            raise
        return error(args.command, f"{unexpected(err)} (rerun with --debug for the traceback)")


def error(command: str, message: str) -> int:
    """Print the one-line error of a failed command and return its exit code."""
    say(f"saeflow {command}: error: {message}")
    return 1


def unexpected(err: BaseException) -> str:
    """An exception nobody turned into a message: its type and message on one line (an OSError names its file)."""
    if isinstance(err, MemoryError):
        return f"MemoryError: out of memory{f' ({one_line(err)})' if str(err) else ''}"
    if isinstance(err, OSError) and err.filename is not None:
        target = f" -> {err.filename2}" if err.filename2 is not None else ""
        return f"{type(err).__name__}: {err.filename}{target}: {err.strerror or one_line(err)}"
    return f"{type(err).__name__}: {one_line(err) or '(no message)'}"
