"""TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"): each vector keeps its k largest
pre-activations (after ReLU); dead latents learn through AuxK. Decoder rows are unit vectors.

Training decodes from the k kept (value, latent) pairs only (objectives.Codes), and a latent-sharded SAE picks the
global top k from every rank's candidates (training.ranks.sharded); inference is `activate`. Since saeflow-train-4
the encoder's gradient, too, comes from the picks only where that is faster (training/picks.py); a run made by
saeflow-train-3 resumes with the dense gradient it started with. Since saeflow-train-5 the decoder trains at
twice the run's rate (`base.DECODER_LR_SCALE`); an earlier run resumes with the rates it started with.
"""

from saeflow.training.archs.base import Arch, Selection, torch


class TopK(Arch):
    name = "topk"
    selection = Selection.TOP_K
    k_sparse = True
    trainer = "saeflow-train-5"  # the decoder at base.DECODER_LR_SCALE
    earlier_trainers = ("saeflow-train-4", "saeflow-train-3")  # 4: the encoder's gradient from the picks
    fast_decoder_since = "saeflow-train-5"
    hyper = ("k",)
    saelens = "topk"
    saelens_required = ("k",)
    sparsify = "topk"

    def picks(self, sae, pre_bs):
        """The k largest pre-activations, after ReLU: the k largest of relu(pre), without a pass over all of them
        (where fewer than k are positive, the others are 0 either way)."""
        vals_bk, idx_bk = pre_bs.topk(sae.cfg.n_kept(1), dim=-1, sorted=False)
        return torch.relu(vals_bk), idx_bk

    def activate(self, sae, pre_bs):
        vals_bk, idx_bk = self.picks(sae, pre_bs)
        return torch.zeros_like(pre_bs).scatter_(-1, idx_bk, vals_bk)

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        return {"k": sae.cfg.n_kept(1), "rescale_acts_by_decoder_norm": False}, tensors

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        if cfg.get("rescale_acts_by_decoder_norm", False):  # SAELens's own fold_W_dec_norm: the same codes
            norm_s = weights["W_dec"].norm(dim=-1).clamp_min(1e-8)
            weights = {**weights, "W_enc": weights["W_enc"] * norm_s, "b_enc": weights["b_enc"] * norm_s,
                       "W_dec": weights["W_dec"] / norm_s[:, None]}  # fmt: skip
        return weights


ARCH = TopK()
