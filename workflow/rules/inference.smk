# Inference and visuals: every run's SAE over its validation shards -> the run's dump for that shard hash (published
# in one rename, read-only; its metrics file stands for it), then the dump's visuals (the latent browser page stands
# for them). Paths: saeflow.store.layout.DumpLayout.
# One job does both: Snakemake creates every output's parent directory before a job starts, which it could not
# do inside a published, read-only dump directory. The config's `inference` and `visuals` settings reach the CLI
# as flags; they are also in .snakemake/saeflow/stages/inference.json, an input rewritten only when they change, so
# changing one reruns this job (the workflow's rerun trigger is mtime: docs/workflow.md).
# No stale dumps: the dump records the sha256 of the sae.pt it used (config.json `sae_sha256`), and sae.pt is a
# plain input (while the run is untrained, its pass representative's: get_trained_sae), so a retrained checkpoint reruns this job in the same call (and the summary after it). The outputs
# are update(): Snakemake does not delete files inside the read-only dump; saeflow replaces a stale dump or
# drawing atomically (--replace-stale, --force) and reuses an identical one. The outputs are then touched, so their
# time stamps say the job ran, and made writable by their owner: Snakemake refuses to rerun a job whose outputs
# are read-only files (ProtectedOutputException); the dump's directories stay read-only, so nothing in it can be
# removed or renamed except by replacing the whole dump.


rule inference:
    input:
        sae=get_trained_sae,
        run_config=ancient(RUNS.config_fpath),
        settings=get_cli_config("stages", "inference"),
        shards=lambda wc: get_shards_if_missing(
            PLAN.run(wc.run_id).dump(wc.shard_hash).metrics_fpath,
            wc.shard_hash,
            *PLAN.runs[wc.run_id].val_shards[1:],  # a transcoder's target of them
        ),
    output:
        metrics=update(DUMPS.metrics_fpath),
        visuals=update(DUMPS.index_fpath),
        plots=[
            report(
                update(DUMPS.plot_fpath(plot)),
                caption=f"../report/{plot}.rst",
                category="Visuals",
                subcategory="run {run_id}",
                labels={"run": "{run_id}", "plot": plot},
            )
            for plot in DUMPS.PLOTS
        ],
    log:
        "logs/inference/{run_id}/{shard_hash}.log",
    conda:
        SAEFLOW_ENV
    threads: job_threads("inference", 2)
    resources:
        **job_resources("inference", stage_on_gpu("inference")),
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
        saeflow inference --run {params.run:q} --shards {params.shards:q} {params.inference:q} --replace-stale >{log:q} 2>&1
        saeflow visuals --run {params.run:q} --shards-hash {wildcards.shard_hash} {params.visuals:q} --force >>{log:q} 2>&1
        touch -c {output:q}
        chmod u+w {output:q}
        """
