"""The typed `exports.<name>` entry (or the ad-hoc flags of `saeflow export`): prompts -> text model -> a dataset.

    export = spec.ExportSpec.from_dict(config["exports"]["probe"])       # then interop.convert.export(export, out)

`from_dict` validates a copy of the entry against `$defs.export_spec` (the schema fills every default).
"""

import dataclasses
import typing

from saeflow import config
from saeflow.store import layout

if typing.TYPE_CHECKING:  # imported when an export is typed: a config without exports plans without them
    from saeflow.interop.lmprobe.format import LmprobeOptions
    from saeflow.interop.pickle_shards import PickleOptions
    from saeflow.interop.zarr_store.format import ZarrOptions

# What `saeflow convert --to` writes: an export format, (saev) a shard directory that training reads, or (saev2.1) a
# saeflow shard directory as saev's own 2.1 directory, for saev's readers (interop.saev_export; no records involved).
SAEV_EXPORT_FORMAT = "saev2.1"
SINK_FORMATS = (*config.enum("export_spec", "format"), "saev", SAEV_EXPORT_FORMAT)
# The SAE checkpoints `saeflow export-checkpoint` writes and `import-checkpoint` reads (interop.checkpoints).
SAE_FORMATS = ("saelens", "sparsify")
CIRCUIT_TRACER = "circuit-tracer"  # a whole transcoder set, a run per layer (interop.checkpoints.circuit_tracer)
CHECKPOINT_FORMATS = (*SAE_FORMATS, CIRCUIT_TRACER)


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

    store: "ZarrOptions"  # the layout of every shard store
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
    lmprobe: "LmprobeOptions"  # lmprobe 2.0 options (format lmprobe)
    zarr: ZarrExport  # Zarr store options (format zarr)
    pickle: "PickleOptions"  # gzip-pickle options (format pickle)

    @classmethod
    def from_dict(cls, obj: dict) -> "ExportSpec":
        """Validate one export entry (a copy), fill its defaults, build the per-format options."""
        from saeflow.interop.lmprobe.format import LmprobeOptions
        from saeflow.interop.pickle_shards import PickleOptions
        from saeflow.interop.zarr_store.format import ZarrOptions

        spec = config.validate_entry(obj, "export_spec")
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
            lmprobe=LmprobeOptions(**spec["lmprobe"]),
            zarr=ZarrExport(
                store=ZarrOptions(**{k: v for k, v in zarr.items() if k not in ("workers", "merge")}),
                workers=zarr["workers"],
                merge=zarr["merge"],
            ),
            pickle=PickleOptions(**spec["pickle"]),
        )

    def out_dpath(self, name: str) -> str:
        """Where export `name` goes: its `out`, else results/exports/<name>."""
        return self.out or str(layout.DEFAULT_EXPORTS_DPATH / name)

    @property
    def marker_fname(self) -> str:
        """The file that stands for a finished export of this format (the workflow's output for it)."""
        from saeflow.interop.lmprobe.format import PARQUET_PATH
        from saeflow.interop.pickle_shards import METADATA_FNAME
        from saeflow.interop.zarr_store.format import MANIFEST_FNAME

        markers = config.by_enum(
            {
                "lmprobe": PARQUET_PATH,
                "zarr": MANIFEST_FNAME,  # written once every shard store exists
                "pickle": METADATA_FNAME,
            },
            "export_spec", "format",
        )  # fmt: skip
        return markers[self.format]
