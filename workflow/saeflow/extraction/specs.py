"""Typed, frozen views of the config's stage entries, built once at the edge from the schema-validated dict.

    spec = specs.ActivationSpec.from_dict(config["activations"]["docs"])  # then extract.plan_activation(spec), ...
    export = specs.ExportSpec.from_dict(config["exports"]["probe"])       # then interop.convert.export(export, out)

`from_dict` validates a copy of the entry against its `$defs` schema (workflow/schemas/config.schema.yaml), which
fills the defaults: the schema is the only source of defaults, so these classes declare none. Stages take these
objects and never look keys up in dicts. Option classes that can also be built without a spec (lmprobe, Zarr,
gzip-pickle, the interop engine) read their defaults from the schema too, through `export_defaults`.
"""

import copy
import dataclasses
import pathlib
import re
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import datasets, models

if typing.TYPE_CHECKING:  # the interop modules import this one (export_defaults); ExportSpec.from_dict imports them
    from saeflow.interop import lmprobe, pickle_shards, zarr_store

# What `dataset.kind` can build (see datasets.from_config).
Dataset = (
    datasets.ImageFolder
    | datasets.SegFolder
    | datasets.GeneratedImages
    | datasets.TextCorpus
    | datasets.BuiltinCorpus
    | datasets.HFDataset
)


def _validated(obj: dict, def_name: str) -> dict:
    """A copy of `obj`, validated against `$defs.<def_name>` and filled with its defaults (the caller's dict stays)."""
    return config.validate(copy.deepcopy(obj), config.def_schema(def_name))


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """One `activations.<name>` entry: one model + layers + dataset -> one content-addressed shard directory.

    Everything but batch_size, device, n_workers and parts changes the stored bytes, and so the shard hash.
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
    parts: int = 1  # workflow: part jobs of whole shards, then a seal job (not hashed: same bytes for any value)

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
            parts=spec["parts"],
        )


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

        is_hash = re.fullmatch(r"[0-9a-f]{64}", self.shards) is not None
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
    """One `activations.<name>` entry, typed: an existing shard directory, or a model + dataset to extract."""
    if isinstance(obj, dict) and "shards" in obj:
        _validated(obj, "activation_spec")
        return ShardsSpec(shards=obj["shards"])
    return ActivationSpec.from_dict(obj)


# ---------------------------------------------------------------------------------------------------------------
# Exports (saeflow.interop)
# ---------------------------------------------------------------------------------------------------------------


def export_defaults(cls, *sections: str | None) -> dict:
    """The schema defaults of dataclass `cls`'s fields, from an `exports.<name>` entry's own keys (section None)
    and from its sections ("model", "lmprobe", "zarr", "pickle"), later sections winning."""
    props = config.load_schema()["$defs"]["export_spec"]["properties"]
    names = {f.name for f in dataclasses.fields(cls)}
    found = {}
    for section in sections:
        section_props = props if section is None else props[section]["properties"]
        for key, prop in section_props.items():
            if key in names and "default" in prop:
                found[key] = copy.deepcopy(prop["default"])
    return found


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A .jsonl, .csv or .parquet table of prompts: a text column, an optional label column, extra columns kept."""

    path: str  # the table
    text_key: str  # its text column
    label_key: str  # its label column (rows without one have no label)
    limit: int | None  # use only the first N prompts; None = all


@dataclasses.dataclass(frozen=True)
class ZarrExport:
    """The `zarr` section: what each shard store holds, and how the stores are written."""

    store: "zarr_store.ZarrOptions"  # the layout of every shard store
    workers: int  # writer processes (each loads the model and writes its own shard stores)
    merge: bool  # also write merged.zarr, one store with every sample


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """One `exports.<name>` entry (or the ad-hoc flags of `saeflow export`): prompts -> text model -> a dataset."""

    format: str  # "lmprobe", "zarr" or "pickle"
    model_name: str  # HF id (from the HF cache when HF_HUB_OFFLINE=1) or local transformers directory
    model_revision: str  # branch, tag or commit; the resolved commit is recorded
    prompts: Prompts  # the prompt table
    layers: tuple[int, ...]  # block indices (negative ones count from the end)
    max_tokens: int  # prompts are truncated to this many tokens before the forward pass
    batch_size: int  # prompts per forward pass, right-padded
    device: str  # torch device of the forward pass
    out: str | None  # output directory; None = results/exports/<name>
    lmprobe: "lmprobe.LmprobeOptions"  # lmprobe 2.0 options (format lmprobe)
    zarr: ZarrExport  # Zarr store options (format zarr)
    pickle: "pickle_shards.PickleOptions"  # gzip-pickle options (format pickle)

    @classmethod
    def from_dict(cls, obj: dict) -> "ExportSpec":
        """Validate one export entry (a copy), fill its defaults, build the per-format options."""
        from saeflow.interop import lmprobe, pickle_shards, zarr_store

        spec = _validated(obj, "export_spec")
        zarr = spec["zarr"]
        return cls(
            format=spec["format"],
            model_name=spec["model"]["name"],
            model_revision=spec["model"]["revision"],
            prompts=Prompts(**spec["prompts"]),
            layers=tuple(spec["layers"]),
            max_tokens=spec["max_tokens"],
            batch_size=spec["batch_size"],
            device=spec["device"],
            out=spec["out"],
            lmprobe=lmprobe.LmprobeOptions(**spec["lmprobe"]),
            zarr=ZarrExport(
                store=zarr_store.ZarrOptions(**{k: v for k, v in zarr.items() if k not in ("workers", "merge")}),
                workers=zarr["workers"],
                merge=zarr["merge"],
            ),
            pickle=pickle_shards.PickleOptions(**spec["pickle"]),
        )

    def out_dpath(self, name: str) -> str:
        """Where export `name` goes: its `out`, else results/exports/<name>."""
        return self.out or f"results/exports/{name}"

    @property
    def marker_fname(self) -> str:
        """The file that stands for a finished export of this format (the workflow's output for it)."""
        from saeflow.interop import lmprobe, pickle_shards, zarr_store

        return {
            "lmprobe": lmprobe.PARQUET_PATH,
            "zarr": zarr_store.MANIFEST_FNAME,  # written once every shard store exists
            "pickle": pickle_shards.METADATA_FNAME,
        }[self.format]
