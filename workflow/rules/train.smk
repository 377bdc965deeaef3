# Training: each planned run gets its run directory (create-run: the hashed training config and links to its shard
# directories), then its trained SAE (train). Run ids hash the training config and the shard hashes. Paths:
# saeflow.store.layout.RunLayout.
# A job asks for its shard directories (ancient) only while its own output is missing (get_shards_if_missing), so a
# shard directory purged from scratch, or a moved shards_root, is extracted again only for a job that must read
# its bytes; complete runs are never touched. Training depends on the run's own config.json (ancient).
# One pass, one job: untrained runs that read identical batches (same train shards, layer, tokens, batch size, data
# seed and length, and a transcoder's target) train together, up to `train.runs_per_pass` (WorkflowPlan.train_passes). The job is the
# pass's representative run's; it declares that run's sae.pt, which saeflow publishes after every other member's,
# and the jobs that read a member's checkpoint ask for the representative's (get_trained_sae). Trained runs are in
# no pass: a new sweep point trains alone (or with other new points), never the existing ones; their sae.pt is no
# job's output but a source file (pass_representative_regex), so a no-op run needs no metadata for it.
# Ranks: config train.gpus x train.nodes become the job's resources (saeflow.training.ranks.launch.rule_resources: GPUs per node,
# nodes, and on several nodes the Slurm plugin's multi-task job); the settings reach `saeflow train` as --gpus and
# --nodes, and saeflow starts the ranks (torch.distributed.run on one node, srun on several; docs/distributed.md).


rule create_run:
    input:
        lambda wc: get_shards_if_missing(
            PLAN.run(wc.run_id).config_fpath,
            # train, val (a transcoder's targets of them)
            *PLAN.runs[wc.run_id].read_shards,
        ),
    output:
        # update(): Snakemake does not delete a config.json before the job (saeflow create-run finds an identical
        # run unchanged); deleting it left a window in which another workflow's train job found it missing
        update(RUNS.config_fpath),
    log:
        "logs/create_run/{run_id}.log",
    localrule: True
    conda:
        SAEFLOW_ENV
    params:
        config=lambda wc: get_cli_config("runs", wc.run_id),
    shell:
        """
        created=$(saeflow create-run {params.config:q} --run-id {wildcards.run_id} 2>{log:q})
        if [ "$(basename "$created")" != {wildcards.run_id} ]; then
            echo "saeflow create-run made '$created'; the workflow planned {wildcards.run_id}" >>{log:q}
            exit 1
        fi
        """


rule train:
    input:
        configs=lambda wc: get_pass_configs(wc.run_id),
        shards=lambda wc: get_pass_shards(wc.run_id),
    output:
        RUNS.sae_fpath,
    log:
        "logs/train/{run_id}.log",
    wildcard_constraints:
        run_id=pass_representative_regex(),
    conda:
        SAEFLOW_ENV
    threads: job_threads("train", 2)
    resources:
        **job_resources(
            "train",
            stage_on_gpu("train"),
            rule_resources(PLAN.cfg.settings["train"]),
        ),
    params:
        runs=lambda wc: [
            f"--run={PLAN.run(member).root}" for member in get_pass(wc.run_id)
        ],
        settings=get_settings_flags("train"),
    shell:
        "saeflow train {params.runs:q} {params.settings:q} >{log:q} 2>&1"
