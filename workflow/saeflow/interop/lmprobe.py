"""lmprobe dataset format 2.0: writer, validator and reader (specs/lmprobe-dataset-format-2.0.txt).

Where lmprobe 0.10.3's own reader differs from the spec text we follow the reader (specs/README.md):
logits tensors are keyed `logits_topk.values` / `logits_topk.indices`; file and key patterns are always the
defaults below (lmprobe ignores custom ones); the index is `index/train-00000-of-00001.parquet`.
Full-sequence storage follows lmprobe's own layout: shards 0..last_token_shards-1 hold each prompt's last token;
the sequence shards after them hold tokens 0..T-2 of each prompt, and `token_shard_ids[-1]` points at the
last-token shard. Our reader also accepts the spec's `topk_values` / `topk_indices` keys.
"""

import dataclasses
import json
import logging
import math
import pathlib
import platform
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.extraction import specs
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET, check_alloc, fmt_bytes
from saeflow.interop.records import Record
from saeflow.store import atomic, provenance

FORMAT_VERSION = "2.0"
PARQUET_PATH = "index/train-00000-of-00001.parquet"
HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
LOGITS_KEYS = ("logits_topk.values", "logits_topk.indices")
SPEC_LOGITS_KEYS = ("topk_values", "topk_indices")
STORAGES = ("pooled", "full_sequence")
MAX_PROBLEMS = 100  # validate stops listing missing or mismatched shards after this many
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                      "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
CORE_COLUMNS = {"text", "label", "num_tokens", "shard_index", "row_offset", "token_offset", "token_shard_ids",
                "token_shard_offsets", "shard_index_logits", "row_offset_logits", "perplexity_mean",
                "perplexity_min", "perplexity_max", "token_ids", "token_perplexity", "token_strings"}

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LmprobeOptions:
    """What an lmprobe dataset holds (`exports.<name>.lmprobe`); `defaults` are the schema's."""

    storage: str  # "pooled" (last-token vectors) or "full_sequence" (every token, plus last-token shards)
    prompts_per_shard: int  # prompts per safetensors shard
    top_k: int  # top-k logits at the last token; 0: no logits shards
    perplexity: bool  # perplexity_mean/min/max and token_perplexity columns
    token_ids: bool  # a token_ids column
    token_strings: bool  # a token_strings column
    allow_duplicate_texts: bool  # lmprobe maps text -> label, so duplicates are refused unless set

    @classmethod
    def defaults(cls, **overrides) -> "LmprobeOptions":
        """The schema's defaults, with `overrides` (for writing without an export spec)."""
        return cls(**{**specs.export_defaults(cls, "lmprobe"), **overrides})

    def __post_init__(self):
        if self.storage not in STORAGES:
            raise SaeflowError(f"lmprobe storage must be one of {STORAGES}, got {self.storage!r}")
        if self.prompts_per_shard < 1 or self.top_k < 0:
            raise SaeflowError("lmprobe prompts_per_shard must be >= 1 and top_k >= 0")


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def _shard_bounds(n: int, per_shard: int) -> list[tuple[int, int]]:
    return [(start, min(start + per_shard, n)) for start in range(0, n, per_shard)]


def _save(fpath: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    import safetensors.numpy

    fpath.parent.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(fpath))


def check_duplicates(texts: list[str], allow: bool, where: str) -> None:
    seen: dict[str, int] = {}
    dups = []
    for i, text in enumerate(texts):
        if text in seen:
            dups.append((seen[text], i))
        seen.setdefault(text, i)
    if not dups:
        return
    msg = (f"{where}: {len(dups)} duplicate prompt texts, "
           f"e.g. rows {dups[0][0]} and {dups[0][1]} ({texts[dups[0][1]][:60]!r})")
    if not allow:
        raise SaeflowError(msg + "; lmprobe looks prompts up by text, so their labels would collide. Deduplicate "
                           "the prompts or set allow_duplicate_texts.")
    logger.warning("%s; lmprobe's text -> label lookup will return one label for all copies", msg)


def write(
    records: typing.Iterable[Record],
    out_dpath: str | pathlib.Path,
    model_name: str,
    model_revision: str | None,
    opts: LmprobeOptions,
) -> pathlib.Path:
    """Write an lmprobe 2.0 dataset to `out_dpath` (staged in a sibling, validated, then renamed into place)."""
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; remove it or choose another output directory")
    full = opts.storage == "full_sequence"
    rows: list[dict] = []
    last_nld: list[np.ndarray] = []  # per prompt: (L, D) last-token vectors
    rest_ntd: list[np.ndarray] = []  # full sequence: per prompt (L, T-1, D)
    topk_v, topk_i = [], []
    layers: tuple[int, ...] | None = None
    for i, rec in enumerate(records):
        layers = layers or rec.layers
        if rec.layers != layers:
            raise SaeflowError(f"lmprobe export: example {i} has layers {list(rec.layers)}, expected {list(layers)}")
        acts_ltd = np.stack([rec.acts[layer] for layer in layers]).astype(np.float32)
        n_tokens = len(rec.token_ids) if rec.token_ids is not None else acts_ltd.shape[1]
        if full and acts_ltd.shape[1] != n_tokens:
            raise SaeflowError(f"lmprobe export: example {i} has {acts_ltd.shape[1]} vectors for {n_tokens} tokens")
        last_nld.append(acts_ltd[:, -1])
        if full:
            rest_ntd.append(acts_ltd[:, :-1])
        if opts.top_k:
            if rec.topk_values is None or len(rec.topk_values) < opts.top_k:
                raise SaeflowError(f"lmprobe export: example {i} has no top-{opts.top_k} logits")
            topk_v.append(np.asarray(rec.topk_values[: opts.top_k], dtype=np.float32))
            topk_i.append(np.asarray(rec.topk_indices[: opts.top_k], dtype=np.int64))
        row = {"text": rec.text, "label": rec.label, "num_tokens": int(n_tokens)}
        stats = rec.perplexity_stats() if opts.perplexity else None
        if opts.perplexity:
            row["perplexity_mean"], row["perplexity_min"], row["perplexity_max"] = stats or (None, None, None)
            row["token_perplexity"] = None if rec.token_nll is None else np.exp(rec.token_nll).tolist()
        if opts.token_ids:
            row["token_ids"] = [int(t) for t in rec.token_ids]
        if opts.token_strings:
            row["token_strings"] = list(rec.token_strings or ())
        clash = CORE_COLUMNS & rec.extra.keys()
        if clash:
            raise SaeflowError(f"lmprobe export: extra columns {sorted(clash)} of example {i} clash with core columns")
        row.update(rec.extra)
        rows.append(row)
    if not rows:
        raise SaeflowError("lmprobe export: no prompts")
    check_duplicates([r["text"] for r in rows], opts.allow_duplicate_texts, "lmprobe export")

    n, d_model = len(rows), last_nld[0].shape[-1]
    bounds = _shard_bounds(n, opts.prompts_per_shard)
    with atomic.building_dir(out_dpath) as staging:
        shards_desc = _write_hidden(staging, layers, last_nld, rest_ntd, bounds, rows)
        hidden = {
            "type": "hidden", "layers": list(layers), "dim": int(d_model), "dtype": "float32",
            "layout": "per_layer", "file_pattern": HIDDEN_FILE_PATTERN, "key_pattern": HIDDEN_KEY_PATTERN,
            "storage": opts.storage, "shards": shards_desc,
        }
        if full:
            hidden["last_token_shards"] = len(bounds)
        else:
            hidden.update(pooling="last_token", row_bytes=int(d_model) * 4)
        tensors = {"hidden_layers": hidden}
        if opts.top_k:
            tensors["logits_topk"] = _write_logits(staging, np.stack(topk_v), np.stack(topk_i), bounds, rows)
        info = {
            "format_version": FORMAT_VERSION,
            "model": {"name": model_name, "revision": model_revision},
            "num_prompts": n,
            "prompt_ordering": "as_given",
            "tensors": tensors,
            "provenance": _provenance(),
        }
        _write_index(staging / PARQUET_PATH, rows, info)
        problems = validate(staging)
        if problems:
            raise SaeflowError("lmprobe export failed validation:\n" + "\n".join(f"  - {p}" for p in problems))
    return out_dpath


def _write_hidden(staging, layers, last_nld, rest_ntd, bounds, rows) -> list[dict]:
    """Last-token shards (and, for full sequences, sequence shards after them); fills the addressing columns."""
    shards_desc = [{"num_prompts": stop - start} for start, stop in bounds]
    for shard, (start, stop) in enumerate(bounds):
        for local, i in enumerate(range(start, stop)):
            rows[i]["shard_index"], rows[i]["row_offset"] = shard, local
        last_nld_shard = np.stack(last_nld[start:stop])
        for li, layer in enumerate(layers):
            fpath = staging / HIDDEN_FILE_PATTERN.format(layer=layer, shard=shard)
            _save(fpath, {HIDDEN_KEY_PATTERN.format(layer=layer): last_nld_shard[:, li]})
    if not rest_ntd:
        return shards_desc
    n_lt = len(bounds)
    for desc in shards_desc:
        desc["num_tokens"] = desc["num_prompts"]
    for j, (start, stop) in enumerate(bounds):
        shard = n_lt + j
        offset = 0
        for i in range(start, stop):
            n_rest = rest_ntd[i].shape[1]
            rows[i]["token_shard_ids"] = [shard] * n_rest + [rows[i]["shard_index"]]
            rows[i]["token_shard_offsets"] = list(range(offset, offset + n_rest)) + [rows[i]["row_offset"]]
            rows[i]["token_offset"] = rows[i]["row_offset"]
            offset += n_rest
        shards_desc.append({"num_prompts": stop - start, "num_tokens": offset})
        for li, layer in enumerate(layers):
            seq_td = np.concatenate([rest_ntd[i][li] for i in range(start, stop)], axis=0)
            fpath = staging / HIDDEN_FILE_PATTERN.format(layer=layer, shard=shard)
            _save(fpath, {HIDDEN_KEY_PATTERN.format(layer=layer): seq_td})
    return shards_desc


def _write_logits(staging, values_nk, indices_nk, bounds, rows) -> dict:
    shards = []
    for shard, (start, stop) in enumerate(bounds):
        for local, i in enumerate(range(start, stop)):
            rows[i]["shard_index_logits"], rows[i]["row_offset_logits"] = shard, local
        fname = LOGITS_FILE_PATTERN.format(shard=shard)
        _save(staging / fname, dict(zip(LOGITS_KEYS, (values_nk[start:stop], indices_nk[start:stop]))))
        shards.append({"file": fname, "num_prompts": stop - start})
    k = values_nk.shape[1]
    return {
        "type": "logits_topk", "k": k, "dtype": "float32", "pooling": "last_token",
        "file_pattern": LOGITS_FILE_PATTERN, "row_bytes": k * (4 + 8), "shards": shards,
    }


def _provenance() -> dict:
    prov = provenance.collect()
    return {
        "lmprobe_version": None,
        "writer": f"saeflow {prov['saeflow_version']}",
        "extraction_backend": "local",
        "nnsight_version": None,
        "torch_version": prov["torch_version"],
        "transformers_version": prov["transformers_version"],
        "python_version": platform.python_version(),
        "created_at": provenance.utc_now(),
    }


def _write_index(fpath: pathlib.Path, rows: list[dict], info: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    labels = [r["label"] for r in rows]
    int_labels = all(isinstance(v, int) and not isinstance(v, bool) for v in labels if v is not None)
    types = {
        "text": pa.string(), "label": pa.int32() if int_labels else pa.string(), "num_tokens": pa.int32(),
        "shard_index": pa.int32(), "row_offset": pa.int32(), "token_offset": pa.int64(),
        "token_shard_ids": pa.list_(pa.int64()), "token_shard_offsets": pa.list_(pa.int64()),
        "shard_index_logits": pa.int32(), "row_offset_logits": pa.int32(), "perplexity_mean": pa.float64(),
        "perplexity_min": pa.float64(), "perplexity_max": pa.float64(), "token_ids": pa.list_(pa.int64()),
        "token_perplexity": pa.list_(pa.float64()), "token_strings": pa.list_(pa.string()),
    }
    if not int_labels:
        for r in rows:
            r["label"] = None if r["label"] is None else str(r["label"])
    names = list(dict.fromkeys(k for r in rows for k in r))
    columns = {name: pa.array([r.get(name) for r in rows], type=types.get(name)) for name in names}
    table = pa.table(columns)
    meta = {f"lmprobe:{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
    fpath.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(meta), str(fpath))


# ---------------------------------------------------------------------------------------------------------------
# Validating and reading
# ---------------------------------------------------------------------------------------------------------------


def read_info(parquet_fpath: pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> tuple[dict, dict]:
    """(lmprobe: metadata dict, index columns as lists) of a dataset's parquet index, within `memory_budget`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(parquet_fpath)
        declared = sum(pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups))
        if declared * 4 > memory_budget:  # columns become Python lists: a few times their arrow size
            raise SaeflowError(f"{parquet_fpath}: the index declares {fmt_bytes(declared)} of columns, too much for "
                               f"the memory budget of {fmt_bytes(memory_budget)}; refusing")
        table = pf.read()
        meta = table.schema.metadata or {}
        info = {k.decode().removeprefix("lmprobe:"): json.loads(v) for k, v in meta.items()
                if k.startswith(b"lmprobe:")}
    except (OSError, ValueError, pa.ArrowException, UnicodeDecodeError) as err:
        raise SaeflowError(f"{parquet_fpath}: not a readable lmprobe parquet index ({_one_line(err)})") from None
    if not info:
        raise SaeflowError(f"{parquet_fpath}: no lmprobe: schema metadata (not an lmprobe 2.0 dataset)")
    return info, table.to_pydict()


def _one_line(err: Exception) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())[:160]


def read_safetensors_header(fpath: pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> dict[str, dict]:
    """{key: {"dtype", "shape", "begin", "end"}} of a safetensors file (absolute byte offsets), checked against the
    file's size and the memory budget before any tensor is read."""
    try:
        size = fpath.stat().st_size
        with open(fpath, "rb") as fd:
            head = fd.read(8)
            n_header = int.from_bytes(head, "little")
            if len(head) < 8 or n_header > size - 8 or n_header > min(memory_budget // 16, 100 << 20):
                raise SaeflowError(f"{fpath}: safetensors header of {n_header} bytes does not fit the file "
                                   f"({size} bytes) or the memory budget; refusing")
            header = json.loads(fd.read(n_header))
    except FileNotFoundError:
        raise SaeflowError(f"{fpath}: missing") from None
    except (OSError, ValueError, RecursionError) as err:
        raise SaeflowError(f"{fpath}: unreadable safetensors header ({_one_line(err)})") from None
    if not isinstance(header, dict):
        raise SaeflowError(f"{fpath}: safetensors header is not an object")
    tensors = {}
    for key, desc in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(desc, dict) or desc.get("dtype") not in SAFETENSORS_DTYPES:
            raise SaeflowError(f"{fpath}: tensor {key!r:.60} has no supported dtype ({str(desc)[:60]})")
        offsets = desc.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)):
            raise SaeflowError(f"{fpath}: tensor {key!r:.60} has malformed data_offsets")
        itemsize = np.dtype(SAFETENSORS_DTYPES[desc["dtype"]]).itemsize
        n = check_alloc(desc.get("shape"), itemsize, memory_budget, str(fpath), f"tensor {key!r:.60}")
        begin, end = 8 + n_header + offsets[0], 8 + n_header + offsets[1]
        if not 8 + n_header <= begin <= end <= size or end - begin != n:
            raise SaeflowError(f"{fpath}: tensor {key!r:.60} of shape {desc['shape']} ({n} bytes) declares bytes "
                               f"{offsets} but the file holds {size - 8 - n_header} data bytes; refusing")
        tensors[key] = {"dtype": SAFETENSORS_DTYPES[desc["dtype"]], "shape": tuple(desc["shape"]), "begin": begin,
                        "end": end}
    return tensors


def read_tensor(fpath: pathlib.Path, key: str, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> np.ndarray:
    """One tensor of a safetensors file, read by its checked offsets (nothing else of the file is loaded)."""
    desc = read_safetensors_header(fpath, memory_budget).get(key)
    if desc is None:
        raise SaeflowError(f"{fpath}: no tensor {key!r}")
    n_items = math.prod(desc["shape"])
    try:
        arr = np.fromfile(fpath, dtype=desc["dtype"], count=n_items, offset=desc["begin"])
    except (OSError, ValueError) as err:
        raise SaeflowError(f"{fpath}: unreadable tensor {key!r} ({_one_line(err)})") from None
    if arr.size != n_items:
        raise SaeflowError(f"{fpath}: tensor {key!r} is truncated")
    return arr.reshape(desc["shape"])


def _tensor_shapes(fpath: pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> dict[str, tuple[int, ...]]:
    return {k: d["shape"] for k, d in read_safetensors_header(fpath, memory_budget).items()}


def validate(dpath: str | pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> list[str]:
    """Everything lmprobe trusts without checking: dims, rows per shard, offsets in range, safetensors headers
    against file sizes and `memory_budget`. Returns problems."""
    dpath = pathlib.Path(dpath)
    try:
        return _validate(dpath, memory_budget)
    except SaeflowError as err:
        return [str(err)]
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as err:
        return [f"{dpath / PARQUET_PATH}: malformed lmprobe metadata or index ({_one_line(err)})"]


def _validate(dpath: pathlib.Path, memory_budget: int) -> list[str]:
    parquet_fpath = dpath / PARQUET_PATH
    if not parquet_fpath.exists():
        return [f"{parquet_fpath}: missing"]
    info, index = read_info(parquet_fpath, memory_budget)
    problems = []
    if info.get("format_version") != FORMAT_VERSION:
        problems.append(f"{parquet_fpath}: format_version {info.get('format_version')!r}, expected {FORMAT_VERSION!r}")
    n = len(index.get("text", []))
    if info.get("num_prompts") != n:
        problems.append(f"{parquet_fpath}: lmprobe:num_prompts={info.get('num_prompts')} but the index has {n} rows")
    hidden = info.get("tensors", {}).get("hidden_layers")
    if hidden is None:
        return problems + [f"{parquet_fpath}: lmprobe:tensors has no hidden_layers descriptor"]
    shards, dim = hidden["shards"], hidden["dim"]
    n_lt = hidden.get("last_token_shards", len(shards)) if hidden.get("storage") == "full_sequence" else len(shards)
    shard_rows = [d["num_prompts"] if s < n_lt else d.get("num_tokens", 0) for s, d in enumerate(shards)]
    for layer in hidden["layers"]:
        if len(problems) > MAX_PROBLEMS:
            break
        key = HIDDEN_KEY_PATTERN.format(layer=layer)
        for shard in range(len(shards)):
            fpath = dpath / HIDDEN_FILE_PATTERN.format(layer=layer, shard=shard)
            if not fpath.exists():
                problems.append(f"{fpath}: missing")
                continue
            shape = _tensor_shapes(fpath, memory_budget).get(key)
            if shape != (shard_rows[shard], dim):
                problems.append(
                    f"{fpath}: tensor {key!r} has shape {shape}, descriptor says ({shard_rows[shard]}, {dim})"
                )
    lt_rows = [d["num_prompts"] for d in shards[:n_lt]]
    if sum(lt_rows) != n:
        problems.append(f"{parquet_fpath}: last-token shards hold {sum(lt_rows)} rows for {n} prompts")
    seen = set()
    for i, (si, off) in enumerate(zip(index.get("shard_index", []), index.get("row_offset", []))):
        if not (0 <= si < n_lt and 0 <= off < lt_rows[si]):
            problems.append(f"{parquet_fpath}: row {i}: shard_index/row_offset ({si}, {off}) out of range")
        elif (si, off) in seen:
            problems.append(f"{parquet_fpath}: row {i}: shard_index/row_offset ({si}, {off}) used twice")
        seen.add((si, off))
    if hidden.get("storage") == "full_sequence":
        if "token_shard_ids" not in index or "token_shard_offsets" not in index:
            return problems + [f"{parquet_fpath}: full_sequence storage without token_shard_ids/token_shard_offsets"]
        for i, (ids, offs) in enumerate(zip(index["token_shard_ids"], index["token_shard_offsets"])):
            if len(ids) != index["num_tokens"][i] or len(offs) != len(ids):
                problems.append(
                    f"{parquet_fpath}: row {i}: {len(ids)} token addresses for {index['num_tokens'][i]} tokens"
                )
            bad = [(si, off) for si, off in zip(ids, offs) if not (0 <= si < len(shards) and 0 <= off < shard_rows[si])]
            if bad:
                problems.append(f"{parquet_fpath}: row {i}: token address {bad[0]} out of range")
    logits = info["tensors"].get("logits_topk")
    if logits is not None:
        for shard, desc in enumerate(logits["shards"]):
            fpath = dpath / LOGITS_FILE_PATTERN.format(shard=shard)
            if not fpath.exists():
                problems.append(f"{fpath}: missing")
                continue
            shapes = _tensor_shapes(fpath, memory_budget)
            keys = LOGITS_KEYS if LOGITS_KEYS[0] in shapes else SPEC_LOGITS_KEYS
            for key in keys:
                if shapes.get(key) != (desc["num_prompts"], logits["k"]):
                    problems.append(f"{fpath}: {key!r} has shape {shapes.get(key)}, "
                                    f"expected ({desc['num_prompts']}, {logits['k']})")
    return problems


class LmprobeDataset:
    """A validated lmprobe 2.0 dataset on local disk; tensors are loaded per (layer, shard) on demand."""

    def __init__(self, dpath: str | pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        self.dpath = pathlib.Path(dpath)
        self.memory_budget = memory_budget
        problems = validate(self.dpath, memory_budget)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise SaeflowError(f"invalid lmprobe dataset {self.dpath}: {problems[0]}{more}")
        self.info, self.index = read_info(self.dpath / PARQUET_PATH, memory_budget)
        self.hidden = self.info["tensors"]["hidden_layers"]
        self.layers = tuple(self.hidden["layers"])
        self.n_prompts = len(self.index["text"])
        self._cache: dict[tuple, np.ndarray] = {}  # loaded tensors, oldest first, within half the budget
        self._logits_keys: dict[pathlib.Path, tuple[str, str]] = {}

    @property
    def full_sequence(self) -> bool:
        return self.hidden.get("storage") == "full_sequence"

    def _tensor(self, fpath: pathlib.Path, key: str) -> np.ndarray:
        if (fpath, key) not in self._cache:
            tensor = read_tensor(fpath, key, self.memory_budget // 2)
            while self._cache and sum(t.nbytes for t in self._cache.values()) + tensor.nbytes > self.memory_budget // 2:
                del self._cache[next(iter(self._cache))]
            self._cache[(fpath, key)] = tensor
        return self._cache[(fpath, key)]

    def _hidden(self, layer: int, shard: int) -> np.ndarray:
        if layer not in self.layers:
            raise SaeflowError(f"{self.dpath}: layer {layer} is not stored; stored layers are {list(self.layers)}")
        fpath = self.dpath / HIDDEN_FILE_PATTERN.format(layer=layer, shard=shard)
        return self._tensor(fpath, HIDDEN_KEY_PATTERN.format(layer=layer))

    @property
    def pooling(self) -> str:
        """What each prompt's stored vector is: `last_token` (always, for full sequences), or lmprobe's pooling
        over the prompt's tokens (`mean`, `first_token`)."""
        return "last_token" if self.full_sequence else str(self.hidden.get("pooling", "last_token"))

    def pooled(self, layer: int) -> np.ndarray:
        """(n_prompts, D) the stored per-prompt vectors in index order, whatever their `pooling`."""
        return np.stack(
            [self._hidden(layer, s)[o] for s, o in zip(self.index["shard_index"], self.index["row_offset"])]
        )

    def _require_last_token(self) -> None:
        if self.pooling != "last_token":
            raise SaeflowError(f"{self.dpath}: pooled by {self.pooling!r} over each prompt's tokens, so its vectors "
                               "are no token's activations (read them with LmprobeDataset.pooled)")

    def last_token(self, layer: int) -> np.ndarray:
        """(n_prompts, D) last-token vectors in index order."""
        self._require_last_token()
        return self.pooled(layer)

    def tokens(self, i: int, layer: int) -> np.ndarray:
        """(num_tokens, D) every token of prompt i (full-sequence datasets only)."""
        if not self.full_sequence:
            raise SaeflowError(f"{self.dpath}: pooled dataset; only last-token vectors are stored")
        ids, offs = self.index["token_shard_ids"][i], self.index["token_shard_offsets"][i]
        return np.stack([self._hidden(layer, s)[o] for s, o in zip(ids, offs)])

    def logits_topk(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(values (n, k) float32, indices (n, k) int64) in index order, or None when not stored."""
        if self.info["tensors"].get("logits_topk") is None:
            return None
        rows = [self._logits_row(i) for i in range(self.n_prompts)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def _logits_row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        fpath = self.dpath / LOGITS_FILE_PATTERN.format(shard=self.index["shard_index_logits"][i])
        if fpath not in self._logits_keys:
            shapes = _tensor_shapes(fpath, self.memory_budget)
            self._logits_keys[fpath] = LOGITS_KEYS if LOGITS_KEYS[0] in shapes else SPEC_LOGITS_KEYS
        keys, o = self._logits_keys[fpath], self.index["row_offset_logits"][i]
        return self._tensor(fpath, keys[0])[o].copy(), self._tensor(fpath, keys[1])[o].copy()

    def _floats(self, values: list, i: int) -> np.ndarray:
        """A list column's numbers: lmprobe writes a list column as strings when its first row is empty."""
        try:
            return np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise SaeflowError(f"{self.dpath / PARQUET_PATH}: row {i}: token_perplexity holds no numbers "
                               f"({_one_line(err)})") from None

    def records(self) -> typing.Iterator[Record]:
        """One record per prompt, reading shards through a cache bounded by half the memory budget."""
        self._require_last_token()
        has_logits = self.info["tensors"].get("logits_topk") is not None
        extra_cols = [c for c in self.index if c not in CORE_COLUMNS]
        for i in range(self.n_prompts):
            if self.full_sequence:
                acts = {layer: self.tokens(i, layer) for layer in self.layers}
            else:
                s, o = self.index["shard_index"][i], self.index["row_offset"][i]
                acts = {layer: self._hidden(layer, s)[o : o + 1].copy() for layer in self.layers}
            logits = self._logits_row(i) if has_logits else None
            ids, strs = self.index.get("token_ids"), self.index.get("token_strings")
            ppl = self.index.get("token_perplexity")
            yield Record(
                text=self.index["text"][i],
                label=self.index["label"][i],
                acts=acts,
                token_ids=None if ids is None or ids[i] is None else np.asarray(ids[i], dtype=np.int64),
                token_strings=None if strs is None or strs[i] is None else tuple(strs[i]),
                topk_values=None if logits is None else logits[0],
                topk_indices=None if logits is None else logits[1],
                token_nll=None if ppl is None or ppl[i] is None else np.log(self._floats(ppl[i], i)),
                extra={c: self.index[c][i] for c in extra_cols},
            )
