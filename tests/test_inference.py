"""Inference dumps: exact codes in patch_acts.npz, streaming top-k equal to brute force, clear errors."""

import json
import time

import numpy as np
import pytest
import scipy.sparse

from builders import identity_sae, run_around_sae, write_shards
from saeflow import cli
from saeflow.analysis import inference
from saeflow.analysis.csr import CsrWriter
from saeflow.errors import SaeflowError
from saeflow.store import atomic
from saeflow.store.layout import DumpLayout


@pytest.fixture
def dumped(tmp_path):
    rng = np.random.default_rng(0)
    acts = rng.standard_normal((11, 2, 5, 6)).astype(np.float32)  # 11 examples, layers (1, 3), CLS + 4 patches
    sd = write_shards(tmp_path / "shards", acts, layers=(1, 3), cls_token=True, ex_per_shard=3)
    run = run_around_sae(tmp_path / "runs", sd, identity_sae(6), layer=3)
    argv = ["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "4", "--batch-size", "7"]
    assert cli.main(argv) == 0
    return acts, sd, run, run.dump(sd.hash).dpath


def test_codes_are_exact_and_scipy_loadable(dumped):
    acts, sd, run, out = dumped
    codes = scipy.sparse.load_npz(DumpLayout(out).acts_fpath)
    expected_rd = np.maximum(acts[:, 1].reshape(-1, 6), 0)  # layer 3 is index 1; row = example * T + token
    assert codes.shape == (11 * 5, 6) and codes.format == "csr"
    assert np.array_equal(codes.toarray(), expected_rd)
    assert codes.nnz == np.count_nonzero(expected_rd)
    config = json.loads(DumpLayout(out).config_fpath.read_text())
    assert config["layer"] == 3 and config["shard_hash"] == sd.hash and config["tokens_per_ex"] == 5
    assert not any(p.name.startswith(".") for p in out.parent.iterdir() if p.is_dir())  # no staging left


def brute_topk_examples(f_rs: np.ndarray, T: int, k: int, keep_r: np.ndarray) -> list[list[int]]:
    """Per latent, the rows of its k best examples among the kept rows: each example at its largest value (its
    earliest row among equals), examples by that value, ties to the earlier row."""
    out = []
    for s in range(f_rs.shape[1]):
        best = {}
        for r in np.flatnonzero(keep_r & (f_rs[:, s] > 0)):
            ex = r // T
            if ex not in best or f_rs[r, s] > f_rs[best[ex], s]:
                best[ex] = r
        out.append(sorted(best.values(), key=lambda r: (-f_rs[r, s], r))[:k])
    return out


def test_stats_topk_and_metrics_cover_the_tokens_the_sae_trained_on(dumped):
    """The run trained on `tokens: content` (the default): every patch, not CLS. The statistics, the top examples
    and the headline metrics are over those rows; the metrics over every stored token are kept under all_tokens."""
    acts, _, _, out = dumped
    f_rs = np.maximum(acts[:, 1].reshape(-1, 6), 0)
    x_rd = acts[:, 1].reshape(-1, 6).astype(np.float64)
    keep_r = np.arange(f_rs.shape[0]) % 5 != 0  # CLS is token 0
    lat = inference.load_dump(out).latents
    fires_rs = (f_rs > 0) & keep_r[:, None]
    assert np.array_equal(lat["n_fires"], fires_rs.sum(0))
    assert np.allclose(lat["freq"], fires_rs.sum(0) / keep_r.sum())
    assert np.allclose(lat["mean_act"], (f_rs * keep_r[:, None]).sum(0) / fires_rs.sum(0))
    assert np.allclose(lat["max_act"], (f_rs * keep_r[:, None]).max(0))
    assert np.array_equal(lat["l0_hist"], np.bincount(fires_rs[keep_r].sum(1), minlength=7))
    for s, rows in enumerate(brute_topk_examples(f_rs, 5, 4, keep_r)):
        assert lat["topk_example"][s].tolist() == [r // 5 for r in rows] + [-1] * (4 - len(rows))
        assert lat["topk_token"][s][: len(rows)].tolist() == [r % 5 for r in rows]
        assert np.allclose(lat["topk_values"][s][: len(rows)], f_rs[rows, s])
    metrics = json.loads(DumpLayout(out).metrics_fpath.read_text())
    for got, x_nd, f_ns in ((metrics, x_rd[keep_r], f_rs[keep_r]), (metrics["all_tokens"], x_rd, f_rs)):
        nmse = ((x_nd - f_ns) ** 2).sum() / ((x_nd - x_nd.mean(0)) ** 2).sum()
        assert got["nmse"] == pytest.approx(nmse) and got["l0"] == pytest.approx((f_ns > 0).sum(1).mean())
        assert got["n_vectors"] == len(x_nd) and got["n_dead"] == int(((f_ns > 0).sum(0) == 0).sum())
    assert metrics["tokens"] == "content" and metrics["all_tokens"]["tokens"] == "all"
    l0_r = fires_rs[keep_r].sum(1)  # L0 varies per row (a threshold or ReLU): its spread beside its mean
    assert len(set(l0_r.tolist())) > 2 and metrics["l0_std"] == pytest.approx(l0_r.std())
    assert [metrics[f"l0_p{q}"] for q in (10, 50, 90)] == [int(np.percentile(l0_r, q, method="inverted_cdf"))
                                                           for q in (10, 50, 90)]  # fmt: skip
    assert json.loads(DumpLayout(out).config_fpath.read_text())["tokens"] == "content"


def test_the_run_config_says_which_tokens_count(tmp_path):
    """`tokens: cls` in checkpoint/config.json: the statistics are over the CLS rows alone."""
    rng = np.random.default_rng(3)
    acts = rng.standard_normal((6, 1, 4, 5)).astype(np.float32)
    sd = write_shards(tmp_path / "shards", acts, layers=(2,), cls_token=True)
    run = run_around_sae(tmp_path / "runs", sd, identity_sae(5), layer=2, tokens="cls")
    out = inference.run_inference(inference.InferenceConfig(run.root, sd.dpath, top_k=3, batch_size=5))
    f_ns = np.maximum(acts[:, 0, 0], 0)
    lat = inference.load_dump(out).latents
    assert np.array_equal(lat["n_fires"], (f_ns > 0).sum(0))
    assert set(lat["topk_token"][lat["topk_example"] >= 0].tolist()) == {0}
    assert json.loads(DumpLayout(out).metrics_fpath.read_text())["n_vectors"] == 6


def _update(topk: inference.TopK, f_bs: np.ndarray, first_row: int) -> None:
    rows_n, cols_n = np.nonzero(f_bs)
    topk.update(rows_n, cols_n, f_bs[rows_n, cols_n], first_row)


def test_topk_pads_latents_that_rarely_fire():
    topk = inference.TopK(d_sae=2, k=3, tokens_per_ex=1)
    _update(topk, np.array([[0.0, 1.0], [2.0, 0.0]], np.float32), first_row=10)
    _update(topk, np.array([[0.0, 3.0]], np.float32), first_row=12)
    assert topk.rows_sk.tolist() == [[11, -1, -1], [12, 10, -1]]
    assert topk.values_sk.tolist() == [[2.0, 0.0, 0.0], [3.0, 1.0, 0.0]]


def test_topk_keeps_distinct_examples():
    """Three strong tokens of example 0 and weaker ones of examples 1 and 2: k=3 keeps one row of each example."""
    topk = inference.TopK(d_sae=1, k=3, tokens_per_ex=4)
    f_rs = np.array([[9.0], [8.0], [7.0], [0.0], [1.0], [0.0], [2.0], [0.0], [0.0], [0.0], [0.0], [3.0]], np.float32)
    _update(topk, f_rs[:6], first_row=0)
    _update(topk, f_rs[6:], first_row=6)
    assert topk.rows_sk.tolist() == [[0, 11, 6]]


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("T", [1, 3, 10])
def test_topk_streaming_equals_brute_force_with_ties(batch, T):
    rng = np.random.default_rng(batch)
    f_rs = np.round(np.maximum(rng.standard_normal((200, 5)), 0), 1).astype(np.float32)  # many ties
    topk = inference.TopK(d_sae=5, k=6, tokens_per_ex=T)
    for start in range(0, 200, batch):
        _update(topk, f_rs[start : start + batch], first_row=start)
    for s, rows in enumerate(brute_topk_examples(f_rs, T, 6, np.ones(200, bool))):
        assert topk.rows_sk[s].tolist() == rows and np.array_equal(topk.values_sk[s], f_rs[rows, s])


def test_csr_writer_streams_in_pieces(tmp_path):
    rng = np.random.default_rng(1)
    x_rs = rng.standard_normal((50, 9)).astype(np.float32) * (rng.random((50, 9)) < 0.2)
    writer = CsrWriter(tmp_path / "m.npz", 9)
    for start in range(0, 50, 13):
        writer.append(x_rs[start : start + 13])
    writer.finish()
    assert np.array_equal(scipy.sparse.load_npz(tmp_path / "m.npz").toarray(), x_rs)
    assert [p.name for p in tmp_path.iterdir()] == ["m.npz"]


def test_existing_dump_is_reused_not_rewritten(dumped, capsys):
    _, sd, run, out = dumped
    before = DumpLayout(out).acts_fpath.stat().st_mtime_ns
    assert cli.main(["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "4"]) == 0
    assert DumpLayout(out).acts_fpath.stat().st_mtime_ns == before
    assert cli.main(["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "5"]) == 1
    assert "different top_k" in capsys.readouterr().err


def test_replace_stale_swaps_in_a_dump_of_the_new_checkpoint(dumped, monkeypatch):
    _, sd, run, out = dumped
    run.sae_fpath.chmod(0o644)
    run.sae_fpath.write_bytes(run.sae_fpath.read_bytes())  # same bytes: the dump is not stale, nothing is redone
    argv = ["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "4", "--replace-stale"]
    before = DumpLayout(out).acts_fpath.stat().st_mtime_ns
    assert cli.main(argv) == 0 and DumpLayout(out).acts_fpath.stat().st_mtime_ns == before
    recorded = json.loads(DumpLayout(out).config_fpath.read_text())["sae_sha256"]
    # A failed rebuild puts the old dump back; a successful one records the new checkpoint's sha256.
    monkeypatch.setattr(inference, "file_sha256", lambda fpath: "0" * 64)
    monkeypatch.setattr(inference, "_dump", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError):
        inference.run_inference(inference.InferenceConfig(run.root, sd.dpath, top_k=4, replace_stale=True))
    assert json.loads(DumpLayout(out).config_fpath.read_text())["sae_sha256"] == recorded
    monkeypatch.undo()
    monkeypatch.setattr(inference, "file_sha256", lambda fpath: "0" * 64)
    assert cli.main(argv) == 0
    assert json.loads(DumpLayout(out).config_fpath.read_text())["sae_sha256"] == "0" * 64
    assert sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")) == [out.name]


def test_clear_errors(tmp_path, capsys):
    acts = np.ones((2, 1, 3, 4), np.float32)
    sd = write_shards(tmp_path / "shards", acts, layers=(2,), ex_per_shard=3)
    no_ckpt = run_around_sae(tmp_path / "runs", sd, None, layer=2)
    with pytest.raises(SaeflowError, match="no checkpoint"):
        inference.run_inference(inference.InferenceConfig(no_ckpt.root, sd.dpath))
    wrong_layer = run_around_sae(tmp_path / "runs", sd, identity_sae(4), layer=5)
    with pytest.raises(SaeflowError, match="trained on layer 5.*stores layers \\[2\\]"):
        inference.run_inference(inference.InferenceConfig(wrong_layer.root, sd.dpath))
    wrong_d = run_around_sae(tmp_path / "runs", sd, identity_sae(8), layer=2, tag="d8")
    with pytest.raises(SaeflowError, match="d_model=8.*d_model=4"):
        inference.run_inference(inference.InferenceConfig(wrong_d.root, sd.dpath))
    assert not wrong_d.dump(sd.hash).dpath.exists()
    assert cli.main(["inference", "--run", str(tmp_path / "nope"), "--shards", str(sd.dpath)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_the_same_inference_twice_writes_the_same_bytes(dumped, monkeypatch):
    """Every file of a dump but provenance.json (times, host: docs/store.md) is a function of its inputs: the zip
    headers inside the .npz files carry no write time."""
    _, sd, run, out = dumped

    def dump_bytes():
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
                if p.is_file() and p.name != "provenance.json"}  # fmt: skip

    first = dump_bytes()
    atomic.remove_staging(out)
    later = time.time() + 3 * 86400  # another day: a zip header stamped with the write time would differ
    monkeypatch.setattr(time, "time", lambda: later)
    argv = ["inference", "--run", str(run.root), "--shards", str(sd.dpath), "--top-k", "4", "--batch-size", "7"]
    assert cli.main(argv) == 0
    assert set(first) == {"config.json", "latents.npz", "metrics.json", "patch_acts.npz"}
    assert dump_bytes() == first
