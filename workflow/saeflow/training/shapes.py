"""The shape of a dictionary, a seam orthogonal to its architecture (training/archs): what it reads and writes.

    sae          a site to itself: reconstructs its input (no `target`)
    transcoder   a site to another: predicts `target` from `train` at one layer (Dunefsky et al. 2024)
    clt          a cross-layer transcoder: one encoder per layer l of `layer` (a list), read from `train`'s layer l,
                 whose latents write every layer l..L-1 of `target` (Ameisen et al. 2025, "Circuit Tracing")

An architecture (activation and loss) trains in a shape, or the shape refuses the pair in one line (`refusal`);
tests/test_shapes.py iterates both registries. The SAE spec's `shape` key chooses (`auto`: sae or transcoder by
`target`); a run's config.json holds `shape` only for a CLT (`keys.INTRODUCED`: "auto"), so no earlier run id
moves. No
torch: planning imports this at parse time.

Adding a shape: an entry of `REGISTRY`, its name in the schema's `sae_spec.shape` enum, its model and trainer
(training/clt.py is the CLT's), and its checkpoint formats (interop/checkpoints); docs/architecture.md.
"""

import dataclasses

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.training import archs
from saeflow.training.archs import Selection


@dataclasses.dataclass(frozen=True)
class Shape:
    """One dictionary shape: whether it has a target, whether it spans layers, and what it trains with."""

    name: str
    transcodes: bool  # it predicts a `target` activation (not its own input)
    cross_layer: bool  # one model over a list of layers, each layer's latents writing that layer and every later one
    # the parallel modes it trains in on several ranks (None: its architecture's own, archs.trains_in)
    modes: tuple[str, ...] | None = None
    # the architecture selections it computes (None: every one)
    selections: tuple[Selection, ...] | None = None
    why_not: str = ""  # what it says of an architecture whose selection it does not compute

    def refusal(self, arch_name: str) -> str | None:
        """Why `arch_name` does not train in this shape (one line), or None when it does."""
        arch = archs.get(arch_name)
        if self.transcodes and not arch.transcodes:
            return (f"{arch_name} has no transcoder (set target: null, or an architecture that transcodes: "
                    f"{', '.join(archs.names(transcoder=True))})")
        if self.selections is not None and arch.selection not in self.selections:
            return f"{arch_name} does not train as a {self.name}: {self.why_not}"
        return None

    def trains_in(self, arch_name: str) -> tuple[str, ...]:
        """The parallel modes `arch_name` trains in, in this shape (none where it does not train in it)."""
        if self.refusal(arch_name) is not None:
            return ()
        own = archs.trains_in(archs.get(arch_name), self.transcodes)
        return own if self.modes is None else tuple(mode for mode in own if mode in self.modes)


REGISTRY: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        Shape("sae", transcodes=False, cross_layer=False),
        Shape("transcoder", transcodes=True, cross_layer=False),
        Shape("clt", transcodes=True, cross_layer=True, modes=(),
              selections=(Selection.DENSE, Selection.TOP_K, Selection.BATCH_TOP_K),
              why_not="its encoder picks latents against one whole residual, and a CLT's latents write many layers"),
    )
}  # fmt: skip
NAMES = tuple(name for name in config.enum("sae_spec", "shape") if name != "auto")  # tests check it is the registry


def get(name: str) -> Shape:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SaeflowError(f"shape: unknown dictionary shape {name!r}; choose one of {tuple(REGISTRY)}") from None


def of(cfg) -> Shape:
    """The shape of a run (a specs.TrainConfig or anything with `shape` and `target`)."""
    if cfg.shape not in (None, "auto"):
        return get(cfg.shape)
    return REGISTRY["transcoder" if cfg.target is not None else "sae"]


def check(shape: Shape, arch_name: str, matryoshka, skip: bool) -> None:
    """Refuse, in one line naming the key, what the shape cannot train: an architecture it does not compute, and a
    CLT's Matryoshka prefixes or skip path (circuit-tracer's CLTs have none; nothing here trains them yet)."""
    if (why := shape.refusal(arch_name)) is not None:
        raise SaeflowError(f"arch: {why}")
    if shape.cross_layer and matryoshka:
        raise SaeflowError("matryoshka: a cross-layer transcoder trains no Matryoshka prefixes; set matryoshka: []")
    if shape.cross_layer and skip:
        raise SaeflowError("skip: a cross-layer transcoder has no linear skip path (circuit-tracer's CLTs carry none)")


def check_mode(cfg, mode: str, where: str) -> None:
    """Refuse, in one line, a parallel mode the run's shape does not train its architecture in."""
    shape = of(cfg)
    if not shape.cross_layer:
        archs.check_mode(cfg.arch, mode, where, cfg.transcoder, cfg)
        return
    if mode in archs.MODES and mode not in shape.trains_in(cfg.arch):
        raise SaeflowError(f"{where}: cross-layer transcoders train on one process, not with parallel: {mode} "
                           "(set train.gpus: 1 and train.nodes: 1 for them)")  # fmt: skip
