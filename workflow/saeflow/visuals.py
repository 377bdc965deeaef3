"""Visuals of an inference dump: RUN/inference/<shard_hash>/visuals/, a static site that works from file://.

    index.html, app.js, style.css   the browser (search by id, sort by frequency, lazy-rendered rows)
    data.js                          every latent's statistics + the drawn latents' top-k (a script, not JSON,
                                     so file:// pages can load it without a server)
    latents/<id>.png                 per drawn latent: top-k images with a patch heatmap (and patch labels when the
                                     shards have labels.bin), or top-k text contexts with tokens shaded by strength
    freq_vs_mean.png, l0_hist.png    summary plots
    config.json                      what was drawn

Per-token activations of the top examples are recomputed from the shards with the run's SAE (a few examples per
latent), so memory does not depend on the size of patch_acts.npz.
"""

import dataclasses
import json
import logging
import math
import pathlib
import shutil

import numpy as np
import torch
import tqdm
from PIL import Image, ImageDraw, ImageFont

from saeflow import atomic, config, datasets, inference, layout, runs, tokenization
from saeflow.errors import SaeflowError

logger = logging.getLogger(__name__)

ASSETS_DPATH = pathlib.Path(__file__).resolve().parent / "assets"
ASSET_FNAMES = (layout.DumpLayout.INDEX_FNAME, "app.js", "style.css")
SELECTIONS = config.section_enum("visuals", "selection")
TEXT_PNG_WIDTH = 960
LINE_PX = 20
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
    tokenizer: str | None = None  # HF id or local directory; needed when the shards came from a local model
    force: bool = False

    def __post_init__(self):
        object.__setattr__(self, "latents", tuple(int(i) for i in self.latents))
        if self.selection not in SELECTIONS:
            raise SaeflowError(f"visuals selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.selection == "list" and not self.latents:
            raise SaeflowError("visuals selection 'list' needs latent ids (--latents 3 17 ...)")
        for key in ("n_latents", "top_k", "tile_px"):
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
    """Token ids from tokens.bin, shown as strings by the model's tokenizer (ids when it cannot be loaded)."""

    kind = "text"

    def __init__(self, token_ids_nt: np.ndarray, tokenizer_name: str):
        self.token_ids_nt = token_ids_nt
        try:
            self.tokenizer = tokenization.from_pretrained(tokenizer_name)
        except Exception as err:  # noqa: BLE001 - any failure means "show ids"
            logger.warning("tokenizer %s not loadable (%s); showing token ids (pass --tokenizer PATH_OR_ID)",
                           tokenizer_name, err)
            self.tokenizer = None

    def tokens(self, ex: int) -> list[str]:
        ids = [int(i) for i in self.token_ids_nt[ex]]
        if self.tokenizer is None:
            return [f"#{i}" for i in ids]
        return [self.tokenizer.decode([i]) for i in ids]


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
            heat = _cmap_rgba("inferno", patch_acts_kp[i].reshape(side, side) / vmax)
            heat[..., 3] = (180 * patch_acts_kp[i].reshape(side, side) / vmax).astype(np.uint8)
            heat_img = Image.fromarray(heat, "RGBA").resize((tile_px, tile_px), Image.Resampling.NEAREST)
            img = Image.alpha_composite(img, heat_img)
        grid.paste(img.convert("RGB"), (x0, y0))
        draw.text((x0 + 3, y0 + 2), f"{examples.caption(ex)}  {value:.3g}", fill="white", font=_font(), stroke_width=1,
                  stroke_fill="black")
        if labels_kp is not None and side * side == labels_kp.shape[1]:
            lab = _cmap_rgba("tab20", (labels_kp[i].reshape(side, side) % 20) / 19.0)[..., :3]
            grid.paste(Image.fromarray(lab, "RGB").resize((tile_px, tile_px), Image.Resampling.NEAREST),
                       (x0, y0 + tile_px))
    return grid


def text_context(examples: TextExamples, ex: int, token: int, acts_t: np.ndarray, n_side: int) -> dict:
    """The tokens around the firing token with their activations."""
    start, stop = max(0, token - n_side), min(len(acts_t), token + n_side + 1)
    return {
        "example": ex,
        "token": token,
        "offset": start,
        "tokens": examples.tokens(ex)[start:stop],
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
    with atomic.exclusive_lock(dump_dpath.parent / f".{dump_dpath.name}.visuals.lock"):
        if final_dpath.exists() and not cfg.force:
            logger.info("reusing %s (pass --force to redraw)", final_dpath)
            return final_dpath
        staging = atomic.staging_dpath(final_dpath)
        with _writable(dump_dpath):
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


class _writable:
    """Let the (read-only, published) dump directory take a new entry, then make it read-only again."""

    def __init__(self, dpath: pathlib.Path):
        self.dpath = dpath

    def __enter__(self):
        self.dpath.chmod(0o755)

    def __exit__(self, *exc):
        self.dpath.chmod(atomic.READONLY_DIR_MODE)


def _render(cfg, dump, model, sd, layer, chosen, vis_config, out_dpath: pathlib.Path) -> None:
    examples = open_examples(sd, cfg.tokenizer)
    md = sd.metadata
    lat = dump.latents
    show_labels = examples.kind == "image" and examples.patch_labels and sd.has_aux(layout.ShardLayout.LABELS_FNAME)
    labels = sd.aux(layout.ShardLayout.LABELS_FNAME) if show_labels else None
    drawn = {}
    for latent in tqdm.tqdm(chosen, desc="visuals", unit="latent", disable=None):
        top = top_rows(lat, latent, cfg.top_k, one_per_example=examples.kind == "image")
        entry = {"top": [[e, t, round(v, 4)] for e, t, v in top]}
        if top and examples.kind != "none":
            acts_kt = _latent_acts(model, sd, layer, [e for e, _, _ in top], latent)
            if examples.kind == "image":
                labels_kp = np.stack([labels[e] for e, _, _ in top]) if labels is not None else None
                img = draw_image_grid(examples, top, acts_kt, labels_kp, md.cls_token, cfg.tile_px)
            else:
                entry["contexts"] = [text_context(examples, e, t, acts_kt[i], cfg.context_tokens)
                                     for i, (e, t, _) in enumerate(top)]
                img = draw_text_contexts(entry["contexts"])
            entry["png"] = f"latents/{latent}.png"
            img.save(out_dpath / entry["png"])
        drawn[str(latent)] = entry
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
        },
        "freq": _round(lat["freq"]),
        "mean": _round(lat["mean_act"]),
        "max": _round(lat["max_act"]),
        "drawn": drawn,
    }
    (out_dpath / "data.js").write_text(
        "window.SAEFLOW_DATA = " + json.dumps(data, separators=(",", ":")) + ";\n", encoding="utf-8"
    )
    for fname in ASSET_FNAMES:
        shutil.copyfile(ASSETS_DPATH / fname, out_dpath / fname)
    atomic.write_json(out_dpath / "config.json", vis_config)
