"""The summary directory (`write_summary`): saeflow.analysis.summary's table and Pareto plot, the grouped table and
the pages, one figure per metric (each a page of the Snakemake report, with its caption in workflow/report/<page>.rst):

    summary.csv          one row per (run, inference shard directory): saeflow.analysis.summary.collect
    pareto.png           L0 against normalized MSE (and the splice score): saeflow.analysis.summary.plot_pareto

    summary_grouped.csv  one row per (seed group, shard directory): every numeric summary column's mean and sample
                         standard deviation over the group's runs (runs that differ only in seed/data_seed;
                         `<column>.mean`, `<column>.std`, blank for one run), the hyper-parameters they share
                         (`config.*`), and the group's seed stability (`stability.*`: fractions of live latents
                         matched above cosine 0.7 and 0.9, the one-to-one matched mean cosine and the MMCS, mean
                         and std over the pairs of runs)
    pareto_nmse.png      L0 against normalized MSE, a front per (kind, shard directory, layer, architecture)
    pareto_splice.png    L0 against the splice score (CE loss recovered, or pooled cosine recovered)
    probe.png            sparse probing: held-out accuracy against k, the dense probe dashed, per seed group
    stability.png        per seed group, the fraction of latents matched above cosine 0.7 and 0.9

A page without data (no evaluation, no labelled shards, no seed group) says so in its figure.
"""

import csv
import io
import pathlib

from saeflow.analysis import stability, summary
from saeflow.errors import say
from saeflow.store import atomic, layout
from saeflow.store.hashing import read_json_object

GROUPED_FNAME = "summary_grouped.csv"
PAGES = ("pareto_nmse", "pareto_splice", "probe", "stability")  # <page>.png in the summary directory
STABILITY_METRICS = stability.METRICS


def page_fname(page: str) -> str:
    return f"{page}.png"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def grouped_rows(rows: list[dict], stability_results: list[dict]) -> list[dict]:
    """One row per (seed group, shard directory): see the module docstring."""
    by_group = {result["group"]: result["metrics"] for result in stability_results}
    out = []
    for group, shard_hash in sorted({(r["group"], r["shard_hash"]) for r in rows}):
        members = [r for r in rows if (r["group"], r["shard_hash"]) == (group, shard_hash)]
        row = {"group": group, "name": summary.group_name(members), "shard_hash": shard_hash, "n_runs": len(members),
               "names": " ".join(sorted(r["name"] or r["run_id"][:12] for r in members))}  # fmt: skip
        keys = dict.fromkeys(k for r in members for k in r if k not in summary.HEAD)
        for key in keys:
            values = [r.get(key) for r in members]
            if key.startswith("config."):
                if key not in ("config.seed", "config.data_seed") and all(v == values[0] for v in values):
                    row[key] = values[0]
                continue
            numbers = [float(v) for v in values if _is_number(v)]
            if numbers:
                row[f"{key}.mean"], row[f"{key}.std"] = summary.mean_std(numbers)
        for name in STABILITY_METRICS if group in by_group else ():
            if name not in by_group[group]:  # a result written before the metric existed (matched_mean_cos)
                continue
            row[f"stability.{name}.mean"] = by_group[group][name]
            row[f"stability.{name}.std"] = by_group[group][f"{name}_std"]
        if group in by_group:
            row["stability.n_pairs"] = by_group[group]["n_pairs"]
        out.append(row)
    return out


def grouped_csv(grouped: list[dict]) -> str:
    """Columns: group, name (the seed group's), shard_hash, n_runs, names (its runs'), the metrics' means and stds,
    stability.*, config.*."""
    columns = list(dict.fromkeys(k for row in grouped for k in row))
    head = ["group", "name", "shard_hash", "n_runs", "names"]
    stab = sorted(c for c in columns if c.startswith("stability."))
    config = sorted(c for c in columns if c.startswith("config."))
    metrics = sorted(c for c in columns if c not in head and c not in stab and c not in config)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=head + metrics + stab + config, lineterminator="\n")
    writer.writeheader()
    writer.writerows(grouped)
    return buf.getvalue()


def _figure(width: float = 6.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, 4.5), dpi=120)


def _nothing(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=10)
    ax.set_axis_off()


def pareto_page(rows: list[dict], page: str, out_fpath: pathlib.Path) -> None:
    """L0 against normalized MSE (pareto_nmse) or against the splice score (pareto_splice)."""
    fig, ax = _figure()
    if page == "pareto_nmse":
        summary.nmse_panel(ax, rows)
    elif any(summary.splice_score(r) is not None for r in rows):
        summary.splice_panel(ax, rows)
    else:
        _nothing(ax, "no run has a splice score (saeflow evaluate)")
    summary.save_figure(fig, out_fpath)


def probe_page(rows: list[dict], out_fpath: pathlib.Path) -> None:
    """Held-out accuracy of the k-sparse probes against k (mean over labels; per seed group, error bars over its
    runs), and the dense probe on the raw activations as a dashed line of the same colour."""
    fig, ax = _figure()
    probed = [r for r in rows if r.get("probe.dense_accuracy") is not None]
    if not probed:
        _nothing(ax, "no run was probed: no shard directory with labels.bin or classes.bin")
        summary.save_figure(fig, out_fpath)
        return
    for i, (group, shard_hash) in enumerate(sorted({(r["group"], r["shard_hash"]) for r in probed})):
        members = sorted((r for r in probed if (r["group"], r["shard_hash"]) == (group, shard_hash)),
                         key=lambda r: r["name"] or r["run_id"])  # fmt: skip
        ks = sorted(int(c.removeprefix("probe.sparse_k").removesuffix("_accuracy")) for c in members[0]
                    if c.startswith("probe.sparse_k") and c.endswith("_accuracy"))  # fmt: skip
        stats = [summary.mean_std([r[f"probe.sparse_k{k}_accuracy"] for r in members]) for k in ks]
        dense, _ = summary.mean_std([r["probe.dense_accuracy"] for r in members])
        auroc, _ = summary.mean_std([r["probe.best_latent_auroc"] for r in members])
        ax.errorbar(ks, [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats], color=f"C{i % 10}", marker="o",
                    capsize=3, label=f"{summary.group_label(members)}; best latent AUROC {auroc:.2f}")  # fmt: skip
        ax.axhline(dense, color=f"C{i % 10}", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("k (latents in the probe, largest mean difference)")
    ax.set_ylabel("held-out accuracy (mean over labels)")
    ax.set_title("k-sparse probes (solid) and the dense probe on raw activations (dashed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    summary.save_figure(fig, out_fpath)


def stability_page(rows: list[dict], stability_results: list[dict], out_fpath: pathlib.Path) -> None:
    """Per seed group, the fraction of latents matched above cosine 0.7 and 0.9 (error bars over the pairs)."""
    fig, ax = _figure()
    if not stability_results:
        _nothing(ax, "no seed group: no runs that differ only in seed/data_seed")
        summary.save_figure(fig, out_fpath)
        return
    members: dict[str, list[dict]] = {}
    for row in rows:
        members.setdefault(row["group"], []).append(row)
    names = {group: summary.group_name(group_rows) for group, group_rows in members.items()}
    for j, threshold in enumerate((0.7, 0.9)):
        key = f"frac_matched_{threshold}"
        xs = [i + 0.4 * j for i in range(len(stability_results))]
        ax.bar(xs, [s["metrics"][key] for s in stability_results], width=0.4, color=f"C{j}",
               yerr=[s["metrics"][f"{key}_std"] for s in stability_results], capsize=3,
               label=f"matched above cosine {threshold}")  # fmt: skip
    ax.set_xticks([i + 0.2 for i in range(len(stability_results))])
    ax.set_xticklabels([f"{names.get(s['group'], s['group'][:8])}\n({s['metrics']['n_runs']} seeds)"
                        for s in stability_results], fontsize=7)  # fmt: skip
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of latents")
    ax.set_title("seed stability: latents matched by decoder direction", fontsize=9)
    ax.legend(fontsize=8)
    summary.save_figure(fig, out_fpath)


def write_pages(rows: list[dict], stability_results: list[dict], out_dpath: pathlib.Path) -> None:
    """summary_grouped.csv and every page, each replaced atomically."""
    stability_results = sorted(stability_results, key=lambda s: s["group"])
    grouped = grouped_rows(rows, stability_results)
    atomic.write_file_atomic(out_dpath / GROUPED_FNAME, grouped_csv(grouped).encode("utf-8"))
    for page in ("pareto_nmse", "pareto_splice"):
        pareto_page(rows, page, out_dpath / page_fname(page))
    probe_page(rows, out_dpath / page_fname("probe"))
    stability_page(rows, stability_results, out_dpath / page_fname("stability"))


def write_summary(
    run_dpaths: list[pathlib.Path], out_dpath: pathlib.Path, names: dict[str, str] | None = None,
    stability_fpaths: tuple[pathlib.Path, ...] = (), group_names: dict[str, str] | None = None,
) -> tuple[pathlib.Path, pathlib.Path]:  # fmt: skip
    """Write `summary.csv`, `pareto.png`, the grouped table and every page into `out_dpath` (each replaced
    atomically; the seed groups' `saeflow stability` results from `stability_fpaths`; `names` and `group_names` map
    run ids to the names of their sweep points and seed groups). Returns the first two."""
    rows = summary.collect(run_dpaths, names, group_names)
    for line in summary.warning_lines(rows):
        say(line)
    out_dpath.mkdir(parents=True, exist_ok=True)
    out = layout.SummaryLayout(out_dpath)
    csv_fpath, png_fpath = out.csv_fpath, out.pareto_fpath
    atomic.write_file_atomic(csv_fpath, summary.to_csv(rows).encode("utf-8"))
    summary.plot_pareto(rows, png_fpath)
    write_pages(rows, [read_json_object(f, "stability JSON object") for f in stability_fpaths], out_dpath)
    return csv_fpath, png_fpath
