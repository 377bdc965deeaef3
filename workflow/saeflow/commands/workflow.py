"""`saeflow summary` (sweep table + Pareto plot) and `saeflow install-profile` (the OSC Slurm profile)."""

import argparse
import getpass
import json
import pathlib
import re
import subprocess
import sys

from saeflow import summary
from saeflow.errors import SaeflowError, one_line

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
PROFILE_TEMPLATE_DPATH = REPO_ROOT / "profiles" / "osc"
ACCOUNT_PLACEHOLDER = "PAS0000"
PYTHON_PLACEHOLDER = "SAEFLOW_PYTHON"
CLUSTERS = tuple(sorted(f.stem for f in (PROFILE_TEMPLATE_DPATH / "clusters").glob("*.yaml")))
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
        help="install the OSC Slurm profile of one cluster so that `snakemake --profile osc` works",
        description="Write ~/.config/snakemake/osc/config.yaml (where Snakemake looks up `--profile osc`): "
        "profiles/osc/config.yaml with your Slurm account filled in everywhere (the account, and the scratch and "
        "project roots /fs/scratch/<account>/$USER/saev/shards and /fs/ess/<account>/$USER/saev/runs) and the "
        "jobs' Python, followed by the resources of one cluster (profiles/osc/clusters/<cluster>.yaml: GPU "
        "requests, cores and memory per GPU, walltimes). The Python must have a CUDA build of torch: jobs given a "
        "GPU refuse to run on the CPU. README 'At OSC' shows how to create that environment.",
    )
    p.add_argument("--account", required=True, help="your OSC project account, e.g. PAS1234")
    p.add_argument("--cluster", required=True, choices=CLUSTERS, help="the OSC cluster whose login node you run on")
    p.add_argument(
        "--python",
        type=pathlib.Path,
        default=pathlib.Path(sys.executable),
        help="the interpreter of the environment the jobs run saeflow in, e.g. "
        "/fs/ess/PAS1234/$USER/saeflow-env/bin/python (default: this one, %(default)s)",
    )
    p.add_argument(
        "--allow-cpu-torch",
        action="store_true",
        help="install even when --python has a CPU-only torch (GPU jobs will then stop with an error)",
    )
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


def install_profile(
    account: str,
    dest_dpath: pathlib.Path,
    force: bool = False,
    cluster: str = "cardinal",
    python: pathlib.Path | None = None,
    allow_cpu_torch: bool = False,
) -> pathlib.Path:
    """Render the profile template for `cluster` with `account` and the jobs' `python`; refuses to overwrite
    unless `force`, and refuses a `python` without a CUDA build of torch unless `allow_cpu_torch`."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", account):
        raise SaeflowError(f"--account {account!r} is not a Slurm account name (expected e.g. PAS1234)")
    if not PROFILE_TEMPLATE_DPATH.is_dir():
        raise SaeflowError(f"the profile template {PROFILE_TEMPLATE_DPATH} is missing; run from a saeflow checkout")
    if cluster not in CLUSTERS:
        raise SaeflowError(f"--cluster {cluster!r}: the profile knows {', '.join(CLUSTERS)}")
    if dest_dpath.exists() and not force:
        raise SaeflowError(f"{dest_dpath} already exists; pass --force to replace it")
    python = pathlib.Path(python or sys.executable)
    if not allow_cpu_torch:
        _check_cuda_torch(python)
    base = (PROFILE_TEMPLATE_DPATH / "config.yaml").read_text(encoding="utf-8")
    base = base.replace(PYTHON_PLACEHOLDER, json.dumps(str(python)))
    resources = (PROFILE_TEMPLATE_DPATH / "clusters" / f"{cluster}.yaml").read_text(encoding="utf-8")
    text = f"{base}\n# ---- resources for {cluster} (profiles/osc/clusters/{cluster}.yaml) ----\n{resources}"
    dest_dpath.mkdir(parents=True, exist_ok=True)
    (dest_dpath / "config.yaml").write_text(text.replace(ACCOUNT_PLACEHOLDER, account), encoding="utf-8")
    return dest_dpath


def _check_cuda_torch(python: pathlib.Path) -> None:
    """One-line error unless `python` imports a torch built with CUDA (checked without a GPU: login nodes have none)."""
    probe = "import torch; print(torch.__version__, torch.version.cuda or '')"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as err:
        raise SaeflowError(f"--python {python}: cannot run it ({err.strerror})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise SaeflowError(f"--python {python}: cannot import torch ({one_line(last)})")
    version, _, cuda = out.stdout.strip().partition(" ")
    if not cuda:
        raise SaeflowError(
            f"--python {python} has torch {version}, a CPU-only build: GPU jobs would refuse to run. Create the "
            "environment of README 'At OSC' and pass its python, or pass --allow-cpu-torch"
        )


def cmd_install_profile(args: argparse.Namespace) -> int:
    dest = install_profile(args.account, args.dest, args.force, args.cluster, args.python, args.allow_cpu_torch)
    print(f"installed the OSC profile for {args.cluster}, account {args.account} (user {getpass.getuser()}) at {dest}")
    print(f"jobs run saeflow with {args.python}")
    print("run the workflow on Slurm with:  snakemake --profile osc")
    return 0
