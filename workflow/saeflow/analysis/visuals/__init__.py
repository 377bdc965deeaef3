"""Visuals of an inference dump: RUN/inference/<shard_hash>/visuals/, a static site that works from file://.

    index.html, app.js, style.css   the browser (search by id, sort by frequency, lazy-rendered rows)
    data.js                          every latent's statistics + the drawn latents' top-k (a script, not JSON,
                                     so file:// pages can load it without a server)
    latents/<id>.png                 per drawn latent: top-k images with a patch heatmap (and patch labels when the
                                     shards have labels.bin), or top-k text contexts with tokens shaded by strength
    freq_vs_mean.png, l0_hist.png    summary plots
    labels.js                        the labels each latent predicts (saeflow probe; rewritten when it runs)
    config.json                      what was drawn

site.py (the stage: choose, render, publish), settings.py, examples.py, latents.py, draw.py, vocab.py,
neuronpedia.py.
Per-token activations of the top examples are recomputed from the shards with the run's SAE (a few examples per
latent), so memory does not depend on the size of patch_acts.npz.
"""

from saeflow.analysis.visuals.draw import LINE_PX, TEXT_PNG_WIDTH
from saeflow.analysis.visuals.latents import top_rows
from saeflow.analysis.visuals.settings import VisualsConfig
from saeflow.analysis.visuals.site import choose_latents, make_visuals

__all__ = ["LINE_PX", "TEXT_PNG_WIDTH", "VisualsConfig", "choose_latents", "make_visuals", "top_rows"]
