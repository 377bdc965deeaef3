"""Compare two results of the same hash made on different platforms: `saeflow compare A B [--tol]`.

Two shard directories of one metadata hash (or two runs of one run id) computed on different CPUs or GPUs hold
different float bytes (saeflow.numerics) but should agree closely. This reports how closely:
- shard directories: per layer, the largest absolute difference and the largest relative difference of a vector
  (||a - b|| / ||a||, over every stored vector, streamed shard by shard); side files (labels, tokens, classes)
  are integers and must be identical;
- runs: per tensor of sae.pt, the largest absolute difference and the relative difference ||a - b|| / ||a||, and
  each validation metric side by side. Training amplifies rounding (a few percent of weight norm after a few
  hundred steps, docs/contracts.md), so a run's default tolerance is loose.
The comparison passes when every relative difference is within the tolerance.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import RunLayout, ShardLayout
from saeflow.store.shards.metadata import AUX_FILES

RUN_TOL = 0.1  # relative weight-norm difference of two trainings of one config (measured: up to 0.04, docs)
FLOAT32_TOL = 1e-4  # relative vector difference of two float32 extractions (measured: up to 2e-6, docs)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compared item: a layer, a tensor, a side file or a metric."""

    name: str
    max_abs: float | None  # None: not a float comparison (a side file: `same` says it all)
    rel: float | None
    same: bool | None = None  # side files: byte-identical

    def ok(self, tol: float) -> bool:
        if self.same is not None:
            return self.same
        return self.rel is not None and self.rel <= tol


@dataclasses.dataclass(frozen=True)
class Report:
    kind: str  # "shards" or "run"
    tol: float
    rows: tuple[Row, ...]
    metrics: tuple[tuple[str, float, float], ...] = ()  # runs: (name, a, b), shown, never judged

    @property
    def ok(self) -> bool:
        return all(row.ok(self.tol) for row in self.rows)


def default_tol(dtype: str) -> float:
    """Two extractions round to the stored dtype on their own: a few of its steps, never below float32's tolerance."""
    return max(FLOAT32_TOL, 4 * float(np.finfo(np.dtype(dtype)).eps))


SaeTensors = Callable[[pathlib.Path], dict[str, np.ndarray]]


def compare(
    a_path: str | pathlib.Path, b_path: str | pathlib.Path, tol: float | None, sae_tensors: SaeTensors
) -> Report:
    """Compare two shard directories or two runs (the kind is read from what `a_path` holds). `sae_tensors` reads a
    run's sae.pt as named arrays (training.sae.sae_tensors: the format is training's, and the store sits below it)."""
    a_path, b_path = pathlib.Path(a_path), pathlib.Path(b_path)
    if ShardLayout(a_path).metadata_fpath.is_file():
        return _compare_shards(a_path, b_path, tol)
    if RunLayout(a_path).config_fpath.is_file():
        return _compare_runs(a_path, b_path, tol, sae_tensors)
    raise SaeflowError(f"{a_path}: neither a shard directory (metadata.json) nor a run (checkpoint/config.json)")


def _compare_shards(a_dpath: pathlib.Path, b_dpath: pathlib.Path, tol: float | None) -> Report:
    from saeflow.store.shards import ShardDir

    a, b = ShardDir(a_dpath), ShardDir(b_dpath)
    if a.metadata.hash != b.metadata.hash:
        raise SaeflowError(f"{b_dpath}: its metadata (hash {b.metadata.hash[:12]}) is not {a_dpath}'s "
                           f"({a.metadata.hash[:12]}): these are not two results of one config")  # fmt: skip
    tol = default_tol(a.metadata.dtype) if tol is None else tol
    rows = [_compare_layer(a, b, layer) for layer in a.metadata.layers]
    for fname in AUX_FILES:
        if a.has_aux(fname) or b.has_aux(fname):
            same = a.has_aux(fname) and b.has_aux(fname) and _same_file(a.layout.file(fname), b.layout.file(fname))
            rows.append(Row(fname, None, None, same=same))
    return Report("shards", tol, tuple(rows))


def _compare_layer(a, b, layer: int) -> Row:
    max_abs, max_rel = 0.0, 0.0
    for (_, a_ntd), (_, b_ntd) in zip(a.iter_blocks(layer), b.iter_blocks(layer)):
        a_nd = a_ntd.reshape(-1, a_ntd.shape[-1]).astype(np.float32)
        b_nd = b_ntd.reshape(-1, b_ntd.shape[-1]).astype(np.float32)
        max_abs = max(max_abs, float(np.abs(a_nd - b_nd).max(initial=0.0)))
        max_rel = max(max_rel, float(vector_rel(a_nd, b_nd).max(initial=0.0)))
    return Row(f"layer {layer}", max_abs, max_rel)


def vector_rel(a_nd: np.ndarray, b_nd: np.ndarray) -> np.ndarray:
    """||a - b|| / ||a|| of each row (a zero row of `a` counts any difference in full)."""
    norm_n = np.maximum(np.linalg.norm(a_nd, axis=-1), np.finfo(np.float32).tiny)
    return np.linalg.norm(a_nd - b_nd, axis=-1) / norm_n


def _same_file(a_fpath: pathlib.Path, b_fpath: pathlib.Path) -> bool:
    return a_fpath.stat().st_size == b_fpath.stat().st_size and file_sha256(a_fpath) == file_sha256(b_fpath)


def _compare_runs(a_root: pathlib.Path, b_root: pathlib.Path, tol: float | None, sae_tensors: SaeTensors) -> Report:
    from saeflow.store import runs

    a, b = runs.open_run(a_root), runs.open_run(b_root)
    if a.config() != b.config():
        raise SaeflowError(f"{b.config_fpath}: differs from {a.config_fpath}: these are not two runs of one config")
    for run in (a, b):
        if not run.sae_fpath.is_file():
            raise SaeflowError(f"{run.sae_fpath}: missing; the run is not trained")
    a_tensors, b_tensors = sae_tensors(a.sae_fpath), sae_tensors(b.sae_fpath)
    rows = [compare_tensor(name, a_tensors[name], b_tensors[name]) for name in a_tensors]
    return Report("run", RUN_TOL if tol is None else tol, tuple(rows), _metrics(a, b))


def compare_tensor(name: str, a_arr: np.ndarray, b_arr: np.ndarray) -> Row:
    diff = a_arr - b_arr
    norm, diff_norm = float(np.linalg.norm(a_arr)), float(np.linalg.norm(diff))
    rel = diff_norm / norm if norm else (0.0 if diff_norm == 0 else float("inf"))
    return Row(name, float(np.abs(diff).max(initial=0.0)), rel)


def _metrics(a, b) -> tuple[tuple[str, float, float], ...]:
    try:
        a_m = json.loads(a.final_metrics_fpath.read_text())
        b_m = json.loads(b.final_metrics_fpath.read_text())
    except (OSError, ValueError):
        return ()
    return tuple((k, a_m[k], b_m[k]) for k in sorted(a_m)
                 if isinstance(a_m[k], (int, float)) and isinstance(b_m.get(k), (int, float)))  # fmt: skip


def format_report(report: Report, a_path, b_path) -> str:
    lines = [f"{report.kind}: {a_path} vs {b_path} (tolerance {report.tol:g} relative)"]
    for row in report.rows:
        if row.same is not None:
            lines.append(f"  {row.name:24s} {'identical' if row.same else 'DIFFERENT (integer side file)'}")
        else:
            verdict = "ok" if row.ok(report.tol) else "ABOVE TOLERANCE"
            lines.append(f"  {row.name:24s} max abs {row.max_abs:.3g}  relative {row.rel:.3g}  {verdict}")
    for name, a_val, b_val in report.metrics:
        lines.append(f"  metric {name:17s} {a_val:.6g} vs {b_val:.6g}")
    lines.append("within tolerance" if report.ok else "NOT within tolerance")
    return "\n".join(lines)
