"""Metrics shared by training and inference: known answers, float64 accumulation across batches."""

import pytest
import torch

from saeflow.training import degenerate
from saeflow.training.metrics import MetricsAccumulator, batch_nmse


def test_known_answers_across_batches():
    x_bd = torch.tensor([[1.0, 0.0], [3.0, 0.0], [1.0, 2.0], [3.0, 2.0]])  # mean (2, 1); total variance 8
    x_hat_bd = x_bd + torch.tensor([1.0, 0.0])  # squared error 1 per vector
    f_bs = torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [0.5, 0, 3.0], [1.0, 0, 0]])
    acc = MetricsAccumulator(d_model=2, d_sae=3, dense_freq=0.5)
    for i in (0, 1, 3):  # uneven batches
        j = min(i + (1 if i < 1 else 2), 4)
        acc.update(x_bd[i:j], x_hat_bd[i:j], f_bs[i:j])
    r = acc.result()
    assert r["n_vectors"] == 4
    assert r["nmse"] == pytest.approx(4 / 8) and r["explained_variance"] == pytest.approx(0.5)
    assert r["mse"] == pytest.approx(4 / 8)
    assert r["l0"] == pytest.approx(5 / 4)
    assert (r["n_dead"], r["n_dense"]) == (1, 1)  # latent 1 never fires; latent 0 fires on 4/4 > 0.5
    assert (acc.fires_s.double() / acc.n_vectors).tolist() == [1.0, 0.0, 0.25]  # per-latent firing counts
    assert batch_nmse(x_bd, x_hat_bd) == pytest.approx(0.5)


def test_float64_accumulation_is_stable_for_large_offsets():
    # A large common offset makes float32 sums of squares lose the variance; float64 keeps it.
    torch.manual_seed(0)
    acc = MetricsAccumulator(d_model=4, d_sae=2)
    for _ in range(50):
        x_bd = 1000.0 + torch.randn(1000, 4)
        acc.update(x_bd, x_bd + 0.1, torch.ones(1000, 2))
    assert acc.result()["nmse"] == pytest.approx(0.01, rel=0.02)


def _result(f_bs: torch.Tensor) -> dict:
    acc = MetricsAccumulator(d_model=1, d_sae=f_bs.shape[1])
    acc.update(torch.zeros(len(f_bs), 1), torch.zeros(len(f_bs), 1), f_bs)
    return acc.result()


def test_degenerate_results_are_every_latent_dead_or_dense_or_l0_above_a_tenth_of_d_sae():
    """Issue 40: a Gated SAE with every latent dense (L0 371 of 1,536) passed silently. The one judgement of training
    and the summary names each way a result is degenerate, and finds nothing wrong with a sparse code."""
    d_sae = 40
    healthy = torch.zeros(100, d_sae)
    healthy[torch.arange(100), torch.arange(100) % d_sae] = 1.0  # one latent a vector, each on 2-3% of vectors
    assert degenerate.reason(_result(healthy), d_sae) == ""
    assert degenerate.reason(_result(torch.zeros(100, d_sae)), d_sae) == (
        "every latent is dead (none of the 40 fired on 100 vectors)")
    dense = degenerate.reason(_result(torch.ones(100, d_sae)), d_sae)
    assert dense == ("every latent is dense (all 40 fire on more than 0.1 of vectors); L0 40.0 is above 0.1 of d_sae "
                     "40: not a sparse code")  # fmt: skip
    wide = healthy.clone()
    wide[:, :6] = 1.0  # 6 latents on every vector, another on 82 of them: L0 6.82 > 4
    assert degenerate.reason(_result(wide), d_sae) == "L0 6.8 is above 0.1 of d_sae 40: not a sparse code"
    assert degenerate.reason(_result(wide), d_sae, "gated") == degenerate.reason(_result(wide), d_sae)
    for arch in ("topk", "batchtopk"):  # k sets their L0: the user's choice (k 7 of 40), not a learned failure
        assert degenerate.reason(_result(wide), d_sae, arch) == ""
        assert degenerate.reason(_result(torch.zeros(100, d_sae)), d_sae, arch).startswith("every latent is dead")
    assert degenerate.MAX_L0_FRACTION == 0.1  # the fraction docs/training.md and the README state
