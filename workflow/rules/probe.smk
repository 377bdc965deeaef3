# Probing: every run's dump on shards that carry labels (labels.bin per patch, classes.bin per example) -> which
# latents predict each label (saeflow probe). Path: saeflow.store.layout.RunLayout.probe_fpath; the dumps probed:
# WorkflowPlan.probes(). The job reads the dump (its metrics.json stands for it, so a new dump reruns the probe) and
# the shards (labels, raw activations), asked for (ancient) only while the probe is missing, as inference does. It
# also puts the labels each latent predicts on the dump's latent pages (visuals/labels.js, replaced atomically).
# The `probe` settings are in .snakemake/saeflow/stages/probe.json, an input rewritten only when they change.


rule probe:
    input:
        dump=DUMPS.metrics_fpath,
        settings=get_cli_config("stages", "probe"),
        shards=lambda wc: get_shards_if_missing(
            PLAN.run(wc.run_id).probe_fpath(wc.shard_hash), wc.shard_hash
        ),
    output:
        RUNS.probe_fpath(SHARD_HASH_WILDCARD),
    log:
        "logs/probe/{run_id}/{shard_hash}.log",
    wildcard_constraints:
        run_id="[0-9a-f]{64}",
        shard_hash="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    threads: job_threads("probe", 2)
    resources:
        **job_resources("probe"),
    params:
        run=lambda wc: PLAN.run(wc.run_id).root,
        shards=lambda wc: PLAN.shard(wc.shard_hash).dpath,
        probe=get_settings_flags("probe"),
    shell:
        "saeflow probe --run {params.run:q} --shards-hash {wildcards.shard_hash} --shards {params.shards:q} {params.probe:q} >{log:q} 2>&1"
