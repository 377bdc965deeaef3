# Summary: every run's inference, splice-evaluation and probe metrics and hyper-parameters in one CSV, and the L0 vs
# normalized-MSE (and splice score) Pareto plot across the sweep. Cheap, so it follows every metrics file (no ancient())
# and .snakemake/saeflow/stages/summary.json, the runs and names it shows (rewritten only when they change:
# removing, reordering or renaming).


rule summary:
    input:
        metrics=get_dump_metrics(),
        evaluations=get_evaluations(),
        probes=get_probes(),
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
    log:
        "logs/summary.log",
    conda:
        SAEFLOW_ENV
    params:
        runs=[f"--run={PLAN.run(run_id).root}" for run_id in sorted(PLAN.runs)],
        labels=[
            f"--label={run_id}={plan.sae_name}[{plan.index}]"
            for run_id, plan in sorted(PLAN.runs.items())
        ],
        out=PLAN.cfg.summary_dir,
    shell:
        "saeflow summary {params.runs:q} {params.labels:q} --out {params.out:q} >{log:q} 2>&1"
