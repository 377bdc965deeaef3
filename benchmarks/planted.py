"""A planted dictionary and its data stream, shared by bench_planted.py and its peer runner.

`n_atoms` random unit atoms in d dimensions; each vector is the sum of `n_active` distinct atoms (uniformly chosen)
with coefficients uniform in [0.5, 2.5] (or Exp(1), or log-normal: `MAGNITUDES`), optionally plus Gaussian noise.
Batch `step` is a pure function of (seed, step), so every trainer (saeflow, sae-lens, sparsify, in whichever process)
sees the same vectors in the same order.
"""

import torch

COEF_LO, COEF_HI = 0.5, 2.5
RECOVERED_COS = 0.9  # an atom counts as recovered when some decoder row has cosine above this with it


def dictionary(d: int, n_atoms: int, seed: int) -> torch.Tensor:
    """(n_atoms, d) unit rows; seeded apart from the SAE init seeds (seed 0) so no init starts on the answer."""
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    atoms_ad = torch.randn(n_atoms, d, generator=gen)
    return atoms_ad / atoms_ad.norm(dim=-1, keepdim=True)


MAGNITUDES = ("uniform", "exp", "lognormal")  # uniform in [COEF_LO, COEF_HI]; Exp(1); exp(N(0, 1)), a heavy tail


def coefficients(gen: torch.Generator, shape: tuple[int, int], magnitude: str) -> torch.Tensor:
    """The active atoms' coefficients (b, k), positive, drawn from `magnitude` (MAGNITUDES)."""
    if magnitude == "uniform":
        return COEF_LO + (COEF_HI - COEF_LO) * torch.rand(shape, generator=gen)
    if magnitude == "exp":
        return -torch.log1p(-torch.rand(shape, generator=gen))
    if magnitude == "lognormal":
        return torch.randn(shape, generator=gen).exp()
    raise ValueError(f"magnitude {magnitude!r}: choose one of {', '.join(MAGNITUDES)}")


def batch(atoms_ad: torch.Tensor, n_active: int, batch_size: int, seed: int, step: int, magnitude: str = "uniform",
          noise: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Batch `step` of the stream: (batch_size, d) float32, plus Gaussian noise of std `noise` per dimension."""
    gen = torch.Generator().manual_seed(seed * 1_000_000_007 + step)
    n_atoms = atoms_ad.shape[0]
    idx_bk = torch.rand(batch_size, n_atoms, generator=gen).topk(n_active, dim=-1).indices
    coef_bk = coefficients(gen, (batch_size, n_active), magnitude)
    x_bd = torch.nn.functional.embedding_bag(idx_bk, atoms_ad, per_sample_weights=coef_bk, mode="sum")
    return x_bd + noise * torch.randn(x_bd.shape, generator=gen) if noise else x_bd


def score(atoms_ad: torch.Tensor, W_dec_sd: torch.Tensor) -> dict:
    """Recovered fraction (max cosine > RECOVERED_COS) and mean max cosine of the atoms against decoder rows."""
    rows_sd = W_dec_sd / W_dec_sd.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    max_cos_a = (atoms_ad @ rows_sd.T).max(dim=-1).values
    return {"recovered": float((max_cos_a > RECOVERED_COS).float().mean()), "mean_max_cos": float(max_cos_a.mean())}


def nmse_l0(x_bd: torch.Tensor, x_hat_bd: torch.Tensor, f_bs: torch.Tensor) -> dict:
    """NMSE (squared error over the variance around the batch mean) and L0 of one held-out batch."""
    err = (x_hat_bd - x_bd).square().sum()
    var = (x_bd - x_bd.mean(0)).square().sum()
    return {"nmse": float(err / var), "l0": float((f_bs > 0).sum(-1).float().mean())}


def output_dictionary(d: int, n_atoms: int, seed: int) -> torch.Tensor:
    """A transcoder's planted output atoms: (n_atoms, d) unit rows, drawn apart from the input atoms (`dictionary`)."""
    return dictionary(d, n_atoms, seed + 7919)


def pair_batch(atoms_in_ad: torch.Tensor, atoms_out_ad: torch.Tensor, n_active: int, batch_size: int, seed: int,
               step: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Batch `step` of a transcoder's stream: inputs x = `batch`'s (the same atoms and coefficients), targets
    y = the same coefficients on the output atoms plus Gaussian noise of std `noise` per dimension: a sparse linear
    function of the input's atoms, plus noise."""
    gen = torch.Generator().manual_seed(seed * 1_000_000_007 + step)
    n_atoms = atoms_in_ad.shape[0]
    idx_bk = torch.rand(batch_size, n_atoms, generator=gen).topk(n_active, dim=-1).indices
    coef_bk = COEF_LO + (COEF_HI - COEF_LO) * torch.rand(batch_size, n_active, generator=gen)
    x_bd = torch.nn.functional.embedding_bag(idx_bk, atoms_in_ad, per_sample_weights=coef_bk, mode="sum")
    y_bd = torch.nn.functional.embedding_bag(idx_bk, atoms_out_ad, per_sample_weights=coef_bk, mode="sum")
    return x_bd, y_bd + noise * torch.randn(y_bd.shape, generator=gen)
