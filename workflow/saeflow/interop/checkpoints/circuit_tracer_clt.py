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
"""

import os
import pathlib

from saeflow.errors import SaeflowError
from saeflow.interop.checkpoints import hooknames
from saeflow.store import atomic, runs
from saeflow.store.shards import ShardDir
from saeflow.training import clt

CONFIG_FNAME, TARGET, EXPORT_VERSION = "config.yaml", "mlp_out", 1


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
    layers = model.cfg.layers
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
