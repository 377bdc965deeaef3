"""TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"): each vector keeps its k largest
pre-activations (after ReLU); dead latents learn through AuxK. Decoder rows are unit vectors.

Training decodes from the k kept (value, latent) pairs only (objectives.Codes), and a latent-sharded SAE picks the
global top k from every rank's candidates (training.ranks.sharded); inference is `activate`.
"""

from saeflow.training.archs.base import Arch, Selection, torch


class TopK(Arch):
    name = "topk"
    selection = Selection.TOP_K
    hyper = ("k",)
    saelens = "topk"
    saelens_required = ("k",)
    sparsify = "topk"

    def activate(self, sae, pre_bs):
        relu_bs = torch.relu(pre_bs)
        vals_bk, idx_bk = relu_bs.topk(sae.cfg.n_kept(1), dim=-1, sorted=False)
        return torch.zeros_like(relu_bs).scatter_(-1, idx_bk, vals_bk)

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        return {"k": sae.cfg.n_kept(1), "rescale_acts_by_decoder_norm": False}, tensors

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        if cfg.get("rescale_acts_by_decoder_norm", False):  # SAELens's own fold_W_dec_norm: the same codes
            norm_s = weights["W_dec"].norm(dim=-1).clamp_min(1e-8)
            weights = {**weights, "W_enc": weights["W_enc"] * norm_s, "b_enc": weights["b_enc"] * norm_s,
                       "W_dec": weights["W_dec"] / norm_s[:, None]}  # fmt: skip
        return weights


ARCH = TopK()
