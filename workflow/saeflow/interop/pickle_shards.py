"""gzip-pickle activation shards (specs/activation-shard-pickle-format-1.0.md): writer and a safe reader.

`pickle.load` runs arbitrary code, so shards from elsewhere are read only after (1) their sha256 matches the
`checksum` in metadata.json and (2) through `SafeUnpickler`, whose `find_class` admits only what numpy arrays
need (array reconstruction and dtypes, under both the numpy 1.x `numpy.core` and 2.x `numpy._core` names, plus
`_codecs.encode`, which protocol 2 uses for bytes); everything else (os.system, builtins.eval, ...) is refused
before it can run. Decompressed input is capped (`max_bytes`) so a gzip bomb fails instead of filling memory.
"""

import dataclasses
import gzip
import hashlib
import io
import json
import pathlib
import pickle
import typing

import numpy as np

from saeflow import atomic, provenance, specs
from saeflow.errors import SaeflowError
from saeflow.interop.records import Record, check_uniform

VERSION = "1.0"
METADATA_FNAME = "metadata.json"
DEFAULT_MAX_BYTES = 4 << 30
PREVIEW_CHARS = 200
ALLOWED_GLOBALS = {
    (numpy_core, name)
    for numpy_core in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
} | {
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


def shard_fname(shard_id: int, compressed: bool = True) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


# ---------------------------------------------------------------------------------------------------------------
# Safe reading
# ---------------------------------------------------------------------------------------------------------------


class SafeUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and plain containers only; any other global is refused without being imported."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in an activation shard")


class _CappedReader(io.RawIOBase):
    """A read-only stream that fails once more than `max_bytes` have been read from `inner`."""

    def __init__(self, inner, max_bytes: int, where: str):
        self.inner, self.left, self.where, self.max_bytes = inner, max_bytes, where, max_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self.inner.readinto(memoryview(buf)[: self.left + 1])
        self.left -= n
        if self.left < 0:
            raise SaeflowError(f"{self.where}: decompresses to more than {self.max_bytes} bytes (limit); refusing")
        return n


def safe_loads_file(fpath: pathlib.Path, compressed: bool, max_bytes: int = DEFAULT_MAX_BYTES):
    """Unpickle a (gzip) file with `SafeUnpickler` under a decompressed-size cap. Verify its checksum first."""
    with open(fpath, "rb") as raw:
        inner = gzip.GzipFile(fileobj=raw) if compressed else raw
        stream = io.BufferedReader(_CappedReader(inner, max_bytes, str(fpath)))
        try:
            return SafeUnpickler(stream).load()
        except (pickle.UnpicklingError, EOFError, gzip.BadGzipFile, ValueError, TypeError, AttributeError) as err:
            raise SaeflowError(f"{fpath}: not a safe activation pickle ({err})") from None


def file_checksum(fpath: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(fpath, "rb") as fd:
        while chunk := fd.read(16 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class PickleShards:
    """A gzip-pickle shard directory: metadata.json is read at once, shards are verified and loaded on demand."""

    def __init__(self, dpath: str | pathlib.Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.dpath = pathlib.Path(dpath)
        self.max_bytes = max_bytes
        md_fpath = self.dpath / METADATA_FNAME
        try:
            self.metadata = json.loads(md_fpath.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SaeflowError(f"{md_fpath}: missing (not a gzip-pickle shard directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SaeflowError(f"{md_fpath}: not valid JSON ({err})") from None
        missing = [k for k in ("version", "extraction_config", "shards") if k not in self.metadata]
        if missing:
            raise SaeflowError(f"{md_fpath}: missing required keys {missing}")
        for i, shard in enumerate(self.shards):
            for key in ("shard_id", "filename", "num_samples", "layers", "checksum"):
                if key not in shard:
                    raise SaeflowError(f"{md_fpath}: shards[{i}] has no {key!r}")
            if pathlib.PurePath(shard["filename"]).name != shard["filename"]:
                raise SaeflowError(f"{md_fpath}: shards[{i}].filename {shard['filename']!r} must be a plain file name")

    @property
    def shards(self) -> list[dict]:
        return self.metadata["shards"]

    @property
    def layers(self) -> list[int]:
        return list(self.metadata["extraction_config"].get("layers_extracted") or self.shards[0]["layers"])

    @property
    def n_samples(self) -> int:
        return sum(s["num_samples"] for s in self.shards)

    def load_shard(self, shard: dict) -> dict:
        """The verified contents of one shard: {"layer_<L>": [item, ...]}."""
        fpath = self.dpath / shard["filename"]
        if not fpath.is_file():
            raise SaeflowError(f"{fpath}: missing (listed in {METADATA_FNAME})")
        got = file_checksum(fpath)
        if got != shard["checksum"]:
            raise SaeflowError(f"{fpath}: checksum {got} differs from {METADATA_FNAME} ({shard['checksum']}); "
                               "the file is corrupt or was replaced, so it is not unpickled")
        data = safe_loads_file(fpath, shard.get("compressed", fpath.suffix == ".gz"), self.max_bytes)
        _check_shard(data, shard, fpath)
        return data

    def iter_activations(self, layer: int) -> typing.Iterator[dict]:
        """The spec's iteration use case: every item of one layer, shard by shard."""
        for shard in self.shards:
            if layer in shard["layers"]:
                yield from self.load_shard(shard)[f"layer_{layer}"]

    def records(self) -> typing.Iterator[Record]:
        """One record per sample (all layers joined by sample_idx), in shard order."""
        for shard in self.shards:
            data = self.load_shard(shard)
            first = data[f"layer_{shard['layers'][0]}"]
            for j, item in enumerate(first):
                acts = {layer: np.asarray(data[f"layer_{layer}"][j]["activation"], dtype=np.float32)
                        for layer in shard["layers"]}
                md = dict(item.get("metadata") or {})
                yield Record(text=item.get("text_preview", ""), acts=acts, label=md.pop("label", None),
                             extra={"sample_idx": int(item["sample_idx"]), **md})


def _check_shard(data, shard: dict, fpath: pathlib.Path) -> None:
    if not isinstance(data, dict):
        raise SaeflowError(f"{fpath}: top level is {type(data).__name__}, expected a dict of layer_<idx> lists")
    sample_ids = None
    for layer in shard["layers"]:
        items = data.get(f"layer_{layer}")
        if not isinstance(items, list) or len(items) != shard["num_samples"]:
            n = len(items) if isinstance(items, list) else None
            raise SaeflowError(f"{fpath}: layer_{layer} holds {n} items, {METADATA_FNAME} says {shard['num_samples']}")
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("activation"), np.ndarray):
                raise SaeflowError(f"{fpath}: layer_{layer} has an item without a numpy 'activation'")
        ids = [int(item["sample_idx"]) for item in items]
        if sample_ids is not None and ids != sample_ids:
            raise SaeflowError(f"{fpath}: layer_{layer} lists samples in a different order than other layers")
        sample_ids = ids


class ActivationDataset:
    """The spec's PyTorch Dataset use case: one layer's items by global index, one cached shard at a time.

    The index comes from metadata.json's num_samples (no shard is loaded to build it); a shard whose item count
    differs fails when loaded.
    """

    def __init__(self, dpath: str | pathlib.Path, layer: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.store = PickleShards(dpath, max_bytes)
        self.layer = layer
        self.index = [
            (k, i) for k, s in enumerate(self.store.shards) if layer in s["layers"] for i in range(s["num_samples"])
        ]
        if not self.index:
            raise SaeflowError(f"{dpath}: no shard holds layer {layer}; layers: {self.store.layers}")
        self._cached: tuple[int, list] | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict:
        k, i = self.index[idx]
        if self._cached is None or self._cached[0] != k:
            self._cached = (k, self.store.load_shard(self.store.shards[k])[f"layer_{self.layer}"])
        item = self._cached[1][i]
        return {
            "activation": item["activation"],
            "sample_idx": int(item["sample_idx"]),
            "text": item.get("text_preview", ""),
        }


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PickleOptions:
    """How gzip-pickle shards are written (`exports.<name>.pickle`); `defaults` are the schema's."""

    samples_per_shard: int  # samples per shard file
    compressed: bool  # gzip the pickles (.pkl.gz)
    protocol: int  # pickle protocol (2..5)
    machine_id: int = 0  # this writer's index in a multi-machine run (not in the schema: saeflow writes alone)
    first_sample_idx: int = 0  # dataset index of the first sample written (likewise)

    @classmethod
    def defaults(cls, **overrides) -> "PickleOptions":
        """The schema's defaults, with `overrides` (for writing without an export spec)."""
        return cls(**{**specs.export_defaults(cls, "pickle"), **overrides})


def write(
    records: typing.Iterable[Record],
    out_dpath: str | pathlib.Path,
    extraction_config: dict,
    opts: PickleOptions,
) -> pathlib.Path:
    """Write records as gzip-pickle shards + metadata.json (sizes, sha256 checksums), staged then renamed."""
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; remove it or choose another output directory")
    if opts.samples_per_shard < 1:
        raise SaeflowError("pickle samples_per_shard must be >= 1")
    started = provenance.utc_now()
    shards: list[dict] = []
    layers = None
    with atomic.building_dir(out_dpath) as staging:
        batch: list[Record] = []
        sample_idx = opts.first_sample_idx
        for rec in records:
            batch.append(rec)
            if len(batch) == opts.samples_per_shard:
                layers = _write_shard(staging, batch, sample_idx, shards, opts, layers)
                sample_idx += len(batch)
                batch = []
        if batch:
            layers = _write_shard(staging, batch, sample_idx, shards, opts, layers)
        if not shards:
            raise SaeflowError("pickle export: no examples")
        n = sum(s["num_samples"] for s in shards)
        metadata = {
            "version": VERSION,
            "created_at": started,
            "extraction_config": {**extraction_config, "layers_extracted": list(layers)},
            "distributed_config": {"machine_id": opts.machine_id, "total_machines": 1, "multihost": False,
                                   "num_hosts": 1, "mesh_type": "1d"},
            "shards": shards,
            "statistics": {"total_shards": len(shards), "total_samples": n,
                           "total_size_bytes": sum(s["size_bytes"] for s in shards), "layers_extracted": list(layers)},
        }
        atomic.write_json(staging / METADATA_FNAME, metadata)
        PickleShards(staging)  # metadata parses
    return out_dpath


def _write_shard(staging, batch, first_idx, shards, opts, layers) -> tuple[int, ...]:
    batch_layers, _ = check_uniform(batch, "pickle export")
    if layers is not None and batch_layers != layers:
        raise SaeflowError(f"pickle export: layers changed from {list(layers)} to {list(batch_layers)}")
    data = {}
    for layer in batch_layers:
        items = []
        for j, rec in enumerate(batch):
            acts_td = np.ascontiguousarray(rec.acts[layer], dtype=np.float32)
            md = {"token_count": rec.n_tokens, "dataset_idx": first_idx + j, "machine_id": opts.machine_id}
            if rec.label is not None:
                md["label"] = rec.label
            items.append({"sample_idx": first_idx + j, "activation": acts_td, "shape": tuple(acts_td.shape),
                          "text_preview": rec.text[:PREVIEW_CHARS], "metadata": md})
        data[f"layer_{layer}"] = items
    shard_id = len(shards) + 1
    fname = shard_fname(shard_id, opts.compressed)
    fpath = staging / fname
    payload = pickle.dumps(data, protocol=opts.protocol)
    fpath.write_bytes(gzip.compress(payload, compresslevel=1, mtime=0) if opts.compressed else payload)
    shards.append({
        "shard_id": shard_id, "filename": fname, "size_bytes": fpath.stat().st_size, "num_samples": len(batch),
        "layers": list(batch_layers), "sample_id_range": [first_idx, first_idx + len(batch) - 1],
        "compressed": opts.compressed, "checksum": file_checksum(fpath),
    })
    return batch_layers
