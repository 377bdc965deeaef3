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

Transcoders (a target other than the input, optionally a skip path) map too: sae_formats.py has their maths and
files (SAELens transcoder / jumprelu_transcoder and their skip_ variants; sparsify transcode / skip_connection), and
hooknames.py the other tools' names of the activations read and predicted, which exports write and imports record.

An import becomes a run directory (`runs.create_run`) whose checkpoint/config.json names its origin (format, the
source cfg.json, the sha256 of the weights file), the layer and the shard directory it is meant for; its sha256 is
the run id, so importing the same files for the same shards and layer gives the same run.
"""

import dataclasses
import logging
import os
import pathlib

from saeflow.errors import SaeflowError
from saeflow.interop.checkpoints import checkpoint_files, hooknames, sae_formats
from saeflow.interop.spec import CHECKPOINT_FORMATS, CIRCUIT_TRACER, SAE_FORMATS
from saeflow.store import atomic, runs
from saeflow.training import archs, sae

logger = logging.getLogger(__name__)

CFG_FNAME = "cfg.json"  # both libraries
WEIGHTS_FNAMES = {"saelens": "sae_weights.safetensors", "sparsify": "sae.safetensors"}
IMPORT_VERSION = 1


RawWeights, raw_weights, from_raw = sae_formats.RawWeights, sae_formats.raw_weights, sae_formats.from_raw


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def export_run(run_dpath: str | os.PathLike, fmt: str, out_dpath: str | os.PathLike) -> pathlib.Path:
    """Write the run's SAE as a SAELens or sparsify directory OUT (cfg.json + safetensors), published atomically."""
    run = runs.open_run(run_dpath)
    model = sae.load_sae(run.require_checkpoint())
    layer = run.config().get("layer")
    origin = {"run_id": run.run_id, "layer": layer, "scale_folded": float(model.scale), "arch": model.cfg.arch}
    if model.cfg.transcoder:
        origin["target_scale_folded"] = float(model.target_scale)
    if model.cfg.matryoshka:
        origin["matryoshka"] = list(model.cfg.matryoshka)
    return export_sae(model, fmt, out_dpath, origin, hooknames.run_where(run, layer, model.cfg.transcoder))


def export_sae(model: sae.SAE, fmt: str, out_dpath: str | os.PathLike, origin: dict | None = None,
               where: dict | None = None) -> pathlib.Path:  # fmt: skip
    """Write `model` as a `fmt` directory; `origin` (JSON) is recorded in cfg.json under "saeflow"; `where`: the
    family and the (hook, layer) of its input (and target), whose names in the other tool cfg.json records."""
    import safetensors.torch

    _check_format(fmt)
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; exports never overwrite")
    where, origin = where or {}, dict(origin or {})
    if "input" in where:
        origin["hook"] = list(where["input"])
        origin.update({"target_hook": list(where["target"])} if "target" in where else {})
    if fmt == "saelens":
        names = {"hook_name": hooknames.to_transformerlens(where["input"])} if "input" in where else {}
        names.update({"hook_name_out": hooknames.to_transformerlens(where["target"])} if "target" in where else {})
        cfg, tensors = sae_formats.saelens_files(model, origin, names)
    else:
        hookpoint = hooknames.to_sparsify(where["family"], where["input"], where.get("target")) if where else None
        cfg, tensors = sae_formats.sparsify_files(model, {**origin, **({"hookpoint": hookpoint} if hookpoint else {})})
    with atomic.building_dir(out_dpath) as staging_dpath:
        safetensors.torch.save_file(tensors, str(staging_dpath / WEIGHTS_FNAMES[fmt]))
        atomic.write_json(staging_dpath / CFG_FNAME, cfg)
    return out_dpath


def _check_format(fmt: str, formats: tuple[str, ...] = SAE_FORMATS) -> None:
    if fmt not in formats:
        raise SaeflowError(f"unknown SAE checkpoint format {fmt!r}; choose one of {formats}")


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
    weights_sha256: str  # of the bytes read, so the run names what it holds
    hooks: dict = dataclasses.field(default_factory=dict)  # the names it gives its input and target (sae_formats)
    target_is_input: bool = False  # a transcoder of its own input (a sparsify SAE with a skip connection)

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
    """saelens or sparsify, from the weights file in SRC (one that exists, whatever its type: `checkpoint_files`
    refuses what is no regular file)."""
    from saeflow.interop.checkpoints import circuit_tracer

    found = [fmt for fmt in SAE_FORMATS if (src_dpath / WEIGHTS_FNAMES[fmt]).exists()]
    found += [CIRCUIT_TRACER] if circuit_tracer.is_set(src_dpath) else []
    if len(found) == 1:
        return found[0]
    if found:
        raise SaeflowError(f"{src_dpath}: holds both a SAELens ({WEIGHTS_FNAMES['saelens']}) and a sparsify "
                           f"({WEIGHTS_FNAMES['sparsify']}) SAE: say which (--format saelens or --format sparsify)")
    subdirs = sae_subdirs(src_dpath)
    more = f" and {len(subdirs) - 8} more" if len(subdirs) > 8 else ""
    hint = f"; it holds SAE directories {', '.join(subdirs[:8])}{more}: give one of them" if subdirs else ""
    raise SaeflowError(
        f"{src_dpath}: not a SAELens ({WEIGHTS_FNAMES['saelens']}) or sparsify ({WEIGHTS_FNAMES['sparsify']}) "
        f"SAE directory{hint}"
    )


def read_checkpoint(src_dpath: str | os.PathLike, fmt: str | None = None, layer: int | None = None) -> Imported:
    """Read a SAELens or sparsify SAE directory, or `layer` of a circuit-tracer transcoder set (format detected when
    `fmt` is None) without running their code, as untrusted input (`checkpoint_files`: every check before the bytes
    it guards are read)."""
    src_dpath = pathlib.Path(src_dpath)
    fmt = fmt or detect_format(src_dpath)
    _check_format(fmt, CHECKPOINT_FORMATS)
    if fmt == CIRCUIT_TRACER:
        return _read_circuit_tracer(src_dpath, layer)
    cfg_fpath = src_dpath / CFG_FNAME
    cfg = checkpoint_files.read_cfg(cfg_fpath)
    sizes = checkpoint_files.check_cfg(fmt, cfg, cfg_fpath)
    weights_fpath = src_dpath / WEIGHTS_FNAMES[fmt]
    tensors, weights_sha256 = checkpoint_files.read_weights(weights_fpath, fmt, sizes, CFG_FNAME)
    try:
        arch, k, weights = (sae_formats.from_saelens if fmt == "saelens" else sae_formats.from_sparsify)(cfg, tensors)
    except KeyError as err:
        raise SaeflowError(f"{src_dpath}: {fmt} checkpoint lacks {err}") from None
    except archs.Unsupported as err:
        raise SaeflowError(f"{src_dpath}: cannot import: {err}") from None
    checkpoint_files.check_all_read(tensors, weights_fpath, _described(fmt, cfg, arch))
    problem = sae_formats.check_shapes(weights)
    if problem is not None:
        raise SaeflowError(f"{weights_fpath}: {problem}")
    target_is_input = fmt == "sparsify" and weights.transcoder and not cfg.get("transcode")
    names = sae_formats.source_names(fmt, cfg, src_dpath.resolve().name, weights.transcoder, target_is_input)
    return Imported(fmt, arch, k, weights, cfg, weights_fpath, weights_sha256, names, target_is_input)


def _read_circuit_tracer(src_dpath: pathlib.Path, layer: int | None) -> Imported:
    from saeflow.interop.checkpoints import circuit_tracer

    try:
        cfg, arch, k, weights, fpath, sha256, names = circuit_tracer.read_layer(src_dpath, layer)
    except KeyError as err:
        raise SaeflowError(f"{src_dpath}: circuit-tracer transcoder file lacks {err}") from None
    return Imported(CIRCUIT_TRACER, arch, k, weights, cfg, fpath, sha256, names)


def _described(fmt: str, cfg: dict, arch: str) -> str:
    """What cfg.json says the checkpoint is, for a refusal."""
    if fmt == "sparsify":
        return f"a sparsify {cfg.get('activation', 'topk')!r} SAE (saeflow {arch})"
    if "architecture" in cfg:
        return f"a SAELens {cfg['architecture']!r} SAE (saeflow {arch})"
    return f"a SAELens 'standard' SAE (saeflow {arch}; cfg.json names no architecture: SAELens's default)"


def import_checkpoint(
    src_dpath: str | os.PathLike,
    runs_root: str | os.PathLike,
    shards_dpath: str | os.PathLike,
    layer: int | None = None,
    fmt: str | None = None,
    target_shards: str | os.PathLike | None = None,
) -> runs.Run:
    """Make (or find) the run directory of an imported SAE, ready for `saeflow inference --run RUN --shards DIR`;
    a transcoder's also links its target's shards (`target_shards`, paired with `shards_dpath`)."""
    from saeflow.store.shards import ShardDir

    imported = read_checkpoint(src_dpath, fmt, layer)
    sd = ShardDir(shards_dpath)
    md = sd.metadata
    source = imported.hooks.get("input", {})
    layer = _pick_layer(layer, md.layers, sd.dpath, source.get("layer"))
    d_sae, d_model = imported.weights.W_enc_ds.shape[::-1]
    if d_model != md.d_model:
        raise SaeflowError(f"{imported.weights_fpath}: the SAE takes d_model={d_model}, but {sd.dpath} has "
                           f"d_model={md.d_model}")  # fmt: skip
    _note_hook(source, sd, layer)
    target_sd = _target_shards(imported, src_dpath, sd, target_shards, layer)
    run_config = {
        "imported": {
            "format": imported.fmt,
            "cfg": imported.source_cfg,
            "weights_sha256": imported.weights_sha256,
            "importer_version": IMPORT_VERSION,
            **({"hooks": imported.hooks} if imported.hooks else {}),
        },
        "arch": imported.arch,
        "k": imported.k,
        "d_model": d_model,
        "d_sae": d_sae,
        "layer": layer,
        "shards": sd.hash,
    }
    if target_sd is not None:  # a transcoder: what inference pairs with the shards (analysis/inference.target_of)
        run_config.update(d_out=imported.weights.W_dec_sd.shape[1], skip=imported.weights.W_skip_dd is not None,
                          target=target_sd.hash)  # fmt: skip
    run = runs.create_run(runs_root, run_config, train_shards=sd.dpath,
                          target_shards=None if target_sd is None else (target_sd.dpath, None))  # fmt: skip
    with atomic.exclusive_lock(run.lock_fpath):
        if not run.sae_fpath.exists():
            sae.save_sae(imported.sae(), run.sae_fpath, readonly=True)
    logger.info("imported %s (%s) as %s", src_dpath, imported.fmt, run.root)
    return run


def _target_shards(imported: Imported, src_dpath, sd, target_shards, layer: int):
    """A transcoder's target shard directory (its input's for a transcoder of its input), checked; None for an SAE."""
    from saeflow.store.shards import ShardDir

    if not imported.weights.transcoder:
        if target_shards is not None:
            raise SaeflowError(f"--target-shards: {src_dpath} is an SAE (it reconstructs its input)")
        return None
    if target_shards is None and not imported.target_is_input:
        raise SaeflowError(f"{src_dpath}: a transcoder predicts another activation than it reads: give its target's "
                           "shards (--target-shards DIR, paired with --shards)")  # fmt: skip
    target_sd = sd if target_shards is None else ShardDir(target_shards)
    d_out = imported.weights.W_dec_sd.shape[1]
    if target_sd.metadata.d_model != d_out or layer not in target_sd.metadata.layers:
        raise SaeflowError(f"{target_sd.dpath}: the transcoder predicts d_out={d_out} at layer {layer}; these target "
                           f"shards store d_model={target_sd.metadata.d_model}, layers "
                           f"{list(target_sd.metadata.layers)}")  # fmt: skip
    _note_hook(imported.hooks.get("target", {}), target_sd, layer)
    return target_sd


def _note_hook(named: dict, sd, layer: int) -> None:
    """Warn when the checkpoint names a hook point or layer other than the shards' (the import goes on: the names
    are the other tool's, recorded in the run's config)."""
    from saeflow.extraction import hooks

    stored = hooks.stored(sd.metadata.data)
    if "hook" in named and (named["hook"], named["layer"]) != (stored, layer):
        logger.warning("%s names %s (%s layer %d), but %s stores %s and the import reads layer %d", "the checkpoint",
                       named["name"], named["hook"], named["layer"], sd.dpath, stored, layer)


def _pick_layer(layer: int | None, layers: tuple[int, ...], shards_dpath: pathlib.Path, named: int | None) -> int:
    """--layer, else the one layer the shards store, else the layer the checkpoint names (`hooknames`)."""
    if layer is None and named in layers and len(layers) > 1:
        return named
    if layer is None:
        if len(layers) != 1:
            raise SaeflowError(f"{shards_dpath} stores layers {list(layers)}: say which one the SAE reads (--layer)")
        return layers[0]
    if layer not in layers:
        raise SaeflowError(f"--layer {layer}: {shards_dpath} stores layers {list(layers)}")
    return layer
