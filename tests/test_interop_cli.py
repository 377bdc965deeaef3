"""`saeflow export` / `saeflow convert` end to end: engine -> each format -> our reader give the same vectors."""

import json
import pathlib

import numpy as np
import pytest
import yaml

from saeflow import cli
from saeflow.interop import engine, pickle_shards, zarr_store
from saeflow.interop.records import read_prompts
from saeflow.store import shards

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "interop"


def engine_records(model_dpath, prompts_fpath, response_max=0):
    # batch_size 8, as the CLI
    cfg = engine.EngineConfig.defaults(model=str(model_dpath), layers=(0, 1), response_max=response_max, batch_size=8)
    eng = engine.TextEngine(cfg)
    return list(eng.records(read_prompts(prompts_fpath), progress=False))


@pytest.fixture(scope="module")
def expected(tiny_lm_dpath, prompts_fpath):
    return engine_records(tiny_lm_dpath, prompts_fpath)


def run(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out.strip().splitlines()[-1] if captured.out.strip() else "", captured.err


def test_export_pickle_adhoc_then_import_to_saev(tiny_lm_dpath, prompts_fpath, expected, tmp_path, capsys):
    out = tmp_path / "pkl"
    rc, printed, err = run(["export", "--format", "pickle", "--model", tiny_lm_dpath, "--prompts", prompts_fpath,
                            "--layers", "0", "1", "--out", out, "--no-progress"], capsys)
    assert rc == 0, err
    assert printed == str(out)
    for rec, back in zip(expected, pickle_shards.PickleShards(out).records(), strict=True):
        assert back.label == rec.label
        for layer in (0, 1):
            assert np.array_equal(back.acts[layer], rec.acts[layer])
    # ragged prompts cannot become saev shards: a clear error, nothing published
    rc, _, err = run(["convert", out, "--to", "saev", tmp_path / "shards"], capsys)
    assert rc == 1 and "saev shards need every example to have" in err
    assert not [p for p in (tmp_path / "shards").iterdir() if not p.name.startswith(".")]


def test_convert_numpy1_pickles_to_saev(tmp_path, capsys):
    rc, printed, err = run(["convert", FIXTURES / "numpy1_protocol2", "--to", "saev", tmp_path], capsys)
    assert rc == 0, err
    sd = shards.ShardDir(printed)
    assert sd.metadata.family == "gpt2" and sd.metadata.ckpt == "fixture/numpy1" and sd.metadata.layers == (0, 2)
    assert shards.validate(sd.dpath, deep=True).ok
    import importlib.util

    spec = importlib.util.spec_from_file_location("m", FIXTURES / "make_numpy1_pickles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert np.array_equal(sd.example(2, 2), mod.expected_activation(2, 2))


def test_export_zarr_from_config_in_parts(tiny_lm_dpath, prompts_fpath, tmp_path, capsys):
    # prompt activations come from the prompt + response forward pass: equal up to float16 rounding
    expected = engine_records(tiny_lm_dpath, prompts_fpath, response_max=2)
    out = tmp_path / "z"
    cfg = {"activations": {}, "exports": {"z": {
        "format": "zarr", "model": {"name": str(tiny_lm_dpath)}, "prompts": {"path": str(prompts_fpath)},
        "layers": [0, 1], "out": str(out),
        "zarr": {"prompt_max": 16, "response_max": 2, "t_chunk_prompt": 8, "samples_per_shard": 2, "merge": True}}}}
    cfg_fpath = tmp_path / "config.yaml"
    cfg_fpath.write_text(yaml.safe_dump(cfg))
    rc, _, err = run(["export", cfg_fpath, "--part", "2", "--no-progress"], capsys)
    assert rc == 0, err
    assert (out / "shards" / "shard-0002.zarr").is_dir() and not (out / zarr_store.MANIFEST_FNAME).exists()
    rc, printed, err = run(["export", cfg_fpath, "--no-progress"], capsys)
    assert rc == 0, err
    manifest = json.loads((out / zarr_store.MANIFEST_FNAME).read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [2, 2, 1]
    for root in (out, out / "merged.zarr"):
        reader = zarr_store.ZarrReader(root)
        for i, rec in enumerate(expected):
            for layer in (0, 1):
                np.testing.assert_allclose(reader.prompt(i, layer), rec.acts[layer], rtol=1e-3, atol=1e-3)
                np.testing.assert_allclose(reader.response(i, layer), rec.response_acts[layer], rtol=1e-3, atol=1e-3)
    rc, _, err = run(["export", cfg_fpath, "--part", "7"], capsys)
    assert rc == 1 and "shards 0..2" in err


def test_bad_input_is_reported(tiny_lm_dpath, tmp_path, capsys):
    rc, _, err = run(["export", "--format", "lmprobe", "--model", tiny_lm_dpath, "--prompts", tmp_path / "nope.jsonl",
                      "--layers", "0", "--out", tmp_path / "o"], capsys)
    assert rc == 1 and "nope.jsonl does not exist" in err and not (tmp_path / "o").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"label": 1}\n')
    rc, _, err = run(["export", "--format", "lmprobe", "--model", tiny_lm_dpath, "--prompts", bad, "--layers", "0"],
                     capsys)
    assert rc == 1 and "row 1 has no non-empty string column 'text'" in err
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"text": "a"}\n{"text": "a"}\n')
    rc, _, err = run(["export", "--format", "lmprobe", "--model", tiny_lm_dpath, "--prompts", dup, "--layers", "0"],
                     capsys)
    assert rc == 1 and "duplicate prompt texts" in err
    (tmp_path / "exists").mkdir()
    rc, _, err = run(["export", "--format", "pickle", "--model", tiny_lm_dpath, "--prompts", dup, "--layers", "0",
                      "--out", tmp_path / "exists"], capsys)
    assert rc == 1 and "already exists" in err
    rc, _, err = run(["export", "--format", "zarr", "--model", tiny_lm_dpath], capsys)
    assert rc == 1 and "--prompts" in err
    rc, _, err = run(["convert", tmp_path, "--to", "zarr", tmp_path / "x"], capsys)
    assert rc == 1 and "not an lmprobe dataset" in err
