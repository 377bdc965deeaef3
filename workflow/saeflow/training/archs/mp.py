"""Matching pursuit SAE (SAELens 6.54.12's `MatchingPursuitSAE`, its PR 601): a tied SAE whose encoder picks latents
greedily against the residual, so a vector's codes come from the whole dictionary at once.

    r = x_n - b_dec
    k times:  j = argmax_s relu(r @ W_dec[s]),  v = relu(r @ W_dec[j]),  f[j] += v,  r -= v W_dec[j]
    x_hat = f @ W_dec + b_dec

A vector stops early when a step adds no latent (its support is what it was: SAELens's `stop_on_duplicate_support`,
whose last step still counts) or its residual's norm falls below the `threshold` buffer (SAELens's
`residual_threshold`; 0, off, in training). `k` is the number of steps (SAELens's `max_iterations`), so L0 <= k. The
gradient flows through the values and the residual to W_dec and b_dec, the picks have none (SAELens's). Decoder rows
are unit vectors (the projection's coefficient is v only for a unit row). The encoder reads every latent
(`Selection.WHOLE_DICTIONARY`), so it trains in one process, sweep and data modes, never latent-sharded; its encoder is
its decoder's transpose, so it has no transcoder. W_enc is held at W_dec's transpose and b_enc at zero (`after_step`):
they give the pre-activations AuxK picks dead latents by, and their gradient (AuxK's) is dropped at each step.

SAELens saves only W_dec and b_dec and pursues raw activations with its rows as they are; the export writes saeflow's
unit rows, b_dec and the residual threshold in raw units, so SAELens's reconstruction is saeflow's and its codes are
saeflow's divided by the input scale (equal for a SAELens file imported, whose scale is 1).
"""

from saeflow.training.archs.base import Arch, Selection, Unsupported, torch


def pursue(resid_bd, W_dec_sd, n_steps: int, residual_threshold: float):
    """SAELens's `_encode_matching_pursuit` (stop_on_duplicate_support on): the codes (b, s) of centred inputs."""
    acts_bs = torch.zeros(resid_bd.shape[0], W_dec_sd.shape[0], device=W_dec_sd.device, dtype=resid_bd.dtype)
    support_bs = torch.zeros(acts_bs.shape, dtype=torch.bool, device=W_dec_sd.device)
    done_b = torch.zeros(resid_bd.shape[0], dtype=torch.bool, device=W_dec_sd.device)
    for _ in range(n_steps):
        with torch.no_grad():
            idx_b1 = (resid_bd @ W_dec_sd.T).relu().max(dim=1, keepdim=True).indices
        picked_bd = W_dec_sd[idx_b1.squeeze(1)]
        vals_b1 = (resid_bd * picked_bd).sum(dim=-1, keepdim=True).relu() * (~done_b).unsqueeze(1).to(resid_bd.dtype)
        acts_bs = acts_bs.scatter_add(1, idx_b1, vals_b1.to(acts_bs.dtype))
        resid_bd = resid_bd - vals_b1 * picked_bd
        with torch.no_grad():
            now_bs = acts_bs != 0
            done_b = done_b | (now_bs == support_bs).all(dim=1)
            support_bs = now_bs
            if residual_threshold > 0:
                done_b = done_b | (resid_bd.norm(dim=-1) < residual_threshold)
            if bool(done_b.all()):
                break
    return acts_bs


class MatchingPursuit(Arch):
    name = "mp"
    selection = Selection.WHOLE_DICTIONARY
    hyper = ("k",)
    transcodes = False
    has_threshold = True  # the residual norm at which a vector stops (0 in training)
    saelens = "matching_pursuit"
    saelens_tensors = ("W_dec", "b_dec")

    def encode(self, sae, xn_bd):
        return pursue(xn_bd - sae.b_dec, sae.W_dec, sae.cfg.n_kept(1), float(sae.threshold))

    def after_step(self, sae, acts, step: int, reduce) -> None:
        """The encoder tied to the decoder again (the pre-activations AuxK reads)."""
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.zero_()

    def saelens_export(self, sae, tensors: dict, threshold) -> tuple[dict, dict]:
        scale = float(sae.scale)  # pursuit is not scale-free in its rows: keep them unit, scale the input's units
        cfg = {"residual_threshold": threshold / scale, "max_iterations": sae.cfg.n_kept(1),
               "stop_on_duplicate_support": True}  # fmt: skip
        return cfg, {"W_dec": sae.W_dec.detach(), "b_dec": tensors["b_dec"]}

    def saelens_import(self, cfg: dict, tensors: dict, weights: dict) -> dict:
        if cfg.get("stop_on_duplicate_support", True) is not True:
            raise Unsupported("matching pursuit with stop_on_duplicate_support other than true (saeflow's stops when "
                              "a step adds no latent)")  # fmt: skip
        W_dec_sd = weights["W_dec"]
        steps, threshold = cfg.get("max_iterations"), cfg.get("residual_threshold", 1e-2)
        steps = W_dec_sd.shape[1] if steps is None else steps  # SAELens's default: d_in
        if type(steps) is not int or steps < 1:
            raise Unsupported(f"max_iterations={steps!r} (a positive integer, or null)")
        if type(threshold) not in (int, float) or not threshold >= 0:
            raise Unsupported(f"residual_threshold={threshold!r} (a number >= 0)")
        b_dec_d = weights["b_dec"] if cfg.get("apply_b_dec_to_input", True) else torch.zeros_like(weights["b_dec"])
        return {**weights, "W_enc": W_dec_sd.T, "b_enc": torch.zeros(W_dec_sd.shape[0]), "b_dec": b_dec_d,
                "threshold": float(threshold), "k": steps}  # fmt: skip


ARCH = MatchingPursuit()
