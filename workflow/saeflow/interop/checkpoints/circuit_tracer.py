"""Transcoder sets to and from circuit-tracer: one saeflow transcoder run per layer <-> the directory its loader reads.

    saeflow export-checkpoint --format circuit-tracer --run RUN_L0 --run RUN_L1 ... OUT
    ReplacementModel.from_pretrained("gpt2", "/abs/OUT")      # circuit-tracer 0.5.0, offline: an absolute path
    saeflow import-checkpoint SET --format circuit-tracer --layer 3 --shards IN_3 --target-shards OUT_3 --runs-root R

OUT holds `config.yaml` (`model_kind: transcoder_set`, `feature_input_hook` and `feature_output_hook`, the runs'
hook points in circuit-tracer's names: `hooks.HookPoint.circuit_tracer`) and `layer_{i}.safetensors` for every layer
0..L-1, each in raw activation space (sae_formats.raw_weights folds saeflow's scales):

    W_enc (d_tc, d_model)   pre = x @ W_enc.T + b_enc            no b_dec centring: a transcoder's b_dec is the target's
    W_dec (d_tc, d_model)   y_hat = f @ W_dec + b_dec (+ x @ W_skip.T)
    activation_function.threshold (d_tc,)   JumpReLU f = pre * (pre > threshold); absent: f = relu(pre)

circuit-tracer's files load ReLU and JumpReLU transcoders only (its loader picks the activation by the threshold's
presence, and any other tensor fails the load), exactly the ones SAELens saves (`Arch.saelens_transcoder`): ReLU,
JumpReLU, and BatchTopK as the JumpReLU of its inference threshold. Its replacement model puts layer i's transcoder
in place of block i's MLP, so every run must predict `mlp_out` of its own layer from a hook point of that layer
(`mlp_in`, circuit-tracer's `mlp.hook_in`, or `resid_mid`), all runs from the same hook point, one run per layer
from 0 up. Anything else is refused in one line before OUT is made.

An import reads one layer's file of a set as untrusted input (`checkpoint_files`: its sizes from the header, every
shape and offset checked before the data is read, no tensor but those above) and config.yaml (at most 1 MiB, plain
YAML; only its model_kind and hook names are kept), as the SAELens transcoder it is (`sae_formats.from_saelens`: relu,
or jumprelu with its thresholds; a skip path), its hook names mapped back (`hooknames.from_circuit_tracer`).
"""

import os
import pathlib

from saeflow.errors import SaeflowError
from saeflow.interop.checkpoints import checkpoint_files, hooknames, sae_formats
from saeflow.store import atomic, runs
from saeflow.training import sae

CONFIG_FNAME = "config.yaml"
TARGET = "mlp_out"  # what circuit-tracer's transcoders replace: the MLP's output
EXPORT_VERSION = 1


def layer_fname(layer: int) -> str:
    return f"layer_{layer}.safetensors"


def export_transcoder_set(run_dpaths: list, out_dpath: str | os.PathLike) -> pathlib.Path:
    """Write the runs (one transcoder per layer) as a circuit-tracer transcoder set OUT, published atomically."""
    import safetensors.torch
    import yaml

    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; exports never overwrite")
    by_layer: dict[int, tuple[runs.Run, sae.SAE, dict]] = {}
    for run_dpath in run_dpaths:
        run = runs.open_run(run_dpath)
        model = sae.load_sae(run.require_checkpoint())
        where = hooknames.run_where(run, run.config().get("layer"), model.cfg.transcoder)
        layer = _check_member(run, model, where)
        if layer in by_layer:
            raise SaeflowError(f"{run.root}: a second run for layer {layer} (the first: {by_layer[layer][0].root})")
        by_layer[layer] = (run, model, where)
    inputs = sorted({where["input"][0] for _, _, where in by_layer.values()})
    if len(inputs) != 1:
        raise SaeflowError(f"the runs read different hook points ({', '.join(inputs)}); a circuit-tracer set reads one")
    missing = sorted(set(range(max(by_layer) + 1)) - set(by_layer))
    if missing:
        raise SaeflowError(f"no run for layer {', '.join(map(str, missing))}: circuit-tracer needs a transcoder for "
                           "every layer from 0 up")  # fmt: skip
    config = {
        "model_kind": "transcoder_set",
        "feature_input_hook": hooknames.to_circuit_tracer(inputs[0]),
        "feature_output_hook": hooknames.to_circuit_tracer(TARGET),
        "scan": "saeflow:" + ",".join(by_layer[layer][0].run_id[:12] for layer in sorted(by_layer)),
        "saeflow": {"export_version": EXPORT_VERSION, "family": by_layer[0][2]["family"],
                    "runs": {layer: run.run_id for layer, (run, _, _) in sorted(by_layer.items())}},
    }  # fmt: skip
    with atomic.building_dir(out_dpath) as staging_dpath:
        for layer, (_, model, _) in sorted(by_layer.items()):
            safetensors.torch.save_file(layer_tensors(model), str(staging_dpath / layer_fname(layer)))
        (staging_dpath / CONFIG_FNAME).write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dpath


def _check_member(run: runs.Run, model: sae.SAE, where: dict) -> int:
    """The layer of a run that can be one layer of a set; else a one-line error naming the run."""
    if not model.cfg.transcoder:
        raise SaeflowError(f"{run.root}: an SAE, not a transcoder; circuit-tracer's sets replace each MLP with a "
                           f"transcoder from a hook point to {TARGET}")  # fmt: skip
    if model.arch.saelens_transcoder is None:
        raise SaeflowError(f"{run.root}: a {model.cfg.arch} transcoder; circuit-tracer's files hold ReLU and JumpReLU "
                           "transcoders (relu, jumprelu, batchtopk)")  # fmt: skip
    if "target" not in where:
        raise SaeflowError(f"{run.root}: its linked shards are not there to read, so what it reads and predicts is "
                           "unknown")  # fmt: skip
    (source, layer), target = where["input"], where["target"]
    if target != (TARGET, layer) or source == TARGET:
        raise SaeflowError(f"{run.root}: predicts {target[0]} {target[1]} from {source} {layer}; circuit-tracer's "
                           f"transcoders predict {TARGET} of the layer they read")  # fmt: skip
    return layer


def layer_tensors(model: sae.SAE) -> dict:
    """One layer's file: circuit-tracer's tensor names and shapes (module docstring), float32, nothing else."""
    weights = sae_formats.raw_weights(model)
    tensors = {"W_enc": weights.W_enc_ds.T, "W_dec": weights.W_dec_sd, "b_enc": weights.b_enc_s,
               "b_dec": weights.b_dec_d}  # fmt: skip
    _, saved = model.arch.saelens_export(model, {**tensors, **weights.extra}, weights.threshold)
    if "threshold" in saved:
        tensors["activation_function.threshold"] = saved["threshold"]
    if weights.W_skip_dd is not None:
        tensors["W_skip"] = weights.W_skip_dd.T
    return {name: t.detach().float().contiguous() for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------

FORMAT = "circuit-tracer"
CONFIG_KEYS = ("model_kind", "feature_input_hook", "feature_output_hook")


def is_set(src_dpath: pathlib.Path) -> bool:
    return (src_dpath / CONFIG_FNAME).is_file() and (src_dpath / layer_fname(0)).exists()


def read_config(src_dpath: pathlib.Path) -> dict:
    """config.yaml's model_kind and hook names (strings), checked: a transcoder set's; nothing else is kept."""
    fpath = src_dpath / CONFIG_FNAME
    raw = checkpoint_files.read_cfg(fpath, yaml_file=True)
    cfg = {key: raw.get(key) for key in CONFIG_KEYS}
    bad = [key for key, value in cfg.items() if not isinstance(value, str) or len(value) > 200]
    if bad:
        raise SaeflowError(f"{fpath}: {', '.join(bad)} must be strings (a circuit-tracer transcoder set's config)")
    if cfg["model_kind"] != "transcoder_set":
        raise SaeflowError(f"{fpath}: model_kind {cfg['model_kind']!r}; saeflow imports transcoder_set directories "
                           "(one transcoder per layer)")  # fmt: skip
    return cfg


def read_layer(src_dpath: pathlib.Path, layer: int | None):
    """(source cfg, arch, k, RawWeights, weights path, sha256, hook names) of layer `layer` of a set."""
    if layer is None:
        raise SaeflowError(f"{src_dpath}: a circuit-tracer set holds a transcoder per layer; say which (--layer L)")
    cfg = read_config(src_dpath)
    fpath = src_dpath / layer_fname(layer)
    tensors, sha256 = checkpoint_files.read_weights(fpath, FORMAT, None, layer_fname(layer))
    skip = "W_skip" in tensors
    jumprelu = "activation_function.threshold" in tensors
    architecture = ("jumprelu_" if jumprelu else "") + ("skip_transcoder" if skip else "transcoder")
    d_sae, d_in = tensors["W_enc"].shape
    saelens_cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "d_out": tensors["b_dec"].shape[0],
                   "apply_b_dec_to_input": False}  # fmt: skip
    renamed = {"W_enc": tensors["W_enc"].T, "W_dec": tensors["W_dec"], "b_enc": tensors["b_enc"],
               "b_dec": tensors["b_dec"]}  # fmt: skip
    renamed.update({"threshold": tensors["activation_function.threshold"]} if jumprelu else {})
    renamed.update({"W_skip": tensors["W_skip"]} if skip else {})
    arch, k, weights = sae_formats.from_saelens(saelens_cfg, checkpoint_files.Tensors(renamed))
    unknown = sorted(set(tensors) - {"W_enc", "W_dec", "b_enc", "b_dec", "activation_function.threshold", "W_skip"})
    if unknown:
        raise SaeflowError(f"{fpath}: tensors {', '.join(n[:60] for n in unknown[:4])} are no circuit-tracer "
                           "transcoder's (its loader fails on them)")  # fmt: skip
    problem = sae_formats.check_shapes(weights)
    if problem is not None:
        raise SaeflowError(f"{fpath}: {problem}")
    names = {role: hooknames.from_circuit_tracer(cfg[key], layer)
             for role, key in (("input", "feature_input_hook"), ("target", "feature_output_hook"))}  # fmt: skip
    return {**cfg, "layer": layer}, arch, k, weights, fpath, sha256, names
