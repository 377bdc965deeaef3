"""Visuals of an inference dump: RUN/inference/<shard_hash>/visuals/, a static site that works from file://.

    index.html, app.js, style.css   the browser (search by id, sort by frequency, lazy-rendered rows)
    data.js                          every latent's statistics + the drawn latents' top-k (a script, not JSON,
                                     so file:// pages can load it without a server)
    latents/<id>.png                 per drawn latent: top-k images with a patch heatmap (and patch labels when the
                                     shards have labels.bin), or top-k text contexts with tokens shaded by strength
    freq_vs_mean.png, l0_hist.png    summary plots
    labels.js                        the labels each latent predicts (saeflow probe; rewritten when it runs)
    config.json                      what was drawn

Per-token activations of the top examples are recomputed from the shards with the run's SAE (a few examples per
latent), so memory does not depend on the size of patch_acts.npz.
"""

import dataclasses
import json
import logging
import math
import pathlib
import shlex
import shutil

import numpy as np
import torch
import tqdm
from PIL import Image, ImageDraw, ImageFont

from saeflow import config
from saeflow.analysis import inference, latent_labels
from saeflow.errors import SaeflowError
from saeflow.extraction import datasets, tokenization
from saeflow.store import atomic, layout, runs

logger = logging.getLogger(__name__)

ASSETS_DPATH = pathlib.Path(__file__).resolve().parents[1] / "assets"
ASSET_FNAMES = (layout.DumpLayout.INDEX_FNAME, "app.js", "style.css")
SELECTIONS = config.section_enum("visuals", "selection")
TEXT_PNG_WIDTH = 960
LINE_PX = 20
HIST_BINS = 24
NEURONPEDIA_FNAME = "neuronpedia-batch.json"
DEFAULTS = config.section_defaults("visuals")


@dataclasses.dataclass(frozen=True)
class Config:
    """Which latents to draw and how."""

    run: pathlib.Path
    shards_hash: str | None = None
    selection: str = DEFAULTS["selection"]
    n_latents: int = DEFAULTS["n_latents"]
    latents: tuple[int, ...] = tuple(DEFAULTS["latents"])
    top_k: int = DEFAULTS["top_k"]
    seed: int = DEFAULTS["seed"]
    tile_px: int = DEFAULTS["tile_px"]
    context_tokens: int = DEFAULTS["context_tokens"]
    n_quantiles: int = DEFAULTS["n_quantiles"]
    quantile_examples: int = DEFAULTS["quantile_examples"]
    n_vocab: int = DEFAULTS["n_vocab"]
    tokenizer: str | None = None  # HF id or local directory; needed when the shards came from a local model
    force: bool = False

    def __post_init__(self):
        object.__setattr__(self, "latents", tuple(int(i) for i in self.latents))
        if self.selection not in SELECTIONS:
            raise SaeflowError(f"visuals selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.selection == "list" and not self.latents:
            raise SaeflowError("visuals selection 'list' needs latent ids (--latents 3 17 ...)")
        for key in ("n_latents", "top_k", "tile_px", "n_quantiles", "quantile_examples", "n_vocab"):
            if getattr(self, key) < 1:
                raise SaeflowError(f"visuals {key} must be at least 1, got {getattr(self, key)}")


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


def redraw_command(cfg: Config, shards_hash: str, drawn: list[int]) -> str:
    """The command a page shows for a latent it did not draw, less that latent's id (the page appends it): this
    run and dump, this page's settings, the latents it drew, redrawn over it (--force); runnable from anywhere."""
    keep = {key: value for key, value in dataclasses.asdict(cfg).items()
            if key in DEFAULTS and key not in ("selection", "n_latents", "latents")}  # fmt: skip
    argv = ["saeflow", "visuals", "--run", str(pathlib.Path(cfg.run).resolve()), "--shards-hash", shards_hash]
    argv += config.section_flags("visuals", keep) + (["--tokenizer", cfg.tokenizer] if cfg.tokenizer else [])
    return shlex.join([*argv, "--force", "--selection", "list", "--latents", *map(str, drawn)])


def choose_latents(cfg: Config, latents: dict[str, np.ndarray]) -> list[int]:
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


# ---------------------------------------------------------------------------------------------------------------
# Examples: what a row of the shards looks like to a person (an image or a token sequence)
# ---------------------------------------------------------------------------------------------------------------


class Examples:
    """Access to the source examples in shard order; `kind` is "image", "text" or "none"."""

    kind = "none"

    def image(self, ex: int) -> Image.Image:
        raise NotImplementedError

    def tokens(self, ex: int) -> list[str]:
        raise NotImplementedError


class ImageExamples(Examples):
    """Images rebuilt from the hashed `data` description, cropped as the model saw them."""

    kind = "image"

    def __init__(self, dataset, preprocess: "datasets.Preprocess | datasets.ProcessorPreprocess | None"):
        self.dataset = dataset
        self.preprocess = preprocess
        # ImageFolder has one class per example (classes.bin), no patch labels: its caption names the class.
        self.patch_labels = not isinstance(dataset, datasets.ImageFolder)

    def caption(self, ex: int) -> str:
        if isinstance(self.dataset, datasets.ImageFolder):
            return f"ex {ex} {self.dataset.classes[self.dataset.items[ex][1]]}"
        return f"ex {ex}"

    def image(self, ex: int) -> Image.Image:
        if isinstance(self.dataset, datasets.GeneratedImages):
            img = Image.fromarray(self.dataset.image(ex)[0])
        else:
            img = Image.open(self.dataset.items[ex][0]).convert("RGB")
        if self.preprocess is not None:
            return self.preprocess.view(img)
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        return img.crop((left, top, left + side, top + side))


class TextExamples(Examples):
    """Token ids from tokens.bin, shown with the tokenizer's own detokenization (ids when it cannot be loaded)."""

    kind = "text"

    def __init__(self, token_ids_nt: np.ndarray, tokenizer_name: str):
        self.token_ids_nt = token_ids_nt
        self.name = tokenizer_name
        try:
            self.tokenizer = tokenization.from_pretrained(tokenizer_name)
        except Exception as err:  # noqa: BLE001 - any failure means "show ids"
            logger.warning("tokenizer %s not loadable (%s); showing token ids (pass --tokenizer PATH_OR_ID)",
                           tokenizer_name, err)
            self.tokenizer = None
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", None) or ())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def pieces(self, ex: int, start: int, stop: int) -> tuple[list[str], list[int]]:
        """Tokens start..stop-1 of an example as the text pieces they add to the decoded string (leading spaces and
        subword joins as the tokenizer detokenizes: "a", " base", "class"), and the offsets of special tokens."""
        ids = [int(i) for i in self.token_ids_nt[ex]]
        if self.tokenizer is None:
            return [f"#{i}" for i in ids[start:stop]], []
        lead = ids[max(0, start - 1) : start]  # one token of left context, so a word piece joins (no space) right
        prev, out = self._decode(lead), []
        for j in range(start, stop):
            text = self._decode(lead + ids[start : j + 1])
            out.append(text[len(prev) :] if text.startswith(prev) else self._decode([ids[j]]))
            prev = text
        return out, [j - start for j in range(start, stop) if ids[j] in self.special_ids]

    def tokens(self, ex: int) -> list[str]:
        return self.pieces(ex, 0, self.token_ids_nt.shape[1])[0]

    def token_text(self, token_id: int) -> str:
        """One vocabulary entry as a reader sees it (the tokenizer's token string: "##ing", "Ġthe" -> " the")."""
        text = self._decode([token_id])
        return text if text.strip() else repr(text)


def _preprocess_from(pre: dict | None):
    """The geometry recorded in `data["preprocess"]`: the processor's settings, or the resize-and-crop fields."""
    if not pre:
        return None
    if pre.get("mode") == "processor":  # only its geometry is used here: no processor is loaded
        return datasets.ProcessorPreprocess("", None, pre["settings"], pre["image_size"], pre["patch_size"])
    pre_names = {f.name for f in dataclasses.fields(datasets.Preprocess)}
    return datasets.Preprocess(**{k: v for k, v in pre.items() if k in pre_names})


def open_examples(sd, tokenizer: str | None = None) -> Examples:
    """Text: `tokenizer`, else the model directory recorded in provenance.json by extraction, else the name the
    shards were tokenized with (an HF id). Images: the dataset rebuilt from the metadata."""
    md = sd.metadata
    if sd.has_aux(layout.ShardLayout.TOKENS_FNAME):
        recorded = (sd.provenance() or {}).get("model_source")
        name = tokenizer or recorded or md.data.get("tokenization", {}).get("tokenizer") or md.ckpt
        return TextExamples(sd.aux(layout.ShardLayout.TOKENS_FNAME), name)
    cls = getattr(datasets, str(md.data.get("__class__")), None)
    if cls in (datasets.ImageFolder, datasets.SegFolder, datasets.GeneratedImages):
        names = {f.name for f in dataclasses.fields(cls)}
        dataset = cls(**{k: v for k, v in md.data.items() if k in names})
        return ImageExamples(dataset, _preprocess_from(md.data.get("preprocess")))
    return Examples()


# ---------------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------------


def _font(size: int = 12) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _cmap_rgba(name: str, x: np.ndarray) -> np.ndarray:
    import matplotlib

    return (matplotlib.colormaps[name](x) * 255).astype(np.uint8)


def draw_image_grid(examples: ImageExamples, top, acts_kt: np.ndarray, labels_kp: np.ndarray | None, cls_token: bool,
                    tile_px: int) -> Image.Image:
    """Top-k images, each with its patch activations as a heatmap; patch labels in a second row when given."""
    k = len(top)
    cols = math.ceil(math.sqrt(k))
    rows = math.ceil(k / cols)
    tile_h = tile_px * (2 if labels_kp is not None else 1)
    grid = Image.new("RGB", (cols * tile_px, rows * tile_h), "white")
    patch_acts_kp = acts_kt[:, 1:] if cls_token else acts_kt
    side = math.isqrt(patch_acts_kp.shape[1])
    vmax = max(float(patch_acts_kp.max()), 1e-12)
    draw = ImageDraw.Draw(grid)
    for i, (ex, _, value) in enumerate(top):
        x0, y0 = (i % cols) * tile_px, (i // cols) * tile_h
        img = examples.image(ex).resize((tile_px, tile_px), Image.Resampling.BICUBIC).convert("RGBA")
        if side * side == patch_acts_kp.shape[1]:
            img = _overlay_heatmap(img, patch_acts_kp[i].reshape(side, side) / vmax, tile_px)
        grid.paste(img.convert("RGB"), (x0, y0))
        draw.text((x0 + 3, y0 + 2), f"{examples.caption(ex)}  {value:.3g}", fill="white", font=_font(), stroke_width=1,
                  stroke_fill="black")
        if labels_kp is not None and side * side == labels_kp.shape[1]:
            lab = _cmap_rgba("tab20", (labels_kp[i].reshape(side, side) % 20) / 19.0)[..., :3]
            grid.paste(Image.fromarray(lab, "RGB").resize((tile_px, tile_px), Image.Resampling.NEAREST),
                       (x0, y0 + tile_px))
    return grid


def _overlay_heatmap(img: Image.Image, a_hw: np.ndarray, tile_px: int) -> Image.Image:
    """Patches where the latent is silent are dimmed; firing patches are tinted (inferno, more opaque when stronger) and
    the strongest patch is outlined, so the heatmap reads at a glance over any image."""
    heat = _cmap_rgba("inferno", 0.3 + 0.7 * a_hw)
    heat[..., 3] = np.where(a_hw > 0, 40 + 170 * a_hw, 140).astype(np.uint8)
    heat[a_hw <= 0, :3] = 0
    img = Image.alpha_composite(img, Image.fromarray(heat, "RGBA").resize((tile_px, tile_px), Image.Resampling.NEAREST))
    side = a_hw.shape[0]
    r, c = divmod(int(np.argmax(a_hw)), side)
    cell = tile_px / side
    ImageDraw.Draw(img).rectangle((c * cell, r * cell, (c + 1) * cell - 1, (r + 1) * cell - 1), outline="cyan", width=2)
    return img


def text_context(examples: TextExamples, ex: int, token: int, acts_t: np.ndarray, n_side: int) -> dict:
    """The tokens around the firing token with their activations."""
    start, stop = max(0, token - n_side), min(len(acts_t), token + n_side + 1)
    pieces, special = examples.pieces(ex, start, stop)
    return {
        "example": ex,
        "token": token,
        "offset": start,
        "tokens": pieces,
        "special": special,
        "acts": [round(float(a), 4) for a in acts_t[start:stop]],
    }


def draw_text_contexts(contexts: list[dict], width_px: int = TEXT_PNG_WIDTH) -> Image.Image:
    """One block per context, tokens shaded orange by activation (relative to the latent's max shown)."""
    font = _font(14)
    vmax = max([max(c["acts"], default=0) for c in contexts] + [1e-12])
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines: list[list[tuple[str, float, bool]]] = []
    for ctx in contexts:
        line, x = [], 0
        for j, (tok, act) in enumerate(zip(ctx["tokens"], ctx["acts"])):
            tok = tok.replace("\n", "\\n") or "_"
            w = measure.textlength(tok, font=font) + 2
            if x + w > width_px - 8 and line:
                lines.append(line)
                line, x = [], 0
            line.append((tok, act, ctx["offset"] + j == ctx["token"]))
            x += w
        lines.append(line)
        lines.append([])  # a blank line between contexts
    img = Image.new("RGB", (width_px, max(1, len(lines)) * LINE_PX), "white")
    draw = ImageDraw.Draw(img)
    for row, line in enumerate(lines):
        x = 4
        for tok, act, is_top in line:
            w = measure.textlength(tok, font=font) + 2
            a = act / vmax
            draw.rectangle((x, row * LINE_PX + 1, x + w, (row + 1) * LINE_PX - 2),
                           fill=(255, int(255 - 120 * a), int(255 - 255 * a)), outline="black" if is_top else None)
            draw.text((x + 1, row * LINE_PX + 2), tok, fill="black", font=font)
            x += w
    return img


def draw_summary(latents: dict[str, np.ndarray], out_dpath: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alive = latents["n_fires"] > 0
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    ax.scatter(np.log10(latents["freq"][alive]), np.log10(latents["mean_act"][alive]), s=4, alpha=0.5)
    ax.set_xlabel("log10 firing frequency")
    ax.set_ylabel("log10 mean activation when firing")
    ax.set_title(f"{int(alive.sum())} live latents of {len(alive)}")
    fig.tight_layout()
    fig.savefig(out_dpath / layout.DumpLayout.plot_fname("freq_vs_mean"))
    plt.close(fig)

    hist = latents["l0_hist"]
    last = int(np.flatnonzero(hist).max()) + 1 if hist.any() else 1
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    ax.bar(np.arange(last), hist[:last], width=1.0)
    ax.set_xlabel("active latents per token (L0)")
    ax.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(out_dpath / layout.DumpLayout.plot_fname("l0_hist"))
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# The whole stage
# ---------------------------------------------------------------------------------------------------------------


def _round(arr: np.ndarray) -> list:
    return [float(f"{v:.4g}") for v in arr.tolist()]


def top_rows(lat: dict[str, np.ndarray], latent: int, k: int, one_per_example: bool) -> list[tuple[int, int, float]]:
    """The latent's best (example, token, value) rows; an image appears once (its best patch) when asked."""
    top, seen = [], set()
    for ex, tok, value in zip(lat["topk_example"][latent], lat["topk_token"][latent], lat["topk_values"][latent]):
        if ex < 0 or len(top) == k:
            break
        if one_per_example and ex in seen:
            continue
        seen.add(ex)
        top.append((int(ex), int(tok), float(value)))
    return top


@torch.no_grad()
def _latent_acts(model, sd, layer: int, examples_k: list[int], latent: int) -> np.ndarray:
    """(k, T) activations of one latent on every token of the given examples."""
    x_ktd = np.stack([sd.example(ex, layer) for ex in examples_k]).astype(np.float32)
    k, T, d = x_ktd.shape
    return model.encode(torch.from_numpy(x_ktd.reshape(k * T, d)))[:, latent].reshape(k, T).numpy()


def make_visuals(cfg: Config) -> pathlib.Path:
    """Write (or, unless forced, reuse) RUN/inference/<hash>/visuals/ and return its path."""
    run = runs.open_run(cfg.run)
    dump_dpath = find_dump(run, cfg.shards_hash)
    dump = inference.load_dump(dump_dpath)
    run, model, sd, layer = inference.open_inputs(run.root, pathlib.Path(dump.config["shards"]))
    chosen = choose_latents(cfg, dump.latents)
    final_dpath = layout.DumpLayout(dump_dpath).visuals_dpath
    vis_config = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("run", "force")},
                  "latents_drawn": chosen}
    vis_config["shards_hash"] = dump_dpath.name
    with atomic.exclusive_lock(latent_labels.visuals_lock_fpath(dump_dpath)):
        if final_dpath.exists() and not cfg.force:
            logger.info("reusing %s (pass --force to redraw)", final_dpath)
            return final_dpath
        staging = atomic.staging_dpath(final_dpath)
        with latent_labels.writable_dir(dump_dpath):
            atomic.remove_staging(staging)
            (staging / "latents").mkdir(parents=True)
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
    examples = open_examples(sd, cfg.tokenizer)
    md = sd.metadata
    lat = dump.latents
    show_labels = examples.kind == "image" and examples.patch_labels and sd.has_aux(layout.ShardLayout.LABELS_FNAME)
    labels = sd.aux(layout.ShardLayout.LABELS_FNAME) if show_labels else None
    values = latent_values(dump, chosen)
    vocab, vocab_note = vocab_effects(cfg, examples, md.family, model, chosen)
    drawn = {}
    for latent in tqdm.tqdm(chosen, desc="visuals", unit="latent", disable=None):
        pen = _Pen(cfg, examples, model, sd, layer, labels, out_dpath)
        drawn[str(latent)] = {**pen.latent(lat, latent, *values[latent]), **vocab.get(latent, {})}
    draw_summary(lat, out_dpath)
    data = {
        "meta": {
            "run": str(dump.config["run"]),
            "shard_hash": dump.dpath.name,
            "layer": layer,
            "kind": examples.kind,
            "d_sae": dump.d_sae,
            "n_rows": dump.metrics.get("n_vectors"),
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
    (out_dpath / "data.js").write_text(
        "window.SAEFLOW_DATA = " + json.dumps(data, separators=(",", ":")) + ";\n", encoding="utf-8"
    )
    probe_result = latent_labels.probe_result_of(pathlib.Path(cfg.run), dump.dpath.name, dump.config.get("sae_sha256"))
    labelled = any(sd.has_aux(fname) for fname in (layout.ShardLayout.LABELS_FNAME, layout.ShardLayout.CLASSES_FNAME))
    (out_dpath / layout.DumpLayout.LABELS_JS_FNAME).write_bytes(latent_labels.labels_js(probe_result, labelled))
    if examples.kind == "text":
        atomic.write_json(out_dpath / NEURONPEDIA_FNAME, neuronpedia_batch(data, md))
    for fname in ASSET_FNAMES:
        shutil.copyfile(ASSETS_DPATH / fname, out_dpath / fname)
    atomic.write_json(out_dpath / "config.json", vis_config)


# ---------------------------------------------------------------------------------------------------------------
# Per latent: its activation distribution, examples across it, and the tokens its decoder direction writes
# ---------------------------------------------------------------------------------------------------------------


def latent_values(dump, chosen: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{latent: (rows, values)} of every row where each chosen latent fires, from patch_acts.npz (memory: the CSR)."""
    import scipy.sparse

    csc = scipy.sparse.load_npz(layout.DumpLayout(dump.dpath).acts_fpath)[:, chosen].tocsc()
    spans = [slice(csc.indptr[j], csc.indptr[j + 1]) for j in range(len(chosen))]
    return {latent: (csc.indices[sp].astype(np.int64), csc.data[sp]) for latent, sp in zip(chosen, spans)}


def histogram(vals_n: np.ndarray, n_bins: int = HIST_BINS) -> dict:
    """Counts of the firing values in `n_bins` equal bins over [0, max]."""
    hi = float(vals_n.max()) if len(vals_n) else 0.0
    counts, _ = np.histogram(vals_n, bins=n_bins, range=(0.0, hi or 1.0))
    return {"lo": 0.0, "hi": round(hi, 4), "counts": counts.tolist()}


def quantile_rows(rows_n, vals_n, T: int, cfg: Config, latent: int, one_per_example: bool) -> list[dict]:
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
        top = top_rows(lat, latent, self.cfg.top_k, one_per_example=image)
        entry = {"top": [[e, t, round(v, 4)] for e, t, v in top], "hist": histogram(vals_n), "quantiles": []}
        if not top or self.examples.kind == "none":
            return entry
        T = self.sd.metadata.tokens_per_ex
        bands = quantile_rows(rows_n, vals_n, T, self.cfg, latent, one_per_example=image)
        examples_needed = sorted({e for e, _, _ in top} | {e for band in bands for e, _, _ in band["rows"]})
        acts = dict(zip(examples_needed, _latent_acts(self.model, self.sd, self.layer, examples_needed, latent)))
        entry["png"] = self.draw(top, acts, f"latents/{latent}.png")
        if not image:
            entry["contexts"] = [self.context(e, t, acts) for e, t, _ in top]
        for b, band in enumerate(bands):
            shown = {"q": band["q"], "range": band["range"], "rows": [[e, t, round(v, 4)] for e, t, v in band["rows"]]}
            if image and band["rows"]:
                shown["png"] = self.draw(band["rows"], acts, f"latents/{latent}-q{b}.png")
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


def vocab_matrix(family: str, name: str) -> tuple[torch.Tensor, str]:
    """(vocabulary x d_model matrix, what it is): a causal LM's unembedding, else the input word embeddings.

    Only that one tensor is read from the checkpoint's safetensors (a 7B model is not loaded to read its LM head);
    a checkpoint without safetensors is loaded whole.
    """
    import transformers

    from saeflow.analysis.evaluate import CAUSAL_FAMILIES

    causal = family in CAUSAL_FAMILIES
    what = "unembedding (the LM head)" if causal else (
        "input word embeddings: an encoder has no unembedding, so these are the tokens whose embeddings the "
        "decoder direction points towards / away from, not a logit effect"
    )
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    with torch.device("meta"):
        skeleton = auto.from_config(transformers.AutoConfig.from_pretrained(name))
    weight = (skeleton.get_output_embeddings() if causal else skeleton.get_input_embeddings()).weight
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    prefix = f"{skeleton.base_model_prefix}."
    keys = [*names, *(n.removeprefix(prefix) for n in names), *(prefix + n for n in names)]
    tensor = _safetensors_tensor(name, keys)
    if tensor is None:
        model = auto.from_pretrained(name)
        tensor = (model.get_output_embeddings() if causal else model.get_input_embeddings()).weight.detach()
    return tensor.float(), what


def _safetensors_tensor(name: str, keys: list[str]) -> torch.Tensor | None:
    """The first of `keys` stored in the checkpoint's safetensors (single file or sharded index), else None."""
    from safetensors import safe_open

    from saeflow.extraction import models

    index_fpath = models.model_file(name, None, "model.safetensors.index.json")
    if index_fpath is not None:
        weight_map = models.read_json(index_fpath).get("weight_map", {})
        files = {key: weight_map[key] for key in keys if key in weight_map}
    else:
        files = dict.fromkeys(keys, "model.safetensors")
    for key, fname in files.items():
        fpath = models.model_file(name, None, fname)
        if fpath is None:
            return None
        with safe_open(str(fpath), framework="pt") as st:
            if key in st.keys():
                return st.get_tensor(key)
    return None


def vocab_effects(cfg: Config, examples, family: str, model, chosen: list[int]) -> tuple[dict, str]:
    """{latent: {"promote": [[token, value]...], "suppress": [...]}} from decoder row x vocabulary matrix, and a note
    saying which matrix (or why there are none)."""
    if not isinstance(examples, TextExamples) or examples.tokenizer is None:
        return {}, "" if examples.kind != "text" else "no tokenizer, so no promoted tokens"
    try:
        W_vd, what = vocab_matrix(family, examples.name)
    except Exception as err:  # noqa: BLE001 - no weights here (random-init model, offline cache miss): say why
        return {}, f"promoted tokens unavailable: cannot load the weights of {examples.name} ({type(err).__name__})"
    if W_vd.shape[1] != model.d_model:
        d_vocab = W_vd.shape[1]
        return {}, f"promoted tokens unavailable: {examples.name} has d={d_vocab}, the SAE d_model={model.d_model}"
    with torch.no_grad():
        effects_sv = model.W_dec[chosen].float() @ W_vd.T  # the direction's sign and ranking (scale is positive)
    n = min(cfg.n_vocab, W_vd.shape[0])
    out = {}
    for j, latent in enumerate(chosen):
        order = torch.argsort(effects_sv[j], descending=True, stable=True).tolist()
        out[latent] = {
            key: [[examples.token_text(i), round(float(effects_sv[j, i]), 4)] for i in ids]
            for key, ids in (("promote", order[:n]), ("suppress", order[::-1][:n]))
        }
    return out, what


def token_index(drawn: dict) -> dict[str, list]:
    """{token (stripped, lower case): [[latent, "top" | "promoted"], ...]}: the page's search by token."""
    index: dict[str, list] = {}
    for latent, entry in drawn.items():
        for ctx in entry.get("contexts", []):
            key = ctx["tokens"][ctx["token"] - ctx["offset"]].strip().lower()
            if key and [int(latent), "top"] not in index.setdefault(key, []):
                index[key].append([int(latent), "top"])
        for tok, _ in entry.get("promote", []):
            key = tok.strip().lower()
            if key and [int(latent), "promoted"] not in index.setdefault(key, []):
                index[key].append([int(latent), "promoted"])
    return index


# ---------------------------------------------------------------------------------------------------------------
# Export: the batch JSON SAEDashboard's Neuronpedia runner writes (sae_dashboard/neuronpedia/neuronpedia_dashboard.py)
# ---------------------------------------------------------------------------------------------------------------

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
