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
from saeflow.extraction import adapters, datasets, fingerprints, hooks, models, specs, tokenization
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
    hooks.check(info.model_type, info.family, spec.hook)  # a hook point the family lacks: refused here, in one line
    hooked = hooks.hashed(spec.hook)  # nothing for the residual stream: every earlier shard hash stays
    dataset = spec.dataset
    text_dataset = datasets.is_text(dataset)
    if info.modality == "vision":
        if text_dataset:
            raise SaeflowError(f"dataset: {info.ckpt} is a vision model but dataset.kind is text")
        pre = datasets.preprocess_for(info, dataset.preprocess)
        n_ex = len(dataset)
        data = {**dataset.data(), "preprocess": pre.hashed(), "compute_dtype": spec.compute_dtype, **hooked}
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
        data = {
            **dataset.data(), "tokenization": dataclasses.asdict(packing), "compute_dtype": spec.compute_dtype, **hooked
        }
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


def per_layer(spec: specs.ActivationSpec, md: shards.Metadata) -> list[tuple[specs.ActivationSpec, shards.Metadata]]:
    """Each shard directory of `spec` (a directory per layer: `ActivationSpec.per_layer`) with its metadata, from
    the spec's own (`plan_activation`, every layer): what `plan` plans for each, with no model config read again."""
    return [(unit, dataclasses.replace(md, layers=unit.layers)) for unit in spec.per_layer(md.layers)]


def directories(spec: specs.ActivationSpec | specs.ShardsSpec, md: shards.Metadata,
                raw_spec: dict) -> dict[int, tuple[specs.ActivationSpec | specs.ShardsSpec, shards.Metadata, dict]]:
    """Layer -> (spec, metadata, `activations` entry) of the shard directory that holds it, from the whole spec's
    (`md`, every layer; `raw_spec` its validated entry): `per_layer`'s directories, or for an existing directory
    (`ShardsSpec`) itself for every layer. A spec of one layer keeps its entry as written (its directory is the one
    earlier saeflow planned, and so is the per-job config that extracts it)."""
    if isinstance(spec, specs.ShardsSpec) or len(spec.layers) == 1:
        return dict.fromkeys(md.layers, (spec, md, specs.canonical_spec(raw_spec)))
    return {unit_md.layers[0]: (unit, unit_md, specs.canonical_spec({**raw_spec, "layers": list(unit.layers)}))
            for unit, unit_md in per_layer(spec, md)}  # fmt: skip


def plan_units(spec: specs.ActivationSpec) -> tuple[specs.ActivationSpec, ...]:
    """The spec of each of `spec`'s shard directories (`ActivationSpec.per_layer`), its layers resolved from the
    model's config (no weights): what `saeflow extract` extracts in one pass."""
    return spec.per_layer(models.describe(spec.model).resolve_layers(spec.layers))


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
    expect_hashes = None if expect_hash is None else [expect_hash]
    (result,) = extract_pass([spec], shards_root, device, progress, part, expect_hashes)
    return result


def extract_pass(
    specs_: typing.Sequence[specs.ActivationSpec],
    shards_root,
    device: str | None = None,
    progress: bool = True,
    part: tuple[int, int] | None = None,
    expect_hashes: typing.Sequence[str] | None = None,
) -> list[Result]:
    """Write (or reuse) the directory of every spec from one forward pass: specs that differ only in `hook` and
    `layers` (`ActivationSpec.shares_pass`; the workflow's are one per layer), one directory each. A published
    directory is reused, never rewritten: only the others are computed, and the pass stops after the deepest block.
    `expect_hashes` (the workflow's plan) must be the hashes planned here, in any order. Each Result of the pass
    carries the pass's times."""
    t0 = time.perf_counter()
    plans = [plan(spec, device=device) for spec in specs_]
    _check_pass(plans, part, expect_hashes)
    root = pathlib.Path(shards_root)
    results: dict[str, Result] = {}
    todo = []
    for plan_ in plans:
        md = plan_.metadata
        if md.hash in results or shards.open_existing(root / md.hash) is not None:
            results.setdefault(md.hash, Result(root / md.hash, True, 0, md.n_ex, total_sec=time.perf_counter() - t0))
        else:
            results[md.hash] = None
            todo.append(plan_)
    if todo:
        results.update(_run_pass(todo, root, progress, part, t0))
    return [results[plan_.metadata.hash] for plan_ in plans]


def _check_pass(plans: list[Plan], part: tuple[int, int] | None, expect_hashes: typing.Sequence[str] | None) -> None:
    """One pass extracts specs that differ only in `hook` and `layers`, into directories of one shard size (the same
    part of each, for a split extraction); the workflow's planned hashes must be these."""
    first = plans[0]
    for plan_ in plans[1:]:
        if not first.spec.shares_pass(plan_.spec):
            keys = [f.name for f in dataclasses.fields(first.spec) if f.name not in ("hook", "layers")
                    and getattr(first.spec, f.name) != getattr(plan_.spec, f.name)]  # fmt: skip
            raise SaeflowError(
                "one extraction pass takes activation specs that differ only in `hook` and `layers`, these differ in "
                f"{', '.join(keys)}: extract each on its own (--activation NAME)"
            )
        if plan_.metadata.ex_per_shard != first.metadata.ex_per_shard:
            raise SaeflowError(
                f"one extraction pass writes directories of one shard size: layers {list(first.spec.layers)} and "
                f"{list(plan_.spec.layers)} give {first.metadata.ex_per_shard} and {plan_.metadata.ex_per_shard} "
                "examples per shard (extract them one layer a directory: ActivationSpec.per_layer)"
            )
    check_hashes([p.metadata.hash for p in plans], expect_hashes)


def _run_pass(plans: list[Plan], root: pathlib.Path, progress: bool, part, t0: float) -> dict[str, Result]:
    """Extract the (unpublished) directories of `plans` from one forward pass over their common inputs."""
    from tqdm import tqdm

    first, md = plans[0], plans[0].metadata  # every plan has the same examples and shard sizes (_check_pass)
    if first.info.modality == "vision":
        first.dataset.check(progress)  # unreadable images fail here, before any weights are loaded
    device_name = str(devices.resolve_device(first.device))  # adapters.load and provenance.json take the name
    provenance_extra = {
        "extraction": {"batch_size": first.spec.batch_size, "device": device_name, "n_workers": first.spec.n_workers},
        # Where the weights came from on this machine (not hashed): lets visuals find a local model's tokenizer.
        "model_source": model_source(first.model_spec),
    }
    if part is None:
        writers = [shards.ShardWriter(root, p.metadata, aux=p.aux_fnames, provenance_extra=provenance_extra)
                   for p in plans]  # fmt: skip
    else:
        writers = [parts.PartWriter(root, p.metadata, *part, aux=p.aux_fnames, provenance_extra=provenance_extra)
                   for p in plans]  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(_saying_what_is_kept(writers))
        for writer in writers:
            stack.enter_context(writer)
        results = {p.metadata.hash: Result(w.built_dpath, w.reused, w.resumed_from, md.n_ex)
                   for p, w in zip(plans, writers)}  # fmt: skip
        live = [(p, w, w.n_written) for p, w in zip(plans, writers) if not w.reused]  # (plan, writer, its start)
        if not live:
            for result in results.values():
                result.total_sec = time.perf_counter() - t0
            return results
        for _, w, start in live:
            if start:
                logger.info("resuming %s from example %d (last complete shard)", w.staging, start)
        adapter = adapters.load(first.model_spec, first.spec.compute_dtype, device_name, info=first.info)
        for p, _, _ in live:
            adapter.point_taps(p.spec.hook)  # every block holds its module, of the right kind: else one line, now
        ex_stop = writers[0].ex_stop  # a part stops at its last shard (the same one in every directory of the pass)
        spans = [s for s in batches(md.n_ex, md.ex_per_shard, first.spec.batch_size, min(s for *_, s in live))
                 if s[0] < ex_stop]  # fmt: skip
        points = list(dict.fromkeys((p.spec.hook, layer) for p, _, _ in live for layer in p.metadata.layers))
        source = _image_batches if first.info.modality == "vision" else _text_batches
        forward_sec = write_sec = 0.0
        bar = tqdm(total=ex_stop, initial=spans[0][0] if spans else ex_stop, unit="ex", desc=f"extract {md.hash[:12]}",
                   disable=not progress)  # fmt: skip
        n_tokens = 0
        t_loop = time.perf_counter()
        with bar:
            for (lo, _), (inputs, aux_rows) in zip(spans, source(first, spans)):
                if preempt.received():  # a stop signal: the writers keep every complete shard to resume from
                    raise preempt.stopped(" and ".join(f"{w.staging} keeps its complete shards" for _, w, _ in live))
                t = time.perf_counter()
                acts = adapter.run_points(inputs, points)
                forward_sec += time.perf_counter() - t
                t = time.perf_counter()
                for p, w, start in live:
                    if lo >= start:  # batches never cross a shard; a writer resumes at a shard boundary
                        acts_nltd = np.stack([acts[p.spec.hook, layer].numpy() for layer in p.metadata.layers], axis=1)
                        w.write(acts_nltd, aux={fname: aux_rows for fname in p.aux_fnames})
                write_sec += time.perf_counter() - t
                n = inputs.shape[0]
                n_tokens += n * md.tokens_per_ex
                bar.update(n)
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"{n_tokens / elapsed:,.0f} tok/s")
        t = time.perf_counter()
    write_sec += time.perf_counter() - t  # drain the queues, checksums, fsync, rename
    for result in results.values():
        if not result.reused:
            result.forward_sec, result.write_sec = forward_sec, write_sec
            result.loop_sec = time.perf_counter() - t_loop
        result.total_sec = time.perf_counter() - t0
    return results


@contextlib.contextmanager
def _saying_what_is_kept(writers: list[shards.ShardWriter]) -> typing.Iterator[None]:
    """Around the writers' block: a Ctrl-C, once every writer has kept its complete shards, says how many, where,
    and how to resume (the CLI prints it: `saeflow extract: interrupted: ...`)."""
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt("; ".join(writer.kept() for writer in writers)) from None


def check_hash(md: shards.Metadata, expect_hash: str | None) -> None:
    """The workflow passes the shard hash it planned: a job that plans another one (its software or inputs differ
    from those of the Snakemake that planned) stops before the model runs."""
    check_hashes([md.hash], None if expect_hash is None else [expect_hash])


def check_hashes(planned: typing.Sequence[str], expected: typing.Sequence[str] | None) -> None:
    """`check_hash` for the directories of one pass: the hashes the workflow planned must be these, in any order."""
    if expected is not None and set(planned) != set(expected):
        raise SaeflowError(
            f"the workflow planned shard directory {', '.join(sorted(set(expected)))}, but this job plans "
            f"{', '.join(sorted(set(planned)))} for the same activation: it sees other software or inputs than the "
            "planning did (compare `saeflow plan --json` in both; a dataset file rewritten in place is seen here, not "
            f"by a re-plan that stats directories only: rerun snakemake with {fingerprints.RECHECK_ENV}=files once)"
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
