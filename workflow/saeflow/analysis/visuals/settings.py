"""What the visuals stage draws and how: its settings, the schema's `visuals` section."""

import dataclasses
import pathlib

from saeflow import config
from saeflow.errors import SaeflowError

SELECTIONS = config.enum("visuals", "selection")
DEFAULTS = config.section_defaults("visuals")


@dataclasses.dataclass(frozen=True)
class VisualsConfig:
    """Which latents to draw and how."""

    run: pathlib.Path
    shards_hash: str | None = None
    selection: str = DEFAULTS["selection"]
    n_latents: int = DEFAULTS["n_latents"]
    latents: tuple[int, ...] = tuple(DEFAULTS["latents"])
    top_k: int = DEFAULTS["top_k"]
    seed: int = DEFAULTS["seed"]
    tile_px: int = DEFAULTS["tile_px"]
    context_tokens: int = DEFAULTS["context_tokens"]
    n_quantiles: int = DEFAULTS["n_quantiles"]
    quantile_examples: int = DEFAULTS["quantile_examples"]
    n_vocab: int = DEFAULTS["n_vocab"]
    tokenizer: str | None = None  # HF id or local directory; needed when the shards came from a local model
    force: bool = False

    def __post_init__(self):
        object.__setattr__(self, "latents", tuple(int(i) for i in self.latents))
        if self.selection not in SELECTIONS:
            raise SaeflowError(f"visuals selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.selection == "list" and not self.latents:
            raise SaeflowError("visuals selection 'list' needs latent ids (--latents 3 17 ...)")
        for key in ("n_latents", "top_k", "tile_px", "n_quantiles", "quantile_examples", "n_vocab"):
            if getattr(self, key) < 1:
                raise SaeflowError(f"visuals {key} must be at least 1, got {getattr(self, key)}")
