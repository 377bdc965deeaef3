"""The saev protocol 2.0 shard store: metadata, sizing maths, an atomic streaming writer and a validating reader.

Layout of a published directory `<shards_root>/<hash>/` (protocol 2.0 plus saeflow's documented extras):

    metadata.json     the hashed description (protocol section 2.1); `<hash>` = sha256 of its canonical JSON
    shards.json       [{"name": "acts000000.bin", "n_ex": ...}, ...]
    acts%06d.bin      float32 (or opt-in float16) C-order arrays of shape (n_ex_in_shard, L, T, D)
    labels.bin        optional, uint8 (n_ex, patches_per_ex): one label per patch, CLS excluded
    tokens.bin        optional, int32 (n_ex, tokens_per_ex): the token id at every stored position (text models)
    checksums.json    {"files": {name: {"bytes": int, "sha256": hex}}} for every file above (deterministic)
    provenance.json   versions, host, git commit, times: the only file that differs between two identical runs

Files not listed here are stray: validation ignores them and `saeflow validate` names them as warnings.
Beside it, while it is built: `.<hash>.partial/` (staging, with `progress.json`) and `.<hash>.lock` (flock).
docs/store.md describes every file and the crash/resume/concurrency guarantees.
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import queue
import threading
import typing

import numpy as np
import tqdm

from saeflow import atomic, provenance
from saeflow.errors import SaeflowError, ShardDirError
from saeflow.hashing import content_hash, file_sha256

PROTOCOL = "2.0"
DTYPES = ("float32", "float16")
DEFAULT_PATCHES_PER_SHARD = 2_400_000
METADATA_FNAME = "metadata.json"
SHARDS_FNAME = "shards.json"
CHECKSUMS_FNAME = "checksums.json"
PROGRESS_FNAME = "progress.json"  # staging only: completed shards, for resume


def shard_fname(shard_idx: int) -> str:
    return f"acts{shard_idx:06d}.bin"


@dataclasses.dataclass(frozen=True)
class AuxSpec:
    """A per-example side array stored in one file beside the shards."""

    dtype: str
    row_shape: typing.Callable[["Metadata"], tuple[int, ...]]


AUX_FILES: dict[str, AuxSpec] = {
    "labels.bin": AuxSpec("uint8", lambda md: (md.patches_per_ex,)),
    "tokens.bin": AuxSpec("int32", lambda md: (md.tokens_per_ex,)),
}
KNOWN_FNAMES = {METADATA_FNAME, SHARDS_FNAME, CHECKSUMS_FNAME, provenance.PROVENANCE_FNAME, *AUX_FILES}


# ---------------------------------------------------------------------------------------------------------------
# Metadata and sizing maths (protocol sections 2.1, 3, 4)
# ---------------------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_plain_json(x) -> bool:
    """True when `x` survives a JSON round trip unchanged, so its hash is the hash of what metadata.json holds."""
    if x is None or isinstance(x, (str, bool, int)):
        return True
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, list):
        return all(_is_plain_json(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in x.items())
    return False


@dataclasses.dataclass(frozen=True)
class Metadata:
    """Exactly the keys of protocol section 2.1. Everything that changes the bytes of the shards is in here."""

    family: str
    ckpt: str
    layers: tuple[int, ...]
    patches_per_ex: int
    cls_token: bool
    d_model: int
    n_ex: int
    patches_per_shard: int
    data: dict
    dataset: str
    dtype: str = "float32"
    protocol: str = PROTOCOL

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        problems = []
        for key in ("family", "ckpt", "dataset", "dtype", "protocol"):
            if not isinstance(getattr(self, key), str):
                problems.append(f"{key} must be a string, got {getattr(self, key)!r}")
        for key in ("patches_per_ex", "d_model", "n_ex", "patches_per_shard"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                problems.append(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(self.cls_token, bool):
            problems.append(f"cls_token must be true or false, got {self.cls_token!r}")
        if not self.layers or not all(_is_int(layer) and layer >= 0 for layer in self.layers):
            problems.append(f"layers must be a non-empty list of non-negative integers, got {list(self.layers)!r}")
        elif len(set(self.layers)) != len(self.layers):
            problems.append(f"layers must not repeat, got {list(self.layers)!r}")
        if not isinstance(self.data, dict) or "__class__" not in self.data:
            problems.append("data must be an object with a '__class__' key")
        elif not _is_plain_json(self.data):
            problems.append("data must be plain JSON (string keys; str, int, finite float, bool, null, list, object)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.protocol != PROTOCOL:
            problems.append(f"protocol must be {PROTOCOL!r}, got {self.protocol!r}")
        if not problems and self.ex_per_shard < 1:
            problems.append(
                f"patches_per_shard={self.patches_per_shard} is smaller than one example "
                f"({self.tokens_per_ex} tokens x {len(self.layers)} layers = {self.tokens_per_ex * len(self.layers)})"
            )
        if problems:
            raise SaeflowError("invalid shard metadata: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, obj: typing.Any) -> "Metadata":
        if not isinstance(obj, dict):
            raise SaeflowError(f"metadata must be a JSON object, got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, extra = sorted(names - obj.keys()), sorted(obj.keys() - names)
        if missing or extra:
            raise SaeflowError(f"metadata keys differ from protocol 2.0: missing {missing}, unexpected {extra}")
        return cls(**obj)

    def to_dict(self) -> dict:
        obj = dataclasses.asdict(self)
        obj["layers"] = list(self.layers)
        return obj

    @property
    def hash(self) -> str:
        return content_hash(self.to_dict())

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def tokens_per_ex(self) -> int:
        return tokens_per_ex(self.patches_per_ex, self.cls_token)

    @property
    def ex_per_shard(self) -> int:
        return ex_per_shard(self.patches_per_shard, self.tokens_per_ex, self.n_layers)

    @property
    def shard_sizes(self) -> list[int]:
        return shard_sizes(self.n_ex, self.ex_per_shard)

    @property
    def bytes_per_ex(self) -> int:
        return self.n_layers * self.tokens_per_ex * self.d_model * np.dtype(self.dtype).itemsize

    @property
    def n_bytes(self) -> int:
        return self.n_ex * self.bytes_per_ex

    def layer_idx(self, layer: int) -> int:
        """Protocol 4.2: the index of a layer *value* in `layers`; an error if it was not recorded."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise SaeflowError(f"layer {layer} is not stored here; stored layers are {list(self.layers)}") from None


def tokens_per_ex(patches_per_ex: int, cls_token: bool) -> int:
    return patches_per_ex + (1 if cls_token else 0)


def ex_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_ex: int, ex_per_shard: int) -> list[int]:
    """Examples per shard: all full but the last, which holds only its own examples (never an empty shard)."""
    n_full, rest = divmod(n_ex, ex_per_shard)
    return [ex_per_shard] * n_full + ([rest] if rest else [])


def locate(md: Metadata, ex: int, layer: int, token: int) -> tuple[int, int]:
    """Protocol 4.2: (shard index, byte offset within that shard) of one vector."""
    if not 0 <= ex < md.n_ex:
        raise SaeflowError(f"example {ex} out of range [0, {md.n_ex})")
    if not 0 <= token < md.tokens_per_ex:
        raise SaeflowError(f"token {token} out of range [0, {md.tokens_per_ex})")
    layer_idx = md.layer_idx(layer)
    shard_idx, ex_in_shard = divmod(ex, md.ex_per_shard)
    T, L = md.tokens_per_ex, md.n_layers
    offset_in_vectors = ex_in_shard * L * T + layer_idx * T + token
    return shard_idx, offset_in_vectors * md.d_model * np.dtype(md.dtype).itemsize


def read_json(fpath: pathlib.Path):
    return json.loads(fpath.read_text(encoding="utf-8"))


def expected_shards_json(md: Metadata) -> list[dict]:
    return [{"name": shard_fname(i), "n_ex": n} for i, n in enumerate(md.shard_sizes)]


# ---------------------------------------------------------------------------------------------------------------
# Validation and reading
# ---------------------------------------------------------------------------------------------------------------


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
    problems: list[str] = []
    warnings: list[str] = []
    checksums = _read_checksums(dpath, problems, warnings)

    md_fpath = dpath / METADATA_FNAME
    try:
        md_obj = read_json(md_fpath)
        md = Metadata.from_dict(md_obj)
    except FileNotFoundError:
        problems.append(f"{md_fpath}: missing")
        md = md_obj = None
    except (json.JSONDecodeError, UnicodeDecodeError, SaeflowError, TypeError) as err:
        problems.append(f"{md_fpath}: unreadable ({err})")
        md = md_obj = None
    if md is None:
        # Without metadata the sizes are unknown, but every other file checksums.json names can still be missed.
        for fname in sorted((checksums or {}).keys() - {METADATA_FNAME}):
            if not (dpath / fname).exists():
                problems.append(f"{dpath / fname}: missing")
        return Report(problems, warnings)

    actual_hash = content_hash(md_obj)
    expected_name = dpath.resolve().name if name is None else name  # a run's links/ symlink names its target
    if actual_hash != expected_name:
        problems.append(
            f"{md_fpath}: its sha256 is {actual_hash}, but the directory must be named {expected_name} "
            "(metadata.json was edited, or the directory was renamed)"
        )

    shards_fpath = dpath / SHARDS_FNAME
    try:
        listed = read_json(shards_fpath)
        if listed != expected_shards_json(md):
            problems.append(
                f"{shards_fpath}: lists {_describe_shards(listed)} but metadata.json implies "
                f"{_describe_shards(expected_shards_json(md))}"
            )
    except FileNotFoundError:
        problems.append(f"{shards_fpath}: missing")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(f"{shards_fpath}: unreadable ({err})")

    expected_bytes = {shard_fname(i): n * md.bytes_per_ex for i, n in enumerate(md.shard_sizes)}
    for fname in AUX_FILES:  # side files are optional: required when checksums.json lists them
        if (checksums is not None and fname in checksums) or (dpath / fname).exists():
            expected_bytes[fname] = aux_n_bytes(md, fname)
    if checksums is not None:
        for fname in sorted(checksums.keys() - expected_bytes.keys() - {METADATA_FNAME, SHARDS_FNAME}):
            problems.append(f"{dpath / CHECKSUMS_FNAME}: lists unexpected file {fname}")

    for fname, n_bytes in expected_bytes.items():
        fpath = dpath / fname
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            problems.append(f"{fpath}: missing")
            continue
        if size != n_bytes:
            problems.append(f"{fpath}: {size} bytes, expected {n_bytes} (truncated or overwritten)")

    if deep and checksums is None:
        problems.append(f"{dpath / CHECKSUMS_FNAME}: missing or unreadable, so checksums cannot be verified")
    elif deep:
        problems.extend(_verify_checksums(dpath, checksums))

    known = KNOWN_FNAMES | expected_bytes.keys()
    for child in sorted(dpath.iterdir()):
        if child.name not in known:
            warnings.append(f"{child}: stray file, not part of the shard directory (ignored)")
    return Report(problems, warnings)


def _read_checksums(dpath: pathlib.Path, problems: list[str], warnings: list[str]) -> dict[str, dict] | None:
    """checksums.json as {name: {"bytes", "sha256"}}; None (with a warning or problem) when absent or broken."""
    fpath = dpath / CHECKSUMS_FNAME
    try:
        files = read_json(fpath)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and _is_int(e.get("bytes")) and isinstance(e.get("sha256"), str) for e in files.values()
        ):
            raise TypeError("expected {'files': {name: {'bytes': int, 'sha256': hex}}}")
        return files
    except FileNotFoundError:
        warnings.append(f"{fpath}: missing (not written by saeflow?): side files and checksums are not checked")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        problems.append(f"{fpath}: unreadable ({err})")
    return None


def _verify_checksums(dpath: pathlib.Path, checksums: dict[str, dict]) -> list[str]:
    """Re-hash every listed file (the slow part of `--deep`), with a progress bar over bytes."""
    problems = []
    present = {f: e for f, e in sorted(checksums.items()) if (dpath / f).exists()}
    total = sum((dpath / f).stat().st_size for f in present)
    with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=None, leave=False) as bar:
        for fname, entry in present.items():
            if file_sha256(dpath / fname, progress=bar.update) != entry["sha256"]:
                problems.append(f"{dpath / fname}: sha256 differs from checksums.json (the bytes changed)")
    return problems


def _describe_shards(shards) -> str:
    if not isinstance(shards, list):
        return repr(shards)[:80]
    return f"{len(shards)} shards with n_ex {[s.get('n_ex') if isinstance(s, dict) else s for s in shards]}"


def aux_n_bytes(md: Metadata, fname: str) -> int:
    return md.n_ex * aux_row_bytes(md, fname)


def aux_row_bytes(md: Metadata, fname: str) -> int:
    spec = AUX_FILES[fname]
    return int(np.prod(spec.row_shape(md))) * np.dtype(spec.dtype).itemsize


class ShardDir:
    """A validated, read-only view of a published shard directory, memory-mapped on demand."""

    def __init__(self, dpath: str | os.PathLike):
        self.dpath = pathlib.Path(dpath)
        report = validate(self.dpath)
        if not report.ok:
            raise ShardDirError(self.dpath, report.problems)
        self.metadata = Metadata.from_dict(read_json(self.dpath / METADATA_FNAME))
        self.hash = self.dpath.resolve().name
        self.shard_sizes = self.metadata.shard_sizes
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._acts: dict[int, np.memmap] = {}

    @property
    def n_ex(self) -> int:
        return self.metadata.n_ex

    def shard_fpath(self, shard_idx: int) -> pathlib.Path:
        return self.dpath / shard_fname(shard_idx)

    def acts(self, shard_idx: int) -> np.memmap:
        """The memory map of one shard, shape (n_ex_in_shard, L, T, D)."""
        if shard_idx not in self._acts:
            md = self.metadata
            shape = (self.shard_sizes[shard_idx], md.n_layers, md.tokens_per_ex, md.d_model)
            self._acts[shard_idx] = np.memmap(self.shard_fpath(shard_idx), dtype=md.dtype, mode="r", shape=shape)
        return self._acts[shard_idx]

    def vector(self, ex: int, layer: int, token: int) -> np.ndarray:
        """One activation vector (D,) by global example index, layer value and token index."""
        shard_idx, _ = locate(self.metadata, ex, layer, token)
        return np.array(self.acts(shard_idx)[ex - self.shard_starts[shard_idx], self.metadata.layer_idx(layer), token])

    def example(self, ex: int, layer: int) -> np.ndarray:
        """All tokens of one example at one layer, (T, D)."""
        shard_idx, _ = locate(self.metadata, ex, layer, 0)
        return np.array(self.acts(shard_idx)[ex - self.shard_starts[shard_idx], self.metadata.layer_idx(layer)])

    def iter_blocks(self, layer: int, ex_per_block: int = 1024) -> typing.Iterator[tuple[int, np.ndarray]]:
        """(first example index, (n, T, D) array) for one layer, in storage order, never crossing a shard."""
        if ex_per_block < 1:
            raise SaeflowError(f"ex_per_block must be a positive integer, got {ex_per_block}")
        layer_idx = self.metadata.layer_idx(layer)
        for shard_idx, n in enumerate(self.shard_sizes):
            acts = self.acts(shard_idx)
            for start in range(0, n, ex_per_block):
                stop = min(start + ex_per_block, n)
                yield int(self.shard_starts[shard_idx]) + start, np.ascontiguousarray(acts[start:stop, layer_idx])

    def has_aux(self, fname: str) -> bool:
        return (self.dpath / fname).exists()

    def aux(self, fname: str) -> np.memmap:
        """labels.bin (n_ex, patches_per_ex) uint8 or tokens.bin (n_ex, T) int32."""
        spec = AUX_FILES[fname]
        fpath = self.dpath / fname
        if not fpath.exists():
            raise SaeflowError(f"{fpath}: this shard directory has no {fname}")
        return np.memmap(fpath, dtype=spec.dtype, mode="r", shape=(self.n_ex, *spec.row_shape(self.metadata)))

    def provenance(self) -> dict | None:
        fpath = self.dpath / provenance.PROVENANCE_FNAME
        return read_json(fpath) if fpath.exists() else None


def open_existing(final_dpath: pathlib.Path) -> ShardDir | None:
    """A valid published directory, None if nothing is there; ShardDirError if something broken is there.

    An empty directory counts as nothing (Snakemake creates an output's parent before the job runs); publishing
    replaces it in the same single rename.
    """
    if not os.path.lexists(final_dpath) or (final_dpath.is_dir() and not any(final_dpath.iterdir())):
        return None
    try:
        return ShardDir(final_dpath)
    except ShardDirError as err:
        raise ShardDirError(
            final_dpath,
            err.problems,
            hint="saeflow never rewrites or deletes a published directory; nothing was changed. Check it with "
            f"`saeflow validate {final_dpath}`, then move it away (chmod -R u+w first) to rebuild it.",
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


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
        self.dpath = self.root / metadata.hash
        self.staging = atomic.staging_dpath(self.dpath)
        self.lock_fpath = self.root / f".{metadata.hash}.lock"
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
            return read_json(self.staging / METADATA_FNAME) == self.md.to_dict()
        except (OSError, ValueError):
            return False

    def _staging_is_sealed(self) -> bool:
        """True when staging holds a complete, valid directory with our side files (progress.json already gone)."""
        if (self.staging / PROGRESS_FNAME).exists() or not self._staging_has_our_metadata():
            return False
        report = validate(self.staging, name=self.md.hash)
        aux_present = tuple(f for f in AUX_FILES if (self.staging / f).exists())
        if not report.ok or aux_present != self.aux_fnames or not (self.staging / CHECKSUMS_FNAME).exists():
            return False
        atomic.make_tree_writable(self.staging)  # a run killed inside publish_dir may have made it read-only
        shard_names = (s["name"] for s in expected_shards_json(self.md))
        self._remove_strays(
            {METADATA_FNAME, SHARDS_FNAME, CHECKSUMS_FNAME, provenance.PROVENANCE_FNAME, *aux_present, *shard_names}
        )
        return True

    def _prepare_staging(self):
        """Resume from the last complete shard in the staging directory, or start it afresh."""
        progress_fpath = self.staging / PROGRESS_FNAME
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
        atomic.write_json(self.staging / METADATA_FNAME, self.md.to_dict())
        for fname in self.aux_fnames:
            (self.staging / fname).touch()
        atomic.write_file_atomic(progress_fpath, json.dumps({"completed": []}).encode())

    def _truncate_to(self, completed: list) -> bool:
        """Drop everything after the completed shards; False if the staging directory cannot be trusted."""
        sizes = self.md.shard_sizes
        try:
            for i, entry in enumerate(completed):
                fpath = self.staging / shard_fname(i)
                if (
                    i >= len(sizes)
                    or entry["name"] != shard_fname(i)
                    or entry["n_ex"] != sizes[i]
                    or entry["bytes"] != sizes[i] * self.md.bytes_per_ex
                    or not isinstance(entry["sha256"], str)
                    or fpath.stat().st_size != entry["bytes"]
                ):
                    return False
            n_done = sum(sizes[: len(completed)])
            for fname in self.aux_fnames:
                if (self.staging / fname).stat().st_size < n_done * aux_row_bytes(self.md, fname):
                    return False
        except (OSError, KeyError, TypeError):
            return False
        # Trusted: remove the unfinished shard, other side files and temporary files, then cut the side files.
        atomic.make_tree_writable(self.staging)  # a run killed inside publish_dir may have made it read-only
        self._remove_strays({METADATA_FNAME, PROGRESS_FNAME, *self.aux_fnames, *(s["name"] for s in completed)})
        for fname in self.aux_fnames:
            os.truncate(self.staging / fname, n_done * aux_row_bytes(self.md, fname))
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
            aux_fds = {fname: open(self.staging / fname, "ab") for fname in self.aux_fnames}
            while (item := self._queue.get()) is not None:
                shard_idx, acts, aux_rows = item
                if shard is None:
                    shard = _ShardFile(self.staging / shard_fname(shard_idx), hasher)
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
        atomic.write_file_atomic(self.staging / PROGRESS_FNAME, progress)

    # -- publishing -------------------------------------------------------------------------------------------

    def _publish(self):
        md = self.md
        if self.n_written != md.n_ex or len(self._completed) != len(md.shard_sizes):
            raise SaeflowError(
                f"only {self.n_written} of {md.n_ex} examples were written to {self.staging}; nothing was published. "
                "Rerun to resume from the last complete shard."
            )
        atomic.write_json(self.staging / SHARDS_FNAME, expected_shards_json(md))
        files = {s["name"]: {"bytes": s["bytes"], "sha256": s["sha256"]} for s in self._completed}
        for fname in (METADATA_FNAME, SHARDS_FNAME, *self.aux_fnames):
            fpath = self.staging / fname
            files[fname] = {"bytes": fpath.stat().st_size, "sha256": file_sha256(fpath)}
        atomic.write_json(self.staging / CHECKSUMS_FNAME, {"files": files})
        prov = {
            **provenance.collect(),
            **self.provenance_extra,
            "started_at": self._started_at,
            "finished_at": provenance.utc_now(),
            "resumed_from_ex": self.resumed_from,
        }
        atomic.write_json(self.staging / provenance.PROVENANCE_FNAME, prov)
        # From here the staging directory is sealed: a run killed before the rename publishes it on entry.
        (self.staging / PROGRESS_FNAME).unlink()
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
