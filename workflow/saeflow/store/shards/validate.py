"""Validation of a shard directory without trusting it: its name against the metadata hash, the shard list, every
file's size, and (with `deep`) every file's sha256 against the checksums file.

The checksums file is {"files": {name: {"bytes": int, "sha256": hex}}} for every listed file but itself and the
provenance (the only file that differs between two identical runs). The listed files are the `ShardLayout` files,
the shards and the side files; anything else is stray: validation ignores it and `saeflow validate` names it as a
warning.
"""

import dataclasses
import json
import os
import pathlib
import stat

import tqdm

from saeflow.errors import SaeflowError, read_problem
from saeflow.store.hashing import content_hash, file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import AUX_FILES, Metadata, _is_int, aux_n_bytes, expected_shards_json

KNOWN_FNAMES = {
    ShardLayout.METADATA_FNAME,
    ShardLayout.SHARDS_FNAME,
    ShardLayout.CHECKSUMS_FNAME,
    ShardLayout.PROVENANCE_FNAME,
    *AUX_FILES,
}


def read_json(fpath: pathlib.Path):
    return json.loads(fpath.read_text(encoding="utf-8"))


class _Unreadable(Exception):
    """A file that could not be read or parsed; the message is the problem (without the path)."""


def _load_json(fpath: pathlib.Path):
    """The parsed JSON of a file; `_Unreadable` says why not (missing, a directory, permission, not JSON)."""
    try:
        return read_json(fpath)
    except OSError as err:
        raise _Unreadable(read_problem(err)) from None
    except UnicodeDecodeError as err:
        raise _Unreadable(f"unreadable (not UTF-8 text: {err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise _Unreadable(f"unreadable (not valid JSON: {err})") from None


def file_problem(fpath: pathlib.Path, n_bytes: int | None = None) -> str | None:
    """Why `fpath` is not a regular file this user can read (of `n_bytes` bytes); None when it is. Cheap: a stat
    and an access check, no read."""
    try:
        st = fpath.stat()
    except OSError as err:
        return f"{fpath}: {read_problem(err)}"
    if stat.S_ISDIR(st.st_mode):
        return f"{fpath}: is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return f"{fpath}: not a regular file"
    if not os.access(fpath, os.R_OK):
        return f"{fpath}: cannot read (permission denied)"
    if n_bytes is not None and st.st_size != n_bytes:
        return f"{fpath}: {st.st_size} bytes, expected {n_bytes} (truncated or overwritten)"
    return None


def stat_problem(dpath: str | os.PathLike, md: Metadata) -> str | None:
    """The first file of a published directory that is missing, unreadable or of the wrong size, found by stat
    alone (nothing read, nothing hashed): metadata.json, every shard `md` implies, and the side files present.

    Cheap enough for planning, where a job must not start on a directory whose files were deleted or truncated
    (a scratch purge removes files one by one); `validate` (`--deep`: every sha256) checks everything else."""
    layout = ShardLayout(pathlib.Path(dpath))
    expected: dict[str, int | None] = {layout.METADATA_FNAME: None}
    expected.update({layout.shard_fname(i): n * md.bytes_per_ex for i, n in enumerate(md.shard_sizes)})
    expected.update({fname: aux_n_bytes(md, fname) for fname in AUX_FILES if os.path.lexists(layout.file(fname))})
    for fname, n_bytes in expected.items():
        if problem := file_problem(layout.file(fname), n_bytes):
            return problem
    return None


@dataclasses.dataclass
class Report:
    """What `validate` found: problems make a directory invalid; warnings (stray files) do not."""

    problems: list[str]
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def validate(dpath: str | os.PathLike, deep: bool = False, name: str | None = None) -> Report:
    """Check a shard directory without trusting it. Every problem is collected, each naming its file.

    `name` is the hash the directory must carry; the default is its own name (the writer passes the hash while
    the directory is still its staging sibling). Reads only metadata, sizes and JSON unless `deep`.
    """
    dpath = pathlib.Path(dpath)
    if not dpath.is_dir():
        return Report([f"{dpath}: does not exist or is not a directory"], [])
    if not os.access(dpath, os.R_OK | os.X_OK):
        return Report([f"{dpath}: cannot read the directory (permission denied)"], [])
    layout = ShardLayout(dpath)
    problems: list[str] = []
    warnings: list[str] = []
    checksums = _read_checksums(layout, problems, warnings)

    md_fpath = layout.metadata_fpath
    try:
        md_obj = _load_json(md_fpath)
        md = Metadata.from_dict(md_obj)
    except _Unreadable as err:
        problems.append(f"{md_fpath}: {err}")
        md = md_obj = None
    except (SaeflowError, TypeError) as err:
        problems.append(f"{md_fpath}: unreadable ({err})")
        md = md_obj = None
    if md is None:
        # Without metadata the sizes are unknown, but every other file the checksums name can still be missed.
        for fname in sorted((checksums or {}).keys() - {layout.METADATA_FNAME}):
            if not layout.file(fname).exists():
                problems.append(f"{layout.file(fname)}: missing")
        return Report(problems, warnings)

    actual_hash = content_hash(md_obj)
    expected_name = dpath.resolve().name if name is None else name  # a run's links/ symlink names its target
    if actual_hash != expected_name:
        problems.append(
            f"{md_fpath}: its sha256 is {actual_hash}, but the directory must be named {expected_name} "
            f"({layout.METADATA_FNAME} was edited, or the directory was renamed)"
        )

    shards_fpath = layout.shards_fpath
    try:
        listed = _load_json(shards_fpath)
        if listed != expected_shards_json(md):
            problems.append(
                f"{shards_fpath}: lists {_describe_shards(listed)} but {layout.METADATA_FNAME} implies "
                f"{_describe_shards(expected_shards_json(md))}"
            )
    except _Unreadable as err:
        problems.append(f"{shards_fpath}: {err}")

    expected_bytes = {layout.shard_fname(i): n * md.bytes_per_ex for i, n in enumerate(md.shard_sizes)}
    for fname in AUX_FILES:  # side files are optional: required when the checksums list them
        if (checksums is not None and fname in checksums) or layout.file(fname).exists():
            expected_bytes[fname] = aux_n_bytes(md, fname)
    if checksums is not None:
        for fname in sorted(checksums.keys() - expected_bytes.keys() - {layout.METADATA_FNAME, layout.SHARDS_FNAME}):
            problems.append(f"{layout.checksums_fpath}: lists unexpected file {fname}")

    for fname, n_bytes in expected_bytes.items():
        if problem := file_problem(layout.file(fname), n_bytes):
            problems.append(problem)

    if deep and checksums is None:
        problems.append(f"{layout.checksums_fpath}: missing or unreadable, so checksums cannot be verified")
    elif deep:
        problems.extend(_verify_checksums(layout, checksums))

    known = KNOWN_FNAMES | expected_bytes.keys()
    for child in sorted(dpath.iterdir()):
        if child.name not in known:
            warnings.append(f"{child}: stray file, not part of the shard directory (ignored)")
    return Report(problems, warnings)


def _read_checksums(layout: ShardLayout, problems: list[str], warnings: list[str]) -> dict[str, dict] | None:
    """The checksums file as {name: {"bytes", "sha256"}}; None (with a warning or problem) when absent or broken."""
    fpath = layout.checksums_fpath
    if not os.path.lexists(fpath):
        warnings.append(f"{fpath}: missing (not written by saeflow?): side files and checksums are not checked")
        return None
    try:
        files = _load_json(fpath)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and _is_int(e.get("bytes")) and isinstance(e.get("sha256"), str) for e in files.values()
        ):
            raise TypeError("expected {'files': {name: {'bytes': int, 'sha256': hex}}}")
        return files
    except _Unreadable as err:
        problems.append(f"{fpath}: {err}")
    except (KeyError, TypeError) as err:
        problems.append(f"{fpath}: unreadable ({err})")
    return None


def _verify_checksums(layout: ShardLayout, checksums: dict[str, dict]) -> list[str]:
    """Re-hash every listed file (the slow part of `--deep`), with a progress bar over bytes."""
    problems = []
    # Files that are missing, not regular or unreadable are already problems of the shallow check.
    present = {f: e for f, e in sorted(checksums.items()) if file_problem(layout.file(f)) is None}
    total = sum(layout.file(f).stat().st_size for f in present)
    with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=None, leave=False) as bar:
        for fname, entry in present.items():
            try:
                digest = file_sha256(layout.file(fname), progress=bar.update)
            except OSError as err:  # an I/O error deep in the file, or it changed under us
                problems.append(f"{layout.file(fname)}: {read_problem(err)}")
                continue
            if digest != entry["sha256"]:
                problems.append(
                    f"{layout.file(fname)}: sha256 differs from {layout.CHECKSUMS_FNAME} (the bytes changed)"
                )
    return problems


def _describe_shards(shards) -> str:
    if not isinstance(shards, list):
        return repr(shards)[:80]
    return f"{len(shards)} shards with n_ex {[s.get('n_ex') if isinstance(s, dict) else s for s in shards]}"
