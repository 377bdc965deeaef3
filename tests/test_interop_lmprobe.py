"""lmprobe 2.0 export: our writer/reader round trip, and lmprobe 0.10.3's own reader loads our exports exactly."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from builders import PROMPTS, pip_site
from hang import HANG_SEC
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


@pytest.mark.slow
def test_lmprobe_reads_our_exports_exactly(exports, records, lmprobe_site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(lmprobe_site), "HF_HUB_OFFLINE": "1", "LMPROBE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).parent / "_lmprobe_reader.py"), str(exports), *lmprobe.STORAGES],
        capture_output=True, text=True, env=env, timeout=HANG_SEC,
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


LMPROBE_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "lmprobe"  # fixtures/lmprobe/make_lmprobe_datasets.py
VARIANTS = ("pooled-last-token", "full-sequence", "pooled-mean", "pooled-first-token")


@pytest.mark.parametrize("variant", VARIANTS)
def test_reads_datasets_lmprobe_wrote_as_lmprobe_reads_them(variant):
    """lmprobe 0.10.3's push_dataset wrote them; its own readers' values are saved beside them."""
    want = np.load(LMPROBE_FIXTURES / variant / "lmprobe.npz")
    ds = lmprobe.LmprobeDataset(LMPROBE_FIXTURES / variant / "dataset")
    assert ds.info["provenance"]["lmprobe_version"] == LMPROBE_VERSION and ds.info["prompt_ordering"] == "random"
    assert ds.index["text"] == list(want["prompts"]) and ds.index["label"] == want["labels"].tolist()
    assert ds.pooling == {"pooled-mean": "mean", "pooled-first-token": "first_token"}.get(variant, "last_token")
    for layer in (0, 1):
        np.testing.assert_array_equal(ds.pooled(layer), want[f"pooled.{layer}"])
        if variant == "full-sequence":
            for i in range(ds.n_prompts):
                np.testing.assert_array_equal(ds.tokens(i, layer), want[f"tokens.{layer}.{i}"])
        else:
            np.testing.assert_array_equal(ds.pooled(layer), want[f"raw.hidden.layer_{layer}"])  # shard order
    if "raw.logits_topk.values" in want:
        values_nk, indices_nk = ds.logits_topk()
        np.testing.assert_array_equal(values_nk, want["raw.logits_topk.values"])
        np.testing.assert_array_equal(indices_nk, want["raw.logits_topk.indices"])
    else:
        assert ds.logits_topk() is None


@pytest.mark.parametrize("variant", ["pooled-last-token", "full-sequence"])
def test_records_of_lmprobe_datasets_carry_lmprobe_perplexities(variant):
    """lmprobe writes token_perplexity as strings when the first row has none (a one-token prompt)."""
    ds = lmprobe.LmprobeDataset(LMPROBE_FIXTURES / variant / "dataset")
    records = list(ds.records())
    assert [r.extra for r in records] == [{"source": s} for s in ds.index["source"]]
    for i, rec in enumerate(records):
        assert len(rec.token_nll) == len(rec.token_ids) - 1 and rec.token_strings[0] == rec.text.split()[0]
        if len(rec.token_nll):
            want = [ds.index[f"perplexity_{s}"][i] for s in ("mean", "min", "max")]
            np.testing.assert_allclose(rec.perplexity_stats(), want, rtol=1e-6)
        if variant == "full-sequence":  # lmprobe leaves num_tokens empty in pooled datasets
            assert len(rec.token_ids) == ds.index["num_tokens"][i] and rec.acts[1].shape == (len(rec.token_ids), 16)
        else:
            assert rec.acts[1].shape == (1, 16)


def test_mean_pooled_datasets_are_no_token_activations():
    ds = lmprobe.LmprobeDataset(LMPROBE_FIXTURES / "pooled-mean" / "dataset")
    with pytest.raises(SaeflowError, match="pooled by 'mean'"):
        ds.last_token(0)
    with pytest.raises(SaeflowError, match="pooled by 'mean'"):
        next(ds.records())


def test_first_token_pooled_datasets_convert_as_token_0(tmp_path, capsys):
    """Issue 33: a dataset lmprobe pooled at the first token was refused as "no token's activations"; its vectors
    are token 0's (the fixture checks lmprobe's against the model run on each prompt alone: `token0.<layer>`). They
    convert to saev shards (one token per prompt) and back to an lmprobe dataset that still says `first_token`."""
    from saeflow import cli
    from saeflow.store.shards import ShardDir

    src = LMPROBE_FIXTURES / "pooled-first-token"
    want = np.load(src / "lmprobe.npz")
    for layer in (0, 1):
        np.testing.assert_allclose(want[f"pooled.{layer}"], want[f"token0.{layer}"], rtol=0, atol=1e-6)
    assert cli.main(["convert", str(src / "dataset"), "--to", "saev", str(tmp_path / "shards")]) == 0
    sd = ShardDir(capsys.readouterr().out.split()[-1])
    assert sd.metadata.layers == (0, 1) and sd.metadata.tokens_per_ex == 1 and sd.n_ex == 6
    assert sd.metadata.data["info"]["hidden_layers"]["pooling"] == "first_token"  # hashed: not a last-token dataset
    for layer in (0, 1):
        acts_nd = np.stack([sd.example(i, layer)[0] for i in range(sd.n_ex)])
        np.testing.assert_array_equal(acts_nd, want[f"pooled.{layer}"])
    assert cli.main(["convert", str(src / "dataset"), "--to", "lmprobe", str(tmp_path / "again")]) == 0
    back = lmprobe.LmprobeDataset(tmp_path / "again")
    assert back.pooling == "first_token" and back.index["text"] == list(want["prompts"])
    np.testing.assert_array_equal(back.pooled(1), want["pooled.1"])
    with pytest.raises(SaeflowError, match="pooled at the first token, not the last"):
        back.last_token(0)


def test_convert_lmprobe_written_datasets(tmp_path, capsys):
    from saeflow import cli

    for variant in ("pooled-last-token", "full-sequence"):
        src = lmprobe.LmprobeDataset(LMPROBE_FIXTURES / variant / "dataset")
        assert cli.main(["convert", str(src.dpath), "--to", "lmprobe", str(tmp_path / variant)]) == 0, variant
        back = lmprobe.LmprobeDataset(tmp_path / variant)
        assert back.index["text"] == src.index["text"] and back.index["label"] == src.index["label"]
        assert back.info["model"]["name"] == "fixture/tiny-gpt2" and back.logits_topk()[0].shape == (6, 5)
        np.testing.assert_array_equal(back.last_token(1), src.last_token(1))
        np.testing.assert_array_equal(back.logits_topk()[1], src.logits_topk()[1])
    capsys.readouterr()
    assert cli.main(["convert", str(LMPROBE_FIXTURES / "pooled-mean" / "dataset"), "--to", "pickle",
                     str(tmp_path / "mean")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("saeflow convert: error: ") and "pooled by 'mean'" in err and "\n" not in err
    assert not (tmp_path / "mean").exists()
