"""A transcoder's batches: (input rows, target rows) of the same tokens, from two shard directories.

The shuffled loader pairs them itself (`ShuffledLoader(target_dir=...)`: one plan, one pool slot per pair). The ordered
pass (validation, inference) reads both directories in storage order, batch by batch (`PairedOrderedLoader`). A
batch is a tensor (an SAE's) or a (input, target) tuple (a transcoder's); `split`, `to_device` and `n_rows` read both.
"""

import typing

import torch

from saeflow.errors import SaeflowError
from saeflow.store.shards import ShardDir
from saeflow.training.loaders.ordered import OrderedLoader
from saeflow.training.loaders.view import DEFAULT_BLOCK_BYTES, paired_view

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def split(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(inputs, targets); targets None for an SAE's batch."""
    return (batch[0], batch[1]) if isinstance(batch, tuple) else (batch, None)


def parts(batch: Batch) -> tuple[torch.Tensor, ...]:
    """(inputs,) for an SAE's batch, (inputs, targets) for a transcoder's."""
    return batch if isinstance(batch, tuple) else (batch,)


def to_device(batch: Batch, device: torch.device, dtype: torch.dtype = torch.float32) -> Batch:
    """The batch (each of its tensors) on `device` as `dtype` (blocking: the loader may recycle its buffers)."""
    if isinstance(batch, tuple):
        return tuple(t.to(device, dtype) for t in batch)
    return batch.to(device, dtype)


def n_rows(batch: Batch) -> int:
    return split(batch)[0].shape[0]


def head(batch: Batch, n: int) -> Batch:
    """The first `n` rows of a batch (of both tensors of a pair)."""
    return tuple(t[:n] for t in batch) if isinstance(batch, tuple) else batch[:n]


def copy(batch: Batch) -> Batch:
    """The batch's own copy (of a borrowed view into a loader's reused buffer)."""
    return tuple(t.clone() for t in batch) if isinstance(batch, tuple) else batch.clone()


def cat(batches: list[Batch]) -> Batch:
    """Batches joined row-wise (pairs stay pairs)."""
    if batches and isinstance(batches[0], tuple):
        return tuple(torch.cat(part) for part in zip(*batches))
    return torch.cat(batches)


class PairedOrderedLoader:
    """Every (input, target) pair of one layer in storage order: two ordered loaders over directories whose
    examples, tokens and shards line up (`paired_view` refuses others in one line), cut into the same batches."""

    def __init__(self, shard_dir: ShardDir, target_dir: ShardDir, layer: int, batch_size: int, tokens: str = "content",
                 block_bytes: int = DEFAULT_BLOCK_BYTES, borrowed: bool = False):  # fmt: skip
        self.inputs = OrderedLoader(shard_dir, layer, batch_size, tokens, block_bytes, borrowed)
        paired_view(self.inputs.view, target_dir).close()  # the pairing check, before any read
        self.targets = OrderedLoader(target_dir, layer, batch_size, tokens, block_bytes, borrowed)
        self.batch_size = batch_size

    @property
    def n_vectors(self) -> int:
        return self.inputs.n_vectors

    def __len__(self) -> int:
        return len(self.inputs)

    def iter_batches(self, epoch: int = 0, start_batch: int = 0) -> typing.Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) batches from `start_batch`, the same rows of both."""
        inputs = self.inputs.iter_batches(epoch, start_batch)
        targets = self.targets.iter_batches(epoch, start_batch)
        for x_bd, y_bd in zip(inputs, targets, strict=True):
            if x_bd.shape[0] != y_bd.shape[0]:
                raise SaeflowError("paired loader: input and target batches differ in rows (directories changed?)")
            yield x_bd, y_bd

    __iter__ = iter_batches

    def close(self) -> None:
        self.inputs.close()
        self.targets.close()


def ordered_loader(shard_dir: ShardDir, target_dir: ShardDir | None, layer: int, batch_size: int, tokens: str,
                   borrowed: bool = False):  # fmt: skip
    """The ordered pass over an SAE's vectors, or over a transcoder's pairs (`target_dir` given)."""
    if target_dir is None:
        return OrderedLoader(shard_dir, layer, batch_size, tokens=tokens, borrowed=borrowed)
    return PairedOrderedLoader(shard_dir, target_dir, layer, batch_size, tokens=tokens, borrowed=borrowed)
