"""Typed, frozen views of the `activations` entries, built once at the edge from the schema-validated dict.

    spec = specs.ActivationSpec.from_dict(config["activations"]["docs"])  # then extract.plan_activation(spec), ...

`from_dict` validates a copy of the entry against its `$defs` schema (workflow/schemas/config.schema.yaml), which
fills the defaults: the schema is the only source of defaults, so these classes declare none. Stages take these
objects and never look keys up in dicts (the exports' entries: interop.spec).
"""

import dataclasses
import pathlib
import re
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import datasets, models
from saeflow.store import layout

# What `dataset.kind` can build (see datasets.from_config).
Dataset = (
    datasets.ImageFolder
    | datasets.SegFolder
    | datasets.GeneratedImages
    | datasets.TextCorpus
    | datasets.BuiltinCorpus
    | datasets.HFDataset
)

# Keys of an `activations.<name>` entry added after the first release, each with the value it was introduced at. The
# per-job configs (planning.cli_configs) leave a key out at that value, so an upgrade that adds a key with a default
# rewrites no job's config and reruns nothing (docs/contracts.md; tests/test_identity.py pins those configs).
INTRODUCED: dict[str, typing.Any] = {
    "hook": "residual",  # issue 35: hook points; before them, every activation was the residual stream
}


def canonical_spec(raw_spec: typing.Mapping[str, typing.Any]) -> dict:
    """A validated `activations.<name>` entry without the introduced keys at their introduction value."""
    return {key: value for key, value in raw_spec.items() if key not in INTRODUCED or value != INTRODUCED[key]}


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """One `activations.<name>` entry: one model + layers + hook point + dataset -> a content-addressed shard
    directory per layer (`per_layer`; one forward pass extracts every layer, and entries that differ only in `hook`
    share it: `shares_pass`).

    Everything but batch_size, device, n_workers and parts changes the stored bytes, and so the shard hash.
    """

    model: models.ModelSpec  # a checkpoint (id or path, revision) or a random-init architecture
    dataset: Dataset  # what the model runs on; its fields are hashed as `data`
    layers: tuple[int, ...]  # blocks as written (negative ones count from the end); planning resolves them
    hook: str  # which tensor of each block (extraction.hooks): hashed only when not the residual stream
    context_length: int  # text: tokens per example (fixed, packed)
    tokenizer: str | None  # text: None = the model's own, "bytes", or an HF id / path
    compute_dtype: str  # dtype the model runs in
    store_dtype: str  # dtype of the stored activations
    patches_per_shard: int  # vector budget per shard file
    batch_size: int  # examples per forward pass (not hashed)
    device: str  # "auto", "cpu", "cuda", "cuda:1", ... (not hashed)
    n_workers: int  # image decoding worker processes (not hashed)
    parts: int = 1  # workflow: part jobs of whole shards, then a seal job (not hashed: same bytes for any value)

    @classmethod
    def from_dict(cls, obj: dict) -> "ActivationSpec":
        """Validate one `activations.<name>` entry (a copy), fill its defaults, build the model and dataset specs."""
        try:
            spec = config.validate_entry(obj, "activation_spec")
        except SaeflowError as err:
            raise SaeflowError(str(err).replace("config does not match", "activation spec does not match")) from None
        return cls(
            model=models.ModelSpec.from_config(spec["model"]),
            dataset=datasets.from_config(spec["dataset"]),
            layers=tuple(spec["layers"]),
            hook=spec["hook"],
            context_length=spec["context_length"],
            tokenizer=spec["tokenizer"],
            compute_dtype=spec["compute_dtype"],
            store_dtype=spec["store_dtype"],
            patches_per_shard=spec["patches_per_shard"],
            batch_size=spec["batch_size"],
            device=spec["device"],
            n_workers=spec["n_workers"],
            parts=spec["parts"],
        )

    def per_layer(self, layers: typing.Sequence[int] | None = None) -> tuple["ActivationSpec", ...]:
        """The spec of each of its shard directories: one directory per layer (docs/contracts.md, "One directory per
        layer"), so adding a layer extracts only that layer and retrains nothing built on the others. `layers`: the
        spec's layers as planning resolved them (absolute, sorted: `ModelInfo.resolve_layers`); default as written.
        A spec of one layer is its own directory's, as written (its hash is the one earlier saeflow gave it)."""
        if len(self.layers) == 1:
            return (self,)
        return tuple(dataclasses.replace(self, layers=(layer,)) for layer in (layers or self.layers))

    def shares_pass(self, other: "ActivationSpec") -> bool:
        """Whether `other` differs from this spec in `hook` and `layers` alone, so one forward pass extracts both (one
        job, a directory each: extract.extract_pass; split into the same `parts`, one job per part, a part of each)."""
        return dataclasses.replace(other, hook=self.hook, layers=self.layers) == self


@dataclasses.dataclass(frozen=True)
class ShardsSpec:
    """An `activations.<name>` entry naming an existing shard directory (converted, imported, shared) instead of
    a model and a dataset: `shards` is its path or its hash. It must lie in shards_root (as `saeflow convert
    --shards-root` publishes it), where runs and the workflow find every shard directory by hash."""

    shards: str
    parts: int = 1  # split-extraction part jobs: an existing directory is never extracted

    def metadata(self, shards_root: pathlib.Path, expand_path: typing.Callable[[str, str], pathlib.Path]):
        """The directory's metadata (whose hash names it), after checking it is a valid shard dir in shards_root."""
        from saeflow.store.shards import ShardDir  # numpy: only when a config names a directory

        is_hash = re.fullmatch(layout.HASH_REGEX, self.shards) is not None
        dpath = shards_root / self.shards if is_hash else expand_path(self.shards, "shards")
        if not dpath.is_dir():
            where = f"no directory {dpath}" + (" (a hash is looked up under shards_root)" if is_hash else "")
            raise SaeflowError(f"shards: {where}")
        shard_dir = ShardDir(dpath)
        if dpath.resolve().parent != shards_root.resolve():
            raise SaeflowError(
                f"shards: {dpath} is not in shards_root {shards_root}; move it there (or convert with "
                f"--shards-root {shards_root}) so runs can find it by its hash"
            )
        if shard_dir.metadata.hash != shard_dir.hash:
            raise SaeflowError(f"shards: {dpath}: its metadata hashes to {shard_dir.metadata.hash}, not its name")
        return shard_dir.metadata


def activation_from_dict(obj: dict) -> "ActivationSpec | ShardsSpec":
    """One `activations.<name>` entry, typed: an existing shard directory, or a model + dataset to extract. A shards
    entry's `hook` would be ignored (its directory stores what it stores), so it is refused; the schema fills in
    the default, which alone cannot be told from a `hook` not given."""
    if isinstance(obj, dict) and "shards" in obj:
        hook = config.validate_entry(obj, "activation_spec")["hook"]
        if hook != config.schema_default("activation_spec", "hook"):
            raise SaeflowError(f"hook: {hook!r} on a shards entry, which is extracted already (its directory's "
                               "metadata says what it stores); remove hook")  # fmt: skip
        return ShardsSpec(shards=obj["shards"])
    return ActivationSpec.from_dict(obj)
