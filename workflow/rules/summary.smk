# Summary: every run's inference, splice-evaluation and probe metrics and hyper-parameters in one CSV, the seed groups'
# means and standard deviations (with their stability) in another, the L0 vs normalized-MSE (and splice score) Pareto
# plot across the sweep, and one report page per metric (saeflow.analysis.report; a caption each, workflow/report/<page>.rst).
# Cheap, so it follows every metrics file (no ancient()) and .snakemake/saeflow/stages/summary.json, the runs and
# names it shows (rewritten only when they change: removing or renaming; a point is named by its values, so
# reordering a sweep changes nothing).
REPORT_CATEGORIES = {
    "pareto_nmse": "Reconstruction",
    "pareto_splice": "Splice evaluation",
    "probe": "Probing",
    "stability": "Seed stability",
}


rule summary:
    input:
        metrics=get_dump_metrics(),
        evaluations=get_evaluations(),
        probes=get_probes(),
        stability=get_stability_results(),
        runs=get_cli_config("stages", "summary"),
    output:
        csv=report(
            PLAN.summary_fpaths()[0],
            caption="../report/summary.rst",
            category="Summary",
        ),
        pareto=report(
            PLAN.summary_fpaths()[1],
            caption="../report/pareto.rst",
            category="Summary",
        ),
        grouped=report(
            PLAN.cfg.summary_dir / saeflow_report.GROUPED_FNAME,
            caption="../report/summary_grouped.rst",
            category="Summary",
        ),
        pages=[
            report(
                PLAN.cfg.summary_dir / saeflow_report.page_fname(page),
                caption=f"../report/{page}.rst",
                category=REPORT_CATEGORIES[page],
            )
            for page in saeflow_report.PAGES
        ],
    log:
        "logs/summary.log",
    localrule: True
    conda:
        SAEFLOW_ENV
    params:
        runs=[f"--run={PLAN.run(run_id).root}" for run_id in sorted(SUMMARIZED)],
        labels=[
            f"--label={run_id}={plan.name}"
            for run_id, plan in sorted(SUMMARIZED.items())
        ],
        group_labels=[
            f"--group-label={run_id}={plan.group_name}"
            for run_id, plan in sorted(SUMMARIZED.items())
        ],
        stability=[f"--stability={fpath}" for fpath in get_stability_results()],
        out=PLAN.cfg.summary_dir,
    shell:
        "saeflow summary {params.runs:q} {params.labels:q} {params.group_labels:q} {params.stability:q} --out {params.out:q} >{log:q} 2>&1"
