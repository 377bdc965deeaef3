"""ReLU SAE with an L1 penalty (Anthropic, "Towards Monosemanticity" and its April 2024 update).

    f_bs = relu(pre_bs)
    loss = mse + l1_coeff x ramp(step) x mean_b sum_s f_bs ||W_dec[s]||   (+ AuxK, dead latents through softplus)

Since saeflow-train-4 its default learning rate is AUTO_LR_SCALE x `rates.auto_lr` (which says why); a run
made by saeflow-train-3 resumes at the rate it started with.

Decoder rows start at norm 0.1 and their norms train freely (the L1 term weighs each code by its row's norm, so
rescaling games nothing; training.sae.init_from_data says why); they are folded into the encoder when
the SAE is published, so sae.pt always has unit rows.
"""

from saeflow.training.archs.base import Arch, Selection, TermInputs, made_since, torch

DECODER_INIT_NORM = 0.1
AUTO_LR_SCALE = 2.5  # its `lr: null` rate over every architecture's (rates.auto_lr, docs/training.md)
AUTO_LR_SCALE_SINCE = "saeflow-train-4"


def l1_ramp(step: int, n_steps: int, warmup_frac: float) -> float:
    """The L1 weight's linear warm-up factor: a full penalty from step 0 would kill latents before they learn."""
    n_warm = int(warmup_frac * n_steps)
    return min(1.0, (step + 1) / n_warm) if n_warm else 1.0


def l1_penalty(W_dec_sd, f_bs):
    """Activations weighted by their decoder norms, summed per vector (rescaling the decoder cannot game it)."""
    return (f_bs * W_dec_sd.norm(dim=-1)).sum(-1).mean()


class ReLU(Arch):
    name = "relu"
    selection = Selection.DENSE
    trainer = "saeflow-train-4"  # the default learning rate at AUTO_LR_SCALE
    earlier_trainers = ("saeflow-train-3",)
    hyper = ("l1_coeff", "sparsity_warmup_frac")
    unit_decoder = False
    decoder_init_norm = DECODER_INIT_NORM
    ghost_aux = True
    term_names = ("mse", "l1", "aux")
    saelens = "standard"
    saelens_transcoder = "transcoder"

    def auto_lr_scale(self, cfg) -> float:
        return AUTO_LR_SCALE if made_since(cfg, AUTO_LR_SCALE_SINCE) else 1.0

    def activate(self, sae, pre_bs):
        return torch.relu(pre_bs)

    def sparsity_terms(self, batch: TermInputs) -> dict:
        cfg = batch.cfg
        ramp = l1_ramp(batch.step, batch.n_steps, cfg.sparsity_warmup_frac)
        return {"l1": cfg.l1_coeff * ramp * l1_penalty(batch.model.W_dec, batch.f_bs)}

    def foldable(self) -> bool:
        return True


ARCH = ReLU()
