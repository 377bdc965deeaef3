"""Gated SAE (Rajamanoharan et al. 2024, "Improving Dictionary Learning with Gated Sparse Autoencoders").

One encoder matrix serves two paths: the gate decides which latents fire, the magnitude path how strongly.

    pi_gate_bs = (x_n - b_dec) @ W_enc + b_enc                    (b_enc is SAELens's b_gate; = pre_bs)
    pi_mag_bs  = (x_n - b_dec) @ (W_enc * exp(r_mag)) + b_mag  = (pi_gate - b_enc) * exp(r_mag) + b_mag
    f_bs       = H(pi_gate_bs) * relu(pi_mag_bs)

The gate has no gradient; it learns through the sparsity term on relu(pi_gate) and the auxiliary reconstruction
from it, as SAELens 6.54.12's GatedTrainingSAE defines them (its decoder is not detached in that term):

    l1  = gate_l1_coeff x ramp x mean_b sum_s relu(pi_gate) ||W_dec[s]||
    aux = mean_b || relu(pi_gate) @ W_dec + b_dec - x_n ||^2      (a transcoder: its target, less the skip path)

Decoder rows start short and their norms train, as ReLU's (the L1 weighs each code by its row's norm); they are
folded into the encoder, r_mag's path and b_mag when the SAE is published. On a latent shard the auxiliary
reconstruction is summed over the ranks (`TermInputs.over_latents`), so it is the same on every rank.

The gate's bias (b_enc) sets where each gate opens, and the L1 closes gates only by lowering it (or shrinking W_enc):
at the run's learning rate Adam moved it too slowly, and a planted dictionary's gates stayed open (88% recovered at
L0 44, true 8, `gate_l1_coeff` 8; 10 fell off a cliff: 63%). It trains at `gate_bias_lr_scale` (4) times the rate
(`lr_scales`), with `gate_l1_coeff` 7: 92% at L0 25 (README). A faster gate bias or a larger coefficient trades
recovery for L0 there (9: 90% at L0 13), and shuts every gate of a small or short run (scale 16 with coefficient 8
in tests/test_archs.py's 8-step CLI run; scale 2 with coefficient 9 on tests/test_train.py's planted data).
"""

from saeflow.errors import SaeflowError
from saeflow.training.archs.base import Arch, Selection, TermInputs, torch
from saeflow.training.archs.relu import l1_penalty, l1_ramp


class Gated(Arch):
    name = "gated"
    selection = Selection.DENSE
    hyper = ("gate_l1_coeff", "gate_bias_lr_scale", "sparsity_warmup_frac")
    ghost_aux = True  # a dead latent's gate is shut (pi_gate < 0): AuxK reaches it through softplus
    unit_decoder = False  # as ReLU: rows start short, their norms train (the L1 weighs them in), folded at publish
    decoder_init_norm = 0.1
    term_names = ("mse", "l1", "gate_recon", "aux")
    whole_terms = ("gate_recon",)
    saelens = "gated"

    def parameters(self, d_sae: int) -> dict:
        return {"r_mag": torch.zeros(d_sae), "b_mag": torch.zeros(d_sae)}

    def lr_scales(self, cfg) -> dict:
        return {"b_enc": cfg.gate_bias_lr_scale}  # where each gate opens: see the module docstring

    def check(self, cfg) -> None:
        if not cfg.gate_bias_lr_scale > 0:
            raise SaeflowError(f"gate_bias_lr_scale: the gate bias's learning-rate multiple must be positive, got "
                               f"{cfg.gate_bias_lr_scale}")  # fmt: skip

    def foldable(self) -> bool:
        return True  # the gate's sign and the magnitude both scale with the row's norm

    def fold_parameters(self, sae, norms_s) -> None:
        sae.b_mag.mul_(norms_s)  # r_mag multiplies W_enc, which is scaled already

    def activate(self, sae, pre_bs):
        mag_bs = (pre_bs - sae.b_enc) * sae.r_mag.exp() + sae.b_mag
        return (pre_bs > 0).to(pre_bs.dtype) * torch.relu(mag_bs)

    def sparsity_terms(self, batch: TermInputs) -> dict:
        cfg, model = batch.cfg, batch.model
        ramp = l1_ramp(batch.step, batch.n_steps, cfg.sparsity_warmup_frac)
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
