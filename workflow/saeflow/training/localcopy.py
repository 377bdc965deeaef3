"""Node-local staging of a shard directory (saev's `use_tmpdir`): copy it once per node to fast local disk
($TMPDIR in a Slurm job), check the copy, and read from it.

    dpath = localcopy.local_copy(shards_dpath, "$TMPDIR")    # <TMPDIR>/saeflow-shards/<hash>/

The copy is built in `.<hash>.partial` beside it, every file's size is compared with the source, and it is renamed
into place; then the marker `.<hash>.complete` is written. A copy without its marker, or whose sizes differ from
the source (a file truncated by a full disk, a source that was rebuilt), is made again. An flock serializes jobs
that share a node, so one copies and the others reuse.
"""

import os
import pathlib
import shutil

from saeflow.errors import SaeflowError
from saeflow.store import atomic

LOCAL_DNAME = "saeflow-shards"


def _sizes(dpath: pathlib.Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(dpath.iterdir()) if f.is_file()}


def local_copy(src_dpath: str | os.PathLike, local_root: str | os.PathLike) -> pathlib.Path:
    """The node-local copy of the shard directory `src_dpath` under `local_root` (environment variables expanded),
    made when missing or not matching the source file by file in size. Returns its path."""
    src = pathlib.Path(src_dpath).resolve()
    root_text = os.path.expandvars(str(local_root))
    if "$" in root_text or not root_text:
        raise SaeflowError(f"local copy: {local_root!r} names an unset environment variable (e.g. $TMPDIR)")
    root = pathlib.Path(root_text) / LOCAL_DNAME
    dest, marker = root / src.name, root / f".{src.name}.complete"
    root.mkdir(parents=True, exist_ok=True)
    want = _sizes(src)
    with atomic.exclusive_lock(root / f".{src.name}.lock"):
        if marker.exists() and dest.is_dir() and _sizes(dest) == want:
            return dest
        marker.unlink(missing_ok=True)
        partial = root / f".{src.name}.partial"
        for stale in (partial, dest):
            if stale.exists():
                atomic.make_tree_writable(stale)
                shutil.rmtree(stale)
        with atomic.no_space_as_error(dest, "removed the partial local copy"):
            try:
                shutil.copytree(src, partial, copy_function=shutil.copyfile)
                got = _sizes(partial)
                if got != want:
                    raise SaeflowError(f"local copy of {src} in {partial}: file sizes differ from the source")
                os.rename(partial, dest)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
        marker.write_text(str(sum(want.values())))
    return dest
