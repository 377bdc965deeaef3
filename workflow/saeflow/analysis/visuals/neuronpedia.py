"""Export: the batch JSON SAEDashboard's Neuronpedia runner writes
(sae_dashboard/neuronpedia/neuronpedia_dashboard.py)."""

import pathlib

# Per-feature keys SAEDashboard fills from analyses saeflow does not run (neuron alignment, correlations, logit
# histogram, attention-head allocation): present, empty, as SAEDashboard writes them when it skips those analyses.
NEURONPEDIA_EMPTY_KEYS = (
    "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1", "correlated_neurons_indices",
    "correlated_neurons_l1", "correlated_neurons_pearson", "correlated_features_indices", "correlated_features_l1",
    "correlated_features_pearson", "logits_hist_data_bar_heights", "logits_hist_data_bar_values",
    "decoder_weights_dist",
)  # fmt: skip


def _np_activation(ctx: dict, bin_min: float, bin_max: float, bin_contains: float) -> dict:
    return {"bin_min": bin_min, "bin_max": bin_max, "bin_contains": bin_contains, "tokens": ctx["tokens"],
            "values": ctx["acts"]}  # fmt: skip


def neuronpedia_feature(latent: str, entry: dict, freq: float, md) -> dict:
    """One drawn latent as a NeuronpediaDashboardFeature dict: top activations as the bin (-1, max, -1), each
    quantile band as (its lowest, its highest activation, the fraction of firing tokens in it)."""
    hist = entry["hist"]
    width = (hist["hi"] - hist["lo"]) / len(hist["counts"]) if hist["counts"] else 0.0
    top_max = entry["top"][0][2] if entry["top"] else 0.0
    activations = [_np_activation(c, -1, top_max, -1) for c in entry.get("contexts", [])]
    for band in entry["quantiles"]:
        share = (band["q"][1] - band["q"][0]) / 100
        activations += [_np_activation(c, band["range"][0], band["range"][1], share) for c in band.get("contexts", [])]
    return {
        "feature_index": int(latent),
        **{key: [] for key in NEURONPEDIA_EMPTY_KEYS},
        "neg_str": [t for t, _ in entry.get("suppress", [])],
        "neg_values": [v for _, v in entry.get("suppress", [])],
        "pos_str": [t for t, _ in entry.get("promote", [])],
        "pos_values": [v for _, v in entry.get("promote", [])],
        "frac_nonzero": freq,
        "freq_hist_data_bar_values": [round(hist["lo"] + (j + 0.5) * width, 4) for j in range(len(hist["counts"]))],
        "freq_hist_data_bar_heights": hist["counts"],
        "n_prompts_total": md.n_ex,
        "n_tokens_in_prompt": md.tokens_per_ex,
        "dataset": md.dataset,
        "activations": activations,
    }


def neuronpedia_batch(data: dict, md) -> dict:
    """The drawn latents as one NeuronpediaDashboardBatch dict (model_id, layer, sae_set, features)."""
    drawn = data["drawn"].items()
    features = [neuronpedia_feature(latent, entry, data["freq"][int(latent)], md) for latent, entry in drawn]
    return {
        "model_id": md.ckpt,
        "layer": data["meta"]["layer"],
        "sae_set": f"saeflow-{pathlib.Path(data['meta']['run']).name[:12]}",
        "features": features,
    }
