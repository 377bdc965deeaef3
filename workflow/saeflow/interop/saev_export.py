"""`saeflow convert DIR --to saev2.1 ROOT`: a saeflow shard directory as a directory saev's own readers read.

saev (OSU-NLP-Group, 3d73f1f) reads a directory only through its `Metadata.load` (exactly its 13 keys, `family`,
`dtype` and `protocol` from its fixed lists, `data` a string, `pixel_agg` one of its enum's values; beartype-checked),
`ShardInfo.load` (shards.json entries `{"name", "n_examples"}`, the directory at `.../saev/shards/<name>`) and
`np.memmap` of every shard at its full `shard_shape` (a short last shard fails). A protocol 2.0 directory passes none
of these, and its hashed metadata must not change, so the export writes a second directory beside saev's own:
`<ROOT>/<first 8 hex digits of saev's hash>/` with saev's metadata.json (saev's field order, indented as saev's
writer indents), saev's shards.json, `acts%06d.bin` and labels.bin. Shard files and labels.bin are hard links to
saeflow's read-only files (no bytes copied; saeflow never rewrites a published file and saev's readers map them
read-only or copy-on-write), copies where a link cannot be made (another file system, a symlinked source); a short last
shard is a copy padded with zeros to saev's full size. `data` is base64 of a pickle of saeflow's `data` object, so a
hook point other than the residual stream stays where saeflow records it (`data.hook`); saeflow's import decodes it
back. An imported saev directory (its `data.__saev__`) goes back under its original `data` and `pixel_agg`, so its
original name. Published like every store entry: flock, staging sibling, checked by saev's rules, one rename.
"""

import base64
import errno
import json
import os
import pathlib
import pickle
import shutil

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.extraction import models
from saeflow.interop import saev_import
from saeflow.store import atomic
from saeflow.store.layout import ShardLayout
from saeflow.store.shards import PROTOCOL, Metadata, ShardDir

# saev's `Metadata.family` (3d73f1f): every family its readers accept. saeflow's vit has no saev family.
SAEV_FAMILIES = ("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip")
# saeflow's segmentation label rule -> saev's pixel_agg (the same two rules); every other directory: saev's default
PIXEL_AGG_OF_RULE = config.by_enum({"majority": "majority", "prefer_foreground": "prefer-fg"},
                            "activation_spec", "dataset", "segmentation_folder", "label_rule")
LABEL_RULE_KEY = "label_rule"
SAEV_KEY = "__saev__"  # what saeflow's import adds to `data` (saev_import.to_metadata)
PICKLE_PROTOCOL = 4  # fixed, so the same directory always gives the same `data` string, so the same name
SAEV_ROOT_PARTS = ("saev", "shards")  # saev's disk.is_shards_dir: a directory is read only at .../saev/shards/<name>
LINK_FALLBACK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)


def looks_like_shard_dir(dpath: pathlib.Path) -> bool:
    """True for a directory whose metadata.json is protocol 2.0's (what `saeflow convert` exports --to saev2.1)."""
    obj = saev_import.sniff_metadata(dpath)
    return obj.get("protocol") == PROTOCOL and "patches_per_shard" in obj


def _refuse_family(md: Metadata, where: pathlib.Path) -> None:
    if md.family in SAEV_FAMILIES:
        return
    families = ", ".join(SAEV_FAMILIES)
    if models.family_modality(md.family) == "text":
        raise SaeflowError(f"{where}: family {md.family} is a text model; saev 2.1 holds vision transformers' "
                           f"activations only (its Metadata.family is one of {families}); nothing was written")
    raise SaeflowError(f"{where}: family {md.family} is none of saev's ({families}): saev's Metadata.load refuses it; "
                       "nothing was written")


def _data_string(data: dict) -> str:
    """base64 of a pickle of `data` (plain JSON) re-read from its canonical JSON: the same object always gives the
    same bytes (pickle's memo follows object identity, which the re-read fixes)."""
    plain = json.loads(json.dumps(data, sort_keys=True))
    return base64.b64encode(pickle.dumps(plain, protocol=PICKLE_PROTOCOL)).decode("ascii")


def saev_metadata(md: Metadata, where: pathlib.Path) -> dict:
    """saev's 13 metadata keys, in its field order, for a protocol 2.0 metadata; one line for what saev cannot hold."""
    _refuse_family(md, where)
    if md.dtype != "float32":
        raise SaeflowError(f"{where}: dtype {md.dtype}; saev stores float32 only (its Metadata.dtype); re-extract "
                           "with store_dtype: float32; nothing was written")
    majority = PIXEL_AGG_OF_RULE["majority"]  # saev's default, for directories without segmentation labels
    back = md.data.get(SAEV_KEY)
    if isinstance(back, dict):  # an imported saev directory: its own data string and pixel_agg
        data, pixel_agg = back.get("data"), back.get("pixel_agg") or majority
    else:
        data, pixel_agg = _data_string(md.data), PIXEL_AGG_OF_RULE.get(md.data.get(LABEL_RULE_KEY), majority)
    md_obj = {"family": md.family, "ckpt": md.ckpt, "layers": list(md.layers),
              "content_tokens_per_example": md.patches_per_ex, "cls_token": md.cls_token, "d_model": md.d_model,
              "n_examples": md.n_ex, "max_tokens_per_shard": md.patches_per_shard, "data": data,
              "dataset": str(pathlib.PurePosixPath(md.dataset)),  # as saev's pathlib.Path writes it back
              "pixel_agg": pixel_agg, "dtype": md.dtype, "protocol": saev_import.PROTOCOL}
    saev_import.check_md(md_obj, str(where))
    return {key: md_obj[key] for key in saev_import.KEYS}


def saev_name(md_obj: dict, where: pathlib.Path) -> str:
    """The name saev (since 075ac76) gives a directory with this metadata: 8 hex digits of its hash."""
    try:
        return saev_import.saev_digest(md_obj)[: saev_import.SHORT_NAME_CHARS]
    except UnicodeEncodeError:
        raise SaeflowError(f"{where}: its metadata holds an unpaired surrogate escape, which saev (orjson) cannot "
                           "write; nothing was written") from None


def _check_root(root: pathlib.Path) -> None:
    if root.resolve().parts[-2:] != SAEV_ROOT_PARTS:
        raise SaeflowError(f"{root}: saev reads a shard directory only at .../{'/'.join(SAEV_ROOT_PARTS)}/<hash> "
                           f"(its disk.is_shards_dir); give a root ending in {'/'.join(SAEV_ROOT_PARTS)}")


def _link_or_copy(src: pathlib.Path, dst: pathlib.Path, n_bytes: int) -> None:
    """`dst` as `src`'s first `n_bytes`, zero-padded to `n_bytes` when `src` is shorter: a hard link when `src` is a
    regular file of exactly that size (not a symlink: the link would chmod someone else's file), else a copy."""
    if not src.is_symlink() and src.stat().st_size == n_bytes:
        try:
            os.link(src, dst, follow_symlinks=False)
            return
        except OSError as err:
            if err.errno not in LINK_FALLBACK_ERRNOS:
                raise
    with open(src, "rb") as fsrc, open(dst, "xb") as fdst:
        shutil.copyfileobj(fsrc, fdst)
        fdst.truncate(n_bytes)  # saev's full shard: the examples, then zeros (a hole, as saev's w+ memmap leaves)


def _populate(staging: ShardLayout, sd: ShardDir, md_obj: dict) -> None:
    """saev's files in `staging` (see the module docstring)."""
    md = sd.metadata
    staging.metadata_fpath.write_text(json.dumps(md_obj, indent=2, ensure_ascii=False), encoding="utf-8")
    listed = [{"name": ShardLayout.shard_fname(i), "n_examples": n} for i, n in enumerate(md.shard_sizes)]
    staging.shards_fpath.write_text(json.dumps(listed, indent=2), encoding="utf-8")
    pairs = [(ShardLayout.shard_fname(i), sd.shard_fpath(i), md.ex_per_shard * md.bytes_per_ex)
             for i in range(len(md.shard_sizes))]
    if sd.has_aux(ShardLayout.LABELS_FNAME):
        pairs.append((ShardLayout.LABELS_FNAME, sd.layout.file(ShardLayout.LABELS_FNAME), md.n_ex * md.patches_per_ex))
    for fname, src, n_bytes in pairs:
        _link_or_copy(src, staging.file(fname), n_bytes)


def _reuse(final: pathlib.Path, md_obj: dict) -> None:
    """An existing directory at the export's name must be this export (saev's rules, the same metadata)."""
    there = saev_import.read_saev(final)
    if there.md_obj != md_obj:
        raise SaeflowError(f"{final}: already holds saev metadata that differs from this export's (8 hex digits "
                           "are shared by chance, or the directory was edited); nothing was written")


def export_saev(src_dpath: str | os.PathLike, saev_root: str | os.PathLike) -> tuple[pathlib.Path, bool]:
    """Publish `<saev_root>/<saev name>/` for the shard directory at `src_dpath`; (its path, whether an existing one
    was reused)."""
    src = pathlib.Path(src_dpath)
    sd = ShardDir(src)
    root = pathlib.Path(saev_root)
    _check_root(root)
    md_obj = saev_metadata(sd.metadata, src)
    final = root / saev_name(md_obj, src)
    root.mkdir(parents=True, exist_ok=True)
    with atomic.exclusive_lock(ShardLayout(final).lock_fpath):
        if os.path.lexists(final):
            _reuse(final, md_obj)
            return final, True
        with atomic.building_dir(final) as staging_dpath:
            _populate(ShardLayout(staging_dpath), sd, md_obj)
            there = saev_import.read_saev(staging_dpath, name=final.name)  # saev's rules, before anything is published
            if there.md_obj != md_obj:
                raise SaeflowError(f"{staging_dpath}: the written metadata reads back differently; nothing was "
                                   "published")
    return final, False
