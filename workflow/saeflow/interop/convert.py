"""Exports and conversions, always source -> `Record`s -> sink (never format-to-format special cases).

Sources: a prompt dataset run through a text model (`export_records`), or an existing lmprobe / Zarr /
gzip-pickle directory (`open_source`). Sinks: lmprobe 2.0, Zarr, gzip-pickle, saev shards (`write`). `convert` is
`saeflow convert`: those, or (--to saev2.1) a saeflow shard directory exported file by file for saev's own readers
(`saev_export`: the same bytes under saev's names, so no records).
"""

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import pathlib
import typing

from saeflow.errors import SaeflowError
from saeflow.interop import lmprobe, pickle_shards, saev_export, saev_import, saev_sink, zarr_store
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET
from saeflow.interop.records import Record, read_prompts
from saeflow.interop.spec import SAEV_EXPORT_FORMAT, SINK_FORMATS, ExportSpec


@dataclasses.dataclass(frozen=True)
class Source:
    """What a sink needs besides the records: how many, and where they came from."""

    records: typing.Callable[[], typing.Iterator[Record]]
    n: int
    model_name: str
    model_revision: str | None
    dataset: str
    family: str  # for saev metadata: the architecture when the source says it
    identity: dict  # for saev metadata `data`: changes exactly when the source bytes do
    pooling: str = "last_token"  # which token a one-vector record holds (an lmprobe dataset may pool the first)


def detect(dpath: pathlib.Path) -> str:
    if (dpath / lmprobe.PARQUET_PATH).exists():
        return "lmprobe"
    if (dpath / zarr_store.MANIFEST_FNAME).exists() or (dpath / ".zmetadata").exists():
        return "zarr"
    zarr_store.refuse_format_3(dpath)
    if saev_export.looks_like_shard_dir(dpath):
        raise SaeflowError(f"{dpath}: a saeflow shard directory (protocol 2.0), which training reads as it is; convert "
                           f"exports it only --to {SAEV_EXPORT_FORMAT} (for saev's own readers)")
    if saev_import.looks_like_saev(dpath):
        raise SaeflowError(f"{dpath}: a saev shard directory (protocol 2.1), not an interop format; import it into "
                           "the shard store with `saeflow import saev DIR --shards-root ROOT`")
    if (dpath / pickle_shards.METADATA_FNAME).exists():
        return "pickle"
    raise SaeflowError(f"{dpath}: not an lmprobe dataset, Zarr store or gzip-pickle shard directory")


def default_spec() -> ExportSpec:
    """The schema's per-format defaults (sections lmprobe/zarr/pickle), for conversions that have no export spec."""
    return ExportSpec.from_dict({"format": "pickle", "model": {"name": "-"}, "prompts": {"path": "-"}, "layers": [0]})


def open_source(dpath: str | pathlib.Path, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Source:
    """Records of an existing interop directory, read as untrusted input: every reader refuses a file that would
    need more than `memory_budget` bytes (declared shapes, decompressed sizes, unpickled objects)."""
    dpath = pathlib.Path(dpath)
    fmt = detect(dpath)
    if fmt == "lmprobe":
        ds = lmprobe.LmprobeDataset(dpath, memory_budget)
        model = ds.info["model"]
        ident = {"__class__": "LmprobeDataset", "info": ds.info["tensors"], "model": model}
        return Source(ds.records, ds.n_prompts, model["name"], model.get("revision"), dpath.name, "text", ident,
                      ds.pooling)
    if fmt == "zarr":
        reader = zarr_store.ZarrReader(dpath, memory_budget)
        keys = [row["sample_key"] for row in reader.text("prompt")]
        ident = {"__class__": "ZarrActivationStore",
                 "attrs": {"layers": list(reader.layers), "P_max": reader.t_max["prompt"],
                           "R_max": reader.t_max.get("response", 0)},
                 "sample_keys_sha256": zarr_store.sample_key("".join(keys)).decode()}
        model = reader.attrs.get("model_id", "unknown")
        return Source(reader.records, reader.n, model, reader.attrs.get("model_revision"), dpath.name, "text", ident)
    store = pickle_shards.PickleShards(dpath, memory_budget)
    ec = store.metadata["extraction_config"]
    ident = {"__class__": "GzipPickleShards", "checksums": [s["checksum"] for s in store.shards]}
    return Source(store.records, store.n_samples, ec.get("model_name", "unknown"), None,
                  ec.get("dataset_name", dpath.name), ec.get("model_architecture", "text"), ident)


def convert(src: str | pathlib.Path, fmt: str, out: pathlib.Path,
            memory_budget: int = DEFAULT_MEMORY_BUDGET) -> pathlib.Path:
    """`saeflow convert`: the directory at `src` written as `fmt` at `out` (see `write`); --to saev2.1 exports a
    saeflow shard directory into the saev shards root `out` (`saev_export`), returning <out>/<saev name>."""
    src = pathlib.Path(src)
    if fmt == SAEV_EXPORT_FORMAT:
        if not saev_export.looks_like_shard_dir(src):
            raise SaeflowError(f"{src}: --to {fmt} exports a saeflow shard directory (protocol 2.0 metadata.json), and "
                               f"this is none; convert it --to saev first, then that directory --to {fmt}")
        return saev_export.export_saev(src, out)[0]
    return write(open_source(src, memory_budget), fmt, out, default_spec())


def write(source: Source, fmt: str, out: pathlib.Path, spec: ExportSpec) -> pathlib.Path:
    """Write `source` as `fmt` at `out` (for saev: into the shards root `out`, returning <out>/<hash>).

    Optional parts the source does not have (logits, perplexity, responses) are left out instead of refused.
    """
    if fmt not in SINK_FORMATS:
        raise SaeflowError(f"unknown output format {fmt!r}; choose one of {SINK_FORMATS}")
    if fmt == SAEV_EXPORT_FORMAT:
        raise SaeflowError(f"{fmt} output is exported from a saeflow shard directory (`convert`), not from records")
    records = source.records()
    first = next(records, None)
    if first is None:
        raise SaeflowError(f"{fmt} output: the source has no examples")
    records = itertools.chain([first], records)
    if fmt == "lmprobe":
        top_k = 0 if first.topk_values is None else min(spec.lmprobe.top_k, len(first.topk_values))  # what it has
        opts = dataclasses.replace(spec.lmprobe, top_k=top_k,
                                   perplexity=spec.lmprobe.perplexity and first.token_nll is not None)
        return lmprobe.write(records, out, source.model_name, source.model_revision, opts, source.pooling)
    if fmt == "pickle":
        ec = {"model_name": source.model_name, "model_revision": source.model_revision, "dataset_name": source.dataset}
        return pickle_shards.write(records, out, ec, spec.pickle)
    if fmt == "zarr":
        opts = spec.zarr.store
        if first.response_acts is None:
            opts = dataclasses.replace(opts, response_max=0)
        attrs = {"model_id": source.model_name, "model_revision": source.model_revision, "dataset": source.dataset}
        bounds = zarr_store.shard_bounds(source.n, opts.samples_per_shard)
        for shard, (start, stop) in enumerate(bounds):
            zarr_store.write_store(itertools.islice(records, stop - start), stop - start,
                                   out / "shards" / zarr_store.shard_dname(shard), attrs, opts)
        zarr_store.write_manifest(out, len(bounds))
        if spec.zarr.merge:
            zarr_store.merge(out, out / "merged.zarr")
        return out
    sd = saev_sink.write(records, source.n, out, source.family, source.model_name, source.dataset, source.identity)
    return sd.dpath


# ---------------------------------------------------------------------------------------------------------------
# Export: prompt dataset -> text engine -> sink
# ---------------------------------------------------------------------------------------------------------------


def _engine_config(spec: ExportSpec):
    """What the engine computes for this export: logits and perplexity for lmprobe, responses for zarr."""
    from saeflow.interop import engine

    lm = spec.format == "lmprobe"
    return engine.EngineConfig(
        model=spec.model_name,
        revision=spec.model_revision,
        layers=spec.layers,
        max_tokens=spec.max_tokens,
        batch_size=spec.batch_size,
        top_k=spec.lmprobe.top_k if lm else 0,
        perplexity=spec.lmprobe.perplexity if lm else False,
        token_strings=spec.lmprobe.token_strings if lm else False,
        response_max=spec.zarr.store.response_max if spec.format == "zarr" else 0,
        device=spec.device,
    )


def _prompts(spec: ExportSpec) -> list[dict]:
    p = spec.prompts
    rows = read_prompts(p.path, p.text_key, p.label_key)
    return rows[: p.limit] if p.limit else rows


def export(spec: ExportSpec, out: pathlib.Path, parts: typing.Sequence[int] | None = None,
           progress: bool = True) -> pathlib.Path:
    """Run an export spec. Zarr exports write shard stores (only `parts` when given; existing ones are reused)
    and the manifest once every shard exists."""
    from saeflow.interop import engine

    fmt = spec.format
    prompts = _prompts(spec)
    if fmt == "zarr":
        return _export_zarr(spec, prompts, out, parts, progress)
    if parts is not None:
        raise SaeflowError("--part applies to zarr exports only (lmprobe and pickle datasets are written whole)")
    if out.exists():  # before the model runs over every prompt
        raise SaeflowError(f"{out} already exists; remove it or choose another output directory")
    eng = engine.TextEngine(_engine_config(spec))
    if fmt == "lmprobe":  # cheap checks before the model runs over every prompt
        texts = [r["text"] for r in prompts]
        lmprobe.check_duplicates(texts, spec.lmprobe.allow_duplicate_texts, str(spec.prompts.path))
    source = Source(lambda: eng.records(prompts, progress), len(prompts), spec.model_name, eng.info.revision,
                    str(spec.prompts.path), eng.info.family, {})
    return write(source, fmt, out, spec)


def _zarr_attrs(spec: ExportSpec, revision: str | None) -> dict:
    return {"model_id": spec.model_name, "model_revision": revision, "dataset": str(spec.prompts.path),
            "max_tokens": spec.max_tokens}


def _export_zarr_part(spec: ExportSpec, prompts: list[dict], dpath: pathlib.Path, progress: bool) -> str:
    from saeflow.interop import engine

    eng = engine.TextEngine(_engine_config(spec))
    attrs = _zarr_attrs(spec, eng.info.revision)
    zarr_store.write_store(eng.records(prompts, progress), len(prompts), dpath, attrs, spec.zarr.store)
    return str(dpath)


def _export_zarr(spec: ExportSpec, prompts, out, parts, progress) -> pathlib.Path:
    zspec = spec.zarr
    bounds = zarr_store.shard_bounds(len(prompts), zspec.store.samples_per_shard)
    wanted = range(len(bounds)) if parts is None else parts
    bad = [p for p in wanted if not 0 <= p < len(bounds)]
    if bad:
        raise SaeflowError(f"--part {bad}: this export has shards 0..{len(bounds) - 1}")
    todo = [(p, out / "shards" / zarr_store.shard_dname(p)) for p in wanted]
    todo = [(p, d) for p, d in todo if not d.exists()]
    if zspec.workers > 1 and len(todo) > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(zspec.workers, mp_context=ctx) as pool:
            futures = [pool.submit(_export_zarr_part, spec, prompts[slice(*bounds[p])], d, False) for p, d in todo]
            for fut in concurrent.futures.as_completed(futures):
                fut.result()
    else:
        for p, d in todo:
            _export_zarr_part(spec, prompts[slice(*bounds[p])], d, progress)
    if all((out / "shards" / zarr_store.shard_dname(p)).exists() for p in range(len(bounds))):
        zarr_store.write_manifest(out, len(bounds))
        if zspec.merge and not (out / "merged.zarr").exists():
            zarr_store.merge(out, out / "merged.zarr")
    return out
