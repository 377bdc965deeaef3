"""`saeflow summary` (sweep table + Pareto plot) and `saeflow install-profile` (the OSC Slurm profile)."""

import argparse
import functools
import getpass
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import yaml

from saeflow import config
from saeflow.analysis import report
from saeflow.errors import SaeflowError, one_line

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
PROFILE_TEMPLATE_DPATH = REPO_ROOT / "profiles" / "osc"
ACCOUNT_PLACEHOLDER = "PAS0000"
PYTHON_PLACEHOLDER = "SAEFLOW_PYTHON"
CLUSTERS = tuple(sorted(f.stem for f in (PROFILE_TEMPLATE_DPATH / "clusters").glob("*.yaml")))
DEFAULT_PROFILE_DPATH = pathlib.Path.home() / ".config" / "snakemake" / "osc"
# The YAML anchors of the partition names in profiles/osc/clusters/<cluster>.yaml: the GPU rules' and every CPU job's.
PARTITION_ANCHORS = {"gpu": "gpu_partition", "cpu": "cpu_partition"}


@functools.cache
def cluster_partitions(cluster: str) -> dict[str, str]:
    """The partition a cluster's GPU jobs and its CPU-only jobs name by default (its profile resources, cited there:
    extraction's, and every job's default)."""
    text = (PROFILE_TEMPLATE_DPATH / "clusters" / f"{cluster}.yaml").read_text(encoding="utf-8")
    resources = yaml.load(text, Loader=config.SAFE_LOADER)  # noqa: S506 (a safe loader)
    return {
        "gpu": resources["set-resources"]["saeflow/extract"]["slurm_partition"],
        "cpu": resources["default-resources"]["slurm_partition"],
    }


def register(subparsers):
    p = subparsers.add_parser(
        "summary",
        help="every run's metrics in one CSV plus an L0 vs normalized-MSE Pareto plot",
        description="Collect <run>/checkpoint/config.json and <run>/inference/*/metrics.json of every run (with its "
        "evaluation and probe results) into summary.csv (one row per run and inference shard; hyper-parameters as "
        "config.* columns), summary_grouped.csv (per seed group: each metric's mean and std over runs that differ "
        "only in seed/data_seed, with their stability) and draw pareto.png (L0 against normalized MSE and the splice "
        "score, a front per kind (SAE, transcoder, skip transcoder), shard directory, layer and architecture, seed "
        "groups with error bars) and one page per metric (pareto_nmse.png, pareto_splice.png, probe.png, "
        "stability.png). A degenerate run (every latent dead or dense, or L0 above 0.1 of d_sae) gets summary.csv's "
        "`warning` and one line on stderr.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--runs-root", type=pathlib.Path, help="summarize every run directory under this root")
    which.add_argument("--run", type=pathlib.Path, action="append", help="a run directory (repeatable)")
    p.add_argument("--out", type=pathlib.Path, required=True, metavar="DIR", help="where summary.csv and pareto.png go")
    p.add_argument(
        "--label", action="append", default=[], metavar="RUN_ID=NAME",
        help="a readable name for a run (the `name` column); the workflow passes the sweep point's name, "
        "<sae>[<swept key>=<value>,...]",
    )  # fmt: skip
    p.add_argument(
        "--group-label", action="append", default=[], metavar="RUN_ID=NAME",
        help="the name of a run's seed group (the plots' points, the grouped table; default the run's --label); the "
        "workflow passes the point's name without its seeds",
    )  # fmt: skip
    p.add_argument("--stability", type=pathlib.Path, action="append", default=[], metavar="FILE",
                   help="a seed group's `saeflow stability` result, for summary_grouped.csv and stability.png")
    p.set_defaults(func=cmd_summary)

    p = subparsers.add_parser(
        "install-profile",
        help="install the OSC Slurm profile of one cluster so that `snakemake --profile osc` works",
        description="Write ~/.config/snakemake/osc/config.yaml (where Snakemake looks up `--profile osc`): "
        "profiles/osc/config.yaml with your Slurm account filled in everywhere (the account, and the default roots "
        "/fs/scratch/<account>/$USER/saev/shards and /fs/ess/<account>/$USER/saev/runs, used where your config "
        "gives none) and the jobs' Python, followed by the resources of one cluster (profiles/osc/clusters/"
        "<cluster>.yaml: GPU requests, cores and memory per GPU, walltimes, and the partitions GPU jobs and "
        "CPU-only jobs name, checked against `scontrol show partition` when run on that cluster). The Python must "
        "have a CUDA build of torch: jobs given a GPU refuse to run on the CPU. README 'At OSC' shows how to create "
        "that environment.",
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
    defaults = ", ".join(f"{c}: {cluster_partitions(c)['gpu']}" for c in CLUSTERS)
    p.add_argument(
        "--gpu-partition",
        help=f"the Slurm partition every GPU job names (default: the cluster's, {defaults}; docs/workflow.md says "
        "which names are confirmed); checked against `scontrol show partition` when run on the cluster",
    )
    defaults = ", ".join(f"{c}: {cluster_partitions(c)['cpu']}" for c in CLUSTERS)
    p.add_argument(
        "--cpu-partition",
        help=f"the Slurm partition every CPU-only job names (the seal of a split extraction, probes, jobs on a `cpu` "
        f"device; default: {defaults})",
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
    names, group_names = _labels(args.label, "--label"), _labels(args.group_label, "--group-label")
    csv_fpath, png_fpath = report.write_summary(run_dpaths, args.out, names, tuple(args.stability), group_names)
    print(csv_fpath)
    print(png_fpath)
    return 0


def _labels(labels: list[str], option: str) -> dict[str, str]:
    """RUN_ID=NAME arguments as {run id: name} (a name may hold "=")."""
    names = {}
    for label in labels:
        run_id, sep, name = label.partition("=")
        if not sep or not run_id or not name:
            raise SaeflowError(f"{option} {label!r}: expected RUN_ID=NAME")
        names[run_id] = name
    return names


def install_profile(
    account: str,
    dest_dpath: pathlib.Path,
    force: bool = False,
    cluster: str = "cardinal",
    python: pathlib.Path | None = None,
    allow_cpu_torch: bool = False,
    partitions: dict[str, str | None] | None = None,
    report=lambda line: None,
) -> pathlib.Path:
    """Render the profile template for `cluster` with `account`, the jobs' `python` and the `partitions` its GPU
    and CPU-only jobs name ({"gpu": name, "cpu": name}; None or absent: the cluster's defaults); refuses to
    overwrite unless `force`, a `python` without a CUDA build of torch unless `allow_cpu_torch`, and a partition
    that `scontrol show partition` here lacks, or a GPU partition without GPUs. `report` gets what was checked."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", account):
        raise SaeflowError(f"--account {account!r} is not a Slurm account name (expected e.g. PAS1234)")
    if not PROFILE_TEMPLATE_DPATH.is_dir():
        raise SaeflowError(f"the profile template {PROFILE_TEMPLATE_DPATH} is missing; run from a saeflow checkout")
    if cluster not in CLUSTERS:
        raise SaeflowError(f"--cluster {cluster!r}: the profile knows {', '.join(CLUSTERS)}")
    if dest_dpath.exists() and not force:
        raise SaeflowError(f"{dest_dpath} already exists; pass --force to replace it")
    chosen = {kind: (partitions or {}).get(kind) or name for kind, name in cluster_partitions(cluster).items()}
    for kind, name in chosen.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise SaeflowError(f"--{kind}-partition {name!r} is not a Slurm partition name")
    python = pathlib.Path(python or sys.executable)
    if not allow_cpu_torch:
        _check_cuda_torch(python)
    checked = check_partitions(cluster, chosen)
    report(checked)
    base = (PROFILE_TEMPLATE_DPATH / "config.yaml").read_text(encoding="utf-8")
    base = base.replace(PYTHON_PLACEHOLDER, json.dumps(str(python)))
    resources = (PROFILE_TEMPLATE_DPATH / "clusters" / f"{cluster}.yaml").read_text(encoding="utf-8")
    for kind, name in chosen.items():
        resources = _set_partition(resources, kind, name)
    header = f"# ---- resources for {cluster} (profiles/osc/clusters/{cluster}.yaml) ----\n# {checked}"
    text = f"{base}\n{header}\n{resources}"
    dest_dpath.mkdir(parents=True, exist_ok=True)
    (dest_dpath / "config.yaml").write_text(text.replace(ACCOUNT_PLACEHOLDER, account), encoding="utf-8")
    return dest_dpath


def _set_partition(resources: str, kind: str, name: str) -> str:
    """The cluster resources with the GPU (kind "gpu") or CPU-only ("cpu") jobs' partition set to `name`."""
    anchor = PARTITION_ANCHORS[kind]
    text, n_set = re.subn(rf"&{anchor} \S+", f"&{anchor} {name}", resources)
    assert n_set == 1, f"the profile template names its {kind} partition once, as &{anchor}"
    return text


# What install-profile asks Slurm: the cluster's name, its partitions (and their TRES), and the GRES of each
# partition's nodes. A partition's TRES lists gres/gpu only when GPU accounting is on (slurmdbd); its nodes' GRES
# show GPUs either way (tests/fixtures/slurm/real-22.05/, captured from a real slurmctld).
SLURM_QUERIES = {
    "config": ["scontrol", "show", "config"],
    "partition": ["scontrol", "show", "partition"],
    "gres": ["sinfo", "-a", "-h", "-o", "%P %D %G"],
}


def _slurm_output(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SaeflowError(f"{' '.join(argv[:3])}: {one_line(str(err))}") from None
    if out.returncode != 0:
        raise SaeflowError(f"{' '.join(argv[:3])} failed: {one_line(out.stderr.strip() or 'no message')}")
    return out.stdout


def node_gpus(sinfo_gres: str) -> dict[str, int]:
    """Partition -> GPUs on its nodes, from `sinfo -a -h -o "%P %D %G"` (a line per partition and GRES: the
    default partition's name ends in `*`, then its node count and the nodes' GRES, e.g. `gpu:h100:4(S:0-1),mps:400`
    or `(null)`)."""
    gpus = {}
    for line in sinfo_gres.splitlines():
        fields = line.split(None, 2)
        if len(fields) != 3 or not fields[1].isdigit():
            continue
        per_node = sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(\s]+)?:(\d+)", fields[2]))
        partition = fields[0].rstrip("*")
        gpus[partition] = gpus.get(partition, 0) + int(fields[1]) * per_node
    return gpus


def slurm_partitions() -> tuple[str, dict[str, int]] | None:
    """(cluster name, partition -> GPUs) from `scontrol` and `sinfo` on this machine; None where there is no Slurm.
    Where the cluster accounts GPUs (some partition's TRES lists gres/gpu), a partition's TRES count; elsewhere no
    TRES lists one, and the GPUs are those its nodes' GRES show."""
    if shutil.which("scontrol") is None:
        return None
    outputs = {what: _slurm_output(argv) for what, argv in SLURM_QUERIES.items()}
    found = re.search(r"^ClusterName\s*=\s*(\S+)", outputs["config"], re.MULTILINE)
    gpus = {}
    for block in re.split(r"\n\s*\n", outputs["partition"].strip()):
        if name := re.match(r"PartitionName=(\S+)", block.strip()):
            n_gpus = re.search(r"gres/gpu(?::[^=,\s]+)?=(\d+)", block)
            gpus[name.group(1)] = int(n_gpus.group(1)) if n_gpus else 0
    if not any(gpus.values()):  # no GPU accounting: no TRES lists a GPU
        on_nodes = node_gpus(outputs["gres"])
        gpus = {partition: on_nodes.get(partition, 0) for partition in gpus}
    return (found.group(1) if found else "", gpus)


def check_partitions(cluster: str, chosen: dict[str, str]) -> str:
    """Refuse a chosen partition this cluster's Slurm lacks, or a GPU partition without GPUs; say what was checked.
    Only on the cluster itself (a login node): elsewhere there is nothing to ask, and the note says so."""
    found = slurm_partitions()
    if found is None:
        return (f"partitions {chosen['gpu']} (GPU jobs) and {chosen['cpu']} (CPU-only jobs) not checked: no scontrol "
                f"here; on a login node of {cluster}, `sinfo -s` lists the partitions")  # fmt: skip
    slurm_cluster, gpus = found
    if cluster not in slurm_cluster.lower():
        return f"partitions not checked: this is Slurm cluster {slurm_cluster!r}, not {cluster}"
    for kind, name in chosen.items():
        if name not in gpus:
            raise SaeflowError(f"--{kind}-partition {name}: no such partition on {cluster} (scontrol show partition "
                               f"lists {', '.join(gpus)})")  # fmt: skip
    if gpus[chosen["gpu"]] == 0:
        with_gpus = ", ".join(p for p, n in gpus.items() if n) or "none"
        raise SaeflowError(f"--gpu-partition {chosen['gpu']}: that partition has no GPUs (its TRES gres/gpu, or "
                           f"without GPU accounting its nodes' GRES): Slurm refuses GPU jobs there; partitions with "
                           f"GPUs: {with_gpus}")  # fmt: skip
    return (
        f"partitions checked against scontrol and sinfo on {slurm_cluster}: GPU jobs go to {chosen['gpu']} "
        f"({gpus[chosen['gpu']]} GPUs), CPU-only jobs to {chosen['cpu']}"
    )


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
    partitions = {"gpu": args.gpu_partition, "cpu": args.cpu_partition}
    dest = install_profile(
        args.account, args.dest, args.force, args.cluster, args.python, args.allow_cpu_torch, partitions, print
    )
    print(f"installed the OSC profile for {args.cluster}, account {args.account} (user {getpass.getuser()}) at {dest}")
    print(f"jobs run saeflow with {args.python}")
    print(f"run the workflow on Slurm with:  snakemake --profile {profile_arg(dest)}")
    return 0


def profile_arg(dest_dpath: pathlib.Path) -> str:
    """What `snakemake --profile` takes for a profile installed at `dest_dpath`: `osc` where Snakemake looks it up
    by name (the default place), else its absolute path (shell-quoted)."""
    if dest_dpath.resolve() == DEFAULT_PROFILE_DPATH.resolve():
        return DEFAULT_PROFILE_DPATH.name
    return shlex.quote(str(dest_dpath.resolve()))
