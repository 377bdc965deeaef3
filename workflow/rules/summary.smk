# Summary: every run's inference metrics and hyper-parameters in one CSV, and the L0 vs normalized-MSE Pareto
# plot across the sweep. Cheap, so it follows every metrics file (no ancient()).


rule summary:
    input:
        [
            inference_dpath(run_id, shard_hash) / "metrics.json"
            for run_id, shard_hash in inference_targets()
        ],
    output:
        csv=report(
            SUMMARY_DIR / "summary.csv",
            caption="../report/summary.rst",
            category="Summary",
        ),
        pareto=report(
            SUMMARY_DIR / "pareto.png",
            caption="../report/pareto.rst",
            category="Summary",
        ),
    log:
        "logs/summary.log",
    conda:
        SAEFLOW_ENV
    params:
        runs=[f"--run={run_dpath(run_id)}" for run_id in sorted(RUN_PLANS)],
        labels=[
            f"--label={run_id}={plan.sae_name}[{plan.index}]"
            for run_id, plan in sorted(RUN_PLANS.items())
        ],
        out=SUMMARY_DIR,
    shell:
        "saeflow summary {params.runs:q} {params.labels:q} --out {params.out:q} >{log:q} 2>&1"
