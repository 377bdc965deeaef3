"""Rare latents (issue 42): JumpReLU's and Gated's runs that target an L0 count a latent firing at under RARE_SHARE of
the rate they target as dead, and pull it up with the pre-activation loss; the runs they do not reach keep their ids.

The rarity's effect on recovery is a benchmark's (benchmarks/bench_planted.py --grid; README "Planted grid"); here:
the counter's verdicts, its state across a resume and a latent split, the term each run computes, and the trainer
version each run records.
"""

import copy
import dataclasses
import math

import pytest
import torch

from saeflow import config
from saeflow.planning import WorkflowPlan
from saeflow.training import archs, objectives, resume
from saeflow.training.archs.jumprelu import REVIVE_COEFF
from saeflow.training.sae import SAE
from saeflow.training.specs import TrainConfig
from test_identity import CASES

REVIVED = {"jumprelu": {}, "gated": {}, "jumprelu-step-warmup": {"jumprelu_loss": "step"}}  # they read k
LEFT = {"jumprelu-step": {"jumprelu_loss": "step", "topk_warmup_frac": 0.0},  # they do not
        "jumprelu-tanh": {"jumprelu_loss": "tanh", "topk_warmup_frac": 0.0}, "gated-l1": {"gated_loss": "l1"}}


def _cfg(arch: str, trainer: str | None = None, **extra) -> TrainConfig:
    spec = config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0, "arch": arch, **extra}}})
    obj = {k: v for k, v in spec["saes"]["s"].items() if k not in ("train", "val")}
    obj = {**obj, "trainer": trainer or archs.get(arch).trainer, "train_shards": "a" * 64, "val_shards": "a" * 64,
           "tokens": "all"}  # fmt: skip
    return TrainConfig.from_dict(obj, arch)


def test_a_latent_firing_in_fewer_batches_than_the_rare_rate_would_is_dead_for_the_next_window():
    """The verdict at a window's end holds through the next window; a latent that fires on every batch is never
    rare, one silent for the window is dead either way; without a rarity the counter is the silent-window one."""
    rate, batch_size, window = 1e-3, 100, 10
    dead = objectives.DeadLatents(3, window, torch.device("cpu"), rate, batch_size)
    assert dead.rare_steps == pytest.approx(-math.expm1(-batch_size * rate) * window)  # 0.95 of a batch in ten
    often, sometimes, never = [True] * window, [True] + [False] * (window - 1), [False] * window
    for step in range(window):
        assert not dead.dead_s.any()
        dead.update(torch.tensor([often[step], sometimes[step], never[step]]))
    assert dead.dead_s.tolist() == [False, False, True]  # once in ten batches: above 0.95
    for step in range(window):
        dead.update(torch.tensor([True, False, step == 0]))  # latent 2 back once; latent 1 silent from here on
        assert dead.dead_s.tolist() == [False, True, step < window - 1]  # 2 rare until this window's verdict
    assert dead.fired_steps_s.tolist() == [0, 0, 0] and dead.rare_s.tolist() == [False, True, False]
    plain = objectives.DeadLatents(3, window, torch.device("cpu"))
    assert list(plain.state()) == ["since_fired_s"] and plain.rare_steps is None


def test_the_rare_rate_is_the_share_of_the_rate_the_run_targets():
    """RARE_SHARE x k / d_sae per vector, so a run's verdicts follow its k, width and batch size."""
    cfg = _cfg("jumprelu", k=8, batch_size=4096)
    dead = objectives.dead_latents(cfg, archs.get("jumprelu"), 512, 4880, torch.device("cpu"))
    assert dead.dead_steps == 488
    assert dead.rare_steps == pytest.approx(-math.expm1(-4096 * archs.base.RARE_SHARE * 8 / 512) * 488)
    for name, extra in LEFT.items():
        cfg = _cfg(name.split("-")[0], **extra)
        assert objectives.dead_latents(cfg, archs.get(cfg.arch), 512, 4880, torch.device("cpu")).rare_steps is None
    earlier = _cfg("jumprelu", trainer="saeflow-train-4")
    assert objectives.dead_latents(earlier, archs.get("jumprelu"), 512, 4880, torch.device("cpu")).rare_steps is None


def test_the_counter_resumes_where_the_window_stopped_and_splits_by_latent():
    """`state` and `load_state` at a step inside a window continue as the uninterrupted counter, and a latent
    split of a resume state (resume.py, latent shards) slices and joins its tensors."""
    rate, batch_size, window = 1e-3, 100, 4
    torch.manual_seed(0)
    fired = [torch.rand(6) < 0.3 for _ in range(11)]
    whole = objectives.DeadLatents(6, window, torch.device("cpu"), rate, batch_size)
    for fired_s in fired:
        whole.update(fired_s)
    first = objectives.DeadLatents(6, window, torch.device("cpu"), rate, batch_size)
    for fired_s in fired[:6]:
        first.update(fired_s)
    state = {name: t.clone() for name, t in first.state().items()}
    again = objectives.DeadLatents(6, window, torch.device("cpu"), rate, batch_size)
    again.load_state(state, step=6)
    for fired_s in fired[6:]:
        again.update(fired_s)
    assert all(torch.equal(a, b) for a, b in zip(again.state().values(), whole.state().values()))
    assert torch.equal(again.dead_s, whole.dead_s) and again.window_step == whole.window_step == 3
    full = {"sae": {}, "opt": {"state": {}}, "step": 6, **state}
    parts = [resume._latent_slices(full, lo, hi, {}) for lo, hi in ((0, 2), (2, 6))]
    assert parts[1]["rare_s"].shape == (4,) and parts[0]["fired_steps_s"].shape == (2,)
    joined = resume._joined(parts, {})
    assert all(torch.equal(joined[name], state[name]) for name in objectives.STATE_KEYS)


def _value(term: torch.Tensor) -> float:
    return float(term.detach())


@pytest.mark.parametrize("name", sorted(REVIVED))
def test_a_run_that_targets_an_l0_pulls_its_dead_and_rare_latents_up_to_their_thresholds(name):
    """The pre-activation term, REVIVE_COEFF x mean_b sum_s relu(theta - pre) over the dead latents, in the run
    this saeflow makes, with gradient to those latents' encoder columns and none to b_dec (which every latent reads);
    none without dead latents, nor in the run its earlier trainer made (whose terms it keeps)."""
    arch = archs.get(name.split("-")[0])
    cfg = _cfg(arch.name, k=2, **REVIVED[name])
    torch.manual_seed(0)
    sae = SAE(cfg.sae_config(8)).train()
    with torch.no_grad():  # unit decoder rows, the encoder their transpose, b_dec off 0, the thresholds at init
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_dec.normal_()
        arch.init_parameters(sae, cfg)
    xn_bd = torch.randn(32, 8)
    with torch.no_grad():
        pre_bs = sae.pre_acts_normed(xn_bd)
    dead_s = torch.zeros(sae.d_sae, dtype=torch.bool)
    dead_s[:3] = True
    batch = archs.TermInputs(cfg, sae, xn_bd, pre_bs, None, step=5, n_steps=10, dead_s=dead_s)
    theta_s = sae.log_threshold.exp() if arch.name == "jumprelu" else torch.zeros(sae.d_sae)
    want = _value(REVIVE_COEFF * ((theta_s - pre_bs).relu() * sae.W_dec.norm(dim=-1))[:, :3].sum(-1).mean())
    assert want > 0.01  # the dead latents are below their thresholds on most vectors
    assert arch.revives_rare(cfg) and _value(arch.sparsity_terms(batch)["pre_act"]) == pytest.approx(want)
    assert tuple(arch.sparsity_terms(batch)) == tuple(t for t in arch.logged_terms(cfg) if t not in ("mse", "aux"))
    assert _value(arch.sparsity_terms(dataclasses.replace(batch, dead_s=torch.zeros_like(dead_s)))["pre_act"]) == 0
    pull = arch.sparsity_terms(dataclasses.replace(batch, pre_bs=sae.pre_acts_normed(xn_bd)))["pre_act"]
    pull.backward()
    assert float(sae.b_dec.grad.abs().max()) == 0 and float(sae.W_enc.grad[:, :3].abs().sum()) > 0  # not b_dec
    assert float(sae.W_enc.grad[:, 3:].abs().sum()) == 0  # only the dead latents' own columns
    earlier = dataclasses.replace(cfg, trainer="saeflow-train-4")
    old = arch.sparsity_terms(dataclasses.replace(batch, cfg=earlier))
    assert not arch.revives_rare(earlier) and _value(old.get("pre_act", torch.zeros(()))) == 0
    assert "pre_act" not in arch.logged_terms(earlier) or arch.name == "jumprelu"  # JumpReLU has always logged it


def test_runs_the_rarity_does_not_reach_keep_the_id_their_last_trainer_gave_them():
    """A new run records its architecture's trainer now where the rarity reaches it, else the version before
    (saeflow-train-4), so a step or tanh JumpReLU without the warm-up, or an L1 Gated, plans the id it had."""
    for name, extra in {**LEFT, **REVIVED}.items():
        arch = archs.get(name.split("-")[0])
        want = arch.trainer if name in REVIVED else "saeflow-train-4"
        assert arch.trainer_for(_cfg(arch.name, **extra)) == want, name
    assert archs.get("topk").trainer_for(_cfg("topk")) == archs.get("topk").trainer
    spec = {"train": "vit", "layer": 1, "expansion": 2}
    cases = {**{name: {**spec, "arch": name.split("-")[0], **extra} for name, extra in {**LEFT, **REVIVED}.items()}}
    cfg = {**copy.deepcopy(CASES["archs-off-default"]), "saes": cases}
    pinned = copy.deepcopy(cfg)
    for sae in pinned["saes"].values():
        sae["trainer"] = "saeflow-train-4"
    planned = {run.sae_name: run_id for run_id, run in WorkflowPlan.from_config(config.validate(cfg)).runs.items()}
    before = {run.sae_name: run_id for run_id, run in WorkflowPlan.from_config(config.validate(pinned)).runs.items()}
    assert {name for name in cases if planned[name] == before[name]} == set(LEFT)
