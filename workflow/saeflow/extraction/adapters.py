"""Model adapters over `transformers`: one interface to load and run vision and language transformers.

    info = models.describe(spec)           # cheap: config.json (+ preprocessor_config.json), no weights
    adapter = adapters.load(spec, compute_dtype="float32", device="cpu")
    acts = adapter.run(batch_bt_or_bchw, layers=(2, 5))   # {layer: acts_btd}, forward stopped after block 5

"Layer k" is the output of transformer block k (the residual stream after block k), 0-indexed. Hooks on the block
modules record it; the hook on the deepest requested block raises `_StopForward`, so later blocks never run.
`adapter.run_points(batch, [(hook, layer), ...])` records other hook points of the blocks (extraction.hooks: a
sublayer's output, the MLP's input, the stream between the sublayers) in the same pass, which also stops after the
deepest block.
For pre-norm decoders (GPT-2, Llama) Hugging Face's `hidden_states[-1]` has the final norm applied; we store the
raw residual stream of the last block instead (the same definition for every layer).
"""

import contextlib
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.extraction.models import ModelInfo, ModelSpec, describe

# Where the list of transformer blocks lives, per model class layout (first match wins).
BLOCK_PATHS = ("vision_model.encoder.layers", "encoder.layer", "encoder.layers", "layers", "h")
COMPUTE_DTYPES = config.enum("activation_spec", "compute_dtype")


class _StopForward(Exception):
    """Raised by the hook on the deepest requested block: the rest of the model never runs."""


def find_blocks(model):
    """The ModuleList of transformer blocks: block k's output is what saeflow calls layer k."""
    import torch

    for path in BLOCK_PATHS:
        module = model
        for attr in path.split("."):
            module = getattr(module, attr, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise SaeflowError(f"cannot find the transformer blocks of {type(model).__name__} (looked at {BLOCK_PATHS})")


@contextlib.contextmanager
def record_blocks(blocks, layers: typing.Sequence[int], stop_after_deepest: bool) -> typing.Iterator[dict]:
    """Forward hooks that store each requested block's output (B, T, D) in the yielded dict, keyed by layer.

    With `stop_after_deepest` the deepest block's hook ends the forward pass, so later blocks never run.
    """
    stop = blocks[max(layers)] if stop_after_deepest else None
    with record({layer: hooks.Tap(blocks[layer], blocks[layer], False) for layer in layers}, stop) as recorded:
        yield recorded


@contextlib.contextmanager
def record(taps: dict, stop_after=None) -> typing.Iterator[dict]:
    """Forward hooks that store each tap's tensor (`hooks.Tap`: a hook point of one block) in the yielded dict under
    the tap's key. `stop_after` (a module) ends the forward pass once it has run, after every recording hook on it
    (hooks on one module run in the order they were registered)."""
    recorded: dict = {}

    def keeper(key):
        def keep(tensor) -> None:
            recorded[key] = tensor.detach()

        return keep

    def stop(module, args, output):
        raise _StopForward

    handles = [handle for key, tap in taps.items() for handle in tap.intercept(keeper(key))]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(stop))
    try:
        yield recorded
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()


def stored_positions(info: ModelInfo, n_model_tokens: int):
    """The positions of a model's sequence that extraction stores, in order (int64 array): all but the register
    tokens (DINOv2 with registers: CLS, registers, patches; CLS then the patches are stored)."""
    import numpy as np

    r = info.n_registers
    return np.r_[0:1, 1 + r : n_model_tokens] if r else np.arange(n_model_tokens)


def keep_stored(info: ModelInfo, acts_btd):
    """The stored positions (`stored_positions`) of a block's output (B, T_model, D)."""
    if info.n_registers == 0:
        return acts_btd
    import torch

    return acts_btd[:, torch.from_numpy(stored_positions(info, acts_btd.shape[1])).to(acts_btd.device)]


class Adapter:
    """A loaded model with one job: activations of chosen blocks for a batch, stopping after the deepest."""

    def __init__(self, info: ModelInfo, model, compute_dtype: str, device: str):
        import torch

        self.info = info
        self.model = model.eval()
        self.compute_dtype = compute_dtype
        self.torch_dtype = getattr(torch, compute_dtype)
        self.device = torch.device(device)
        self.blocks = find_blocks(self.model)
        if len(self.blocks) != info.n_layers:
            raise SaeflowError(f"{info.ckpt}: found {len(self.blocks)} blocks, config says {info.n_layers}")
        self._point_taps: dict[str, list] = {}  # hook point -> its tap in every block, found and checked once

    @property
    def n_layers(self) -> int:
        return self.info.n_layers

    @property
    def d_model(self) -> int:
        return self.info.d_model

    def run(self, batch, layers: typing.Sequence[int]) -> dict:
        """{layer: float32 acts (B, T, D) on CPU}: the residual stream after each block, for images (B, 3, H, W) or
        token ids (B, T). `layers` are absolute block indices. Register tokens are removed; CLS (when the model has
        one) stays first."""
        acts = self.run_points(batch, [(hooks.RESIDUAL, layer) for layer in layers])
        return {layer: acts[hooks.RESIDUAL, layer] for layer in layers}

    def point_taps(self, name: str) -> list:
        """Where every block computes hook point `name` (`hooks.Tap`), located and checked in all of them the first
        time (extraction asks before its first batch): a one-line error when the family lacks it or a block does."""
        if name not in self._point_taps:
            self._point_taps[name] = hooks.find_taps(self.blocks, self.info.model_type, self.info.family, name)
        return self._point_taps[name]

    def run_points(self, batch, points: typing.Sequence[tuple[str, int]]) -> dict:
        """{(hook point, layer): float32 acts (B, T, D) on CPU} from one forward pass, stopped after the deepest
        block any point names (`run`'s positions)."""
        import torch

        taps = {(name, layer): self.point_taps(name)[layer] for name, layer in points}
        stop_after = self.blocks[max(layer for _, layer in points)]
        with record(taps, stop_after) as recorded, torch.inference_mode():
            batch = batch.to(self.device)
            if self.info.modality == "vision":
                self.model(pixel_values=batch.to(self.torch_dtype))
            else:
                self.model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
        return {point: keep_stored(self.info, recorded[point]).float().cpu() for point in points}


def build(info: ModelInfo, spec: ModelSpec, compute_dtype: str = "float32", lm_head: bool = False):
    """The transformers module (weights loaded, or randomly initialized from the seed), in `compute_dtype`. With
    `lm_head`, a causal LM (`info.causal`) comes with its language-model head (its blocks under `.base_model`); a
    random-init one gets the seeded base model's weights and a head initialized (or tied) from the seed."""
    import torch
    import transformers

    dtype = getattr(torch, compute_dtype)
    with_head = lm_head and info.causal
    cls = transformers.AutoModelForCausalLM if with_head else {
        "clip_vision_model": transformers.CLIPVisionModel,
        "siglip_vision_model": transformers.SiglipVisionModel,
    }.get(info.model_type, transformers.AutoModel)
    if info.source is None:
        try:
            config = transformers.AutoConfig.for_model(spec.random_arch, **spec.random_config)
        except Exception as err:  # transformers validates configs with several exception types
            raise SaeflowError(f"model.random.config: invalid for {spec.random_arch}: {err}") from None
        torch.manual_seed(spec.seed)
        model = transformers.AutoModel.from_config(config).to(dtype)
        if with_head:
            base = model
            torch.manual_seed(spec.seed)
            model = cls.from_config(base.config).to(dtype)
            model.base_model.load_state_dict(base.state_dict())
    else:
        try:
            model = cls.from_pretrained(info.source, revision=info.revision, dtype=dtype)
        except (OSError, ValueError) as err:
            raise SaeflowError(f"cannot load the weights of {info.ckpt}: {err}") from None
    built = (model.config.num_hidden_layers, model.config.hidden_size)
    if built != (info.n_layers, info.d_model):
        raise SaeflowError(
            f"{info.ckpt}: planning read {info.n_layers} blocks x d={info.d_model} from config.json, but transformers "
            f"built {built[0]} x d={built[1]}; the shard hash would be wrong (please report this config)"
        )
    return model


def load(
    spec: ModelSpec, compute_dtype: str = "float32", device: str = "cpu", info: ModelInfo | None = None
) -> Adapter:
    """Describe (unless given) and load a model, ready to `run`."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise SaeflowError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    info = info or describe(spec)
    model = build(info, spec, compute_dtype).to(device)
    return Adapter(info, model, compute_dtype, device)
