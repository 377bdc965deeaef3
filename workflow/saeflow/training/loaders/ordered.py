"""The ordered loader (inference, validation): every vector of one layer in storage order, read ahead by two threads."""

import dataclasses
import queue
import threading
import typing

import numpy as np
import torch

from saeflow.errors import SaeflowError
from saeflow.store.shards import ShardDir
from saeflow.training.loaders.view import DEFAULT_BLOCK_BYTES, Block, LayerView


@dataclasses.dataclass(frozen=True)
class Window:
    """The unit read at once by the ordered pipeline: one block."""

    blocks: tuple[Block, ...]  # read one after another
    n_rows: int  # selected rows in them (examples x selected tokens)


class _Stopped(Exception):
    """The consumer went away; pipeline threads unwind."""


class _Stoppable:
    """Pipeline threads wait on queues but give up when `stop` is set."""

    stop: threading.Event

    def _take(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                pass
        raise _Stopped

    def _wait(self, cond: threading.Condition, ready: typing.Callable[[], bool]) -> None:
        with cond:
            while not ready():
                if self.stop.is_set():
                    raise _Stopped
                cond.wait(0.05)


def _read_window(view: LayerView, window: Window, out_nd: np.ndarray) -> None:
    """A window's blocks one after another, `span` rows per example as `read_block` lays them out."""
    row = 0
    for block in window.blocks:
        n = block.n_ex * view.span
        view.read_block(block, out_nd[row : row + n])
        row += n


def _select_rows(view: LayerView, window: Window, raw_nd: np.ndarray, out_nd: torch.Tensor) -> None:
    """Copy the window's selected rows of `raw_nd` (CLS or special tokens dropped) into `out_nd`."""
    selected, n_raw = [], 0
    for block in window.blocks:
        selected.append(view.selected_rows(block) + n_raw)
        n_raw += block.n_ex * view.span
    src = torch.from_numpy(raw_nd[:n_raw])
    torch.index_select(src, 0, torch.cat(selected), out=out_nd[: window.n_rows])


class _Pipeline(_Stoppable):
    """One ordered pass over a list of windows (blocks), read ahead of the consumer by two background threads.

    reader thread:   preads a window's blocks into a raw buffer (2 in rotation)
    shuffler thread: copies the selected rows (CLS dropped) into an output buffer (3 in rotation: the consumer may
                     still hold batches of the previous window while the next one is being filled)
    Ordered windows whose rows read are exactly the rows selected skip the copy: they go straight to an output buffer.
    Buffers travel along queues, so each is owned by one stage at a time.
    """

    def __init__(
        self,
        view: LayerView,
        windows: list[Window],
        raw_nds: list[np.ndarray],
        out_nds: list[torch.Tensor],
    ):
        self.view, self.windows = view, windows
        self.raw_free: queue.Queue = queue.Queue()
        self.out_free: queue.Queue = queue.Queue()
        for buf in raw_nds:
            self.raw_free.put(buf)
        for buf in out_nds:
            self.out_free.put(buf)
        self.read_q: queue.Queue = queue.Queue()  # (window, raw buffer or None, output buffer or None)
        self.out_q: queue.Queue = queue.Queue()  # (output buffer, rows), then None or the error that ended the pass
        self.stop = threading.Event()

    def _reader(self) -> None:
        windows = self.windows
        try:
            for i, window in enumerate(windows):
                for block in windows[i + 1].blocks if i + 1 < len(windows) else ():
                    self.view.prefetch(block)
                if self.view.compact:
                    out = self._take(self.out_free)
                    _read_window(self.view, window, out.numpy())
                    self.read_q.put((window, None, out))
                else:
                    raw = self._take(self.raw_free)
                    _read_window(self.view, window, raw)
                    self.read_q.put((window, raw, None))
            self.read_q.put(None)
        except _Stopped:
            pass
        except BaseException as err:  # surfaced in the consumer
            self.read_q.put(err)

    def _shuffler(self) -> None:
        try:
            while (item := self._take(self.read_q)) is not None and not isinstance(item, BaseException):
                window, raw, out = item
                if raw is not None:
                    out = self._take(self.out_free)
                    _select_rows(self.view, window, raw, out)
                    self.raw_free.put(raw)
                self.out_q.put((out, window.n_rows))
            self.out_q.put(item)
        except _Stopped:
            pass
        except BaseException as err:
            self.out_q.put(err)

    def __iter__(self) -> typing.Iterator[torch.Tensor]:
        """Each window's rows (n_rows, D); the threads stop when the consumer stops iterating."""
        threads = [
            threading.Thread(target=target, name=f"saeflow-{name}", daemon=True)
            for name, target in (("reader", self._reader), ("shuffler", self._shuffler))
        ]
        for thread in threads:
            thread.start()
        in_use: list[torch.Tensor] = []
        try:
            while (item := self.out_q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                out, n_rows = item
                in_use.append(out)
                if len(in_use) > 2:  # the consumer no longer holds batches of the window before the last
                    self.out_free.put(in_use.pop(0))
                yield out[:n_rows]
        finally:
            self.stop.set()
            for thread in threads:
                thread.join()


def _cut_batches(
    windows_rows: typing.Iterable[torch.Tensor], batch_size: int, skip: int, borrowed: bool = False
) -> typing.Iterator[torch.Tensor]:
    """Batches of `batch_size` rows (the last one may be smaller) across window boundaries, after `skip` rows.

    Batches inside a window are copied out of it, or with `borrowed` are views of it; a batch spanning windows is
    copied together either way (the window may be recycled before the batch is full).
    """
    carry: list[torch.Tensor] = []
    n_carry = 0
    for rows in windows_rows:
        rows, skip = rows[skip:], 0
        if n_carry:
            need = batch_size - n_carry
            carry.append(rows[:need].clone())
            rows = rows[need:]
            n_carry += carry[-1].shape[0]
            if n_carry < batch_size:
                continue
            yield torch.cat(carry)
            carry, n_carry = [], 0
        n_full = rows.shape[0] // batch_size * batch_size
        for i in range(0, n_full, batch_size):
            yield rows[i : i + batch_size] if borrowed else rows[i : i + batch_size].clone()
        if n_full < rows.shape[0]:
            carry, n_carry = [rows[n_full:].clone()], rows.shape[0] - n_full
    if n_carry:
        yield torch.cat(carry)


class _StreamLoader:
    """Batches cut from windows of blocks (the subclass lists them), read by a `_Pipeline` into reused buffers.

    Each batch is the caller's own tensor unless `borrowed`: then it is a view into one of 3 reused buffers, valid
    only until the second next batch is requested (`torch.cat(list(loader))` would then hold overwritten rows). Only
    callers that finish with a batch before asking for the one after next borrow (inference, evaluation,
    validation); the copy costs what `benchmarks/bench_loader.py --ordered` measures."""

    N_RAW, N_OUT = 2, 3  # raw and output buffers in rotation (see `_Pipeline`)

    def __init__(self, view: LayerView, batch_size: int, block_bytes: int, borrowed: bool = False):
        if batch_size < 1:
            raise SaeflowError(f"batch_size must be positive, got {batch_size}")
        self.view, self.batch_size, self.borrowed = view, batch_size, borrowed
        self.block_list = view.blocks(block_bytes)
        max_ex = max(b.n_ex for b in self.block_list)  # a window is one block
        self.max_window_ex = max_ex
        self._raw: list[np.ndarray] = []
        self._out: list[torch.Tensor] = []

    @property
    def n_vectors(self) -> int:
        return self.view.n_vectors

    def __len__(self) -> int:
        return -(-self.n_vectors // self.batch_size)

    def _windows(self, epoch: int) -> list[Window]:
        raise NotImplementedError

    def _allocate(self, need_raw: bool) -> None:
        d, dtype = self.view.d_model, self.view.dtype
        if need_raw and not self._raw:
            self._raw = [np.empty((self.max_window_ex * self.view.span, d), dtype=dtype) for _ in range(self.N_RAW)]
        if not self._out:
            shape = (self.max_window_ex * self.view.n_tok, d)
            self._out = [torch.from_numpy(np.empty(shape, dtype=dtype)) for _ in range(self.N_OUT)]

    def iter_windows(self, windows: list[Window]) -> typing.Iterator[torch.Tensor]:
        """Each window's rows (n_rows, D), read and permuted ahead of the consumer by background threads."""
        direct = self.view.compact  # ordered windows go straight into an output buffer
        self._allocate(not direct)
        yield from _Pipeline(self.view, windows, self._raw, self._out)

    def iter_batches(self, epoch: int = 0, start_batch: int = 0) -> typing.Iterator[torch.Tensor]:
        """Batches (batch_size, D) (the last one may be smaller) from `start_batch` of `epoch`: the caller's own
        tensors, or views into reused buffers when `borrowed` (valid until the second next batch is requested).
        """
        windows = self._windows(epoch)
        skip = start_batch * self.batch_size
        while windows and skip >= windows[0].n_rows:
            skip -= windows[0].n_rows
            windows = windows[1:]
        yield from _cut_batches(self.iter_windows(windows), self.batch_size, skip, self.borrowed)

    __iter__ = iter_batches

    def close(self) -> None:
        self.view.close()


class OrderedLoader(_StreamLoader):
    """Every vector of one layer in storage order (global index 0, 1, ...), for inference."""

    def __init__(
        self,
        shard_dir: ShardDir,
        layer: int,
        batch_size: int,
        tokens: str = "content",
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        borrowed: bool = False,
    ):
        super().__init__(LayerView(shard_dir, layer, tokens), batch_size, block_bytes, borrowed)

    def _windows(self, epoch: int) -> list[Window]:
        return [Window((b,), self.view.n_rows(b)) for b in self.block_list]
