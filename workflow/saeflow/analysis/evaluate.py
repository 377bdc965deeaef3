"""The SAE spliced back into its model: what the model loses when the reconstruction replaces the activation.

    cfg = evaluate.EvaluateConfig(run=RUN, spec=specs.ActivationSpec.from_dict(...))  # the run's validation spec
    fpath = evaluate.run_evaluation(cfg)        # RUN/evaluation/<val_shard_hash>.json

The first ceil(n_tokens / tokens_per_example) examples of the run's validation activation spec go through the
model four times, on the same inputs:

    clean         the model as it is
    spliced       block `layer`'s output x replaced by the SAE's decode(encode(x)) (raw space: normalization undone)
    ablated       block `layer`'s output replaced by zeros (zero ablation)
    mean_ablated  block `layer`'s output replaced by its mean over the validation shards (mean ablation: the mean
                  of every vector the SAE's tokens select in the run's validation shard directory, one streamed pass)

Exactly the positions the SAE was trained on are replaced (the run's `tokens`, selected by the loaders' own
`LayerView` of the validation shards: `no_special` leaves the text special tokens [CLS], [SEP], BOS, EOS out,
`content` the CLS token); the others, and vision register tokens, stay clean in all three passes. Text inputs are
the ids of the shards' tokens.bin, exactly what extraction ran.

Before scoring, the clean pass of the first batch is checked against the stored shards: its block `layer` output
must equal the stored activations within the tolerance of the coarsest dtype involved (STORED_TOLERANCE: the store
dtype, extraction's and evaluate's compute dtypes); otherwise the model is not the one extraction ran (weights
rewritten in place) and evaluate refuses, naming the model and the shard directory.

What each pass is scored by (cross-entropy and KL for causal LMs, the output embedding otherwise) and the recovered
fractions are saeflow.analysis.scoring's. The output is what is scored, so every pass runs to the end of the model;
but the blocks up to `layer` run once: the clean pass records their outputs and the spliced and ablated passes replay
them (identical inputs give identical outputs), running only the later blocks.
"""

import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import typing

import numpy as np
import torch
import tqdm

from saeflow import config, devices
from saeflow.analysis.inference import trained_layer
from saeflow.analysis.scoring import Scores, n_spliced_scored, next_token_logp, score_embeddings, score_lm, summarize
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract, hooks, models, specs
from saeflow.store import atomic, provenance, runs
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir
from saeflow.training import loaders, sae

logger = logging.getLogger(__name__)

DEFAULTS = config.section_defaults("evaluate")
MODES = ("clean", "spliced", "ablated", "mean_ablated")
# The mean relative error per position (|x - x_stored| / |x_stored|) the first batch's clean activations may have,
# by the coarsest dtype among the store dtype and the two compute dtypes. Measured on MiniLM (6 blocks): float16
# storage rounds by 2e-4, bfloat16 against float32 compute differs by 0.5-1.2%, 1% noise on every weight moves the
# activations by 1.4-3.4%; float32 leaves room for GPU kernels (TF32 convolutions) against CPU ones.
STORED_TOLERANCE = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 5e-2}
Reconstruct = typing.Callable[[torch.Tensor], torch.Tensor]  # raw activations (n, d) -> reconstruction (n, d)


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


@dataclasses.dataclass
class Spliceable:
    """A loaded model, its blocks, and how to run one batch to what is scored (logits or final hidden states)."""

    info: models.ModelInfo
    model: torch.nn.Module
    blocks: torch.nn.ModuleList
    causal: bool

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of a causal LM, else the final hidden states (B, T, D); float32."""
        if self.info.modality == "vision":
            out = self.model(pixel_values=inputs.to(next(self.model.parameters()).dtype))
        else:
            out = self.model(input_ids=inputs, attention_mask=torch.ones_like(inputs), use_cache=False)
        return (out.logits if self.causal else out.last_hidden_state).float()


def load_model(info: models.ModelInfo, spec: models.ModelSpec, compute_dtype: str, device) -> Spliceable:
    """The model with the weights extraction used; causal LMs with their LM head (random-init: tied or seeded)."""
    model = adapters.build(info, spec, compute_dtype, lm_head=True).to(device).eval()
    blocks = adapters.find_blocks(model.base_model if info.causal else model)
    return Spliceable(info, model, blocks, info.causal)


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


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def check_stored(sd: ShardDir, info: models.ModelInfo, layer: int, compute_dtype: str, lo: int, out_btd) -> None:
    """Refuse when the clean pass's block `layer` output for examples lo.. is not what the shards store (module
    docstring): the model is not the one extraction ran, and a splice into it would score another model."""
    got_btd = adapters.keep_stored(info, _hidden(out_btd)).float().cpu()
    stored_btd = torch.from_numpy(np.stack([sd.example(ex, layer) for ex in range(lo, lo + len(got_btd))])).float()
    err = float(((got_btd - stored_btd).norm(dim=-1) / stored_btd.norm(dim=-1).clamp_min(1e-12)).mean())
    dtypes = {sd.metadata.dtype, sd.metadata.data.get("compute_dtype", "float32"), compute_dtype}
    tol = max(STORED_TOLERANCE[dtype] for dtype in dtypes)
    if not err <= tol:
        raise SaeflowError(
            f"model {info.ckpt} ({info.source or 'random init'}) does not compute the activations stored in "
            f"{sd.dpath}: block {layer}, examples {lo}..{lo + len(got_btd) - 1}, mean relative error {err:.3g} > "
            f"{tol:g} ({'/'.join(sorted(dtypes))}); the model is not the one extraction ran (rewritten in place?), "
            "so evaluate will not score a splice into it: extract and train again"
        )


# ---------------------------------------------------------------------------------------------------------------
# Three passes
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _prefix(blocks: torch.nn.ModuleList, layer: int, outputs: dict, record: bool) -> typing.Iterator[None]:
    """Record the outputs of blocks 0..layer (the clean pass), or replay them: each block's forward returns its
    recorded output without computing, so the spliced and ablated passes run only the blocks after `layer`.

    The three passes see identical inputs up to block `layer`, so the replayed outputs are exactly the ones the
    blocks would compute again (the "early exit" a splice allows: the prefix runs once, not three times).
    """
    handles, patched = [], []
    try:
        for k in range(layer + 1):
            block = blocks[k]
            if record:
                handles.append(block.register_forward_hook(lambda mod, args, out, k=k: outputs.__setitem__(k, out)))
            else:
                patched.append((block, block.__dict__.get("forward")))
                block.forward = lambda *args, _out=outputs[k], **kwargs: _out
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block, original in patched:
            if original is None:
                del block.forward
            else:
                block.forward = original


def spliced_forward(
    m: Spliceable, layer: int, inputs: torch.Tensor, mask_bt: torch.Tensor, replace: Reconstruct | None,
    prefix: dict | None = None,
) -> torch.Tensor:
    """The model's output with block `layer`'s output at `mask_bt` replaced by `replace(x)`. `replace=None` is the
    clean pass, which records blocks 0..layer into `prefix`; the other passes replay them (prefix None: neither,
    every block runs)."""

    def hook(module, args, output):
        hidden = _hidden(output)
        x_nd = hidden[mask_bt].float()
        new = hidden.clone()
        new[mask_bt] = replace(x_nd).to(hidden.dtype)
        return (new, *output[1:]) if isinstance(output, (tuple, list)) else new

    reuse = contextlib.nullcontext() if prefix is None else _prefix(m.blocks, layer, prefix, record=replace is None)
    with reuse, torch.inference_mode():
        if replace is None:
            return m.forward(inputs)
        handle = m.blocks[layer].register_forward_hook(hook)
        try:
            return m.forward(inputs)
        finally:
            handle.remove()


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


def three_passes(
    m: Spliceable, plan: extract.Plan, view: loaders.LayerView, reconstruct: Reconstruct, n_ex: int, batch_size: int,
    device, progress: bool = True, check: typing.Callable[[int, typing.Any], None] | None = None,
    mean_d: torch.Tensor | None = None,
) -> dict:  # fmt: skip
    """Clean, spliced and zero-ablated outputs (and mean-ablated: `mean_d` written at every spliced position) of the
    first `n_ex` examples of the view's shards, the SAE spliced at the view's layer on its tokens; scored (the
    metrics of `summarize`). `check(lo, block output)` sees the first batch's clean output of that block
    (check_stored)."""
    batch, layer = example_inputs(plan, view.sd), view.layer
    replace = {"clean": None, "spliced": reconstruct, "ablated": torch.zeros_like}
    if mean_d is not None:
        mean_d = mean_d.to(device, torch.float32)
        replace["mean_ablated"] = lambda x_nd: mean_d.expand_as(x_nd)
    has_cls = m.info.cls_token or m.info.family in models.ENCODER_FAMILIES
    scores = Scores()
    scores.n_spliced = 0
    with tqdm.tqdm(total=n_ex, unit="ex", desc="evaluate (3 passes)", disable=not progress) as bar:
        for lo in range(0, n_ex, batch_size):
            hi = min(lo + batch_size, n_ex)
            inputs = batch(lo, hi).to(device)
            mask_bt = splice_mask(view, m.info, lo, hi).to(device)
            scores.n_spliced += n_spliced_scored(mask_bt, m.causal)
            prefix: dict = {}  # blocks 0..layer of the clean pass, replayed by the other two
            if m.causal:  # one pass's logits at a time beside the clean log-probs: memory 2 x (B, T, V)
                logp_clean = next_token_logp(spliced_forward(m, layer, inputs, mask_bt, None, prefix))
                for mode, fn in replace.items():
                    logits = None if fn is None else spliced_forward(m, layer, inputs, mask_bt, fn, prefix)
                    logp = logp_clean if fn is None else next_token_logp(logits)
                    score_lm(scores, mode, logp, logp_clean, inputs)
                    del logits, logp
            else:
                outs = {mode: spliced_forward(m, layer, inputs, mask_bt, fn, prefix) for mode, fn in replace.items()}
                score_embeddings(scores, outs, has_cls)
            if check is not None and lo == 0:
                check(lo, prefix[layer])
            bar.update(hi - lo)
    return summarize(scores, m.causal)


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def check_spec(run: runs.Run, plan: extract.Plan, model: sae.SAE, layer: int, shards_dpath: pathlib.Path) -> str:
    """The validation shard hash of the run, after checking that the spec is the one the run was validated on."""
    run_cfg = run.config()
    val_hash = run_cfg.get("val_shards") or run_cfg.get("train_shards")
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
    point = hooks.stored(plan.metadata.data)
    if point != hooks.RESIDUAL:
        raise SaeflowError(
            f"{run.config_fpath}: the run's shards hold hook point {point}; evaluate splices an SAE into the residual "
            "stream only (splicing at other hook points is not built yet)"
        )
    if layer not in plan.metadata.layers:
        layers = list(plan.metadata.layers)
        raise SaeflowError(f"{run.config_fpath}: layer {layer} is not among the spec's layers {layers}")
    if model.d_model != plan.info.d_model:
        raise SaeflowError(
            f"{run.sae_fpath}: the SAE takes d_model={model.d_model}, but {plan.info.ckpt} has d={plan.info.d_model}"
        )
    return val_hash


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


def run_evaluation(cfg: EvaluateConfig) -> pathlib.Path:
    """Evaluate the run's SAE spliced into its model; write RUN/evaluation/<val_shard_hash>.json atomically."""
    run = runs.open_run(cfg.run)
    sae_fpath = run.require_checkpoint()
    layer = trained_layer(run)
    model = sae.load_sae(sae_fpath)
    plan = extract.plan(cfg.spec)
    shards_dpath = (cfg.shards or run.link(run.VAL_SHARDS)).resolve()  # messages name the directory, not a link
    shard_hash = check_spec(run, plan, model, layer, shards_dpath)
    sd = open_val_shards(shards_dpath, shard_hash)
    tokens = run.tokens()
    view = loaders.LayerView(sd, layer, tokens)
    T = plan.metadata.tokens_per_ex
    n_ex = min(plan.metadata.n_ex, math.ceil(cfg.n_tokens / T))
    device = devices.resolve_device(cfg.device)
    started_at = provenance.utc_now()
    m = load_model(plan.info, cfg.spec.model, cfg.compute_dtype, device)
    model = model.to(device)

    def reconstruct(x_nd: torch.Tensor) -> torch.Tensor:
        return model(x_nd)[0]

    def check(lo: int, out_btd) -> None:
        check_stored(sd, plan.info, layer, cfg.compute_dtype, lo, out_btd)

    mean_d, n_mean = mean_activation(view)
    metrics = three_passes(m, plan, view, reconstruct, n_ex, cfg.batch_size, device, cfg.progress, check, mean_d)
    view.close()
    result = {
        "config": {
            "run": str(run.root.resolve()),
            "sae_sha256": file_sha256(sae_fpath),
            "shard_hash": shard_hash,
            "ckpt": plan.info.ckpt,
            "layer": layer,
            "tokens": tokens,
            "n_ex": n_ex,
            "tokens_per_ex": T,
            "compute_dtype": cfg.compute_dtype,
            "scored": "next-token predictions at positions 0..T-2" if m.causal else "one embedding per example",
            "mean_ablation": f"the mean of the {n_mean} vectors of the validation shards at tokens={tokens!r}",
        },
        "metrics": metrics,
        "provenance": {**provenance.collect(), "device": str(device), "started_at": started_at,
                       "finished_at": provenance.utc_now()},
    }  # fmt: skip
    out_fpath = run.evaluation_fpath(shard_hash)
    out_fpath.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_fpath, result)
    logger.info("%s", json.dumps(metrics))
    return out_fpath


def read_metrics(fpath: pathlib.Path) -> dict:
    """The `metrics` object of an evaluation file (summary)."""
    from saeflow.store.hashing import read_json_object

    obj = read_json_object(fpath, "evaluation JSON object")
    metrics = obj.get("metrics")
    if not isinstance(metrics, dict):
        raise SaeflowError(f"{fpath}: no `metrics` object; rerun `saeflow evaluate`")
    return metrics
