"""`saeflow probe`: on planted data where each class (and each patch label) adds a known direction, the best single
latent of an SAE that recovered the directions is the latent aligned with it; the probes agree with scikit-learn
fitted on the same arrays, computed here from the shards and the SAE themselves."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from _cdp import Browser, find_chromium
from builders import run_around_sae, write_shards
from hang import HANG_SEC
from saeflow import cli
from saeflow.analysis import inference, probe, probe_samples, visuals
from saeflow.store.layout import ShardLayout
from saeflow.training import sae

N_CLASSES, N_SHAPES, D, T = 30, 4, 64, 4  # T: CLS + 3 patches


def planted(tmp_path, n_ex: int = 1500, seed: int = 0):
    """Shards where example n of class c carries direction c in one of its patches, and every patch of shape label
    l >= 1 carries shape direction l, over noise and two random distractor directions per token. Returns the shard
    directory, the SAE whose decoder rows are every direction (shuffled) and the latent of each direction."""
    rng = np.random.default_rng(seed)
    n_dirs = N_CLASSES + N_SHAPES + 62
    dirs_ad = rng.standard_normal((n_dirs, D)).astype(np.float32)
    dirs_ad /= np.linalg.norm(dirs_ad, axis=1, keepdims=True)
    classes_n = rng.integers(0, N_CLASSES, n_ex).astype(np.int32)
    shapes_np = (rng.random((n_ex, T - 1)) < 0.5) * rng.integers(1, N_SHAPES + 1, (n_ex, T - 1))
    acts_ntd = rng.normal(0, 0.1, (n_ex, T, D)).astype(np.float32)
    distract_ntk = rng.integers(N_CLASSES + N_SHAPES, n_dirs, (n_ex, T, 2))
    acts_ntd += np.einsum("ntk,ntkd->ntd", rng.uniform(1, 2, (n_ex, T, 2)), dirs_ad[distract_ntk])
    where_n = rng.integers(1, T, n_ex)  # the patch that shows the class
    acts_ntd[np.arange(n_ex), where_n] += rng.uniform(2, 3, (n_ex, 1)) * dirs_ad[classes_n]
    shape_dirs = dirs_ad[N_CLASSES + shapes_np - 1] * (shapes_np > 0)[..., None]
    acts_ntd[:, 1:] += rng.uniform(2, 3, (n_ex, T - 1, 1)) * shape_dirs
    aux = {ShardLayout.CLASSES_FNAME: classes_n, ShardLayout.LABELS_FNAME: shapes_np.astype(np.uint8)}
    sd = write_shards(tmp_path / "shards", acts_ntd[:, None], layers=(0,), cls_token=True, aux=aux,
                      data={"classes": [f"c{c}" for c in range(N_CLASSES)]})  # fmt: skip
    latent_of = rng.permutation(n_dirs)  # direction a is latent latent_of[a]
    W_dec = torch.from_numpy(dirs_ad[np.argsort(latent_of)])
    model = sae.SAE.from_weights(W_dec.T.contiguous(), torch.full((n_dirs,), -0.8), W_dec, torch.zeros(D), arch="relu",
                                 k=1)  # fmt: skip
    return sd, model, latent_of


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("probe")
    sd, model, latent_of = planted(tmp_path)
    run = run_around_sae(tmp_path / "runs", sd, model, 0, tokens="content")
    inference.run_inference(inference.InferenceConfig(run=run.root, shards=sd.dpath, device="cpu"))
    visuals.make_visuals(visuals.VisualsConfig(run=run.root, n_latents=4))
    assert cli.main(["probe", "--run", str(run.root), "--ks", "1", "5"]) == 0
    result = json.loads(run.probe_fpath(sd.hash).read_text())
    return {"sd": sd, "model": model, "latent_of": latent_of, "run": run, "result": result}


def test_the_best_latent_of_each_class_is_the_one_aligned_with_its_direction(probed):
    labels = {(e["file"], e["value"]): e for e in probed["result"]["labels"]}
    latent_of = probed["latent_of"]
    classes = [labels[("classes.bin", c)] for c in range(N_CLASSES)]
    found = [e["best_latent"]["latent"] == latent_of[c] for c, e in enumerate(classes)]
    assert np.mean(found) >= 0.95, [e["best_latent"] for e in classes]
    assert all(e["name"] == f"c{e['value']}" and e["scored"] == "example" for e in classes)
    assert np.mean([e["best_latent"]["auroc"] for e in classes]) > 0.95
    assert np.mean([e["best_latent"]["f1"] for e in classes]) > 0.8
    # Per patch: shape l (1..4) is direction N_CLASSES + l - 1; background (0) is scored too.
    for shape in range(1, N_SHAPES + 1):
        entry = labels[("labels.bin", shape)]
        assert entry["scored"] == "patch" and entry["best_latent"]["latent"] == latent_of[N_CLASSES + shape - 1]
        assert entry["sparse"]["1"]["accuracy"] > 0.9
    assert ("labels.bin", 0) in labels
    metrics = probed["result"]["metrics"]
    assert metrics["n_labels"] == metrics["n_probed"] == N_CLASSES + N_SHAPES + 1
    assert set(metrics) >= {"best_latent_auroc", "best_latent_f1", "sparse_k1_accuracy", "sparse_k5_accuracy",
                            "dense_accuracy"}  # fmt: skip


def _sklearn_probe(x_train, y_train, x_test, y_test) -> dict:
    """Held-out accuracy and AUROC of scikit-learn's own pipeline, with its own metrics."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000)).fit(x_train, y_train)
    return {"accuracy": accuracy_score(y_test, clf.predict(x_test)),
            "auroc": roc_auc_score(y_test, clf.decision_function(x_test))}  # fmt: skip


def test_the_probes_match_scikit_learn_on_the_same_arrays(probed):
    """The dense probe's and the k-sparse probes' held-out accuracy (and AUROC) equal scikit-learn's on features built
    here from the shard files (raw activations, mean over the patches) and the SAE (codes, max over the patches), for
    the units of the probe's own split and samples; the best latent's AUROC and F1 equal sklearn.metrics' on its
    codes."""
    from sklearn.metrics import f1_score, roc_auc_score

    sd, model, result = probed["sd"], probed["model"], probed["result"]
    acts_ntd = np.stack([sd.example(ex, 0) for ex in range(sd.n_ex)])
    raw_nd = acts_ntd[:, 1:].mean(1)  # tokens: content (the patches)
    with torch.no_grad():
        codes_ns = model.encode(torch.from_numpy(acts_ntd.reshape(-1, D))).numpy().reshape(sd.n_ex, T, -1)
    codes_ns = codes_ns[:, 1:].max(1)
    cfg = probe.ProbeConfig(run=probed["run"].root, ks=(1, 5))
    classes = next(s for s in probe.label_sources(sd) if s.fname == "classes.bin")
    sample = probe.sample_units(sd, classes, cfg)
    test_ex = probe_samples.is_test(np.arange(sd.n_ex), cfg.seed, cfg.test_frac)
    for vi, value in enumerate(sample.values[:8]):
        entry = next(e for e in result["labels"] if e["file"] == "classes.bin" and e["value"] == value)
        (pos, neg), (pos_t, neg_t) = sample.task(0, vi), sample.task(1, vi)
        assert not test_ex[np.r_[pos, neg]].any() and test_ex[np.r_[pos_t, neg_t]].all()  # split by example
        assert (np.asarray(sd.aux("classes.bin"))[pos] == value).all() and len(pos) == len(neg) > 10
        train, test = np.r_[pos, neg], np.r_[pos_t, neg_t]
        y, y_t = np.r_[np.ones(len(pos)), np.zeros(len(neg))], np.r_[np.ones(len(pos_t)), np.zeros(len(neg_t))]
        dense = _sklearn_probe(raw_nd[train], y, raw_nd[test], y_t)
        assert entry["dense"]["accuracy"] == dense["accuracy"]
        assert entry["dense"]["auroc"] == pytest.approx(dense["auroc"], abs=1e-12)
        codes_k = codes_ns[:, entry["sparse"]["5"]["latents"]]
        assert entry["sparse"]["5"]["accuracy"] == _sklearn_probe(codes_k[train], y, codes_k[test], y_t)["accuracy"]
        best, threshold = entry["best_latent"]["latent"], entry["best_latent"]["threshold"]
        assert entry["best_latent"]["auroc"] == pytest.approx(roc_auc_score(y_t, codes_ns[test, best]), abs=1e-12)
        assert entry["best_latent"]["f1"] == pytest.approx(f1_score(y_t, codes_ns[test, best] > threshold), abs=1e-12)
        cand = [c[0] for c in entry["candidates"]]
        assert [c[2] for c in entry["candidates"]] == pytest.approx(
            [roc_auc_score(y_t, codes_ns[test, c]) for c in cand], abs=1e-4)


def test_the_f1_threshold_is_the_best_firing_threshold_on_the_training_sample():
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    y = rng.random(200) < 0.5
    x = np.where(rng.random(200) < 0.7, 0.0, rng.random(200)) + y * rng.random(200)
    t = probe.f1_threshold(x, y)
    grid = np.r_[0.0, np.unique(x[x > 0])]
    assert f1_score(y, x > t) == max(f1_score(y, x > g) for g in grid)
    assert probe.f1_threshold(np.zeros(10), np.arange(10) < 5) == 0.0  # a latent that never fires: F1 0, not 2/3


def test_the_split_and_samples_are_a_function_of_the_seed(probed, tmp_path):
    sd = probed["sd"]
    source = next(s for s in probe.label_sources(sd) if s.fname == "labels.bin")
    cfg = probe.ProbeConfig(run=probed["run"].root, max_units=400)
    a, b = probe.sample_units(sd, source, cfg), probe.sample_units(sd, source, cfg)
    assert all(np.array_equal(a.positives[key], b.positives[key]) for key in a.positives)
    other = probe.sample_units(sd, source, probe.ProbeConfig(run=probed["run"].root, max_units=400, seed=1))
    assert not np.array_equal(a.units_n, other.units_n)
    assert len(a.units_n) <= 400  # the budget: 5 labels and the pool share max_units
    # The keys do not depend on how the units are read: one chunk or many.
    ids = np.arange(10_000)
    halves = [probe_samples.uniform(ids[:77], 3, 1), probe_samples.uniform(ids[77:], 3, 1)]
    assert np.array_equal(probe_samples.uniform(ids, 3, 1), np.concatenate(halves))
    assert abs(probe_samples.is_test(ids, 0, 0.2).mean() - 0.2) < 0.02


def test_each_latent_page_lists_the_labels_it_predicts(probed, tmp_path):
    run, sd, latent_of = probed["run"], probed["sd"], probed["latent_of"]
    js = run.dump(sd.hash).labels_js_fpath.read_text()
    assert js.startswith("window.SAEFLOW_LABELS = ")
    page = json.loads(js.removeprefix("window.SAEFLOW_LABELS = ").rstrip(";\n"))
    assert page["note"] == "" and page["labelled"] is True
    first = page["latents"][str(latent_of[0])][0]  # class c0's latent: c0 first, as its best single latent
    assert first[0] == "c0" and first[3] is True and first[1] > 0.9
    # Visuals drawn again read the probe result (same checkpoint), so the page keeps its labels.
    visuals.make_visuals(visuals.VisualsConfig(run=run.root, n_latents=4, force=True))
    assert run.dump(sd.hash).labels_js_fpath.read_text() == js
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (make browser, or apt-get install chromium)")
    browser = Browser(exe, tmp_path / "chromium-profile")
    try:  # what a reader sees on the page of class c0's latent (not drawn: every latent has the section)
        session = browser.open_page(run.dump(sd.hash).index_fpath.as_uri())
        browser.evaluate(session, f"location.hash = 'latent-{latent_of[0]}'")
        browser.evaluate(session, "new Promise(r => setTimeout(r, 150))")
        section = browser.evaluate(session, "document.querySelector('#labels').innerText")
        assert section.startswith("Labels this latent predicts") and "c0" in section and "yes" in section
        assert browser.console_errors() == []
    finally:
        browser.close()


def test_a_class_seen_in_one_split_only_is_counted_and_skipped(tmp_path):
    """The largest class id in the training split only (and a class in the held-out split only): counted per split,
    probed where both splits hold it, skipped with a reason elsewhere; unlabelled examples (-1) are left out."""
    rng = np.random.default_rng(0)
    ex = np.arange(400)
    test_n = probe_samples.is_test(ex, 0, 0.2)
    classes = rng.integers(0, 2, 400).astype(np.int32)
    classes[np.flatnonzero(~test_n)[:20]] = 7  # class 7: training split only
    classes[np.flatnonzero(test_n)[:5]] = 3  # class 3: held-out split only
    classes[np.flatnonzero(~test_n)[20:25]] = -1
    acts = rng.standard_normal((400, 1, 2, 8)).astype(np.float32)
    sd = write_shards(tmp_path / "shards", acts, layers=(0,), cls_token=True, aux={ShardLayout.CLASSES_FNAME: classes})
    run = run_around_sae(tmp_path / "runs", sd, sae.SAE.from_weights(torch.eye(8), torch.zeros(8), torch.eye(8),
                                                                     torch.zeros(8), arch="relu", k=1), 0,
                         tokens="content")  # fmt: skip
    inference.run_inference(inference.InferenceConfig(run=run.root, shards=sd.dpath, device="cpu"))
    result = json.loads(probe.run_probe(probe.ProbeConfig(run=run.root, ks=(1,))).read_text())
    by_value = {e["value"]: e for e in result["labels"]}
    assert sorted(by_value) == [0, 1, 3, 7] and by_value[7]["n_units"] == [20, 0] and by_value[3]["n_units"][0] == 0
    assert "skipped" in by_value[7] and "skipped" in by_value[3]
    assert "best_latent" in by_value[0] and "best_latent" in by_value[1]
    assert sum(sum(e["n_units"]) for e in by_value.values()) == 395
    assert result["metrics"]["n_labels"] == 4 and result["metrics"]["n_probed"] == 2


def test_shards_without_labels_are_a_one_line_error(tmp_path, capsys):
    rng = np.random.default_rng(0)
    sd = write_shards(tmp_path / "shards", rng.standard_normal((8, 1, 2, 4)).astype(np.float32), layers=(0,))
    run = run_around_sae(tmp_path / "runs", sd, sae.SAE.from_weights(torch.eye(4), torch.zeros(4), torch.eye(4),
                                                                     torch.zeros(4), arch="relu", k=1), 0)  # fmt: skip
    inference.run_inference(inference.InferenceConfig(run=run.root, shards=sd.dpath, device="cpu"))
    assert cli.main(["probe", "--run", str(run.root)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nothing to probe" in err and "labels.bin" in err
    assert not run.probe_fpath(sd.hash).exists()


def labelled_run(tmp_path, labels_np=None, classes_n=None, n_ex=None):
    """A run of an 8-latent identity SAE with a dump on random shards (4 patches and CLS) carrying the given
    labels.bin and/or classes.bin."""
    n_ex = n_ex or len(labels_np if labels_np is not None else classes_n)
    aux = {ShardLayout.LABELS_FNAME: labels_np, ShardLayout.CLASSES_FNAME: classes_n}
    acts = np.random.default_rng(0).standard_normal((n_ex, 1, 5, 8)).astype(np.float32)
    sd = write_shards(tmp_path / "shards", acts, layers=(0,), cls_token=True,
                      aux={k: v for k, v in aux.items() if v is not None})  # fmt: skip
    model = sae.SAE.from_weights(torch.eye(8), torch.zeros(8), torch.eye(8), torch.zeros(8), arch="relu", k=1)
    run = run_around_sae(tmp_path / "runs", sd, model, 0, tokens="content")
    inference.run_inference(inference.InferenceConfig(run=run.root, shards=sd.dpath, device="cpu"))
    return run, sd


def test_a_common_label_gets_as_many_negatives_as_positives(tmp_path):
    """Issue 33: negatives came from one uniform pool of train_per_label units, so a label on 97% of the patches got
    a few pairs. A patch label on 97% and a class on 55% of the data both get their 64 training and 16 held-out
    pairs, which the data hold (3% of 3,200 training patches is 96)."""
    rng = np.random.default_rng(1)
    labels_np = np.where(rng.random((1000, 4)) < 0.03, 0, 1).astype(np.uint8)
    classes_n = np.where(rng.random(1000) < 0.55, 0, 1).astype(np.int32)
    run, sd = labelled_run(tmp_path, labels_np, classes_n)
    result = json.loads(probe.run_probe(probe.ProbeConfig(run=run.root, train_per_label=64, test_per_label=16,
                                                          ks=(1,))).read_text())  # fmt: skip
    assert [(e["file"], e["value"], e["n_train"], e["n_test"]) for e in result["labels"]] == [
        ("labels.bin", 0, 128, 32), ("labels.bin", 1, 128, 32), ("classes.bin", 0, 128, 32),
        ("classes.bin", 1, 128, 32)]  # fmt: skip


def test_a_run_where_every_label_is_skipped_says_why_per_label(tmp_path, capsys):
    """Issue 33: one class, or every example unlabelled (-1), exited 0 with nothing on stderr."""
    run, sd = labelled_run(tmp_path / "one", classes_n=np.zeros(40, np.int32))
    assert cli.main(["probe", "--run", str(run.root), "--ks", "1"]) == 0
    n_train, n_test = json.loads(run.probe_fpath(sd.hash).read_text())["labels"][0]["n_units"]
    assert capsys.readouterr().err.splitlines() == [
        "saeflow probe: warning: no label was probed:",
        "saeflow probe: warning:   class 0 (classes.bin): 0 training and 0 held-out pairs (a probe needs 2 and 1): "
        f"the label has {n_train} of {n_train} training units and {n_test} of {n_test} held-out ones, and every other "
        "unit is a negative",
    ]
    run, _ = labelled_run(tmp_path / "none", classes_n=np.full(40, -1, np.int32))
    assert cli.main(["probe", "--run", str(run.root), "--ks", "1"]) == 0
    assert capsys.readouterr().err == ("saeflow probe: warning: no label was probed: every unit of classes.bin is "
                                       "unlabelled (a negative class id, -1, marks an unlabelled example)\n")


def test_a_k_above_d_sae_is_refused_in_one_line(tmp_path, capsys):
    """Issue 33: `--ks 300` on 256 latents fitted all of them and reported it as k300."""
    run, _ = labelled_run(tmp_path, classes_n=np.arange(40, dtype=np.int32) % 2)
    assert cli.main(["probe", "--run", str(run.root), "--ks", "1", "9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "probe ks: k 9 exceeds the SAE's 8 latents (d_sae); give ks of at most 8" in err


def test_class_ids_are_remapped_so_a_huge_id_costs_no_memory(tmp_path):
    """Issue 33: a class id of 2^31 - 1 was an index (np.bincount): 16 GiB per split. The sampling runs under a 3 GiB
    address-space limit (the import of numpy, scipy and scikit-learn takes about 1)."""
    classes_n = np.array([0, 2**31 - 1] * 20, np.int32)
    run, sd = labelled_run(tmp_path, classes_n=classes_n)
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from saeflow.analysis import probe
from saeflow.store.shards import ShardDir
sd = ShardDir({str(sd.dpath)!r})
(source,) = probe.label_sources(sd)
sample = probe.sample_units(sd, source, probe.ProbeConfig(run=None))
print(sample.values.tolist(), sample.counts_sv.sum(0).tolist())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_SEC)
    assert proc.returncode == 0 and proc.stdout.split("\n")[0] == f"{[0, 2**31 - 1]} [20, 20]", proc.stderr[-2000:]
