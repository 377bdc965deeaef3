"""Training on several ranks (`train.parallel`): which mode a pass uses, how large its pool is, and the loop.

A pass is the runs that read identical batches (saeflow.training.train). On N ranks it trains in one of three modes:

    sweep    its runs are spread over the ranks (run i on rank i mod N); every rank sees every batch, so each
             checkpoint is byte-identical to training that run alone (at the same per-process thread count)
    data     each run on every rank, each global batch split across them (saeflow.training.ranks.dataparallel)
    latents  each run's latents split across the ranks (saeflow.training.ranks.sharded)
    auto     latents when one SAE's training state would not fit in DEVICE_FRACTION of one device; else sweep when
             the pass has at least N runs; else data

In every mode the batches are the one-process batches (ranks.distloader: the pool is the job's, each rank
holds 1/N of it), a checkpoint is whole at one step on every rank, and a stop signal on any rank stops them all at the
same step: every rank saves, then every rank stops. Nothing is published until every rank has trained the pass to its
end. Rank 0 takes the runs' locks, plans, and prints the results.
"""

import contextlib
import typing

import torch
import tqdm

from saeflow import preempt
from saeflow.errors import SaeflowError
from saeflow.store import runs
from saeflow.store.shards import ShardDir
from saeflow.training import archs, loaders, memory, train
from saeflow.training.ranks.dataparallel import DataParallelTrainer
from saeflow.training.ranks.distloader import DistributedShuffledLoader
from saeflow.training.ranks.distributed import Comm
from saeflow.training.ranks.sharded import ShardedTrainer
from saeflow.training.specs import TrainConfig

DEVICE_FRACTION = 0.5  # auto: latent sharding when one SAE's training state needs more of a device than this
_SIGNAL_CODES = {sig.name: code for code, sig in enumerate(preempt.RANK_SIGNALS, start=1)}


def device_bytes(comm: Comm) -> int:
    """The memory of this rank's device: its GPU's, or its share of the job's RAM."""
    if comm.device.type == "cuda":
        return torch.cuda.get_device_properties(comm.device).total_memory
    return memory.job_memory()[0] // comm.local_world_size


def choose_mode(setting: str, n_runs: int, world_size: int, sae_state_bytes: int, dev_bytes: int) -> str:
    if setting != "auto":
        return setting
    if sae_state_bytes > DEVICE_FRACTION * dev_bytes:
        return "latents"
    return "sweep" if n_runs >= world_size else "data"


def join(device: str) -> Comm:
    """This process's Comm (saeflow.training.ranks.distributed.init): a rank of the job when a launcher made it one."""
    from saeflow.training.ranks import distributed

    return distributed.init(device)


def train_runs(comm: Comm, run_paths: typing.Sequence, settings: train.TrainSettings) -> list[dict]:
    """train.train_runs on the ranks of `comm` (every rank calls it with the same arguments, through entry); the
    results of the runs published, on rank 0 (an empty list elsewhere)."""
    opened: dict[str, runs.Run] = {}
    planned: list[str] = []  # the runs this job trains: those of them with a sae.pt are published

    def published() -> list[str]:
        return [root for root in planned if opened[root].sae_fpath.exists()]

    try:
        with preempt.as_rank(), comm.guard(published), contextlib.ExitStack() as locks:
            opened.update((str(run.root), run) for run in map(runs.open_run, run_paths))
            passes = comm.on_root(lambda: _plan_passes(opened, settings.runs_per_pass, locks))
            planned += [root for members in passes for root, _ in members]
            results = []
            for members in passes:
                group = [(opened[root], TrainConfig.from_dict(cfg, root)) for root, cfg in members]
                results += _train_pass(comm, group, settings)
            gathered = comm.gather_objects(results)
            return [r for part in gathered for r in part] if comm.is_root else []
    finally:
        comm.close()


def _plan_passes(opened: dict[str, runs.Run], runs_per_pass: int, locks: contextlib.ExitStack) -> list[list]:
    """On rank 0: lock every run (held until the job ends), finish interrupted publishes, and cut the untrained
    runs into passes (as train.train_runs does), each a list of (run root, config dict)."""
    from saeflow.store import atomic

    for key in sorted(opened):
        locks.enter_context(atomic.exclusive_lock(opened[key].lock_fpath))
    todo: dict[tuple, list] = {}
    for root, run in opened.items():
        if train.Checkpoint(run).finish_pending():
            train.logger.info("%s: already trained (%s exists)", run.root, run.sae_fpath)
            continue
        cfg = TrainConfig.from_dict(run.config(), str(run.config_fpath))
        todo.setdefault(cfg.loader_key(), []).append((root, cfg.to_dict()))
    return [group[i : i + runs_per_pass] for group in todo.values() for i in range(0, len(group), runs_per_pass)]


def _make_trainers(mode: str, comm: Comm, group, val_dirs, d_model: int, n_steps: int, d_out: int) -> list[tuple]:
    """(trainer, validation shards) of each run this rank trains: its share of the pass (sweep), or every run
    (`d_out`: a transcoder's target width)."""
    members = list(zip(group, val_dirs))
    if mode == "sweep":
        mine = members[comm.rank :: comm.world_size]
        return [(train.Trainer(run, cfg, d_model, n_steps, comm.device, d_out), val_dir)
                for (run, cfg), val_dir in mine]  # fmt: skip
    if mode == "data":
        return [(DataParallelTrainer(comm, run, cfg, d_model, n_steps, comm.device, d_out), val_dir)
                for (run, cfg), val_dir in members]  # fmt: skip
    return [(ShardedTrainer(comm, run, cfg, d_model, n_steps, comm.device, d_out), val_dir)
            for (run, cfg), val_dir in members]  # fmt: skip


def _restore(t) -> bool:
    return t.restore() if hasattr(t, "restore") else t.checkpoint.restore(t)


def _save(t) -> None:
    t.save_resume() if hasattr(t, "save_resume") else t.checkpoint.save(t.state_dict())


def _writes(t) -> bool:
    return getattr(t, "writes", True)


def _train_pass(comm: Comm, group: list[tuple[runs.Run, TrainConfig]], settings: train.TrainSettings) -> list[dict]:
    """One pass on every rank: the same batches everywhere, each rank training its trainers; see the module doc."""
    cfg0 = group[0][1]
    dev_bytes = device_bytes(comm)
    train_dir = train._open_shards(group[0][0], runs.Run.TRAIN_SHARDS)
    d_model = train_dir.metadata.d_model
    biggest = max(memory.state_bytes(cfg, d_model) for _, cfg in group)
    mode = comm.on_root(lambda: choose_mode(settings.parallel, len(group), comm.world_size, biggest, dev_bytes))
    for run, cfg in group:  # an architecture trains in the modes it names (training/archs), or is refused here
        archs.check_mode(cfg.arch, mode, f"{run.config_fpath}: arch", cfg.transcoder, cfg)
    pool = memory.pool_bytes(group, settings.buffer_bytes, mode, train_dir, comm)

    def make_loader(shard_dir: ShardDir, cfg: TrainConfig, target_dir: ShardDir | None):
        return DistributedShuffledLoader(comm, shard_dir, cfg.layer, cfg.batch_size, cfg.data_seed, tokens=cfg.tokens,
                                         buffer_bytes=pool, target_dir=target_dir)  # fmt: skip

    loader, val_dirs = train._open_data(group, settings.local_copy, make_loader)
    n_steps = -(-cfg0.n_train_vectors // cfg0.batch_size) if cfg0.n_train_vectors else cfg0.n_epochs * len(loader)
    here = loader.rank_plan(0)
    train.logger.info("pass of %d run(s) on %d ranks: %s mode, pool of %d rows (%d here)", len(group),
                      comm.world_size, mode, here.plan.n_pool, here.n_pool)  # fmt: skip
    pairs = _make_trainers(mode, comm, group, val_dirs, d_model, n_steps, loader.views[-1].d_model)
    for t, _ in pairs:
        t.pool_rows = loader.n_pool
    fresh = [t for t, _ in pairs if not _restore(t)]
    if comm.any_true(bool(fresh)):
        init_nd = train._first_vectors(loader, train.N_INIT_VECTORS)  # every rank takes part: the batches are shared
        for t in fresh:
            if _writes(t):
                t.checkpoint.restart_log()
            t.init_from_data(*loaders.pairs.parts(init_nd))
    start = comm.min_int(min((t.step for t, _ in pairs), default=n_steps))
    stop = n_steps if settings.max_steps is None else min(n_steps, start + settings.max_steps)
    with contextlib.ExitStack() as trackers:
        for t, _ in pairs:
            if _writes(t):
                t.tracker = train.tracking.open_tracker(settings.tracking, t.run, t.step)
                trackers.callback(t.tracker.close)
        stop, stopped_by = _run_steps(comm, [t for t, _ in pairs], loader, start, stop, settings.checkpoint_every,
                                      mode == "data")  # fmt: skip
        loader.close()
        if stop < n_steps:
            for t, _ in pairs:
                _save(t)
            if stopped_by:
                raise SaeflowError(f"stopped by {stopped_by}: resume checkpoints saved at step {stop} of {n_steps}; "
                                   "rerun to resume from there")  # fmt: skip
            return []
        comm.barrier()  # every rank trained the pass to its end: only now is anything published
        finished = [(t, t.finish(val_dir)) for t, val_dir in pairs]
    return [{"run": str(t.run.root), **result} for t, result in finished if result is not None]


def _stop_requested(comm: Comm) -> str | None:
    """A stop signal received by any rank, as "SIGUSR1 on rank 1" (every rank gets the same answer)."""
    name = preempt.received()
    flag = torch.tensor([_SIGNAL_CODES.get(name, 0), comm.rank + 1 if name else 0], device=comm.device)
    code, rank = (int(v) for v in comm.all_reduce(flag, "max"))
    if not code:
        return None
    names = {c: n for n, c in _SIGNAL_CODES.items()}
    return f"{names[code]} on rank {rank - 1}" if comm.distributed else names[code]


def _run_steps(comm: Comm, trainers: list, loader, start: int, stop: int, checkpoint_every: int, slices: bool):
    """Steps `start..stop-1` on every rank (train._run_steps, with the stop signal agreed on after each step), on
    whole batches, or on each rank's slice of them (`slices`: data parallelism). Returns (the step reached, the stop
    signal that ended the pass early, or None)."""
    per_epoch = len(loader)
    bar = tqdm.tqdm(total=(stop - start) * loader.batch_size, unit="vec", unit_scale=True,
                    desc=f"train x{len(trainers)} on {comm.world_size} ranks", disable=not comm.is_root)  # fmt: skip
    step, stopped_by = start, None
    try:
        while step < stop:
            epoch, batch_idx = divmod(step, per_epoch)
            if slices:  # data parallelism: each rank receives only the rows it trains on
                batches = loader.iter_slices(epoch, batch_idx)
            else:
                batches = ((batch, loaders.pairs.n_rows(batch)) for batch in loader.iter_batches(epoch, batch_idx))
            for x_nd, batch_size in batches:  # a transcoder's: (inputs, targets)
                x_nd = loaders.pairs.to_device(x_nd, comm.device)
                for t in trainers:
                    if t.step == step:
                        t.train_slice(x_nd, batch_size) if slices else t.train_step(x_nd)
                        if t.step % checkpoint_every == 0 and t.step < t.n_steps:
                            _save(t)
                step += 1
                bar.update(batch_size)
                if trainers and trainers[0].last and step % train.LOG_EVERY == 0:
                    last = trainers[0].last
                    bar.set_postfix(loss=f"{last['loss']:.4g}", L0=f"{last['l0']:.1f}", NMSE=f"{last['nmse']:.3f}")
                stopped_by = _stop_requested(comm)
                if stopped_by:
                    stop = step
                if step >= stop:
                    break
    finally:
        bar.close()
    return stop, stopped_by
