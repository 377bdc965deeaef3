"""Zarr activation store: plain zarr reads what we write, our direct-chunk reader agrees, shards + manifest, merge;
stores read the same under zarr-python 2.18 and the installed zarr-python (3.x), whichever wrote them."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import zarr

import _zarr_other_version as other
import saeflow
from builders import PROMPTS, pip_site
from hang import HANG_SEC
from saeflow.errors import SaeflowError
from saeflow.interop import engine, zarr_store
from saeflow.interop.records import Record
from saeflow.interop.zarr_store import compat as zarr_compat

LAYERS = (0, 1)
OPTS = zarr_store.ZarrOptions(prompt_max=8, response_max=4, t_chunk_prompt=4, samples_per_shard=3)
ZARR2_VERSION = "2.18.7"


@pytest.fixture(scope="module")
def records(tiny_lm_dpath):
    cfg = engine.EngineConfig.defaults(model=str(tiny_lm_dpath), layers=LAYERS, response_max=OPTS.response_max)
    eng = engine.TextEngine(cfg)
    return [eng.record(p["text"], p["label"], {"source": p["source"]}) for p in PROMPTS]


@pytest.fixture(scope="module")
def sharded(records, tmp_path_factory):
    root = tmp_path_factory.mktemp("zarr") / "acts"
    for shard, (start, stop) in enumerate(zarr_store.shard_bounds(len(records), OPTS.samples_per_shard)):
        shard_dpath = root / "shards" / zarr_store.shard_dname(shard)
        zarr_store.write_store(records[start:stop], stop - start, shard_dpath, {"model_id": "tiny"}, OPTS)
    zarr_store.write_manifest(root, 2)
    return root


def test_plain_zarr_reads_our_store(sharded, records):
    store_dpath = sharded / "shards" / zarr_store.shard_dname(0)
    z = zarr_compat.open_consolidated(store_dpath)
    acts = z["arrays/prompt_activations"]
    assert acts.dtype == np.float16 and acts.shape == (3, 2, 8, 32) and acts.chunks == (1, 1, 4, 32)
    zmeta = json.loads((store_dpath / ".zmetadata").read_text())
    assert zmeta["zarr_consolidated_format"] == 1 and zmeta["metadata"][".zgroup"] == {"zarr_format": 2}
    zarray = zmeta["metadata"]["arrays/prompt_activations/.zarray"]  # the spec's v2 layout, from either zarr-python
    assert {k: zarray[k] for k in ("zarr_format", "dtype", "compressor", "filters", "order", "fill_value")} == {
        "zarr_format": 2, "dtype": "<f2", "compressor": None, "filters": None, "order": "C", "fill_value": 0}
    assert zmeta["metadata"]["arrays/prompt_len/.zarray"]["compressor"] == zarr_compat.SMALL_COMPRESSOR
    assert z["arrays/response_activations"].chunks == (1, 1, 4, 32)
    assert z.attrs["layers"] == [0, 1] and z.attrs["hidden_size"] == 32 and z.attrs["model_id"] == "tiny"
    n_long = sum(r.n_tokens > 8 for r in records[:3])
    assert z.attrs["prompt_truncated_count"] == n_long and z.attrs["prompt_truncated_fraction"] == n_long / 3
    assert z.attrs["response_truncated_count"] == 3  # every greedy response ran to R_max
    reader = zarr_store.ZarrReader(store_dpath)
    assert all(reader.stores[0].direct.values())
    for i, rec in enumerate(records[:3]):
        p = min(rec.n_tokens, 8)
        assert z["arrays/prompt_len"][i] == p and z["arrays/sample_key"][i] == zarr_store.sample_key(rec.text)
        assert z["arrays/label"][i] == rec.label
        for li, layer in enumerate(LAYERS):
            np.testing.assert_array_equal(reader.prompt(i, layer), acts[i, li, :p])
            assert not acts[i, li, p:].any()  # padding is zeros
            np.testing.assert_allclose(acts[i, li, :p], rec.acts[layer][:p], rtol=1e-3, atol=1e-3)  # float16
            np.testing.assert_array_equal(reader.response(i, layer), z["arrays/response_activations"][i, li])
    prompts = [json.loads(line) for line in (store_dpath / "text/prompts.jsonl").read_text().splitlines()]
    assert [p["prompt"] for p in prompts] == [p["text"] for p in PROMPTS[:3]]


def test_manifest_reader_serves_global_indices_and_batches(sharded, records):
    manifest = json.loads((sharded / zarr_store.MANIFEST_FNAME).read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [3, 2] and manifest["num_samples"] == 5
    reader = zarr_store.ZarrReader(sharded)
    assert len(reader) == 5
    for i, rec in enumerate(records):
        np.testing.assert_allclose(reader.prompt(i, 1), rec.acts[1][:8], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(reader.response(i, 0), rec.response_acts[0], rtol=1e-3, atol=1e-3)
    out, lens = reader.batch([4, 0], [[1, 0], [0, 1]])
    assert out.shape == (2, 2, 4, 32) and list(lens) == [4, 4]
    np.testing.assert_array_equal(out[0, 0], reader.response(4, 1))
    assert [r["i"] for r in reader.text("extra")] == list(range(5)) and reader.text("extra")[3]["source"] == "c"
    import pickle

    # DataLoader workers
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(reader)).prompt(3, 0), reader.prompt(3, 0))
    back = list(reader.records())
    assert back[4].text == records[4].text and back[4].label == records[4].label
    with pytest.raises(SaeflowError, match="layer 7 is not stored"):
        reader.prompt(0, 7)
    with pytest.raises(SaeflowError, match="out of range"):
        reader.prompt(5, 0)


def test_merge_equals_shards(sharded, tmp_path):
    merged = zarr_store.merge(sharded, tmp_path / "merged.zarr")
    z = zarr_compat.open_consolidated(merged)
    reader = zarr_store.ZarrReader(sharded)
    assert z["arrays/prompt_activations"].shape == (5, 2, 8, 32) and z.attrs["num_samples"] == 5
    for i in range(5):
        for li, layer in enumerate(LAYERS):
            p = reader.lengths()[i]
            np.testing.assert_array_equal(z["arrays/prompt_activations"][i, li, :p], reader.prompt(i, layer))
    assert list(z["arrays/label"][:]) == [p["label"] for p in PROMPTS]


def test_fallback_to_zarr_when_compressed(tmp_path):
    recs = [Record(text=f"t{i}", label=None, acts={3: np.full((5, 6), i, np.float32)}) for i in range(2)]
    opts = zarr_store.ZarrOptions.defaults(prompt_max=4, response_max=0, t_chunk_prompt=2)
    dpath = zarr_store.write_store(recs, 2, tmp_path / "s.zarr", {"model_id": "m"}, opts)
    assert (dpath / "arrays/prompt_activations/1.0.1.0").stat().st_size == 2 * 6 * 2  # raw chunk bytes
    acts = zarr_compat.open_consolidated(dpath)["arrays/prompt_activations"]
    dpath.chmod(0o755)
    for p in dpath.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    data = acts[:]
    import shutil

    shutil.rmtree(dpath / "arrays/prompt_activations")
    arrays = zarr.open_group(str(dpath / "arrays"), mode="r+")
    zarr_compat.create_array(arrays, "prompt_activations", data.shape, acts.chunks, data.dtype, 0,
                             {"id": "zlib", "level": 1})[:] = data
    zarr_compat.consolidate(dpath)
    reader = zarr_store.ZarrReader(dpath)
    assert reader.stores[0].direct["prompt"] is None
    np.testing.assert_array_equal(reader.prompt(1, 3), np.ones((4, 6), np.float16))


@pytest.fixture(scope="session")
def zarr2_site():
    """zarr-python 2.18 with numcodecs 0.15 (the newest it supports) and their pure-Python dependencies."""
    return pip_site(f"zarr-{ZARR2_VERSION}", [f"zarr=={ZARR2_VERSION}", "numcodecs>=0.15,<0.16", "asciitree",
                                              "fasteners", "deprecated", "wrapt"], "zarr/hierarchy.py")


def run_other_zarr(site: pathlib.Path, *args) -> None:
    """_zarr_other_version.py in a subprocess with `site` first on its path (then this saeflow)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(pathlib.Path(saeflow.__file__).parents[1])])}
    proc = subprocess.run([sys.executable, other.__file__, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=HANG_SEC)
    assert proc.returncode == 0, proc.stderr[-3000:]


def zarrays(dpath: pathlib.Path) -> dict:
    meta = json.loads((dpath / ".zmetadata").read_text())["metadata"]
    return {k: {**v, "dimension_separator": v.get("dimension_separator", ".")} for k, v in meta.items()
            if k.endswith(".zarray")}


def test_zarr_2_18_and_installed_zarr_read_each_others_stores(zarr2_site, tmp_path):
    """Written here (3.x after the pin change), read by 2.18; written under 2.18, read here: the same values, the
    same format-2 .zarray fields and the same chunk files either way."""
    records = other.synthetic_records()
    here = zarr_store.write_store(records, other.N_SAMPLES, tmp_path / "here.zarr", {"model_id": "synthetic"},
                                  other.options())
    run_other_zarr(zarr2_site, "read", here, tmp_path / "here.npz")
    run_other_zarr(zarr2_site, "write", tmp_path / "zarr2.zarr")
    zarr2 = tmp_path / "zarr2.zarr"
    got = np.load(tmp_path / "here.npz")
    assert str(got["zarr_version"]) == ZARR2_VERSION
    root = zarr_compat.open_consolidated(here)
    assert json.loads(str(got["attrs"])) == dict(root.attrs)
    names = sorted(k for k in got.files if k.startswith("arrays/"))
    assert names == sorted(f"arrays/{name}" for name, _ in root["arrays"].arrays()) and len(names) == 6
    root2 = zarr_compat.open_consolidated(zarr2)
    for name in names:
        np.testing.assert_array_equal(got[name], root[name][:])  # ours, read by zarr-python 2.18
        np.testing.assert_array_equal(root2[name][:], root[name][:])  # 2.18's, read by the installed zarr
    assert zarrays(here) == zarrays(zarr2)
    chunk_files = [sorted(str(p.relative_to(d)) for p in (d / "arrays").rglob("[0-9]*")) for d in (here, zarr2)]
    assert chunk_files[0] == chunk_files[1]
    readers = [zarr_store.ZarrReader(d) for d in (here, zarr2)]
    for i, rec in enumerate(records):
        for layer in other.LAYERS:
            want = rec.acts[layer][: other.P_MAX].astype(np.float16)
            for reader in readers:
                np.testing.assert_array_equal(reader.prompt(i, layer), want)
                np.testing.assert_array_equal(reader.response(i, layer),
                                              rec.response_acts[layer][: other.R_MAX].astype(np.float16))


ZARR_FIXTURES_DPATH = pathlib.Path(__file__).parent / "fixtures" / "zarr"  # made by fixtures/zarr/make_zarr_stores.py


def test_a_format_3_store_is_refused_naming_format_3(tmp_path, capsys):
    """Issue 33: the store zarr-python 3.1.6 writes when not told zarr_format=2 (fixtures/zarr/make_zarr_stores.py
    --default-format) was refused as "not an lmprobe dataset, Zarr store or gzip-pickle shard directory"."""
    from saeflow import cli

    store_dpath = ZARR_FIXTURES_DPATH / "zarr-3.1.6-format3" / "activations.zarr"
    assert json.loads((store_dpath / "zarr.json").read_text())["zarr_format"] == 3
    with pytest.raises(SaeflowError, match=r"a Zarr format 3 store \(zarr.json; zarr-python 3 writes format 3"):
        zarr_store.ZarrReader(store_dpath)
    assert cli.main(["convert", str(store_dpath), "--to", "saev", str(tmp_path / "shards")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "saeflow reads Zarr format 2 stores (.zmetadata)" in err, err
    assert "zarr_format=2" in err and not (tmp_path / "shards").exists()


@pytest.mark.parametrize("version", ["2.18.7", "3.1.6"])
def test_reads_stores_zarr_python_wrote_by_the_spec(version):
    """A store another logger wrote with plain zarr-python calls (spec names, no saeflow attrs; under 3.x the
    padding-only chunks are absent) reads exactly as zarr-python itself read it back."""
    fixture_dpath = ZARR_FIXTURES_DPATH / f"zarr-{version}"
    want = np.load(fixture_dpath / "expected.npz")
    assert str(want["zarr_version"]) == version
    reader = zarr_store.ZarrReader(fixture_dpath / "activations.zarr")
    assert len(reader) == 5 and reader.layers == (0, 1, 2)
    assert all(reader.stores[0].direct.values())  # raw chunks: the direct path, not zarr-python
    n_chunk_files = len(list((fixture_dpath / "activations.zarr/arrays/response_activations").glob("[0-9]*")))
    assert n_chunk_files == {"2.18.7": 15, "3.1.6": 12}[version]  # 3.x skips sample 2's all-padding chunks
    np.testing.assert_array_equal(reader.lengths(), want["arrays/prompt_len"])
    np.testing.assert_array_equal(reader.lengths("response"), want["arrays/response_len"])
    for i in range(len(reader)):
        p, r = want["arrays/prompt_len"][i], want["arrays/response_len"][i]
        for layer in reader.layers:
            np.testing.assert_array_equal(reader.prompt(i, layer), want["arrays/prompt_activations"][i, layer, :p])
            np.testing.assert_array_equal(reader.response(i, layer), want["arrays/response_activations"][i, layer, :r])
    out, lens = reader.batch([2, 0, 4], [[2, 0], [1, 1], [0, 2]])
    assert out.shape == (3, 2, 4, 8) and list(lens) == list(want["arrays/response_len"][[2, 0, 4]])
    np.testing.assert_array_equal(out[2, 1], want["arrays/response_activations"][4, 2])
    assert [row["prompt"] for row in reader.text("prompt")] == list(want["prompts"])
    records = list(reader.records())
    assert [rec.text for rec in records] == list(want["prompts"])
    assert [rec.response_text for rec in records] == list(want["responses"])
    assert [rec.extra for rec in records] == [{"hallu_label": int(h), "split": int(s)}
                                              for h, s in zip(want["arrays/hallu_label"], want["arrays/split"])]
    np.testing.assert_array_equal(records[1].acts[2], want["arrays/prompt_activations"][1, 2].astype(np.float32))
