"""Datasets for extraction, one module per family of `dataset.kind`:

    base.py        what every kind shares: its hashed fields, its defaults (the schema's), its root
    preprocess.py  how pixels reach the model (the checkpoint's image processor, or resize and crop)
    images.py      image_folder, segmentation_folder, generated_images (and their side rows)
    text.py        text, builtin_text
    hf.py          hf_dataset (a Hugging Face `datasets` dataset on local disk: text or images)
    kinds.py       `dataset.kind` -> its class

Each dataset is a frozen dataclass whose fields are exactly what goes into the hashed `data` object
(`dataclasses.asdict` plus `__class__`, saev protocol 2.1). Listing items is cheap (file names, sorted, so the
order is the same on every machine); decoding happens during extraction. File-backed datasets are hashed by a
content fingerprint of their files (`extraction.fingerprints`): computed once, then kept by (path, size, mtime_ns,
inode), so planning stats files and reads none.
"""

from saeflow.extraction.datasets.hf import HFDataset
from saeflow.extraction.datasets.images import GeneratedImages, ImageFolder, SegFolder
from saeflow.extraction.datasets.kinds import from_config, is_text
from saeflow.extraction.datasets.preprocess import Preprocess, ProcessorPreprocess, patch_labels, preprocess_for
from saeflow.extraction.datasets.text import BuiltinCorpus, TextCorpus

__all__ = ["BuiltinCorpus", "GeneratedImages", "HFDataset", "ImageFolder", "Preprocess", "ProcessorPreprocess",
           "SegFolder", "TextCorpus", "from_config", "is_text", "patch_labels", "preprocess_for"]
