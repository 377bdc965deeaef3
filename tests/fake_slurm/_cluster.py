"""The cluster the fake Slurm commands stand for: a directory of tests/fixtures/slurm/ named by FAKE_SLURM_CLUSTER,
holding what `sinfo -s`, `sinfo -a -h -o "%P %D %G"` (sinfo-gres.txt) and `scontrol show partition` print there, and
`scontrol show config` where it was captured (tests/fixtures/slurm/README.md says where each value comes from).
FAKE_SLURM_DEFAULT_PARTITION, when set, makes that partition the default instead (`*` in sinfo, Default=YES in
scontrol), e.g. a CPU-only one: the worst case for a job that names no partition."""

import os
import pathlib
import re
import sys

FIXTURES_DPATH = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def name() -> str:
    cluster = os.environ.get("FAKE_SLURM_CLUSTER")
    if not cluster or not (FIXTURES_DPATH / cluster).is_dir():
        known = ", ".join(sorted(p.name for p in FIXTURES_DPATH.iterdir() if p.is_dir()))
        sys.exit(f"fake Slurm: set FAKE_SLURM_CLUSTER to one of {known} (got {cluster!r})")
    return cluster


def _fixture(fname: str) -> str:
    return (FIXTURES_DPATH / name() / fname).read_text()


def _is_default(partition: str, marked: bool) -> bool:
    override = os.environ.get("FAKE_SLURM_DEFAULT_PARTITION")
    return partition == override if override else marked


def sinfo_lines() -> list[str]:
    """`sinfo -s` as printed on the cluster (header first), the default partition's name followed by `*`."""
    header, *rows = _fixture("sinfo.txt").splitlines()
    out = [header]
    for row in rows:
        token, rest = row.split(" ", 1)
        bare = token.rstrip("*")
        marked = bare + ("*" if _is_default(bare, token.endswith("*")) else "")
        if len(marked) > len(token) and rest.startswith(" "):
            rest = rest[1:]
        out.append(f"{marked:<{len(token)}} {rest}")
    return out


def scontrol_blocks() -> dict[str, str]:
    """Partition name -> its `scontrol show partition` block, Default=YES on the default partition only."""
    blocks = {}
    for block in _fixture("scontrol-show-partition.txt").strip().split("\n\n"):
        partition = re.match(r"PartitionName=(\S+)", block).group(1)
        default = _is_default(partition, "Default=YES" in block)
        blocks[partition] = re.sub(r"Default=(YES|NO)", f"Default={'YES' if default else 'NO'}", block)
    return blocks


def default_partition() -> str:
    (default,) = [p for p, block in scontrol_blocks().items() if "Default=YES" in block]
    return default


def sinfo_gres_lines() -> list[str]:
    """`sinfo -a -h -o "%P %D %G"` (partition, node count, the nodes' GRES), the default partition marked `*`."""
    lines = []
    for line in _fixture("sinfo-gres.txt").splitlines():
        token, rest = line.split(" ", 1)
        bare = token.rstrip("*")
        lines.append(f"{bare}{'*' if _is_default(bare, token.endswith('*')) else ''} {rest}")
    return lines


def config_text() -> str | None:
    """`scontrol show config` where it was captured (a real Slurm's), else None."""
    fpath = FIXTURES_DPATH / name() / "scontrol-show-config.txt"
    return fpath.read_text() if fpath.is_file() else None


def n_gpus(partition: str) -> int:
    """GPUs in the partition (0 for CPU-only): its TRES gres/gpu count where the cluster accounts GPUs (some
    partition's TRES lists gres/gpu), else (no GPU accounting) what its nodes' GRES show."""
    in_tres = {p: re.search(r"gres/gpu=(\d+)", block) for p, block in scontrol_blocks().items()}
    if any(in_tres.values()):
        return int(in_tres[partition].group(1)) if in_tres[partition] else 0
    on_nodes = 0
    for line in sinfo_gres_lines():
        part, n_nodes, gres = line.split(None, 2)
        if part.rstrip("*") == partition:
            on_nodes += int(n_nodes) * sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(\s]+)?:(\d+)", gres))
    return on_nodes
