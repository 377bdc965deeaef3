"""A replacement model evaluated whole: every run of a transcoder set (one per layer) spliced into the model at once.

    cfg = replacement.SetEvaluateConfig(runs=(RUN_L0, RUN_L1, ...), spec=ActivationSpec(...), out=OUT.json)
    replacement.run_set_evaluation(cfg)      # OUT.json: {"config", "replacement": metrics, "per_layer": {l: metrics}}

Each run is spliced as `saeflow evaluate` splices it (analysis/evaluate.py: its prediction in place of its target's
tensor, at the tokens it trained on), all together in one pass (`splice.Splices`): layer l's transcoder reads what the
transcoders before it made, so `replacement` scores the model with every MLP replaced, as circuit-tracer's
replacement model computes it. The ablations replace every target at once (zeros; each target's validation mean).
`per_layer` is each run alone, the numbers `saeflow evaluate` writes for it. The runs' validation shards are per-layer
directories of one activation spec (`spec`, every layer); each run is checked against its own as evaluate checks one
run, and all must select the same tokens. Memory: one batch's passes, as evaluate; time: (L + 1) evaluations.

A cross-layer transcoder (`--run` once, a `shape: clt` run: training/clt.py) is a member per layer (`clt_members`):
layer l's splice reads its input hook point, encodes it, and writes l's prediction from the codes of every layer up
to l, which the pass's earlier splices left (`CLTPass`). Alone, layer l's prediction reads the clean inputs of the
layers before it (their splices record their codes and write their tensor back unchanged).
"""

import dataclasses
import json
import logging
import math
import pathlib

import torch

from saeflow import devices
from saeflow.analysis import evaluate
from saeflow.analysis.inference import target_of, trained_layer
from saeflow.analysis.splice import Point, Splice, load_model
from saeflow.errors import SaeflowError
from saeflow.extraction import extract, hooks, specs
from saeflow.store import atomic, provenance, runs
from saeflow.training import clt, loaders, sae

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SetEvaluateConfig:
    """A set evaluation: the runs (one per layer), the activation spec of their inputs (every layer), where to write."""

    runs: tuple[pathlib.Path, ...]
    spec: specs.ActivationSpec
    out: pathlib.Path
    n_tokens: int = evaluate.DEFAULTS["n_tokens"]
    batch_size: int = evaluate.DEFAULTS["batch_size"]
    compute_dtype: str = evaluate.DEFAULTS["compute_dtype"]
    device: str = evaluate.DEFAULTS["device"]
    progress: bool = True


@dataclasses.dataclass
class Member:
    """One run of the set, checked as evaluate checks a run: its splice and the shards of what it reads and writes."""

    run: runs.Run
    layer: int
    plan: extract.Plan
    view: loaders.LayerView
    written_view: loaders.LayerView
    splice: Splice
    alone: tuple[Splice, ...] | None = None  # what splices it alone, where that is more than `splice` (a CLT's)

    def close(self) -> None:
        self.view.close()
        if self.written_view is not self.view:
            self.written_view.close()


def open_members(run_dpath: pathlib.Path, spec: specs.ActivationSpec, device) -> list[Member]:
    """The run as the set's members: a transcoder's one, a CLT's one per layer."""
    run = runs.open_run(run_dpath)
    if run.config().get("shape") == "clt":
        return clt_members(run, spec, device)
    return [open_member(run, spec, device)]


def open_member(run: runs.Run, spec: specs.ActivationSpec, device) -> Member:
    model = sae.load_sae(run.require_checkpoint())
    layer = trained_layer(run)
    plan = extract.plan(evaluate.layer_spec(spec, layer, evaluate.validation_hash(run)))
    shards_dpath = run.link(run.VAL_SHARDS).resolve()
    sd = evaluate.open_val_shards(shards_dpath, evaluate.check_spec(run, plan, model, layer, shards_dpath))
    written_sd = target_of(run, sd) or sd
    tokens = run.tokens()
    view = loaders.LayerView(sd, layer, tokens)
    written_view = view if written_sd is sd else loaders.LayerView(written_sd, layer, tokens)
    read, write = (Point(hooks.stored(s.metadata.data), layer) for s in (sd, written_sd))
    return Member(run, layer, plan, view, written_view, evaluate.sae_splice(model.to(device), read, write))


class CLTPass:
    """One forward pass of a CLT spliced in: each layer's codes as its splice encodes them, read by the later ones."""

    def __init__(self, model: clt.CLT):
        self.model, self.codes = model, {}

    @torch.no_grad()
    def predict(self, i: int, x_nd: torch.Tensor, write: bool = True) -> torch.Tensor:
        """Layer index i's splice: its codes of `x_nd` (raw), and its prediction (raw) from every layer's codes up to
        it; with `write` False its own tensor back (the layer only feeds later ones)."""
        if i == 0:
            self.codes.clear()  # a new pass
        self.codes[i] = self.model.encoders[i].encode(x_nd)
        return self.model.predict(self.codes, i) if write else x_nd


def clt_members(run: runs.Run, spec: specs.ActivationSpec, device) -> list[Member]:
    """A CLT run as a member per layer (module docstring), each checked as evaluate checks a run of that layer."""
    model = clt.load_clt(run.require_checkpoint()).to(device)
    layers, whole, tokens, members = model.cfg.layer_ids, CLTPass(model), run.tokens(), []
    for i, layer in enumerate(layers):
        sd, written_sd = (evaluate.open_val_shards(run.layer_link(link, layer).resolve(), shard_hash) for link,
                          shard_hash in ((run.VAL_SHARDS, run.config()["val_shards"][i]),
                                         (run.VAL_TARGET_SHARDS, run.config()["val_target"][i])))  # fmt: skip
        plan = extract.plan(evaluate.layer_spec(spec, layer, sd.hash))
        if plan.metadata.hash != sd.hash:
            raise SaeflowError(f"{run.config_fpath}: layer {layer} was validated on shards {sd.hash}, but the "
                               f"activation spec given plans {plan.metadata.hash}; pass its validation activation spec")
        view, written_view = loaders.LayerView(sd, layer, tokens), loaders.LayerView(written_sd, layer, tokens)
        read, write = (Point(hooks.stored(s.metadata.data), layer) for s in (sd, written_sd))
        alone_pass = CLTPass(model)
        alone = tuple(Splice(Point(read.hook, before), Point(read.hook, before), observes=True,
                             fn=lambda x, h=h, p=alone_pass: p.predict(h, x, write=False))
                      for h, before in enumerate(layers[:i]))  # fmt: skip
        mine = Splice(read, write, lambda x, i=i: whole.predict(i, x))
        members.append(Member(run, layer, plan, view, written_view, mine,
                              (*alone, Splice(read, write, lambda x, i=i, p=alone_pass: p.predict(i, x)))))
    return members


def check_set(members: list[Member]) -> None:
    """One run per layer, all reading the same examples and tokens of one model; else one line naming the runs."""
    seen: dict[int, Member] = {}
    for one in members:
        if one.layer in seen:
            raise SaeflowError(f"{one.run.root} and {seen[one.layer].run.root} both splice layer {one.layer}; a set "
                               "has one run per layer")  # fmt: skip
        seen[one.layer] = one
        first = members[0]
        if one.view.tokens != first.view.tokens:
            raise SaeflowError(f"{one.run.root} trained on tokens={one.view.tokens!r}, {first.run.root} on "
                               f"tokens={first.view.tokens!r}: a set splices the same positions at every layer")
        if one.plan.info.ckpt != first.plan.info.ckpt:
            raise SaeflowError(f"{one.run.root} is of {one.plan.info.ckpt}, {first.run.root} of {first.plan.info.ckpt}")


def run_set_evaluation(cfg: SetEvaluateConfig) -> pathlib.Path:
    """Evaluate the set spliced whole and each run alone; write cfg.out (JSON) atomically, never over a file."""
    if cfg.out.exists():
        raise SaeflowError(f"{cfg.out} already exists; evaluations never overwrite")
    device = devices.resolve_device(cfg.device)
    members = sorted((one for run_dpath in cfg.runs for one in open_members(run_dpath, cfg.spec, device)),
                     key=lambda one: one.layer)  # fmt: skip
    try:
        check_set(members)
        return _evaluate(cfg, members, device)
    finally:
        for one in members:
            one.close()


def _evaluate(cfg: SetEvaluateConfig, members: list[Member], device) -> pathlib.Path:
    first = members[0]
    plan, view = first.plan, first.view
    n_ex = min(plan.metadata.n_ex, math.ceil(cfg.n_tokens / plan.metadata.tokens_per_ex))
    started_at = provenance.utc_now()
    m = load_model(plan.info, plan.spec.model, cfg.compute_dtype, device)
    means = {one.splice.write: evaluate.mean_activation(one.written_view)[0] for one in members}
    stored_at = {p: v.sd for one in members for p, v in ((one.splice.read, one.view),
                                                         (one.splice.write, one.written_view))}  # fmt: skip

    def check(lo: int, clean_acts: dict) -> None:
        for point, sd in stored_at.items():
            evaluate.check_stored(sd, plan.info, point, cfg.compute_dtype, lo, clean_acts[point])

    splices = tuple(one.splice for one in members)
    whole = evaluate.three_passes(m, plan, view, splices, n_ex, cfg.batch_size, device, cfg.progress, check, means)
    per_layer = {one.layer: evaluate.three_passes(m, plan, view, one.alone or one.splice, n_ex, cfg.batch_size,
                                                  device, cfg.progress, mean_d=means[one.splice.write])
                 for one in members}  # fmt: skip
    result = {
        "config": {
            "runs": {one.layer: str(one.run.root.resolve()) for one in members},
            "ckpt": plan.info.ckpt,
            "splices": [{"read": s.read.to_dict(), "write": s.write.to_dict()} for s in splices],
            "tokens": view.tokens,
            "n_ex": n_ex,
            "tokens_per_ex": plan.metadata.tokens_per_ex,
            "compute_dtype": cfg.compute_dtype,
            "scored": "next-token predictions at positions 0..T-2" if m.causal else "one embedding per example",
            "ablation": "every target replaced by zeros at the spliced positions, all at once",
            "mean_ablation": "every target replaced by its validation shards' mean, all at once",
        },
        "replacement": whole,
        "per_layer": per_layer,
        "provenance": {**provenance.collect(), "device": str(device), "started_at": started_at,
                       "finished_at": provenance.utc_now()},
    }  # fmt: skip
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_file_atomic(cfg.out, (json.dumps(result, indent=2, sort_keys=True) + "\n").encode())
    logger.info("replacement of %d layers: %s", len(members), json.dumps(whole))
    return cfg.out
