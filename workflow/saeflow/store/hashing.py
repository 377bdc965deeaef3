"""Canonical JSON and content hashes: the identity of every published directory."""

import hashlib
import json
import os
import pathlib
import typing

from saeflow.errors import SaeflowError, unreadable


def canonical_json(obj: typing.Any) -> str:
    """The one serialization that is hashed: sorted keys, no whitespace (saev protocol 2.0)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def content_hash(obj: typing.Any) -> str:
    """Full 64-hex-digit sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def read_json_object(fpath: pathlib.Path, what: str = "JSON object") -> dict:
    """A JSON file that must hold an object; every way it can fail is one SaeflowError naming the file."""
    try:
        obj = json.loads(pathlib.Path(fpath).read_text(encoding="utf-8"))
    except OSError as err:
        raise unreadable(fpath, err) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise SaeflowError(f"{fpath}: unreadable (not valid JSON: {err})") from None
    if not isinstance(obj, dict):
        raise SaeflowError(f"{fpath}: holds a {type(obj).__name__}, not a {what}")
    return obj


def file_sha256(fpath, chunk_bytes: int = 16 << 20, progress: typing.Callable[[int], object] | None = None) -> str:
    """sha256 of a file's bytes, read in chunks; `progress(n_bytes)` is called after each chunk."""
    h = hashlib.sha256()
    with open(fpath, "rb") as fd:
        while chunk := fd.read(chunk_bytes):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def file_git_sha1(fpath, chunk_bytes: int = 16 << 20) -> str:
    """git's blob id of a file: sha1 of `blob <size>\\0` and its bytes (the Hugging Face Hub names a file that is not
    in LFS by it, as its ETag and so as its blob in the cache)."""
    with open(fpath, "rb") as fd:
        h = hashlib.sha1(f"blob {os.fstat(fd.fileno()).st_size}\0".encode())
        while chunk := fd.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()
