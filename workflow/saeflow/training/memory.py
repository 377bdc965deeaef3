"""How much RAM a training job may use, and how large its shuffle pool is (`train.buffer_bytes`).

The pool buys batch mixing (docs/training.md, "How the loader reads"), so `auto` gives it what the job can spare:
the job's memory limit (its cgroup's, or what Slurm granted: SLURM_MEM_PER_NODE, SLURM_MEM_PER_CPU x CPUs,
SLURM_MEM_PER_GPU x GPUs; else the RAM available now), split between the ranks of the node, less each rank's room
for its SAEs and RANK_OVERHEAD_BYTES, rounded down to 2^k or 1.5 x 2^k bytes (so a few MB more or less free RAM do
not change the plan). The ranks' shares add up to the job's pool. An explicit size is the pool of the whole job, at
any world size (each rank holds 1/N of it), so it gives the same batches on 1, 2 or 4 ranks. A resumed pass keeps
the pool its checkpoint recorded (`pool_bytes`). `state_bytes` (one SAE's training state) also picks the `auto`
parallel mode (saeflow.training.ranks.parallel).
"""

import os
import pathlib
import re
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.store import runs
from saeflow.store.shards import ShardDir
from saeflow.training.loaders.shuffled import DEFAULT_BUFFER_BYTES
from saeflow.training.ranks.distributed import Comm
from saeflow.training.resume import LEGACY_POOL, resume_info
from saeflow.training.specs import TrainConfig

RANK_OVERHEAD_BYTES = 2 << 30  # python, torch (and a CUDA context), batch and staging buffers, per rank
MIN_POOL_BYTES = 64 << 20
UNLIMITED_BYTES = 1 << 60  # a cgroup limit at or above this means none
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int, key: str = "buffer_bytes") -> int | None:
    """`auto` -> None; bytes as an integer or with a binary unit ("8GiB", "512M", "1.5T")."""
    if isinstance(text, int):
        value = text
    elif str(text).strip() == "auto":
        return None
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
        if not match:
            raise SaeflowError(f"{key}: {text!r} is not a size (auto, bytes, or e.g. 8GiB, 512M)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise SaeflowError(f"{key}: must be positive, got {text!r}")
    return value


def _cgroup_limits(proc_cgroup: pathlib.Path, root: pathlib.Path) -> typing.Iterator[int]:
    """The memory limits of this process's cgroup and its ancestors (v2 memory.max, v1 memory.limit_in_bytes)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy
            base, fname = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, fname = root / controllers, "memory.limit_in_bytes"
        else:
            continue
        dpath = base / path.lstrip("/")
        while True:
            try:
                value = (dpath / fname).read_text().strip()
            except OSError:
                value = "max"
            if value.isdigit() and int(value) < UNLIMITED_BYTES:
                yield int(value)
            if dpath == base or base not in dpath.parents:
                break
            dpath = dpath.parent


def _slurm_limit(env: typing.Mapping[str, str]) -> int | None:
    """What Slurm granted this node's share of the job, in bytes (its variables are in MB)."""
    mb = 1 << 20
    if env.get("SLURM_MEM_PER_NODE", "").isdigit():
        return int(env["SLURM_MEM_PER_NODE"]) * mb
    for per, count in (("SLURM_MEM_PER_CPU", "SLURM_CPUS_ON_NODE"), ("SLURM_MEM_PER_GPU", "SLURM_GPUS_ON_NODE")):
        if env.get(per, "").isdigit() and env.get(count, "").isdigit():
            return int(env[per]) * int(env[count]) * mb
    return None


def _available_bytes(meminfo: pathlib.Path) -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    return int(match.group(1)) << 10 if match else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def job_memory(
    environ: typing.Mapping[str, str] | None = None,
    proc_cgroup: pathlib.Path = pathlib.Path("/proc/self/cgroup"),
    cgroup_root: pathlib.Path = pathlib.Path("/sys/fs/cgroup"),
    meminfo: pathlib.Path = pathlib.Path("/proc/meminfo"),
) -> tuple[int, str]:
    """(bytes this node's part of the job may use, where that figure came from)."""
    env = os.environ if environ is None else environ
    limits = [(value, "cgroup limit") for value in _cgroup_limits(proc_cgroup, cgroup_root)]
    if (slurm := _slurm_limit(env)) is not None:
        limits.append((slurm, "Slurm allocation"))
    if limits:
        return min(limits)
    return _available_bytes(meminfo), "available RAM"


def round_pool(n_bytes: int) -> int:
    """The largest 2^k or 1.5 x 2^k not above `n_bytes` (at least MIN_POOL_BYTES)."""
    n_bytes = max(n_bytes, MIN_POOL_BYTES)
    power = 1 << (n_bytes.bit_length() - 1)
    return power + power // 2 if power + power // 2 <= n_bytes else power


def auto_pool_share(limit_bytes: int, local_ranks: int, room_bytes: int) -> int:
    """One rank's share of the pool: its part of the node's memory less its SAEs' room and the fixed overhead."""
    return round_pool(limit_bytes // max(local_ranks, 1) - room_bytes - RANK_OVERHEAD_BYTES)


def sae_params(cfg: TrainConfig, d_model: int) -> int:
    """One SAE's parameters: W_enc, W_dec, b_enc, b_dec, and a skip transcoder's W_skip. A transcoder's target is
    taken as wide as its input (the mode and the pool are chosen before its target directory is opened; an MLP's
    output is)."""
    d_sae = cfg.expansion * d_model
    if cfg.cross_layer:  # a CLT: an encoder a layer, layer l's decoders write L - l layers (docs/distributed.md)
        n = len(cfg.spanned_layers)
        return n * (d_model * d_sae + d_sae) + (d_sae * d_model + d_model) * n * (n + 1) // 2
    return 2 * d_model * d_sae + d_sae + d_model + (d_model * d_model if cfg.skip else 0)


def state_bytes(cfg: TrainConfig, d_model: int) -> int:
    """One SAE's training state: weights, gradients and two Adam moments (fp32), and the (batch, d_sae)
    pre-activations, codes and their gradient (a CLT's: of every layer)."""
    return 16 * sae_params(cfg, d_model) + 12 * cfg.batch_size * cfg.expansion * d_model * len(cfg.spanned_layers)


def _room_bytes(mode: str, cfgs: list[TrainConfig], d_model: int, comm: Comm) -> int:
    """RAM a rank keeps for its SAEs beside the pool: their training state on the CPU (and a checkpoint's copy of
    the weights); on a GPU, a host copy of the weights when a checkpoint or sae.pt is written."""
    n = comm.world_size
    per_sae = [(state_bytes(c, d_model) if comm.device.type == "cpu" else 0) + 8 * sae_params(c, d_model)
               for c in cfgs]  # fmt: skip
    if mode == "sweep":
        return sum(per_sae[comm.rank :: n])
    return sum(per_sae) // (n if mode == "latents" else 1)


def pool_bytes(group: list[tuple[runs.Run, TrainConfig]], setting: str | int, mode: str, train_dir: ShardDir,
               comm: Comm, row_dirs: list[ShardDir] | None = None) -> int:  # fmt: skip
    """The job's shuffle pool for a pass: what a resumed member recorded (so a resumed epoch keeps its plan), else
    `setting` (the whole job's pool), or for `auto` the ranks' shares of their memory added up. A transcoder's pool
    row holds a pair (its input's row and its target's: `ShuffledLoader(target_dir=...)`), a CLT's a row of each of
    `row_dirs`."""
    md = train_dir.metadata
    run0, cfg0 = group[0]
    if row_dirs is not None:
        mds = [sd.metadata for sd in row_dirs]
    else:
        mds = [md, *([ShardDir(run0.link(run0.TARGET_SHARDS).resolve()).metadata] if cfg0.transcoder else [])]
    row_bytes = sum(m.d_model * np.dtype(m.dtype).itemsize for m in mds)
    recorded = comm.on_root(lambda: next((info[1] for run, _ in group if (info := resume_info(run)) and info[1]),
                                         None))  # fmt: skip
    if recorded == LEGACY_POOL:  # resumed from a checkpoint of the fixed-pool loader: keep its plan
        return DEFAULT_BUFFER_BYTES
    if recorded:
        return int(recorded) * row_bytes
    explicit = parse_size(setting)
    if explicit is not None:
        return explicit
    limit, _ = job_memory()
    share = auto_pool_share(limit, comm.local_world_size, _room_bytes(mode, [c for _, c in group], md.d_model, comm))
    return comm.min_int(share) * comm.world_size
