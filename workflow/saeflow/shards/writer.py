"""The writer: streams examples into a staging directory and publishes it atomically (docs/store.md)."""

import collections
import concurrent.futures
import hashlib
import json
import os
import pathlib
import queue
import threading
import typing

import numpy as np

from saeflow import atomic, provenance
from saeflow.errors import SaeflowError, ShardDirError
from saeflow.hashing import file_sha256
from saeflow.layout import ShardLayout
from saeflow.shards.metadata import AUX_FILES, Metadata, aux_row_bytes, expected_shards_json
from saeflow.shards.reader import open_existing
from saeflow.shards.validate import read_json, validate


class ShardWriter:
    """Streams examples, in order, into `<shards_root>/<hash>/` and publishes it atomically.

        with ShardWriter(root, metadata, aux=("tokens.bin",)) as writer:
            for start in range(writer.n_written, metadata.n_ex, batch_size):  # resumes after a crash
                writer.write(acts_nltd, aux={"tokens.bin": ids_nt})
        writer.dpath  # the published directory

    `reused` is True when there is nothing to write: the directory was already published (it is validated, never
    rewritten; a broken one raises ShardDirError and is left alone) or a killed run had finished building it.
    Only one process builds a given hash at a time (an `flock` on `<root>/.<hash>.lock`); a second one waits and
    then reuses the published directory. The build happens in `<root>/.<hash>.partial/`; every completed shard is
    fsynced and recorded in its `progress.json`, so a killed writer resumes from the last complete shard
    (`n_written` on entry). Disk writes and sha256 run on background threads, so the producer is not slowed by I/O.
    """

    def __init__(
        self,
        shards_root: str | os.PathLike,
        metadata: Metadata,
        aux: typing.Iterable[str] = (),
        provenance_extra: dict | None = None,
        queue_depth: int = 4,
    ):
        self.root = pathlib.Path(shards_root)
        self.md = metadata
        self.aux_fnames = tuple(sorted(set(aux)))
        for fname in self.aux_fnames:
            if fname not in AUX_FILES:
                raise SaeflowError(f"unknown side file {fname!r}; known: {sorted(AUX_FILES)}")
        self.provenance_extra = dict(provenance_extra or {})
        self._layout = ShardLayout.at(self.root, metadata.hash)
        self.dpath = self._layout.dpath
        self.staging = self._layout.staging.dpath
        self.lock_fpath = self._layout.lock_fpath
        self.reused = False
        self.n_written = 0  # examples accepted so far (durable up to the resume point at entry)
        self.resumed_from = 0
        self._queue_depth = queue_depth
        self._lock_cm = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._error: BaseException | None = None
        self._completed: list[dict] = []
        self._started_at = provenance.utc_now()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def __enter__(self) -> "ShardWriter":
        if open_existing(self.dpath) is not None:
            self.reused = True
            return self
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock_cm = atomic.exclusive_lock(self.lock_fpath)
            lock_cm.__enter__()
            self._lock_cm = lock_cm
            if open_existing(self.dpath) is not None:  # published by another process while we waited
                self.reused = True
                return self
            if self._staging_is_sealed():  # a run was killed while publishing: finish its job
                self._rename_into_place()
                self.reused = True
                return self
            self._prepare_staging()
        except BaseException as err:
            self._release_lock()
            if isinstance(err, OSError):
                raise SaeflowError(f"cannot prepare {self.staging}: {err!r}; nothing was published") from err
            raise
        self._queue = queue.Queue(maxsize=self._queue_depth)
        self._thread = threading.Thread(target=self._drain, name="shard-writer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.reused:
                return
            self._stop_thread()
            if exc_type is None:
                self._raise_if_failed()
                self._publish()
        finally:
            self._release_lock()

    def _release_lock(self):
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None
            if self.dpath.exists():  # later writers find the directory before they look for the lock
                self.lock_fpath.unlink(missing_ok=True)

    # -- resuming ---------------------------------------------------------------------------------------------

    def _staging_has_our_metadata(self) -> bool:
        try:
            return read_json(self._layout.staging.metadata_fpath) == self.md.to_dict()
        except (OSError, ValueError):
            return False

    def _staging_is_sealed(self) -> bool:
        """True when staging holds a complete, valid directory with our side files (progress.json already gone)."""
        if (self._layout.staging.progress_fpath).exists() or not self._staging_has_our_metadata():
            return False
        report = validate(self.staging, name=self.md.hash)
        aux_present = tuple(f for f in AUX_FILES if (self._layout.staging.file(f)).exists())
        if not report.ok or aux_present != self.aux_fnames or not (self._layout.staging.checksums_fpath).exists():
            return False
        atomic.make_tree_writable(self.staging)  # a run killed inside publish_dir may have made it read-only
        shard_names = (s["name"] for s in expected_shards_json(self.md))
        self._remove_strays(
            {
                ShardLayout.METADATA_FNAME,
                ShardLayout.SHARDS_FNAME,
                ShardLayout.CHECKSUMS_FNAME,
                ShardLayout.PROVENANCE_FNAME,
                *aux_present,
                *shard_names,
            }
        )
        return True

    def _prepare_staging(self):
        """Resume from the last complete shard in the staging directory, or start it afresh."""
        progress_fpath = self._layout.staging.progress_fpath
        try:
            completed = read_json(progress_fpath)["completed"] if self._staging_has_our_metadata() else None
        except (OSError, ValueError, KeyError, TypeError):
            completed = None
        if completed is not None and self._truncate_to(completed):
            self._completed = completed
            self.n_written = self.resumed_from = sum(s["n_ex"] for s in completed)
            return
        atomic.remove_staging(self.staging)
        self.staging.mkdir(parents=True)
        atomic.write_json(self._layout.staging.metadata_fpath, self.md.to_dict())
        for fname in self.aux_fnames:
            (self._layout.staging.file(fname)).touch()
        atomic.write_file_atomic(progress_fpath, json.dumps({"completed": []}).encode())

    def _truncate_to(self, completed: list) -> bool:
        """Drop everything after the completed shards; False if the staging directory cannot be trusted."""
        sizes = self.md.shard_sizes
        try:
            for i, entry in enumerate(completed):
                fpath = self._layout.staging.shard_fpath(i)
                if (
                    i >= len(sizes)
                    or entry["name"] != ShardLayout.shard_fname(i)
                    or entry["n_ex"] != sizes[i]
                    or entry["bytes"] != sizes[i] * self.md.bytes_per_ex
                    or not isinstance(entry["sha256"], str)
                    or fpath.stat().st_size != entry["bytes"]
                ):
                    return False
            n_done = sum(sizes[: len(completed)])
            for fname in self.aux_fnames:
                if (self._layout.staging.file(fname)).stat().st_size < n_done * aux_row_bytes(self.md, fname):
                    return False
        except (OSError, KeyError, TypeError):
            return False
        # Trusted: remove the unfinished shard, other side files and temporary files, then cut the side files.
        atomic.make_tree_writable(self.staging)  # a run killed inside publish_dir may have made it read-only
        self._remove_strays(
            {ShardLayout.METADATA_FNAME, ShardLayout.PROGRESS_FNAME, *self.aux_fnames, *(s["name"] for s in completed)}
        )
        for fname in self.aux_fnames:
            os.truncate(self._layout.staging.file(fname), n_done * aux_row_bytes(self.md, fname))
        return True

    def _remove_strays(self, keep: set[str]):
        for child in self.staging.iterdir():
            if child.name in keep:
                continue
            if child.is_dir() and not child.is_symlink():
                atomic.remove_staging(child)
            else:
                child.unlink()

    # -- producing --------------------------------------------------------------------------------------------

    def write(self, acts_nltd: np.ndarray, aux: dict[str, np.ndarray] | None = None) -> None:
        """Append n examples, shape (n, L, T, D), plus their side rows. The writer owns the arrays afterwards."""
        if self.reused:
            raise SaeflowError(f"{self.dpath} is already complete; nothing to write")
        if self._queue is None:
            raise SaeflowError("ShardWriter.write() must be called inside `with ShardWriter(...) as writer:`")
        self._raise_if_failed()
        md = self.md
        expected = (md.n_layers, md.tokens_per_ex, md.d_model)
        if acts_nltd.ndim != 4 or tuple(acts_nltd.shape[1:]) != expected:
            raise SaeflowError(
                f"activations must have shape (n, {', '.join(map(str, expected))}), got {tuple(acts_nltd.shape)}"
            )
        n = acts_nltd.shape[0]
        if self.n_written + n > md.n_ex:
            raise SaeflowError(f"too many examples: {self.n_written} written + {n} > n_ex={md.n_ex}")
        aux = dict(aux or {})
        if set(aux) != set(self.aux_fnames):
            raise SaeflowError(f"side arrays {sorted(aux)} differ from the declared {sorted(self.aux_fnames)}")
        aux_rows = {}
        for fname, rows in aux.items():
            spec = AUX_FILES[fname]
            rows = np.asarray(rows)
            if rows.shape != (n, *spec.row_shape(md)):
                raise SaeflowError(f"{fname} rows must have shape {(n, *spec.row_shape(md))}, got {rows.shape}")
            aux_rows[fname] = np.ascontiguousarray(rows, dtype=spec.dtype)
        acts = np.ascontiguousarray(acts_nltd, dtype=md.dtype)
        # Split at shard boundaries so every queue item belongs to exactly one shard file.
        done = 0
        while done < n:
            shard_idx, ex_in_shard = divmod(self.n_written, md.ex_per_shard)
            take = min(n - done, md.shard_sizes[shard_idx] - ex_in_shard)
            item = (
                shard_idx,
                acts[done : done + take],
                {fname: rows[done : done + take] for fname, rows in aux_rows.items()},
            )
            self._put(item)
            done += take
            self.n_written += take

    def _put(self, item):
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _raise_if_failed(self):
        if self._error is not None:
            raise SaeflowError(
                f"writing {self.staging} failed: {self._error!r}. Nothing was published; "
                "fix the cause (e.g. free disk space) and rerun to resume from the last complete shard."
            ) from self._error

    def _stop_thread(self):
        if self._thread is None:
            return
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self._thread.join()
        self._thread = None

    # -- the background thread --------------------------------------------------------------------------------

    def _drain(self):
        """Write queued pieces to their shard file. Hashing and each shard's fsync run on their own threads, so
        the disk, sha256 and the next shard's writes overlap; shards are finished (recorded) strictly in order."""
        hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-sha256")
        finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-fsync")
        shard: _ShardFile | None = None
        finishing: concurrent.futures.Future | None = None
        aux_fds = {}
        try:
            aux_fds = {fname: open(self._layout.staging.file(fname), "ab") for fname in self.aux_fnames}
            while (item := self._queue.get()) is not None:
                shard_idx, acts, aux_rows = item
                if shard is None:
                    shard = _ShardFile(self._layout.staging.shard_fpath(shard_idx), hasher)
                shard.write(acts)
                for fname, rows in aux_rows.items():
                    aux_fds[fname].write(_bytes_view(rows))
                if shard.n_ex == self.md.shard_sizes[shard_idx]:
                    for aux_fd in aux_fds.values():
                        aux_fd.flush()
                    if finishing is not None:
                        finishing.result()
                    finishing = finisher.submit(self._finish_shard, shard, aux_fds)
                    shard = None
            if finishing is not None:
                finishing.result()
        except BaseException as err:  # surfaced to the producer by _raise_if_failed
            self._error = err
            while True:  # drop queued work so a producer blocked on a full queue sees the error
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        finally:
            finisher.shutdown()
            hasher.shutdown(cancel_futures=True)
            if shard is not None:
                shard.fd.close()
            for aux_fd in aux_fds.values():
                aux_fd.close()

    def _finish_shard(self, shard: "_ShardFile", aux_fds: dict):
        """fsync a complete shard and the side files up to it, then record it in progress.json (the resume point)."""
        entry = shard.close()
        for aux_fd in aux_fds.values():
            os.fsync(aux_fd.fileno())
        self._completed.append({"name": shard.fpath.name, **entry})
        progress = json.dumps({"completed": self._completed}).encode()
        atomic.write_file_atomic(self._layout.staging.progress_fpath, progress)

    # -- publishing -------------------------------------------------------------------------------------------

    def _publish(self):
        md = self.md
        if self.n_written != md.n_ex or len(self._completed) != len(md.shard_sizes):
            raise SaeflowError(
                f"only {self.n_written} of {md.n_ex} examples were written to {self.staging}; nothing was published. "
                "Rerun to resume from the last complete shard."
            )
        atomic.write_json(self._layout.staging.shards_fpath, expected_shards_json(md))
        files = {s["name"]: {"bytes": s["bytes"], "sha256": s["sha256"]} for s in self._completed}
        for fname in (ShardLayout.METADATA_FNAME, ShardLayout.SHARDS_FNAME, *self.aux_fnames):
            fpath = self._layout.staging.file(fname)
            files[fname] = {"bytes": fpath.stat().st_size, "sha256": file_sha256(fpath)}
        atomic.write_json(self._layout.staging.checksums_fpath, {"files": files})
        prov = {
            **provenance.collect(),
            **self.provenance_extra,
            "started_at": self._started_at,
            "finished_at": provenance.utc_now(),
            "resumed_from_ex": self.resumed_from,
        }
        atomic.write_json(self._layout.staging.provenance_fpath, prov)
        # From here the staging directory is sealed: a run killed before the rename publishes it on entry.
        (self._layout.staging.progress_fpath).unlink()
        report = validate(self.staging, name=md.hash)
        if not report.ok:
            raise ShardDirError(self.staging, report.problems, hint="nothing was published")
        self._rename_into_place()

    def _rename_into_place(self):
        if not atomic.publish_dir(self.staging, self.dpath):
            open_existing(self.dpath)  # lost a rename race despite the lock: the winner's directory must be valid


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
        """fsync and close; the entry progress.json and checksums.json record for this shard."""
        self.fd.flush()
        os.fsync(self.fd.fileno())
        self.fd.close()
        while self.pending:
            self.pending.popleft().result()
        return {"n_ex": self.n_ex, "bytes": self.n_bytes, "sha256": self.digest.hexdigest()}


def _bytes_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(arr.reshape(-1).view(np.uint8))
