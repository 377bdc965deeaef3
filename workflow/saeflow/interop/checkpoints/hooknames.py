"""Other tools' hook names <-> saeflow's hook points (extraction/hooks.py) and layers (docs/interop.md has the table).

A `Where` is (hook point, layer): layer k is transformer block k (0-indexed), `residual` its output. Each
`hooks.HookPoint` carries its own TransformerLens and circuit-tracer names; this module maps whole names both ways.

SAELens names its activations as TransformerLens hooks (`hook_name`, a transcoder's `hook_name_out`):

    blocks.{k}.hook_resid_post        residual k          blocks.{k}.hook_resid_pre   residual k-1 (none for k = 0)
    blocks.{k}.hook_attn_out          attn_out k          blocks.{k}.hook_mlp_out     mlp_out k
    blocks.{k}.ln2.hook_normalized    mlp_in k            blocks.{k}.hook_resid_mid   resid_mid k
    blocks.{k}.hook_mlp_in            resid_mid k

`blocks.{k}.hook_mlp_in` is NOT saeflow's mlp_in: TransformerLens records it before ln2, the MLP block's input, which
is resid_mid. circuit-tracer names hook points the same way but for mlp_in, `mlp.hook_in` (`to_circuit_tracer`).

sparsify names a module of the base model (`h.3.mlp`, `layers.3`, optionally `/seedN`): an SAE reads the module's
output, a transcoder predicts its output from its input. The module's path inside a block is saeflow's own
(`HookPoint.paths`, every block layout), so `h.3.mlp` is mlp_out 3 and, for a transcoder, mlp_in 3 -> mlp_out 3; a
whole block `layers.3` is residual 3 (a transcoder: residual 2 -> residual 3). resid_mid is no module's output (the
block's input plus the attention's), so no sparsify hookpoint names it.
"""

import logging
import re

from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.extraction.models import MODEL_TYPES

logger = logging.getLogger(__name__)

Where = tuple[str, int]  # (saeflow hook point, layer)

RESIDUAL = hooks.RESIDUAL
# TransformerLens hook (after `blocks.{k}.`) -> saeflow hook point: each hook point's own name, and hook_mlp_in, which
# TransformerLens records before ln2 (the MLP block's input: resid_mid)
_TL_HOOKS = {**{point.transformerlens: name for name, point in hooks.HOOK_POINTS.items()}, "hook_mlp_in": "resid_mid"}
# a block layout -> where its blocks live in the base model sparsify hooks (`model.base_model`)
_BLOCKS = {"gpt2": "h", "llama": "layers", "bert": "encoder.layer", "vit": "encoder.layer", "dinov2": "encoder.layer",
           "clip": "vision_model.encoder.layers"}  # fmt: skip
_HOOKPOINT = re.compile(r"(?:(?P<blocks>[A-Za-z_][\w.]*?)\.)?(?P<layer>\d+)(?:\.(?P<sub>[A-Za-z_][\w.]*))?")
MLP = "mlp"  # the one module whose input saeflow also stores (mlp_in): a transcoder of it maps both ends


def _module_hooks() -> dict[str, str]:
    """A submodule path inside a block -> the hook point that is its output, over every block layout (one meaning
    each; `resid_mid` adds the block's input to the attention module's output, so no module name means it)."""
    found: dict[str, str] = {}
    for point in filter(lambda p: p.is_module_output, hooks.HOOK_POINTS.values()):
        for paths in point.paths.values():
            for path in filter(None, paths):
                assert found.setdefault(path, point.name) == point.name, path
    return found


def from_transformerlens(name) -> Where | None:
    """A TransformerLens hook name's (hook point, layer); None where saeflow stores no such activation."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name) if isinstance(name, str) else None
    if match is None:
        return None
    layer, hook = int(match[1]), match[2]
    if hook == "hook_resid_pre":
        return (RESIDUAL, layer - 1) if layer > 0 else None
    return (_TL_HOOKS[hook], layer) if hook in _TL_HOOKS else None


def to_transformerlens(where: Where) -> str:
    hook, layer = where
    return f"blocks.{layer}.{hooks.HOOK_POINTS[hook].transformerlens}"


def from_circuit_tracer(hook_name: str, layer: int) -> dict:
    """A circuit-tracer hook (after `blocks.{l}.`) of layer `layer`: {"name", "hook", "layer"}, as the SAELens and
    sparsify imports record names (no "hook" where saeflow stores no such activation)."""
    found = [name for name, point in hooks.HOOK_POINTS.items() if point.circuit_tracer == hook_name]
    found += ["mlp_out"] if hook_name == "mlp.hook_out" else []  # its MLP's own name for hook_mlp_out
    return {"name": f"blocks.{layer}.{hook_name}", **({"hook": found[0], "layer": layer} if found else {})}


def to_circuit_tracer(hook: str) -> str:
    """circuit-tracer's name of a hook point, after `blocks.{k}.` (its config.yaml's feature_input_hook and
    feature_output_hook)."""
    return hooks.HOOK_POINTS[hook].circuit_tracer


def from_sparsify(hookpoint, transcode: bool) -> tuple[Where | None, Where | None]:
    """A sparsify hookpoint's (input, target): an SAE's both are the module's output; a transcoder reads the module's
    input (saeflow stores it for a whole block and the MLP only) and predicts its output."""
    match = _HOOKPOINT.fullmatch(hookpoint.partition("/")[0]) if isinstance(hookpoint, str) else None
    if match is None:
        return None, None
    layer, sub = int(match["layer"]), match["sub"]
    out = (RESIDUAL, layer) if sub is None else (_module_hooks()[sub], layer) if sub in _module_hooks() else None
    if not transcode:
        return out, out
    if sub is None:
        return ((RESIDUAL, layer - 1) if layer > 0 else None), out
    return (("mlp_in", layer) if sub == MLP else None), out


def to_sparsify(family: str, source: Where, target: Where | None) -> str | None:
    """The hookpoint sparsify would train this SAE (target None) or transcoder at, for a model of `family`; None
    where no module of that family reads and writes these activations."""
    layouts = {hooks.BLOCK_LAYOUTS[t] for t, (fam, _, _) in MODEL_TYPES.items() if fam == family}
    layout = next(iter(layouts)) if len(layouts) == 1 else None
    if layout not in _BLOCKS:
        return None
    hook, layer = source if target is None else target
    point = hooks.HOOK_POINTS[hook]
    paths = point.paths.get(layout, ()) if point.is_module_output else ()
    sub = "" if hook == RESIDUAL else f".{paths[0]}" if paths else None
    if target is None or sub is None:
        return None if sub is None else f"{_BLOCKS[layout]}.{layer}{sub}"
    # a transcoder of a whole block (residual k-1 -> residual k) or of its MLP (mlp_in k -> mlp_out k) only
    if (hook, sub) == (RESIDUAL, "") and source == (RESIDUAL, layer - 1):
        return f"{_BLOCKS[layout]}.{layer}"
    if sub == f".{MLP}" and source == ("mlp_in", layer):
        return f"{_BLOCKS[layout]}.{layer}{sub}"
    return None


# the names each format gives a hook: TransformerLens dotted attribute paths; a sparsify module path, optionally
# `/` and a name (`layers.3/seed0`)
_WELL_FORMED = {"saelens": re.compile(r"\w+(?:\.\w+)*", re.ASCII),
                "sparsify": re.compile(r"\w+(?:\.\w+)*(?:/\w+)?", re.ASCII)}  # fmt: skip
EXAMPLES = {"saelens": "blocks.3.hook_resid_post", "sparsify": "layers.3 or h.3.mlp"}


def well_formed(fmt: str, name) -> bool:
    """Whether `name` is a hook name of the form `fmt` gives its hooks (no path, no spaces, at most 200 characters);
    where it maps to saeflow's hook points is `from_transformerlens` / `from_sparsify`'s."""
    return isinstance(name, str) and len(name) <= 200 and _WELL_FORMED[fmt].fullmatch(name) is not None


def run_where(run, layer, transcoder: bool) -> dict:
    """{"family", "input": (hook, layer)[, "target": ...]} of the run's linked shards; {} where they are not there
    to read (the export then names no hook)."""
    from saeflow.store.shards import ShardDir

    links = [("input", run.TRAIN_SHARDS)] + ([("target", run.TARGET_SHARDS)] if transcoder else [])
    found = {}
    for role, link in links:
        try:
            md = ShardDir(run.link(link).resolve()).metadata
        except (SaeflowError, OSError) as err:
            logger.info("%s: no hook names in the export (%s)", run.root, err)
            return {}
        found.update({"family": md.family, role: (hooks.stored(md.data), layer)})
    return found if isinstance(layer, int) else {}
