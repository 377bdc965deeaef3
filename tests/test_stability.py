"""Seed stability: two seeds that both recover a planted dictionary share their latents (decoder directions matched
by the optimal assignment); two unrelated random SAEs share almost none; the matching is linear_sum_assignment's."""

import json

import numpy as np
import pytest
import scipy.optimize
import torch

from builders import run_around_sae, run_from_sae_spec, write_shards
from saeflow import cli
from saeflow.analysis import inference, stability
from saeflow.errors import SaeflowError
from saeflow.training import sae, train
from saeflow.training.sae import load_sae


@pytest.mark.slow
def test_two_seeds_that_recover_the_planted_dictionary_match_and_random_saes_do_not(tmp_path, capsys):
    """A dictionary of as many atoms as latents (expansion 1), so "match 90% of the latents" asks both runs to find
    nearly every atom: orthonormal atoms, three per vector, which TopK recovers in a few hundred steps."""
    rng = np.random.default_rng(0)
    atoms_ad = np.linalg.qr(rng.standard_normal((64, 64)))[0].T
    idx_nk = np.argsort(rng.random((16384, 64)), axis=1)[:, :3]
    x_nd = (np.einsum("nk,nkd->nd", rng.uniform(1, 3, (16384, 3)), atoms_ad[idx_nk]) + 0.5).astype(np.float32)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 16, 64), layers=(0,), tag="planted")
    spec = {"arch": "topk", "k": 3, "expansion": 1, "batch_size": 128, "n_epochs": 6, "dead_after_vectors": 8192}
    runs = [run_from_sae_spec(tmp_path / "runs", sd, **spec, seed=seed, data_seed=seed) for seed in (0, 1)]
    train.train_runs([run.root for run in runs], train.TrainSettings(device="cpu"))
    for run in runs:  # both recover the planted dictionary
        cos_a = (atoms_ad @ load_sae(run.sae_fpath).W_dec.detach().double().numpy().T).max(1)
        assert (cos_a > 0.9).mean() >= 0.95, (cos_a > 0.9).mean()
    out_fpath = tmp_path / "stability.json"
    argv = ["stability", "--run", str(runs[0].root), "--run", str(runs[1].root), "--out", str(out_fpath)]
    assert cli.main(argv) == 0 and capsys.readouterr().out.strip() == str(out_fpath)
    result = json.loads(out_fpath.read_text())
    assert result["metrics"]["frac_matched_0.9"] >= 0.9, result["metrics"]
    assert result["metrics"]["frac_matched_0.7"] >= result["metrics"]["frac_matched_0.9"]
    assert result["group"] == stability.group_key(runs[0].config()) and len(result["pairs"]) == 1
    assert result["seeds"][runs[0].root.name] == {"seed": 0, "data_seed": 0}
    # Two unrelated random SAEs of the same shape: almost no latent has a counterpart.
    rng = np.random.default_rng(0)
    a_sd, b_sd = (rng.standard_normal((64, 64)) for _ in range(2))
    unrelated = stability.compare_pair(*(m / np.linalg.norm(m, axis=1, keepdims=True) for m in (a_sd, b_sd)))
    assert unrelated["frac_matched_0.7"] <= 0.02 and unrelated["frac_matched_0.9"] == 0.0
    assert unrelated["mmcs"] < 0.5 < result["metrics"]["mmcs"]


def test_the_matching_is_the_optimal_assignment_of_the_cosine_matrix():
    """On near-copies (so components hold several candidates each), matching component by component gives what
    linear_sum_assignment gives on the whole matrix with cosines below the floor set to 0; in blocks of any size."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((60, 16))
    a_sd = base[rng.integers(0, 60, 200)] + 0.35 * rng.standard_normal((200, 16))
    b_sd = base[rng.integers(0, 60, 180)] + 0.35 * rng.standard_normal((180, 16))
    a_sd, b_sd = (m / np.linalg.norm(m, axis=1, keepdims=True) for m in (a_sd, b_sd))
    rows, cols, cos, best_a, best_b = stability.cosine_pairs(a_sd, b_sd, block_rows=7)
    cos_ab = a_sd @ b_sd.T
    assert np.allclose(best_a, cos_ab.max(1)) and np.allclose(best_b, cos_ab.max(0))
    assert len(rows) == (cos_ab >= stability.MATCH_FLOOR).sum() > 200  # many candidates per latent
    _, _, matched = stability.match(rows, cols, cos, 200, 180)
    clipped = np.where(cos_ab >= stability.MATCH_FLOOR, cos_ab, 0.0)
    ri, ci = scipy.optimize.linear_sum_assignment(clipped, maximize=True)
    assert matched.sum() == pytest.approx(clipped[ri, ci].sum(), abs=1e-9)
    full = clipped[ri, ci]
    for t in stability.THRESHOLDS:
        assert (matched >= t).sum() == (full >= t).sum()


def test_groups_are_runs_that_differ_only_in_their_seeds(tmp_path):
    base = {"layer": 1, "arch": "topk", "k": 8, "seed": 0, "data_seed": 0}
    configs = {"a": base, "b": {**base, "seed": 1}, "c": {**base, "seed": 2, "data_seed": 5}, "d": {**base, "k": 4},
               "e": {**base, "k": 4, "data_seed": 1}, "f": {**base, "k": 16}}  # fmt: skip
    groups = stability.seed_groups(configs)
    assert sorted(groups.values()) == [["a", "b", "c"], ["d", "e"]]  # f has no other seed: no group
    with pytest.raises(SaeflowError, match="differ only in seed and data_seed"):
        stability.compare_runs([tmp_path])


def test_the_matched_mean_is_one_to_one_and_the_mmcs_is_not():
    """Issue 33: `mmcs` is each latent's best cosine (two latents may share a partner); `matched_mean_cos` is the
    one-to-one assignment's summed cosine over the smaller run, here 0.5 where mmcs is about 0.75."""
    a_sd = np.array([[1.0, 0, 0], [1.0, 0.1, 0]])
    b_sd = np.array([[1.0, 0, 0], [0, 0, 1.0]])
    a_sd /= np.linalg.norm(a_sd, axis=1, keepdims=True)
    out = stability.compare_pair(a_sd, b_sd)
    assert out["matched_mean_cos"] == pytest.approx(0.5) and out["frac_matched_0.9"] == 0.5
    assert out["mmcs"] == pytest.approx((1 + a_sd[1, 0] + 1 + 0) / 4)


def test_only_latents_that_fired_in_the_dump_are_matched(tmp_path):
    """Issue 33: the fractions counted dead latents. Two seeds share 4 live latents (permuted); their 4 dead latents
    (bias far below any input) keep unrelated decoder rows. Over live latents every one is matched; the nonzero-
    decoder rule (no dump) counts all 8."""
    rng = np.random.default_rng(0)
    sd = write_shards(tmp_path / "shards", rng.standard_normal((64, 1, 2, 8)).astype(np.float32), layers=(0,))
    runs = []
    for seed, order in ((0, [0, 1, 2, 3]), (1, [2, 0, 3, 1])):
        W_dec = np.r_[np.eye(8)[order], rng.standard_normal((4, 8))].astype(np.float32)
        b_enc = torch.tensor([0.0] * 4 + [-1e4] * 4)
        model = sae.SAE.from_weights(torch.from_numpy(W_dec.T.copy()), b_enc, torch.from_numpy(W_dec),
                                     torch.zeros(8), arch="relu", k=1)  # fmt: skip
        runs.append(run_around_sae(tmp_path / "runs", sd, model, 0, val_shards=sd.hash, seed=seed))
    undumped = stability.compare_runs([run.root for run in runs])
    assert undumped["metrics"]["frac_matched_0.9"] == 0.5 and undumped["live"][runs[0].root.name]["n_live"] == 8
    for run in runs:
        inference.run_inference(inference.InferenceConfig(run=run.root, shards=sd.dpath, device="cpu"))
    result = stability.compare_runs([run.root for run in runs])
    assert result["live"][runs[1].root.name] == {"n_live": 4, "d_sae": 8, "live": f"fired in the dump on {sd.hash}"}
    assert result["metrics"]["frac_matched_0.9"] == 1.0 and result["metrics"]["matched_mean_cos"] == pytest.approx(1)
