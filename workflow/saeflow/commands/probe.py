"""`saeflow probe`: which latents of a run's SAE predict the labels of its validation shard directory."""

import argparse
import pathlib

from saeflow import config

# probe imports scikit-learn, scipy and torch (the loaders): load it only when the command runs.


def register(subparsers):
    p = subparsers.add_parser(
        "probe",
        help="sparse probing: which latents predict the labels of the dump's shards (labels.bin, classes.bin)",
        description="For every label of the dump's shard directory (labels.bin: per patch; classes.bin: per "
        "example, codes max-pooled over the SAE's tokens), on a seeded split by example and balanced samples: the "
        "best single latent (its held-out AUROC and F1), k-sparse probes (the k latents of largest mean difference, "
        "then scikit-learn's logistic regression) and a dense logistic-regression probe on the raw activations. "
        "Reads the inference dump and the shards in chunks (memory bounded by --max-units). Writes "
        "RUN/probe/<shard_hash>.json (the summary reads it) and puts the labels each latent predicts on the dump's "
        "latent pages (visuals/labels.js); prints the JSON's path.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory (holds an inference dump)")
    p.add_argument("--shards-hash", metavar="HASH", help="which inference dump (optional when the run has one)")
    p.add_argument("--shards", type=pathlib.Path, metavar="DIR",
                   help="the dump's shard directory (default: the path the dump's config.json records)")
    config.add_section_options(p, "probe")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    from saeflow.analysis import probe

    print(probe.run_probe(config.from_args(probe.ProbeConfig, args)))
    return 0
