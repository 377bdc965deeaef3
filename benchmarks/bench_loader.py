"""Shuffled-loader throughput against a sequential read of the same files and a naive memmap row gather.

    python benchmarks/bench_loader.py [--gib 1.0] [--d-model 768] [--dir /tmp]

Writes one synthetic saev shard directory (CLS + 196 patches per example, one layer, float32), then measures,
in one run and on the same files:
  seq cold / warm     16 MiB sequential reads into a reused buffer (the limit for streaming the data)
  loader warm         ShuffledLoader epoch from the page cache: vectors/s (target >= 1M at d=768) and GB/s
  loader cold         the same after evicting the files (posix_fadvise DONTNEED): ratio to seq cold (target >= 0.85)
  memmap gather cold  random 4096-row gathers through np.memmap fancy indexing (the slow path), files evicted
                      before every batch, for a few seconds
"""

import argparse
import os
import pathlib
import tempfile
import time

import numpy as np

from saeflow.loaders import ShuffledLoader
from saeflow.shards import Metadata, ShardDir, ShardWriter

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
                writer.write(block_nltd[: min(64, n_ex - start)].copy())
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the synthetic shard directory (1.0)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--gather-seconds", type=float, default=5.0, help="time spent on the memmap gather (5)")
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="where to write the shards (a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sd = make_shards(pathlib.Path(tmp), args.gib, args.d_model)
        row_bytes = args.d_model * 4
        print(f"shards: {sd.dpath} ({sd.metadata.n_bytes / 1e9:.2f} GB, {len(sd.shard_sizes)} files, d={args.d_model})")

        evict(sd)
        t_seq_cold, n_bytes = seq_read(sd)
        t_seq_warm, _ = seq_read(sd)
        loader = ShuffledLoader(sd, 0, batch_size=args.batch_size, seed=0)
        loader_epoch(loader, 0)  # allocates the loader's buffers (as any training run's first window does)
        t_warm, n_vec = loader_epoch(loader, 1)  # the files are in the page cache: they were just read
        evict(sd)
        t_cold, _ = loader_epoch(loader, 2)
        loader.close()
        gather_rows_s = memmap_gather(sd, args.gather_seconds, args.batch_size)
        os.system(f"chmod -R u+w {tmp}")

    seq_cold, seq_warm = n_bytes / t_seq_cold / 1e9, n_bytes / t_seq_warm / 1e9
    # The loader reads every example's content rows (CLS skipped): bytes it read per second.
    gb = n_vec * row_bytes / 1e9
    print(f"seq read cold          {seq_cold:6.2f} GB/s")
    print(f"seq read warm          {seq_warm:6.2f} GB/s")
    print(f"loader warm            {n_vec / t_warm / 1e6:6.2f} M vectors/s  {gb / t_warm:6.2f} GB/s")
    print(f"loader cold            {n_vec / t_cold / 1e6:6.2f} M vectors/s  {gb / t_cold:6.2f} GB/s")
    print(f"memmap gather cold     {gather_rows_s / 1e6:6.4f} M vectors/s")
    print(f"ratio loader warm / 1M vectors/s target : {n_vec / t_warm / 1e6:.2f} (target >= 1)")
    print(f"ratio loader cold / seq read cold       : {(gb / t_cold) / seq_cold:.2f} (target >= 0.85)")
    print(f"ratio loader cold / memmap gather cold  : {n_vec / t_cold / gather_rows_s:.1f}x")


if __name__ == "__main__":
    main()
