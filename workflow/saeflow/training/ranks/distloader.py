"""The shuffled loader across ranks: one global plan, each rank holding part of the pool, every batch gathered.

Every rank walks the same `EpochPlan` (a pure function of seed, epoch and sizes), whose pool is the pool of the whole
job: rank r holds the pool slots [r P/N, (r+1) P/N) and reads only the stream rows that land there (`RankPlan`), so
the ranks' pools add up and each vector is read once per epoch in total. For each batch a rank gathers, in batch
order, the rows its slots hold; `DistributedShuffledLoader` then all-gathers the parts and puts every row back at its
place in the batch. So every rank gets the batches one process with the same pool would get, row for row: each
vector exactly once per epoch, the same contents in the same order (tests/test_distributed.py).
"""

import collections
import typing

import numpy as np
import torch

from saeflow.training.loaders.shuffled import EpochPlan, ShuffledLoader, _ReservoirPipeline
from saeflow.training.ranks.distributed import Comm


class RankStep(typing.NamedTuple):
    """One rank's part of a `loaders.Step`: the slots are this rank's own (0-based), in batch order."""

    slots: np.ndarray  # local slots gathered into the batch part
    rows: np.ndarray  # the stream rows they hold
    refill_slots: np.ndarray  # a prefix of `slots`: those refilled after the gather
    refill_rows: np.ndarray  # the stream rows read into them (ascending)


class RankPlan:
    """Rank `rank`'s part of a global `EpochPlan`: its pool slots, and what to gather and read for each batch.

    The refilled slots of a global step are its first k gathered slots, so a rank's refilled slots are a prefix of
    its gathered ones, as the two-worker pipeline expects (`loaders._ReservoirPipeline`). `owners` receives, batch by
    batch, which rank holds each row of the batch (the consumer needs it to put the gathered parts in place).
    """

    def __init__(self, plan: EpochPlan, rank: int, world_size: int):
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.bounds = np.array([r * plan.n_pool // world_size for r in range(world_size + 1)], dtype=np.int64)
        self.lo = int(self.bounds[rank])
        self.n_pool = int(self.bounds[rank + 1]) - self.lo  # the pool rows this rank holds
        self.blocks, self.row_starts_b, self.batch_size = plan.blocks, plan.row_starts_b, plan.batch_size
        self.owners: collections.deque = collections.deque()

    def owner(self, slots: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, slots, side="right") - 1

    def steps(self, start_batch: int = 0) -> typing.Iterator:
        """This rank's pool load (slots, rows), then one RankStep per batch (the plan's `steps`, filtered)."""
        items = self.plan.steps(start_batch)
        load = next(items, None)
        if load is not None:
            slots, rows = load
            mine = self.owner(slots) == self.rank
            yield slots[mine] - self.lo, rows[mine]
        for step in items:
            owner_b = self.owner(step.slots)
            mine = owner_b == self.rank
            k = step.refill_slots.size
            self.owners.append(owner_b)
            yield RankStep(step.slots[mine] - self.lo, step.rows[mine], step.refill_slots[mine[:k]] - self.lo,
                           step.refill_rows[mine[:k]])  # fmt: skip


class DistributedShuffledLoader(ShuffledLoader):
    """`ShuffledLoader` whose pool (`buffer_bytes`: the whole job's) is spread over the ranks of `comm`; every
    rank iterates the same global batches, as tensors on `comm.device`."""

    def __init__(self, comm: Comm, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = comm

    def rank_plan(self, epoch: int) -> RankPlan:
        """This rank's part of `plan(epoch)` (the global plan, which `batches()` and the mixing figures read)."""
        return RankPlan(self.plan(epoch), self.comm.rank, self.comm.world_size)

    def _parts(self, epoch: int, start_batch: int) -> typing.Iterator[tuple[torch.Tensor, np.ndarray]]:
        """This rank's part of each batch (its rows, in batch order) and which rank holds each row of the batch."""
        if self._current is not None:
            self._current.close()
        rank_plan = self.rank_plan(epoch)
        self._current = _ReservoirPipeline(self, rank_plan, start_batch)  # reads this rank's part of each batch
        for part_nd in self._current:
            yield part_nd, rank_plan.owners.popleft()

    def iter_batches(self, epoch: int = 0, start_batch: int = 0) -> typing.Iterator[torch.Tensor]:
        """Batches (batch_size, D) on `comm.device` (the last one may be smaller), identical on every rank."""
        for part_nd, owner_b in self._parts(epoch, start_batch):
            yield self._assemble(part_nd, owner_b)

    __iter__ = iter_batches

    def iter_slices(self, epoch: int = 0, start_batch: int = 0) -> typing.Iterator[tuple[torch.Tensor, int]]:
        """(rows [B r/N, B (r+1)/N) of each batch, B) on `comm.device`: rank r receives only the rows of the batch
        it trains on in data parallelism (`rank_slice`), about 1/N of what `iter_batches` moves."""
        for part_nd, owner_b in self._parts(epoch, start_batch):
            yield self._route(part_nd, owner_b), owner_b.size

    def _assemble(self, part_nd, owner_b: np.ndarray):
        """The whole batch from every rank's part (each in batch order), rows back at their places (a pair: both)."""
        if isinstance(part_nd, tuple):
            return tuple(self._assemble(t, owner_b) for t in part_nd)
        comm = self.comm
        counts = np.bincount(owner_b, minlength=comm.world_size).tolist()
        gathered_nd = comm.all_gather_rows(part_nd.to(comm.device), counts)  # rank 0's rows, then rank 1's, ...
        return _in_batch_order(gathered_nd, owner_b)

    def _route(self, part_nd, owner_b: np.ndarray):
        """This rank's slice of the batch: each rank sends every other rank the rows of its part in that rank's slice
        (contiguous in the part, which is in batch order), then the slice's rows are put back in place (a pair:
        both)."""
        if isinstance(part_nd, tuple):
            return tuple(self._route(t, owner_b) for t in part_nd)
        comm, n = self.comm, self.comm.world_size
        bounds = [slice_bounds(owner_b.size, r, n) for r in range(n)]
        dest_b = np.concatenate([np.full(hi - lo, r) for r, (lo, hi) in enumerate(bounds)]).astype(np.int64)
        send = np.bincount(dest_b[owner_b == comm.rank], minlength=n).tolist()
        lo, hi = bounds[comm.rank]
        recv = np.bincount(owner_b[lo:hi], minlength=n).tolist()
        return _in_batch_order(comm.exchange_rows(part_nd.to(comm.device), send, recv), owner_b[lo:hi])


def slice_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank r's rows of a batch in data parallelism: [B r/N, B (r+1)/N)."""
    return batch_size * rank // world_size, batch_size * (rank + 1) // world_size


def _in_batch_order(gathered_nd: torch.Tensor, owner_b: np.ndarray) -> torch.Tensor:
    """Rows received in rank order (each rank's in batch order) put back at their places (`owner_b`: whose each is)."""
    out_nd = torch.empty_like(gathered_nd)
    order = torch.from_numpy(np.argsort(owner_b, kind="stable")).to(gathered_nd.device)
    out_nd[order] = gathered_nd
    return out_nd
