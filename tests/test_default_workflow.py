"""The default workflow reproduces its committed reference on any machine (tests/default_reference.py).

Pinned exactly: what is platform-independent (each shard directory's metadata.json and so its name, its integer
side files, the run ids). Compared within a tolerance: the float outputs, which depend on the CPU's kernels
(saeflow.numerics). The workflow runs twice: with saeflow's default kernels (`portable`), and with torch's own
kernels on AVX2 (`SAEFLOW_NUMERICS=native ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`: a second instruction
set on any x86-64 machine), and both must match the reference the same way.
"""

import json
import pathlib

import pytest

from default_reference import check
from saeflow import config, numerics
from saeflow.planning import WorkflowPlan
from workflow_helpers import REPO_ROOT, minilm_path, snakemake

NATIVE_AVX2 = {numerics.ENV_VAR: "native", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [{}, NATIVE_AVX2], ids=["portable", "native-avx2"])
def test_default_workflow_matches_its_reference(tmp_path, monkeypatch, kernels):
    model_link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    model_link.parent.mkdir(parents=True)
    model_link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)  # the config's relative paths (the model link, the roots) as the workflow sees them
    plan = WorkflowPlan.from_config(config.load(REPO_ROOT / "config" / "config.yaml"))
    sae_targets = {str(plan.run(plan.trained_by(run_id)).sae_fpath) for run_id in plan.runs}  # one job per pass
    for name in numerics.PORTABLE_ENV:  # this process's own pins (conftest) must not reach a native run
        monkeypatch.delenv(name, raising=False)
    snakemake(tmp_path, REPO_ROOT / "config" / "config.yaml", *sorted(sae_targets), **kernels)
    results = pathlib.Path(tmp_path) / "results" / "saev"
    for prov_fpath in [*results.glob("shards/*/provenance.json"), *results.glob("runs/*/checkpoint/provenance.json")]:
        assert json.loads(prov_fpath.read_text())["platform"]["numerics"] == kernels.get(numerics.ENV_VAR, "portable")
    assert check(results) == []


@pytest.mark.slow
def test_default_vision_pages_show_nine_distinct_images_and_trained_token_metrics(tmp_path, monkeypatch):
    """The default workflow's ViT run: every drawn latent's page shows visuals.top_k (9) different images, and the
    dump's headline metrics are over the 64 patches of each image the SAE trained on (tokens: content), not CLS."""
    model_link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    model_link.parent.mkdir(parents=True)
    model_link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)
    cfg = config.load(REPO_ROOT / "config" / "config.yaml")
    plan = WorkflowPlan.from_config(cfg)
    ((run_id, shard_hash),) = [(r, h) for r, h in plan.dumps() if plan.runs[r].sae_name == "vit-relu"]
    dump = plan.run(run_id).dump(shard_hash)
    snakemake(tmp_path, REPO_ROOT / "config" / "config.yaml", str(dump.index_fpath))  # the ViT's jobs alone
    data = json.loads(dump.visuals.data_fpath.read_text().removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    distinct = [len({ex for ex, _, _ in page["top"]}) for page in data["drawn"].values()]
    assert len(distinct) == cfg["visuals"]["n_latents"] and set(distinct) == {cfg["visuals"]["top_k"]}
    metrics = json.loads(dump.metrics_fpath.read_text())
    md = plan.activation_metadata["vit-shapes"]
    assert metrics["tokens"] == "content" and metrics["n_vectors"] == md.n_ex * (md.tokens_per_ex - 1)
    assert metrics["all_tokens"]["n_vectors"] == md.n_ex * md.tokens_per_ex


def test_the_default_config_plans_its_pinned_shard_hashes_and_run_ids(tmp_path, monkeypatch):
    """Plan only, no model run: the reference's shard directory names and run ids (keys added later, such as an
    activation's `hook`, change no existing identity at their defaults)."""
    model_link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    model_link.parent.mkdir(parents=True)
    model_link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)
    plan = WorkflowPlan.from_config(config.load(REPO_ROOT / "config" / "config.yaml"))
    reference = json.loads((REPO_ROOT / "tests" / "data" / "default-workflow.json").read_text())
    pinned = {pathlib.PurePath(key).parts[1] for key in reference["exact"] if key.startswith("shards/")}
    assert set(plan.shard_hash.values()) == pinned
    assert sorted(plan.runs) == sorted(reference["runs"])
