"""Training step of a TopK SAE against a bare-torch reference step, in the same run (AuxK idle and active).

    python benchmarks/bench_train.py [--d-model 768] [--expansion 16] [--k 32] [--batch-size 1024] [--steps 8]

Times saeflow's real step (`saeflow.training.train.Trainer.train_step`: learning-rate schedule, TopK, sparse decode,
Matryoshka-free MSE, AuxK, decoder gradient projection, Adam, renormalization, dead-latent counters, the metrics
record every LOG_EVERY steps) three times: with no dead latents (AuxK idle), with a quarter of the latents dead
(AuxK active; a run that has lost a quarter of its latents is in real trouble) and with every latent dead (AuxK's
worst case). Beside it, a reference step written with bare torch: encoder matmul, top-k, ReLU, sparse decode
(embedding_bag), squared error, backward, Adam. Limits (issue 13): step / reference <= 1.1 with AuxK idle and
<= 1.3 with AuxK active. The reference does no AuxK, so the active ratios include AuxK's own cost (its work grows
with the number of dead latents).

End to end (`--cli-steps`, default 64; 0 skips it): `saeflow train` in a subprocess on a real shard directory
(written here, float32, d_model as above, CLS + 128 tokens per example), through the shuffled loader, the batch
copy, metrics and checkpoints: its training loop's vectors/s (the "trained N steps in S s" line; start-up, the
initialization sample and validation excluded; the best of --rounds runs) against the pure step's vectors/s
measured above (AuxK idle).
Limit (issue 13): >= 0.8.
"""

import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from saeflow import devices
from saeflow.store import runs
from saeflow.store.shards import Metadata, ShardWriter
from saeflow.training import specs, train

LIMIT_IDLE, LIMIT_ACTIVE, LIMIT_CLI = 1.1, 1.3, 0.8
TOKENS_PER_EX = 129  # CLS + 128


def make_trainer(args, run: runs.Run, dev, n_steps: int, dead_frac: float, x_bd) -> train.Trainer:
    cfg = specs.TrainConfig(
        trainer=specs.trainer_of("topk"), train_shards="bench", val_shards="bench", layer=0, tokens="content",
        arch="topk",
        expansion=args.expansion, k=args.k, matryoshka=(), l1_coeff=0.0, aux_k=256, aux_alpha=1 / 32,
        dead_after_vectors=1 if dead_frac else 10**12, lr=None, lr_warmup_frac=0.05, sparsity_warmup_frac=0.0,
        batch_size=args.batch_size, n_epochs=1, n_train_vectors=None, n_val_vectors=None, seed=0, data_seed=0,
    )  # fmt: skip
    trainer = train.Trainer(run, cfg, args.d_model, n_steps=n_steps, device=dev)
    trainer.init_from_data(x_bd)
    if dead_frac:  # that fraction of the latents counts as dead: AuxK runs at every step
        trainer.dead.since_fired_s[:: round(1 / dead_frac)] = 10**9
        trainer.dead.update = lambda fired_s: None
    return trainer


class Reference:
    """The bare-torch TopK step: what any implementation must do."""

    def __init__(self, d_model: int, d_sae: int, k: int, dev):
        gen = torch.Generator().manual_seed(0)
        self.W_dec = torch.nn.Parameter(torch.randn(d_sae, d_model, generator=gen).to(dev) / d_model**0.5)
        self.W_enc = torch.nn.Parameter(self.W_dec.detach().T.clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae, device=dev))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_model, device=dev))
        self.k = k
        self.opt = torch.optim.Adam([self.W_enc, self.b_enc, self.W_dec, self.b_dec], lr=1e-3)

    def step(self, x_bd):
        pre_bs = (x_bd - self.b_dec) @ self.W_enc + self.b_enc
        vals_bk, idx_bk = pre_bs.topk(self.k, dim=-1, sorted=False)
        x_hat_bd = torch.nn.functional.embedding_bag(
            idx_bk, self.W_dec, per_sample_weights=torch.relu(vals_bk), mode="sum"
        )
        loss = (x_hat_bd + self.b_dec - x_bd).square().sum(-1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def cli_vectors_per_sec(args, cfg: specs.TrainConfig, tmp: pathlib.Path) -> float:
    """`saeflow train` end to end on a shard directory of `args.cli_steps` batches: its loop's vectors/s (the best
    of `args.rounds` runs: the VM's speed drifts by 2x between seconds, and the step timings keep their best too)."""
    n_vectors = args.cli_steps * args.batch_size
    n_ex = -(-n_vectors // (TOKENS_PER_EX - 1))  # the content tokens are trained on
    md = Metadata(
        family="clip", ckpt="bench", layers=(0,), patches_per_ex=TOKENS_PER_EX - 1, cls_token=True,
        d_model=args.d_model, n_ex=n_ex, patches_per_shard=(n_ex // 4 + 1) * TOKENS_PER_EX,
        data={"__class__": "Bench"}, dataset="/bench",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    with ShardWriter(tmp / "shards", md) as writer:
        for start in range(0, n_ex, 64):
            writer.write(rng.standard_normal((min(64, n_ex - start), 1, TOKENS_PER_EX, args.d_model), np.float32))
    best = 0.0
    for seed in range(args.rounds):  # fresh runs (new seeds), the best kept, as for the step timings
        config = dataclasses.replace(cfg, train_shards=md.hash, val_shards=md.hash, n_val_vectors=4096, seed=seed)
        run = runs.create_run(tmp / "runs", config.to_dict(), train_shards=writer.dpath, val_shards=writer.dpath)
        proc = subprocess.run(
            [sys.executable, "-m", "saeflow", "train", "--run", str(run.root), "--device", args.device],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        match = re.search(r"trained (\d+) steps in ([0-9.]+) s", proc.stderr)
        if proc.returncode != 0 or not match:
            sys.exit(f"saeflow train failed:\n{proc.stderr[-3000:]}")
        best = max(best, int(match.group(1)) * args.batch_size / float(match.group(2)))
    return best


def time_steps(step_fn, x_bd, n_steps: int, dev) -> float:
    for _ in range(2):
        step_fn(x_bd)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        step_fn(x_bd)
    _sync(dev)
    return (time.perf_counter() - t0) / n_steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--expansion", type=int, default=16)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="timed steps after 2 warm-up steps (8)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds; the best of each is kept")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cli-steps", type=int, default=64, help="steps of the end-to-end `saeflow train` (0: skip)")
    args = parser.parse_args()

    dev = devices.resolve_device(args.device)
    gen = torch.Generator().manual_seed(0)
    x_bd = torch.randn(args.batch_size, args.d_model, generator=gen).to(dev)
    n_total = (args.steps + 2) * args.rounds + 1
    dead_fracs = {"idle": 0.0, "active": 0.25, "all dead": 1.0}
    best = {"reference": float("inf"), **{name: float("inf") for name in dead_fracs}}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in dead_fracs:
            run = runs.Run(pathlib.Path(tmp) / name)
            run.checkpoint_dpath.mkdir(parents=True)
            trainers[name] = make_trainer(args, run, dev, n_total, dead_fracs[name], x_bd)
        ref = Reference(args.d_model, trainers["idle"].sae.d_sae, args.k, dev)
        for _ in range(args.rounds):  # interleaved, so a busy machine slows all three alike
            best["reference"] = min(best["reference"], time_steps(ref.step, x_bd, args.steps, dev))
            for name, trainer in trainers.items():
                best[name] = min(best[name], time_steps(trainer.train_step, x_bd, args.steps, dev))
    d_sae = trainers["idle"].sae.d_sae
    print(f"device {dev}, torch threads {torch.get_num_threads()}, d_model {args.d_model}, d_sae {d_sae}, k {args.k}")
    for name, sec in best.items():
        print(f"{name:10s} step (batch {args.batch_size}) {sec * 1e3:8.1f} ms {args.batch_size / sec:10.0f} vectors/s")
    ratio = {name: best[name] / best["reference"] for name in dead_fracs}
    print(f"ratio step / reference, AuxK idle            : {ratio['idle']:.2f}  (limit {LIMIT_IDLE})")
    print(f"ratio step / reference, AuxK active (1/4 dead): {ratio['active']:.2f}  (limit {LIMIT_ACTIVE})")
    print(f"ratio step / reference, every latent dead     : {ratio['all dead']:.2f}  (AuxK's worst case)")
    if args.cli_steps:
        with tempfile.TemporaryDirectory() as tmp:
            cli_rate = cli_vectors_per_sec(args, trainers["idle"].cfg, pathlib.Path(tmp))
        step_rate = args.batch_size / best["idle"]
        print(f"saeflow train end to end: {cli_rate:.0f} vectors/s over its loop ({args.cli_steps} steps), "
              f"pure step {step_rate:.0f} vectors/s")  # fmt: skip
        print(f"ratio end to end / pure step             : {cli_rate / step_rate:.2f}  (limit {LIMIT_CLI})")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
