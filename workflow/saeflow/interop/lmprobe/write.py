"""The lmprobe 2.0 writer: records -> per-layer safetensors shards + the parquet index, validated, published once."""

import json
import logging
import pathlib
import platform
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.interop.lmprobe.format import (
    CORE_COLUMNS,
    FORMAT_VERSION,
    HIDDEN_FILE_PATTERN,
    HIDDEN_KEY_PATTERN,
    LOGITS_FILE_PATTERN,
    LOGITS_KEYS,
    PARQUET_PATH,
    LmprobeOptions,
)
from saeflow.interop.lmprobe.read import validate
from saeflow.interop.records import Record
from saeflow.store import atomic, provenance

logger = logging.getLogger(__name__)

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
    pooling: str = "last_token",
) -> pathlib.Path:
    """Write an lmprobe 2.0 dataset to `out_dpath` (staged in a sibling, validated, then renamed into place).
    `pooling`: which token a pooled record's one vector is (`first_token` from an lmprobe dataset pooled there)."""
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; remove it or choose another output directory")
    full = opts.storage == "full_sequence"
    if full and pooling != "last_token":
        raise SaeflowError(f"lmprobe export: the source holds one vector per prompt ({pooling}), not full sequences")
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
            hidden.update(pooling=pooling, row_bytes=int(d_model) * 4)
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
