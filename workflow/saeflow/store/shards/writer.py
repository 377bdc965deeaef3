"""The writer: streams examples, in order, into the staging sibling of a shard directory and publishes it with
one rename (docs/store.md has the crash/resume/concurrency guarantees).

    ShardWriter   the producer's side: checks each `write` and splits it at shard boundaries into queue items
    _Drainer      the background thread: writes queued items to the shard files, hashing and fsyncing on threads
                  of their own, and records each finished shard, in order, in the progress file
    Staging       (staging.py) the directory it builds in, under its lock: the hash's staging sibling, or one part's
"""

import collections
import concurrent.futures
import hashlib
import os
import pathlib
import queue
import threading
import typing

import numpy as np

from saeflow.errors import SaeflowError
from saeflow.store import atomic
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import AUX_FILES, Metadata
from saeflow.store.shards.reader import open_existing
from saeflow.store.shards.staging import Part, Staging


class ShardWriter:
    """Streams examples, in order, into `<shards_root>/<hash>/` and publishes it atomically.

        with ShardWriter(root, metadata, aux=(ShardLayout.TOKENS_FNAME,)) as writer:
            for start in range(writer.n_written, metadata.n_ex, batch_size):  # resumes after a crash
                writer.write(acts_nltd, aux={ShardLayout.TOKENS_FNAME: ids_nt})
        writer.dpath  # the published directory

    `reused` is True when there is nothing to write: the directory was already published (it is validated, never
    rewritten; a broken one raises ShardDirError and is left alone) or a killed run had finished building it.
    Only one process builds a given hash at a time (an `flock` on `lock_fpath`); a second one waits and then
    reuses the published directory. The build happens in `staging`; every completed shard is fsynced and recorded
    in its progress file, so a killed writer resumes from the last complete shard (`n_written` on entry). Disk
    writes and sha256 run on background threads, so the producer is not slowed by I/O.
    """

    def __init__(
        self,
        shards_root: str | os.PathLike,
        metadata: Metadata,
        aux: typing.Iterable[str] = (),
        provenance_extra: dict | None = None,
        queue_depth: int = 4,
        part: Part | None = None,
    ):
        self.root = pathlib.Path(shards_root)
        self.md = metadata
        self.aux_fnames = tuple(sorted(set(aux)))
        for fname in self.aux_fnames:
            if fname not in AUX_FILES:
                raise SaeflowError(f"unknown side file {fname!r}; known: {sorted(AUX_FILES)}")
        self.provenance_extra = dict(provenance_extra or {})
        layout = ShardLayout.at(self.root, metadata.hash)
        self._staging = Staging(layout, metadata, self.aux_fnames, self.provenance_extra, part)
        self.dpath = layout.dpath
        self.staging = self._staging.layout.dpath
        self.lock_fpath = self._staging.lock_fpath
        self.ex_stop = self._staging.ex_stop  # a part writes up to its last shard
        self.reused = False
        self.n_written = 0  # examples accepted so far (durable up to the resume point at entry)
        self.resumed_from = 0
        self._queue_depth = queue_depth
        self._drainer: _Drainer | None = None

    @property
    def built_dpath(self) -> pathlib.Path:
        """What this writer makes: the shard directory, or a part's directory."""
        return self.dpath if self._staging.part is None else self.staging

    def __enter__(self) -> "ShardWriter":
        if open_existing(self.dpath) is not None:
            self.reused = True
            return self
        try:
            self.reused = not self._staging.acquire()
        except BaseException as err:
            self._staging.release()
            if isinstance(err, OSError):
                raise SaeflowError(f"cannot prepare {self.staging}: {err!r}; nothing was published") from err
            raise
        if not self.reused:
            self.n_written = self.resumed_from = self._staging.ex_start + self._staging.resumed_from
            self._drainer = _Drainer(self._staging, self._queue_depth)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.reused:
                return
            self._drainer.stop()
            if atomic.is_no_space(self._drainer.error):  # free the torn shard: staging keeps only complete ones
                self._staging.cut_back()
            if exc_type is None:
                self._drainer.raise_if_failed()
                with atomic.no_space_as_error(self.dpath, _kept(self.staging)):
                    self._staging.publish(self.n_written)
        finally:
            self._staging.release()

    def kept(self) -> str:
        """What a build stopped early (Ctrl-C) leaves, once the block is left, and how to resume it."""
        n_shards = len(self._staging.completed)
        shards = f"{n_shards} complete shard{'s' * (n_shards != 1)}"
        return f"{shards} kept in {self.staging}; rerun the same command to resume"

    def write(self, acts_nltd: np.ndarray, aux: dict[str, np.ndarray] | None = None) -> None:
        """Append n examples, shape (n, L, T, D), plus their side rows. The writer owns the arrays afterwards."""
        if self.reused:
            raise SaeflowError(f"{self.dpath} is already complete; nothing to write")
        if self._drainer is None:
            raise SaeflowError("ShardWriter.write() must be called inside `with ShardWriter(...) as writer:`")
        self._drainer.raise_if_failed()
        acts_nltd, aux_rows = _checked(self.md, self.aux_fnames, self.n_written, acts_nltd, aux)
        md, n = self.md, acts_nltd.shape[0]
        # Split at shard boundaries so every queue item belongs to exactly one shard file.
        done = 0
        while done < n:
            shard_idx, ex_in_shard = divmod(self.n_written, md.ex_per_shard)
            take = min(n - done, md.shard_sizes[shard_idx] - ex_in_shard)
            item = (
                shard_idx,
                acts_nltd[done : done + take],
                {fname: rows[done : done + take] for fname, rows in aux_rows.items()},
            )
            self._drainer.put(item)
            done += take
            self.n_written += take


class _Drainer:
    """The background thread that writes queued (shard index, acts, side rows) items into the staging directory.

    Hashing and each shard's fsync run on their own threads, so the disk, sha256 and the next shard's writes
    overlap; shards are finished (recorded) strictly in order. A failure is kept and raised in the producer by
    `raise_if_failed`, so it surfaces at the next `write` or at the end.
    """

    def __init__(self, staging: Staging, queue_depth: int):
        self.staging = staging
        self.queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="shard-writer", daemon=True)
        self.thread.start()

    def put(self, item):
        while True:
            self.raise_if_failed()
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def raise_if_failed(self):
        if atomic.is_no_space(self.error):
            raise atomic.no_space_error(self.staging.final.dpath, _kept(self.staging.layout.dpath)) from None
        if self.error is not None:
            raise SaeflowError(
                f"writing {self.staging.layout.dpath} failed: {self.error!r}. Nothing was published; "
                "fix the cause (e.g. free disk space) and rerun to resume from the last complete shard."
            ) from self.error

    def stop(self):
        """Let the thread finish what is queued, then join it."""
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self.thread.join()

    def _drain(self):
        layout, shard_sizes = self.staging.layout, self.staging.md.shard_sizes
        hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-sha256")
        finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-fsync")
        shard: _ShardFile | None = None
        finishing: concurrent.futures.Future | None = None
        aux_fds = {}
        try:
            aux_fds = {fname: open(layout.file(fname), "ab") for fname in self.staging.aux_fnames}
            while (item := self.queue.get()) is not None:
                shard_idx, acts, aux_rows = item
                if shard is None:
                    shard = _ShardFile(layout.shard_fpath(shard_idx), hasher)
                shard.write(acts)
                for fname, rows in aux_rows.items():
                    aux_fds[fname].write(_bytes_view(rows))
                if shard.n_ex == shard_sizes[shard_idx]:
                    for aux_fd in aux_fds.values():
                        aux_fd.flush()
                    if finishing is not None:
                        finishing.result()
                    finishing = finisher.submit(self._finish_shard, shard, aux_fds)
                    shard = None
            if finishing is not None:
                finishing.result()
        except BaseException as err:  # surfaced to the producer by raise_if_failed
            self.error = err
            while True:  # drop queued work so a producer blocked on a full queue sees the error
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
        finally:
            finisher.shutdown()
            hasher.shutdown(cancel_futures=True)
            for fd in ([shard.fd] if shard is not None else []) + list(aux_fds.values()):
                try:
                    fd.close()  # flushes: fails again on a full disk
                except OSError as err:
                    self.error = self.error or err

    def _finish_shard(self, shard: "_ShardFile", aux_fds: dict):
        """fsync a complete shard and the side files up to it, then record it (the resume point)."""
        entry = shard.close()
        for aux_fd in aux_fds.values():
            os.fsync(aux_fd.fileno())
        self.staging.record({"name": shard.fpath.name, **entry})


def _kept(staging_dpath: pathlib.Path) -> str:
    """What a full disk leaves: the resumable staging directory, cut back to its complete shards."""
    return f"kept the complete shards in {staging_dpath.name} to resume from, nothing was published"


def _checked(
    md: Metadata, aux_fnames: tuple[str, ...], n_written: int, acts_nltd: np.ndarray, aux: dict[str, np.ndarray] | None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The activations and side rows of one `write`, checked against the metadata, C-contiguous, stored dtypes."""
    expected = (md.n_layers, md.tokens_per_ex, md.d_model)
    if acts_nltd.ndim != 4 or tuple(acts_nltd.shape[1:]) != expected:
        raise SaeflowError(
            f"activations must have shape (n, {', '.join(map(str, expected))}), got {tuple(acts_nltd.shape)}"
        )
    n = acts_nltd.shape[0]
    if n_written + n > md.n_ex:
        raise SaeflowError(f"too many examples: {n_written} written + {n} > n_ex={md.n_ex}")
    aux = dict(aux or {})
    if set(aux) != set(aux_fnames):
        raise SaeflowError(f"side arrays {sorted(aux)} differ from the declared {sorted(aux_fnames)}")
    aux_rows = {}
    for fname, rows in aux.items():
        spec = AUX_FILES[fname]
        rows = np.asarray(rows)
        if rows.shape != (n, *spec.row_shape(md)):
            raise SaeflowError(f"{fname} rows must have shape {(n, *spec.row_shape(md))}, got {rows.shape}")
        aux_rows[fname] = np.ascontiguousarray(rows, dtype=spec.dtype)
    return np.ascontiguousarray(acts_nltd, dtype=md.dtype), aux_rows


class _ShardFile:
    """One shard file being written: bytes go to disk on the writer thread while sha256 runs on `hasher`.

    hashlib and file writes both release the GIL, so hashing overlaps the write of the same piece. At most
    `max_pending` pieces wait for the hasher, so the write and the hash read the same few MiB while they are in
    the CPU cache: with 32 MiB pieces both streamed from RAM and the writer was ~3x slower (benchmarks/).
    """

    PIECE_BYTES = 2 << 20

    def __init__(self, fpath: pathlib.Path, hasher: concurrent.futures.Executor, max_pending: int = 2):
        self.fpath = fpath
        self.fd = open(fpath, "wb")
        self.digest = hashlib.sha256()
        self.hasher = hasher
        self.pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self.max_pending = max_pending
        self.n_ex = 0
        self.n_bytes = 0

    def write(self, acts: np.ndarray):
        buf = _bytes_view(acts)
        for start in range(0, buf.nbytes, self.PIECE_BYTES):
            piece = buf[start : start + self.PIECE_BYTES]
            while len(self.pending) >= self.max_pending:
                self.pending.popleft().result()
            self.pending.append(self.hasher.submit(self.digest.update, piece))
            self.fd.write(piece)
        self.n_ex += acts.shape[0]
        self.n_bytes += buf.nbytes

    def close(self) -> dict:
        """fsync and close; the entry the progress file and the checksums record for this shard."""
        self.fd.flush()
        os.fsync(self.fd.fileno())
        self.fd.close()
        while self.pending:
            self.pending.popleft().result()
        return {"n_ex": self.n_ex, "bytes": self.n_bytes, "sha256": self.digest.hexdigest()}


def _bytes_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(arr.reshape(-1).view(np.uint8))
