"""A Hugging Face `datasets` dataset on local disk: text (streamed) or images (with an optional class label)."""

import dataclasses
import functools
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.extraction import fingerprints
from saeflow.extraction.datasets.base import _DEFAULTS, _data_dict, _preprocess_field, _root
from saeflow.store.layout import ShardLayout

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
