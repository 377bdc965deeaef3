"""The reader: a validated, read-only view of a published shard directory, memory-mapped shard by shard."""

import os
import pathlib
import typing

import numpy as np

from saeflow.errors import SaeflowError, ShardDirError, unreadable
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import AUX_FILES, Metadata, locate
from saeflow.store.shards.validate import read_json, validate


class ShardDir:
    """A validated, read-only view of a published shard directory, memory-mapped on demand."""

    def __init__(self, dpath: str | os.PathLike):
        self.dpath = pathlib.Path(dpath)
        report = validate(self.dpath)
        if not report.ok:
            raise ShardDirError(self.dpath, report.problems)
        self.layout = ShardLayout(self.dpath)
        self.metadata = Metadata.from_dict(read_json(self.layout.metadata_fpath))
        self.hash = self.dpath.resolve().name
        self.shard_sizes = self.metadata.shard_sizes
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._acts: dict[int, np.memmap] = {}

    @property
    def n_ex(self) -> int:
        return self.metadata.n_ex

    def shard_fpath(self, shard_idx: int) -> pathlib.Path:
        return self.layout.shard_fpath(shard_idx)

    def acts(self, shard_idx: int) -> np.memmap:
        """The memory map of one shard, shape (n_ex_in_shard, L, T, D)."""
        if shard_idx not in self._acts:
            md = self.metadata
            shape = (self.shard_sizes[shard_idx], md.n_layers, md.tokens_per_ex, md.d_model)
            self._acts[shard_idx] = np.memmap(self.shard_fpath(shard_idx), dtype=md.dtype, mode="r", shape=shape)
        return self._acts[shard_idx]

    def vector(self, ex: int, layer: int, token: int) -> np.ndarray:
        """One activation vector (D,) by global example index, layer value and token index."""
        shard_idx, _ = locate(self.metadata, ex, layer, token)
        return np.array(self.acts(shard_idx)[ex - self.shard_starts[shard_idx], self.metadata.layer_idx(layer), token])

    def example(self, ex: int, layer: int) -> np.ndarray:
        """All tokens of one example at one layer, (T, D)."""
        shard_idx, _ = locate(self.metadata, ex, layer, 0)
        return np.array(self.acts(shard_idx)[ex - self.shard_starts[shard_idx], self.metadata.layer_idx(layer)])

    def iter_blocks(self, layer: int, ex_per_block: int = 1024) -> typing.Iterator[tuple[int, np.ndarray]]:
        """(first example index, (n, T, D) array) for one layer, in storage order, never crossing a shard."""
        if ex_per_block < 1:
            raise SaeflowError(f"ex_per_block must be a positive integer, got {ex_per_block}")
        layer_idx = self.metadata.layer_idx(layer)
        for shard_idx, n in enumerate(self.shard_sizes):
            acts = self.acts(shard_idx)
            for start in range(0, n, ex_per_block):
                stop = min(start + ex_per_block, n)
                yield int(self.shard_starts[shard_idx]) + start, np.ascontiguousarray(acts[start:stop, layer_idx])

    def has_aux(self, fname: str) -> bool:
        return self.layout.file(fname).exists()

    def aux(self, fname: str) -> np.memmap:
        """A side file of AUX_FILES: labels (n_ex, P) uint8, tokens (n_ex, T) int32 or classes (n_ex,) int32."""
        spec = AUX_FILES[fname]
        fpath = self.layout.file(fname)
        if not fpath.exists():
            raise SaeflowError(f"{fpath}: this shard directory has no {fname}")
        return np.memmap(fpath, dtype=spec.dtype, mode="r", shape=(self.n_ex, *spec.row_shape(self.metadata)))

    def provenance(self) -> dict | None:
        fpath = self.layout.provenance_fpath
        if not fpath.exists():
            return None
        try:
            return read_json(fpath)
        except OSError as err:
            raise unreadable(fpath, err) from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise SaeflowError(f"{fpath}: unreadable (not valid JSON: {err})") from None


def open_existing(final_dpath: pathlib.Path) -> ShardDir | None:
    """A valid published directory, None if nothing is there; ShardDirError if something broken is there.

    An empty directory counts as nothing (Snakemake creates an output's parent before the job runs); publishing
    replaces it in the same single rename.
    """
    if not os.path.lexists(final_dpath) or (
        final_dpath.is_dir() and os.access(final_dpath, os.R_OK) and not any(final_dpath.iterdir())
    ):
        return None  # an unreadable directory is not "nothing": ShardDir below reports it
    try:
        return ShardDir(final_dpath)
    except ShardDirError as err:
        raise ShardDirError(
            final_dpath,
            err.problems,
            hint="saeflow never rewrites or deletes a published directory; nothing was changed. Check it with "
            f"`saeflow validate {final_dpath}`, then move it away (chmod -R u+w first) to rebuild it.",
        ) from None
