"""Atomic, immutable publishing on one filesystem.

Every published output is first written into a hidden sibling (same filesystem, so `os.rename` is atomic),
fsynced, made read-only, and then renamed into place. A crash at any point leaves either nothing or a complete
directory at the final path.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import stat
import typing

from saeflow.errors import SaeflowError
from saeflow.store import provenance
from saeflow.store.layout import staging_dpath

logger = logging.getLogger(__name__)

READONLY_FILE_MODE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
READONLY_DIR_MODE = READONLY_FILE_MODE | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def fsync_path(path: pathlib.Path) -> None:
    """fsync a file or a directory (directories need it so a rename or a new entry is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(dpath: pathlib.Path) -> None:
    for sub_dpath, _, fnames in os.walk(dpath):
        for fname in _not_links(sub_dpath, fnames):  # a link's target is someone else's file
            fsync_path(pathlib.Path(sub_dpath) / fname)
        fsync_path(pathlib.Path(sub_dpath))


def _not_links(sub_dpath: str, fnames: list[str]) -> list[str]:
    return [fname for fname in fnames if not os.path.islink(os.path.join(sub_dpath, fname))]


def make_tree_readonly(dpath: pathlib.Path) -> None:
    """Files r--r--r--, directories r-xr-xr-x (deepest first so we can still descend). Symlinks are left alone:
    chmod would follow them and change the linked file (e.g. an imported saev shard) rather than the link."""
    for sub_dpath, _, fnames in os.walk(dpath, topdown=False):
        for fname in _not_links(sub_dpath, fnames):
            os.chmod(pathlib.Path(sub_dpath) / fname, READONLY_FILE_MODE)
        os.chmod(sub_dpath, READONLY_DIR_MODE)


def make_tree_writable(dpath: pathlib.Path) -> None:
    """Undo `make_tree_readonly` on a private staging directory before removing it."""
    for sub_dpath, _, fnames in os.walk(dpath):
        os.chmod(sub_dpath, 0o755)
        for fname in _not_links(sub_dpath, fnames):
            os.chmod(pathlib.Path(sub_dpath) / fname, 0o644)


def remove_staging(dpath: pathlib.Path) -> None:
    if dpath.exists():
        make_tree_writable(dpath)
        shutil.rmtree(dpath)


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_TEXT = "No space left on device"


def is_no_space(err: BaseException | None) -> bool:
    """A full disk (or quota), anywhere in the exception chain; also what torch/pyarrow wrap without an errno."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
            return True
        if not isinstance(err, SaeflowError) and any(
            text in str(err) for text in (NO_SPACE_TEXT, "Disk quota exceeded")
        ):
            return True
        err = err.__cause__ or err.__context__
    return False


def no_space_error(path: pathlib.Path, cleaned: str) -> SaeflowError:
    """The one-line message of a full disk: the path, what was cleaned up, what to do."""
    return SaeflowError(f"{NO_SPACE_TEXT} writing {path}; {cleaned}. Free space there and rerun.")


@contextlib.contextmanager
def no_space_as_error(path: pathlib.Path, cleaned: str = "nothing was published") -> typing.Iterator[None]:
    """Turn a full disk (OSError ENOSPC/EDQUOT, torch's or pyarrow's wrapped ones) into a one-line SaeflowError."""
    try:
        yield
    except SaeflowError:
        raise
    except Exception as err:
        if is_no_space(err):
            raise no_space_error(path, cleaned) from None
        raise


def publish_dir(staging: pathlib.Path, final_dpath: pathlib.Path) -> bool:
    """fsync, make read-only and rename `staging` to `final_dpath` in one `os.rename`.

    Returns False (and removes `staging`) when another process published `final_dpath` first; the caller
    then validates and reuses the existing directory.
    """
    fsync_tree(staging)
    make_tree_readonly(staging)
    try:
        os.rename(staging, final_dpath)
    except OSError:
        if final_dpath.exists():
            remove_staging(staging)
            return False
        raise
    fsync_path(final_dpath.parent)
    return True


@contextlib.contextmanager
def building_dir(final_dpath: pathlib.Path, publish_lock: pathlib.Path | None = None) -> typing.Iterator[pathlib.Path]:
    """A fresh, empty staging sibling in which to build `final_dpath`.

    When the block ends normally the staging directory is published (`publish_dir`, under an exclusive flock on
    `publish_lock` when given); when it raises, the staging directory is removed, so a failure never leaves a
    partial output at the final path or beside it. A full disk raises a one-line SaeflowError that says so.
    """
    staging = staging_dpath(final_dpath)
    remove_staging(staging)
    with no_space_as_error(final_dpath, f"removed its staging directory {staging.name}, nothing was published"):
        try:
            staging.mkdir(parents=True)
            yield staging
            with exclusive_lock(publish_lock) if publish_lock else contextlib.nullcontext():
                publish_dir(staging, final_dpath)
        except BaseException:
            remove_staging(staging)
            raise


TMP_INFIX = ".tmp-"  # `.<name>.tmp-<pid>`: a temporary left by a killed process matches `.*.tmp-*`


@contextlib.contextmanager
def replacing(fpath: pathlib.Path, fsync: bool = True) -> typing.Iterator[pathlib.Path]:
    """Yield a temporary sibling of `fpath` to write; on success it replaces `fpath` in one rename.

    The one write-temp-fsync-rename mechanism: a crash leaves the old file or the new one, never a torn one. On
    failure the temporary is removed; a full disk raises a one-line SaeflowError that names `fpath` and says so.
    `fsync=False` is for what has no data to sync (a symlink).
    """
    fpath = pathlib.Path(fpath)
    tmp_fpath = fpath.parent / f".{fpath.name}{TMP_INFIX}{os.getpid()}"
    with no_space_as_error(fpath, f"removed its temporary {tmp_fpath.name}, {fpath.name} is unchanged"):
        try:
            yield tmp_fpath
            if fsync:
                fsync_path(tmp_fpath)
            os.replace(tmp_fpath, fpath)
        except BaseException:
            if os.path.lexists(tmp_fpath):
                tmp_fpath.unlink()
            raise
        fsync_path(fpath.parent)


def write_file_atomic(fpath: pathlib.Path, data: bytes, readonly: bool = False) -> None:
    """Write a single file through a temporary sibling and a rename."""
    with replacing(fpath) as tmp_fpath:
        tmp_fpath.write_bytes(data)
        if readonly:
            os.chmod(tmp_fpath, READONLY_FILE_MODE)


def write_json(fpath: pathlib.Path, obj: typing.Any) -> None:
    """Human-readable JSON (indented, sorted, trailing newline): deterministic bytes for the same object."""
    fpath.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def exclusive_lock(lock_fpath: pathlib.Path) -> typing.Iterator[None]:
    """Block until this process holds an exclusive `flock` on `lock_fpath`. The holder records itself in the lock
    file (pid, host, since when) while it holds it, so a process that has to wait says so at once, naming it."""
    lock_fpath.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_fpath, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for the lock %s (%s): another process works on the same output",
                        lock_fpath, _lock_holder(fd))  # fmt: skip
            fcntl.flock(fd, fcntl.LOCK_EX)
        _record_holder(fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": provenance.utc_now()})
        try:
            yield
        finally:
            _record_holder(fd, None)  # a later waiter never names a holder that has gone
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _record_holder(fd: int, holder: dict | None) -> None:
    """Write (or, with None, clear) the holder's record in its lock file; best effort: a full disk still locks."""
    try:
        os.ftruncate(fd, 0)
        if holder is not None:
            os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError:
        pass


def _lock_holder(fd: int) -> str:
    """Who holds a lock, as its holder recorded it in the lock file."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"held by pid {holder['pid']} on {holder['host']} since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):  # not recorded yet, or by a saeflow that did not record it
        return "held by another process"
