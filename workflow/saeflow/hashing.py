"""Canonical JSON and content hashes: the identity of every published directory."""

import hashlib
import json
import typing


def canonical_json(obj: typing.Any) -> str:
    """The one serialization that is hashed: sorted keys, no whitespace (saev protocol 2.0)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def content_hash(obj: typing.Any) -> str:
    """Full 64-hex-digit sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def file_sha256(fpath, chunk_bytes: int = 16 << 20, progress: typing.Callable[[int], object] | None = None) -> str:
    """sha256 of a file's bytes, read in chunks; `progress(n_bytes)` is called after each chunk."""
    h = hashlib.sha256()
    with open(fpath, "rb") as fd:
        while chunk := fd.read(chunk_bytes):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()
