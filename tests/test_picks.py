"""The k-sparse paths: the picks-only encoder gradient (training/picks.py), the trainer version it bumped, and
inference from the picks.

The gradient is autograd's up to rounding, with either backward kernel, for SAEs and transcoders, repeated picks
included; a TopK run made by saeflow-train-3 resumes with the dense autograd gradient it started with; a trainer no
architecture computes is refused in one line; inference from the picks writes the dense codes' CSR entries.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from builders import planted_data, run_from_sae_spec, write_shards
from saeflow import cli
from saeflow.analysis import inference
from saeflow.store import runs, shards
from saeflow.training import archs, objectives, picks, train
from saeflow.training.archs.base import FIRST_TRAINER
from saeflow.training.sae import SAE, load_sae
from saeflow.training.specs import SAEConfig


def _random_model(transcoder: bool, arch: str = "topk") -> SAE:
    cfg = SAEConfig(d_model=24, d_sae=96, arch=arch, k=4, d_out=20 if transcoder else None)
    model = SAE(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def _param_grads(model: SAE) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _grads(model: SAE, xn_bd: torch.Tensor, ids_bn: torch.Tensor, r_bn: torch.Tensor, picked: bool) -> tuple:
    model.zero_grad(set_to_none=True)
    pre = picks.PreActs(model, xn_bd, picked=picked)
    out_bn = pre.gather(ids_bn)
    (out_bn * r_bn).sum().backward()
    return out_bn.detach(), _param_grads(model)


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
@pytest.mark.parametrize("kernel", ["sparse", "dense"])
def test_the_picked_gradient_is_autograds(transcoder, kernel, monkeypatch):
    model = _random_model(transcoder)
    gen = torch.Generator().manual_seed(1)
    xn_bd = torch.randn(32, 24, generator=gen)
    ids_bn = torch.randint(0, 96, (32, 7), generator=gen)
    ids_bn[:, 6] = ids_bn[:, 0]  # a latent picked twice in a row (TopK's pick that is also AuxK's): its terms add
    r_bn = torch.randn(32, 7, generator=gen)
    monkeypatch.setattr(picks, "sparse_picks", lambda *_: kernel == "sparse")
    want_bn, want = _grads(model, xn_bd, ids_bn, r_bn, picked=False)
    got_bn, got = _grads(model, xn_bd, ids_bn, r_bn, picked=True)
    assert torch.equal(got_bn, want_bn)  # the forward values are autograd's, bit for bit
    assert sorted(got) == sorted(want) == (["W_enc", "b_enc"] if transcoder else ["W_enc", "b_dec", "b_enc"])
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
@pytest.mark.parametrize("kernel", ["sparse", "dense"])
def test_the_gradient_of_entries_a_varying_number_per_vector_is_autograds(transcoder, kernel, monkeypatch):
    """BatchTopK's CSR picks (`PreActs.gather_entries`): rows of 0 to 96 entries, one row of none."""
    model = _random_model(transcoder)
    gen = torch.Generator().manual_seed(2)
    xn_bd = torch.randn(32, 24, generator=gen)
    keep_bs = torch.rand(32, 96, generator=gen) < torch.linspace(0, 1, 32)[:, None] ** 3
    keep_bs[5] = False
    monkeypatch.setattr(picks, "sparse_picks", lambda *_: kernel == "sparse")
    results = []
    for picked in (False, True):
        model.zero_grad(set_to_none=True)
        vals_n, cols_n, offsets_b = picks.PreActs(model, xn_bd, picked=picked).gather_entries(keep_bs)
        (vals_n * torch.linspace(-1, 2, vals_n.numel())).sum().backward()
        grads = _param_grads(model)
        results.append((vals_n.detach(), cols_n, offsets_b, grads))
    (want_n, want_cols, want_offsets, want), (got_n, got_cols, got_offsets, got) = results
    rows_n, cols_n = keep_bs.nonzero().unbind(1)
    assert torch.equal(got_cols, cols_n) and torch.equal(want_cols, cols_n)  # row by row, as stored
    counts_b = keep_bs.sum(1)
    assert torch.equal(got_offsets, counts_b.cumsum(0) - counts_b) and torch.equal(got_offsets, want_offsets)
    assert torch.equal(got_n, want_n) and torch.equal(got_n, model.pre_acts_normed(xn_bd).detach()[rows_n, cols_n])
    assert sorted(got) == sorted(want) == (["W_enc", "b_enc"] if transcoder else ["W_enc", "b_dec", "b_enc"])
    for name in want:  # sums of up to 96 terms of unit scale each: compared relative to their size
        assert float((got[name] - want[name]).norm() / want[name].norm()) < 1e-6, name


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
def test_batchtopk_from_its_picks_is_its_dense_codes_loss_and_gradient(transcoder):
    """One training batch of BatchTopK (and AuxK) as saeflow-train-4 computes it, from CSR picks, against the dense
    codes of saeflow-train-3: the same kept entries and reconstruction, the gradients within rounding."""
    model = _random_model(transcoder, arch="batchtopk").train()
    gen = torch.Generator().manual_seed(3)
    xn_bd = torch.randn(32, 24, generator=gen)
    aux_ids_bk = torch.randint(0, 96, (32, 3), generator=gen)
    out = []
    for trainer in (FIRST_TRAINER, archs.get("batchtopk").trainer):
        model.zero_grad(set_to_none=True)
        cfg = type("Cfg", (), {"trainer": trainer})()
        pre = objectives.pre_acts(cfg, model, xn_bd)
        codes, aux_pre_bk = objectives.encode(model, xn_bd, pre, aux_ids_bk)
        x_hat_bd = codes.decode(model)
        ((x_hat_bd - 0.5).square().sum() + aux_pre_bk.square().sum()).backward()
        grads = _param_grads(model)
        out.append((pre.picked, codes, x_hat_bd.detach(), grads))
    (dense_picked, dense, want_bd, want), (picked, sparse, got_bd, got) = out
    assert not dense_picked and picked and sparse.f_bs is None and dense.f_bs is not None
    assert sparse.l0() == dense.l0() and torch.equal(sparse.fired_s(), dense.fired_s())
    kept = dense.activations()
    assert torch.equal(sparse.activations()[sparse.activations() > 0].sort().values, kept[kept > 0].sort().values)
    assert torch.allclose(got_bd, want_bd, rtol=1e-5, atol=1e-5)
    assert sorted(got) == sorted(want)
    for name in want:
        assert float((got[name] - want[name]).norm() / want[name].norm()) < 1e-6, name


def test_the_crossover_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert picks.sparse_picks(32, 12288, cpu) and picks.sparse_picks(64, 65536, cpu)
    assert not picks.sparse_picks(128, 2048, cpu)  # 1/16 of the latents: the dense backward is faster
    assert not picks.sparse_picks(32, 12288, cuda)  # not measured on a GPU: the dense one


def _run_at(tmp_path, name: str, trainer: str, arch: str = "topk") -> runs.Run:
    """A TopK (or BatchTopK) run (256 latents of d 16, k 2: a picks share the sparse backward takes) whose config
    says `trainer`."""
    sd = shards.ShardDir(next((tmp_path / "shards").glob("*"))) if (tmp_path / "shards").exists() else None
    if sd is None:
        x_nd, _ = planted_data(2048, d_model=16, n_atoms=32, k=2, seed=1)
        sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=64, tag="picks")
    planned = run_from_sae_spec(tmp_path / "planned" / name, sd, arch=arch, k=2, expansion=16, aux_k=2,
                                batch_size=32, n_epochs=1, dead_after_vectors=256)  # fmt: skip
    config = {**planned.config(), "trainer": trainer}
    return runs.create_run(tmp_path / name, config, sd.dpath, sd.dpath)


def _count_picked(monkeypatch) -> list:
    calls = []
    for function in (picks._PickedPreActs, picks._PickedEntries):
        monkeypatch.setattr(function, "apply", lambda *a, apply=function.apply: calls.append(1) or apply(*a))
    return calls


@pytest.mark.parametrize("arch", ["topk", "batchtopk"])
def test_a_run_of_the_first_trainer_resumes_with_the_dense_gradient_it_started_with(tmp_path, monkeypatch, arch):
    topk = archs.get(arch)
    assert topk.trainer != FIRST_TRAINER and FIRST_TRAINER in topk.earlier_trainers
    calls = _count_picked(monkeypatch)
    whole = _run_at(tmp_path, "whole", FIRST_TRAINER, arch)
    train.train_runs([whole.root], train.TrainSettings(device="cpu"))
    assert not calls  # autograd's dense gradient, the maths saeflow-train-3 trained with
    stopped = _run_at(tmp_path, "stopped", FIRST_TRAINER, arch)
    assert stopped.root.name == whole.root.name  # one run id: the same run
    train.train_runs([stopped.root], train.TrainSettings(device="cpu", max_steps=20))
    train.train_runs([stopped.root], train.TrainSettings(device="cpu"))
    assert not calls
    want, got = load_sae(whole.sae_fpath).state_dict(), load_sae(stopped.sae_fpath).state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)
    # the picks' trainer (TopK's since moved on, to its faster decoder): another run id, the picked gradient
    now = _run_at(tmp_path, "now", objectives.PICKS_SINCE, arch)
    assert now.root.name != whole.root.name
    train.train_runs([now.root], train.TrainSettings(device="cpu"))
    assert calls
    moved = load_sae(now.sae_fpath).state_dict()
    assert not torch.equal(moved["W_enc"], want["W_enc"])  # other roundings ...
    rel = (moved["W_dec"] - want["W_dec"]).norm() / want["W_dec"].norm()
    assert rel < 0.1, float(rel)  # ... of the same maths
    if topk.trainer != objectives.PICKS_SINCE:  # a later trainer keeps the picks (archs.made_since)
        calls.clear()
        train.train_runs([_run_at(tmp_path, "latest", topk.trainer, arch).root], train.TrainSettings(device="cpu"))
        assert calls


def test_a_trainer_that_no_architecture_computes_is_refused_in_one_line(tmp_path, capsys):
    run = _run_at(tmp_path, "old", "saeflow-train-2")
    assert cli.main(["train", "--run", str(run.root), "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "saeflow-train-2" in err[0] and "config.json" in err[0], err
    assert not run.sae_fpath.exists() and json.loads(run.config_fpath.read_text())["trainer"] == "saeflow-train-2"


def test_objective_reads_topk_through_its_picks_only_in_a_run_of_todays_trainer():
    model = _random_model(False)
    xn_bd = torch.randn(4, 24)
    cfg = type("Cfg", (), {"trainer": archs.get("topk").trainer})()
    assert objectives.pre_acts(cfg, model, xn_bd).picked
    cfg.trainer = FIRST_TRAINER
    assert not objectives.pre_acts(cfg, model, xn_bd).picked


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
def test_inference_from_the_picks_writes_the_dense_paths_entries(transcoder):
    """`inference.encode_entries` of TopK codes (decoded from the picks, never dense) gives the CSR entries of the
    dense codes bit for bit, zeros among the picks left out, and their prediction up to rounding."""
    model = _random_model(transcoder)
    with torch.no_grad():
        model.W_enc.mul_(0.3)
        model.b_enc[:] = -3.0  # most pre-activations negative: some rows have fewer than k positive picks
    x_bd = torch.randn(64, 24, generator=torch.Generator().manual_seed(2))
    x_hat_bd, (rows_n, cols_n, vals_n) = inference.encode_entries(model, x_bd)
    with torch.no_grad():
        want_bd, f_bs = model(x_bd)
    f_np = f_bs.numpy()
    want_rows, want_cols = np.nonzero(f_np)
    assert (np.bincount(want_rows, minlength=64) < 4).any()
    assert np.array_equal(rows_n, want_rows) and np.array_equal(cols_n, want_cols)
    assert np.array_equal(vals_n, f_np[want_rows, want_cols])
    assert torch.allclose(x_hat_bd, want_bd, rtol=1e-5, atol=1e-5)


def test_inference_of_codes_that_are_not_k_sparse_reads_them_dense():
    assert [name for name in archs.REGISTRY if archs.get(name).k_sparse] == ["topk"]
    model = SAE(SAEConfig(d_model=24, d_sae=96, arch="relu", k=4))
    x_bd = torch.randn(8, 24)
    x_hat_bd, (rows_n, cols_n, _) = inference.encode_entries(model, x_bd)
    with torch.no_grad():
        want_bd, f_bs = model(x_bd)
    assert torch.equal(x_hat_bd, want_bd) and np.array_equal(rows_n, np.nonzero(f_bs.numpy())[0])


def test_validation_from_the_picks_counts_what_the_dense_codes_count(tmp_path):
    """A TopK run's validation metrics (decoded from its picks) against the dense path's on the same SAE: the same
    firing counts, so L0 and dead latents, and the NMSE up to rounding."""
    run = _run_at(tmp_path, "val", archs.get("topk").trainer)
    train.train_runs([run.root], train.TrainSettings(device="cpu"))
    model = load_sae(run.sae_fpath)
    cfg = train.TrainConfig.from_dict(run.config(), "config.json")
    sd = shards.ShardDir(next((tmp_path / "shards").glob("*")))
    got = train.validation_metrics(model, sd, cfg, torch.device("cpu"))
    want = train.validation_metrics(model, sd, dataclasses.replace(cfg, trainer=FIRST_TRAINER), torch.device("cpu"))
    assert {k: v for k, v in got.items() if k not in ("mse", "nmse", "explained_variance")} == {
        k: v for k, v in want.items() if k not in ("mse", "nmse", "explained_variance")}
    assert got["nmse"] == pytest.approx(want["nmse"], rel=1e-5)


@pytest.mark.parametrize("transcoder", [False, True], ids=["sae", "transcoder"])
def test_pre_activations_with_the_bias_added_in_place_are_the_out_of_place_ones_bit_for_bit(transcoder):
    """`SAE.pre_acts_normed` adds its bias into the matmul's output: the values and every gradient equal those of
    `x @ W_enc + bias` bit for bit, so no run's bytes move (saeflow-train-3's included)."""
    model = _random_model(transcoder)
    gen = torch.Generator().manual_seed(3)
    xn_bd, r_bs = torch.randn(16, 24, generator=gen), torch.randn(16, 96, generator=gen)

    def run(pre_fn):
        model.zero_grad(set_to_none=True)
        pre_bs = pre_fn()
        (torch.relu(pre_bs) * r_bs).sum().backward()
        return pre_bs.detach(), _param_grads(model)

    bias = (lambda: model.b_enc) if transcoder else (lambda: model.b_enc - model.b_dec @ model.W_enc)
    want_bs, want = run(lambda: xn_bd @ model.W_enc + bias())
    got_bs, got = run(lambda: model.pre_acts_normed(xn_bd))
    assert torch.equal(got_bs, want_bs) and sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
