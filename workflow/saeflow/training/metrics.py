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
        self.update_counts(x_bd, x_hat_bd, (f_bs.detach() > 0).sum(0))

    @torch.no_grad()
    def update_counts(self, x_bd: torch.Tensor, x_hat_bd: torch.Tensor, fires_s: torch.Tensor) -> None:
        """`update` from each latent's count of active vectors in the batch (`fires_s`, (s,); its sum is the batch's
        active codes), so sparse codes need no dense (b, s) pass."""
        x64 = x_bd.detach().to("cpu", torch.float64)
        err_b = (x64 - x_hat_bd.detach().to("cpu", torch.float64)).square().sum(-1)
        self.update_rows(x64, err_b, x64.square().sum(-1), fires_s)

    def update_rows(self, x64_bd: torch.Tensor, err_b: torch.Tensor, sq_b: torch.Tensor, fires_s: torch.Tensor) -> None:
        """`update_counts` from a batch's float64 inputs and their per-vector squared error and squared norm (a caller
        keeping two accumulators over one batch computes them once)."""
        self.n_vectors += x64_bd.shape[0]
        self.sq_err += float(err_b.sum())
        self.sum_d += x64_bd.sum(0)
        self.sum_sq += float(sq_b.sum())
        self.n_active += int(fires_s.sum())
        self.fires_s += fires_s.to("cpu", torch.int64)

    def total_var(self) -> float:
        """Total variance around the mean: sum ||x||^2 - n ||mean||^2 (exact in float64 for our scales)."""
        return self.sum_sq - float(self.sum_d.square().sum()) / max(self.n_vectors, 1)

    def result(self) -> dict:
        n = max(self.n_vectors, 1)
        total_var = self.total_var()
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
