"""The workflow's plan: a validated config -> typed specs -> shard hashes -> run plans -> every output path.

Snakemake builds one `WorkflowPlan` at parse time (workflow/rules/common.smk, also inside every Slurm job) and asks
it for paths through a few `get_*` helpers; tests build it directly. Planning reads model configs and lists
datasets, never weights or activations. Paths come from `saeflow.store.layout`; nothing here spells one.

    plan = WorkflowPlan.from_config(config_dict)       # validated (Snakemake's validate or config.validate)
    plan.layer_hash["minilm-docs"][3]                  # the content address of one layer's shard directory
    plan.metadata[shard_hash]                          # what that directory holds
    plan.runs[run_id].train_activation                 # every point of every SAE sweep
    plan.write_cli_configs(".snakemake/saeflow")       # the per-job configs the rules hand to the CLI
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

from saeflow.analysis import stability
from saeflow.config import expand_path
from saeflow.errors import SaeflowError
from saeflow.extraction import extract
from saeflow.extraction.specs import ActivationSpec, ShardsSpec, activation_from_dict, canonical_spec
from saeflow.interop.spec import ExportSpec
from saeflow.store import hashing, layout, shards
from saeflow.store.atomic import write_file_atomic
from saeflow.store.shards import parts
from saeflow.store.shards.validate import stat_problem
from saeflow.training import keys, run_checks, sweeps

SETTINGS_SECTIONS = ("train", "inference", "visuals", "evaluate", "probe")  # CLI flags (config.section_flags)


@dataclasses.dataclass(frozen=True)
class WorkflowConfig:
    """The whole workflow config, typed: built once from the schema-validated dict."""

    shards_root: pathlib.Path  # where shard directories <sha256>/ are published (scratch on a cluster)
    runs_root: pathlib.Path  # where run directories <run_id>/ live (project storage on a cluster)
    summary_dir: pathlib.Path  # summary.csv and pareto.png
    activations: dict[str, ActivationSpec | ShardsSpec]  # name -> spec: a content-addressed shard dir per layer
    saes: dict[str, sweeps.SAESpec]  # name -> spec; list-valued hyper-parameters expand into a sweep
    exports: dict[str, ExportSpec]  # name -> interop export
    settings: dict[str, dict]  # `train`, `inference`, `visuals`: how stages run, handed to the CLI as flags
    raw: dict = dataclasses.field(repr=False)  # the validated dict, for the per-job config files the CLI reads

    @classmethod
    def from_dict(cls, config: dict) -> "WorkflowConfig":
        for section in ("activations", "saes"):
            _refuse_names_equal_but_for_case(section, config[section])
        return cls(
            shards_root=expand_path(config["shards_root"], "shards_root"),
            runs_root=expand_path(config["runs_root"], "runs_root"),
            summary_dir=expand_path(config["summary_dir"], "summary_dir"),
            activations={name: _typed(activation_from_dict, spec, f"activations.{name}")
                         for name, spec in config["activations"].items()},
            saes={name: _typed(lambda s, n=name: sweeps.SAESpec.from_dict(n, s), spec, f"saes.{name}")
                  for name, spec in config["saes"].items()},
            exports={name: _typed(ExportSpec.from_dict, spec, f"exports.{name}")
                     for name, spec in config["exports"].items()},
            settings={section: dict(config[section]) for section in SETTINGS_SECTIONS},
            raw=config,
        )  # fmt: skip


def sae_subconfig(config: dict, sae_name: str) -> dict:
    """The part of a validated config that plans the runs of SAE `sae_name` alone: its train and validation
    activations (a transcoder's targets too; only those are planned), no other SAE, no export."""
    sae = config["saes"][sae_name]
    names = dict.fromkeys((sae["train"], sae.get("val") or sae["train"], *(
        name for name in (sae.get("target"), sae.get("val_target")) if name is not None)))
    activations = {name: config["activations"][name] for name in names if name in config["activations"]}
    return {**config, "activations": activations, "saes": {sae_name: sae}, "exports": {}}


def _refuse_names_equal_but_for_case(section: str, names) -> None:
    """Names that differ only by case are one name on a case-insensitive filesystem (macOS, Windows): what is
    written under them would merge."""
    seen: dict[str, str] = {}
    for name in names:
        first = seen.setdefault(name.casefold(), name)
        if first != name:
            raise SaeflowError(f"{section}: {first!r} and {name!r} differ only by case, which a case-insensitive "
                               "filesystem takes for one name; rename one")  # fmt: skip


def _typed(build, obj, key: str):
    try:
        return build(obj)
    except SaeflowError as err:
        raise SaeflowError(f"{key}: {err}") from None


def has_labels(spec: ActivationSpec | ShardsSpec, shards: layout.ShardLayout) -> bool:
    """Whether a shard directory carries labels to probe: its dataset writes labels.bin or classes.bin (planned
    from the spec), or, for an existing directory, it holds one of them (a stat)."""
    label_fnames = (layout.ShardLayout.LABELS_FNAME, layout.ShardLayout.CLASSES_FNAME)
    if isinstance(spec, ShardsSpec):
        return any(shards.file(fname).exists() for fname in label_fnames)
    return getattr(spec.dataset, "aux_fname", None) in label_fnames  # text datasets have none


def _metadata(spec: ActivationSpec | ShardsSpec, shards_root: pathlib.Path):
    """The shard metadata an activation plans; an existing directory (ShardsSpec) hands its own, no extraction."""
    if isinstance(spec, ShardsSpec):
        return spec.metadata(shards_root, expand_path)
    return extract.plan_activation(spec)


def activation_key(raw_spec: dict) -> str:
    """Names an activation spec by its content (the validated `activations.<name>` entry): the key of its planned
    metadata (`cli_config("planned", key)`)."""
    return hashlib.sha256(hashing.canonical_json(canonical_spec(raw_spec)).encode("utf-8")).hexdigest()


def read_planned(raw_activations: dict, cache_dpath: pathlib.Path) -> dict[str, dict]:
    """Activation key -> the shard metadata an earlier parse planned and wrote under `cache_dpath` (those found).

    A Slurm job's own parse of the Snakefile takes these instead of planning again: it must rebuild the DAG the
    Snakemake that submitted it planned, and it then lists no dataset and reads no model file (on a 1.28M-file image
    folder, seconds of stat calls in every job). The job's `saeflow` command still plans its own inputs."""
    planned = {}
    for raw_spec in raw_activations.values():
        key = activation_key(raw_spec)
        try:
            planned[key] = json.loads((cache_dpath / WorkflowPlan.cli_config("planned", key)).read_text("utf-8"))
        except (OSError, ValueError):
            continue  # not planned by this working directory's Snakemake (or torn): planned again
    return planned


def plan_metadata(cfg: WorkflowConfig, planned: dict[str, dict]) -> dict[str, shards.Metadata]:
    """Activation name -> its shard metadata, every layer: from `planned` (read_planned) where it holds the spec,
    else planned."""
    out = {}
    for name, spec in cfg.activations.items():
        known = planned.get(activation_key(cfg.raw["activations"][name]))
        if known is not None and isinstance(spec, ActivationSpec):
            out[name] = _typed(shards.Metadata.from_dict, known, f"activations.{name} (planned)")
        else:
            out[name] = _typed(lambda s: _metadata(s, cfg.shards_root), spec, f"activations.{name}")
    return out


@dataclasses.dataclass(frozen=True)
class ShardDirPlan:
    """One shard directory the workflow reads: an activation spec's directory of one layer (`ActivationSpec.
    per_layer`), or an existing directory (`ShardsSpec`, every layer it holds)."""

    activation: str  # the first `activations.<name>` that plans it (identical specs share a directory)
    spec: ActivationSpec | ShardsSpec  # what extracts it: a spec of its layer alone (or the existing directory)
    metadata: shards.Metadata  # its metadata.json; its hash names the directory
    raw: dict  # the `activations.<name>` entry of its spec, as the per-job configs hold it (canonical_spec)


def plan_shard_dirs(cfg: WorkflowConfig, activation_metadata: dict[str, shards.Metadata]):
    """(shard hash -> its directory's plan, activation name -> {layer: shard hash}): a directory per layer of a spec,
    an existing directory for every layer it holds (`extract.directories`). Activation specs with identical content
    share their directories; the first name speaks for each."""
    shard_dirs: dict[str, ShardDirPlan] = {}
    layer_hash: dict[str, dict[int, str]] = {}
    for name, md in activation_metadata.items():
        layer_hash[name] = {}
        for layer, (spec, dir_md, raw) in extract.directories(cfg.activations[name], md,
                                                               cfg.raw["activations"][name]).items():  # fmt: skip
            shard_dirs.setdefault(dir_md.hash, ShardDirPlan(name, spec, dir_md, raw))
            layer_hash[name][layer] = dir_md.hash
    return shard_dirs, layer_hash


class WorkflowPlan:
    """Every job of the workflow and every path it writes, computed from the config alone."""

    def __init__(self, cfg: WorkflowConfig, planned: dict[str, dict] | None = None):
        """`planned`: shard metadata an earlier parse planned (read_planned), taken as it is."""
        self.cfg = cfg
        self.activation_metadata = plan_metadata(cfg, planned or {})  # name -> what its spec plans, every layer
        self.shard_dirs, self.layer_hash = plan_shard_dirs(cfg, self.activation_metadata)
        self.metadata = {shard_hash: d.metadata for shard_hash, d in self.shard_dirs.items()}
        self.hash_activation = {shard_hash: d.activation for shard_hash, d in self.shard_dirs.items()}
        # Split extraction: hash -> number of part jobs (> 1 only; capped at the shard count). Not hashed.
        n_parts = {h: parts.n_parts_of(d.metadata, cfg.activations[d.activation].parts)
                   for h, d in self.shard_dirs.items()}  # fmt: skip
        self.shard_parts = {h: n for h, n in n_parts.items() if n > 1}
        auto_tokens = {name: sweeps.auto_tokens_of(md) for name, md in self.activation_metadata.items()}
        self.runs = {plan.run_id: plan for plan in sweeps.plan_runs(cfg.saes, self.layer_hash, auto_tokens)}
        check_runs(self)

    @property
    def shard_hash(self) -> dict[str, str]:
        """Activation name -> its shard hash, for the activations of one directory (one layer, or an existing
        directory); `layer_hash` names every directory."""
        return single_directories(self.layer_hash)

    @classmethod
    def from_config(cls, config: dict, planned: dict[str, dict] | None = None) -> "WorkflowPlan":
        return cls(WorkflowConfig.from_dict(config), planned)

    # -- layouts ----------------------------------------------------------------------------------------------

    def shard(self, shard_hash: str) -> layout.ShardLayout:
        return layout.ShardLayout.at(self.cfg.shards_root, shard_hash)

    def run(self, run_id: str) -> layout.RunLayout:
        return layout.RunLayout.at(self.cfg.runs_root, run_id)

    def dumps(self) -> list[tuple[str, str]]:
        """(run_id, shard_hash) of every inference dump: each run on its validation shards (a CLT has none)."""
        return [(r, p.train_config.val_shards) for r, p in self.runs.items() if not p.train_config.cross_layer]

    def probes(self) -> list[tuple[str, str]]:
        """(run_id, shard_hash) of every dump whose shards carry labels (labels.bin, classes.bin): saeflow probe."""
        return [(run_id, shard_hash) for run_id, shard_hash in self.dumps()
                if has_labels(self.shard_dirs[shard_hash].spec, self.shard(shard_hash))]

    @functools.cached_property
    def train_passes(self) -> dict[str, tuple[str, ...]]:
        """Run id -> the runs trained with it in one job, for every run untrained when first asked (one snapshot,
        so every job of a Snakemake invocation sees the same passes; see `train_passes`)."""
        return train_passes(self)

    def trained_by(self, run_id: str) -> str:
        """The run whose sae.pt stands for `run_id`'s training: its pass's representative, or itself once trained."""
        return self.train_passes.get(run_id, (run_id,))[-1]

    def export_dpath(self, name: str) -> pathlib.Path:
        return expand_path(self.cfg.exports[name].out_dpath(name), f"exports.{name}.out")

    def export_marker(self, name: str) -> pathlib.Path:
        """The file that stands for a finished export (written last by its format's writer)."""
        return self.export_dpath(name) / self.cfg.exports[name].marker_fname

    def summary_fpaths(self) -> tuple[pathlib.Path, pathlib.Path]:
        summary = layout.SummaryLayout(self.cfg.summary_dir)
        return summary.csv_fpath, summary.pareto_fpath

    def targets(self) -> list[pathlib.Path]:
        """What `snakemake` builds by default: every run's config and checkpoint (so a purged one is made again,
        not left missing behind its up-to-date dump), every dump's visuals, the summary (of dumps), every export."""
        return [
            *(self.run(run_id).config_fpath for run_id in self.runs),
            *dict.fromkeys(self.run(self.trained_by(run_id)).sae_fpath for run_id in self.runs),
            *(self.run(run_id).dump(shard_hash).index_fpath for run_id, shard_hash in self.dumps()),
            *(self.summary_fpaths() if self.dumps() else ()),
            *(self.export_marker(name) for name in self.cfg.exports),
        ]

    # -- the configs each job hands to the CLI ----------------------------------------------------------------

    def cli_configs(self) -> dict[pathlib.Path, dict]:
        """Relative path -> content of every per-job config (see `cli_configs`)."""
        return cli_configs(self)

    @staticmethod
    def cli_config(kind: str, key: str) -> pathlib.Path:
        """Where the config of one job lives under the cache directory: kind is shards, runs, exports or stability,
        key the shard hash, run id, export name or seed group; or what a parse planned (kind planned, key
        activation_key)."""
        return layout.CliConfigLayout.rel_fpath(kind, key)

    def write_cli_configs(self, cache_dpath: pathlib.Path) -> None:
        """Write every per-job config under `cache_dpath`, atomically and only where its content changed.

        A file written for the first time gets time stamp 0 (the epoch): Snakemake's mtime trigger then sees a
        change of content, never the file's introduction (a saeflow upgrade, a fresh .snakemake/), as a reason to
        rerun a job that has it as an input.
        """
        for rel_fpath, content in self.cli_configs().items():
            fpath = cache_dpath / rel_fpath
            text = hashing.canonical_json(content) + "\n"
            is_new = not fpath.exists()
            if is_new or fpath.read_text(encoding="utf-8") != text:
                fpath.parent.mkdir(parents=True, exist_ok=True)
                write_file_atomic(fpath, text.encode("utf-8"))
                if is_new:
                    os.utime(fpath, (0, 0))

    # -- what is gone -----------------------------------------------------------------------------------------

    def purged_shard_warnings(self) -> list[str]:
        """One line per shard directory that is missing (purged from scratch?) while runs built on it exist."""
        return purged_shard_warnings(self)

    def shard_hashes_to_read(self) -> list[str]:
        """The shard directories a job still has to read (see `shard_hashes_to_read`)."""
        return shard_hashes_to_read(self)

    def check_published_shards(self) -> None:
        """Refuse a damaged published shard directory a job will read (see `check_published_shards`)."""
        check_published_shards(self)


def single_directories(layer_hash: dict[str, dict[int, str]]) -> dict[str, str]:
    """Activation name -> its shard hash, for the activations held in one directory."""
    return {name: next(iter(hashes.values())) for name, hashes in layer_hash.items() if len(set(hashes.values())) == 1}


def check_runs(plan: WorkflowPlan) -> None:
    """What training would refuse of every run, from the planned shard metadata (`run_checks.check_run`)."""
    for run in plan.runs.values():
        for one in run_checks.per_layer(run):  # a CLT's checks are its layers' as transcoders, and its own
            cfg = one.train_config
            targets = None if cfg.target is None else (plan.metadata[cfg.target], plan.metadata[cfg.val_target])
            run_checks.check_run(one, plan.metadata[cfg.train_shards], plan.metadata[cfg.val_shards], None, targets)
        run_checks.check_parallel(run, plan.cfg.settings["train"])  # the parallel mode, in the run's own shape


def pending_passes(plan: WorkflowPlan) -> dict[str, tuple[str, ...]]:
    """Pass key -> the hashes of an extraction pass whose directories are not published yet (a stat each), for passes
    with any: one job extracts them (rule extract_pass_<key>), reusing the published ones, never rewriting them."""
    pending = {key: tuple(h for h in hashes if not plan.shard(h).shards_fpath.exists())
               for key, hashes in extraction_passes(plan).items()}  # fmt: skip
    return {key: hashes for key, hashes in pending.items() if hashes}


def evaluations(plan: WorkflowPlan) -> list[tuple[str, str]]:
    """(run_id, shard_hash) of every dump, whose SAE `saeflow evaluate` splices into its model at the hook point its
    shard metadata holds (the residual stream, an attention or MLP output, the MLP's input); a transcoder's prediction
    replaces its target's tensor."""
    return list(plan.dumps())


def extraction_passes(plan: WorkflowPlan) -> dict[str, tuple[str, ...]]:
    """Pass key -> the shard hashes (two or more, sorted) that one job extracts from one forward pass: the layers of
    one spec, and of the specs that differ from it only in the hook point (`ActivationSpec.shares_pass`). The key is
    the sha256 of the hashes, so it names the same pass in every parse of the same config (a Slurm job's own, a
    retry's)."""
    groups: list[list[str]] = []
    for shard_hash, shard_dir in plan.shard_dirs.items():
        if not isinstance(shard_dir.spec, ActivationSpec):
            continue
        for group in groups:
            if plan.shard_dirs[group[0]].spec.shares_pass(shard_dir.spec):
                group.append(shard_hash)
                break
        else:
            groups.append([shard_hash])
    passes = [tuple(sorted(group)) for group in groups if len(group) > 1]
    return {hashlib.sha256(" ".join(hashes).encode()).hexdigest(): hashes for hashes in passes}


def purged_shard_warnings(plan: WorkflowPlan) -> list[str]:
    """One line per shard directory that is missing (purged from scratch?) while runs built on it exist.

    Nothing is rebuilt for complete runs: a job asks for its shard directories only while its own output is
    missing (common.smk get_shards_if_missing), so a shard directory is extracted again only when a job needs it.
    """
    warnings = []
    for shard_hash, name in plan.hash_activation.items():
        shards = plan.shard(shard_hash)
        if shards.shards_fpath.exists():
            continue
        users = [
            run_id
            for run_id, run_plan in plan.runs.items()
            if shard_hash in run_plan.read_shards and plan.run(run_id).config_fpath.exists()
        ]
        if users:
            warnings.append(
                f"saeflow: shard directory {shards.dpath} (activation {name!r}) is missing, purged from scratch? "
                f"{len(users)} existing run(s) were built on it: {', '.join(u[:12] for u in users)}. Complete "
                "runs are kept as they are; the directory is extracted again only if a job still needs it."
            )
    return warnings


def check_published_shards(plan: WorkflowPlan) -> None:
    """Refuse, in one line, a published shard directory a job will read whose files are missing or of the wrong
    size (a stat per file: planning stays cheap), before any job starts on it."""
    for shard_hash in plan.shard_hashes_to_read():
        shards, name = plan.shard(shard_hash), plan.hash_activation[shard_hash]
        if not shards.shards_fpath.exists():
            continue  # not published: its extraction job makes it
        if problem := stat_problem(shards.dpath, plan.metadata[shard_hash]):
            raise SaeflowError(
                f"shard directory {shards.dpath} (activation {name!r}) is damaged and a job needs it: {problem}. "
                f"Remove it to extract it again (chmod -R u+w {shards.dpath} && rm -rf {shards.dpath}; runs "
                f"trained on it are kept), or see every problem with `saeflow validate --deep {shards.dpath}`"
            )


def shard_hashes_to_read(plan: WorkflowPlan) -> list[str]:
    """The shard directories that jobs still have to read, in plan order: a run's train and validation directories
    (a transcoder's targets too) while its run config or checkpoint is missing (create_run, train), its validation
    directory (and target) while its dump or its probe (labelled shards) is missing (inference, probe). The same
    conditions as common.smk's get_shards_if_missing, which asks for them."""
    hashes: dict[str, None] = {}
    probed = set(plan.probes())
    for run_id, run_plan in plan.runs.items():
        run = plan.run(run_id)
        val_hash = run_plan.train_config.val_shards
        if not run.config_fpath.exists() or not run.sae_fpath.exists():
            hashes.update(dict.fromkeys(run_plan.read_shards))
        elif run_plan.train_config.cross_layer:  # trained, and no dump (WorkflowPlan.dumps)
            continue
        elif not run.dump(val_hash).metrics_fpath.exists():
            hashes.update(dict.fromkeys(run_plan.val_shards))
        elif (run_id, val_hash) in probed and not run.probe_fpath(val_hash).exists():
            hashes[val_hash] = None
    return list(hashes)


def train_passes(plan: WorkflowPlan) -> dict[str, tuple[str, ...]]:
    """Run id -> the runs trained with it in one job (one pass over the data), for every run not yet trained.

    Untrained runs (no sae.pt) that read identical batches (`TrainConfig.loader_key`) are taken in run-id order and
    cut into passes of at most `train.runs_per_pass`. Trained runs are in no pass, so adding a sweep point never
    retrains an existing one. Each pass is listed with its representative (its smallest run id) last: that run's
    sae.pt is the job's declared output, and `saeflow train` publishes it last, so its presence means the whole
    pass is done.
    """
    untrained: dict[tuple, list[str]] = {}
    for run_id in sorted(plan.runs):
        if not plan.run(run_id).sae_fpath.exists():
            untrained.setdefault(plan.runs[run_id].train_config.loader_key(), []).append(run_id)
    size, passes = plan.cfg.settings["train"]["runs_per_pass"], {}
    for run_ids in untrained.values():
        for first in range(0, len(run_ids), size):
            members = (*run_ids[first + 1 : first + size], run_ids[first])
            passes.update(dict.fromkeys(members, members))
    return passes


def cli_configs(plan: WorkflowPlan) -> dict[pathlib.Path, dict]:
    """Relative path -> content of every per-job config, each named by what it holds (hash, run id, export).

    A job's command line then depends on its own hash only, so renaming an activation or editing an SAE never
    looks like a change to a protected shard directory.
    """
    raw = plan.cfg.raw
    roots = {"shards_root": str(plan.cfg.shards_root), "runs_root": str(plan.cfg.runs_root)}
    configs = {}

    def activation(name: str) -> dict:  # as written before keys were added to it: no rerun on an upgrade
        return canonical_spec(raw["activations"][name])

    for shard_hash, shard_dir in plan.shard_dirs.items():  # its layer's spec alone: the job extracts that directory
        configs[plan.cli_config("shards", shard_hash)] = {**roots, "activations": {shard_dir.activation: shard_dir.raw}}
    for key, hashes in extraction_passes(plan).items():  # one job, one forward pass, a directory each
        names = [plan.hash_activation[h] for h in hashes]
        configs[plan.cli_config("passes", key)] = {**roots, "activations": {n: activation(n) for n in names}}
    for run_id, run_plan in plan.runs.items():
        names = dict.fromkeys(run_plan.read_activations)
        configs[plan.cli_config("runs", run_id)] = {
            **roots,
            "activations": {name: activation(name) for name in names},
            "saes": {run_plan.sae_name: keys.job_spec(raw["saes"][run_plan.sae_name])},
        }
    for name, spec in plan.cfg.activations.items():  # what a job's own parse takes as planned (read_planned)
        if isinstance(spec, ActivationSpec):
            key = activation_key(raw["activations"][name])
            configs[plan.cli_config("planned", key)] = plan.activation_metadata[name].to_dict()
    for name in plan.cfg.exports:
        configs[plan.cli_config("exports", name)] = {"activations": {}, "exports": {name: raw["exports"][name]}}
    # What else decides a rerun, as inputs of those jobs (the workflow's rerun trigger is the files' content):
    # the settings of inference and visuals, and the runs and names the summary shows.
    configs[plan.cli_config("stages", "inference")] = {
        section: plan.cfg.settings[section] for section in ("inference", "visuals")
    }
    configs[plan.cli_config("stages", "evaluate")] = {"evaluate": plan.cfg.settings["evaluate"]}
    configs[plan.cli_config("stages", "probe")] = {"probe": plan.cfg.settings["probe"]}
    for group, run_ids in stability.seed_groups(seed_group_configs(plan)).items():
        configs[plan.cli_config("stability", group)] = {"runs": run_ids}  # the group's members: its rerun trigger
    summarized = summarized_runs(plan)
    configs[plan.cli_config("stages", "summary")] = {
        "runs": sorted(str(plan.run(run_id).root) for run_id in summarized),
        "labels": {run_id: p.name for run_id, p in sorted(summarized.items())},
        "group_labels": {run_id: p.group_name for run_id, p in sorted(summarized.items())},
    }
    return configs


def summarized_runs(plan: WorkflowPlan) -> dict:
    """Run id -> plan of the runs the summary shows: those with an inference dump (a CLT has none yet)."""
    dumped = {run_id for run_id, _ in plan.dumps()}
    return {run_id: run for run_id, run in plan.runs.items() if run_id in dumped}


def seed_group_configs(plan: WorkflowPlan) -> dict[str, dict]:
    """Run id -> training config of the runs whose seed groups the stability stage compares: those with dumps."""
    return {run_id: run.train_config.to_dict() for run_id, run in summarized_runs(plan).items()}


def describe_run(plan: WorkflowPlan, run_id: str) -> str:
    """A planned run for a person, as `saeflow plan` and the workflow's parse say it: `run <name>: <run id> (train
    <activation>, val <activation>)`, a transcoder's with its `target` and `val_target` activations."""
    run = plan.runs[run_id]
    reads = f"train {run.train_activation}, val {run.val_activation}"
    if run.train_config.cross_layer:
        reads = f"a cross-layer transcoder of layers {list(run.train_config.spanned_layers)}: " + reads
    if run.target_activation is not None:
        reads += f", target {run.target_activation}, val_target {run.val_target_activation}"
    return f"run {run.name}: {run_id} ({reads})"
