"""Where the shards of one hash are built, under a lock: the one staging class of the one-job writer, the part jobs
of a split extraction and the seal.

    Staging(final, md, aux_fnames, provenance_extra)              the hash's staging sibling: every shard, published
                                                                  by one rename (`publish` seals it first)
    Staging(final, md, aux_fnames, provenance_extra, part=Part)   one part's directory: shards [first, stop), finished
                                                                  by its part.json (the seal publishes the hash)

Both keep a progress file listing the durable shards, so a killed build resumes after the last one, and both are
cut back to their complete shards after a failed write. A sealed staging directory (shard list, checksums and
provenance written, progress file removed) has only the rename left: a killed run's is published by the next run.
"""

import dataclasses
import json
import os

from saeflow.errors import SaeflowError, ShardDirError
from saeflow.store import atomic, provenance
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import AUX_FILES, Metadata, aux_row_bytes, expected_shards_json
from saeflow.store.shards.reader import open_existing
from saeflow.store.shards.validate import KNOWN_FNAMES, read_json, validate


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a split extraction: the shards [first, stop) of a hash, built in `layout` (ShardLayout.part)."""

    layout: ShardLayout
    first: int
    stop: int


class Staging:
    """The directory shards [first, stop) of one hash are built in, under its lock (see the module docstring)."""

    def __init__(self, final: ShardLayout, md: Metadata, aux_fnames: tuple[str, ...], provenance_extra: dict,
                 part: Part | None = None):  # fmt: skip
        self.final, self.md, self.aux_fnames, self.provenance_extra, self.part = (
            final, md, aux_fnames, provenance_extra, part
        )  # fmt: skip
        self.layout = final.staging if part is None else part.layout
        self.lock_fpath = final.lock_fpath if part is None else part.layout.lock_fpath
        self.first, self.stop = (0, len(md.shard_sizes)) if part is None else (part.first, part.stop)
        self.ex_start, self.ex_stop = sum(md.shard_sizes[: self.first]), sum(md.shard_sizes[: self.stop])
        self.completed: list[dict] = []  # the progress entries of the durable shards, in order
        self.resumed_from = 0  # examples of this staging directory kept from a killed run
        self.started_at = provenance.utc_now()
        self._lock_cm = None

    def acquire(self) -> bool:
        """Take the lock and make the directory ready to append to. False when there is nothing to write: the hash
        was published while we waited, this part is finished, or a killed run had sealed staging (published now)."""
        self.layout.dpath.parent.mkdir(parents=True, exist_ok=True)
        lock_cm = atomic.exclusive_lock(self.lock_fpath)
        lock_cm.__enter__()
        self._lock_cm = lock_cm
        if open_existing(self.final.dpath) is not None:  # published by another process while we waited
            return False
        if self.part is not None and finished_part(self.layout, self.md) is not None:
            return False
        if self.part is None and _is_sealed(self.layout, self.md, self.aux_fnames):  # killed while publishing
            atomic.make_tree_writable(self.layout.dpath)  # a run killed inside publish_dir may have made it read-only
            remove_strays(self.layout, keep=KNOWN_FNAMES | {s["name"] for s in expected_shards_json(self.md)})
            self._rename_into_place()
            return False
        self._prepare()
        return True

    def release(self):
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None
            if self.final.dpath.exists():  # later writers find the directory before they look for the lock
                self.lock_fpath.unlink(missing_ok=True)

    def record(self, entry: dict):
        """Append a durable shard's entry to the progress file: the point a killed build resumes from."""
        self.completed.append(entry)
        self._write_progress()

    def _write_progress(self):
        atomic.write_file_atomic(self.layout.progress_fpath, json.dumps({"completed": self.completed}).encode())

    def _prepare(self):
        """Resume from the last complete shard in the directory, or start it afresh (an empty directory Snakemake
        made for a part's marker is fine)."""
        completed = _resume_point(self)
        if completed is None:
            if self.layout.dpath.exists():
                atomic.make_tree_writable(self.layout.dpath)
                remove_strays(self.layout, keep=set())
            self.layout.dpath.mkdir(parents=True, exist_ok=True)
            atomic.write_json(self.layout.metadata_fpath, self.md.to_dict())
            for fname in self.aux_fnames:
                self.layout.file(fname).touch()
            completed = []
        self._truncate_to(completed)
        self.completed = completed
        self.resumed_from = sum(s["n_ex"] for s in completed)
        self._write_progress()

    def rows_before(self, n_completed: int) -> int:
        """The examples in this directory's first `n_completed` shards."""
        return sum(self.md.shard_sizes[self.first : self.first + n_completed])

    def cut_back(self):
        """After a failed write: back to the last complete shard (frees the torn one; resume starts there)."""
        if self.layout.dpath.exists():
            self._truncate_to(list(self.completed))

    def _truncate_to(self, completed: list[dict]):
        """Remove the unfinished shard, other side files and temporary files, then cut the side files."""
        atomic.make_tree_writable(self.layout.dpath)  # a run killed inside publish_dir may have made it read-only
        keep = {self.layout.METADATA_FNAME, self.layout.PROGRESS_FNAME, *self.aux_fnames}
        remove_strays(self.layout, keep=keep | {s["name"] for s in completed})
        for fname in self.aux_fnames:
            os.truncate(self.layout.file(fname), self.rows_before(len(completed)) * aux_row_bytes(self.md, fname))

    def publish(self, n_written: int):
        """Finish the directory once every example was written: seal and rename the hash's staging sibling into
        place, or write a part's part.json (its shards, side-file checksums and provenance), atomically and last."""
        if n_written != self.ex_stop or len(self.completed) != self.stop - self.first:
            raise SaeflowError(
                f"only {n_written - self.ex_start} of {self.ex_stop - self.ex_start} examples were written to "
                f"{self.layout.dpath}; nothing was published. Rerun to resume from the last complete shard."
            )
        prov = {
            **provenance.collect(),
            **self.provenance_extra,
            "started_at": self.started_at,
            "finished_at": provenance.utc_now(),
            "resumed_from_ex": self.resumed_from,
        }
        if self.part is None:
            _seal(self, prov)
            self._rename_into_place()
        else:
            _finish_part(self, prov)

    def _rename_into_place(self):
        if not atomic.publish_dir(self.layout.dpath, self.final.dpath):
            open_existing(self.final.dpath)  # lost a rename race despite the lock: the winner's directory must be valid


def _resume_point(staging: Staging) -> list[dict] | None:
    """The progress entries a killed build left, when each matches its shard file and the side files hold at least
    their rows; None when the directory cannot be trusted (it is started afresh)."""
    layout, md, first = staging.layout, staging.md, staging.first
    try:
        if read_json(layout.metadata_fpath) != md.to_dict():
            return None
        completed = read_json(layout.progress_fpath)["completed"]
        for offset, entry in enumerate(completed):
            if not entry_ok(layout, md, first + offset, entry, first + offset < staging.stop):
                return None
        n_rows = staging.rows_before(len(completed))
        if any(layout.file(f).stat().st_size < n_rows * aux_row_bytes(md, f) for f in staging.aux_fnames):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return completed


def _seal(staging: Staging, prov: dict):
    """Shard list, checksums and provenance, then the progress file goes: only the rename is left."""
    layout, md = staging.layout, staging.md
    atomic.write_json(layout.shards_fpath, expected_shards_json(md))
    hashed_fnames = (layout.METADATA_FNAME, layout.SHARDS_FNAME, *staging.aux_fnames)
    atomic.write_json(layout.checksums_fpath, _checksums(layout, staging.completed, hashed_fnames))
    atomic.write_json(layout.provenance_fpath, prov)
    layout.progress_fpath.unlink()  # sealed: a run killed before the rename publishes it on entry
    report = validate(layout.dpath, name=md.hash)
    if not report.ok:
        raise ShardDirError(layout.dpath, report.problems, hint="nothing was published")


def _finish_part(staging: Staging, prov: dict):
    """part.json (the part's shards, its side files' sizes and sha256, its provenance), then the progress file goes."""
    layout = staging.layout
    aux = {f: {"bytes": layout.file(f).stat().st_size, "sha256": file_sha256(layout.file(f))}
           for f in staging.aux_fnames}  # fmt: skip
    done = {"shards": [staging.first, staging.stop], "completed": staging.completed, "aux": aux, "provenance": prov}
    atomic.write_json(layout.part_done_fpath, done)
    layout.progress_fpath.unlink()


def entry_ok(layout: ShardLayout, md: Metadata, shard_idx: int, entry: dict, in_range: bool = True) -> bool:
    """A progress/part entry names shard `shard_idx` with its planned count and size, and the file has that size."""
    return (
        in_range
        and entry["name"] == layout.shard_fname(shard_idx)
        and entry["n_ex"] == md.shard_sizes[shard_idx]
        and entry["bytes"] == md.shard_sizes[shard_idx] * md.bytes_per_ex
        and isinstance(entry["sha256"], str)
        and layout.shard_fpath(shard_idx).stat().st_size == entry["bytes"]
    )


def finished_part(part: ShardLayout, md: Metadata) -> dict | None:
    """part.json of a finished part of this metadata, else None."""
    try:
        if read_json(part.metadata_fpath) != md.to_dict():
            return None
        return read_json(part.part_done_fpath)
    except (OSError, ValueError):
        return None


def _is_sealed(layout: ShardLayout, md: Metadata, aux_fnames: tuple[str, ...]) -> bool:
    """True when staging holds a complete, valid directory with our side files (progress file already gone)."""
    try:
        if layout.progress_fpath.exists() or read_json(layout.metadata_fpath) != md.to_dict():
            return False
    except (OSError, ValueError):
        return False
    report = validate(layout.dpath, name=md.hash)
    aux_present = tuple(f for f in AUX_FILES if layout.file(f).exists())
    return report.ok and aux_present == aux_fnames and layout.checksums_fpath.exists()


def _checksums(layout: ShardLayout, completed: list[dict], fnames: tuple[str, ...]) -> dict:
    """The checksums file: each shard's entry as recorded when it was finished, the files `fnames` hashed now."""
    files = {s["name"]: {"bytes": s["bytes"], "sha256": s["sha256"]} for s in completed}
    for fname in fnames:
        fpath = layout.file(fname)
        files[fname] = {"bytes": fpath.stat().st_size, "sha256": file_sha256(fpath)}
    return {"files": files}


def remove_strays(layout: ShardLayout, keep: set[str]):
    """Remove every entry of the directory not named in `keep` (half-written shards, temporary files)."""
    for child in layout.dpath.iterdir():
        if child.name in keep:
            continue
        if child.is_dir() and not child.is_symlink():
            atomic.remove_staging(child)
        else:
            child.unlink()
