"""The writer: streams examples, in order, into the staging sibling of a shard directory and publishes it with
one rename (docs/store.md has the crash/resume/concurrency guarantees).

    ShardWriter   the producer's side: checks each `write` and splits it at shard boundaries into queue items
    _Drainer      the background thread: writes queued items to the shard files, hashing and fsyncing on threads
                  of their own, and records each finished shard, in order, in the progress file
    _Staging      the staging directory of one hash under its lock: resumes from the progress file (cut back to
                  the last complete shard), finishes a build a killed run had sealed, and publishes
"""

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

from saeflow.errors import SaeflowError, ShardDirError
from saeflow.store import atomic, provenance
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import AUX_FILES, Metadata, aux_row_bytes, expected_shards_json
from saeflow.store.shards.reader import open_existing
from saeflow.store.shards.validate import KNOWN_FNAMES, read_json, validate


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
    ):
        self.root = pathlib.Path(shards_root)
        self.md = metadata
        self.aux_fnames = tuple(sorted(set(aux)))
        for fname in self.aux_fnames:
            if fname not in AUX_FILES:
                raise SaeflowError(f"unknown side file {fname!r}; known: {sorted(AUX_FILES)}")
        self.provenance_extra = dict(provenance_extra or {})
        layout = ShardLayout.at(self.root, metadata.hash)
        self.dpath = layout.dpath
        self.staging = layout.staging.dpath
        self.lock_fpath = layout.lock_fpath
        self.reused = False
        self.n_written = 0  # examples accepted so far (durable up to the resume point at entry)
        self.resumed_from = 0
        self._queue_depth = queue_depth
        self._staging = _Staging(layout, metadata, self.aux_fnames, self.provenance_extra)
        self._drainer: _Drainer | None = None

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
            self.n_written = self.resumed_from = self._staging.resumed_from
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

    def __init__(self, staging: "_Staging", queue_depth: int):
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


class _Staging:
    """The staging sibling of one shard directory, built under the hash's lock.

    Its progress file lists the durable shards, so a killed build resumes after the last one; once sealed (shard
    list, checksums and provenance written, progress file removed) only the rename is left, and a killed run's
    sealed directory is published by the next run.
    """

    def __init__(self, final: ShardLayout, md: Metadata, aux_fnames: tuple[str, ...], provenance_extra: dict):
        self.final = final
        self.layout = final.staging
        self.md = md
        self.aux_fnames = aux_fnames
        self.provenance_extra = provenance_extra
        self.completed: list[dict] = []  # the progress entries of the durable shards, in order
        self.resumed_from = 0
        self.started_at = provenance.utc_now()
        self._lock_cm = None

    def acquire(self) -> bool:
        """Take the lock and make staging ready to append to. False when there is nothing to write: the directory
        was published while we waited, or a killed run had sealed staging and it is published now."""
        self.final.dpath.parent.mkdir(parents=True, exist_ok=True)
        lock_cm = atomic.exclusive_lock(self.final.lock_fpath)
        lock_cm.__enter__()
        self._lock_cm = lock_cm
        if open_existing(self.final.dpath) is not None:  # published by another process while we waited
            return False
        if _is_sealed(self.layout, self.md, self.aux_fnames):  # a run was killed while publishing: finish its job
            atomic.make_tree_writable(self.layout.dpath)  # a run killed inside publish_dir may have made it read-only
            _remove_strays(self.layout, keep=KNOWN_FNAMES | {s["name"] for s in expected_shards_json(self.md)})
            self._rename_into_place()
            return False
        self._prepare()
        return True

    def release(self):
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None
            if self.final.dpath.exists():  # later writers find the directory before they look for the lock
                self.final.lock_fpath.unlink(missing_ok=True)

    def record(self, entry: dict):
        """Append a durable shard's entry to the progress file: the point a killed build resumes from."""
        self.completed.append(entry)
        self._write_progress()

    def _write_progress(self):
        atomic.write_file_atomic(self.layout.progress_fpath, json.dumps({"completed": self.completed}).encode())

    def _prepare(self):
        """Resume from the last complete shard in the staging directory, or start it afresh."""
        completed = _resume_point(self.layout, self.md, self.aux_fnames)
        if completed is not None:
            self._truncate_to(completed)
            self.completed = completed
            self.resumed_from = sum(s["n_ex"] for s in completed)
            return
        atomic.remove_staging(self.layout.dpath)
        self.layout.dpath.mkdir(parents=True)
        atomic.write_json(self.layout.metadata_fpath, self.md.to_dict())
        for fname in self.aux_fnames:
            self.layout.file(fname).touch()
        self._write_progress()

    def cut_back(self):
        """After a failed write: back to the last complete shard (frees the torn one; resume starts there)."""
        if self.layout.dpath.exists():
            self._truncate_to(list(self.completed))

    def _truncate_to(self, completed: list[dict]):
        """Remove the unfinished shard, other side files and temporary files, then cut the side files."""
        atomic.make_tree_writable(self.layout.dpath)  # a run killed inside publish_dir may have made it read-only
        keep = {self.layout.METADATA_FNAME, self.layout.PROGRESS_FNAME, *self.aux_fnames}
        _remove_strays(self.layout, keep=keep | {s["name"] for s in completed})
        n_done = sum(self.md.shard_sizes[: len(completed)])
        for fname in self.aux_fnames:
            os.truncate(self.layout.file(fname), n_done * aux_row_bytes(self.md, fname))

    def publish(self, n_written: int):
        """Seal staging (shard list, checksums, provenance, then the progress file goes) and rename it into place."""
        md = self.md
        if n_written != md.n_ex or len(self.completed) != len(md.shard_sizes):
            raise SaeflowError(
                f"only {n_written} of {md.n_ex} examples were written to {self.layout.dpath}; nothing was published. "
                "Rerun to resume from the last complete shard."
            )
        atomic.write_json(self.layout.shards_fpath, expected_shards_json(md))
        hashed_fnames = (self.layout.METADATA_FNAME, self.layout.SHARDS_FNAME, *self.aux_fnames)
        atomic.write_json(self.layout.checksums_fpath, _checksums(self.layout, self.completed, hashed_fnames))
        prov = {
            **provenance.collect(),
            **self.provenance_extra,
            "started_at": self.started_at,
            "finished_at": provenance.utc_now(),
            "resumed_from_ex": self.resumed_from,
        }
        atomic.write_json(self.layout.provenance_fpath, prov)
        # From here the staging directory is sealed: a run killed before the rename publishes it on entry.
        self.layout.progress_fpath.unlink()
        report = validate(self.layout.dpath, name=md.hash)
        if not report.ok:
            raise ShardDirError(self.layout.dpath, report.problems, hint="nothing was published")
        self._rename_into_place()

    def _rename_into_place(self):
        if not atomic.publish_dir(self.layout.dpath, self.final.dpath):
            open_existing(self.final.dpath)  # lost a rename race despite the lock: the winner's directory must be valid


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


def _holds_metadata(layout: ShardLayout, md: Metadata) -> bool:
    try:
        return read_json(layout.metadata_fpath) == md.to_dict()
    except (OSError, ValueError):
        return False


def _is_sealed(layout: ShardLayout, md: Metadata, aux_fnames: tuple[str, ...]) -> bool:
    """True when staging holds a complete, valid directory with our side files (progress file already gone)."""
    if layout.progress_fpath.exists() or not _holds_metadata(layout, md):
        return False
    report = validate(layout.dpath, name=md.hash)
    aux_present = tuple(f for f in AUX_FILES if layout.file(f).exists())
    return report.ok and aux_present == aux_fnames and layout.checksums_fpath.exists()


def _resume_point(layout: ShardLayout, md: Metadata, aux_fnames: tuple[str, ...]) -> list[dict] | None:
    """The progress entries a killed build left in staging, when each matches its shard file and the side files
    hold at least their rows; None when staging cannot be trusted (it is started afresh)."""
    if not _holds_metadata(layout, md):
        return None
    sizes = md.shard_sizes
    try:
        completed = read_json(layout.progress_fpath)["completed"]
        for i, entry in enumerate(completed):
            if (
                i >= len(sizes)
                or entry["name"] != layout.shard_fname(i)
                or entry["n_ex"] != sizes[i]
                or entry["bytes"] != sizes[i] * md.bytes_per_ex
                or not isinstance(entry["sha256"], str)
                or layout.shard_fpath(i).stat().st_size != entry["bytes"]
            ):
                return None
        n_done = sum(sizes[: len(completed)])
        for fname in aux_fnames:
            if layout.file(fname).stat().st_size < n_done * aux_row_bytes(md, fname):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return completed


def _checksums(layout: ShardLayout, completed: list[dict], fnames: tuple[str, ...]) -> dict:
    """The checksums file: each shard's entry as recorded when it was finished, the files `fnames` hashed now."""
    files = {s["name"]: {"bytes": s["bytes"], "sha256": s["sha256"]} for s in completed}
    for fname in fnames:
        fpath = layout.file(fname)
        files[fname] = {"bytes": fpath.stat().st_size, "sha256": file_sha256(fpath)}
    return {"files": files}


def _remove_strays(layout: ShardLayout, keep: set[str]):
    """Remove every entry of the directory not named in `keep` (half-written shards, temporary files)."""
    for child in layout.dpath.iterdir():
        if child.name in keep:
            continue
        if child.is_dir() and not child.is_symlink():
            atomic.remove_staging(child)
        else:
            child.unlink()


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
