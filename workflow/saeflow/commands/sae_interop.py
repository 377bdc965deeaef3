"""`saeflow export-sae` and `saeflow import-sae`: SAE checkpoints to and from SAELens and sparsify."""

import argparse
import pathlib

FORMATS = ("saelens", "sparsify")  # interop.sae_checkpoints.FORMATS (not imported here: the CLI starts without torch)

EXPORT_DESCRIPTION = """\
Write the SAE of RUN (checkpoint/sae.pt) as a directory the other library loads with its own code:

  saelens   cfg.json + sae_weights.safetensors: sae_lens.SAE.load_from_disk(OUT) (relu -> standard, topk -> topk,
            batchtopk -> jumprelu with the BatchTopK threshold for every latent)
  sparsify  cfg.json + sae.safetensors: sparsify.Sae.load_from_disk(OUT) (topk only)

saeflow's input scale is folded into the weights (W_enc * scale, W_dec / scale, b_dec / scale), so the codes equal
saeflow's and the reconstruction is in raw activation space; cfg.json records the run, layer and folded scale
(SAELens: metadata.saeflow; sparsify: saeflow). OUT must not exist; it is published in one rename.
"""

IMPORT_DESCRIPTION = """\
Turn a SAELens (cfg.json + sae_weights.safetensors) or sparsify (cfg.json + sae.safetensors) SAE directory into a
saeflow run directory ROOT/<run_id>/ (checkpoint/config.json naming the origin, the weights' sha256, the layer and
the shard directory; checkpoint/sae.pt; links/train-shards -> DIR), ready for
`saeflow inference --run RUN --shards DIR` and `saeflow visuals`. The run id is the sha256 of that config, so an
import is idempotent. Architectures: SAELens standard, topk, jumprelu with one threshold for all latents
(BatchTopK); sparsify topk. The weights are read with safetensors; no code from the checkpoint runs.
"""


def register(subparsers):
    p = subparsers.add_parser("export-sae", help="write a run's SAE as a SAELens or sparsify checkpoint directory",
                              description=EXPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=pathlib.Path, help="a trained run directory")
    p.add_argument("--format", required=True, choices=FORMATS, help="which library's files to write")
    p.add_argument("out", type=pathlib.Path, metavar="OUT", help="output directory (must not exist)")
    p.set_defaults(func=cmd_export_sae)

    p = subparsers.add_parser("import-sae", help="make a run directory from a SAELens or sparsify SAE checkpoint",
                              description=IMPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=pathlib.Path, metavar="SRC", help="the SAE directory (holding cfg.json)")
    p.add_argument("--format", choices=FORMATS, default=None, help="default: detected from the weights file name")
    p.add_argument("--runs-root", required=True, type=pathlib.Path, help="where run directories <run_id>/ live")
    p.add_argument("--shards", required=True, type=pathlib.Path, help="the shard directory the SAE will read")
    p.add_argument("--layer", type=int, default=None,
                   help="the stored layer the SAE reads (optional when the shards store one layer)")
    p.set_defaults(func=cmd_import_sae)


def cmd_export_sae(args: argparse.Namespace) -> int:
    from saeflow.interop import sae_checkpoints

    print(sae_checkpoints.export_run(args.run, args.format, args.out))
    return 0


def cmd_import_sae(args: argparse.Namespace) -> int:
    from saeflow.interop import sae_checkpoints

    run = sae_checkpoints.import_checkpoint(args.src, args.runs_root, args.shards, layer=args.layer, fmt=args.format)
    print(run.root)
    return 0
