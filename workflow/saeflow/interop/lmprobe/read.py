"""lmprobe 2.0 datasets read as untrusted input: the validator (what lmprobe trusts without checking) and the
reader, which loads tensors per (layer, shard) within a memory budget. It also accepts the spec's `topk_values` /
`topk_indices` logits keys."""

import json
import math
import pathlib
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET, check_alloc, fmt_bytes
from saeflow.interop.lmprobe.format import (
    CORE_COLUMNS,
    FORMAT_VERSION,
    HIDDEN_FILE_PATTERN,
    HIDDEN_KEY_PATTERN,
    LOGITS_FILE_PATTERN,
    LOGITS_KEYS,
    PARQUET_PATH,
    SPEC_LOGITS_KEYS,
)
from saeflow.interop.records import Record

ONE_TOKEN_POOLINGS = ("last_token", "first_token")  # lmprobe poolings whose vector is one token's activations
MAX_PROBLEMS = 100  # validate stops listing missing or mismatched shards after this many
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                      "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


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
            self._require_one_token()
            raise SaeflowError(f"{self.dpath}: pooled at the {self.pooling.split('_')[0]} token, not the last")

    def _require_one_token(self) -> None:
        """Each stored vector is one token's: the last's, or token 0's (lmprobe's `first_token`, checked against the
        model run on each prompt alone in tests/fixtures/lmprobe)."""
        if self.pooling not in ONE_TOKEN_POOLINGS:
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
        """One record per prompt, reading shards through a cache bounded by half the memory budget. A pooled
        dataset's record holds its one token: the last, or token 0 (`pooling`)."""
        self._require_one_token()
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
