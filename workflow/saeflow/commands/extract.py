"""`saeflow plan` and `saeflow extract`: an activation spec of the workflow config -> its shard directory."""

import argparse
import json
import os
import pathlib

from saeflow import config
from saeflow.errors import SaeflowError, say


def register(subparsers):
    p = subparsers.add_parser(
        "plan",
        help="list every activation (shard hash) and run of CONFIG, or one activation's metadata (no model run)",
        description="Without --activation, list every `activations` entry of CONFIG with its shard hash and every "
        "run its SAE sweeps plan (run id, its name `<sae>[<swept key>=<value>,...]`, train/validation activations, a "
        "transcoder's target activations), "
        "as the workflow would. With --activation NAME (or --json), resolve that entry into the saev protocol 2.0 "
        "metadata that names its shard directory: model revision, absolute layers, dataset size, "
        "preprocessing/tokenization. Reads the model's config.json only, never its weights; text corpora are tokenized "
        "to count examples.",
    )
    _common_args(p)
    p.add_argument("--json", action="store_true", help='print {"name", "hash", "metadata"} as one JSON object')
    p.set_defaults(func=cmd_plan)

    p = subparsers.add_parser(
        "extract",
        help="run the model and write (or reuse) SHARDS_ROOT/<hash>/",
        description="Extract the activations of one `activations.<name>` entry of CONFIG into SHARDS_ROOT/<hash>/ "
        "and print that path. An existing complete directory is reused (nothing runs). A crashed or preempted "
        "extraction resumes from its last complete shard. Inputs are checked before the model is loaded. Without "
        "--activation, a CONFIG whose entries differ only in `hook` is extracted in one forward pass, one directory "
        "each (one path printed per entry).",
    )
    _common_args(p)
    p.add_argument(
        "--shards-root",
        help="where shard directories live (default: the config's shards_root); $VARS and ~ are expanded",
    )
    p.add_argument(
        "--expect-hash", metavar="HASH", action="append", help="stop before anything runs unless the activation plans "
        "this shard hash (the workflow passes the hash it planned; once per entry of a pass)",
    )
    p.add_argument("--device", help="override the spec's device (cpu, cuda, cuda:1, auto); not hashed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--part",
        metavar="I/N",
        type=_part_arg,
        help="write only part I (0-based) of N: a contiguous range of whole shards, into SHARDS_ROOT/.<hash>.parts/ "
        "(resumable; prints the part directory). Any N gives the same bytes once sealed",
    )
    split.add_argument(
        "--seal",
        metavar="N",
        type=int,
        help="verify the N finished parts (shard sizes, counts, sha256) and publish SHARDS_ROOT/<hash>/ in one rename",
    )
    p.set_defaults(func=cmd_extract)


def _part_arg(text: str) -> tuple[int, int]:
    try:
        part_idx, n_parts = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected I/N, e.g. 0/4") from None
    if n_parts < 1 or not 0 <= part_idx < n_parts:
        raise argparse.ArgumentTypeError(f"--part {text!r}: I must be in 0..N-1")
    return part_idx, n_parts


def _common_args(p: argparse.ArgumentParser):
    p.add_argument(
        "config", type=pathlib.Path, nargs="+", metavar="CONFIG", help="the workflow config (YAML); several files are "
        "merged as `snakemake --configfile A B` merges them (mapping by mapping, a later file winning), so a small "
        "file can point one dataset's path: `saeflow plan example.yaml paths.yaml`",
    )  # fmt: skip
    p.add_argument("--activation", metavar="NAME", help="which `activations` entry (optional when there is one)")


def _spec(args) -> tuple[dict, str, dict]:
    cfg = config.load(args.config)
    name, spec = config.pick(cfg["activations"], args.activation, "activation")
    return cfg, name, spec


def cmd_plan(args: argparse.Namespace) -> int:
    from saeflow.extraction import extract, specs

    if args.activation is None and not args.json:
        return _print_workflow_plan(*config.load_with_root_sources(args.config))
    _, name, spec = _spec(args)
    typed = specs.ActivationSpec.from_dict(spec)
    mds = [md for _, md in extract.per_layer(typed, extract.plan_activation(typed))]  # a directory per layer
    if args.json:
        directories = [{"hash": md.hash, "metadata": md.to_dict()} for md in mds]
        print(json.dumps({"name": name, "directories": directories, **(directories[0] if len(mds) == 1 else {})},
                         indent=2, sort_keys=True))  # fmt: skip
        return 0
    for md in mds:
        print(f"activation {name}: {md.hash}")
        print(f"  {md.describe()}")
        print(json.dumps(md.to_dict(), indent=2, sort_keys=True))
    return 0


def _print_workflow_plan(cfg: dict, root_sources: dict[str, str]) -> int:
    """The roots (and where each came from), every activation (hash) and every run of the config, as the workflow
    plans them."""
    from saeflow.planning import WorkflowPlan, describe_run, extraction_passes
    from saeflow.training.sweeps import transcoder_sets

    plan = WorkflowPlan.from_config(cfg)
    for line in config.describe_roots(cfg, root_sources):
        print(line)
    for name, hashes in plan.layer_hash.items():  # a directory per layer (one for an existing directory)
        for layer, shard_hash in hashes.items() if len(set(hashes.values())) > 1 else [(None, *hashes.values())]:
            print(f"activation {name}{'' if layer is None else f' layer {layer}'}: {shard_hash}")
    for key, hashes in extraction_passes(plan).items():
        names = ", ".join(dict.fromkeys(plan.hash_activation[h] for h in hashes))
        print(f"extraction pass {key[:16]}: {names}, {len(hashes)} directories (one forward pass, a directory each)")
    for run_id in plan.runs:
        print(describe_run(plan, run_id))
    for name, members in transcoder_sets(plan).items():
        layers, ids = ", ".join(map(str, members)), ", ".join(r[:12] for r in members.values())
        print(f"transcoder set {name}: layers {layers} (runs {ids}; one model: saeflow evaluate --run ... --out, "
              "export-checkpoint --format circuit-tracer)")  # fmt: skip
    for line in _unread_sweeps(plan):
        print(line)
    return 0


def _unread_sweeps(plan) -> list[str]:
    """One line per SAE spec and architecture of the WorkflowPlan `plan` whose swept keys it does not read made
    several points one run: `saes.minilm-topk: l1_coeff is swept but topk does not read it: 3 points are one run`."""
    from saeflow.training import sweeps

    plans, groups = list(plan.runs.values()), {}
    for run in plans:
        read = run.train_config.read_keys()
        unread = tuple(key for key in sweeps.swept_keys(plan.cfg.saes[run.sae_name].hyper) if key not in read)
        if unread:
            groups.setdefault((run.sae_name, run.train_config.arch, unread), []).append(run)
    lines = []
    for (sae_name, arch, keys), members in groups.items():
        n_points = sum(1 + len(run.same_points) for run in members)
        if n_points == len(members):
            continue
        named, it = (keys[0], "it") if len(keys) == 1 else (", ".join(keys), "them")
        swept = f"saes.{sae_name}: {named} {'is' if len(keys) == 1 else 'are'} swept but"
        runs_text = "one run" if len(members) == 1 else f"{len(members)} runs"
        if any(p.sae_name == sae_name and p.train_config.arch == arch and set(keys) & set(p.train_config.read_keys())
               for p in plans):  # read in another mode of the architecture
            lines.append(f"{swept} {n_points} of its {arch} points do not read {it}: they are {runs_text}")
        else:
            lines.append(f"{swept} {arch} does not read {it}: {n_points} points are {runs_text}")
    return lines


def cmd_extract(args: argparse.Namespace) -> int:
    from saeflow.extraction import extract, fingerprints, specs

    cfg = config.load(args.config)
    if args.activation is None and len(cfg["activations"]) > 1:  # one pass: entries that differ only in hook
        named = dict(cfg["activations"])
    else:
        named = dict([config.pick(cfg["activations"], args.activation, "activation")])
    shards_root = config.root(cfg, "shards_root", args.shards_root, "--shards-root")
    units = [(name, unit) for name, spec in named.items()  # a directory per layer, every one of them from the pass
             for unit in extract.plan_units(specs.ActivationSpec.from_dict(spec))]  # fmt: skip
    typed = [unit for _, unit in units]
    if args.seal is None and fingerprints.recheck_mode() == "auto":  # about to read the dataset: stat every file
        os.environ[fingerprints.RECHECK_ENV] = "files"
    if args.seal is not None:
        if len(typed) > 1 or len(args.expect_hash or ()) > 1:
            raise SaeflowError("--seal takes one activation and one --expect-hash (choose it with --activation)")
        expect_hash = args.expect_hash[0] if args.expect_hash else None
        results = [extract.seal(typed[0], shards_root, args.seal, expect_hash=expect_hash)]
    else:
        results = extract.extract_pass(typed, shards_root, device=args.device, progress=not args.no_progress,
                                       part=args.part, expect_hashes=args.expect_hash)  # fmt: skip
    for (name, _), result in zip(units, results):
        if result.reused:
            say(f"activation {name}: {result.dpath} already exists and is valid; nothing to do")
        elif result.resumed_from:
            say(f"activation {name}: resumed from example {result.resumed_from}; published")
        print(result.dpath)
    return 0
