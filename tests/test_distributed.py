"""Training on several ranks, on the CPU with gloo (docs/distributed.md).

Ranks are forked copies of the test process (tests/_ranks.py: no interpreter start), except where the launcher
itself is under test. World size 1 is one process (a launcher that starts one rank makes none). The quick tests use
1 and 2 ranks; 4 ranks, torchrun's own command line and the fake-Slurm workflow are marked slow.

What each proves:
  - the launch line: every `saeflow train` option but --run passes torchrun's parser (--run-dir stands for --run);
    the rendezvous comes from torchrun's or srun's variables;
  - the pool: the job's memory limit (cgroup, Slurm, available RAM) sizes it; ranks hold disjoint parts adding up to
    the job's pool, and every rank gets the one-process batches (each vector once per epoch in total);
  - latent sharding selects exactly what the whole SAE selects (TopK, BatchTopK, AuxK) and holds 1/N of the
    parameters and Adam moments (plus O(d));
  - each mode against one process: sweep byte-identical, data and latents within TOL; resume across world sizes;
    a stop signal on one rank stops every rank at one step with a checkpoint; a killed rank stops the others in
    bounded time with one line naming it, and nothing is published.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from _ranks import run_ranks, start_ranks
from builders import MODE_FREE, planted_data, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow import cli, config
from saeflow.errors import SaeflowError
from saeflow.store.shards import ShardDir
from saeflow.training import archs, entry, memory, objectives, rates, resume, specs, sweeps
from saeflow.training.adam import Adam
from saeflow.training.loaders import Block, EpochPlan, ShuffledLoader
from saeflow.training.picks import PreActs
from saeflow.training.ranks import distributed, parallel, sharded
from saeflow.training.ranks.dataparallel import global_batch_keep, rank_slice
from saeflow.training.ranks.distloader import DistributedShuffledLoader, RankPlan
from saeflow.training.sae import SAE, SAEConfig, load_sae, randn_rows

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4  # data and latents against one process: max |w - w_1| / max |w_1| over each tensor (measured <= 6e-6)
SPEC = dict(k=2, expansion=4, batch_size=32, n_epochs=1, dead_after_vectors=256)  # 64 steps, AuxK from step 8
# A killed rank is noticed through its closed connection within seconds; without that, only after RANK_TIMEOUT_SEC of
# heartbeat silence. The bound sits between the two, far from both, so load cannot fail it and the silence cannot pass.
NOTICED_SEC = 0.75 * distributed.RANK_TIMEOUT_SEC
POOL = "19200"  # 300 rows of d=16: smaller than the 2,048 training vectors, so the pool really is split


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardDir:
    x_nd, _ = planted_data(2048, d_model=16, n_atoms=32, k=2, seed=1)
    return write_shards(tmp_path_factory.mktemp("shards"), x_nd.reshape(-1, 1, 8, 16), layers=(0,), ex_per_shard=50,
                        tag="distributed")  # fmt: skip


def _state(run) -> dict:
    return load_sae(run.sae_fpath).state_dict()


def _assert_close(a: dict, b: dict, tol: float = TOL) -> None:
    for name, tensor in a.items():
        rel = float((tensor - b[name]).abs().max() / tensor.abs().max().clamp_min(1e-12))
        assert rel <= tol, f"{name}: {rel:.2e} relative"


# --- the launch line and the rendezvous ------------------------------------------------------------------------


def _train_parser():
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return subparsers.choices["train"]


def test_every_train_option_but_run_passes_torchruns_parser():
    """torchrun parses the whole command line, saeflow's part included: `--run` is taken as an abbreviation of its
    `--run-path` and fails; `--run-dir` and every other option of `saeflow train` reach saeflow as written."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    head = ["--nproc-per-node", "2", "-m", "saeflow", "train"]
    with pytest.raises(SystemExit):
        torchrun.parse_args([*head, "--run", "R"])
    checked = []
    for action in _train_parser()._actions:
        for flag in action.option_strings:
            if flag in ("--run", "--nproc", "-h", "--help"):  # --nproc: for saeflow's own launcher, not torchrun
                continue
            value = [] if action.nargs == 0 else [str((action.choices or ["1"])[0])]
            parsed = torchrun.parse_args([*head, flag, *value])
            assert parsed.training_script_args == ["train", flag, *value], flag
            checked.append(flag)
    assert {"--run-dir", "--parallel", "--gpus", "--nodes", "--buffer-bytes", "--max-steps"} <= set(checked)


def test_rendezvous_from_torchrun_and_srun_variables():
    assert distributed.rendezvous_from_env({}) is None
    assert distributed.rendezvous_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None  # a world of one: alone
    rdv = distributed.rendezvous_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                           "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})  # fmt: skip
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size, rdv.source) == (3, 4, 1, 2, "torchrun")
    srun = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}  # fmt: skip
    rdv = distributed.rendezvous_from_env(srun)
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (5, 8, 1, 4)
    assert (rdv.master_addr, rdv.master_port, rdv.source) == ("gpu07", 29500 + 1234 * 7 % 10000, "srun")
    # The batch script of a multi-task job is no rank (srun sets SLURM_STEP_NUM_TASKS for the tasks it starts).
    assert distributed.rendezvous_from_env({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) is None
    assert distributed.expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert distributed.expand_hostlist("a[8-10]b,c7") == ["a8b", "a9b", "a10b", "c7"]


def test_job_memory_comes_from_the_cgroup_slurm_or_the_available_ram(tmp_path):
    gib, mib = 1 << 30, 1 << 20
    proc = tmp_path / "cgroup"
    proc.write_text("0::/slurm/job_1/step_0\n")
    (tmp_path / "fs" / "slurm" / "job_1" / "step_0").mkdir(parents=True)
    (tmp_path / "fs" / "slurm" / "job_1" / "memory.max").write_text(f"{100 * gib}\n")
    (tmp_path / "fs" / "slurm" / "job_1" / "step_0" / "memory.max").write_text("max\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 99999999 kB\nMemAvailable:   20971520 kB\n")
    kw = dict(proc_cgroup=proc, cgroup_root=tmp_path / "fs", meminfo=meminfo)
    assert memory.job_memory({}, **kw) == (100 * gib, "cgroup limit")
    slurm = {"SLURM_MEM_PER_CPU": "8000", "SLURM_CPUS_ON_NODE": "12"}  # Cardinal: 12 cores x 8000 MB per GPU
    assert memory.job_memory(slurm, **kw) == (96000 * mib, "Slurm allocation")
    proc.write_text("4:memory:/batch/x\n")  # cgroup v1, no limit set: Slurm, else the available RAM
    assert memory.job_memory({"SLURM_MEM_PER_NODE": "4096"}, **kw) == (4 * gib, "Slurm allocation")
    assert memory.job_memory({}, **kw) == (20 * gib, "available RAM")
    # auto: the rank's part of the node, less its SAEs' room and the overhead, rounded down to 2^k or 1.5 x 2^k.
    assert memory.auto_pool_share(96000 * mib, 1, 4 * gib) == 64 * gib
    assert memory.auto_pool_share(4 * 96000 * mib, 4, 40 * gib) == 48 * gib
    assert [memory.round_pool(n * gib) for n in (1, 2, 3, 5, 7)] == [gib, 2 * gib, 3 * gib, 4 * gib, 6 * gib]
    assert memory.parse_size("32GiB") == 32 * gib and memory.parse_size("auto") is None
    assert memory.parse_size("512M") == 512 * mib and memory.parse_size(1000) == 1000
    with pytest.raises(Exception, match="--buffer-bytes: 'lots' is not a size"):
        memory.parse_size("lots", "--buffer-bytes")


def _train_config(**spec) -> specs.TrainConfig:
    cfg = config.validate({"activations": {}, "saes": {"s": {"train": "x", "layer": 0, **spec}}})
    (plan,) = sweeps.plan_runs({"s": sweeps.SAESpec.from_dict("s", cfg["saes"]["s"])}, {"x": "h" * 64}, {"x": "all"})
    return plan.train_config


def test_auto_mode_shards_what_does_not_fit_and_sweeps_what_fills_the_ranks():
    h100 = 80 << 30
    big = memory.state_bytes(_train_config(expansion=256), 4096)  # 2^20 latents on d=4096: 100+ GiB of state
    small = memory.state_bytes(_train_config(expansion=16), 4096)  # 2^16 latents: about 12 GB
    assert big > h100 > 2 * small
    assert parallel.choose_mode("auto", 8, 4, big, h100) == "latents"
    assert parallel.choose_mode("auto", 4, 4, small, h100) == "sweep"
    assert parallel.choose_mode("auto", 3, 4, small, h100) == "data"
    assert parallel.choose_mode("data", 8, 4, big, h100) == "data"


# --- the loader across ranks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sizes, n_tok, n_pool, batch_size", [([9, 4, 7], 3, 17, 5), ([30], 2, 200, 8),
                                                              ([5, 5], 4, 3, 7), ([12, 1, 8, 3], 1, 11, 4)])
def test_rank_plans_split_the_pool_and_rebuild_every_batch(world_size, sizes, n_tok, n_pool, batch_size):
    """In index space: the ranks' pools are disjoint and add up to the job's; each batch, rebuilt from the ranks'
    parts as the loader rebuilds it, is the one-process batch; every stream row is read once, by one rank; a rank's
    refilled slots are a prefix of its gathered ones (what the two-worker pipeline needs); from any start batch."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    blocks = [Block(i, s, min(2, n - s)) for i, n in enumerate(sizes) for s in range(0, n, 2)]
    for start in (0, 3):
        plan = EpochPlan(blocks, starts, n_tok, n_pool, batch_size, seed=7, epoch=2)
        parts = [RankPlan(EpochPlan(blocks, starts, n_tok, n_pool, batch_size, 7, 2), r, world_size)
                 for r in range(world_size)]  # fmt: skip
        assert sum(p.n_pool for p in parts) == plan.n_pool
        assert max(p.n_pool for p in parts) <= -(-plan.n_pool // world_size)
        steps = [p.steps(start) for p in parts]
        global_steps = plan.steps(start)
        loaded = [next(s, None) for s in steps]
        want = next(global_steps, None)
        read = []
        if want is not None:
            rows = np.concatenate([rows for _, rows in loaded])
            assert np.array_equal(np.sort(rows), np.sort(want[1])) and len(rows) == len(want[1])
            read.append(rows)
        for step in global_steps:
            mine = [next(s) for s in steps]
            owner_b = parts[0].owners.popleft()
            for p in parts[1:]:
                assert np.array_equal(p.owners.popleft(), owner_b)
            rebuilt = np.empty_like(step.rows)
            for r, part in enumerate(mine):
                rebuilt[owner_b == r] = part.rows
                assert np.array_equal(part.refill_slots, part.slots[: part.refill_slots.size])
                assert part.slots.size == 0 or part.slots.max() < parts[r].n_pool
                read.append(part.refill_rows)
            assert np.array_equal(rebuilt, step.rows)
        read = np.concatenate(read) if read else np.zeros(0)
        if start == 0:  # the whole epoch: every stream row read exactly once, by exactly one rank
            assert np.array_equal(np.sort(read), np.arange(plan.n_rows))


def _loader_batches(sd_dpath, pool_bytes: int, start: int):
    comm = distributed.init("cpu")
    loader = DistributedShuffledLoader(comm, ShardDir(sd_dpath), 0, 24, seed=3, block_bytes=3 * 8 * 64,
                                       buffer_bytes=pool_bytes)  # fmt: skip
    batches = [x_bd.clone().numpy() for x_bd in loader.iter_batches(1, start)]
    here = loader.rank_plan(1).n_pool
    loader.close()
    comm.close()
    return batches, here


def test_loader_on_two_ranks_gives_each_the_one_process_batches(shards):
    """Real reads: every rank gets exactly the batches of one process with the same pool, from the start of an
    epoch (each vector once) and from a later batch (a resume); each rank holds half the pool."""
    pool_bytes = 100 * 64
    alone = ShuffledLoader(shards, 0, 24, seed=3, block_bytes=3 * 8 * 64, buffer_bytes=pool_bytes)
    for start in (0, 5):
        want = [x_bd.clone().numpy() for x_bd in alone.iter_batches(1, start)]
        results = run_ranks(2, _loader_batches, shards.dpath, pool_bytes, start)
        for batches, _ in results:
            assert len(batches) == len(want)
            for got, expected in zip(batches, want):
                np.testing.assert_array_equal(got, expected)
        assert [here for _, here in results] == [50, 50]
    rows = np.concatenate(want if start == 0 else [b.clone().numpy() for b in alone.iter_batches(1)])
    assert len(np.unique(rows, axis=0)) == alone.n_vectors == 2048
    alone.close()


def _loader_slices(sd_dpath, pool_bytes: int):
    comm = distributed.init("cpu")
    loader = DistributedShuffledLoader(comm, ShardDir(sd_dpath), 0, 24, seed=3, block_bytes=3 * 8 * 64,
                                       buffer_bytes=pool_bytes)  # fmt: skip
    parts = [(x_nd.clone().numpy(), n) for x_nd, n in loader.iter_slices(1)]
    sent = comm.sent_bytes["all_to_all"]
    comm.sent_bytes.clear()
    for _ in loader.iter_batches(1):
        pass
    loader.close()
    comm.close()
    return parts, sent, comm.sent_bytes["all_to_all"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_ranks_receive_only_the_rows_they_train_on(shards, world_size):
    """iter_slices: rank r gets rows [B r/N, B (r+1)/N) of each one-process batch, and sends only the rows of its part
    that other ranks train on: over an epoch, about 1/N of what the whole batches cost it (exactly (N-1) x its part's
    rows for whole batches: no padding)."""
    pool_bytes = 100 * 64
    alone = ShuffledLoader(shards, 0, 24, seed=3, block_bytes=3 * 8 * 64, buffer_bytes=pool_bytes)
    want = [x_bd.clone().numpy() for x_bd in alone.iter_batches(1)]
    alone.close()
    results = run_ranks(world_size, _loader_slices, shards.dpath, pool_bytes)
    for rank, (parts, sent_slices, sent_whole) in enumerate(results):
        assert len(parts) == len(want)
        for (got, n), expected in zip(parts, want):
            assert n == len(expected)
            np.testing.assert_array_equal(got, expected[rank_slice(n, _comm_stub(rank, world_size))])
        assert sent_slices < 1.5 * sent_whole / world_size, (sent_slices, sent_whole)
    row_bytes = 16 * 4
    assert sum(whole for _, _, whole in results) == (world_size - 1) * 2048 * row_bytes  # each row to N-1 ranks


def _rows_with_an_empty_part():
    comm = distributed.init("cpu")
    counts = [0, 3]  # rank 0 holds no row of this batch
    rows_nd = torch.arange(counts[comm.rank] * 2, dtype=torch.float32).reshape(-1, 2)
    whole_nd = comm.all_gather_rows(rows_nd, counts)
    sent = comm.sent_bytes["all_to_all"]
    mine_nd = comm.exchange_rows(rows_nd, [1, 2] if comm.rank else [0, 0], [0, 1] if comm.rank == 0 else [0, 2])
    comm.close()
    return whole_nd.tolist(), mine_nd.tolist(), sent


def test_batch_exchanges_count_exact_rows_and_allow_a_rank_with_none():
    """A rank may hold no row of a batch: the all-to-all still runs, and each rank counts exactly the bytes it sends
    (rank 1: its 3 rows of 2 floats to rank 0; then 1 row to rank 0 in the routed exchange)."""
    (whole0, mine0, sent0), (whole1, mine1, sent1) = run_ranks(2, _rows_with_an_empty_part)
    assert whole0 == whole1 == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and (sent0, sent1) == (0, 3 * 2 * 4)
    assert mine0 == [[0.0, 1.0]] and mine1 == [[2.0, 3.0], [4.0, 5.0]]


def _comm_stub(rank: int, world_size: int):
    """A stand-in for a Comm: what rank_slice reads."""
    import types

    return types.SimpleNamespace(rank=rank, world_size=world_size)


# --- latent sharding and data parallelism, piece by piece ---------------------------------------------------------


def _random_sae(arch: str, seed: int = 0) -> SAE:
    torch.manual_seed(seed)
    sae = SAE(SAEConfig(d_model=16, d_sae=64, arch=arch, k=4, matryoshka=(16,) if arch == "batchtopk" else ()))
    with torch.no_grad():
        for param in sae.parameters():
            param.normal_()
        sae.threshold.fill_(0.5)
    return sae


def _shard_of(sae: SAE, comm) -> sharded.LatentShard:
    bounds = sharded.latent_bounds(sae.d_sae, comm.world_size)
    shard = sharded.LatentShard(sae.cfg, bounds[comm.rank], bounds[comm.rank + 1])
    state = {"sae": sae.state_dict(), "opt": {"state": {}}, "since_fired_s": torch.zeros(sae.d_sae)}
    shard.load_state_dict(resume._latent_slices(state, shard.lo, shard.hi, sae.arch.latent_axes())["sae"])
    return shard


def _selections():
    """On each rank: the sharded selections and decodes against the whole SAE's, on the same weights and batch."""
    comm, out = distributed.init("cpu"), {}
    x_bd = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    for arch in archs.names(mode="latents"):  # what a latent shard must compute: every architecture that claims it
        model = _random_sae(arch).train()
        shard = _shard_of(model, comm)
        pre_bs = model.pre_acts_normed(x_bd)
        codes = sharded.encode(shard, PreActs(shard, x_bd), comm, 32, training=True)
        if model.arch.selection is archs.Selection.TOP_K:
            want = pre_bs.topk(4, dim=-1).indices.sort(1).values
            out[arch] = torch.equal(codes.gids_bk.sort(1).values, want)
        else:
            f_bs = model.activate(pre_bs)
            out[arch] = torch.equal(codes.f_bs, f_bs[:, shard.lo : shard.hi])
        x_hat = sharded.decode(shard, codes, comm, model.cfg.matryoshka)[-1]
        whole_codes, _ = objectives.encode(model, x_bd, PreActs(model, x_bd), None)
        out[f"{arch}_decode"] = float((x_hat - whole_codes.decode(model)).abs().max())
        if model.arch.selection is archs.Selection.BATCH_TOP_K:  # and from its CSR picks (saeflow-train-4)
            picked = sharded.encode(shard, PreActs(shard, x_bd, picked=True), comm, 32, training=True)
            out[f"{arch}_picked"] = picked.f_bs is None and torch.equal(picked.dense(shard), codes.f_bs.detach())
            picked_x_hat = sharded.decode(shard, picked, comm, model.cfg.matryoshka)
            out[f"{arch}_picked_decode"] = float((picked_x_hat[-1] - whole_codes.decode(model)).abs().max())
        dead_s = torch.arange(64) % 3 == 0
        dead_z, pick_bk = objectives.pick_dead(pre_bs, dead_s, 8)
        picks = sharded.dead_picks(shard, shard.pre_acts_normed(x_bd), dead_s[shard.lo : shard.hi], 8, comm)
        out[f"{arch}_aux"] = torch.equal(picks.sort(1).values, dead_z[pick_bk].sort(1).values)
    # BatchTopK over a batch split between the ranks (data-parallel) keeps what one process keeps.
    model = _random_sae("batchtopk").train()
    part = rank_slice(32, comm)
    keep_bs = global_batch_keep(model.pre_acts_normed(x_bd[part]), model.cfg.n_kept(32), comm)
    out["data_batchtopk"] = torch.equal(keep_bs, model.activate(model.pre_acts_normed(x_bd))[part] > 0)
    out["slice"] = (part.start, part.stop)
    # Memory: parameters and Adam moments of this rank's shard of a wide SAE, against the whole SAE's.
    wide = SAEConfig(d_model=16, d_sae=4096, arch="topk", k=4)
    bounds = sharded.latent_bounds(4096, comm.world_size)
    shard = sharded.LatentShard(wide, bounds[comm.rank], bounds[comm.rank + 1])
    opt = Adam(shard.parameters(), lr=1e-3)
    for param in shard.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    held = sum(t.numel() for t in [*shard.parameters(), *(m for s in opt.state.values() for m in s.values())])
    out["held_floats"] = held
    comm.close()
    return out


def test_one_rank_of_data_parallelism_keeps_the_batch_and_what_batchtopk_keeps():
    """World size 1 (in process; the ranked tests fork): a rank's slice is the whole batch, and the global
    BatchTopK over it keeps exactly what SAE.activate keeps."""
    comm = distributed.Comm.alone(torch.device("cpu"))
    sae = _random_sae("batchtopk").train()
    x_bd = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    assert rank_slice(32, comm) == slice(0, 32)
    keep_bs = global_batch_keep(sae.pre_acts_normed(x_bd), sae.cfg.n_kept(32), comm)
    assert torch.equal(keep_bs, sae.activate(sae.pre_acts_normed(x_bd)) > 0)


@pytest.mark.slow
def test_latent_shards_select_what_the_whole_sae_selects_in_a_share_of_the_memory():
    """Same weights, same batch, every architecture: the global TopK picks, the BatchTopK codes, the dense codes (each
    latent's own parameters cut with it), the AuxK dead picks and the reconstruction of 2 latent shards equal the
    whole SAE's; BatchTopK over a batch split between 2 ranks keeps
    what one process keeps; a rank holds half the parameters and Adam moments, plus b_dec's (O(d))."""
    results = run_ranks(2, _selections)
    for out in results:
        latents = archs.names(mode="latents")
        for key in (*latents, *(f"{name}_aux" for name in latents), "data_batchtopk", "batchtopk_picked"):
            assert out[key] is True, key
        for key in (*(f"{name}_decode" for name in latents), "batchtopk_picked_decode"):
            assert out[key] < 1e-4, (key, out[key])
    assert [out["slice"] for out in results] == [(0, 16), (16, 32)]
    whole = 3 * (2 * 16 * 4096 + 4096 + 16)  # parameters and two Adam moments (plus scalar step counts)
    for out in results:
        assert out["held_floats"] <= whole / 2 + 3 * 16 + 8, (out["held_floats"], whole)


# --- each mode against one process --------------------------------------------------------------------------------


def _train(run_roots, mode: str, **kw):
    return entry.train_runs(run_roots, entry.TrainSettings(device="cpu", parallel=mode, buffer_bytes=POOL, **kw))


def _cli_train(run_roots, *flags: str) -> int:
    return cli.main(["train", *(a for r in run_roots for a in ("--run", str(r))), "--device", "cpu",
                     "--buffer-bytes", POOL, *flags])  # fmt: skip


def _runs(root: pathlib.Path, shards: ShardDir, seeds=(0,), **spec) -> list:
    return [run_from_sae_spec(root, shards, **{**SPEC, **spec, "seed": s}) for s in seeds]


@pytest.mark.slow
def test_sweep_on_two_ranks_publishes_the_bytes_of_each_run_trained_alone(tmp_path, shards):
    """3 runs of one pass on 2 ranks (rank 0 trains two, rank 1 one): every sae.pt and metrics.jsonl is the file a
    single process writes for that run alone; the results come back on rank 0."""
    spread = _runs(tmp_path / "spread", shards, seeds=(0, 1, 2), arch="batchtopk", matryoshka=[0.25])
    results = run_ranks(2, _train, [r.root for r in spread], "sweep")
    assert sorted(r["run"] for r in results[0]) == sorted(str(r.root) for r in spread) and results[1] == []
    for seed, run in enumerate(spread):
        (alone,) = _runs(tmp_path / f"alone{seed}", shards, seeds=(seed,), arch="batchtopk", matryoshka=[0.25])
        _train([alone.root], "sweep")
        assert run.sae_fpath.read_bytes() == alone.sae_fpath.read_bytes()
        assert run.metrics_log_fpath.read_text() == alone.metrics_log_fpath.read_text()


# Every architecture of the registry in every mode it says it trains in (the plan refuses the others:
# tests/test_archs.py), so a new architecture is trained here in each mode it claims.
SUPPORTED = [(mode, name) for name in sorted(archs.REGISTRY) for mode in archs.MODES if mode in archs.get(name).modes]
# A JumpReLU code jumps by its threshold when a pre-activation crosses it, so a summation order that moves one across
# parts the runs at once (TopK's near-ties swap near-equal values instead); near threshold 0 the jump is small. The
# exact one-step gradients of every architecture in data mode are in tests/test_archs.py.
# ReLU at its default rate (2.5x `rates.auto_lr` since saeflow-train-4) grows the summation order's rounding past TOL
# within these 64 steps (2.4e-4 after a resume from 2 ranks, 6e-6 at 1x): these tests compare the modes at 1x.
SMALL_JUMPS = {"jumprelu": {"threshold_init": 0.05, "bandwidth": 0.05, "l0_coeff": 1.0},
               "relu": {"lr": rates.auto_lr(16 * SPEC["expansion"])}}  # fmt: skip


def _extra(arch: str, mode: str) -> dict:
    """The spec's keys beyond SPEC for `arch` trained in `mode` (latent shards: MODE_FREE)."""
    return {**SMALL_JUMPS.get(arch, {}), **(MODE_FREE if mode == "latents" else {})}


@pytest.mark.parametrize("mode, arch", [pair for pair in SUPPORTED if pair[0] != "sweep"])
def test_data_and_latents_on_two_ranks_match_one_process(tmp_path, shards, mode, arch):
    """One SAE trained data-parallel or latent-sharded on 2 ranks ends within TOL of one process (the sums are taken
    in another order), its validation metrics within 1e-4, with the same number of metrics lines; with Matryoshka
    prefixes, so every reconstruction term is covered."""
    extra = {"matryoshka": [0.25], **_extra(arch, mode)}
    (split,) = _runs(tmp_path / "split", shards, arch=arch, **extra)
    (alone,) = _runs(tmp_path / "alone", shards, arch=arch, **extra)
    (result,), _ = run_ranks(2, _train, [split.root], mode)
    (want,) = _train([alone.root], "sweep")
    _assert_close(_state(alone), _state(split))
    for key in ("nmse", "l0", "n_vectors"):
        assert result[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    lines = [json.loads(line) for line in split.metrics_log_fpath.read_text().splitlines()]
    want_lines = [json.loads(line) for line in alone.metrics_log_fpath.read_text().splitlines()]
    assert [line["step"] for line in lines] == [line["step"] for line in want_lines]
    assert lines[-2]["loss"] == pytest.approx(want_lines[-2]["loss"], rel=1e-3)
    assert not split.resume_fpath.exists() and not split.resume_shards_dpath.exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode, arch", SUPPORTED)
def test_resume_on_one_process_after_two_ranks(tmp_path, shards, mode, arch):
    """2 ranks train 20 steps and stop (a resume checkpoint: whole tensors, or one file per rank and a manifest for
    latents); one process resumes to the end. The result is an uninterrupted one-process run's: the same bytes for
    sweep, within TOL otherwise. And the other way: a one-process checkpoint resumed on 2 ranks."""
    extra = _extra(arch, mode)
    (run,) = _runs(tmp_path / "two", shards, arch=arch, **extra)
    assert run_ranks(2, _train, [run.root], mode, max_steps=20, checkpoint_every=7) == [[], []]
    assert run.resume_manifest_fpath.exists() == (mode == "latents")
    assert resume.resume_info(run)[0] == 20
    _train([run.root], mode)
    (clean,) = _runs(tmp_path / "clean", shards, arch=arch, **extra)
    _train([clean.root], mode)
    if mode == "sweep":
        assert run.sae_fpath.read_bytes() == clean.sae_fpath.read_bytes()
    else:
        _assert_close(_state(clean), _state(run))
    (back,) = _runs(tmp_path / "back", shards, arch=arch, **extra)
    _train([back.root], mode, max_steps=30)
    run_ranks(2, _train, [back.root], mode)
    if mode == "sweep":
        assert back.sae_fpath.read_bytes() == clean.sae_fpath.read_bytes()
    else:
        _assert_close(_state(clean), _state(back))


def _wait_for(path_fn, job, timeout: float = HANG_SEC) -> None:
    deadline = time.monotonic() + timeout
    while not path_fn() and time.monotonic() < deadline and all(p.is_alive() for p in job.procs):
        time.sleep(0.02)
    assert path_fn(), "training ended (or failed) before the moment the test waits for"


@pytest.mark.slow
def test_usr1_on_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path, shards):
    """Slurm's warning signal reaching rank 1 only: both ranks stop after the same step, each run (one per rank,
    sweep) saved there, one line each; resuming on one process gives the bytes of uninterrupted runs."""
    two = _runs(tmp_path / "two", shards, seeds=(0, 1), arch="topk", n_epochs=3)
    job = start_ranks(2, _cli_train, [r.root for r in two], "--parallel", "sweep", "--checkpoint-every", "40")
    _wait_for(lambda: two[0].resume_fpath.exists(), job)
    job.kill(1, signal.SIGUSR1)
    assert job.wait(HANG_SEC) == [0, 0] and [job.result(r) for r in (0, 1)] == [1, 1]
    steps = [torch.load(r.resume_fpath, weights_only=True)["step"] for r in two]
    assert steps[0] == steps[1] and 40 <= steps[0] < 192
    for rank in (0, 1):
        (line,) = [x for x in job.stderr(rank).splitlines() if "error" in x]
        assert f"rank {rank}: stopped by SIGUSR1 on rank 1: resume checkpoints saved at step {steps[0]}" in line
    assert _cli_train([r.root for r in two], "--parallel", "sweep") == 0
    clean = _runs(tmp_path / "clean", shards, seeds=(0, 1), arch="topk", n_epochs=3)
    _train([r.root for r in clean], "sweep")
    for a, b in zip(two, clean):
        assert a.sae_fpath.read_bytes() == b.sae_fpath.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data", "latents"])
def test_a_killed_rank_stops_the_others_with_one_line_and_nothing_is_published(tmp_path, shards, mode):
    """Rank 1 SIGKILLed mid-training: rank 0 stops within seconds with one line naming rank 1; no sae.pt, no
    metrics.json; the last checkpoint resumes on one process to the end."""
    (run,) = _runs(tmp_path, shards, arch="topk", n_epochs=3)
    job = start_ranks(2, _cli_train, [run.root], "--parallel", mode, "--checkpoint-every", "40")
    _wait_for(lambda: resume.resume_info(run) is not None, job)
    killed_at = time.monotonic()
    job.kill(1)
    codes = job.wait(HANG_SEC)
    assert codes == [0, -signal.SIGKILL] and job.result(0) == 1, (codes, job.stderr(0))
    assert time.monotonic() - killed_at < NOTICED_SEC  # through the closed connection, not the heartbeat's silence
    (line,) = [x for x in job.stderr(0).splitlines() if "error" in x]
    assert line.startswith("saeflow train: error: rank 0: rank 1 is gone (") and "nothing was published" in line
    assert "Traceback" not in job.stderr(0)
    assert not run.sae_fpath.exists() and not run.final_metrics_fpath.exists()
    assert _cli_train([run.root], "--parallel", mode) == 0 and run.sae_fpath.exists()


def _blocked_on_rank_0_when_rank_2_dies() -> str:
    """Rank 2 dies; ranks 0 and 1 fail in an all-reduce with it; rank 3 waits on a receive from rank 0 alone, which
    fails only when rank 0 (the store's holder) leaves. Each rank's one error line."""
    comm = distributed.init("cpu")
    comm.barrier()
    if comm.rank == 2:
        os._exit(9)
    try:
        with comm.guard():
            comm.recv(torch.zeros(1), 0) if comm.rank == 3 else comm.barrier()
    except SaeflowError as err:
        return str(err)
    return "no error"


def test_a_rank_blocked_on_the_store_holder_names_the_dead_rank():
    """The race CI hit with two suites on 2 cores: rank 3 blocked on rank 0 alone learns who died only when rank 0
    leaves and takes the store with it. The verdict written to the store, read by every heartbeat, names rank 2 on
    every live rank, with no C++ store warnings on stderr."""
    job = start_ranks(4, _blocked_on_rank_0_when_rank_2_dies)
    assert job.wait(HANG_SEC) == [0, 0, 9, 0]
    for r in (0, 1, 3):
        assert job.result(r).startswith("rank 2 is gone ("), (r, job.result(r))
        assert "frame #" not in job.stderr(r) and "Traceback" not in job.stderr(r), job.stderr(r)


@pytest.mark.slow
def test_the_launcher_reports_a_killed_rank_in_one_line(tmp_path, shards):
    """`saeflow train --nproc 2` starts its ranks through torch.distributed.run's launcher; SIGKILL one of them: the
    command ends within a bounded time, every line it prints is one line naming rank 1, nothing is published."""
    (run,) = _runs(tmp_path, shards, arch="topk", n_epochs=40)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "saeflow", "train", "--run", str(run.root), "--device", "cpu",
                             "--nproc", "2", "--parallel", "latents", "--checkpoint-every", "20"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + HANG_SEC
    while not run.resume_shards_dpath.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    rank1 = _rank_pid(proc.pid, 1)
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG_SEC)
    assert proc.returncode == 1 and time.monotonic() - killed_at < NOTICED_SEC
    lines = [line for line in err.splitlines() if "error" in line]
    assert lines and all("rank 1" in line for line in lines), err[-3000:]
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in lines[-1] and "Traceback" not in err
    assert not run.sae_fpath.exists()


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of a rank the launcher started (its environment says RANK=rank)."""
    todo = [launcher_pid]
    while todo:
        pid = todo.pop()
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            for child in map(int, (task / "children").read_text().split()):
                todo.append(child)
                environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ and any(v.startswith(b"TORCHELASTIC_RUN_ID=") for v in environ):
                    return child
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


# --- slow: 4 ranks, torchrun's own command line ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sweep", "data", "latents"])
def test_four_ranks_match_one_process_resume_across_world_sizes_and_name_a_killed_rank(tmp_path, shards, mode):
    """4 ranks against one process (sweep: 4 runs, each the bytes of that run alone; data, latents: within TOL); a
    run stopped on 2 ranks resumes on 4, one stopped on 4 resumes on 1, both to the uninterrupted result; rank 2 of
    4 killed: every other rank stops with one line naming it, and nothing is published."""
    seeds = (0, 1, 2, 3) if mode == "sweep" else (0,)
    spread = _runs(tmp_path / "spread", shards, seeds=seeds, arch="batchtopk", matryoshka=[0.25])
    alone = _runs(tmp_path / "alone", shards, seeds=seeds, arch="batchtopk", matryoshka=[0.25])
    run_ranks(4, _train, [r.root for r in spread], mode)
    _train([r.root for r in alone], "sweep")
    for a, b in zip(spread, alone):
        if mode == "sweep":
            assert a.sae_fpath.read_bytes() == b.sae_fpath.read_bytes()
        else:
            _assert_close(_state(b), _state(a))
    for first, then, name in ((2, 4, "two-four"), (4, 1, "four-one")):
        (run,) = _runs(tmp_path / name, shards, arch="batchtopk", matryoshka=[0.25])
        run_ranks(first, _train, [run.root], mode, max_steps=20, checkpoint_every=9)
        run_ranks(then, _train, [run.root], mode) if then > 1 else _train([run.root], mode)
        if mode == "sweep":
            assert run.sae_fpath.read_bytes() == alone[0].sae_fpath.read_bytes()
        else:
            _assert_close(_state(alone[0]), _state(run))
    (run,) = _runs(tmp_path / "killed", shards, arch="topk", n_epochs=3)
    job = start_ranks(4, _cli_train, [run.root], "--parallel", mode, "--checkpoint-every", "40")
    _wait_for(lambda: resume.resume_info(run) is not None, job)
    job.kill(2)
    codes = job.wait(HANG_SEC)
    assert codes[2] == -signal.SIGKILL and all(codes[r] == 0 and job.result(r) == 1 for r in (0, 1, 3)), codes
    for r in (0, 1, 3):
        (line,) = [x for x in job.stderr(r).splitlines() if "error" in x]
        assert f"rank {r}: rank 2 is gone" in line, line
    assert not run.sae_fpath.exists()


@pytest.mark.slow
def test_torchrun_starts_saeflow_train_with_run_dir(tmp_path, shards):
    """The torchrun line of docs/distributed.md: `torchrun --standalone --nproc-per-node 2 -m saeflow train --run-dir
    R ...` trains a 2-run pass in sweep mode, to the bytes of each run alone."""
    two = _runs(tmp_path / "two", shards, seeds=(0, 1), arch="topk")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "workflow"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "saeflow",
            "train", *(a for r in two for a in ("--run-dir", str(r.root))), "--device", "cpu", "--parallel", "sweep",
            "--buffer-bytes", POOL]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG_SEC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = _runs(tmp_path / "alone", shards, seeds=(0, 1), arch="topk")
    _train([r.root for r in alone], "sweep")
    for a, b in zip(two, alone):
        assert a.sae_fpath.read_bytes() == b.sae_fpath.read_bytes()


@pytest.mark.parametrize("d", [7, 8, 16, 20, 768])
def test_each_rank_draws_its_rows_of_the_one_process_decoder_init(monkeypatch, d):
    """The decoder's random rows, drawn in chunks up to a rank's last row (sae.randn_rows), are exactly the rows
    of one `torch.randn(d_sae, d)` draw: for any width, chunk size and latent range (tails under 16 values too)."""
    n_rows = 37
    whole = torch.randn(n_rows, d, generator=torch.Generator().manual_seed(5))
    for chunk_elems in (16, 3 * d, 1 << 20):
        monkeypatch.setattr("saeflow.training.sae.RANDN_CHUNK_ELEMS", chunk_elems)
        for lo, hi in ((0, n_rows), (0, 5), (5, 19), (19, n_rows), (36, 37)):
            assert torch.equal(randn_rows(5, n_rows, d, lo, hi), whole[lo:hi]), (chunk_elems, lo, hi)


def test_a_resumed_run_keeps_the_pool_it_started_with(tmp_path, shards, capsys, monkeypatch):
    """resume.pt records the pool, which a resumed pass takes over whatever `buffer_bytes` now says; a resume.pt of
    the loader before pools were recorded gets that loader's fixed 1 GiB. `--nodes` needs a Slurm allocation."""
    (run,) = _runs(tmp_path, shards, arch="topk")
    _train([run.root], "sweep", max_steps=5)
    group = [(run, specs.TrainConfig.from_dict(run.config(), "r"))]
    alone = distributed.Comm.alone(torch.device("cpu"))
    assert resume.resume_info(run) == (5, 300)  # POOL: 300 rows
    assert memory.pool_bytes(group, "auto", "sweep", shards, alone) == 300 * 64
    state = torch.load(run.resume_fpath, weights_only=True)
    del state["pool_rows"]
    torch.save(state, run.resume_fpath)
    assert memory.pool_bytes(group, "8M", "sweep", shards, alone) == 1 << 30
    run.resume_fpath.unlink()
    assert memory.pool_bytes(group, "8M", "sweep", shards, alone) == 8 << 20
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert cli.main(["train", "--run", str(run.root), "--nodes", "2"]) == 1
    assert "--nodes 2: ranks on several nodes are started with srun inside a Slurm" in capsys.readouterr().err


def _loss_with_an_empty_slice(name: str) -> float:
    """One data-parallel loss of a batch of one vector on two ranks: rank 0's slice is empty."""
    from saeflow.training.ranks.dataparallel import data_parallel_loss
    from test_archs import _random_sae, _train_config

    comm = distributed.init("cpu")
    cfg = _train_config(name, k=4, aux_k=8)  # at its defaults: JumpReLU's and Gated's target loss
    sae = _random_sae(cfg)
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)  # AuxK's collective runs too
    x_bd = torch.randn(1, 16, generator=torch.Generator().manual_seed(1))[: comm.rank]  # rank 0: no row
    loss = data_parallel_loss(objectives.Objective(cfg, 100), sae, x_bd, 1, 90, dead, comm)
    total = float(comm.all_reduce(loss.total.detach().reshape(1))[0])
    comm.close()
    return total


@pytest.mark.parametrize("name", ["jumprelu", "gated", "relu"])
def test_a_rank_with_no_row_of_the_last_batch_joins_every_collective_of_the_loss(name):
    """A last batch smaller than the world leaves a rank without rows; it still joins each all-reduce the others'
    loss makes (the target loss's batch mean, AuxK's residual energy), so the step neither hangs nor pairs one
    rank's sum with another's, and the loss is the one process's."""
    from test_archs import _random_sae, _train_config

    cfg = _train_config(name, k=4, aux_k=8)
    sae = _random_sae(cfg)
    dead = objectives.DeadLatents(sae.d_sae, 1, torch.device("cpu"))
    dead.since_fired_s.fill_(5)
    x_bd = torch.randn(1, 16, generator=torch.Generator().manual_seed(1))
    alone = float(objectives.Objective(cfg, 100)(sae, x_bd, 90, dead).total.detach())
    totals = run_ranks(2, _loss_with_an_empty_slice, name)
    assert totals[0] == totals[1] and abs(totals[0] - alone) <= 1e-5 * max(1.0, abs(alone)), (totals, alone)
