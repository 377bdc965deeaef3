"""Random (sample, layer) reads from a saeflow Zarr activation store: our direct chunk reader beside zarr-python.

Writes a synthetic store (float16, chunks (1, 1, T, H)), then measures with 0 and 2 worker processes:
  - k random single reads (sample i, random layer) of the response slice (one chunk) and the prompt slice;
  - the training batch pattern: b random samples x 2 random layers, assembled into one (b, 2, R_max, H) array.
The limit is measured in the same run: a bare open() + readinto() of the same chunk files (what any reader
must at least do). Printed ratios: ours / limit (1.0 is the floor) and zarr-python / ours (speed-up).
Files are in the page cache (just written): this measures software overhead, not the disk.

    python benchmarks/bench_zarr.py                  # defaults: a few minutes at most on 2 cores
    python benchmarks/bench_zarr.py --n 64 --k 500   # smaller
"""

import argparse
import collections.abc
import multiprocessing
import os
import pathlib
import tempfile
import time

import numpy as np

from saeflow.interop import zarr_store
from saeflow.interop.records import Record
from saeflow.interop.zarr_store import compat as zarr_compat


class SyntheticRecords(collections.abc.Sequence):
    """Records generated on demand (seeded per sample), so the store can exceed what we want to hold in RAM."""

    def __init__(self, n, layers, p_max, r_max, d):
        self.n, self.layers, self.p_max, self.r_max, self.d = n, layers, p_max, r_max, d

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = np.random.default_rng(i)
        p, r = int(rng.integers(self.p_max // 2, self.p_max + 1)), int(rng.integers(1, self.r_max + 1))
        acts = {layer: rng.standard_normal((p, self.d), dtype=np.float32) for layer in self.layers}
        resp = {layer: rng.standard_normal((r, self.d), dtype=np.float32) for layer in self.layers}
        return Record(text=f"sample {i}", acts=acts, response_acts=resp, response_ids=np.zeros(r, np.int64))


def stats_us(seconds):
    us = np.asarray(seconds) * 1e6
    return {"mean": us.mean(), "median": np.median(us), "p95": np.percentile(us, 95)}


def bare_read(dpath: str, kind: str, i: int, li: int, n_chunks: int, buf: np.ndarray):
    """The floor: open, read into a preallocated buffer, close, for exactly the chunk files a read needs."""
    for c in range(n_chunks):
        fd = os.open(f"{dpath}/arrays/{kind}_activations/{i}.{li}.{c}.0", os.O_RDONLY)
        os.readv(fd, [buf[c]])
        os.close(fd)


def run_reads(args):
    """In one process: per-read latencies of the three readers over the same queries."""
    dpath, kind, queries = args
    reader = zarr_store.ZarrReader(dpath)
    z = zarr_compat.open_consolidated(dpath)["arrays"][f"{kind}_activations"]
    lens = reader.lengths(kind)
    t_chunk = z.chunks[2]
    buf = np.empty((z.shape[2] // t_chunk, t_chunk, z.shape[3]), np.float16)
    out = {"limit": [], "ours": [], "zarr": []}
    read = reader.response if kind == zarr_store.RESPONSE else reader.prompt
    for i, layer in queries:
        li = reader.layer_pos(layer)
        n_tok = int(lens[i])
        bare_read(dpath, kind, i, li, -(-n_tok // t_chunk), buf)  # untimed: every reader then sees a warm cache
        t0 = time.perf_counter()
        bare_read(dpath, kind, i, li, -(-n_tok // t_chunk), buf)
        t1 = time.perf_counter()
        read(i, layer)
        out["limit"].append(t1 - t0)
        out["ours"].append(time.perf_counter() - t1)
    # zarr-python in a pass of its own: 3.x's event-loop thread, busy just after a read, would slow the next reads
    for i, layer in queries:
        t0 = time.perf_counter()
        b = z[i, reader.layer_pos(layer), : int(lens[i])]
        out["zarr"].append(time.perf_counter() - t0)
        if not np.array_equal(read(i, layer), b):
            raise SystemExit(f"mismatch at sample {i} layer {layer}")
    return out


def run_batches(args):
    dpath, batches = args
    reader = zarr_store.ZarrReader(dpath)
    z = zarr_compat.open_consolidated(dpath)["arrays"]["response_activations"]
    out = {"ours": [], "zarr": []}
    for idx, layer_pairs in batches:
        t0 = time.perf_counter()
        reader.batch(idx, layer_pairs)
        out["ours"].append(time.perf_counter() - t0)
    for idx, layer_pairs in batches:  # a pass of its own, as in run_reads
        t0 = time.perf_counter()
        theirs = np.stack(
            [np.stack([z[i, reader.layer_pos(layer)] for layer in pair]) for i, pair in zip(idx, layer_pairs)]
        )
        out["zarr"].append(time.perf_counter() - t0)
        if not np.array_equal(reader.batch(idx, layer_pairs)[0], theirs):
            raise SystemExit("batch mismatch")
    return out


def in_workers(fn, dpath, items, workers):
    """Run fn over items split across `workers` processes (0 = this process); merge the latency lists."""
    if workers == 0:
        return fn((*dpath, items)) if isinstance(dpath, tuple) else fn((dpath, items))
    parts = [items[w::workers] for w in range(workers)]
    args = [((*dpath, p) if isinstance(dpath, tuple) else (dpath, p)) for p in parts]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(fn, args)
    return {key: sum((r[key] for r in results), []) for key in results[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=128, help="samples in the store")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=768, help="hidden size H")
    ap.add_argument("--p-max", type=int, default=128)
    ap.add_argument("--r-max", type=int, default=64)
    ap.add_argument("--t-chunk-prompt", type=int, default=64)
    ap.add_argument("--k", type=int, default=2000, help="random single reads per setting")
    ap.add_argument("--b", type=int, default=32, help="samples per batch (x 2 random layers)")
    ap.add_argument("--n-batches", type=int, default=20)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    layers = tuple(range(args.layers))
    opts = zarr_store.ZarrOptions(prompt_max=args.p_max, response_max=args.r_max, t_chunk_prompt=args.t_chunk_prompt,
                                  samples_per_shard=args.n)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-zarr-") as tmp:
        dpath = pathlib.Path(tmp) / "store.zarr"
        t0 = time.perf_counter()
        records = SyntheticRecords(args.n, layers, args.p_max, args.r_max, args.d)
        zarr_store.write_store(records, args.n, dpath, {"model_id": "synthetic"}, opts)
        n_bytes = sum(f.stat().st_size for f in dpath.rglob("*") if f.is_file())
        import zarr

        print(f"zarr-python {zarr.__version__}; store: N={args.n} L={args.layers} P_max={args.p_max} "
              f"R_max={args.r_max} H={args.d} float16, "
              f"{n_bytes / 2**20:.0f} MiB written in {time.perf_counter() - t0:.1f} s")
        print("latency per read in microseconds (mean / median / p95); "
              "ratios on the median (robust to a noisy machine)")
        for kind in (zarr_store.RESPONSE, zarr_store.PROMPT):
            for workers in args.workers:
                queries = [(int(rng.integers(args.n)), int(rng.choice(layers))) for _ in range(args.k)]
                res = in_workers(run_reads, (dpath, kind), queries, workers)
                s = {name: stats_us(v) for name, v in res.items()}
                row = "  ".join(
                    f"{name} {v['mean']:7.1f} / {v['median']:7.1f} / {v['p95']:7.1f}" for name, v in s.items()
                )
                print(f"{kind:8s} k={args.k} workers={workers}: {row}"
                      f"   ours/limit {s['ours']['median'] / s['limit']['median']:.2f}"
                      f"   zarr/ours {s['zarr']['median'] / s['ours']['median']:.1f}x")
        for workers in args.workers:
            batches = []
            for _ in range(args.n_batches):
                idx = rng.choice(args.n, size=min(args.b, args.n), replace=False).tolist()
                batches.append((idx, [rng.choice(layers, size=2, replace=False).tolist() for _ in idx]))
            res = in_workers(run_batches, dpath, batches, workers)
            s = {name: stats_us(v) for name, v in res.items()}
            print(f"batch b={args.b} x 2 layers, workers={workers}: ours {s['ours']['median'] / 1e3:.2f} ms "
                  f"(p95 {s['ours']['p95'] / 1e3:.2f}), zarr-python {s['zarr']['median'] / 1e3:.2f} ms "
                  f"(p95 {s['zarr']['p95'] / 1e3:.2f})   zarr/ours {s['zarr']['median'] / s['ours']['median']:.1f}x")


if __name__ == "__main__":
    main()
