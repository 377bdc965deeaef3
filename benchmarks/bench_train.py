"""Training throughput of a TopK SAE (d=768, 16x expansion) on CPU, against the dense-matmul limit of this machine.

    python benchmarks/bench_train.py [--d-model 768] [--expansion 16] [--batch-size 1024] [--steps 8]

Runs the real trainer (`saeflow.train.Trainer.train_step`: TopK, AuxK, decoder renormalization, Adam) on random
activations, and in the same run times the two dense (batch, d_model) x (d_model, d_sae) matmuls that any SAE
training step needs (encoder forward and encoder weight gradient; the TopK decoder is sparse) with `torch.mm`.
The ratio says how close the step is to that limit.
"""

import argparse
import pathlib
import tempfile
import time

import torch

from saeflow import devices, runs, sweeps, train


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--expansion", type=int, default=16)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="timed steps after 2 warm-up steps (8)")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    dev = devices.resolve_device(args.device)
    cfg = sweeps.TrainConfig(
        trainer=sweeps.TRAINER, train_shards="bench", val_shards="bench", layer=0, tokens="content", arch="topk",
        expansion=args.expansion, k=args.k, matryoshka=(), l1_coeff=0.0, aux_k=256, aux_alpha=1 / 32,
        dead_after_vectors=args.batch_size, lr=4e-4, lr_warmup_frac=0.05, sparsity_warmup_frac=0.0,
        batch_size=args.batch_size, n_epochs=1, n_train_vectors=None, n_val_vectors=None, seed=0, data_seed=0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x_bd = torch.randn(args.batch_size, args.d_model, generator=gen).to(dev)
    with tempfile.TemporaryDirectory() as tmp:
        run = runs.Run(pathlib.Path(tmp))
        run.checkpoint_dpath.mkdir()
        trainer = train.Trainer(run, cfg, args.d_model, n_steps=args.steps + 2, device=dev)
        trainer.init_from_data(x_bd)
        for _ in range(2):
            trainer.train_step(x_bd)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(x_bd)
        _sync(dev)
        t_step = (time.perf_counter() - t0) / args.steps
        d_sae = trainer.sae.d_sae

    W_ds = torch.randn(args.d_model, d_sae, device=dev)
    f_bs = torch.randn(args.batch_size, d_sae, device=dev)
    for _ in range(2):
        _encoder_matmuls(x_bd, W_ds, f_bs)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        _encoder_matmuls(x_bd, W_ds, f_bs)
    _sync(dev)
    t_mm = (time.perf_counter() - t0) / args.steps

    print(f"device {dev}, torch threads {torch.get_num_threads()}, d_model {args.d_model}, d_sae {d_sae}, k {args.k}")
    print(f"train step (batch {args.batch_size})   {t_step * 1e3:8.1f} ms  {args.batch_size / t_step:10.0f} examples/s")
    print(f"2 encoder matmuls (limit)    {t_mm * 1e3:8.1f} ms  {args.batch_size / t_mm:10.0f} examples/s")
    print(f"ratio train / matmul limit : {t_mm / t_step:.2f}")


def _encoder_matmuls(x_bd, W_ds, f_bs):
    torch.mm(x_bd, W_ds)  # encoder forward
    torch.mm(x_bd.T, f_bs)  # encoder weight gradient


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
