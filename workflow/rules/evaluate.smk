# Evaluation: every run's SAE spliced into its model on the run's validation activation spec (CE loss recovered
# and KL for causal LMs, embedding similarity for encoders and vision towers). Path: saeflow.store.layout.RunLayout.
# The job gets the per-shard config of the validation activations; saeflow checks it plans the run's val_shards,
# and reads the validation shard directory (tokens.bin, and the stored activations its model check compares), asked
# for (ancient) only while the evaluation is missing, as inference does; a transcoder's validation target directory
# too (the tensor its prediction replaces, found through the run's links).
# The evaluation records the sha256 of the sae.pt it scored, and sae.pt is a plain input (get_trained_sae), so a retrained checkpoint
# is evaluated again in the same call; the `evaluate` settings are in .snakemake/saeflow/stages/evaluate.json, an
# input rewritten only when they change (the workflow's rerun trigger is mtime: docs/workflow.md).


rule evaluate:
    input:
        sae=get_trained_sae,
        run_config=ancient(RUNS.config_fpath),
        settings=get_cli_config("stages", "evaluate"),
        shards=lambda wc: get_shards_if_missing(
            PLAN.run(wc.run_id).evaluation_fpath(wc.shard_hash),
            wc.shard_hash,
            *PLAN.runs[wc.run_id].val_shards[1:],  # a transcoder's target of them
        ),
    output:
        RUNS.evaluation_fpath(SHARD_HASH_WILDCARD),
    log:
        "logs/evaluate/{run_id}/{shard_hash}.log",
    conda:
        SAEFLOW_ENV
    threads: job_threads("evaluate", 2)
    resources:
        **job_resources("evaluate", stage_on_gpu("evaluate")),
    params:
        run=lambda wc: PLAN.run(wc.run_id).root,
        config=lambda wc: get_cli_config("shards", wc.shard_hash),
        shards=lambda wc: PLAN.shard(wc.shard_hash).dpath,
        evaluate=get_settings_flags("evaluate"),
    shell:
        "saeflow evaluate --run {params.run:q} {params.config:q} --shards {params.shards:q} {params.evaluate:q} >{log:q} 2>&1"
