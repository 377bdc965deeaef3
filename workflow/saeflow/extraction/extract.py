"""Activation spec -> shard metadata (plan, cheap) -> shards (extract, runs the model).

    spec = specs.ActivationSpec.from_dict(config["activations"][name])   # validated, defaults filled, once
    md = extract.plan_activation(spec)                                    # shards.Metadata; md.hash names the dir
    result = extract.extract(spec, shards_root)                           # writes (or reuses) <shards_root>/<hash>/

`plan_activation(spec)` is what Snakemake calls at parse time: it reads the model's config.json (never its
weights) and stats the dataset's files, so it is fast. The dataset's content fingerprint and, for text, the number
of examples (a streaming tokenization of the corpus) are computed once and then come from the fingerprint cache
(`saeflow.extraction.fingerprints`): a re-plan stats files and reads none (a Slurm job's parse of the Snakefile does not
plan at all: saeflow.planning.read_planned).

Everything that changes the stored bytes is in the hashed metadata: model and revision (`ckpt`), absolute layers,
dataset (`data` and `dataset`), preprocessing or tokenization, compute dtype, storage dtype. Things that do not
change what is computed (batch size, device, worker count) are not hashed and go to provenance.json. Numerical
kernels can differ in the last bits between CPU and GPU; the hash names the computation, not the hardware.
"""

import contextlib
import dataclasses
import json
import logging
import pathlib
import time
import typing

import numpy as np

from saeflow import devices, preempt
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, datasets, fingerprints, models, specs, tokenization
from saeflow.store import layout, shards
from saeflow.store.hashing import canonical_json
from saeflow.store.shards import parts

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A resolved activation spec: what will be computed, and where it will be stored."""

    spec: specs.ActivationSpec  # what was asked for
    metadata: shards.Metadata  # what will be computed; its hash names the shard directory
    info: models.ModelInfo  # the model, read from its config (no weights)
    device: str  # the spec's device or the caller's override, resolved only when extracting (not hashed)
    preprocess: datasets.Preprocess | datasets.ProcessorPreprocess | None = None  # vision: how pixels reach the model
    packing: tokenization.Packing | None = None  # text: how the corpus becomes examples

    @property
    def model_spec(self) -> models.ModelSpec:
        return self.spec.model

    @property
    def dataset(self) -> specs.Dataset:
        return self.spec.dataset

    @property
    def aux_fnames(self) -> tuple[str, ...]:
        """Vision: the dataset's side file (labels.bin per patch, classes.bin per example, none for an unlabeled
        hf_dataset); text: tokens.bin."""
        if self.info.modality != "vision":
            return (layout.ShardLayout.TOKENS_FNAME,)
        return () if self.dataset.aux_fname is None else (self.dataset.aux_fname,)


def plan(spec: specs.ActivationSpec, device: str | None = None) -> Plan:
    """Resolve a spec without running the model (see module docstring for the cost)."""
    info = models.describe(spec.model)
    layers = info.resolve_layers(spec.layers)
    dataset = spec.dataset
    text_dataset = datasets.is_text(dataset)
    if info.modality == "vision":
        if text_dataset:
            raise SaeflowError(f"dataset: {info.ckpt} is a vision model but dataset.kind is text")
        pre = datasets.preprocess_for(info, dataset.preprocess)
        n_ex = len(dataset)
        data = {**dataset.data(), "preprocess": pre.hashed(), "compute_dtype": spec.compute_dtype}
        patches_per_ex = info.patches_per_ex
        extra = dict(preprocess=pre)
    else:
        if not text_dataset:
            raise SaeflowError(
                f"dataset: {info.ckpt} is a text model; use dataset.kind text, builtin_text or hf_dataset (text_column)"
            )
        if spec.context_length > info.max_positions:
            raise SaeflowError(
                f"context_length={spec.context_length} is larger than {info.ckpt} allows "
                f"({info.max_positions} positions)"
            )
        packing = tokenization.model_packing(info, spec.tokenizer, spec.context_length)
        n_ex = tokenization.example_count(info, spec.tokenizer, dataset, packing)
        data = {**dataset.data(), "tokenization": dataclasses.asdict(packing), "compute_dtype": spec.compute_dtype}
        patches_per_ex = spec.context_length
        extra = dict(packing=packing)
    md = shards.Metadata(
        family=info.family,
        ckpt=info.ckpt,
        layers=layers,
        patches_per_ex=patches_per_ex,
        cls_token=info.cls_token,
        d_model=info.d_model,
        n_ex=n_ex,
        patches_per_shard=spec.patches_per_shard,
        data=json.loads(canonical_json(shards.canonical_data(data))),  # plain JSON, as metadata.json reads back
        dataset=dataset.dataset_path,
        dtype=spec.store_dtype,
    )
    return Plan(spec=spec, metadata=md, info=info, device=device or spec.device, **extra)


def plan_activation(spec: specs.ActivationSpec) -> shards.Metadata:
    """The shard metadata (and so `.hash`, the directory name) of one activation spec. Parse-time safe."""
    return plan(spec).metadata


# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """What `extract` did, and where the time went (seconds)."""

    dpath: pathlib.Path  # the published shard directory <shards_root>/<hash>
    reused: bool  # it already existed and was valid: nothing ran
    resumed_from: int  # examples kept from an interrupted run (0: a fresh run)
    n_ex: int  # examples in the directory
    forward_sec: float = 0.0  # model time
    write_sec: float = 0.0  # time extraction waited on the writer: handing arrays over (blocked included) + publish
    total_sec: float = 0.0  # planning, checks, model loading, forward and writing
    loop_sec: float = 0.0  # the batch loop and the publish: input loading, forward, writing (no planning or loading)


def batches(n_ex: int, ex_per_shard: int, batch_size: int, start: int) -> list[tuple[int, int]]:
    """[start, stop) batches that never cross a shard boundary and restart at every shard.

    A resumed run (which starts at a shard boundary) therefore sees exactly the batches of an uninterrupted run,
    and the bytes come out identical.
    """
    out = []
    for shard_start in range(0, n_ex, ex_per_shard):
        shard_stop = min(shard_start + ex_per_shard, n_ex)
        for lo in range(shard_start, shard_stop, batch_size):
            if lo >= start:
                out.append((lo, min(lo + batch_size, shard_stop)))
    return out


class _Examples:
    """Map-style torch dataset of preprocessed images + patch labels (decoded in DataLoader workers)."""

    def __init__(self, dataset, pre: datasets.Preprocess | datasets.ProcessorPreprocess):
        self.dataset, self.pre = dataset, pre

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset.example(i, self.pre)


def _image_batches(plan_: Plan, spans: list[tuple[int, int]]):
    import torch
    import torch.utils.data

    examples = _Examples(plan_.dataset, plan_.preprocess)
    loader = torch.utils.data.DataLoader(
        examples,
        batch_sampler=[list(range(lo, hi)) for lo, hi in spans],
        num_workers=plan_.spec.n_workers,
        collate_fn=_collate,
    )
    yield from loader


def _collate(items):
    """(pixels (B, 3, H, W) tensor, side rows: labels (B, P) or classes (B,)) of a list of examples; module-level so it
    pickles."""
    import torch

    side = None if items[0][1] is None else np.stack([labels for _, labels in items])
    return torch.from_numpy(np.stack([x for x, _ in items])), side


def _text_batches(plan_: Plan, spans: list[tuple[int, int]]):
    import torch

    ids_nt = tokenization.token_ids(plan_.info, plan_.spec.tokenizer, plan_.dataset, plan_.packing)
    for lo, hi in spans:
        yield torch.from_numpy(ids_nt[lo:hi].astype(np.int64)), ids_nt[lo:hi]


def model_source(spec: models.ModelSpec) -> str | None:
    """The absolute path of a local model directory, else the HF id; None for a random-init model."""
    if spec.name is None:
        return None
    local = pathlib.Path(spec.name).expanduser()
    return str(local.resolve()) if local.is_dir() else spec.name


def extract(
    spec: specs.ActivationSpec,
    shards_root,
    device: str | None = None,
    progress: bool = True,
    part: tuple[int, int] | None = None,
    expect_hash: str | None = None,
) -> Result:
    """Write (or reuse) `<shards_root>/<hash>/`. Every input is checked before the model is loaded.

    With `part=(part_idx, n_parts)` only that part's contiguous range of whole shards is written, into the parts
    area (`seal` publishes the directory once every part is finished); `Result.dpath` is then the part directory.
    `expect_hash` (the workflow's plan) must be the hash planned here (`check_hash`). A Ctrl-C keeps every complete
    shard and says so (`KeyboardInterrupt(writer.kept())`).
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    plan_ = plan(spec, device=device)
    md = plan_.metadata
    check_hash(md, expect_hash)
    dataset = plan_.dataset
    if shards.open_existing(pathlib.Path(shards_root) / md.hash) is not None:
        return Result(pathlib.Path(shards_root) / md.hash, True, 0, md.n_ex, total_sec=time.perf_counter() - t0)
    if plan_.info.modality == "vision":
        dataset.check(progress)  # unreadable images fail here, before any weights are loaded
    device_name = str(devices.resolve_device(plan_.device))  # adapters.load and provenance.json take the name
    provenance_extra = {
        "extraction": {"batch_size": plan_.spec.batch_size, "device": device_name, "n_workers": plan_.spec.n_workers},
        # Where the weights came from on this machine (not hashed): lets visuals find a local model's tokenizer.
        "model_source": model_source(plan_.model_spec),
    }
    if part is None:
        writer = shards.ShardWriter(shards_root, md, aux=plan_.aux_fnames, provenance_extra=provenance_extra)
    else:
        writer = parts.PartWriter(shards_root, md, *part, aux=plan_.aux_fnames, provenance_extra=provenance_extra)
    ex_stop = writer.ex_stop  # a part stops at its last shard
    with _saying_what_is_kept(writer), writer:
        if writer.reused:
            return Result(writer.built_dpath, True, 0, md.n_ex, total_sec=time.perf_counter() - t0)
        if writer.resumed_from:
            logger.info("resuming %s from example %d (last complete shard)", writer.staging, writer.resumed_from)
        adapter = adapters.load(plan_.model_spec, plan_.spec.compute_dtype, device_name, info=plan_.info)
        spans = [
            s for s in batches(md.n_ex, md.ex_per_shard, plan_.spec.batch_size, writer.n_written) if s[0] < ex_stop
        ]
        source = _image_batches if plan_.info.modality == "vision" else _text_batches
        result = Result(writer.built_dpath, False, writer.resumed_from, md.n_ex)
        bar = tqdm(
            total=ex_stop, initial=writer.n_written, unit="ex", desc=f"extract {md.hash[:12]}", disable=not progress
        )
        n_tokens = 0
        t_loop = time.perf_counter()
        with bar:
            for inputs, aux_rows in source(plan_, spans):
                if preempt.received():  # a stop signal: the writer keeps every complete shard to resume from
                    raise preempt.stopped(f"{writer.staging} keeps its complete shards")
                t = time.perf_counter()
                acts = adapter.run(inputs, md.layers)
                acts_nltd = np.stack([acts[layer].numpy() for layer in md.layers], axis=1)
                result.forward_sec += time.perf_counter() - t
                t = time.perf_counter()
                writer.write(acts_nltd, aux={fname: aux_rows for fname in plan_.aux_fnames})
                result.write_sec += time.perf_counter() - t
                n = acts_nltd.shape[0]
                n_tokens += n * md.tokens_per_ex
                bar.update(n)
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"{n_tokens / elapsed:,.0f} tok/s")
        t = time.perf_counter()
    result.write_sec += time.perf_counter() - t  # drain the queue, checksums, fsync, rename
    result.total_sec = time.perf_counter() - t0
    result.loop_sec = time.perf_counter() - t_loop
    return result


@contextlib.contextmanager
def _saying_what_is_kept(writer: shards.ShardWriter) -> typing.Iterator[None]:
    """Around the writer's block: a Ctrl-C, once the writer has kept its complete shards, says how many, where, and
    how to resume (the CLI prints it: `saeflow extract: interrupted: ...`)."""
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(writer.kept()) from None


def check_hash(md: shards.Metadata, expect_hash: str | None) -> None:
    """The workflow passes the shard hash it planned: a job that plans another one (its software or inputs differ
    from those of the Snakemake that planned) stops before the model runs."""
    if expect_hash is not None and md.hash != expect_hash:
        raise SaeflowError(
            f"the workflow planned shard directory {expect_hash}, but this job plans {md.hash} for the same "
            "activation: it sees other software or inputs than the planning did (compare `saeflow plan --json` in "
            "both; a dataset file rewritten in place is seen here, not by a re-plan that stats directories only: "
            f"rerun snakemake with {fingerprints.RECHECK_ENV}=files once)"
        )


def seal(spec: specs.ActivationSpec, shards_root, n_parts: int, expect_hash: str | None = None) -> Result:
    """Publish `<shards_root>/<hash>/` from the `n_parts` finished parts of a split extraction (no model run):
    every part is verified (shard names, counts, sizes, sha256) before one rename publishes the directory."""
    t0 = time.perf_counter()
    plan_ = plan(spec)
    md = plan_.metadata
    check_hash(md, expect_hash)
    dpath, reused = parts.seal(
        shards_root,
        md,
        n_parts,
        aux=plan_.aux_fnames,
        provenance_extra={"model_source": model_source(plan_.model_spec)},
    )
    return Result(dpath, reused, 0, md.n_ex, total_sec=time.perf_counter() - t0)
