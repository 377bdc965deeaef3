"""The SAE spliced back into its model: what the model loses when the reconstruction replaces the activation.

    cfg = evaluate.EvaluateConfig(run=RUN, spec=specs.ActivationSpec.from_dict(...))  # the run's validation spec
    fpath = evaluate.run_evaluation(cfg)        # RUN/evaluation/<val_shard_hash>.json

The SAE is spliced at its hook point (saeflow.analysis.splice: the tensor of block `layer` that its shards hold,
`hooks.stored(metadata.data)`: the residual stream, the attention or MLP output, the MLP's input, or the stream
between the sublayers; the rest of the model runs on the replacement). The first ceil(n_tokens /
tokens_per_example) examples of the run's validation activation spec go through the model four times, on the same
inputs:

    clean         the model as it is
    spliced       the hook point's tensor x replaced by the SAE's decode(encode(x)) (raw space: normalization undone)
    ablated       that tensor replaced by zeros (zero ablation; for attn_out / mlp_out: the sublayer adds nothing)
    mean_ablated  that tensor replaced by its mean over the validation shards (mean ablation: the mean of every
                  vector the SAE's tokens select in the run's validation shard directory, one streamed pass)

Both ablations replace the tensor the splice writes, at the same positions (`baselines`): for a transcoder (reads
one hook point, writes another) that is its target's tensor, and the mean is that of the target's shards. A
transcoder (training.sae: `target`) reads its input hook point and writes its prediction (skip path included) in
place of its target's tensor: `mlp_in` -> `mlp_out` puts it in place of its MLP, and the MLP's own output is unused.
Its target's validation directory is the one its run links (`inference.target_of`).

Exactly the positions the SAE was trained on are replaced (the run's `tokens`, selected by the loaders' own
`LayerView` of the validation shards: `no_special` leaves the text special tokens [CLS], [SEP], BOS, EOS out,
`content` the CLS token); the others, and vision register tokens, stay clean in all passes. Text inputs are the ids
of the shards' tokens.bin, exactly what extraction ran.

Before scoring, the clean pass of the first batch is checked against the stored shards: its tensor at the hook point
must equal the stored activations within the tolerance of the coarsest dtype involved (STORED_TOLERANCE: the store
dtype, extraction's and evaluate's compute dtypes); otherwise the model is not the one extraction ran (weights
rewritten in place) and evaluate refuses, naming the model and the shard directory.

What each pass is scored by (cross-entropy and KL for causal LMs, the output embedding otherwise) and the recovered
fractions are saeflow.analysis.scoring's. The output is what is scored, so every pass runs to the end of the model;
but the blocks before the splice run once: the clean pass records their outputs and the other passes replay them
(identical inputs give identical outputs; `splice.Prefix`), running only the block of the splice and the later ones.
"""

import dataclasses
import functools
import json
import logging
import math
import pathlib
import typing

import numpy as np
import torch
import tqdm

from saeflow import config, devices
from saeflow.analysis.inference import target_of, trained_layer
from saeflow.analysis.scoring import Scores, n_spliced_scored, next_token_logp, score_embeddings, score_lm, summarize
from saeflow.analysis.splice import Point, Prefix, Splice, Spliceable, Splices, as_splices, load_model, spliced_forward
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract, hooks, models, specs
from saeflow.store import atomic, provenance, runs
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir
from saeflow.training import loaders, sae

logger = logging.getLogger(__name__)

DEFAULTS = config.section_defaults("evaluate")
# The mean relative error per position (|x - x_stored| / |x_stored|) the first batch's clean activations may have,
# by the coarsest dtype among the store dtype and the two compute dtypes. Measured on MiniLM (6 blocks): float16
# storage rounds by 2e-4, bfloat16 against float32 compute differs by 0.5-1.2%, 1% noise on every weight moves the
# activations by 1.4-3.4%; float32 leaves room for GPU kernels (TF32 convolutions) against CPU ones.
STORED_TOLERANCE = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    """One evaluation: which run, on which activation spec (the run's validation one), how."""

    run: pathlib.Path
    spec: specs.ActivationSpec
    shards: pathlib.Path | None = None  # the run's validation shard directory; None: RUN/links/val-shards
    n_tokens: int = DEFAULTS["n_tokens"]
    batch_size: int = DEFAULTS["batch_size"]
    compute_dtype: str = DEFAULTS["compute_dtype"]
    device: str = DEFAULTS["device"]
    progress: bool = True

    def __post_init__(self):
        if self.n_tokens < 1 or self.batch_size < 1:
            raise SaeflowError(f"n_tokens and batch_size must be at least 1, got {self.n_tokens}, {self.batch_size}")
        if self.compute_dtype not in adapters.COMPUTE_DTYPES:
            raise SaeflowError(f"compute_dtype must be one of {adapters.COMPUTE_DTYPES}, got {self.compute_dtype!r}")


# ---------------------------------------------------------------------------------------------------------------
# The model and its inputs
# ---------------------------------------------------------------------------------------------------------------


def example_inputs(plan: extract.Plan, sd: ShardDir) -> typing.Callable[[int, int], torch.Tensor]:
    """batch(lo, hi) -> the model inputs of examples lo..hi-1: the ids of tokens.bin (text: exactly what extraction
    ran), or the dataset's images through the spec's preprocessing."""
    if plan.info.modality == "vision":  # extraction checked every image when it made the shards
        ds = plan.dataset

        def images(lo: int, hi: int) -> torch.Tensor:
            return torch.from_numpy(np.stack([ds.example(i, plan.preprocess)[0] for i in range(lo, hi)]))

        return images
    ids_nt = sd.aux(ShardLayout.TOKENS_FNAME)
    return lambda lo, hi: torch.from_numpy(np.asarray(ids_nt[lo:hi], dtype=np.int64))


def splice_mask(view: loaders.LayerView, info: models.ModelInfo, lo: int, hi: int) -> torch.Tensor:
    """bool (B, T_model): the positions the reconstruction replaces, exactly those the SAE trained on (the loaders'
    selection of the stored positions, `view.keep`); register tokens, never stored, stay clean."""
    keep_nt = view.keep(lo, hi)
    mask_nt = np.zeros((hi - lo, keep_nt.shape[1] + info.n_registers), dtype=bool)
    mask_nt[:, adapters.stored_positions(info, mask_nt.shape[1])] = keep_nt
    return torch.from_numpy(mask_nt)


def check_stored(sd: ShardDir, info: models.ModelInfo, point: Point, compute_dtype: str, lo: int, acts_btd) -> None:
    """Refuse when the clean pass's tensor at `point` (the hook point of `sd`, block `point.layer`) for examples lo..
    is not what the shards store (module docstring): the model is not the one extraction ran, and a splice into it
    would score another model."""
    got_btd = adapters.keep_stored(info, acts_btd).float().cpu()
    stored_btd = torch.from_numpy(np.stack([sd.example(ex, point.layer) for ex in range(lo, lo + len(got_btd))]))
    stored_btd = stored_btd.float()
    err = float(((got_btd - stored_btd).norm(dim=-1) / stored_btd.norm(dim=-1).clamp_min(1e-12)).mean())
    dtypes = {sd.metadata.dtype, sd.metadata.data.get("compute_dtype", "float32"), compute_dtype}
    tol = max(STORED_TOLERANCE[dtype] for dtype in dtypes)
    if not err <= tol:
        raise SaeflowError(
            f"model {info.ckpt} ({info.source or 'random init'}) does not compute the activations stored in "
            f"{sd.dpath}: {point}, examples {lo}..{lo + len(got_btd) - 1}, mean relative error {err:.3g} > "
            f"{tol:g} ({'/'.join(sorted(dtypes))}); the model is not the one extraction ran (rewritten in place?), "
            "so evaluate will not score a splice into it: extract and train again"
        )


# ---------------------------------------------------------------------------------------------------------------
# Three passes
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def mean_activation(view: loaders.LayerView, batch_size: int = 4096) -> tuple[torch.Tensor, int]:
    """The mean (float64, D) of every vector the view selects (the SAE's tokens of the validation shards, in one
    streamed pass: memory one batch) and how many vectors it averages: what mean ablation writes."""
    loader = loaders.OrderedLoader(view.sd, view.layer, batch_size, tokens=view.tokens, borrowed=True)
    sum_d, n = torch.zeros(view.d_model, dtype=torch.float64), 0
    try:
        for x_bd in loader.iter_batches():
            sum_d += x_bd.double().sum(0)
            n += x_bd.shape[0]
    finally:
        loader.close()
    if n == 0:
        raise SaeflowError(f"{view.sd.dpath}: no vector for tokens={view.tokens!r}: nothing to take the mean of")
    return sum_d / n, n


def _mean_of(mean_d: torch.Tensor, x_nd: torch.Tensor) -> torch.Tensor:
    return mean_d.to(x_nd).expand_as(x_nd)


def baselines(splice: Splice | Splices, mean_d: torch.Tensor | dict | None) -> dict[str, Splices | None]:
    """Each pass's splices: clean (none), the splice itself (or every splice of a set), and the ablations of the
    tensors they write (not an observing splice's: `Splice.observes`), at their write points and positions: zeros
    (`ablated`) and, given `mean_d` (a set's: {write point: mean}), each tensor's mean (`mean_ablated`)."""
    splices = as_splices(splice)
    written = [one for one in splices if not one.observes]
    zeros = tuple(Splice.at(one.write, torch.zeros_like) for one in written)
    passes = {"clean": None, "spliced": splices, "ablated": zeros}
    if mean_d is not None:
        means = mean_d if isinstance(mean_d, dict) else {written[0].write: mean_d}
        passes["mean_ablated"] = tuple(Splice.at(one.write, functools.partial(_mean_of, means[one.write]))
                                       for one in written)  # fmt: skip
    return passes


def three_passes(
    m: Spliceable, plan: extract.Plan, view: loaders.LayerView, splice: Splice | Splices, n_ex: int,
    batch_size: int, device, progress: bool = True, check: typing.Callable[[int, dict], None] | None = None,
    mean_d: torch.Tensor | dict | None = None,
) -> dict:  # fmt: skip
    """Clean, spliced and zero-ablated outputs (and mean-ablated: `mean_d` written at every spliced position) of the
    first `n_ex` examples of the view's shards, `splice` (or a set of splices, together) at the view's tokens
    (`baselines`); scored (the metrics of `summarize`). `check(lo, {point: clean tensor})` sees the first batch's
    clean tensors at every read and write point (check_stored)."""
    batch = example_inputs(plan, view.sd)
    passes = baselines(splice, mean_d)
    points = {point: m.tap(point) for one in as_splices(splice) for point in (one.read, one.write)}
    has_cls = m.info.cls_token or m.info.family in models.ENCODER_FAMILIES
    scores = Scores()
    scores.n_spliced = 0
    with tqdm.tqdm(total=n_ex, unit="ex", desc=f"evaluate ({len(passes) - 1} splices)", disable=not progress) as bar:
        for lo in range(0, n_ex, batch_size):
            hi = min(lo + batch_size, n_ex)
            inputs = batch(lo, hi).to(device)
            mask_bt = splice_mask(view, m.info, lo, hi).to(device)
            scores.n_spliced += n_spliced_scored(mask_bt, m.causal)
            prefix = Prefix.of(splice)  # the blocks before the splice, from the clean pass, replayed by the others
            with adapters.record(points) as clean_acts:
                clean = spliced_forward(m, inputs, mask_bt, None, prefix)
            if m.causal:  # one pass's logits at a time beside the clean log-probs: memory 2 x (B, T, V)
                logp_clean = next_token_logp(clean)
                del clean
                for mode, one in passes.items():
                    logits = None if one is None else spliced_forward(m, inputs, mask_bt, one, prefix)
                    logp = logp_clean if one is None else next_token_logp(logits)
                    score_lm(scores, mode, logp, logp_clean, inputs)
                    del logits, logp
            else:
                outs = {mode: clean if one is None else spliced_forward(m, inputs, mask_bt, one, prefix)
                        for mode, one in passes.items()}  # fmt: skip
                score_embeddings(scores, outs, has_cls)
            if check is not None and lo == 0:
                check(lo, clean_acts)
            bar.update(hi - lo)
    return summarize(scores, m.causal)


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def check_spec(run: runs.Run, plan: extract.Plan, model: sae.SAE, layer: int, shards_dpath: pathlib.Path) -> str:
    """The validation shard hash of the run, after checking that the spec is the one the run was validated on."""
    val_hash = validation_hash(run)
    if plan.metadata.hash != val_hash:
        stored = _stored_ckpt(shards_dpath)
        if stored is not None and stored != plan.info.ckpt:
            raise SaeflowError(
                f"model {plan.info.source or plan.info.ckpt} is not the one the run's shards {shards_dpath} were "
                f"extracted from: it is {plan.info.ckpt} now, {stored} then (rewritten in place?); extract and "
                "train again"
            )
        raise SaeflowError(
            f"{run.config_fpath}: the run was validated on shards {val_hash}, but the activation spec given plans "
            f"shards {plan.metadata.hash}; pass the run's validation activation spec"
        )
    if layer not in plan.metadata.layers:
        layers = list(plan.metadata.layers)
        raise SaeflowError(f"{run.config_fpath}: layer {layer} is not among the spec's layers {layers}")
    if model.d_model != plan.info.d_model:
        raise SaeflowError(
            f"{run.sae_fpath}: the SAE takes d_model={model.d_model}, but {plan.info.ckpt} has d={plan.info.d_model}"
        )
    return val_hash


def validation_hash(run: runs.Run) -> str | None:
    """The shard hash the run was validated on (its training shards when it names no validation ones)."""
    run_cfg = run.config()
    return run_cfg.get("val_shards") or run_cfg.get("train_shards")


def layer_spec(spec: specs.ActivationSpec, layer: int, val_hash: str | None) -> specs.ActivationSpec:
    """The spec that plans the run's validation directory: `spec` itself when it does (a directory of every layer,
    as `extract_pass` writes for one spec), else its directory of `layer` (a config's entry names every layer, the
    workflow's directories one each); `check_spec` then says in one line when neither is the run's."""
    whole = extract.plan_activation(spec)
    if whole.hash == val_hash or len(whole.layers) == 1:
        return spec
    units = {md.layers[0]: unit for unit, md in extract.per_layer(spec, whole)}
    return units.get(layer, spec)


def _stored_ckpt(shards_dpath: pathlib.Path) -> str | None:
    """The model identity a shard directory was extracted with, None when it cannot be read."""
    try:
        return ShardDir(shards_dpath).metadata.ckpt
    except SaeflowError:
        return None


def open_val_shards(shards_dpath: pathlib.Path, shard_hash: str) -> ShardDir:
    """The run's validation shard directory (evaluate reads its tokens.bin and checks the model against it)."""
    try:
        sd = ShardDir(shards_dpath)
    except SaeflowError as err:
        raise SaeflowError(f"the run's validation shards are needed (pass --shards DIR): {err}") from None
    if sd.hash != shard_hash:
        raise SaeflowError(f"{shards_dpath} holds shards {sd.hash}, not the run's validation shards {shard_hash}")
    return sd


def sae_splice(model: sae.SAE, read: Point, write: Point | None = None) -> Splice:
    """The run's splice: what the model outputs in raw space (normalization undone) replaces the tensor at `write`:
    an SAE's reconstruction decode(encode(x)) the tensor it reads (`write` None), a transcoder's prediction its
    target's."""

    def predict(x_nd: torch.Tensor) -> torch.Tensor:
        return model(x_nd)[0]

    return Splice(read, write or read, predict)


def run_evaluation(cfg: EvaluateConfig) -> pathlib.Path:
    """Evaluate the run's SAE spliced into its model at its hook point; write RUN/evaluation/<val_shard_hash>.json
    atomically."""
    run = runs.open_run(cfg.run)
    sae_fpath = run.require_checkpoint()
    layer = trained_layer(run)
    model = sae.load_sae(sae_fpath)
    plan = extract.plan(layer_spec(cfg.spec, layer, validation_hash(run)))
    shards_dpath = (cfg.shards or run.link(run.VAL_SHARDS)).resolve()  # messages name the directory, not a link
    shard_hash = check_spec(run, plan, model, layer, shards_dpath)
    sd = open_val_shards(shards_dpath, shard_hash)
    written_sd = target_of(run, sd) or sd  # a transcoder writes its target's tensor
    tokens = run.tokens()
    view = loaders.LayerView(sd, layer, tokens)
    T = plan.metadata.tokens_per_ex
    n_ex = min(plan.metadata.n_ex, math.ceil(cfg.n_tokens / T))
    device = devices.resolve_device(cfg.device)
    started_at = provenance.utc_now()
    m = load_model(plan.info, cfg.spec.model, cfg.compute_dtype, device)
    point = Point(hooks.stored(sd.metadata.data), layer)
    splice = sae_splice(model.to(device), point, Point(hooks.stored(written_sd.metadata.data), layer))

    stored_at = {splice.read: sd, splice.write: written_sd}  # one point for an SAE: checked once

    def check(lo: int, clean_acts: dict) -> None:
        for one_point, one_sd in stored_at.items():
            check_stored(one_sd, plan.info, one_point, cfg.compute_dtype, lo, clean_acts[one_point])

    written_view = view if written_sd is sd else loaders.LayerView(written_sd, layer, tokens)
    mean_d, n_mean = mean_activation(written_view)
    metrics = three_passes(m, plan, view, splice, n_ex, cfg.batch_size, device, cfg.progress, check, mean_d)
    view.close()
    if written_view is not view:
        written_view.close()
    result = {
        "config": {
            "run": str(run.root.resolve()),
            "sae_sha256": file_sha256(sae_fpath),
            "shard_hash": shard_hash,
            "ckpt": plan.info.ckpt,
            "hook": splice.write.hook,  # the tensor replaced (the summary's eval.hook)
            "layer": layer,
            "splice": {"read": splice.read.to_dict(), "write": splice.write.to_dict()},
            "tokens": tokens,
            "n_ex": n_ex,
            "tokens_per_ex": T,
            "compute_dtype": cfg.compute_dtype,
            "scored": "next-token predictions at positions 0..T-2" if m.causal else "one embedding per example",
            "ablation": f"{splice.write} replaced by zeros at the spliced positions",
            "mean_ablation": f"{splice.write} replaced by the mean of the {n_mean} vectors of the validation shards "
                             f"{written_sd.hash} at tokens={tokens!r}",
        },
        "metrics": metrics,
        "provenance": {**provenance.collect(), "device": str(device), "started_at": started_at,
                       "finished_at": provenance.utc_now()},
    }  # fmt: skip
    out_fpath = run.evaluation_fpath(shard_hash)
    out_fpath.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_fpath, result)
    logger.info("%s: %s", point, json.dumps(metrics))
    return out_fpath


def read_metrics(fpath: pathlib.Path) -> dict:
    """The `metrics` object of an evaluation file (summary)."""
    from saeflow.store.hashing import read_json_object

    obj = read_json_object(fpath, "evaluation JSON object")
    metrics = obj.get("metrics")
    if not isinstance(metrics, dict):
        raise SaeflowError(f"{fpath}: no `metrics` object; rerun `saeflow evaluate`")
    return metrics
