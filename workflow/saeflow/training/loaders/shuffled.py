"""The shuffled loader (training): every vector once per epoch, in an order fixed by (seed, epoch).

Shuffled order is a pure function of (seed, epoch, sizes), computed in index space by `EpochPlan`: the epoch's
blocks are permuted into a stream that refills a RAM pool (`buffer_bytes`, the RAM budget) from which every batch is
drawn uniformly. Batch `b` of an epoch is known without reading batches `0..b-1` (training resumes exactly there).
"""

import dataclasses
import functools
import itertools
import os
import queue
import threading
import typing

import numpy as np
import torch

from saeflow.errors import SaeflowError
from saeflow.store.shards import ShardDir
from saeflow.training.loaders.ordered import _Stoppable, _Stopped
from saeflow.training.loaders.view import DEFAULT_BLOCK_BYTES, Block, LayerView, first_vectors, paired_view

DEFAULT_BUFFER_BYTES = 1 << 30  # the shuffled loader's pool (RAM budget)
MAX_IOV = min(1024, os.sysconf("SC_IOV_MAX"))  # buffers per preadv call (Linux: 1024)
PREFETCH_BLOCKS = 4  # blocks advised (posix_fadvise WILLNEED) ahead of the one being read


@dataclasses.dataclass(frozen=True)
class Step:
    """One batch of a shuffled epoch: the pool slots gathered, and the stream rows read into slots after it."""

    slots: np.ndarray  # (n,) pool slots gathered into the batch, in batch order
    rows: np.ndarray  # (n,) the stream rows those slots hold
    refill_slots: np.ndarray  # (k,) slots refilled after the gather (k = 0 in the final drain)
    refill_row: int  # the first of the k consecutive stream rows read into `refill_slots`

    @property
    def refill_rows(self) -> np.ndarray:
        """(k,) the stream rows read into `refill_slots` (a rank's part of a step lists its own: distloader)."""
        return np.arange(self.refill_row, self.refill_row + self.refill_slots.size)


class EpochPlan:
    """Which vectors each batch of one shuffled epoch holds, in index space: nothing is read to compute it.

    The epoch's blocks are permuted into a stream (rows of a block in storage order). The first `n_pool` stream rows
    fill a pool; each batch then draws `batch_size` slots uniformly from the pool (except the slots refilled after
    the previous batch, whose reads may still be in flight) and those slots are refilled with the next stream rows.
    When the stream ends, the rest of the pool comes out in a uniform random order. Every row enters the pool once
    and leaves it once, so each vector appears exactly once per epoch; the plan is a pure function of
    (seed, epoch, sizes), so batch b is known without reading batches 0..b-1.
    """

    def __init__(
        self,
        block_list: list[Block],
        shard_starts: typing.Sequence[int],
        n_tok: int,
        n_pool: int,
        batch_size: int,
        seed: int,
        epoch: int,
        ex_starts: np.ndarray | None = None,
    ):
        """`shard_starts`: each shard's first example; `n_tok`: vectors per example, unless `ex_starts` gives each
        example's first global vector index (n_ex + 1 entries: examples of different sizes); `n_pool`: pool rows."""
        rng = np.random.default_rng([seed, epoch])
        self.blocks = [block_list[i] for i in rng.permutation(len(block_list))]
        ex_b = np.array([int(shard_starts[b.shard_idx]) + b.ex_start for b in self.blocks], dtype=np.int64)
        n_ex_b = np.array([b.n_ex for b in self.blocks], dtype=np.int64)
        self.global_starts_b = np.asarray(first_vectors(ex_b, n_tok, ex_starts), dtype=np.int64)
        rows_b = first_vectors(ex_b + n_ex_b, n_tok, ex_starts) - self.global_starts_b
        self.row_starts_b = np.concatenate([[0], np.cumsum(rows_b)]).astype(np.int64)  # stream row of each block
        self.n_rows = int(self.row_starts_b[-1])
        self.batch_size = batch_size
        self.n_pool = min(self.n_rows, max(n_pool, 2 * batch_size))
        self.n_batches = -(-self.n_rows // batch_size)
        self._seed = [seed, epoch, 1]

    def global_index(self, rows: np.ndarray) -> np.ndarray:
        """Global vector indices (storage order) of stream rows."""
        block_idx = np.searchsorted(self.row_starts_b, rows, side="right") - 1
        return self.global_starts_b[block_idx] + rows - self.row_starts_b[block_idx]

    def _load(self, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = np.flatnonzero(pool >= 0)
        order = np.argsort(pool[slots], kind="stable")
        return slots[order], pool[slots[order]]

    def steps(self, start_batch: int = 0) -> typing.Iterator[tuple[np.ndarray, np.ndarray] | Step]:
        """First the pool's contents before batch `start_batch` (slots, stream rows ascending), then its Steps."""
        P, bs, N = self.n_pool, self.batch_size, self.n_rows
        rng = np.random.default_rng(self._seed)
        pool = np.arange(P, dtype=np.int64)  # the stream row each slot holds; -1: empty
        slots_p = np.arange(P, dtype=np.int64)  # all slots; the last bs were refilled after the previous batch
        t, pos = 0, P
        while pos < N:
            if t == start_batch:
                yield self._load(pool)
            drawn = rng.choice(P - bs, size=bs, replace=False)
            slots = slots_p[drawn]
            slots_p[drawn] = slots_p[P - bs :]
            slots_p[P - bs :] = slots
            k = min(bs, N - pos)
            rows = pool[slots]
            pool[slots[:k]] = np.arange(pos, pos + k)
            pool[slots[k:]] = -1
            if t >= start_batch:
                yield Step(slots, rows, slots[:k], pos)
            t, pos = t + 1, pos + k
        rest = rng.permutation(np.flatnonzero(pool >= 0))
        for i in range(0, rest.size, bs):
            if t == start_batch:
                yield self._load(pool)
            slots = rest[i : i + bs]
            if t >= start_batch:
                yield Step(slots, pool[slots], slots[:0], N)
            pool[slots] = -1
            t += 1

    def batches(self, start_batch: int = 0) -> typing.Iterator[np.ndarray]:
        """Global vector indices of each batch from `start_batch` (for tests and mixing measurements)."""
        steps = self.steps(start_batch)
        next(steps, None)
        for step in steps:
            yield self.global_index(step.rows)


def _preadv_all(fd: int, iov: list, want: int, offset: int, fpath) -> None:
    """preadv until the `want` bytes of buffers `iov` are full (a regular file returns less only at its end)."""
    while (n := os.preadv(fd, iov, offset)) < want:
        if n == 0:
            raise SaeflowError(f"{fpath}: ended early at byte {offset} (truncated after validation?)")
        offset, want, i = offset + n, want - n, 0
        while n >= len(iov[i]):  # drop the buffers filled, then the filled part of the next
            n, i = n - len(iov[i]), i + 1
        iov = [iov[i][n:], *iov[i + 1 :]]


def _scatter_read(view: LayerView, block: Block, offsets: np.ndarray, slots: np.ndarray, pool: "_Pool") -> None:
    """Read the rows at file `offsets` (ascending, one shard) into pool `slots`: few preadv calls, many buffers.

    Consecutive slots of consecutive rows share a buffer; a small gap in the file (a CLS row between examples) is
    read into `scratch_mv` rather than starting a new call.
    """
    rb = view.row_bytes
    gap = np.diff(offsets) - rb  # bytes skipped between consecutive rows
    new_call = np.concatenate([[True], (gap < 0) | (gap > len(pool.scratch_mv))])
    new_buf = new_call | np.concatenate([[True], (gap != 0) | (np.diff(slots) != 1)])
    seg = np.flatnonzero(new_buf)
    seg_end = np.append(seg[1:], offsets.size)
    bufs = [pool.mv[a:b] for a, b in zip((slots[seg] * rb).tolist(), ((slots[seg] + seg_end - seg) * rb).tolist())]
    seg_gap = np.concatenate([[0], gap])[seg]
    seg_bytes = (seg_end - seg) * rb
    calls = np.flatnonzero(new_call[seg])
    fpath = view.sd.shard_fpath(block.shard_idx)
    fd = view.fd(block.shard_idx)
    per_call = MAX_IOV // 2  # a scratch buffer may precede each
    for c0, c1 in zip(calls.tolist(), np.append(calls[1:], seg.size).tolist()):
        for p0 in range(c0, c1, per_call):
            p1 = min(c1, p0 + per_call)
            iov = bufs[p0:p1]
            for i in reversed(np.flatnonzero(seg_gap[p0 + 1 : p1]).tolist()):
                iov.insert(i + 1, pool.scratch_mv[: seg_gap[p0 + 1 + i]])
            want = int(seg_bytes[p0:p1].sum() + seg_gap[p0 + 1 : p1].sum())
            _preadv_all(fd, iov, want, int(offsets[seg[p0]]), fpath)


class _Staging:
    """A worker's landing buffer for refills into scattered pool slots: one pread of the rows' whole byte range,
    then one numpy row scatter into the pool. That is two native calls where a preadv straight into the slots needs
    a Python buffer object per row, which held the GIL for about a fifth of a steady-state batch. The range's rows
    nobody asked for (the CLS row between two examples) are copied into the worker's own sink row."""

    def __init__(self, n_rows: int, view: LayerView, sink: int):
        self.rows_nd = np.empty((n_rows, view.d_model), dtype=view.dtype)
        self.mv = memoryview(self.rows_nd.reshape(-1).view(np.uint8))
        self.sink = sink


class _Pool:
    """The shuffled loader's rows in RAM, and each worker's staging buffer with its sink row past them."""

    def __init__(self, n_rows: int, view: LayerView, n_workers: int, stage_rows: int):
        self.n_rows = n_rows
        self.rows_nd = np.empty((n_rows + n_workers, view.d_model), dtype=view.dtype)
        self.rows = torch.from_numpy(self.rows_nd)
        self.mv = memoryview(self.rows_nd.reshape(-1).view(np.uint8))
        self.scratch_mv = memoryview(bytearray(max(1, view.n_tok) * view.row_bytes))  # gaps read through (CLS rows)
        self.stages = [_Staging(stage_rows, view, sink=n_rows + w) for w in range(n_workers)]


def _stage_read(view: LayerView, block: Block, offsets: np.ndarray, slots: np.ndarray, pool: _Pool, stage: _Staging):
    """Read the rows at file `offsets` (ascending, one shard, few gaps: `view.contiguous`) into pool `slots`."""
    rb, cap = view.row_bytes, stage.rows_nd.shape[0]
    range_rows = (offsets - offsets[0]) // rb  # each row's place in the byte range from the first
    fpath, fd = view.sd.shard_fpath(block.shard_idx), view.fd(block.shard_idx)
    lo = 0
    while lo < offsets.size:  # a range longer than the staging buffer takes several reads
        hi = lo + int(np.searchsorted(range_rows[lo:], range_rows[lo] + cap))
        n = int(range_rows[hi - 1] - range_rows[lo]) + 1
        dest = np.full(n, stage.sink, dtype=np.int64)
        dest[range_rows[lo:hi] - range_rows[lo]] = slots[lo:hi]
        _preadv_all(fd, [stage.mv[: n * rb]], n * rb, int(offsets[lo]), fpath)
        pool.rows_nd[dest] = stage.rows_nd[:n]  # numpy's row scatter: 1.2-1.3x torch's index_copy_ here
        lo = hi


def _read_rows(
    view: LayerView, plan: EpochPlan, pool: _Pool, stage: _Staging, slots: np.ndarray, rows: np.ndarray, advised: int
) -> int:
    """Read stream `rows` (ascending within a block) into pool `slots`, advising the kernel of the blocks ahead.

    Slots in long runs (the pool's load) are read into directly; scattered ones (a refill) through `stage` where
    the layer's rows lie close together in the file. Returns the last stream block advised (pass it back in: each
    block is advised once).
    """
    if not rows.size:
        return advised
    block_idx = np.searchsorted(plan.row_starts_b, rows, side="right") - 1
    cuts = (np.flatnonzero(np.diff(block_idx)) + 1).tolist()
    for lo, hi in zip([0, *cuts], [*cuts, rows.size]):
        b = int(block_idx[lo])
        for ahead in range(max(advised + 1, b), min(b + PREFETCH_BLOCKS + 1, len(plan.blocks))):
            view.prefetch(plan.blocks[ahead])
            advised = ahead
        block = plan.blocks[b]
        ex, tok = view.tokens_of(block, rows[lo:hi] - plan.row_starts_b[b])
        offsets = view.offset(block.shard_idx, block.ex_start + ex, tok)
        if view.contiguous and 4 * np.count_nonzero(np.diff(slots[lo:hi]) != 1) > hi - lo:
            _stage_read(view, block, offsets, slots[lo:hi], pool, stage)
        else:
            _scatter_read(view, block, offsets, slots[lo:hi], pool)
    return advised


def _one_torch_thread(target: typing.Callable[..., None], *args) -> None:
    """Run `target` with torch's intra-op parallelism off in this thread: the two pipeline threads already use both
    cores of a small machine, and a parallel `index_select` on a busy one ran 4x slower than a serial one. With the
    OpenMP backend the setting is per thread (the caller's training keeps its threads); with others it is global,
    so it is left alone there."""
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(1)
    target(*args)


class _ReservoirPipeline(_Stoppable):
    """One pass of an EpochPlan by two worker threads that split every batch in halves.

    Worker 0 walks the plan and passes each step on to worker 1. For each batch a worker copies its half of
    the batch's slots out of the pool (`torch.index_select`) into the batch's buffer, then preads its half of the
    refill rows into the slots emptied. The plan never draws the slots refilled after the previous batch, so a
    worker gathers batch t+1 while the other may still refill batch t, and waits for that refill before batch t+2
    (in the final drain, which draws from every slot, before t+1). Whichever worker finishes the second half of a
    batch hands it to the consumer. The halves keep the two workers equally busy (the split assumes two workers).
    """

    N_WORKERS = 2
    N_OUT = 4  # batch buffers: the consumer holds two, the workers fill the next two

    def __init__(self, loader: "ShuffledLoader", plan: EpochPlan, start_batch: int):
        self.plan, self.start_batch, self.views = plan, start_batch, loader.views
        self.pools = loader._pools_for(plan.n_pool, self.N_WORKERS)  # one per directory read (input, target)
        self.bufs = loader._batch_bufs(self.N_OUT)  # per batch buffer, one tensor per directory
        self.out_q: queue.Queue = queue.Queue()  # (buffer, rows) in batch order, then None or the error
        self.cond = threading.Condition()
        self.refilled = [0] * self.N_WORKERS  # reads each worker finished: the pool's load, then one per batch
        self.halves: dict[int, int] = {}  # batch -> halves gathered, until both are
        self.released = 0  # batches the consumer no longer holds (their buffers are free for batch + N_OUT)
        self.n_finished = 0  # workers done with the pass
        self.shared_steps: queue.Queue = queue.Queue()  # worker 0's plan items for worker 1; None ends
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _signal(self, worker: int, batch: int | None = None, buf: list | None = None, n: int = 0) -> None:
        """Count a finished read of `worker`, or its half of `batch` (the second half publishes the batch)."""
        with self.cond:
            if batch is None:
                self.refilled[worker] += 1
            elif self.halves.setdefault(batch, 0) + 1 == self.N_WORKERS:
                del self.halves[batch]
                self.out_q.put((buf, n))
            else:
                self.halves[batch] += 1
            self.cond.notify_all()

    def _may_gather(self, other: int, need: int, batch: int) -> bool:
        """The other worker has done `need` reads, and the buffer of `batch` is no longer the consumer's."""
        return self.refilled[other] >= need and self.released > batch - self.N_OUT

    def _steps(self, w: int) -> typing.Iterator:
        """The plan's items (the load, then Steps): worker 0 computes them and passes them on to worker 1."""
        if w == 1:
            while (item := self._take(self.shared_steps)) is not None:
                yield item
            return
        for item in self.plan.steps(self.start_batch):
            self.shared_steps.put(item)
            yield item
        self.shared_steps.put(None)

    def _worker(self, w: int) -> None:
        other = 1 - w
        advised = [-1 if w == 0 else len(self.plan.blocks)] * len(self.views)  # worker 0 advises blocks ahead
        try:
            steps = self._steps(w)
            load = next(steps, None)
            if load is not None:
                part = _half(load[0].size, w)
                _read_each(self, w, load[0][part], load[1][part], advised)
            self._signal(w)
            for t, step in enumerate(steps):
                drain = not step.refill_slots.size
                need = t + 1 if drain else max(t, 1)
                self._wait(self.cond, functools.partial(self._may_gather, other, need, t))
                bufs, n = self.bufs[t % self.N_OUT], step.slots.size
                part = _half(n, w)
                slots = torch.from_numpy(step.slots[part])
                for pool, buf in zip(self.pools, bufs):
                    torch.index_select(pool.rows, 0, slots, out=buf[part])
                self._signal(w, t, bufs, n)
                k = step.refill_slots.size  # the first k of the batch's slots; each worker refills those it emptied
                part = slice(min(part.start, k), min(part.stop, k))
                _read_each(self, w, step.refill_slots[part], step.refill_rows[part], advised)
                self._signal(w)
        except _Stopped:
            return
        except BaseException as err:  # the consumer raises it
            self.out_q.put(err)
            return
        with self.cond:
            self.n_finished += 1
            if self.n_finished == self.N_WORKERS:
                self.out_q.put(None)

    def __iter__(self) -> typing.Iterator[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """Each batch: the input's rows, or (input, target) rows of a paired loader."""
        self.threads = [
            threading.Thread(target=_one_torch_thread, args=(self._worker, w), name=f"saeflow-shuffle{w}", daemon=True)
            for w in range(self.N_WORKERS)
        ]
        for thread in self.threads:
            thread.start()
        try:
            for i in itertools.count():
                if (item := self._take(self.out_q)) is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                bufs, n = item
                yield bufs[0][:n] if len(bufs) == 1 else tuple(buf[:n] for buf in bufs)
                with self.cond:  # asked for batch i + 1, the consumer may still hold batch i but no earlier one
                    self.released = i
                    self.cond.notify_all()
        except _Stopped:
            raise SaeflowError("this pass of the shuffled loader was stopped by a newer pass of it") from None
        finally:
            self.close()

    def close(self) -> None:
        """Stop and join the threads (they touch the loader's shared pool)."""
        self.stop.set()
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join()


def _read_each(pipe: _ReservoirPipeline, w: int, slots: np.ndarray, rows: np.ndarray, advised: list[int]) -> None:
    """Worker `w` reads stream `rows` into pool `slots` of every directory (a pair's rows land in the same slots of
    the input's and the target's pools, so they stay paired)."""
    for i, (view, pool) in enumerate(zip(pipe.views, pipe.pools)):
        advised[i] = _read_rows(view, pipe.plan, pool, pool.stages[w], slots, rows, advised[i])


def _half(n: int, worker: int) -> slice:
    """Worker `worker`'s half of n items (the first half: worker 0)."""
    return slice(0, n // 2) if worker == 0 else slice(n // 2, n)


class ShuffledLoader:
    """Every vector of one layer exactly once per epoch, in a random order fixed by (seed, epoch).

    Batches are drawn uniformly from a pool of `buffer_bytes` of rows (the RAM budget; see EpochPlan), refilled from
    ~`block_bytes` blocks of consecutive examples read in a random order. A pool that holds the whole layer gives
    uniform shuffling; a smaller one mixes less (docs/training.md has the figures).

    With `target_dir` (a transcoder's target: the same examples and tokens at another hook point) every batch is a
    pair (input rows, target rows): row i of both is the same token. The pairs follow one plan, the input's blocks
    read from both directories into the same pool slots, so they mix exactly as the input alone would with a pool of
    as many rows; `buffer_bytes` holds both (rows = buffer_bytes / both rows' bytes). A cross-layer transcoder's
    batches are its layers' inputs and targets (`also`: more (directory, layer) pairs, read the same way), a tuple.
    """

    def __init__(
        self,
        shard_dir: ShardDir,
        layer: int,
        batch_size: int,
        seed: int,
        tokens: str = "content",
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        borrowed: bool = False,
        target_dir: ShardDir | None = None,
        also: typing.Sequence[tuple[ShardDir, int]] = (),
    ):
        if batch_size < 1:
            raise SaeflowError(f"batch_size must be positive, got {batch_size}")
        self.view = LayerView(shard_dir, layer, tokens)
        self.views = [self.view] + ([] if target_dir is None else [paired_view(self.view, target_dir)])
        self.views += [paired_view(self.view, sd, one_layer) for sd, one_layer in also]
        self.batch_size, self.seed, self.borrowed = batch_size, seed, borrowed
        self.block_list = self.view.blocks(block_bytes)
        row_bytes = sum(view.row_bytes for view in self.views)
        self.n_pool = max(1, buffer_bytes // row_bytes)  # rows (EpochPlan keeps >= 2 batches)
        self._pools: list[_Pool] = []
        self._bufs: list[list[torch.Tensor]] = []
        self._current: _ReservoirPipeline | None = None

    @property
    def n_vectors(self) -> int:
        return self.view.n_vectors

    def __len__(self) -> int:
        return -(-self.n_vectors // self.batch_size)

    def plan(self, epoch: int) -> EpochPlan:
        """The index-space schedule of `epoch` (EpochPlan.batches gives each batch's global vector indices)."""
        view = self.view
        return EpochPlan(self.block_list, view.sd.shard_starts, view.n_tok, self.n_pool, self.batch_size, self.seed,
                         epoch, view.ex_starts)  # fmt: skip

    def _pools_for(self, n_rows: int, n_workers: int) -> list[_Pool]:
        if not self._pools or self._pools[0].n_rows != n_rows:
            self._pools = [_Pool(n_rows, view, n_workers, stage_rows=self.batch_size) for view in self.views]
        return self._pools

    def _batch_bufs(self, n: int) -> list[list[torch.Tensor]]:
        if not self._bufs:
            self._bufs = [[torch.from_numpy(np.empty((self.batch_size, view.d_model), dtype=view.dtype))
                           for view in self.views] for _ in range(n)]  # fmt: skip
        return self._bufs

    def iter_batches(self, epoch: int = 0, start_batch: int = 0) -> typing.Iterator[torch.Tensor]:
        """Batches (batch_size, D) (the last one may be smaller) from `start_batch` of `epoch`.

        A batch is the caller's own tensor, or with `borrowed` (the trainer) a view into a reused buffer that stays
        valid until the second next batch is requested. Reading runs ahead in background threads; starting a new pass
        stops an unfinished earlier one of this loader.
        """
        if self._current is not None:
            self._current.close()
        self._current = _ReservoirPipeline(self, self.plan(epoch), start_batch)
        if self.borrowed:
            return iter(self._current)
        return (x.clone() if isinstance(x, torch.Tensor) else tuple(t.clone() for t in x) for x in self._current)

    __iter__ = iter_batches

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
        for view in self.views:
            view.close()
