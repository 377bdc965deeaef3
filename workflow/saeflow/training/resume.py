"""Resume checkpoints at any world size: `checkpoint/resume.pt` (whole tensors, one process or rank 0 of a data-parallel
run) or, for a latent-sharded run, one file per rank and a manifest (`checkpoint/resume-shards/`). Every reader here
takes either form, at any world size, one process included; both the one-process loop (train.Checkpoint) and the
ranks (saeflow.training.ranks.parallel) read and drop them through this module.

A rank file holds Trainer.state_dict's layout cut to latents [lo, hi): every per-latent parameter along its latent
axis (the architecture's `Arch.latent_axes`: W_enc's columns, b_enc, W_dec's rows and its own per-latent vectors),
their Adam moments and the dead-latent counters; everything else whole.
"""

import json
import pathlib
import shutil

import torch

from saeflow.errors import SaeflowError
from saeflow.store import atomic
from saeflow.training.objectives import STATE_KEYS
from saeflow.training.sae import save_atomic

LEGACY_POOL = "legacy"  # resume_info's pool of a resume.pt written before the pool was recorded (loaders' old 1 GiB)

def _latent_slices(state: dict, lo: int, hi: int, axes: dict) -> dict:
    """The part of a training state (Trainer.state_dict) that latents [lo, hi) of it need; `axes`: each parameter's
    latent axis in the SAE's order (`Arch.latent_axes`: the Adam state's indices), None for one held whole."""
    dims = list(axes.values())
    sae = {name: t.narrow(axes[name], lo, hi - lo) if axes.get(name) is not None else t
           for name, t in state["sae"].items()}  # fmt: skip
    opt_state = {}
    for idx, moments in state["opt"]["state"].items():
        dim = dims[int(idx)]
        opt_state[idx] = {key: t.narrow(dim, lo, hi - lo) if dim is not None and t.dim() else t
                          for key, t in moments.items()}  # fmt: skip
    counters = {name: state[name][lo:hi] for name in STATE_KEYS if name in state}  # DeadLatents.state's
    return {**state, "sae": sae, "opt": {**state["opt"], "state": opt_state}, **counters}


def _joined(parts: list[dict], axes: dict) -> dict:
    """Consecutive latent ranges' states as one (the inverse of `_latent_slices`)."""
    if len(parts) == 1:
        return parts[0]
    first, dims = parts[0], list(axes.values())
    sae = {name: torch.cat([p["sae"][name] for p in parts], axes[name]) if axes.get(name) is not None else t
           for name, t in first["sae"].items()}  # fmt: skip
    opt_state = {}
    for idx, moments in first["opt"]["state"].items():
        dim = dims[int(idx)]
        opt_state[idx] = {key: torch.cat([p["opt"]["state"][idx][key] for p in parts], dim)
                          if dim is not None and t.dim() else t for key, t in moments.items()}  # fmt: skip
    counters = {name: torch.cat([p[name] for p in parts]) for name in STATE_KEYS if name in first}
    return {**first, "sae": sae, "opt": {**first["opt"], "state": opt_state}, **counters}


def _manifest(run) -> dict | None:
    fpath = run.resume_manifest_fpath
    try:
        return json.loads(fpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise SaeflowError(f"{fpath}: unreadable resume manifest ({err}); delete {fpath.parent} to restart") from None


def _load(fpath, device=None) -> dict:
    try:
        return torch.load(fpath, map_location=device, weights_only=True, mmap=device is None)
    except Exception as err:  # noqa: BLE001 -- torch raises many types for a damaged file
        raise SaeflowError(f"{fpath}: unreadable resume checkpoint ({err}); delete it to restart this run") from None


def resume_info(run) -> tuple[int, int | None] | None:
    """(step, pool rows) of the run's newest resume checkpoint, whichever form it has; None when there is none. A
    resume.pt from before pools were recorded was trained with the old fixed pool: the old fixed 1 GiB (LEGACY_POOL)."""
    found = []
    if (manifest := _manifest(run)) is not None:
        found.append((manifest["step"], manifest.get("pool_rows")))
    if run.resume_fpath.exists():
        state = _load(run.resume_fpath)  # memory-mapped: the tensors are not read
        found.append((int(state["step"]), state.get("pool_rows", LEGACY_POOL)))
    return max(found, key=lambda item: item[0]) if found else None


def read_resume(run, device, axes: dict, latents: tuple[int, int] | None = None) -> dict | None:
    """The newest resume state of `run` (resume.pt, or the ranks' files of a sharded checkpoint), cut to
    `latents` (lo, hi) when given; None when there is none. Any world size reads any checkpoint. `axes`: the
    architecture's `Arch.latent_axes` (which parameters are cut along the latents, and how)."""
    manifest = _manifest(run)
    whole = _load(run.resume_fpath) if run.resume_fpath.exists() else None
    if whole is not None and (manifest is None or int(whole["step"]) >= manifest["step"]):
        state = whole if latents is None else _latent_slices(whole, *latents, axes)
    elif manifest is not None:
        lo, hi = latents or (0, manifest["d_sae"])
        parts = []
        for shard in manifest["shards"]:
            if shard["hi"] > lo and shard["lo"] < hi:
                if pathlib.PurePath(shard["fname"]).name != shard["fname"]:
                    raise SaeflowError(f"{run.resume_manifest_fpath}: names {shard['fname']!r}, not a file beside it")
                part = _load(run.resume_shards_dpath / shard["fname"])
                a, b = max(lo, shard["lo"]) - shard["lo"], min(hi, shard["hi"]) - shard["lo"]
                parts.append(_latent_slices(part, a, b, axes))
        state = _joined(parts, axes)
    else:
        return None
    return _to_device(state, device)


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)  # off the memory map
    if isinstance(obj, dict):
        return {key: _to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_to_device(value, device) for value in obj]
    return obj


def write_resume(trainer) -> None:
    """A latent-sharded checkpoint of `trainer` (a sharded.ShardedTrainer, on every rank): every rank writes its
    latents' state, then rank 0 the manifest (the commit point: a checkpoint is whole or absent) and removes what it
    replaced (older rank files, a resume.pt)."""
    run, comm = trainer.run, trainer.comm
    dpath = run.resume_shards_dpath
    dpath.mkdir(parents=True, exist_ok=True)
    fpath = run.resume_shard_fpath(trainer.step, trainer.sae.lo, trainer.sae.hi)
    save_atomic(trainer.state_dict(), fpath)
    shards = comm.gather_objects({"fname": fpath.name, "lo": trainer.sae.lo, "hi": trainer.sae.hi})
    if comm.is_root:
        manifest = {"step": trainer.step, "d_sae": trainer.sae.cfg.d_sae, "pool_rows": trainer.pool_rows,
                    "shards": shards}  # fmt: skip
        atomic.write_file_atomic(run.resume_manifest_fpath, (json.dumps(manifest, indent=1) + "\n").encode())
        run.resume_fpath.unlink(missing_ok=True)
        keep = {run.resume_manifest_fpath.name, *(s["fname"] for s in shards)}
        for fpath in dpath.iterdir():
            if fpath.name not in keep:
                fpath.unlink()
    comm.barrier()  # no rank writes its next file before the stale ones are gone


def remove_resume_shards(run) -> None:
    """Drop a sharded checkpoint (a newer resume.pt replaced it, or the run is published)."""
    shutil.rmtree(run.resume_shards_dpath, ignore_errors=True)
