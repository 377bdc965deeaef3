"""lmprobe 2.0 export: our writer/reader round trip, and lmprobe 0.10.3's own reader loads our exports exactly."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from builders import PROMPTS, pip_site
from saeflow.errors import SaeflowError
from saeflow.interop import engine, lmprobe
from saeflow.interop.records import Record, read_prompts

LMPROBE_VERSION = "0.10.3"
LAYERS = (0, 1)
TOP_K = 5


@pytest.fixture(scope="module")
def records(tiny_lm_dpath, prompts_fpath):
    cfg = engine.EngineConfig.defaults(model=str(tiny_lm_dpath), layers=LAYERS, top_k=TOP_K, perplexity=True,
                                       token_strings=True)
    return list(engine.TextEngine(cfg).records(read_prompts(prompts_fpath), progress=False))


@pytest.fixture(scope="module")
def exports(records, tmp_path_factory):
    root = tmp_path_factory.mktemp("lmprobe")
    for storage in lmprobe.STORAGES:
        opts = lmprobe.LmprobeOptions.defaults(storage=storage, prompts_per_shard=2, top_k=TOP_K, token_ids=True,
                                               token_strings=True)
        lmprobe.write(records, root / storage, "tiny-gpt2", "0" * 40, opts)
    return root


@pytest.fixture(scope="session")
def lmprobe_site():
    """lmprobe 0.10.3 (+ scikit-learn, which it imports) installed once with `pip install --target` into a cache."""
    return pip_site(f"lmprobe-{LMPROBE_VERSION}", [f"lmprobe=={LMPROBE_VERSION}", "scikit-learn", "joblib",
                                                   "threadpoolctl"], "lmprobe/sharing.py")


def test_lmprobe_reads_our_exports_exactly(exports, records, lmprobe_site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(lmprobe_site), "HF_HUB_OFFLINE": "1", "LMPROBE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).parent / "_lmprobe_reader.py"), str(exports), *lmprobe.STORAGES],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    labels = [p["label"] for p in PROMPTS]
    topk_v = np.stack([r.topk_values for r in records])
    topk_i = np.stack([r.topk_indices for r in records])
    for storage in lmprobe.STORAGES:
        out = got[storage]
        assert out["labels"] == labels and out["model_name"] == "tiny-gpt2"
        assert out["prompts"] == [p["text"] for p in PROMPTS]
        assert np.array_equal(np.array(out["raw"]["logits_topk.values"], dtype=np.float32), topk_v)
        assert np.array_equal(np.array(out["raw"]["logits_topk.indices"]), topk_i)
        for layer in LAYERS:
            last_nd = np.stack([r.acts[layer][-1] for r in records])
            assert np.array_equal(np.array(out["pooled"][str(layer)], dtype=np.float32), last_nd)
            raw_nd = np.array(out["raw"][f"hidden.layer_{layer}"], dtype=np.float32)
            if storage == "pooled":
                assert np.array_equal(raw_nd, last_nd)
            else:  # lmprobe concatenates last-token shards then sequence shards: address every token through the index
                ds = lmprobe.LmprobeDataset(exports / storage)
                starts = np.cumsum([0] + [s.get("num_tokens", s["num_prompts"]) for s in ds.hidden["shards"]])
                for i, rec in enumerate(records):
                    shard_offsets = zip(ds.index["token_shard_ids"][i], ds.index["token_shard_offsets"][i])
                    rows = [starts[s] + o for s, o in shard_offsets]
                    assert np.array_equal(raw_nd[rows], rec.acts[layer])


def test_round_trip_through_our_reader(exports, records):
    for storage in lmprobe.STORAGES:
        ds = lmprobe.LmprobeDataset(exports / storage)
        assert ds.info["model"] == {"name": "tiny-gpt2", "revision": "0" * 40}
        assert ds.info["provenance"]["torch_version"]
        for rec, back in zip(records, ds.records(), strict=True):
            assert back.text == rec.text and back.label == rec.label and back.extra == {"source": rec.extra["source"]}
            assert np.array_equal(back.token_ids, rec.token_ids)
            assert back.token_strings == rec.token_strings
            assert np.array_equal(back.topk_indices, rec.topk_indices)
            np.testing.assert_allclose(back.perplexity_stats(), rec.perplexity_stats(), rtol=1e-12)
            for layer in LAYERS:
                want = rec.acts[layer] if storage == "full_sequence" else rec.acts[layer][-1:]
                assert np.array_equal(back.acts[layer], want)
    assert ds.index["perplexity_mean"][0] == pytest.approx(records[0].perplexity_stats()[0])


def test_duplicate_texts_refused(records, tmp_path):
    dup = records[:2] + [records[0]]
    with pytest.raises(SaeflowError, match="duplicate prompt texts"):
        lmprobe.write(dup, tmp_path / "dup", "m", None, lmprobe.LmprobeOptions.defaults(top_k=0))
    assert not (tmp_path / "dup").exists() and not list(tmp_path.iterdir())
    lmprobe.write(dup, tmp_path / "ok", "m", None, lmprobe.LmprobeOptions.defaults(top_k=0, allow_duplicate_texts=True))


def test_writer_refuses_inconsistent_records_and_existing_output(records, exports, tmp_path):
    bad = Record(text="x", acts={0: np.zeros((3, 7), np.float32), 1: np.zeros((3, 7), np.float32)})
    with pytest.raises(SaeflowError, match="has no top-5 logits"):
        lmprobe.write([bad], tmp_path / "a", "m", None, lmprobe.LmprobeOptions.defaults(top_k=TOP_K))
    with pytest.raises(SaeflowError, match="already exists"):
        lmprobe.write(records, exports / "pooled", "m", None, lmprobe.LmprobeOptions.defaults())


def test_validator_catches_damage(exports, tmp_path):
    import shutil

    import safetensors.numpy

    dpath = tmp_path / "copy"
    shutil.copytree(exports / "full_sequence", dpath)
    for p in dpath.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    fpath = dpath / lmprobe.HIDDEN_FILE_PATTERN.format(layer=1, shard=0)
    safetensors.numpy.save_file({"hidden.layer_1": np.zeros((1, 32), np.float32)}, str(fpath))
    problems = lmprobe.validate(dpath)
    assert any("hidden_layer001_shard000" in p and "(2, 32)" in p for p in problems)
    with pytest.raises(SaeflowError, match="invalid lmprobe dataset"):
        lmprobe.LmprobeDataset(dpath)
