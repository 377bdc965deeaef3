"""A memory budget for reading untrusted interop files (gzip-pickle, lmprobe, Zarr).

Readers charge a `Budget` before they allocate: declared sizes (array shapes, safetensors offsets, `.zarray`
shapes and chunks, bytes a pickle is about to read) are checked against what is left, so a hostile file is
refused with a `SaeflowError` naming the file instead of growing the process until the kernel kills it.
"""

import json
import math
import pathlib

from saeflow.errors import SaeflowError

DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes; `saeflow convert --memory-budget`
JSON_AMPLIFICATION = 16  # a JSON file may become this many times its size in Python objects


def fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


class Budget:
    """Bytes a reader may hold at once. `charge` before allocating; `release` what was transient."""

    def __init__(self, limit_bytes: int, where: str):
        if limit_bytes < 1:
            raise SaeflowError(f"memory budget must be a positive number of bytes, got {limit_bytes}")
        self.limit_bytes, self.where, self.used_bytes = int(limit_bytes), where, 0

    def charge(self, n_bytes: int, what: str = "data") -> None:
        if n_bytes > self.limit_bytes - self.used_bytes:
            raise SaeflowError(f"{self.where}: {what} needs {fmt_bytes(self.used_bytes + n_bytes)}, more than the "
                               f"memory budget of {fmt_bytes(self.limit_bytes)}; refusing (raise --memory-budget "
                               "only for a trusted file)")
        self.used_bytes += n_bytes

    def release(self, n_bytes: int) -> None:
        self.used_bytes = max(0, self.used_bytes - n_bytes)


def check_shape(shape, where: str, what: str) -> tuple[int, ...]:
    """A declared shape as a tuple of non-negative ints (at most 32 axes), or a SaeflowError."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 32:
        raise SaeflowError(f"{where}: {what} has shape {_short(shape)}, not a list of at most 32 sizes")
    if not all(type(s) is int and s >= 0 for s in shape):  # bool and numpy ints are not sizes
        raise SaeflowError(f"{where}: {what} has shape {_short(shape)}, not non-negative integers")
    return tuple(shape)


def nbytes(shape, itemsize: int) -> int:
    return math.prod(shape) * int(itemsize)


def check_alloc(shape, itemsize: int, limit_bytes: int, where: str, what: str) -> int:
    """Bytes of an array of `shape`, refused when over `limit_bytes` (before anything is allocated)."""
    n = nbytes(check_shape(shape, where, what), itemsize)
    if n > limit_bytes:
        raise SaeflowError(f"{where}: {what} declares shape {_short(shape)} ({fmt_bytes(n)}), more than the memory "
                           f"budget of {fmt_bytes(limit_bytes)}; refusing")
    return n


def read_json(fpath: pathlib.Path, limit_bytes: int, what: str = "JSON"):
    """Parse a JSON file whose size leaves its parsed objects within `limit_bytes`; errors name the file."""
    try:
        size = fpath.stat().st_size
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: missing") from None
    if size * JSON_AMPLIFICATION > limit_bytes:
        raise SaeflowError(f"{fpath}: {fmt_bytes(size)} of {what} is too large for the memory budget of "
                           f"{fmt_bytes(limit_bytes)}; refusing")
    try:
        return json.loads(fpath.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise SaeflowError(f"{fpath}: not valid {what} ({_short(err)})") from None


def _short(value, n_chars: int = 80) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= n_chars else text[: n_chars - 3] + "..."
