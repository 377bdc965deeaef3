"""Metrics shared by training and inference: known answers, float64 accumulation across batches."""

import pytest
import torch

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
