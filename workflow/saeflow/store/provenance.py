"""Provenance: where and with what a directory was made. Never hashed, always beside the data."""

import datetime
import getpass
import importlib.metadata
import os
import platform as _platform
import socket
import subprocess
import sys

import saeflow
from saeflow import devices, numerics
from saeflow.store.layout import PROVENANCE_FNAME  # noqa: F401 (importable here, as before)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The commit of the saeflow checkout, when saeflow runs from one (editable install)."""
    pkg_dpath = os.path.dirname(os.path.abspath(saeflow.__file__))
    try:
        out = subprocess.run(
            ["git", "-C", pkg_dpath, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def platform() -> dict:
    """What decides the float bytes of a result: the CPU and its kernels, torch, the GPU (saeflow.numerics)."""
    return {**numerics.platform(), **devices.gpu_provenance()}


def collect() -> dict:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    return {
        "saeflow_version": saeflow.__version__,
        "git_commit": _git_commit(),
        "python_version": _platform.python_version(),
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
        "numpy_version": _version("numpy"),
        "host": socket.gethostname(),
        "user": user,
        "argv": list(sys.argv),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "platform": platform(),
    }
