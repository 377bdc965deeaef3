"""Each architecture declares the training keys it reads (`Arch.hyper`, `Arch.reads`; the common ones are
`training.keys.COMMON`): a key it does not read names no run (the hashed config holds it at a fixed value, so no
published id moves: tests/test_identity.py), a sweep over one plans one run and `saeflow plan` says so, and what a
person reads (checkpoint/hyperparameters.json, summary.csv's config.* columns) holds every value the run trained
with, introduced keys included."""

import copy
import csv
import dataclasses
import io
import json

import pytest
import torch
import yaml

from saeflow import cli, config
from saeflow.analysis import summary
from saeflow.planning import WorkflowPlan
from saeflow.store import runs
from saeflow.training import archs, keys, objectives, specs, sweeps
from test_archs import _random_sae
from test_identity import RANDOM_VIT, ROOTS

# A value off its default for every architecture key (and a valid one: k fits d_sae, positive scales); jumprelu_loss
# is the other loss
OFF = {"k": 7, "l1_coeff": 11.0, "sparsity_warmup_frac": 0.9, "jumprelu_loss": "tanh", "l0_coeff": 9.0,
       "bandwidth": 0.3, "threshold_init": 0.7, "tanh_coeff": 5.0, "tanh_scale": 9.0, "pre_act_coeff": 0.5,
       "gate_l1_coeff": 1.0, "threshold_lr_scale": 9.0, "gate_bias_lr_scale": 9.0, "target_l0_coeff": 3.0,
       "topk_warmup_frac": 0.9}  # fmt: skip
# Every architecture, JumpReLU in each of its losses and Gated in its other (their defaults: target)
KINDS = ([(name, {}) for name in archs.NAMES] + [("jumprelu", {"jumprelu_loss": loss}) for loss in ("step", "tanh")]
         + [("gated", {"gated_loss": "l1"})])  # fmt: skip


def _config(saes: dict) -> dict:
    return config.validate(copy.deepcopy({**ROOTS, "activations": {"vit": RANDOM_VIT}, "saes": saes}))


def _runs(**sae) -> dict:
    """Run id -> RunPlan of one SAE spec `x` on the random ViT."""
    return WorkflowPlan.from_config(_config({"x": {"train": "vit", "layer": 1, **sae}})).runs


@pytest.mark.parametrize(("arch", "mode", "extra"), [
    ("topk", {}, {"l1_coeff": 5.0}),
    ("gated", {"gated_loss": "l1"}, {"k": 8, "target_l0_coeff": 3.0, "bandwidth": 0.5}),
    ("gated", {}, {"gate_l1_coeff": 9.0, "l0_coeff": 5.0}), ("relu", {}, {"k": 8, "gate_l1_coeff": 9.0}),
    ("batchtopk", {}, {"l1_coeff": 5.0, "sparsity_warmup_frac": 0.5}),
    ("jumprelu", {"jumprelu_loss": "step", "topk_warmup_frac": 0.0}, {"l1_coeff": 5.0, "k": 8}),
    ("jumprelu", {"jumprelu_loss": "tanh"}, {"gate_bias_lr_scale": 1.0}),
])  # fmt: skip
def test_a_key_the_architecture_does_not_read_keeps_the_run_id(arch, mode, extra):
    """Adding a key no architecture of the spec reads gives the run it always was."""
    assert list(_runs(arch=arch, **mode, **extra)) == list(_runs(arch=arch, **mode))


@pytest.mark.parametrize(("arch", "key", "value"), [
    ("topk", "k", 8), ("gated", "k", 8), ("gated", "gated_loss", "l1"), ("gated", "target_l0_coeff", 3.0),
    ("relu", "l1_coeff", 5.0), ("jumprelu", "target_l0_coeff", 3.0),
    ("jumprelu", "bandwidth", 0.5), ("gated", "aux_k", 64), ("jumprelu", "k", 8), ("jumprelu", "topk_warmup_frac", 0.2),
])  # fmt: skip
def test_a_key_the_architecture_reads_still_changes_the_run_id(arch, key, value):
    assert list(_runs(arch=arch, **{key: value})) != list(_runs(arch=arch))


def test_a_sweep_over_an_unread_key_plans_one_run_and_saeflow_plan_says_so(tmp_path, capsys):
    """Three points, one run: named without the value it ignores, the run of the spec without the key, and
    `create-run --index` of any point makes that one run directory."""
    swept = _runs(arch="topk", l1_coeff=[1.0, 2.0, 5.0])
    assert list(swept) == list(_runs(arch="topk"))
    (plan,) = swept.values()
    assert plan.name == "x" and (plan.index, plan.same_points) == (0, (1, 2))
    mixed = _runs(arch=["topk", "relu"], l1_coeff=[1.0, 5.0])  # relu reads it: two relu runs, one topk run
    assert sorted(p.name for p in mixed.values()) == ["x[arch=relu,l1_coeff=1.0]", "x[arch=relu,l1_coeff=5.0]",
                                                      "x[arch=topk]"]  # fmt: skip
    cfg = {
        **ROOTS,
        "activations": {"vit": RANDOM_VIT},
        "saes": {"minilm-topk": {"train": "vit", "layer": 1, "arch": "topk", "l1_coeff": [1.0, 2.0, 5.0]}},
    }
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "saes.minilm-topk: l1_coeff is swept but topk does not read it: 3 points are one run" in out
    assert len([line for line in out if line.startswith("run ")]) == 1
    created = set()
    for index in range(3):
        assert cli.main(["create-run", str(config_fpath), "--index", str(index), "--runs-root",
                         str(tmp_path / "runs")]) == 0  # fmt: skip
        created.add(capsys.readouterr().out.strip())
    assert created == {str(tmp_path / "runs" / plan.run_id)}


def test_a_sweep_over_a_key_another_point_of_it_reads_keeps_its_ids_and_plans_one_run():
    """A key another architecture of the sweep (or JumpReLU's other loss) reads is hashed at one of the sweep's values:
    the one it always was when the spec gives one, so arch sweeps published with a shared k keep their ids."""
    one = _runs(arch=["topk", "relu"], k=4)
    relu = next(p for p in one.values() if p.train_config.arch == "relu")
    assert relu.train_config.k == 4 and relu.name == "x[arch=relu]"
    jumprelu = _runs(arch="jumprelu", jumprelu_loss=["step", "tanh"], tanh_coeff=[0.1, 0.5])
    assert sorted(p.name for p in jumprelu.values()) == [
        "x[jumprelu_loss=step]", "x[jumprelu_loss=tanh,tanh_coeff=0.1]", "x[jumprelu_loss=tanh,tanh_coeff=0.5]"
    ]  # fmt: skip


def test_every_training_key_is_read_by_every_run_or_declared_by_an_architecture():
    fields = [f.name for f in dataclasses.fields(specs.TrainConfig)]
    assert set(keys.COMMON) | set(keys.ARCH_KEYS) == set(fields) and not set(keys.COMMON) & set(keys.ARCH_KEYS)
    assert set(keys.ARCH_KEYS) <= set(sweeps.UNREAD) | set(keys.INTRODUCED)
    properties = config.def_schema("sae_spec")["properties"]
    assert {key: properties[key]["default"] for key in sweeps.UNREAD} == sweeps.UNREAD  # the defaults they froze


def _one_step(cfg: specs.TrainConfig, step: int) -> dict:
    """What the run `cfg` computes in one step of one process (`step` of 100): its initial state, loss terms,
    gradients, state after the step's forward and the learning-rate multiples of its parameters (AuxK and the
    dead-latent terms active)."""
    torch.manual_seed(0)
    sae = _random_sae(cfg, b_enc_std=0.5)  # wider biases: more latents fire, so more keys reach the step
    state = {name: t.clone() for name, t in sae.state_dict().items()}
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)
    loss = objectives.Objective(cfg, 100)(sae, torch.randn(32, 16) * 2, step, dead)
    loss.total.backward()
    grads = {name: p.grad.clone() for name, p in sae.named_parameters()}
    return {"state": state, "terms": {n: t.detach() for n, t in loss.terms.items()}, "grads": grads,
            "after": {name: t.detach().clone() for name, t in sae.state_dict().items()},
            "lr_scales": sae.arch.lr_scales(cfg)}  # fmt: skip


def _steps(cfg: specs.TrainConfig) -> dict:
    """`_one_step` early in the run (inside the sparsity and TopK warm-ups) and late (after both at their defaults,
    inside OFF's)."""
    return {"early": _one_step(cfg, 1), "late": _one_step(cfg, 80)}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same(a[k], b[k]) if isinstance(a[k], dict) else
               (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a)  # fmt: skip


@pytest.mark.parametrize(("arch", "mode"), KINDS, ids=[f"{a}-{''.join(m.values())}" for a, m in KINDS])
def test_an_architecture_reads_exactly_the_keys_it_declares(arch, mode):
    """The declarations are what training computes: changing a key the run does not read changes nothing of one
    step (so hashing it at a fixed value trains the same SAE), changing one it reads changes something."""
    obj = {"trainer": specs.trainer_of(arch), "train_shards": "a" * 64, "val_shards": "a" * 64, "tokens": "all",
           **{k: v for k, v in config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0,
                                                "arch": arch, "k": 4, "aux_k": 8, **mode}}})["saes"]["s"].items()
              if k not in ("train", "val")}}  # fmt: skip
    cfg = specs.TrainConfig.from_dict(obj, arch)
    base, read = _steps(cfg), cfg.read_keys()
    other_losses = {"jumprelu_loss": "step" if cfg.jumprelu_loss == "tanh" else "tanh",
                    "gated_loss": "l1" if cfg.gated_loss == "target" else "target"}
    for key, value in {**OFF, **other_losses}.items():
        changed = _steps(dataclasses.replace(cfg, **{key: value}))
        if key in read:
            assert not _same(base, changed), f"{arch}: declares {key} but does not read it"
        else:
            assert _same(base, changed), f"{arch}: reads {key} but does not declare it"


def _gated_and_step_jumprelu(tmp_path, capsys) -> dict:
    """arch -> the run directory `saeflow create-run` makes for a Gated SAE and a JumpReLU at defaults."""
    cfg = {**ROOTS, "runs_root": str(tmp_path / "runs"), "activations": {"vit": RANDOM_VIT},
           "saes": {"gated": {"train": "vit", "layer": 1, "arch": "gated"},
                    "jumprelu": {"train": "vit", "layer": 1, "arch": "jumprelu"}}}  # fmt: skip
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    made = {}
    for name in ("gated", "jumprelu"):
        assert cli.main(["create-run", str(config_fpath), "--sae", name]) == 0
        made[name] = runs.open_run(capsys.readouterr().out.strip())
    return made


def test_the_readable_file_holds_every_value_the_run_trains_with(tmp_path, capsys):
    made = _gated_and_step_jumprelu(tmp_path, capsys)
    for run in made.values():  # the hashed config is what it always was: its sha256 is the run id
        assert runs.run_id(run.config()) == run.run_id and "gate_l1_coeff" not in run.config()
    gated = json.loads(made["gated"].hyperparameters_fpath.read_text())
    assert gated["gated_loss"] == "target" and gated["target_l0_coeff"] == 8.0 and gated["k"] == 32
    assert gated["gate_bias_lr_scale"] == 4.0 and gated["aux_k"] == 256 and gated["topk_warmup_frac"] == 0.75
    assert {"gate_l1_coeff", "l1_coeff", "l0_coeff", "threshold_init"} <= set(gated["not_read"])
    jumprelu = json.loads(made["jumprelu"].hyperparameters_fpath.read_text())
    assert jumprelu["jumprelu_loss"] == "target" and jumprelu["target_l0_coeff"] == 8.0 and jumprelu["k"] == 32
    assert jumprelu["topk_warmup_frac"] == 0.75 and jumprelu["bandwidth"] == 1.0
    assert {"tanh_coeff", "tanh_scale", "pre_act_coeff", "l0_coeff"} <= set(jumprelu["not_read"])
    fields = {f.name for f in dataclasses.fields(specs.TrainConfig)}
    for view in (gated, jumprelu):
        assert set(view) - {"not_read"} | set(view["not_read"]) == fields


def test_summary_csv_has_a_column_for_every_value_and_blank_where_the_run_does_not_read_it(tmp_path, capsys):
    """Also for a run made before hyperparameters.json existed: the columns come from its config.json."""
    made = _gated_and_step_jumprelu(tmp_path, capsys)
    made["gated"].hyperparameters_fpath.unlink()
    for run in made.values():
        dump = run.dump("b" * 64)
        dump.dpath.mkdir(parents=True)
        dump.metrics_fpath.write_text(json.dumps({"l0": 4.0, "nmse": 0.2}))
    rows = list(csv.DictReader(io.StringIO(summary.to_csv(summary.collect([r.root for r in made.values()])))))
    by_arch = {row["config.arch"]: row for row in rows}
    assert by_arch["gated"]["config.target_l0_coeff"] == "8.0" and "config.gate_l1_coeff" not in by_arch["gated"]
    assert by_arch["jumprelu"]["config.jumprelu_loss"] == "target" and "config.l0_coeff" not in by_arch["jumprelu"]
    assert by_arch["jumprelu"]["config.target_l0_coeff"] == "8.0" and by_arch["jumprelu"]["config.k"] == "32"
    assert by_arch["jumprelu"]["config.bandwidth"] == "1.0" and by_arch["jumprelu"]["config.gate_bias_lr_scale"] == ""
    assert by_arch["gated"]["config.threshold_lr_scale"] == "" and by_arch["gated"]["config.gated_loss"] == "target"
    assert "l1_coeff" in json.loads(by_arch["gated"]["config.not_read"])
