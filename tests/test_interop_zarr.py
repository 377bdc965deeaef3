"""Zarr activation store: plain zarr reads what we write, our direct-chunk reader agrees, shards + manifest, merge."""

import json

import numpy as np
import pytest
import zarr

from builders import PROMPTS
from saeflow.errors import SaeflowError
from saeflow.interop import engine, zarr_store
from saeflow.interop.records import Record

LAYERS = (0, 1)
OPTS = zarr_store.ZarrOptions(prompt_max=8, response_max=4, t_chunk_prompt=4, samples_per_shard=3)


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
    z = zarr.open_consolidated(str(store_dpath), mode="r")
    acts = z["arrays/prompt_activations"]
    assert acts.dtype == np.float16 and acts.shape == (3, 2, 8, 32) and acts.chunks == (1, 1, 4, 32)
    assert acts.compressor is None and acts.filters is None
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
    z = zarr.open_consolidated(str(merged), mode="r")
    reader = zarr_store.ZarrReader(sharded)
    assert z["arrays/prompt_activations"].shape == (5, 2, 8, 32) and z.attrs["num_samples"] == 5
    for i in range(5):
        for li, layer in enumerate(LAYERS):
            p = reader.lengths()[i]
            np.testing.assert_array_equal(z["arrays/prompt_activations"][i, li, :p], reader.prompt(i, layer))
    assert list(z["arrays/label"][:]) == [p["label"] for p in PROMPTS]


def test_fallback_to_zarr_when_compressed(tmp_path):
    import numcodecs

    recs = [Record(text=f"t{i}", label=None, acts={3: np.full((5, 6), i, np.float32)}) for i in range(2)]
    opts = zarr_store.ZarrOptions.defaults(prompt_max=4, response_max=0, t_chunk_prompt=2)
    dpath = zarr_store.write_store(recs, 2, tmp_path / "s.zarr", {"model_id": "m"}, opts)
    assert (dpath / "arrays/prompt_activations/1.0.1.0").stat().st_size == 2 * 6 * 2  # raw chunk bytes
    acts = zarr.open(str(dpath / "arrays/prompt_activations"), mode="r")
    dpath.chmod(0o755)
    for p in dpath.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    zarr.array(acts[:], store=str(tmp_path / "c"), chunks=acts.chunks, compressor=numcodecs.Zlib())
    import shutil

    shutil.rmtree(dpath / "arrays/prompt_activations")
    shutil.copytree(tmp_path / "c", dpath / "arrays/prompt_activations")
    zarr.consolidate_metadata(str(dpath))
    reader = zarr_store.ZarrReader(dpath)
    assert reader.stores[0].direct["prompt"] is None
    np.testing.assert_array_equal(reader.prompt(1, 3), np.ones((4, 6), np.float16))
