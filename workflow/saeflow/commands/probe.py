"""`saeflow probe`: which latents of a run's SAE predict the labels of its validation shard directory."""

import argparse
import pathlib

from saeflow import config
from saeflow.errors import say

# probe imports scikit-learn, scipy and torch (the loaders): load it only when the command runs.


def register(subparsers):
    p = subparsers.add_parser(
        "probe",
        help="sparse probing: which latents predict the labels of the dump's shards (labels.bin, classes.bin)",
        description="For every label of the dump's shard directory (labels.bin: per patch; classes.bin: per "
        "example, codes max-pooled over the SAE's tokens; a negative class id, -1, marks an unlabelled example, "
        "left out), on a seeded split by example and balanced samples (per label as many negatives as positives "
        "where the data hold them): the "
        "best single latent (its held-out AUROC and F1), k-sparse probes (the k latents of largest mean difference, "
        "then scikit-learn's logistic regression) and a dense logistic-regression probe on the raw activations. "
        "Reads the inference dump and the shards in chunks (memory bounded by --max-units). Writes "
        "RUN/probe/<shard_hash>.json (the summary reads it) and puts the labels each latent predicts on the dump's "
        "latent pages (visuals/labels.js); prints the JSON's path. When no label can be probed (one class, every "
        "unit unlabelled, too few positives), it says why per label on stderr and still writes the JSON. A k of "
        "--ks above the SAE's d_sae is refused.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, help="the run directory (holds an inference dump)")
    p.add_argument("--shards-hash", metavar="HASH", help="which inference dump (optional when the run has one)")
    p.add_argument("--shards", type=pathlib.Path, metavar="DIR",
                   help="the dump's shard directory (default: the path the dump's config.json records)")
    config.add_section_options(p, "probe")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    import json

    from saeflow.analysis import probe

    out_fpath = probe.run_probe(config.from_args(probe.ProbeConfig, args))
    for line in probe.skip_warnings(json.loads(out_fpath.read_text())):
        say(f"saeflow probe: warning: {line}")
    print(out_fpath)
    return 0
