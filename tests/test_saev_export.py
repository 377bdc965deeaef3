"""`saeflow convert DIR --to saev2.1 ROOT` (interop/saev_export.py): saeflow shard directories that saev's own readers
read. tests/fixtures/saev/export/ holds two saeflow directories of a tiny random CLIP vision tower (the residual stream
and the MLP output) and, for each, what saev's `indexed.Dataset` read from its export (make_saev_export_fixtures.py,
with saev 3d73f1f in a side venv). Here the same directories are exported again: the name must be saev's own hash of
the metadata, saev's reads must be saeflow's vectors bit for bit, and saeflow's import must give back the vectors and
the hook point."""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from builders import write_shards
from saeflow.cli import main
from saeflow.extraction import hooks
from saeflow.interop import saev_export, saev_import
from saeflow.store import shards
from saeflow.store.layout import ShardLayout

FIXTURES_DPATH = pathlib.Path(__file__).resolve().parent / "fixtures" / "saev"
EXPORT_DPATH = FIXTURES_DPATH / "export"
INPUTS = sorted(p for p in (EXPORT_DPATH / "saeflow").iterdir() if p.is_dir())


def source(src: pathlib.Path, tmp_path: pathlib.Path) -> shards.ShardDir:
    """A copy of a committed saeflow directory (publishing makes hard-linked files read-only: never the repo's)."""
    return shards.ShardDir(shutil.copytree(src, tmp_path / "store" / src.name))


def export(capsys, src, root) -> tuple[int, str, str]:
    rc = main(["convert", str(src), "--to", "saev2.1", str(root)])
    out, err = capsys.readouterr()
    return rc, out.strip(), err


def saev_read(name: str) -> dict:
    fpath = EXPORT_DPATH / f"{name}.npz"
    assert fpath.exists(), f"no {fpath.name}: the export's name changed; regenerate with make_saev_export_fixtures.py"
    with np.load(fpath, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def test_the_fixtures_hold_a_residual_and_an_mlp_out_directory_and_what_saev_read_from_each():
    assert sorted(hooks.stored(shards.ShardDir(p).metadata.data) for p in INPUTS) == ["mlp_out", "residual"]
    assert len(list(EXPORT_DPATH.glob("*.npz"))) == len(INPUTS)


@pytest.mark.parametrize("src", INPUTS, ids=lambda p: hooks.stored(shards.ShardDir(p).metadata.data))
def test_saev_read_saeflows_vectors_bit_for_bit_from_a_directory_named_by_saevs_hash(src, tmp_path, capsys):
    sd = source(src, tmp_path)
    md = sd.metadata
    rc, printed, err = export(capsys, sd.dpath, tmp_path / "saev" / "shards")
    assert rc == 0, err
    out = pathlib.Path(printed)
    read = saev_read(out.name)
    md_obj = json.loads((out / "metadata.json").read_text())
    assert tuple(md_obj) == saev_import.KEYS and str(read["saev_hash"]) == out.name  # saev's own Metadata.hash
    assert out.name == saev_import.saev_digest(md_obj)[:8] and md_obj["protocol"] == "2.1"
    # the hook point travels in saev's data: saev unpickled saeflow's data object, hook included when not residual
    assert json.loads(str(read["data_json"])) == md.data and hooks.stored(md.data) in ("residual", "mlp_out")
    assert ("hook" in md.data) == (hooks.stored(md.data) != "residual")
    P, T = md.patches_per_ex, md.tokens_per_ex
    labels = np.asarray(sd.aux(ShardLayout.LABELS_FNAME))
    for layer in md.layers:
        key = f"content_L{layer}"
        ex, tok = np.arange(md.n_ex * P) // P, np.arange(md.n_ex * P) % P
        want = np.stack([sd.vector(e, layer, t + 1) for e, t in zip(ex, tok)])
        assert read[f"{key}_act"].tobytes() == want.tobytes()  # every content vector, bitwise
        assert read[f"{key}_example_idx"].tolist() == ex.tolist() and read[f"{key}_token_idx"].tolist() == tok.tolist()
        assert read[f"{key}_label"].tolist() == labels[ex, tok].tolist()
        key = f"special_L{layer}"  # saev's CLS reads land where its IndexMap says (`//` for `%`): that example's CLS
        read_ex = [shard * md.ex_per_shard + in_shard for shard, in_shard, _, _ in read[f"{key}_read_at"]]
        want = np.stack([sd.vector(e, layer, 0) for e in read_ex])
        assert read[f"{key}_act"].tobytes() == want.tobytes() and T == P + 1
    # saev's files: full-size shards (the short last one zero-padded), hard links where nothing needed changing
    full = md.ex_per_shard * md.bytes_per_ex
    assert json.loads((out / "shards.json").read_text()) == [
        {"name": ShardLayout.shard_fname(i), "n_examples": n} for i, n in enumerate(md.shard_sizes)]
    last = len(md.shard_sizes) - 1
    for i, n in enumerate(md.shard_sizes):
        got, own = (out / ShardLayout.shard_fname(i)).read_bytes(), sd.shard_fpath(i).read_bytes()
        assert len(got) == full and got[: len(own)] == own and not any(got[len(own):])
        assert os.path.samefile(out / ShardLayout.shard_fname(i), sd.shard_fpath(i)) == (n == md.ex_per_shard)
    assert md.shard_sizes[last] < md.ex_per_shard  # the fixtures have a short last shard to pad
    assert os.path.samefile(out / ShardLayout.LABELS_FNAME, sd.layout.file(ShardLayout.LABELS_FNAME))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["metadata.json", "shards.json", "labels.bin", *(ShardLayout.shard_fname(i) for i in range(last + 1))])
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("src", INPUTS, ids=lambda p: hooks.stored(shards.ShardDir(p).metadata.data))
def test_export_then_import_gives_back_the_vectors_labels_and_hook(src, tmp_path):
    sd = source(src, tmp_path)
    out, reused = saev_export.export_saev(sd.dpath, tmp_path / "saev" / "shards")
    assert not reused
    back_dpath, _ = saev_import.import_saev(out, tmp_path / "back")
    back = shards.ShardDir(back_dpath)
    assert hooks.stored(back.metadata.data) == hooks.stored(sd.metadata.data)
    assert back.metadata.data["__saev__"]["hash"] == out.name and back.hash != sd.hash  # the import says where from
    for name in ("layers", "patches_per_ex", "cls_token", "d_model", "n_ex", "family", "ckpt", "dataset"):
        assert getattr(back.metadata, name) == getattr(sd.metadata, name)
    for layer in sd.metadata.layers:
        for (start, want), (start_back, got) in zip(sd.iter_blocks(layer), back.iter_blocks(layer), strict=True):
            assert start == start_back and got.tobytes() == want.tobytes()
    assert np.array_equal(back.aux(ShardLayout.LABELS_FNAME), sd.aux(ShardLayout.LABELS_FNAME))
    # exporting again: the same name, the published directory reused, nothing rewritten
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert saev_export.export_saev(sd.dpath, out.parent) == (out, True)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # and the imported directory exports back to the same saev directory
    assert saev_export.export_saev(back_dpath, tmp_path / "again" / "saev" / "shards")[0].name == out.name


def test_an_imported_saev_directory_exports_back_to_saevs_own_name_and_files(tmp_path):
    (src,) = [p for p in (FIXTURES_DPATH / "hash8").iterdir() if p.is_dir() and not (p / "labels.bin").exists()]
    imported, _ = saev_import.import_saev(src, tmp_path / "store")
    out, _ = saev_export.export_saev(imported, tmp_path / "saev" / "shards")
    assert out.name == src.name  # what saev's own writer wrote: the same metadata, byte for byte, and shards
    for fname in ("metadata.json", "shards.json", *(e["name"] for e in json.loads((src / "shards.json").read_text()))):
        assert (out / fname).read_bytes() == (src / fname).read_bytes(), fname


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_what_saev_cannot_hold_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    acts = np.arange(2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4)
    root = tmp_path / "saev" / "shards"
    cases = {
        "gpt2": ({"family": "gpt2"}, "family gpt2 is a text model; saev 2.1 holds vision transformers' activations"),
        "vit": ({"family": "vit"}, "family vit is none of saev's (bird-mae, clip, dinov2, dinov3, fake-clip"),
        "f16": ({"family": "clip", "dtype": "float16"}, "dtype float16; saev stores float32 only"),
    }
    for tag, (kw, reason) in cases.items():
        sd = write_shards(tmp_path / "store", acts.astype(kw.get("dtype", "float32")), layers=(0,), tag=tag, **kw)
        rc, _, err = export(capsys, sd.dpath, root)
        assert rc == 1 and f"{sd.dpath}: {reason}" in one_line(err)
        assert not root.exists() or not list(root.iterdir())
    sd = write_shards(tmp_path / "store", acts, layers=(0,), family="clip")
    rc, _, err = export(capsys, sd.dpath, tmp_path / "elsewhere")
    assert rc == 1 and "saev reads a shard directory only at .../saev/shards/<hash>" in one_line(err)
    rc, _, err = export(capsys, FIXTURES_DPATH / "hash8", root)
    assert rc == 1 and "--to saev2.1 exports a saeflow shard directory" in one_line(err)
    rc = main(["convert", str(sd.dpath), "--to", "pickle", str(tmp_path / "p")])
    assert rc == 1 and "a saeflow shard directory (protocol 2.0)" in one_line(capsys.readouterr().err)
    # a directory already at the export's name with other metadata is never overwritten
    name = saev_export.saev_name(saev_export.saev_metadata(sd.metadata, sd.dpath), sd.dpath)
    squatter = shutil.copytree(FIXTURES_DPATH / "hash8" / "01342da5", root / name)
    rc, _, err = export(capsys, sd.dpath, root)
    assert rc == 1 and str(squatter) in one_line(err) and (root / name / "acts000000.bin").exists()
