"""`saeflow evaluate`: the run's SAE spliced into its model on the run's validation data."""

import argparse
import pathlib

from saeflow import config

# evaluate imports torch and transformers: load it only when the command runs, so `saeflow --help` stays fast.


def register(subparsers):
    p = subparsers.add_parser(
        "evaluate",
        help="splice the run's SAE into its model: CE loss recovered / KL, or embedding similarity",
        description="Run the first ceil(n_tokens / tokens per example) examples of the run's validation "
        "activation spec through the model four times: clean, with the tensor at the run's hook point (the residual "
        "stream, an attention or MLP output, the MLP's input) replaced by the SAE's reconstruction on exactly the "
        "tokens the SAE trained on (the others kept clean; a transcoder's prediction replaces its target's tensor, "
        "e.g. its MLP's output), zero-ablated and mean-ablated; the clean "
        "pass's first batch must match the stored activations (else the model changed: refused). Causal language "
        "models: per-token cross-entropy of each pass, CE loss recovered = (CE_abl - CE_sae) / (CE_abl - CE_clean), "
        "KL(clean || spliced) and the KL score. Encoders and vision towers: cosine similarity and relative error of "
        "the mean-pooled output (and the CLS token), with the same recovered fractions. Writes "
        "RUN/evaluation/<val_shard_hash>.json (the summary reads it) and prints its path. Given --run once per layer "
        "(a transcoder set) and --out FILE, splices them all at once, the replacement model, and each alone, and "
        "writes FILE: {replacement, per_layer}; a cross-layer transcoder (one --run of shape: clt, with --out FILE) "
        "is spliced the same way, every layer's prediction from the codes of every layer up to it.",
    )
    p.add_argument("--run", type=pathlib.Path, required=True, action="append",
                   help="the run directory (holds a trained SAE); again for each layer of a transcoder set")
    p.add_argument("--out", type=pathlib.Path, metavar="FILE",
                   help="a set's or a CLT's evaluation JSON (must not exist); needed with more than one --run")
    p.add_argument("config", type=pathlib.Path, metavar="CONFIG",
                   help="a config holding the run's validation activation spec (the workflow passes its per-shard "
                   "config); its planned shard hash must be the run's val_shards")
    p.add_argument("--activation", metavar="NAME",
                   help="which `activations` entry (default: the one that plans the run's validation shards)")
    p.add_argument("--shards", type=pathlib.Path, metavar="DIR",
                   help="the run's validation shard directory: its tokens.bin gives the text inputs and the tokens "
                   "the SAE trained on, and the model is checked against its activations (default: "
                   "RUN/links/val-shards)")
    config.add_section_options(p, "evaluate")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from saeflow.analysis import evaluate
    from saeflow.errors import SaeflowError
    from saeflow.extraction import specs
    from saeflow.store import runs

    run = runs.open_run(args.run[0])
    cross_layer = len(args.run) == 1 and run.config().get("shape") == "clt"  # one model over many layers: a set's
    if (len(args.run) > 1 or cross_layer) and args.out is None:
        what = "a cross-layer transcoder" if cross_layer else f"--run given {len(args.run)} times (a transcoder set)"
        raise SaeflowError(f"{what}: give --out FILE for its evaluation")
    if len(args.run) == 1 and args.out is not None and not cross_layer:
        raise SaeflowError("--out is a set's (more than one --run, or a CLT); one run's evaluation goes to "
                           "RUN/evaluation/")  # fmt: skip
    cfg_dict = config.load(args.config)
    activations = cfg_dict["activations"]
    if args.activation is None and len(activations) > 1:
        args.activation = _validation_activation(run, activations, args.config)
    name, spec = config.pick(activations, args.activation, "activation")
    try:
        typed = specs.ActivationSpec.from_dict(spec)
    except SaeflowError as err:
        raise SaeflowError(f"{args.config}: activations.{name}: {err}") from None
    if args.out is not None:
        from saeflow.analysis import replacement

        cfg = config.from_args(replacement.SetEvaluateConfig, args, spec=typed, runs=tuple(args.run), out=args.out,
                               progress=not args.no_progress)  # fmt: skip
        print(replacement.run_set_evaluation(cfg))
        return 0
    cfg = config.from_args(evaluate.EvaluateConfig, args, spec=typed, run=args.run[0], progress=not args.no_progress)
    print(evaluate.run_evaluation(cfg))
    return 0


def _validation_activation(run, activations: dict, config_fpath: pathlib.Path) -> str:
    """The name of the activation spec that plans the run's validation shards (planning reads no weights)."""
    from saeflow.analysis import evaluate
    from saeflow.errors import SaeflowError
    from saeflow.extraction import extract, specs

    val_hash = evaluate.validation_hash(run)
    val_hash = val_hash[0] if isinstance(val_hash, list) else val_hash  # a CLT's: its first layer's
    for name, spec in activations.items():
        typed = specs.ActivationSpec.from_dict(spec)
        if val_hash in (md.hash for _, md in extract.per_layer(typed, extract.plan_activation(typed))):
            return name
    raise SaeflowError(
        f"{config_fpath}: none of its activations ({', '.join(activations)}) plans the run's validation shards "
        f"{val_hash} ({run.config_fpath})"
    )
