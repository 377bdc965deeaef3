"""The workflow's probe and stability stages, run for real on generated images (a shape label per patch) and a 2-seed
ReLU sweep: each dump is probed and its latent pages list the labels, the seed group is matched and summarized with
means and standard deviations; probe settings rerun only the probes (and the summary), a new seed only its own jobs,
the group's stability and the summary."""

import copy
import csv
import json

import pytest

from saeflow import config
from saeflow.analysis import report, stability
from saeflow.planning import WorkflowPlan
from test_workflow_rerun import planned_jobs
from workflow_helpers import REPO_ROOT, snakemake, write_config

pytestmark = pytest.mark.slow  # every test here runs Snakemake end to end

CFG = {
    "shards_root": "shards",
    "runs_root": "runs",
    "summary_dir": "summary",
    "activations": {
        "images": {
            "model": {"random": {"arch": "vit", "config": {"hidden_size": 32, "num_hidden_layers": 2,
                                                           "num_attention_heads": 2, "intermediate_size": 64,
                                                           "image_size": 32, "patch_size": 8}}},
            "layers": [1],
            "dataset": {"kind": "generated_images", "n_ex": 24, "size": 32},
            "device": "cpu",
        }
    },
    "saes": {"vit": {"train": "images", "layer": 1, "arch": "relu", "expansion": 2, "batch_size": 64, "seed": [0, 1]}},
    "visuals": {"n_latents": 2, "top_k": 2},
    "evaluate": {"n_tokens": 68},
    "probe": {"train_per_label": 64, "test_per_label": 16},
}  # fmt: skip


def _plan(cfg: dict) -> WorkflowPlan:
    return WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))


def _dry_run(workdir, cfg: dict, name: str) -> set[str]:
    return planned_jobs(snakemake(workdir, write_config(workdir, cfg, name), "-n").stdout)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("probe-workflow")
    snakemake(workdir, write_config(workdir, CFG))
    return workdir


def test_every_labelled_dump_is_probed_and_the_seed_group_is_matched(tree):
    plan = _plan(CFG)
    shard_hash = plan.shard_hash["images"]
    assert sorted(plan.probes()) == sorted((run_id, shard_hash) for run_id in plan.runs)
    for run_id in plan.runs:
        result = json.loads((tree / plan.run(run_id).probe_fpath(shard_hash)).read_text())
        assert [e["name"] for e in result["labels"]] == ["background", "rectangle", "ellipse"]
        assert result["config"]["train_per_label"] == 64 and result["metrics"]["n_labels"] == 3
        page = (tree / plan.run(run_id).dump(shard_hash).labels_js_fpath).read_text()
        assert '"note":""' in page and "rectangle" in page  # the latent pages list the labels
    (group,) = stability.seed_groups({r: p.train_config.to_dict() for r, p in plan.runs.items()})
    matched = json.loads((tree / stability.result_fpath(plan.cfg.summary_dir, group)).read_text())
    assert sorted(matched["runs"]) == sorted(plan.runs) and matched["metrics"]["n_pairs"] == 1
    rows = list(csv.DictReader((tree / "summary" / "summary.csv").open()))
    assert all(row["probe.dense_accuracy"] and row["group"] == group for row in rows)
    (grouped,) = csv.DictReader((tree / "summary" / report.GROUPED_FNAME).open())
    assert grouped["n_runs"] == "2" and grouped["nmse.std"] and grouped["probe.sparse_k1_accuracy.mean"]
    assert float(grouped["stability.frac_matched_0.7.mean"]) == matched["metrics"]["frac_matched_0.7"]
    for page in report.PAGES:
        assert (tree / "summary" / report.page_fname(page)).read_bytes()[:4] == b"\x89PNG"


def test_probe_settings_rerun_only_the_probes_and_a_new_seed_only_its_jobs(tree):
    plan = _plan(CFG)
    shard_hash = plan.shard_hash["images"]
    assert _dry_run(tree, CFG, "same.yaml") == set()
    changed = {**CFG, "probe": {**CFG["probe"], "seed": 1}}
    assert _dry_run(tree, changed, "probe-seed.yaml") == {"summary", "all"} | {
        f"probe:{run_id}/{shard_hash}" for run_id in plan.runs
    }
    more = copy.deepcopy(CFG)
    more["saes"]["vit"]["seed"] = [0, 1, 2]
    (new,) = set(_plan(more).runs) - set(plan.runs)
    (group,) = stability.seed_groups({r: p.train_config.to_dict() for r, p in _plan(more).runs.items()})
    jobs = _dry_run(tree, more, "three-seeds.yaml")
    assert jobs == {"summary", "all", f"create_run:{new}", f"train:{new}", f"inference:{new}/{shard_hash}",
                    f"evaluate:{new}/{shard_hash}", f"probe:{new}/{shard_hash}", f"stability:{group}"}  # fmt: skip


def test_inference_settings_rerun_inference_the_probes_and_the_summary_as_the_readme_says(tree):
    """Issue 33: the README said an inference setting reruns "inference (and the summary) only"; a dump's probe reads
    it, and so does the seed group's stability (it matches the latents that fired in the dumps)."""
    plan = _plan(CFG)
    shard_hash = plan.shard_hash["images"]
    (group,) = stability.seed_groups({r: p.train_config.to_dict() for r, p in plan.runs.items()})
    changed = {**CFG, "inference": {"top_k": 8}}
    assert _dry_run(tree, changed, "inference-top-k.yaml") == {"summary", "all", f"stability:{group}"} | {
        f"{rule}:{run_id}/{shard_hash}" for run_id in plan.runs for rule in ("inference", "probe")
    }
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    assert "changing it reruns inference (with its visuals), what reads the dumps it remakes (the probes" in readme

