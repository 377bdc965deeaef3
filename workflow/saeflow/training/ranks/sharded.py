"""Latent-sharded training: rank r holds latents [lo_r, hi_r) of each SAE, so its weights and Adam moments are 1/N.

Shapes: b batch, d d_model (a transcoder's decodes: its target's width), s this rank's latents (hi - lo), k picks per
vector, p Matryoshka prefixes + the full.

A rank holds W_enc[:, lo:hi], b_enc[lo:hi], W_dec[lo:hi], the architecture's own per-latent parameters (each cut
along the axis `Arch.latent_axes` names) and their Adam moments; b_dec, the scale and the BatchTopK threshold are
whole on every rank, and so are a transcoder's target_scale and skip path W_skip (its encoder columns read the input,
its decoder rows write the target: `objectives.latent_target`). Every rank holds the whole batch (the loader
all-gathers it; a transcoder's pairs). One step:
  - pre-activations of this rank's latents, (b, s): no communication;
  - TopK: each rank's top k per vector (values and global ids) are all-gathered and the top k of those are the
    picks (the global top k, exactly the unsharded SAE's choice); BatchTopK: each rank's top k x b activations are
    all-gathered and the (k x b)-th largest is the threshold; AuxK picks among the dead latents the same way;
  - each rank decodes its own picks and the partial outputs are summed, an all-reduce of (p, b, d) (`sum_over_ranks`,
    whose backward is the identity: every rank computes the same loss from the same sum);
  - the b_dec gradient is all-reduced (its decoder term is counted on rank 0 only); W_skip's needs nothing: it comes
    from the reconstruction error alone, the same sum on every rank, so every rank makes the same update.
Per step that moves about b x (p d + 2 k N) values (docs/distributed.md). The resume checkpoint is one file per rank
with a manifest (saeflow.training.resume: `write_resume`), readable at any world size and by one process
(`read_resume`); sae.pt is assembled on rank 0 at the end (the Adam moments are dropped first).
"""

import dataclasses
import math

import torch

from saeflow.store import provenance
from saeflow.training import objectives, rates, train
from saeflow.training.adam import Adam
from saeflow.training.archs import Selection
from saeflow.training.loaders import ordered_loader, pairs
from saeflow.training.metrics import MetricsAccumulator
from saeflow.training.objectives import Loss
from saeflow.training.picks import PreActs
from saeflow.training.ranks.dataparallel import global_batch_keep
from saeflow.training.ranks.distributed import Comm
from saeflow.training.resume import read_resume, write_resume
from saeflow.training.sae import SAE, SAEConfig

SEND_CHUNK_BYTES = 64 << 20  # latents sent to rank 0 at a time when sae.pt is assembled


def latent_bounds(d_sae: int, world_size: int) -> list[int]:
    """Rank r holds latents [bounds[r], bounds[r + 1])."""
    return [r * d_sae // world_size for r in range(world_size + 1)]


class LatentShard(SAE):
    """Latents [lo, hi) of an SAE whose architecture is `cfg`: the SAE's parameters, each cut along its latent axis
    (`Arch.latent_axes`: W_enc's columns, b_enc, W_dec's rows and the architecture's own per-latent vectors).

    It keeps SAE's parameterization and row-wise geometry (pre_acts_normed, normalize_decoder, remove_parallel_grad,
    fold_decoder_norms act on its own rows); encoding and decoding need the other ranks (this module's functions).
    """

    def __init__(self, cfg: SAEConfig, lo: int, hi: int):
        torch.nn.Module.__init__(self)
        self.cfg, self.lo, self.hi = cfg, lo, hi
        self.d_model, self.d_sae, self.d_out = cfg.d_model, hi - lo, cfg.d_target
        self.W_enc = torch.nn.Parameter(torch.zeros(cfg.d_model, hi - lo))  # same order as SAE: the Adam state maps
        self.b_enc = torch.nn.Parameter(torch.zeros(hi - lo))
        self.W_dec = torch.nn.Parameter(torch.zeros(hi - lo, self.d_out))
        self.b_dec = torch.nn.Parameter(torch.zeros(self.d_out))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("threshold", torch.zeros(()))
        for name, zeros in self.arch.parameters(hi - lo).items():  # its own, cut as `Arch.latent_axes` says
            self.register_parameter(name, torch.nn.Parameter(zeros))
        if cfg.transcoder:  # whole on every rank, as in SAE after everything else
            self.register_buffer("target_scale", torch.ones(()))
        if cfg.skip:
            self.W_skip = torch.nn.Parameter(torch.zeros(cfg.d_model, self.d_out))


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward, since every rank computes the same loss from the sum."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(partial.clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_ranks(partial: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _SumOverRanks.apply(partial, comm) if comm.distributed else partial


@torch.no_grad()
def global_top(vals_bk: torch.Tensor, gids_bk: torch.Tensor, k: int, comm: Comm) -> torch.Tensor:
    """(b, k) global latent ids of the k largest values per vector among every rank's candidates (b, <= k each)."""
    pad = k - vals_bk.shape[1]
    vals_bk = torch.nn.functional.pad(vals_bk, (0, pad), value=-torch.inf)
    gids_bk = torch.nn.functional.pad(gids_bk.to(torch.int32), (0, pad), value=-1)
    packed = comm.all_gather(torch.cat([vals_bk, gids_bk.view(torch.float32)], 1))  # ids travel as their bits
    vals_bn = packed[:, :, :k].permute(1, 0, 2).reshape(vals_bk.shape[0], -1)
    gids_bn = packed[:, :, k:].contiguous().view(torch.int32).permute(1, 0, 2).reshape(vals_bk.shape[0], -1)
    return gids_bn.gather(1, vals_bn.topk(k, dim=-1, sorted=False).indices).long()


@dataclasses.dataclass(frozen=True)
class ShardCodes:
    """A batch encoded: this rank's dense codes (relu, a BatchTopK run of an earlier trainer), the global TopK picks
    and this rank's part (b, k), or this rank's BatchTopK picks as CSR entries (n,), vector i's from offsets_b[i]."""

    f_bs: torch.Tensor | None
    gids_bk: torch.Tensor | None = None  # the picks' global latent ids
    local_bk: torch.Tensor | None = None  # their ids on this rank (TopK: clamped where another rank's)
    vals_bk: torch.Tensor | None = None  # their values, with gradient (TopK: 0 where another rank's)
    offsets_b: torch.Tensor | None = None  # CSR picks: where each vector's entries start

    def partial(self, shard: LatentShard, n_latents: int | None = None) -> torch.Tensor:
        """This rank's part (b, d) of the decode from the first `n_latents` latents (None: all)."""
        if self.f_bs is None:
            vals_bk = self.vals_bk if n_latents is None else self.vals_bk * (self.gids_bk < n_latents)
            return torch.nn.functional.embedding_bag(self.local_bk, shard.W_dec, self.offsets_b,
                                                     per_sample_weights=vals_bk, mode="sum")  # fmt: skip
        m = shard.d_sae if n_latents is None else min(max(n_latents - shard.lo, 0), shard.d_sae)
        return self.f_bs[:, :m] @ shard.W_dec[:m]

    @torch.no_grad()
    def fired_s(self, shard: LatentShard) -> torch.Tensor:
        if self.f_bs is not None:
            return (self.f_bs > 0).any(0)
        fired_s = torch.zeros(shard.d_sae, dtype=torch.bool, device=shard.W_dec.device)
        fired_s[self.local_bk[self.vals_bk > 0]] = True
        return fired_s

    def activations(self) -> torch.Tensor:
        """The activations as held (dense, or the picks' values): what `Arch.after_step` reads."""
        return self.f_bs if self.f_bs is not None else self.vals_bk

    def dense(self, shard: LatentShard) -> torch.Tensor:
        """(b, s) this rank's codes, dense (validation metrics: codes of a threshold or the TopK picks)."""
        if self.f_bs is not None:
            return self.f_bs
        if self.offsets_b is not None:  # CSR picks: entry j is in the last row starting at or before it
            rows_n = torch.searchsorted(self.offsets_b, torch.arange(self.vals_bk.numel()), right=True) - 1
            return torch.zeros(self.offsets_b.numel(), shard.d_sae, device=self.vals_bk.device).index_put_(
                (rows_n, self.local_bk), self.vals_bk.detach())
        return torch.zeros(self.vals_bk.shape[0], shard.d_sae, device=self.vals_bk.device).scatter_add_(
            1, self.local_bk, self.vals_bk.detach())


def _mine(shard: LatentShard, gids_bk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's picks (bool), their local ids clamped into range)."""
    return (gids_bk >= shard.lo) & (gids_bk < shard.hi), (gids_bk - shard.lo).clamp(0, shard.d_sae - 1)


def encode(shard: LatentShard, pre: PreActs, comm: Comm, batch_size: int, training: bool,
           train_cfg=None, progress: tuple[int, int] | None = None) -> ShardCodes:  # fmt: skip
    """The codes of a batch (its pre-activations `pre`) by the architecture's selection (archs.Selection): TOP_K picks
    globally, BATCH_TOP_K keeps the global top k x batch in training (its own activation, a threshold, in eval), DENSE
    needs nobody (in training with the run's config `train_cfg`: `Arch.train_activate`, e.g. JumpReLU's
    straight-through gradient)."""
    cfg, selection, pre_bs = shard.cfg, shard.arch.selection, pre.pre_bs
    if selection is Selection.DENSE and training and train_cfg is not None:
        return ShardCodes(shard.arch.train_activate(shard, pre_bs, train_cfg, *progress))
    if selection is Selection.DENSE or (selection is Selection.BATCH_TOP_K and not training):
        return ShardCodes(shard.arch.activate(shard, pre_bs))
    if selection is Selection.BATCH_TOP_K:
        codes = objectives.batch_codes(pre, global_batch_keep(pre_bs, cfg.n_kept(batch_size), comm))
        if codes.f_bs is not None:
            return ShardCodes(codes.f_bs)
        return ShardCodes(None, codes.idx_bk + shard.lo, codes.idx_bk, codes.vals_bk, codes.offsets_b)
    k = cfg.n_kept(1)  # of the whole SAE: each rank offers its own best (at most its latents) for the global top k
    with torch.no_grad():
        top = pre_bs.topk(min(k, shard.d_sae), dim=-1, sorted=False)
        gids_bk = global_top(top.values, top.indices + shard.lo, k, comm)
    mine_bk, local_bk = _mine(shard, gids_bk)
    return ShardCodes(None, gids_bk, local_bk, torch.relu(pre.gather(local_bk)) * mine_bk)


def decode(shard: LatentShard, codes: ShardCodes, comm: Comm, prefixes: tuple[int, ...] = ()) -> torch.Tensor:
    """(p, b, d) the reconstructions from each Matryoshka prefix, then from every latent (normalized space)."""
    partial_pbd = torch.stack([codes.partial(shard, m) for m in (*prefixes, None)])
    if comm.is_root:
        partial_pbd = partial_pbd + shard.b_dec
    return sum_over_ranks(partial_pbd, comm)


@torch.no_grad()
def dead_picks(shard: LatentShard, pre_bs: torch.Tensor, dead_s: torch.Tensor, aux_k: int, comm: Comm):
    """AuxK's picks (b, k) as global ids: the dead latents with the highest pre-activations over every rank (the
    unsharded `objectives.pick_dead`); None when no latent is dead anywhere."""
    dead_z = dead_s.nonzero().squeeze(1)
    n_dead = int(comm.all_reduce(torch.tensor([dead_z.numel()], device=pre_bs.device)).item())
    if n_dead == 0:
        return None
    k = min(aux_k, n_dead)
    top = pre_bs.index_select(1, dead_z).topk(min(k, dead_z.numel()), dim=-1, sorted=False)
    return global_top(top.values, dead_z[top.indices] + shard.lo, k, comm)


def aux_loss(shard: LatentShard, pre: PreActs, gids_bk, resid_bd, ghost: bool, comm: Comm) -> torch.Tensor:
    """`objectives.aux_k_loss` with the picked dead latents spread over the ranks (their decodes summed)."""
    mine_bk, local_bk = _mine(shard, gids_bk)
    aux_pre_bk = pre.gather(local_bk)
    vals_bk = (torch.nn.functional.softplus(aux_pre_bk) if ghost else torch.relu(aux_pre_bk)) * mine_bk
    partial_bd = torch.nn.functional.embedding_bag(local_bk, shard.W_dec, per_sample_weights=vals_bk, mode="sum")
    resid_bd = resid_bd.detach()
    err = (sum_over_ranks(partial_bd, comm) - resid_bd).square().sum(-1).mean()
    return err / resid_bd.square().sum(-1).mean().clamp_min(1e-12)


def sharded_loss(trainer: "ShardedTrainer", batch: pairs.Batch) -> Loss:
    """This rank's loss on a batch (an SAE's inputs or a transcoder's pairs): the (replicated) reconstruction and AuxK
    terms, and the architecture's sparsity terms on its own latents (a term made from a whole decode, e.g. Gated's
    auxiliary reconstruction, sums the ranks' parts: `Arch.whole_terms`), so its gradient is the unsharded SAE's
    gradient on its parameters (b_dec's after the all-reduce). A transcoder's latents decode toward its target less
    the skip path (`objectives.latent_target`), as in one process."""
    shard, comm, cfg = trainer.sae, trainer.comm, trainer.cfg
    x_bd, y_bd = pairs.split(batch)
    xn_bd = x_bd * shard.scale
    pre = objectives.pre_acts(cfg, shard, xn_bd)
    pre_bs = pre.pre_bs
    picks_bk = dead_picks(shard, pre_bs, trainer.dead.dead_s, cfg.aux_k, comm)
    codes = encode(shard, pre, comm, x_bd.shape[0], training=True, train_cfg=cfg,
                   progress=(trainer.step, trainer.n_steps))
    recon_pbd = decode(shard, codes, comm, shard.cfg.matryoshka)
    target_bd, yn_bd = objectives.latent_target(shard, xn_bd, y_bd)
    xn_hat_bd = recon_pbd[-1]
    mse = torch.stack([(r_bd - target_bd).square().sum(-1).mean() for r_bd in recon_pbd]).mean()

    def aux_error():
        if picks_bk is None:
            return None
        return aux_loss(shard, pre, picks_bk, target_bd - xn_hat_bd, shard.arch.ghost_aux, comm)

    terms = objectives.loss_terms(cfg, shard, xn_bd, pre_bs, codes.f_bs, mse, aux_error, trainer.step,
                                  trainer.n_steps, dead_s=trainer.dead.dead_s,
                                  target_bd=None if yn_bd is None else target_bd,
                                  over_latents=lambda partial_bd: sum_over_ranks(partial_bd, comm))  # fmt: skip
    return objectives.transcoder_loss({"total": sum(terms.values()), "terms": terms, "xn_hat_bd": xn_hat_bd,
                                       "codes": codes}, target_bd, yn_bd)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The trainer of one latent-sharded run
# ---------------------------------------------------------------------------------------------------------------


class ShardedTrainer(train.Trainer):
    """One run trained latent-sharded. It keeps Trainer's state layout (state_dict, load_state_dict work on the
    shard's tensors) but never builds the whole SAE: its own __init__ makes the shard, its optimizer and counters."""

    def __init__(self, comm: Comm, run, cfg, d_model: int, n_steps: int, device: torch.device,
                 d_out: int | None = None):  # fmt: skip
        self.comm, self.run, self.cfg, self.n_steps, self.device = comm, run, cfg, n_steps, device
        self.writes = comm.is_root
        self.checkpoint = train.Checkpoint(run)
        sae_cfg = cfg.sae_config(d_model, d_out)
        bounds = latent_bounds(sae_cfg.d_sae, comm.world_size)
        self.sae = LatentShard(sae_cfg, bounds[comm.rank], bounds[comm.rank + 1]).to(device).train()
        self.peak_lr = rates.peak_lr(cfg, sae_cfg.d_sae)
        self.opt = Adam(self.sae.parameters(), lr=self.peak_lr, lr_scales=rates.lr_scales(self.sae, cfg))
        self.objective = objectives.Objective(cfg, n_steps)
        self.step, self.pool_rows = 0, None
        self.dead = objectives.DeadLatents(self.sae.d_sae, objectives.dead_after_steps(cfg, n_steps), device)
        self.last: dict = {}
        self.platforms = [provenance.platform()]
        self.started_at = provenance.utc_now()
        self.tracker = train.tracking.Tracker([])

    @property
    def latents(self) -> tuple[int, int]:
        return self.sae.lo, self.sae.hi

    def restore(self) -> bool:
        """Rank 0 cleans the checkpoint directory (Checkpoint.restore); every rank reads its latents."""
        if self.comm.is_root:
            found = self.checkpoint.restore(self)
        found = self.comm.broadcast_object(found if self.comm.is_root else None)
        if found and not self.comm.is_root:
            self.load_state_dict(read_resume(self.run, self.device, self.sae.latent_axes(), self.latents))
        return found

    def save_resume(self) -> None:
        write_resume(self)

    def train_step(self, batch: pairs.Batch) -> None:
        """One step on the whole batch (an SAE's inputs or a transcoder's pairs), held by every rank."""
        comm, shard = self.comm, self.sae
        self.set_lr()
        loss = sharded_loss(self, batch)
        self.opt.zero_grad()
        loss.total.backward()
        if shard.b_dec.grad is None:  # a transcoder's reaches the loss through rank 0's decode only
            shard.b_dec.grad = torch.zeros_like(shard.b_dec)
        comm.all_reduce(shard.b_dec.grad)
        train.adam_step(self.opt, shard, self.cfg)
        with torch.no_grad():
            self.dead.update(loss.codes.fired_s(shard))
            shard.arch.after_step(shard, loss.codes.activations(), self.step,
                                  lambda t, op: comm.all_reduce(t.reshape(1).clone(), op)[0])  # over the ranks' latents
        self.step += 1
        if self.step % train.LOG_EVERY == 0 or self.step == self.n_steps:
            self.last = sharded_record(self, pairs.split(batch)[0], loss)
            if self.writes:
                self.checkpoint.log(self.last)
                self.tracker.log(self.last)

    def finish(self, val) -> dict | None:
        """Validation over every rank's latents (`val`: the validation shards, or a transcoder's pair of them), sae.pt
        assembled and published by rank 0 (Trainer.finish)."""
        val_dir = val[0] if isinstance(val, tuple) else val
        self.sae.eval()
        if not self.sae.arch.unit_decoder_for(self.cfg):
            self.sae.fold_decoder_norms()
        metrics = sharded_validation(self, val)
        self.opt = None  # the Adam moments go before the weights are gathered
        sae = gather_sae(self.sae, self.comm)
        result = None
        if self.writes:
            result = {**train.measured_on(self.cfg, val_dir), "step": self.step, **metrics}
            prov = {**provenance.collect(), "started_at": self.started_at, "finished_at": provenance.utc_now(),
                    "platforms": self.platforms, "mixed_platforms": len(self.platforms) > 1}  # fmt: skip
            self.checkpoint.publish(result, sae, prov)
            self.tracker.close(final=result)
        self.comm.barrier()
        return result


@torch.no_grad()
def sharded_record(trainer: ShardedTrainer, x_bd: torch.Tensor, loss: Loss) -> dict:
    """Trainer._record over every rank's latents (the sparsity terms each rank has a share of, active and dead
    counts summed)."""
    codes = loss.codes
    n_active = (codes.f_bs > 0).sum() if codes.f_bs is not None else (codes.vals_bk > 0).sum()
    shares = [name for name in loss.terms if name not in ("mse", "aux", *trainer.sae.arch.whole_terms)]
    sums = trainer.comm.all_reduce(torch.stack([*(loss.terms[name].double() for name in shares), n_active.double(),
                                                trainer.dead.dead_s.sum().double()]))  # fmt: skip
    terms = {**loss.terms, **dict(zip(shares, sums))}
    sums = sums[len(shares) :]
    return {
        "step": trainer.step,
        "n_vectors": trainer.step * trainer.cfg.batch_size,
        "lr": trainer.opt.param_groups[0]["lr"],
        "loss": float(sum(float(t) for t in terms.values())),
        **{name: float(value) for name, value in terms.items()},
        "nmse": loss.nmse(x_bd * trainer.sae.scale),
        "l0": float(sums[0]) / x_bd.shape[0],
        "n_dead": int(sums[1]),
    }


@torch.no_grad()
def sharded_validation(trainer: ShardedTrainer, val) -> dict:
    """train.validation_metrics with the latents spread over the ranks (every rank reads the same vectors; `val`: the
    validation shards, or a transcoder's pair of them, whose metrics are of its predictions of the targets)."""
    shard, comm, cfg = trainer.sae, trainer.comm, trainer.cfg
    val_dir, target_dir = val if isinstance(val, tuple) else (val, None)
    acc = MetricsAccumulator(shard.d_out, shard.d_sae)  # this rank's latents' firing counts
    loader = ordered_loader(val_dir, target_dir, cfg.layer, cfg.batch_size, cfg.tokens, borrowed=True)  # used at once
    n_max = cfg.n_val_vectors or loader.n_vectors
    for batch in loader:
        x_bd, y_bd = pairs.split(pairs.to_device(pairs.head(batch, n_max - acc.n_vectors), trainer.device))
        xn_bd = x_bd * shard.scale
        codes = encode(shard, PreActs(shard, xn_bd), comm, x_bd.shape[0], training=False)
        yn_hat_bd = decode(shard, codes, comm)[-1]
        skip_bd = shard.skip_normed(xn_bd)
        yn_hat_bd = yn_hat_bd if skip_bd is None else yn_hat_bd + skip_bd
        acc.update(x_bd if y_bd is None else y_bd, yn_hat_bd / shard.out_scale, codes.dense(shard))
        if acc.n_vectors >= n_max:
            break
    loader.close()
    result = acc.result()
    counts = comm.all_reduce(torch.tensor([acc.n_active, result["n_dead"], result["n_dense"]], dtype=torch.int64,
                                          device=trainer.device))  # fmt: skip
    n_active, n_dead, n_dense = (int(c) for c in counts)
    return {**result, "l0": n_active / max(acc.n_vectors, 1), "n_dead": n_dead, "n_dense": n_dense}


def _latent_rows(shard: LatentShard, lo: int, hi: int) -> torch.Tensor:
    """Latents [lo, hi) of this shard (local ids) as rows: each per-latent parameter (`Arch.latent_axes`) with its
    latent axis first, flattened, side by side."""
    parts = [getattr(shard, name).movedim(axis, 0)[lo:hi].reshape(hi - lo, -1)
             for name, axis in shard.latent_axes().items() if axis is not None]  # fmt: skip
    return torch.cat(parts, 1)


@torch.no_grad()
def gather_sae(shard: LatentShard, comm: Comm) -> SAE | None:
    """The whole SAE on rank 0's CPU (None elsewhere): each rank sends its latents (every per-latent parameter's
    entries: `_latent_rows`) in chunks of SEND_CHUNK_BYTES; what is whole (b_dec, the buffers) is rank 0's."""
    cfg = shard.cfg
    axes = shard.latent_axes()
    width = sum(math.prod(n for i, n in enumerate(getattr(shard, name).shape) if i != axis)
                for name, axis in axes.items() if axis is not None)  # fmt: skip
    rows = max(1, SEND_CHUNK_BYTES // (width * 4))
    bounds = latent_bounds(cfg.d_sae, comm.world_size)
    if not comm.is_root:
        for start in range(0, shard.d_sae, rows):
            comm.send(_latent_rows(shard, start, min(start + rows, shard.d_sae)).contiguous(), 0)
        return None
    sae = SAE(cfg)
    for name, tensor in shard.state_dict().items():
        if axes.get(name, None) is None:  # whole on every rank
            getattr(sae, name).copy_(tensor.cpu())
    for r in range(comm.world_size):
        for start in range(bounds[r], bounds[r + 1], rows):
            stop = min(start + rows, bounds[r + 1])
            if r == 0:
                part = _latent_rows(shard, start, stop)
            else:
                part = comm.recv(torch.empty(stop - start, width, device=comm.device), r)
            part, col = part.cpu(), 0
            for name, axis in axes.items():
                if axis is None:
                    continue
                target = getattr(sae, name).movedim(axis, 0)  # a view: writing it writes the parameter
                n = target[0].numel()
                target[start:stop] = part[:, col : col + n].reshape(stop - start, *target.shape[1:])
                col += n
    return sae.eval()
