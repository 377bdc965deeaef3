"""Sweeps in one pass inside the workflow: untrained runs that read identical batches train in one job, reading
the data once (the test counts the bytes read), each publishing the checkpoint it would have alone; a new sweep
point trains without touching the existing ones (docs/workflow.md, "One pass per sweep")."""

import json
import os

import pytest

from _readcount import ReadCounter
from saeflow import config
from saeflow.planning import WorkflowPlan
from saeflow.store import runs
from saeflow.training import train
from workflow_helpers import REPO_ROOT, job_counts, snakemake, tree_state, write_config

pytestmark = pytest.mark.slow  # every test here runs Snakemake or the CLI end to end

GPT2 = {"random": {"arch": "gpt2", "config": {"n_embd": 16, "n_layer": 2, "n_head": 2, "vocab_size": 300,
                                              "n_positions": 32, "bos_token_id": 1, "eos_token_id": 2}}}  # fmt: skip


def _config(tmp_path, k: list[int]) -> dict:
    text = {"model": GPT2, "tokenizer": "bytes", "layers": [1], "context_length": 16, "device": "cpu"}
    return {
        "shards_root": str(tmp_path / "shards"),
        "runs_root": str(tmp_path / "runs"),
        "summary_dir": str(tmp_path / "summary"),
        "activations": {
            "text": {**text, "dataset": {"kind": "builtin_text", "n_ex": 48}},
            "held": {**text, "dataset": {"kind": "builtin_text", "n_ex": 8}},  # validation: another directory
        },
        "saes": {"topk": {"train": "text", "val": "held", "layer": 1, "arch": "topk", "expansion": 2, "k": k,
                          "aux_k": 8, "batch_size": 64, "n_epochs": 2}},
    }  # fmt: skip


def _train_through_the_workflow(tmp_path, cfg: dict) -> tuple[WorkflowPlan, dict, list[dict]]:
    """Snakemake asked for every checkpoint still to train (each pass's representative's: a trained run's sae.pt is
    a source file, no job's output); job counts, and what each process that read the training shards read."""
    plan = WorkflowPlan.from_config(config.validate(json.loads(json.dumps(cfg))))
    targets = sorted({str(plan.run(plan.trained_by(run_id)).sae_fpath) for run_id in plan.train_passes})
    out = tmp_path / f"reads-{len(plan.runs)}"
    proc = snakemake(
        tmp_path, write_config(tmp_path, cfg), *targets,
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "tests" / "readcount"), os.environ.get("PYTHONPATH", "")]),
        SAEFLOW_TEST_COUNT_READS=f"{plan.shard(plan.shard_hash['text']).dpath}:{out}",
    )  # fmt: skip
    reads = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    return plan, job_counts(proc.stdout + proc.stderr), reads


def test_a_four_run_sweep_trains_in_one_job_reading_the_data_once(tmp_path):
    plan, counts, reads = _train_through_the_workflow(tmp_path, _config(tmp_path, [2, 4, 6, 8]))
    assert counts["train"] == 1 and counts["create_run"] == 4, counts
    (job,) = reads  # one process read the training shards: the pass
    assert sum(arg.startswith("--run") for arg in job["argv"]) == 4, job["argv"]

    shards_dpath = plan.shard(plan.shard_hash["text"]).dpath
    n_layer_bytes = sum(f.stat().st_size for f in shards_dpath.glob("acts*.bin"))  # the one layer stored
    for run_id in plan.runs:  # each run trained alone reads what the pass read, and ends with the same bytes
        held_dpath = plan.shard(plan.shard_hash["held"]).dpath
        alone = runs.create_run(tmp_path / "alone", plan.runs[run_id].train_config.to_dict(),
                                train_shards=shards_dpath, val_shards=held_dpath)  # fmt: skip
        with ReadCounter(shards_dpath) as counter:
            train.train_runs([alone.root], train.TrainSettings(device="cpu"))
        assert counter.n_bytes == job["n_bytes"] >= 2 * n_layer_bytes, (counter.n_bytes, job["n_bytes"])
        assert plan.run(run_id).sae_fpath.read_bytes() == alone.sae_fpath.read_bytes(), run_id

    trained = tree_state(tmp_path / "runs")
    plan5, counts, reads = _train_through_the_workflow(tmp_path, _config(tmp_path, [2, 4, 6, 8, 10]))
    (new_run,) = set(plan5.runs) - set(plan.runs)
    assert counts["train"] == 1 and counts["create_run"] == 1, counts
    (job,) = reads
    assert [arg for arg in job["argv"] if arg.startswith("--run")] == [f"--run={plan5.run(new_run).root}"]
    now = tree_state(tmp_path / "runs")
    assert {p: s for p, s in now.items() if p in trained} == trained, "an existing run was touched"
