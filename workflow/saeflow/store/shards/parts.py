"""Split extraction: N part jobs each build a contiguous range of whole shards, one seal job publishes them.

    ranges = part_ranges(len(md.shard_sizes), n_parts)             # [(first_shard, stop_shard), ...]
    with PartWriter(root, md, part_idx, n_parts, aux=...) as w:     # in each part job (resumable shard by shard)
        for lo, hi in spans starting at w.n_written: w.write(...)
    seal(root, md, n_parts, aux=...)                                # the seal job: verify every part, one rename

Parts write into `<shards_root>/.<hash>.parts/part-<i>-of-<n>/` (ShardLayout.part), beside the staging directory
and on the same filesystem. A part records every durable shard in its progress file like the one-job writer, so a
killed part resumes from its last complete shard; a finished part writes part.json (its shards' sizes and sha256,
its side-file rows' checksum, its provenance). The seal checks every part against the metadata (shard names, counts,
sizes) and re-hashes what it moves, hard-links the shard files into the hash's staging directory, concatenates the
side files, and publishes with the one-job writer's seal (shards.json, checksums.json, provenance, validate,
rename). Shards are cut and batched exactly as in one job, so any number of parts gives the same bytes.
"""

import logging
import os
import pathlib
import shutil

from saeflow import numerics
from saeflow.errors import SaeflowError
from saeflow.store import atomic
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import Metadata, aux_row_bytes
from saeflow.store.shards.reader import open_existing
from saeflow.store.shards.staging import Part, Staging, entry_ok, finished_part
from saeflow.store.shards.writer import ShardWriter

logger = logging.getLogger(__name__)


def part_ranges(n_shards: int, n_parts: int) -> list[tuple[int, int]]:
    """[first, stop) shard ranges of `n_parts` (capped at `n_shards`) contiguous parts, the larger ones first."""
    n_parts = max(1, min(n_parts, n_shards))
    base, extra = divmod(n_shards, n_parts)
    ranges, first = [], 0
    for part_idx in range(n_parts):
        stop = first + base + (part_idx < extra)
        ranges.append((first, stop))
        first = stop
    return ranges


def n_parts_of(md: Metadata, n_parts: int) -> int:
    """The number of part jobs actually run: at most one per shard."""
    return len(part_ranges(len(md.shard_sizes), n_parts))


def _part_range(md: Metadata, part_idx: int, n_parts: int) -> tuple[int, int]:
    ranges = part_ranges(len(md.shard_sizes), n_parts)
    if n_parts != len(ranges) or not 0 <= part_idx < n_parts:
        raise SaeflowError(
            f"part {part_idx}/{n_parts} does not exist: {md.hash[:12]} has {len(md.shard_sizes)} shards, so "
            f"1 to {len(md.shard_sizes)} parts numbered from 0"
        )
    return ranges[part_idx]


class PartWriter(ShardWriter):
    """A ShardWriter for the shards of one part only; `n_written` counts from the start of the whole directory
    (the first example of the part on a fresh start), and leaving the block finishes the part, never publishes."""

    def __init__(self, shards_root, metadata: Metadata, part_idx: int, n_parts: int, aux=(), provenance_extra=None):
        first, stop = _part_range(metadata, part_idx, n_parts)
        part = Part(ShardLayout.at(shards_root, metadata.hash).part(part_idx, n_parts), first, stop)
        super().__init__(shards_root, metadata, aux=aux, provenance_extra=provenance_extra, part=part)

    def write(self, acts_nltd, aux=None) -> None:
        if self.n_written + acts_nltd.shape[0] > self.ex_stop:
            ex_start = self.ex_stop - sum(self.md.shard_sizes[self._staging.first : self._staging.stop])
            raise SaeflowError(f"part {self.staging.name} holds examples [{ex_start}, {self.ex_stop}) only")
        super().write(acts_nltd, aux)


def _checked_part(part: ShardLayout, md: Metadata, rng: tuple[int, int], aux_fnames, moved: int) -> dict:
    """part.json of a finished part, every shard not yet moved (index >= `moved`) checked: name, count, size and a
    fresh sha256; the side files by size and sha256. One-line SaeflowError naming the part and the problem."""
    done = finished_part(part, md)
    if done is None:
        raise SaeflowError(f"{part.dpath} is not a finished part of {md.hash} (no part.json); run that part first")
    first, stop = rng
    if done.get("shards") != [first, stop] or len(done.get("completed", ())) != stop - first:
        raise SaeflowError(f"{part.part_done_fpath}: holds shards {done.get('shards')}, expected [{first}, {stop}]")
    for offset, entry in enumerate(done["completed"]):
        idx = first + offset
        if idx < moved:
            continue
        try:
            ok = entry_ok(part, md, idx, entry) and file_sha256(part.shard_fpath(idx)) == entry["sha256"]
        except (OSError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SaeflowError(f"{part.shard_fpath(idx)}: missing, or its size or sha256 differs from part.json")
    n_ex = sum(md.shard_sizes[first:stop])
    for fname in aux_fnames:
        fpath, want = part.file(fname), done["aux"].get(fname, {})
        size = fpath.stat().st_size if fpath.is_file() else None
        if moved < stop and (
            size != want.get("bytes") or size != n_ex * aux_row_bytes(md, fname) or file_sha256(fpath) != want["sha256"]
        ):
            raise SaeflowError(f"{fpath}: missing, or its size or sha256 differs from part.json")
    return done


def seal(
    shards_root, md: Metadata, n_parts: int, aux=(), provenance_extra: dict | None = None
) -> tuple[pathlib.Path, bool]:
    """Verify the `n_parts` finished parts and publish `<shards_root>/<hash>/` in one rename; (path, reused).

    Resumable: a seal killed while moving shards continues from the staging directory's progress file."""
    final = ShardLayout.at(shards_root, md.hash)
    if open_existing(final.dpath) is not None:
        return final.dpath, True
    ranges = part_ranges(len(md.shard_sizes), n_parts)
    if len(ranges) != n_parts:
        raise SaeflowError(f"{md.hash[:12]} has {len(md.shard_sizes)} shards: it cannot be sealed from {n_parts} parts")
    aux_fnames = tuple(sorted(set(aux)))
    staging = Staging(final, md, aux_fnames, dict(provenance_extra or {}))
    try:
        if not staging.acquire():
            return final.dpath, True
        moved = len(staging.completed)  # shards a killed seal had moved already
        parts = [final.part(i, n_parts) for i in range(n_parts)]
        dones = [_checked_part(p, md, rng, aux_fnames, moved) for p, rng in zip(parts, ranges)]
        staging.provenance_extra["parts"] = [done["provenance"] for done in dones]
        staging.provenance_extra["mixed_platforms"] = _warn_if_mixed_platforms(final.dpath, dones)
        aux_fds = {f: open(staging.layout.file(f), "ab") for f in aux_fnames}
        try:
            for part, (first, _stop), done in zip(parts, ranges, dones):
                for offset, entry in enumerate(done["completed"]):
                    if first + offset >= moved:
                        _move_shard(part, staging, md, first, first + offset, entry, aux_fds)
        finally:
            for fd in aux_fds.values():
                fd.close()
        staging.publish(md.n_ex)
    finally:
        staging.release()
    shutil.rmtree(final.parts_dpath, ignore_errors=True)
    return final.dpath, False


def _warn_if_mixed_platforms(dpath: pathlib.Path, dones: list[dict]) -> bool:
    """Parts computed on different platforms (an A100 part and an H100 part) agree within float tolerance, not
    bitwise: the directory is sealed anyway (its name is its config, and a cluster picks the nodes), with a warning
    and `mixed_platforms` in its provenance (docs/extraction.md)."""
    keys = [numerics.platform_key(done["provenance"].get("platform", {})) for done in dones]
    if len(set(keys)) == 1:
        return False
    names = sorted({" ".join(str(v) for v in key if v not in (None, False)) for key in keys})
    logger.warning("%s: its parts were computed on %d platforms (%s): its bytes match a one-job extraction within "
                   "float tolerance, not bitwise", dpath, len(names), "; ".join(names))  # fmt: skip
    return True


def _move_shard(part: ShardLayout, staging: Staging, md: Metadata, first: int, idx: int, entry: dict, aux_fds):
    """Link one shard file into staging, append its side rows, fsync, and record it (the seal's resume point)."""
    for fname, fd in aux_fds.items():
        row_bytes = aux_row_bytes(md, fname)
        with open(part.file(fname), "rb") as src:
            src.seek(sum(md.shard_sizes[first:idx]) * row_bytes)
            fd.write(src.read(md.shard_sizes[idx] * row_bytes))
        fd.flush()
        os.fsync(fd.fileno())
    # A hard link, not a rename: the part keeps its file until the directory is published, so a seal killed at
    # any point resumes (an unrecorded link in staging is a stray and is removed on resume).
    try:
        os.link(part.shard_fpath(idx), staging.layout.shard_fpath(idx))
    except OSError:  # a filesystem without hard links
        shutil.copyfile(part.shard_fpath(idx), staging.layout.shard_fpath(idx))
        with open(staging.layout.shard_fpath(idx), "rb+") as fd:
            os.fsync(fd.fileno())
    atomic.fsync_path(staging.layout.dpath)
    staging.record(dict(entry))
