"""What every dataset kind shares: its hashed `data` fields, its defaults (the schema's), its root on disk."""

import dataclasses
import pathlib

from saeflow import config
from saeflow.errors import SaeflowError

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
