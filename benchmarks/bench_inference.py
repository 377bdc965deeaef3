"""Inference memory and speed: peak RSS must not grow with the dataset (the CSR is streamed to disk).

Runs `saeflow inference` in fresh processes on a small and an N-times larger synthetic shard directory (same SAE,
batch size and top-k) and prints peak RSS of each, their ratio (limit: --max-ratio, default 1.25 while the data
grows --scale times) and the time of the whole command against a same-run limit: the SAE forward alone on as many
rows (the rest is reading, the CSR, top-k, statistics, metrics and process start-up).

    python benchmarks/bench_inference.py [--n-ex 500] [--scale 4] [--tokens 64] [--d-model 256] [--d-sae 2048]
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from saeflow.store import runs, shards
from saeflow.training import sae


def build(root: pathlib.Path, n_ex: int, T: int, d: int, model: sae.SAE) -> tuple[pathlib.Path, pathlib.Path]:
    md = shards.Metadata(family="bench", ckpt="synthetic", layers=(0,), patches_per_ex=T, cls_token=False, d_model=d,
                         n_ex=n_ex, patches_per_shard=200_000, data={"__class__": "Synthetic", "n_ex": n_ex},
                         dataset="/nonexistent")
    rng = np.random.default_rng(0)
    with shards.ShardWriter(root / "shards", md) as writer:
        for start in range(0, n_ex, 256):
            writer.write(rng.standard_normal((min(256, n_ex - start), 1, T, d), dtype=np.float32))
    run = runs.create_run(root / "runs", {"layer": 0, "train_shards": md.hash}, writer.dpath)
    sae.save_sae(model, run.sae_fpath)
    return run.root, writer.dpath


def measure(run_dpath, shards_dpath, batch_size: int) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `saeflow inference` in a fresh process."""
    code = (
        "import resource, sys; from saeflow import cli; rc = cli.main(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, "inference", "--run", str(run_dpath),
                          "--shards", str(shards_dpath), "--batch-size", str(batch_size)],
                         capture_output=True, text=True, check=True)
    return time.perf_counter() - start, int(out.stderr.strip().splitlines()[-1]) / 1024


@torch.no_grad()
def forward_only(model: sae.SAE, n_rows: int, d: int, batch_size: int) -> float:
    """Seconds for the SAE forward alone over n_rows (the work no inference pipeline can avoid)."""
    x_bd = torch.randn(batch_size, d)
    start = time.perf_counter()
    for first in range(0, n_rows, batch_size):
        model(x_bd[: min(batch_size, n_rows - first)])
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-ex", type=int, default=500)
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-sae", type=int, default=2048)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--max-ratio", type=float, default=1.25)
    args = parser.parse_args()
    torch.manual_seed(0)
    d, s = args.d_model, args.d_sae
    model = sae.SAE.from_weights(torch.randn(d, s) / d**0.5, torch.zeros(s), torch.randn(s, d) / d**0.5, torch.zeros(d),
                                 arch="topk", k=args.k)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n_ex in (args.n_ex, args.n_ex * args.scale):
            run_dpath, shards_dpath = build(pathlib.Path(tmp) / str(n_ex), n_ex, args.tokens, d, model)
            model_s = forward_only(model, n_ex * args.tokens, d, args.batch_size)
            secs, rss_mib = measure(run_dpath, shards_dpath, args.batch_size)
            n_rows = n_ex * args.tokens
            npz_mib = next(run_dpath.glob("inference/*/patch_acts.npz")).stat().st_size / 2**20
            results[n_ex] = rss_mib
            print(f"n_ex={n_ex:>7} rows={n_rows:>9} d_sae={s} k={args.k}: {secs:6.1f} s ({n_rows / secs:,.0f} rows/s), "
                  f"peak RSS {rss_mib:7.1f} MiB, patch_acts.npz {npz_mib:7.1f} MiB; SAE forward alone {model_s:.1f} s "
                  f"(whole command / forward = {secs / model_s:.2f}x, process start included)")
    small, large = results[args.n_ex], results[args.n_ex * args.scale]
    ratio = large / small
    print(f"peak RSS ratio at {args.scale}x the data: {ratio:.2f} (limit {args.max_ratio}): "
          + ("OK" if ratio <= args.max_ratio else "FAIL"))
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
