"""What training would refuse of a planned run, found at plan time from the shard metadata (no torch, no data):
`check_run` (a layer the directory lacks, k above d_sae, CLS tokens, widths, the parallel mode) and a transcoder's
pairs (`check_pairs`). planning.check_runs calls it for every run."""

import dataclasses
import typing

from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.training import shapes
from saeflow.training.sweeps import RunPlan, auto_tokens_of, config_key


def check_run(plan: RunPlan, train_md, val_md, train_settings: typing.Mapping[str, typing.Any] | None = None,
              targets: tuple | None = None) -> None:  # fmt: skip
    """What training would refuse, found at plan time from the shard metadata (no extraction has to run first):
    a layer the activation does not extract, k above d_sae, CLS tokens the model has none of, train and
    validation activations of different widths, a parallel mode the architecture does not train in (`check_parallel`,
    given the `train` settings), a transcoder's target that is not the same examples and tokens as its input
    (`targets`: the metadata of the target and of the validation target; `check_pairs`). The error names the key,
    as `saes.<name>[<sweep index>].<key>` (`config_key`)."""
    cfg, where = plan.train_config, config_key(plan.sae_name, plan.index, bool(plan.varying))
    if targets is not None:
        check_pairs(plan, (train_md, val_md), targets)
    for role, name, md in (("train", plan.train_activation, train_md), ("val", plan.val_activation, val_md)):
        if cfg.layer not in md.layers:
            raise SaeflowError(f"{where}.layer: layer {cfg.layer} is not extracted by the {role} activation "
                               f"{name!r} (activations.{name}.layers resolve to {list(md.layers)})")  # fmt: skip
        if cfg.tokens == "cls" and not md.cls_token:
            raise SaeflowError(f"{where}.tokens: 'cls' asked for, but the {role} activation {name!r} has no CLS token")
        if cfg.tokens == "no_special" and auto_tokens_of(md) != "no_special":
            raise SaeflowError(f"{where}.tokens: 'no_special' (what auto means for text) needs the special ids of a "
                               f"text packing, but the {role} activation {name!r} records none (not text saeflow "
                               "extracted); set tokens: content")  # fmt: skip
    if train_md.d_model != val_md.d_model:
        raise SaeflowError(f"{where}.val: activation {plan.val_activation!r} has d_model {val_md.d_model}, but the "
                           f"train activation {plan.train_activation!r} has {train_md.d_model}")  # fmt: skip
    try:
        cfg.sae_config(train_md.d_model, targets[0].d_model if targets else None)  # k must fit d_sae
    except SaeflowError as err:
        raise SaeflowError(f"{where}.{err}") from None
    if train_settings is not None:
        check_parallel(plan, train_settings)


def per_layer(plan: RunPlan) -> list[RunPlan]:
    """The run as `check_run` checks it: itself, or a CLT as the transcoder of each of its layers (its layer's
    directories and its own hyper-parameters; the CLT's own checks are `check_parallel`'s)."""
    cfg = plan.train_config
    if not cfg.cross_layer:
        return [plan]
    keys = ("layer", "train_shards", "val_shards", "target", "val_target")
    return [dataclasses.replace(plan, train_config=dataclasses.replace(cfg, shape="auto", **dict(zip(keys, values))))
            for values in zip(*(cfg.per_layer(key) for key in keys))]  # fmt: skip


def check_parallel(plan: RunPlan, train_settings: typing.Mapping[str, typing.Any]) -> None:
    """Refuse at plan time, in one line, a parallel mode (`train.parallel`) the run's architecture does not train in
    in its shape (an SAE, a transcoder, a CLT: training/shapes.py), when the job has several ranks (`train.gpus` x
    `train.nodes`; one process trains every architecture in every shape)."""
    if train_settings["gpus"] * train_settings["nodes"] > 1:
        where = f"{config_key(plan.sae_name, plan.index, bool(plan.varying))}.arch"
        shapes.check_mode(plan.train_config, train_settings["parallel"], where)


def _pair_identity(md) -> dict:
    """What a transcoder's input and target must share to be the same examples and tokens: all of their metadata
    but the hook point (and the width, which a hook may change)."""
    obj = md.to_dict()
    obj["data"] = {key: value for key, value in obj["data"].items() if key != hooks.HOOK_KEY}
    return {key: value for key, value in obj.items() if key != "d_model"}


def check_pairs(plan: RunPlan, inputs: tuple, targets: tuple) -> None:
    """Refuse, in one line, a transcoder whose target (or validation target) is not its input's examples and tokens:
    another model, checkpoint, dataset, example count, token layout, layers or shard layout. One forward pass of
    specs that differ in `hook` alone (`ActivationSpec.shares_pass`) always pairs."""
    where = config_key(plan.sae_name, plan.index, bool(plan.varying))
    roles = (("target", plan.train_activation, plan.target_activation),
             ("val_target", plan.val_activation, plan.val_target_activation))  # fmt: skip
    for (key, source, target), source_md, target_md in zip(roles, inputs, targets):
        a, b = _pair_identity(source_md), _pair_identity(target_md)
        if a != b:
            differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise SaeflowError(f"{where}.{key}: activation {target!r} is not the same examples and tokens as "
                               f"{source!r} (their shard metadata differ in {', '.join(differ)} beyond the hook); a "
                               "transcoder's target comes from the same model, dataset and tokens (e.g. one spec "
                               "with another hook)")  # fmt: skip
