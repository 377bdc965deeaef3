"""Shared by the training tests: tiny shard directories and runs built through the real APIs."""

import pathlib

import numpy as np

from saeflow import config, runs, sweeps
from saeflow.shards import Metadata, ShardDir, ShardWriter


def write_shards(
    root: pathlib.Path, acts_nltd: np.ndarray, layers=(0,), cls_token=False, ex_per_shard=None, tag="t", dtype="float32"
):
    """Publish `acts_nltd` (n, L, T, D) as a saev shard directory; `tag` keeps different data sets apart."""
    n, L, T, D = acts_nltd.shape
    ex_per_shard = ex_per_shard or n
    md = Metadata(
        family="clip",
        ckpt="test",
        layers=tuple(layers),
        patches_per_ex=T - int(cls_token),
        cls_token=cls_token,
        d_model=D,
        n_ex=n,
        patches_per_shard=ex_per_shard * L * T,
        data={"__class__": "Synthetic", "tag": tag},
        dataset="/nonexistent",
        dtype=dtype,
    )
    with ShardWriter(root, md) as writer:
        writer.write(acts_nltd)
    return ShardDir(writer.dpath)


def make_run(runs_root: pathlib.Path, train_sd: ShardDir, val_sd: ShardDir | None = None, **spec) -> runs.Run:
    """A run directory for one SAE spec (schema defaults filled), exactly as `saeflow create-run` makes it."""
    val_sd = val_sd or train_sd
    cfg = config.validate({"activations": {}, "saes": {"s": {"train": "tr", "val": "va", "layer": 0, **spec}}})
    sae_spec = sweeps.SAESpec.from_dict("s", cfg["saes"]["s"])
    (plan,) = sweeps.plan_runs({"s": sae_spec}, {"tr": train_sd.hash, "va": val_sd.hash})
    return runs.create_run(runs_root, plan.train_config.to_dict(), train_sd.dpath, val_sd.dpath)


def planted_data(n: int, d_model: int, n_atoms: int, k: int, seed: int = 0):
    """Vectors that are sums of k of n_atoms random unit directions with positive weights: (x_nd, atoms_ad)."""
    rng = np.random.default_rng(seed)
    atoms_ad = rng.standard_normal((n_atoms, d_model)).astype(np.float32)
    atoms_ad /= np.linalg.norm(atoms_ad, axis=1, keepdims=True)
    idx_nk = np.argsort(rng.random((n, n_atoms)), axis=1)[:, :k]
    coef_nk = rng.uniform(1.0, 3.0, size=(n, k)).astype(np.float32)
    x_nd = np.einsum("nk,nkd->nd", coef_nk, atoms_ad[idx_nk]) + 0.5
    return x_nd.astype(np.float32), atoms_ad
