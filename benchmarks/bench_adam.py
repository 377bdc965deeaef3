"""saeflow's Adam step (`saeflow.training.adam.Adam`) against torch.optim.Adam on one SAE's parameters, same run.

    python benchmarks/bench_adam.py [--d-model 768] [--d-sae 16384] [--steps 15] [--threads 2]

Both optimizers step the same parameters with the same gradients; the script prints each one's time per step,
the ratio (limit: <= 1.1, since saeflow's Adam exists to skip torch.optim's import of torch._dynamo, not to be
slower) and whether the parameters are bitwise equal afterwards (they must be). Exits 1 when either fails.
"""

import argparse
import sys
import time

import torch

from saeflow.training.adam import Adam

LIMIT = 1.1


def sae_params(d_model: int, d_sae: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(d_model, d_sae), (d_sae,), (d_sae, d_model), (d_model,)]  # W_enc, b_enc, W_dec, b_dec
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]


def seconds_per_step(make_opt, args) -> tuple[float, list[torch.nn.Parameter]]:
    params = sae_params(args.d_model, args.d_sae)
    gen = torch.Generator().manual_seed(1)
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    opt = make_opt(params)
    opt.step()  # warm-up: allocates the moments
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.step()
    return (time.perf_counter() - start) / args.steps, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-sae", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ours_s, ours = seconds_per_step(lambda params: Adam(params, lr=1e-3), args)
    torch_s, theirs = seconds_per_step(lambda params: torch.optim.Adam(params, lr=1e-3), args)
    equal = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    ratio = ours_s / torch_s
    print(f"d_model={args.d_model} d_sae={args.d_sae}, {args.threads} threads: "
          f"saeflow Adam {ours_s * 1e3:.1f} ms/step, torch.optim.Adam {torch_s * 1e3:.1f} ms/step; "
          f"ratio {ratio:.2f} (limit {LIMIT}); bitwise equal: {equal}")
    return 0 if equal and ratio <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
