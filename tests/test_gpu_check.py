"""benchmarks/gpu/check.py --cpu: the GPU check's whole pipeline on tiny models, on the CPU, prints its table."""

import os
import pathlib
import subprocess
import sys

import pytest

from hang import HANG_SEC

pytestmark = pytest.mark.slow  # both run benchmarks/gpu/check.py in a subprocess

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK_FPATH = REPO_ROOT / "benchmarks" / "gpu" / "check.py"
STAGES = (
    "pytest -m cuda",
    "extract tiny ViT: tokens/s",
    "extract tiny ViT: writer share",
    "extract tiny Llama: tokens/s",
    "extract tiny Llama: writer share",
    "train topk (d 32, 4x): examples/s",
    "train topk: peak GPU memory",
    "train batchtopk (d 32, 4x): examples/s",
    "train batchtopk: peak GPU memory",
    "inference: vectors/s",
    "GPU utilization, extraction",
    "GPU longest idle gap, extraction",
    "GPU utilization, training",
    "GPU longest idle gap, training",
)
# Rows that need a GPU (nvidia-smi, `pytest -m cuda`, CUDA memory stats): the dry run says "skipped".
CUDA_ONLY = {s for s in STAGES if s.startswith(("pytest", "GPU ")) or s.endswith("peak GPU memory")}


def test_cpu_dry_run_prints_the_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(CHECK_FPATH), "--cpu", "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=HANG_SEC,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("GPU check: ") and "(cpu dry run)" in lines[0] and "torch " in lines[0]
    assert lines[2] == "| stage | measured | limit | ratio | target |"
    rows = {}
    for line in lines[4:]:
        stage, measured, limit, ratio, target = (cell.strip() for cell in line.strip("|").split("|"))
        rows[stage] = (measured, ratio)
    assert tuple(rows) == STAGES
    for stage, (measured, ratio) in rows.items():
        if stage in CUDA_ONLY:
            assert (measured, ratio) == ("skipped", "-"), stage
        else:
            assert float(ratio) > 0, stage
    assert list(tmp_path.iterdir()) == []  # shards and runs went to --dir and were removed


def test_help_explains(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow")}
    proc = subprocess.run([sys.executable, str(CHECK_FPATH), "--help"], capture_output=True, text=True, env=env,
                          timeout=HANG_SEC)  # fmt: skip
    assert proc.returncode == 0
    for words in ("--cpu", "pytest -m cuda", "bare forward", "nvidia-smi", "srun"):
        assert words in proc.stdout, words
