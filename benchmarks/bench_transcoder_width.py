"""Skip transcoders at the width users train, not the tests' toy width: latent sharding and the peers' own loaders.

    python benchmarks/bench_transcoder_width.py [--d-model 768] [--expansion 32] [--k 32] [--n-vectors 16384]
                                                [--batch-size 4096] [--no-peers]

Data: synthetic MLP-like pairs, inputs x ~ N(0, 1) and targets y = relu(x W) with W ~ N(0, 1/d), as two shard
directories (the target's `data.hook` mlp_out), d_model 768 (GPT-2 small's) by default. For a TopK and a JumpReLU skip
transcoder of expansion 32 (24,576 latents, W_skip 768 x 768), one epoch in batches of 4,096:

  latents     trained by one process (`sweep`, one torch thread) and by 2 forked gloo ranks in `latents` mode (each
              holds half the latents, one thread each): the validation NMSE's and L0's relative differences against
              docs/distributed.md's claim (1e-4); how many latents' parameters (encoder column, bias, decoder row)
              differ by more than 1e-3 of their tensor's largest entry (a near-tie at the k-th value picks another
              latent in one run; its decoder row, started at zero, then takes Adam's full step in one run only), and
              the whole tensors' (b_dec, W_skip) largest relative difference; the time of 2 ranks / 1 process
  peers       the one-process transcoder exported (TopK -> sparsify, JumpReLU -> SAELens, the formats that compute
              them), loaded by sparsify's `SparseCoder.load_from_disk` and SAELens's `SAE.load_from_disk` in a
              subprocess (tests/_sae_peers.py, the install tests/test_sae_interop.py makes under $SAEFLOW_TEST_CACHE)
              and run on 1,024 inputs: the library's codes and forward output (the prediction, skip path included)
              against saeflow's, the largest difference relative to the largest magnitude, against issue 35's 1e-5

Exit 1 when a figure is over its limit.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from _ranks import run_ranks  # noqa: E402
from bench_planted import peers_site  # noqa: E402
from builders import run_from_sae_spec, write_shards  # noqa: E402
from saeflow.interop.checkpoints import sae_checkpoints  # noqa: E402
from saeflow.training import entry, sae  # noqa: E402
from saeflow.training.sae import load_sae  # noqa: E402

CASES = (("topk", "sparsify"), ("jumprelu", "saelens"))  # arch -> the format whose library computes it
METRICS_LIMIT, PEERS_LIMIT = 1e-4, 1e-5
LATENT_TOL = 1e-3  # a latent's parameters differ when off by more than this of their tensor's largest entry
TOKENS = 128


def pairs(root: pathlib.Path, d_model: int, n_vectors: int):
    rng = np.random.default_rng(0)
    x_nltd = rng.standard_normal((n_vectors // TOKENS, 1, TOKENS, d_model), dtype=np.float32)
    w_dd = rng.standard_normal((d_model, d_model), dtype=np.float32) / np.float32(np.sqrt(d_model))
    y_nltd = np.maximum(x_nltd @ w_dd, 0)
    kw = dict(layers=(0,), ex_per_shard=32, tag="width")
    return write_shards(root, x_nltd, **kw), write_shards(root, y_nltd, data={"hook": "mlp_out"}, **kw), x_nltd


def train(run_roots, mode: str):
    return entry.train_runs(run_roots, entry.TrainSettings(device="cpu", parallel=mode, buffer_bytes=1 << 29))


def compare(split: sae.SAE, alone: sae.SAE) -> tuple[int, int, float]:
    """(latents whose parameters differ, latents, the whole tensors' largest relative difference), the parameters
    cut by `SAE.latent_axes` (W_enc's columns, W_dec's rows, per-latent vectors; W_skip and b_dec whole)."""
    got, want = split.state_dict(), alone.state_dict()
    off = torch.zeros(alone.d_sae, dtype=torch.bool)
    whole = 0.0
    for key, axis in alone.latent_axes().items():
        gap = (got[key] - want[key]).abs() / max(float(want[key].abs().max()), 1e-12)
        if axis is None:
            whole = max(whole, float(gap.max()))
        else:
            off |= gap.movedim(axis, 0).reshape(alone.d_sae, -1).amax(dim=1) > LATENT_TOL
    return int(off.sum()), alone.d_sae, whole


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def peers_outputs(root: pathlib.Path, load: dict, x_nd: np.ndarray) -> dict:
    site = peers_site("pass --no-peers")
    np.save(root / "x.npy", x_nd)
    job = {"inputs": str(root / "x.npy"), "out": str(root / "peers.npz"), "load": load}
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(TESTS / "_sae_peers.py"), str(root / "job.json")], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"the peers' loaders failed:\n{proc.stderr[-4000:]}")
    with np.load(root / "peers.npz") as npz:
        return {name: npz[name] for name in npz.files}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--expansion", type=int, default=32)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--n-vectors", type=int, default=16384)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--no-peers", action="store_true", help="skip the sparsify and SAELens loaders")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank
    print(f"skip transcoders, d_model {args.d_model}, {args.expansion * args.d_model:,} latents, k {args.k}, "
          f"{args.n_vectors:,} pairs in batches of {args.batch_size:,}, one epoch")  # fmt: skip
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        x_sd, y_sd, x_nltd = pairs(root / "shards", args.d_model, args.n_vectors)
        spec = dict(k=args.k, expansion=args.expansion, batch_size=args.batch_size, n_epochs=1, skip=True)
        load, models = {}, {}
        for arch, fmt in CASES:
            alone = run_from_sae_spec(root / f"alone-{arch}", x_sd, target_sd=y_sd, arch=arch, **spec)
            split = run_from_sae_spec(root / f"split-{arch}", x_sd, target_sd=y_sd, arch=arch, **spec)
            t0 = time.perf_counter()
            (one,) = train([alone.root], "sweep")
            t1 = time.perf_counter()
            ((two,), _) = run_ranks(2, train, [split.root], "latents")
            t2 = time.perf_counter()
            n_off, d_sae, whole = compare(load_sae(split.sae_fpath), load_sae(alone.sae_fpath))
            metrics = max(abs(two[key] - one[key]) / abs(one[key]) for key in ("nmse", "l0"))
            print(f"  {arch}: NMSE {one['nmse']:.4f}, L0 {one['l0']:.1f}; 2 ranks (latents) against 1 process: "
                  f"NMSE, L0 {metrics:.1e} (limit {METRICS_LIMIT:g}); latents off by > {LATENT_TOL:g}: {n_off:,} of "
                  f"{d_sae:,}; whole tensors {whole:.1e}; time {t2 - t1:.1f} s / {t1 - t0:.1f} s = "
                  f"{(t2 - t1) / (t1 - t0):.2f}x", flush=True)  # fmt: skip
            failed += [f"{arch} latents"] if metrics > METRICS_LIMIT else []
            out = sae_checkpoints.export_run(alone.root, fmt, root / f"export-{arch}")
            load[arch], models[arch] = [fmt, str(out)], load_sae(alone.sae_fpath).eval()
        if not args.no_peers:
            x_nd = torch.from_numpy(x_nltd.reshape(-1, args.d_model)[:1024])
            library = peers_outputs(root, load, x_nd.numpy())
            for arch, fmt in CASES:
                with torch.no_grad():
                    y_hat, f_bs = models[arch](x_nd)
                codes = relative(library[f"{arch}.codes"], f_bs.numpy())
                forward = relative(library[f"{arch}.forward"], y_hat.numpy())
                print(f"  {arch} -> {fmt} ({library['versions'][0 if fmt == 'saelens' else 1]}), the library's own "
                      f"loader: codes {codes:.1e}, prediction {forward:.1e} (limit {PEERS_LIMIT:g})")  # fmt: skip
                failed += [f"{arch} {fmt}"] if max(codes, forward) > PEERS_LIMIT else []
    if failed:
        sys.exit(f"over the limit: {', '.join(failed)}")


if __name__ == "__main__":
    main()
