"""Hook points: which tensor of a transformer block an activation spec stores (its `hook`; docs/extraction.md).

    hooks.check(info.model_type, info.family, "mlp_out")   # plan time, from the config: one line if it lacks it
    taps = hooks.find_taps(blocks, info.model_type, info.family, "mlp_out")   # loaded: each block's, checked
    handles = taps[3].intercept(on_tensor)   # record block 3's tensor, or replace it (extraction, evaluate, splice)
    data = {**data, **hooks.hashed("mlp_out")}; hooks.stored(data)   # how the shard metadata records it
    HOOK_POINTS["mlp_in"].transformerlens, .circuit_tracer   # what the other tools call it (interop/checkpoints)

A `HookPoint` is the one object that knows a hook point: where it sits in each block layout, how a block computes it
(`Tap`: what extraction records and a splice reads and writes, so the two are the same tensor by construction), and
its names in TransformerLens (SAELens), circuit-tracer and, where it is a module's output, sparsify.

`residual` (the schema's default) is a block's own output, the residual stream after the block; it is in no shard
metadata, so every shard hash from before hook points stays as it was. The others are one sublayer's tensor, recorded
by a forward hook on the submodule that computes it (its output; the first element when it returns a tuple):

- `attn_out`, `mlp_out`: what the attention / MLP sublayer adds to the residual stream (DINOv2: after its layer
  scale). Post-norm encoders (BERT, RoBERTa) add before they normalize: there, the sublayer's dense output, before
  dropout, the residual and LayerNorm. Dropout and drop-path are the identity in eval mode, so no hook point needs
  them.
- `mlp_in`: the MLP's input, the output of the norm before it (BERT, RoBERTa: the attention sublayer's LayerNorm).
- `resid_mid`: the residual stream between the sublayers of a pre-norm block, the block's input plus `attn_out`
  (what circuit-tracer's cross-layer transcoders read). Post-norm encoders have none of their own: their stream after
  attention is the LayerNorm's output, which is `mlp_in` (one tensor gets one name, so one shard hash).

A block layout lists, per hook point, the submodule paths it may sit at (first match wins: transformers moved ViT's
MLP from `output.dense` to `mlp` in version 5). Once the model is loaded, every block must hold one of them for each
requested hook point, of the expected kind (a norm for `mlp_in`), or extraction stops in one line before any example
runs (a residual-stream extraction asks for no submodule, so a moved one never stops it).
"""

import dataclasses
import typing

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
    """One hook point: where it sits in each block layout, what it is, and what the other tools call it."""

    name: str
    what: str  # for a person: errors and docs
    paths: dict[str, tuple[str, ...]]  # block layout -> submodule paths in a block, first match wins; "" = the block
    transformerlens: str  # TransformerLens's hook after `blocks.{k}.` (SAELens's hook names)
    circuit_tracer: str  # circuit-tracer's hook after `blocks.{k}.` (its feature_input_hook / feature_output_hook)
    norm: bool = False  # the submodule must be a norm (its class name ends in Norm)
    plus_block_input: bool = False  # the tensor is the block's input plus the submodule's output, not the output

    def candidates(self, model_type: str) -> tuple[str, ...]:
        return self.paths.get(BLOCK_LAYOUTS[model_type], ())

    @property
    def is_module_output(self) -> bool:
        """Whether the tensor is one submodule's output, so a tool that hooks modules by name (sparsify) can name it."""
        return not self.plus_block_input


@dataclasses.dataclass(frozen=True)
class Tap:
    """Where one block computes a hook point's tensor: `module`'s output (its first element when it returns a tuple),
    plus the block's input when the point is the residual stream after a sublayer (`resid_mid`: the block adds them,
    and IEEE addition commutes, so the sum here is that tensor bit for bit)."""

    block: typing.Any  # torch.nn.Module (no torch import at planning)
    module: typing.Any
    plus_block_input: bool

    def intercept(self, on_tensor: typing.Callable) -> list:
        """Forward hooks that call on_tensor(tensor (B, T, D)) each time the block computes it. A (mask_bt, values_nd)
        it returns replaces the tensor at those positions (None leaves it): for `resid_mid`, the submodule's output
        becomes values - block input there, so the block's own sum is the values to float rounding, and every other
        position is untouched. Returns the hook handles, to remove."""
        block_input: list = []
        handles = []
        if self.plus_block_input:

            def keep_input(module, args, kwargs):
                block_input[:] = [args[0] if args else kwargs["hidden_states"]]

            handles.append(self.block.register_forward_pre_hook(keep_input, with_kwargs=True))

        def on_output(module, args, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            base = block_input.pop() if self.plus_block_input else None
            replaced = on_tensor(h if base is None else base + h)
            if replaced is None:
                return None
            mask_bt, values_nd = replaced
            if base is not None:
                values_nd = values_nd.float() - base[mask_bt].float()
            new = h.clone()
            new[mask_bt] = values_nd.to(h.dtype)
            return (new, *output[1:]) if isinstance(output, (tuple, list)) else new

        handles.append(self.module.register_forward_hook(on_output))
        return handles


ATTN_PATHS = {"vit": ("attention",), "clip": ("self_attn",), "dinov2": ("layer_scale1",), "gpt2": ("attn",),
              "llama": ("self_attn",)}  # fmt: skip
# Every hook point (the schema's `hook` enum: config.by_enum checks they agree), and where it sits in each layout.
HOOK_POINTS: dict[str, HookPoint] = config.by_enum({
    RESIDUAL: HookPoint(RESIDUAL, "the residual stream after the block", dict.fromkeys(BLOCK_LAYOUTS.values(), ("",)),
                        "hook_resid_post", "hook_resid_post"),
    "attn_out": HookPoint("attn_out", "the attention sublayer's output",
                          {**ATTN_PATHS, "bert": ("attention.output.dense",)}, "hook_attn_out", "hook_attn_out"),
    "mlp_out": HookPoint("mlp_out", "the MLP sublayer's output", {
        "vit": ("mlp", "output.dense"), "clip": ("mlp",), "dinov2": ("layer_scale2",), "gpt2": ("mlp",),
        "llama": ("mlp",), "bert": ("output.dense",),
    }, "hook_mlp_out", "hook_mlp_out"),
    "mlp_in": HookPoint("mlp_in", "the MLP's input after its norm", {
        "vit": ("layernorm_after",), "clip": ("layer_norm2",), "dinov2": ("norm2",), "gpt2": ("ln_2",),
        "llama": ("post_attention_layernorm",), "bert": ("attention.output.LayerNorm",),
    }, "ln2.hook_normalized", "mlp.hook_in", norm=True),
    # pre-norm blocks only: a post-norm block's stream after attention is its LayerNorm's output, which is mlp_in
    "resid_mid": HookPoint("resid_mid", "the residual stream between the attention and MLP sublayers", ATTN_PATHS,
                           "hook_resid_mid", "hook_resid_mid", plus_block_input=True),
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


def find_taps(blocks, model_type: str, family: str, name: str) -> list[Tap]:
    """Where every block computes hook point `name`'s tensor (its `Tap`), checked as `find_modules` does."""
    point = check(model_type, family, name)
    modules = find_modules(blocks, model_type, family, name)
    return [Tap(block, module, point.plus_block_input) for block, module in zip(blocks, modules)]


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
