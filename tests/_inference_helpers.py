"""Builders shared by the inference and visuals tests: tiny shard directories, runs and SAEs with known codes."""

import pathlib

import numpy as np
import torch

from saeflow import runs, sae, shards


def write_shards(root: pathlib.Path, acts_nltd: np.ndarray, layers=(2,), cls_token=False, data=None, dataset="/nonexistent",
                 aux=None, patches_per_shard=None, ckpt="synthetic") -> shards.ShardDir:
    n_ex, n_layers, T, d = acts_nltd.shape
    md = shards.Metadata(
        family="test", ckpt=ckpt, layers=tuple(layers), patches_per_ex=T - int(cls_token), cls_token=cls_token,
        d_model=d, n_ex=n_ex, patches_per_shard=patches_per_shard or 3 * T * n_layers,
        data=data or {"__class__": "Synthetic"}, dataset=dataset,
    )
    aux = aux or {}
    with shards.ShardWriter(root, md, aux=tuple(aux)) as writer:
        writer.write(acts_nltd, aux=aux)
    return shards.ShardDir(writer.dpath)


def identity_sae(d: int) -> sae.SAE:
    """codes = relu(x): the codes of every row are known."""
    eye = torch.eye(d)
    return sae.SAE.from_weights(eye, torch.zeros(d), eye, torch.zeros(d), arch="relu")


def make_run(runs_root: pathlib.Path, sd: shards.ShardDir, model: sae.SAE | None, layer: int, **extra) -> runs.Run:
    run = runs.create_run(runs_root, {"layer": layer, "train_shards": sd.hash, **extra}, sd.dpath)
    if model is not None:
        sae.save_sae(model, run.sae_fpath)
    return run
