"""Dataset fingerprints: a content hash of every file a dataset reads, computed once, then kept by stat.

    fp = fingerprints.of_files(root, starts, suffixes)   # Fingerprint(sha256, n_files, n_bytes): hashed as data
    n = fingerprints.cached_value(key, compute)          # a value derived from hashed content (text example counts)
    hex_ = fingerprints.file_digest(fpath, "git-sha1")   # one file's digest (a Hugging Face cache blob), kept by stat

Identity: `sha256` is the sha256 of the manifest `relpath<TAB>size<TAB>sha256(file bytes)<LF>` of every file
below `starts` (symlinks followed) whose suffix is in `suffixes`, sorted by relpath (relative to `root`). It depends
on names and bytes only, never on mtime, inode or the cache: `touch` keeps it, a same-size edit of one file changes
it, and a machine without the cache computes the same value.

Cost: the first fingerprint of a dataset reads every byte once (a progress bar shows the rate). The cache then
keeps, per dataset, the listing of (relpath, size, mtime_ns, inode) of every file and each file's content hash.
A re-plan lists and stats the files (`find -L ... -printf`, in parallel processes, no file is opened): when the
listing is the cached one, the cached fingerprint is the answer; otherwise only the files whose (relpath, size,
mtime, inode) changed are read again. A `saeflow` command in a Slurm job therefore stats files and reads none (the
job's parse of the Snakefile takes what its Snakemake planned: saeflow.planning.read_planned).
Files modified in the last RACY_SEC seconds are never trusted by stat (git's "racy clean" rule): a same-size edit
within the file system's timestamp granularity is still seen.

A stat per file is the floor of that re-plan: 1.28M files cost ~2 s of kernel time alone (and far more on a
cluster's parallel file system). So a re-plan of a dataset of AUTO_DIRECTORIES_FILES files or more stats only its
directories (and start files): adding, removing or renaming an entry changes its directory's mtime, and then the
files are listed as above. A file rewritten in place under the same name keeps its directory's mtime; the re-plan
does not see it, but `saeflow extract`, the job about to read the files, stats every one of them (it sets `files`)
and refuses with one line when the dataset no longer has the fingerprint the workflow planned (--expect-hash).
Shards extracted before such a rewrite stay as they are: named by the content they were made from.
`SAEFLOW_FINGERPRINT_RECHECK` picks the recheck for every dataset: `auto` (the default, as above), `files` (every
file, every time) or `directories` (directories only, whatever the size; extraction jobs too).

Where: `$SAEFLOW_FINGERPRINT_CACHE`, else `$XDG_CACHE_HOME/saeflow/fingerprints`, else
`~/.cache/saeflow/fingerprints` (on a cluster the home directory is seen by the login node and every compute node,
so jobs find what the submitting process computed). Entries are written atomically (concurrent planners are safe);
the cache can be deleted at any time; an unwritable cache only costs time (one warning).
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import subprocess
import time
import typing

from saeflow.errors import SaeflowError, unreadable
from saeflow.store.atomic import write_file_atomic
from saeflow.store.hashing import canonical_json, file_git_sha1, file_sha256

logger = logging.getLogger(__name__)

CACHE_ENV = "SAEFLOW_FINGERPRINT_CACHE"
CACHE_VERSION = 1
DIGEST_BYTES = 32
# A file modified this recently (seconds) when the cache is written is "racy": a second edit within the file
# system's timestamp granularity could leave its stat unchanged, so its digest is not kept (as git does for its
# index) and the next plan reads it again.
RACY_SEC = 5.0
_FIND_PRINTF = "%p\\t%s\\t%T@\\t%i\\0"  # path, size, mtime (s.ns), inode; NUL-terminated (names may hold newlines)
_warned_unwritable: set[str] = set()
# How a re-plan looks for changes: `files` stats every file (any edit is seen); `directories` stats only the
# directories (and start files), so a re-plan no longer grows with the number of files; `auto` (the default) is
# `directories` for a dataset of AUTO_DIRECTORIES_FILES files or more, else `files` (see the module docstring).
RECHECK_ENV = "SAEFLOW_FINGERPRINT_RECHECK"
RECHECKS = ("auto", "files", "directories")
AUTO_DIRECTORIES_FILES = 100_000  # ~0.2 s of stat calls on a local disk: below it, every re-plan stats every file
DIGESTS = {"sha256": file_sha256, "git-sha1": file_git_sha1}  # file_digest's algorithms


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The content identity of a set of files, and how many files and bytes it covers."""

    sha256: str  # sha256 of the sorted manifest (relpath, size, content sha256)
    n_files: int  # files with a listed suffix
    n_bytes: int  # their total size


def cache_dpath() -> pathlib.Path:
    """The fingerprint cache directory (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base, "saeflow", "fingerprints")


# ---------------------------------------------------------------------------------------------------------------
# Listing: relpath, size, mtime, inode of every file (stat only)
# ---------------------------------------------------------------------------------------------------------------


def _find(starts: list[str]) -> bytes:
    proc = subprocess.run(["find", "-L", *starts, "-type", "f", "-printf", _FIND_PRINTF], capture_output=True)
    if proc.returncode != 0:
        first = proc.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
        raise SaeflowError(f"cannot list {starts[0]}: {first[0] if first else f'find exited {proc.returncode}'}")
    return proc.stdout


def _walk(starts: list[str]) -> bytes:
    """The same lines as `_find`, in Python (where GNU find is missing): files of each start, depth first."""
    lines = []
    for start in starts:
        paths = [start] if os.path.isfile(start) else []
        for dpath, dnames, fnames in os.walk(start, followlinks=True):
            dnames.sort()
            paths.extend(os.path.join(dpath, name) for name in sorted(fnames))
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as err:
                raise SaeflowError(f"cannot list {path}: {err.strerror}") from None
            if os.path.isfile(path):
                sec, nsec = divmod(st.st_mtime_ns, 10**9)
                lines.append(f"{path}\t{st.st_size}\t{sec}.{nsec:09d}0\t{st.st_ino}\0")
    return "".join(lines).encode("utf-8", "surrogateescape")


def listing(starts: list[pathlib.Path], n_procs: int | None = None) -> bytes:
    """b"path\\tsize\\tmtime\\tinode\\0" for every file below `starts`, in start order; stats, never reads.

    The starts are split over up to `n_procs` (default: the CPU count, at most 8) `find` processes that run at once;
    their outputs are joined in start order, so the bytes do not depend on the split."""
    names = [str(p) for p in starts]
    if not names:
        return b""
    n_procs = max(1, min(n_procs or min(os.cpu_count() or 1, 8), len(names)))
    chunks = [names[i * len(names) // n_procs : (i + 1) * len(names) // n_procs] for i in range(n_procs)]
    try:
        with concurrent.futures.ThreadPoolExecutor(n_procs) as pool:  # the threads wait on find processes
            return b"".join(pool.map(_find, chunks))
    except (FileNotFoundError, SaeflowError) as err:  # no find, or not GNU find (no -printf): list in Python
        if isinstance(err, SaeflowError) and "printf" not in str(err):
            raise
        return _walk(names)


class _Entry(typing.NamedTuple):
    rel: str  # path relative to the root (the file's name when the root is the file)
    size: int  # bytes
    line: bytes  # relpath, size, mtime, inode: the cache key of its content digest
    path: str  # where to read it


def _mtime(line: bytes) -> float:
    return float(line.rsplit(b"\t", 2)[1])


def _entries(root: pathlib.Path, raw: bytes, suffixes: tuple[str, ...]) -> list[_Entry]:
    """Every listed file with a suffix in `suffixes`, sorted by relpath."""
    prefix = str(root) + os.sep
    out = []
    for line in raw.split(b"\0")[:-1]:
        path_b, size_b, _mtime, _ino = line.rsplit(b"\t", 3)
        path = path_b.decode("utf-8", "surrogateescape")
        rel = path[len(prefix) :] if path.startswith(prefix) else os.path.basename(path)
        if os.path.splitext(rel)[1].lower() in suffixes:
            out.append(_Entry(rel, int(size_b), rel.encode("utf-8", "surrogateescape") + line[len(path_b) :], path))
    out.sort(key=lambda e: e.rel)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------


def _cache_fpaths(key: dict) -> tuple[pathlib.Path, pathlib.Path]:
    name = hashlib.sha256(canonical_json(key).encode("utf-8")).hexdigest()[:40]
    dpath = cache_dpath()
    return dpath / f"{name}.json", dpath / f"{name}.entries"


def _write(fpath: pathlib.Path, data: bytes) -> None:
    try:
        fpath.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(fpath, data)
    except OSError as err:
        if str(fpath.parent) not in _warned_unwritable:
            _warned_unwritable.add(str(fpath.parent))
            logger.warning("saeflow: cannot write the fingerprint cache %s (%s); set %s", fpath.parent, err, CACHE_ENV)


def _read_header(fpath: pathlib.Path, key: dict) -> dict | None:
    try:
        header = json.loads(fpath.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(header, dict) and header.get("version") == CACHE_VERSION and header.get("key") == key
    return header if ok else None


def _read_digests(fpath: pathlib.Path, n: int) -> dict[bytes, bytes]:
    """stat line -> content digest of the files the cache has seen (empty when unreadable or torn)."""
    try:
        data = fpath.read_bytes()
    except OSError:
        return {}
    lines = data[n * DIGEST_BYTES :].split(b"\0")
    if len(lines) != n:
        return {}
    return {line: data[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i, line in enumerate(lines)}


def _hash_files(root: pathlib.Path, todo: list[_Entry], progress: bool) -> dict[bytes, bytes]:
    from tqdm import tqdm

    n_bytes = sum(e.size for e in todo)
    digests = {}
    bar = tqdm(total=n_bytes, unit="B", unit_scale=True, desc=f"fingerprint {root}", disable=not progress, delay=1.0)
    with bar:
        for i, entry in enumerate(todo):
            try:
                digests[entry.line] = bytes.fromhex(file_sha256(entry.path, progress=bar.update))
            except OSError as err:
                raise SaeflowError(f"{entry.path}: unreadable ({err.strerror})") from None
            if i % 1024 == 0:
                bar.set_postfix_str(f"{i + 1}/{len(todo)} files", refresh=False)
    return digests


def recheck_mode() -> str:
    """How a re-plan looks for changes (RECHECK_ENV): `auto` (default), `files` or `directories`; one line for
    another."""
    mode = os.environ.get(RECHECK_ENV, "auto").strip().lower() or "auto"
    if mode not in RECHECKS:
        raise SaeflowError(f"{RECHECK_ENV}={mode!r}: not a recheck mode; choose one of {', '.join(RECHECKS)}")
    return mode


def _tracked(starts: list[pathlib.Path]) -> list[str]:
    """What `directories` mode stats: every directory below the starts (symlinks followed) and every start that
    is a file. Adding, removing or renaming an entry changes its directory's mtime; a start file is stat'ed itself."""
    out = []
    for start in map(str, starts):
        if not os.path.isdir(start):
            out.append(start)
            continue
        out.extend(dpath for dpath, _, _ in os.walk(start, followlinks=True))
    return out


def _tracked_sha256(paths: list[str], settled: float | None = None) -> str | None:
    """sha256 of (path, size, mtime, inode) of each tracked path; None when one is gone or (given `settled`) was
    modified after it (racy: not to be trusted later)."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if settled is not None and st.st_mtime >= settled:
            return None
        digest.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_ino}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _unchanged_directories(header: dict | None) -> bool:
    """`directories` mode: the tracked directories are as they were when the cache was written."""
    if header is None or header.get("listing_sha256") is None or not header.get("tracked_sha256"):
        return False
    return _tracked_sha256(header["tracked"]) == header["tracked_sha256"]


def of_files(
    root: pathlib.Path, starts: list[pathlib.Path], suffixes: tuple[str, ...], progress: bool = True
) -> Fingerprint:
    """The content fingerprint of the files below `starts` with a suffix in `suffixes` (lower case), relative to
    `root`; from the cache when nothing was changed since the last call (see the module docstring)."""
    suffixes = tuple(s.lower() for s in suffixes)
    key = {"root": str(root), "starts": [str(p) for p in starts], "suffixes": sorted(suffixes)}
    header_fpath, entries_fpath = _cache_fpaths(key)
    header = _read_header(header_fpath, key)
    tracked = {}  # `directories` mode: the directories' stats, taken before the listing (a later change is seen)
    mode = recheck_mode()
    if mode == "auto":  # a dataset not seen yet is tracked by directory too, in case it turns out big
        big = header is None or header["n_files"] >= AUTO_DIRECTORIES_FILES
        mode = "directories" if big else "files"
    if mode == "directories":
        if _unchanged_directories(header):
            return Fingerprint(header["sha256"], header["n_files"], header["n_bytes"])
        paths = _tracked(starts)
        tracked = {"tracked": paths, "tracked_sha256": _tracked_sha256(paths, time.time() - RACY_SEC)}
    raw = listing(starts)
    listing_sha256 = hashlib.sha256(raw).hexdigest()
    if header is not None and header["listing_sha256"] == listing_sha256:
        if tracked:
            _write(header_fpath, (json.dumps({**header, **tracked}, indent=1) + "\n").encode("utf-8"))
        return Fingerprint(header["sha256"], header["n_files"], header["n_bytes"])
    entries = _entries(root, raw, suffixes)
    known = _read_digests(entries_fpath, header["n_entries"]) if header is not None else {}
    fresh = _hash_files(root, [e for e in entries if e.line not in known], progress)
    digests = [known.get(e.line) or fresh[e.line] for e in entries]
    manifest = hashlib.sha256()
    for entry, digest in zip(entries, digests):
        manifest.update(f"{entry.rel}\t{entry.size}\t{digest.hex()}\n".encode("utf-8", "surrogateescape"))
    fp = Fingerprint(manifest.hexdigest(), len(entries), sum(e.size for e in entries))
    settled = time.time() - RACY_SEC
    kept = [(e, digest) for e, digest in zip(entries, digests) if _mtime(e.line) < settled]
    _write(entries_fpath, b"".join(d for _, d in kept) + b"\0".join(e.line for e, _ in kept))
    if len(kept) < len(entries):  # a racy file: the next plan must look at it again
        listing_sha256 = None
    header = {"version": CACHE_VERSION, "key": key, "listing_sha256": listing_sha256, "n_entries": len(kept)}
    _write(header_fpath, (json.dumps({**header, **tracked, **dataclasses.asdict(fp)}, indent=1) + "\n").encode("utf-8"))
    return fp


def cached_value(key: dict, compute: typing.Callable[[], typing.Any]):
    """`compute()` once per `key` (a JSON object naming everything the value depends on, content fingerprints
    included), then from the cache: e.g. the number of examples of a tokenized corpus."""
    fpath = cache_dpath() / "values" / f"{hashlib.sha256(canonical_json(key).encode('utf-8')).hexdigest()}.json"
    try:
        stored = json.loads(fpath.read_text(encoding="utf-8"))
        if stored.get("key") == json.loads(canonical_json(key)):
            return stored["value"]
    except (OSError, ValueError, AttributeError):
        pass
    value = compute()
    _write(fpath, (canonical_json({"key": key, "value": value}) + "\n").encode("utf-8"))
    return value


def file_digest(fpath: pathlib.Path, algorithm: str) -> str:
    """The hex digest ("sha256" or "git-sha1", DIGESTS) of one file's bytes: read once per (path, size, mtime_ns,
    inode), then from the cache; a file modified in the last RACY_SEC seconds is read every time."""
    try:
        st = os.stat(fpath)
    except OSError as err:
        raise unreadable(fpath, err) from None

    def compute() -> str:
        try:
            return DIGESTS[algorithm](fpath)
        except OSError as err:
            raise unreadable(fpath, err) from None

    if st.st_mtime >= time.time() - RACY_SEC:
        return compute()
    key = {"what": "file digest", "algorithm": algorithm, "path": os.path.abspath(fpath), "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}  # fmt: skip
    return cached_value(key, compute)
