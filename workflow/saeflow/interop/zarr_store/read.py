"""Reading Zarr activation stores and roots as untrusted input: metadata and chunk files checked against a memory
budget, the hot path reading chunk files directly.

The reader's hot path reads chunk files directly: with no compressor and no filters, a v2 chunk is the raw
C-order bytes of its (1, 1, T_chunk, H) block at `<array>/<i>.<l>.<t>.0`. `ZarrReader` checks that layout from
the consolidated metadata at open and otherwise falls back to zarr-python. A missing chunk file is fill (zeros).
"""

import bisect
import json
import math
import os
import pathlib
import typing
import zlib

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.interop.budget import (
    DEFAULT_MEMORY_BUDGET,
    JSON_AMPLIFICATION,
    check_alloc,
    check_shape,
    fmt_bytes,
    read_json,
)
from saeflow.interop.records import Record
from saeflow.interop.zarr_store import compat as zarr_compat
from saeflow.interop.zarr_store.format import MANIFEST_FNAME, PROMPT, RESPONSE, SAMPLE_CORE, TEXT_FILES


class _Store:
    """One consolidated store: its metadata, small arrays in memory, and the direct chunk-read plan.

    Stores are untrusted: `.zmetadata` is size-checked before it is parsed, every `.zarray` shape and chunk is
    checked against `memory_budget`, and chunks zarr-python decodes are first checked to decompress to no more
    than their declared size (`_check_chunk_files`).
    """

    def __init__(self, dpath: pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.dpath, self.memory_budget = dpath, memory_budget
        refuse_format_3(dpath)  # a manifest's shard store, too
        zmeta_fpath = dpath / ".zmetadata"
        zmeta = read_json(zmeta_fpath, memory_budget, "consolidated zarr metadata")
        self.meta = zmeta.get("metadata") if isinstance(zmeta, dict) else None
        if not isinstance(self.meta, dict) or not isinstance(self.meta.get(".zattrs", {}), dict):
            raise SaeflowError(f"{zmeta_fpath}: no metadata object (not a consolidated zarr v2 store)")
        self.attrs = self.meta.get(".zattrs", {})
        # Sizes come from the arrays (the spec fixes their names and axes, not the attrs): any store that follows
        # it reads, whoever wrote it. Checked before zarr-python opens the store: 3.x parses every .zarray at open.
        zarrays = {kind: self._zarray(f"arrays/{kind}_activations", 4) for kind in (PROMPT, RESPONSE)
                   if kind == PROMPT or f"arrays/{kind}_activations/.zarray" in self.meta}
        self.n, n_layers, _, self.hidden_size = zarrays[PROMPT]["shape"]
        for kind, zarray in zarrays.items():
            if [zarray["shape"][i] for i in (0, 1, 3)] != [self.n, n_layers, self.hidden_size]:
                raise SaeflowError(f"{zmeta_fpath}: arrays/{kind}_activations has shape {zarray['shape']}, but "
                                   f"prompt_activations has {zarrays[PROMPT]['shape']}")
        self.layers = _stored_layers(self.attrs, n_layers, self.n, zmeta_fpath)
        self.t_max = {kind: zarray["shape"][2] for kind, zarray in zarrays.items()}
        self.lens = {kind: self._lengths(kind) for kind in zarrays}
        self.direct = {kind: self._direct_ok(f"arrays/{kind}_activations") for kind in self.lens}
        self._zarr = None

    def __getstate__(self) -> dict:
        # zarr-python handles are not carried into DataLoader workers (3.x's hold an event loop); reopened on use
        return {**self.__dict__, "_zarr": None}

    def _zarray(self, array: str, ndim: int) -> dict:
        return _checked_zarray(self.meta, self.dpath, array, ndim, self.memory_budget)

    def small(self, name: str) -> np.ndarray:
        """The (n,) per-sample array arrays/<name>, decoded by zarr-python once its chunks are checked."""
        array = f"arrays/{name}"
        zarray = self._zarray(array, 1)
        if zarray["shape"] != [self.n]:
            raise SaeflowError(f"{self.dpath / '.zmetadata'} ({array}/.zarray): shape {zarray['shape']}, "
                               f"expected [{self.n}] samples")
        _check_chunk_files(self.dpath / array, zarray, self.memory_budget)
        try:
            return zarr_compat.open_consolidated(self.dpath)["arrays"][name][:]
        except Exception as err:  # zarr-python and numcodecs raise many types; the file is named either way
            raise SaeflowError(f"{self.dpath / array}: unreadable ({type(err).__name__}: {err})") from None

    def _lengths(self, kind: str) -> np.ndarray:
        lens = self.small(f"{kind}_len")
        if lens.dtype.kind not in "iu":
            raise SaeflowError(f"{self.dpath / 'arrays' / f'{kind}_len'}: expected {self.n} integer lengths")
        return lens

    def _direct_ok(self, array: str) -> dict | None:
        """The array's .zarray when its chunks are raw C-order bytes we can read ourselves, else None."""
        zarray = self._zarray(array, 4)
        kind = PROMPT if array.startswith(f"arrays/{PROMPT}") else RESPONSE
        shape, where = zarray["shape"], f"{self.dpath / '.zmetadata'} ({array}/.zarray)"
        if shape[0] != self.n or int(self.lens[kind].max(initial=0)) > shape[2] or self.lens[kind].min(initial=0) < 0:
            raise SaeflowError(f"{where}: shape {shape} does not hold {self.n} samples of the stored lengths")
        check_alloc(shape[2:], np.dtype(zarray["dtype"]).itemsize, self.memory_budget, where, "one sample")
        ok = (zarray.get("compressor") is None and not zarray.get("filters") and zarray.get("order") == "C"
              and np.dtype(zarray["dtype"]) == np.dtype("<f2") and zarray["chunks"][:2] == [1, 1]
              and zarray["chunks"][3] == zarray["shape"][3])
        if not ok:
            _check_chunk_files(self.dpath / array, zarray, self.memory_budget)
        return zarray if ok else None

    def read(self, kind: str, i: int, li: int, out: np.ndarray | None = None) -> np.ndarray:
        """(len_i, H) float16 of sample i, layer position li; reads only the chunks that hold len_i tokens."""
        n_tok = int(self.lens[kind][i])
        zarray = self.direct[kind]
        if zarray is None:
            return self._zarr_array(kind)[i, li, :n_tok]
        t_chunk, h = zarray["chunks"][2], zarray["chunks"][3]
        sep = zarray.get("dimension_separator", ".")
        prefix = f"{self.dpath}/arrays/{kind}_activations/{i}{sep}{li}{sep}"  # str, not pathlib: this is the hot path
        buf = out if out is not None else np.empty(((n_tok + t_chunk - 1) // t_chunk * t_chunk, h), np.float16)
        for c in range((n_tok + t_chunk - 1) // t_chunk):
            dst = buf[c * t_chunk : (c + 1) * t_chunk]
            try:
                fd = os.open(f"{prefix}{c}{sep}0", os.O_RDONLY)
            except FileNotFoundError:
                dst[:] = 0  # never written: the fill value
                continue
            try:
                if os.readv(fd, [dst]) != dst.nbytes:
                    raise SaeflowError(f"{prefix}{c}{sep}0: truncated chunk file")
            finally:
                os.close(fd)
        return buf[:n_tok]

    def _zarr_array(self, kind: str):
        try:
            if self._zarr is None:
                self._zarr = zarr_compat.open_consolidated(self.dpath)["arrays"]
            return self._zarr[f"{kind}_activations"]
        except Exception as err:  # zarr-python raises many types; the store is named either way
            raise SaeflowError(f"{self.dpath}: unreadable {kind} activations ({type(err).__name__}: {err})") from None

    def text(self, key: str) -> list[dict]:
        fpath = self.dpath / TEXT_FILES[key]
        if not fpath.exists():
            return []
        if fpath.stat().st_size * JSON_AMPLIFICATION > self.memory_budget:
            raise SaeflowError(f"{fpath}: {fmt_bytes(fpath.stat().st_size)} of text rows is too large for the "
                               f"memory budget of {fmt_bytes(self.memory_budget)}; refusing")
        try:
            rows = [json.loads(line) for line in fpath.read_text(encoding="utf-8").splitlines()]
        except (ValueError, RecursionError) as err:
            raise SaeflowError(f"{fpath}: not JSON lines ({type(err).__name__}: {err})") from None
        want = {PROMPT: "prompt", RESPONSE: "response", "extra": "i"}[key]
        if len(rows) != self.n or not all(isinstance(r, dict) and type(r.get("i")) is int and want in r for r in rows):
            raise SaeflowError(f"{fpath}: expected {self.n} rows, each an object with 'i' and {want!r}")
        return rows


def _checked_zarray(meta: dict, dpath: pathlib.Path, array: str, ndim: int, memory_budget: int) -> dict:
    """The array's checked .zarray: shape/chunks of `ndim` sizes, a chunk within the budget."""
    where = f"{dpath / '.zmetadata'} ({array}/.zarray)"
    zarray = meta.get(f"{array}/.zarray")
    if not isinstance(zarray, dict):
        raise SaeflowError(f"{dpath}: no {array}")
    try:
        itemsize = np.dtype(zarray["dtype"]).itemsize
    except (KeyError, TypeError, ValueError) as err:
        raise SaeflowError(f"{where}: bad dtype ({type(err).__name__}: {err})") from None
    shape = check_shape(zarray.get("shape"), where, "the array")
    chunks = check_shape(zarray.get("chunks"), where, "a chunk")
    if len(shape) != ndim or len(chunks) != ndim or not all(chunks):
        raise SaeflowError(f"{where}: shape {list(shape)} and chunks {list(chunks)} must both have {ndim} "
                           "positive sizes")
    check_alloc(chunks, itemsize, memory_budget, where, "a chunk")
    if zarray.get("dimension_separator", ".") not in (".", "/"):
        raise SaeflowError(f"{where}: dimension_separator must be '.' or '/'")
    return zarray


def _sample_fields(meta: dict) -> list[str]:
    """Names of a store's other 1-D arrays under arrays/ (the spec's hallu_label, split, ...)."""
    names = []
    for key, zarray in meta.items():
        name = key.removeprefix("arrays/").removesuffix("/.zarray")
        shape = zarray.get("shape") if isinstance(zarray, dict) else None
        if (key == f"arrays/{name}/.zarray" and "/" not in name and name not in SAMPLE_CORE
                and not name.endswith("_activations") and isinstance(shape, list) and len(shape) == 1):
            names.append(name)
    return sorted(names)


def _stored_layers(attrs: dict, n_layers: int, n: int, where: pathlib.Path) -> tuple[int, ...]:
    """Block numbers along axis 1: the `layers` attribute saeflow writes, else 0..L-1 (the spec's layer index)."""
    layers = attrs.get("layers", list(range(n_layers)))
    if (not isinstance(layers, list) or len(layers) != n_layers or len(set(layers)) != n_layers
            or not all(type(x) is int for x in layers)):
        raise SaeflowError(f"{where}: .zattrs layers must list {n_layers} distinct int layers (axis 1 of the "
                           f"activation arrays), got {str(layers)[:80]}")
    if attrs.get("num_samples", n) != n:
        raise SaeflowError(f"{where}: .zattrs num_samples={attrs['num_samples']!r}, the arrays hold {n} samples")
    return tuple(layers)


def _check_chunk_files(array_dpath: pathlib.Path, zarray: dict, memory_budget: int) -> None:
    """Every chunk file of a zarr-python-decoded array decompresses to at most its declared size."""
    chunk_bytes = math.prod(zarray["chunks"]) * np.dtype(zarray["dtype"]).itemsize
    comp = zarray.get("compressor")
    cid = comp.get("id") if isinstance(comp, dict) else comp
    if cid not in (None, "zlib", "gzip", "blosc") or zarray.get("filters"):
        raise SaeflowError(f"{array_dpath}/.zarray: compressor {cid!r} / filters {zarray.get('filters')!r} are not "
                           "supported in untrusted stores (use none, zlib, gzip or blosc, no filters)")
    for fpath in array_dpath.rglob("*"):
        if fpath.name.startswith(".") or not fpath.is_file():
            continue
        if fpath.stat().st_size > memory_budget:
            raise SaeflowError(f"{fpath}: chunk file larger than the memory budget; refusing")
        data = fpath.read_bytes()
        if cid == "blosc":
            n_out = int.from_bytes(data[4:8], "little") if len(data) >= 16 else chunk_bytes + 1
        elif cid is None:
            n_out = len(data)
        else:
            try:
                dec = zlib.decompressobj(zlib.MAX_WBITS | (16 if cid == "gzip" else 0))
                n_out = len(dec.decompress(data, chunk_bytes + 1))
            except zlib.error as err:
                raise SaeflowError(f"{fpath}: corrupt {cid} chunk ({err})") from None
        if n_out > chunk_bytes:
            raise SaeflowError(f"{fpath}: chunk decompresses to more than its declared {chunk_bytes} bytes; refusing")


def _manifest_stores(root: pathlib.Path, memory_budget: int) -> list[pathlib.Path]:
    fpath = root / MANIFEST_FNAME
    manifest = read_json(fpath, memory_budget, "manifest JSON")
    entries = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SaeflowError(f"{fpath}: no list of shards")
    dpaths = []
    for k, entry in enumerate(entries):
        rel = entry.get("path") if isinstance(entry, dict) else None
        parts = pathlib.PurePosixPath(rel).parts if isinstance(rel, str) else ("..",)
        if not parts or parts[0] == "/" or ".." in parts:
            raise SaeflowError(f"{fpath}: shards[{k}].path must be a relative path inside the root")
        dpaths.append(root / rel)
    return dpaths


V3_METADATA_FNAME = "zarr.json"  # every node of a Zarr format 3 store


def refuse_format_3(dpath: pathlib.Path) -> None:
    """A Zarr format 3 store (zarr-python 3's default when not told `zarr_format=2`) is refused in one line that
    says so: saeflow reads format 2, the activation-store spec's (its direct chunk reads follow format 2's layout)."""
    if (dpath / V3_METADATA_FNAME).is_file() and not (dpath / ".zmetadata").exists():
        raise SaeflowError(
            f"{dpath}: a Zarr format 3 store ({V3_METADATA_FNAME}; zarr-python 3 writes format 3 unless told), and "
            "saeflow reads Zarr format 2 stores (.zmetadata), the activation-store spec's format: rewrite it with "
            "zarr.open_group(path, mode='w', zarr_format=2)"
        )


class ZarrReader:
    """Global-index reads over one store or a manifest of shard stores. Safe in DataLoader workers: it holds
    no open files (every read opens its chunk files), so it can be pickled into worker processes."""

    def __init__(self, path: str | os.PathLike, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        path = pathlib.Path(path)
        if (path / MANIFEST_FNAME).exists():
            self.stores = [_Store(d, memory_budget) for d in _manifest_stores(path, memory_budget)]
        elif (path / ".zmetadata").exists():
            self.stores = [_Store(path, memory_budget)]
        else:
            refuse_format_3(path)
            raise SaeflowError(f"{path}: neither a zarr store (.zmetadata) nor a sharded root ({MANIFEST_FNAME})")
        self.path = path
        self.attrs = self.stores[0].attrs
        first = self.stores[0]
        self.layers, self.hidden_size, self.t_max = first.layers, first.hidden_size, first.t_max
        for store in self.stores[1:]:
            if (store.layers, store.hidden_size, store.t_max) != (self.layers, self.hidden_size, self.t_max):
                raise SaeflowError(f"{store.dpath}: layers {list(store.layers)}, hidden size {store.hidden_size} and "
                                   f"token axes {store.t_max} differ from {first.dpath}'s")
        self.starts = np.cumsum([0] + [s.n for s in self.stores])
        self._starts = [int(x) for x in self.starts]  # a list: bisect on it beats numpy on single lookups
        self.n = self._starts[-1]

    def __len__(self) -> int:
        return self.n

    def _locate(self, i: int) -> tuple["_Store", int]:
        if not 0 <= i < self.n:
            raise SaeflowError(f"sample {i} out of range [0, {self.n})")
        k = bisect.bisect_right(self._starts, i) - 1
        return self.stores[k], i - self._starts[k]

    def layer_pos(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise SaeflowError(
                f"{self.path}: layer {layer} is not stored; stored layers are {list(self.layers)}"
            ) from None

    def prompt(self, i: int, layer: int) -> np.ndarray:
        """(prompt_len[i], H) float16 activations of sample i at block `layer`."""
        store, j = self._locate(i)
        return store.read(PROMPT, j, self.layer_pos(layer))

    def response(self, i: int, layer: int) -> np.ndarray:
        store, j = self._locate(i)
        if RESPONSE not in store.lens:
            raise SaeflowError(f"{self.path}: no response activations stored (R_max = 0)")
        return store.read(RESPONSE, j, self.layer_pos(layer))

    def lengths(self, kind: str = PROMPT) -> np.ndarray:
        return np.concatenate([s.lens[kind] for s in self.stores])

    def batch(self, idx: typing.Sequence[int], layers_per_sample: typing.Sequence[typing.Sequence[int]],
              kind: str = RESPONSE) -> tuple[np.ndarray, np.ndarray]:
        """The training pattern: for each sample its listed layers, padded to T_max -> ((B, k, T, H), lens (B,))."""
        if kind not in self.t_max:
            raise SaeflowError(f"{self.path}: no {kind} activations stored")
        k = len(layers_per_sample[0])
        out = np.zeros((len(idx), k, self.t_max[kind], self.hidden_size), np.float16)
        lens = np.zeros(len(idx), np.int32)
        for b, (i, sample_layers) in enumerate(zip(idx, layers_per_sample)):
            store, j = self._locate(int(i))
            lens[b] = store.lens[kind][j]
            for c, layer in enumerate(sample_layers):
                store.read(kind, j, self.layer_pos(layer), out=out[b, c])
        return out, lens

    def text(self, key: str) -> list[dict]:
        """prompts / responses / extra JSONL rows with global `i`."""
        rows = []
        for store, start in zip(self.stores, self.starts):
            rows += [{**row, "i": row["i"] + int(start)} for row in store.text(key)]
        return rows

    def sample_fields(self) -> dict[str, list]:
        """Per-sample values of the arrays besides lengths and keys (`label`: -1 is none), as Python scalars."""
        names = [name for name in _sample_fields(self.stores[0].meta)
                 if all(name in _sample_fields(s.meta) for s in self.stores)]
        if all("arrays/label/.zarray" in s.meta for s in self.stores):
            names.append("label")
        fields = {}
        for name in names:
            values = np.concatenate([s.small(name) for s in self.stores]).tolist()
            fields[name] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
        if "label" in fields:
            fields["label"] = [None if v == -1 else v for v in fields["label"]]
        return fields

    def records(self) -> typing.Iterator[Record]:
        """float32 records of the prompt (and response) activations, for converters. Labels and extra fields come
        from text/extra_metadata.jsonl when it exists, else from the per-sample arrays."""
        prompts, responses, extras = self.text(PROMPT), self.text(RESPONSE), self.text("extra")
        if len(prompts) != self.n:
            raise SaeflowError(f"{self.path}: {TEXT_FILES[PROMPT]} needs a row per sample")
        fields = self.sample_fields()
        for i in range(self.n):
            extra = {name: values[i] for name, values in fields.items()}
            if extras:
                extra.update({k: v for k, v in extras[i].items() if k not in ("i", "sample_key")})
            resp = None
            if RESPONSE in self.t_max:
                resp = {layer: self.response(i, layer).astype(np.float32) for layer in self.layers}
            yield Record(
                text=prompts[i]["prompt"], label=extra.pop("label", None), extra=extra,
                acts={layer: self.prompt(i, layer).astype(np.float32) for layer in self.layers},
                response_text=responses[i]["response"] if responses else None, response_acts=resp,
            )

