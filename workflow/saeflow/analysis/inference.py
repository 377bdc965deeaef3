"""Inference dumps: run a trained SAE over one shard directory, streaming, into RUN/inference/<shard_hash>/.

    config.json        what was run on what (run, checkpoint sha256, shard dir and hash, layer, top_k)
    patch_acts.npz     scipy CSR (n_ex * tokens_per_ex, d_sae) float32: `scipy.sparse.load_npz` reads it.
                       Row r is example r // tokens_per_ex, token r % tokens_per_ex (example-major, token-minor,
                       the protocol's token axis: CLS first when the shards have one).
    latents.npz        per latent, over the rows of the tokens the SAE trained on: n_fires, freq (fraction of those
                       rows where it fires), mean_act (mean value when firing, 0 when it never fires), max_act; its
                       top-k *examples*, best first, each at its strongest token: topk_values (d_sae, k) float32,
                       topk_example (d_sae, k) int64, topk_token (d_sae, k) int64 (-1 / 0.0 pad latents that fired in
                       fewer than k examples); l0_hist[n] = those rows with n active latents
    metrics.json       NMSE, L0 (the mean over rows; its spread: l0_std, l0_p10, l0_p50, l0_p90), explained variance,
                       dead/dense counts (training.metrics definitions) on the tokens the SAE trained on (`tokens`,
                       the run's config: the headline), and the same over every stored token under `all_tokens`; a
                       transcoder's NMSE is of its target (the shards' pair, `target_shards`)
    provenance.json    versions, host, times (not part of the result)

The directory is built in a hidden staging sibling and renamed into place once complete (saeflow.store.atomic), under
the run's lock (`RunLayout.lock_fpath`); a full disk removes the staging directory and says so in one line. An
existing complete directory with the same result-defining settings is reused. Memory is bounded by the batch size
and top_k (the CSR is streamed to disk), not by the number of rows.
"""

import dataclasses
import json
import logging
import os
import pathlib

import numpy as np
import torch
import tqdm

from saeflow import config
from saeflow.analysis.csr import CsrWriter
from saeflow.devices import resolve_device
from saeflow.errors import SaeflowError, unreadable
from saeflow.extraction import hooks
from saeflow.store import atomic, layout, provenance, runs
from saeflow.store.hashing import file_sha256, read_json_object
from saeflow.store.shards import ShardDir
from saeflow.training import loaders, metrics, sae

logger = logging.getLogger(__name__)

# config.json keys that change the result; an existing dump must agree on them to be reused.
RESULT_KEYS = ("shard_hash", "layer", "sae_sha256", "top_k", "tokens", "top_k_of", "target_hash")
TOP_K_OF = "examples"  # what inference.top_k counts: distinct examples per latent (an older dump counted rows)
DEFAULTS = config.section_defaults("inference")


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """One inference dump: which run, on which shards, how."""

    run: pathlib.Path
    shards: pathlib.Path
    top_k: int = DEFAULTS["top_k"]
    batch_size: int = DEFAULTS["batch_size"]
    dense_freq: float = DEFAULTS["dense_freq"]  # a latent firing on more than this fraction of rows is dense
    device: str = DEFAULTS["device"]  # "auto": cuda when visible; does not change the result beyond float rounding
    replace_stale: bool = False  # replace a dump of another sae.pt or other RESULT_KEYS instead of refusing it

    def __post_init__(self):
        if self.top_k < 1:
            raise SaeflowError(f"top_k must be at least 1, got {self.top_k}")
        if self.batch_size < 1:
            raise SaeflowError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0 < self.dense_freq <= 1:
            raise SaeflowError(f"dense_freq must be in (0, 1], got {self.dense_freq}")


class TopK:
    """Per latent, the k examples where it fires most, merged batch by batch: each example at its largest value (its
    earliest row among equal values), the examples by that value, ties to the earlier row. Rows are numbered
    example-major (row = example * tokens_per_ex + token), so a latent page can show k different images or documents.

    Only entries above a latent's current k-th value are candidates, so after the first batches a merge sorts a
    few thousand entries, not the batch. Memory is O(d_sae * k).
    """

    def __init__(self, d_sae: int, k: int, tokens_per_ex: int):
        self.k, self.tokens_per_ex = k, tokens_per_ex
        self.values_sk = np.zeros((d_sae, k), dtype=np.float32)
        self.rows_sk = np.full((d_sae, k), -1, dtype=np.int64)
        self._latent_sk = np.repeat(np.arange(d_sae), k).reshape(d_sae, k)

    def update(self, rows_n: np.ndarray, cols_n: np.ndarray, vals_n: np.ndarray, first_row: int) -> None:
        """Merge a batch given by its non-zero entries (batch row, latent, value)."""
        cand_n = vals_n > self.values_sk[cols_n, -1]
        if not cand_n.any():
            return
        touched_s = np.zeros(len(self.values_sk), dtype=bool)  # only latents with a candidate can change
        touched_s[cols_n[cand_n]] = True
        held_sk = (self.rows_sk >= 0) & touched_s[:, None]
        cols_m = np.concatenate([self._latent_sk[held_sk], cols_n[cand_n]])
        vals_m = np.concatenate([self.values_sk[held_sk], vals_n[cand_n]])
        rows_m = np.concatenate([self.rows_sk[held_sk], rows_n[cand_n] + first_row])
        # One entry per (latent, example): its largest value, the earliest row among equals. (latent, example) as one
        # int64 key: a lexsort of three keys, not four.
        pair_m = cols_m * (rows_m.max() // self.tokens_per_ex + 1) + rows_m // self.tokens_per_ex
        order = np.lexsort((rows_m, -vals_m, pair_m))
        cols_m, vals_m, rows_m, pair_m = cols_m[order], vals_m[order], rows_m[order], pair_m[order]
        first_m = np.ones(cols_m.size, dtype=bool)
        first_m[1:] = pair_m[1:] != pair_m[:-1]
        cols_m, vals_m, rows_m = cols_m[first_m], vals_m[first_m], rows_m[first_m]
        order = np.lexsort((rows_m, -vals_m, cols_m))  # by latent, then value descending, then row
        cols_m, vals_m, rows_m = cols_m[order], vals_m[order], rows_m[order]
        rank_m = np.arange(cols_m.size) - np.searchsorted(cols_m, cols_m, side="left")
        keep = rank_m < self.k
        touched = np.unique(cols_m)  # every latent holding an entry: rewritten whole (it may hold fewer than k)
        self.values_sk[touched], self.rows_sk[touched] = 0.0, -1
        self.values_sk[cols_m[keep], rank_m[keep]] = vals_m[keep]
        self.rows_sk[cols_m[keep], rank_m[keep]] = rows_m[keep]


def trained_layer(run: runs.Run) -> int:
    """The layer (value, not index) the run's SAE was trained on, from checkpoint/config.json."""
    train_config = run.config()
    layer = train_config.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise SaeflowError(f"{run.config_fpath}: no integer 'layer' key saying which layer the SAE was trained on")
    return layer


def open_inputs(run_dpath: pathlib.Path, shards_dpath: pathlib.Path) -> tuple[runs.Run, sae.SAE, ShardDir, int]:
    """Resolve and cross-check the run, its checkpoint and the shards; errors say which file disagrees."""
    run = runs.open_run(run_dpath)
    sae_fpath = run.require_checkpoint()
    layer = trained_layer(run)
    model = sae.load_sae(sae_fpath)
    sd = ShardDir(shards_dpath)
    md = sd.metadata
    if layer not in md.layers:
        raise SaeflowError(
            f"{run.config_fpath}: the SAE was trained on layer {layer}, but {sd.dpath}/metadata.json "
            f"stores layers {list(md.layers)}"
        )
    if md.d_model != model.d_model:
        raise SaeflowError(
            f"{sae_fpath}: the SAE takes d_model={model.d_model}, but {sd.dpath}/metadata.json has "
            f"d_model={md.d_model}"
        )
    return run, model, sd, layer


def target_of(run: runs.Run, sd: ShardDir) -> ShardDir | None:
    """A transcoder's target directory paired with shards `sd` (its train or validation shards, by the run's links);
    None for an SAE. One line when the run pairs no target with them."""
    cfg = run.config()
    if cfg.get("target") is None:
        return None
    # an imported transcoder's config names its shards `shards` (interop/checkpoints/sae_checkpoints.import_checkpoint)
    for shards_key, link in (("val_shards", run.VAL_TARGET_SHARDS), ("train_shards", run.TARGET_SHARDS),
                             ("shards", run.TARGET_SHARDS)):  # fmt: skip
        if cfg.get(shards_key) == sd.hash:
            target = ShardDir(run.link(link).resolve())
            if target.hash != cfg["val_target" if shards_key == "val_shards" else "target"]:
                raise SaeflowError(f"{run.link(link)}: does not point to the target shards of {run.config_fpath}")
            return target
    raise SaeflowError(f"{sd.dpath}: the transcoder {run.root} predicts its targets of its train and validation shards "
                       "only; no target is paired with these")  # fmt: skip


def run_inference(cfg: InferenceConfig) -> pathlib.Path:
    """Write (or reuse) RUN/inference/<shard_hash>/ and return its path."""
    run, model, sd, layer = open_inputs(cfg.run, cfg.shards)
    target = target_of(run, sd)
    dump_config = {
        "run": str(run.root.resolve()),
        "sae_sha256": file_sha256(run.sae_fpath),
        "shards": str(sd.dpath.resolve()),
        "shard_hash": sd.hash,
        "layer": layer,
        "top_k": cfg.top_k,
        "top_k_of": TOP_K_OF,
        "tokens": run.tokens(),
        "batch_size": cfg.batch_size,
        "dense_freq": cfg.dense_freq,
        "d_model": model.d_model,
        "d_sae": model.d_sae,
        "n_ex": sd.n_ex,
        "tokens_per_ex": sd.metadata.tokens_per_ex,
        "row_order": "row = example * tokens_per_ex + token",
        **({} if target is None else {"target_shards": str(target.dpath.resolve()), "target_hash": target.hash,
                                      "target_hook": hooks.stored(target.metadata.data),
                                      "d_out": model.d_out}),  # fmt: skip
    }
    final = run.dump(sd.hash)
    with atomic.no_space_as_error(final.dpath), atomic.exclusive_lock(run.dump_lock_fpath(sd.hash)):
        stale = None
        if final.dpath.exists():
            try:
                check_reusable(final, dump_config)
            except SaeflowError:
                if not cfg.replace_stale:
                    raise
                stale = _set_aside(final.dpath)
            else:
                logger.info("reusing %s", final.dpath)
                return final.dpath
        try:
            # Built under the dump's lock, published under the run's (as training publishes sae.pt).
            with atomic.building_dir(final.dpath, publish_lock=run.lock_fpath) as staging_dpath:
                staging = layout.DumpLayout(staging_dpath)
                started_at = provenance.utc_now()
                atomic.write_json(staging.config_fpath, dump_config)
                _dump(model, sd, layer, dump_config["tokens"], cfg, staging, target)
                atomic.write_json(
                    staging.provenance_fpath,
                    {**provenance.collect(), "started_at": started_at, "finished_at": provenance.utc_now()},
                )
        except BaseException:
            if stale is not None and not final.dpath.exists():
                stale.rename(final.dpath)  # the old dump back: never left with none
            raise
        if stale is not None:
            atomic.remove_staging(stale)
    return final.dpath


def _set_aside(dump_dpath: pathlib.Path) -> pathlib.Path:
    """Move a stale published dump to a hidden sibling (one rename), to be removed once its successor is out."""
    old = atomic.staging_dpath(dump_dpath, "old")
    atomic.remove_staging(old)
    dump_dpath.rename(old)
    logger.info("replacing %s: made from another checkpoint or with other settings", dump_dpath)
    return old


def check_reusable(dump: layout.DumpLayout, dump_config: dict) -> None:
    dpath = dump.dpath
    try:
        existing = json.loads(dump.config_fpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SaeflowError(f"{dump.config_fpath}: unreadable ({err}); remove {dpath} to redo it") from None
    differ = [k for k in RESULT_KEYS if existing.get(k) != dump_config.get(k)]
    if differ:
        raise SaeflowError(
            f"{dpath} already exists but was made with different {', '.join(differ)} "
            f"({', '.join(f'{k}={existing.get(k)!r}' for k in differ)}); published dumps are never rewritten: "
            f"remove it (chmod -R u+w; rm -r) to redo it with the new settings"
        )


class LatentStats:
    """Per-latent statistics, top-k examples and metrics of the rows the SAE trained on (`tokens`), and the metrics of
    every stored row, accumulated batch by batch (rows in dump order)."""

    def __init__(self, sd: ShardDir, tokens: str, d_model: int, d_sae: int, cfg: InferenceConfig):
        self.selection = loaders.TokenSelection(sd, tokens)
        self.topk = TopK(d_sae, cfg.top_k, sd.metadata.tokens_per_ex)
        self.sum_act_s = np.zeros(d_sae)
        self.max_act_s = np.zeros(d_sae, dtype=np.float32)
        self.l0_hist = np.zeros(d_sae + 1, dtype=np.int64)
        self.trained = metrics.MetricsAccumulator(d_model, d_sae, dense_freq=cfg.dense_freq)
        self.all_rows = metrics.MetricsAccumulator(d_model, d_sae, dense_freq=cfg.dense_freq)
        self.first_row = 0

    def update(self, x_bd, x_hat_bd, rows_n, cols_n, vals_n) -> None:
        """One batch: its vectors and reconstructions, and the codes' non-zero entries (row-major)."""
        n_rows, d_sae = x_bd.shape[0], len(self.sum_act_s)
        x64_bd = x_bd.to("cpu", torch.float64)
        err_b = (x64_bd - x_hat_bd.to("cpu", torch.float64)).square().sum(-1)
        sq_b = x64_bd.square().sum(-1)
        self.all_rows.update_rows(x64_bd, err_b, sq_b, torch.from_numpy(np.bincount(cols_n, minlength=d_sae)))
        keep_b = self.selection.keeps(np.arange(self.first_row, self.first_row + n_rows))
        if not keep_b.all():
            kept_n = keep_b[rows_n]
            rows_n, cols_n, vals_n = rows_n[kept_n], cols_n[kept_n], vals_n[kept_n]
            keep_t = torch.from_numpy(keep_b)
            x64_bd, err_b, sq_b = x64_bd[keep_t], err_b[keep_t], sq_b[keep_t]
        self.topk.update(rows_n, cols_n, vals_n, self.first_row)
        fires_s = np.bincount(cols_n, minlength=d_sae)
        self.sum_act_s += np.bincount(cols_n, weights=vals_n, minlength=d_sae)
        np.maximum.at(self.max_act_s, cols_n, vals_n)
        self.l0_hist += np.bincount(np.bincount(rows_n, minlength=n_rows)[keep_b], minlength=len(self.l0_hist))
        self.trained.update_rows(x64_bd, err_b, sq_b, torch.from_numpy(fires_s))
        self.first_row += n_rows

    def latents(self) -> dict[str, np.ndarray]:
        """latents.npz's arrays."""
        T, rows_sk = self.selection.md.tokens_per_ex, self.topk.rows_sk
        n_fires = self.trained.fires_s.numpy()
        return {
            "n_fires": n_fires,
            "freq": n_fires / max(self.trained.n_vectors, 1),
            "mean_act": np.divide(self.sum_act_s, n_fires, out=np.zeros(len(n_fires)), where=n_fires > 0),
            "max_act": self.max_act_s,
            "topk_values": self.topk.values_sk,
            "topk_example": np.where(rows_sk >= 0, rows_sk // T, -1),
            "topk_token": np.where(rows_sk >= 0, rows_sk % T, 0),
            "l0_hist": self.l0_hist,
        }

    def metrics(self) -> dict:
        """metrics.json: the trained tokens' metrics (named by `tokens`) with their L0's spread over the rows
        (`l0_spread`), every stored token's under all_tokens."""
        return {"tokens": self.selection.tokens, **self.trained.result(), **l0_spread(self.l0_hist),
                "all_tokens": {"tokens": "all", **self.all_rows.result()}}  # fmt: skip


def l0_spread(l0_hist: np.ndarray) -> dict:
    """How L0 varies over the rows (`l0` is its mean): its standard deviation and its 10th, 50th and 90th percentiles
    (the smallest n with at least that fraction of rows at or below it), from `l0_hist` (rows with n active latents).
    TopK keeps k on every row; a threshold (JumpReLU, BatchTopK at inference) or ReLU keeps what clears it."""
    n = int(l0_hist.sum())
    if n == 0:
        return {"l0_std": None, "l0_p10": None, "l0_p50": None, "l0_p90": None}
    counts_n = np.arange(len(l0_hist), dtype=np.float64)
    mean = float((counts_n * l0_hist).sum() / n)
    cum_n = np.cumsum(l0_hist)
    at = {q: int(np.searchsorted(cum_n, q * n / 100)) for q in (10, 50, 90)}
    return {"l0_std": float(np.sqrt(((counts_n - mean) ** 2 * l0_hist).sum() / n)),
            "l0_p10": at[10], "l0_p50": at[50], "l0_p90": at[90]}  # fmt: skip


@torch.no_grad()
def encode_entries(model: sae.SAE, x_bd: torch.Tensor) -> tuple[torch.Tensor, tuple[np.ndarray, ...]]:
    """(the prediction (b, d), the codes' non-zero entries (rows_n, cols_n, vals_n) in row-major order, columns
    ascending: the CSR order). Codes that are k-sparse (`Arch.k_sparse`) are decoded from their picks (O(b k d), not a
    dense O(b s d)) and never made dense; the others are `forward`'s dense codes, read by `np.nonzero`. Either way
    the entries are the dense codes' non-zeros, bit for bit."""
    if not model.arch.k_sparse:
        x_hat_bd, f_bs = model(x_bd)
        f_np = f_bs.cpu().numpy()
        rows_n, cols_n = np.nonzero(f_np)
        return x_hat_bd, (rows_n, cols_n, f_np[rows_n, cols_n])
    x_hat_bd, vals_bk, idx_bk = sae.forward_picks(model, x_bd)
    idx_bk, order_bk = idx_bk.sort(dim=1)
    vals_bk = vals_bk.gather(1, order_bk)
    on_bk = vals_bk > 0
    rows_bk = torch.arange(idx_bk.shape[0], device=idx_bk.device)[:, None].expand_as(idx_bk)
    entries = (rows_bk[on_bk].cpu().numpy(), idx_bk[on_bk].cpu().numpy(), vals_bk[on_bk].cpu().numpy())
    return x_hat_bd, entries


@torch.no_grad()
def _dump(model: sae.SAE, sd: ShardDir, layer: int, tokens: str, cfg: InferenceConfig, out: layout.DumpLayout,
          target: ShardDir | None = None) -> None:  # fmt: skip
    """One streaming pass over every stored token: CSR rows, per-latent statistics, top-k and metrics (a transcoder's,
    `target` its targets' directory: of its predictions)."""
    n_rows = sd.n_ex * sd.metadata.tokens_per_ex
    csr = CsrWriter(out.acts_fpath, model.d_sae)
    stats = LatentStats(sd, tokens, model.d_out, model.d_sae, cfg)
    device = resolve_device(cfg.device)
    model = model.to(device)
    # pread into reused buffers (training.loaders): a memmap would keep every page read resident, so RSS would grow
    # with the dataset.
    loader = loaders.ordered_loader(sd, target, layer, cfg.batch_size, "all", borrowed=True)  # each batch used at once
    try:
        with tqdm.tqdm(total=n_rows, unit="tok", desc="inference", disable=None) as bar:
            for batch in loader.iter_batches():
                x_bd, y_bd = loaders.pairs.split(loaders.pairs.to_device(batch, device))
                x_hat_bd, (rows_n, cols_n, vals_n) = encode_entries(model, x_bd)
                x_bd = x_bd if y_bd is None else y_bd  # what the metrics compare the output with
                csr.append_nonzero(rows_n, cols_n, vals_n, n_rows=x_bd.shape[0])
                stats.update(x_bd, x_hat_bd, rows_n, cols_n, vals_n)
                bar.update(x_bd.shape[0])
        csr.finish()
    except BaseException:
        csr.abort()
        raise
    np.savez(out.latents_fpath, **stats.latents())
    atomic.write_json(out.metrics_fpath, stats.metrics())


@dataclasses.dataclass(frozen=True)
class Dump:
    """A published inference directory, read back."""

    dpath: pathlib.Path
    config: dict
    latents: dict[str, np.ndarray]
    metrics: dict

    @property
    def d_sae(self) -> int:
        return int(self.config["d_sae"])


def load_dump(dpath: str | os.PathLike) -> Dump:
    """A published dump read back; a missing, unreadable or garbled file is a SaeflowError naming it."""
    dump = layout.DumpLayout(pathlib.Path(dpath))
    for fpath in (dump.config_fpath, dump.latents_fpath, dump.metrics_fpath):
        if not fpath.exists():
            raise SaeflowError(f"{fpath}: missing; run `saeflow inference` first")
    try:
        with np.load(dump.latents_fpath, allow_pickle=False) as npz:
            latents = {name: npz[name] for name in npz.files}
    except OSError as err:
        raise unreadable(dump.latents_fpath, err) from None
    except Exception as err:  # zipfile.BadZipFile, ValueError, EOFError: a damaged archive
        raise SaeflowError(f"{dump.latents_fpath}: not a readable .npz archive (damaged? {err})") from None
    return Dump(dump.dpath, read_json_object(dump.config_fpath), latents, read_json_object(dump.metrics_fpath))

