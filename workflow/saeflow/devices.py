"""The one resolver of torch device names: `auto` is CUDA when a GPU is visible, else the CPU.

Inside a job that asked for a GPU (Slurm sets SLURM_GPUS and friends; SAEFLOW_REQUIRE_GPU=1 asks by hand), the
computing commands first check that torch sees one (`check_requested_gpu`): a CPU-only torch build or a missing
driver is a one-line error at once, never hours of silent CPU work with `device: auto`.
"""

import os

from saeflow import numerics
from saeflow.errors import SaeflowError

# Environment variables that say this process runs in a job that was given GPUs, in the order they are named.
GPU_REQUEST_VARS = (
    "SAEFLOW_REQUIRE_GPU",
    "SLURM_GPUS",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
    "SLURM_JOB_GPUS",
)


def is_cpu(name: str) -> bool:
    """Whether a config or CLI device name is the CPU's (`cpu`, `cpu:0`): a job for it needs no GPU, and the workflow
    plans it as a CPU job. `auto` is not (it takes the GPU where the job has one)."""
    return name == "cpu" or name.startswith("cpu:")


def resolve_device(name: str):
    """A `torch.device` for a config or CLI device name; a clear error for a bad name or a missing GPU. Every stage
    that computes resolves its device first, so this is also where torch's CPU kernels are configured."""
    import torch

    numerics.configure_torch()

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SaeflowError(f"unknown device {name!r} ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SaeflowError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def requested_gpu(environ=None) -> str | None:
    """`NAME=value` of the first variable saying this job was given a GPU, else None (a count of 0 = not)."""
    environ = os.environ if environ is None else environ
    for name in GPU_REQUEST_VARS:
        value = environ.get(name, "").strip()
        is_index_list = name == "SLURM_JOB_GPUS"  # GPU indices ("0" is the first GPU), not a count
        if value and (is_index_list or value.lower() not in ("0", "none", "no", "false")):
            return f"{name}={value}"
    return None


def check_requested_gpu(environ=None) -> None:
    """Raise a one-line SaeflowError when the job asked for a GPU but torch sees no CUDA device."""
    request = requested_gpu(environ)
    if request is None:
        return
    import sys

    import torch

    if torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    raise SaeflowError(
        f"this job asked for a GPU ({request}) but torch {torch.__version__} ({build}, {sys.executable}) sees no "
        "CUDA device; run the job in an environment with a CUDA build of torch on a GPU node "
        "(README, 'At OSC')"
    )


def gpu_provenance() -> dict:
    """The GPU model and the CUDA/cuDNN versions of this process, when torch is loaded and sees a GPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    return {
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()),
        "gpu_count": torch.cuda.device_count(),
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
    }
