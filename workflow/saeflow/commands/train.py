"""`saeflow create-run` and `saeflow train`: plan a run directory from the config, then train it."""

import argparse
import json
import pathlib

from saeflow import config as config_mod
from saeflow import runs, sweeps
from saeflow.errors import SaeflowError


def register(subparsers):
    p = subparsers.add_parser(
        "create-run",
        help="create (or find) the run directory of one sweep point; prints its path",
        description="Expand the SAE spec NAME of CONFIG into its sweep (the cartesian product of list-valued keys), "
        "take point INDEX, and create <runs-root>/<run_id>/ with checkpoint/config.json (the hashed training config) "
        "and links/ to the train/val shard directories and their source datasets. Idempotent; prints the run dir.",
    )
    p.add_argument("config", type=pathlib.Path, metavar="CONFIG", help="workflow config (YAML)")
    p.add_argument("--sae", default=None, help="name of the entry under `saes` (optional when there is one)")
    p.add_argument("--index", type=int, default=0, help="point of the sweep (0-based; see docs/training.md)")
    p.add_argument("--shards-root", type=pathlib.Path, required=True, help="where shard directories <hash>/ live")
    p.add_argument("--runs-root", type=pathlib.Path, required=True, help="where run directories <run_id>/ live")
    p.set_defaults(func=cmd_create_run)

    p = subparsers.add_parser(
        "train",
        help="train SAE runs (resumes after a crash); several runs on the same data share one pass",
        description="Train each --run (a directory made by create-run) to checkpoint/sae.pt, writing "
        "checkpoint/metrics.jsonl during training and checkpoint/metrics.json (validation) at the end. "
        "Runs that read the same shards, layer, tokens, batch size and data seed train in one pass over the data. "
        "A resume checkpoint is saved every --checkpoint-every steps; rerunning after a kill continues from it and "
        "reaches the same final weights. Finished runs are skipped.",
    )
    p.add_argument("--run", action="append", required=True, type=pathlib.Path, help="run directory (repeatable)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:1, ...")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between resume checkpoints (500)")
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (resumable), e.g. to fit a job limit"
    )
    p.set_defaults(func=cmd_train)


def shard_hashes(config: dict) -> dict[str, str]:
    """Activation name -> shard hash, computed from the config alone (no model, no data)."""
    from saeflow import extract

    return {name: extract.plan_activation(spec).hash for name, spec in config["activations"].items()}


def cmd_create_run(args: argparse.Namespace) -> int:
    config = config_mod.load(args.config)
    name, _ = config_mod.pick(config.get("saes", {}), args.sae, "SAE spec")
    specs = {sae_name: sweeps.SAESpec.from_dict(sae_name, obj) for sae_name, obj in config.get("saes", {}).items()}
    plans = [p for p in sweeps.plan_runs(specs, shard_hashes(config)) if p.sae_name == name]
    if not 0 <= args.index < len(plans):
        raise SaeflowError(f"--index {args.index} is out of range: saes.{name} expands into {len(plans)} runs")
    plan = plans[args.index]
    train_dpath = args.shards_root / plan.train_config.train_shards
    val_dpath = args.shards_root / plan.train_config.val_shards
    run = runs.create_run(
        args.runs_root,
        plan.train_config.to_dict(),
        train_shards=train_dpath,
        val_shards=val_dpath,
        train_dataset=_dataset_of(train_dpath),
        val_dataset=_dataset_of(val_dpath),
    )
    print(run.root)
    return 0


def _dataset_of(shards_dpath: pathlib.Path) -> str | None:
    """The source dataset root recorded in a shard directory's metadata, when it exists on this machine."""
    try:
        dataset = json.loads((shards_dpath / "metadata.json").read_text(encoding="utf-8"))["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dataset if isinstance(dataset, str) and pathlib.Path(dataset).is_dir() else None


def cmd_train(args: argparse.Namespace) -> int:
    from saeflow import train

    if args.checkpoint_every < 1:
        raise SaeflowError(f"--checkpoint-every must be positive, got {args.checkpoint_every}")
    for result in train.train_runs(args.run, args.device, args.checkpoint_every, args.max_steps):
        print(json.dumps(result, sort_keys=True))
    return 0
