"""`saeflow migrate`: bring a tree published by an earlier layout to this one, recomputing nothing.

Layout 2 (store.layout.LAYOUT_VERSION; issue 40) gives an activation spec a shard directory per layer, where layout 1
gave the spec one directory holding every layer. A run names its shard directories, so its id moved with them. For
each activation of the config that has several layers, this module

- cuts every layer of the published layout-1 directory (the spec's own metadata hash, which layout 1 named it by)
  into that layer's directory: the same vectors and side files, re-cut into the per-layer shard size, published
  atomically and verified like any extraction (`ShardWriter`), no model run;
- moves every run planned on those layers from its layout-1 id to its layout-2 id: files are hard-linked, the text
  files that name an old hash or id (config.json, dump and evaluation files, visuals) are rewritten with the new
  ones and keep their time stamps, `links/` point at the new directories; sae.pt, metrics and dumps' arrays are
  the same files;
- writes the summary again from the moved runs (`report.write_summary`, what the summary rule runs: no run is
  computed again); a seed group's stability, named by its members' ids, is the workflow's to compute again.

Nothing published is changed or removed: the layout-1 directories and runs stay (readable and trainable by this
saeflow, as `shards:` activations) until the user removes them; the last lines say which. A rerun migrates nothing
twice: what exists at its new name is kept.

    plan = planning.WorkflowPlan.from_config(cfg)
    for line in migrate(plan):  # one line per directory and run migrated, then what was kept
        print(line)
"""

import dataclasses
import os
import pathlib
import shutil
import typing

import numpy as np

from saeflow.analysis import report, stability
from saeflow.errors import SaeflowError
from saeflow.extraction.specs import ActivationSpec
from saeflow.planning import WorkflowPlan
from saeflow.store import layout, runs, shards
from saeflow.store.atomic import remove_staging
from saeflow.training import archs, specs

TEXT_SUFFIXES = (".json", ".jsonl", ".js", ".html", ".csv", ".txt", ".css", ".md")  # files that may name a hash
HASH_KEYS = ("train_shards", "val_shards", "target", "val_target")  # the keys of a run config naming directories
BLOCK_BYTES = 16 * 2**20  # copied at a time: small enough that reading the next overlaps the writer's hash and write


def legacy_shard_hashes(plan: WorkflowPlan) -> dict[str, str]:
    """Layout-1 hash -> activation name, for every activation of several layers (layout 1's directory of the whole
    spec is its metadata's hash, every layer)."""
    return {plan.activation_metadata[name].hash: name for name, spec in plan.cfg.activations.items()
            if isinstance(spec, ActivationSpec) and len(spec.layers) > 1}  # fmt: skip


def migrate(plan: WorkflowPlan, dry_run: bool = False) -> typing.Iterator[str]:
    """Migrate the tree of `plan`'s roots to layout 2 (module docstring); yield one line per thing done."""
    legacy = legacy_shard_hashes(plan)
    shard_layers = {old_hash: plan.layer_hash[name] for old_hash, name in legacy.items()}
    for old_hash, name in legacy.items():
        old = plan.shard(old_hash)
        if not old.shards_fpath.exists():
            continue
        for layer, new_hash in plan.layer_hash[name].items():
            if plan.shard(new_hash).shards_fpath.exists():
                continue
            if not dry_run:
                cut_layer(shards.ShardDir(old.dpath), layer, plan.metadata[new_hash], plan.cfg.shards_root)
            yield f"shards {old_hash[:12]} layer {layer} -> {plan.shard(new_hash).dpath} (activation {name})"
    moved, unplanned = [], []  # unplanned: runs moved under an earlier trainer's id, which the config does not plan
    for new_id, run_plan in plan.runs.items():
        for cfg in trainer_versions(run_plan.train_config):
            old_config = legacy_run_config(cfg, shard_layers)
            if old_config is None:
                break
            old_id, cfg_id = runs.run_id(old_config), runs.run_id(cfg.to_dict())
            old_run, new_run = plan.run(old_id), plan.run(cfg_id)
            if not old_run.config_fpath.exists() or new_run.root.exists():
                continue
            renames = {old_id: cfg_id, **{old_config[key]: value for key, value in cfg.to_dict().items()
                                          if key in HASH_KEYS and value is not None}}  # fmt: skip
            if not dry_run:
                move_run(old_run.root, new_run.root, renames)
            moved.append(old_run.root)
            yield f"run {old_id[:12]} -> {new_run.root} ({run_plan.name})"
            if cfg_id != new_id:
                unplanned.append(run_plan.name)
                yield (f"  made by {cfg.trainer}, which {cfg.arch}'s training has moved on from "
                       f"({run_plan.train_config.trainer}): the config trains it again under {new_id[:12]} unless "
                       f"saes.{run_plan.sae_name} pins `trainer: {cfg.trainer}`")  # fmt: skip
            break
    if moved and not dry_run and plan.cfg.summary_dir.is_dir():
        if unplanned:
            yield f"summary not written: the workflow writes it once it has trained {', '.join(unplanned)}"
        else:
            yield f"summary {write_summary(plan)[0]} (from the runs as they are now: nothing computed again)"
    for old_hash in legacy:
        if plan.shard(old_hash).dpath.exists():
            yield (f"kept layout-1 shards {plan.shard(old_hash).dpath}: remove it once nothing else reads it "
                   f"(chmod -R u+w DIR && rm -rf DIR)")  # fmt: skip
    for root in moved:
        yield f"kept layout-1 run {root}: remove it once the migrated one is checked"


def write_summary(plan: WorkflowPlan) -> tuple[pathlib.Path, pathlib.Path]:
    """The summary of `plan`'s runs, as the summary rule writes it (the stability results that exist)."""
    train_configs = {run_id: p.train_config.to_dict() for run_id, p in plan.runs.items()}
    stability_fpaths = [stability.result_fpath(plan.cfg.summary_dir, group)
                        for group in stability.seed_groups(train_configs)]  # fmt: skip
    return report.write_summary(
        [plan.run(run_id).root for run_id in sorted(plan.runs)],
        plan.cfg.summary_dir,
        {run_id: p.name for run_id, p in plan.runs.items()},
        tuple(f for f in stability_fpaths if f.exists()),
        {run_id: p.group_name for run_id, p in plan.runs.items()},
    )


def trainer_versions(cfg: specs.TrainConfig) -> list[specs.TrainConfig]:
    """The run `cfg` plans, then the same run at each other trainer version its architecture still trains: a layout-1
    run made before a trainer bump is still that run, under its own trainer's id."""
    arch = archs.get(cfg.arch)
    others = [t for t in (arch.trainer, *arch.earlier_trainers) if t != cfg.trainer]
    return [cfg, *(dataclasses.replace(cfg, trainer=t) for t in others)]


def legacy_run_config(cfg: specs.TrainConfig, shard_layers: dict[str, dict[int, str]]) -> dict | None:
    """The config.json layout 1 gave the run `cfg` plans (its directories' hashes those of the whole specs), or None
    when the run reads no directory of a migrated spec."""
    new_to_old = {layers[cfg.layer]: old for old, layers in shard_layers.items() if cfg.layer in layers}
    obj = cfg.to_dict()
    if not any(obj.get(key) in new_to_old for key in HASH_KEYS):
        return None
    return {key: new_to_old.get(value, value) if key in HASH_KEYS else value for key, value in obj.items()}


def cut_layer(old: shards.ShardDir, layer: int, new_md: shards.Metadata, shards_root: pathlib.Path) -> pathlib.Path:
    """Publish `layer` of a layout-1 directory as its own directory `new_md` (its vectors and side files, re-cut
    into `new_md`'s shard size), refusing metadata that is not the old one's with that layer alone."""
    expected = dataclasses.replace(old.metadata, layers=(layer,))
    if expected != new_md:
        raise SaeflowError(f"{old.dpath}: layer {layer} of it is not directory {new_md.hash} (the metadata differs)")
    aux = [fname for fname in shards.AUX_FILES if old.has_aux(fname)]
    provenance = {"migrated_from": {"shards": old.hash, "layer": layer, "layout": layout.LAYOUT_VERSION - 1}}
    with shards.ShardWriter(shards_root, new_md, aux=aux, provenance_extra=provenance) as writer:
        if not writer.reused:
            ex_bytes = new_md.tokens_per_ex * new_md.d_model * np.dtype(new_md.dtype).itemsize
            for start, acts_ntd in old.iter_blocks(layer, max(1, BLOCK_BYTES // ex_bytes)):
                if start < writer.n_written:
                    continue  # resumed: those shards are complete
                stop = start + acts_ntd.shape[0]
                writer.write(acts_ntd[:, None], aux={fname: np.array(old.aux(fname)[start:stop]) for fname in aux})
    return writer.dpath


def move_run(old_root: pathlib.Path, new_root: pathlib.Path, renames: dict[str, str]) -> pathlib.Path:
    """Lay `old_root` out again at `new_root` (staged beside it, one rename): every name and text that holds an old
    hash or id holds the new one, other files are hard links (a copy across file systems), time stamps kept."""
    staging = layout.staging_dpath(new_root, "migrating")
    remove_staging(staging)
    try:
        for dirpath, dirnames, fnames in os.walk(old_root):  # a link to a directory is among dirnames, not walked
            rel = pathlib.Path(dirpath).relative_to(old_root)
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in links]  # staging, locks
            target_dpath = staging / _renamed(str(rel), renames)
            target_dpath.mkdir(parents=True, exist_ok=True)
            for fname in [*fnames, *links]:
                if fname.startswith("."):
                    continue
                source = pathlib.Path(dirpath) / fname
                target = target_dpath / _renamed(fname, renames)
                if source.is_symlink():
                    os.symlink(_renamed(os.readlink(source), renames), target)
                else:
                    _copy_renamed(source, target, renames)
        os.rename(staging, new_root)
    except BaseException:
        remove_staging(staging)
        raise
    return new_root


def _renamed(text: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        text = text.replace(old, new)
    return text


def _copy_renamed(source: pathlib.Path, target: pathlib.Path, renames: dict[str, str]) -> None:
    stat = source.stat()
    text = source.read_text(encoding="utf-8") if source.suffix in TEXT_SUFFIXES else None
    if text is not None and _renamed(text, renames) != text:
        target.write_text(_renamed(text, renames), encoding="utf-8")
    else:
        try:
            os.link(source, target)
            return
        except OSError:
            shutil.copy2(source, target)
    os.chmod(target, stat.st_mode & 0o777)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
