"""`dataset.kind` -> the dataset class that reads it."""

import dataclasses

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction.datasets.hf import HFDataset
from saeflow.extraction.datasets.images import GeneratedImages, ImageFolder, SegFolder
from saeflow.extraction.datasets.text import BuiltinCorpus, TextCorpus


def is_text(dataset) -> bool:
    """Whether a dataset feeds a text model (documents) rather than a vision model (images)."""
    if isinstance(dataset, HFDataset):
        return dataset.text_column is not None
    return isinstance(dataset, (TextCorpus, BuiltinCorpus))


def from_config(obj: dict):
    """The dataset object of one `dataset:` config entry (already validated by the schema)."""
    kinds = config.by_enum(
        {
            "image_folder": ImageFolder,
            "segmentation_folder": SegFolder,
            "generated_images": GeneratedImages,
            "text": TextCorpus,
            "builtin_text": BuiltinCorpus,
            "hf_dataset": HFDataset,
        },
        "activation_spec", "dataset", "kind",
    )  # fmt: skip
    obj = dict(obj)
    kind = obj.pop("kind", None)
    if kind not in kinds:
        raise SaeflowError(f"dataset.kind must be one of {sorted(kinds)}, got {kind!r}")
    cls = kinds[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    if obj.keys() - names:
        raise SaeflowError(f"dataset ({kind}): unknown keys {sorted(obj.keys() - names)}; allowed: {sorted(names)}")
    return cls(**obj)
