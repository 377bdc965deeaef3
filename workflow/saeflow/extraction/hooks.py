"""Hook points: which tensor of a transformer block an activation spec stores (its `hook`; docs/extraction.md).

    hooks.check(info.model_type, info.family, "mlp_out")   # plan time, from the config: one line if it lacks it
    modules = hooks.find_modules(blocks, info.model_type, info.family, "mlp_out")   # loaded: each block's, checked
    data = {**data, **hooks.hashed("mlp_out")}; hooks.stored(data)   # how the shard metadata records it

`residual` (the schema's default) is a block's own output, the residual stream after the block; it is in no shard
metadata, so every shard hash from before hook points stays as it was. The others are one sublayer's tensor, recorded
by a forward hook on the submodule that computes it (its output; the first element when it returns a tuple):

- `attn_out`, `mlp_out`: what the attention / MLP sublayer adds to the residual stream (DINOv2: after its layer
  scale). Post-norm encoders (BERT, RoBERTa) add before they normalize: there, the sublayer's dense output, before
  dropout, the residual and LayerNorm. Dropout and drop-path are the identity in eval mode, so no hook point needs
  them.
- `mlp_in`: the MLP's input, the output of the norm before it (BERT, RoBERTa: the attention sublayer's LayerNorm).

A block layout lists, per hook point, the submodule paths it may sit at (first match wins: transformers moved ViT's
MLP from `output.dense` to `mlp` in version 5). Once the model is loaded, every block must hold one of them for each
requested hook point, of the expected kind (a norm for `mlp_in`), or extraction stops in one line before any example
runs (a residual-stream extraction asks for no submodule, so a moved one never stops it).
"""

import dataclasses

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.store import shards

RESIDUAL = config.schema_default("activation_spec", "hook")  # a block's output: never in the shard metadata
HOOK_KEY = "hook"  # its key in the metadata's `data`

# model type -> the layout of its blocks (the schema's `model.random.arch` enum: config.by_enum checks they agree)
BLOCK_LAYOUTS: dict[str, str] = config.by_enum({
    "vit": "vit",
    "clip_vision_model": "clip",
    "siglip_vision_model": "clip",
    "dinov2": "dinov2",
    "dinov2_with_registers": "dinov2",
    "gpt2": "gpt2",
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mistral": "llama",
    "bert": "bert",
    "roberta": "bert",
}, "activation_spec", "model", "random", "arch")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HookPoint:
    """One hook point: where it sits in each block layout, and what it is."""

    name: str
    what: str  # for a person: errors and docs
    paths: dict[str, tuple[str, ...]]  # block layout -> submodule paths in a block, first match wins; "" = the block
    norm: bool = False  # the submodule must be a norm (its class name ends in Norm)

    def candidates(self, model_type: str) -> tuple[str, ...]:
        return self.paths.get(BLOCK_LAYOUTS[model_type], ())


# Every hook point (the schema's `hook` enum: config.by_enum checks they agree), and where it sits in each layout.
HOOK_POINTS: dict[str, HookPoint] = config.by_enum({
    RESIDUAL: HookPoint(RESIDUAL, "the residual stream after the block", dict.fromkeys(BLOCK_LAYOUTS.values(), ("",))),
    "attn_out": HookPoint("attn_out", "the attention sublayer's output", {
        "vit": ("attention",), "clip": ("self_attn",), "dinov2": ("layer_scale1",), "gpt2": ("attn",),
        "llama": ("self_attn",), "bert": ("attention.output.dense",),
    }),
    "mlp_out": HookPoint("mlp_out", "the MLP sublayer's output", {
        "vit": ("mlp", "output.dense"), "clip": ("mlp",), "dinov2": ("layer_scale2",), "gpt2": ("mlp",),
        "llama": ("mlp",), "bert": ("output.dense",),
    }),
    "mlp_in": HookPoint("mlp_in", "the MLP's input after its norm", {
        "vit": ("layernorm_after",), "clip": ("layer_norm2",), "dinov2": ("norm2",), "gpt2": ("ln_2",),
        "llama": ("post_attention_layernorm",), "bert": ("attention.output.LayerNorm",),
    }, norm=True),
}, "activation_spec", "hook")  # fmt: skip


def hashed(name: str) -> dict:
    """What hook point `name` adds to a shard directory's metadata `data`: nothing for the residual stream, the key's
    introduction value (`shards.INTRODUCED_DATA`), so every shard hash from before hook points stays; else
    {"hook": name}."""
    return shards.canonical_data({HOOK_KEY: name})


def stored(data: dict) -> str:
    """The hook point a shard directory holds, from its metadata's `data` (`hashed`'s inverse)."""
    return data.get(HOOK_KEY, shards.INTRODUCED_DATA[HOOK_KEY])


def check(model_type: str, family: str, name: str) -> HookPoint:
    """The hook point `name` of a model type, or a one-line error naming what its family has (plan time: no weights)."""
    point = HOOK_POINTS.get(name)
    if point is None:
        raise SaeflowError(f"hook: unknown hook point {name!r}; known: {', '.join(HOOK_POINTS)}")
    if not point.candidates(model_type):
        has = [n for n, p in HOOK_POINTS.items() if p.candidates(model_type)]
        raise SaeflowError(f"hook: {family} ({model_type}) has no {name} ({point.what}); it has: {', '.join(has)}")
    return point


def submodule(block, path: str):
    """The module at a dotted path inside a block (the block itself for ""), None when there is none."""
    module = block
    for attr in filter(None, path.split(".")):
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module


def find_modules(blocks, model_type: str, family: str, name: str) -> list:
    """The module of hook point `name` in every block, checked: each block holds one of its paths (the first found in
    block 0 for all), of the expected kind; else a one-line error naming the block's class and what was looked for."""
    import torch

    point = check(model_type, family, name)
    found = [p for p in point.candidates(model_type) if isinstance(submodule(blocks[0], p), torch.nn.Module)]
    where = f"hook {name}: {family} block {type(blocks[0]).__name__}"
    if not found:
        raise SaeflowError(f"{where} has no submodule {' or '.join(point.candidates(model_type))} ({point.what})")
    path = found[0]
    modules = [submodule(block, path) for block in blocks]
    for layer, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise SaeflowError(f"{where}: block {layer} has no submodule {path} (block 0 has)")
        if point.norm and not type(module).__name__.endswith("Norm"):
            raise SaeflowError(f"{where}: {path} of block {layer} is a {type(module).__name__}, not a norm")
    return modules
