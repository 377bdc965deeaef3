"""`saeflow import saev`: a directory written by saev (OSU-NLP-Group, its protocol 2.1) as a protocol 2.0 store entry.

saev writes the same bytes in the same layout (C-order (n, L, T, D) float32 shards) under other names: metadata keys
`content_tokens_per_example`, `n_examples`, `max_tokens_per_shard`, `pixel_agg`, `data` as base64 of a pickle,
`protocol` "2.1"; shards.json counts `n_examples`; every shard file, the last included, is allocated at full size.
saev names the directory by the sha256 of `orjson.dumps(metadata, option=OPT_SORT_KEYS)`: its metadata is a dataclass,
which orjson writes in field order (OPT_SORT_KEYS sorts dict keys only), so the hashed bytes are the compact JSON of
the metadata in saev's field order (`KEYS`). saev since 075ac76 (2025-10-14) keeps the first 8 hex digits; its 2.1
commits before (00d8cec..c4c888f) kept all 64. `read_saev` checks a directory by saev's own rules (its `Metadata`,
`ShardInfo` and writer); `import_saev` publishes `<shards_root>/<sha256>/` through the store's staging sibling and one
rename, with every shard a symlink to the original except a trimmed copy of a padded last shard. docs/interop.md
("Importing saev directories") has the key map; tests/fixtures/saev/ holds directories saev itself wrote.
"""

import dataclasses
import hashlib
import json
import os
import pathlib

from saeflow.errors import SaeflowError, ShardDirError
from saeflow.interop import saev_data
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET, read_json
from saeflow.store import atomic, provenance
from saeflow.store.hashing import file_sha256
from saeflow.store.layout import ShardLayout
from saeflow.store.shards.metadata import Metadata, expected_shards_json
from saeflow.store.shards.reader import open_existing
from saeflow.store.shards.validate import file_problem, validate

PROTOCOL = "2.1"
# saev's Metadata fields in definition order: the order its directory hash serializes them in.
KEYS = ("family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
        "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol")
PIXEL_AGGS = ("majority", "prefer-fg")
SHORT_NAME_CHARS = 8  # saev since 075ac76; before it, all 64 hex digits
COPY_CHUNK_BYTES = 16 << 20


def saev_digest(md_obj: dict) -> str:
    """The full sha256 saev names a directory by: orjson's compact dump of its Metadata dataclass (fields in `KEYS`
    order, UTF-8 not ASCII-escaped; json.dumps with ensure_ascii=False escapes every code point as orjson 3.13
    does, checked one by one). `md_obj` has exactly saev's keys; UnicodeEncodeError for a lone surrogate,
    which orjson cannot write."""
    text = json.dumps({key: md_obj[key] for key in KEYS}, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sniff_metadata(dpath: pathlib.Path) -> dict:
    """The metadata.json object of `dpath` when it is a small readable JSON object, else {}: enough to tell which
    format a directory is in (`looks_like_saev`, `saev_export.looks_like_shard_dir`), never an error."""
    fpath = ShardLayout(dpath).metadata_fpath
    try:
        if fpath.stat().st_size > 1 << 20:
            return {}
        obj = json.loads(fpath.read_bytes())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def looks_like_saev(dpath: pathlib.Path) -> bool:
    """True for a directory with saev's metadata keys (what `saeflow convert` must not read as gzip-pickle)."""
    return {"max_tokens_per_shard", "content_tokens_per_example"} <= sniff_metadata(dpath).keys()


@dataclasses.dataclass(frozen=True)
class SaevDir:
    """A saev directory that passed `read_saev`: its metadata, mapped, and what each shard file holds."""

    dpath: pathlib.Path
    md_obj: dict
    metadata: Metadata  # protocol 2.0
    shard_fpaths: tuple[pathlib.Path, ...]  # the shards holding examples (an empty extra one left out)
    labels_fpath: pathlib.Path | None
    saev_name: str  # the directory's name: 8 or 64 hex digits of saev_digest


def _int_ok(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_md(md_obj, where: str) -> None:
    """saev's `Metadata.load`: exactly its keys, its protocol, its types."""
    if not isinstance(md_obj, dict):
        raise SaeflowError(f"{where}: not a JSON object, so not saev metadata")
    missing, extra = [k for k in KEYS if k not in md_obj], sorted(md_obj.keys() - set(KEYS))
    if "protocol" in md_obj and md_obj["protocol"] != PROTOCOL:
        raise SaeflowError(f"{where}: saev protocol {md_obj['protocol']!r} is not supported (only {PROTOCOL!r}); "
                           "re-extract with a current saev")
    if missing or extra:
        raise SaeflowError(f"{where}: not saev {PROTOCOL} metadata: missing keys {missing}, unexpected keys {extra}")
    bad = [k for k in ("family", "ckpt", "data", "dataset") if not isinstance(md_obj[k], str) or not md_obj[k]]
    bad += [k for k in ("content_tokens_per_example", "d_model", "n_examples", "max_tokens_per_shard")
            if not _int_ok(md_obj[k], 1)]
    layers = md_obj["layers"]
    if not isinstance(layers, list) or not layers or not all(_int_ok(x, 0) for x in layers) or \
            len(set(layers)) != len(layers):
        bad.append("layers")
    if not isinstance(md_obj["cls_token"], bool):
        bad.append("cls_token")
    if md_obj["pixel_agg"] not in (*PIXEL_AGGS, None):  # null: saev's 64-digit era, for datasets without masks
        bad.append("pixel_agg")
    if md_obj["dtype"] != "float32":
        bad.append("dtype")
    if bad:
        raise SaeflowError(f"{where}: saev metadata has invalid {', '.join(bad)}")


def _check_name(dpath: pathlib.Path, md_obj: dict, where: str, name: str | None = None) -> str:
    """The directory's name (`name` when given), if it is saev's for this metadata (either era); else a one-line error
    naming both."""
    name = name or dpath.resolve().name
    try:
        digest = saev_digest(md_obj)
    except UnicodeEncodeError:
        raise SaeflowError(f"{where}: holds an unpaired surrogate escape, which saev (orjson) cannot write; "
                           "edited") from None
    if len(name) not in (SHORT_NAME_CHARS, len(digest)) or digest[: len(name)] != name:
        raise SaeflowError(f"{dpath}: named {name}, but saev names this metadata {digest[:SHORT_NAME_CHARS]} (saev "
                           f"since 075ac76) or {digest} (its 2.1 commits before); it was renamed or its "
                           "metadata.json was edited")
    if len(name) == SHORT_NAME_CHARS and md_obj["pixel_agg"] is None:
        raise SaeflowError(f"{where}: pixel_agg null, which saev wrote only under 64-digit names (since 075ac76 it "
                           f"writes and reads {' or '.join(PIXEL_AGGS)}); edited")
    return name


def to_metadata(md_obj: dict, saev_name: str, limit_bytes: int, where: str) -> Metadata:
    """The protocol 2.0 metadata of a checked saev metadata object (docs/interop.md has the table)."""
    data = saev_data.decode(md_obj["data"], limit_bytes, where)
    if "__saev__" in data:
        raise SaeflowError(f"{where}: saev's data has a field named __saev__, which the import needs for itself")
    data["__saev__"] = {"data": md_obj["data"], "hash": saev_name, "pixel_agg": md_obj["pixel_agg"],
                        "protocol": md_obj["protocol"]}
    md = Metadata(family=md_obj["family"], ckpt=md_obj["ckpt"], layers=tuple(md_obj["layers"]),
                  patches_per_ex=md_obj["content_tokens_per_example"], cls_token=md_obj["cls_token"],
                  d_model=md_obj["d_model"], n_ex=md_obj["n_examples"],
                  patches_per_shard=md_obj["max_tokens_per_shard"], data=data, dataset=md_obj["dataset"],
                  dtype=md_obj["dtype"])
    return md


def _check_shards_json(listed, md: Metadata, where: str, allow_empty_extra: bool) -> int:
    """How many entries of saev's shards.json hold examples; errors for anything saev's writer would not write."""
    expected = [{"name": e["name"], "n_examples": e["n_ex"]} for e in expected_shards_json(md)]
    extra = {"name": ShardLayout.shard_fname(len(expected)), "n_examples": 0}
    if listed == expected + [extra]:
        if not allow_empty_extra:
            raise SaeflowError(f"{where}: lists an empty extra shard {extra['name']} (saev's writer bug when "
                               f"n_examples is a multiple of the examples per shard); the data is intact: rerun with "
                               "--allow-empty-extra-shard to leave it out")
        return len(expected)
    if listed != expected:
        got = [e.get("n_examples") if isinstance(e, dict) else e for e in listed] if isinstance(listed, list) \
            else listed
        raise SaeflowError(f"{where}: lists n_examples {str(got):.120} but metadata.json implies "
                           f"{[e['n_examples'] for e in expected]} (shards of {md.ex_per_shard} examples)")
    return len(expected)


def _check_files(dpath: pathlib.Path, md: Metadata, n_shards: int) -> tuple[pathlib.Path, ...]:
    """Every shard a readable regular file of saev's full size (the last one: full, or already trimmed)."""
    layout = ShardLayout(dpath)
    full_bytes = md.ex_per_shard * md.bytes_per_ex
    fpaths = tuple(layout.shard_fpath(i) for i in range(n_shards))
    for i, (fpath, n) in enumerate(zip(fpaths, md.shard_sizes)):
        if problem := file_problem(fpath):
            raise SaeflowError(problem)
        size = fpath.stat().st_size
        if size != full_bytes and (i != n_shards - 1 or size != n * md.bytes_per_ex):
            raise SaeflowError(f"{fpath}: {size} bytes, but saev writes {full_bytes} (a full shard of "
                               f"{md.ex_per_shard} examples, the last one padded); truncated or overwritten")
    return fpaths


def read_saev(dpath: str | os.PathLike, limit_bytes: int = DEFAULT_MEMORY_BUDGET,
              allow_empty_extra_shard: bool = False, name: str | None = None) -> SaevDir:
    """Check a saev 2.1 directory by saev's rules (a one-line SaeflowError for the first problem) and map it. `name`
    is the name it must carry, when it is still a staging sibling (default: its own)."""
    dpath = pathlib.Path(dpath)
    if not dpath.is_dir():
        raise SaeflowError(f"{dpath}: does not exist or is not a directory")
    layout = ShardLayout(dpath)
    md_obj = read_json(layout.metadata_fpath, limit_bytes, "saev metadata")
    check_md(md_obj, str(layout.metadata_fpath))
    saev_name = _check_name(dpath, md_obj, str(layout.metadata_fpath), name)
    md = to_metadata(md_obj, saev_name, limit_bytes, str(layout.metadata_fpath))
    listed = read_json(layout.shards_fpath, limit_bytes, "saev shard list")
    n_shards = _check_shards_json(listed, md, str(layout.shards_fpath), allow_empty_extra_shard)
    fpaths = _check_files(dpath, md, n_shards)
    labels_fpath = layout.file(layout.LABELS_FNAME)
    if os.path.lexists(labels_fpath):
        if problem := file_problem(labels_fpath, md.n_ex * md.patches_per_ex):
            raise SaeflowError(problem)
    else:
        labels_fpath = None
    return SaevDir(dpath, md_obj, md, fpaths, labels_fpath, saev_name)


def _trimmed_copy(src_fpath: pathlib.Path, dst_fpath: pathlib.Path, n_bytes: int) -> str:
    """Copy the first `n_bytes` of `src_fpath` (a padded last shard) and return their sha256."""
    digest = hashlib.sha256()
    with open(src_fpath, "rb") as src, open(dst_fpath, "xb") as dst:
        left = n_bytes
        while left:
            chunk = src.read(min(COPY_CHUNK_BYTES, left))
            if not chunk:
                raise SaeflowError(f"{src_fpath}: ended early while copying (changed during the import?)")
            dst.write(chunk)
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _populate(layout: ShardLayout, src: SaevDir, link_checksums: bool) -> dict:
    """Write metadata, shard list, links (or the trimmed last shard) and checksums into staging; what was linked."""
    md = src.metadata
    atomic.write_json(layout.metadata_fpath, md.to_dict())
    atomic.write_json(layout.shards_fpath, expected_shards_json(md))
    files, linked, copied = {}, [], []
    pairs = [(layout.shard_fname(i), fpath, n * md.bytes_per_ex)
             for i, (fpath, n) in enumerate(zip(src.shard_fpaths, md.shard_sizes))]
    if src.labels_fpath is not None:
        pairs.append((layout.LABELS_FNAME, src.labels_fpath, md.n_ex * md.patches_per_ex))
    for fname, src_fpath, n_bytes in pairs:
        dst_fpath = layout.file(fname)
        if src_fpath.stat().st_size != n_bytes:
            files[fname] = {"bytes": n_bytes, "sha256": _trimmed_copy(src_fpath, dst_fpath, n_bytes)}
            copied.append(fname)
            continue
        os.symlink(os.path.realpath(src_fpath), dst_fpath)
        linked.append(fname)
        if link_checksums:
            files[fname] = {"bytes": n_bytes, "sha256": file_sha256(dst_fpath)}
    for fname in (layout.METADATA_FNAME, layout.SHARDS_FNAME):
        files[fname] = {"bytes": layout.file(fname).stat().st_size, "sha256": file_sha256(layout.file(fname))}
    atomic.write_json(layout.checksums_fpath, {"files": dict(sorted(files.items()))})
    return {"linked": linked, "copied": copied, "link_checksums": link_checksums}


def import_saev(src_dpath: str | os.PathLike, shards_root: str | os.PathLike,
                limit_bytes: int = DEFAULT_MEMORY_BUDGET, allow_empty_extra_shard: bool = False,
                link_checksums: bool = True) -> tuple[pathlib.Path, bool]:
    """Publish `<shards_root>/<sha256>/` for a saev directory; (its path, whether an existing one was reused)."""
    src = read_saev(src_dpath, limit_bytes, allow_empty_extra_shard)
    md = src.metadata
    final = ShardLayout.at(shards_root, md.hash)
    final.dpath.parent.mkdir(parents=True, exist_ok=True)
    started_at = provenance.utc_now()
    with atomic.exclusive_lock(final.lock_fpath):
        if open_existing(final.dpath) is not None:
            return final.dpath, True
        with atomic.building_dir(final.dpath) as staging_dpath:
            staging = ShardLayout(staging_dpath)
            done = _populate(staging, src, link_checksums)
            prov = {**provenance.collect(), "imported_from": str(src.dpath.resolve()), "saev_hash": src.saev_name,
                    **done, "started_at": started_at, "finished_at": provenance.utc_now(), "resumed_from_ex": 0}
            atomic.write_json(staging.provenance_fpath, prov)
            report = validate(staging_dpath, name=md.hash)
            if not report.ok:
                raise ShardDirError(staging_dpath, report.problems, hint="nothing was published")
    return final.dpath, False
