"""Text corpora: documents (strings) that `extraction.tokenization` packs into fixed-length examples."""

import dataclasses
import functools
import hashlib
import json
import pathlib
import typing

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import fingerprints
from saeflow.extraction.datasets.base import _DEFAULTS, _data_dict, _root

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
BUILTIN_CORPORA = config.enum("activation_spec", "dataset", "builtin_text", "name")


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
