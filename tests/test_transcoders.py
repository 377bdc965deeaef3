"""Transcoders and skip transcoders (issue 35): an SAE spec with `target` predicts one activation from another.

The plan: the target's shard hash enters the run config only when set, a target that is not the same examples and
tokens and a `skip` on a plain SAE are refused in one line before any job, and the parallel modes a transcoder does
not train in too. The data: the shuffled loader serves (input, target) pairs that stay paired through shuffles,
epochs and a resumed start, in exactly the order (so the mixing) the input alone gets. The model: every registered
architecture computes a transcoder (d_in -> d_out, separate normalization, optional W_skip), its sae.pt loads, and
an SAE's sae.pt is written as before. Training: every architecture learns a planted output dictionary as a
transcoder; a skip transcoder learns the linear part in W_skip.
"""

import copy

import numpy as np
import pytest
import torch

from builders import write_shards
from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.planning import WorkflowPlan, evaluations
from saeflow.training import archs, objectives
from saeflow.training.loaders import OrderedLoader, PairedOrderedLoader, ShuffledLoader
from saeflow.training.sae import FORMAT_VERSION, SAE, TRANSCODER_VERSION, load_sae, save_sae
from saeflow.training.sweeps import SAEConfig, TrainConfig
from test_identity import RANDOM_GPT2, RANDOM_VIT, ROOTS

ARCH_NAMES = sorted(archs.REGISTRY)
KINDS = {"sae": {}, "transcoder": {}, "skip": {"skip": True}}  # a transcoder's target is 12 wide, its input 16


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------

def _case(**sae) -> dict:
    """A plan-only config: a random ViT's MLP input and output (one forward pass), its residual stream, a text model."""
    return {**ROOTS, "activations": {"in": {**RANDOM_VIT, "hook": "mlp_in"}, "out": {**RANDOM_VIT, "hook": "mlp_out"},
                                     "res": RANDOM_VIT, "text": RANDOM_GPT2},
            "saes": {"tc": {"train": "in", "target": "out", "layer": 1, "expansion": 2, "k": 4, **sae},
                     "plain": {"train": "res", "layer": 1, "expansion": 2, "k": 4}}}  # fmt: skip


def _plan(cfg: dict) -> WorkflowPlan:
    return WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))


def test_a_transcoder_plans_with_its_targets_shard_hash_in_its_run_config_and_only_there():
    plan = _plan(_case(skip=[False, True]))
    by_name = {}
    for run_id, run_plan in plan.runs.items():
        by_name.setdefault(run_plan.sae_name, []).append((run_id, run_plan))
    (plain_id, plain), = by_name["plain"]
    assert {"target", "val_target", "skip"}.isdisjoint(plain.train_config.to_dict())  # an SAE's config as before
    explicit = _plan({**_case(), "saes": {"plain": {"train": "res", "layer": 1, "expansion": 2, "k": 4,
                                                    "target": None, "skip": False}}})  # fmt: skip
    assert list(explicit.runs) == [plain_id]
    (_, off), (_, on) = by_name["tc"]
    assert off.train_config.to_dict()["target"] == plan.shard_hash["out"] == off.train_config.val_target
    assert "skip" not in off.train_config.to_dict() and on.train_config.to_dict()["skip"] is True
    assert off.read_activations == ("in", "in", "out", "out") and off.varying == {"skip": False}
    # the run's per-job config holds its target activation; evaluate plans no splice of a transcoder
    assert set(plan.cli_configs()[plan.cli_config("runs", on.run_id)]["activations"]) == {"in", "out"}
    assert [plan.runs[r].sae_name for r, _ in evaluations(plan)] == ["plain"]
    # another target is another run; the same target in another spec is the same run
    other = _plan({**_case(), "saes": {"tc": {"train": "in", "target": "res", "layer": 1, "expansion": 2, "k": 4}}})
    assert set(other.runs).isdisjoint(plan.runs)


@pytest.mark.parametrize(("sae", "activations", "message"), [
    ({"target": None, "skip": True}, {},
     "saes.tc: skip: the linear skip path is a transcoder's (set target: <activation>); a plain SAE reconstructs its "
     "own input"),
    ({"target": None, "skip": [False, True]}, {}, "saes.tc: skip: the linear skip path is a transcoder's"),
    ({"target": "nope"}, {}, "saes.tc.target: activation 'nope' is not defined"),
    ({"val": "res"}, {}, "saes.tc: val_target: the transcoder validates on 'res'; name the activation it predicts"),
    ({"target": None, "val_target": "out"}, {}, "saes.tc: val_target: a plain SAE has no target"),
    ({"target": "text"}, {}, "saes.tc[0].target: activation 'text' is not the same examples and tokens as 'in'"),
    ({"target": "other"}, {"other": {**RANDOM_VIT, "hook": "mlp_out", "dataset": {**RANDOM_VIT["dataset"], "seed": 1}}},
     "saes.tc[0].target: activation 'other' is not the same examples and tokens as 'in' (their shard metadata differ "
     "in data beyond the hook)"),
    ({"target": "other"}, {"other": {**RANDOM_VIT, "hook": "mlp_out", "layers": [0, 1]}},
     "saes.tc[0].target: activation 'other' is not the same examples and tokens as 'in' (their shard metadata differ "
     "in layers beyond the hook)"),
])  # fmt: skip
def test_a_bad_transcoder_is_refused_at_plan_time_in_one_line(sae, activations, message):
    cfg = _case(**sae)
    cfg["activations"].update(activations)
    with pytest.raises(SaeflowError) as err:
        _plan(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("name", "mode"), [(name, mode) for name in ARCH_NAMES for mode in archs.MODES])
def test_a_mode_a_transcoder_does_not_train_in_is_refused_at_plan_time_in_one_line(name, mode):
    """The registry says in which parallel modes each architecture trains as a transcoder; the plan refuses the
    others before any job (one process trains every architecture as a transcoder)."""
    arch = archs.get(name)
    cfg = {**_case(arch=name), "train": {"parallel": mode, "gpus": 2}}
    modes = [m for m in arch.modes if m in arch.transcoder_modes]
    assert "sweep" in modes and "data" in modes or "data" not in arch.modes
    if mode in modes:
        _plan(cfg)
        return
    with pytest.raises(SaeflowError) as err:
        _plan(cfg)
    assert str(err.value) == (f"saes.tc[0].arch: {name} transcoders do not train with parallel: {mode} (they train "
                              f"with {', '.join(modes)})")  # fmt: skip
    _plan({**cfg, "train": {"parallel": mode, "gpus": 1}})


# ---------------------------------------------------------------------------------------------------------------
# The data: pairs
# ---------------------------------------------------------------------------------------------------------------


def _pair_dirs(root, layers=(0,), cls_token=True, ex_per_shard=7, n_ex=40, d_in=8, d_out=6):
    """An input directory and its target: the target's rows are a known function of the input's (2 x[:6] + 1), so
    any row of a batch says whether it is paired with its own input."""
    T = 5
    x_nltd = np.random.default_rng(0).standard_normal((n_ex, len(layers), T, d_in)).astype(np.float32)
    x_nltd += np.arange(n_ex, dtype=np.float32)[:, None, None, None]  # every row distinct
    y_nltd = 2 * x_nltd[..., :d_out] + 1
    kw = dict(layers=layers, cls_token=cls_token, ex_per_shard=ex_per_shard, tag="pairs")
    return (write_shards(root / "s", x_nltd, **kw),
            write_shards(root / "s", y_nltd, data={"hook": "mlp_out"}, **kw))  # fmt: skip


def _paired(x_bd, y_bd) -> bool:
    return torch.equal(2 * x_bd[:, : y_bd.shape[1]] + 1, y_bd)


@pytest.mark.parametrize("layers", [(0,), (0, 1)], ids=["contiguous", "strided"])
def test_pairs_stay_paired_across_shuffles_epochs_and_resume_and_mix_as_the_input_alone(tmp_path, layers):
    """Paired batches hold the input rows the plain loader gives with a pool of as many rows, in the same order (so
    the same mixing, tests/test_loaders.py), every target row beside its own input, every vector once per epoch; a
    resumed start serves the same batches."""
    x_sd, y_sd = _pair_dirs(tmp_path, layers)
    n_pool, batch_size = 48, 16
    plain = ShuffledLoader(x_sd, 0, batch_size, seed=3, buffer_bytes=n_pool * 8 * 4)
    paired = ShuffledLoader(x_sd, 0, batch_size, seed=3, buffer_bytes=n_pool * (8 + 6) * 4, target_dir=y_sd)
    assert paired.n_pool == plain.n_pool == n_pool
    for epoch in (0, 1):
        seen = []
        batches = list(paired.iter_batches(epoch))
        assert len(batches) == len(plain)
        for (x_bd, y_bd), x_plain in zip(batches, plain.iter_batches(epoch), strict=True):
            assert torch.equal(x_bd, x_plain) and _paired(x_bd, y_bd)
            seen.append(x_bd)
        assert sorted(torch.cat(seen)[:, 0].tolist()) == sorted(torch.cat(list(OrderedLoader(x_sd, 0, 64)))[:, 0]
                                                                .tolist())  # fmt: skip
        resumed = list(paired.iter_batches(epoch, 3))
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(resumed, batches[3:], strict=True))
    assert not torch.equal(batches[0][0], list(paired.iter_batches(0))[0][0])  # the epochs differ
    paired.close()
    plain.close()


def test_the_ordered_pass_pairs_rows_and_misaligned_directories_are_refused_in_one_line(tmp_path):
    x_sd, y_sd = _pair_dirs(tmp_path)
    loader = PairedOrderedLoader(x_sd, y_sd, 0, 16, tokens="content")
    pairs = list(loader)
    assert sum(x.shape[0] for x, _ in pairs) == loader.n_vectors == 40 * 4 and all(_paired(x, y) for x, y in pairs)
    loader.close()
    other_x, other_y = _pair_dirs(tmp_path / "other", ex_per_shard=9)
    for target in (other_y, _pair_dirs(tmp_path / "fewer", n_ex=39)[1]):
        with pytest.raises(SaeflowError) as err:
            ShuffledLoader(x_sd, 0, 16, seed=0, target_dir=target)
        assert "a transcoder's target must hold the same examples, tokens and shards" in str(err.value)
        assert "\n" not in str(err.value)
        with pytest.raises(SaeflowError, match="same examples, tokens and shards"):
            PairedOrderedLoader(x_sd, target, 0, 16)


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


def _train_config(name: str, transcoder: bool = False, **extra) -> TrainConfig:
    """A run config (a transcoder's: with target shard hashes, as plan_runs writes them)."""
    spec = config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0, "arch": name, **extra}}})
    obj = {k: v for k, v in spec["saes"]["s"].items() if k not in ("train", "val", "target", "val_target")}
    obj = {**obj, "trainer": "saeflow-train-3", "train_shards": "a" * 64, "val_shards": "a" * 64, "tokens": "all"}
    if transcoder:
        obj.update(target="b" * 64, val_target="b" * 64)
    return TrainConfig.from_dict(obj, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ARCH_NAMES)
def test_every_architecture_computes_a_transcoder_and_its_loss_reaches_every_parameter(name, kind):
    """Every registered architecture as an SAE, a transcoder (16 -> 12) and a skip transcoder: the declared loss
    terms, every parameter (W_skip too) gets a gradient, the codes are non-negative, the prediction is the documented
    formula, and sae.pt gives back the same function."""
    torch.manual_seed(0)
    cfg = _train_config(name, bool(KINDS[kind]), k=4, aux_k=8, l1_coeff=1.0, **KINDS[kind])
    d_out = 12 if KINDS[kind] else 16
    sae = SAE(cfg.sae_config(16, d_out)).train()
    assert sae.W_dec.shape == (sae.d_sae, d_out) and sae.b_dec.shape == (d_out,)
    with torch.no_grad():
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        if sae.cfg.skip:
            sae.W_skip.normal_(0, 0.1)
        if sae.cfg.transcoder:
            sae.target_scale.fill_(0.5)
        sae.scale.fill_(2.0)
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)  # every latent dead: AuxK runs
    x_bd, y_bd = torch.randn(32, 16), (torch.randn(32, d_out) if sae.cfg.transcoder else None)
    loss = objectives.Objective(cfg, 100)(sae, x_bd, 10, dead, y_bd)
    assert tuple(loss.terms) == archs.get(name).term_names and torch.isfinite(loss.total)
    loss.total.backward()
    for pname, param in sae.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), f"{name}: no gradient reaches {pname}"
    sae.eval()
    y_hat_bd, f_bs = sae(x_bd)
    assert bool((f_bs >= 0).all())
    with torch.no_grad():
        want = f_bs @ sae.W_dec + sae.b_dec
        if sae.cfg.skip:
            want = want + (x_bd * sae.scale) @ sae.W_skip
        torch.testing.assert_close(y_hat_bd, want / sae.out_scale)


def test_sae_pt_keeps_an_saes_format_and_a_transcoder_says_it_is_one(tmp_path):
    """An SAE's sae.pt is written as every earlier saeflow wrote it (version 1, no transcoder keys, so an older saeflow
    still reads it); a transcoder's is version 2 and loads back the same function."""
    for cfg, version in ((SAEConfig(d_model=8, d_sae=16, arch="topk", k=2), FORMAT_VERSION),
                         (SAEConfig(d_model=8, d_sae=16, arch="relu", k=2, d_out=6, skip=True), TRANSCODER_VERSION)):
        sae = SAE(cfg)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in sae.parameters():
                p.normal_()
        save_sae(sae, tmp_path / "sae.pt")
        obj = torch.load(tmp_path / "sae.pt", weights_only=True)
        assert obj["version"] == version
        if version == FORMAT_VERSION:
            assert set(obj["config"]) == {"d_model", "d_sae", "arch", "k", "matryoshka"}
            assert set(obj["state_dict"]) == {"W_enc", "b_enc", "W_dec", "b_dec", "scale", "threshold"}
        back = load_sae(tmp_path / "sae.pt")
        x_bd = torch.randn(4, 8)
        assert back.cfg == cfg and torch.equal(back(x_bd)[0], sae.eval()(x_bd)[0])
        (tmp_path / "sae.pt").unlink()
    with pytest.raises(SaeflowError, match="^skip: the linear skip path is a transcoder's"):
        SAEConfig(d_model=8, d_sae=16, arch="topk", k=2, skip=True)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
