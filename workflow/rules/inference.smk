# Inference and visuals: every run's SAE over its validation shards -> the run's dump for that shard hash (published
# in one rename, read-only; its metrics file stands for it), then the dump's visuals (the latent browser page stands
# for them). Paths: saeflow.layout.DumpLayout.
# One job does both: Snakemake creates every output's parent directory before a job starts, which it could not
# do inside a published, read-only dump directory. The config's `inference` and `visuals` settings reach the CLI
# as flags, so changing one reruns this job.


rule inference:
    input:
        sae=ancient(RUNS.sae_fpath),
        run_config=ancient(RUNS.config_fpath),
    output:
        metrics=DUMPS.metrics_fpath,
        visuals=DUMPS.index_fpath,
        plots=[
            report(
                DUMPS.plot_fpath(plot),
                caption=f"../report/{plot}.rst",
                category="Visuals",
                subcategory="run {run_id}",
                labels={"run": "{run_id}", "plot": plot},
            )
            for plot in DUMPS.PLOTS
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
        run=lambda wc: PLAN.run(wc.run_id).root,
        shards=lambda wc: PLAN.shard(wc.shard_hash).dpath,
        dump=lambda wc: PLAN.run(wc.run_id).dump(wc.shard_hash).dpath,
        dump_visuals=lambda wc: PLAN.run(wc.run_id).dump(wc.shard_hash).visuals_dpath,
        inference=get_settings_flags("inference"),
        visuals=get_settings_flags("visuals"),
    shell:
        # Remove the empty directories Snakemake made; saeflow publishes each directory by one rename.
        """
        rmdir {params.dump_visuals:q} {params.dump:q} 2>/dev/null || true
        saeflow inference --run {params.run:q} --shards {params.shards:q} {params.inference:q} >{log:q} 2>&1
        saeflow visuals --run {params.run:q} --shards-hash {wildcards.shard_hash} {params.visuals:q} >>{log:q} 2>&1
        """
