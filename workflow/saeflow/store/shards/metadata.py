"""Shard metadata (protocol section 2.1) and the sizing maths every reader and writer shares (sections 3, 4).

`Metadata` is the hashed description of a shard directory (named by the sha256 of its canonical JSON); from it
follow the examples per shard, the shard sizes, the byte offset of any vector (`locate`), the side files' sizes and
the shard list the directory must hold. What the data files hold (their names are `saeflow.store.layout.ShardLayout`'s):

    shard i      C-order array of `dtype` (float32, or opt-in float16), shape (n_ex_in_shard, L, T, D), no header
    AUX_FILES    optional side files, one row per example: labels uint8 (n_ex, patches_per_ex), one per patch,
                 CLS excluded; tokens int32 (n_ex, T), the token id at every stored position (text models);
                 classes int32 (n_ex,), the class id of each example of an image folder (any class count fits)
"""

import dataclasses
import math
import typing

import numpy as np

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.store.hashing import content_hash
from saeflow.store.layout import ShardLayout

PROTOCOL = "2.0"
DTYPES = config.enum("activation_spec", "store_dtype")
DEFAULT_PATCHES_PER_SHARD = config.schema_default("activation_spec", "patches_per_shard")  # protocol section 3


# Keys of the metadata's `data` object added after the first release, each with the value it was introduced at.
# `canonical_data` leaves a key out at that value and `data_value` reads an absent key as it, so adding one changes no
# shard hash (docs/contracts.md). The value is the introduction's, never a later default.
INTRODUCED_DATA: dict[str, typing.Any] = {
    "hook": "residual",  # the hook point (extraction.hooks, issue 35): a block's output, as before hook points
}


def canonical_data(data: dict) -> dict:
    """The `data` object as it is hashed: introduced keys at their introduction value left out."""
    return {key: value for key, value in data.items() if key not in INTRODUCED_DATA or value != INTRODUCED_DATA[key]}


def data_value(md: "Metadata", key: str):
    """`md.data[key]`, or the introduction value of an introduced key that a directory's metadata leaves out."""
    return md.data[key] if key in md.data else INTRODUCED_DATA[key]


@dataclasses.dataclass(frozen=True)
class AuxSpec:
    """A per-example side array stored in one file beside the shards."""

    dtype: str
    row_shape: typing.Callable[["Metadata"], tuple[int, ...]]


AUX_FILES: dict[str, AuxSpec] = {
    ShardLayout.LABELS_FNAME: AuxSpec("uint8", lambda md: (md.patches_per_ex,)),
    ShardLayout.TOKENS_FNAME: AuxSpec("int32", lambda md: (md.tokens_per_ex,)),
    ShardLayout.CLASSES_FNAME: AuxSpec("int32", lambda md: ()),
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_plain_json(x) -> bool:
    """True when `x` survives a JSON round trip unchanged, so its hash is the hash of what the metadata file holds."""
    if x is None or isinstance(x, (str, bool, int)):
        return True
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, list):
        return all(_is_plain_json(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in x.items())
    return False


@dataclasses.dataclass(frozen=True)
class Metadata:
    """Exactly the keys of protocol section 2.1. Everything that changes the bytes of the shards is in here."""

    family: str
    ckpt: str
    layers: tuple[int, ...]
    patches_per_ex: int
    cls_token: bool
    d_model: int
    n_ex: int
    patches_per_shard: int
    data: dict
    dataset: str
    dtype: str = "float32"
    protocol: str = PROTOCOL

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        problems = []
        for key in ("family", "ckpt", "dataset", "dtype", "protocol"):
            if not isinstance(getattr(self, key), str):
                problems.append(f"{key} must be a string, got {getattr(self, key)!r}")
        for key in ("patches_per_ex", "d_model", "n_ex", "patches_per_shard"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                problems.append(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(self.cls_token, bool):
            problems.append(f"cls_token must be true or false, got {self.cls_token!r}")
        if not self.layers or not all(_is_int(layer) and layer >= 0 for layer in self.layers):
            problems.append(f"layers must be a non-empty list of non-negative integers, got {list(self.layers)!r}")
        elif len(set(self.layers)) != len(self.layers):
            problems.append(f"layers must not repeat, got {list(self.layers)!r}")
        if not isinstance(self.data, dict) or "__class__" not in self.data:
            problems.append("data must be an object with a '__class__' key")
        elif not _is_plain_json(self.data):
            problems.append("data must be plain JSON (string keys; str, int, finite float, bool, null, list, object)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.protocol != PROTOCOL:
            problems.append(f"protocol must be {PROTOCOL!r}, got {self.protocol!r}")
        if not problems and self.ex_per_shard < 1:
            problems.append(
                f"patches_per_shard={self.patches_per_shard} is smaller than one example "
                f"({self.tokens_per_ex} tokens x {len(self.layers)} layers = {self.tokens_per_ex * len(self.layers)})"
            )
        if problems:
            raise SaeflowError("invalid shard metadata: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, obj: typing.Any) -> "Metadata":
        if not isinstance(obj, dict):
            raise SaeflowError(f"metadata must be a JSON object, got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, extra = sorted(names - obj.keys()), sorted(obj.keys() - names)
        if missing or extra:
            raise SaeflowError(f"metadata keys differ from protocol 2.0: missing {missing}, unexpected {extra}")
        return cls(**obj)

    def to_dict(self) -> dict:
        obj = dataclasses.asdict(self)
        obj["layers"] = list(self.layers)
        return obj

    @property
    def hash(self) -> str:
        return content_hash(self.to_dict())

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def tokens_per_ex(self) -> int:
        return tokens_per_ex(self.patches_per_ex, self.cls_token)

    @property
    def ex_per_shard(self) -> int:
        return ex_per_shard(self.patches_per_shard, self.tokens_per_ex, self.n_layers)

    @property
    def shard_sizes(self) -> list[int]:
        return shard_sizes(self.n_ex, self.ex_per_shard)

    @property
    def bytes_per_ex(self) -> int:
        return self.n_layers * self.tokens_per_ex * self.d_model * np.dtype(self.dtype).itemsize

    @property
    def n_bytes(self) -> int:
        return self.n_ex * self.bytes_per_ex

    def describe(self) -> str:
        """One line for a person: the model, layers and sizes."""
        return (f"{self.family} {self.ckpt}, layers {list(self.layers)}, {self.n_ex} examples x {self.tokens_per_ex} "
                f"tokens x d={self.d_model} ({self.n_bytes / 2**20:,.1f} MiB in {len(self.shard_sizes)} shards)")

    def layer_idx(self, layer: int) -> int:
        """Protocol 4.2: the index of a layer *value* in `layers`; an error if it was not recorded."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise SaeflowError(f"layer {layer} is not stored here; stored layers are {list(self.layers)}") from None


def tokens_per_ex(patches_per_ex: int, cls_token: bool) -> int:
    return patches_per_ex + (1 if cls_token else 0)


def ex_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_ex: int, ex_per_shard: int) -> list[int]:
    """Examples per shard: all full but the last, which holds only its own examples (never an empty shard)."""
    n_full, rest = divmod(n_ex, ex_per_shard)
    return [ex_per_shard] * n_full + ([rest] if rest else [])


def locate(md: Metadata, ex: int, layer: int, token: int) -> tuple[int, int]:
    """Protocol 4.2: (shard index, byte offset within that shard) of one vector."""
    if not 0 <= ex < md.n_ex:
        raise SaeflowError(f"example {ex} out of range [0, {md.n_ex})")
    if not 0 <= token < md.tokens_per_ex:
        raise SaeflowError(f"token {token} out of range [0, {md.tokens_per_ex})")
    layer_idx = md.layer_idx(layer)
    shard_idx, ex_in_shard = divmod(ex, md.ex_per_shard)
    T, L = md.tokens_per_ex, md.n_layers
    offset_in_vectors = ex_in_shard * L * T + layer_idx * T + token
    return shard_idx, offset_in_vectors * md.d_model * np.dtype(md.dtype).itemsize


def expected_shards_json(md: Metadata) -> list[dict]:
    """The shard list (`ShardLayout.SHARDS_FNAME`) that `md` implies, entry for entry."""
    return [{"name": ShardLayout.shard_fname(i), "n_ex": n} for i, n in enumerate(md.shard_sizes)]


def aux_n_bytes(md: Metadata, fname: str) -> int:
    return md.n_ex * aux_row_bytes(md, fname)


def aux_row_bytes(md: Metadata, fname: str) -> int:
    spec = AUX_FILES[fname]
    return int(np.prod(spec.row_shape(md))) * np.dtype(spec.dtype).itemsize
