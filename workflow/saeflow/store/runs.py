"""Run directories: create one from its training config, open one, read its config.

A run is `<runs_root>/<run_id>/` in the layout of `saeflow.store.layout.RunLayout` (storage-and-run-manifest v1).
`run_id` is the full sha256 of the canonical training config, which names the train/val shard hashes, so a run
directory is content-addressed like a shard directory: same config and data, same run id.
"""

import json
import os
import pathlib
import re

from saeflow.errors import SaeflowError
from saeflow.store import atomic, layout
from saeflow.store.hashing import content_hash, read_json_object


def run_id(train_config: dict) -> str:
    """The content address of a run: sha256 of its canonical training config (which includes shard hashes)."""
    return content_hash(train_config)


class Run(layout.RunLayout):
    """A run directory: its layout plus what reading it involves."""

    def config(self) -> dict:
        if not os.path.lexists(self.config_fpath):
            raise SaeflowError(f"{self.config_fpath}: missing; is {self.root} a run directory?")
        return read_json_object(self.config_fpath, "training config object")

    def tokens(self) -> str:
        """The positions of each example the SAE trained on (`tokens` in checkpoint/config.json, `auto` resolved when
        planned): what inference, evaluation and probing count as its data. A run around an imported checkpoint
        records none: `content` (every patch or token but CLS)."""
        return self.config().get("tokens", "content")

    def require_checkpoint(self) -> pathlib.Path:
        if not self.sae_fpath.exists():
            raise SaeflowError(
                f"{self.sae_fpath}: no checkpoint; train this run first (saeflow train --run {self.root})"
            )
        return self.sae_fpath


def open_run(path: str | os.PathLike) -> Run:
    run = Run(pathlib.Path(path))
    if not run.root.is_dir():
        raise SaeflowError(f"run directory {run.root} does not exist")
    return run


def _symlink(target: str | os.PathLike | None, link_fpath: pathlib.Path) -> None:
    if target is None:
        return
    target = pathlib.Path(target).resolve()
    if link_fpath.is_symlink():
        current = pathlib.Path(os.readlink(link_fpath))
        if current == target:
            return
        if not _same_shard_hash(current, target):
            raise SaeflowError(f"{link_fpath} points to {current}, not {target}; refusing to relink")
        # The same content-addressed shard directory under a moved shards root: repoint the link atomically.
        with atomic.replacing(link_fpath, fsync=False) as tmp_fpath:
            os.symlink(target, tmp_fpath, target_is_directory=True)
        return
    os.symlink(target, link_fpath, target_is_directory=True)


def _same_shard_hash(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Both paths name a shard directory by the same full sha256 (so the same bytes, wherever the root is)."""
    return a.name == b.name and re.fullmatch(layout.HASH_REGEX, a.name) is not None


def create_run(
    runs_root: str | os.PathLike,
    train_config: dict,
    train_shards: str | os.PathLike | None,
    val_shards: str | os.PathLike | None = None,
    train_dataset: str | os.PathLike | None = None,
    val_dataset: str | os.PathLike | None = None,
    target_shards: tuple[str | os.PathLike, str | os.PathLike] | None = None,
    readable: dict | None = None,
    layer_links: dict[str, dict[int, str | os.PathLike]] | None = None,
) -> Run:
    """Create (or find, unchanged) `<runs_root>/<run_id>/` with checkpoint/config.json and links/, and the
    `readable` view of its config (`TrainConfig.readable`) as checkpoint/hyperparameters.json when given and absent.
    A cross-layer transcoder's shard directories are `layer_links` (link name -> {layer: directory}:
    links/<name>.layer<l>), with `train_shards` and `val_shards` None.

    Idempotent: the same training config gives the same run and rewrites nothing. Runs under the run's lock, so
    two workflows creating the same run do not race on its links.
    """
    run = Run(pathlib.Path(runs_root) / run_id(train_config))
    with atomic.exclusive_lock(run.lock_fpath):
        run.checkpoint_dpath.mkdir(parents=True, exist_ok=True)
        run.links_dpath.mkdir(parents=True, exist_ok=True)
        if run.config_fpath.exists():
            if json.loads(run.config_fpath.read_text(encoding="utf-8")) != train_config:
                raise SaeflowError(f"{run.config_fpath} differs from the config whose hash names this run")
        else:
            config_bytes = (json.dumps(train_config, indent=2, sort_keys=True) + "\n").encode()
            atomic.write_file_atomic(run.config_fpath, config_bytes, readonly=True)
        if readable is not None and not run.hyperparameters_fpath.exists():
            readable_bytes = (json.dumps(readable, indent=2, sort_keys=True) + "\n").encode()
            atomic.write_file_atomic(run.hyperparameters_fpath, readable_bytes, readonly=True)
        _symlink(train_shards, run.link(run.TRAIN_SHARDS))
        _symlink(val_shards, run.link(run.VAL_SHARDS))
        _symlink(train_dataset, run.link(run.TRAIN_DATASET))
        _symlink(val_dataset, run.link(run.VAL_DATASET))
        for name, target in zip(run.TARGET_LINK_NAMES, target_shards or ()):  # a transcoder's targets (train, val)
            _symlink(target, run.link(name))
        for name, by_layer in (layer_links or {}).items():
            for layer, dpath in by_layer.items():
                _symlink(dpath, run.layer_link(name, layer))
    return run
