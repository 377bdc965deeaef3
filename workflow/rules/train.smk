# Training: each planned run gets <runs_root>/<run_id>/ (create-run: checkpoint/config.json and links/ to its
# shard directories), then checkpoint/sae.pt (train). Run ids hash the training config and the shard hashes.
# Shards come in through ancient() and training depends on the run's own config.json, so a shard directory
# purged from scratch does not retrain a finished run, and an extraction rerun for a new run leaves it alone.


rule create_run:
    input:
        train_shards=lambda wc: ancient(
            shards_json(RUN_PLANS[wc.run_id].train_activation)
        ),
        val_shards=lambda wc: ancient(shards_json(RUN_PLANS[wc.run_id].val_activation)),
    output:
        f"{RUNS_ROOT}/{{run_id}}/checkpoint/config.json",
    log:
        "logs/create_run/{run_id}.log",
    wildcard_constraints:
        run_id="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    params:
        config=lambda wc: run_config_fpath(wc.run_id),
        sae=lambda wc: RUN_PLANS[wc.run_id].sae_name,
        index=lambda wc: RUN_PLANS[wc.run_id].index,
        shards_root=SHARDS_ROOT,
        runs_root=RUNS_ROOT,
    shell:
        """
        created=$(saeflow create-run {params.config:q} --sae {params.sae:q} --index {params.index} --shards-root {params.shards_root:q} --runs-root {params.runs_root:q} 2>{log:q})
        if [ "$(basename "$created")" != {wildcards.run_id} ]; then
            echo "saeflow create-run made '$created'; the workflow planned {wildcards.run_id}" >>{log:q}
            exit 1
        fi
        """


rule train:
    input:
        ancient(f"{RUNS_ROOT}/{{run_id}}/checkpoint/config.json"),
    output:
        f"{RUNS_ROOT}/{{run_id}}/checkpoint/sae.pt",
    log:
        "logs/train/{run_id}.log",
    wildcard_constraints:
        run_id="[0-9a-f]{64}",
    conda:
        SAEFLOW_ENV
    threads: 2
    params:
        run=lambda wc: run_dpath(wc.run_id),
    shell:
        "saeflow train --run {params.run:q} >{log:q} 2>&1"
