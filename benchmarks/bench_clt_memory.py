"""A cross-layer transcoder's memory and step time at a real model's width, against the cost model (issue 43).

    python benchmarks/bench_clt_memory.py [--d 768] [--layers 12] [--expansion 8] [--batch 512] [--steps 2]
                                          [--arch jumprelu]

Builds saeflow's CLT (training/clt.py) at GPT-2 small's width by default (d 768, 12 layers), trains `--steps` steps
on random inputs through `clt_loss` and Adam as `saeflow train` does, and prints: the parameter count against the
formula P = L (d s + s + a s) + (d s + d) L (L + 1) / 2 (s latents per layer, a the architecture's own per-latent
vectors), the training state 16 P bytes (weights, gradients, two Adam moments) against the process's peak RSS
above its start, and the seconds a step takes. It also prints what the parallel modes would send per step on N ranks
by the cost model of docs/distributed.md (data: the gradients, 2 (N-1)/N P x 4 B; latents: the (B, L d) decode
partials, 2 (N-1)/N B L d x 4 B), which saeflow does not run for CLTs yet (it refuses them in one line).
"""

import argparse
import resource
import time

import torch

from saeflow import config
from saeflow.training import clt, objectives, specs
from saeflow.training.adam import Adam
from saeflow.training.specs import SAEConfig, TrainConfig


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--expansion", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--arch", default="jumprelu")
    p.add_argument("--ranks", type=int, default=4, help="N of the communication model")
    args = p.parse_args()
    torch.set_num_threads(2)
    d, L, s = args.d, args.layers, args.expansion * args.d
    start_rss = peak_rss_bytes()
    model = clt.CLT(clt.CLTConfig(tuple(range(L)), SAEConfig(d_model=d, d_sae=s, arch=args.arch, k=32, d_out=d)))
    spec = config.validate({"activations": {}, "saes": {"c": {"train": "x", "layer": 0, "arch": args.arch,
                                                             "expansion": args.expansion, "batch_size": args.batch}}})
    hyper = {key: value for key, value in spec["saes"]["c"].items() if key not in ("train", "val")}
    cfg = TrainConfig.from_dict({"trainer": specs.trainer_of(args.arch), "train_shards": "x", "val_shards": "x",
                                 **hyper}, "bench")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    sample = [torch.randn(4096, d, generator=gen) for _ in range(2 * L)]
    clt.init_from_data(model, sample[:L], sample[L:], 0, cfg, "bench")
    del sample
    opt = Adam(model.parameters(), lr=1e-4, lr_scales=[1.0] * len(list(model.parameters())))
    deads = [objectives.DeadLatents(s, 10**9, torch.device("cpu")) for _ in range(L)]
    n_params = sum(t.numel() for t in model.parameters())
    n_own = len(model.arch.parameters(0))
    formula = L * (d * s + s + n_own * s) + (d * s + d) * L * (L + 1) // 2
    seconds = []
    for step in range(args.steps):
        batch = [torch.randn(args.batch, d, generator=gen) for _ in range(2 * L)]
        t0 = time.perf_counter()
        loss = clt.clt_loss(model, batch[:L], batch[L:], step, args.steps, deads, cfg)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    state = 16 * n_params
    rss = peak_rss_bytes() - start_rss
    N = args.ranks
    print(f"CLT {args.arch}: d {d}, {L} layers, {s:,} latents per layer ({L * s:,} in all), batch {args.batch}")
    print(f"parameters {n_params:,} (formula {formula:,}: {n_params / formula:.3f}); decoders "
          f"{(d * s + d) * L * (L + 1) // 2 / n_params:.1%} of them")
    print(f"training state 16 P = {state / 2**30:.2f} GiB; peak RSS above start {rss / 2**30:.2f} GiB "
          f"({rss / state:.2f}x: the rest is the init sample, the step's activations, (B, s) a layer, and Adam's "
          "temporaries)")
    print(f"step {min(seconds):.2f} s (best of {args.steps}), one process, 2 threads")
    print(f"per step on {N} ranks, by the cost model: data {2 * (N - 1) / N * n_params * 4 / 2**20:,.0f} MiB "
          f"(gradients); latents {2 * (N - 1) / N * args.batch * L * d * 4 / 2**20:,.1f} MiB (decode partials)")


if __name__ == "__main__":
    main()
