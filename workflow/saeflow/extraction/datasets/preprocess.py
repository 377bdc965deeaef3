"""Image preprocessing: how pixels reach the model, hashed inside `data` as `preprocess`.

Images go through the checkpoint's own image processor (`ProcessorPreprocess`, transformers' AutoImageProcessor:
its resize mode and size, crop, resample, rescale and normalization) when it ships one; random-init models, and
`preprocess: resize_crop`, get `Preprocess`: resize the shorter side to `resize_size` (bicubic), center-crop
`image_size`, scale to [0, 1], normalize by mean/std. Masks (patch labels) and the visuals' view of an image follow
the same geometry.
"""

import dataclasses
import functools

import numpy as np

from saeflow.errors import SaeflowError


class _ImageGeometry:
    """What both preprocessing rules share: masks and the visuals' view follow the same resize and crop as the
    pixels (each rule defines `_geometry(img, resample)`)."""

    patch_size: int

    def patch_labels(self, mask, rule: str = "majority", background: int = 0) -> np.ndarray:
        """Label mask (PIL, mode L/P/I) -> uint8 (n_patches,), row-major patch order like the ViT."""
        from PIL import Image

        m_hw = np.asarray(self._geometry(mask, Image.Resampling.NEAREST))
        return patch_labels(m_hw, self.patch_size, rule, background)

    def view(self, img):
        """The image as the model sees it (before normalization), for visuals."""
        from PIL import Image

        return self._geometry(img.convert("RGB"), Image.Resampling.BICUBIC)


@dataclasses.dataclass(frozen=True)
class Preprocess(_ImageGeometry):
    """How pixels reach the model; hashed inside `data` as `preprocess`."""

    resize_size: int
    image_size: int
    patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: str = "bicubic"

    def _geometry(self, img, resample):
        w, h = img.size
        scale = self.resize_size / min(w, h)
        new_w, new_h = max(self.image_size, round(w * scale)), max(self.image_size, round(h * scale))
        img = img.resize((new_w, new_h), resample=resample)
        left, top = (new_w - self.image_size) // 2, (new_h - self.image_size) // 2
        return img.crop((left, top, left + self.image_size, top + self.image_size))

    def pixels(self, img) -> np.ndarray:
        """RGB PIL image -> normalized float32 (3, image_size, image_size)."""
        from PIL import Image

        x_hwc = np.asarray(self._geometry(img.convert("RGB"), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
        x_hwc = (x_hwc - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(x_hwc.transpose(2, 0, 1))

    def hashed(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProcessorPreprocess(_ImageGeometry):
    """The checkpoint's own image processor (`transformers.AutoImageProcessor`): stored activations are those of
    `model(**processor(images))`. Its preprocessor_config.json is hashed inside `data` as `preprocess.settings`;
    masks follow the same geometry (resize as `size` says, center crop as `crop_size` says) with nearest neighbour."""

    source: str  # local directory or HF id the processor loads from (not hashed: `ckpt` names the checkpoint)
    revision: str | None  # resolved commit (not hashed, same reason)
    settings: dict  # preprocessor_config.json
    image_size: int
    patch_size: int

    def pixels(self, img) -> np.ndarray:
        """RGB PIL image -> float32 (3, image_size, image_size), exactly as the processor returns it."""
        x_chw = _image_processor(self.source, self.revision)(images=[img.convert("RGB")], return_tensors="np")
        x_chw = np.asarray(x_chw["pixel_values"][0], np.float32)
        if x_chw.shape != (3, self.image_size, self.image_size):
            raise SaeflowError(
                f"the image processor of {self.source} returned pixels of shape {x_chw.shape}, not "
                f"(3, {self.image_size}, {self.image_size}); set dataset.preprocess: resize_crop"
            )
        return x_chw

    def _geometry_settings(self) -> dict:
        """resize/crop settings: the loaded processor's (its class fills what the JSON leaves out); without a source
        (visuals, which load no processor) the JSON's."""
        if not self.source:
            return self.settings
        proc = _image_processor(self.source, self.revision)
        out = {}
        for key in ("do_resize", "size", "do_center_crop", "crop_size"):
            value = getattr(proc, key, None)
            if value is not None and not isinstance(value, (bool, int, dict)):  # SizeDict
                value = {k: v for k, v in vars(value).items() if v is not None}
            out[key] = value
        return out

    def _geometry(self, img, resample):
        settings = self._geometry_settings()
        if settings.get("do_resize", True):
            size = settings.get("size") or {}
            w, h = img.size
            if isinstance(size, int):
                size = {"shortest_edge": size} if settings.get("do_center_crop") else {"height": size, "width": size}
            if "shortest_edge" in size:
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
                w, h = (new_short, new_long) if w <= h else (new_long, new_short)
            else:
                w, h = size["width"], size["height"]
            img = img.resize((w, h), resample=resample)
        if settings.get("do_center_crop"):
            crop = settings.get("crop_size") or {}
            crop_h, crop_w = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
            top, left = (img.size[1] - crop_h) // 2, (img.size[0] - crop_w) // 2
            img = img.crop((left, top, left + crop_w, top + crop_h))
        return img

    def hashed(self) -> dict:
        sizes = {"image_size": self.image_size, "patch_size": self.patch_size}
        return {"mode": "processor", "settings": self.settings, **sizes}


@functools.lru_cache(maxsize=4)
def _image_processor(source: str, revision: str | None):
    """AutoImageProcessor of a checkpoint, loaded once per process (DataLoader workers load their own)."""
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as err:
        raise SaeflowError(f"cannot load the image processor of {source!r}: {err}") from None


def preprocess_for(info, mode: str) -> "Preprocess | ProcessorPreprocess":
    """How pixels reach model `info` (a models.ModelInfo): its own processor when `mode` is processor and the
    checkpoint ships a preprocessor_config.json, else the bicubic resize and center crop (random-init models)."""
    if mode == "processor" and info.preprocessor and info.source is not None:
        return ProcessorPreprocess(info.source, info.revision, info.preprocessor, info.image_size, info.patch_size)
    return Preprocess(info.resize_size, info.image_size, info.patch_size, info.mean, info.std)


def patch_labels(m_hw: np.ndarray, patch_size: int, rule: str, background: int) -> np.ndarray:
    if m_hw.ndim != 2:
        raise SaeflowError(f"a mask must be single-channel, got shape {m_hw.shape}")
    if m_hw.size and (m_hw.min() < 0 or m_hw.max() > 255):
        raise SaeflowError(f"mask values must be in 0..255 to fit labels.bin (uint8), got {m_hw.min()}..{m_hw.max()}")
    g = m_hw.shape[0] // patch_size
    p_gpgp = m_hw[: g * patch_size, : g * patch_size].astype(np.int64).reshape(g, patch_size, g, patch_size)
    p_np = p_gpgp.transpose(0, 2, 1, 3).reshape(g * g, patch_size * patch_size)
    counts_n256 = np.zeros((g * g, 256), np.int64)
    np.add.at(counts_n256, (np.arange(g * g)[:, None], p_np), 1)
    if rule == "prefer_foreground":
        fg_n256 = counts_n256.copy()
        fg_n256[:, background] = 0
        has_fg = fg_n256.sum(1) > 0
        return np.where(has_fg, fg_n256.argmax(1), background).astype(np.uint8)
    return counts_n256.argmax(1).astype(np.uint8)  # ties go to the smaller label
