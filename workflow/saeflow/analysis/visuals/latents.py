"""One drawn latent: its activation distribution, its top examples and samples across its quantile bands."""

import numpy as np
import torch

from saeflow.analysis.visuals.draw import draw_image_grid, draw_text_contexts, text_context
from saeflow.analysis.visuals.settings import VisualsConfig
from saeflow.store import layout

HIST_BINS = 24


def top_rows(lat: dict[str, np.ndarray], latent: int, k: int) -> list[tuple[int, int, float]]:
    """The latent's k best examples as (example, strongest token, value): inference keeps distinct examples."""
    ex_k, tok_k, val_k = lat["topk_example"][latent][:k], lat["topk_token"][latent][:k], lat["topk_values"][latent][:k]
    return [(int(ex), int(tok), float(value)) for ex, tok, value in zip(ex_k, tok_k, val_k) if ex >= 0]


@torch.no_grad()
def _latent_acts(model, sd, layer: int, examples_k: list[int], latent: int) -> np.ndarray:
    """(k, T) activations of one latent on every token of the given examples."""
    x_ktd = np.stack([sd.example(ex, layer) for ex in examples_k]).astype(np.float32)
    k, T, d = x_ktd.shape
    return model.encode(torch.from_numpy(x_ktd.reshape(k * T, d)))[:, latent].reshape(k, T).numpy()


def latent_values(dump, chosen: list[int], selection) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{latent: (rows, values)} of every row where each chosen latent fires among the rows `selection` (the tokens
    the SAE trained on, a loaders.TokenSelection) keeps, from patch_acts.npz (memory: the CSR)."""
    import scipy.sparse

    csc = scipy.sparse.load_npz(layout.DumpLayout(dump.dpath).acts_fpath)[:, chosen].tocsc()
    out = {}
    for j, latent in enumerate(chosen):
        rows_n = csc.indices[csc.indptr[j] : csc.indptr[j + 1]].astype(np.int64)
        kept_n = selection.keeps(rows_n)
        out[latent] = (rows_n[kept_n], csc.data[csc.indptr[j] : csc.indptr[j + 1]][kept_n])
    return out


def histogram(vals_n: np.ndarray, n_bins: int = HIST_BINS) -> dict:
    """Counts of the firing values in `n_bins` equal bins over [0, max]."""
    hi = float(vals_n.max()) if len(vals_n) else 0.0
    counts, _ = np.histogram(vals_n, bins=n_bins, range=(0.0, hi or 1.0))
    return {"lo": 0.0, "hi": round(hi, 4), "counts": counts.tolist()}


def quantile_rows(rows_n, vals_n, T: int, cfg: VisualsConfig, latent: int, one_per_example: bool) -> list[dict]:
    """Seeded samples from each quantile band of the firing values, strongest band first."""
    if len(vals_n) == 0:
        return []
    edges = np.quantile(vals_n, np.linspace(0.0, 1.0, cfg.n_quantiles + 1))
    rng = np.random.default_rng([cfg.seed, latent])
    bands = []
    for b in reversed(range(cfg.n_quantiles)):
        upper = vals_n <= edges[b + 1] if b == cfg.n_quantiles - 1 else vals_n < edges[b + 1]
        picked, seen = [], set()
        for i in rng.permutation(np.flatnonzero((vals_n >= edges[b]) & upper)):
            ex, tok = divmod(int(rows_n[i]), T)
            if one_per_example and ex in seen:
                continue
            seen.add(ex)
            picked.append((ex, tok, float(vals_n[i])))
            if len(picked) == cfg.quantile_examples:
                break
        q_lo, q_hi = round(100 * b / cfg.n_quantiles), round(100 * (b + 1) / cfg.n_quantiles)
        bands.append({"q": [q_lo, q_hi], "range": [round(float(edges[b]), 4), round(float(edges[b + 1]), 4)],
                      "rows": picked})  # fmt: skip
    return bands


class _Pen:
    """Draws one latent: its top examples and quantile samples (PNG grids for images, decoded contexts for text)."""

    def __init__(self, cfg, examples, model, sd, layer, labels, out_dpath):
        self.cfg, self.examples, self.model, self.sd, self.layer = cfg, examples, model, sd, layer
        self.labels, self.out_dpath = labels, out_dpath

    def latent(self, lat, latent: int, rows_n: np.ndarray, vals_n: np.ndarray) -> dict:
        image = self.examples.kind == "image"
        top = top_rows(lat, latent, self.cfg.top_k)
        entry = {"top": [[e, t, round(v, 4)] for e, t, v in top], "hist": histogram(vals_n), "quantiles": []}
        if not top or self.examples.kind == "none":
            return entry
        T = self.sd.metadata.tokens_per_ex
        bands = quantile_rows(rows_n, vals_n, T, self.cfg, latent, one_per_example=image)
        examples_needed = sorted({e for e, _, _ in top} | {e for band in bands for e, _, _ in band["rows"]})
        acts = dict(zip(examples_needed, _latent_acts(self.model, self.sd, self.layer, examples_needed, latent)))
        entry["png"] = self.draw(top, acts, layout.VisualsLayout.latent_png(latent))
        if not image:
            entry["contexts"] = [self.context(e, t, acts) for e, t, _ in top]
        for b, band in enumerate(bands):
            shown = {"q": band["q"], "range": band["range"], "rows": [[e, t, round(v, 4)] for e, t, v in band["rows"]]}
            if image and band["rows"]:
                shown["png"] = self.draw(band["rows"], acts, layout.VisualsLayout.latent_png(latent, b))
            elif band["rows"]:
                shown["contexts"] = [self.context(e, t, acts) for e, t, _ in band["rows"]]
            entry["quantiles"].append(shown)
        return entry

    def context(self, ex: int, tok: int, acts: dict) -> dict:
        return text_context(self.examples, ex, tok, acts[ex], self.cfg.context_tokens)

    def draw(self, rows: list, acts: dict, rel_fpath: str) -> str:
        acts_kt = np.stack([acts[e] for e, _, _ in rows])
        if self.examples.kind == "image":
            labels_kp = np.stack([self.labels[e] for e, _, _ in rows]) if self.labels is not None else None
            img = draw_image_grid(self.examples, rows, acts_kt, labels_kp, self.sd.metadata.cls_token, self.cfg.tile_px)
        else:
            img = draw_text_contexts([self.context(e, t, acts) for e, t, _ in rows])
        img.save(self.out_dpath / rel_fpath)
        return rel_fpath
