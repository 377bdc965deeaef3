"""Reconstruction and sparsity metrics accumulated over batches (float64 sums: stable over billions of vectors).

Used by training (validation) and inference, so both report the same numbers:

    nmse                = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2    (0 = perfect, 1 = as good as the mean)
    explained_variance  = 1 - nmse
    l0                  = mean number of active latents per vector
    dead / dense        = latents that never fire / fire on more than `dense_freq` of vectors
"""

import dataclasses

import torch

DEFAULT_DENSE_FREQ = 0.1


@dataclasses.dataclass
class MetricsAccumulator:
    """Feed (x, x_hat, f) batches in raw space; `result()` gives the summary dict."""

    d_model: int
    d_sae: int
    dense_freq: float = DEFAULT_DENSE_FREQ

    def __post_init__(self):
        self.n_vectors = 0
        self.sq_err = 0.0
        self.sum_d = torch.zeros(self.d_model, dtype=torch.float64)
        self.sum_sq = 0.0
        self.n_active = 0
        self.fires_s = torch.zeros(self.d_sae, dtype=torch.int64)

    @torch.no_grad()
    def update(self, x_bd: torch.Tensor, x_hat_bd: torch.Tensor, f_bs: torch.Tensor) -> None:
        x64 = x_bd.detach().to("cpu", torch.float64)
        self.n_vectors += x64.shape[0]
        self.sq_err += float((x64 - x_hat_bd.detach().to("cpu", torch.float64)).square().sum())
        self.sum_d += x64.sum(0)
        self.sum_sq += float(x64.square().sum())
        fires_s = (f_bs.detach() > 0).sum(0)  # the batch's total is the sum of these d_sae counts
        self.n_active += int(fires_s.sum())
        self.fires_s += fires_s.to("cpu", torch.int64)

    def result(self) -> dict:
        n = max(self.n_vectors, 1)
        # Total variance around the mean: sum ||x||^2 - n ||mean||^2 (exact in float64 for our scales).
        total_var = self.sum_sq - float(self.sum_d.square().sum()) / n
        nmse = self.sq_err / total_var if total_var > 0 else float("nan")
        freq_s = self.fires_s.double() / n
        return {
            "n_vectors": self.n_vectors,
            "mse": self.sq_err / (n * self.d_model),
            "nmse": nmse,
            "explained_variance": 1.0 - nmse,
            "l0": self.n_active / n,
            "n_dead": int((self.fires_s == 0).sum()),
            "n_dense": int((freq_s > self.dense_freq).sum()),
            "dense_freq": self.dense_freq,
        }


def batch_nmse(x_bd: torch.Tensor, x_hat_bd: torch.Tensor) -> float:
    """NMSE of one batch (for progress bars): error over variance around the batch mean."""
    with torch.no_grad():
        x64, err = x_bd.double(), (x_bd - x_hat_bd).double()
        var = (x64 - x64.mean(0)).square().sum()
        return float(err.square().sum() / var) if var > 0 else float("nan")
