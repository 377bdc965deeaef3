"""circuit-tracer's feature-view files from saeflow's inference dumps: what its frontend shows for a feature node.

    saeflow export-features --run RUN_L0 --run RUN_L1 ... OUT      # a transcoder set's runs, dumps on their val shards
    OUT/features/index.json.gz     gzip JSON: a list indexed by layer of {"filename": "layer_<l>.bin",
                                   "offsets": [n_features + 1 byte offsets into it]}
    OUT/features/layer_<l>.bin     feature f's record at offsets[f]: a 4-byte little-endian length n, then n bytes of
                                   zlib-compressed JSON (circuit-tracer's frontend/feature_models.py `Model`)

The frontend names a feature by the Cantor pair of its layer and index (`cantor_pair`: (l + i)(l + i + 1)/2 + i) and
fetches `offsets[i]..offsets[i + 1]` of the layer's file (circuit_tracer/frontend/assets: util.js getFile,
init-feature-examples.js). Nothing in circuit-tracer 0.5.0 writes these files. Each record holds the latent's top
examples from its dump (`latents.npz`: its k best examples, each at its strongest token; the example's activations
per token from `patch_acts.npz` and its token strings from the shards' tokens.bin, as the visuals decode them), its
activation frequency and maximum, and a histogram of its nonzero activations. A latent that never fired has a record
with no examples. Written through a staging directory and renamed: OUT appears whole or not at all.
"""

import gzip
import json
import os
import pathlib
import struct
import zlib

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.store import atomic, runs
from saeflow.store.shards import ShardDir

FEATURES_DNAME, INDEX_FNAME = "features", "index.json.gz"
N_BINS = 20


def cantor_pair(layer: int, index: int) -> int:
    """The frontend's feature id of latent `index` of layer `layer` (circuit_tracer/frontend/graph_models.py)."""
    return (layer + index) * (layer + index + 1) // 2 + index


def layer_fname(layer: int) -> str:
    return f"layer_{layer}.bin"


def record_bytes(feature: dict) -> bytes:
    """One record: the length of the zlib-compressed JSON (4 bytes, little-endian), then it."""
    body = zlib.compress(json.dumps(feature, separators=(",", ":")).encode())
    return struct.pack("<I", len(body)) + body


def _dump_of(run: runs.Run):
    """(layer, the dump on the run's validation shards, those shards) of a trained run with its dump."""
    cfg = run.config()
    if cfg.get("shape") == "clt":
        raise SaeflowError(f"{run.root}: a cross-layer transcoder has no inference dump to read features from")
    layer = cfg.get("layer")
    dump = run.dump(cfg.get("val_shards") or cfg.get("train_shards"))
    if not isinstance(layer, int) or not dump.latents_fpath.exists() or not dump.acts_fpath.exists():
        raise SaeflowError(f"{dump.dpath}: no inference dump of the run on its validation shards; run saeflow "
                           f"inference --run {run.root} first")  # fmt: skip
    return layer, dump, ShardDir(run.link(run.VAL_SHARDS).resolve())


def layer_features(run: runs.Run, tokenizer: str | None = None) -> tuple[int, list[dict]]:
    """(the run's layer, a circuit-tracer feature record per latent) from its dump."""
    import scipy.sparse

    from saeflow.analysis.visuals.examples import open_examples

    layer, dump, sd = _dump_of(run)
    with np.load(dump.latents_fpath, allow_pickle=False) as npz:
        lat = {key: npz[key] for key in ("freq", "max_act", "topk_values", "topk_example")}
    acts = scipy.sparse.load_npz(dump.acts_fpath).tocsc()  # (rows, d_sae): a column per latent
    n_tok = sd.metadata.tokens_per_ex
    examples = open_examples(sd, tokenizer)
    features = []
    for i in range(acts.shape[1]):
        col = acts.getcol(i)
        values_n, rows_n = col.data, col.indices
        hist, _ = np.histogram(values_n, bins=N_BINS) if values_n.size else (np.zeros(N_BINS, int), None)
        top = []
        for value, ex in zip(lat["topk_values"][i], lat["topk_example"][i]):
            if ex < 0 or value <= 0:
                continue
            acts_t = np.zeros(n_tok, dtype=np.float32)
            here = (rows_n >= ex * n_tok) & (rows_n < (ex + 1) * n_tok)
            acts_t[rows_n[here] - ex * n_tok] = values_n[here]
            tokens = examples.tokens(int(ex)) if examples.kind == "text" else [str(t) for t in range(n_tok)]
            top.append({"tokens_acts_list": [round(float(a), 6) for a in acts_t],
                        "train_token_ind": int(acts_t.argmax()), "is_repeated_datapoint": False,
                        "tokens": tokens})  # fmt: skip
        features.append({
            "transcoder_id": f"saeflow-{run.run_id[:12]}", "index": i,
            "examples_quantiles": [{"quantile_name": "Top activations", "examples": top}] if top else [],
            "top_logits": [], "bottom_logits": [], "act_min": 0.0, "act_max": float(lat["max_act"][i]),
            "quantile_values": [], "histogram": [int(c) for c in hist],
            "activation_frequency": float(lat["freq"][i]),
        })  # fmt: skip
    return layer, features


def export_features(run_dpaths: list, out_dpath: str | os.PathLike, tokenizer: str | None = None) -> pathlib.Path:
    """Write the runs' feature-view files (one run per layer, every layer from 0 up) under OUT/features/."""
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; exports never overwrite")
    by_layer: dict[int, list[dict]] = {}
    for run_dpath in run_dpaths:
        layer, features = layer_features(runs.open_run(run_dpath), tokenizer)
        if layer in by_layer:
            raise SaeflowError(f"{run_dpath}: a second run for layer {layer}")
        by_layer[layer] = features
    missing = sorted(set(range(max(by_layer) + 1)) - set(by_layer))
    if missing:
        raise SaeflowError(f"no run for layer {', '.join(map(str, missing))}: the index lists every layer from 0 up")
    index = []
    with atomic.building_dir(out_dpath) as staging_dpath:
        (staging_dpath / FEATURES_DNAME).mkdir()
        for layer in sorted(by_layer):
            records = [record_bytes(feature) for feature in by_layer[layer]]
            offsets = np.concatenate([[0], np.cumsum([len(r) for r in records])]).astype(int).tolist()
            (staging_dpath / FEATURES_DNAME / layer_fname(layer)).write_bytes(b"".join(records))
            index.append({"filename": layer_fname(layer), "offsets": offsets})
        (staging_dpath / FEATURES_DNAME / INDEX_FNAME).write_bytes(gzip.compress(json.dumps(index).encode(), mtime=0))
    return out_dpath
