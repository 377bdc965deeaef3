"""The resumable SAE training loop: `train_runs` trains run directories made by `saeflow create-run`.

A run is content-addressed by its training config (`sweeps.TrainConfig`, `runs.run_id`): the train/val shard hashes
plus every hyper-parameter, seeds included. Training is a pure function of that config: the data order depends only
on (data_seed, epoch, step) (see `loaders`), the initialization only on `seed`, and every `checkpoint_every` steps
the full state (weights, Adam moments, dead-latent counters, BatchTopK threshold, step) is saved atomically to
`checkpoint/resume.pt`. A killed run restarts from there and ends with the same weights as an uninterrupted one.

Runs that read the same vectors in the same order (same train shards, layer, tokens, batch size, data seed and
length) train in one pass: each batch is read once and fed to every SAE of the group.
"""

import json
import logging
import math
import os
import time
import typing

import torch
import tqdm

from saeflow import atomic, devices, runs
from saeflow.errors import SaeflowError
from saeflow.loaders import OrderedLoader, ShuffledLoader
from saeflow.metrics import MetricsAccumulator, batch_nmse
from saeflow.sae import SAE, SAEConfig, save_atomic, save_sae
from saeflow.shards import ShardDir
from saeflow.sweeps import TrainConfig

logger = logging.getLogger("saeflow.train")

N_INIT_VECTORS = 16384
LOG_EVERY = 10


def sae_config(cfg: TrainConfig, d_model: int) -> SAEConfig:
    """The architecture a run trains: Matryoshka fractions of d_sae become latent counts."""
    d_sae = cfg.expansion * d_model
    prefixes = tuple(sorted({max(1, int(f * d_sae)) for f in cfg.matryoshka}))
    return SAEConfig(d_model=d_model, d_sae=d_sae, arch=cfg.arch, k=cfg.k, matryoshka=prefixes)


def lr_at(step: int, n_steps: int, peak: float, warmup_frac: float) -> float:
    """Linear warm-up, then cosine decay to zero at the last step."""
    n_warm = int(warmup_frac * n_steps)
    if step < n_warm:
        return peak * (step + 1) / n_warm
    progress = (step - n_warm) / max(1, n_steps - n_warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """One SAE being trained: its state, its loss, its checkpoints."""

    def __init__(self, run: runs.Run, cfg: TrainConfig, d_model: int, n_steps: int, device: torch.device):
        self.run, self.cfg, self.n_steps, self.device = run, cfg, n_steps, device
        self.sae = SAE(sae_config(cfg, d_model)).to(device).train()
        self.opt = torch.optim.Adam(self.sae.parameters(), lr=cfg.lr)
        self.step = 0
        self.dead_steps = max(1, -(-cfg.dead_after_vectors // cfg.batch_size))
        self.since_fired_s = torch.zeros(self.sae.d_sae, dtype=torch.int64, device=device)
        self.last: dict = {}

    # -- state ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_from_data(self, x_nd: torch.Tensor) -> None:
        """Scale so mean ||x||^2 = d_model; b_dec = mean; random unit decoder rows; encoder = decoder transpose."""
        sae = self.sae
        x_nd = x_nd.to(self.device, torch.float32)
        mean_sq = x_nd.square().sum(-1).mean()
        if not torch.isfinite(mean_sq) or mean_sq <= 0:
            raise SaeflowError(f"{self.run.root}: training vectors are all zero or not finite; cannot normalize")
        sae.scale.fill_(math.sqrt(sae.d_model / float(mean_sq)))
        sae.b_dec.copy_((x_nd * sae.scale).mean(0))
        gen = torch.Generator().manual_seed(self.cfg.seed)
        sae.W_dec.copy_(torch.randn(sae.d_sae, sae.d_model, generator=gen))
        sae.normalize_decoder()
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.zero_()

    def load_resume(self) -> bool:
        """Restore from checkpoint/resume.pt; False when there is none."""
        for stale in self.run.checkpoint_dpath.glob(f".*{atomic.TMP_INFIX}*"):  # half-written by a killed process
            stale.unlink()
        if not self.run.resume_fpath.exists():
            return False
        try:
            state = torch.load(self.run.resume_fpath, map_location=self.device, weights_only=True)
            self.sae.load_state_dict(state["sae"])
            self.opt.load_state_dict(state["opt"])
            self.since_fired_s.copy_(state["since_fired_s"])
            self.step = int(state["step"])
        except Exception as err:
            raise SaeflowError(
                f"{self.run.resume_fpath}: unreadable resume checkpoint ({err}); delete it to restart this run"
            ) from None
        self._truncate_metrics()
        logger.info("%s: resuming at step %d of %d", self.run.root, self.step, self.n_steps)
        return True

    def save_resume(self) -> None:
        state = {
            "sae": self.sae.state_dict(),
            "opt": self.opt.state_dict(),
            "since_fired_s": self.since_fired_s,
            "step": self.step,
        }
        save_atomic(state, self.run.resume_fpath)

    def _truncate_metrics(self) -> None:
        """Drop metric lines logged after the resume point (they will be logged again, identically)."""
        if not self.run.metrics_log_fpath.exists():
            return
        keep = []
        for line in self.run.metrics_log_fpath.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by the kill
                continue
            if record.get("step", math.inf) <= self.step:
                keep.append(line)
        atomic.write_file_atomic(self.run.metrics_log_fpath, "".join(line + "\n" for line in keep).encode())

    # -- one step -------------------------------------------------------------------------------------------

    def loss(self, x_bd: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
        sae, cfg = self.sae, self.cfg
        xn_bd = x_bd * sae.scale
        pre_bs = sae.pre_acts_normed(xn_bd)
        if cfg.arch == "topk":  # decode from the k active latents only (the dense decode would dominate the step)
            vals_bk, idx_bk = pre_bs.topk(cfg.k, dim=-1, sorted=False)
            vals_bk = torch.relu(vals_bk)
            f_bs = torch.zeros_like(pre_bs).scatter_(-1, idx_bk, vals_bk.detach())  # for metrics only
            decode = lambda m: sae.decode_sparse_normed(vals_bk, idx_bk, m)  # noqa: E731
        else:
            f_bs = sae.activate(pre_bs)
            decode = lambda m: sae.decode_normed(f_bs, m)  # noqa: E731
        xn_hat_bd = decode(None)
        recon = [(decode(m) - xn_bd).square().sum(-1).mean() for m in sae.cfg.matryoshka]
        mse = torch.stack([*recon, (xn_hat_bd - xn_bd).square().sum(-1).mean()]).mean()
        terms = {"mse": mse}
        if cfg.arch == "relu":
            n_warm = int(cfg.sparsity_warmup_frac * self.n_steps)
            ramp = min(1.0, (self.step + 1) / n_warm) if n_warm else 1.0
            terms["l1"] = cfg.l1_coeff * ramp * (f_bs * sae.W_dec.norm(dim=-1)).sum(-1).mean()
        else:
            terms["aux"] = cfg.aux_alpha * self._aux_loss(pre_bs, xn_bd - xn_hat_bd)
        return sum(terms.values()), terms, (xn_hat_bd, f_bs)

    def _aux_loss(self, pre_bs: torch.Tensor, resid_bd: torch.Tensor) -> torch.Tensor:
        """AuxK: the top-`aux_k` dead latents reconstruct the residual, so dead latents get gradient again."""
        dead_s = self.since_fired_s >= self.dead_steps
        n_dead = int(dead_s.sum())
        if n_dead == 0:
            return torch.zeros((), device=pre_bs.device)
        vals_bk, idx_bk = pre_bs.masked_fill(~dead_s, -math.inf).topk(min(self.cfg.aux_k, n_dead), dim=-1, sorted=False)
        vals_bk = torch.relu(vals_bk)
        resid_bd = resid_bd.detach()
        err = (self.sae.decode_sparse_normed(vals_bk, idx_bk) - self.sae.b_dec - resid_bd).square().sum(-1).mean()
        return err / resid_bd.square().sum(-1).mean().clamp_min(1e-12)

    def train_step(self, x_bd: torch.Tensor) -> None:
        sae = self.sae
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.n_steps, self.cfg.lr, self.cfg.lr_warmup_frac)
        loss, terms, (xn_hat_bd, f_bs) = self.loss(x_bd)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_parallel_grad()
        self.opt.step()
        sae.normalize_decoder()
        with torch.no_grad():
            fired_s = (f_bs > 0).any(0)
            self.since_fired_s += 1
            self.since_fired_s[fired_s] = 0
            if self.cfg.arch == "batchtopk":  # inference threshold: running mean of the smallest kept activation
                min_kept = f_bs[f_bs > 0].min() if fired_s.any() else sae.threshold
                sae.threshold.copy_(min_kept if self.step == 0 else 0.99 * sae.threshold + 0.01 * min_kept)
        self.step += 1
        if self.step % LOG_EVERY == 0 or self.step == self.n_steps:
            self._log(x_bd, xn_hat_bd, f_bs, loss, terms)

    def _log(self, x_bd, xn_hat_bd, f_bs, loss, terms) -> None:
        with torch.no_grad():
            record = {
                "step": self.step,
                "n_vectors": self.step * self.cfg.batch_size,
                "lr": self.opt.param_groups[0]["lr"],
                "loss": float(loss),
                **{name: float(value) for name, value in terms.items()},
                "nmse": batch_nmse(x_bd * self.sae.scale, xn_hat_bd),
                "l0": float((f_bs > 0).sum(-1).float().mean()),
                "n_dead": int((self.since_fired_s >= self.dead_steps).sum()),
            }
        self.last = record
        with open(self.run.metrics_log_fpath, "a", encoding="utf-8") as fd:
            fd.write(json.dumps(record, sort_keys=True) + "\n")

    # -- the end --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def finish(self, val_dir: ShardDir) -> dict:
        """Validation metrics in raw space, then sae.pt (written last: its presence means the run is done)."""
        self.sae.eval()
        cfg = self.cfg
        acc = MetricsAccumulator(self.sae.d_model, self.sae.d_sae)
        loader = OrderedLoader(val_dir, cfg.layer, cfg.batch_size, tokens=cfg.tokens)
        n_max = cfg.n_val_vectors or loader.n_vectors
        for x_bd in loader:
            x_bd = x_bd[: n_max - acc.n_vectors].to(self.device, torch.float32)
            x_hat_bd, f_bs = self.sae(x_bd)
            acc.update(x_bd, x_hat_bd, f_bs)
            if acc.n_vectors >= n_max:
                break
        loader.close()
        result = {"split": "val", "shards": val_dir.hash, "step": self.step, **acc.result()}
        with open(self.run.metrics_log_fpath, "a", encoding="utf-8") as fd:
            fd.write(json.dumps({**result, "final": True}, sort_keys=True) + "\n")
        atomic.write_file_atomic(
            self.run.final_metrics_fpath,
            (json.dumps(result, indent=2, sort_keys=True) + "\n").encode(),
        )
        self.sae.cpu()
        save_sae(self.sae, self.run.sae_fpath)
        self.run.resume_fpath.unlink(missing_ok=True)
        return result


def _open_shards(run: runs.Run, link: str) -> ShardDir:
    return ShardDir(run.link(link).resolve())


def train_runs(
    run_paths: typing.Sequence[str | os.PathLike],
    device: str = "auto",
    checkpoint_every: int = 500,
    max_steps: int | None = None,
) -> list[dict]:
    """Train every run not yet done (checkpoint/sae.pt absent), sharing passes over the data where possible.

    `max_steps` stops after that many steps (with a resume checkpoint), for tests and time-limited jobs.
    Returns the final validation metrics of runs that finished.
    """
    dev = devices.resolve_device(device)
    todo: dict[tuple, list[tuple[runs.Run, TrainConfig]]] = {}
    for path in run_paths:
        run = runs.open_run(path)
        if run.sae_fpath.exists():
            logger.info("%s: already trained (%s exists)", run.root, run.sae_fpath)
            continue
        cfg = TrainConfig.from_dict(run.config(), str(run.config_fpath))
        todo.setdefault(cfg.loader_key(), []).append((run, cfg))
    results = []
    for group in todo.values():
        results.extend(_train_group(group, dev, checkpoint_every, max_steps))
    return results


def _train_group(group, dev: torch.device, checkpoint_every: int, max_steps: int | None) -> list[dict]:
    run0, cfg0 = group[0]
    train_dir = _open_shards(run0, "train-shards")
    for run, _ in group:
        if _open_shards(run, "train-shards").hash != cfg0.train_shards or train_dir.hash != cfg0.train_shards:
            raise SaeflowError(f"{run.link('train-shards')}: does not point to shards {cfg0.train_shards}")
    val_dirs = [_open_shards(run, "val-shards") for run, _ in group]
    loader = ShuffledLoader(train_dir, cfg0.layer, cfg0.batch_size, cfg0.data_seed, tokens=cfg0.tokens)
    d_model = train_dir.metadata.d_model
    for (run, cfg), val_dir in zip(group, val_dirs):
        if val_dir.metadata.d_model != d_model:
            raise SaeflowError(
                f"{run.link('val-shards')}: d_model {val_dir.metadata.d_model} differs from training's {d_model}"
            )
    per_epoch = len(loader)
    n_steps = -(-cfg0.n_train_vectors // cfg0.batch_size) if cfg0.n_train_vectors else cfg0.n_epochs * per_epoch
    trainers = [Trainer(run, cfg, d_model, n_steps, dev) for run, cfg in group]
    fresh = [t for t in trainers if not t.load_resume()]
    if fresh:
        init_nd = _first_vectors(loader, N_INIT_VECTORS)
        for t in fresh:
            t.run.metrics_log_fpath.unlink(missing_ok=True)
            t.init_from_data(init_nd)
    start = min(t.step for t in trainers)
    stop = n_steps if max_steps is None else min(n_steps, start + max_steps)
    bar = tqdm.tqdm(total=(stop - start) * cfg0.batch_size, unit="vec", unit_scale=True, desc=f"train x{len(trainers)}")
    step = start
    t0 = time.perf_counter()
    while step < stop:
        epoch, batch_idx = divmod(step, per_epoch)
        for x_bd in loader.iter_batches(epoch, batch_idx):
            x_bd = x_bd.to(dev, torch.float32, non_blocking=True)
            for t in trainers:
                if t.step == step:
                    t.train_step(x_bd)
                    if t.step % checkpoint_every == 0 and t.step < n_steps:
                        t.save_resume()
            step += 1
            bar.update(x_bd.shape[0])
            if trainers[0].last and step % LOG_EVERY == 0:
                last = trainers[0].last
                bar.set_postfix(loss=f"{last['loss']:.4g}", L0=f"{last['l0']:.1f}", NMSE=f"{last['nmse']:.3f}")
            if step >= stop:
                break
    bar.close()
    loader.close()
    logger.info("trained %d steps in %.1f s", stop - start, time.perf_counter() - t0)
    if stop < n_steps:
        for t in trainers:
            t.save_resume()
        return []
    return [{"run": str(t.run.root), **t.finish(val_dir)} for t, val_dir in zip(trainers, val_dirs)]


def _first_vectors(loader: ShuffledLoader, n: int) -> torch.Tensor:
    """The first `n` vectors of epoch 0 (the data-based initialization sample)."""
    parts, got = [], 0
    for x_bd in loader.iter_batches(0):
        parts.append(x_bd[: n - got].clone())
        got += parts[-1].shape[0]
        if got >= n:
            break
    return torch.cat(parts)
