"""`saeflow migrate`: move a tree published by an earlier shard layout to this one (saeflow.migration)."""

import argparse
import pathlib

from saeflow import config


def register(subparsers):
    p = subparsers.add_parser(
        "migrate",
        help="move a published tree (shards and runs) to this saeflow's layout, recomputing nothing",
        description="Layout 2 gives an activation spec a shard directory per layer (layout 1: one directory of every "
        "layer), so adding a layer extracts only that layer and retrains nothing. For each activation of CONFIG "
        "with several layers, this cuts its published layout-1 directory into per-layer directories (the same "
        "vectors, no model run), moves each run on them to its new run id (hard links; the text files that name an "
        "old hash or id rewritten, time stamps kept), and writes the summary again from the moved runs. Nothing "
        "published is changed or removed: the layout-1 directories and runs are listed at the end, to remove once "
        "checked. Afterwards `snakemake -n` with CONFIG plans no extraction, training, inference or evaluation (a run "
        "made by a trainer its architecture has since moved on from moves under its own trainer's id, and is trained "
        "anew unless CONFIG pins that `trainer:` on its SAE: the output says which). Safe to rerun.",
    )
    p.add_argument("config", type=pathlib.Path, metavar="CONFIG", help="the workflow config whose tree to migrate")
    p.add_argument("--dry-run", action="store_true", help="say what would move, and move nothing")
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    from saeflow import migration
    from saeflow.planning import WorkflowPlan

    plan = WorkflowPlan.from_config(config.load(args.config))
    n = 0
    for line in migration.migrate(plan, dry_run=args.dry_run):
        print(("would move " if args.dry_run and not line.startswith("kept") else "") + line)
        n += 1
    if n == 0:
        print(f"nothing to migrate: the tree of {args.config} is in layout 2")
    return 0
