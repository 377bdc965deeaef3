"""Shuffled loader: batch mixing beside speed (page cache, and cold against a sequential read of the same files).

    python benchmarks/bench_loader.py [--gib 2.0] [--d-model 768] [--buffer-gib 1.0] [--dir /tmp]
    python benchmarks/bench_loader.py --plan-only [--data-gib 20 1024] [--pool-gib 1 8 32] [--job-mem-mb 96000]
    python benchmarks/bench_loader.py --ownership-only [--gib 2.0] [--warm-epochs 5]

--ownership-only: warm epochs of the shuffled and the ordered loader handing out owned batches (their default: each
batch copied out of the reused buffers) against borrowed views (`borrowed=True`, what the trainer, inference and
evaluation read), interleaved on the same files. The main run measures the shuffled loader borrowed, as trained.

--plan-only reads and writes nothing: the mixing of the loader's index-space plan for data of --data-gib per layer
(d=768, CLS + 196 tokens, content tokens, ~16 MiB blocks) and pools of --pool-gib, and of the pool `buffer_bytes:
auto` gives one training job of --job-mem-mb MB (an OSC Cardinal job: 12 cores x 8000 MB per GPU) that trains a
d x 16 SAE on its GPU (saeflow.training.memory.auto_pool_share); the median over every --every-th batch of an epoch.

Writes one synthetic saev shard directory (CLS + 196 patches per example, one layer, float32; every vector carries
its example's index in its first component), then measures, in one run and on the same files:
  mixing              distinct examples per 4096-vector batch: read from the data (an epoch of the loader) and from
                      the loader's index-space plan, against the expectation under uniform sampling without
                      replacement (target >= 0.8), and under the old loader's policy (rows permuted within
                      windows of 4 blocks); then the plan alone for other buffer sizes, on this directory
                      and on a larger one (index space only), and at saev's default reservoir size (64 batches)
  seq cold / warm     16 MiB sequential reads into a reused buffer, dd-style (the limit for streaming the data)
  loader warm         ShuffledLoader epochs from the page cache: vectors/s (target >= 1M at d=768) and GB/s, the
                      median of --warm-epochs epochs (a shared VM's speed drifts between epochs)
  loader cold         the same after evicting the files (posix_fadvise DONTNEED): ratio to seq cold (target >= 0.85)
  memmap gather cold  random 4096-row gathers through np.memmap fancy indexing (the slow path), files evicted
                      before every batch, for a few seconds
"""

import argparse
import math
import os
import pathlib
import tempfile
import time

import numpy as np
import torch

from saeflow.store.shards import Metadata, ShardDir, ShardWriter
from saeflow.training import memory
from saeflow.training.loaders import Block, EpochPlan, OrderedLoader, ShuffledLoader

PATCHES, CHUNK_BYTES = 196, 16 << 20


def make_shards(root: pathlib.Path, gib: float, d_model: int) -> ShardDir:
    T = PATCHES + 1
    n_ex = max(2, int(gib * (1 << 30) / (T * d_model * 4)))
    md = Metadata(
        family="clip", ckpt="bench", layers=(0,), patches_per_ex=PATCHES, cls_token=True, d_model=d_model,
        n_ex=n_ex, patches_per_shard=(n_ex // 4 + 1) * T, data={"__class__": "Bench"}, dataset="/bench",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    block_nltd = rng.standard_normal((64, 1, T, d_model), dtype=np.float32)
    with ShardWriter(root, md) as writer:
        if not writer.reused:
            for start in range(0, n_ex, 64):
                chunk_nltd = block_nltd[: min(64, n_ex - start)].copy()
                chunk_nltd[:, :, :, 0] = np.arange(start, start + chunk_nltd.shape[0])[:, None, None]
                writer.write(chunk_nltd)
    return ShardDir(writer.dpath)


def evict(sd: ShardDir) -> None:
    """Drop the shard files from the page cache (clean pages only; they were fsynced when published)."""
    for i in range(len(sd.shard_sizes)):
        fd = os.open(sd.shard_fpath(i), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def seq_read(sd: ShardDir) -> tuple[float, int]:
    buf = bytearray(CHUNK_BYTES)
    n_bytes, t0 = 0, time.perf_counter()
    for i in range(len(sd.shard_sizes)):
        with open(sd.shard_fpath(i), "rb", buffering=0) as fd:
            while n := fd.readinto(buf):
                n_bytes += n
    return time.perf_counter() - t0, n_bytes


def loader_epoch(loader: ShuffledLoader, epoch: int) -> tuple[float, int]:
    n, t0 = 0, time.perf_counter()
    for x_bd in loader.iter_batches(epoch):
        n += x_bd.shape[0]
    return time.perf_counter() - t0, n


def ownership_cost(sd: ShardDir, batch_size: int, buffer_bytes: int, n_epochs: int) -> None:
    """Warm epochs (files in the page cache) of both loaders, handing out owned batches (the default: each batch
    copied out of the reused buffers) against borrowed views (`borrowed=True`, the trainer's and inference's)."""
    def median_sec(make, epoch_batches) -> tuple[float, int]:
        loader = make()
        n = sum(x_bd.shape[0] for x_bd in epoch_batches(loader, 0))  # allocates the buffers and the pool
        times = []
        for e in range(n_epochs):
            t0 = time.perf_counter()
            for _ in epoch_batches(loader, 1 + e):
                pass
            times.append(time.perf_counter() - t0)
        loader.close()
        return float(np.median(times)), n

    seq_read(sd)  # into the page cache
    for name, make, batches in (
        ("shuffled", lambda borrowed: ShuffledLoader(sd, 0, batch_size, seed=0, buffer_bytes=buffer_bytes,
                                                      borrowed=borrowed), lambda ld, e: ld.iter_batches(e)),
        ("ordered", lambda borrowed: OrderedLoader(sd, 0, batch_size, borrowed=borrowed),
         lambda ld, e: ld.iter_batches()),
    ):  # fmt: skip
        sec = {}
        for borrowed in (True, False, True, False):  # interleaved: the machine's load hits both alike
            t, n = median_sec(lambda b=borrowed, make=make: make(b), batches)
            sec.setdefault(borrowed, []).append(t)
        gb = n * sd.metadata.d_model * 4 / 1e9
        owned, views = min(sec[False]), min(sec[True])
        print(f"{name:9s} warm: owned {gb / owned:5.2f} GB/s, borrowed {gb / views:5.2f} GB/s; "
              f"ratio owned / borrowed time {owned / views:.2f} (best of 2 x median of {n_epochs} epochs)")


def distinct_read(loader: ShuffledLoader, epoch: int) -> np.ndarray:
    """Distinct examples in each full batch of an epoch, from the example index each vector carries."""
    return np.array(
        [torch.unique(x_bd[:, 0]).numel() for x_bd in loader.iter_batches(epoch) if x_bd.shape[0] == loader.batch_size]
    )


def distinct_planned(plan: EpochPlan, n_tok: int) -> np.ndarray:
    return np.array([np.unique(g // n_tok).size for g in plan.batches() if g.size == plan.batch_size])


def uniform_distinct(n_ex: int, n_tok: int, batch_size: int) -> float:
    """Expected distinct examples among `batch_size` of n_ex * n_tok vectors drawn without replacement."""
    n = n_ex * n_tok
    log_none = float(np.sum(np.log1p(-n_tok / (n - np.arange(batch_size)))))
    return n_ex * (1 - math.exp(log_none))


def memmap_gather(sd: ShardDir, seconds: float, batch_size: int) -> float:
    """Rows/s of random fancy-index gathers from memmaps, the files evicted before every batch (so each is cold)."""
    rng = np.random.default_rng(1)
    n, spent = 0, 0.0
    while spent < seconds:
        evict(sd)
        shard_idx = int(rng.integers(len(sd.shard_sizes)))
        md = sd.metadata
        shape = (sd.shard_sizes[shard_idx], md.n_layers, md.tokens_per_ex, md.d_model)
        ex = np.sort(rng.integers(shape[0], size=batch_size))
        tok = rng.integers(1, shape[2], size=batch_size)
        t0 = time.perf_counter()
        acts = np.memmap(
            sd.shard_fpath(shard_idx), dtype=md.dtype, mode="r", shape=shape
        )  # fresh: unmapped pages can be evicted
        np.asarray(acts[ex, 0, tok])
        del acts
        spent += time.perf_counter() - t0
        n += batch_size
    return n / spent


def distinct_old_windows(loader: ShuffledLoader, window_blocks: int = 4) -> np.ndarray:
    """Distinct examples per full batch under the old policy (rows permuted within windows of 4 permuted blocks)."""
    rng = np.random.default_rng(0)
    ex_starts = np.asarray(loader.view.sd.shard_starts)[[b.shard_idx for b in loader.block_list]]
    ex_starts = ex_starts + np.array([b.ex_start for b in loader.block_list])
    order = rng.permutation(len(loader.block_list))
    examples = []
    for i in range(0, order.size, window_blocks):
        window = order[i : i + window_blocks]
        ex = np.concatenate([np.arange(ex_starts[j], ex_starts[j] + loader.block_list[j].n_ex) for j in window])
        examples.append(rng.permutation(np.repeat(ex, loader.view.n_tok)))
    stream, bs = np.concatenate(examples), loader.batch_size
    return np.array([np.unique(stream[i : i + bs]).size for i in range(0, stream.size - bs + 1, bs)])


def mixing_table(loader: ShuffledLoader, big_gib: float, row_bytes: int) -> None:
    """Median distinct examples per batch from the plan alone, for several buffer sizes, here and on a bigger set."""
    bs, n_tok = loader.batch_size, loader.view.n_tok
    ex_per_block = loader.block_list[0].n_ex
    n_big = int(big_gib * (1 << 30) / ((n_tok + 1) * row_bytes))
    big = [Block(0, s, min(ex_per_block, n_big - s)) for s in range(0, n_big, ex_per_block)]
    sets = (
        ("this directory", loader.block_list, loader.view.sd.shard_starts, loader.view.sd.metadata.n_ex),
        (f"{big_gib:g} GiB (plan only)", big, [0], n_big),
    )
    print(f"\nmixing vs RAM (median distinct examples per batch of {bs}, ratio to uniform; plan only)")
    sizes = [(f"{g:g} GiB", int(g * (1 << 30)) // row_bytes) for g in (0.25, 0.5, 1, 2, 4)]
    sizes.append(("saev default (64 batches)", 64 * bs))
    for name, blocks, starts, n_ex in sets:
        uniform = uniform_distinct(n_ex, n_tok, bs)
        cells = []
        for label, n_pool in sizes:
            plan = EpochPlan(blocks, starts, n_tok, n_pool, bs, seed=0, epoch=0)
            med = float(np.median(distinct_planned(plan, n_tok)))
            cells.append(f"{label}: {med:5.0f} ({med / uniform:.2f})")
        print(f"  {name:22s} uniform {uniform:5.0f} | " + " | ".join(cells))


def plan_only(data_gibs: list[float], pool_gibs: list[float], job_mem_mb: int, d_model: int, batch_size: int,
              every: int) -> None:
    """Median distinct examples per batch against uniform, for each data size and pool, from the plan alone."""
    row_bytes, n_tok = d_model * 4, PATCHES
    ex_per_block = max(1, CHUNK_BYTES // ((n_tok + 1) * row_bytes))
    d_sae = 16 * d_model
    auto = memory.auto_pool_share(job_mem_mb << 20, 1, 8 * (2 * d_model * d_sae + d_sae + d_model))
    pools = [(f"{g:g} GiB", int(g * (1 << 30))) for g in pool_gibs]
    pools.append((f"auto, a {job_mem_mb} MB job: {auto / (1 << 30):g} GiB", auto))
    print(f"mixing vs pool (d={d_model}, batches of {batch_size}; median distinct examples per batch over every "
          f"{every}th batch, / uniform; plan only)")
    for gib in data_gibs:
        n_ex = int(gib * (1 << 30) / ((n_tok + 1) * row_bytes))
        blocks = [Block(0, s, min(ex_per_block, n_ex - s)) for s in range(0, n_ex, ex_per_block)]
        uniform = uniform_distinct(n_ex, n_tok, batch_size)
        cells = []
        for label, pool_bytes in pools:
            t0 = time.perf_counter()
            plan = EpochPlan(blocks, [0], n_tok, pool_bytes // row_bytes, batch_size, seed=0, epoch=0)
            distinct = [np.unique(g // n_tok).size for i, g in enumerate(plan.batches())
                        if i % every == 0 and g.size == batch_size]  # fmt: skip
            med = float(np.median(distinct))
            cells.append(f"{label}: {med / uniform:.3f} ({time.perf_counter() - t0:.0f} s)")
        print(f"  {gib:g} GiB per layer, uniform {uniform:.0f} | " + " | ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan-only", action="store_true", help="only the mixing of the plan (nothing is read)")
    parser.add_argument("--data-gib", type=float, nargs="+", default=[20, 1024], help="--plan-only: data per layer")
    parser.add_argument("--pool-gib", type=float, nargs="+", default=[1, 8, 32], help="--plan-only: pools")
    parser.add_argument("--job-mem-mb", type=int, default=96000, help="--plan-only: the job whose auto pool is shown")
    parser.add_argument("--every", type=int, default=16, help="--plan-only: count every N-th batch (default 16)")
    parser.add_argument("--gib", type=float, default=2.0, help="size of the synthetic shard directory (2.0)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--buffer-gib", type=float, default=1.0, help="the loader's shuffle pool (1.0, its default)")
    parser.add_argument("--big-gib", type=float, default=20.0, help="size of the plan-only mixing case (20)")
    parser.add_argument("--gather-seconds", type=float, default=3.0, help="time spent on the memmap gather (3)")
    parser.add_argument("--warm-epochs", type=int, default=5, help="page-cache epochs timed; the median counts (5)")
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="where to write the shards (a temp dir)")
    parser.add_argument("--ownership-only", action="store_true",
                        help="only what owned batches (the loaders' default) cost against borrowed views")
    args = parser.parse_args()
    if args.plan_only:
        return plan_only(args.data_gib, args.pool_gib, args.job_mem_mb, args.d_model, args.batch_size, args.every)
    if args.ownership_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            sd = make_shards(pathlib.Path(tmp), args.gib, args.d_model)
            ownership_cost(sd, args.batch_size, int(args.buffer_gib * (1 << 30)), args.warm_epochs)
            os.system(f"chmod -R u+w {tmp}")
        return None

    row_bytes = args.d_model * 4
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sd = make_shards(pathlib.Path(tmp), args.gib, args.d_model)
        n_ex = sd.metadata.n_ex
        print(f"shards: {sd.dpath} ({sd.metadata.n_bytes / 1e9:.2f} GB, {len(sd.shard_sizes)} files, {n_ex} examples")
        print(f"        of CLS + {PATCHES} tokens, d={args.d_model}); batches of {args.batch_size} content vectors")

        evict(sd)
        t_seq_cold, n_bytes = seq_read(sd)
        t_seq_warm, _ = seq_read(sd)
        buffer_bytes = int(args.buffer_gib * (1 << 30))
        loader = ShuffledLoader(sd, 0, batch_size=args.batch_size, seed=0, buffer_bytes=buffer_bytes,
                                borrowed=True)  # what the trainer reads
        loader_epoch(loader, 0)  # allocates the loader's pool (as any training run's first batches do)
        warm = [loader_epoch(loader, 1 + e) for e in range(args.warm_epochs)]  # files in the page cache: just read
        n_vec = warm[0][1]
        t_warm = float(np.median([t for t, _ in warm]))
        evict(sd)
        t_cold, _ = loader_epoch(loader, args.warm_epochs + 1)
        read = distinct_read(loader, args.warm_epochs + 2)
        planned = distinct_planned(loader.plan(args.warm_epochs + 2), PATCHES)
        old = distinct_old_windows(loader)
        pool_gb = loader.plan(0).n_pool * row_bytes / 1e9
        mixing_table(loader, args.big_gib, row_bytes)
        loader.close()
        gather_rows_s = memmap_gather(sd, args.gather_seconds, args.batch_size)
        os.system(f"chmod -R u+w {tmp}")

    uniform = uniform_distinct(n_ex, PATCHES, args.batch_size)
    seq_cold, seq_warm = n_bytes / t_seq_cold / 1e9, n_bytes / t_seq_warm / 1e9
    # The loader reads every example's content rows (CLS skipped): bytes it delivered per second.
    gb = n_vec * row_bytes / 1e9
    print(f"\nloader pool            {pool_gb:6.2f} GB (--buffer-gib {args.buffer_gib:g}; RAM beside 4 batches and 2")
    print("                       staging buffers of a batch)")
    print(f"distinct ex / batch    read: median {np.median(read):.0f}, 10th pct {np.percentile(read, 10):.0f}, min")
    print(f"                       {read.min()}; plan: median {np.median(planned):.0f}; uniform: {uniform:.0f};")
    print(f"                       the old window loader's policy: median {np.median(old):.0f}")
    print(f"seq read cold          {seq_cold:6.2f} GB/s")
    print(f"seq read warm          {seq_warm:6.2f} GB/s")
    print(f"loader warm            {n_vec / t_warm / 1e6:6.2f} M vectors/s  {gb / t_warm:6.2f} GB/s  (median of")
    print(f"                       {len(warm)} epochs: " + " ".join(f"{n_vec / t / 1e6:.2f}" for t, _ in warm) + ")")
    print(f"loader cold            {n_vec / t_cold / 1e6:6.2f} M vectors/s  {gb / t_cold:6.2f} GB/s")
    print(f"memmap gather cold     {gather_rows_s / 1e6:6.4f} M vectors/s")
    print(f"ratio mixing: median distinct / uniform : {np.median(read) / uniform:.2f} (target >= 0.8)")
    print(f"ratio loader warm / 1M vectors/s target : {n_vec / t_warm / 1e6:.2f} (target >= 1)")
    print(f"ratio loader warm / seq read warm       : {(gb / t_warm) / seq_warm:.2f} (the same machine's memory limit)")
    print(f"ratio loader cold / seq read cold       : {(gb / t_cold) / seq_cold:.2f} (target >= 0.85)")
    print(f"ratio loader cold / memmap gather cold  : {n_vec / t_cold / gather_rows_s:.1f}x")


if __name__ == "__main__":
    main()
