"""ShardWriter throughput against a plain sequential write + fsync of the same bytes, measured in the same run.

The writer streams ViT-B/16-shaped examples (2 layers x 197 tokens x 768 float32) through `ShardWriter` (hashing,
per-shard fsync, progress records, validation, atomic publish); the limit writes the same buffer the same number
of times to one file and fsyncs it once. Runs alternate (limit, writer, limit, writer, ...) and the best of each
is reported, so a noisy neighbour hurts both sides alike. Prints `ratio = writer GB/s / plain GB/s`; target >= 0.8.

    python benchmarks/bench_writer.py              # ~2 GiB per run, 5 repeats, in a temp dir under /tmp
    python benchmarks/bench_writer.py --gib 0.25 --repeats 1 --dir /fs/scratch/me
"""

import argparse
import hashlib
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

from saeflow.store import atomic, shards

TARGET_RATIO = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="bytes written per run, in GiB (default 2)")
    p.add_argument("--shard-mib", type=float, default=512, help="approximate shard size in MiB (default 512)")
    p.add_argument("--batch-ex", type=int, default=64, help="examples per write() call (default 64, ~77 MB)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each side; the best is reported (default 5)")
    p.add_argument("--dir", type=pathlib.Path, default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=197, help="tokens per example incl. CLS (default 197)")
    p.add_argument("--d-model", type=int, default=768)
    return p.parse_args(argv)


def make_metadata(args: argparse.Namespace) -> shards.Metadata:
    bytes_per_ex = args.layers * args.tokens * args.d_model * 4
    n_ex = max(1, int(args.gib * 2**30) // bytes_per_ex)
    ex_per_shard = max(1, int(args.shard_mib * 2**20) // bytes_per_ex)
    return shards.Metadata(
        family="clip",
        ckpt="bench",
        layers=tuple(range(args.layers)),
        patches_per_ex=args.tokens - 1,
        cls_token=True,
        d_model=args.d_model,
        n_ex=n_ex,
        patches_per_shard=ex_per_shard * args.tokens * args.layers,
        data={"__class__": "Bench", "seed": time.time_ns()},  # a fresh hash every run: never a reuse
        dataset="/bench",
    )


def batches(md: shards.Metadata, pool_lbd: np.ndarray):
    """The same read-only pool of examples, repeated until n_ex are produced."""
    for start in range(0, md.n_ex, len(pool_lbd)):
        yield pool_lbd[: min(len(pool_lbd), md.n_ex - start)]


def plain_write(fpath: pathlib.Path, md: shards.Metadata, pool_lbd: np.ndarray) -> float:
    start = time.perf_counter()
    with open(fpath, "wb") as fd:
        for batch in batches(md, pool_lbd):
            fd.write(memoryview(batch.reshape(-1).view(np.uint8)))
        fd.flush()
        os.fsync(fd.fileno())
    atomic.fsync_path(fpath.parent)
    return time.perf_counter() - start


def sha256_only(md: shards.Metadata, pool_lbd: np.ndarray) -> float:
    """sha256 of the same bytes on one core, no disk: the writer's ceiling when the disk is faster than this."""
    start = time.perf_counter()
    digest = hashlib.sha256()
    for batch in batches(md, pool_lbd):
        digest.update(memoryview(batch.reshape(-1).view(np.uint8)))
    return time.perf_counter() - start


def writer_write(root: pathlib.Path, md: shards.Metadata, pool_lbd: np.ndarray) -> float:
    start = time.perf_counter()
    with shards.ShardWriter(root, md) as writer:
        for batch in batches(md, pool_lbd):
            writer.write(batch)
    elapsed = time.perf_counter() - start
    assert shards.validate(writer.dpath).ok
    return elapsed


def main(argv=None) -> int:
    args = parse_args(argv)
    pool_lbd = np.random.default_rng(0).standard_normal(
        (args.batch_ex, args.layers, args.tokens, args.d_model), dtype=np.float32
    )
    pool_lbd.setflags(write=False)
    work_dpath = pathlib.Path(tempfile.mkdtemp(prefix="saeflow-bench-writer-", dir=args.dir))
    best = {"plain": float("inf"), "writer": float("inf"), "sha256": float("inf")}
    try:
        for rep in range(args.repeats):
            md = make_metadata(args)
            seconds = plain_write(work_dpath / "plain.bin", md, pool_lbd)
            best["plain"] = min(best["plain"], seconds)
            (work_dpath / "plain.bin").unlink()
            gb = md.n_bytes / 1e9
            print(f"[{rep}] plain  {gb:.2f} GB in {seconds:.2f} s = {gb / seconds:.2f} GB/s", file=sys.stderr)
            best["sha256"] = min(best["sha256"], sha256_only(md, pool_lbd))
            seconds = writer_write(work_dpath / "shards", md, pool_lbd)
            best["writer"] = min(best["writer"], seconds)
            atomic.remove_staging(work_dpath / "shards")
            n_shards = len(md.shard_sizes)
            print(
                f"[{rep}] writer {gb:.2f} GB in {seconds:.2f} s = {gb / seconds:.2f} GB/s ({n_shards} shards)",
                file=sys.stderr,
            )
    finally:
        atomic.remove_staging(work_dpath)
    gb = md.n_bytes / 1e9
    plain_gbs, writer_gbs = gb / best["plain"], gb / best["writer"]
    ratio = writer_gbs / plain_gbs
    print(
        f"{md.n_bytes / 2**30:.2f} GiB per run, best of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"plain sequential write+fsync: {plain_gbs:.2f} GB/s")
    print(f"sha256 alone, one core (context: the writer's ceiling on a fast disk): {gb / best['sha256']:.2f} GB/s")
    print(f"ShardWriter (sha256, per-shard fsync, publish): {writer_gbs:.2f} GB/s")
    print(f"ratio = {ratio:.2f} (target >= {TARGET_RATIO}) {'PASS' if ratio >= TARGET_RATIO else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
