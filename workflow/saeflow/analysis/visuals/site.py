"""The visuals stage: which latents to draw, drawn into a staging directory and published as
RUN/inference/<shard_hash>/visuals/ (replacing an older drawing atomically with --force)."""

import dataclasses
import json
import logging
import pathlib
import shlex
import shutil

import numpy as np
import tqdm

from saeflow import config
from saeflow.analysis import inference, latent_labels
from saeflow.analysis.visuals.draw import draw_summary
from saeflow.analysis.visuals.examples import open_examples
from saeflow.analysis.visuals.latents import _Pen, latent_values
from saeflow.analysis.visuals.neuronpedia import neuronpedia_batch
from saeflow.analysis.visuals.settings import DEFAULTS, VisualsConfig
from saeflow.analysis.visuals.vocab import token_index, vocab_effects
from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.store import atomic, layout, runs
from saeflow.training import loaders

logger = logging.getLogger(__name__)

ASSETS_DPATH = pathlib.Path(__file__).resolve().parent / "assets"


def find_dump(run: runs.Run, shards_hash: str | None) -> pathlib.Path:
    """RUN/inference/<hash>/; the hash may be omitted when the run has exactly one dump."""
    inference_dpath = run.inference_dpath
    hashes = sorted(p.name for p in inference_dpath.iterdir() if p.is_dir() and not p.name.startswith(".")) if (
        inference_dpath.is_dir()
    ) else []
    if shards_hash is None:
        if len(hashes) != 1:
            raise SaeflowError(
                f"{inference_dpath}: {len(hashes)} inference dumps ({', '.join(hashes) or 'none'}); "
                + ("run `saeflow inference` first" if not hashes else "choose one with --shards-hash")
            )
        shards_hash = hashes[0]
    if shards_hash not in hashes:
        raise SaeflowError(f"{run.dump(shards_hash).dpath}: no such inference dump; have {', '.join(hashes) or 'none'}")
    return run.dump(shards_hash).dpath


def redraw_command(cfg: VisualsConfig, shards_hash: str, drawn: list[int]) -> str:
    """The command a page shows for a latent it did not draw, less that latent's id (the page appends it): this
    run and dump, this page's settings, the latents it drew, redrawn over it (--force); runnable from anywhere."""
    keep = {key: value for key, value in dataclasses.asdict(cfg).items()
            if key in DEFAULTS and key not in ("selection", "n_latents", "latents")}  # fmt: skip
    argv = ["saeflow", "visuals", "--run", str(pathlib.Path(cfg.run).resolve()), "--shards-hash", shards_hash]
    argv += config.section_flags("visuals", keep) + (["--tokenizer", cfg.tokenizer] if cfg.tokenizer else [])
    return shlex.join([*argv, "--force", "--selection", "list", "--latents", *map(str, drawn)])


def choose_latents(cfg: VisualsConfig, latents: dict[str, np.ndarray]) -> list[int]:
    """Latent ids to draw: most frequent first, a seeded random sample of live latents, or an explicit list."""
    d_sae = len(latents["freq"])
    if cfg.selection == "list":
        bad = [i for i in cfg.latents if not 0 <= i < d_sae]
        if bad:
            raise SaeflowError(f"unknown latent id(s) {bad}: this SAE has latents 0..{d_sae - 1}")
        return list(dict.fromkeys(cfg.latents))
    alive = np.flatnonzero(latents["n_fires"] > 0)
    if cfg.selection == "random":
        rng = np.random.default_rng(cfg.seed)
        return sorted(rng.choice(alive, size=min(cfg.n_latents, len(alive)), replace=False).tolist())
    order = alive[np.argsort(-latents["freq"][alive], kind="stable")]
    return order[: cfg.n_latents].tolist()


def _round(arr: np.ndarray) -> list:
    return [float(f"{v:.4g}") for v in arr.tolist()]


def make_visuals(cfg: VisualsConfig) -> pathlib.Path:
    """Write (or, unless forced, reuse) RUN/inference/<hash>/visuals/ and return its path."""
    run = runs.open_run(cfg.run)
    dump_dpath = find_dump(run, cfg.shards_hash)
    dump = inference.load_dump(dump_dpath)
    run, model, sd, layer = inference.open_inputs(run.root, pathlib.Path(dump.config["shards"]))
    chosen = choose_latents(cfg, dump.latents)
    dump_layout = layout.DumpLayout(dump_dpath)
    final_dpath = dump_layout.visuals_dpath
    vis_config = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("run", "force")},
                  "latents_drawn": chosen}
    vis_config["shards_hash"] = dump_dpath.name
    with atomic.exclusive_lock(dump_layout.visuals_lock_fpath):
        if final_dpath.exists() and not cfg.force:
            logger.info("reusing %s (pass --force to redraw)", final_dpath)
            return final_dpath
        staging = atomic.staging_dpath(final_dpath)
        with latent_labels.writable_dir(dump_dpath):
            atomic.remove_staging(staging)
            layout.VisualsLayout(staging).latents_dpath.mkdir(parents=True)
            try:
                _render(cfg, dump, model, sd, layer, chosen, vis_config, staging)
                old = atomic.staging_dpath(final_dpath, "old")
                if final_dpath.exists():  # --force: swap the new drawing in, the old one back on failure
                    atomic.remove_staging(old)
                    final_dpath.rename(old)
                try:
                    atomic.publish_dir(staging, final_dpath)
                except BaseException:
                    if old.exists() and not final_dpath.exists():
                        old.rename(final_dpath)
                    raise
                atomic.remove_staging(old)
            finally:
                atomic.remove_staging(staging)
    return final_dpath


def _render(cfg, dump, model, sd, layer, chosen, vis_config, out_dpath: pathlib.Path) -> None:
    out = layout.VisualsLayout(out_dpath)
    examples = open_examples(sd, cfg.tokenizer)
    md = sd.metadata
    lat = dump.latents
    show_labels = examples.kind == "image" and examples.patch_labels and sd.has_aux(layout.ShardLayout.LABELS_FNAME)
    labels = sd.aux(layout.ShardLayout.LABELS_FNAME) if show_labels else None
    tokens = runs.open_run(cfg.run).tokens()
    values = latent_values(dump, chosen, loaders.TokenSelection(sd, tokens))
    vocab, vocab_note = vocab_effects(cfg, examples, md.family, model, chosen)
    drawn = {}
    for latent in tqdm.tqdm(chosen, desc="visuals", unit="latent", disable=None):
        pen = _Pen(cfg, examples, model, sd, layer, labels, out_dpath)
        drawn[str(latent)] = {**pen.latent(lat, latent, *values[latent]), **vocab.get(latent, {})}
    draw_summary(lat, out)
    data = {
        "meta": {
            "run": str(dump.config["run"]),
            "shard_hash": dump.dpath.name,
            "layer": layer,
            "hook": hooks.stored(md.data),  # what the latents read; a transcoder's prediction replaces `writes`
            "writes": dump.config.get("target_hook"),
            "kind": examples.kind,
            "d_sae": dump.d_sae,
            "n_rows": dump.metrics.get("n_vectors"),
            "tokens": tokens,
            "tokens_per_ex": md.tokens_per_ex,
            "metrics": dump.metrics,
            "vocab_note": vocab_note,
            "redraw": redraw_command(cfg, dump.dpath.name, chosen),
        },
        "freq": _round(lat["freq"]),
        "mean": _round(lat["mean_act"]),
        "max": _round(lat["max_act"]),
        "drawn": drawn,
        "token_index": token_index(drawn),
    }
    out.data_fpath.write_text(
        "window.SAEFLOW_DATA = " + json.dumps(data, separators=(",", ":")) + ";\n", encoding="utf-8"
    )
    probe_result = latent_labels.probe_result_of(pathlib.Path(cfg.run), dump.dpath.name, dump.config.get("sae_sha256"))
    labelled = any(sd.has_aux(fname) for fname in (layout.ShardLayout.LABELS_FNAME, layout.ShardLayout.CLASSES_FNAME))
    out.labels_js_fpath.write_bytes(latent_labels.labels_js(probe_result, labelled))
    if examples.kind == "text":
        atomic.write_json(out.neuronpedia_fpath, neuronpedia_batch(data, md))
    for fname in out.ASSET_FNAMES:
        shutil.copyfile(ASSETS_DPATH / fname, out.dpath / fname)
    atomic.write_json(out.config_fpath, vis_config)
