"""The SAE training loss: reconstruction (with Matryoshka prefixes), the architecture's sparsity terms and AuxK.

`loss_terms` is the one definition of a step's loss terms: the one-process `Objective`, the data-parallel
(training.ranks.dataparallel) and the latent-sharded (training.ranks.sharded) trainers each compute the reconstruction
and the AuxK error their way (over a slice, or over the ranks' latents) and hand them to it, and the architecture
(training/archs: `Arch.sparsity_terms`) adds its own. `Objective(cfg, n_steps)(sae, x_bd, step, dead)` is one step's
loss; the loop (`training.train`) owns the optimizer,
the step and the dead-latent counters. Everything here is in the SAE's normalized space (x * scale). Runs with the
same id train to the same weights, so the operations keep the order they had when the architecture's trainer version
(`Arch.trainer`, in the run id) was last bumped: reordering them moves roundings, which is a change of the training
maths (and calls for a new version of the architectures it touches).

Shapes: b batch, d d_model, s d_sae latents, k active latents per vector, z dead latents (AuxK).
"""

import dataclasses
import math
import typing

import torch

from saeflow.training.archs import Selection, TermInputs, made_since
from saeflow.training.metrics import batch_nmse
from saeflow.training.picks import PreActs
from saeflow.training.sae import SAE
from saeflow.training.specs import TrainConfig

# The selections whose training reads the pre-activations at their picks only (training/picks.py)
PICKED = (Selection.TOP_K, Selection.BATCH_TOP_K)
PICKS_SINCE = "saeflow-train-4"  # the trainer that introduced them (TopK's and BatchTopK's)
DEAD_AFTER_MAX_VECTORS = 10_000_000  # the default dead-latent window's cap (see dead_after_steps)


@dataclasses.dataclass(frozen=True)
class Codes:
    """A batch encoded for training, and what decoding it needs: dense activations, or the picks (latent ids and
    their values, with gradient): k per vector (TopK: (b, k)), or a varying number in CSR rows (a BatchTopK run of its
    trainer now: (n,) entries, vector i's from `offsets_b[i]`)."""

    pre_bs: torch.Tensor  # pre-activations (AuxK picks dead latents among them)
    f_bs: torch.Tensor | None  # activations; None where the picks carry the same information
    vals_bk: torch.Tensor | None  # the picks' activations, with gradient: (b, k), or (n,) with offsets_b
    idx_bk: torch.Tensor | None  # their latent ids
    offsets_b: torch.Tensor | None = None  # CSR picks: where each vector's entries start

    def decode(self, sae: SAE, n_latents: int | None = None) -> torch.Tensor:
        """Reconstruction (b, d) from the first `n_latents` latents (None: all)."""
        if self.idx_bk is not None:  # from the active latents only (the dense decode would dominate the step)
            return sae.decode_sparse_normed(self.vals_bk, self.idx_bk, n_latents, self.offsets_b)
        return sae.decode_normed(self.f_bs, n_latents)

    def activations(self) -> torch.Tensor:
        """The activations as held (dense, or the picks' values): what `Arch.after_step` reads of a step's codes."""
        return self.f_bs if self.f_bs is not None else self.vals_bk

    @torch.no_grad()
    def fired_s(self) -> torch.Tensor:
        """(s,) bool: the latents active on some vector of the batch."""
        if self.idx_bk is None:
            return (self.f_bs > 0).any(0)
        fired_s = torch.zeros(self.pre_bs.shape[-1], dtype=torch.bool, device=self.pre_bs.device)
        fired_s[self.idx_bk[self.vals_bk > 0]] = True
        return fired_s

    @torch.no_grad()
    def l0(self) -> float:
        """Mean active latents per vector."""
        if self.offsets_b is not None:
            return float((self.vals_bk > 0).sum()) / max(self.pre_bs.shape[0], 1)
        active_bk = self.f_bs > 0 if self.idx_bk is None else self.vals_bk > 0
        return float(active_bk.sum(-1).float().mean())


def pre_acts(cfg: TrainConfig, model, xn_bd: torch.Tensor) -> PreActs:
    """The batch's pre-activations for training `model` (an SAE or a latent shard) in the run `cfg`: a TOP_K
    selection reads them through its picks (training/picks.py) in a run made since saeflow-train-4 (PICKS_SINCE); a
    run made before, and every other selection, through autograd."""
    return PreActs(model, xn_bd, picked=model.arch.selection in PICKED and made_since(cfg, PICKS_SINCE))


def batch_codes(pre: PreActs, keep_bs: torch.Tensor) -> Codes:
    """BatchTopK's codes, the activations where `keep_bs` (b, s) marks the kept ones: dense, or (picked) as CSR
    picks whose gradient reaches the encoder from those entries only (training/picks.py)."""
    if not pre.picked:
        relu_bs = torch.relu(pre.pre_bs)
        return Codes(pre.pre_bs, torch.where(keep_bs, relu_bs, torch.zeros_like(relu_bs)), None, None)
    vals_n, cols_n, offsets_b = pre.gather_entries(keep_bs)
    return Codes(pre.pre_bs, None, torch.relu(vals_n), cols_n, offsets_b)


def encode(sae: SAE, xn_bd: torch.Tensor, pre: PreActs, aux_ids_bk: torch.Tensor | None,
           cfg: TrainConfig | None = None, progress: tuple[int, int] | None = None):  # fmt: skip
    """The batch's codes from its normalized inputs `xn_bd` and their pre-activations `pre` (in training, `cfg`
    given: `Arch.train_activate` at `progress`, (step, n_steps); a WHOLE_DICTIONARY selection: `Arch.encode` of the
    inputs), and the pre-activations (b, aux k) of AuxK's picks `aux_ids_bk` (None: no dead latent).

    Selection.TOP_K chooses without gradient and gathers its values and AuxK's in one gather, so the gradient reaching
    the (b, s) pre-activations is built once, not once per term and then summed (the same values, placed the same).
    """
    pre_bs = pre.pre_bs
    if sae.arch.selection is Selection.BATCH_TOP_K and pre.picked:
        aux_pre_bk = None if aux_ids_bk is None else pre.gather(aux_ids_bk)
        return batch_codes(pre, sae.arch.batch_keep(sae, pre_bs)), aux_pre_bk
    if sae.arch.selection is not Selection.TOP_K:
        aux_pre_bk = None if aux_ids_bk is None else pre_bs.gather(1, aux_ids_bk)
        if sae.arch.selection is Selection.WHOLE_DICTIONARY:
            f_bs = sae.arch.encode(sae, xn_bd)
        else:
            f_bs = sae.activate(pre_bs) if cfg is None else sae.arch.train_activate(sae, pre_bs, cfg, *progress)
        return Codes(pre_bs, f_bs, None, None), aux_pre_bk
    n_kept = sae.cfg.n_kept(1)
    with torch.no_grad():
        idx_bk = pre_bs.topk(n_kept, dim=-1, sorted=False).indices
    if aux_ids_bk is None:
        return Codes(pre_bs, None, torch.relu(pre.gather(idx_bk)), idx_bk), None
    vals_bk, aux_pre_bk = pre.gather(torch.cat([idx_bk, aux_ids_bk], 1)).split([n_kept, aux_ids_bk.shape[1]], 1)
    return Codes(pre_bs, None, torch.relu(vals_bk), idx_bk), aux_pre_bk  # no dense (b, s) codes: never needed


def reconstruction_loss(sae: SAE, codes: Codes, xn_bd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error per vector, averaged over the Matryoshka prefixes and the full dictionary; and x_hat (b, d).

    Each prefix must reconstruct on its own, so the first latents learn the coarse directions.
    """
    xn_hat_bd = codes.decode(sae)
    recon = [(codes.decode(sae, m) - xn_bd).square().sum(-1).mean() for m in sae.cfg.matryoshka]
    mse = torch.stack([*recon, (xn_hat_bd - xn_bd).square().sum(-1).mean()]).mean()
    return mse, xn_hat_bd


def one_process(t: torch.Tensor, op: str) -> torch.Tensor:
    """`Arch.after_step`'s reduction over the ranks when there is one: the tensor itself."""
    return t


def dead_after_steps(cfg: TrainConfig, n_steps: int) -> int:
    """Steps a latent must stay silent to count as dead: `dead_after_vectors` in steps, or by default a tenth of
    the run (so AuxK can revive latents in short runs too), at most 10M vectors (long runs: OpenAI's window)."""
    if cfg.dead_after_vectors is not None:
        return max(1, -(-cfg.dead_after_vectors // cfg.batch_size))
    return max(1, min(n_steps // 10, -(-DEAD_AFTER_MAX_VECTORS // cfg.batch_size)))


STATE_KEYS = ("since_fired_s", "fired_steps_s", "rare_s")  # DeadLatents.state's, each with one entry per latent


class DeadLatents:
    """Steps since each latent last fired; latents silent for `dead_steps` steps are dead and feed AuxK.

    With `rare_rate` (a firing rate per vector), a latent that fired in fewer of a window's `dead_steps` batches of
    `batch_size` vectors than one firing at that rate would (1 - exp(-batch_size x rate) of them) is dead too, from
    the end of that window to the end of the next. The trainers give `update` the latents that fired on some vector of
    the (global) batch, so a batch count is the estimate every trainer has, whatever its split of the batch."""

    def __init__(self, d_sae: int, dead_steps: int, device: torch.device, rare_rate: float | None = None,
                 batch_size: int = 1):  # fmt: skip
        self.dead_steps = dead_steps
        self.since_fired_s = torch.zeros(d_sae, dtype=torch.int64, device=device)
        self.rare_steps = None if rare_rate is None else -math.expm1(-batch_size * rare_rate) * dead_steps
        if self.rare_steps is not None:
            self.fired_steps_s = torch.zeros(d_sae, dtype=torch.int64, device=device)  # in the window so far
            self.rare_s = torch.zeros(d_sae, dtype=torch.bool, device=device)  # the last whole window's verdict
        self.window_step = 0

    @property
    def dead_s(self) -> torch.Tensor:
        silent_s = self.since_fired_s >= self.dead_steps
        return silent_s if self.rare_steps is None else silent_s | self.rare_s

    def update(self, fired_s: torch.Tensor) -> None:
        self.since_fired_s += 1
        self.since_fired_s[fired_s] = 0
        if self.rare_steps is None:
            return
        self.fired_steps_s += fired_s
        self.window_step += 1
        if self.window_step == self.dead_steps:
            self.rare_s = self.fired_steps_s < self.rare_steps
            self.fired_steps_s.zero_()
            self.window_step = 0

    def state(self) -> dict:
        """Its tensors for resume.pt (STATE_KEYS: only since_fired_s without a rarity, as before rarity existed)."""
        if self.rare_steps is None:
            return {"since_fired_s": self.since_fired_s}
        return {"since_fired_s": self.since_fired_s, "fired_steps_s": self.fired_steps_s, "rare_s": self.rare_s}

    def load_state(self, state: dict, step: int) -> None:
        """`state`'s tensors (`state()`'s keys) at training step `step` (where in its window the run stopped)."""
        for name, t in self.state().items():
            t.copy_(state[name])
        self.window_step = step % self.dead_steps


def dead_latents(cfg: TrainConfig, arch, d_sae: int, n_steps: int, device: torch.device) -> DeadLatents:
    """The run `cfg`'s dead-latent counter: with rare latents counted dead at `arch.rare_rate` (None: none)."""
    return DeadLatents(d_sae, dead_after_steps(cfg, n_steps), device, arch.rare_rate(cfg, d_sae), cfg.batch_size)


@torch.no_grad()
def pick_dead(pre_bs: torch.Tensor, dead_s: torch.Tensor, aux_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AuxK's choice: the dead latents (z,) and, per vector, the `aux_k` of them with the highest pre-activations
    (b, k: positions among the dead); None when no latent is dead. The search runs on the dead latents' columns
    only, so it costs in proportion to how many are dead."""
    dead_z = dead_s.nonzero().squeeze(1)
    if dead_z.numel() == 0:
        return dead_z, None
    return dead_z, pre_bs.index_select(1, dead_z).topk(min(aux_k, dead_z.numel()), dim=-1, sorted=False).indices


def aux_k_loss(
    sae: SAE, aux_pre_bk: torch.Tensor, dead_z: torch.Tensor, pick_bk: torch.Tensor, resid_bd: torch.Tensor,
    ghost: bool = False, energy: torch.Tensor | None = None,
) -> torch.Tensor:
    """AuxK: the picked dead latents (`pick_dead`; their pre-activations `aux_pre_bk`) reconstruct the residual, so
    dead latents get gradient again.

    Normalized by the residual's energy, so the weight `aux_alpha` does not depend on how well the SAE does.
    `ghost` (ReLU SAEs): the dead latents act through softplus instead of ReLU. A ReLU latent is dead because its
    pre-activation is negative on every input, where ReLU passes no gradient at all; softplus passes a small one
    of the right sign, which Adam (a step of about lr whatever the gradient's size) turns into a real move
    (Anthropic's ghost grads use exp the same way). The codes decode over the dead latents' rows with one dense
    product, cheaper than a sparse decode of aux_k per vector. `energy`: the residual's mean squared norm over the
    whole batch when this is part of it (data-parallel training: training.ranks.dataparallel); None: this batch's own.
    """
    vals_bk = torch.nn.functional.softplus(aux_pre_bk) if ghost else torch.relu(aux_pre_bk)
    codes_bz = vals_bk.new_zeros(vals_bk.shape[0], dead_z.numel()).scatter(1, pick_bk, vals_bk)
    resid_bd = resid_bd.detach()
    err = (codes_bz @ sae.W_dec.index_select(0, dead_z) - resid_bd).square().sum(-1).mean()
    energy = resid_bd.square().sum(-1).mean() if energy is None else energy
    return err / energy.clamp_min(1e-12)


@dataclasses.dataclass(frozen=True)
class Loss:
    """One step's loss and what the step logs and updates from it."""

    total: torch.Tensor  # what the optimizer minimizes: the sum of `terms`
    terms: dict[str, torch.Tensor]  # Arch.logged_terms: mse, the architecture's sparsity terms, aux; weights applied
    xn_hat_bd: torch.Tensor  # the full reconstruction (a transcoder's: of its target less the skip path)
    codes: Codes  # the activations (firing counts, threshold statistics, metrics)
    yn_bd: torch.Tensor | None = None  # a transcoder's target, normalized; None: an SAE, whose target is its input
    yn_hat_bd: torch.Tensor | None = None  # its whole prediction, skip path included

    def nmse(self, xn_bd: torch.Tensor) -> float:
        """The batch's NMSE (progress and metrics.jsonl): of the input's reconstruction, or of a transcoder's target."""
        if self.yn_bd is None:
            return batch_nmse(xn_bd, self.xn_hat_bd)
        return batch_nmse(self.yn_bd, self.yn_hat_bd)


def latent_target(sae: SAE, xn_bd: torch.Tensor, y_bd: torch.Tensor | None) -> tuple:
    """(what the latents decode toward, the normalized target): the input itself for an SAE (y_bd None: no target),
    a transcoder's normalized target less its skip path (whose gradient reaches W_skip through this difference, the
    same loss as adding the path to the prediction)."""
    if y_bd is None:
        return xn_bd, None
    yn_bd = y_bd * sae.target_scale
    skip_bd = sae.skip_normed(xn_bd)
    return (yn_bd if skip_bd is None else yn_bd - skip_bd), yn_bd


def transcoder_loss(loss_args: dict, recon_bd: torch.Tensor, yn_bd: torch.Tensor | None) -> Loss:
    """A Loss (`loss_args`: total, terms, xn_hat_bd, codes) with a transcoder's target and whole prediction."""
    loss = Loss(**loss_args)
    if yn_bd is None:
        return loss
    return dataclasses.replace(loss, yn_bd=yn_bd, yn_hat_bd=yn_bd - (recon_bd - loss.xn_hat_bd))


def loss_terms(
    cfg: TrainConfig, model, xn_bd: torch.Tensor, pre_bs: torch.Tensor, f_bs: torch.Tensor | None, mse: torch.Tensor,
    aux_error: typing.Callable[[], torch.Tensor | None], step: int, n_steps: int, weight: float | None = None,
    dead_s: torch.Tensor | None = None, target_bd: torch.Tensor | None = None,
    over_latents: typing.Callable | None = None, batch_mean: typing.Callable | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The loss terms of one step, the one definition every trainer uses: `mse` (the Matryoshka reconstruction
    error), the architecture's sparsity terms (`Arch.sparsity_terms`: ReLU's L1, ...), then AuxK's error
    (`aux_error()`, None when no latent is dead) weighted by `aux_alpha`; each times `weight` when given (a
    data-parallel rank's share of the batch). `model` is the SAE or a rank's latent shard (its terms cover its own
    latents; `over_latents` sums a partial decode over the ranks: `TermInputs.over_latents`). `target_bd`: a
    transcoder's (`latent_target`), which an architecture's own reconstruction terms aim at (without gradient: the
    skip path learns from `mse`); `batch_mean`: `TermInputs.batch_mean` over a data-parallel batch. The terms are built
    in this order, which fixes the order their gradients are summed
    in."""

    def weighted(term: torch.Tensor) -> torch.Tensor:
        return term if weight is None else term * weight

    terms = {"mse": weighted(mse)}
    target_bd = None if target_bd is None else target_bd.detach()
    batch = TermInputs(cfg, model, xn_bd, pre_bs, f_bs, step, n_steps, dead_s, target_bd)
    if over_latents is not None:
        batch = dataclasses.replace(batch, over_latents=over_latents)
    if batch_mean is not None:
        batch = dataclasses.replace(batch, batch_mean=batch_mean)
    for name, term in model.arch.sparsity_terms(batch).items():
        terms[name] = weighted(term)
    terms["aux"] = torch.zeros((), device=xn_bd.device)
    aux = aux_error()
    if aux is not None:
        terms["aux"] = weighted(cfg.aux_alpha * aux)
    return terms


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss of one run on one process: its architecture's sparsity terms on top of the Matryoshka reconstruction."""

    cfg: TrainConfig  # what loss_terms and the architecture read (aux_k, aux_alpha, l1_coeff, ...)
    n_steps: int  # of the whole run (warm-ups are fractions of it)

    def encode(self, sae: SAE, xn_bd: torch.Tensor, pre: PreActs, aux_ids_bk: torch.Tensor | None, step: int):
        """`encode` in training at `step`, with this run's SAE and config."""
        return encode(sae, xn_bd, pre, aux_ids_bk, self.cfg, (step, self.n_steps))

    def __call__(self, sae: SAE, x_bd: torch.Tensor, step: int, dead: DeadLatents, y_bd: torch.Tensor | None = None
                 ) -> Loss:  # fmt: skip
        """One step's loss on inputs `x_bd` (and a transcoder's targets `y_bd`, raw)."""
        cfg = self.cfg
        xn_bd = x_bd * sae.scale
        pre = pre_acts(cfg, sae, xn_bd)
        pre_bs = pre.pre_bs
        dead_z, pick_bk = pick_dead(pre_bs, dead.dead_s, cfg.aux_k)
        codes, aux_pre_bk = self.encode(sae, xn_bd, pre, None if pick_bk is None else dead_z[pick_bk], step)
        recon_bd, yn_bd = latent_target(sae, xn_bd, y_bd)
        mse, xn_hat_bd = reconstruction_loss(sae, codes, recon_bd)

        def aux_error():
            if pick_bk is None:
                return None
            return aux_k_loss(sae, aux_pre_bk, dead_z, pick_bk, recon_bd - xn_hat_bd, sae.arch.ghost_aux)

        terms = loss_terms(cfg, sae, xn_bd, pre_bs, codes.f_bs, mse, aux_error, step, self.n_steps, None, dead.dead_s,
                           None if yn_bd is None else recon_bd)  # fmt: skip
        return transcoder_loss({"total": sum(terms.values()), "terms": terms, "xn_hat_bd": xn_hat_bd, "codes": codes},
                               recon_bd, yn_bd)  # fmt: skip
