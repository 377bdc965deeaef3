"""A cross-layer transcoder out to circuit-tracer: one saeflow CLT run <-> the directory circuit-tracer's `load_clt`
reads (circuit_tracer.py is the per-layer set's).

    saeflow export-checkpoint --format circuit-tracer --run CLT_RUN OUT
    ReplacementModel.from_pretrained("gpt2", "/abs/OUT")      # circuit-tracer 0.5.0

OUT holds `config.yaml` (`model_kind: cross_layer_transcoder`, the hook names) and, for every layer i of 0..L-1,
raw activation space (training/clt.py `CLT.weights` folds the scales):

    W_enc_{i}.safetensors   W_enc_{i} (d_tc, d_model), b_enc_{i} (d_tc), b_dec_{i} (d_model)[, threshold_{i} (d_tc)]
    W_dec_{i}.safetensors   W_dec_{i} (d_tc, L - i, d_model): slot j writes layer i + j

circuit-tracer's CLTs compute ReLU and JumpReLU (a threshold per layer's latents: saeflow's jumprelu, and batchtopk
as the JumpReLU of its inference threshold), carry no skip path, and read every layer of the model from 0 up, from
one hook point to `mlp_out`; anything else is refused in one line before OUT is made.

    saeflow import-checkpoint CLT_DIR --runs-root ROOT --shards IN [--shards IN_1 ...] --target-shards OUT [...]

reads such a directory back (circuit-tracer's own `to_safetensors` writes the same files) as untrusted input, as a
set's layers are read (`checkpoint_files`: every size from W_enc_0's header, every other shape and offset checked
against them and each file's length before its data is read, no tensor but the ones above, config.yaml plain YAML of
at most 1 MiB), into a CLT run (`shape: clt`, relu or jumprelu) linked to its shards: one directory of every layer,
or one per layer (`--shards` and `--target-shards` once each per layer).
"""

import os
import pathlib

from saeflow.errors import SaeflowError
from saeflow.interop.checkpoints import checkpoint_files, hooknames
from saeflow.store import atomic, runs
from saeflow.store.shards import ShardDir
from saeflow.training import clt

CONFIG_FNAME, TARGET, EXPORT_VERSION, IMPORT_VERSION = "config.yaml", "mlp_out", 1, 1
FORMAT, MAX_LAYERS = "circuit-tracer-clt", 1024


def is_clt_run(run_dpath) -> bool:
    return runs.open_run(run_dpath).config().get("shape") == "clt"


def export_clt(run_dpath, out_dpath: str | os.PathLike) -> pathlib.Path:
    """Write the CLT run as circuit-tracer's CLT directory OUT, published atomically."""
    import safetensors.torch
    import yaml

    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; exports never overwrite")
    run = runs.open_run(run_dpath)
    model = clt.load_clt(run.require_checkpoint())
    source, family = _check(run, model)
    tensors = model.weights()
    thresholds = [_threshold(sae) for sae in model.encoders]
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": hooknames.to_circuit_tracer(source),
              "feature_output_hook": hooknames.to_circuit_tracer(TARGET), "scan": f"saeflow:{run.run_id[:12]}",
              "saeflow": {"export_version": EXPORT_VERSION, "family": family, "run": run.run_id}}  # fmt: skip
    with atomic.building_dir(out_dpath) as staging_dpath:
        for i, threshold_s in enumerate(thresholds):
            enc = {f"{name}_{i}": tensors[f"{name}_{i}"] for name in ("W_enc", "b_enc", "b_dec")}
            if threshold_s is not None:
                enc[f"threshold_{i}"] = threshold_s
            for fname, part in ((f"W_enc_{i}.safetensors", enc), (f"W_dec_{i}.safetensors",
                                                                   {f"W_dec_{i}": tensors[f"W_dec_{i}"]})):
                part = {name: t.detach().float().contiguous() for name, t in part.items()}
                safetensors.torch.save_file(part, str(staging_dpath / fname))
        (staging_dpath / CONFIG_FNAME).write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dpath


def _threshold(sae):
    """An encoder's JumpReLU thresholds (d_tc,) as its SAELens export computes them; None for a ReLU."""
    extra = {name: getattr(sae, name).detach() for name in sae.arch.parameters(0)}
    _, saved = sae.arch.saelens_export(sae, extra, float(sae.threshold))
    return saved.get("threshold")


def _check(run: runs.Run, model: clt.CLT) -> tuple[str, str]:
    """(the hook point it reads, the model family) of a CLT circuit-tracer can load; else one line naming the run."""
    if model.arch.saelens_transcoder is None:
        raise SaeflowError(f"{run.root}: a {model.arch.name} CLT; circuit-tracer's CLTs compute ReLU and JumpReLU "
                           "(relu, jumprelu, batchtopk)")  # fmt: skip
    layers = model.cfg.layer_ids
    if layers != tuple(range(len(layers))):
        raise SaeflowError(f"{run.root}: a CLT of layers {list(layers)}; circuit-tracer's reads every layer from 0 up")
    try:
        mds = [ShardDir(run.layer_link(link, 0).resolve()).metadata for link in (run.TRAIN_SHARDS, run.TARGET_SHARDS)]
    except (SaeflowError, OSError) as err:
        raise SaeflowError(f"{run.root}: its linked shards are not there to read, so what it reads is unknown "
                           f"({err})") from None
    source, target = (hooknames.hooks.stored(md.data) for md in mds)
    if target != TARGET or source == TARGET:
        raise SaeflowError(f"{run.root}: predicts {target} from {source}; circuit-tracer's CLTs predict {TARGET}")
    return source, mds[0].family


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------


def is_clt_dir(src_dpath) -> bool:
    src_dpath = pathlib.Path(src_dpath)
    return (src_dpath / CONFIG_FNAME).is_file() and (src_dpath / "W_enc_0.safetensors").exists()


def read_clt(src_dpath: pathlib.Path) -> tuple[dict, clt.CLT, dict]:
    """(config.yaml's model_kind and hook names, the CLT, each file's sha256) of a circuit-tracer CLT directory."""
    import torch

    from saeflow.training.specs import SAEConfig

    fpath = src_dpath / CONFIG_FNAME
    raw = checkpoint_files.read_cfg(fpath, yaml_file=True)
    cfg = {key: raw.get(key) for key in ("model_kind", "feature_input_hook", "feature_output_hook")}
    if not all(isinstance(v, str) and len(v) <= 200 for v in cfg.values()):
        raise SaeflowError(f"{fpath}: model_kind, feature_input_hook and feature_output_hook must be strings")
    if cfg["model_kind"] != "cross_layer_transcoder":
        raise SaeflowError(f"{fpath}: model_kind {cfg['model_kind']!r}, not a cross_layer_transcoder")
    n_layers = next(i for i in range(MAX_LAYERS + 1) if not (src_dpath / f"W_enc_{i}.safetensors").exists())
    if n_layers > MAX_LAYERS:
        raise SaeflowError(f"{src_dpath}: more than {MAX_LAYERS} layers; refusing")
    files, sha256 = {}, {}
    sizes = None
    for i in range(n_layers):
        for kind in ("enc", "dec"):
            fname = f"W_{kind}_{i}.safetensors"
            layer_sizes = None if sizes is None else checkpoint_files.Sizes(sizes.d_in, sizes.d_sae, sizes.d_out,
                                                                             n_layers - i)  # fmt: skip
            files[fname], sha256[fname] = checkpoint_files.read_weights(src_dpath / fname, FORMAT, layer_sizes, fname)
            if sizes is None:
                sizes = checkpoint_files.Sizes(files[fname]["W_enc_0"].shape[1], files[fname]["b_enc_0"].shape[0],
                                               files[fname]["b_dec_0"].shape[0])  # fmt: skip
    jumprelu = "threshold_0" in files["W_enc_0.safetensors"]
    for i in range(n_layers):
        want = {"enc": {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", *([f"threshold_{i}"] if jumprelu else [])},
                "dec": {f"W_dec_{i}"}}  # fmt: skip
        for kind, names in want.items():
            got = set(files[f"W_{kind}_{i}.safetensors"])
            if got != names:
                raise SaeflowError(f"{src_dpath / f'W_{kind}_{i}.safetensors'}: holds {sorted(got)[:6]}, not "
                                   f"{sorted(names)} (a circuit-tracer CLT's, every layer alike)")  # fmt: skip
    model = clt.CLT(clt.CLTConfig(tuple(range(n_layers)), SAEConfig(d_model=sizes.d_in, d_sae=sizes.d_sae,
                    arch="jumprelu" if jumprelu else "relu", k=1, d_out=sizes.d_out)))  # fmt: skip
    with torch.no_grad():
        for i, sae in enumerate(model.encoders):
            enc, dec = files[f"W_enc_{i}.safetensors"], files[f"W_dec_{i}.safetensors"]
            sae.W_enc.copy_(enc[f"W_enc_{i}"].T)
            sae.b_enc.copy_(enc[f"b_enc_{i}"])
            sae.W_dec.copy_(dec[f"W_dec_{i}"].reshape(sizes.d_sae, -1))
            sae.b_dec.zero_()
            sae.b_dec[: sizes.d_out] = enc[f"b_dec_{i}"]  # b_dec_j is every encoder's bias at j, summed
            if jumprelu:  # circuit-tracer's pre * (pre > threshold): saeflow's relu(pre) * H, a negative one at 0
                sae.log_threshold.copy_(enc[f"threshold_{i}"].clamp(min=0).log())
    return cfg, model.eval(), sha256


def import_clt(src_dpath, runs_root, shards: list, target_shards: list) -> runs.Run:
    """Make (or find) the run directory of an imported circuit-tracer CLT, linked to its input and target shards
    (one directory of every layer, or one per layer, each list)."""
    src_dpath = pathlib.Path(src_dpath)
    cfg, model, sha256 = read_clt(src_dpath)
    layers = model.cfg.layer_ids
    by_role = {}
    for role, given, hook_key in (("input", shards, "feature_input_hook"),
                                  ("target", target_shards or [], "feature_output_hook")):  # fmt: skip
        flag = "--shards" if role == "input" else "--target-shards"
        if len(given) not in (1, len(layers)):
            raise SaeflowError(f"{flag}: a CLT of {len(layers)} layers takes one directory of every layer or one per "
                               f"layer, got {len(given)}")  # fmt: skip
        dirs = [ShardDir(d) for d in given] * (len(layers) if len(given) == 1 else 1)
        want = hooknames.from_circuit_tracer(cfg[hook_key], 0).get("hook")
        for layer, sd in zip(layers, dirs):
            md = sd.metadata
            if layer not in md.layers or (md.d_model != (model.cfg.sae.d_model if role == "input" else
                                                         model.cfg.d_out)):  # fmt: skip
                raise SaeflowError(f"{flag} {sd.dpath}: does not hold layer {layer} at the CLT's width")
            if want is not None and hooknames.hooks.stored(md.data) != want:
                raise SaeflowError(f"{flag} {sd.dpath}: holds {hooknames.hooks.stored(md.data)}, but the CLT's "
                                   f"{hook_key} is {cfg[hook_key]} ({want})")  # fmt: skip
        by_role[role] = dirs
    run_config = {
        "imported": {"format": "circuit-tracer", "cfg": cfg, "weights_sha256": sha256,
                     "importer_version": IMPORT_VERSION},
        "shape": "clt", "arch": model.arch.name, "layer": list(layers),
        **{key: [sd.hash for sd in by_role[role]] for key, role in (("train_shards", "input"), ("val_shards", "input"),
                                                                    ("target", "target"), ("val_target", "target"))},
    }  # fmt: skip
    links = {name: {layer: sd.dpath for layer, sd in zip(layers, by_role[role])}
             for name, role in ((runs.Run.TRAIN_SHARDS, "input"), (runs.Run.VAL_SHARDS, "input"),
                                (runs.Run.TARGET_SHARDS, "target"), (runs.Run.VAL_TARGET_SHARDS, "target"))}
    run = runs.create_run(runs_root, run_config, None, layer_links=links)
    with atomic.exclusive_lock(run.lock_fpath):
        if not run.sae_fpath.exists():
            clt.save_clt(model, run.sae_fpath, readonly=True)
    return run
