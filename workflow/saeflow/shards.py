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
"""

import dataclasses
import json
import os
import pathlib
import queue
import threading
import typing

import numpy as np

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


def validate(dpath: pathlib.Path, deep: bool = False) -> Report:
    """Check a shard directory without trusting it. Every problem is collected, each naming its file."""
    dpath = pathlib.Path(dpath)
    problems: list[str] = []
    warnings: list[str] = []
    if not dpath.is_dir():
        return Report([f"{dpath} does not exist or is not a directory"], [])

    md_fpath = dpath / METADATA_FNAME
    try:
        md_obj = read_json(md_fpath)
        md = Metadata.from_dict(md_obj)
    except FileNotFoundError:
        return Report([f"{md_fpath}: missing"], [])
    except (json.JSONDecodeError, UnicodeDecodeError, SaeflowError, TypeError) as err:
        return Report([f"{md_fpath}: unreadable ({err})"], [])

    actual_hash = content_hash(md_obj)
    if dpath.name != actual_hash:
        problems.append(
            f"{md_fpath}: its sha256 is {actual_hash}, but the directory is named {dpath.name} "
            "(metadata.json was edited, or the directory was renamed)"
        )

    shards_fpath = dpath / SHARDS_FNAME
    try:
        shards = read_json(shards_fpath)
        if shards != expected_shards_json(md):
            problems.append(
                f"{shards_fpath}: lists {_describe_shards(shards)} but metadata.json implies "
                f"{_describe_shards(expected_shards_json(md))}"
            )
    except FileNotFoundError:
        problems.append(f"{shards_fpath}: missing")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(f"{shards_fpath}: unreadable ({err})")

    expected_bytes = {shard_fname(i): n * md.bytes_per_ex for i, n in enumerate(md.shard_sizes)}
    checksums = None
    checksums_fpath = dpath / CHECKSUMS_FNAME
    if checksums_fpath.exists():
        try:
            checksums = read_json(checksums_fpath)["files"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            problems.append(f"{checksums_fpath}: unreadable ({err})")
    if checksums:
        for fname in AUX_FILES:
            if fname in checksums:
                expected_bytes[fname] = aux_n_bytes(md, fname)
        for fname in checksums.keys() - expected_bytes.keys() - {METADATA_FNAME, SHARDS_FNAME}:
            problems.append(f"{checksums_fpath}: lists unexpected file {fname}")
    elif (dpath / "labels.bin").exists():
        expected_bytes["labels.bin"] = aux_n_bytes(md, "labels.bin")

    for fname, n_bytes in expected_bytes.items():
        fpath = dpath / fname
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            problems.append(f"{fpath}: missing")
            continue
        if size != n_bytes:
            problems.append(f"{fpath}: {size} bytes, expected {n_bytes} (truncated or overwritten)")

    if deep:
        if checksums is None:
            problems.append(f"{checksums_fpath}: missing, so checksums cannot be verified")
        else:
            for fname, entry in sorted(checksums.items()):
                fpath = dpath / fname
                if fpath.exists() and file_sha256(fpath) != entry["sha256"]:
                    problems.append(f"{fpath}: sha256 differs from checksums.json (the bytes changed)")

    known = KNOWN_FNAMES | expected_bytes.keys()
    for child in sorted(dpath.iterdir()):
        if child.name not in known:
            warnings.append(f"{child}: stray file, not part of the shard directory (ignored)")
    return Report(problems, warnings)


def _describe_shards(shards) -> str:
    if not isinstance(shards, list):
        return repr(shards)[:80]
    return f"{len(shards)} shards with n_ex {[s.get('n_ex') if isinstance(s, dict) else s for s in shards]}"


def aux_n_bytes(md: Metadata, fname: str) -> int:
    spec = AUX_FILES[fname]
    return md.n_ex * int(np.prod(spec.row_shape(md))) * np.dtype(spec.dtype).itemsize


class ShardDir:
    """A validated, read-only view of a published shard directory, memory-mapped on demand."""

    def __init__(self, dpath: str | os.PathLike):
        self.dpath = pathlib.Path(dpath)
        report = validate(self.dpath)
        if not report.ok:
            raise ShardDirError(self.dpath, report.problems)
        self.metadata = Metadata.from_dict(read_json(self.dpath / METADATA_FNAME))
        self.hash = self.dpath.name
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
    """A valid published directory, None if nothing is there; ShardDirError if something broken is there."""
    if not final_dpath.exists():
        return None
    return ShardDir(final_dpath)


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


class ShardWriter:
    """Streams examples, in order, into `<shards_root>/<hash>/` and publishes it atomically.

        with ShardWriter(root, metadata, aux=("tokens.bin",)) as writer:
            if not writer.reused:
                for batch in batches[writer.n_written:]:   # resume point after a crash
                    writer.write(acts_nltd, aux={"tokens.bin": ids_nt})
        writer.dpath  # the published directory

    Only one process builds a given hash at a time (an `flock` on `<root>/.<hash>.lock`); a second one waits and
    then reuses the published directory. The build happens in `<root>/.<hash>.partial/`; every completed shard is
    fsynced and recorded there, so a killed writer resumes from the last complete shard. Disk writes and checksums
    run on a background thread, so the producer (the model) is not slowed by I/O.
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
        self.aux_fnames = tuple(aux)
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
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_cm = atomic.exclusive_lock(self.lock_fpath)
        self._lock_cm.__enter__()
        try:
            if open_existing(self.dpath) is not None:  # published by another process while we waited
                self.reused = True
                return self
            self._prepare_staging()
        except BaseException:
            self._release_lock()
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
            if self.dpath.exists():
                self.lock_fpath.unlink(missing_ok=True)

    def _prepare_staging(self):
        """Resume from the last complete shard in the staging directory, or start it afresh."""
        progress_fpath = self.staging / PROGRESS_FNAME
        try:
            same_md = read_json(self.staging / METADATA_FNAME) == self.md.to_dict()
            completed = read_json(progress_fpath)["completed"] if same_md else None
        except (OSError, ValueError, KeyError, TypeError):
            completed = None
        if completed is not None and self._truncate_to(completed):
            self._completed = completed
            self.n_written = self.resumed_from = sum(s["n_ex"] for s in completed)
            return
        atomic.remove_staging(self.staging)
        self.staging.mkdir(parents=True)
        atomic.write_json(self.staging / METADATA_FNAME, self.md.to_dict())
        atomic.write_file_atomic(progress_fpath, json.dumps({"completed": []}).encode())
        for fname in self.aux_fnames:
            (self.staging / fname).touch()

    def _truncate_to(self, completed: list[dict]) -> bool:
        """Drop everything after the completed shards; False if the staging directory cannot be trusted."""
        n_done = sum(s["n_ex"] for s in completed)
        for i, entry in enumerate(completed):
            fpath = self.staging / shard_fname(i)
            if entry["name"] != shard_fname(i) or not fpath.exists() or fpath.stat().st_size != entry["bytes"]:
                return False
        for child in self.staging.glob("acts*.bin"):
            if child.name not in {s["name"] for s in completed}:
                child.unlink()
        for fname in self.aux_fnames:
            fpath = self.staging / fname
            row_bytes = aux_n_bytes(self.md, fname) // self.md.n_ex
            if not fpath.exists() or fpath.stat().st_size < n_done * row_bytes:
                return False
            os.truncate(fpath, n_done * row_bytes)
        return True

    # -- producing --------------------------------------------------------------------------------------------

    def write(self, acts_nltd: np.ndarray, aux: dict[str, np.ndarray] | None = None) -> None:
        """Append n examples, shape (n, L, T, D), plus their side rows. The writer owns the arrays afterwards."""
        if self.reused:
            raise SaeflowError(f"{self.dpath} already exists; nothing to write")
        self._raise_if_failed()
        md = self.md
        expected = (md.n_layers, md.tokens_per_ex, md.d_model)
        if acts_nltd.ndim != 4 or tuple(acts_nltd.shape[1:]) != expected:
            raise SaeflowError(f"activations must have shape (n, {', '.join(map(str, expected))}), got {acts_nltd.shape}")
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
                f"writing {self.staging} failed: {self._error}. Published outputs are untouched; "
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
                if self._error is not None:
                    break
        self._thread.join()
        self._thread = None

    # -- the background thread --------------------------------------------------------------------------------

    def _drain(self):
        import hashlib

        fd = None
        digest = None
        cur_shard, cur_n, cur_bytes = -1, 0, 0
        aux_fds = {}
        try:
            aux_fds = {fname: open(self.staging / fname, "ab") for fname in self.aux_fnames}
            while True:
                item = self._queue.get()
                if item is None:
                    break
                shard_idx, acts, aux_rows = item
                if shard_idx != cur_shard:
                    fd = open(self.staging / shard_fname(shard_idx), "wb")
                    digest = hashlib.sha256()
                    cur_shard, cur_n, cur_bytes = shard_idx, 0, 0
                buf = memoryview(acts).cast("B")
                fd.write(buf)
                digest.update(buf)
                for fname, rows in aux_rows.items():
                    aux_fds[fname].write(memoryview(rows).cast("B"))
                cur_n += acts.shape[0]
                cur_bytes += buf.nbytes
                if cur_n == self.md.shard_sizes[shard_idx]:
                    fd.flush()
                    os.fsync(fd.fileno())
                    fd.close()
                    fd = None
                    for aux_fd in aux_fds.values():
                        aux_fd.flush()
                        os.fsync(aux_fd.fileno())
                    self._completed.append(
                        {"name": shard_fname(shard_idx), "n_ex": cur_n, "bytes": cur_bytes, "sha256": digest.hexdigest()}
                    )
                    progress = json.dumps({"completed": self._completed}).encode()
                    atomic.write_file_atomic(self.staging / PROGRESS_FNAME, progress)
        except BaseException as err:  # surfaced to the producer by _raise_if_failed
            self._error = err
            while True:  # unblock a producer waiting on a full queue
                try:
                    if self._queue.get_nowait() is None:
                        break
                except queue.Empty:
                    break
        finally:
            if fd is not None:
                fd.close()
            for aux_fd in aux_fds.values():
                aux_fd.close()

    # -- publishing -------------------------------------------------------------------------------------------

    def _publish(self):
        md = self.md
        if self.n_written != md.n_ex or len(self._completed) != len(md.shard_sizes):
            raise SaeflowError(
                f"only {self.n_written} of {md.n_ex} examples were written to {self.staging}; nothing was published"
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
        (self.staging / PROGRESS_FNAME).unlink()
        report = validate(self.staging)
        # The staging directory's name is not the hash, so only that problem is expected here.
        problems = [p for p in report.problems if "directory is named" not in p]
        if problems:
            raise ShardDirError(self.staging, problems)
        if not atomic.publish_dir(self.staging, self.dpath):
            ShardDir(self.dpath)  # lost a race: the winner's directory must be valid
