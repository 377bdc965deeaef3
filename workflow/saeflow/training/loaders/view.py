"""Where one layer's vectors live in a shard directory, which tokens are selected, and random access by index.

A shard is (n, L, T, D), so one layer's tokens of one example are a contiguous (T, D) run and a block of examples
is a strided read. We read with `os.preadv` straight into reused buffers (one call per block, or per example,
when the layer's runs are contiguous, one per example otherwise); cold memmap row gathers are ~1000x slower
(DESIGN.md). Vector numbering ("global index") is storage order: example-major, then selected token.

Which tokens (`tokens`): `content` (all but CLS), `cls`, `all`: the same positions of every example; `no_special`
(text): every position whose id in tokens.bin is not one of the special ids the packing put in (metadata.json's
`data.tokenization`: [CLS], [SEP], BOS, EOS), so examples hold different numbers of vectors (`LayerView.keep_nt`).
"""

import dataclasses
import os
import threading
import typing

import numpy as np
import torch

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import tokenization
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import ShardDir

TOKENS = tuple(t for t in config.enum("sae_spec", "tokens") if t != "auto")  # auto is resolved when planning
DEFAULT_BLOCK_BYTES = 16 << 20
_FD_LOCK = threading.Lock()


def no_special_mask(shard_dir: ShardDir) -> np.ndarray:
    """bool (n_ex, T): the positions of a text shard directory whose token is none of the special ids its packing
    put in (metadata.json's data.tokenization), read from tokens.bin: what `tokens: no_special` trains on."""
    packing = tokenization.recorded_packing(shard_dir.metadata)
    if packing is None or not shard_dir.has_aux(ShardLayout.TOKENS_FNAME):
        raise SaeflowError(
            f"{shard_dir.dpath}: tokens='no_special' needs text shards extracted by saeflow (metadata.json's "
            "data.tokenization names the special ids, tokens.bin the ids); use tokens: content"
        )
    return ~np.isin(np.asarray(shard_dir.aux(ShardLayout.TOKENS_FNAME)), packing.special_ids)


def first_vectors(ex, n_tok: int, ex_starts: np.ndarray | None):
    """The global index of example `ex`'s first vector (an int or an array of them): `ex * n_tok` when every
    example holds `n_tok`, else from the cumulative counts `ex_starts` (n_ex + 1 entries, `tokens: no_special`)."""
    return ex * n_tok if ex_starts is None else ex_starts[ex]


@dataclasses.dataclass(frozen=True)
class Block:
    """A run of consecutive examples inside one shard."""

    shard_idx: int
    ex_start: int  # within the shard
    n_ex: int


class TokenSelection:
    """Which stored positions of each example a loader selects (`tokens`): the same range [t_lo, t_hi) of every
    example, or (`no_special`) a mask per example; and the numbering of the selected vectors (global index)."""

    def __init__(self, shard_dir: ShardDir, tokens: str):
        md = shard_dir.metadata
        if tokens not in TOKENS:
            raise SaeflowError(f"tokens must be one of {TOKENS}, got {tokens!r}")
        if tokens == "cls" and not md.cls_token:
            raise SaeflowError(f"{shard_dir.dpath}: tokens='cls' asked for, but metadata.json has cls_token=false")
        self.sd, self.md, self.tokens = shard_dir, md, tokens
        T, c = md.tokens_per_ex, int(md.cls_token)
        self.t_lo, self.t_hi = {"content": (c, T), "cls": (0, 1), "all": (0, T), "no_special": (0, T)}[tokens]
        self.n_tok = self.t_hi - self.t_lo  # vectors per example (at most, with a mask)
        # no_special: which positions are kept, and the global index of each example's first vector (n_ex + 1).
        self.keep_nt = no_special_mask(shard_dir) if tokens == "no_special" else None
        self.ex_starts = None if self.keep_nt is None else np.concatenate([[0], np.cumsum(self.keep_nt.sum(1))])
        self.n_vectors = int(self.first_vector(md.n_ex))

    def coords(self, index: int) -> tuple[int, int]:
        """Global vector index -> (example, token within T)."""
        if self.keep_nt is None:
            ex, tok = divmod(index, self.n_tok)
            return ex, self.t_lo + tok
        ex = int(np.searchsorted(self.ex_starts, index, side="right")) - 1
        return ex, int(np.flatnonzero(self.keep_nt[ex])[index - self.ex_starts[ex]])

    def keep(self, lo: int, hi: int) -> np.ndarray:
        """bool (hi - lo, T): the selected positions of examples lo..hi-1 (what training reads of them)."""
        if self.keep_nt is not None:
            return np.array(self.keep_nt[lo:hi])
        keep_nt = np.zeros((hi - lo, self.md.tokens_per_ex), dtype=bool)
        keep_nt[:, self.t_lo : self.t_hi] = True
        return keep_nt

    def keeps(self, rows_n: np.ndarray) -> np.ndarray:
        """bool: whether each stored row (example * T + token, an inference dump's row order) is selected."""
        if self.keep_nt is not None:
            return self.keep_nt.reshape(-1)[rows_n]
        tok_n = rows_n % self.md.tokens_per_ex
        return (tok_n >= self.t_lo) & (tok_n < self.t_hi)

    def first_vector(self, ex):
        """The global index of example `ex`'s first vector (an int or an array of them; `n_ex`: the count)."""
        return first_vectors(ex, self.n_tok, self.ex_starts)

    def global_ex(self, block: "Block") -> int:
        return int(self.sd.shard_starts[block.shard_idx]) + block.ex_start

    def n_rows(self, block: "Block") -> int:
        """The vectors selected in a block."""
        ex = self.global_ex(block)
        return int(self.first_vector(ex + block.n_ex) - self.first_vector(ex))

    def tokens_of(self, block: "Block", rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(example within the block, token within T) of the block's selected rows `rows` (0 = its first)."""
        if self.keep_nt is None:
            ex, tok = np.divmod(rows, self.n_tok)
            return ex, self.t_lo + tok
        ex = self.global_ex(block)
        return np.divmod(np.flatnonzero(self.keep_nt[ex : ex + block.n_ex])[rows], self.md.tokens_per_ex)


class LayerView(TokenSelection):
    """Where one layer's selected tokens live in a shard directory, and how to read them."""

    def __init__(self, shard_dir: ShardDir, layer: int, tokens: str = "content"):
        super().__init__(shard_dir, tokens)
        md, T = self.md, self.md.tokens_per_ex
        self.layer, self.layer_idx = layer, md.layer_idx(layer)
        self.d_model = md.d_model
        self.dtype = np.dtype(md.dtype)
        self.row_bytes = self.d_model * self.dtype.itemsize
        # The rows read per example ("span"). With one stored layer, a block of examples is one contiguous run on
        # disk, so we read all T tokens in one pread (skipping CLS in RAM) unless that would read over 2x the rows.
        self.contiguous = md.n_layers == 1 and 2 * self.n_tok >= T
        self.span_lo, self.span = (0, T) if self.contiguous else (self.t_lo, self.n_tok)
        self.compact = self.span == self.n_tok and self.keep_nt is None  # the rows read are the rows selected
        self._fds: dict[int, int] = {}

    def __getstate__(self):  # file descriptors are per process
        return {**self.__dict__, "_fds": {}}

    def fd(self, shard_idx: int) -> int:
        with _FD_LOCK:  # the shuffled loader's two threads read at once
            if shard_idx not in self._fds:
                fpath = self.sd.shard_fpath(shard_idx)
                try:
                    self._fds[shard_idx] = os.open(fpath, os.O_RDONLY)
                except OSError as err:
                    raise SaeflowError(
                        f"{fpath}: cannot open shard ({err.strerror}); was the directory purged?"
                    ) from None
            return self._fds[shard_idx]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def offset(self, shard_idx: int, ex_in_shard: int, token: int) -> int:
        """Byte offset (protocol 4.2) of token `token` (0..T-1) of an example at this layer."""
        md = self.md
        return ((ex_in_shard * md.n_layers + self.layer_idx) * md.tokens_per_ex + token) * self.row_bytes

    def selected_rows(self, block: "Block") -> torch.Tensor:
        """Positions of the selected tokens among the span rows of the block read by `read_block`."""
        if self.keep_nt is not None:  # span = T from 0
            ex = self.global_ex(block)
            return torch.from_numpy(np.flatnonzero(self.keep_nt[ex : ex + block.n_ex]))
        first = self.t_lo - self.span_lo
        return (torch.arange(block.n_ex)[:, None] * self.span + torch.arange(first, first + self.n_tok)).reshape(-1)

    def blocks(self, block_bytes: int) -> list[Block]:
        """The directory cut into blocks of about `block_bytes` of selected rows, never crossing a shard."""
        ex_per_block = max(1, block_bytes // (self.span * self.row_bytes))
        return [
            Block(shard_idx, start, min(ex_per_block, n - start))
            for shard_idx, n in enumerate(self.sd.shard_sizes)
            for start in range(0, n, ex_per_block)
        ]

    def read_block(self, block: Block, out_nd: np.ndarray) -> None:
        """Read a block's span rows, in storage order, into `out_nd` (block.n_ex * span, D)."""
        fd = self.fd(block.shard_idx)
        mem = memoryview(out_nd.reshape(-1).view(np.uint8))
        run = self.span * self.row_bytes
        if self.contiguous:
            self._pread(fd, mem[: block.n_ex * run], self.offset(block.shard_idx, block.ex_start, 0), block)
            return
        for i in range(block.n_ex):
            offset = self.offset(block.shard_idx, block.ex_start + i, self.span_lo)
            self._pread(fd, mem[i * run : (i + 1) * run], offset, block)

    def prefetch(self, block: Block) -> None:
        """Ask the kernel to start reading a block now (asynchronously), so cold reads overlap with work."""
        fd = self.fd(block.shard_idx)
        if self.md.n_layers == 1:  # one advice for the whole run (the other tokens are in it anyway)
            start = self.offset(block.shard_idx, block.ex_start, 0)
            stop = self.offset(block.shard_idx, block.ex_start + block.n_ex, 0)
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
            return
        for i in range(block.n_ex):
            offset = self.offset(block.shard_idx, block.ex_start + i, self.span_lo)
            os.posix_fadvise(fd, offset, self.span * self.row_bytes, os.POSIX_FADV_WILLNEED)

    def _pread(self, fd: int, mem: memoryview, offset: int, block: Block) -> None:
        done = 0
        while done < len(mem):
            n = os.preadv(fd, [mem[done:]], offset + done)
            if n == 0:
                fpath = self.sd.shard_fpath(block.shard_idx)
                raise SaeflowError(f"{fpath}: ended early at byte {offset + done} (truncated after validation?)")
            done += n


class IndexedReader:
    """Random access by global vector index (for visuals): one pread per vector, sorted for locality."""

    def __init__(self, shard_dir: ShardDir, layer: int, tokens: str = "content"):
        self.view = LayerView(shard_dir, layer, tokens)

    def __len__(self) -> int:
        return self.view.n_vectors

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.get([index])[0]

    def get(self, indices: typing.Sequence[int]) -> torch.Tensor:
        """Vectors (n, D) at the given global indices, in the order given."""
        idx_n = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = idx_n[(idx_n < 0) | (idx_n >= self.view.n_vectors)]
        if bad.size:
            raise SaeflowError(f"vector index {int(bad[0])} out of range [0, {self.view.n_vectors})")
        out_nd = np.empty((idx_n.size, self.view.d_model), dtype=self.view.dtype)
        mem = memoryview(out_nd.view(np.uint8).reshape(-1))
        starts = self.view.sd.shard_starts
        rb = self.view.row_bytes
        for i in np.argsort(idx_n, kind="stable"):
            ex, tok = self.view.coords(int(idx_n[i]))
            shard_idx = int(np.searchsorted(starts, ex, side="right") - 1)
            block = Block(shard_idx, ex - int(starts[shard_idx]), 1)
            offset = self.view.offset(shard_idx, block.ex_start, tok)
            self.view._pread(self.view.fd(shard_idx), mem[i * rb : (i + 1) * rb], offset, block)
        return torch.from_numpy(out_nd)

    def close(self) -> None:
        self.view.close()


def paired_view(view: LayerView, target_dir: ShardDir, layer: int | None = None) -> LayerView:
    """The same layer (or `layer`: a CLT reads one directory per layer) and tokens of a transcoder's target
    directory, refused in one line unless its examples, tokens and shards line up with `view`'s row for row (the
    plan checks the metadata first: run_checks.check_pairs)."""
    target = LayerView(target_dir, view.layer if layer is None else layer, view.tokens)
    a, b = view.md, target.md
    layout_a = (a.n_ex, a.tokens_per_ex, a.cls_token, tuple(view.sd.shard_sizes), view.n_vectors)
    layout_b = (b.n_ex, b.tokens_per_ex, b.cls_token, tuple(target.sd.shard_sizes), target.n_vectors)
    same_keep = view.keep_nt is None or np.array_equal(view.keep_nt, target.keep_nt)
    if layout_a != layout_b or not same_keep:
        target.close()
        raise SaeflowError(f"{target_dir.dpath}: a transcoder's target must hold the same examples, tokens and shards "
                           f"as its input {view.sd.dpath} (examples, tokens per example, CLS, shard sizes, vectors: "
                           f"{layout_b} vs {layout_a}{'' if same_keep else '; other special tokens'})")  # fmt: skip
    return target
