"""Probing and seed stability at ImageNet size: time and peak RSS against reading the same dump once.

Generates, under --dir (default: a temporary directory under /tmp, removed at the end unless --keep):

- a shard directory of --n-ex examples (default 1,000,000) of --tokens tokens (CLS + patches, float16, d_model
  --d-model) with classes.bin holding one of --n-classes classes (default 1000) per example;
- a run whose SAE has --d-sae latents (default 2^15) and its inference dump `patch_acts.npz`, written with the
  writer `saeflow inference` uses (saeflow.analysis.csr.CsrWriter): every token has --k active latents, and one patch of
  each example also has its class's latent (latent c for class c). The stored activations are the SAE's decoding of
  those codes (so codes and activations agree; encoding 4M vectors with a 2^15-latent SAE would take hours on a CPU);
- a second run of the same config but its seed, whose decoder is the first's, permuted, with 90% of its rows
  perturbed (cosine ~0.96) and the rest random: the seed group `saeflow stability` matches.

Then, each in a fresh process (wall time, peak RSS from the kernel's rusage): reading the dump once (every row,
in chunks, through saeflow.analysis.csr_stream: the limit both commands are compared against), `saeflow probe` on the
dump (1000 per-example labels: codes max-pooled over the patches), and `saeflow stability` on the two runs. With
--small-too the probe also runs on a 10x smaller set of the same shape: its peak RSS should be the same (memory does
not grow with the data). Prints one table; generating takes a few minutes and ~9 GB of disk at the default size.

    python benchmarks/bench_probe.py [--n-ex 1000000] [--n-classes 1000] [--d-sae 32768] [--d-model 1024]
                                     [--tokens 4] [--k 32] [--small-too] [--dir /tmp] [--keep]
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from saeflow.analysis.csr import CsrWriter
from saeflow.store import runs, shards
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.training import sae

CHUNK_EX = 4096


def codes_of(rng, n: int, T: int, k: int, n_classes: int, d_sae: int):
    """Sorted latent ids and values (n * T, k) of n examples (a duplicate id's value set to 0), and the classes."""
    classes_n = rng.integers(0, n_classes, n)
    idx_ntk = rng.integers(n_classes, d_sae, (n, T, k))
    vals_ntk = rng.uniform(0.5, 1.5, (n, T, k)).astype(np.float32)
    where_n = rng.integers(1, T, n)  # the patch that shows the class
    idx_ntk[np.arange(n), where_n, 0] = classes_n
    vals_ntk[np.arange(n), where_n, 0] = rng.uniform(2.0, 3.0, n)
    idx_rk, vals_rk = idx_ntk.reshape(n * T, k), vals_ntk.reshape(n * T, k)
    order = np.argsort(idx_rk, axis=1)
    idx_rk, vals_rk = np.take_along_axis(idx_rk, order, 1), np.take_along_axis(vals_rk, order, 1)
    vals_rk[:, 1:][idx_rk[:, 1:] == idx_rk[:, :-1]] = 0.0
    return idx_rk, vals_rk, classes_n.astype(np.int32)


def generate(root: pathlib.Path, args, n_ex: int) -> dict:
    """The shard directory, the two runs (seeds 0 and 1) and the first run's dump; their paths."""
    T, d, S = args.tokens, args.d_model, args.d_sae
    g = torch.Generator().manual_seed(0)
    W_dec = torch.nn.functional.normalize(torch.randn(S, d, generator=g), dim=1)
    names = [f"c{c}" for c in range(args.n_classes)]
    md = shards.Metadata(family="bench", ckpt="synthetic", layers=(0,), patches_per_ex=T - 1, cls_token=True,
                         d_model=d, n_ex=n_ex, patches_per_shard=2_400_000, dtype="float16",
                         data={"__class__": "Synthetic", "n_ex": n_ex, "classes": names}, dataset="/synthetic")
    model = sae.SAE.from_weights(W_dec.T.contiguous(), torch.zeros(S), W_dec, torch.zeros(d), arch="topk", k=args.k)
    run = runs.create_run(root / "runs", {"layer": 0, "train_shards": md.hash, "tokens": "content", "seed": 0},
                          root / "shards" / md.hash)  # fmt: skip
    sae.save_sae(model, run.sae_fpath)
    dump = run.dump(md.hash)
    dump.dpath.mkdir(parents=True)
    csr = CsrWriter(dump.acts_fpath, S)
    with shards.ShardWriter(root / "shards", md, aux=(ShardLayout.CLASSES_FNAME,)) as writer:
        for lo in range(0, n_ex, CHUNK_EX):
            n = min(CHUNK_EX, n_ex - lo)
            idx_rk, vals_rk, classes_n = codes_of(np.random.default_rng([1, lo]), n, T, args.k, args.n_classes, S)
            keep = vals_rk != 0
            csr.append_nonzero(np.nonzero(keep)[0], idx_rk[keep], vals_rk[keep], n_rows=n * T)
            x_rd = torch.nn.functional.embedding_bag(torch.from_numpy(idx_rk), W_dec,
                                                     per_sample_weights=torch.from_numpy(vals_rk), mode="sum")
            x_nltd = x_rd.numpy().astype(np.float16).reshape(n, 1, T, d)
            writer.write(x_nltd, aux={ShardLayout.CLASSES_FNAME: classes_n})
    csr.finish()
    (dump.config_fpath).write_text(json.dumps({
        "run": str(run.root), "sae_sha256": file_sha256(run.sae_fpath), "shards": str(writer.dpath),
        "shard_hash": md.hash, "layer": 0, "top_k": 16, "d_model": d, "d_sae": S, "n_ex": n_ex, "tokens_per_ex": T,
        "row_order": "row = example * tokens_per_ex + token"}))  # fmt: skip
    # Seed 1: the same dictionary, permuted, 90% of the rows perturbed (cosine ~0.96), the rest new.
    other = runs.create_run(root / "runs", {**run.config(), "seed": 1}, writer.dpath)
    perm = torch.randperm(S, generator=g)
    W_b = W_dec[perm] + 0.3 / d**0.5 * torch.randn(S, d, generator=g)
    W_b[int(0.9 * S) :] = torch.randn(S - int(0.9 * S), d, generator=g)
    W_b = torch.nn.functional.normalize(W_b, dim=1)
    sae.save_sae(sae.SAE.from_weights(W_b.T.contiguous(), torch.zeros(S), W_b, torch.zeros(d), arch="topk", k=args.k),
                 other.sae_fpath)  # fmt: skip
    return {"run": run.root, "other": other.root, "shard_hash": md.hash, "dump": dump.acts_fpath}


# A process's own peak RSS: VmHWM of its memory map, printed at exit. (The kernel's rusage of a child counts the
# peak of the parent's memory the child was forked from until it exec'd: 1.3 GiB here, the generator's.)
PEAK_AT_EXIT = """
import atexit, re, sys
atexit.register(lambda: print("VmHWM", re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1),
                              file=sys.stderr))
"""
# The limit: every row of the dump, in chunks of 2^16 rows, touched once (what any reader must do), in a process that
# imports only what reading needs.
READ_ONCE = PEAK_AT_EXIT + """
from saeflow.analysis.csr_stream import CsrFile
total = 0.0
with CsrFile(sys.argv[1]) as csr:
    for _, rows in csr.iter_rows(1 << 16):
        total += float(rows.data.sum())
print(total)
"""
SAEFLOW = PEAK_AT_EXIT + """
from saeflow import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def measure(code: str, *args: str) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `python -c code args` in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return seconds, int(proc.stderr.split("VmHWM ")[-1].split()[0]) / 1024


def bench(root: pathlib.Path, args, n_ex: int) -> dict[str, tuple[float, float]]:
    t0 = time.perf_counter()
    made = generate(root, args, n_ex)
    print(f"generated {n_ex} examples in {time.perf_counter() - t0:.0f} s under {root}", flush=True)
    out = {"read the dump once": measure(READ_ONCE, str(made["dump"]))}
    out["saeflow probe"] = measure(SAEFLOW, "probe", "--run", str(made["run"]), "--shards-hash", made["shard_hash"])
    if not args.skip_stability:
        out["saeflow stability"] = measure(SAEFLOW, "stability", "--run", str(made["run"]), "--run", str(made["other"]),
                                           "--out", str(root / "stability.json"))  # fmt: skip
    probe_result = json.loads(runs.open_run(made["run"]).probe_fpath(made["shard_hash"]).read_text())
    print(f"probe metrics: {probe_result['metrics']}")
    found = np.mean([e["best_latent"]["latent"] == e["value"] for e in probe_result["labels"] if "best_latent" in e])
    print(f"classes whose best latent is their planted latent: {found:.1%}")
    if not args.skip_stability:
        print(f"stability metrics: {json.loads((root / 'stability.json').read_text())['metrics']}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-ex", type=int, default=1_000_000)
    p.add_argument("--n-classes", type=int, default=1000)
    p.add_argument("--d-sae", type=int, default=1 << 15)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=4, help="tokens per example: CLS + patches")
    p.add_argument("--k", type=int, default=32, help="active latents per token")
    p.add_argument("--small-too", action="store_true", help="also probe a 10x smaller set (peak RSS must not grow)")
    p.add_argument("--skip-stability", action="store_true")
    p.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    args = p.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench-probe-", dir=args.dir))
    try:
        results = bench(root / "full", args, args.n_ex)
        if args.small_too:
            small = bench(root / "small", argparse.Namespace(**{**vars(args), "skip_stability": True}), args.n_ex // 10)
            results[f"saeflow probe, {args.n_ex // 10} examples"] = small["saeflow probe"]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    base_sec, base_mib = results["read the dump once"]
    print(f"\n{'command':<40} {'seconds':>9} {'peak RSS MiB':>13} {'time ratio':>11} {'RSS ratio':>10}")
    for name, (sec, mib) in results.items():
        print(f"{name:<40} {sec:9.1f} {mib:13.0f} {sec / base_sec:11.2f} {mib / base_mib:10.2f}")
    if args.small_too:
        ratio = results["saeflow probe"][1] / results[f"saeflow probe, {args.n_ex // 10} examples"][1]
        print(f"probe peak RSS, {args.n_ex} / {args.n_ex // 10} examples: {ratio:.2f}")


if __name__ == "__main__":
    main()
