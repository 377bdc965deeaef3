"""`saeflow import saev`: saev (OSU-NLP-Group) protocol 2.1 directories become protocol 2.0 store entries whose shards
are symlinks to the originals, read back bit for bit; saev-specific faults are one-line errors."""

import base64
import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import stat
import sys
import types

import numpy as np
import pytest
import torch

from saeflow import shards
from saeflow.cli import main
from saeflow.loaders import IndexedReader, OrderedLoader
from saeflow.shards.validate import validate


@dataclasses.dataclass(frozen=True)
class ImgFolder:
    """Stands in for saev.data.datasets.ImgFolder (pickled under that name by `saev_modules`)."""

    root: pathlib.Path = pathlib.Path("/data/imgs")
    n_examples: int = 7
    splits: tuple = ("train", "val")


class Evil:
    """A data pickle that would run a shell command if it were unpickled with pickle.load."""

    def __init__(self, marker_fpath: pathlib.Path):
        self.marker_fpath = marker_fpath

    def __reduce__(self):
        return os.system, (f"touch {self.marker_fpath}",)


@pytest.fixture
def saev_modules(monkeypatch):
    """Register ImgFolder as saev.data.datasets.ImgFolder so pickle writes saev's own global for it."""
    mods = {name: types.ModuleType(name) for name in ("saev", "saev.data", "saev.data.datasets")}
    monkeypatch.setattr(ImgFolder, "__module__", "saev.data.datasets")
    mods["saev.data.datasets"].ImgFolder = ImgFolder
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def saev_hash(md: dict) -> str:
    return hashlib.sha256(json.dumps(md, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:8]


def write_saev(shards_root: pathlib.Path, n_ex=7, ex_per_shard=3, layers=(3, 5), content=4, cls_token=True, d=8,
               data=None, labels=True, **md_overrides):
    """A directory as saev's ShardWriter writes it: metadata.json (orjson indent 2, not sorted), every shard a full
    (ex_per_shard, L, T, D) float32 memmap (the last one padded with zeros), shards.json with n_examples (plus the
    empty extra shard when n_ex is a multiple of ex_per_shard), labels.bin (n_ex, content) uint8."""
    T, L = content + int(cls_token), len(layers)
    md = {"family": "clip", "ckpt": "hf-hub:timm/vit_base_patch16_clip_224.openai", "layers": list(layers),
          "content_tokens_per_example": content, "cls_token": cls_token, "d_model": d, "n_examples": n_ex,
          "max_tokens_per_shard": ex_per_shard * T * L, "data": base64.b64encode(pickle.dumps(data)).decode(),
          "dataset": "/data/imgs", "pixel_agg": "majority", "dtype": "float32", "protocol": "2.1", **md_overrides}
    dpath = shards_root / saev_hash(md)
    dpath.mkdir(parents=True)
    (dpath / "metadata.json").write_text(json.dumps(md, indent=2))
    acts_nltd = np.random.default_rng(0).standard_normal((n_ex, L, T, d)).astype(np.float32)
    listed = []
    for i, start in enumerate(range(0, n_ex + (1 if n_ex % ex_per_shard == 0 else 0), ex_per_shard)):
        shard = np.zeros((ex_per_shard, L, T, d), np.float32)
        part = acts_nltd[start:start + ex_per_shard]
        shard[: len(part)] = part
        shard.tofile(dpath / f"acts{i:06d}.bin")
        listed.append({"name": f"acts{i:06d}.bin", "n_examples": len(part)})
    (dpath / "shards.json").write_text(json.dumps(listed, indent=2))
    labels_np = (np.arange(n_ex * content) % 7).astype(np.uint8).reshape(n_ex, content)
    if labels:
        labels_np.tofile(dpath / "labels.bin")
    return dpath, acts_nltd, labels_np


def run_import(capsys, src, root, *flags):
    rc = main(["import", "saev", str(src), "--shards-root", str(root), *flags])
    out, err = capsys.readouterr()
    return rc, out.strip(), err


def test_import_reads_back_every_vector_and_copies_less_than_a_shard(tmp_path, shards_root, capsys, saev_modules):
    src, acts_nltd, labels_np = write_saev(tmp_path / "saev" / "shards", data=ImgFolder(), d=128)
    modes = {f.name: f.stat().st_mode for f in src.iterdir()}
    rc, out, err = run_import(capsys, src, shards_root)
    assert rc == 0, err
    dpath = pathlib.Path(out)
    sd = shards.ShardDir(dpath)
    assert dpath.parent == shards_root and len(dpath.name) == 64 and sd.hash == sd.metadata.hash
    n_ex, L, T, D = acts_nltd.shape
    for ex in range(n_ex):
        for li, layer in enumerate(sd.metadata.layers):
            for token in range(T):
                assert sd.vector(ex, layer, token).tobytes() == acts_nltd[ex, li, token].tobytes()
    np.testing.assert_array_equal(sd.aux("labels.bin"), labels_np)
    # Shards 0 and 1 and labels.bin are links to the originals; the padded last shard is a trimmed copy.
    links = sorted(f.name for f in dpath.iterdir() if f.is_symlink())
    assert links == ["acts000000.bin", "acts000001.bin", "labels.bin"]
    shard_bytes = 3 * L * T * D * 4
    written_bytes = sum(f.stat().st_size for f in dpath.iterdir() if not f.is_symlink())  # JSON + trimmed shard
    assert written_bytes < shard_bytes
    assert (dpath / "acts000002.bin").stat().st_size == L * T * D * 4  # one example, not the padded three
    assert {f.name: f.stat().st_mode for f in src.iterdir()} == modes  # publishing did not chmod the originals
    assert not os.access(dpath, os.W_OK) or os.geteuid() == 0
    assert stat.S_IMODE((dpath / "metadata.json").stat().st_mode) == 0o444
    md = sd.metadata
    assert (md.patches_per_ex, md.n_ex, md.ex_per_shard, md.protocol) == (4, 7, 3, "2.0")
    assert md.data["__class__"] == "ImgFolder" and md.data["root"] == "/data/imgs"
    assert md.data["splits"] == ["train", "val"] and md.data["__saev__"]["hash"] == src.name
    assert main(["validate", str(dpath), "--deep"]) == 0
    assert validate(dpath, deep=True).warnings == []
    # The loaders read through the links too.
    rows = torch.cat(list(OrderedLoader(sd, 5, batch_size=4, tokens="all")))
    np.testing.assert_array_equal(rows.numpy(), acts_nltd[:, 1].reshape(-1, D))
    np.testing.assert_array_equal(IndexedReader(sd, 3, tokens="all").get([T * 7 - 1])[0].numpy(), acts_nltd[6, 0, -1])


def test_import_twice_reuses_the_directory(tmp_path, shards_root, capsys):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"__class__": "FakeImg", "n_examples": 7}, labels=False,
                           cls_token=False)
    rc, first, _ = run_import(capsys, src, shards_root)
    prov = (pathlib.Path(first) / "provenance.json").read_bytes()
    rc2, second, _ = run_import(capsys, src, shards_root, "--no-link-checksums")
    assert rc == rc2 == 0 and first == second
    assert (pathlib.Path(first) / "provenance.json").read_bytes() == prov
    assert sorted(p.name for p in shards_root.iterdir()) == sorted([pathlib.Path(first).name,
                                                                     f".{pathlib.Path(first).name}.lock"])


def test_empty_extra_shard_is_refused_then_left_out_on_request(tmp_path, shards_root, capsys):
    src, acts_nltd, _ = write_saev(tmp_path / "saev" / "shards", n_ex=6, data={"split": "train"})
    assert json.loads((src / "shards.json").read_text())[-1] == {"name": "acts000002.bin", "n_examples": 0}
    rc, _, err = run_import(capsys, src, shards_root)
    assert rc == 1 and "empty extra shard acts000002.bin" in err and len(err.splitlines()) == 1
    assert list(shards_root.iterdir()) == [] or all(p.name.endswith(".lock") for p in shards_root.iterdir())
    rc, out, err = run_import(capsys, src, shards_root, "--allow-empty-extra-shard")
    assert rc == 0, err
    sd = shards.ShardDir(out)
    assert sd.shard_sizes == [3, 3] and not (pathlib.Path(out) / "acts000002.bin").exists()
    assert sd.example(5, 3).tobytes() == acts_nltd[5, 0].tobytes()


def _truncate_shard(src):
    os.truncate(src / "acts000001.bin", 100)


def _drop_shard(src):
    (src / "acts000001.bin").unlink()


def _rename(src):
    return src.rename(src.parent / "deadbeef")


def _drop_metadata(src):
    (src / "metadata.json").unlink()


def _shard_is_dir(src):
    (src / "acts000000.bin").unlink()
    (src / "acts000000.bin").mkdir()


@pytest.mark.parametrize("breaks, message", [
    (_truncate_shard, "acts000001.bin: 100 bytes, but saev writes"),
    (_drop_shard, "acts000001.bin: missing"),
    (_shard_is_dir, "acts000000.bin: is a directory"),
    (_rename, "saev names this directory"),
    (_drop_metadata, "metadata.json: missing"),
])  # fmt: skip
def test_broken_saev_directory_is_one_line_error(tmp_path, shards_root, capsys, breaks, message):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"split": "train"})
    src = breaks(src) or src
    rc, out, err = run_import(capsys, src, shards_root)
    assert rc == 1 and out == "" and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and err.startswith("saeflow import: error:")
    assert not any(p.is_dir() for p in shards_root.iterdir())


@pytest.mark.parametrize("overrides, message", [
    ({"protocol": "1.1"}, "saev protocol '1.1' is not supported"),
    ({"pixel_agg": "mean"}, "invalid pixel_agg"),
    ({"patches_per_ex": 4}, "unexpected keys ['patches_per_ex']"),
    ({"dtype": "float16"}, "invalid dtype"),
])  # fmt: skip
def test_unsupported_saev_metadata_is_one_line_error(tmp_path, shards_root, capsys, overrides, message):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"split": "train"}, **overrides)
    rc, _, err = run_import(capsys, src, shards_root)
    assert rc == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_missing_saev_key_is_one_line_error(tmp_path, shards_root, capsys):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"split": "train"})
    md = json.loads((src / "metadata.json").read_text())
    del md["pixel_agg"]
    (src / "metadata.json").write_text(json.dumps(md))
    src = src.rename(src.parent / saev_hash(md))
    rc, _, err = run_import(capsys, src, shards_root)
    assert rc == 1 and "missing keys ['pixel_agg']" in err and len(err.strip().splitlines()) == 1, err


def test_data_pickle_with_a_disallowed_global_is_refused_without_running_it(tmp_path, shards_root, capsys):
    marker = tmp_path / "pwned"
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data=Evil(marker))
    rc, _, err = run_import(capsys, src, shards_root)
    assert rc == 1 and "is not allowed in saev's data pickle" in err and "system" in err, err
    assert len(err.strip().splitlines()) == 1 and not marker.exists()


def test_convert_points_a_saev_directory_to_import(tmp_path, capsys):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"split": "train"})
    rc = main(["convert", str(src), "--to", "zarr", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "saeflow import saev" in err and len(err.strip().splitlines()) == 1, err


def test_validate_refuses_a_dangling_link(tmp_path, shards_root, capsys):
    src, _, _ = write_saev(tmp_path / "saev" / "shards", data={"split": "train"})
    rc, out, _ = run_import(capsys, src, shards_root, "--no-link-checksums")
    assert rc == 0
    (src / "acts000000.bin").unlink()
    report = validate(out)
    assert not report.ok and any("acts000000.bin: missing" in p for p in report.problems)
