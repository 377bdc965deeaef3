"""Image datasets: ImageNet-style folders, segmentation folders (image + mask), generated images.

Every image dataset also yields a side row (`aux_fname` names its file):
- ImageFolder: the example's class index (sorted sub-folder names) as one int32, written to classes.bin, so any
  class count fits (ImageNet's 1000 included); the class names are hashed in `data["classes"]`;
- one uint8 label per patch (CLS excluded), written to labels.bin, as the protocol defines it:
- SegFolder: from the mask, resized with nearest neighbour and cropped like the image, then per patch either the
  majority value or, with `label_rule: prefer_foreground`, the most frequent non-background value when any;
- GeneratedImages: the shape under each patch (0 background, 1 rectangle, 2 ellipse), majority rule.
"""

import dataclasses
import functools
import pathlib

import numpy as np

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import fingerprints
from saeflow.extraction.datasets.base import _DEFAULTS, _data_dict, _preprocess_field, _root
from saeflow.extraction.datasets.preprocess import Preprocess
from saeflow.store.layout import ShardLayout

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
MASK_SUFFIXES = (".png", ".bmp", ".gif", ".tif", ".tiff")
LABEL_RULES = config.enum("activation_spec", "dataset", "segmentation_folder", "label_rule")


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


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face `datasets`
# ---------------------------------------------------------------------------------------------------------------
