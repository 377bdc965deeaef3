"""`saeflow inference` and `saeflow visuals`: dump SAE codes on a shard directory, then draw them."""

import argparse
import pathlib

from saeflow import config

# inference/visuals import torch: load them only when their command runs, so `saeflow --help` stays fast.


def register(subparsers):
    p = subparsers.add_parser(
        "inference",
        help="run a trained SAE over a shard directory: RUN/inference/<shard_hash>/",
        description="Encode every stored token of the run's layer with the run's SAE, streaming, and publish "
        "RUN/inference/<shard_hash>/ atomically: patch_acts.npz (scipy CSR, row = example * tokens_per_ex + token, "
        "one column per latent), latents.npz (firing frequency, mean activation when firing, top-k rows per "
        "latent, L0 histogram), metrics.json (NMSE, L0, explained variance, dead/dense counts) and config.json. "
        "An existing dump with the same settings is reused. Memory is bounded by --batch-size and --top-k.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory (has checkpoint/sae.pt)")
    p.add_argument("--shards", type=pathlib.Path, required=True, metavar="DIR", help="a shard directory <root>/<hash>")
    d = config.section_defaults("inference")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="rows kept per latent (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="rows per forward pass (default %(default)s)")
    p.add_argument("--dense-freq", type=float, default=d["dense_freq"],
                   help="firing frequency above which a latent counts as dense (default %(default)s)")
    p.add_argument("--device", default=d["device"], help="torch device; auto = cuda when visible (default %(default)s)")
    p.set_defaults(func=cmd_inference)

    p = subparsers.add_parser(
        "visuals",
        help="draw an inference dump: RUN/inference/<hash>/visuals/ (open index.html)",
        description="Draw the chosen latents of an inference dump into RUN/inference/<hash>/visuals/: per latent "
        "a grid of its top-k images with a patch heatmap (patch labels below when the shards have labels.bin) or "
        "its top-k text contexts shaded by strength; summary plots (log frequency vs log mean activation, L0 "
        "histogram); and index.html, a static latent browser that works from file:// (search by id, sort by "
        "frequency). Existing visuals are reused unless --force.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory")
    p.add_argument("--shards-hash", metavar="HASH", help="which inference dump (optional when the run has one)")
    d = config.section_defaults("visuals")
    p.add_argument("--selection", choices=config.section_enum("visuals", "selection"), default=d["selection"],
                   help="which latents to draw (default %(default)s); `list` draws --latents")
    p.add_argument("--n-latents", type=int, default=d["n_latents"], help="how many (default %(default)s)")
    p.add_argument("--latents", type=int, nargs="+", default=d["latents"], metavar="ID",
                   help="explicit latent ids; implies --selection list")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="examples per latent (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of --selection random (default %(default)s)")
    p.add_argument("--tile-px", type=int, default=d["tile_px"], help="image tile side (default %(default)s)")
    p.add_argument("--context-tokens", type=int, default=d["context_tokens"],
                   help="text tokens shown each side of the firing token (default %(default)s)")
    p.add_argument("--tokenizer", metavar="ID_OR_DIR",
                   help="tokenizer for text shards; needed when they came from a local model directory (the metadata "
                   "holds only its fingerprint), else token ids are shown")
    p.add_argument("--force", action="store_true", help="redraw even if visuals/ exists (replaced atomically)")
    p.set_defaults(func=cmd_visuals)


def cmd_inference(args: argparse.Namespace) -> int:
    from saeflow import inference

    cfg = inference.Config(
        run=args.run,
        shards=args.shards,
        top_k=args.top_k,
        batch_size=args.batch_size,
        dense_freq=args.dense_freq,
        device=args.device,
    )
    print(inference.run_inference(cfg))
    return 0


def cmd_visuals(args: argparse.Namespace) -> int:
    from saeflow import visuals

    cfg = visuals.Config(
        run=args.run,
        shards_hash=args.shards_hash,
        selection="list" if args.latents else args.selection,
        n_latents=args.n_latents,
        latents=tuple(args.latents),
        top_k=args.top_k,
        seed=args.seed,
        tile_px=args.tile_px,
        context_tokens=args.context_tokens,
        tokenizer=args.tokenizer,
        force=args.force,
    )
    print(visuals.make_visuals(cfg) / "index.html")
    return 0
