"""`saeflow migrate`'s cut of a layout-1 directory into per-layer directories against publishing the same bytes.

A layout-1 directory of ViT-B/16-shaped examples (2 layers x 197 tokens x 768 float32, written by `ShardWriter`, as
bench_writer.py makes it) is cut into its two layers' directories by `migration.cut_layer` (read every layer's block,
re-cut into the per-layer shard size, sha256, per-shard fsync, publish). The limit publishes the same per-layer
directories from examples already in memory through `ShardWriter` (what any publish of those bytes costs, its sha256
included); a plain copy of the shard files (`shutil.copyfile` + fsync, no hash) is shown for context. Runs
alternate (limit, cut, ...) and the best of each is reported. Prints `ratio = cut GB/s / publish GB/s`; target >= 0.8.

    python benchmarks/bench_migrate.py              # ~1 GiB layout-1 directory, 3 repeats, under /tmp
    python benchmarks/bench_migrate.py --gib 0.25 --repeats 1 --dir /fs/scratch/me
"""

import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from bench_writer import make_metadata, parse_args, writer_write
from saeflow import migration
from saeflow.store import atomic, shards

TARGET_RATIO = 0.8


def copy_shards(old: shards.ShardDir, dst_dpath: pathlib.Path) -> float:
    """Copy the directory's shard files and fsync them: the same bytes the cut reads and writes."""
    dst_dpath.mkdir()
    start = time.perf_counter()
    for shard_idx in range(len(old.shard_sizes)):
        dst = dst_dpath / old.shard_fpath(shard_idx).name
        shutil.copyfile(old.shard_fpath(shard_idx), dst)
        with open(dst, "rb") as fd:
            os.fsync(fd.fileno())
    atomic.fsync_path(dst_dpath)
    return time.perf_counter() - start


def publish(md: shards.Metadata, pool_lbd: np.ndarray, root: pathlib.Path) -> float:
    """Each layer's directory published from the in-memory pool: the cut's bytes, with no read of a directory."""
    seconds = 0.0
    for layer_idx, layer in enumerate(md.layers):
        layer_md = dataclasses.replace(md, layers=(layer,), data={**md.data, "publish": time.time_ns()})
        seconds += writer_write(root, layer_md, np.ascontiguousarray(pool_lbd[:, layer_idx : layer_idx + 1]))
    return seconds


def cut(old: shards.ShardDir, root: pathlib.Path) -> float:
    start = time.perf_counter()
    for layer in old.metadata.layers:
        migration.cut_layer(old, layer, dataclasses.replace(old.metadata, layers=(layer,)), root)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(["--gib", "1", "--repeats", "3", *(sys.argv[1:] if argv is None else argv)])
    pool_lbd = np.random.default_rng(0).standard_normal((args.batch_ex, args.layers, args.tokens, args.d_model),
                                                        dtype=np.float32)  # fmt: skip
    work_dpath = pathlib.Path(tempfile.mkdtemp(prefix="saeflow-bench-migrate-", dir=args.dir))
    best = {"copy": float("inf"), "publish": float("inf"), "cut": float("inf")}
    try:
        md = make_metadata(args)
        writer_write(work_dpath / "layout1", md, pool_lbd)
        old = shards.ShardDir(work_dpath / "layout1" / md.hash)
        gb = md.n_bytes / 1e9
        for rep in range(args.repeats):
            best["copy"] = min(best["copy"], seconds := copy_shards(old, work_dpath / "copy"))
            print(f"[{rep}] copy {gb:.2f} GB in {seconds:.2f} s = {gb / seconds:.2f} GB/s", file=sys.stderr)
            atomic.remove_staging(work_dpath / "copy")
            best["publish"] = min(best["publish"], seconds := publish(md, pool_lbd, work_dpath / "published"))
            print(f"[{rep}] publish {gb:.2f} GB in {seconds:.2f} s = {gb / seconds:.2f} GB/s", file=sys.stderr)
            atomic.remove_staging(work_dpath / "published")
            best["cut"] = min(best["cut"], seconds := cut(old, work_dpath / "layout2"))
            print(f"[{rep}] cut  {gb:.2f} GB in {seconds:.2f} s = {gb / seconds:.2f} GB/s", file=sys.stderr)
            atomic.remove_staging(work_dpath / "layout2")
    finally:
        atomic.remove_staging(work_dpath)
    copy_gbs, publish_gbs, cut_gbs = gb / best["copy"], gb / best["publish"], gb / best["cut"]
    ratio = cut_gbs / publish_gbs
    print(f"{md.n_bytes / 2**30:.2f} GiB layout-1 directory ({args.layers} layers), best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"plain copy of its shard files + fsync (context: no sha256): {copy_gbs:.2f} GB/s")
    print(f"ShardWriter publishing the per-layer directories from memory: {publish_gbs:.2f} GB/s")
    print(f"migration.cut_layer, every layer (sha256, per-shard fsync, publish): {cut_gbs:.2f} GB/s")
    print(f"ratio = {ratio:.2f} (target >= {TARGET_RATIO}) {'PASS' if ratio >= TARGET_RATIO else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
