"""Datasets for extraction: image folders, segmentation folders, generated images, text corpora.

Each dataset is a frozen dataclass whose fields are exactly what goes into the hashed `data` object
(`dataclasses.asdict` plus `__class__`, saev protocol 2.1). Listing items is cheap (file names, sorted, so the
order is the same on every machine); decoding happens during extraction.

Images go through the checkpoint's own image processor (`ProcessorPreprocess`, transformers' AutoImageProcessor:
its resize mode and size, crop, resample, rescale and normalization) when it ships one; random-init models, and
`preprocess: resize_crop`, get `Preprocess`: resize the shorter side to `resize_size` (bicubic), center-crop
`image_size`, scale to [0, 1], normalize by mean/std. Every image dataset also yields a side row
(`aux_fname` names its file):
- ImageFolder: the example's class index (sorted sub-folder names) as one int32, written to classes.bin, so any
  class count fits (ImageNet's 1000 included); the class names are hashed in `data["classes"]`;
- one uint8 label per patch (CLS excluded), written to labels.bin, as the protocol defines it:
- SegFolder: from the mask, resized with nearest neighbour and cropped like the image, then per patch either the
  majority value or, with `label_rule: prefer_foreground`, the most frequent non-background value when any;
- GeneratedImages: the shape under each patch (0 background, 1 rectangle, 2 ellipse), majority rule.

Text corpora yield documents (strings); `extraction.tokenization` turns them into fixed-length examples. `HFDataset`
reads a Hugging Face `datasets` dataset on local disk (text or images, with an optional class label column).

File-backed datasets are hashed by a content fingerprint of their files (`extraction.fingerprints`): computed once,
then kept by (path, size, mtime_ns, inode), so planning stats files and reads none.
"""

import dataclasses
import functools
import hashlib
import json
import pathlib
import typing

import numpy as np

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import fingerprints
from saeflow.store.layout import ShardLayout

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
MASK_SUFFIXES = (".png", ".bmp", ".gif", ".tif", ".tiff")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
LABEL_RULES = ("majority", "prefer_foreground")
BUILTIN_CORPORA = ("python-docs",)
# Field defaults of every dataset kind: the schema's (config.schema.yaml), never a second copy here.
_DEFAULTS = config.dataset_defaults()


def _data_dict(cfg) -> dict:
    """The hashed fields (all but those marked `hashed: False`, which are hashed elsewhere) and the class name."""
    fields = [f.name for f in dataclasses.fields(cfg) if f.metadata.get("hashed", True)]
    return {**{name: getattr(cfg, name) for name in fields}, "__class__": type(cfg).__name__}


def _preprocess_field(kind: str):
    """`preprocess: processor | resize_crop`; hashed as `data["preprocess"]` (what it resolves to), not here."""
    return dataclasses.field(default=_DEFAULTS[kind]["preprocess"], metadata={"hashed": False})


def _root(path: str, key: str) -> pathlib.Path:
    root = pathlib.Path(path).expanduser().resolve()
    if not root.exists():
        raise SaeflowError(f"dataset.{key}: {root} does not exist")
    return root


def _images_in(dpath: pathlib.Path, suffixes=IMAGE_SUFFIXES) -> list[pathlib.Path]:
    return sorted(p for p in dpath.rglob("*") if p.suffix.lower() in suffixes and p.is_file())


def _limit(items: list, n_ex: int | None, where: str) -> list:
    if not items:
        raise SaeflowError(f"{where}: the dataset is empty")
    if n_ex is not None:
        if n_ex > len(items):
            raise SaeflowError(f"{where}: n_ex={n_ex} but the dataset has only {len(items)} examples")
        items = items[:n_ex]
    return items


# ---------------------------------------------------------------------------------------------------------------
# Image preprocessing
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# Image datasets
# ---------------------------------------------------------------------------------------------------------------


class _Folder:
    """Shared by datasets read from a directory `root` with a sorted list `items`; `check` opens each file."""

    @property
    def dataset_path(self) -> str:
        return str(_root(self.root, "root"))

    def __len__(self) -> int:
        return len(self.items)

    def check(self, progress: bool = False) -> None:
        from tqdm import tqdm

        for item in tqdm(self.items, desc="check images", unit="img", disable=not progress, leave=False):
            for fpath in item:
                if isinstance(fpath, pathlib.Path):
                    _check_image(fpath)

    def data(self) -> dict:
        """The hashed description: the fields, the absolute root and the content fingerprint of the files."""
        return {**_data_dict(self), "root": self.dataset_path, "sha256": self.fingerprint.sha256}


@dataclasses.dataclass(frozen=True)
class ImageFolder(_Folder):
    """root/<class>/<image>: sorted class names give label indices."""

    root: str
    n_ex: int | None = _DEFAULTS["image_folder"]["n_ex"]
    preprocess: str = _preprocess_field("image_folder")

    aux_fname = ShardLayout.CLASSES_FNAME  # one int32 class id per example

    @functools.cached_property
    def classes(self) -> list[str]:
        root = _root(self.root, "root")
        return sorted(p.name for p in root.iterdir() if p.is_dir())

    @functools.cached_property
    def fingerprint(self) -> fingerprints.Fingerprint:
        """Every image of every class (also those past n_ex); from the fingerprint cache after the first time."""
        root = _root(self.root, "root")
        return fingerprints.of_files(root, [root / name for name in self.classes], IMAGE_SUFFIXES)

    def __len__(self) -> int:
        """From the fingerprint's file count: planning never lists the images into Python objects."""
        n_files = self.fingerprint.n_files
        where = f"dataset.root {self.dataset_path} (class sub-folders with images)"
        if n_files == 0:
            raise SaeflowError(f"{where}: the dataset is empty")
        if self.n_ex is not None and self.n_ex > n_files:
            raise SaeflowError(f"{where}: n_ex={self.n_ex} but the dataset has only {n_files} examples")
        return n_files if self.n_ex is None else self.n_ex

    @functools.cached_property
    def items(self) -> list[tuple[pathlib.Path, int]]:
        root = _root(self.root, "root")
        items = [(p, c) for c, name in enumerate(self.classes) for p in _images_in(root / name)]
        return _limit(items, self.n_ex, f"dataset.root {root} (class sub-folders with images)")

    def example(self, i: int, pre: Preprocess) -> tuple[np.ndarray, np.int32]:
        fpath, label = self.items[i]
        return pre.pixels(_open_image(fpath)), np.int32(label)

    def data(self) -> dict:
        return {**super().data(), "classes": self.classes}


@dataclasses.dataclass(frozen=True)
class SegFolder(_Folder):
    """root/<images>/<stem>.<ext> with root/<masks>/<stem>.png (pixel value = class) -> per-patch labels."""

    root: str
    images: str = _DEFAULTS["segmentation_folder"]["images"]
    masks: str = _DEFAULTS["segmentation_folder"]["masks"]
    label_rule: str = _DEFAULTS["segmentation_folder"]["label_rule"]
    background: int = _DEFAULTS["segmentation_folder"]["background"]
    n_ex: int | None = _DEFAULTS["segmentation_folder"]["n_ex"]
    preprocess: str = _preprocess_field("segmentation_folder")

    aux_fname = ShardLayout.LABELS_FNAME  # one uint8 label per patch

    @functools.cached_property
    def fingerprint(self) -> fingerprints.Fingerprint:
        root = _root(self.root, "root")
        starts = [root / self.images, root / self.masks]
        return fingerprints.of_files(root, [p for p in starts if p.exists()], IMAGE_SUFFIXES + MASK_SUFFIXES)

    @functools.cached_property
    def items(self) -> list[tuple[pathlib.Path, pathlib.Path]]:
        root = _root(self.root, "root")
        if self.label_rule not in LABEL_RULES:
            raise SaeflowError(f"dataset.label_rule must be one of {LABEL_RULES}, got {self.label_rule!r}")
        masks = {
            p.relative_to(root / self.masks).with_suffix(""): p for p in _images_in(root / self.masks, MASK_SUFFIXES)
        }
        items = []
        for img in _images_in(root / self.images):
            key = img.relative_to(root / self.images).with_suffix("")
            if key not in masks:
                raise SaeflowError(f"dataset: image {img} has no mask {root / self.masks / key}.png")
            items.append((img, masks[key]))
        return _limit(items, self.n_ex, f"dataset.root {root / self.images}")

    def example(self, i: int, pre: Preprocess) -> tuple[np.ndarray, np.ndarray]:
        img, mask = self.items[i]
        try:
            labels = pre.patch_labels(_open_image(mask), self.label_rule, self.background)
        except SaeflowError as err:
            raise SaeflowError(f"{mask}: {err}") from None
        return pre.pixels(_open_image(img)), labels


@dataclasses.dataclass(frozen=True)
class GeneratedImages:
    """Procedural images from a seed (rectangles and ellipses on a colored background): no files, no download."""

    n_ex: int = _DEFAULTS["generated_images"]["n_ex"]
    seed: int = _DEFAULTS["generated_images"]["seed"]
    size: int = _DEFAULTS["generated_images"]["size"]
    preprocess: str = _preprocess_field("generated_images")

    dataset_path = "generated-images"  # not a directory: the images exist only as this recipe
    aux_fname = ShardLayout.LABELS_FNAME  # one uint8 shape label per patch
    LABEL_NAMES = ("background", "rectangle", "ellipse")  # what each value of labels.bin means

    def __len__(self) -> int:
        if self.n_ex < 1:
            raise SaeflowError(f"dataset.n_ex must be at least 1, got {self.n_ex}")
        return self.n_ex

    def check(self, progress: bool = False) -> None:
        len(self)

    def image(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """uint8 RGB (size, size, 3) and its shape mask (size, size): the same for the same (seed, i) anywhere."""
        rng = np.random.default_rng([self.seed, i])
        s = self.size
        img_hwc = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), (s, s, 3)).copy()
        mask_hw = np.zeros((s, s), np.uint8)
        yy, xx = np.mgrid[0:s, 0:s]
        for _ in range(int(rng.integers(1, 4))):
            shape = int(rng.integers(1, 3))
            cy, cx = rng.integers(0, s, 2)
            hy, hx = rng.integers(s // 8, s // 3 + 1, 2)
            if shape == 1:
                inside = (abs(yy - cy) <= hy) & (abs(xx - cx) <= hx)
            else:
                inside = ((yy - cy) / hy) ** 2 + ((xx - cx) / hx) ** 2 <= 1.0
            img_hwc[inside] = rng.integers(0, 256, 3, dtype=np.uint8)
            mask_hw[inside] = shape
        noise = rng.integers(-8, 9, img_hwc.shape)
        return np.clip(img_hwc.astype(np.int16) + noise, 0, 255).astype(np.uint8), mask_hw

    def example(self, i: int, pre: Preprocess) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        img_hwc, mask_hw = self.image(i)
        return pre.pixels(Image.fromarray(img_hwc)), pre.patch_labels(Image.fromarray(mask_hw))

    def data(self) -> dict:
        return _data_dict(self)


def _open_image(fpath: pathlib.Path):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(fpath)
        img.load()
        return img
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise SaeflowError(f"{fpath}: unreadable image ({err})") from None


def _check_image(fpath: pathlib.Path) -> None:
    """Header-level check (fast): catches non-images and truncated headers before any model runs."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(fpath) as img:
            img.verify()
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise SaeflowError(f"{fpath}: unreadable image ({err})") from None


# ---------------------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """A .txt file (one document), a .jsonl file or a .parquet file (one document per row, in `field`), or a
    directory of such files (sorted by name)."""

    path: str
    field: str = _DEFAULTS["text"]["field"]
    n_ex: int | None = _DEFAULTS["text"]["n_ex"]

    @property
    def dataset_path(self) -> str:
        return str(_root(self.path, "path"))

    @functools.cached_property
    def files(self) -> list[pathlib.Path]:
        path = _root(self.path, "path")
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
        for fpath in files:
            if fpath.suffix not in TEXT_SUFFIXES:
                raise SaeflowError(f"dataset.path {fpath}: unsupported text file type; use one of {TEXT_SUFFIXES}")
        if not files:
            raise SaeflowError(f"dataset.path {path}: no {'/'.join(TEXT_SUFFIXES)} files in it")
        return files

    @property
    def label(self) -> str:
        """The corpus as a message names it: its file, or its directory and the files in it."""
        if not _root(self.path, "path").is_dir():
            return f"dataset.path {self.path}"
        names = [str(fpath.relative_to(_root(self.path, "path"))) for fpath in self.files]
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"dataset.path {self.path} ({listed})"

    def documents(self) -> typing.Iterator[str]:
        for fpath in self.files:
            yield from _read_documents(fpath, self.field)

    @functools.cached_property
    def fingerprint(self) -> fingerprints.Fingerprint:
        """The content of every file (names relative to the path); from the fingerprint cache after a first time."""
        return fingerprints.of_files(_root(self.path, "path"), self.files, TEXT_SUFFIXES)

    def data(self) -> dict:
        return {**_data_dict(self), "path": self.dataset_path, "sha256": self.fingerprint.sha256}


def _read_documents(fpath: pathlib.Path, field: str) -> typing.Iterator[str]:
    try:
        if fpath.suffix == ".txt":
            yield fpath.read_text(encoding="utf-8")
        elif fpath.suffix == ".jsonl":
            with open(fpath, encoding="utf-8") as fd:
                for lineno, line in enumerate(fd, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as err:
                        raise SaeflowError(f"{fpath}:{lineno}: not valid JSON ({err})") from None
                    if not isinstance(row, dict) or not isinstance(row.get(field), str):
                        raise SaeflowError(f"{fpath}:{lineno}: no string field {field!r} (set dataset.field)")
                    yield row[field]
        else:
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(fpath)
            if field not in pf.schema_arrow.names:
                raise SaeflowError(
                    f"{fpath}: no column {field!r}; columns are {pf.schema_arrow.names} (set dataset.field)"
                )
            for batch in pf.iter_batches(columns=[field]):
                for value in batch.column(0).to_pylist():
                    if not isinstance(value, str):
                        raise SaeflowError(f"{fpath}: column {field!r} holds {type(value).__name__}, not text")
                    yield value
    except (OSError, UnicodeDecodeError) as err:
        raise SaeflowError(f"{fpath}: unreadable ({err})") from None


@dataclasses.dataclass(frozen=True)
class BuiltinCorpus:
    """Text that every Python installation already has: the `pydoc_data` help topics (the language reference).

    No download; its sha256 is hashed, so a different Python release (different text) gives a different directory.
    """

    name: str = _DEFAULTS["builtin_text"]["name"]
    n_ex: int | None = _DEFAULTS["builtin_text"]["n_ex"]

    dataset_path = "builtin-corpus"  # not a directory: the text ships with Python

    @property
    def label(self) -> str:
        return f"dataset builtin_text {self.name!r}"

    def documents(self) -> typing.Iterator[str]:
        if self.name not in BUILTIN_CORPORA:
            raise SaeflowError(f"dataset.name: unknown built-in corpus {self.name!r}; known: {BUILTIN_CORPORA}")
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        for key in sorted(topics):
            yield topics[key]

    def data(self) -> dict:
        digest = hashlib.sha256("\x00".join(self.documents()).encode("utf-8")).hexdigest()
        return {**_data_dict(self), "sha256": digest}


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face `datasets`
# ---------------------------------------------------------------------------------------------------------------

HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


@dataclasses.dataclass(frozen=True)
class HFDataset:
    """A Hugging Face `datasets` dataset on local disk: a `save_to_disk` directory (memory-mapped Arrow, read in
    place), or .parquet/.arrow/.jsonl files opened through `datasets` (text: streamed, so a corpus larger than memory
    works). `text_column` feeds a text model; `image_column` (and an integer `label_column`, written to
    classes.bin) a vision model. Hashed by the content fingerprint of every file under `path`; the number of
    examples is cached with it, so planning does not import `datasets` after the first time."""

    path: str
    split: str = _DEFAULTS["hf_dataset"]["split"]
    text_column: str | None = _DEFAULTS["hf_dataset"]["text_column"]
    image_column: str | None = _DEFAULTS["hf_dataset"]["image_column"]
    label_column: str | None = _DEFAULTS["hf_dataset"]["label_column"]
    n_ex: int | None = _DEFAULTS["hf_dataset"]["n_ex"]
    preprocess: str = _preprocess_field("hf_dataset")

    def __post_init__(self):
        if (self.text_column is None) == (self.image_column is None):
            raise SaeflowError("dataset (hf_dataset): give exactly one of text_column or image_column")
        if self.label_column is not None and self.image_column is None:
            raise SaeflowError("dataset (hf_dataset): label_column goes with image_column")

    @property
    def dataset_path(self) -> str:
        return str(_root(self.path, "path"))

    @property
    def aux_fname(self) -> str | None:
        return ShardLayout.CLASSES_FNAME if self.label_column is not None else None

    @functools.cached_property
    def fingerprint(self) -> fingerprints.Fingerprint:
        root = _root(self.path, "path")
        return fingerprints.of_files(root, [root], tuple(HF_FILE_BUILDERS))  # data files and their JSON state

    def _open(self, streaming: bool):
        import datasets as hf

        root = _root(self.path, "path")
        try:
            if root.is_dir() and ((root / "dataset_dict.json").exists() or (root / "state.json").exists()):
                ds = hf.load_from_disk(str(root))
                if isinstance(ds, hf.DatasetDict):
                    if self.split not in ds:
                        raise SaeflowError(f"dataset.split: {root} has splits {sorted(ds)}, not {self.split!r}")
                    ds = ds[self.split]
                return ds.to_iterable_dataset() if streaming else ds
            files = sorted(p for p in root.rglob("*") if p.suffix in HF_FILE_BUILDERS) if root.is_dir() else [root]
            builders = {HF_FILE_BUILDERS.get(p.suffix) for p in files}
            if not files or len(builders) != 1 or None in builders:
                raise SaeflowError(f"dataset.path {root}: not a save_to_disk directory nor one kind of "
                                   f"{'/'.join(HF_FILE_BUILDERS)} files")  # fmt: skip
            return hf.load_dataset(builders.pop(), data_files={self.split: [str(p) for p in files]},
                                   split=self.split, streaming=streaming)  # fmt: skip
        except (OSError, ValueError, FileNotFoundError) as err:
            raise SaeflowError(f"dataset.path {root}: cannot open it with `datasets` ({err})") from None

    def _column(self, ds, name: str, key: str) -> None:
        columns = list(ds.column_names or ds.features or [])
        if columns and name not in columns:  # (streamed JSON knows its columns only once read)
            raise SaeflowError(f"dataset.{key}: no column {name!r} in {self.path}; columns are {columns}")

    @functools.cached_property
    def _table(self):
        """The map-style dataset (images need random access): memory-mapped, decoded one row at a time."""
        ds = self._open(streaming=False)
        self._column(ds, self.image_column, "image_column")
        if self.label_column is not None:
            self._column(ds, self.label_column, "label_column")
        return ds

    @property
    def label(self) -> str:
        return f"dataset.path {self.path} (text_column {self.text_column!r})"

    def documents(self) -> typing.Iterator[str]:
        ds = self._open(streaming=True)
        self._column(ds, self.text_column, "text_column")
        for row in ds:
            if self.text_column not in row:
                raise SaeflowError(f"dataset.text_column: no column {self.text_column!r} in {self.path}")
            value = row[self.text_column]
            if not isinstance(value, str):
                raise SaeflowError(f"dataset.text_column {self.text_column!r} holds {type(value).__name__}, not text")
            yield value

    def __len__(self) -> int:
        key = {"what": "hf_dataset rows", "data": self.data()}
        n_rows = fingerprints.cached_value(key, lambda: len(self._table))
        if n_rows == 0:
            raise SaeflowError(f"dataset.path {self.dataset_path}: the dataset is empty")
        if self.n_ex is not None and self.n_ex > n_rows:
            raise SaeflowError(f"dataset.path {self.dataset_path}: n_ex={self.n_ex} but it has only {n_rows} rows")
        return n_rows if self.n_ex is None else self.n_ex

    def check(self, progress: bool = False) -> None:
        len(self)

    def example(self, i: int, pre) -> tuple[np.ndarray, np.int32 | None]:
        row = self._table[i]
        img = row[self.image_column]
        if not hasattr(img, "convert"):
            raise SaeflowError(f"dataset.image_column {self.image_column!r}: row {i} holds {type(img).__name__}")
        label = None if self.label_column is None else np.int32(row[self.label_column])
        return pre.pixels(img), label

    def data(self) -> dict:
        return {**_data_dict(self), "path": self.dataset_path, "sha256": self.fingerprint.sha256}


def is_text(dataset) -> bool:
    """Whether a dataset feeds a text model (documents) rather than a vision model (images)."""
    if isinstance(dataset, HFDataset):
        return dataset.text_column is not None
    return isinstance(dataset, (TextCorpus, BuiltinCorpus))


def from_config(obj: dict):
    """The dataset object of one `dataset:` config entry (already validated by the schema)."""
    kinds = {
        "image_folder": ImageFolder,
        "segmentation_folder": SegFolder,
        "generated_images": GeneratedImages,
        "text": TextCorpus,
        "builtin_text": BuiltinCorpus,
        "hf_dataset": HFDataset,
    }
    obj = dict(obj)
    kind = obj.pop("kind", None)
    if kind not in kinds:
        raise SaeflowError(f"dataset.kind must be one of {sorted(kinds)}, got {kind!r}")
    cls = kinds[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    if obj.keys() - names:
        raise SaeflowError(f"dataset ({kind}): unknown keys {sorted(obj.keys() - names)}; allowed: {sorted(names)}")
    return cls(**obj)
