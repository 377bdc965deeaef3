"""`saeflow inference` and `saeflow visuals`: dump SAE codes on a shard directory, then draw them."""

import argparse
import pathlib

from saeflow import config
from saeflow.store import layout

# inference/visuals import torch: load them only when their command runs, so `saeflow --help` stays fast.


def register(subparsers):
    p = subparsers.add_parser(
        "inference",
        help="run a trained SAE over a shard directory: RUN/inference/<shard_hash>/",
        description="Encode every stored token of the run's layer with the run's SAE, streaming, and publish "
        "RUN/inference/<shard_hash>/ atomically: patch_acts.npz (scipy CSR, row = example * tokens_per_ex + token, "
        "one column per latent), latents.npz (firing frequency, mean activation when firing, the top-k examples "
        "per latent, L0 histogram) and metrics.json (NMSE, L0, explained variance, dead/dense counts), both over the "
        "tokens the SAE trained on (the run's `tokens`; metrics.json's all_tokens: over every token), and config.json. "
        "An existing dump with the same checkpoint and settings is reused. Memory is bounded by --batch-size and "
        "--top-k.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory (holds a trained SAE)")
    p.add_argument("--shards", type=pathlib.Path, required=True, metavar="DIR", help="a shard directory <root>/<hash>")
    config.add_section_options(p, "inference")
    p.add_argument(
        "--replace-stale", action="store_true",
        help="replace an existing dump made from another checkpoint (sae.pt) or with other result settings, "
        "atomically (the old one stays in place if the new one fails); without it such a dump is an error",
    )  # fmt: skip
    p.set_defaults(func=cmd_inference)

    p = subparsers.add_parser(
        "visuals",
        help="draw an inference dump: RUN/inference/<hash>/visuals/ (open index.html)",
        description="Draw the chosen latents of an inference dump into RUN/inference/<hash>/visuals/: per latent "
        "an activation histogram, its top-k images with a patch heatmap (patch labels below when the shards have "
        "labels.bin) or its top-k text contexts (the tokenizer's own detokenization, specials marked), examples "
        "sampled from activation quantile bands, and for text the tokens its decoder direction promotes and "
        "suppresses; summary plots (log frequency vs log mean activation, L0 histogram); index.html, a static "
        "latent browser that works from file:// (search by id or token, sort by frequency); and for text runs "
        "neuronpedia-batch.json (SAEDashboard's Neuronpedia batch format). Existing visuals are reused unless --force.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory")
    p.add_argument("--shards-hash", metavar="HASH", help="which inference dump (optional when the run has one)")
    config.add_section_options(p, "visuals")  # --latents implies --selection list
    p.add_argument("--tokenizer", metavar="ID_OR_DIR",
                   help="tokenizer for text shards; needed when they came from a local model directory (the metadata "
                   "holds only its fingerprint), else token ids are shown")
    p.add_argument("--force", action="store_true", help="redraw even if visuals/ exists (replaced atomically)")
    p.set_defaults(func=cmd_visuals)


def cmd_inference(args: argparse.Namespace) -> int:
    from saeflow.analysis import inference

    print(inference.run_inference(config.from_args(inference.InferenceConfig, args)))
    return 0


def cmd_visuals(args: argparse.Namespace) -> int:
    from saeflow.analysis import visuals

    cfg = config.from_args(visuals.VisualsConfig, args, selection="list" if args.latents else args.selection)
    print(layout.VisualsLayout(visuals.make_visuals(cfg)).index_fpath)
    return 0
