"""JumpReLU SAE (Rajamanoharan et al. 2024, "Jumping Ahead"; Gemma Scope): each latent fires above its own learned
threshold theta_s = exp(log_threshold_s), a parameter.

    f_bs = pre_bs * H(pre_bs - theta_s)           (H the Heaviside step; inference: relu(pre) * H, as SAELens)

The step has no gradient, so training uses straight-through estimators with a rectangle kernel of width `bandwidth`
(eps): d f / d theta = -(theta / eps) rect((pre - theta) / eps), d H / d theta = -(1 / eps) rect((pre - theta) / eps),
with rect(u) = 1 on (-1/2, 1/2); the pre-activations get f's ordinary gradient (H where the latent fires). These are
SAELens 6.54.12's `JumpReLU` and `Step` functions (`jumprelu_ste_to_input: false`, DeepMind's choice). Sparsity,
`jumprelu_loss`:

    target (the default)  target_l0_coeff x ramp x k x (L0 / k - 1)^2,  L0 = mean_b sum_s H(pre - theta)
    step (DeepMind's L0)  l0_coeff x ramp x mean_b sum_s H(pre - theta)
    tanh (Anthropic, Jan 2025)  tanh_coeff x ramp x mean_b sum_s tanh(tanh_scale x f ||W_dec[s]||)
                          + pre_act_coeff x mean_b sum_s relu(theta - pre) x dead_s x ||W_dec[s]||

(the pre-activation loss pulls dead latents' pre-activations up to their thresholds; ramp: `sparsity_warmup_frac`).
The first `topk_warmup_frac` of the steps train as TopK and calibrate the thresholds to TopK's firing rates
(`topk_warmup`, `calibrated_thresholds`): issue 42's planted grid and MiniLM, docs/training.md.
Decoder rows are unit vectors (both penalties ignore a row's norm or weigh it in). The L0 is not fixed: each vector
keeps what clears the thresholds, so metrics report the mean L0 over vectors (and inference its spread). The
threshold is a log parameter (DeepMind's): positive by construction, and Adam moves it by about its learning rate
relatively per step. At the run's lr that was too slow for a short run to find its thresholds (83% of a planted
dictionary, README), so the thresholds train at `threshold_lr_scale` times it (`lr_scales`; 4: 89%).
"""

import math

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.training.archs.base import Arch, Selection, TermInputs, torch
from saeflow.training.archs.relu import l1_ramp

# The keys only each sparsity loss reads (`JumpReLU.hyper`'s others every loss reads)
LOSS_KEYS = config.by_enum({"step": ("l0_coeff",), "tanh": ("tanh_coeff", "tanh_scale", "pre_act_coeff"),
                            "target": ("target_l0_coeff",)}, "sae_spec", "jumprelu_loss")  # fmt: skip
# The TopK warm-up's calibration: each step moves every log threshold this far toward the one that fires its latent
# as often as TopK kept it in the batch (an exponential moving average over the last few warm-up steps)
CALIBRATION_RATE = 0.2
# The pre-activation loss's weight on the dead and rare latents (archs.base.RARE_SHARE) of a run that revives them
# (`Arch.revives_rare`, `revival_pull`; issue 42, docs/training.md "Rare latents"): at d 128 and 256, 8 active, Exp(1),
# held-out silent latents 1.6-2.9% -> at most 1.0%; 0.1 left JumpReLU at d 256 with 1.3%, a pull on the thresholds
# alone (no encoder gradient) 1.6-2.0%, the rarity without the loss 2.0%.
REVIVE_COEFF = 0.3
# Bisection steps for that threshold, in log theta over [MIN_THRESHOLD, the column's largest pre-activation]: within
# 0.1% of it up to a range of 1e6 (24 steps on a linear scale, float32's precision, took 1.6x as long)
CALIBRATION_HALVINGS = 14
MIN_THRESHOLD = 1e-3  # a latent TopK kept whenever positive gets this threshold (thresholds are positive)
CALIBRATION_ATTR = "_warmup_batch"  # where a warm-up step leaves (pre_bs, count_s) for `after_step` (not state)


def reads_whole_vectors(cfg) -> bool:
    """The run's training reads every latent of a vector, and k: the target loss (L0 over all of them) or the TopK
    warm-up (each vector's k largest)."""
    return cfg.jumprelu_loss == "target" or cfg.topk_warmup_frac > 0


def topk_warmup_steps(cfg, n_steps: int) -> int:
    """The steps at the start of a run whose codes are each vector's k largest (`topk_warmup_frac`)."""
    return int(cfg.topk_warmup_frac * n_steps)


def topk_warmup(sae, values_bs, k: int):
    """A TopK step: each vector keeps its k largest values, pre-activations (JumpReLU) or magnitudes (Gated), with
    TopK's gradient. It leaves the batch and how often TopK kept each latent in it for `after_step`, which moves the
    thresholds toward the ones that fire every latent as often (`calibration`), so that when the thresholds take
    over the firing rates hold."""
    with torch.no_grad():
        idx_bk = values_bs.topk(min(k, values_bs.shape[1]), dim=-1, sorted=False).indices
        keep_bs = torch.zeros_like(values_bs).scatter_(1, idx_bk, 1.0)
        setattr(sae, CALIBRATION_ATTR, (values_bs.detach(), keep_bs.sum(0)))
    return torch.relu(values_bs) * keep_bs


def calibration(sae, reduce):
    """After a TopK warm-up step (`topk_warmup`), each latent's threshold on the values it ranked that fires it as
    often as TopK kept it in the global batch (`calibrated_thresholds`); None after any other step."""
    warmup_batch = sae.__dict__.pop(CALIBRATION_ATTR, None)
    return None if warmup_batch is None else calibrated_thresholds(*warmup_batch, reduce)


def whole_vector_refusal(cfg, arch: str, loss_key: str, others: str) -> str:
    """Why a run whose training reads every latent of a vector (the TopK warm-up or the target loss) does not train
    on a latent shard, in one line naming the key to change (`Arch.mode_refusal`)."""
    if cfg.topk_warmup_frac > 0:
        return (f"{arch}'s TopK warm-up (topk_warmup_frac {cfg.topk_warmup_frac}) picks each vector's k largest "
                "of every latent, which a latent shard does not hold, so it does not train with parallel: "
                "latents (set topk_warmup_frac: 0 for it, or parallel: sweep or data)")
    return (f"{arch}'s target loss steers each vector's L0 over every latent, which a latent shard does not hold, "
            f"so it does not train with parallel: latents (set {loss_key}: {others} for it, or parallel: sweep or "
            "data)")


def check_mechanism(cfg, keys: tuple[str, ...]) -> None:
    """Refuse, as SaeflowError "<key>: <problem>", a value of the straight-through, warm-up and target-loss keys
    among `keys` that the mechanism cannot train with (JumpReLU's and Gated's `Arch.check`)."""
    if "bandwidth" in keys and not cfg.bandwidth > 0:
        raise SaeflowError(f"bandwidth: the straight-through kernel's width must be positive, got {cfg.bandwidth}")
    if "topk_warmup_frac" in keys and not 0 <= cfg.topk_warmup_frac < 1:
        raise SaeflowError(f"topk_warmup_frac: the TopK warm-up's share of the steps is in [0, 1), got "
                           f"{cfg.topk_warmup_frac}")  # fmt: skip
    if "target_l0_coeff" in keys and not cfg.target_l0_coeff > 0:
        raise SaeflowError(f"target_l0_coeff: the target loss's weight must be positive, got {cfg.target_l0_coeff}")


def target_l0(l0_b, batch: TermInputs):
    """The target loss, target_l0_coeff x k x (L0 / k - 1)^2 of the whole batch's mean L0 (`TermInputs.batch_mean`:
    the same on every data-parallel rank), as a sum over this rank's vectors. `l0_b`: each vector's L0 through the
    step's straight-through estimator (`Step`)."""
    cfg = batch.cfg
    off = batch.batch_mean(l0_b) / cfg.k - 1
    return cfg.target_l0_coeff * (cfg.k * off.square() + 2 * off * (l0_b.mean() - l0_b.mean().detach()))


def calibrated_thresholds(pre_bs, count_s, reduce):
    """(s,): each latent's threshold, at least MIN_THRESHOLD, that it clears on no more of the batch's vectors than
    `count_s` (summed over the ranks' slices by `reduce`, as `Arch.after_step` gives it) and within 0.1% of the
    smallest such one, found by halving log theta's range. Every test is a count of vectors, an integer, so any split
    of the batch over ranks finds the bytes one process finds."""
    count_s = reduce(count_s.clone(), "sum")
    top_s = pre_bs.amax(0) if pre_bs.shape[0] else pre_bs.new_full(pre_bs.shape[1:], MIN_THRESHOLD)  # an empty slice
    log_hi_s = reduce(top_s.clamp(min=MIN_THRESHOLD), "max").log()  # cleared by no vector
    log_lo_s = torch.full_like(log_hi_s, math.log(MIN_THRESHOLD))
    for _ in range(CALIBRATION_HALVINGS):
        log_mid_s = (log_lo_s + log_hi_s) / 2
        over_s = reduce(torch.count_nonzero(pre_bs > log_mid_s.exp(), dim=0).to(pre_bs.dtype), "sum") > count_s
        log_lo_s, log_hi_s = torch.where(over_s, log_mid_s, log_lo_s), torch.where(over_s, log_hi_s, log_mid_s)
    return log_hi_s.exp()


def _rectangle(u):
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class _JumpReLU:
    """f = pre * H(pre - theta), straight-through to theta (a torch.autograd.Function, made on first use)."""

    fn = None

    @classmethod
    def apply(cls, pre_bs, theta_s, bandwidth: float):
        if cls.fn is None:
            cls.fn = _functions()[0]
        return cls.fn.apply(pre_bs, theta_s, bandwidth)


class Step:
    """H(pre - theta), straight-through to theta."""

    fn = None

    @classmethod
    def apply(cls, pre_bs, theta_s, bandwidth: float):
        if cls.fn is None:
            cls.fn = _functions()[1]
        return cls.fn.apply(pre_bs, theta_s, bandwidth)


def _functions():
    """The two autograd functions (built when training first needs them: torch is not imported at parse time)."""
    autograd = torch.autograd

    class JumpReLUFn(autograd.Function):
        @staticmethod
        def forward(ctx, pre_bs, theta_s, bandwidth):
            ctx.save_for_backward(pre_bs, theta_s)
            ctx.bandwidth = bandwidth
            return pre_bs * (pre_bs > theta_s).to(pre_bs.dtype)

        @staticmethod
        def backward(ctx, grad_bs):
            pre_bs, theta_s = ctx.saved_tensors
            eps = ctx.bandwidth
            ste_bs = (theta_s / eps) * _rectangle((pre_bs - theta_s) / eps) * grad_bs
            return (pre_bs > theta_s) * grad_bs, torch.sum(-ste_bs, dim=0), None

    class StepFn(autograd.Function):
        @staticmethod
        def forward(ctx, pre_bs, theta_s, bandwidth):
            ctx.save_for_backward(pre_bs, theta_s)
            ctx.bandwidth = bandwidth
            return (pre_bs > theta_s).to(pre_bs.dtype)

        @staticmethod
        def backward(ctx, grad_bs):
            pre_bs, theta_s = ctx.saved_tensors
            eps = ctx.bandwidth
            ste_bs = (1.0 / eps) * _rectangle((pre_bs - theta_s) / eps) * grad_bs
            return None, torch.sum(-ste_bs, dim=0), None

    return JumpReLUFn, StepFn


def pre_act_loss(pre_bs, theta_s, dead_s, norm_s):
    """Anthropic's pre-activation loss (January 2025): mean_b sum_s relu(theta - pre) x dead x ||W_dec||, which pulls
    the dead latents' pre-activations up to their thresholds (`theta_s`: Gated's are 0 of pi_gate)."""
    return ((theta_s - pre_bs).relu() * dead_s * norm_s).sum(-1).mean()


def revival_pull(model, pre_bs, theta_s, dead_s):
    """REVIVE_COEFF x `pre_act_loss` on the dead and rare latents, whose gradient reaches each latent's own encoder
    column, bias and threshold but not an SAE's b_dec, which centres every latent's input: where hundreds of latents
    were rare at once (MiniLM at a rarity of 1/50), their pull on b_dec moved the whole reconstruction (layer 4's MLP
    output: L0 17 against k's 32, NMSE 1.2-1.8x TopK's at that L0; with b_dec left out L0 29, 1.0x). The added
    product is 0 in value and cancels b_dec's gradient through `pre_bs` (a transcoder's input is not centred)."""
    if not model.cfg.transcoder:
        pre_bs = pre_bs + (model.b_dec - model.b_dec.detach()) @ model.W_enc
    return REVIVE_COEFF * pre_act_loss(pre_bs, theta_s, dead_s, model.W_dec.norm(dim=-1))


class JumpReLU(Arch):
    name = "jumprelu"
    selection = Selection.DENSE
    trainer = "saeflow-train-5"  # rare latents revived (REVIVE_COEFF)
    earlier_trainers = ("saeflow-train-3", "saeflow-train-4")
    fast_decoder_since = "saeflow-train-4"  # the decoder at base.DECODER_LR_SCALE
    revives_rare_since = "saeflow-train-5"
    hyper = ("jumprelu_loss", "l0_coeff", "tanh_coeff", "bandwidth", "threshold_init", "tanh_scale", "pre_act_coeff",
             "threshold_lr_scale", "sparsity_warmup_frac", "target_l0_coeff", "topk_warmup_frac")  # fmt: skip
    ghost_aux = True  # a dead latent sits below its threshold, usually below zero: AuxK reaches it through softplus
    term_names = ("mse", "l0", "pre_act", "aux")
    saelens = "jumprelu"
    saelens_transcoder = "jumprelu_transcoder"

    def reads(self, cfg) -> tuple[str, ...]:
        """Its loss's own keys and not the others' (`LOSS_KEYS`), as `sparsity_terms` reads them; and `k` where the
        target loss or the TopK warm-up reads it (not in `hyper`: a run that reads neither hashes k at its fixed
        value, as it did before either existed)."""
        own = self.loss_reads(LOSS_KEYS, cfg.jumprelu_loss)
        return (*own, "k") if reads_whole_vectors(cfg) else own

    def parameters(self, d_sae: int) -> dict:
        return {"log_threshold": torch.zeros(d_sae)}

    def init_parameters(self, sae, cfg) -> None:
        sae.log_threshold.fill_(math.log(cfg.threshold_init))

    def lr_scales(self, cfg) -> dict:
        return {"log_threshold": cfg.threshold_lr_scale}

    def mode_refusal(self, cfg, mode: str) -> str | None:
        if mode != "latents" or not reads_whole_vectors(cfg):
            return None
        return whole_vector_refusal(cfg, self.name, "jumprelu_loss", "step or tanh")

    def batch_means(self, cfg) -> int:
        return int(cfg.jumprelu_loss == "target")

    def check(self, cfg) -> None:
        if not cfg.threshold_lr_scale > 0:
            raise SaeflowError(f"threshold_lr_scale: the thresholds' learning-rate multiple must be positive, got "
                               f"{cfg.threshold_lr_scale}")  # fmt: skip
        check_mechanism(cfg, self.hyper)
        if not cfg.threshold_init > 0:
            raise SaeflowError(f"threshold_init: JumpReLU thresholds are positive (a log parameter), got "
                               f"{cfg.threshold_init}")  # fmt: skip

    def activate(self, sae, pre_bs):
        theta_s = sae.log_threshold.exp()
        return torch.relu(pre_bs) * (pre_bs > theta_s).to(pre_bs.dtype)

    def train_activate(self, sae, pre_bs, cfg, step: int, n_steps: int):
        if step < topk_warmup_steps(cfg, n_steps):
            return topk_warmup(sae, pre_bs, cfg.k)
        return _JumpReLU.apply(pre_bs, sae.log_threshold.exp(), cfg.bandwidth)

    def after_step(self, sae, acts, step: int, reduce) -> None:
        """A TopK warm-up step's calibration (`topk_warmup`): the thresholds move toward the global batch's."""
        theta_s = calibration(sae, reduce)
        if theta_s is not None:
            sae.log_threshold.mul_(1 - CALIBRATION_RATE).add_(CALIBRATION_RATE * theta_s.log())

    def sparsity_terms(self, batch: TermInputs) -> dict:
        cfg, model, pre_bs = batch.cfg, batch.model, batch.pre_bs
        ramp = l1_ramp(batch.step, batch.n_steps, cfg.sparsity_warmup_frac)
        theta_s = model.log_threshold.exp()
        norm_s = model.W_dec.norm(dim=-1)
        if cfg.jumprelu_loss == "tanh":
            l0 = cfg.tanh_coeff * torch.tanh(cfg.tanh_scale * batch.f_bs * norm_s).sum(-1).mean()
        elif cfg.jumprelu_loss == "target":
            l0 = target_l0(Step.apply(pre_bs, theta_s, cfg.bandwidth).sum(-1), batch)
        else:
            l0 = cfg.l0_coeff * Step.apply(pre_bs, theta_s, cfg.bandwidth).sum(-1).mean()
        terms = {"l0": ramp * l0, "pre_act": pre_bs.new_zeros(())}
        dead_s = batch.dead_s
        if dead_s is None or not bool(dead_s.any()):
            return terms
        if cfg.jumprelu_loss == "tanh":
            terms["pre_act"] = cfg.pre_act_coeff * pre_act_loss(pre_bs, theta_s, dead_s, norm_s)
        elif self.revives_rare(cfg):
            terms["pre_act"] = revival_pull(model, pre_bs, theta_s, dead_s)
        return terms

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        """The thresholds exp(log_threshold) in float64, rounded once to float32: the same bytes whatever exp
        kernel the CPU runs (float32 AVX2 and AVX-512 exps differ in the last bit)."""
        threshold_s = tensors["log_threshold"].double().exp().to(tensors["log_threshold"].dtype)
        return {}, {**{n: t for n, t in tensors.items() if n != "log_threshold"}, "threshold": threshold_s}

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        """SAELens's codes are relu(pre) * H(pre - threshold), as `activate`'s: below 0 a threshold drops nothing the
        ReLU keeps, so a negative one is threshold 0 exactly (in training too: pre * H(pre) = relu(pre))."""
        threshold_s = tensors["threshold"].clamp(min=0)
        return {**weights, "log_threshold": threshold_s.log()}  # a threshold of 0 is exp(-inf)


ARCH = JumpReLU()
