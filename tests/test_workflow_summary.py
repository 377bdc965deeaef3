"""saeflow summary: the Pareto fronts (one per shard directory, layer and architecture; a point per seed group with
error bars), the CSV columns, the grouped (seed) table, the report pages, and clear errors for runs without
metrics."""

import csv
import io
import json

import numpy as np
import pytest

from saeflow import cli
from saeflow.analysis import report, summary
from saeflow.errors import SaeflowError
from saeflow.store import runs


def test_pareto_front_keeps_only_undominated_points():
    points = [(8.0, 0.6), (32.0, 0.4), (16.0, 0.7), (64.0, 0.4), (128.0, 0.2)]
    assert summary.pareto_front(points) == [0, 1, 4]


def make_run(tmp_path, k: int, metrics: dict | None, **config):
    run = runs.create_run(tmp_path / "runs", {"arch": "topk", "k": k, "train_shards": "a" * 64, **config}, tmp_path)
    if metrics is not None:
        dump = run.dump("b" * 64)
        dump.dpath.mkdir(parents=True)
        dump.metrics_fpath.write_text(json.dumps(metrics))
    return run.root


def test_summary_writes_one_row_per_run_and_a_png(tmp_path):
    run_dpaths = [make_run(tmp_path, k, {"l0": float(k), "nmse": 1.0 / k}) for k in (4, 16)]
    csv_fpath, png_fpath = report.write_summary(run_dpaths, tmp_path / "out")
    rows = list(csv.DictReader(io.StringIO(csv_fpath.read_text())))
    assert [float(r["l0"]) for r in sorted(rows, key=lambda r: float(r["l0"]))] == [4.0, 16.0]
    assert list(rows[0])[:10] == ["name", "run_id", "shard_hash", "group", "group_name", "kind", "activation",
                                  "warning", "l0", "nmse"]  # fmt: skip
    assert "config.k" in rows[0]
    assert png_fpath.read_bytes()[:4] == b"\x89PNG"


def test_the_headline_metrics_are_the_trained_tokens_and_say_so(tmp_path):
    """metrics.json's top level (the tokens the SAE trained on, named by `tokens`) is the headline: the columns after
    `warning`, and the Pareto plot's y axis; every stored token's metrics follow as all_tokens.*. In each group the
    settings they were measured with (`dense_freq`, `tokens`) follow the metrics (issue 40: `dense_freq` was the first
    metric column)."""
    metrics = {"tokens": "content", "l0": 4.0, "nmse": 0.2, "dense_freq": 0.1,
               "all_tokens": {"tokens": "all", "l0": 4.1, "nmse": 0.3, "dense_freq": 0.1}}  # fmt: skip
    rows = summary.collect([make_run(tmp_path, 4, metrics)])
    columns = summary.to_csv(rows).splitlines()[0].split(",")
    assert columns[7:16] == ["warning", "l0", "nmse", "dense_freq", "tokens", "all_tokens.l0", "all_tokens.nmse",
                             "all_tokens.dense_freq", "all_tokens.tokens"]  # fmt: skip
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    summary.nmse_panel(ax, rows)
    assert ax.get_ylabel() == "normalized MSE\n(on the tokens the SAE trained on)"
    assert [float(y) for y in ax.get_lines()[0].get_ydata()] == [0.2]
    plt.close(fig)


def test_summary_labels_name_runs(tmp_path):
    run_dpaths = [make_run(tmp_path, k, {"l0": float(k), "nmse": 1.0 / k}) for k in (4, 16)]
    labels = [f"--label={d.name}=topk[k={k},seed=0]" for k, d in zip((4, 16), run_dpaths)]
    labels += [f"--group-label={d.name}=topk[k={k}]" for k, d in zip((4, 16), run_dpaths)]
    argv = ["summary", *[f"--run={d}" for d in run_dpaths], *labels, "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "summary.csv").read_text())))
    assert {r["run_id"]: (r["name"], r["group_name"]) for r in rows} == {
        d.name: (f"topk[k={k},seed=0]", f"topk[k={k}]") for k, d in zip((4, 16), run_dpaths)}
    grouped = list(csv.DictReader(io.StringIO((tmp_path / "out" / report.GROUPED_FNAME).read_text())))
    assert sorted(r["name"] for r in grouped) == ["topk[k=16]", "topk[k=4]"]
    assert cli.main(["summary", f"--run={run_dpaths[0]}", "--label=nonsense", "--out", str(tmp_path / "o2")]) == 1


def test_summary_errors_name_the_problem(tmp_path):
    bare = make_run(tmp_path, 4, None)
    with pytest.raises(SaeflowError, match="none of the 1 runs has inference metrics"):
        report.write_summary([bare], tmp_path / "out")
    no_l0 = make_run(tmp_path, 8, {"nmse": 0.5})
    with pytest.raises(SaeflowError, match="lack L0"):
        report.write_summary([no_l0], tmp_path / "out")


def test_summary_carries_the_splice_evaluation(tmp_path):
    run_dpaths = [make_run(tmp_path, k, {"l0": float(k), "nmse": 1.0 / k}) for k in (4, 16)]
    evaluation = runs.open_run(run_dpaths[1]).evaluation_fpath("b" * 64)
    evaluation.parent.mkdir()
    evaluation.write_text(json.dumps({"config": {"hook": "mlp_out"},
                                      "metrics": {"ce_loss_recovered": 0.75, "kl_score": None}}))  # fmt: skip
    csv_fpath, png_fpath = report.write_summary(run_dpaths, tmp_path / "out")
    rows = {r["config.k"]: r for r in csv.DictReader(io.StringIO(csv_fpath.read_text()))}
    assert rows["16"]["eval.ce_loss_recovered"] == "0.75" and rows["4"]["eval.ce_loss_recovered"] == ""
    assert rows["16"]["eval.hook"] == "mlp_out" and rows["4"]["eval.hook"] == ""  # the hook point it spliced
    assert rows["16"]["eval.kl_score"] == ""  # a null ratio is a blank cell
    header = list(rows["16"])
    assert header.index("nmse") < header.index("eval.ce_loss_recovered") < header.index("config.k")
    assert png_fpath.read_bytes()[:4] == b"\x89PNG"
    evaluation.write_text(json.dumps({"metrics": {"ce_loss_recovered": 0.75}}))  # before hook points: the residual
    rows = {r["config.k"]: r for r in csv.DictReader(io.StringIO(report.write_summary(run_dpaths, tmp_path / "o2")[0]
                                                                  .read_text()))}  # fmt: skip
    assert rows["16"]["eval.hook"] == "residual"
    evaluation.write_text("[]")
    with pytest.raises(SaeflowError, match="evaluation"):
        report.write_summary(run_dpaths, tmp_path / "out")


def test_summary_shows_the_learning_rate_a_run_trained_with(tmp_path):
    """Issue 25: `config.lr` is blank when the default (null: `rates.auto_lr(d_sae)`) is used, so the rate a run
    trained with was shown nowhere. Training records it in checkpoint/metrics.json (and its final line), and the
    summary shows it as `train.peak_lr`; the run id (the hashed config) is unchanged."""
    from builders import planted_data, run_from_sae_spec, write_shards
    from saeflow.analysis import inference
    from saeflow.training import rates, train

    x_nd, _ = planted_data(512, d_model=16, n_atoms=16, k=2)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), tag="lr")
    spec = dict(arch="topk", k=2, expansion=2, batch_size=64, n_epochs=1)
    default = run_from_sae_spec(tmp_path / "runs", sd, **spec)
    explicit = run_from_sae_spec(tmp_path / "runs", sd, **spec, lr=3e-3)
    results = train.train_runs([default.root, explicit.root], train.TrainSettings(device="cpu"))
    assert sorted(r["peak_lr"] for r in results) == sorted([rates.auto_lr(32), 3e-3])
    for run in (default, explicit):
        assert run.root.name == runs.run_id(run.config())
        inference.run_inference(inference.InferenceConfig(run.root, sd.dpath))
    csv_fpath, _ = report.write_summary([default.root, explicit.root], tmp_path / "out")
    rows = {r["run_id"]: r for r in csv.DictReader(io.StringIO(csv_fpath.read_text()))}
    assert rows[default.root.name]["config.lr"] == "" and rows[explicit.root.name]["config.lr"] == "0.003"
    assert float(rows[default.root.name]["train.peak_lr"]) == rates.auto_lr(32)
    assert float(rows[explicit.root.name]["train.peak_lr"]) == 3e-3


def test_a_degenerate_run_is_said_by_training_and_by_the_summary(tmp_path, caplog, capsys):
    """Issue 40: a run whose every latent is dense passed training and the summary silently. A ReLU SAE without its L1
    (about half its latents on every vector) gets one line at the end of training and one from the summary, and the
    summary's `warning` column; a sparse TopK run beside it gets neither."""
    from builders import planted_data, run_from_sae_spec, write_shards
    from saeflow.analysis import inference
    from saeflow.training import train

    x_nd, _ = planted_data(512, d_model=16, n_atoms=16, k=2)
    sd = write_shards(tmp_path / "shards", x_nd.reshape(-1, 1, 8, 16), layers=(0,), tag="degenerate")
    dense = run_from_sae_spec(tmp_path / "runs", sd, arch="relu", l1_coeff=0.0, expansion=2, batch_size=64)
    sparse = run_from_sae_spec(tmp_path / "runs", sd, arch="topk", k=2, expansion=2, batch_size=64)
    caplog.set_level("WARNING", logger="saeflow.training.train")
    train.train_runs([dense.root, sparse.root], train.TrainSettings(device="cpu"))
    said = [r.getMessage() for r in caplog.records if "degenerate" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{dense.root}: degenerate result: ") and "of d_sae 32" in said[0]
    for run in (dense, sparse):
        inference.run_inference(inference.InferenceConfig(run.root, sd.dpath))
    capsys.readouterr()
    out = tmp_path / "out"
    assert cli.main(["summary", f"--run={dense.root}", f"--run={sparse.root}", f"--label={dense.root.name}=relu",
                     "--out", str(out)]) == 0  # fmt: skip
    rows = {r["run_id"]: r for r in csv.DictReader(io.StringIO((out / "summary.csv").read_text()))}
    assert "is above 0.1 of d_sae 32: not a sparse code" in rows[dense.root.name]["warning"]
    assert rows[sparse.root.name]["warning"] == ""
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"saeflow summary: run relu ({dense.root.name[:12]}) on shards {sd.hash[:8]}: degenerate result: "
                    f"{rows[dense.root.name]['warning']}")  # fmt: skip


def _panel_lines(rows):
    """What summary.pareto_panel draws: {legend label: (x, y) of its front}, and the error bars' half-widths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    summary.nmse_panel(ax, rows)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
             if not line.get_label().startswith("_")}  # fmt: skip
    bars = [seg for coll in ax.collections if hasattr(coll, "get_segments") for seg in coll.get_segments()]
    plt.close(fig)
    return lines, bars


def test_one_pareto_front_per_shard_directory_layer_and_architecture(tmp_path):
    """SAEs on layers 3 and 5 of the same shard directory, and a ReLU beside the TopKs, are three fronts."""
    specs = [(4, 3, "topk"), (16, 3, "topk"), (8, 5, "topk"), (32, 5, "topk"), (8, 3, "relu")]
    run_dpaths = [make_run(tmp_path, k, {"l0": float(k), "nmse": 1.0 / k}, layer=layer, arch=arch)
                  for k, layer, arch in specs]  # fmt: skip
    rows = summary.collect(run_dpaths)
    lines, _ = _panel_lines(rows)
    assert sorted(lines) == [f"SAE: shards {'b' * 8} L3 relu (1 runs)", f"SAE: shards {'b' * 8} L3 topk (2 runs)",
                             f"SAE: shards {'b' * 8} L5 topk (2 runs)"]  # fmt: skip
    assert lines[f"SAE: shards {'b' * 8} L5 topk (2 runs)"][0] == [8.0, 32.0]


def test_the_pareto_plot_keeps_saes_transcoders_and_skip_transcoders_apart_and_names_what_they_read(tmp_path):
    """Issue 40: a skip transcoder sat among the SAEs as one series, named "shards 54e56f25 layer 4 topk". SAEs,
    transcoders and skip transcoders of one shard directory are series of their own (kind first in the legend, a
    marker each), named by the model, dataset and hook point their shard directory records (a transcoder's target
    hook point too), the layer and the architecture; two directories alike to a person also say their hash."""
    from builders import write_shards

    acts = np.zeros((4, 1, 2, 8), dtype=np.float32)
    mlp_in = write_shards(tmp_path / "shards", acts, layers=(4,), data={"hook": "mlp_in"}, tag="docs",
                          ckpt="sentence-transformers/all-MiniLM-L6-v2")  # fmt: skip
    other = write_shards(tmp_path / "shards", acts, layers=(4,), data={"hook": "mlp_in"}, tag="other",
                         ckpt="sentence-transformers/all-MiniLM-L6-v2")  # fmt: skip
    target = {"target": "c" * 64, "val_target": "c" * 64}
    kinds = [(4, {}, mlp_in, None), (16, {}, mlp_in, None), (8, target, mlp_in, "mlp_out"),
             (8, {**target, "skip": True}, mlp_in, "mlp_out"), (4, {}, other, None)]  # fmt: skip
    run_dpaths = []
    for k, extra, sd, target_hook in kinds:
        run = runs.open_run(make_run(tmp_path, k, None, layer=4, seed=len(run_dpaths), **extra))
        dump = run.dump(sd.hash)
        dump.dpath.mkdir(parents=True)
        dump.metrics_fpath.write_text(json.dumps({"l0": float(k), "nmse": 1.0 / k}))
        dump.config_fpath.write_text(json.dumps({"shards": str(sd.dpath), **({"target_hook": target_hook}
                                                                              if target_hook else {})}))  # fmt: skip
        run_dpaths.append(run.root)
    rows = summary.collect(run_dpaths)
    name = "all-MiniLM-L6-v2/nonexistent mlp_in"  # write_shards' dataset is /nonexistent
    assert sorted((r["kind"], r["activation"]) for r in rows) == [
        *[("SAE", name)] * 3, ("skip transcoder", f"{name}->mlp_out"), ("transcoder", f"{name}->mlp_out")]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    summary.nmse_panel(ax, rows)
    legend = [(line.get_label(), line.get_marker()) for line in ax.get_lines() if not line.get_label().startswith("_")]
    plt.close(fig)
    assert legend == [
        *sorted([(f"SAE: {name} L4 topk [shards {mlp_in.hash[:8]}] (2 runs)", "o"),
                 (f"SAE: {name} L4 topk [shards {other.hash[:8]}] (1 runs)", "o")]),
        (f"transcoder: {name}->mlp_out L4 topk (1 runs)", "s"),
        (f"skip transcoder: {name}->mlp_out L4 topk (1 runs)", "^"),
    ]  # fmt: skip


def test_seed_groups_are_one_point_with_error_bars_and_one_grouped_row(tmp_path):
    """Three seeds of one config and one other config: the grouped table holds each metric's mean and standard
    deviation over the seeds, the seed stability of the group (saeflow stability's result) and the shared config;
    the Pareto plot draws the group as one point with error bars; every report page is written."""
    seeds = [make_run(tmp_path, 8, {"l0": 8.0, "nmse": nmse}, seed=seed, data_seed=seed)
             for seed, nmse in enumerate((0.2, 0.3, 0.4))]  # fmt: skip
    other = make_run(tmp_path, 16, {"l0": 16.0, "nmse": 0.1})
    rows = summary.collect([*seeds, other], {d.name: f"topk[{i}]" for i, d in enumerate([*seeds, other])})
    group = rows[0]["group"] if rows[0]["run_id"] in {d.name for d in seeds} else rows[-1]["group"]
    assert {r["group"] for r in rows if r["run_id"] in {d.name for d in seeds}} == {group}
    lines, bars = _panel_lines(rows)
    (front,) = lines.values()
    assert front == ([8.0, 16.0], [pytest.approx(0.3), 0.1])  # the group's mean, then the other run
    assert any(abs(seg[1][1] - seg[0][1]) == pytest.approx(0.2) for seg in bars)  # y error bar: 2 x std 0.1
    result = {"group": group, "metrics": {"frac_matched_0.7": 0.95, "frac_matched_0.7_std": 0.01,
                                          "frac_matched_0.9": 0.9, "frac_matched_0.9_std": 0.02, "mmcs": 0.97,
                                          "mmcs_std": 0.0, "n_runs": 3, "n_pairs": 3}}  # fmt: skip
    stability_fpath = tmp_path / "stability.json"
    stability_fpath.write_text(json.dumps(result))
    report.write_summary([*seeds, other], tmp_path / "out", stability_fpaths=(stability_fpath,))
    grouped_text = (tmp_path / "out" / report.GROUPED_FNAME).read_text()
    grouped = {r["group"]: r for r in csv.DictReader(io.StringIO(grouped_text))}
    seeded = grouped[group]
    assert seeded["n_runs"] == "3" and float(seeded["nmse.mean"]) == pytest.approx(0.3)
    assert float(seeded["nmse.std"]) == pytest.approx(0.1) and seeded["config.k"] == "8"
    assert "config.seed" not in seeded and seeded["stability.frac_matched_0.9.mean"] == "0.9"
    assert seeded["stability.frac_matched_0.7.std"] == "0.01" and seeded["stability.n_pairs"] == "3"
    (single,) = [r for g, r in grouped.items() if g != group]
    assert single["n_runs"] == "1" and single["nmse.std"] == "" and single["stability.n_pairs"] == ""
    for page in report.PAGES:
        assert (tmp_path / "out" / report.page_fname(page)).read_bytes()[:4] == b"\x89PNG", page


def test_point_labels_and_legends_cover_nothing(tmp_path):
    """Seed groups and runs at equal L0 (TopK k=32 on four layers) and equal or almost equal NMSE and splice score,
    with long names: every point label lies inside its axes and overlaps no other, and each legend lies outside its
    axes, over no label (geometry of the laid-out figure, in pixels)."""
    run_dpaths, names = [], {}
    for layer in (3, 5, 7, 9):
        for seed in (0, 1) if layer == 3 else (0,):
            # NMSE: layer 3's seeds average 0.301, layer 5's too, layer 7 0.3012; the splice score equal but layer 9
            nmse = {3: 0.3 + 0.002 * seed, 5: 0.301, 7: 0.3012, 9: 0.35}[layer]
            dpath = make_run(tmp_path, 32, {"l0": 32.0, "nmse": nmse}, layer=layer, seed=seed)
            evaluation = {"metrics": {"ce_loss_recovered": 0.95 if layer == 9 else 0.9}}
            runs.open_run(dpath).evaluation_fpath("b" * 64).parent.mkdir(exist_ok=True)
            runs.open_run(dpath).evaluation_fpath("b" * 64).write_text(json.dumps(evaluation))
            run_dpaths.append(dpath)
            names[dpath.name] = f"clip-vit-b16-l{layer}-topk-imagenet[k=32,seed={seed}]"
    group_names = {run_id: name.replace(",seed=0", "").replace(",seed=1", "") for run_id, name in names.items()}
    rows = summary.collect(run_dpaths, names, group_names)
    fig = summary.pareto_figure(rows)
    summary.lay_out(fig)
    renderer = fig.canvas.get_renderer()
    assert len(fig.axes) == 2
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_gid() == summary.POINT_LABEL_GID]
        assert sorted(t.get_text() for t in labels) == [
            "clip-vit-b16-l3-topk-imagenet[k=32] (2 seeds)", *(f"clip-vit-b16-l{layer}-topk-imagenet[k=32]"
                                                                for layer in (5, 7, 9))]  # fmt: skip
        boxes = [t.get_window_extent(renderer) for t in labels]
        ax_box, legend_box = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
        assert all(ax_box.x0 <= b.x0 and b.x1 <= ax_box.x1 and ax_box.y0 <= b.y0 and b.y1 <= ax_box.y1 for b in boxes)
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        assert not legend_box.overlaps(ax_box) and not any(legend_box.overlaps(b) for b in boxes)
        assert fig.bbox.x0 <= legend_box.x0 and legend_box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= legend_box.y0
        assert not legend_box.overlaps(ax.xaxis.label.get_window_extent(renderer))
    import matplotlib.pyplot as plt

    plt.close(fig)
