"""`saeflow summary` (sweep table + Pareto plot) and `saeflow install-profile` (the OSC Slurm profile)."""

import argparse
import getpass
import pathlib
import re

from saeflow import summary
from saeflow.errors import SaeflowError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
PROFILE_TEMPLATE_DPATH = REPO_ROOT / "profiles" / "osc"
ACCOUNT_PLACEHOLDER = "PAS0000"
DEFAULT_PROFILE_DPATH = pathlib.Path.home() / ".config" / "snakemake" / "osc"


def register(subparsers):
    p = subparsers.add_parser(
        "summary",
        help="every run's metrics in one CSV plus an L0 vs normalized-MSE Pareto plot",
        description="Collect <run>/checkpoint/config.json and <run>/inference/*/metrics.json of every run into "
        "summary.csv (one row per run and inference shard; hyper-parameters as config.* columns) and draw "
        "pareto.png (L0 against normalized MSE, the non-dominated runs joined).",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--runs-root", type=pathlib.Path, help="summarize every run directory under this root")
    which.add_argument("--run", type=pathlib.Path, action="append", help="a run directory (repeatable)")
    p.add_argument("--out", type=pathlib.Path, required=True, metavar="DIR", help="where summary.csv and pareto.png go")
    p.add_argument(
        "--label", action="append", default=[], metavar="RUN_ID=NAME",
        help="a readable name for a run (the `name` column and the plot labels); the workflow passes <sae>[<index>]",
    )  # fmt: skip
    p.set_defaults(func=cmd_summary)

    p = subparsers.add_parser(
        "install-profile",
        help="install the OSC Slurm profile so that `snakemake --profile osc` works",
        description="Copy profiles/osc/ to ~/.config/snakemake/osc/ (where Snakemake looks up `--profile osc`) "
        "with your Slurm account filled in everywhere (the Slurm account, and the scratch and project roots "
        "/fs/scratch/<account>/$USER/saev/shards and /fs/ess/<account>/$USER/saev/runs).",
    )
    p.add_argument("--account", required=True, help="your OSC project account, e.g. PAS1234")
    p.add_argument(
        "--dest",
        type=pathlib.Path,
        default=DEFAULT_PROFILE_DPATH,
        help=f"profile directory (default {DEFAULT_PROFILE_DPATH})",
    )
    p.add_argument("--force", action="store_true", help="replace an existing profile at --dest")
    p.set_defaults(func=cmd_install_profile)


def cmd_summary(args: argparse.Namespace) -> int:
    if args.runs_root is not None:
        if not args.runs_root.is_dir():
            raise SaeflowError(f"--runs-root {args.runs_root} is not a directory")
        run_dpaths = [d for d in args.runs_root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    else:
        run_dpaths = args.run
    names = {}
    for label in args.label:
        run_id, sep, name = label.partition("=")
        if not sep or not run_id or not name:
            raise SaeflowError(f"--label {label!r}: expected RUN_ID=NAME")
        names[run_id] = name
    csv_fpath, png_fpath = summary.write_summary(run_dpaths, args.out, names)
    print(csv_fpath)
    print(png_fpath)
    return 0


def install_profile(account: str, dest_dpath: pathlib.Path, force: bool = False) -> pathlib.Path:
    """Render the profile template with `account`; refuses to overwrite unless `force`."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", account):
        raise SaeflowError(f"--account {account!r} is not a Slurm account name (expected e.g. PAS1234)")
    if not PROFILE_TEMPLATE_DPATH.is_dir():
        raise SaeflowError(f"the profile template {PROFILE_TEMPLATE_DPATH} is missing; run from a saeflow checkout")
    if dest_dpath.exists() and not force:
        raise SaeflowError(f"{dest_dpath} already exists; pass --force to replace it")
    dest_dpath.mkdir(parents=True, exist_ok=True)
    for src_fpath in sorted(PROFILE_TEMPLATE_DPATH.iterdir()):
        if src_fpath.is_file():
            text = src_fpath.read_text(encoding="utf-8").replace(ACCOUNT_PLACEHOLDER, account)
            (dest_dpath / src_fpath.name).write_text(text, encoding="utf-8")
    return dest_dpath


def cmd_install_profile(args: argparse.Namespace) -> int:
    dest = install_profile(args.account, args.dest, args.force)
    print(f"installed the OSC profile for account {args.account} (user {getpass.getuser()}) at {dest}")
    print("run the workflow on Slurm with:  snakemake --profile osc")
    return 0
