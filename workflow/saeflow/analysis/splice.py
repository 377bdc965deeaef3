"""A function spliced into a model at its hook points: read one tensor, replace another with f(it), run on.

    m = splice.load_model(info, model_spec, "float32", device)
    sae_splice = splice.Splice.at(splice.Point("mlp_out", 3), reconstruct)              # an SAE: reads and writes one
    transcoder = splice.Splice(splice.Point("mlp_in", 3), splice.Point("mlp_out", 3), predict)   # reads one, writes one
    prefix = splice.Prefix.of(transcoder)
    clean = splice.spliced_forward(m, inputs, mask_bt, None, prefix)          # records the blocks before the splice
    out = splice.spliced_forward(m, inputs, mask_bt, transcoder, prefix)      # replays them, then splices

A `Point` is a hook point (saeflow.extraction.hooks: `residual`, `attn_out`, `mlp_out`, `mlp_in`, `resid_mid`) of
one block. Its tensor is the very one extraction records (`hooks.find_taps`: a submodule's output, the block itself for
`residual`, the block's input plus its attention output for `resid_mid`), so what a splice reads or replaces is by
construction the extracted tensor, and the rest of the model runs on the replacement exactly as it would on the
model's own tensor: `attn_out` / `mlp_out` are what the block adds to the
residual stream (post-norm BERT and RoBERTa: the dense output, which dropout, the residual and LayerNorm follow),
`mlp_in` is the norm's output the MLP reads (in post-norm BERT and RoBERTa that LayerNorm's output is also the
residual stream the MLP sublayer adds to: one tensor, replaced for both), `residual` the block's output, and
`resid_mid` the stream both the MLP's norm and the block's last sum read (written as the attention output that makes
it: replacement - block input, so the block's own sum is the replacement to float rounding).

A `Splice` reads `read`'s tensor at the masked positions (float32, (n, d)), calls `fn` on it and writes the result
at the same positions of `write`'s tensor, in one forward pass; every other position stays as the model computes it.
An SAE reads and writes one point (`Splice.at`: fn = decode(encode(x))); a transcoder reads its input hook point and
writes its prediction at its target hook point (fn = its forward from input to prediction, raw activation space).
Both points are forward hooks on their modules (`hooks.Tap.intercept`), the read one registered first: a splice whose
write point runs before its read point in the forward pass is refused in one line when it fires (no table of module
order to copy).

A tuple of splices runs together in one pass (`Splices`: a replacement model, a transcoder in place of every MLP);
each reads what the splices before it made.

`Prefix` is the "early exit" a splice allows: every pass of one batch sees the same inputs up to the first module it
hooks, so the clean pass records the outputs of the blocks before that (up to and including a `residual` point's
block: its output is the hooked tensor itself) and the other passes replay them.
"""

import contextlib
import dataclasses
import functools
import typing

import torch

from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, hooks, models

Reconstruct = typing.Callable[[torch.Tensor], torch.Tensor]  # raw activations (n, d) -> replacement (n, d)


@dataclasses.dataclass(frozen=True)
class Point:
    """One hook point of one block: the tensor extraction stores as `layer` of a shard directory with this `hook`."""

    hook: str
    layer: int

    def __str__(self) -> str:
        return f"{self.hook} of block {self.layer}"

    def to_dict(self) -> dict:
        return {"hook": self.hook, "layer": self.layer}

    @property
    def replayable(self) -> int:
        """The last block every pass may replay before this point is reached: its own block for `residual` (the hook
        sees the replayed output), the one before for a submodule inside the block (which must run)."""
        return self.layer if self.hook == hooks.RESIDUAL else self.layer - 1


@dataclasses.dataclass(frozen=True)
class Splice:
    """Read `read`'s tensor at the masked positions, write fn(it) into `write`'s tensor there (module docstring)."""

    read: Point
    write: Point
    fn: Reconstruct
    observes: bool = False  # fn only reads (a CLT's earlier layer, for a later one's prediction): no ablation of it

    @classmethod
    def at(cls, point: Point, fn: Reconstruct) -> "Splice":
        """A splice that replaces one tensor with a function of itself: an SAE's reconstruction, or an ablation."""
        return cls(point, point, fn)

    def __post_init__(self):
        if self.read.layer > self.write.layer:
            raise SaeflowError(f"a splice cannot read {self.read} to write {self.write}: block {self.write.layer} "
                               "runs first")  # fmt: skip


@dataclasses.dataclass
class Spliceable:
    """A loaded model, its blocks, and how to run one batch to what is scored (logits or final hidden states)."""

    info: models.ModelInfo
    model: torch.nn.Module
    blocks: torch.nn.ModuleList
    causal: bool
    point_taps: dict = dataclasses.field(default_factory=dict)  # hook -> its tap in every block, found once

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of a causal LM, else the final hidden states (B, T, D); float32."""
        if self.info.modality == "vision":
            out = self.model(pixel_values=inputs.to(next(self.model.parameters()).dtype))
        else:
            out = self.model(input_ids=inputs, attention_mask=torch.ones_like(inputs), use_cache=False)
        return (out.logits if self.causal else out.last_hidden_state).float()

    def tap(self, point: Point) -> hooks.Tap:
        """Where the model computes `point`'s tensor: the tap extraction records (a one-line error if it lacks it)."""
        if point.hook not in self.point_taps:
            info = self.info
            self.point_taps[point.hook] = hooks.find_taps(self.blocks, info.model_type, info.family, point.hook)
        return self.point_taps[point.hook][point.layer]


def load_model(info: models.ModelInfo, spec: models.ModelSpec, compute_dtype: str, device) -> Spliceable:
    """The model with the weights extraction used; causal LMs with their LM head (random-init: tied or seeded)."""
    model = adapters.build(info, spec, compute_dtype, lm_head=True).to(device).eval()
    blocks = adapters.find_blocks(model.base_model if info.causal else model)
    return Spliceable(info, model, blocks, info.causal)


@dataclasses.dataclass
class Prefix:
    """The outputs of blocks 0..last of one batch's clean pass, which its other passes replay (module docstring)."""

    last: int
    outputs: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, splice: "Splice | Splices") -> "Prefix":
        splices = as_splices(splice)
        return cls(min(point.replayable for one in splices for point in (one.read, one.write)))

    @contextlib.contextmanager
    def reuse(self, blocks: torch.nn.ModuleList, record: bool) -> typing.Iterator[None]:
        """Record the outputs of blocks 0..last (the clean pass), or replay them: each block's forward returns its
        recorded output without computing. Identical inputs give identical outputs, so a replayed block returns
        exactly what it would compute again."""
        handles, patched = [], []
        try:
            for k in range(self.last + 1):
                block = blocks[k]
                if record:
                    handles.append(block.register_forward_hook(functools.partial(self._record, k)))
                else:
                    patched.append((block, block.__dict__.get("forward")))
                    block.forward = lambda *args, _out=self.outputs[k], **kwargs: _out
            yield
        finally:
            for handle in handles:
                handle.remove()
            for block, original in patched:
                if original is None:
                    del block.forward
                else:
                    block.forward = original

    def _record(self, k: int, module, args, output) -> None:
        self.outputs[k] = output


Splices = tuple[Splice, ...]  # spliced together in one pass: a replacement model (a transcoder per layer)


def as_splices(splice: "Splice | typing.Sequence[Splice]") -> Splices:
    return (splice,) if isinstance(splice, Splice) else tuple(splice)


@contextlib.contextmanager
def hooked(m: Spliceable, splice: Splice | Splices, mask_bt: torch.Tensor) -> typing.Iterator[None]:
    """Forward hooks that make the model's next forward pass run with `splice`, or with every splice of a tuple at
    once (each its read hook first): a later splice reads what the earlier ones made, as a replacement model does."""
    handles = []
    try:
        for one in as_splices(splice):
            handles += _hook_one(m, one, mask_bt)
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hook_one(m: Spliceable, splice: Splice, mask_bt: torch.Tensor) -> list:
    read: list[torch.Tensor] = []

    def on_read(tensor_btd):
        read.append(tensor_btd[mask_bt].float())

    def on_write(tensor_btd):
        if not read:
            raise SaeflowError(f"a splice cannot read {splice.read} to write {splice.write}: the model computes "
                               f"{splice.write} first")  # fmt: skip
        return mask_bt, splice.fn(read.pop())

    handles = m.tap(splice.read).intercept(on_read)
    try:
        handles += m.tap(splice.write).intercept(on_write)
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def spliced_forward(
    m: Spliceable, inputs: torch.Tensor, mask_bt: torch.Tensor, splice: Splice | Splices | None,
    prefix: Prefix | None = None,
) -> torch.Tensor:  # fmt: skip
    """The model's output with `splice` (or every splice of a tuple) at `mask_bt` (bool (B, T_model)). `splice=None`
    is the clean pass, which records the prefix's blocks; the other passes replay them (prefix None: neither, every
    block runs)."""
    reuse = contextlib.nullcontext() if prefix is None else prefix.reuse(m.blocks, record=splice is None)
    hooking = contextlib.nullcontext() if splice is None else hooked(m, splice, mask_bt)
    with reuse, hooking, torch.inference_mode():
        return m.forward(inputs)
