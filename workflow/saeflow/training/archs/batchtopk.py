"""BatchTopK SAE (Bussmann et al. 2024): in training a batch keeps its k x batch largest activations (k per vector
on average); at inference a vector keeps what exceeds one threshold, the running mean of the smallest activation
kept in training (the threshold statistic, `after_step`). Decoder rows are unit vectors; dead latents learn
through AuxK. SAELens saves it for inference as a JumpReLU with that threshold on every latent.
"""

from saeflow.training.archs.base import Arch, Selection, Unsupported, torch


class BatchTopK(Arch):
    name = "batchtopk"
    selection = Selection.BATCH_TOP_K
    # saeflow-train-4 (issue 44): its encoder gradient and decode come from the kept entries only (training/picks.py)
    trainer = "saeflow-train-4"
    earlier_trainers = ("saeflow-train-3",)
    hyper = ("k",)
    has_threshold = True
    saelens = "jumprelu"
    saelens_transcoder = "jumprelu_transcoder"

    def activate(self, sae, pre_bs):
        """Training: the batch's k x b largest; eval: what exceeds the threshold, per vector."""
        if sae.training:
            relu_bs = torch.relu(pre_bs)
            flat = relu_bs.flatten()
            vals_n, idx_n = flat.topk(sae.cfg.n_kept(relu_bs.shape[0]), sorted=False)
            return torch.zeros_like(flat).scatter_(0, idx_n, vals_n).view_as(relu_bs)
        return torch.where(pre_bs > sae.threshold, pre_bs, torch.zeros_like(pre_bs)).clamp_min(0)

    def batch_keep(self, sae, pre_bs):
        """(b, s) bool: training's choice, the batch's k x b largest activations (as `activate` keeps them)."""
        with torch.no_grad():
            flat = torch.relu(pre_bs).flatten()
            keep = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
            keep[flat.topk(sae.cfg.n_kept(pre_bs.shape[0]), sorted=False).indices] = True
        return keep.view_as(pre_bs)

    def after_step(self, sae, acts, step: int, reduce) -> None:
        """The inference threshold: the running mean of the smallest kept activation (over every rank); a step
        where nothing fired leaves it."""
        kept = acts[acts > 0]
        min_kept = reduce(kept.min() if kept.numel() else acts.new_tensor(torch.inf), "min")
        if not bool(torch.isfinite(min_kept)):
            min_kept = sae.threshold
        sae.threshold.copy_(min_kept if step == 0 else 0.99 * sae.threshold + 0.01 * min_kept)

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        # k is no JumpReLU field (SAELens drops it); kept for the way back
        return {"k": sae.cfg.n_kept(1)}, {**tensors, "threshold": torch.full((sae.d_sae,), threshold)}

    def saelens_claims(self, cfg: dict) -> bool:
        """SAELens saves BatchTopK as JumpReLU; its training metadata (or our export's) says it was BatchTopK."""
        metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
        ours = metadata.get("saeflow") if isinstance(metadata.get("saeflow"), dict) else {}
        trained = str(metadata.get("training_architecture", ""))
        return ours.get("arch") == self.name or trained in ("batchtopk", "matryoshka_batchtopk")

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        threshold_s = tensors["threshold"]
        if not bool((threshold_s == threshold_s[0]).all()):
            raise Unsupported("a JumpReLU SAE with per-latent thresholds (saeflow's BatchTopK has one threshold)")
        return {**weights, "threshold": float(threshold_s[0])}


ARCH = BatchTopK()
