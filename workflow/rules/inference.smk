# Inference and visuals: every run's SAE over its validation shards -> RUN/inference/<shard_hash>/ (published in
# one rename, read-only; metrics.json stands for it), then its visuals/ (visuals/index.html stands for it).
# One job does both: Snakemake creates every output's parent directory before a job starts, which it could not
# do inside a published, read-only dump directory.

VISUALS_PLOTS = ("l0_hist", "freq_vs_mean")


rule inference:
    input:
        sae=ancient(f"{RUNS_ROOT}/{{run_id}}/checkpoint/sae.pt"),
        run_config=ancient(f"{RUNS_ROOT}/{{run_id}}/checkpoint/config.json"),
    output:
        metrics=f"{RUNS_ROOT}/{{run_id}}/inference/{{shard_hash}}/metrics.json",
        visuals=f"{RUNS_ROOT}/{{run_id}}/inference/{{shard_hash}}/visuals/index.html",
        plots=[
            report(
                f"{RUNS_ROOT}/{{run_id}}/inference/{{shard_hash}}/visuals/{plot}.png",
                caption=f"../report/{plot}.rst",
                category="Visuals",
                subcategory="run {run_id}",
                labels={"run": "{run_id}", "plot": plot},
            )
            for plot in VISUALS_PLOTS
        ],
    log:
        "logs/inference/{run_id}/{shard_hash}.log",
    wildcard_constraints:
        run_id="[0-9a-f]{64}",
        shard_hash="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    threads: 2
    params:
        run=lambda wc: run_dpath(wc.run_id),
        shards=lambda wc: shard_dpath(wc.shard_hash),
    shell:
        # Remove the empty directories Snakemake made; saeflow publishes each directory by one rename.
        """
        dump={params.run:q}/inference/{wildcards.shard_hash}
        rmdir "$dump/visuals" "$dump" 2>/dev/null || true
        saeflow inference --run {params.run:q} --shards {params.shards:q} >{log:q} 2>&1
        saeflow visuals --run {params.run:q} --shards-hash {wildcards.shard_hash} >>{log:q} 2>&1
        """
