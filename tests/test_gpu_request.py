"""A job that asked for a GPU fails at once, in one line, when torch sees no CUDA device (never a silent CPU run)."""

import os
import subprocess
import sys

import pytest
import torch
import yaml

from builders import text_spec
from saeflow import devices
from workflow_helpers import REPO_ROOT


def test_which_variables_count_as_a_gpu_request():
    assert devices.requested_gpu({}) is None
    assert devices.requested_gpu({"SLURM_GPUS_ON_NODE": "0", "SLURM_JOB_GPUS": ""}) is None
    assert devices.requested_gpu({"SLURM_GPUS": "1"}) == "SLURM_GPUS=1"
    assert devices.requested_gpu({"SLURM_JOB_GPUS": "0"}) == "SLURM_JOB_GPUS=0"  # indices: GPU 0 was given
    assert devices.requested_gpu({"SLURM_GPUS_PER_NODE": "a100:2"}) == "SLURM_GPUS_PER_NODE=a100:2"
    assert devices.requested_gpu({"SAEFLOW_REQUIRE_GPU": "1"}) == "SAEFLOW_REQUIRE_GPU=1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check passes here")
@pytest.mark.slow
def test_a_gpu_job_without_cuda_exits_nonzero_naming_the_problem(tmp_path):
    command = "extract"  # train and inference go through the same check in saeflow.cli
    config_fpath = tmp_path / "config.yaml"
    config = {"shards_root": str(tmp_path / "shards"), "activations": {"a": text_spec()}}
    config_fpath.write_text(yaml.safe_dump(config))
    argv = ["extract", str(config_fpath)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow"), "SLURM_GPUS_ON_NODE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "saeflow", *argv], env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"saeflow {command}: error: this job asked for a GPU (SLURM_GPUS_ON_NODE=1)")
    assert "sees no CUDA device" in lines[0] and "At OSC" in lines[0]
    assert not (tmp_path / "shards").exists()  # failed before any work


def test_cpu_provenance_has_no_gpu_fields():
    assert devices.gpu_provenance() == {}
