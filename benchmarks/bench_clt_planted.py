"""Does a cross-layer transcoder find cross-layer features? A CLT against a per-layer transcoder set (issue 43).

    python benchmarks/bench_clt_planted.py [--layers 4] [--d 64] [--per-layer 128] [--k 4] [--n 131072]
                                           [--epochs 2] [--arch topk]

Planted data (tests/builders.py `planted_cross_layer`): each feature reads one layer (its unit input direction stays
in the residual of every later layer's input, as a residual stream carries it) and writes its own unit output
direction at that layer and at every later one, with the same code; `k` features per layer are active per token
(weights 1-3), plus noise 0.01. Both models train through saeflow's trainer (`saeflow train`'s code path) on the same
shard directories, one per layer of each of input and target, at the same total latents (the CLT's per layer, the
set's per transcoder) and the same k per layer:

  features    the share of planted features some latent of their own layer's encoder decodes to (every layer it
              writes, concatenated) at cosine >= 0.9: only a CLT's latents write several layers, so a set scores 0
  writes      the share of (feature, layer it writes) pairs whose output direction some latent writing that layer
              decodes to at cosine >= 0.9 (a CLT's latents of every layer up to it; a set's transcoder of it)
  nmse, l0    validation NMSE of each layer's target (their mean), active latents per token summed over the layers

It prints one line per model and the ratio. The README has the latest figures.
"""

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from builders import planted_cross_layer, run_from_sae_spec, run_of_clt, write_shards  # noqa: E402
from saeflow.training import clt, entry, train  # noqa: E402
from saeflow.training.sae import load_sae  # noqa: E402

MIN_COS = 0.9


def unit_rows(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-8)


def clt_scores(model: clt.CLT, dec_fld: np.ndarray, src_f: np.ndarray) -> tuple[float, float]:
    w, n_layers = model.weights(), dec_fld.shape[1]
    features, writes = [], []
    for f, layer in enumerate(src_f):
        own = unit_rows(w[f"W_dec_{layer}"].reshape(model.cfg.d_sae, -1).numpy())
        features.append((own @ unit_rows(dec_fld[f, layer:].reshape(-1))).max() >= MIN_COS)
        for j in range(layer, n_layers):
            rows = np.concatenate([unit_rows(w[f"W_dec_{i}"][:, j - i].numpy()) for i in range(j + 1)])
            writes.append((rows @ dec_fld[f, j]).max() >= MIN_COS)
    return float(np.mean(features)), float(np.mean(writes))


def set_writes(models: list, dec_fld: np.ndarray, src_f: np.ndarray) -> float:
    rows = [unit_rows(m.W_dec.detach().numpy()) for m in models]
    hits = [(rows[j] @ dec_fld[f, j]).max() >= MIN_COS for f, layer in enumerate(src_f)
            for j in range(layer, dec_fld.shape[1])]  # fmt: skip
    return float(np.mean(hits))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--per-layer", type=int, default=128, help="planted features per layer (= latents per layer)")
    p.add_argument("--k", type=int, default=4, help="features active per token at each layer")
    p.add_argument("--n", type=int, default=131072, help="tokens")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--arch", default="topk")
    args = p.parse_args()
    T = 16
    xs, ys, dec_fld, src_f = planted_cross_layer(args.n, args.layers, args.d, args.per_layer, args.k, noise=0.01)
    expansion = args.per_layer // args.d
    spec = dict(arch=args.arch, expansion=expansion, batch_size=1024, n_epochs=args.epochs, n_val_vectors=16384,
                **({"k": args.k} if args.arch in ("topk", "batchtopk") else {}))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        ins = [write_shards(root / "s", xs[layer].reshape(-1, 1, T, args.d), layers=(layer,), ex_per_shard=1024,
                            tag="bench-clt") for layer in range(args.layers)]  # fmt: skip
        outs = [write_shards(root / "s", ys[layer].reshape(-1, 1, T, args.d), layers=(layer,), ex_per_shard=1024,
                             tag="bench-clt", data={"hook": "mlp_out"}) for layer in range(args.layers)]  # fmt: skip
        settings = train.TrainSettings(device="cpu")
        t0 = time.perf_counter()
        run = run_of_clt(root / "runs", ins, outs, **spec)
        (clt_result,) = entry.train_runs([run.root], settings)
        clt_sec = time.perf_counter() - t0
        features, writes = clt_scores(clt.load_clt(run.sae_fpath), dec_fld, src_f)
        t0 = time.perf_counter()
        members = [run_from_sae_spec(root / "runs", ins[layer], target_sd=outs[layer], layer=layer, **spec)
                   for layer in range(args.layers)]  # fmt: skip
        set_results = entry.train_runs([m.root for m in members], settings)
        set_sec = time.perf_counter() - t0
        by_root = {r["run"]: r for r in set_results}
        set_write = set_writes([load_sae(m.sae_fpath) for m in members], dec_fld, src_f)
    errs = [(by_root[str(m.root)]["nmse"], by_root[str(m.root)]["l0"]) for m in members]
    set_nmse, set_l0 = float(np.mean([e for e, _ in errs])), sum(l0 for _, l0 in errs)
    print(f"planted: {args.layers} layers, d {args.d}, {args.per_layer} features and latents per layer, k {args.k} "
          f"per layer, {args.n:,} tokens, {args.epochs} epochs, {args.arch}")
    clt_nmse = float(np.mean([r["nmse"] for r in clt_result["layers"].values()]))
    print(f"CLT:            features {features:.3f}  writes {writes:.3f}  nmse {clt_nmse:.3f} (mean of layers)  "
          f"l0 {clt_result['l0']:.1f}  {clt_sec:.0f} s")
    print(f"transcoder set: features 0.000  writes {set_write:.3f}  nmse {set_nmse:.3f} (mean of layers)  "
          f"l0 {set_l0:.1f}  {set_sec:.0f} s")
    print(f"writes recovered, CLT / set: {writes / max(set_write, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
