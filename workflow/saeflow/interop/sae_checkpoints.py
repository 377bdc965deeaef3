"""SAE checkpoints in and out: SAELens and sparsify directories <-> saeflow's `sae.pt` and run directories.

Both libraries compute, in RAW activation space (no input scaling at inference),

    f     = act((x - b_dec) @ W_enc + b_enc)        SAELens: W_enc (d_in, d_sae); sparsify: encoder.weight (d_sae, d_in)
    x_hat = f @ W_dec + b_dec                        W_dec (d_sae, d_in) in both

saeflow computes the same in normalized space, x_n = x * scale (docs/training.md). Exports FOLD the scale into the
weights, as SAELens's own `fold_activation_norm_scaling_factor` does: W_enc * scale, W_dec / scale, b_dec / scale,
b_enc and the BatchTopK threshold unchanged. The codes f are then identical to saeflow's and x_hat is raw; the
decoder rows have norm 1 / scale instead of 1 (so sparsify's cfg says normalize_decoder=false). Imports take the
weights as they are, with scale = 1.

Each architecture says how it maps (training/archs: `Arch.saelens`, `saelens_export`, `saelens_import`,
`Arch.sparsify`; None refuses in one line):

    saeflow arch     SAELens architecture                        sparsify activation
    relu             standard                                    (none: refused)
    topk             topk (rescale_acts_by_decoder_norm=false)   topk
    batchtopk        jumprelu, threshold = the scalar per latent (none: refused)
    jumprelu         jumprelu, threshold = exp(log_threshold)     (none: refused)
    gated            gated (b_gate = b_enc, b_mag, r_mag)          (none: refused)

An import becomes a run directory (`runs.create_run`) whose checkpoint/config.json names its origin (format, the
source cfg.json, the sha256 of the weights file), the layer and the shard directory it is meant for; its sha256 is
the run id, so importing the same files for the same shards and layer gives the same run.
"""

import dataclasses
import json
import logging
import os
import pathlib

import torch

from saeflow.errors import SaeflowError, unreadable
from saeflow.interop.spec import SAE_FORMATS
from saeflow.store import atomic, runs
from saeflow.store.hashing import file_sha256
from saeflow.training import archs, sae

logger = logging.getLogger(__name__)

CFG_FNAME = "cfg.json"  # both libraries
WEIGHTS_FNAMES = {"saelens": "sae_weights.safetensors", "sparsify": "sae.safetensors"}
IMPORT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RawWeights:
    """An SAE in raw activation space (the convention above); `threshold` the inference threshold of an architecture
    that has one (`Arch.has_threshold`; None otherwise)."""

    W_enc_ds: torch.Tensor
    b_enc_s: torch.Tensor
    W_dec_sd: torch.Tensor
    b_dec_d: torch.Tensor
    threshold: float | None = None
    extra: dict = dataclasses.field(default_factory=dict)  # the architecture's own parameters (Arch.parameters)


def raw_weights(model: sae.SAE) -> RawWeights:
    """Fold saeflow's input scale into the weights: the same codes, a raw-space reconstruction."""
    scale = float(model.scale)
    with torch.no_grad():
        return RawWeights(
            W_enc_ds=(model.W_enc * scale).contiguous(),
            b_enc_s=model.b_enc.clone(),
            W_dec_sd=(model.W_dec / scale).contiguous(),
            b_dec_d=model.b_dec / scale,
            threshold=float(model.threshold) if model.arch.has_threshold else None,
            extra={name: getattr(model, name).detach().clone() for name in model.arch.parameters(model.d_sae)},
        )


def from_raw(weights: RawWeights, arch: str, k: int) -> sae.SAE:
    """A saeflow SAE (scale 1) computing exactly what the raw weights compute."""
    return sae.SAE.from_weights(
        weights.W_enc_ds, weights.b_enc_s, weights.W_dec_sd, weights.b_dec_d,
        arch=arch, k=k, scale=1.0, threshold=weights.threshold or 0.0, extra=weights.extra,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def export_run(run_dpath: str | os.PathLike, fmt: str, out_dpath: str | os.PathLike) -> pathlib.Path:
    """Write the run's SAE as a SAELens or sparsify directory OUT (cfg.json + safetensors), published atomically."""
    run = runs.open_run(run_dpath)
    model = sae.load_sae(run.require_checkpoint())
    layer = run.config().get("layer")
    origin = {"run_id": run.run_id, "layer": layer, "scale_folded": float(model.scale), "arch": model.cfg.arch}
    if model.cfg.matryoshka:
        origin["matryoshka"] = list(model.cfg.matryoshka)
    return export_sae(model, fmt, out_dpath, origin)


def export_sae(model: sae.SAE, fmt: str, out_dpath: str | os.PathLike, origin: dict | None = None) -> pathlib.Path:
    """Write `model` as a `fmt` directory; `origin` (JSON) is recorded in cfg.json under "saeflow"."""
    import safetensors.torch

    _check_format(fmt)
    out_dpath = pathlib.Path(out_dpath)
    if model.cfg.transcoder:  # its target's scale, output width and skip path have no place in these files yet
        raise SaeflowError(f"{out_dpath}: a transcoder; saeflow exports SAEs to {fmt} (transcoders: not yet)")
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; exports never overwrite")
    cfg, tensors = (_saelens_files if fmt == "saelens" else _sparsify_files)(model, origin or {})
    with atomic.building_dir(out_dpath) as staging_dpath:
        safetensors.torch.save_file(tensors, str(staging_dpath / WEIGHTS_FNAMES[fmt]))
        atomic.write_json(staging_dpath / CFG_FNAME, cfg)
    return out_dpath


def _check_format(fmt: str) -> None:
    if fmt not in SAE_FORMATS:
        raise SaeflowError(f"unknown SAE checkpoint format {fmt!r}; choose one of {SAE_FORMATS}")


def _saelens_files(model: sae.SAE, origin: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """SAELens 6.x inference SAE: cfg.json as `SAEConfig.to_dict()` writes it, sae_weights.safetensors."""
    if model.arch.saelens is None:
        raise SaeflowError(f"SAELens has no architecture that computes a {model.cfg.arch} SAE")
    weights = raw_weights(model)
    cfg = {
        "architecture": model.arch.saelens,
        "d_in": model.d_model,
        "d_sae": model.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",  # the scale is folded into the weights
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.0.0", "saeflow": {**origin, "arch": model.cfg.arch}},
    }
    tensors = {"W_enc": weights.W_enc_ds, "b_enc": weights.b_enc_s, "W_dec": weights.W_dec_sd, "b_dec": weights.b_dec_d,
               **weights.extra}  # fmt: skip
    cfg_extra, tensors = model.arch.saelens_export(model, tensors, weights.threshold)
    cfg.update(cfg_extra)
    return cfg, {name: t.detach().float().contiguous() for name, t in tensors.items()}


def _sparsify_files(model: sae.SAE, origin: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """sparsify `Sae.save_to_disk`'s files: cfg.json (SparseCoderConfig + d_in), sae.safetensors."""
    if model.arch.sparsify is None:
        raise SaeflowError(
            f"sparsify has TopK SAEs only (activation topk or groupmax); this SAE is {model.cfg.arch}: "
            f"export it with --format saelens"
        )
    weights = raw_weights(model)
    cfg = {
        "activation": model.arch.sparsify,
        "expansion_factor": max(1, model.d_sae // model.d_model),
        "normalize_decoder": False,  # decoder rows have norm 1/scale once the scale is folded
        "num_latents": model.d_sae,
        "k": model.cfg.k,
        "multi_topk": False,
        "skip_connection": False,
        "transcode": False,
        "d_in": model.d_model,
        "saeflow": origin,
    }
    tensors = {
        "encoder.weight": weights.W_enc_ds.T,
        "encoder.bias": weights.b_enc_s,
        "W_dec": weights.W_dec_sd,
        "b_dec": weights.b_dec_d,
    }
    return cfg, {name: t.detach().float().contiguous() for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Imported:
    """A checkpoint read from another library, as saeflow sees it."""

    fmt: str
    arch: str
    k: int
    weights: RawWeights
    source_cfg: dict
    weights_fpath: pathlib.Path

    def sae(self) -> sae.SAE:
        return from_raw(self.weights, self.arch, self.k)


def sae_subdirs(src_dpath: pathlib.Path, max_depth: int = 3) -> list[str]:
    """The SAE directories (cfg.json beside a weights file) below SRC, up to `max_depth` levels down, as paths
    relative to it: a sparsify Trainer run's root holds one per hookpoint (`layers.6/`, beside the run's own cfg.json),
    a root of several seeds or runs one more level down (`seed0/layers.6/`)."""
    if not src_dpath.is_dir():
        return []
    found = set()
    for depth in range(1, max_depth + 1):
        for cfg_fpath in src_dpath.glob("/".join(["*"] * depth + [CFG_FNAME])):
            if any((cfg_fpath.parent / fname).is_file() for fname in WEIGHTS_FNAMES.values()):
                found.add(cfg_fpath.parent.relative_to(src_dpath).as_posix())
    return sorted(found)


def detect_format(src_dpath: pathlib.Path) -> str:
    """saelens or sparsify, from the weights file in SRC."""
    found = [fmt for fmt in SAE_FORMATS if (src_dpath / WEIGHTS_FNAMES[fmt]).is_file()]
    if len(found) == 1:
        return found[0]
    subdirs = sae_subdirs(src_dpath)
    more = f" and {len(subdirs) - 8} more" if len(subdirs) > 8 else ""
    hint = f"; it holds SAE directories {', '.join(subdirs[:8])}{more}: give one of them" if subdirs else ""
    raise SaeflowError(
        f"{src_dpath}: not a SAELens ({WEIGHTS_FNAMES['saelens']}) or sparsify ({WEIGHTS_FNAMES['sparsify']}) "
        f"SAE directory{hint}"
    )


def read_checkpoint(src_dpath: str | os.PathLike, fmt: str | None = None) -> Imported:
    """Read a SAELens or sparsify SAE directory (format detected when `fmt` is None) without running their code."""
    src_dpath = pathlib.Path(src_dpath)
    fmt = fmt or detect_format(src_dpath)
    _check_format(fmt)
    cfg = _read_cfg(src_dpath / CFG_FNAME)
    weights_fpath = src_dpath / WEIGHTS_FNAMES[fmt]
    tensors = _read_tensors(weights_fpath)
    try:
        arch, k, weights = (_from_saelens if fmt == "saelens" else _from_sparsify)(cfg, tensors)
    except KeyError as err:
        raise SaeflowError(f"{src_dpath}: {fmt} checkpoint lacks {err}") from None
    except archs.Unsupported as err:
        raise SaeflowError(f"{src_dpath}: cannot import: {err}") from None
    d_sae, d_model = weights.W_dec_sd.shape
    extra_ok = all(t.shape == (d_sae,) for t in weights.extra.values())
    if weights.W_enc_ds.shape != (d_model, d_sae) or weights.b_enc_s.shape != (d_sae,) or weights.b_dec_d.shape != (
        d_model,
    ) or not extra_ok:
        raise SaeflowError(f"{weights_fpath}: inconsistent shapes (W_dec {tuple(weights.W_dec_sd.shape)}, W_enc "
                           f"{tuple(weights.W_enc_ds.shape)}, b_enc {tuple(weights.b_enc_s.shape)}, b_dec "
                           f"{tuple(weights.b_dec_d.shape)})")  # fmt: skip
    return Imported(fmt, arch, k, weights, cfg, weights_fpath)


def _read_cfg(fpath: pathlib.Path) -> dict:
    try:
        cfg = json.loads(fpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: missing") from None
    except OSError as err:
        raise unreadable(fpath, err) from None
    except ValueError as err:
        raise SaeflowError(f"{fpath}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise SaeflowError(f"{fpath}: holds a {type(cfg).__name__}, not a config object")
    return cfg


def _read_tensors(fpath: pathlib.Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    try:
        tensors = safetensors.torch.load_file(str(fpath), device="cpu")
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: missing") from None
    except OSError as err:
        raise unreadable(fpath, err) from None
    except Exception as err:  # safetensors raises its own SafetensorError on a damaged header
        raise SaeflowError(f"{fpath}: not a readable safetensors file ({err})") from None
    return {name: t.to(torch.float32) for name, t in tensors.items()}


def _refuse_unless(ok: bool, what: str) -> None:
    if not ok:
        raise archs.Unsupported(what)


def _checked_k(k) -> int:
    if type(k) is not int or k < 1:
        raise archs.Unsupported(f"k={k!r} (k must be a positive integer)")
    return k


def _saelens_k(cfg: dict) -> int:
    """k of a TopK SAE, or of a BatchTopK SAE saved as JumpReLU (SAELens keeps it only in the training metadata);
    1 when unnamed (BatchTopK's k matters in training only)."""
    metadata = cfg.get("metadata")
    details = metadata.get("training_architecture_details") if isinstance(metadata, dict) else None
    return _checked_k(cfg.get("k") or (details.get("k") if isinstance(details, dict) else None) or 1)


def _from_saelens(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[str, int, RawWeights]:
    """SAELens 6.x, through the architecture saved under its name (`archs.from_saelens`, `Arch.saelens_import`)."""
    norm = cfg.get("normalize_activations", "none")
    arch = archs.from_saelens(cfg.get("architecture", "standard"), cfg)
    _refuse_unless(norm in ("none", None), f"normalize_activations={norm!r}: saeflow SAEs have no run-time input "
                   "normalization; fold it first (SAELens: sae.fold_activation_norm_scaling_factor)")  # fmt: skip
    _refuse_unless(cfg.get("reshape_activations", "none") == "none", "hook_z (per-head) SAEs")
    W_enc, W_dec, b_dec = (tensors[n] for n in ("W_enc", "W_dec", "b_dec"))
    common = {"W_enc": W_enc, "b_enc": tensors.get("b_enc"), "W_dec": W_dec, "b_dec": b_dec, "threshold": None}
    weights = arch.saelens_import(cfg, tensors, common)
    if weights["b_enc"] is None:
        raise KeyError("b_enc")
    if not cfg.get("apply_b_dec_to_input", True):  # x @ W_enc + b_enc == (x - b_dec) @ W_enc + (b_enc + b_dec @ W_enc)
        weights["b_enc"] = weights["b_enc"] + b_dec @ weights["W_enc"]
    k = _saelens_k(cfg) if arch.uses_k else 1
    extra = {name: weights[name] for name in arch.parameters(W_dec.shape[0])}
    raw = RawWeights(*(weights[n] for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")), extra)
    return arch.name, min(k, W_dec.shape[0]), raw


def _from_sparsify(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[str, int, RawWeights]:
    """sparsify SparseCoder with an activation an architecture is saved as (`Arch.sparsify`: topk), autoencoding
    (no transcoder, no skip connection)."""
    activation = cfg.get("activation", "topk")
    found = [arch for arch in archs.REGISTRY.values() if arch.sparsify is not None and arch.sparsify == activation]
    _refuse_unless(bool(found), f"sparsify activation {cfg.get('activation')!r}")
    _refuse_unless(not cfg.get("transcode") and not cfg.get("skip_connection"), "sparsify transcoders and skip "
                   "connections (saeflow SAEs reconstruct their input)")  # fmt: skip
    weights = RawWeights(tensors["encoder.weight"].T.contiguous(), tensors["encoder.bias"], tensors["W_dec"],
                         tensors["b_dec"])  # fmt: skip
    return found[0].name, _checked_k(cfg.get("k", 32)), weights


def import_checkpoint(
    src_dpath: str | os.PathLike,
    runs_root: str | os.PathLike,
    shards_dpath: str | os.PathLike,
    layer: int | None = None,
    fmt: str | None = None,
) -> runs.Run:
    """Make (or find) the run directory of an imported SAE, ready for `saeflow inference --run RUN --shards DIR`."""
    from saeflow.store.shards import ShardDir

    imported = read_checkpoint(src_dpath, fmt)
    sd = ShardDir(shards_dpath)
    md = sd.metadata
    layer = _pick_layer(layer, md.layers, sd.dpath)
    d_sae, d_model = imported.weights.W_dec_sd.shape
    if d_model != md.d_model:
        raise SaeflowError(f"{imported.weights_fpath}: the SAE takes d_model={d_model}, but {sd.dpath} has "
                           f"d_model={md.d_model}")  # fmt: skip
    run_config = {
        "imported": {
            "format": imported.fmt,
            "cfg": imported.source_cfg,
            "weights_sha256": file_sha256(imported.weights_fpath),
            "importer_version": IMPORT_VERSION,
        },
        "arch": imported.arch,
        "k": imported.k,
        "d_model": d_model,
        "d_sae": d_sae,
        "layer": layer,
        "shards": sd.hash,
    }
    run = runs.create_run(runs_root, run_config, train_shards=sd.dpath)
    with atomic.exclusive_lock(run.lock_fpath):
        if not run.sae_fpath.exists():
            sae.save_sae(imported.sae(), run.sae_fpath, readonly=True)
    logger.info("imported %s (%s) as %s", src_dpath, imported.fmt, run.root)
    return run


def _pick_layer(layer: int | None, layers: tuple[int, ...], shards_dpath: pathlib.Path) -> int:
    if layer is None:
        if len(layers) != 1:
            raise SaeflowError(f"{shards_dpath} stores layers {list(layers)}: say which one the SAE reads (--layer)")
        return layers[0]
    if layer not in layers:
        raise SaeflowError(f"--layer {layer}: {shards_dpath} stores layers {list(layers)}")
    return layer
