"""User-facing errors: the CLI prints them as one line without a traceback and exits 1."""

import errno
import sys

# What an OSError on reading a file means to the user, by errno (the rest: the system's own words).
_READ_REASONS = {
    errno.EACCES: "cannot read (permission denied)",
    errno.EPERM: "cannot read (operation not permitted)",
    errno.EISDIR: "is a directory, not a file",
    errno.ENOENT: "missing",
    errno.ENOTDIR: "missing (a parent is not a directory)",
    errno.EIO: "cannot read (I/O error: the disk or file system failed)",
    errno.ELOOP: "cannot read (too many levels of symbolic links)",
}


def say(line: str) -> None:
    """Write one line to stderr in a single write: Python's stderr writes through unbuffered, so `print` is two writes
    (the text, then its newline), and the lines of ranks sharing a terminal or a log interleave between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class SaeflowError(Exception):
    """Something the user can fix (bad input, bad config, damaged data). Message says what and where."""


class ShardDirError(SaeflowError):
    """A shard directory is incomplete, corrupt, or does not match its hash.

    `problems` lists every problem found (each names the file), so a scratch purge is reported at once.
    """

    def __init__(self, dpath, problems, hint: str = ""):
        self.dpath = dpath
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid shard directory {dpath}:\n{lines}" + (f"\n{hint}" if hint else ""))


def read_problem(err: OSError) -> str:
    """Why a file could not be read, in words ("cannot read (permission denied)", "is a directory, not a file")."""
    return _READ_REASONS.get(err.errno, f"cannot read ({err.strerror or type(err).__name__})")


def unreadable(fpath, err: OSError) -> SaeflowError:
    """The one-line error for a file that could not be read: `<path>: <why>`."""
    return SaeflowError(f"{fpath}: {read_problem(err)}")


def one_line(text: str) -> str:
    """A message on one line: continuation lines (bulleted problem lists) joined by '; ' after the first."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    rest = [line[2:] if line.startswith("- ") else line for line in lines[1:]]
    return lines[0] + (" " + "; ".join(rest) if rest else "")
