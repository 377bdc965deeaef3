"""The architecture registry (training/archs): one object per architecture, asked by every trainer, stage and format.

Every test here iterates the registry, so a new architecture is covered (or fails) without editing this file:
the registry is the schema's enum; each architecture names the parallel modes it trains in, and the plan refuses
the others in one line before any job runs; its one-process loss has the terms it declares, every parameter gets a
gradient, its codes are non-negative. The modes themselves are checked against one process in
tests/test_distributed.py, over the registry crossed with the modes.
"""

import copy
import dataclasses

import pytest
import torch

from builders import MODE_FREE
from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.planning import WorkflowPlan
from saeflow.training import archs, objectives
from saeflow.training.sae import SAE
from saeflow.training.specs import SAEConfig, TrainConfig
from test_identity import CASES

ARCH_NAMES = sorted(archs.REGISTRY)
PAIRS = [(name, mode) for name in ARCH_NAMES for mode in archs.MODES]


def test_the_registry_is_the_schemas_list_and_every_module_defines_one_architecture():
    assert sorted(archs.NAMES) == ARCH_NAMES
    assert sorted(archs.MODULES) == ARCH_NAMES  # one module per architecture, named after it
    with pytest.raises(SaeflowError, match=r"^arch: unknown SAE architecture 'nope'; choose one of"):
        archs.get("nope")


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_each_architecture_declares_what_the_trainers_ask(name):
    arch = archs.get(name)
    properties = config.def_schema("sae_spec")["properties"]
    assert arch.name == name and set(arch.modes) <= set(archs.MODES) and "sweep" in arch.modes
    assert set(arch.hyper) <= set(properties), f"{name}: hyper-parameters not in the schema"
    assert arch.term_names[0] == "mse" and arch.term_names[-1] == "aux"
    assert isinstance(arch.selection, archs.Selection)


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_each_architecture_names_every_parameters_latent_axis_and_a_shard_holds_its_slice(name):
    """`Arch.latent_axes` lists the SAE's parameters in their order (the Adam state's indices), each with the axis
    that has one entry per latent (None: whole); a latent shard has exactly that slice of each, and `gather_sae`
    puts every shard's parameters back where they were (one process here; 2 ranks in tests/test_distributed.py)."""
    from saeflow.training import resume
    from saeflow.training.ranks import distributed, sharded

    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_model=6, d_sae=10, arch=name, k=2))
    with torch.no_grad():
        for param in sae.parameters():
            param.normal_()
    axes = archs.get(name).latent_axes()
    assert list(axes) == [pname for pname, _ in sae.named_parameters()]
    for pname, param in sae.named_parameters():
        assert (10 not in param.shape) if axes[pname] is None else param.shape[axes[pname]] == 10, pname
    shard = sharded.LatentShard(sae.cfg, 3, 7)
    state = {"sae": sae.state_dict(), "opt": {"state": {}}, "since_fired_s": torch.zeros(10)}
    shard.load_state_dict(resume._latent_slices(state, 3, 7, axes)["sae"])
    assert [pname for pname, _ in shard.named_parameters()] == list(axes)
    for pname, param in shard.named_parameters():
        axis = axes[pname]
        assert torch.equal(param, getattr(sae, pname) if axis is None else getattr(sae, pname).narrow(axis, 3, 4))
    whole = sharded.LatentShard(sae.cfg, 0, 10)
    whole.load_state_dict(sae.state_dict())
    gathered = sharded.gather_sae(whole, distributed.Comm.alone(torch.device("cpu")))
    for pname, tensor in sae.state_dict().items():
        assert torch.equal(gathered.state_dict()[pname], tensor), pname


def _train_config(name: str, **extra) -> TrainConfig:
    spec = config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0, "arch": name, **extra}}})
    obj = {k: v for k, v in spec["saes"]["s"].items() if k not in ("train", "val")}
    obj = {**obj, "trainer": "saeflow-train-3", "train_shards": "a" * 64, "val_shards": "a" * 64, "tokens": "all"}
    return TrainConfig.from_dict(obj, name)


def _random_sae(cfg: TrainConfig, b_enc_std: float = 0.1) -> SAE:
    """An SAE of width 16 in training mode, seeded: unit decoder rows, the encoder their transpose, small encoder
    biases (`b_enc_std`), the architecture's own parameters at their init."""
    torch.manual_seed(0)
    sae = SAE(cfg.sae_config(16)).train()
    with torch.no_grad():
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.normal_(0, b_enc_std)
        sae.arch.init_parameters(sae, cfg)
    return sae


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_each_architectures_loss_has_its_terms_and_reaches_every_parameter(name):
    """One step's loss on one process: the declared terms (AuxK active), finite, every trained parameter gets a
    gradient; codes are non-negative in training and at inference."""
    cfg = _train_config(name, k=4, aux_k=8, l1_coeff=1.0)
    sae = _random_sae(cfg)
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)  # every latent dead: AuxK runs
    x_bd = torch.randn(32, 16)
    loss = objectives.Objective(cfg, 100)(sae, x_bd, 10, dead)
    assert tuple(loss.terms) == archs.get(name).logged_terms(cfg) and torch.isfinite(loss.total)
    loss.total.backward()
    for pname, param in sae.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), f"{name}: no gradient reaches {pname}"
    assert bool((sae.encode(x_bd) >= 0).all())
    assert bool((sae.eval().encode(x_bd) >= 0).all())


def test_relu_trains_at_two_and_a_half_times_the_auto_rate_since_its_trainer_4_and_a_set_lr_is_the_rate():
    """Issue 42: ReLU's `lr: null` is 2.5x `rates.auto_lr` (its L1 codes stayed dense in a short run at 1x); a run made
    by saeflow-train-3 resumes at 1x, an `lr` the user sets is the rate, and every other architecture is at 1x."""
    from saeflow.training import rates

    def new_run(name, **extra):  # as a run planned today records it
        return dataclasses.replace(_train_config(name, **extra), trainer=archs.get(name).trainer)

    auto = rates.auto_lr(1536)
    assert archs.get("relu").trainer == "saeflow-train-4" and rates.peak_lr(new_run("relu"), 1536) == 2.5 * auto
    assert rates.peak_lr(_train_config("relu"), 1536) == auto  # made by saeflow-train-3
    assert rates.peak_lr(new_run("relu", lr=1e-3), 1536) == 1e-3
    assert {rates.peak_lr(new_run(name), 1536) for name in ARCH_NAMES if name != "relu"} == {auto}


def test_topk_jumprelu_and_gated_decoders_train_at_twice_the_rate_in_new_runs_only():
    """Issue 42: the unit decoder rows of TopK (since saeflow-train-5), JumpReLU and Gated (since saeflow-train-4)
    train at DECODER_LR_SCALE x the run's rate, beside each one's own multiples; a run made by an earlier trainer
    resumes with the rates it started with, and no other architecture's decoder is faster."""
    from saeflow.training import rates
    from saeflow.training.archs.base import DECODER_LR_SCALE, made_since

    def scales(name, trainer):
        cfg = dataclasses.replace(_train_config(name, k=4), trainer=trainer)
        sae = SAE(cfg.sae_config(16))
        return dict(zip((n for n, _ in sae.named_parameters()), rates.lr_scales(sae, cfg)))

    fast = {"topk": "saeflow-train-5", "jumprelu": "saeflow-train-4", "gated": "saeflow-train-4"}
    assert DECODER_LR_SCALE == 2.0
    for name in ARCH_NAMES:
        now = scales(name, archs.get(name).trainer)
        assert now["W_dec"] == (DECODER_LR_SCALE if name in fast else 1.0), (name, now)
        assert now["W_enc"] == 1.0 and now["b_dec"] == 1.0, (name, now)
        for trainer in archs.get(name).earlier_trainers:
            then = dataclasses.replace(_train_config(name), trainer=trainer)
            fast_then = name in fast and made_since(then, fast[name])
            assert scales(name, trainer)["W_dec"] == (DECODER_LR_SCALE if fast_then else 1.0), (name, trainer)
    assert scales("jumprelu", "saeflow-train-3")["W_dec"] == scales("gated", "saeflow-train-3")["W_dec"] == 1.0
    assert archs.get("topk").trainer == fast["topk"] and scales("topk", "saeflow-train-4")["W_dec"] == 1.0
    assert scales("jumprelu", "saeflow-train-4")["log_threshold"] == 4.0  # its own multiple kept
    assert scales("gated", "saeflow-train-4")["b_enc"] == 4.0


@pytest.mark.parametrize(("name", "mode"), PAIRS)
def test_a_mode_an_architecture_does_not_train_in_is_refused_at_plan_time_in_one_line(name, mode, monkeypatch):
    """Each architecture plans in the modes it names; without `mode` (as an architecture that lacks it) the plan
    refuses the pairing in one line, and one process (gpus: 1) trains it whatever the mode says."""
    spec = {"train": "vit", "layer": 1, "arch": name, "expansion": 2, **MODE_FREE}
    cfg = {**CASES["archs-off-default"], "saes": {"s": spec}, "train": {"parallel": mode, "gpus": 2}}
    if mode in archs.get(name).modes:
        WorkflowPlan.from_config(config.validate(cfg))
    monkeypatch.setattr(archs.get(name), "modes", tuple(m for m in archs.get(name).modes if m != mode))
    with pytest.raises(SaeflowError) as err:
        WorkflowPlan.from_config(config.validate(cfg))
    assert str(err.value) == (f"saes.s.arch: {name} SAEs do not train with parallel: {mode} (they train with "
                              f"{', '.join(archs.get(name).modes)})")  # fmt: skip
    WorkflowPlan.from_config(config.validate({**cfg, "train": {"parallel": mode, "gpus": 1}}))  # one process: any


@pytest.mark.parametrize(("name", "loss_key", "others"), [("jumprelu", "jumprelu_loss", "step or tanh"),
                                                           ("gated", "gated_loss", "l1")])  # fmt: skip
def test_the_topk_warmup_and_target_loss_are_refused_on_latent_shards_at_plan_time_in_one_line(name, loss_key, others):
    """The warm-up picks each vector's k largest latents, which no latent shard holds; data and sweep split no
    vector's latents, and one process trains it whatever the mode. JumpReLU's and Gated's defaults both do."""
    spec = {"train": "vit", "layer": 1, "arch": name, "expansion": 2}
    cfg = {**CASES["archs-off-default"], "saes": {"s": spec}, "train": {"parallel": "latents", "gpus": 2}}
    with pytest.raises(SaeflowError) as err:
        WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    assert str(err.value) == (f"saes.s.arch: {name}'s TopK warm-up (topk_warmup_frac 0.75) picks each vector's k "
                              "largest of every latent, which a latent shard does not hold, so it does not train with "
                              "parallel: latents (set topk_warmup_frac: 0 for it, or parallel: sweep or data)")
    for settings in ({"parallel": "data", "gpus": 2}, {"parallel": "sweep", "gpus": 2}, {"parallel": "latents"}):
        WorkflowPlan.from_config(config.validate(copy.deepcopy({**cfg, "train": settings})))
    spec.update(topk_warmup_frac=0.0)  # the target loss, its default, refuses them too
    with pytest.raises(SaeflowError, match=rf"^saes\.s\.arch: {name}'s target loss steers each vector's L0 over every "
                                           rf"latent, .* \(set {loss_key}: {others} for it, or parallel: sweep "
                                           r"or data\)$"):  # fmt: skip
        WorkflowPlan.from_config(config.validate(copy.deepcopy(cfg)))
    WorkflowPlan.from_config(config.validate({**cfg, "saes": {"s": {**spec, **MODE_FREE}}}))


def test_the_sae_config_checks_k_only_for_architectures_that_use_it():
    for name in ARCH_NAMES:
        if archs.get(name).uses_k:
            with pytest.raises(SaeflowError, match=rf"^k: k=9 must be in \[1, d_sae=8\] for {name}$"):
                SAEConfig(d_model=4, d_sae=8, arch=name, k=9)
        else:
            SAEConfig(d_model=4, d_sae=8, arch=name, k=9)


@pytest.mark.parametrize(("arch", "key", "value", "problem"), [
    ("jumprelu", "bandwidth", -0.1, "bandwidth: the straight-through kernel's width must be positive, got -0.1"),
    ("jumprelu", "bandwidth", 0.0, "bandwidth: the straight-through kernel's width must be positive, got 0.0"),
    ("jumprelu", "threshold_init", 0.0, "threshold_init: JumpReLU thresholds are positive (a log parameter), got 0.0"),
    ("jumprelu", "threshold_init", -1.0,
     "threshold_init: JumpReLU thresholds are positive (a log parameter), got -1.0"),
    ("jumprelu", "threshold_lr_scale", 0.0,
     "threshold_lr_scale: the thresholds' learning-rate multiple must be positive, got 0.0"),
    ("gated", "gate_bias_lr_scale", -2.0,
     "gate_bias_lr_scale: the gate bias's learning-rate multiple must be positive, got -2.0"),
])  # fmt: skip
def test_bad_jumprelu_and_gated_hyper_parameters_are_refused_at_plan_time_in_one_line(arch, key, value, problem):
    cfg = {**CASES["archs-off-default"], "saes": {"j": {"train": "vit", "layer": 1, "arch": arch, key: value}}}
    with pytest.raises(SaeflowError) as err:
        WorkflowPlan.from_config(config.validate(cfg))
    assert str(err.value) == f"saes.j.{problem}"  # not swept: no sweep index (issue 40)
    cfg["saes"]["j"]["arch"] = "topk"  # keys an architecture does not read are not its to refuse
    WorkflowPlan.from_config(config.validate(cfg))


def test_every_architecture_trains_and_runs_every_stage_from_the_cli(tmp_path):
    """`saeflow train`, `inference`, `visuals`, `probe` (a class per example), `stability` (two seeds) and `summary`
    (the table and the Pareto plot) on a run of every registered architecture: the stages go through the SAE's
    encode and decode, whatever the architecture. L0 is reported as a mean with its spread: JumpReLU's varies per
    token. (The splice evaluation: the next test.)"""
    import csv
    import io
    import json

    import numpy as np

    from builders import planted_data, run_from_sae_spec, write_shards
    from saeflow import cli

    x_nd, _ = planted_data(512, d_model=16, n_atoms=32, k=2, seed=3)
    classes_n = np.random.default_rng(0).integers(0, 3, 64).astype(np.int32)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=16, tag="archs",
                      aux={"classes.bin": classes_n}, data={"classes": ["a", "b", "c"]})  # fmt: skip
    roots = {}
    for name in ARCH_NAMES:
        for seed in (1, 0):  # the seed-0 run goes on to visuals and probe
            run = run_from_sae_spec(tmp_path / "runs", sd, arch=name, k=2, expansion=2, batch_size=64, seed=seed)
            roots[name, seed] = run.root
            assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 0
            assert cli.main(["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "2"]) == 0
        assert cli.main(["visuals", "--run", str(run.root), "--n-latents", "2", "--top-k", "2"]) == 0
        assert (run.dump(sd.hash).visuals_dpath / "l0_hist.png").read_bytes()[:4] == b"\x89PNG"
        assert cli.main(["probe", "--run", str(run.root), "--ks", "1", "2"]) == 0
        probed = json.loads(run.probe_fpath(sd.hash).read_text())
        assert probed["metrics"]["n_probed"] == 3 and 0 <= probed["metrics"]["sparse_k1_accuracy"] <= 1, name
        out = tmp_path / f"{name}.json"
        pair = [a for seed in (0, 1) for a in ("--run", str(roots[name, seed]))]
        assert cli.main(["stability", *pair, "--out", str(out)]) == 0
    assert cli.main(["summary", *(f"--run={r}" for r in roots.values()), "--out", str(tmp_path / "summary")]) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary" / "summary.csv").read_text())))
    assert sorted({r["config.arch"] for r in rows}) == ARCH_NAMES
    assert all(0 < float(r["l0"]) < 32 and float(r["nmse"]) < 1.0 for r in rows), rows
    assert all(float(r["l0_p10"]) <= float(r["l0"]) <= float(r["l0_p90"]) for r in rows), rows
    assert all(float(r["l0_std"]) > 0 for r in rows if r["config.arch"] == "jumprelu"), rows  # varies per token
    assert (tmp_path / "summary" / "pareto.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_every_architecture_trains_through_the_workflow_in_the_modes_it_declares(tmp_path):
    """Snakemake plans and trains a run of every registered architecture (`--until train`, one process: every
    architecture trains there); on 2 ranks each plans in the modes it declares, and Snakemake stops in one line
    before any job at a mode an architecture does not declare (matching pursuit's `latents`)."""
    from saeflow.store.runs import open_run
    from workflow_helpers import snakemake, tiny_config, write_config

    cfg = tiny_config(n_ex=8, k=(4,))
    cfg["saes"] = {name: {**cfg["saes"]["topk"], "arch": name, "k": 4} for name in ARCH_NAMES}
    snakemake(tmp_path, write_config(tmp_path, cfg), "--until", "train")
    plan = WorkflowPlan.from_config(config.validate(cfg))
    trained = {run.sae_name: open_run(tmp_path / "runs" / run_id) for run_id, run in plan.runs.items()}
    assert sorted(trained) == ARCH_NAMES and all(run.sae_fpath.exists() for run in trained.values())
    for mode in archs.MODES:
        claim = {name: {**cfg["saes"][name], **MODE_FREE} for name in archs.names(mode=mode)}
        ranks = {**cfg, "saes": claim, "train": {"gpus": 2, "parallel": mode}}
        snakemake(tmp_path, write_config(tmp_path, ranks, "ranks.yaml"), "-n")
        for name in sorted(set(ARCH_NAMES) - set(claim)):
            one = {**ranks, "saes": {name: cfg["saes"][name]}}
            proc = snakemake(tmp_path, write_config(tmp_path, one, "ranks.yaml"), "-n", check=False)
            want = (f"saes.{name}.arch: {name} SAEs do not train with parallel: {mode} (they train with "
                    f"{', '.join(archs.get(name).modes)})")  # fmt: skip
            assert proc.returncode != 0 and want in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_every_architecture_is_spliced_into_its_model_by_saeflow_evaluate(tmp_path):
    """`saeflow evaluate` on a run of every registered architecture trained on a tiny random GPT-2's activations: the
    splice goes through the SAE's encode and decode, so every architecture gets finite CE and KL figures, and the
    summary carries them (`eval.*`) beside the Pareto plot's splice panel."""
    import csv
    import io
    import json
    import math

    import yaml

    from builders import run_from_sae_spec, text_spec, typed
    from saeflow import cli
    from saeflow.extraction import extract
    from saeflow.store.shards import ShardDir

    spec = text_spec("gpt2", layers=[1], dataset={"kind": "builtin_text", "n_ex": 12})
    sd = ShardDir(extract.extract(typed(spec), tmp_path / "shards", progress=False).dpath)
    config_fpath = tmp_path / "val.yaml"
    config_fpath.write_text(yaml.safe_dump({"activations": {"val": spec}}))
    roots = []
    for name in ARCH_NAMES:
        run = run_from_sae_spec(tmp_path / "runs", sd, arch=name, layer=1, k=4, expansion=2, batch_size=16)
        roots.append(run.root)
        assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) == 0
        assert cli.main(["inference", "--run", str(run.root), "--shards", str(sd.dpath)]) == 0
        assert cli.main(["evaluate", "--run", str(run.root), str(config_fpath), "--n-tokens", "64", "--batch-size",
                         "4", "--no-progress", "--device", "cpu"]) == 0  # fmt: skip
        got = json.loads(run.evaluation_fpath(sd.hash).read_text())["metrics"]
        assert all(math.isfinite(got[key]) for key in ("ce_spliced", "kl_spliced", "ce_loss_recovered")), (name, got)
        assert got["n_scored_spliced"] > 0, name
    assert cli.main(["summary", *(f"--run={r}" for r in roots), "--out", str(tmp_path / "summary")]) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary" / "summary.csv").read_text())))
    assert sorted(r["config.arch"] for r in rows) == ARCH_NAMES and all(r["eval.ce_loss_recovered"] for r in rows)


def test_jumprelu_thresholds_learn_from_the_reconstruction_through_the_straight_through_estimator():
    """With no sparsity term, the reconstruction alone moves each threshold by SAELens's estimator:
    dL/dtheta_s = -sum_b (theta_s / bandwidth) rect((pre - theta_s) / bandwidth) dL/df (and log_threshold by theta x
    that); a plain step would give the thresholds no gradient at all."""
    torch.manual_seed(0)
    cfg = _train_config("jumprelu", jumprelu_loss="step", l0_coeff=0.0, aux_alpha=0.0, bandwidth=0.5,
                        threshold_init=0.3, topk_warmup_frac=0.0)
    sae = SAE(cfg.sae_config(8)).train()
    with torch.no_grad():
        sae.W_dec.normal_()
        sae.normalize_decoder()
        sae.W_enc.copy_(sae.W_dec.T)
        archs.get("jumprelu").init_parameters(sae, cfg)
    x_bd = torch.randn(64, 8)
    dead = objectives.DeadLatents(sae.d_sae, 10**9, torch.device("cpu"))
    objectives.Objective(cfg, 100)(sae, x_bd, 50, dead).total.backward()
    with torch.no_grad():
        pre_bs = sae.pre_acts_normed(x_bd)
        theta_s = sae.log_threshold.exp()
    f_bs = (pre_bs * (pre_bs > theta_s)).requires_grad_()
    (f_bs @ sae.W_dec.detach() + sae.b_dec.detach() - x_bd).square().sum(-1).mean().backward()
    rect_bs = (((pre_bs - theta_s) / 0.5).abs() < 0.5).float()
    want_s = theta_s * -(theta_s / 0.5 * rect_bs * f_bs.grad).sum(0)
    assert bool(want_s.abs().sum() > 0)
    torch.testing.assert_close(sae.log_threshold.grad, want_s, rtol=1e-4, atol=1e-6)


def _ranks_reduce(n_ranks: int):
    """`n_ranks` threads' `Arch.after_step` reduction (elementwise over the threads, as the ranks' all-reduce)."""
    import threading

    barrier, slots, lock = threading.Barrier(n_ranks), {}, threading.Lock()
    ops = {"sum": lambda ts: sum(ts[1:], ts[0]), "min": lambda ts: torch.stack(ts).amin(0),
           "max": lambda ts: torch.stack(ts).amax(0)}  # fmt: skip

    def reduce(t, op):
        with lock:
            slots[threading.get_ident()] = t.clone()
        barrier.wait()
        out = ops[op]([slots[key] for key in sorted(slots)])
        barrier.wait()
        return out

    return reduce


def test_jumprelus_topk_warmup_calibration_fires_each_latent_as_often_as_topk_kept_it_on_any_split():
    """A warm-up step's thresholds (`calibrated_thresholds`) fire each latent on no more of the batch's vectors than
    TopK kept it on, and 0.1% lower would fire it on at least as many; the batch split over 3 ranks (an empty slice
    among them) finds the same bytes."""
    from saeflow.training.archs import jumprelu

    pre_bs = torch.randn(96, 40, generator=torch.Generator().manual_seed(0)) + 1.5
    pre_bs[:, 0] -= 3  # a latent TopK never keeps: its threshold is above all of its pre-activations
    keep_bs = torch.zeros_like(pre_bs).scatter_(1, pre_bs.topk(5, dim=-1).indices, 1.0)
    count_s = keep_bs.sum(0)
    theta_s = jumprelu.calibrated_thresholds(pre_bs, count_s, objectives.one_process)
    free_s = theta_s > jumprelu.MIN_THRESHOLD  # not held at the floor
    assert bool(free_s.all()) and bool((count_s > 0).any()) and bool((count_s == 0).any())
    assert bool(((pre_bs > theta_s).sum(0) <= count_s).all())
    assert bool(((pre_bs > theta_s * 0.999).sum(0) >= count_s).all())
    import concurrent.futures

    reduce, parts = _ranks_reduce(3), (slice(0, 40), slice(40, 40), slice(40, 96))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        split = list(pool.map(lambda rows: jumprelu.calibrated_thresholds(pre_bs[rows], keep_bs[rows].sum(0), reduce),
                              parts))  # fmt: skip
    assert all(torch.equal(theta, theta_s) for theta in split)


def _one_step_gradients(name: str, extra: dict, mode: str) -> dict:
    """On each rank: one step's gradients of every parameter in `mode` (data: this rank's slice of the batch,
    all-reduced; latents: this rank's latents, b_dec's all-reduced) and on one process (the whole batch), from the
    same weights, batch and dead latents (AuxK on); the worst relative difference of each parameter."""
    import copy
    import types

    from saeflow.training import resume
    from saeflow.training.ranks import distributed, sharded
    from saeflow.training.ranks.dataparallel import data_parallel_loss, rank_slice

    comm = distributed.init("cpu")
    cfg = _train_config(name, k=4, aux_k=8, expansion=4, **extra)
    sae = _random_sae(cfg)
    x_bd = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)) * 2
    dead = objectives.DeadLatents(sae.d_sae, 2, torch.device("cpu"))
    dead.since_fired_s[::3] = 5  # a third of the latents dead: AuxK (and JumpReLU's pre-activation loss) run
    whole = copy.deepcopy(sae)
    objectives.Objective(cfg, 100)(whole, x_bd, 90, dead).total.backward()  # past the TopK warm-up
    axes = sae.arch.latent_axes()
    lo, hi = 0, sae.d_sae
    if mode == "data":
        part = rank_slice(32, comm)
        data_parallel_loss(objectives.Objective(cfg, 100), sae, x_bd[part], 32, 90, dead, comm).total.backward()
        model = sae
    else:
        bounds = sharded.latent_bounds(sae.d_sae, comm.world_size)
        lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
        model = sharded.LatentShard(sae.cfg, lo, hi)
        state = {"sae": sae.state_dict(), "opt": {"state": {}}, "since_fired_s": dead.since_fired_s}
        model.load_state_dict(resume._latent_slices(state, lo, hi, axes)["sae"])
        shard_dead = objectives.DeadLatents(hi - lo, 2, torch.device("cpu"))
        shard_dead.since_fired_s.copy_(dead.since_fired_s[lo:hi])
        trainer = types.SimpleNamespace(sae=model, comm=comm, cfg=cfg, dead=shard_dead, step=90, n_steps=100)
        sharded.sharded_loss(trainer, x_bd).total.backward()
    worst = {}
    for (pname, param), want in zip(model.named_parameters(), whole.parameters(), strict=True):
        got = param.grad if axes[pname] is not None and mode == "latents" else comm.all_reduce(param.grad)
        want_grad = want.grad if axes[pname] is None else want.grad.narrow(axes[pname], lo, hi - lo)
        worst[pname] = float((got - want_grad).abs().max() / want_grad.abs().max().clamp_min(1e-12))
    comm.close()
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(("name", "extra", "mode"), [
    *((n, {}, mode) for n in ARCH_NAMES for mode in ("data", "latents") if mode in archs.get(n).modes
      and not (n in ("jumprelu", "gated") and mode == "latents")),
    *(("jumprelu", {"jumprelu_loss": loss, "topk_warmup_frac": 0.0}, mode) for loss in ("step", "tanh")
      for mode in ("data", "latents")),
    *(("gated", {"gated_loss": "l1"}, mode) for mode in ("data", "latents")),
    ("jumprelu", {"topk_warmup_frac": 0.95}, "data")])  # fmt: skip
def test_one_data_parallel_or_latent_sharded_step_has_the_one_process_gradients(name, extra, mode):
    """Every architecture in each of `data` and `latents` it trains in: the gradients of 2 ranks (data: the
    all-reduced gradients of their slices; latents: each rank's latents, b_dec's all-reduced) equal one process's on
    the whole batch (1e-5 relative, every parameter), with AuxK and every sparsity term on; every loss for JumpReLU
    and Gated (their default, the target loss, in data: latent shards refuse it), and JumpReLU's TopK warm-up, so
    each term's share of a slice or of the latents is right. (Multi-step runs of JumpReLU part across summation
    orders: tests/test_distributed.py.)"""
    from _ranks import run_ranks

    for worst in run_ranks(2, _one_step_gradients, name, extra, mode):
        assert max(worst.values()) < 1e-5, worst


def _train_refusal(run_root, mode: str) -> str | None:
    """On each rank: `saeflow train`'s entry on the ranks in `mode`; the one-line refusal, or None when it trains."""
    from saeflow.training import entry

    try:
        entry.train_runs([run_root], entry.TrainSettings(device="cpu", parallel=mode, buffer_bytes="19200"))
    except SaeflowError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), [pair for pair in PAIRS if pair[1] != "sweep"])
def test_saeflow_train_on_the_ranks_refuses_a_mode_the_architecture_does_not_train_in(tmp_path, name, mode,
                                                                                        monkeypatch):  # fmt: skip
    """Without the workflow's plan (`saeflow train --gpus 2 --parallel MODE`), an architecture that lacks the mode
    (here: the mode taken from its `modes`; the ranks are forked, so they see it) is refused on every rank in one
    line before a step, and nothing is written."""
    from _ranks import run_ranks
    from builders import planted_data, run_from_sae_spec, write_shards

    monkeypatch.setattr(archs.get(name), "modes", tuple(m for m in archs.get(name).modes if m != mode))
    x_nd, _ = planted_data(256, d_model=16, n_atoms=32, k=2, seed=3)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=16, tag="refusal")
    run = run_from_sae_spec(tmp_path / "runs", sd, arch=name, expansion=2, batch_size=64)
    want = f"{run.config_fpath}: arch: {name} SAEs do not train with parallel: {mode} (they train with "
    for message in run_ranks(2, _train_refusal, run.root, mode):
        assert message is not None and message.startswith(want) and "\n" not in message, message
    assert not run.sae_fpath.exists() and not run.resume_fpath.exists()
