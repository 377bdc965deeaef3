"""Training on 2 gloo ranks against 1, per parallel mode: throughput, bytes per step, memory per rank.

    python benchmarks/bench_distributed.py [--d-model 128] [--expansion 32] [--k 32] [--batch-size 512]
                                           [--steps 20] [--realistic] [--mem-expansion 256] [--mem-batch 256]
                                           [--no-memory]

Writes a synthetic shard directory (random float32 vectors), then runs saeflow's own trainers on batches of the
distributed loader, in forked ranks (one torch thread each, gloo, tests/_ranks.py), at world sizes 1 and 2:
  throughput  vectors/s over --steps TopK steps (after 2 warm-up steps), loader included: 2 ranks / 1 rank, per mode
              (sweep trains 2 runs, on one rank or one each; data and latents train 1 run)
  bytes/step  what a rank sends per step at the collectives, the two ranks' mean (distributed.Comm.sent_bytes: an
              all-reduce of S bytes sends 2 (N-1)/N S on a ring, an all-gather of s bytes per rank (N-1) s, the
              batch's all-to-all the rows it sends), per kind, against the cost model of docs/distributed.md (AuxK
              idle: no latent dies in a benchmark this short); --realistic adds d=256, 16x, batch 4096
  memory      latent sharding of a wider SAE (--mem-expansion, 3 steps): what a rank holds in parameters and Adam
              moments, and the peak RSS it adds while training (VmHWM, reset first), sharded on 2 ranks against
              one unsharded process
--paper prints the step-time model on paper of docs/distributed.md (4 NVLink H100s, 2 InfiniBand nodes).
"""

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from _ranks import run_ranks  # noqa: E402
from saeflow import config  # noqa: E402
from saeflow.store import runs
from saeflow.store.shards import Metadata, ShardDir, ShardWriter  # noqa: E402
from saeflow.training import specs, sweeps, train  # noqa: E402
from saeflow.training.ranks import parallel  # noqa: E402
from saeflow.training.ranks.distloader import DistributedShuffledLoader  # noqa: E402

REALISTIC = (256, 16, 4096, 8)  # --realistic: d_model, expansion, batch, steps (issue 32's size)


def make_shards(root: pathlib.Path, n_vectors: int, d_model: int) -> ShardDir:
    T = 64
    n_ex = n_vectors // T
    md = Metadata(family="clip", ckpt="bench", layers=(0,), patches_per_ex=T, cls_token=False, d_model=d_model,
                  n_ex=n_ex, patches_per_shard=(n_ex // 4 + 1) * T, data={"__class__": "BenchDist"}, dataset="/b")
    rng = np.random.default_rng(0)
    with ShardWriter(root, md) as writer:
        for start in range(0, n_ex, 64):
            writer.write(rng.standard_normal((min(64, n_ex - start), 1, T, d_model), dtype=np.float32))
    return ShardDir(writer.dpath)


def make_runs(root: pathlib.Path, sd: ShardDir, n_runs: int, **spec) -> list[str]:
    cfg = config.validate({"activations": {}, "saes": {"s": {"train": "x", "layer": 0, "tokens": "all",
                                                               "seed": list(range(n_runs)), **spec}}})  # fmt: skip
    plans = sweeps.plan_runs({"s": sweeps.SAESpec.from_dict("s", cfg["saes"]["s"])}, {"x": sd.hash}, {"x": "all"})
    return [str(runs.create_run(root, p.train_config.to_dict(), sd.dpath, sd.dpath).root) for p in plans]


def _status(key: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    return 0


def rank_bench(run_roots: list[str], mode: str, steps: int) -> dict:
    """On one rank: `steps` training steps of this rank's trainers after 2 warm-up steps; what they cost."""
    comm = parallel.join("cpu")
    group = [(runs.open_run(r), specs.TrainConfig.from_dict(runs.open_run(r).config(), r)) for r in run_roots]
    sd, cfg0 = ShardDir(group[0][0].link(runs.Run.TRAIN_SHARDS).resolve()), group[0][1]
    pool_bytes = max(8 << 20, 8 * cfg0.batch_size * sd.metadata.d_model * 4)  # at least 8 batches
    loader = DistributedShuffledLoader(comm, sd, 0, cfg0.batch_size, 0, tokens="all", buffer_bytes=pool_bytes)
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    rss0 = _status("VmRSS")
    pairs = parallel._make_trainers(mode, comm, group, [None] * len(group), sd.metadata.d_model, len(loader))
    init_nd = train._first_vectors(loader, train.N_INIT_VECTORS)
    for t, _ in pairs:
        t.init_from_data(init_nd)
    slices = mode == "data"  # as parallel._run_steps: a data-parallel rank receives only its rows of each batch
    batches = loader.iter_slices(0) if slices else ((x_bd, x_bd.shape[0]) for x_bd in loader.iter_batches(0))
    t0 = 0.0
    for i in range(steps + 2):
        if i == 2:  # warm-up done
            comm.sent_bytes.clear()
            comm.calls.clear()
            t0 = time.perf_counter()
        x_nd, batch_size = next(batches)
        x_nd = x_nd.to(torch.float32)
        for t, _ in pairs:
            t.train_slice(x_nd, batch_size) if slices else t.train_step(x_nd)
        parallel._stop_requested(comm)
    dt = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for t, _ in pairs for p in t.sae.parameters())
    held += sum(m.numel() * m.element_size() for t, _ in pairs for s in t.opt.state.values() for m in s.values())
    loader.close()
    comm.close()
    return {"vec_s": steps * cfg0.batch_size / dt, "sent": {k: v / steps for k, v in comm.sent_bytes.items()},
            "calls": {k: v / steps for k, v in comm.calls.items()}, "held": held,
            "peak": _status("VmHWM") - rss0}  # fmt: skip


def cost_model(mode: str, n: int, batch: int, d: int, d_sae: int, k: int) -> dict:
    """Bytes a rank sends per step on average (docs/distributed.md, AuxK idle, TopK, no Matryoshka): the batch
    exchange (all-to-all: a rank sends each row it holds to the N-1 others, or in `data` only to the rank training
    it), the collectives of the mode."""
    rows = (n - 1) / n * batch if mode != "data" else (n - 1) / n * batch / n
    ring = 2 * (n - 1) / n
    model = {"all_to_all": rows * d * 4, "all_gather": 0.0, "all_reduce": ring * 2 * 8}  # the batch; the stop flag
    if mode == "data":
        model["all_reduce"] += ring * (4 * (2 * d * d_sae + d_sae + d) + d_sae)  # gradients, fired latents
    if mode == "latents":
        model["all_gather"] += (n - 1) * batch * 2 * k * 4  # TopK candidates: values and ids
        model["all_reduce"] += ring * (4 * batch * d + 4 * d + 8)  # decoder partials, b_dec's gradient, dead count
    return model


# The paper model (--paper): H100 SXM peak rates, lower bounds; nothing here was measured on a GPU.
FP32_FLOPS = 67e12  # dense fp32 (saeflow trains in fp32; TF32 is off by default in torch)
HBM_BYTES_S = 3.35e12
GPU_BYTES = 80e9
NVLINK_BYTES_S = 450e9  # NVLink 4, per direction
IB_BYTES_S = 50e9  # one 400 Gb/s NDR InfiniBand link per node, per direction (an assumption: OSC's fabric unconfirmed)


def paper_step(mode: str, n_gpus: int, n_nodes: int, d: int, s: int, batch: int, k: int, n_runs: int):
    """(seconds per batch, GB of training state per GPU) of a TopK pass on `n_gpus` GPUs over `n_nodes` nodes:
    encoder matmuls (forward and weight gradient, 4 B d s flop) at peak fp32; (B, s) activations read and written
    4 times, Adam and the decoder geometry (72 d s bytes) at HBM speed; collectives on a ring at link speed (across
    nodes, what leaves a node over its one link)."""
    n_params = 2 * d * s + s + d
    step = 4 * batch * d * s / FP32_FLOPS + (16 * batch * s + 72 * d * s) / HBM_BYTES_S  # one SAE, one GPU
    state = 16 * n_params + 12 * batch * s

    def all_reduce(n_bytes):
        ring = 2 * (n_gpus - 1) / n_gpus * n_bytes / NVLINK_BYTES_S
        return ring + (n_bytes / IB_BYTES_S if n_nodes > 1 else 0)

    def all_gather(n_bytes_all):  # every rank ends with n_bytes_all
        ring = (n_gpus - 1) / n_gpus * n_bytes_all / NVLINK_BYTES_S
        return ring + (n_bytes_all * (n_nodes - 1) / n_nodes / IB_BYTES_S if n_nodes > 1 else 0)

    gather_batch = all_gather(batch * d * 4) if n_gpus > 1 else 0
    if mode == "sweep":
        return -(-n_runs // n_gpus) * step + gather_batch, state * -(-n_runs // n_gpus) / 1e9
    if mode == "data":
        compute = 4 * batch * d * s / n_gpus / FP32_FLOPS + (16 * batch * s / n_gpus + 72 * d * s) / HBM_BYTES_S
        return compute + gather_batch + all_reduce(4 * n_params), state / 1e9
    comm = gather_batch + all_reduce(4 * batch * d) + all_gather(batch * 2 * k * 4 * n_gpus)  # partials, candidates
    return step / n_gpus + comm, state / n_gpus / 1e9


def paper_table() -> None:
    d, batch, k = 4096, 4096, 32
    print(f"A MODEL ON PAPER (no GPU measured it): TopK, d={d}, batch {batch}, k {k}, fp32; H100 SXM peak rates "
          f"({FP32_FLOPS / 1e12:.0f} TFLOP/s, {HBM_BYTES_S / 1e12:.2f} TB/s), NVLink {NVLINK_BYTES_S / 1e9:.0f} GB/s, "
          f"IB {IB_BYTES_S / 1e9:.0f} GB/s a node; lower bounds on the step time (ms per batch), GB of state a GPU")
    for s in (1 << 16, 1 << 20):
        for label, n_gpus, n_nodes in (("1 H100", 1, 1), ("4 H100, NVLink", 4, 1), ("2 nodes x 4 H100, IB", 8, 2)):
            cells = []
            for mode, n_runs in (("sweep", n_gpus), ("data", 1), ("latents", 1)):
                sec, gb = paper_step(mode, n_gpus, n_nodes, d, s, batch, k, n_runs)
                fits = "" if gb <= GPU_BYTES / 1e9 else " (does not fit)"
                runs = f" {n_runs} runs" if mode == "sweep" else ""
                cells.append(f"{mode}{runs}: {sec * 1e3:6.1f} ms, {gb:5.1f} GB{fits}")
            print(f"  2^{s.bit_length() - 1} latents, {label:21s} " + " | ".join(cells))


def throughput_table(root: pathlib.Path, d: int, expansion: int, k: int, bs: int, steps: int) -> None:
    """Each mode on 1 and 2 ranks: vectors/s and the bytes a rank sends per step against the cost model."""
    s = d * expansion
    spec = dict(arch="topk", k=k, expansion=expansion, batch_size=bs, dead_after_vectors=10**9)
    sd = make_shards(root / f"shards-{d}-{bs}", max(64 * bs, 1 << 16), d)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nd_model {d}, d_sae {s}, k {k}, batch {bs}, {steps} steps; gloo on this machine ({os.cpu_count()} "
          f"cores, load average {load}), one thread a rank")
    print(f"{'mode':8s} {'1 rank vec/s':>13s} {'2 ranks vec/s':>14s} {'ratio':>6s}   bytes/step a rank sends: "
          "measured / model (ratio)")
    for mode in ("sweep", "data", "latents"):
        n_runs = 2 if mode == "sweep" else 1
        tag = f"{mode}-{d}-{bs}"
        one = run_ranks(1, rank_bench, make_runs(root / f"{tag}-1", sd, n_runs, **spec), "sweep", steps)[0]
        two = run_ranks(2, rank_bench, make_runs(root / f"{tag}-2", sd, n_runs, **spec), mode, steps)
        vec_s = min(r["vec_s"] for r in two)
        model = cost_model(mode, 2, bs, d, s, k)
        kinds = [kind for kind in ("all_to_all", "all_gather", "all_reduce") if model[kind]]
        sent = {kind: sum(r["sent"].get(kind, 0) for r in two) / 2 for kind in kinds}  # the ranks' mean
        cells = "  ".join(f"{kind} {sent[kind] / 1e6:.3f} / {model[kind] / 1e6:.3f} MB "
                          f"({sent[kind] / model[kind]:.2f})" for kind in kinds)  # fmt: skip
        print(f"{mode:8s} {one['vec_s']:13.0f} {vec_s:14.0f} {vec_s / one['vec_s']:6.2f}   {cells}")


def memory_table(root: pathlib.Path, d: int, k: int, mem_expansion: int, mem_batch: int) -> None:
    """Latent sharding of a wide SAE: what a rank holds and the peak RSS it adds, on 2 ranks against 1."""
    sd = make_shards(root / "shards-mem", 1 << 16, d)
    peaks = {}
    for expansion in (1, mem_expansion):  # a 1x SAE measures what a rank adds besides the SAE
        mem_spec = dict(arch="topk", k=min(k, d), expansion=expansion, batch_size=mem_batch, dead_after_vectors=10**9)
        one = run_ranks(1, rank_bench, make_runs(root / f"mem{expansion}-1", sd, 1, **mem_spec), "sweep", 3)[0]
        two = run_ranks(2, rank_bench, make_runs(root / f"mem{expansion}-2", sd, 1, **mem_spec), "latents", 3)
        peaks[expansion] = (one["peak"], max(r["peak"] for r in two), one["held"], max(r["held"] for r in two))
    (base1, base2, _, _), (peak1, peak2, held1, held2) = peaks[1], peaks[mem_expansion]
    print(f"\nmemory, d_sae {d * mem_expansion}, batch {mem_batch}: parameters + Adam per rank "
          f"{held2 / 1e6:.1f} MB sharded on 2 / {held1 / 1e6:.1f} MB unsharded = {held2 / held1:.3f}")
    print(f"  peak RSS a rank adds: {peak2 / 1e6:.1f} MB sharded / {peak1 / 1e6:.1f} MB unsharded = "
          f"{peak2 / peak1:.3f};\n  less what it adds with a {d}-latent SAE ({base2 / 1e6:.1f} / {base1 / 1e6:.1f} "
          f"MB: the loader, gloo, pages copied from the forked parent): {(peak2 - base2) / (peak1 - base1):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="print docs/distributed.md's paper model; run nothing")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--expansion", type=int, default=32)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--realistic", action="store_true",
                        help=f"also measure at d={REALISTIC[0]}, {REALISTIC[1]}x, batch {REALISTIC[2]} "
                        f"({REALISTIC[3]} steps)")  # fmt: skip
    parser.add_argument("--mem-expansion", type=int, default=256, help="the memory case's SAE width (x d_model)")
    parser.add_argument("--mem-batch", type=int, default=256)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory case")
    args = parser.parse_args()
    if args.paper:
        return paper_table()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        throughput_table(root, args.d_model, args.expansion, args.k, args.batch_size, args.steps)
        if args.realistic:
            d, expansion, bs, steps = REALISTIC
            throughput_table(root, d, expansion, args.k, bs, steps)
        if not args.no_memory:
            memory_table(root, args.d_model, args.k, args.mem_expansion, args.mem_batch)


if __name__ == "__main__":
    main()
