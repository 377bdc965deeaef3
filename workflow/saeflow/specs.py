"""Typed, frozen views of the config's stage entries, built once at the edge from the schema-validated dict.

    spec = specs.ActivationSpec.from_dict(config["activations"]["docs"])  # then extract.plan_activation(spec), ...

`from_dict` validates a copy of the entry against its `$defs` schema (workflow/schemas/config.schema.yaml), which
fills the defaults: the schema is the only source of defaults, so these classes declare none. Stages take these
objects and never look keys up in dicts.
"""

import copy
import dataclasses

from saeflow import config, datasets, models
from saeflow.errors import SaeflowError

# What `dataset.kind` can build (see datasets.from_config).
Dataset = (
    datasets.ImageFolder | datasets.SegFolder | datasets.GeneratedImages | datasets.TextCorpus | datasets.BuiltinCorpus
)


def _validated(obj: dict, def_name: str) -> dict:
    """A copy of `obj`, validated against `$defs.<def_name>` and filled with its defaults (the caller's dict stays)."""
    return config.validate(copy.deepcopy(obj), config.def_schema(def_name))


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """One `activations.<name>` entry: one model + layers + dataset -> one content-addressed shard directory.

    Everything but batch_size, device and n_workers changes the stored bytes, and so the shard hash.
    """

    model: models.ModelSpec  # a checkpoint (id or path, revision) or a random-init architecture
    dataset: Dataset  # what the model runs on; its fields are hashed as `data`
    layers: tuple[int, ...]  # blocks as written (negative ones count from the end); planning resolves them
    context_length: int  # text: tokens per example (fixed, packed)
    tokenizer: str | None  # text: None = the model's own, "bytes", or an HF id / path
    compute_dtype: str  # dtype the model runs in
    store_dtype: str  # dtype of the stored activations
    patches_per_shard: int  # vector budget per shard file
    batch_size: int  # examples per forward pass (not hashed)
    device: str  # "auto", "cpu", "cuda", "cuda:1", ... (not hashed)
    n_workers: int  # image decoding worker processes (not hashed)

    @classmethod
    def from_dict(cls, obj: dict) -> "ActivationSpec":
        """Validate one `activations.<name>` entry (a copy), fill its defaults, build the model and dataset specs."""
        try:
            spec = _validated(obj, "activation_spec")
        except SaeflowError as err:
            raise SaeflowError(str(err).replace("config does not match", "activation spec does not match")) from None
        return cls(
            model=models.ModelSpec.from_config(spec["model"]),
            dataset=datasets.from_config(spec["dataset"]),
            layers=tuple(spec["layers"]),
            context_length=spec["context_length"],
            tokenizer=spec["tokenizer"],
            compute_dtype=spec["compute_dtype"],
            store_dtype=spec["store_dtype"],
            patches_per_shard=spec["patches_per_shard"],
            batch_size=spec["batch_size"],
            device=spec["device"],
            n_workers=spec["n_workers"],
        )
