"""Drawing: top-k image grids with patch heatmaps, text contexts shaded by activation, the summary plots."""

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from saeflow.analysis.inference import l0_spread
from saeflow.analysis.visuals.examples import ImageExamples, TextExamples
from saeflow.store import layout

TEXT_PNG_WIDTH = 960
LINE_PX = 20


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


def draw_summary(latents: dict[str, np.ndarray], out: layout.VisualsLayout) -> None:
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
    fig.savefig(out.plot_fpath("freq_vs_mean"))
    plt.close(fig)

    hist = latents["l0_hist"]
    last = int(np.flatnonzero(hist).max()) + 1 if hist.any() else 1
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    ax.bar(np.arange(last), hist[:last], width=1.0)
    ax.set_xlabel("active latents per token (L0)")
    ax.set_ylabel("tokens")
    if hist.any():  # L0 varies per token (a threshold, ReLU): its mean with its spread (inference.l0_spread)
        spread = l0_spread(hist)
        mean = float((np.arange(len(hist)) * hist).sum() / hist.sum())
        ax.set_title(f"L0 mean {mean:.1f}, std {spread['l0_std']:.1f}; 10th-90th percentile "
                     f"{spread['l0_p10']}-{spread['l0_p90']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out.plot_fpath("l0_hist"))
    plt.close(fig)
