"""gzip-pickle activation shards (specs/activation-shard-pickle-format-1.0.md): writer and a safe reader.

`pickle.load` runs arbitrary code, so shards from elsewhere are read only after (1) their sha256 matches the
`checksum` in metadata.json and (2) through `safe_unpickle.BudgetUnpickler`, which admits only what numpy arrays
need (array reconstruction and plain dtypes, under both the numpy 1.x `numpy.core` and 2.x `numpy._core` names,
plus `_codecs.encode`, which protocol 2 uses for bytes); everything else (os.system, builtins.eval, ...) is
refused before it can run. A memory budget (`memory_budget`, `saeflow convert --memory-budget`) bounds both the
decompressed stream and what the unpickler allocates, so a gzip bomb or a memo blow-up fails instead of filling
memory.
"""

import dataclasses
import gzip
import hashlib
import pathlib
import pickle
import typing

import numpy as np

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET, Budget, read_json
from saeflow.interop.records import Record, check_uniform
from saeflow.interop.safe_unpickle import BoundedStream, BudgetUnpickler
from saeflow.store import atomic, provenance

VERSION = "1.0"
METADATA_FNAME = "metadata.json"
PREVIEW_CHARS = 200


def shard_fname(shard_id: int, compressed: bool = True) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


# ---------------------------------------------------------------------------------------------------------------
# Safe reading
# ---------------------------------------------------------------------------------------------------------------


def safe_loads_file(fpath: pathlib.Path, compressed: bool, memory_budget: int = DEFAULT_MEMORY_BUDGET):
    """Unpickle a (gzip) file with `BudgetUnpickler` within `memory_budget` bytes (verify its checksum first).

    The decompressed stream is capped at the budget while it is read, and everything the unpickler allocates is
    charged to the same budget before it is allocated; every failure is a one-line SaeflowError naming the file.
    """
    budget = Budget(memory_budget, str(fpath))
    with open(fpath, "rb") as raw:
        inner = gzip.GzipFile(fileobj=raw) if compressed else raw
        try:
            return BudgetUnpickler(BoundedStream(inner, memory_budget, str(fpath)), budget).load()
        except SaeflowError as err:
            if str(err).startswith(str(fpath)):
                raise
            raise SaeflowError(f"{fpath}: {err}") from None
        except (Exception, RecursionError) as err:  # a hostile stream must never escape as a traceback
            raise SaeflowError(f"{fpath}: not a safe activation pickle ({type(err).__name__}: "
                               f"{' '.join(str(err).split())[:160]})") from None


def file_checksum(fpath: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(fpath, "rb") as fd:
        while chunk := fd.read(16 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class PickleShards:
    """A gzip-pickle shard directory: metadata.json is read at once, shards are verified and loaded on demand."""

    def __init__(self, dpath: str | pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.dpath = pathlib.Path(dpath)
        self.memory_budget = memory_budget
        md_fpath = self.dpath / METADATA_FNAME
        if not md_fpath.is_file():
            raise SaeflowError(f"{md_fpath}: missing (not a gzip-pickle shard directory)")
        self.metadata = read_json(md_fpath, memory_budget, "metadata JSON")
        _check_metadata(self.metadata, md_fpath)

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
        data = safe_loads_file(fpath, shard.get("compressed", fpath.suffix == ".gz"), self.memory_budget)
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


def _check_metadata(md, md_fpath: pathlib.Path) -> None:
    """metadata.json has the keys and types the reader relies on (so a broken one is an error, not a crash)."""
    if not isinstance(md, dict):
        raise SaeflowError(f"{md_fpath}: top level is {type(md).__name__}, expected an object")
    missing = [k for k in ("version", "extraction_config", "shards") if k not in md]
    if missing:
        raise SaeflowError(f"{md_fpath}: missing required keys {missing}")
    if not isinstance(md["extraction_config"], dict) or not isinstance(md["shards"], list) or not md["shards"]:
        raise SaeflowError(f"{md_fpath}: extraction_config must be an object and shards a non-empty list")
    types = {"shard_id": int, "filename": str, "num_samples": int, "layers": list, "checksum": str}
    for i, shard in enumerate(md["shards"]):
        if not isinstance(shard, dict):
            raise SaeflowError(f"{md_fpath}: shards[{i}] is {type(shard).__name__}, expected an object")
        for key, typ in types.items():
            if key not in shard:
                raise SaeflowError(f"{md_fpath}: shards[{i}] has no {key!r}")
            if not isinstance(shard[key], typ) or isinstance(shard[key], bool):
                raise SaeflowError(f"{md_fpath}: shards[{i}].{key} is {type(shard[key]).__name__}, "
                                   f"expected {typ.__name__}")
        if shard["num_samples"] < 0 or not shard["layers"] or not all(
                type(layer) is int for layer in shard["layers"]):
            raise SaeflowError(f"{md_fpath}: shards[{i}] needs num_samples >= 0 and a non-empty list of int layers")
        if pathlib.PurePath(shard["filename"]).name != shard["filename"] or shard["filename"] in ("", ".", ".."):
            raise SaeflowError(f"{md_fpath}: shards[{i}].filename {shard['filename']!r} must be a plain file name")
    layers = md["extraction_config"].get("layers_extracted")
    if layers is not None and not (isinstance(layers, list) and all(type(x) is int for x in layers)):
        raise SaeflowError(f"{md_fpath}: extraction_config.layers_extracted must be a list of ints")


def _check_item(item, where: str) -> None:
    if not isinstance(item, dict):
        raise SaeflowError(f"{where} is {type(item).__name__}, expected a dict")
    missing = [k for k in ("sample_idx", "activation") if k not in item]
    if missing:
        raise SaeflowError(f"{where} has no {missing[0]!r}")
    act = item["activation"]
    if not isinstance(act, np.ndarray) or act.dtype.kind not in "biuf" or act.ndim != 2:
        raise SaeflowError(f"{where}: 'activation' must be a 2-D (tokens, hidden) numeric numpy array")
    if not isinstance(item["sample_idx"], (int, np.integer)) or isinstance(item["sample_idx"], bool):
        raise SaeflowError(f"{where}: 'sample_idx' is {type(item['sample_idx']).__name__}, expected an integer")
    if not isinstance(item.get("text_preview", ""), str) or not isinstance(item.get("metadata") or {}, dict):
        raise SaeflowError(f"{where}: 'text_preview' must be a str and 'metadata' a dict")


def _check_shard(data, shard: dict, fpath: pathlib.Path) -> None:
    if not isinstance(data, dict):
        raise SaeflowError(f"{fpath}: top level is {type(data).__name__}, expected a dict of layer_<idx> lists")
    sample_ids = None
    for layer in shard["layers"]:
        items = data.get(f"layer_{layer}")
        if not isinstance(items, list) or len(items) != shard["num_samples"]:
            n = len(items) if isinstance(items, list) else None
            raise SaeflowError(f"{fpath}: layer_{layer} holds {n} items, {METADATA_FNAME} says {shard['num_samples']}")
        for j, item in enumerate(items):
            _check_item(item, f"{fpath}: layer_{layer}[{j}]")
        ids = [int(item["sample_idx"]) for item in items]
        if sample_ids is not None and ids != sample_ids:
            raise SaeflowError(f"{fpath}: layer_{layer} lists samples in a different order than other layers")
        sample_ids = ids


class ActivationDataset:
    """The spec's PyTorch Dataset use case: one layer's items by global index, one cached shard at a time.

    The index comes from metadata.json's num_samples (no shard is loaded to build it); a shard whose item count
    differs fails when loaded.
    """

    def __init__(self, dpath: str | pathlib.Path, layer: int, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.store = PickleShards(dpath, memory_budget)
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
        return cls(**{**config.export_defaults(cls, "pickle"), **overrides})


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
