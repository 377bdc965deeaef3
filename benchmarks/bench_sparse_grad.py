"""The crossover between the dense and the picks-only encoder gradient of a TopK SAE (training/picks.py), on a grid.

    python benchmarks/bench_sparse_grad.py [--d-model 256 768 2048] [--expansion 8 16 32] [--k 32 64 128]
                                           [--batch-size 1024 4096] [--threads 1] [--rounds 2]

In each cell, a real SAE's encoder part of a training step: `PreActs` (pre-activations), top k, the gather of the
picks and the backward of a loss on them, three ways: autograd's (a run of an earlier trainer), and `_PickedPreActs`
with its dense and its sparse (CSR) backward forced; CPU seconds of this process (the best of --rounds), so a loaded
machine does not decide the ratio. Prints, per cell, the times, dense / sparse, the backward `picks.sparse_picks`
chooses and whether it is the faster (or within 5% of it), and the relative error of the sparse dW_enc against
autograd's. Exits 1 when the rule picks a backward more than 5% slower than the other in some cell: the crossover in
picks.py must then move.
"""

import argparse
import functools
import itertools
import sys
import time
import warnings

import torch

from saeflow.training import picks, sae, specs

SLACK = 1.05
RULE = picks.sparse_picks
FORCED = {"autograd": RULE, "dense": lambda *_: False, "sparse": lambda *_: True}
WAYS = tuple(FORCED)


def make_sae(d_model: int, expansion: int, k: int) -> sae.SAE:
    cfg = specs.SAEConfig(arch="topk", d_model=d_model, d_sae=d_model * expansion, k=k)
    model = sae.SAE(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.W_enc.copy_(torch.randn(d_model, d_model * expansion, generator=gen) / d_model**0.5)
        model.b_dec.copy_(torch.randn(d_model, generator=gen) * 0.1)
    return model


def encoder_step(model: sae.SAE, xn_bd: torch.Tensor, k: int, r_bk: torch.Tensor, way: str) -> torch.Tensor:
    """One forward and backward; `way`: autograd, dense or sparse (the picked backward forced to that kernel)."""
    model.zero_grad(set_to_none=True)
    picks.sparse_picks = FORCED[way]
    pre = picks.PreActs(model, xn_bd, picked=way != "autograd")
    with torch.no_grad():
        idx_bk = pre.pre_bs.topk(k, dim=-1, sorted=False).indices
    (torch.relu(pre.gather(idx_bk)) * r_bk).sum().backward()
    return model.W_enc.grad


def cpu_seconds(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, nargs="+", default=[256, 768, 2048])
    parser.add_argument("--expansion", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--k", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the peers' protocol)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    print(f"torch {torch.__version__}, {args.threads} thread(s); CPU seconds of the encoder's forward and backward")
    print("| d_model | expansion | k | batch | autograd ms | dense ms | sparse ms | dense / sparse | rule | ok | "
          "dW err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for d, e, b in itertools.product(args.d_model, args.expansion, args.batch_size):
        gen = torch.Generator().manual_seed(1)
        xn_bd = torch.randn(b, d, generator=gen)
        for k in args.k:
            model = make_sae(d, e, k)
            r_bk = torch.randn(b, k, generator=gen)
            times, grads = {}, {}
            for way in WAYS:
                grads[way] = encoder_step(model, xn_bd, k, r_bk, way).clone()
                step = functools.partial(encoder_step, model, xn_bd, k, r_bk, way)
                times[way] = cpu_seconds(step, args.rounds)
            rule = "sparse" if RULE(k, d * e, torch.device("cpu")) else "dense"
            ok = times[rule] <= SLACK * min(times["dense"], times["sparse"])
            bad += not ok
            err = float((grads["sparse"] - grads["autograd"]).norm() / grads["autograd"].norm())
            ms = " | ".join(f"{times[way] * 1e3:.0f}" for way in WAYS)
            print(f"| {d} | {e} | {k} | {b} | {ms} | {times['dense'] / times['sparse']:.2f} | {rule} | "
                  f"{'yes' if ok else 'NO'} | {err:.1e} |", flush=True)  # fmt: skip
    print(f"rule picks the faster path (within {SLACK:.2f}) in {'every cell' if not bad else f'all but {bad} cells'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
