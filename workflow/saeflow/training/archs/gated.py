"""Gated SAE (Rajamanoharan et al. 2024, "Improving Dictionary Learning with Gated Sparse Autoencoders").

One encoder matrix serves two paths: the gate decides which latents fire, the magnitude path how strongly.

    pi_gate_bs = (x_n - b_dec) @ W_enc + b_enc                    (b_enc is SAELens's b_gate; = pre_bs)
    pi_mag_bs  = (x_n - b_dec) @ (W_enc * exp(r_mag)) + b_mag  = (pi_gate - b_enc) * exp(r_mag) + b_mag
    f_bs       = H(pi_gate_bs) * relu(pi_mag_bs)

The gate fires where pi_mag clears theta_s = b_mag - exp(r_mag) b_enc: a JumpReLU of the magnitude path whose
threshold the gate bias sets. It trains by one of two losses, `gated_loss`:

    target (the default)  JumpReLU's: the first `topk_warmup_frac` of the steps keep each vector's k largest
                          magnitudes (jumprelu.topk_warmup) while the gate biases follow the thresholds that fire
                          each latent as often; then the gate, with a straight-through gradient to its bias (the
                          reconstruction's and the L0's, jumprelu.Step, window `bandwidth` in pi_gate's units),
                          and target_l0_coeff x ramp x k x (L0 / k - 1)^2. Decoder rows are unit vectors, as JumpReLU's.
    l1 (the paper's)      the gate has no gradient; it learns through the L1 on relu(pi_gate) and the auxiliary
                          reconstruction from it, as SAELens 6.54.12's GatedTrainingSAE defines them (its decoder is
                          not detached in that term):
        l1  = gate_l1_coeff x ramp x mean_b sum_s relu(pi_gate) ||W_dec[s]||
        aux = mean_b || relu(pi_gate) @ W_dec + b_dec - x_n ||^2      (a transcoder: its target, less the skip path)
                          Decoder rows start short (`decoder_init_norm`) and their norms train, as ReLU's, folded into
                          the encoder, r_mag's path and b_mag when the SAE is published. On a latent shard the
                          auxiliary reconstruction is summed over the ranks (`TermInputs.over_latents`).

Why the target loss (issue 42, docs/training.md): with the L1, the gates of MiniLM's activations stayed open (L0
120-655 of 1,536 latents, NMSE 4.5-6.9x TopK's at that L0), and no fixed coefficient suits both planted and real
data. JumpReLU's mechanism with Gated's short free decoder rows left 45-70% of the latents dead; with unit rows it
is TopK's NMSE at k's L0. The gate's bias trains at `gate_bias_lr_scale` (4) times the run's rate (`lr_scales`):
under the L1 the run's rate left a planted dictionary's gates open (L0 44, true 8; with 4 and `gate_l1_coeff` 7:
92% at L0 25), and a faster gate bias or a larger coefficient shut every gate of a small run.
"""

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.training.archs.base import Arch, Selection, TermInputs, torch
from saeflow.training.archs.jumprelu import (
    CALIBRATION_RATE,
    Step,
    calibration,
    check_mechanism,
    revival_pull,
    target_l0,
    topk_warmup,
    topk_warmup_steps,
    whole_vector_refusal,
)
from saeflow.training.archs.relu import l1_penalty, l1_ramp

# The keys only each loss reads (`Gated.hyper`'s others both read)
LOSS_KEYS = config.by_enum({"l1": ("gate_l1_coeff",), "target": ("target_l0_coeff", "topk_warmup_frac", "bandwidth")},
                           "sae_spec", "gated_loss")  # fmt: skip
LOSS_TERMS = config.by_enum({"l1": ("l1", "gate_recon"), "target": ("l0",)}, "sae_spec", "gated_loss")


def _magnitudes(sae, pre_bs):
    """(b, s) pi_mag from pi_gate (the pre-activations)."""
    return (pre_bs - sae.b_enc) * sae.r_mag.exp() + sae.b_mag


def _gate(sae, pre_bs, cfg):
    """(b, s) H(pi_gate), straight-through to the gate bias: the step at 0 of pi_gate (no gradient to W_enc), whose
    threshold is b_enc.detach() - b_enc (0, with the gradient of minus the gate bias), so a gate that opens with a
    rising bias gets its bias's gradient."""
    return Step.apply(pre_bs.detach(), sae.b_enc.detach() - sae.b_enc, cfg.bandwidth)


class Gated(Arch):
    name = "gated"
    selection = Selection.DENSE
    trainer = "saeflow-train-5"  # rare latents revived (jumprelu.revival_pull)
    earlier_trainers = ("saeflow-train-3", "saeflow-train-4")
    fast_decoder_since = "saeflow-train-4"  # the decoder at base.DECODER_LR_SCALE
    revives_rare_since = "saeflow-train-5"  # the target loss's runs (they read k)
    hyper = ("gated_loss", "gate_l1_coeff", "gate_bias_lr_scale", "sparsity_warmup_frac", "target_l0_coeff",
             "topk_warmup_frac", "bandwidth")  # fmt: skip
    legacy_hashed = ()  # each loss reads every key of hyper it read before the target loss came (issue 42)
    ghost_aux = True  # a dead latent's gate is shut (pi_gate < 0): AuxK reaches it through softplus
    unit_decoder = False  # the L1's: as ReLU, rows start short, their norms train (the L1 weighs them), folded
    decoder_init_norm = 0.1
    term_names = ("mse", "l1", "gate_recon", "l0", "pre_act", "aux")  # both losses' (`logged_terms`: the run's)
    whole_terms = ("gate_recon",)
    saelens = "gated"

    def reads(self, cfg) -> tuple[str, ...]:
        """Its loss's own keys and not the other's (`LOSS_KEYS`), and `k` where the target loss reads it."""
        own = self.loss_reads(LOSS_KEYS, cfg.gated_loss)
        return (*own, "k") if cfg.gated_loss == "target" else own

    def logged_terms(self, cfg) -> tuple[str, ...]:
        return ("mse", *LOSS_TERMS[cfg.gated_loss], *(("pre_act",) if self.revives_rare(cfg) else ()), "aux")

    def unit_decoder_for(self, cfg) -> bool:
        return cfg.gated_loss == "target"

    def decoder_init_norm_for(self, cfg) -> float:
        return 1.0 if self.unit_decoder_for(cfg) else self.decoder_init_norm

    def parameters(self, d_sae: int) -> dict:
        return {"r_mag": torch.zeros(d_sae), "b_mag": torch.zeros(d_sae)}

    def lr_scales(self, cfg) -> dict:
        return {"b_enc": cfg.gate_bias_lr_scale}  # where each gate opens: see the module docstring

    def mode_refusal(self, cfg, mode: str) -> str | None:
        if mode != "latents" or cfg.gated_loss != "target":
            return None
        return whole_vector_refusal(cfg, self.name, "gated_loss", "l1")

    def batch_means(self, cfg) -> int:
        return int(cfg.gated_loss == "target")

    def check(self, cfg) -> None:
        if not cfg.gate_bias_lr_scale > 0:
            raise SaeflowError(f"gate_bias_lr_scale: the gate bias's learning-rate multiple must be positive, got "
                               f"{cfg.gate_bias_lr_scale}")  # fmt: skip
        check_mechanism(cfg, self.reads(cfg))

    def foldable(self) -> bool:
        return True  # the gate's sign and the magnitude both scale with the row's norm

    def fold_parameters(self, sae, norms_s) -> None:
        sae.b_mag.mul_(norms_s)  # r_mag multiplies W_enc, which is scaled already

    def activate(self, sae, pre_bs):
        return (pre_bs > 0).to(pre_bs.dtype) * torch.relu(_magnitudes(sae, pre_bs))

    def train_activate(self, sae, pre_bs, cfg, step: int, n_steps: int):
        if cfg.gated_loss != "target":
            return self.activate(sae, pre_bs)
        if step < topk_warmup_steps(cfg, n_steps):
            return topk_warmup(sae, _magnitudes(sae, pre_bs), cfg.k)
        return _gate(sae, pre_bs, cfg) * torch.relu(_magnitudes(sae, pre_bs))

    def after_step(self, sae, acts, step: int, reduce) -> None:
        """A TopK warm-up step's calibration: each gate bias moves toward the one whose gate opens where the
        magnitude clears its calibrated threshold theta_s (b_enc = (b_mag - theta_s) exp(-r_mag))."""
        theta_s = calibration(sae, reduce)
        if theta_s is not None:
            bias_s = (sae.b_mag - theta_s) * (-sae.r_mag).exp()
            sae.b_enc.mul_(1 - CALIBRATION_RATE).add_(CALIBRATION_RATE * bias_s)

    def sparsity_terms(self, batch: TermInputs) -> dict:
        cfg, model = batch.cfg, batch.model
        ramp = l1_ramp(batch.step, batch.n_steps, cfg.sparsity_warmup_frac)
        if cfg.gated_loss == "target":
            terms = {"l0": ramp * target_l0(_gate(model, batch.pre_bs, cfg).sum(-1), batch)}
            if self.revives_rare(cfg):  # the dead and rare latents' gates pulled open (pi_gate up to 0)
                dead_s, terms["pre_act"] = batch.dead_s, batch.pre_bs.new_zeros(())
                if dead_s is not None and bool(dead_s.any()):
                    terms["pre_act"] = revival_pull(model, batch.pre_bs, 0, dead_s)
            return terms
        gate_bs = torch.relu(batch.pre_bs)
        via_gate_bd = batch.over_latents(gate_bs @ model.W_dec.detach()) + model.b_dec.detach()  # stop-gradient
        return {"l1": cfg.gate_l1_coeff * ramp * l1_penalty(model.W_dec, gate_bs),
                "gate_recon": (via_gate_bd - batch.recon_bd).square().sum(-1).mean()}  # fmt: skip

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        out = {("b_gate" if name == "b_enc" else name): t for name, t in tensors.items()}
        return {}, out

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        """Without `apply_b_dec_to_input` SAELens's paths read x, not x - b_dec: pi_mag = x @ (W_enc e^r_mag) + b_mag,
        which is saeflow's with b_mag + (b_dec @ W_enc) e^r_mag (sae_formats.from_saelens shifts b_enc, the gate's,
        by b_dec @ W_enc)."""
        b_mag_s, r_mag_s = tensors["b_mag"], tensors["r_mag"]
        if not cfg.get("apply_b_dec_to_input", True):
            b_mag_s = b_mag_s + (weights["b_dec"] @ weights["W_enc"]) * r_mag_s.exp()
        return {**weights, "b_enc": tensors["b_gate"], "r_mag": r_mag_s, "b_mag": b_mag_s}


ARCH = Gated()
