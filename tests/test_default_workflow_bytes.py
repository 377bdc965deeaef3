"""The default workflow reproduces the recorded bytes: shards, metadata and trained SAEs (tests/data/*.sha256).

The hashes were recorded before the layout/config refactor (issue 18) and must never move without a reason: a
change to them means a change to what saeflow computes, and so to the content addresses users rely on. Floating
point kernels differ between CPU families; the recording machine is the 2-core x86-64 VM the CI runs on.
"""

import hashlib
import pathlib

import pytest

from saeflow import config
from saeflow.planning import WorkflowPlan
from workflow_helpers import REPO_ROOT, minilm_path, snakemake

RECORDED_FPATH = pathlib.Path(__file__).parent / "data" / "default-workflow.sha256"
RESULTS_DNAME = "results/saev"  # the default config's roots are results/saev/{shards,runs}


@pytest.mark.slow
def test_default_workflow_gives_the_recorded_shard_and_checkpoint_bytes(tmp_path, monkeypatch):
    recorded = {}
    for line in RECORDED_FPATH.read_text().splitlines():
        digest, rel_fpath = line.split(maxsplit=1)
        recorded[rel_fpath] = digest
    model_link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    model_link.parent.mkdir(parents=True)
    model_link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)  # the config's relative paths (the model link, the roots) as the workflow sees them
    plan = WorkflowPlan.from_config(config.load(REPO_ROOT / "config" / "config.yaml"))
    assert {f"runs/{run_id}/checkpoint/sae.pt" for run_id in plan.runs} <= set(recorded), "run ids moved"
    sae_targets = {str(plan.run(plan.trained_by(run_id)).sae_fpath) for run_id in plan.runs}  # one job per pass
    snakemake(tmp_path, REPO_ROOT / "config" / "config.yaml", *sorted(sae_targets))
    actual = {
        rel: hashlib.sha256((tmp_path / RESULTS_DNAME / rel).read_bytes()).hexdigest() for rel in recorded
    }
    assert actual == recorded
