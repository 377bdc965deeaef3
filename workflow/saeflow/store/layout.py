"""Where everything lives: the one definition of the shard-directory and run-directory layouts.

Nothing else in saeflow (the package, the Snakemake rules, the tests) spells a path of these layouts; they ask
these classes. With a Snakemake wildcard in place of the hash they give the rules' patterns (`RunLayout.at(runs_root,
RUN_ID_WILDCARD).sae_fpath`, which the rules get from the plan), which can never drift from what the CLI writes.

    <shards_root>/<shard_hash>/                  ShardLayout (saev protocol 2.0 plus saeflow's extras, docs/store.md)
      metadata.json  shards.json  acts000000.bin ...  labels.bin  tokens.bin  classes.bin
      checksums.json  provenance.json
    <shards_root>/.<shard_hash>.partial/         staging while it is built (with progress.json), renamed when done
    <shards_root>/.<shard_hash>.lock             flock: one builder per hash
    <shards_root>/.<shard_hash>.parts/           split extraction (docs/extraction.md): one directory per part job
      part-<i>-of-<n>/  metadata.json  progress.json  acts<k>.bin ...  tokens.bin|labels.bin  part.json
      .part-<i>-of-<n>.lock                      flock: one writer per part

    <runs_root>/<run_id>/                        RunLayout (storage-and-run-manifest v1)
      checkpoint/config.json  sae.pt  resume.pt  metrics.jsonl  metrics.json  provenance.json
      checkpoint/.publish.partial/               the final files staged together, renamed out sae.pt last
      links/train-shards  train-dataset  val-shards  val-dataset
      inference/<shard_hash>/                    DumpLayout
        config.json  patch_acts.npz  latents.npz  metrics.json  provenance.json
        visuals/                                 VisualsLayout: index.html app.js style.css data.js config.json
                                                 l0_hist.png freq_vs_mean.png latents/<id>.png neuronpedia-batch.json
                                                 labels.js
      inference/.<shard_hash>.lock               flock: one builder per dump
      inference/.<shard_hash>.visuals.lock       flock: one drawer per dump's visuals
      evaluation/<shard_hash>.json               `saeflow evaluate`: the SAE spliced into the model on those data
      probe/<shard_hash>.json                    `saeflow probe`: which latents predict the labels of those data
    <runs_root>/.<run_id>.lock                   flock: one writer per run (create-run, train, dump publishing)

    <summary_dir>/summary.csv  pareto.png        SummaryLayout
    results/exports/<name>/                      an export whose `out` is null (DEFAULT_EXPORTS_DPATH)
    .snakemake/saeflow/<kind>/<key>.json         CliConfigLayout: the per-job configs the rules hand to the CLI

A content hash (a shard hash, a run id) is the full sha256: HASH_REGEX.
"""

import dataclasses
import os
import pathlib

HASH_REGEX = "[0-9a-f]{64}"  # a shard hash or a run id (the workflow's wildcard constraint)
# How the workflow lays activation specs out in shard directories. 1: one directory per spec, every layer in it.
# 2 (issue 40): one directory per layer (ActivationSpec.per_layer), so adding a layer extracts only that layer and
# retrains nothing built on the others; a spec of one layer keeps its layout-1 directory. `saeflow migrate` moves a
# layout-1 tree (saeflow.migration), and layout-1 directories stay readable as `shards:` activations.
LAYOUT_VERSION = 2
SHARD_HASH_WILDCARD = "{shard_hash}"
RUN_ID_WILDCARD = "{run_id}"
PROVENANCE_FNAME = "provenance.json"
STAGING_TAG = "partial"


def _path(base: str, *parts: str, doc: str | None = None) -> property:
    """A read-only path property: `self.<base>` joined with `parts` (one line per path of a layout)."""
    return property(lambda self: getattr(self, base).joinpath(*parts), doc=doc)


def staging_dpath(final_dpath: pathlib.Path, tag: str = STAGING_TAG) -> pathlib.Path:
    """The hidden sibling where `final_dpath` is built (same filesystem, so one rename publishes it)."""
    return final_dpath.parent / f".{final_dpath.name}.{tag}"


class _ContentAddressed:
    """A directory `<root>/<content hash>/` (the hash may be a Snakemake wildcard: the rules' patterns)."""

    @classmethod
    def at(cls, root: str | os.PathLike, key: str) -> "_ContentAddressed":
        return cls(pathlib.Path(root) / key)


@dataclasses.dataclass(frozen=True)
class ShardLayout(_ContentAddressed):
    """A shard directory `<shards_root>/<shard_hash>/` (or its staging sibling, which holds the same files)."""

    dpath: pathlib.Path

    METADATA_FNAME = "metadata.json"
    SHARDS_FNAME = "shards.json"
    CHECKSUMS_FNAME = "checksums.json"
    PROVENANCE_FNAME = PROVENANCE_FNAME
    PROGRESS_FNAME = "progress.json"  # staging only: the completed shards, for resume
    PART_DONE_FNAME = "part.json"  # a finished part of a split extraction: its shards, checksums, provenance
    LABELS_FNAME = "labels.bin"
    TOKENS_FNAME = "tokens.bin"
    CLASSES_FNAME = "classes.bin"  # per-example class ids of an image folder (not a protocol file)

    @staticmethod
    def shard_fname(shard_idx: int) -> str:
        return f"acts{shard_idx:06d}.bin"

    def shard_fpath(self, shard_idx: int) -> pathlib.Path:
        return self.dpath / self.shard_fname(shard_idx)

    def file(self, fname: str) -> pathlib.Path:
        """Any file of the directory by its name (the *_FNAME constants, a shard name, a side file)."""
        return self.dpath / fname

    metadata_fpath = _path("dpath", METADATA_FNAME)
    shards_fpath = _path("dpath", SHARDS_FNAME, doc="shards.json: written last; the workflow lets it stand for the dir")
    checksums_fpath = _path("dpath", CHECKSUMS_FNAME)
    provenance_fpath = _path("dpath", PROVENANCE_FNAME)
    progress_fpath = _path("dpath", PROGRESS_FNAME)

    @property
    def staging(self) -> "ShardLayout":
        return ShardLayout(staging_dpath(self.dpath))

    @property
    def lock_fpath(self) -> pathlib.Path:
        return self.dpath.parent / f".{self.dpath.name}.lock"

    @property
    def parts_dpath(self) -> pathlib.Path:
        """`.<hash>.parts/`: the shared area where the part jobs of a split extraction write (same filesystem)."""
        return staging_dpath(self.dpath, "parts")

    def part(self, part_idx: int | str, n_parts: int | str) -> "ShardLayout":
        """Part `part_idx` (0-based) of `n_parts`: a directory holding a contiguous range of whole shards."""
        return ShardLayout(self.parts_dpath / f"part-{part_idx}-of-{n_parts}")

    part_done_fpath = _path("dpath", PART_DONE_FNAME, doc="part.json: written last by a part job; stands for the part")


@dataclasses.dataclass(frozen=True)
class VisualsLayout:
    """The visuals of a dump, `RUN/inference/<shard_hash>/visuals/` (or its staging sibling): a static site."""

    dpath: pathlib.Path

    INDEX_FNAME = "index.html"
    ASSET_FNAMES = (INDEX_FNAME, "app.js", "style.css")  # the page itself, copied from the package's assets
    DATA_FNAME = "data.js"  # every latent's statistics and the drawn ones: a script, so file:// pages load it
    CONFIG_FNAME = "config.json"  # what was drawn
    NEURONPEDIA_FNAME = "neuronpedia-batch.json"  # text runs: SAEDashboard's Neuronpedia batch
    LATENTS_DNAME = "latents"
    PLOTS = ("l0_hist", "freq_vs_mean")  # <plot>.png, drawn for every dump
    LABELS_JS_FNAME = "labels.js"  # the labels each latent predicts (saeflow probe), a script

    index_fpath = _path("dpath", INDEX_FNAME, doc="index.html: the latent browser")
    labels_js_fpath = _path("dpath", LABELS_JS_FNAME, doc="labels.js: probe results per latent")
    data_fpath = _path("dpath", DATA_FNAME)
    config_fpath = _path("dpath", CONFIG_FNAME)
    neuronpedia_fpath = _path("dpath", NEURONPEDIA_FNAME)
    latents_dpath = _path("dpath", LATENTS_DNAME)

    @classmethod
    def latent_png(cls, latent: int, band: int | None = None) -> str:
        """`latents/<id>.png` (its top examples) or `latents/<id>-q<band>.png`, relative: the page links it."""
        return f"{cls.LATENTS_DNAME}/{latent}{'' if band is None else f'-q{band}'}.png"

    @staticmethod
    def plot_fname(plot: str) -> str:
        return f"{plot}.png"

    def plot_fpath(self, plot: str) -> pathlib.Path:
        return self.dpath / self.plot_fname(plot)


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
    INDEX_FNAME = VisualsLayout.INDEX_FNAME
    PLOTS = VisualsLayout.PLOTS

    config_fpath = _path("dpath", CONFIG_FNAME)
    acts_fpath = _path("dpath", ACTS_FNAME)
    latents_fpath = _path("dpath", LATENTS_FNAME)
    metrics_fpath = _path("dpath", METRICS_FNAME, doc="metrics.json: the workflow lets it stand for the published dump")
    provenance_fpath = _path("dpath", PROVENANCE_FNAME)
    visuals_dpath = _path("dpath", VISUALS_DNAME)

    @property
    def visuals(self) -> VisualsLayout:
        return VisualsLayout(self.visuals_dpath)

    @property
    def index_fpath(self) -> pathlib.Path:
        """visuals/index.html: the latent browser (the workflow lets it stand for the visuals)."""
        return self.visuals.index_fpath

    @property
    def labels_js_fpath(self) -> pathlib.Path:
        return self.visuals.labels_js_fpath

    @property
    def visuals_lock_fpath(self) -> pathlib.Path:
        """`inference/.<shard_hash>.visuals.lock`: flock held while one process draws the dump's visuals."""
        return self.dpath.parent / f".{self.dpath.name}.visuals.lock"

    def plot_fpath(self, plot: str) -> pathlib.Path:
        return self.visuals.plot_fpath(plot)


@dataclasses.dataclass(frozen=True)
class RunLayout(_ContentAddressed):
    """A run directory `<runs_root>/<run_id>/` (storage-and-run-manifest v1)."""

    root: pathlib.Path

    CHECKPOINT_DNAME = "checkpoint"
    LINKS_DNAME = "links"
    INFERENCE_DNAME = "inference"
    EVALUATION_DNAME = "evaluation"
    PROBE_DNAME = "probe"
    TRAIN_SHARDS, TRAIN_DATASET = "train-shards", "train-dataset"  # links/: symlinks to the shard dirs and datasets
    VAL_SHARDS, VAL_DATASET = "val-shards", "val-dataset"
    LINK_NAMES = (TRAIN_SHARDS, TRAIN_DATASET, VAL_SHARDS, VAL_DATASET)
    # a transcoder's too: the shard directories of its targets, paired with train-shards and val-shards
    TARGET_SHARDS, VAL_TARGET_SHARDS = "target-shards", "val-target-shards"
    TARGET_LINK_NAMES = (TARGET_SHARDS, VAL_TARGET_SHARDS)

    @property
    def run_id(self) -> str:
        return self.root.name

    checkpoint_dpath = _path("root", CHECKPOINT_DNAME)
    config_fpath = _path("root", CHECKPOINT_DNAME, "config.json", doc="the training config; its sha256 = run id")
    hyperparameters_fpath = _path("root", CHECKPOINT_DNAME, "hyperparameters.json",
                                  doc="every value the run trains with (its readable config): not hashed")
    sae_fpath = _path("root", CHECKPOINT_DNAME, "sae.pt", doc="the trained SAE, renamed in last: present = trained")
    resume_fpath = _path("root", CHECKPOINT_DNAME, "resume.pt")
    resume_shards_dpath = _path("root", CHECKPOINT_DNAME, "resume-shards", doc="a latent-sharded resume checkpoint")
    resume_manifest_fpath = _path("root", CHECKPOINT_DNAME, "resume-shards", "manifest.json",
                                  doc="its commit point: the step and each rank file's latent range")  # fmt: skip
    metrics_log_fpath = _path("root", CHECKPOINT_DNAME, "metrics.jsonl", doc="one line per logged step, then the final")
    final_metrics_fpath = _path("root", CHECKPOINT_DNAME, "metrics.json", doc="validation metrics at the end")
    provenance_fpath = _path("root", CHECKPOINT_DNAME, PROVENANCE_FNAME, doc="versions, platforms, times: not hashed")
    publish_dpath = _path("root", CHECKPOINT_DNAME, ".publish.partial", doc="the final files staged together")
    links_dpath = _path("root", LINKS_DNAME)
    inference_dpath = _path("root", INFERENCE_DNAME)

    @property
    def lock_fpath(self) -> pathlib.Path:
        """`<runs_root>/.<run_id>.lock`: flock held while creating, training or publishing into the run."""
        return self.root.parent / f".{self.root.name}.lock"

    def resume_shard_fpath(self, step: int, lo: int, hi: int) -> pathlib.Path:
        """`resume-shards/step<step>-<lo>-<hi>.pt`: latents [lo, hi) of a sharded resume checkpoint at `step`."""
        return self.resume_shards_dpath / f"step{step:09d}-{lo}-{hi}.pt"

    def link(self, name: str) -> pathlib.Path:
        """links/train-shards, links/train-dataset, links/val-shards or links/val-dataset (a transcoder's also
        links/target-shards and links/val-target-shards)."""
        if name not in self.LINK_NAMES + self.TARGET_LINK_NAMES:
            raise ValueError(f"unknown run link {name!r}; the layout has {self.LINK_NAMES + self.TARGET_LINK_NAMES}")
        return self.links_dpath / name

    def layer_link(self, name: str, layer: int) -> pathlib.Path:
        """A cross-layer transcoder's link `name` (`link`'s names) for one of its layers: links/<name>.layer<layer>
        (it reads a directory per layer of each role)."""
        return self.link(name).with_name(f"{name}.layer{layer}")

    def dump(self, shard_hash: str) -> DumpLayout:
        """The inference dump of this run's SAE on the shard directory `shard_hash`."""
        return DumpLayout(self.inference_dpath / shard_hash)

    def evaluation_fpath(self, shard_hash: str) -> pathlib.Path:
        """`evaluation/<shard_hash>.json`: splice metrics of this run's SAE on the data of shards `shard_hash`."""
        return self.root / self.EVALUATION_DNAME / f"{shard_hash}.json"

    def probe_fpath(self, shard_hash: str) -> pathlib.Path:
        """`probe/<shard_hash>.json`: which of this run's latents predict the labels of shards `shard_hash`."""
        return self.root / self.PROBE_DNAME / f"{shard_hash}.json"

    def dump_lock_fpath(self, shard_hash: str) -> pathlib.Path:
        """`inference/.<shard_hash>.lock`: flock held while one process builds that dump."""
        return self.inference_dpath / f".{shard_hash}.lock"


@dataclasses.dataclass(frozen=True)
class SummaryLayout:
    """The workflow's summary, `<summary_dir>/`: one row per run, and the Pareto plot of the sweep."""

    dpath: pathlib.Path

    csv_fpath = _path("dpath", "summary.csv")
    pareto_fpath = _path("dpath", "pareto.png")


DEFAULT_EXPORTS_DPATH = pathlib.Path("results", "exports")  # exports.<name>.out when null: <this>/<name>


@dataclasses.dataclass(frozen=True)
class CliConfigLayout:
    """The per-job configs the workflow hands to the CLI (relative to its working directory): `<kind>/<key>.json`,
    kind shards, runs or exports (a job's config, named by its shard hash, run id or export name), or stages (what
    decides a stage's rerun). Each is rewritten only when its content changes."""

    dpath: pathlib.Path = pathlib.Path(".snakemake", "saeflow")

    @staticmethod
    def rel_fpath(kind: str, key: str) -> pathlib.Path:
        return pathlib.Path(kind, f"{key}.json")

    def fpath(self, kind: str, key: str) -> pathlib.Path:
        return self.dpath / self.rel_fpath(kind, key)
