"""Shared by the shard-store tests: small metadata, deterministic activations, snapshots, a writer entry point.

Run as a script (`python tests/store_helpers.py ROOT N_EX`) it writes the standard test directory and prints
`published` or `reused`: the concurrency and hash-seed tests start it in separate processes.
"""

import json
import os
import pathlib
import sys

import numpy as np

from saeflow import shards


def make_md(
    n_ex=7, layers=(3, 5), patches_per_ex=4, cls_token=True, d_model=8, ex_per_shard=3, **kw
) -> shards.Metadata:
    """Metadata whose patches_per_shard gives exactly `ex_per_shard` examples per shard."""
    tokens = patches_per_ex + int(cls_token)
    return shards.Metadata(
        family=kw.pop("family", "clip"),
        ckpt=kw.pop("ckpt", "hf-hub:test/tiny"),
        layers=tuple(layers),
        patches_per_ex=patches_per_ex,
        cls_token=cls_token,
        d_model=d_model,
        n_ex=n_ex,
        patches_per_shard=ex_per_shard * tokens * len(layers),
        data=kw.pop("data", {"__class__": "ImageFolder", "root": "/data/imgs", "split": "train"}),
        dataset=kw.pop("dataset", "/data/imgs"),
        **kw,
    )


def make_acts(md: shards.Metadata, start: int, stop: int) -> np.ndarray:
    """Examples [start, stop) as (n, L, T, D): a smooth function of all four coordinates, so every value differs."""
    ex, layer, token, dim = np.ogrid[start:stop, : md.n_layers, : md.tokens_per_ex, : md.d_model]
    acts = np.sin(ex * 1.37 + layer * 0.71 + token * 0.113 + dim * 0.0137) + ex * 1e-3
    return acts.astype(md.dtype)


def make_aux(md: shards.Metadata, fname: str, start: int, stop: int) -> np.ndarray:
    spec = shards.AUX_FILES[fname]
    shape = (stop - start, *spec.row_shape(md))
    return (np.arange(start * int(np.prod(shape[1:])), stop * int(np.prod(shape[1:]))).reshape(shape) % 251).astype(
        spec.dtype
    )


def write_all(root, md: shards.Metadata, aux=("labels.bin",), batch=2) -> shards.ShardWriter:
    """Write every example (resuming where a staging directory left off) and publish."""
    with shards.ShardWriter(root, md, aux=aux) as writer:
        if not writer.reused:
            for start in range(writer.n_written, md.n_ex, batch):
                stop = min(start + batch, md.n_ex)
                writer.write(make_acts(md, start, stop), aux={f: make_aux(md, f, start, stop) for f in aux})
    return writer


def snapshot(root: pathlib.Path) -> dict:
    """Every path under root with its bytes, mtime and mode: equal snapshots mean nothing was touched."""
    out = {}
    for dpath, dnames, fnames in os.walk(root):
        for name in dnames + fnames:
            path = pathlib.Path(dpath) / name
            st = path.lstat()
            data = path.read_bytes() if path.is_file() else None
            out[str(path.relative_to(root))] = (data, st.st_mtime_ns, st.st_mode)
    return out


def file_bytes(dpath: pathlib.Path, skip=("provenance.json",)) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dpath.iterdir()) if p.name not in skip}


if __name__ == "__main__":
    writer = write_all(pathlib.Path(sys.argv[1]), make_md(n_ex=int(sys.argv[2]), d_model=64))
    print(json.dumps({"result": "reused" if writer.reused else "published", "hash": writer.md.hash}))
