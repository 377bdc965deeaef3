"""One table of every run's metrics and the sparsity/reconstruction Pareto plot across a sweep.

Each run contributes one row per inference directory `<run>/inference/<shard_hash>/metrics.json` (its headline
metrics are over the tokens the SAE trained on, named in the `tokens` column; `all_tokens.*` over every stored token);
the row also carries every value the run trained with (`sweeps.readable_config`, flattened) so a sweep can be read
as a table, and its seed `group` (saeflow.analysis.stability.group_key: runs with the same group differ only in
seed/data_seed). The Pareto plot puts L0 (active latents per token) against normalized MSE, one series per (kind: SAE,
transcoder or skip transcoder; evaluation shard directory, layer, architecture; `series_names` names it): lower-left
is better, and the points no other on the same series beats on both are joined as the front. A point is a seed
group: the mean of its runs, with error bars of one standard deviation. When runs have a splice evaluation (`saeflow
evaluate`), a second panel puts L0 against its score: CE loss recovered for causal LMs, the pooled-embedding cosine
recovered otherwise (upper-left is better). saeflow.analysis.report writes
them (`write_summary`) with the grouped table and one page per metric.
"""

import csv
import io
import json
import math
import pathlib

import numpy as np

from saeflow.analysis import stability
from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.store import atomic
from saeflow.store.hashing import read_json_object
from saeflow.store.layout import ShardLayout
from saeflow.store.runs import open_run
from saeflow.training import degenerate, sweeps

# The metric names inference writes; the first present one is used for each axis of the Pareto plot.
L0_KEYS = ("l0", "L0")
NMSE_KEYS = ("nmse", "normalized_mse")
# Splice evaluation (saeflow.analysis.evaluate): the fraction of the ablation's damage the SAE avoids, higher is better.
SPLICE_KEYS = ("eval.ce_loss_recovered", "eval.pooled_cos_recovered")
# summary.csv's first columns: which run, which group, what it is and reads, why its result is degenerate (blank when
# it is not)
HEAD = ("name", "run_id", "shard_hash", "group", "group_name", "kind", "activation", "warning")
# What a run is (`kind`), in the order the plots list them, and each one's marker there.
KIND_MARKERS = {"SAE": "o", "transcoder": "s", "skip transcoder": "^"}
# Metrics-file keys that are settings, not measurements: the tokens measured on, the firing rate that counts as dense.
MEASURED_WITH = ("dense_freq", "tokens")
POINT_LABEL_GID = "saeflow-point-label"  # the Pareto points' labels (place_point_labels moves them apart)
LABEL_OFFSET = (4, 4)  # a point label's place beside its point, in points
# Where a label may go, in order: right of its point, then left, then a line (9 points) lower, higher, ...
LABEL_PLACES = tuple(((dx * LABEL_OFFSET[0], LABEL_OFFSET[1] + 9 * line), "left" if dx > 0 else "right")
                     for line in (0, -1, 1, -2, 2, -3, 3, -4, 4, -5, 5, -6, 6) for dx in (1, -1))  # fmt: skip
NMSE_LABEL = "normalized MSE\n(on the tokens the SAE trained on)"  # inference's headline metrics (`tokens`)


def flatten(obj: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists become JSON text so one cell holds one value."""
    flat = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, list):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


def read_metrics(fpath: pathlib.Path) -> dict:
    return read_json_object(fpath, "JSON object of metrics")


def run_rows(run_dpath: pathlib.Path, name: str = "", group_name: str = "") -> list[dict]:
    """One row per inference directory of the run (a run without inference yet gives no row).

    Columns: `name` (a label such as the sweep point's name, saeflow.training.sweeps.point_name; run ids are content
    hashes), `group_name` (its seed group's name: the point's name without its seeds; default `name`), `kind` (SAE,
    transcoder or skip transcoder), `activation` (what the dump's shard directory holds: `_activation`), `warning`
    (saeflow.training.degenerate.reason of the inference metrics: every latent dead or dense, or L0 above a
    fraction of d_sae; blank when healthy), the inference
    metrics, `train.*` (the final validation metrics of training, checkpoint/metrics.json, when present) and
    `config.*` (every value the run trained with, `sweeps.readable_config`: blank where its architecture does not
    read the key, which `config.not_read` lists), and `eval.*` (the splice evaluation of the SAE on the same
    activations, `<run>/evaluation/<shard_hash>.json`, when present; `eval.hook` names the hook point it spliced).
    """
    run = open_run(run_dpath)
    group = stability.group_key(run.config())
    hparams = flatten(sweeps.readable_config(run.config(), str(run.config_fpath)), "config.")
    train_fpath = run.final_metrics_fpath
    train = flatten(read_metrics(train_fpath), "train.") if train_fpath.exists() else {}
    rows = []
    for dump_dpath in sorted(run.inference_dpath.glob("*")):
        dump = run.dump(dump_dpath.name)
        if not dump.metrics_fpath.exists():
            continue
        inferred = read_metrics(dump.metrics_fpath)
        dump_config = read_json_object(dump.config_fpath, "inference config") if dump.config_fpath.exists() else {}
        rows.append({
            "name": name,
            "run_id": run.root.name,
            "shard_hash": dump_dpath.name,
            "group": group,
            "group_name": group_name or name,
            "kind": kind_of(run.config()),
            "activation": _activation(dump_config, dump_dpath.name),
            "warning": _warning(dump_config, inferred, run.config().get("arch")),
            **flatten(inferred),
            **train,
            **_evaluation(run, dump_dpath.name),
            **_probe(run, dump_dpath.name),
            **hparams,
        })  # fmt: skip
    return rows


def kind_of(train_config: dict) -> str:
    """A run's kind (KIND_MARKERS) from its training config: an SAE has no `target`, a transcoder one, and a skip
    transcoder also its linear skip path (`skip`)."""
    if train_config.get("target") is None:
        return "SAE"
    return "skip transcoder" if train_config.get("skip") else "transcoder"


def _activation(dump_config: dict, shard_hash: str) -> str:
    """What a dump's shard directory holds, for a person: its model, dataset and hook point from its metadata.json
    (`all-MiniLM-L6-v2/docs mlp_out`; a transcoder's `mlp_in->mlp_out`, its target's hook point from the dump's
    config.json); `shards <hash prefix>` where the directory is gone (purged from scratch) or the dump names none."""
    fpath = ShardLayout(pathlib.Path(dump_config.get("shards", ""))).metadata_fpath
    if "shards" not in dump_config or not fpath.is_file():
        return f"shards {shard_hash[:8]}"
    md = read_json_object(fpath, "shard metadata")
    model, dataset = (pathlib.PurePosixPath(str(md.get(key, "")).rstrip("/")).name for key in ("ckpt", "dataset"))
    hook = hooks.stored(md.get("data") or {})
    target = f"->{dump_config['target_hook']}" if "target_hook" in dump_config else ""
    return f"{model}/{dataset} {hook}{target}"


def _warning(dump_config: dict, inferred: dict, arch: str | None) -> str:
    """Why the dump's headline metrics are degenerate (degenerate.reason, with the d_sae its config.json records);
    blank when they are not, or when the dump records no latent counts to judge by."""
    if "d_sae" not in dump_config or not all(key in inferred for key in ("n_dead", "n_dense", "l0", "dense_freq")):
        return ""
    return degenerate.reason(inferred, dump_config["d_sae"], arch)


def warning_lines(rows: list[dict]) -> list[str]:
    """One line per degenerate row (`warning`), naming the run and the shard directory it was measured on."""
    return [f"saeflow summary: run {row['name'] or row['run_id'][:12]} ({row['run_id'][:12]}) on shards "
            f"{row['shard_hash'][:8]}: degenerate result: {row['warning']}"
            for row in rows if row["warning"]]  # fmt: skip


def _evaluation(run, shard_hash: str) -> dict:
    """`eval.hook` (the hook point the splice replaced; an evaluation written before hook points spliced the residual
    stream) and `eval.*`, the metrics of `saeflow evaluate` on the same shards (RUN/evaluation/<hash>.json), if any."""
    fpath = run.evaluation_fpath(shard_hash)
    if not fpath.exists():
        return {}
    obj = read_metrics(fpath)
    metrics, cfg = obj.get("metrics"), obj.get("config")
    if not isinstance(metrics, dict):
        raise SaeflowError(f"{fpath}: no `metrics` object; rerun `saeflow evaluate`")
    hook = cfg.get("hook", hooks.RESIDUAL) if isinstance(cfg, dict) else hooks.RESIDUAL
    return {"eval.hook": hook, **flatten(metrics, "eval.")}


def _probe(run, shard_hash: str) -> dict:
    """`probe.*`: the means over labels of `saeflow probe` on the same shards (RUN/probe/<hash>.json), if any."""
    fpath = run.probe_fpath(shard_hash)
    if not fpath.exists():
        return {}
    metrics = read_metrics(fpath).get("metrics")
    if not isinstance(metrics, dict):
        raise SaeflowError(f"{fpath}: no `metrics` object; rerun `saeflow probe`")
    return flatten(metrics, "probe.")


def collect(
    run_dpaths: list[pathlib.Path], names: dict[str, str] | None = None, group_names: dict[str, str] | None = None
) -> list[dict]:
    """Rows of every run; `names` maps run ids to labels for the `name` column, `group_names` to the names of their
    seed groups (the plots' points)."""
    names, group_names = names or {}, group_names or {}
    ids = [pathlib.Path(dpath).name for dpath in sorted(run_dpaths)]
    rows = [row for dpath, run_id in zip(sorted(run_dpaths), ids)
            for row in run_rows(dpath, names.get(run_id, ""), group_names.get(run_id, ""))]  # fmt: skip
    if not rows:
        raise SaeflowError(f"none of the {len(run_dpaths)} runs has inference metrics (inference/*/metrics.json)")
    return rows


def _column_order(column: str) -> tuple[bool, str]:
    """Inside a group of columns, the metrics first (sorted), then the settings they were measured with."""
    return column.rpartition(".")[2] in MEASURED_WITH, column


def to_csv(rows: list[dict]) -> str:
    """Columns: name, run_id, shard_hash, group, group_name, warning, the inference metrics on the tokens each SAE
    trained on, then what they were measured with (`tokens` names those tokens, `dense_freq`), all_tokens.* (the same
    over every stored token), eval.*, probe.*, train.*, config.* (union over rows; in each group metrics sorted,
    then settings)."""
    columns = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    head, groups = list(HEAD), ("all_tokens.", "eval.", "probe.", "train.", "config.")
    metric_cols = sorted((c for c in columns if c not in head and not c.startswith(groups)), key=_column_order)
    buf = io.StringIO()
    grouped = [c for group in groups for c in sorted((c for c in columns if c.startswith(group)), key=_column_order)]
    fieldnames = head + metric_cols + grouped
    writer = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def metric(row: dict, keys: tuple[str, ...], what: str) -> float:
    for key in keys:
        if key in row:
            return float(row[key])
    raise SaeflowError(f"run {row['run_id']}: inference metrics lack {what} (looked for {', '.join(keys)})")


def pareto_front(points_n2: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (x, y) minimization, ordered by x."""
    order = sorted(range(len(points_n2)), key=lambda i: points_n2[i])
    front, best_y = [], math.inf
    for i in order:
        if points_n2[i][1] < best_y:
            front.append(i)
            best_y = points_n2[i][1]
    return front


def splice_score(row: dict) -> tuple[str, float] | None:
    """(metric name, value) of the row's splice score, None when it has none (not evaluated, or a null ratio)."""
    for key in SPLICE_KEYS:
        if row.get(key) is not None:
            return key, float(row[key])
    return None


def series_key(row: dict) -> tuple[int, str, str, str, str]:
    """What one Pareto front compares: runs of one kind (SAEs, transcoders and skip transcoders apart, in that order)
    on one shard directory (a transcoder's: and one target), at one layer, of one architecture."""
    return (list(KIND_MARKERS).index(row["kind"]), row["shard_hash"], str(row.get("config.target") or ""),
            str(row.get("config.layer", "")), str(row.get("config.arch", "")))  # fmt: skip


def series_names(rows: list[dict]) -> dict[tuple, str]:
    """Each series' name: kind, activation, layer and architecture, `SAE: all-MiniLM-L6-v2/docs mlp_out L4 topk`;
    where two series would share a name (two shard directories alike to a person), each says its shard hash."""
    names = {}
    for row in rows:
        names.setdefault(series_key(row), f"{row['kind']}: {row['activation']} L{row.get('config.layer', '?')} "
                                          f"{row.get('config.arch', '')}".rstrip())  # fmt: skip
    shared = {name for name in names.values() if list(names.values()).count(name) > 1}
    return {key: name + (f" [shards {key[1][:8]}]" if name in shared else "") for key, name in names.items()}


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if arr.size > 1 else None)


def group_name(members: list[dict]) -> str:
    """A seed group's name: its runs' `group_name` (the sweep point's name without its seeds), else its first run's
    name or run id."""
    first = min(members, key=lambda r: r["name"] or r["run_id"])
    return first.get("group_name") or first["name"] or first["run_id"][:8]


def group_label(members: list[dict]) -> str:
    """A seed group's name and its number of seeds, `clip-topk[k=32] (3 seeds)`: its point's label in the plots."""
    return group_name(members) + (f" ({len(members)} seeds)" if len(members) > 1 else "")


def group_points(rows: list[dict], y_of) -> list[dict]:
    """One point per seed group of `rows` (rows of one series): the mean L0 and y of its runs and their standard
    deviations (error bars), with its group_label."""
    points = []
    for group in sorted({r["group"] for r in rows}):
        members = sorted((r for r in rows if r["group"] == group), key=lambda r: r["name"] or r["run_id"])
        x, xerr = mean_std([metric(r, L0_KEYS, "L0") for r in members])
        y, yerr = mean_std([y_of(r) for r in members])
        points.append({"x": x, "y": y, "xerr": xerr or 0.0, "yerr": yerr or 0.0, "n": len(members),
                       "label": group_label(members)})  # fmt: skip
    return points


def pareto_panel(ax, rows: list[dict], y_of, ylabel: str, higher_better: bool) -> None:
    """One series per (kind, shard directory, layer, architecture; series_key), named by series_names, its marker
    its kind's: its runs faint, a point per seed group (mean, error bars of one standard deviation), the Pareto front
    of those points joined (lower L0 and better y)."""
    names = series_names(rows)
    for i, key in enumerate(sorted(names)):
        members = [r for r in rows if series_key(r) == key]
        points = group_points(members, y_of)
        front = pareto_front([(p["x"], -p["y"] if higher_better else p["y"]) for p in points])
        color, marker = f"C{i % 10}", KIND_MARKERS[members[0]["kind"]]
        ax.scatter([metric(r, L0_KEYS, "L0") for r in members], [y_of(r) for r in members], color=color, alpha=0.3,
                   s=12, marker=marker)  # fmt: skip
        ax.errorbar([p["x"] for p in points], [p["y"] for p in points], xerr=[p["xerr"] for p in points],
                    yerr=[p["yerr"] for p in points], fmt="none", ecolor=color, capsize=3)  # fmt: skip
        ax.plot([points[j]["x"] for j in front], [points[j]["y"] for j in front], color=color, marker=marker,
                label=f"{names[key]} ({len(members)} runs)")  # fmt: skip
        for p in points:
            ax.annotate(p["label"], (p["x"], p["y"]), textcoords="offset points", xytext=LABEL_OFFSET, fontsize=7,
                        gid=POINT_LABEL_GID)  # fmt: skip
    ax.set_xlabel("L0 (active latents per token)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    # Below the axes, where it covers no point and no label (inside, matplotlib's "best" place ignores the labels).
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)


def nmse_panel(ax, rows: list[dict]) -> None:
    pareto_panel(ax, rows, lambda r: metric(r, NMSE_KEYS, "normalized MSE"), NMSE_LABEL, False)
    ax.set_title(f"sparsity vs reconstruction ({len(rows)} runs); lines join each Pareto front", fontsize=9)


def splice_panel(ax, rows: list[dict]) -> None:
    """L0 against the splice score of the runs that have one (`rows` must hold at least one)."""
    spliced = [r for r in rows if splice_score(r) is not None]
    names = sorted({splice_score(r)[0].removeprefix("eval.") for r in spliced})
    pareto_panel(ax, spliced, lambda r: splice_score(r)[1], f"splice score: {' / '.join(names)}", True)
    ax.set_title("SAE spliced into the model: fraction of the ablation's damage avoided", fontsize=9)


def pareto_figure(rows: list[dict]):
    """L0 vs normalized MSE; beside it L0 vs the splice score (saeflow.analysis.evaluate) of the runs that have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spliced = any(splice_score(r) is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if spliced else 1, figsize=(11 if spliced else 6, 4.5), dpi=120, squeeze=False)
    nmse_panel(axes[0, 0], rows)
    if spliced:
        splice_panel(axes[0, 1], rows)
    return fig


def plot_pareto(rows: list[dict], out_fpath: pathlib.Path) -> None:
    """pareto.png: `pareto_figure`."""
    save_figure(pareto_figure(rows), out_fpath)


def _room_for_labels(ax, labels: list, renderer) -> None:
    """Widen the x axis to the right (never narrow it) so that the widest label fits right of the rightmost point."""
    ax_box = ax.get_window_extent(renderer)
    need_px = max(t.get_window_extent(renderer).width for t in labels) + LABEL_OFFSET[0] * ax.figure.dpi / 72 + 2
    if need_px >= ax_box.width:
        return  # it cannot fit: place_point_labels does what it can
    x0, x1 = ax.get_xlim()
    x1_needed = x0 + (max(t.xy[0] for t in labels) - x0) * ax_box.width / (ax_box.width - need_px)
    if x1_needed > x1:
        ax.set_xlim(x0, x1_needed)


def place_point_labels(fig) -> None:
    """Move the point labels (POINT_LABEL_GID) of every axes of a laid-out figure so that none overlaps another and
    each stays inside its axes (widened to the right when the labels need it): the first free place of
    LABEL_PLACES, else the first place."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = sorted((t for t in ax.texts if t.get_gid() == POINT_LABEL_GID), key=lambda t: (t.xy[0], -t.xy[1]))
        if labels:
            _room_for_labels(ax, labels, renderer)
        ax_box = ax.get_window_extent(renderer)
        placed = []
        for label in labels:
            for offset, ha in (*LABEL_PLACES, LABEL_PLACES[0]):  # the last one: nowhere free
                label.xyann = offset
                label.set_horizontalalignment(ha)
                box = label.get_window_extent(renderer)
                inside = ax_box.x0 <= box.x0 and box.x1 <= ax_box.x1 and ax_box.y0 <= box.y0 and box.y1 <= ax_box.y1
                if inside and not any(box.overlaps(other) for other in placed):
                    break
            placed.append(box)


def lay_out(fig) -> None:
    """Fit the figure's parts (matplotlib's tight layout), then move the point labels apart."""
    fig.tight_layout()
    place_point_labels(fig)


def save_figure(fig, out_fpath: pathlib.Path) -> None:
    """A matplotlib figure as a PNG, replaced atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    lay_out(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic.write_file_atomic(out_fpath, buf.getvalue())
