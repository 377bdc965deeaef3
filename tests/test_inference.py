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


def test_stats_and_topk_match_brute_force(dumped):
    acts, _, _, out = dumped
    f_rs = np.maximum(acts[:, 1].reshape(-1, 6), 0)
    lat = inference.load_dump(out).latents
    fires_rs = f_rs > 0
    assert np.array_equal(lat["n_fires"], fires_rs.sum(0))
    assert np.allclose(lat["freq"], fires_rs.mean(0))
    assert np.allclose(lat["mean_act"], f_rs.sum(0) / fires_rs.sum(0))
    assert np.array_equal(lat["l0_hist"], np.bincount(fires_rs.sum(1), minlength=7))
    for s in range(6):
        rows = np.argsort(-f_rs[:, s], kind="stable")[:4]
        assert np.array_equal(lat["topk_example"][s], rows // 5)
        assert np.array_equal(lat["topk_token"][s], rows % 5)
        assert np.allclose(lat["topk_values"][s], f_rs[rows, s])
    metrics = json.loads(DumpLayout(out).metrics_fpath.read_text())
    x_rd = acts[:, 1].reshape(-1, 6).astype(np.float64)
    nmse = ((x_rd - f_rs) ** 2).sum() / ((x_rd - x_rd.mean(0)) ** 2).sum()
    assert metrics["nmse"] == pytest.approx(nmse) and metrics["l0"] == pytest.approx(fires_rs.sum(1).mean())


def _update(topk: inference.TopK, f_bs: np.ndarray, first_row: int) -> None:
    rows_n, cols_n = np.nonzero(f_bs)
    topk.update(rows_n, cols_n, f_bs[rows_n, cols_n], first_row)


def test_topk_pads_latents_that_rarely_fire():
    topk = inference.TopK(d_sae=2, k=3)
    _update(topk, np.array([[0.0, 1.0], [2.0, 0.0]], np.float32), first_row=10)
    _update(topk, np.array([[0.0, 3.0]], np.float32), first_row=12)
    assert topk.rows_sk.tolist() == [[11, -1, -1], [12, 10, -1]]
    assert topk.values_sk.tolist() == [[2.0, 0.0, 0.0], [3.0, 1.0, 0.0]]


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_topk_streaming_equals_brute_force_with_ties(batch):
    rng = np.random.default_rng(batch)
    f_rs = np.round(np.maximum(rng.standard_normal((200, 5)), 0), 1).astype(np.float32)  # many ties
    topk = inference.TopK(d_sae=5, k=6)
    for start in range(0, 200, batch):
        _update(topk, f_rs[start : start + batch], first_row=start)
    for s in range(5):
        rows = np.argsort(-f_rs[:, s], kind="stable")[:6]  # ties: earlier row first
        assert topk.rows_sk[s].tolist() == rows.tolist() and np.array_equal(topk.values_sk[s], f_rs[rows, s])


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
