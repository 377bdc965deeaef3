"""The SAELens and sparsify files of an SAE or transcoder, in raw activation space (sae_checkpoints.py says how
the scales fold; docs/interop.md has the tables).

A transcoder in raw space (what SAELens's Transcoder/SkipTranscoder and sparsify's `transcode=True` compute):

    f     = act(x @ W_enc + b_enc)                   no b_dec centring: b_dec lives in the target's space
    y_hat = f @ W_dec + b_dec (+ x @ W_skip)         W_dec (d_sae, d_out); both files store W_skip as (d_out, d_in)

sparsify's `skip_connection` without `transcode` is an SAE with a skip path, centred by b_dec: saeflow imports it as a
skip transcoder whose target is its input, the centring folded into b_enc (b_enc - b_dec @ W_enc).
"""

import dataclasses

import torch

from saeflow.errors import SaeflowError
from saeflow.interop.checkpoints import hooknames
from saeflow.training import archs, sae


@dataclasses.dataclass(frozen=True)
class RawWeights:
    """An SAE or transcoder in raw activation space (the convention above); `threshold` the inference threshold of an
    architecture that has one (`Arch.has_threshold`; None otherwise)."""

    W_enc_ds: torch.Tensor
    b_enc_s: torch.Tensor
    W_dec_sd: torch.Tensor  # (d_sae, d_out): d_out = d_model for an SAE
    b_dec_d: torch.Tensor
    threshold: float | None = None
    extra: dict = dataclasses.field(default_factory=dict)  # the architecture's own parameters (Arch.parameters)
    transcoder: bool = False  # pre-activations x @ W_enc + b_enc: no b_dec centring
    W_skip_dd: torch.Tensor | None = None  # a skip transcoder's (d_model, d_out): y_hat += x @ W_skip


def raw_weights(model: sae.SAE) -> RawWeights:
    """Fold saeflow's input scale (and a transcoder's target scale) into the weights: the same codes, a raw-space
    output."""
    scale, out_scale = float(model.scale), float(model.out_scale)
    with torch.no_grad():
        skip = model.skip_normed(torch.eye(model.d_model)) if model.cfg.skip else None  # W_skip
        return RawWeights(
            W_enc_ds=(model.W_enc * scale).contiguous(),
            b_enc_s=model.b_enc.clone(),
            W_dec_sd=(model.W_dec / out_scale).contiguous(),
            b_dec_d=model.b_dec / out_scale,
            threshold=float(model.threshold) if model.arch.has_threshold else None,
            extra={name: getattr(model, name).detach().clone() for name in model.arch.parameters(model.d_sae)},
            transcoder=model.cfg.transcoder,
            W_skip_dd=None if skip is None else (skip * scale / out_scale).contiguous(),
        )


def from_raw(weights: RawWeights, arch: str, k: int) -> sae.SAE:
    """A saeflow SAE or transcoder (scales 1) computing exactly what the raw weights compute."""
    return sae.SAE.from_weights(
        weights.W_enc_ds, weights.b_enc_s, weights.W_dec_sd, weights.b_dec_d,
        arch=arch, k=k, scale=1.0, threshold=weights.threshold or 0.0, extra=weights.extra,
        transcoder=weights.transcoder, W_skip_dd=weights.W_skip_dd,
    )  # fmt: skip


def _float32(tensors: dict) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().contiguous() for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def saelens_files(model: sae.SAE, origin: dict, names: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """SAELens 6.x inference SAE or transcoder: cfg.json as `SAEConfig.to_dict()` writes it, sae_weights.safetensors;
    `names`: the TransformerLens hook names (`hook_name`, a transcoder's `hook_name_out`) for its metadata."""
    transcoder = model.cfg.transcoder
    name = model.arch.saelens_transcoder if transcoder else model.arch.saelens
    if name is None:
        what = "transcoder (its transcoders are ReLU or JumpReLU)" if transcoder else "SAE"
        hint = ": export it with --format sparsify" if model.arch.sparsify is not None else ""
        raise SaeflowError(f"SAELens has no architecture that computes a {model.cfg.arch} {what}{hint}")
    if model.cfg.skip:
        name = name.replace("transcoder", "skip_transcoder")
    weights = raw_weights(model)
    cfg = {
        "architecture": name,
        "d_in": model.d_model,
        "d_sae": model.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": not transcoder,  # SAELens's transcoders refuse true: their b_dec is the target's
        "normalize_activations": "none",  # the scales are folded into the weights
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.0.0", **names, "saeflow": {**origin, "arch": model.cfg.arch}},
        **({"d_out": model.d_out} if transcoder else {}),
    }
    tensors = {"W_enc": weights.W_enc_ds, "b_enc": weights.b_enc_s, "W_dec": weights.W_dec_sd, "b_dec": weights.b_dec_d,
               **weights.extra}  # fmt: skip
    cfg_extra, tensors = model.arch.saelens_export(model, tensors, weights.threshold)
    cfg.update(cfg_extra)
    if weights.W_skip_dd is not None:
        tensors["W_skip"] = weights.W_skip_dd.T
    return cfg, _float32(tensors)


def sparsify_files(model: sae.SAE, origin: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """sparsify `SparseCoder.save_to_disk`'s files: cfg.json (SparseCoderConfig + d_in), sae.safetensors."""
    if model.arch.sparsify is None:
        raise SaeflowError(
            f"sparsify has TopK SAEs only (activation topk or groupmax); this SAE is {model.cfg.arch}: "
            f"export it with --format saelens"
        )
    if model.d_out != model.d_model:
        raise SaeflowError(f"sparsify's transcoders predict a target as wide as their input; this one maps d_model="
                           f"{model.d_model} to d_out={model.d_out}")  # fmt: skip
    weights = raw_weights(model)
    cfg = {
        "activation": model.arch.sparsify,
        "expansion_factor": max(1, model.d_sae // model.d_model),
        "normalize_decoder": False,  # decoder rows have norm 1/scale once the scale is folded
        "num_latents": model.d_sae,
        "k": model.cfg.k,
        "multi_topk": False,
        "skip_connection": model.cfg.skip,
        "transcode": model.cfg.transcoder,
        "d_in": model.d_model,
        "saeflow": origin,
    }
    tensors = {
        "encoder.weight": weights.W_enc_ds.T,
        "encoder.bias": weights.b_enc_s,
        "W_dec": weights.W_dec_sd,
        "b_dec": weights.b_dec_d,
    }
    if weights.W_skip_dd is not None:
        tensors["W_skip"] = weights.W_skip_dd.T
    return cfg, _float32(tensors)


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------


def refuse_unless(ok: bool, what: str) -> None:
    if not ok:
        raise archs.Unsupported(what)


def checked_k(k) -> int:
    if type(k) is not int or k < 1:
        raise archs.Unsupported(f"k={k!r} (k must be a positive integer)")
    return k


# SAELens's run-time input normalizations: what can be done about each (sae_lens/saes/sae.py)
RUN_TIME_NORMS = {
    "expected_average_only_in": "one constant scale: fold it first (SAELens: sae.fold_activation_norm_scaling_factor)",
    "covariance_whitening": "an affine map: fold it first (SAELens: sae.fold_activation_whitening)",
    "layer_norm": "each input is centred and scaled by its own mean and std, which no weights can fold in",
    "constant_norm_rescale": "each input is scaled by its own norm, which no weights can fold in",
}


def _saelens_k(cfg: dict) -> int:
    """k of a TopK SAE, or of a BatchTopK SAE saved as JumpReLU (SAELens keeps it only in the training metadata);
    1 when unnamed (BatchTopK's k matters in training only)."""
    metadata = cfg.get("metadata")
    details = metadata.get("training_architecture_details") if isinstance(metadata, dict) else None
    return checked_k(cfg.get("k") or (details.get("k") if isinstance(details, dict) else None) or 1)


def from_saelens(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[str, int, RawWeights]:
    """SAELens 6.x, through the architecture saved under its name (`archs.from_saelens`, `Arch.saelens_import`);
    a transcoder (`*transcoder`, `d_out`) reads no b_dec on its input and may have a skip path."""
    norm = cfg.get("normalize_activations", "none")
    name = cfg.get("architecture", "standard")
    transcoder = isinstance(name, str) and name.endswith("transcoder")
    arch = archs.from_saelens(name, cfg, transcoder=transcoder)
    refuse_unless(norm in ("none", None), f"normalize_activations={norm!r}: saeflow SAEs have no run-time input "
                  f"normalization; {RUN_TIME_NORMS.get(str(norm), 'saeflow cannot represent it')}")  # fmt: skip
    refuse_unless(cfg.get("reshape_activations", "none") == "none", "hook_z (per-head) SAEs")
    refuse_unless(not (transcoder and cfg.get("apply_b_dec_to_input", False)), "apply_b_dec_to_input=true on a "
                  "transcoder (its b_dec is the target's; SAELens refuses it too)")  # fmt: skip
    common = {"W_enc": None, "b_enc": tensors.get("b_enc"), "threshold": None,
              **{n: tensors[n] for n in arch.saelens_tensors}}  # what the architecture's file holds (mp: no W_enc)
    weights = arch.saelens_import(cfg, tensors, common)
    for n in ("W_enc", "b_enc"):
        if weights[n] is None:
            raise KeyError(n)
    W_dec, b_dec = weights["W_dec"], weights["b_dec"]
    if not transcoder and not cfg.get("apply_b_dec_to_input", True):  # x @ W_enc + b_enc ==
        weights["b_enc"] = weights["b_enc"] + b_dec @ weights["W_enc"]  # (x - b_dec) @ W_enc + (b_enc + b_dec @ W_enc)
    skip = transcoder and "skip_transcoder" in name
    k = weights.get("k") or (_saelens_k(cfg) if arch.uses_k else 1)  # `k`: an architecture's own key for it (mp)
    extra = {n: weights[n] for n in arch.parameters(W_dec.shape[0])}
    raw = RawWeights(*(weights[n] for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")), extra,
                     transcoder=transcoder, W_skip_dd=tensors["W_skip"].T.contiguous() if skip else None)  # fmt: skip
    return arch.name, k, raw  # k <= d_sae: checkpoint_files.check_cfg


def from_sparsify(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[str, int, RawWeights]:
    """sparsify SparseCoder with an activation an architecture is saved as (`Arch.sparsify`: topk): an SAE, a
    transcoder (`transcode`), either with a skip path (`skip_connection`; an SAE's becomes a transcoder of its
    input, the b_dec centring folded into b_enc)."""
    activation = cfg.get("activation", "topk")
    found = [arch for arch in archs.REGISTRY.values() if arch.sparsify is not None and arch.sparsify == activation]
    refuse_unless(bool(found), f"sparsify activation {cfg.get('activation')!r}")
    transcode, skip = bool(cfg.get("transcode")), bool(cfg.get("skip_connection"))
    W_enc, b_enc, b_dec = tensors["encoder.weight"].T.contiguous(), tensors["encoder.bias"], tensors["b_dec"]
    if skip and not transcode:
        b_enc = b_enc - b_dec @ W_enc
    W_skip = tensors["W_skip"].T.contiguous() if skip else None
    weights = RawWeights(W_enc, b_enc, tensors["W_dec"], b_dec, transcoder=transcode or skip, W_skip_dd=W_skip)
    return found[0].name, checked_k(cfg.get("k", 32)), weights


def check_shapes(weights: RawWeights) -> str | None:
    """What is inconsistent about the weights' shapes (None: nothing)."""
    d_model, d_sae = weights.W_enc_ds.shape if weights.W_enc_ds.ndim == 2 else (-1, -1)
    d_out = weights.W_dec_sd.shape[-1]
    ok = (weights.W_dec_sd.shape == (d_sae, d_out) and weights.b_enc_s.shape == (d_sae,)
          and weights.b_dec_d.shape == (d_out,) and (weights.transcoder or d_out == d_model)
          and all(t.shape == (d_sae,) for t in weights.extra.values())
          and (weights.W_skip_dd is None or weights.W_skip_dd.shape == (d_model, d_out)))  # fmt: skip
    if ok:
        return None
    shapes = {"W_enc": weights.W_enc_ds, "b_enc": weights.b_enc_s, "W_dec": weights.W_dec_sd, "b_dec": weights.b_dec_d,
              **({} if weights.W_skip_dd is None else {"W_skip (transposed)": weights.W_skip_dd})}  # fmt: skip
    return "inconsistent shapes (" + ", ".join(f"{n} {tuple(t.shape)}" for n, t in shapes.items()) + ")"


# ---------------------------------------------------------------------------------------------------------------
# hook names
# ---------------------------------------------------------------------------------------------------------------


def source_names(fmt: str, cfg: dict, dir_name: str, transcoder: bool, target_is_input: bool) -> dict:
    """The names the checkpoint gives what it reads (and a transcoder's target), with saeflow's hook point and layer
    where one maps (`hooknames`): {"input": {"name", "hook", "layer"}, "target": {...}}; {} when it names none.
    sparsify keeps the hookpoint in the directory's name only (or our export's `saeflow.hookpoint`)."""
    if fmt == "saelens":
        metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
        name_in = metadata.get("hook_name", cfg.get("hook_name"))
        name_out = metadata.get("hook_name_out", cfg.get("hook_name_out"))
        where_in, where_out = hooknames.from_transformerlens(name_in), hooknames.from_transformerlens(name_out)
    else:
        ours = cfg.get("saeflow") if isinstance(cfg.get("saeflow"), dict) else {}
        name_in = name_out = ours.get("hookpoint", dir_name)
        where_in, where_out = hooknames.from_sparsify(name_in, transcoder and not target_is_input)
        if where_out is None and "hookpoint" not in ours:
            return {}  # a directory name that is no hookpoint
    found = {}
    for role, name, where in (("input", name_in, where_in), ("target", name_out, where_out)):
        if isinstance(name, str) and (role == "input" or transcoder):
            found[role] = {"name": name, **({} if where is None else {"hook": where[0], "layer": where[1]})}
    return found
