"""JumpReLU SAE (Rajamanoharan et al. 2024, "Jumping Ahead"; Gemma Scope): each latent fires above its own learned
threshold theta_s = exp(log_threshold_s), a parameter.

    f_bs = pre_bs * H(pre_bs - theta_s)           (H the Heaviside step; inference: relu(pre) * H, as SAELens)

The step has no gradient, so training uses straight-through estimators with a rectangle kernel of width `bandwidth`
(eps): d f / d theta = -(theta / eps) rect((pre - theta) / eps), d H / d theta = -(1 / eps) rect((pre - theta) / eps),
with rect(u) = 1 on (-1/2, 1/2); the pre-activations get f's ordinary gradient (H where the latent fires). These are
SAELens 6.54.12's `JumpReLU` and `Step` functions (`jumprelu_ste_to_input: false`, DeepMind's choice). Sparsity,
`jumprelu_loss`:

    step (DeepMind's L0)  l0_coeff x ramp x mean_b sum_s H(pre - theta)
    tanh (Anthropic, Jan 2025)  tanh_coeff x ramp x mean_b sum_s tanh(tanh_scale x f ||W_dec[s]||)
                          + pre_act_coeff x mean_b sum_s relu(theta - pre) x dead_s x ||W_dec[s]||

(the pre-activation loss pulls dead latents' pre-activations up to their thresholds; ramp: `sparsity_warmup_frac`).
Decoder rows are unit vectors (both penalties ignore a row's norm or weigh it in). The L0 is not fixed: each vector
keeps what clears the thresholds, so metrics report the mean L0 over vectors (and inference its spread). The
threshold is a log parameter (DeepMind's): positive by construction, and Adam moves it by about its learning rate
relatively per step. At the run's lr that was too slow for a short run to find its thresholds (83% of a planted
dictionary, README), so the thresholds train at `threshold_lr_scale` times it (`lr_scales`; 4: 89%).
"""

import math

from saeflow.errors import SaeflowError
from saeflow.training.archs.base import Arch, Selection, TermInputs, torch
from saeflow.training.archs.relu import l1_ramp

# The keys only the step loss reads, and only the tanh loss (`JumpReLU.hyper`'s others both read)
STEP_KEYS, TANH_KEYS = ("l0_coeff",), ("tanh_coeff", "tanh_scale", "pre_act_coeff")


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


class _Step:
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


class JumpReLU(Arch):
    name = "jumprelu"
    selection = Selection.DENSE
    hyper = ("jumprelu_loss", "l0_coeff", "tanh_coeff", "bandwidth", "threshold_init", "tanh_scale", "pre_act_coeff",
             "threshold_lr_scale", "sparsity_warmup_frac")  # fmt: skip
    ghost_aux = True  # a dead latent sits below its threshold, usually below zero: AuxK reaches it through softplus
    term_names = ("mse", "l0", "pre_act", "aux")
    saelens = "jumprelu"
    saelens_transcoder = "jumprelu_transcoder"

    def reads(self, cfg) -> tuple[str, ...]:
        """Its loss's own keys and not the other loss's (`STEP_KEYS`, `TANH_KEYS`), as `sparsity_terms` reads them."""
        other = STEP_KEYS if cfg.jumprelu_loss == "tanh" else TANH_KEYS
        return tuple(key for key in self.hyper if key not in other)

    def parameters(self, d_sae: int) -> dict:
        return {"log_threshold": torch.zeros(d_sae)}

    def init_parameters(self, sae, cfg) -> None:
        sae.log_threshold.fill_(math.log(cfg.threshold_init))

    def lr_scales(self, cfg) -> dict:
        return {"log_threshold": cfg.threshold_lr_scale}

    def check(self, cfg) -> None:
        if not cfg.threshold_lr_scale > 0:
            raise SaeflowError(f"threshold_lr_scale: the thresholds' learning-rate multiple must be positive, got "
                               f"{cfg.threshold_lr_scale}")  # fmt: skip
        if not cfg.bandwidth > 0:
            raise SaeflowError(f"bandwidth: the straight-through kernel's width must be positive, got {cfg.bandwidth}")
        if not cfg.threshold_init > 0:
            raise SaeflowError(f"threshold_init: JumpReLU thresholds are positive (a log parameter), got "
                               f"{cfg.threshold_init}")  # fmt: skip

    def activate(self, sae, pre_bs):
        theta_s = sae.log_threshold.exp()
        return torch.relu(pre_bs) * (pre_bs > theta_s).to(pre_bs.dtype)

    def train_activate(self, sae, pre_bs, cfg):
        return _JumpReLU.apply(pre_bs, sae.log_threshold.exp(), cfg.bandwidth)

    def sparsity_terms(self, batch: TermInputs) -> dict:
        cfg, model, pre_bs = batch.cfg, batch.model, batch.pre_bs
        ramp = l1_ramp(batch.step, batch.n_steps, cfg.sparsity_warmup_frac)
        theta_s = model.log_threshold.exp()
        norm_s = model.W_dec.norm(dim=-1)
        if cfg.jumprelu_loss == "tanh":
            l0 = cfg.tanh_coeff * torch.tanh(cfg.tanh_scale * batch.f_bs * norm_s).sum(-1).mean()
        else:
            l0 = cfg.l0_coeff * _Step.apply(pre_bs, theta_s, cfg.bandwidth).sum(-1).mean()
        terms = {"l0": ramp * l0, "pre_act": pre_bs.new_zeros(())}
        dead_s = batch.dead_s
        if cfg.jumprelu_loss == "tanh" and dead_s is not None and bool(dead_s.any()):
            per_vector_b = ((theta_s - pre_bs).relu() * dead_s * norm_s).sum(-1)
            terms["pre_act"] = cfg.pre_act_coeff * per_vector_b.mean()
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
