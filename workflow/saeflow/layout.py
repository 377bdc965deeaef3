"""Where everything lives: the one definition of the shard-directory and run-directory layouts.

Nothing else in saeflow (the package, the Snakemake rules, the tests) spells a path of these layouts; they ask
these classes. `pattern(root)` gives the same layout with a Snakemake wildcard in place of the hash, so a rule's
output is `RunLayout.pattern(runs_root).sae_fpath` and can never drift from what the CLI writes.

    <shards_root>/<shard_hash>/                  ShardLayout (saev protocol 2.0 plus saeflow's extras, docs/store.md)
      metadata.json  shards.json  acts000000.bin ...  labels.bin  tokens.bin  checksums.json  provenance.json
    <shards_root>/.<shard_hash>.partial/         staging while it is built (with progress.json), renamed when done
    <shards_root>/.<shard_hash>.lock             flock: one builder per hash

    <runs_root>/<run_id>/                        RunLayout (storage-and-run-manifest v1)
      checkpoint/config.json  sae.pt  resume.pt  metrics.jsonl  metrics.json
      checkpoint/.publish.partial/               the final files staged together, renamed out sae.pt last
      links/train-shards  train-dataset  val-shards  val-dataset
      inference/<shard_hash>/                    DumpLayout
        config.json  patch_acts.npz  latents.npz  metrics.json  provenance.json
        visuals/index.html  l0_hist.png  freq_vs_mean.png  ...
      inference/.<shard_hash>.lock               flock: one builder per dump
    <runs_root>/.<run_id>.lock                   flock: one writer per run (create-run, train, dump publishing)
"""

import dataclasses
import os
import pathlib

SHARD_HASH_WILDCARD = "{shard_hash}"
RUN_ID_WILDCARD = "{run_id}"
PROVENANCE_FNAME = "provenance.json"
STAGING_TAG = "partial"


def staging_dpath(final_dpath: pathlib.Path, tag: str = STAGING_TAG) -> pathlib.Path:
    """The hidden sibling where `final_dpath` is built (same filesystem, so one rename publishes it)."""
    return final_dpath.parent / f".{final_dpath.name}.{tag}"


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """A shard directory `<shards_root>/<shard_hash>/` (or its staging sibling, which holds the same files)."""

    dpath: pathlib.Path

    METADATA_FNAME = "metadata.json"
    SHARDS_FNAME = "shards.json"
    CHECKSUMS_FNAME = "checksums.json"
    PROVENANCE_FNAME = PROVENANCE_FNAME
    PROGRESS_FNAME = "progress.json"  # staging only: the completed shards, for resume
    LABELS_FNAME = "labels.bin"
    TOKENS_FNAME = "tokens.bin"

    @classmethod
    def at(cls, shards_root: str | os.PathLike, shard_hash: str) -> "ShardLayout":
        return cls(pathlib.Path(shards_root) / shard_hash)

    @classmethod
    def pattern(cls, shards_root: str | os.PathLike) -> "ShardLayout":
        """The layout with `{shard_hash}` for the hash: Snakemake rule inputs and outputs."""
        return cls.at(shards_root, SHARD_HASH_WILDCARD)

    @staticmethod
    def shard_fname(shard_idx: int) -> str:
        return f"acts{shard_idx:06d}.bin"

    def shard_fpath(self, shard_idx: int) -> pathlib.Path:
        return self.dpath / self.shard_fname(shard_idx)

    def file(self, fname: str) -> pathlib.Path:
        """Any file of the directory by its name (the *_FNAME constants, a shard name, a side file)."""
        return self.dpath / fname

    @property
    def metadata_fpath(self) -> pathlib.Path:
        return self.dpath / self.METADATA_FNAME

    @property
    def shards_fpath(self) -> pathlib.Path:
        """shards.json: written last of the listed files, so the workflow lets it stand for the directory."""
        return self.dpath / self.SHARDS_FNAME

    @property
    def checksums_fpath(self) -> pathlib.Path:
        return self.dpath / self.CHECKSUMS_FNAME

    @property
    def provenance_fpath(self) -> pathlib.Path:
        return self.dpath / self.PROVENANCE_FNAME

    @property
    def progress_fpath(self) -> pathlib.Path:
        return self.dpath / self.PROGRESS_FNAME

    @property
    def staging(self) -> "ShardLayout":
        return ShardLayout(staging_dpath(self.dpath))

    @property
    def lock_fpath(self) -> pathlib.Path:
        return self.dpath.parent / f".{self.dpath.name}.lock"


@dataclasses.dataclass(frozen=True)
class DumpLayout:
    """An inference dump `RUN/inference/<shard_hash>/` and its visuals."""

    dpath: pathlib.Path

    CONFIG_FNAME = "config.json"
    ACTS_FNAME = "patch_acts.npz"
    LATENTS_FNAME = "latents.npz"
    METRICS_FNAME = "metrics.json"
    PROVENANCE_FNAME = PROVENANCE_FNAME
    VISUALS_DNAME = "visuals"
    INDEX_FNAME = "index.html"
    PLOTS = ("l0_hist", "freq_vs_mean")  # visuals/<plot>.png, drawn for every dump

    @property
    def config_fpath(self) -> pathlib.Path:
        return self.dpath / self.CONFIG_FNAME

    @property
    def acts_fpath(self) -> pathlib.Path:
        return self.dpath / self.ACTS_FNAME

    @property
    def latents_fpath(self) -> pathlib.Path:
        return self.dpath / self.LATENTS_FNAME

    @property
    def metrics_fpath(self) -> pathlib.Path:
        """metrics.json: the workflow lets it stand for the published dump."""
        return self.dpath / self.METRICS_FNAME

    @property
    def provenance_fpath(self) -> pathlib.Path:
        return self.dpath / self.PROVENANCE_FNAME

    @property
    def visuals_dpath(self) -> pathlib.Path:
        return self.dpath / self.VISUALS_DNAME

    @property
    def index_fpath(self) -> pathlib.Path:
        """visuals/index.html: the latent browser, standing for the visuals."""
        return self.visuals_dpath / self.INDEX_FNAME

    @staticmethod
    def plot_fname(plot: str) -> str:
        return f"{plot}.png"

    def plot_fpath(self, plot: str) -> pathlib.Path:
        return self.visuals_dpath / self.plot_fname(plot)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """A run directory `<runs_root>/<run_id>/` (storage-and-run-manifest v1)."""

    root: pathlib.Path

    CHECKPOINT_DNAME = "checkpoint"
    LINKS_DNAME = "links"
    INFERENCE_DNAME = "inference"
    TRAIN_SHARDS, TRAIN_DATASET = "train-shards", "train-dataset"  # links/: symlinks to the shard dirs and datasets
    VAL_SHARDS, VAL_DATASET = "val-shards", "val-dataset"
    LINK_NAMES = (TRAIN_SHARDS, TRAIN_DATASET, VAL_SHARDS, VAL_DATASET)

    @classmethod
    def at(cls, runs_root: str | os.PathLike, run_id: str) -> "RunLayout":
        return cls(pathlib.Path(runs_root) / run_id)

    @classmethod
    def pattern(cls, runs_root: str | os.PathLike) -> "RunLayout":
        """The layout with `{run_id}` for the run id: Snakemake rule inputs and outputs."""
        return cls.at(runs_root, RUN_ID_WILDCARD)

    @property
    def run_id(self) -> str:
        return self.root.name

    @property
    def checkpoint_dpath(self) -> pathlib.Path:
        return self.root / self.CHECKPOINT_DNAME

    @property
    def config_fpath(self) -> pathlib.Path:
        """checkpoint/config.json: the hashed training config whose sha256 is the run id."""
        return self.checkpoint_dpath / "config.json"

    @property
    def sae_fpath(self) -> pathlib.Path:
        """checkpoint/sae.pt: written last, so its presence means the run is trained."""
        return self.checkpoint_dpath / "sae.pt"

    @property
    def resume_fpath(self) -> pathlib.Path:
        return self.checkpoint_dpath / "resume.pt"

    @property
    def publish_dpath(self) -> pathlib.Path:
        """checkpoint/.publish.partial/: metrics.jsonl, metrics.json and sae.pt staged together (sae.pt last)."""
        return self.checkpoint_dpath / ".publish.partial"

    @property
    def lock_fpath(self) -> pathlib.Path:
        """`<runs_root>/.<run_id>.lock`: flock held while creating, training or publishing into the run."""
        return self.root.parent / f".{self.root.name}.lock"

    @property
    def metrics_log_fpath(self) -> pathlib.Path:
        """checkpoint/metrics.jsonl: one line per logged training step, then the final validation line."""
        return self.checkpoint_dpath / "metrics.jsonl"

    @property
    def final_metrics_fpath(self) -> pathlib.Path:
        """checkpoint/metrics.json: the validation metrics at the end of training."""
        return self.checkpoint_dpath / "metrics.json"

    @property
    def links_dpath(self) -> pathlib.Path:
        return self.root / self.LINKS_DNAME

    def link(self, name: str) -> pathlib.Path:
        """links/train-shards, links/train-dataset, links/val-shards or links/val-dataset."""
        if name not in self.LINK_NAMES:
            raise ValueError(f"unknown run link {name!r}; the layout has {self.LINK_NAMES}")
        return self.links_dpath / name

    @property
    def inference_dpath(self) -> pathlib.Path:
        return self.root / self.INFERENCE_DNAME

    def dump(self, shard_hash: str) -> DumpLayout:
        """The inference dump of this run's SAE on the shard directory `shard_hash`."""
        return DumpLayout(self.inference_dpath / shard_hash)

    def dump_lock_fpath(self, shard_hash: str) -> pathlib.Path:
        """`inference/.<shard_hash>.lock`: flock held while one process builds that dump."""
        return self.inference_dpath / f".{shard_hash}.lock"
