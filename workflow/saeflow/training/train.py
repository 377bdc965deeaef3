"""The resumable SAE training loop: `train_runs` trains run directories made by `saeflow create-run`.

A run is content-addressed by its training config (`specs.TrainConfig`, `runs.run_id`): the train/val shard hashes
plus every hyper-parameter, seeds included. Training is a pure function of that config: the data order depends only
on (data_seed, epoch, step) (see `loaders`), the initialization only on `seed`, and every `checkpoint_every` steps
the full state (weights, Adam moments, dead-latent counters, BatchTopK threshold, step) is saved atomically to
`checkpoint/resume.pt`. A killed run restarts from there and ends with the same weights as an uninterrupted one.

Runs that read the same vectors in the same order (same train shards, layer, tokens, batch size, data seed and
length) train in one pass: each batch is read once and fed to every SAE of the group. The loss is `objectives`'.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import typing

import torch
import tqdm

from saeflow import config, devices, numerics, preempt
from saeflow.errors import SaeflowError
from saeflow.store import atomic, provenance, runs
from saeflow.store.shards import ShardDir
from saeflow.training import degenerate, localcopy, memory, rates, resume, tracking
from saeflow.training.adam import Adam
from saeflow.training.archs import made_since
from saeflow.training.loaders import ShuffledLoader, ordered_loader, pairs
from saeflow.training.metrics import MetricsAccumulator
from saeflow.training.objectives import PICKS_SINCE, Loss, Objective, dead_latents, one_process
from saeflow.training.ranks.distributed import Comm
from saeflow.training.sae import SAE, forward_picks, init_from_data, save_atomic, save_sae
from saeflow.training.specs import TrainConfig

logger = logging.getLogger("saeflow.training.train")

N_INIT_VECTORS = 16384
LOG_EVERY = 10
TRAIN_DEFAULTS = config.section_defaults("train")  # device, checkpoint_every: the schema's `train` section


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How one `saeflow train` process trains its runs (what each run trains is its own config.json)."""

    device: str = TRAIN_DEFAULTS["device"]  # auto, cpu, cuda, cuda:N (devices.resolve_device)
    checkpoint_every: int = TRAIN_DEFAULTS["checkpoint_every"]  # steps between resume checkpoints
    max_steps: int | None = None  # stop after this many steps, with a resume checkpoint (tests, time-limited jobs)
    local_copy: str = ""  # read the training shards from a node-local copy here, e.g. "$TMPDIR" (localcopy)
    runs_per_pass: int = TRAIN_DEFAULTS["runs_per_pass"]  # at most this many runs share one pass over the data
    tracking: "tracking.Settings | None" = None  # mirror the metrics to W&B/TensorBoard (saeflow.training.tracking)
    parallel: str = TRAIN_DEFAULTS["parallel"]  # how the ranks of a launched job share a pass (parallel.choose_mode)
    buffer_bytes: str | int = TRAIN_DEFAULTS["buffer_bytes"]  # the shuffle pool; `auto` sizes it from the job's memory


DEFAULT_SETTINGS = TrainSettings()


def adam_step(opt: Adam, sae, cfg: TrainConfig) -> None:
    """The optimizer step. Decoder rows of unit norm (the architecture's decoder policy for the run `cfg`,
    `Arch.unit_rows`: an SAE's `unit_decoder_for`, never a transcoder's; see sae.init_from_data) lose the gradient
    along themselves first and are renormalized after. `sae` is a whole SAE or a rank's latent shard."""
    unit_rows = sae.arch.unit_rows(sae.cfg, cfg)
    if unit_rows:
        sae.remove_parallel_grad()
    opt.step()
    if unit_rows:
        sae.normalize_decoder()


class Checkpoint:
    """A run's files while it trains: resume.pt (the full state, for an exact restart) and metrics.jsonl."""

    def __init__(self, run: runs.Run):
        self.run = run

    def restore(self, trainer: "Trainer") -> bool:
        """Load resume.pt into `trainer` and drop the metric lines logged after it; False when there is none."""
        for stale in self.run.checkpoint_dpath.glob(f".*{atomic.TMP_INFIX}*"):  # half-written by a killed process
            stale.unlink()
        atomic.remove_staging(self.run.publish_dpath)  # an unsealed publish: the finish is redone
        self.run.final_metrics_fpath.unlink(missing_ok=True)  # never left without sae.pt (see `publish`)
        # resume.pt, or the ranks' files of a latent-sharded checkpoint
        state = resume.read_resume(self.run, trainer.device, trainer.sae.latent_axes(), trainer.latents)
        if state is None:
            return False
        trainer.load_state_dict(state)
        self._truncate_log(trainer.step)
        logger.info("%s: resuming at step %d of %d", self.run.root, trainer.step, trainer.n_steps)
        return True

    def save(self, state: dict) -> None:
        save_atomic(state, self.run.resume_fpath)
        resume.remove_resume_shards(self.run)  # a latent-sharded checkpoint of an earlier attempt is older now

    def restart_log(self) -> None:
        """A fresh run starts a fresh metrics.jsonl (one left by a run that never reached a resume point)."""
        self.run.metrics_log_fpath.unlink(missing_ok=True)

    def log(self, record: dict) -> None:
        """Append one line; a failed append (a full disk) is cut back, so the log never holds a torn line."""
        fpath = self.run.metrics_log_fpath
        size_bytes = fpath.stat().st_size if fpath.exists() else 0
        try:
            with open(fpath, "a", encoding="utf-8") as fd:
                fd.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as err:
            os.truncate(fpath, size_bytes)
            if atomic.is_no_space(err):
                raise atomic.no_space_error(fpath, "the log was cut back to its last whole line") from None
            raise

    def _truncate_log(self, step: int) -> None:
        """Drop metric lines logged after the resume point (they will be logged again, identically)."""
        fpath = self.run.metrics_log_fpath
        if not fpath.exists():
            return
        keep = []
        for line in fpath.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by the kill
                continue
            if record.get("step", math.inf) <= step:
                keep.append(line)
        atomic.write_file_atomic(fpath, "".join(line + "\n" for line in keep).encode())

    def publish(self, result: dict, sae: SAE, prov: dict, save: typing.Callable | None = None) -> None:
        """Stage metrics.jsonl (with the final line), metrics.json, provenance.json and sae.pt together, then rename
        them out; a degenerate result (saeflow.training.degenerate) is said in one line of the log.

        The staging directory is sealed once its sae.pt exists (written last, after the other two are fsynced);
        `finish_pending` completes a sealed publish after a crash and an unsealed one is redone, so a run never
        shows metrics.json without sae.pt. sae.pt is renamed out last: its presence means "done". All three are
        published read-only.
        """
        if problem := degenerate.reason(result, sae.d_sae, sae.arch.name):  # one line per run, in the training log
            logger.warning("%s: degenerate result: %s", self.run.root, problem)
        staging = self.run.publish_dpath
        atomic.remove_staging(staging)
        log_fpath = self.run.metrics_log_fpath
        log_text = log_fpath.read_text(encoding="utf-8") if log_fpath.exists() else ""
        final_line = json.dumps({**result, "final": True}, sort_keys=True) + "\n"
        with atomic.no_space_as_error(self.run.sae_fpath, f"removed {staging.name}, nothing was published"):
            try:
                staging.mkdir()
                for fname, text in (
                    (log_fpath.name, log_text + final_line),
                    (self.run.final_metrics_fpath.name, json.dumps(result, indent=2, sort_keys=True) + "\n"),
                    (self.run.provenance_fpath.name, json.dumps(prov, indent=2, sort_keys=True) + "\n"),
                ):
                    (staging / fname).write_text(text, encoding="utf-8")
                    atomic.fsync_path(staging / fname)
                    os.chmod(staging / fname, atomic.READONLY_FILE_MODE)
                (save or save_sae)(sae, staging / self.run.sae_fpath.name, readonly=True)  # seals the staging dir
            except BaseException:
                atomic.remove_staging(staging)
                raise
        self.finish_pending()

    def finish_pending(self) -> bool:
        """Complete a sealed publish (rename out metrics.jsonl, metrics.json, then sae.pt) and drop what a
        finished run no longer needs. True when the run is trained (sae.pt present)."""
        run, staging = self.run, self.run.publish_dpath
        if not run.sae_fpath.exists() and (staging / run.sae_fpath.name).exists():
            for final_fpath in (run.metrics_log_fpath, run.final_metrics_fpath, run.provenance_fpath, run.sae_fpath):
                if (staging / final_fpath.name).exists():
                    os.replace(staging / final_fpath.name, final_fpath)
            atomic.fsync_path(run.checkpoint_dpath)
        if not run.sae_fpath.exists():
            return False
        atomic.remove_staging(staging)
        run.resume_fpath.unlink(missing_ok=True)
        resume.remove_resume_shards(run)
        return True


class Trainer:
    """One SAE being trained: its weights, optimizer, step and dead-latent counters."""

    latents: tuple[int, int] | None = None  # the latents [lo, hi) it holds (a latent shard: sharded); None: all

    def __init__(self, run: runs.Run, cfg: TrainConfig, d_model: int, n_steps: int, device: torch.device,
                 d_out: int | None = None):  # fmt: skip
        self.run, self.cfg, self.n_steps, self.device = run, cfg, n_steps, device
        self.checkpoint = Checkpoint(run)
        self.sae = SAE(cfg.sae_config(d_model, d_out)).to(device).train()
        self.peak_lr = rates.peak_lr(cfg, self.sae.d_sae)
        self.opt = Adam(self.sae.parameters(), lr=self.peak_lr, lr_scales=rates.lr_scales(self.sae, cfg))
        self.objective = Objective(cfg, n_steps)
        self.step, self.pool_rows = 0, None  # pool_rows: the shuffle pool feeding it (kept in resume.pt)
        self.dead = dead_latents(cfg, self.sae.arch, self.sae.d_sae, n_steps, device)
        self._common_state()

    def _common_state(self) -> None:
        self.last: dict = {}  # the latest metrics record (for the progress bar)
        self.platforms = [provenance.platform()]  # of each attempt that trained it, when they differ (resume.pt)
        self.started_at = provenance.utc_now()
        self.tracker = tracking.Tracker([])  # W&B / TensorBoard mirrors of the metrics, opened by `_train_group`

    def init_from_data(self, x_nd: torch.Tensor, y_nd: torch.Tensor | None = None) -> None:
        """The run's start from the sample `x_nd` (a transcoder's targets `y_nd`): `sae.init_from_data`, on the
        latents this trainer holds."""
        init_from_data(self.sae, x_nd, y_nd, self.cfg, self.run.root, 0 if self.latents is None else self.latents[0])

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (resume.pt)."""
        return {
            "sae": self.sae.state_dict(),
            "opt": self.opt.state_dict(),
            **self.dead.state(),
            "step": self.step,
            "platforms": self.platforms, "pool_rows": self.pool_rows,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sae.load_state_dict(state["sae"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self.dead.load_state(state, self.step)
        earlier, here = list(state.get("platforms", [])), self.platforms[-1]
        if earlier and numerics.platform_key(earlier[-1]) != numerics.platform_key(here):
            logger.warning(
                "%s: resumed on another platform than step %d was computed on; the result matches an "
                "uninterrupted run within float tolerance, not bitwise", self.run.root, self.step,
            )
            earlier.append(here)
        self.platforms = earlier or [here]

    def set_lr(self) -> None:
        """This step's learning rate (warmup, then decay: rates.lr_at) on every parameter group."""
        for group in self.opt.param_groups:
            group["lr"] = rates.lr_at(self.step, self.n_steps, self.peak_lr, self.cfg.lr_warmup_frac)

    def train_step(self, batch: pairs.Batch) -> None:
        """One step on a batch: an SAE's inputs, or a transcoder's (inputs, targets)."""
        sae, (x_bd, y_bd) = self.sae, pairs.split(batch)
        self.set_lr()
        loss = self.objective(sae, x_bd, self.step, self.dead, y_bd)
        self.opt.zero_grad()
        loss.total.backward()
        adam_step(self.opt, sae, self.cfg)
        with torch.no_grad():
            self.dead.update(loss.codes.fired_s())
            sae.arch.after_step(sae, loss.codes.activations(), self.step, one_process)
        self.step += 1
        if self.step % LOG_EVERY == 0 or self.step == self.n_steps:
            self.last = self._record(x_bd, loss)
            self.checkpoint.log(self.last)
            self.tracker.log(self.last)

    @torch.no_grad()
    def _record(self, x_bd: torch.Tensor, loss: Loss) -> dict:
        return {
            "step": self.step,
            "n_vectors": self.step * self.cfg.batch_size,
            "lr": self.opt.param_groups[0]["lr"],
            "loss": float(loss.total),
            **{name: float(value) for name, value in loss.terms.items()},
            "nmse": loss.nmse(x_bd * self.sae.scale),
            "l0": loss.codes.l0(),
            "n_dead": int(self.dead.dead_s.sum()),
        }

    def finish(self, val: "ShardDir | tuple[ShardDir, ShardDir]") -> dict:
        """Validation metrics in raw space (`val`: the validation shards, or a transcoder's pair of them), then the
        run's final files (sae.pt last)."""
        val_dir, target_dir = val if isinstance(val, tuple) else (val, None)
        self.sae.eval()
        if not self.sae.arch.unit_decoder_for(self.cfg):
            self.sae.fold_decoder_norms()  # an SAE's sae.pt always has unit decoder rows (a TopK transcoder's not)
        metrics = validation_metrics(self.sae, val_dir, self.cfg, self.device, target_dir)
        result = {**measured_on(self.cfg, val_dir), "step": self.step, "peak_lr": self.peak_lr, **metrics}
        return self.publish(result)

    def publish(self, result: dict, save: typing.Callable | None = None) -> dict:
        self.sae.cpu()  # the run's final files from its validation `result`: the model written by `save`, sae.pt last
        prov = {**provenance.collect(), "started_at": self.started_at, "finished_at": provenance.utc_now(),
                "platforms": self.platforms, "mixed_platforms": len(self.platforms) > 1}  # fmt: skip
        self.checkpoint.publish(result, self.sae, prov, save)
        self.tracker.close(final=result)
        return result


def measured_on(cfg: TrainConfig, val_dir: ShardDir) -> dict:
    """What the final metrics were measured on: `shards`, and `split` "val", or "train" where no `val` was given."""
    return {"split": "train" if val_dir.hash == cfg.train_shards else "val", "shards": val_dir.hash}


@torch.no_grad()
def validation_metrics(sae: SAE, val_dir: ShardDir, cfg: TrainConfig, device: torch.device,
                       target_dir: ShardDir | None = None) -> dict:  # fmt: skip
    """The SAE's metrics on the first `n_val_vectors` (all when None) validation vectors, in storage order; a
    transcoder's (`target_dir`: its validation targets) of its predictions of the targets. k-sparse codes of a run
    made since the picks (`PICKS_SINCE`) are decoded from them (`forward_picks`), never made dense."""
    acc = MetricsAccumulator(sae.d_out, sae.d_sae)
    picked = sae.arch.k_sparse and made_since(cfg, PICKS_SINCE)
    loader = ordered_loader(val_dir, target_dir, cfg.layer, cfg.batch_size, cfg.tokens, borrowed=True)  # used at once
    n_max = cfg.n_val_vectors or loader.n_vectors
    for batch in loader:
        x_bd, y_bd = pairs.split(pairs.to_device(pairs.head(batch, n_max - acc.n_vectors), device))
        if picked:
            x_hat_bd, vals_bk, idx_bk = forward_picks(sae, x_bd)
            fires_s = torch.bincount(idx_bk[vals_bk > 0], minlength=sae.d_sae)
            acc.update_counts(x_bd if y_bd is None else y_bd, x_hat_bd, fires_s)
        else:
            x_hat_bd, f_bs = sae(x_bd)
            acc.update(x_bd if y_bd is None else y_bd, x_hat_bd, f_bs)
        if acc.n_vectors >= n_max:
            break
    loader.close()
    return acc.result()


def train_runs(run_paths: typing.Sequence[str | os.PathLike], settings: TrainSettings = DEFAULT_SETTINGS,
               open_clt: typing.Callable | None = None) -> list[dict]:  # fmt: skip
    """Train every run not yet done (checkpoint/sae.pt absent) in this process, sharing passes over the data where
    possible.

    Runs that read identical batches (`TrainConfig.loader_key`) train in one pass, at most `runs_per_pass` at a
    time, in the order given: each publishes its own sae.pt, in that order. Returns the final validation metrics of
    runs that finished. Each run's lock (`RunLayout.lock_fpath`) is held throughout, so a second trainer of the same
    run waits and then finds it done.
    The ranks of a launched job train together instead (saeflow.training.entry.train_runs chooses). A cross-layer
    transcoder's pass is opened by `open_clt` (saeflow.training.clt_train.open_pass, which entry passes)."""
    dev = devices.resolve_device(settings.device)
    opened = {str(run.root): run for run in map(runs.open_run, run_paths)}
    with contextlib.ExitStack() as locks:
        for key in sorted(opened):  # one order for every process: no deadlock between overlapping run lists
            locks.enter_context(atomic.exclusive_lock(opened[key].lock_fpath))
        todo: dict[tuple, list[tuple[runs.Run, TrainConfig]]] = {}
        for run in opened.values():
            if Checkpoint(run).finish_pending():
                logger.info("%s: already trained (%s exists)", run.root, run.sae_fpath)
                continue
            cfg = TrainConfig.from_dict(run.config(), str(run.config_fpath))
            todo.setdefault(cfg.loader_key(), []).append((run, cfg))
        results = []
        for group in todo.values():
            open_pass = open_clt if group[0][1].cross_layer else _open_pass
            for first in range(0, len(group), settings.runs_per_pass):
                results.extend(_train_group(group[first : first + settings.runs_per_pass], dev, settings, open_pass))
    return results


def _open_shards(run: runs.Run, link: str, shard_hash: str | None = None) -> ShardDir:
    """The shard directory a run's link points to, refused unless it is `shard_hash` (when given)."""
    shard_dir = ShardDir(run.link(link).resolve())
    if shard_hash is not None and shard_dir.hash != shard_hash:
        raise SaeflowError(f"{run.link(link)}: does not point to shards {shard_hash}")
    return shard_dir


def _open_data(group: list[tuple[runs.Run, TrainConfig]], local_copy: str, make_loader) -> tuple[ShuffledLoader, list]:
    """The group's shared training loader (`make_loader(shard_dir, config, target_dir)`) and each run's validation
    shards (a transcoder's: the pair of them), checked against the configs."""
    run0, cfg0 = group[0]
    train_dir = _open_shards(run0, run0.TRAIN_SHARDS, cfg0.train_shards)
    target_dir = _open_shards(run0, run0.TARGET_SHARDS, cfg0.target) if cfg0.transcoder else None
    for run, _ in group:
        _open_shards(run, run.TRAIN_SHARDS, cfg0.train_shards)
    val_dirs = [_open_shards(run, run.VAL_SHARDS) if not cfg.transcoder else
                (_open_shards(run, run.VAL_SHARDS), _open_shards(run, run.VAL_TARGET_SHARDS, cfg.val_target))
                for run, cfg in group]  # fmt: skip
    if local_copy:  # read the training shards from node-local disk (checked copy, made once per node)
        train_dir = ShardDir(localcopy.local_copy(train_dir.dpath, local_copy))
        target_dir = target_dir and ShardDir(localcopy.local_copy(target_dir.dpath, local_copy))
    loader = make_loader(train_dir, cfg0, target_dir)
    d_model = train_dir.metadata.d_model
    for (run, _), val in zip(group, val_dirs):
        val_dir = val[0] if isinstance(val, tuple) else val
        if val_dir.metadata.d_model != d_model:
            raise SaeflowError(
                f"{run.link(run.VAL_SHARDS)}: d_model {val_dir.metadata.d_model} differs from training's {d_model}"
            )
    return loader, val_dirs


def _open_pass(group: list[tuple[runs.Run, TrainConfig]], dev: torch.device, settings: TrainSettings):
    """(the pass's shuffled loader, each run's validation shards, its trainers, the steps of the run)."""
    cfg0 = group[0][1]
    train_dir = _open_shards(group[0][0], runs.Run.TRAIN_SHARDS)
    pool = memory.pool_bytes(group, settings.buffer_bytes, "sweep", train_dir, Comm.alone(dev))

    def make_loader(shard_dir: ShardDir, cfg: TrainConfig, target_dir: ShardDir | None) -> ShuffledLoader:
        return ShuffledLoader(shard_dir, cfg.layer, cfg.batch_size, cfg.data_seed, tokens=cfg.tokens, buffer_bytes=pool,
                              borrowed=True, target_dir=target_dir)  # each batch is used before the next is asked for

    loader, val_dirs = _open_data(group, settings.local_copy, make_loader)
    d_model, d_out = loader.views[0].d_model, loader.views[-1].d_model
    n_steps = -(-cfg0.n_train_vectors // cfg0.batch_size) if cfg0.n_train_vectors else cfg0.n_epochs * len(loader)
    trainers = [Trainer(run, cfg, d_model, n_steps, dev, d_out) for run, cfg in group]
    return loader, val_dirs, trainers, n_steps


def _train_group(group: list[tuple[runs.Run, TrainConfig]], dev: torch.device, settings: TrainSettings, open_pass):
    loader, val_dirs, trainers, n_steps = open_pass(group, dev, settings)
    for t in trainers:
        t.pool_rows = loader.n_pool
    fresh = [t for t in trainers if not t.checkpoint.restore(t)]
    if fresh:
        init_nd = _first_vectors(loader, N_INIT_VECTORS)
        for t in fresh:
            t.checkpoint.restart_log()
            t.init_from_data(*pairs.parts(init_nd))
    start = min(t.step for t in trainers)
    stop = n_steps if settings.max_steps is None else min(n_steps, start + settings.max_steps)
    with contextlib.ExitStack() as trackers:
        for t in trainers:
            t.tracker = tracking.open_tracker(settings.tracking, t.run, t.step)
            trackers.callback(t.tracker.close)  # stopped or failed: closed without a final record
        stop = _run_steps(trainers, loader, start, stop, settings.checkpoint_every)  # earlier when a stop signal came
        loader.close()
        if stop < n_steps:
            for t in trainers:
                t.checkpoint.save(t.state_dict())
            if preempt.received():
                raise preempt.stopped(f"resume checkpoints saved at step {stop} of {n_steps}")
            return []
        return [{"run": str(t.run.root), **t.finish(val_dir)} for t, val_dir in zip(trainers, val_dirs)]


def _run_steps(trainers: list[Trainer], loader: ShuffledLoader, start: int, stop: int, checkpoint_every: int) -> int:
    """Steps `start..stop-1` of the group: each batch is read once and fed to every trainer at that step. Returns
    the step reached: `stop`, or the step after which a stop signal (saeflow.preempt) came."""
    batch_size, n_steps, per_epoch = loader.batch_size, trainers[0].n_steps, len(loader)
    bar = tqdm.tqdm(total=(stop - start) * batch_size, unit="vec", unit_scale=True, desc=f"train x{len(trainers)}")
    step = start
    t0_sec, t0_cpu_sec = time.perf_counter(), time.process_time()
    try:
        while step < stop:
            epoch, batch_idx = divmod(step, per_epoch)
            for batch in loader.iter_batches(epoch, batch_idx):
                # Blocking: the batch is a view of a pageable buffer the loader recycles two batches later.
                batch = pairs.to_device(batch, trainers[0].device)
                for t in trainers:
                    if t.step == step:
                        t.train_step(batch)
                        if t.step % checkpoint_every == 0 and t.step < n_steps:
                            t.checkpoint.save(t.state_dict())
                step += 1
                bar.update(pairs.n_rows(batch))
                if trainers[0].last and step % LOG_EVERY == 0:
                    last = trainers[0].last
                    bar.set_postfix(loss=f"{last['loss']:.4g}", L0=f"{last['l0']:.1f}", NMSE=f"{last['nmse']:.3f}")
                if preempt.received():
                    stop = step
                if step >= stop:
                    break
    finally:
        bar.close()  # the error message starts on a line of its own
    logger.info("trained %d steps in %.2f s (%.2f CPU-s of this process, its loader's threads included)", stop - start,
                time.perf_counter() - t0_sec, time.process_time() - t0_cpu_sec)  # fmt: skip
    return stop


def _first_vectors(loader: ShuffledLoader, n: int) -> pairs.Batch:
    """The first `n` vectors (a transcoder's: pairs) of epoch 0 (the data-based initialization sample)."""
    parts, got = [], 0
    for batch in loader.iter_batches(0):
        parts.append(pairs.copy(pairs.head(batch, n - got)))  # the loader reuses its buffers
        got += pairs.n_rows(parts[-1])
        if got >= n:
            break
    return pairs.cat(parts)
