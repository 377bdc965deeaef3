"""`saeflow create-run` and `saeflow train`: plan a run directory from the config, then train it."""

import argparse
import json
import pathlib

from saeflow import config as config_mod
from saeflow.errors import SaeflowError
from saeflow.store import layout, runs


def register(subparsers):
    p = subparsers.add_parser(
        "create-run",
        help="create (or find) the run directory of one sweep point; prints its path",
        description="Expand the SAE spec NAME of CONFIG into its sweep (the cartesian product of list-valued keys), "
        "take point INDEX, and create <runs-root>/<run_id>/ with checkpoint/config.json (the hashed training config), "
        "checkpoint/hyperparameters.json (every value the run trains with, for people) and links/ to the train/val "
        "shard directories and their source datasets. Idempotent; prints the run dir. "
        "Roots default to the config's; $VARS and ~ in them are expanded as the workflow expands them.",
    )
    p.add_argument("config", type=pathlib.Path, metavar="CONFIG", help="workflow config (YAML)")
    p.add_argument("--sae", default=None, help="name of the entry under `saes` (optional when there is one)")
    p.add_argument("--index", type=int, default=0, help="point of the sweep (0-based; see docs/training.md)")
    p.add_argument(
        "--run-id", default=None, help="the sweep point whose run id this is, instead of --sae/--index (the workflow "
        "passes it, so renaming a spec or reordering a sweep list changes no command line)",
    )
    p.add_argument("--shards-root", help="where shard directories <hash>/ live (default: the config's shards_root)")
    p.add_argument("--runs-root", help="where run directories <run_id>/ live (default: the config's runs_root)")
    p.set_defaults(func=cmd_create_run)

    p = subparsers.add_parser(
        "train",
        help="train SAE runs (resumes after a crash); several runs on the same data share one pass",
        description="Train each --run (a directory made by create-run) to checkpoint/sae.pt, writing "
        "checkpoint/metrics.jsonl during training and checkpoint/metrics.json (validation) at the end. "
        "Runs that read the same shards, layer, tokens, batch size and data seed train in one pass over the data "
        "(at most --runs-per-pass of them), each publishing its own sae.pt in the order given. "
        "A resume checkpoint is saved every --checkpoint-every steps; rerunning after a kill continues from it and "
        "reaches the same final weights. Finished runs are skipped. --gpus N (--nproc N) starts N ranks here, "
        "--nodes M inside a Slurm allocation M x N with srun; a process started by torchrun or srun is one rank "
        "(under torchrun write --run-dir: its parser takes --run for its own --run-path). docs/distributed.md.",
    )
    p.add_argument(
        "--run", "--run-dir", dest="run", action="append", required=True, type=pathlib.Path,
        help="run directory (repeatable)",
    )
    config_mod.add_section_options(p, "train")
    p.add_argument("--nproc", dest="gpus", type=int, default=argparse.SUPPRESS, help="the same as --gpus")
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (resumable), e.g. to fit a job limit"
    )
    p.set_defaults(func=cmd_train)


def cmd_create_run(args: argparse.Namespace) -> int:
    from saeflow.planning import WorkflowPlan, sae_subconfig

    cfg = config_mod.load(args.config)
    if args.run_id is not None:
        planned = WorkflowPlan.from_config(cfg).runs
        if args.run_id not in planned:
            raise SaeflowError(f"--run-id {args.run_id}: no sweep point of {args.config} has this run id")
        train_config = planned[args.run_id].train_config
    else:
        name, _ = config_mod.pick(cfg["saes"], args.sae, "SAE spec")
        plan = WorkflowPlan.from_config(sae_subconfig(cfg, name))
        n_points = len(plan.cfg.saes[name].points())
        if not 0 <= args.index < n_points:
            raise SaeflowError(f"--index {args.index} is out of range: saes.{name} expands into {n_points} points")
        train_config = next(run.train_config for run in plan.runs.values()
                            if args.index in (run.index, *run.same_points))  # fmt: skip
    shards_root = config_mod.root(cfg, "shards_root", args.shards_root, "--shards-root")
    train_shards = layout.ShardLayout.at(shards_root, train_config.per_layer("train_shards")[0])
    val_shards = layout.ShardLayout.at(shards_root, train_config.per_layer("val_shards")[0])
    targets, layer_links = None, None  # a transcoder's target shard directories (train, val); a CLT's, per layer
    if train_config.cross_layer:
        links = {runs.Run.TRAIN_SHARDS: "train_shards", runs.Run.VAL_SHARDS: "val_shards",
                 runs.Run.TARGET_SHARDS: "target", runs.Run.VAL_TARGET_SHARDS: "val_target"}  # fmt: skip
        layers = train_config.spanned_layers
        layer_links = {name: {layer: layout.ShardLayout.at(shards_root, h).dpath
                              for layer, h in zip(layers, train_config.per_layer(key))} for name, key in links.items()}
    elif train_config.transcoder:
        targets = tuple(layout.ShardLayout.at(shards_root, h).dpath for h in (train_config.target,
                                                                              train_config.val_target))  # fmt: skip
    plain = layer_links is None
    run = runs.create_run(
        config_mod.root(cfg, "runs_root", args.runs_root, "--runs-root"),
        train_config.to_dict(),
        train_shards=train_shards.dpath if plain else None,
        val_shards=val_shards.dpath if plain else None,
        train_dataset=_dataset_of(train_shards),
        val_dataset=_dataset_of(val_shards),
        target_shards=targets,
        readable=train_config.readable(),
        layer_links=layer_links,
    )
    print(run.root)
    return 0


def _dataset_of(shards: layout.ShardLayout) -> str | None:
    """The source dataset root recorded in a shard directory's metadata, when it exists on this machine."""
    try:
        dataset = json.loads(shards.metadata_fpath.read_text(encoding="utf-8"))["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dataset if isinstance(dataset, str) and pathlib.Path(dataset).is_dir() else None


def _check_args(args: argparse.Namespace) -> None:
    """Every count of `saeflow train` at least its schema minimum (--gpus/--nproc, --nodes, --runs-per-pass,
    --checkpoint-every), --max-steps positive, and one device per rank: checked before any rank starts."""
    for key, prop in config_mod.section_properties("train").items():
        value, low = getattr(args, key), prop.get("minimum")
        if low is not None and value < low:
            flag = config_mod.option_flag(key) + (" (--nproc)" if key == "gpus" else "")
            raise SaeflowError(f"{flag} must be at least {low}, got {value}")
    if args.max_steps is not None and args.max_steps < 1:
        raise SaeflowError(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.gpus > 1 and args.device.startswith("cuda:"):
        raise SaeflowError(
            f"--device {args.device} with --gpus {args.gpus}: each rank takes its own GPU (cuda:LOCAL_RANK); "
            "write --device cuda, or choose the GPUs with CUDA_VISIBLE_DEVICES"
        )


def cmd_train(args: argparse.Namespace) -> int:
    from saeflow.training import entry, memory, tracking
    from saeflow.training.ranks import distributed, launch

    _check_args(args)
    memory.parse_size(args.buffer_bytes, "--buffer-bytes")
    if (code := launch.start_ranks(args)) is not None:
        return code
    tracking_settings = tracking.Settings.from_section(
        {"tracking": args.tracking, "tracking_dir": args.tracking_dir, "wandb_project": args.wandb_project}
    )
    settings = entry.TrainSettings(
        device=args.device, checkpoint_every=args.checkpoint_every, max_steps=args.max_steps,
        local_copy=args.local_copy, runs_per_pass=args.runs_per_pass, tracking=tracking_settings,
        parallel=args.parallel, buffer_bytes=args.buffer_bytes,
    )  # fmt: skip
    rdv = distributed.rendezvous_from_env()
    try:
        results = entry.train_runs(args.run, settings)
    except SaeflowError as err:
        raise err if rdv is None else SaeflowError(f"rank {rdv.rank}: {err}") from None
    for result in results:
        print(json.dumps(result, sort_keys=True))
    return 0
