"""Data-parallel training: every rank holds the whole SAE and trains on its slice of each global batch.

Each rank receives only its slice of each batch (`DistributedShuffledLoader.iter_slices`) and computes its share of
the global batch's loss (a mean over the slice, weighted by slice / batch), so the sum over ranks is the one-process
loss and the all-reduced gradient sums are its gradient. What depends on the whole batch is computed over it:
BatchTopK keeps the top k x batch activations of the global batch (each rank's top candidates are all-gathered), AuxK
divides by the global residual energy, a latent fired if it fired on any rank (dead-latent counters), the BatchTopK
inference threshold takes the global minimum kept activation, the logged NMSE divides by the global batch's variance
(from summed moments), and the decoder bias starts at the mean of the global initialization sample (which every rank
holds whole). The replicas therefore stay identical, bit for bit, and rank 0 writes the run's files. Against one
process the sums are taken in another order: not bitwise, see docs/distributed.md for what holds.
"""

import torch

from saeflow.training import objectives, resume, train
from saeflow.training.archs import Selection
from saeflow.training.loaders import pairs
from saeflow.training.objectives import Loss
from saeflow.training.ranks.distloader import slice_bounds
from saeflow.training.ranks.distributed import Comm
from saeflow.training.sae import SAE


def rank_slice(batch_size: int, comm: Comm) -> slice:
    """Rank r's rows of a global batch: [B r/N, B (r+1)/N) (the rows `DistributedShuffledLoader.iter_slices` gives)."""
    return slice(*slice_bounds(batch_size, comm.rank, comm.world_size))


@torch.no_grad()
def global_kth_largest(vals_n: torch.Tensor, n_keep: int, comm: Comm) -> torch.Tensor:
    """The `n_keep`-th largest value of every rank's `vals_n` together: each rank's top candidates, all-gathered."""
    local = vals_n.topk(min(n_keep, vals_n.numel()), sorted=False).values
    padded = torch.full((n_keep,), -torch.inf, dtype=vals_n.dtype, device=vals_n.device)
    padded[: local.numel()] = local
    return comm.all_gather(padded).flatten().topk(n_keep, sorted=False).values.min()


@torch.no_grad()
def global_batch_keep(pre_bs: torch.Tensor, n_keep: int, comm: Comm) -> torch.Tensor:
    """BatchTopK over the global batch, (b, s) bool: the activations at or above the `n_keep`-th largest of all
    ranks' (SAEConfig.n_kept of the global batch; with a tie exactly at that value, all of them: one process keeps an
    arbitrary subset of the tied)."""
    relu_bs = torch.relu(pre_bs)
    return relu_bs >= global_kth_largest(relu_bs.flatten(), n_keep, comm)


def data_parallel_loss(
    objective: objectives.Objective, sae: SAE, x_bd: torch.Tensor, batch_size: int, step: int,
    dead: objectives.DeadLatents, comm: Comm, y_bd: torch.Tensor | None = None,
) -> Loss:  # fmt: skip
    """This rank's share of the global batch's loss (`objectives.Objective` on the slice, each term weighted by
    slice / batch; a transcoder's targets `y_bd`). Every rank makes the same collective calls, an empty slice
    included."""
    cfg, n = objective.cfg, x_bd.shape[0]
    xn_bd = x_bd * sae.scale
    pre = objectives.pre_acts(cfg, sae, xn_bd)
    pre_bs = pre.pre_bs
    dead_z, pick_bk = objectives.pick_dead(pre_bs, dead.dead_s, cfg.aux_k)
    aux_ids_bk = None if pick_bk is None else dead_z[pick_bk]
    if sae.arch.selection is Selection.BATCH_TOP_K:
        codes = objectives.batch_codes(pre, global_batch_keep(pre_bs, sae.cfg.n_kept(batch_size), comm))
        aux_pre_bk = None if aux_ids_bk is None else pre.gather(aux_ids_bk)
    else:
        codes, aux_pre_bk = objective.encode(sae, xn_bd, pre, aux_ids_bk, step)
    recon_bd, yn_bd = objectives.latent_target(sae, xn_bd, y_bd)
    if n == 0:  # a last batch smaller than the world: no rows here, but the same collectives, in the same order
        for _ in range(sae.arch.batch_means(cfg) + (pick_bk is not None)):  # the sparsity terms', then AuxK's
            comm.all_reduce(torch.zeros(1, device=x_bd.device))
        zero = sum(p.sum() for p in sae.parameters()) * 0.0
        empty = {"total": zero, "terms": dict.fromkeys(sae.arch.logged_terms(cfg), zero),
                 "xn_hat_bd": codes.decode(sae), "codes": codes}  # fmt: skip
        return objectives.transcoder_loss(empty, recon_bd, yn_bd)
    mse, xn_hat_bd = objectives.reconstruction_loss(sae, codes, recon_bd)

    def aux_error():
        if pick_bk is None:
            return None
        resid_bd = recon_bd - xn_hat_bd
        energy = comm.all_reduce(resid_bd.detach().square().sum().reshape(1))[0] / batch_size
        return objectives.aux_k_loss(sae, aux_pre_bk, dead_z, pick_bk, resid_bd, sae.arch.ghost_aux, energy)

    def batch_mean(value_b):
        return comm.all_reduce(value_b.detach().sum().reshape(1))[0] / batch_size

    terms = objectives.loss_terms(cfg, sae, xn_bd, pre_bs, codes.f_bs, mse, aux_error, step, objective.n_steps,
                                  weight=n / batch_size, dead_s=dead.dead_s,
                                  target_bd=None if yn_bd is None else recon_bd, batch_mean=batch_mean)  # fmt: skip
    return objectives.transcoder_loss({"total": sum(terms.values()), "terms": terms, "xn_hat_bd": xn_hat_bd,
                                       "codes": codes}, recon_bd, yn_bd)  # fmt: skip


@torch.no_grad()
def global_record(trainer, x_part: torch.Tensor, batch_size: int, xn_hat_part: torch.Tensor, loss: Loss,
                  n_active) -> dict:  # fmt: skip
    """A metrics.jsonl record over the global batch: loss terms, counts, the squared error and the batch's sums
    (of x and of |x|^2, for its variance; a transcoder's: of its target) summed over the ranks in one all-reduce
    (each rank holds its slice)."""
    comm, sae = trainer.comm, trainer.sae
    if loss.yn_bd is None:
        xn_bd = (x_part * sae.scale).double()
    else:  # a transcoder: the NMSE of its target
        xn_bd, xn_hat_part = loss.yn_bd.detach().double(), loss.yn_hat_bd
    err = (xn_bd - xn_hat_part.double()).square().sum()
    sums = torch.cat([torch.stack([loss.total.double(), *(t.double() for t in loss.terms.values()),
                                   torch.as_tensor(n_active, dtype=torch.float64, device=x_part.device), err,
                                   xn_bd.square().sum()]), xn_bd.sum(0)])  # fmt: skip
    sums = comm.all_reduce(sums)
    n_terms = len(loss.terms)
    n_active, err, sq = sums[1 + n_terms], sums[2 + n_terms], sums[3 + n_terms]
    var = sq - sums[4 + n_terms :].square().sum() / batch_size
    return {
        "step": trainer.step,
        "n_vectors": trainer.step * trainer.cfg.batch_size,
        "lr": trainer.opt.param_groups[0]["lr"],
        "loss": float(sums[0]),
        **{name: float(value) for name, value in zip(loss.terms, sums[1 : 1 + n_terms])},
        "nmse": float(err / var) if var > 0 else float("nan"),
        "l0": float(n_active) / batch_size,
        "n_dead": trainer.n_dead(),
    }


class DataParallelTrainer(train.Trainer):
    """A run trained data-parallel: the same SAE and Adam state on every rank; rank 0 writes its files."""

    def __init__(self, comm: Comm, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = comm
        self.writes = comm.is_root

    def n_dead(self) -> int:
        return int(self.dead.dead_s.sum())

    def restore(self) -> bool:
        """Rank 0 cleans the run's checkpoint directory and reads resume.pt; then every rank loads the same state."""
        if self.comm.is_root:
            found = self.checkpoint.restore(self)
        found = self.comm.broadcast_object(found if self.comm.is_root else None)
        if found and not self.comm.is_root:
            self.load_state_dict(resume.read_resume(self.run, self.device, self.sae.latent_axes()))
        return found

    def save_resume(self) -> None:
        if self.writes:
            self.checkpoint.save(self.state_dict())

    def train_step(self, batch) -> None:
        """One step on the global batch (an SAE's inputs or a transcoder's pairs) held whole by every rank
        (`train_slice` on this rank's rows)."""
        n = pairs.n_rows(batch)
        part = rank_slice(n, self.comm)
        self.train_slice(tuple(t[part] for t in batch) if isinstance(batch, tuple) else batch[part], n)

    def train_slice(self, part, batch_size: int) -> None:
        """One step on a global batch of `batch_size` rows, of which this rank holds and computes `part` (inputs, or
        a transcoder's (inputs, targets))."""
        comm, sae = self.comm, self.sae
        x_part, y_part = pairs.split(part)
        self.set_lr()
        loss = data_parallel_loss(self.objective, sae, x_part, batch_size, self.step, self.dead, comm, y_part)
        self.opt.zero_grad()
        loss.total.backward()
        for param in sae.parameters():
            if param.grad is None:  # the loss did not reach it (mp's tied encoder without dead latents): every rank
                param.grad = torch.zeros_like(param)  # all-reduces the same tensors, an empty slice's zeros included
            comm.all_reduce(param.grad)
        train.adam_step(self.opt, sae, self.cfg)
        with torch.no_grad():
            fired_s = comm.all_reduce(loss.codes.fired_s().to(torch.uint8), "max").bool()
            self.dead.update(fired_s)
            sae.arch.after_step(sae, loss.codes.activations(), self.step, self._global)
        self.step += 1
        if self.step % train.LOG_EVERY == 0 or self.step == self.n_steps:
            n_active = (loss.codes.f_bs > 0).sum() if loss.codes.idx_bk is None else (loss.codes.vals_bk > 0).sum()
            self.last = global_record(self, x_part, batch_size, loss.xn_hat_bd, loss, n_active)
            if self.writes:
                self.checkpoint.log(self.last)
                self.tracker.log(self.last)

    def _global(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """A tensor reduced elementwise over the ranks by `op` (statistics of the global batch: `Arch.after_step`)."""
        return self.comm.all_reduce(value.reshape(-1).clone(), op).reshape(value.shape)

    def finish(self, val_dir) -> dict | None:
        """Rank 0 validates and publishes (the others hold the same SAE and wait)."""
        result = super().finish(val_dir) if self.writes else None
        self.comm.barrier()
        return result
