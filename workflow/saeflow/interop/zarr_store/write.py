"""Writing Zarr activation stores: one store per writer shard (staged, consolidated, renamed), the manifest that
maps global sample indices to shards, and the merge of every shard into one store."""

import itertools
import json
import pathlib
import shutil
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.interop.records import Record, check_uniform
from saeflow.interop.zarr_store import compat as zarr_compat
from saeflow.interop.zarr_store.format import (
    MANIFEST_FNAME,
    PROMPT,
    RESPONSE,
    SCHEMA_VERSION,
    TEXT_FILES,
    ZarrOptions,
    sample_key,
    shard_dname,
)
from saeflow.interop.zarr_store.read import ZarrReader
from saeflow.store import atomic, provenance


def write_store(records: typing.Iterable[Record], n: int, out_dpath, attrs: dict, opts: ZarrOptions) -> pathlib.Path:
    """Write n streamed records as one self-contained store (staged, consolidated, renamed). Returns its path.

    Arrays are pre-allocated for n samples and each record is written as it arrives (one shard of float32
    records never has to fit in memory).
    """
    out_dpath = pathlib.Path(out_dpath)
    where = f"zarr store {out_dpath}"
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; remove it or choose another output")
    records = iter(records)
    first = next(records, None)
    if first is None or n < 1:
        raise SaeflowError(f"{where}: no examples to write")
    layers, d_model = check_uniform([first], where)
    L = len(layers)
    want_resp = opts.response_max > 0
    with atomic.building_dir(out_dpath) as staging, zarr_compat.settled_on_error():
        root = zarr_compat.new_group(staging)
        arrays = root.create_group("arrays")

        def acts_array(name, t_max, t_chunk):
            return zarr_compat.create_array(arrays, name, (n, L, t_max, d_model), (1, 1, t_chunk, d_model), "<f2", 0)

        prompt_arr = acts_array("prompt_activations", opts.prompt_max, min(opts.t_chunk_prompt, opts.prompt_max))
        resp_arr = acts_array("response_activations", opts.response_max, opts.response_max) if want_resp else None
        prompt_len = np.zeros(n, np.int32)
        resp_len = np.zeros(n, np.int32)
        n_prompt_trunc = n_resp_trunc = 0
        lines = {key: [] for key in TEXT_FILES}
        keys, labels = [], []
        for i, rec in enumerate(itertools.chain([first], records)):
            if i >= n:
                raise SaeflowError(f"{where}: more than the declared {n} examples")
            if check_uniform([rec], where) != (layers, d_model):
                raise SaeflowError(f"{where}: example {i} has layers {list(rec.layers)} of width "
                                   f"{rec.acts[rec.layers[0]].shape[-1]}; "
                                   f"example 0 has {list(layers)} of width {d_model}")
            if want_resp and rec.response_acts is None:
                raise SaeflowError(f"{where}: response_max={opts.response_max} but example {i} has no response")
            keys.append(sample_key(rec.text))
            labels.append(rec.label)
            key = keys[-1].decode()
            p = min(rec.n_tokens, opts.prompt_max)
            n_prompt_trunc += rec.n_tokens > opts.prompt_max
            prompt_len[i] = p
            prompt_arr[i, :, :p] = np.stack([rec.acts[layer][:p] for layer in layers]).astype(np.float16)
            lines[PROMPT].append({"i": i, "sample_key": key, "prompt": rec.text})
            if want_resp:
                n_resp = len(rec.response_ids) if rec.response_ids is not None else len(rec.response_acts[layers[0]])
                r = min(n_resp, opts.response_max)
                n_resp_trunc += n_resp >= opts.response_max
                resp_len[i] = r
                if r:
                    resp_arr[i, :, :r] = np.stack([rec.response_acts[layer][:r] for layer in layers]).astype(np.float16)
                lines[RESPONSE].append({"i": i, "sample_key": key, "response": rec.response_text})
            lines["extra"].append({"i": i, "sample_key": key, "label": rec.label, **rec.extra})
        if len(keys) != n:
            raise SaeflowError(f"{where}: got {len(keys)} examples, declared {n}")
        _small_array(arrays, "prompt_len", prompt_len)
        if want_resp:
            _small_array(arrays, "response_len", resp_len)
        _small_array(arrays, "sample_key", np.array(keys, dtype="|S64"))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in labels if v is not None):
            _small_array(arrays, "label", np.array([-1 if v is None else v for v in labels], np.int64))
        for key, fname in TEXT_FILES.items():
            if lines[key]:
                fpath = staging / fname
                fpath.parent.mkdir(parents=True, exist_ok=True)
                fpath.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines[key]), encoding="utf-8")
        prov = provenance.collect()
        root.attrs.update({
            **attrs,
            "schema_version": SCHEMA_VERSION,
            "layers": list(layers),
            "num_layers": L,
            "hidden_size": int(d_model),
            "num_samples": n,
            "P_max": opts.prompt_max,
            "R_max": opts.response_max,
            "T_chunk_prompt": prompt_arr.chunks[2],
            "T_chunk_response": opts.response_max,
            "dtype": "float16",
            "prompt_truncated_count": int(n_prompt_trunc),
            "response_truncated_count": int(n_resp_trunc),
            "prompt_truncated_fraction": n_prompt_trunc / n,
            "response_truncated_fraction": n_resp_trunc / n if want_resp else 0.0,
            "created_at": provenance.utc_now(),
            **{k: prov[k] for k in ("saeflow_version", "git_commit", "torch_version", "transformers_version")},
        })
        zarr_compat.consolidate(staging)
    return out_dpath


def _small_array(group, name: str, values: np.ndarray) -> None:
    """A per-sample (N,) array in one blosc chunk (what zarr-python 2.18's `group.array` wrote)."""
    fill = b"" if values.dtype.kind == "S" else 0
    zarr_compat.create_array(group, name, values.shape, values.shape, values.dtype, fill,
                             zarr_compat.SMALL_COMPRESSOR)[:] = values


def shard_bounds(n: int, per_shard: int) -> list[tuple[int, int]]:
    return [(start, min(start + per_shard, n)) for start in range(0, n, per_shard)]


def write_manifest(root_dpath, n_shards: int) -> pathlib.Path:
    """After all shard stores exist: manifest.json with each shard's sample count and global offset."""
    root_dpath = pathlib.Path(root_dpath)
    entries, offset, first_attrs = [], 0, None
    for shard in range(n_shards):
        dpath = root_dpath / "shards" / shard_dname(shard)
        if not (dpath / ".zmetadata").exists():
            raise SaeflowError(f"{dpath}: missing or incomplete; write every shard before the manifest")
        attrs = json.loads((dpath / ".zmetadata").read_text())["metadata"][".zattrs"]
        same = {k: attrs[k] for k in ("layers", "hidden_size", "P_max", "R_max", "T_chunk_prompt", "model_id")}
        if first_attrs is not None and same != first_attrs:
            raise SaeflowError(f"{dpath}: schema {same} differs from shard 0 {first_attrs}")
        first_attrs = same
        entries.append({"path": f"shards/{shard_dname(shard)}", "num_samples": attrs["num_samples"], "offset": offset})
        offset += attrs["num_samples"]
    fpath = root_dpath / MANIFEST_FNAME
    manifest = {"schema_version": SCHEMA_VERSION, "num_samples": offset, "shards": entries, **first_attrs}
    atomic.write_file_atomic(fpath, (json.dumps(manifest, indent=2) + "\n").encode())
    return fpath


# ---------------------------------------------------------------------------------------------------------------
# Merge (spec option B)
# ---------------------------------------------------------------------------------------------------------------


def merge(root_dpath, out_dpath) -> pathlib.Path:
    """One store from a manifest's shards: chunk files are copied under their new sample index (no decode)."""
    reader = ZarrReader(root_dpath)
    out_dpath = pathlib.Path(out_dpath)
    if out_dpath.exists():
        raise SaeflowError(f"{out_dpath} already exists; remove it or choose another output")
    if any(d is None for s in reader.stores for d in s.direct.values()):
        raise SaeflowError(f"{root_dpath}: merge needs uncompressed (1, 1, T, H) chunks in every shard")
    with atomic.building_dir(out_dpath) as staging, zarr_compat.settled_on_error():
        first = zarr_compat.open_consolidated(reader.stores[0].dpath)
        root = zarr_compat.new_group(staging)
        arrays = root.create_group("arrays")
        for name, src in first["arrays"].arrays():
            chunks = (1, *src.chunks[1:]) if src.ndim == 4 else (max(reader.n, 1),)
            zarr_compat.create_array(arrays, name, (reader.n, *src.shape[1:]), chunks, src.dtype, src.fill_value)
        for store, start in zip(reader.stores, reader.starts):
            src_root = zarr_compat.open_consolidated(store.dpath)
            for name, src in src_root["arrays"].arrays():
                if src.ndim == 4:
                    _copy_chunks(store.dpath / "arrays" / name, staging / "arrays" / name, int(start))
                else:
                    arrays[name][int(start) : int(start) + store.n] = src[:]
        for key, fname in TEXT_FILES.items():
            rows = reader.text(key)
            if rows:
                (staging / fname).parent.mkdir(parents=True, exist_ok=True)
                (staging / fname).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        stores_attrs = [s.attrs for s in reader.stores]
        n_p = sum(a["prompt_truncated_count"] for a in stores_attrs)
        n_r = sum(a["response_truncated_count"] for a in stores_attrs)
        root.attrs.update({**reader.attrs, "num_samples": reader.n, "prompt_truncated_count": n_p,
                           "response_truncated_count": n_r, "prompt_truncated_fraction": n_p / reader.n,
                           "response_truncated_fraction": n_r / reader.n if reader.attrs["R_max"] else 0.0,
                           "merged_from": [str(s.dpath.relative_to(reader.path)) for s in reader.stores]})
        zarr_compat.consolidate(staging)
    return out_dpath


def _copy_chunks(src_dpath: pathlib.Path, dst_dpath: pathlib.Path, offset: int) -> None:
    for fpath in src_dpath.iterdir():
        if fpath.name.startswith("."):
            continue
        i, rest = fpath.name.split(".", 1)
        shutil.copyfile(fpath, dst_dpath / f"{int(i) + offset}.{rest}")
