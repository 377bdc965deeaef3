"""Identities outlive upgrades (docs/contracts.md, "Identities that outlive upgrades"; DESIGN principle 12).

tests/data/identity.json pins, for today's default workflow and for non-default configs covering every
architecture, the shard hashes, the run ids and the sha256 of the per-job configs of the shard and run jobs (what
Snakemake's rerun trigger compares), all from the plan alone (`WorkflowPlan`, nothing trained or extracted).
They must never change: a key added later with a default must leave every one of them as it was. Changing one on
purpose means bumping an architecture's trainer version (`Arch.trainer`: a change of its training maths) and saying
why in the commit. The pins were made when every architecture trained as `FIRST_TRAINER`, so they are compared with
each architecture's trainer set back to that (`at_pinned_trainers`): what a bump moves, and only that, is checked on
its own (test_a_trainer_bump_moves_only_its_architectures_run_ids). New cases are added with
`python tests/test_identity.py --add NAME` after adding the config to CASES, never by rewriting old ones.
"""

import copy
import dataclasses
import hashlib
import json
import pathlib
import sys

import pytest

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.planning import WorkflowPlan
from saeflow.store import hashing, shards
from saeflow.training import archs, keys, specs, sweeps
from saeflow.training.archs.base import FIRST_TRAINER
from workflow_helpers import REPO_ROOT, minilm_path

FIXTURE_FPATH = pathlib.Path(__file__).parent / "data" / "identity.json"
DEFAULT = "default-workflow"  # config/config.yaml, as shipped
RANDOM_VIT = {
    "model": {"random": {"arch": "vit", "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                   "intermediate_size": 64, "image_size": 32, "patch_size": 8},
                         "seed": 0}},
    "layers": [1],
    "dataset": {"kind": "generated_images", "n_ex": 64, "seed": 0, "size": 32},
    "device": "cpu",
}  # fmt: skip
RANDOM_GPT2 = {
    "model": {"random": {"arch": "gpt2", "config": {"n_embd": 16, "n_layer": 2, "n_head": 2, "vocab_size": 300,
                                                    "n_positions": 32, "bos_token_id": 1, "eos_token_id": 2}}},
    "tokenizer": "bytes",
    "layers": [1],
    "dataset": {"kind": "builtin_text", "n_ex": 16},
    "context_length": 16,
    "device": "cpu",
}  # fmt: skip
ROOTS = {"shards_root": "shards", "runs_root": "runs", "summary_dir": "summary"}
# name -> a workflow config (plan-only). Every architecture appears, and most training keys off their defaults.
CASES = {
    "archs-off-default": {
        **ROOTS,
        "activations": {"vit": RANDOM_VIT, "text": RANDOM_GPT2},
        "saes": {
            "relu": {"train": "vit", "layer": 1, "arch": "relu", "expansion": 4, "l1_coeff": [1.0, 4.0],
                     "matryoshka": [0.25], "sparsity_warmup_frac": 0.1, "tokens": "all"},
            "topk": {"train": "vit", "layer": 1, "arch": "topk", "k": 8, "aux_k": 32, "aux_alpha": 0.0625,
                     "lr": 0.001, "dead_after_vectors": 5000, "n_train_vectors": 10000, "seed": 3, "data_seed": 2,
                     "tokens": "cls"},
            "batchtopk": {"train": "vit", "layer": 1, "arch": "batchtopk", "expansion": 8, "k": 16,
                          "matryoshka": [[0.125], [0.25, 0.5]], "n_val_vectors": None, "lr_warmup_frac": 0.1,
                          "batch_size": 512, "n_epochs": 3},
            "text": {"train": "text", "layer": 1, "arch": ["topk", "batchtopk", "relu"], "k": 4, "expansion": 2},
        },
    },
    # Added with JumpReLU and Gated (issue 34): each at its defaults and off them.
    "jumprelu-gated": {
        **ROOTS,
        "activations": {"vit": RANDOM_VIT},
        "saes": {
            "jumprelu": {"train": "vit", "layer": 1, "arch": "jumprelu", "jumprelu_loss": ["step", "tanh"]},
            "jumprelu-off": {"train": "vit", "layer": 1, "arch": "jumprelu", "l0_coeff": 3.0, "bandwidth": 0.1,
                             "threshold_init": 0.25, "tanh_scale": 2.0, "pre_act_coeff": 1.0e-5,
                             "jumprelu_loss": "tanh", "matryoshka": [0.25]},
            "gated": {"train": "vit", "layer": 1, "arch": "gated", "gate_l1_coeff": [8.0, 10.0], "expansion": 4},
        },
    },
    # Added with transcoders (issue 35): MLP input -> output of one pass, plain and skip, two architectures.
    "transcoders": {
        **ROOTS,
        "activations": {"vit-in": {**RANDOM_VIT, "hook": "mlp_in"}, "vit-out": {**RANDOM_VIT, "hook": "mlp_out"}},
        "saes": {
            "tc": {"train": "vit-in", "target": "vit-out", "layer": 1, "arch": ["topk", "relu"], "k": 8,
                   "skip": [False, True]},
            "mlp-out": {"train": "vit-out", "layer": 1, "k": 8},
        },
    },
    # Added with matching pursuit (issue 41): its k (the pursuit steps) swept, and off the defaults.
    "mp": {
        **ROOTS,
        "activations": {"vit": RANDOM_VIT},
        "saes": {
            "mp": {"train": "vit", "layer": 1, "arch": "mp", "k": [4, 8]},
            "mp-off": {"train": "vit", "layer": 1, "arch": "mp", "k": 16, "expansion": 4, "matryoshka": [0.25],
                       "aux_k": 16, "lr": 0.001},
        },
    },
}  # fmt: skip


def _default_config(monkeypatch, tmp_path) -> dict:
    """config/config.yaml as the workflow reads it from a results tree whose model link exists."""
    link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    link.parent.mkdir(parents=True)
    link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)
    return config.load(REPO_ROOT / "config" / "config.yaml")


# Schema defaults moved off their introduction values, each with why (a moved default names new runs of the
# architectures that read the key, and only those: test_a_moved_default_moves_only_the_runs_that_read_it)
MOVED_DEFAULTS = {
    "jumprelu_loss": "target",  # issue 42: the L0 steered to k (docs/training.md)
    "topk_warmup_frac": 0.75,  # issue 42: JumpReLU's and Gated's TopK start (0.5 before 2026-12-07)
    "gated_loss": "target",  # issue 42: Gated's gates trained by JumpReLU's mechanism (docs/training.md)
}


@pytest.fixture
def at_pinned_trainers(monkeypatch):
    """Every architecture's trainer as it was when the pins were made (`FIRST_TRAINER`), and every moved default at
    its introduction value."""
    pinned_trainers(monkeypatch.setattr)
    pinned_defaults(monkeypatch.setitem)


def pinned_trainers(setattr_=setattr) -> None:
    for arch in archs.REGISTRY.values():
        setattr_(arch, "trainer", FIRST_TRAINER)


def pinned_defaults(setitem=dict.__setitem__) -> None:
    properties = config.def_schema("sae_spec")["properties"]
    for key in MOVED_DEFAULTS:
        setitem(properties[key], "default", keys.INTRODUCED[key])


def identities(cfg: dict) -> dict:
    """What the fixture pins of a config: shard hashes, run ids and the per-job configs of shard and run jobs."""
    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    jobs = {str(rel): hashlib.sha256(hashing.canonical_json(content).encode()).hexdigest()
            for rel, content in plan.cli_configs().items() if rel.parts[0] in ("shards", "runs")}  # fmt: skip
    return {"shards": dict(sorted(plan.shard_hash.items())), "runs": sorted(plan.runs), "job_configs": jobs}


def _fixture() -> dict:
    return json.loads(FIXTURE_FPATH.read_text())


def test_default_workflow_identities_never_change(monkeypatch, tmp_path, at_pinned_trainers):
    assert identities(_default_config(monkeypatch, tmp_path)) == _fixture()[DEFAULT]


@pytest.mark.parametrize("name", sorted(CASES))
def test_identities_never_change(name, at_pinned_trainers):
    assert identities(CASES[name]) == _fixture()[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_trainer_bump_moves_only_its_architectures_run_ids(name, monkeypatch):
    """Against the pins' trainers, a run keeps its id exactly when its architecture's trainer is still the one it
    was pinned at; the shard hashes never move (a trainer is no part of them)."""
    now = WorkflowPlan.from_config(config.validate(copy.deepcopy(CASES[name])))
    with monkeypatch.context() as patch:
        pinned_trainers(patch.setattr)
        then = WorkflowPlan.from_config(config.validate(copy.deepcopy(CASES[name])))
    assert now.shard_hash == then.shard_hash
    then_ids = {(run.sae_name, run.index): run_id for run_id, run in then.runs.items()}
    for run_id, run in now.runs.items():
        bumped = archs.get(run.train_config.arch).trainer != FIRST_TRAINER
        assert (run_id != then_ids[run.sae_name, run.index]) == bumped, (run.sae_name, run.index)


@pytest.mark.parametrize("name", [DEFAULT, *sorted(CASES)])
def test_a_moved_default_moves_only_the_runs_that_read_it(name, monkeypatch, tmp_path):
    """At today's defaults (the pins' trainers), a run keeps its pinned id and job config unless its architecture
    reads a moved default (`MOVED_DEFAULTS`, none given in its spec); the shard hashes never move."""
    pinned_trainers(monkeypatch.setattr)
    cfg = _default_config(monkeypatch, tmp_path) if name == DEFAULT else CASES[name]
    now, pinned = identities(cfg), _fixture()[name]
    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    assert now["shards"] == pinned["shards"]
    for run_id, run in plan.runs.items():
        moved = any(key in run.train_config.read_keys() for key in MOVED_DEFAULTS)
        job = f"runs/{run_id}.json"
        kept = run_id in pinned["runs"] and now["job_configs"][job] == pinned["job_configs"].get(job)
        assert kept != moved, (run.sae_name, run.index)


def test_the_moved_defaults_are_the_schemas():
    properties = config.def_schema("sae_spec")["properties"]
    moved = {key: properties[key]["default"] for key in keys.INTRODUCED if properties[key]["default"] !=
             keys.INTRODUCED[key]}  # fmt: skip
    assert moved == MOVED_DEFAULTS


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_trainer_pinned_in_the_config_names_the_runs_that_trainer_made(name, monkeypatch):
    """`trainer: saeflow-train-3` on every SAE (each architecture still trains that way) plans exactly the pinned run
    ids, those planned before any architecture's trainer moved: an upgrade need not retrain what it moved on from."""
    pinned_defaults(monkeypatch.setitem)
    cfg = copy.deepcopy(CASES[name])
    for spec in cfg["saes"].values():
        spec["trainer"] = FIRST_TRAINER
    assert sorted(WorkflowPlan.from_config(config.validate(cfg)).runs) == _fixture()[name]["runs"]


def test_the_migration_looks_for_a_run_under_each_trainer_its_architecture_still_trains():
    """`saeflow migrate` (tests/test_migrate.py end to end): the run the config plans first, then the same run at each
    other trainer version of its architecture, whose id is the one that trainer gave it."""
    from saeflow import migration

    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(CASES["jumprelu-gated"])))
    recorded = set()
    for run in plan.runs.values():  # JumpReLU and Gated: the run's own trainer, then the others they still train
        cfg = run.train_config
        others = [t for t in ("saeflow-train-5", "saeflow-train-3", "saeflow-train-4") if t != cfg.trainer]
        assert [c.trainer for c in migration.trainer_versions(cfg)] == [cfg.trainer, *others]
        recorded.add(cfg.trainer)
    assert recorded == {"saeflow-train-5"}  # each reads k (tests/test_rare_latents.py: the runs that record 4)
    mp = dataclasses.replace(next(iter(plan.runs.values())).train_config, arch="mp", trainer="saeflow-train-3")
    assert migration.trainer_versions(mp) == [mp]  # one trainer version, so only the planned run
    topk = dataclasses.replace(mp, arch="topk", trainer="saeflow-train-4")
    assert [c.trainer for c in migration.trainer_versions(topk)] == ["saeflow-train-4", "saeflow-train-5",
                                                                     "saeflow-train-3"]  # fmt: skip
    assert [c.trainer for c in migration.trainer_versions(dataclasses.replace(topk, trainer="saeflow-train-3"))] == [
        "saeflow-train-3", "saeflow-train-5", "saeflow-train-4"]


def test_a_trainer_an_architecture_does_not_compute_is_refused_in_one_line():
    cfg = copy.deepcopy(CASES[sorted(CASES)[0]])
    for spec in cfg["saes"].values():
        spec["arch"], spec["trainer"] = "relu", "saeflow-train-5"
    with pytest.raises(SaeflowError, match=r"^saes\.[^ ]+\.trainer: this saeflow does not train relu as "
                                           r"'saeflow-train-5'; choose one of saeflow-train-4, saeflow-train-3$"):
        WorkflowPlan.from_config(config.validate(cfg))


def test_every_architecture_of_the_registry_has_a_pinned_case():
    """An architecture added to the registry fails here until a case of CASES plans a run of it and that case is
    pinned (`python tests/test_identity.py --add NAME`), so no architecture's run ids go unpinned."""
    pinned, planned = _fixture(), set()
    for name, cfg in CASES.items():
        assert name in pinned, f"{name}: pin it with python tests/test_identity.py --add {name}"
        plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
        planned |= {run.train_config.arch for run in plan.runs.values()}
    assert sorted(archs.REGISTRY) == sorted(planned), "give each architecture a case (see the module docstring)"


def test_the_default_reference_trains_the_default_workflows_runs(monkeypatch, tmp_path):
    """The run ids test_default_workflow.py trains (its reference) are those the default workflow plans today."""
    reference = json.loads((REPO_ROOT / "tests" / "data" / "default-workflow.json").read_text())
    assert identities(_default_config(monkeypatch, tmp_path))["runs"] == reference["runs"]


def test_a_config_json_of_today_loads_and_is_its_own_run():
    """A run's config.json as saeflow-train-3 first wrote it (every key, none introduced later) loads, and its
    canonical form is itself, so its run id stays the sha256 it was named by."""
    today = {
        "trainer": "saeflow-train-3", "train_shards": "a" * 64, "val_shards": "b" * 64, "layer": 3,
        "tokens": "no_special", "arch": "topk", "expansion": 4, "k": 8, "matryoshka": [], "l1_coeff": 3.0,
        "aux_k": 64, "aux_alpha": 0.03125, "dead_after_vectors": None, "lr": None, "lr_warmup_frac": 0.05,
        "sparsity_warmup_frac": 0.05, "batch_size": 1024, "n_epochs": 2, "n_train_vectors": None,
        "n_val_vectors": 262144, "seed": 0, "data_seed": 0,
    }  # fmt: skip
    cfg = specs.TrainConfig.from_dict(today, "config.json")
    assert cfg.to_dict() == today
    for key, value in sweeps.INTRODUCED.items():
        assert getattr(cfg, key) == value


def test_an_introduced_key_is_hashed_only_off_its_introduction_value(monkeypatch):
    """The mechanism on its own: a key introduced at a value is left out there, kept elsewhere, filled when absent."""
    monkeypatch.setitem(sweeps.INTRODUCED, "aux_alpha", 0.03125)
    obj = {"trainer": specs.trainer_of("topk"), "train_shards": "a" * 64, "val_shards": "a" * 64, "layer": 0,
           "tokens": "all",
           "arch": "topk", "expansion": 2, "k": 2, "matryoshka": [], "l1_coeff": 3.0, "aux_k": 8,
           "dead_after_vectors": None, "lr": None, "lr_warmup_frac": 0.05, "sparsity_warmup_frac": 0.05,
           "batch_size": 8, "n_epochs": 1, "n_train_vectors": None, "n_val_vectors": None, "seed": 0,
           "data_seed": 0}  # fmt: skip
    cfg = specs.TrainConfig.from_dict(obj, "x")
    assert cfg.aux_alpha == 0.03125 and "aux_alpha" not in cfg.to_dict() and cfg.to_dict() == obj
    other = specs.TrainConfig.from_dict({**obj, "aux_alpha": 0.5}, "x")
    assert other.to_dict()["aux_alpha"] == 0.5
    assert keys.canonical_spec({"aux_alpha": 0.03125, "k": 2}) == {"k": 2}
    assert keys.canonical_spec({"aux_alpha": [0.03125, 0.5]}) == {"aux_alpha": [0.03125, 0.5]}  # a sweep stays


def test_every_key_added_to_the_training_config_is_introduced():
    """A field beyond saeflow-train-3's first keys must have an introduction value (or every run id would move), and
    its schema default is where the introduction value came from when it was added."""
    first = {"trainer", "train_shards", "val_shards", "layer", "tokens", "arch", "expansion", "k", "matryoshka",
             "l1_coeff", "aux_k", "aux_alpha", "dead_after_vectors", "lr", "lr_warmup_frac", "sparsity_warmup_frac",
             "batch_size", "n_epochs", "n_train_vectors", "n_val_vectors", "seed", "data_seed"}  # fmt: skip
    fields = {f.name for f in sweeps.dataclasses.fields(specs.TrainConfig)}
    assert fields - first == set(sweeps.INTRODUCED)
    properties = config.def_schema("sae_spec")["properties"]
    defaults = {key: properties[key]["default"] for key in sweeps.INTRODUCED}
    assert defaults == {**sweeps.INTRODUCED, **MOVED_DEFAULTS}  # (no default moved but those listed)


def test_a_data_key_added_later_changes_no_shard_hash(monkeypatch):
    """Shard metadata's `data` object: a key at its introduction value is left out and read back as it."""
    cfg = CASES["archs-off-default"]
    before = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg))).shard_hash
    monkeypatch.setitem(shards.INTRODUCED_DATA, "compute_dtype", "float32")  # as if added later at float32
    plan = WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    assert plan.shard_hash != before  # the key is left out now, so these hashes move ...
    md = plan.activation_metadata["vit"]
    assert "compute_dtype" not in md.data and shards.data_value(md, "compute_dtype") == "float32"
    monkeypatch.setitem(shards.INTRODUCED_DATA, "compute_dtype", "bfloat16")  # ... and at another value they stay
    assert WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg))).shard_hash == before


def _add(name: str) -> None:
    """Pin a new case (never rewrite an old one: that is what the tests refuse)."""
    fixture = _fixture() if FIXTURE_FPATH.exists() else {}
    pinned_trainers()
    if name in fixture:
        raise SystemExit(f"{name} is pinned already; pins never change (see the module docstring)")
    if name == DEFAULT:
        import tempfile

        class _Chdir:
            def chdir(self, path):
                import os

                os.chdir(path)

        with tempfile.TemporaryDirectory() as tmp:
            fixture[name] = identities(_default_config(_Chdir(), pathlib.Path(tmp)))
    else:
        fixture[name] = identities(CASES[name])
    FIXTURE_FPATH.write_text(json.dumps(fixture, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--add":
        raise SystemExit("usage: python tests/test_identity.py --add NAME")
    _add(sys.argv[2])
