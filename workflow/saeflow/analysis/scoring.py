"""What saeflow.analysis.evaluate's passes are scored by, and the recovered fractions made of the scores.

Causal language models (GPT-2, Llama, Qwen, Mistral) are scored on their next-token predictions: positions
0..T-2 of every example, predicting tokens 1..T-1 (every prediction in the context, specials included as
targets; as SAELens). Per token, averaged over those positions:

    ce_clean, ce_spliced, ce_ablated     cross-entropy (nats)
    ce_loss_recovered = (ce_ablated - ce_spliced) / (ce_ablated - ce_clean)      1 = lossless, 0 = as bad as zeros
    kl_spliced = KL(p_clean || p_spliced),  kl_ablated = KL(p_clean || p_ablated) (nats)
    kl_score = (kl_ablated - kl_spliced) / kl_ablated                          1 = lossless, 0 = as bad as zeros
    ce_mean_ablated, kl_mean_ablated, and the same ratios against mean ablation: ce_loss_recovered_vs_mean,
    kl_score_vs_mean (1 = lossless, 0 = as bad as the mean)

Encoders (BERT, RoBERTa) and vision towers have no language-model loss; their output embedding is scored instead:
the mean of the final hidden states over all positions (`pooled`), and the first position (`cls`, when the model
has a CLS token: vision CLS, or the [CLS]/<s> every text encoder example starts with). Per example, averaged:

    <which>_cos_spliced / _cos_ablated           cosine similarity to the clean embedding
    <which>_rel_err_spliced / _rel_err_ablated   ||e - e_clean|| / ||e_clean||
    <which>_cos_recovered = (cos_spliced - cos_ablated) / (1 - cos_ablated)
    <which>_rel_err_recovered = (rel_err_ablated - rel_err_spliced) / rel_err_ablated
    <which>_cos_mean_ablated, <which>_rel_err_mean_ablated, and the recovered fractions against mean ablation
    (<which>_cos_recovered_vs_mean, <which>_rel_err_recovered_vs_mean)

An evaluation that scores nothing downstream of a spliced position (a causal LM whose only spliced position is the
last one of each example, e.g. context 2 with a BOS under `no_special`; an encoder example without a spliced
position) cannot measure the splice: it warns, and every metric but the clean ones is null (`n_scored_spliced`: 0).

A ratio whose denominator is 0 within float32 noise (at most 2^-20 of the magnitudes it is the difference of: the
ablation changes nothing measurable) is null, never a quotient of noise such as -0.0.
"""

import logging
import math

import torch

logger = logging.getLogger("saeflow.analysis.evaluate")  # its warnings are evaluate's

# A recovered fraction's denominator at most this fraction of the magnitudes it is made of (8 float32 ulps) is noise:
# the ablation changed nothing measurable, and the ratio is null.
NOISE_FRAC = 2.0**-20


class Scores:
    """Sums over scored tokens (causal LMs) or examples (embeddings) of each metric; `result()` averages them.
    `n_spliced` counts the scored tokens or examples downstream of a spliced position (None: not counted)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.n_spliced: int | None = None

    def add(self, name: str, values: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(values.double().sum())
        self.counts[name] = self.counts.get(name, 0) + values.numel()

    def mean(self, name: str) -> float:
        return self.sums[name] / self.counts[name]


def next_token_logp(logits_btv: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (B*(T-1), V) of the next-token predictions at positions 0..T-2."""
    return torch.log_softmax(logits_btv[:, :-1].reshape(-1, logits_btv.shape[-1]), dim=-1)


def score_lm(scores: Scores, mode: str, logp_nv: torch.Tensor, logp_clean_nv: torch.Tensor, ids_bt: torch.Tensor):
    """Per-token CE of one pass and, for spliced/ablated, KL(clean || pass)."""
    targets_n = ids_bt[:, 1:].reshape(-1)
    scores.add(f"ce_{mode}", -logp_nv.gather(1, targets_n[:, None])[:, 0])
    if mode != "clean":
        scores.add(f"kl_{mode}", (logp_clean_nv.exp() * (logp_clean_nv - logp_nv)).sum(-1))


def score_embeddings(scores: Scores, hidden: dict[str, torch.Tensor], has_cls: bool) -> None:
    """Cosine similarity and relative error of each pass's pooled (and CLS) embedding against the clean one."""
    views = {"pooled": lambda h: h.mean(dim=1)}
    if has_cls:
        views["cls"] = lambda h: h[:, 0]
    for which, view in views.items():
        clean_bd = view(hidden["clean"]).double()
        for mode in (m for m in hidden if m != "clean"):
            e_bd = view(hidden[mode]).double()
            scores.add(f"{which}_cos_{mode}", torch.nn.functional.cosine_similarity(e_bd, clean_bd, dim=-1, eps=0))
            scores.add(f"{which}_rel_err_{mode}", (e_bd - clean_bd).norm(dim=-1) / clean_bd.norm(dim=-1))


def _ratio(num: float, den: float, scale: float) -> float | None:
    """num / den, None when den is zero within float32 noise of the quantities it is made of (`scale`: their
    magnitude), where the quotient would be noise (e.g. 0 / -2e-16 = -0.0 when the ablation changes nothing)."""
    if not abs(den) > NOISE_FRAC * abs(scale) or not math.isfinite(num / den):
        return None
    return num / den


# The baselines a recovered fraction is measured against: (pass, suffix of the ratio's name).
BASELINES = (("ablated", ""), ("mean_ablated", "_vs_mean"))


def summarize(scores: Scores, causal: bool) -> dict:
    """The averaged metrics plus the recovered fractions against each baseline present (module docstring); every
    metric but the clean ones null, with a warning, when nothing scored is downstream of a spliced position."""
    out = {name: scores.mean(name) for name in sorted(scores.sums)}
    baselines = [(mode, suffix) for mode, suffix in BASELINES if f"ce_{mode}" in out or f"pooled_cos_{mode}" in out]
    if causal:
        ce_s, ce_c = out["ce_spliced"], out["ce_clean"]
        for mode, suffix in baselines:
            ce_a, kl_a = out[f"ce_{mode}"], out[f"kl_{mode}"]
            out[f"ce_loss_recovered{suffix}"] = _ratio(ce_a - ce_s, ce_a - ce_c, max(abs(ce_a), abs(ce_c)))
            out[f"kl_score{suffix}"] = _ratio(kl_a - out["kl_spliced"], kl_a, ce_c)  # KL noise: nats
        out["n_scored_tokens"] = scores.counts["ce_clean"]
    else:
        for which in ("pooled", "cls"):
            for mode, suffix in baselines if f"{which}_cos_spliced" in out else ():
                cos_s, cos_a = out[f"{which}_cos_spliced"], out[f"{which}_cos_{mode}"]
                err_s, err_a = out[f"{which}_rel_err_spliced"], out[f"{which}_rel_err_{mode}"]
                out[f"{which}_cos_recovered{suffix}"] = _ratio(cos_s - cos_a, 1 - cos_a, 1.0)
                out[f"{which}_rel_err_recovered{suffix}"] = _ratio(err_a - err_s, err_a, 1.0)  # relative already
        out["n_scored_examples"] = scores.counts["pooled_cos_spliced"]
    if scores.n_spliced is not None:
        out["n_scored_spliced"] = scores.n_spliced
    if scores.n_spliced == 0:
        logger.warning("nothing scored is downstream of a spliced position (every spliced position is the last of "
                       "its example, or there is none): the splice cannot change what is scored; its metrics are "
                       "null")  # fmt: skip
        kept = ("ce_clean", "n_scored_tokens", "n_scored_examples", "n_scored_spliced")
        out = {name: (value if name in kept else None) for name, value in out.items()}
    return out


def n_spliced_scored(mask_bt: torch.Tensor, causal: bool) -> int:
    """Scored tokens (causal: the prediction at position i sees positions 0..i, and positions 0..T-2 are scored) or
    examples (an encoder's embedding sees every position) that a spliced position can change."""
    if causal:
        return int(mask_bt.cummax(dim=1).values[:, :-1].sum())
    return int(mask_bt.any(dim=1).sum())
