"""`saeflow stability`: how many latents runs that differ only in their seeds share (decoder directions matched)."""

import argparse
import pathlib


def register(subparsers):
    p = subparsers.add_parser(
        "stability",
        help="match the latents of runs that differ only in seed/data_seed by decoder direction",
        description="For every pair of the given runs (their training configs must be equal but for seed and "
        "data_seed): the cosine of every pair of decoder rows (in blocks), the optimal one-to-one assignment "
        "(scipy.optimize.linear_sum_assignment; a cosine below 0.7 is no match), the fraction of live latents matched "
        "above cosine 0.7 and 0.9, the one-to-one matched mean cosine (matched_mean_cos: the assignment's summed "
        "cosine over the smaller number of live latents) and the mean max cosine similarity (mmcs: each live "
        "latent's best cosine, not one-to-one); their mean and standard deviation over the pairs. A latent is live "
        "when it fired in the run's dump on its validation shards (saeflow inference), or, with no such dump, when "
        "its decoder row is nonzero. Writes OUT (JSON; the summary's grouped table reads it) and prints its path.",
    )
    p.add_argument("--run", type=pathlib.Path, action="append", required=True, help="a run directory (2 or more)")
    p.add_argument("--out", type=pathlib.Path, required=True, metavar="FILE", help="the JSON to write")
    p.set_defaults(func=cmd_stability)


def cmd_stability(args: argparse.Namespace) -> int:
    from saeflow.analysis import stability

    print(stability.write_stability(args.run, args.out))
    return 0
