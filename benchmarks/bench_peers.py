"""saeflow against sparsify, SAELens and a bare-torch reference: TopK training and inference on one shard directory.

    python benchmarks/bench_peers.py [--sizes 768x16:32 2048x32:64] [--n-vectors 65536 16384] [--batch-size 4096]
                                     [--rounds 1] [--threads 1] [--sides saeflow,bare,sparsify,saelens]
    python benchmarks/bench_peers.py --arch batchtopk   # saeflow and SAELens's BatchTopK, training only

Per size (d_model x expansion : k), one protocol-2.0 shard directory (float32, CLS + 128 tokens per example) is
written; every side trains a TopK SAE (one Adam step per batch of --batch-size, one epoch) on its vectors, each in
its own process with --threads torch threads:
- saeflow: `saeflow train` as users run it (its shuffled loader, metrics, checkpoints), timed by its own log line
  ("trained N steps in S s (C CPU-s ...)"; start-up, initialization and validation excluded); and the same run at
  each earlier trainer version the architecture still trains (saeflow-train-3: autograd's dense encoder gradient);
- bare, sparsify (1.3.3), SAELens (6.54.12): benchmarks/_peers_speed.py, timed around their loops;
and then inference over every stored token of the directory: `saeflow inference` (run_inference: CSR, latents.npz,
metrics) against a bare loop that writes the same CSR entries and the metrics' sums.

Figures are vectors per CPU-second of each process (`time.process_time`: a loaded machine does not decide the
ratio), the median of --rounds, and each process's peak RSS. SAELens and sparsify come from the install
tests/test_sae_interop.py makes (bench_planted.peers_site). Targets (issue 44): saeflow train at or above the
fastest peer and within 1.1 of the bare reference (CPU-s per vector), inference at least 0.9 of the bare loop.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from saeflow.store import runs
from saeflow.store.shards import Metadata, ShardWriter
from saeflow.training import archs, specs

HERE = pathlib.Path(__file__).parent
TOKENS_PER_EX = 129  # CLS + 128 content tokens
TARGET_PEER, TARGET_BARE, TARGET_INFERENCE = 1.0, 1.1, 0.9


@dataclasses.dataclass(frozen=True)
class Size:
    d_model: int
    expansion: int
    k: int

    @classmethod
    def parse(cls, text: str) -> "Size":
        match = re.fullmatch(r"(\d+)x(\d+):(\d+)", text)
        if not match:
            raise SystemExit(f"--sizes: {text!r} is not D_MODELxEXPANSION:K (e.g. 768x16:32)")
        return cls(*(int(g) for g in match.groups()))


def write_shards(root: pathlib.Path, d_model: int, n_vectors: int) -> pathlib.Path:
    """Random vectors with a low-rank part (so a TopK SAE has something to fit), `n_vectors` content tokens."""
    n_ex = -(-n_vectors // (TOKENS_PER_EX - 1))
    md = Metadata(family="clip", ckpt="bench-peers", layers=(0,), patches_per_ex=TOKENS_PER_EX - 1, cls_token=True,
                  d_model=d_model, n_ex=n_ex, patches_per_shard=(n_ex // 4 + 1) * TOKENS_PER_EX,
                  data={"__class__": "BenchPeers"}, dataset="/bench-peers")  # fmt: skip
    rng = np.random.default_rng(0)
    dirs_rd = rng.standard_normal((64, d_model)).astype(np.float32)
    with ShardWriter(root, md) as writer:
        for start in range(0, n_ex, 16):
            n = min(16, n_ex - start)
            noise = rng.standard_normal((n, 1, TOKENS_PER_EX, d_model), np.float32)
            writer.write(noise + rng.random((n, 1, TOKENS_PER_EX, 64), np.float32) @ dirs_rd)
    return writer.dpath


def timed(cmd: list[str], env: dict) -> tuple[str, str, float]:
    """(stdout, stderr, peak RSS in GiB) of one process, its rusage its own (os.wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{stderr[-3000:]}")
    return stdout, stderr, usage.ru_maxrss / 2**20


def env_for(threads: int, peers: pathlib.Path | None = None) -> dict:
    paths = [str(HERE.parent / "workflow"), *([str(peers)] if peers else [])]
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join(paths)}  # fmt: skip


def saeflow_train(run_root: pathlib.Path, threads: int) -> dict:
    _, stderr, rss = timed([sys.executable, "-m", "saeflow", "train", "--run", str(run_root), "--device", "cpu"],
                           env_for(threads))  # fmt: skip
    match = re.search(r"trained (\d+) steps in ([0-9.]+) s \(([0-9.]+) CPU-s", stderr)
    if not match:
        sys.exit(f"saeflow train printed no timing line:\n{stderr[-2000:]}")
    n = int(match.group(1)) * runs.Run(run_root).config()["batch_size"]
    return {"vectors": n, "cpu_s": float(match.group(3)), "rss_gib": rss}


def peer_side(job: dict, peers: pathlib.Path | None) -> dict:
    stdout, _, rss = timed([sys.executable, str(HERE / "_peers_speed.py"), json.dumps(job)],
                           env_for(job["threads"], peers))  # fmt: skip
    return {**json.loads(stdout.strip().splitlines()[-1]), "rss_gib": rss}


def make_run(tmp: pathlib.Path, shards_dpath: pathlib.Path, size: Size, args, seed: int, aux: bool,
             trainer: str | None = None) -> pathlib.Path:  # fmt: skip
    """A run of --arch at saeflow's defaults (`trainer`: its architecture's now). `aux`: the default dead-latent
    window (a tenth of the run: in a benchmark of a few steps AuxK is active from the second on); otherwise OpenAI's
    10M vectors, so AuxK stays idle, as in a healthy run's first window."""
    cfg = specs.TrainConfig(
        trainer=trainer or specs.trainer_of(args.arch), train_shards=shards_dpath.name, val_shards=shards_dpath.name,
        layer=0, tokens="content", arch=args.arch, expansion=size.expansion, k=size.k, matryoshka=(), l1_coeff=0.0,
        aux_k=256, aux_alpha=1 / 32, dead_after_vectors=None if aux else 10_000_000, lr=None, lr_warmup_frac=0.05,
        sparsity_warmup_frac=0.0, batch_size=args.batch_size, n_epochs=1, n_train_vectors=None,
        n_val_vectors=args.batch_size, seed=seed, data_seed=0,
    )  # fmt: skip
    return runs.create_run(tmp / "runs", cfg.to_dict(), train_shards=shards_dpath, val_shards=shards_dpath).root


def rate(result: dict) -> float:
    return result["vectors"] / result["cpu_s"]


def bench_size(size: Size, n_vectors: int, args, peers: pathlib.Path | None) -> dict:
    sides, arch = args.sides.split(","), {"topk": "TopK", "batchtopk": "BatchTopK"}[args.arch]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        shards_dpath = write_shards(tmp / "shards", size.d_model, n_vectors)
        job = {"shards": str(shards_dpath), "d_model": size.d_model, "d_sae": size.d_model * size.expansion,
               "k": size.k, "batch_size": args.batch_size, "threads": args.threads, "arch": args.arch}  # fmt: skip
        run_root = None
        for seed in range(args.rounds):  # interleaved rounds: a machine whose load drifts slows every side alike
            for side in sides:
                if side == "saeflow":
                    for trainer in archs.get(args.arch).earlier_trainers:  # the maths its runs had before
                        run_root = make_run(tmp, shards_dpath, size, args, seed, aux=False, trainer=trainer)
                        results.setdefault(f"saeflow train, {trainer}", []).append(
                            {**saeflow_train(run_root, args.threads), "computes": f"{arch}, AuxK idle, Adam, dense"})
                    run_root = make_run(tmp, shards_dpath, size, args, seed, aux=True)
                    results.setdefault("saeflow train, AuxK active", []).append(
                        {**saeflow_train(run_root, args.threads), "computes": f"{arch}, AuxK active, Adam"})
                    run_root = make_run(tmp, shards_dpath, size, args, seed, aux=False)
                    result = {**saeflow_train(run_root, args.threads), "computes": f"{arch}, AuxK idle, Adam"}
                else:
                    result = peer_side({**job, "side": f"{side}-train"}, peers if side in ("sparsify", "saelens")
                                       else None)  # fmt: skip
                results.setdefault(f"{side} train", []).append(result)
            if run_root is not None and args.inference:
                for side in ("saeflow", "bare"):
                    result = peer_side({**job, "side": f"{side}-inference", "run": str(run_root)}, None)
                    results.setdefault(f"{side} inference", []).append(result)
                    for dump in (run_root / "inference").glob("*"):  # the next round writes a fresh dump
                        subprocess.run(["chmod", "-R", "u+w", str(dump)], check=True)
                        subprocess.run(["rm", "-rf", str(dump)], check=True)
    return results


def report(size: Size, results: dict) -> list[str]:
    """The size's table; returns the targets it misses."""
    med = {name: statistics.median(rate(r) for r in rs) for name, rs in results.items()}
    print(f"\n### d_model {size.d_model}, {size.expansion}x = {size.d_model * size.expansion} latents, k {size.k}\n")
    print("| side | vectors per CPU-s (median) | rounds | peak RSS GiB | computes | saeflow / side |")
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        mine = "saeflow inference" if name.endswith("inference") else "saeflow train"  # AuxK idle, as the peers
        ratio = med[mine] / med[name] if mine in med else float("nan")
        rounds = ", ".join(f"{rate(r):.0f}" for r in rs)
        print(f"| {name} | {med[name]:.0f} | {rounds} | {max(r['rss_gib'] for r in rs):.2f} | {rs[0]['computes']} | "
              f"{ratio:.2f} |")  # fmt: skip
    missed = []
    if "saeflow train" in med:
        peers = [med[n] for n in ("sparsify train", "saelens train") if n in med]
        if peers and med["saeflow train"] < TARGET_PEER * max(peers):
            missed.append(f"{size}: saeflow train below the fastest peer")
        if "bare train" in med and med["bare train"] / med["saeflow train"] > TARGET_BARE:
            missed.append(f"{size}: saeflow train beyond {TARGET_BARE} of the bare reference")
    if "bare inference" in med and med["saeflow inference"] / med["bare inference"] < TARGET_INFERENCE:
        missed.append(f"{size}: saeflow inference below {TARGET_INFERENCE} of the bare loop")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["768x16:32", "2048x32:64"])
    parser.add_argument("--n-vectors", type=int, nargs="+", default=[65536, 16384], help="per size (content tokens)")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1: the issue's protocol)")
    parser.add_argument("--sides", default=None, help="default: saeflow,bare,sparsify,saelens (batchtopk: saeflow,"
                        "saelens: sparsify trains no BatchTopK, the bare loop is TopK's)")
    parser.add_argument("--arch", choices=["topk", "batchtopk"], default="topk",
                        help="batchtopk: also saeflow's earlier trainer (the dense maths) and no inference")
    parser.add_argument("--no-inference", dest="inference", action="store_false")
    args = parser.parse_args()
    args.sides = args.sides or ("saeflow,bare,sparsify,saelens" if args.arch == "topk" else "saeflow,saelens")
    args.inference = args.inference and args.arch == "topk"  # the bare inference loop is TopK's
    sizes = [Size.parse(s) for s in args.sizes]
    n_vectors = (args.n_vectors * len(sizes))[: len(sizes)] if len(args.n_vectors) == 1 else args.n_vectors
    if len(n_vectors) != len(sizes):
        raise SystemExit("--n-vectors: one count, or one per size")
    peers = None
    if {"sparsify", "saelens"} & set(args.sides.split(",")):
        sys.path.insert(0, str(HERE))
        from bench_planted import peers_site

        peers = peers_site("drop sparsify,saelens from --sides")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.threads} torch thread(s) per process, "
          f"batch {args.batch_size}")  # fmt: skip
    missed = []
    for size, n in zip(sizes, n_vectors):
        missed += report(size, bench_size(size, n, args, peers))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    print("targets met" if not missed else "targets missed: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
